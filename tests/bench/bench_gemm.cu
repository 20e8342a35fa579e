// GEMM benchmark: the hand-written mainloop (both tile configurations and the automatic choice) against
// cuBLASLt, side by side in one run, on every GEMM of gpt2-124m (32768 tokens) and llama3.2-1b (16384
// tokens), forward / dgrad / wgrad (fp32 accumulate). Then the cost of CODA epilogue programs over the
// bare mainloop of the same shape (bench_epilogues).
//
// Method (tests/bench/bench_util.cuh): random inputs; several input sets rotated so the timed runs cannot live in
// L2 (>= 150 MB of operands in the rotation); 5 warm-up rounds; CUDA events around each of 25 runs; the
// median; the contenders of a shape interleaved run by run. Each shape also compares our output with
// cuBLAS's (relative error), so a fast wrong kernel cannot pass unnoticed.
// Usage: bench_gemm [--quick] [--epilogues] [--overlap]   (--quick: 10 timed runs; --epilogues: only the
// programs; --overlap: only the rows that ask whether an epilogue hides under the ping-pong MMAs)
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include <cuda_fp16.h>

#include "kernels/gemm/cublaslt.cuh"
#include "kernels/gemm/gemm_instance.cuh"
#include "tests/bench/bench_util.cuh"
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

size_t tile_index(GemmTile tile) {
  return std::find(std::begin(kGemmTiles), std::end(kGemmTiles), tile) - std::begin(kGemmTiles);
}

