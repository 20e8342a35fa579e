// GEMM benchmark: the hand-written mainloop (both tile configurations and the automatic choice) against
// cuBLASLt, side by side in one run, on every GEMM of gpt2-124m (32768 tokens) and llama3.2-1b (16384
// tokens), forward / dgrad / wgrad (fp32 accumulate). Then the cost of a three-primitive CODA epilogue
// (row scale + pairwise map + partial row reduction) over the bare mainloop of the same shape.
//
// Method: random inputs; several input sets rotated so the timed runs cannot live in L2 (>= 150 MB of
// operands in the rotation); 5 warm-up rounds; CUDA events around each of 25 runs; the median. The
// contenders of a shape run interleaved, run by run, so all of them see the same clocks (under
// sustained load the card sits at its power cap and the SM clock drops: timing contenders one after
// the other favoured whoever ran first by up to 20%). Each shape also compares our output with
// cuBLAS's (relative error), so a fast wrong kernel cannot pass unnoticed.
// Usage: bench_gemm [--quick]   (--quick: 10 timed runs)
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/gemm/cublaslt.cuh"
#include "kernels/gemm/gemm_launch.cuh"
#include "tests/gemm_reference.cuh"

namespace {

using namespace coda;

int g_timed_runs = 25;

struct Shape {
  const char* model;
  const char* name;
  GemmLayout layout;
  int M, N, K;
};

// Linear layer (tokens, in, out) -> its three GEMMs in gemm.cuh's M, N, K terms.
void add_layer(std::vector<Shape>& shapes, const char* model, const char* name, int tokens, int in, int out) {
  shapes.push_back({model, name, GemmLayout::Forward, tokens, out, in});
  shapes.push_back({model, name, GemmLayout::Dgrad, tokens, in, out});
  shapes.push_back({model, name, GemmLayout::Wgrad, out, in, tokens});
}

std::vector<Shape> model_shapes() {
  std::vector<Shape> s;
  add_layer(s, "gpt2", "qkv", 32768, 768, 2304);
  add_layer(s, "gpt2", "attn_out", 32768, 768, 768);
  add_layer(s, "gpt2", "mlp_up", 32768, 768, 3072);
  add_layer(s, "gpt2", "mlp_down", 32768, 3072, 768);
  add_layer(s, "gpt2", "lm_head", 32768, 768, 50304);
  add_layer(s, "llama", "qkv", 16384, 2048, 3072);
  add_layer(s, "llama", "attn_out", 16384, 2048, 2048);
  add_layer(s, "llama", "gate_up", 16384, 2048, 16384);
  add_layer(s, "llama", "down", 16384, 8192, 2048);
  add_layer(s, "llama", "lm_head", 16384, 2048, 128256);
  return s;
}

// Median time in ms of each contender; contender j's run i is run(j)(i), interleaved by i.
std::vector<double> median_ms(const std::vector<std::function<void(int)>>& runs) {
  const int n = static_cast<int>(runs.size());
  for (int i = 0; i < 5; ++i)
    for (const auto& run : runs) run(i);
  std::vector<cudaEvent_t> ev(2 * g_timed_runs * n);
  for (auto& e : ev) CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < g_timed_runs; ++i)
    for (int j = 0; j < n; ++j) {
      CUDA_CHECK(cudaEventRecord(ev[2 * (i * n + j)]));
      runs[j](i);
      CUDA_CHECK(cudaEventRecord(ev[2 * (i * n + j) + 1]));
    }
  CUDA_CHECK(cudaEventSynchronize(ev.back()));
  std::vector<double> medians(n);
  for (int j = 0; j < n; ++j) {
    std::vector<float> ms(g_timed_runs);
    for (int i = 0; i < g_timed_runs; ++i)
      CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * (i * n + j)], ev[2 * (i * n + j) + 1]));
    std::nth_element(ms.begin(), ms.begin() + g_timed_runs / 2, ms.end());
    medians[j] = ms[g_timed_runs / 2];
  }
  for (auto& e : ev) CUDA_CHECK(cudaEventDestroy(e));
  return medians;
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
    const size_t set_bytes = (a_elems + b_elems) * 2;
    sets = static_cast<int>(std::min<size_t>(8, std::max<size_t>(1, (150u << 20) / set_bytes + 1)));
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

