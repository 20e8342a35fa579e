// GEMM benchmark: the hand-written mainloop (both tile configurations and the automatic choice) against
// cuBLASLt, side by side in one run, on every GEMM of gpt2-124m (32768 tokens) and llama3.2-1b (16384
// tokens), forward / dgrad / wgrad (fp32 accumulate). Then the cost of CODA epilogue programs over the
// bare mainloop of the same shape (gemm_epilogues.cu, gemm_overlap.cu). Method: bench_util.cuh (median_ms,
// >= 150 MB of operands in the rotation); each shape also compares our output with cuBLAS's (relative
// error), so a fast wrong kernel cannot pass unnoticed.
// Usage: bench_gemm [--quick] [--epilogues] [--overlap]   (--quick: 10 timed runs; --epilogues: only the
// programs; --overlap: only the rows that ask whether an epilogue hides under the ping-pong MMAs; --fp8: only
// the FP8 GEMMs against cuBLASLt's, gemm_fp8.cu, which the full run also times after the bf16 mainloop)

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <string>
#include <vector>


#include "kernels/gemm/cublaslt.cuh"
#include "tests/bench/gemm_bench.cuh"

namespace {

using namespace coda;
using namespace coda::gemm_bench;

// Each linear's three GEMMs in gemm.cuh's M, N, K terms.
std::vector<Shape> model_shapes() {
  std::vector<Shape> s;
  for (const Linear& l : model_linears()) {
    s.push_back({l.model, l.name, GemmLayout::Forward, l.tokens, l.out, l.in});
    s.push_back({l.model, l.name, GemmLayout::Dgrad, l.tokens, l.in, l.out});
    s.push_back({l.model, l.name, GemmLayout::Wgrad, l.out, l.in, l.tokens});
  }
  return s;
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

void run_cublas(const Shape& s, Operands& ops, int i, CublasLt& cublas) {
  const int k = i % ops.sets;
  if (s.layout == GemmLayout::Forward)
    cublas.gemm(static_cast<__nv_bfloat16*>(ops.D_ref), ops.A[k], Op::N, ops.B[k], Op::T, s.M, s.N, s.K, false, nullptr);
  else if (s.layout == GemmLayout::Dgrad)
    cublas.gemm(static_cast<__nv_bfloat16*>(ops.D_ref), ops.A[k], Op::N, ops.B[k], Op::N, s.M, s.N, s.K, false, nullptr);
  else
    cublas.gemm(static_cast<float*>(ops.D_ref), ops.A[k], Op::T, ops.B[k], Op::N, s.M, s.N, s.K, true, nullptr);
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

}  // namespace

int main(int argc, char** argv) {
  bool mainloop = true, overlap = false, fp8_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0)
      g_timed_runs = 10;
    else if (std::strcmp(argv[i], "--epilogues") == 0)
      mainloop = false;
    else if (std::strcmp(argv[i], "--overlap") == 0)
      overlap = true;
    else if (std::strcmp(argv[i], "--fp8") == 0)
      fp8_only = true;
    else {
      std::fprintf(stderr,
                   "bench_gemm: unknown argument %s (usage: bench_gemm [--quick] [--epilogues] [--overlap] [--fp8])\n",
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
    if (fp8_only) {
      bench_fp8(cublas);
      return 0;
    }
    if (mainloop) {
      bench_mainloop(cublas);
      bench_fp8(cublas);
    }
    bench_epilogues();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
