// The pieces bench_gemm's translation units share (bench_gemm.cu: the mainloop against cuBLASLt;
// gemm_epilogues.cu, gemm_overlap.cu: programs against the bare mainloop, compiled apart so that the
// build runs them in parallel): the shapes, their rotated operands, our GEMM of a shape on a tile, and the
// program-over-bare comparison.
#pragma once
#include <algorithm>
#include <cstdio>
#include <functional>
#include <iterator>
#include <vector>

#include "kernels/gemm/cublaslt.cuh"
#include "kernels/gemm/gemm_instance.cuh"
#include "tests/bench/bench_util.cuh"
#include "tests/gemm_reference.cuh"

namespace coda::gemm_bench {

inline int g_timed_runs = 25;

struct Shape {
  const char* model;
  const char* name;
  GemmLayout layout;
  int M, N, K;
};

// The block linears (and LM heads) of gpt2-124m (32768 tokens) and llama3.2-1b (16384 tokens): tokens,
// in and out features.
struct Linear {
  const char* model;
  const char* name;
  int tokens, in, out;
  bool lm_head;
};
inline std::vector<Linear> model_linears() {
  return {{"gpt2", "qkv", 32768, 768, 2304, false},       {"gpt2", "attn_out", 32768, 768, 768, false},
          {"gpt2", "mlp_up", 32768, 768, 3072, false},    {"gpt2", "mlp_down", 32768, 3072, 768, false},
          {"gpt2", "lm_head", 32768, 768, 50304, true},   {"llama", "qkv", 16384, 2048, 3072, false},
          {"llama", "attn_out", 16384, 2048, 2048, false}, {"llama", "gate_up", 16384, 2048, 16384, false},
          {"llama", "down", 16384, 8192, 2048, false},    {"llama", "lm_head", 16384, 2048, 128256, true}};
}

// out = in, element by element (comparing bf16 outputs with testing::relative_error); one copy per file.
static __global__ void bf16_to_float_kernel(float* out, const __nv_bfloat16* in, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

// Device memory for one shape: `sets` rotated copies of A and B, two outputs (ours, cuBLAS).
struct Operands {
  int sets = 1;
  size_t a_elems = 0, b_elems = 0, d_elems = 0;
  std::vector<__nv_bfloat16*> A, B;
  void* D = nullptr;
  void* D_ref = nullptr;
  Operands(const Shape& s, size_t out_bytes) {
    a_elems = size_t(s.M) * s.K;
    b_elems = size_t(s.K) * s.N;
    d_elems = size_t(s.M) * s.N;
    sets = bench::rotation_sets((a_elems + b_elems) * 2);
    for (int i = 0; i < sets; ++i) {
      __nv_bfloat16 *a, *b;
      CUDA_CHECK(cudaMalloc(&a, a_elems * 2));
      CUDA_CHECK(cudaMalloc(&b, b_elems * 2));
      testing::fill_uniform(a, a_elems, 1000 + i);
      testing::fill_uniform(b, b_elems, 2000 + i);
      A.push_back(a);
      B.push_back(b);
    }
    CUDA_CHECK(cudaMalloc(&D, d_elems * out_bytes));
    CUDA_CHECK(cudaMalloc(&D_ref, d_elems * out_bytes));
    CUDA_CHECK(cudaMemset(D, 0, d_elems * out_bytes));
    CUDA_CHECK(cudaMemset(D_ref, 0, d_elems * out_bytes));
  }
  ~Operands() {
    for (auto* p : A) cudaFree(p);
    for (auto* p : B) cudaFree(p);
    cudaFree(D);
    cudaFree(D_ref);
  }
};

inline void run_ours(const Shape& s, Operands& ops, int i, GemmTile tile) {
  const int k = i % ops.sets;
  if (s.layout == GemmLayout::Forward)
    gemm_forward(static_cast<__nv_bfloat16*>(ops.D), ops.A[k], ops.B[k], s.M, s.N, s.K, nullptr, tile);
  else if (s.layout == GemmLayout::Dgrad)
    gemm_dgrad(static_cast<__nv_bfloat16*>(ops.D), ops.A[k], ops.B[k], s.M, s.N, s.K, nullptr, tile);
  else
    gemm_wgrad(static_cast<float*>(ops.D), ops.A[k], ops.B[k], s.M, s.N, s.K, true, nullptr, tile);
}

inline double tflops(const Shape& s, double ms) { return 2.0 * s.M * s.N * double(s.K) / (ms * 1e-3) / 1e12; }

inline size_t tile_index(GemmTile tile) {
  return std::find(std::begin(kGemmTiles), std::end(kGemmTiles), tile) - std::begin(kGemmTiles);
}

// What a program may read besides the accumulators: a row vector (rstd), a partial buffer, and a bf16
// tile of twice the output width (SwiGLU backward's saved gate/up pairs); and where it may store an
// auxiliary bf16 output of the accumulator's width.
struct EpilogueInputs {
  const float* rstd;
  float* partials;  // room for one (max, sum) pair per (row, 128-column tile)
  const __nv_bfloat16* gu;
  __nv_bfloat16* aux;
};

// Bare mainloop vs the same GEMM with a program, per tile configuration, then the tile gemm_choose_tile
// picks. The program's output may be wider than the bare one (1 -> 2 maps): it gets its own buffer.
template <GemmLayout kLayout, class MakeProgram>
void bench_epilogue(const char* label, const Shape& s, MakeProgram make) {
  using Program = decltype(make(EpilogueInputs{}));
  const size_t out_cols = size_t(s.N) * Program::kOutsPerCol / Program::kColsPerOut;
  Operands ops(s, 2);
  EpilogueInputs in{};
  __nv_bfloat16* out = nullptr;
  __nv_bfloat16* gu = nullptr;
  float* rstd = nullptr;
  CUDA_CHECK(cudaMalloc(&rstd, s.M * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&in.partials, size_t(s.M) * (s.N / 128 + 1) * sizeof(epi::LogSumExp::Out)));
  CUDA_CHECK(cudaMalloc(&gu, size_t(s.M) * 2 * s.N * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMalloc(&in.aux, size_t(s.M) * s.N * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMalloc(&out, size_t(s.M) * out_cols * sizeof(__nv_bfloat16)));
  testing::fill_uniform(rstd, s.M, 77, 0.5f, 2.0f);
  testing::fill_uniform(gu, size_t(s.M) * 2 * s.N, 78, -3.0f, 3.0f);
  in.rstd = rstd;
  in.gu = gu;
  const Program program = make(in);
  double overhead[std::size(kGemmTiles)] = {};
  for (size_t t = 0; t < std::size(kGemmTiles); ++t) {
    const GemmTile tile = kGemmTiles[t];
    const auto ms = bench::median_ms(g_timed_runs, {[&](int i) { run_ours(s, ops, i, tile); },
                               [&](int i) {
                                 const int k = i % ops.sets;
                                 gemm_run<kLayout>(tile, out, ops.A[k], ops.B[k], s.M, s.N, s.K, false, program,
                                                   nullptr);
                               }});
    overhead[t] = 100.0 * (ms[1] / ms[0] - 1.0);
    std::printf("%-46s %-16s bare %7.3f ms (%5.1f TF/s)  program %7.3f ms (%5.1f TF/s)  overhead %+5.1f%%\n", label,
                gemm_tile_name(tile), ms[0], tflops(s, ms[0]), ms[1], tflops(s, ms[1]), overhead[t]);
    std::fflush(stdout);
  }
  const GemmTile pick = gemm_choose_tile(s.layout, s.M, s.N, s.K, gemm_epilogue_of<Program>());
  std::printf("%-46s auto = %-9s overhead %+5.1f%%  (out cols %zu)\n", label, gemm_tile_name(pick),
              overhead[tile_index(pick)], out_cols);
  CUDA_CHECK(cudaFree(rstd));
  CUDA_CHECK(cudaFree(in.partials));
  CUDA_CHECK(cudaFree(gu));
  CUDA_CHECK(cudaFree(in.aux));
  CUDA_CHECK(cudaFree(out));
}

void bench_epilogues();  // gemm_epilogues.cu
void bench_overlap();    // gemm_overlap.cu
void bench_fp8(CublasLt& cublas);  // gemm_fp8.cu

}  // namespace coda::gemm_bench