void bench_mainloop(CublasLt& cublas) {
  static const char* layouts[] = {"fwd", "dgrad", "wgrad"};
  std::printf("%-6s %-9s %-6s %6s %6s %6s | %8s %8s %8s %8s | %-16s %6s | %9s\n", "model", "gemm", "pass", "M", "N",
              "K", "cublas", "coop256", "pp128", "pp64x256", "auto", "ratio", "rel.err");
  double worst = 1e9;
  for (const Shape& s : model_shapes()) {
    Operands ops(s, s.layout == GemmLayout::Wgrad ? 4 : 2);
    std::vector<std::function<void(int)>> runs = {[&](int i) { run_cublas(s, ops, i, cublas); }};
    for (GemmTile tile : kGemmTiles) runs.push_back([&, tile](int i) { run_ours(s, ops, i, tile); });
    const auto ms = bench::median_ms(g_timed_runs, runs);
    const GemmTile pick = gemm_choose_tile(s.layout, s.M, s.N, s.K, GemmEpilogue::Bare);
    const double t_cublas = tflops(s, ms[0]), t_auto = tflops(s, ms[1 + tile_index(pick)]);
    const double err = compare_with_cublas(s, ops, cublas);
    worst = std::min(worst, t_auto / t_cublas);
    std::printf("%-6s %-9s %-6s %6d %6d %6d | %8.1f %8.1f %8.1f %8.1f | %-16s %6.3f | %9.2e\n", s.model, s.name,
                layouts[static_cast<int>(s.layout)], s.M, s.N, s.K, t_cublas, tflops(s, ms[1]), tflops(s, ms[2]),
                tflops(s, ms[3]), gemm_tile_name(pick), t_auto / t_cublas, err);
    std::fflush(stdout);
  }
  std::printf("worst auto/cublas ratio: %.3f\n\n", worst);
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

// The three-primitive programs (row scale + pairwise map + partial row reduction), each primitive of the short-K one alone (where the cost comes from),
// and SwiGLU backward (1 -> 2, reads the saved gate/up pairs: 3x the bare GEMM's output traffic).
void bench_epilogues() {
  using namespace coda::epi;
  const Shape gate_up{"llama", "gate_up", GemmLayout::Forward, 16384, 16384, 2048};
  const Shape qkv{"llama", "qkv", GemmLayout::Forward, 16384, 3072, 2048};
  const Shape fc{"gpt2", "mlp_up", GemmLayout::Forward, 32768, 3072, 768};
  const Shape down_dgrad{"llama", "down", GemmLayout::Dgrad, 16384, 8192, 2048};
  const Rope<64> rope{2048, 2560, 13.287712f};
  bench_epilogue<GemmLayout::Forward>("llama gate_up: rstd * acc, SwiGLU, sum sq", gate_up, [](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), Pairwise<SwiGlu>(), RowReduce<SumSquares>(in.partials));
  });
  bench_epilogue<GemmLayout::Forward>("llama qkv: rstd * acc, RoPE, sum sq", qkv, [&](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), Pairwise<Rope<64>>(rope), RowReduce<SumSquares>(in.partials));
  });
  bench_epilogue<GemmLayout::Forward>("gpt2 mlp_up: rstd * acc, SwiGLU, sum sq", fc, [](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), Pairwise<SwiGlu>(), RowReduce<SumSquares>(in.partials));
  });
  bench_epilogue<GemmLayout::Forward>("  gpt2 mlp_up: aux store (bf16) only", fc, [](EpilogueInputs in) {
    return make_program(StoreAux<__nv_bfloat16>(in.aux, 3072));
  });
  bench_epilogue<GemmLayout::Forward>("  llama gate_up: rstd * acc, aux (g, u), SwiGLU", gate_up, [](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), StoreAux<__nv_bfloat16>(in.aux, 16384), Pairwise<SwiGlu>());
  });
  bench_epilogue<GemmLayout::Forward>("  gpt2 mlp_up: rstd * acc only", fc,
                                      [](EpilogueInputs in) { return make_program(RowBroadcast<Mul>(in.rstd)); });
  bench_epilogue<GemmLayout::Forward>("  gpt2 mlp_up: SwiGLU only", fc,
                                      [](EpilogueInputs) { return make_program(Pairwise<SwiGlu>()); });
  bench_epilogue<GemmLayout::Forward>("  gpt2 mlp_up: sum sq only", fc, [](EpilogueInputs in) {
    return make_program(RowReduce<SumSquares>(in.partials));
  });
  bench_epilogue<GemmLayout::Forward>("  llama qkv: RoPE only", qkv,
                                      [&](EpilogueInputs) { return make_program(Pairwise<Rope<64>>(rope)); });
  bench_epilogue<GemmLayout::Dgrad>("llama down dgrad: SwiGLU bwd, <dz,z>, rstd", down_dgrad, [](EpilogueInputs in) {
    return make_program(SwiGluBackward<__nv_bfloat16>(in.gu, 2 * 8192, nullptr, 8192),
                        RowDot<Tile>(Tile{in.gu, 2 * 8192}, in.partials), RowBroadcast<Mul>(in.rstd));
  });
}

// Arithmetic alone: kSteps dependent instructions per value of one kind, no memory access (the compiler
// may not fold any of the chains): fp32 multiply-adds (FFMA), integer multiply-adds on the value's bits
// (IMAD), packed half-precision multiply-adds (HFMA2), tanh (MUFU). What the overlap rows below compare.
enum class Pipe { Fp32, Int, Half2, Sfu };
template <Pipe kPipe, int kSteps>
struct AluWork {
  CODA_HD float operator()(float x) const {
#if defined(__CUDA_ARCH__)
    if constexpr (kPipe == Pipe::Fp32) {
      for (int i = 0; i < kSteps; ++i) x = fmaf(x, 0.999f, 0.0001f);
    } else if constexpr (kPipe == Pipe::Int) {
      int v = __float_as_int(x);
      for (int i = 0; i < kSteps; ++i) v = v * v + 1;
      x += __int_as_float(v & 0x00800000);
    } else if constexpr (kPipe == Pipe::Half2) {
      __half2 h = __floats2half2_rn(x, 0.5f * x);
      const __half2 a = __floats2half2_rn(0.999f, 0.999f), b = __floats2half2_rn(0.0001f, 0.0001f);
      for (int i = 0; i < kSteps; ++i) h = __hfma2(h, a, b);
      x = __low2float(h) + __high2float(h);
    } else {
      for (int i = 0; i < kSteps; ++i) asm("tanh.approx.f32 %0, %0;" : "+f"(x));
    }
#endif
    return x;
  }
};