__global__ void bf16_to_float_kernel(float* out, const __nv_bfloat16* in, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

// Relative difference of our output and cuBLAS's for the same inputs (both overwrite, no accumulate).
double compare_with_cublas(const Shape& s, Operands& ops, CublasLt& cublas) {
  if (s.layout == GemmLayout::Wgrad) {
    auto* D = static_cast<float*>(ops.D);
    auto* R = static_cast<float*>(ops.D_ref);
    gemm_wgrad(D, ops.A[0], ops.B[0], s.M, s.N, s.K, false, nullptr);
    cublas.gemm(R, ops.A[0], Op::T, ops.B[0], Op::N, s.M, s.N, s.K, false, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    return testing::relative_error(D, R, ops.d_elems);
  }
  auto* D = static_cast<__nv_bfloat16*>(ops.D);
  auto* R = static_cast<__nv_bfloat16*>(ops.D_ref);
  if (s.layout == GemmLayout::Forward) {
    gemm_forward(D, ops.A[0], ops.B[0], s.M, s.N, s.K, nullptr);
    cublas.gemm(R, ops.A[0], Op::N, ops.B[0], Op::T, s.M, s.N, s.K, false, nullptr);
  } else {
    gemm_dgrad(D, ops.A[0], ops.B[0], s.M, s.N, s.K, nullptr);
    cublas.gemm(R, ops.A[0], Op::N, ops.B[0], Op::N, s.M, s.N, s.K, false, nullptr);
  }
  float* Rf = nullptr;
  CUDA_CHECK(cudaMalloc(&Rf, ops.d_elems * sizeof(float)));
  bf16_to_float_kernel<<<1024, 256>>>(Rf, R, ops.d_elems);
  CUDA_CHECK_LAUNCH();
  const double err = testing::relative_error(D, Rf, ops.d_elems);
  CUDA_CHECK(cudaFree(Rf));
  return err;
}

void run_ours(const Shape& s, Operands& ops, int i, GemmTile tile) {
  const int k = i % ops.sets;
  if (s.layout == GemmLayout::Forward)
    gemm_forward(static_cast<__nv_bfloat16*>(ops.D), ops.A[k], ops.B[k], s.M, s.N, s.K, nullptr, tile);
  else if (s.layout == GemmLayout::Dgrad)
    gemm_dgrad(static_cast<__nv_bfloat16*>(ops.D), ops.A[k], ops.B[k], s.M, s.N, s.K, nullptr, tile);
  else
    gemm_wgrad(static_cast<float*>(ops.D), ops.A[k], ops.B[k], s.M, s.N, s.K, true, nullptr, tile);
}

void run_cublas(const Shape& s, Operands& ops, int i, CublasLt& cublas) {
  const int k = i % ops.sets;
  if (s.layout == GemmLayout::Forward)
    cublas.gemm(static_cast<__nv_bfloat16*>(ops.D_ref), ops.A[k], Op::N, ops.B[k], Op::T, s.M, s.N, s.K, false, nullptr);
  else if (s.layout == GemmLayout::Dgrad)
    cublas.gemm(static_cast<__nv_bfloat16*>(ops.D_ref), ops.A[k], Op::N, ops.B[k], Op::N, s.M, s.N, s.K, false, nullptr);
  else
    cublas.gemm(static_cast<float*>(ops.D_ref), ops.A[k], Op::T, ops.B[k], Op::N, s.M, s.N, s.K, true, nullptr);
}

double tflops(const Shape& s, double ms) { return 2.0 * s.M * s.N * double(s.K) / (ms * 1e-3) / 1e12; }

void bench_mainloop(CublasLt& cublas) {
  static const char* layouts[] = {"fwd", "dgrad", "wgrad"};
  std::printf("%-6s %-9s %-6s %6s %6s %6s | %8s %8s %8s | %-16s %6s | %9s\n", "model", "gemm", "pass", "M", "N", "K",
              "cublas", "coop256", "pp128", "auto", "ratio", "rel.err");
  double worst = 1e9;
  for (const Shape& s : model_shapes()) {
    Operands ops(s, s.layout == GemmLayout::Wgrad ? 4 : 2);
    const auto ms = median_ms({[&](int i) { run_cublas(s, ops, i, cublas); },
                               [&](int i) { run_ours(s, ops, i, GemmTile::Cooperative128x256); },
                               [&](int i) { run_ours(s, ops, i, GemmTile::PingPong128x128); }});
    const double t_cublas = tflops(s, ms[0]), t_coop = tflops(s, ms[1]), t_pp = tflops(s, ms[2]);
    const GemmTile pick = gemm_choose_tile(s.layout, s.M, s.N, s.K);
    const double t_auto = pick == GemmTile::Cooperative128x256 ? t_coop : t_pp;
    const double err = compare_with_cublas(s, ops, cublas);
    worst = std::min(worst, t_auto / t_cublas);
    std::printf("%-6s %-9s %-6s %6d %6d %6d | %8.1f %8.1f %8.1f | %-16s %6.3f | %9.2e\n", s.model, s.name,
                layouts[static_cast<int>(s.layout)], s.M, s.N, s.K, t_cublas, t_coop, t_pp, gemm_tile_name(pick),
                t_auto / t_cublas, err);
    std::fflush(stdout);
  }
  std::printf("worst auto/cublas ratio: %.3f\n\n", worst);
}

// Bare mainloop vs the same GEMM with a three-primitive program, per tile configuration.
template <class MakeProgram>
void bench_epilogue(const char* label, const Shape& s, MakeProgram make, int cols_per_out) {
  Operands ops(s, 2);
  float* rstd = nullptr;
  float* partials = nullptr;
  CUDA_CHECK(cudaMalloc(&rstd, s.M * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&partials, size_t(s.M) * (s.N / 128 + 1) * sizeof(float)));
  testing::fill_uniform(rstd, s.M, 77, 0.5f, 2.0f);
  for (GemmTile tile : {GemmTile::Cooperative128x256, GemmTile::PingPong128x128}) {
    const auto program = make(rstd, partials);
    auto* D = static_cast<__nv_bfloat16*>(ops.D);
    const auto ms = median_ms({[&](int i) { run_ours(s, ops, i, tile); },
                               [&](int i) {
                                 const int k = i % ops.sets;
                                 gemm_run<GemmLayout::Forward>(tile, D, ops.A[k], ops.B[k], s.M, s.N, s.K, false,
                                                               program, nullptr);
                               }});
    const double bare = ms[0], fused = ms[1];
    std::printf("%-44s %-16s bare %7.3f ms (%5.1f TF/s)  program %7.3f ms (%5.1f TF/s)  overhead %+5.1f%%  (out cols %d)\n",
                label, gemm_tile_name(tile), bare, tflops(s, bare), fused, tflops(s, fused),
                100.0 * (fused / bare - 1.0), s.N / cols_per_out);
    std::fflush(stdout);
  }
  CUDA_CHECK(cudaFree(rstd));
  CUDA_CHECK(cudaFree(partials));
}

void bench_epilogues() {
  using namespace coda::epi;
  const Shape gate_up{"llama", "gate_up", GemmLayout::Forward, 16384, 16384, 2048};
  bench_epilogue("llama gate_up: rstd * acc, SwiGLU, sum sq", gate_up,
                 [](const float* rstd, float* partials) {
                   return make_program(RowBroadcast<Mul>(rstd), Pairwise<SwiGlu>(), RowReduce<SumSquares>(partials));
                 },
                 2);
  const Shape qkv{"llama", "qkv", GemmLayout::Forward, 16384, 3072, 2048};
  bench_epilogue("llama qkv: rstd * acc, RoPE, sum sq", qkv,
                 [](const float* rstd, float* partials) {
                   return make_program(RowBroadcast<Mul>(rstd), Pairwise<Rope>(Rope{2048, 64, 2560, 13.287712f}),
                                       RowReduce<SumSquares>(partials));
                 },
                 1);
  const Shape fc{"gpt2", "mlp_up", GemmLayout::Forward, 32768, 3072, 768};
  bench_epilogue("gpt2 mlp_up: rstd * acc, SwiGLU, sum sq", fc,
                 [](const float* rstd, float* partials) {
                   return make_program(RowBroadcast<Mul>(rstd), Pairwise<SwiGlu>(), RowReduce<SumSquares>(partials));
                 },
                 2);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--quick") == 0) g_timed_runs = 10;
  try {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs; median of %d timed runs (TFLOP/s)\n\n", prop.name, prop.multiProcessorCount,
                g_timed_runs);
    CublasLt cublas;
    bench_mainloop(cublas);
    bench_epilogues();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