// One elementwise arithmetic program (Work per value) against the bare GEMM.
template <class Work>
void bench_arithmetic(const char* label, const Shape& s) {
  bench_epilogue<GemmLayout::Forward>(label, s,
                                      [](EpilogueInputs) { return epi::make_program(epi::Elementwise<Work>()); });
}

// Does an epilogue hide under the other consumer's MMAs on the ping-pong tiles? The same kinds of work
// alone (arithmetic only; column-vector loads from L1; a tile input from shared memory; the online
// log-sum-exp; the LayerNorm reparameterization) at gpt2's fc shape (K = 768: 12 k-blocks, the
// shortest mainloop of the programs), on every tile against its bare GEMM. On the ping-pong tiles fp32
// instructions (FFMA, FMUL, FADD) slow the other consumer's MMAs by about their issue cycles, integer and
// half2 ones do not (a clock64 timeline of the kernel, docs/LOG.md) but run at half rate, so their rows
// cost about as much in time; tanh hides.
void bench_overlap() {
  using namespace coda::epi;
  const Shape fc{"gpt2", "mlp_up", GemmLayout::Forward, 32768, 3072, 768};
  bench_arithmetic<AluWork<Pipe::Fp32, 16>>("overlap: 16 FMAs per value", fc);
  bench_arithmetic<AluWork<Pipe::Fp32, 48>>("overlap: 48 FMAs per value", fc);
  bench_arithmetic<AluWork<Pipe::Fp32, 8>>("overlap: 8 FMAs per value", fc);
  bench_arithmetic<AluWork<Pipe::Int, 8>>("overlap: 8 integer multiply-adds per value", fc);
  bench_arithmetic<AluWork<Pipe::Half2, 8>>("overlap: 8 half2 FMAs per value", fc);
  bench_arithmetic<AluWork<Pipe::Sfu, 2>>("overlap: 2 tanh per value", fc);
  bench_epilogue<GemmLayout::Forward>("overlap: two fp32 column vectors", fc, [](EpilogueInputs in) {
    return make_program(ColBroadcast<Add>(in.rstd), ColBroadcast<Mul>(in.rstd + 8));
  });
  bench_epilogue<GemmLayout::Forward>("overlap: one tile input", fc, [](EpilogueInputs in) {
    return make_program(TileLoad<Add>(in.gu, 3072));
  });
  bench_epilogue<GemmLayout::Forward>("overlap: log-sum-exp partials", fc, [](EpilogueInputs in) {
    return make_program(RowReduce<LogSumExp>(reinterpret_cast<LogSumExp::Out*>(in.partials)));
  });
  bench_epilogue<GemmLayout::Forward>("overlap: LayerNorm reparameterization", fc, [](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), SubScaled<ColVector>(in.rstd, ColVector{in.rstd + 8}),
                        ColBroadcast<Add>(in.rstd + 16));
  });
}

}  // namespace

int main(int argc, char** argv) {
  bool mainloop = true, overlap = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0)
      g_timed_runs = 10;
    else if (std::strcmp(argv[i], "--epilogues") == 0)
      mainloop = false;
    else if (std::strcmp(argv[i], "--overlap") == 0)
      overlap = true;
    else {
      std::fprintf(stderr, "bench_gemm: unknown argument %s (usage: bench_gemm [--quick] [--epilogues] [--overlap])\n",
                   argv[i]);
      return 2;
    }
  }
  try {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs; median of %d timed runs (TFLOP/s)\n\n", prop.name, prop.multiProcessorCount,
                g_timed_runs);
    CublasLt cublas;
    if (overlap) {
      bench_overlap();
      return 0;
    }
    if (mainloop) bench_mainloop(cublas);
    bench_epilogues();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
