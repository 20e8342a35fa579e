// bench_gemm's FP8 rows: the hand-written GEMM's FP8 layouts (gemm_fp8) against cuBLASLt's FP8 GEMM, side
// by side in one run, on the three GEMMs of every block linear of gpt2-124m and llama3.2-1b as the FP8
// recipe runs them (docs/FP8.md): forward e4m3 x e4m3 -> bf16, dgrad e5m2 x e4m3 -> bf16, wgrad e5m2 x e4m3
// -> fp32 accumulated, each on K-major operands (the transposed copies). Each row also compares our output
// with cuBLASLt's (relative error) and gives the bf16 GEMM of the same shape for scale.
#include <cuda_fp8.h>

#include <cstdio>
#include <functional>
#include <vector>

#include "kernels/gemm/cublaslt.cuh"
#include "kernels/unfused/unfused.cuh"
#include "tests/bench/gemm_bench.cuh"

namespace coda::gemm_bench {

namespace {

// Random FP8 codes of |x| < 8 (values well inside both formats), one thread per byte.
__global__ void fill_fp8_kernel(uint8_t* q, size_t n, uint32_t seed, bool e5m2) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    const float x = (static_cast<float>(h & 0xFFFF) / 32768.0f - 1.0f) * 8.0f;
    q[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
  }
}

struct Fp8Shape {
  const char* model;
  const char* name;
  const char* pass;
  GemmLayout layout;  // ForwardE4m3 or ForwardE5m2
  bool fp32_out;      // the weight gradient: fp32, accumulated
  int M, N, K;
};

// The block linears' three GEMMs (the LM heads stay bf16 in the recipe).
std::vector<Fp8Shape> fp8_shapes() {
  std::vector<Fp8Shape> s;
  for (const Linear& l : model_linears()) {
    if (l.lm_head) continue;
    s.push_back({l.model, l.name, "fwd", GemmLayout::ForwardE4m3, false, l.tokens, l.out, l.in});
    s.push_back({l.model, l.name, "dgrad", GemmLayout::ForwardE5m2, false, l.tokens, l.in, l.out});
    s.push_back({l.model, l.name, "wgrad", GemmLayout::ForwardE5m2, true, l.out, l.in, l.tokens});
  }
  return s;
}

// `sets` rotated FP8 copies of A and B, the two outputs, the dequantization factors.
struct Fp8Operands {
  int sets = 1;
  size_t a_elems, b_elems, d_elems;
  std::vector<uint8_t*> A, B;
  void* D = nullptr;
  void* D_ref = nullptr;
  float* dequant = nullptr;  // dq_a, dq_b in 16-byte slots (cuBLASLt's alignment for scale pointers)
  const float* dq_a() const { return dequant; }
  const float* dq_b() const { return dequant + unfused::kFp8DequantSlot; }
  explicit Fp8Operands(const Fp8Shape& s)
      : a_elems(size_t(s.M) * s.K), b_elems(size_t(s.N) * s.K), d_elems(size_t(s.M) * s.N) {
    sets = bench::rotation_sets(a_elems + b_elems);
    for (int i = 0; i < sets; ++i) {
      uint8_t *a, *b;
      CUDA_CHECK(cudaMalloc(&a, a_elems));
      CUDA_CHECK(cudaMalloc(&b, b_elems));
      fill_fp8_kernel<<<1024, 256>>>(a, a_elems, 1000 + i, s.layout == GemmLayout::ForwardE5m2);
      fill_fp8_kernel<<<1024, 256>>>(b, b_elems, 2000 + i, false);
      CUDA_CHECK_LAUNCH();
      A.push_back(a);
      B.push_back(b);
    }
    const size_t out_bytes = s.fp32_out ? 4 : 2;
    CUDA_CHECK(cudaMalloc(&D, d_elems * out_bytes));
    CUDA_CHECK(cudaMalloc(&D_ref, d_elems * out_bytes));
    std::vector<float> factors(2 * unfused::kFp8DequantSlot, 0.0f);
    factors[0] = factors[unfused::kFp8DequantSlot] = 1.0f / 64.0f;
    CUDA_CHECK(cudaMalloc(&dequant, factors.size() * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(dequant, factors.data(), factors.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  ~Fp8Operands() {
    for (auto* p : A) cudaFree(p);
    for (auto* p : B) cudaFree(p);
    cudaFree(D);
    cudaFree(D_ref);
    cudaFree(dequant);
  }
};

void run_ours(const Fp8Shape& s, Fp8Operands& ops, int i, GemmTile tile, bool accumulate) {
  const int k = i % ops.sets;
  const float *da = ops.dq_a(), *db = ops.dq_b();
  if (s.fp32_out)
    gemm_fp8<GemmLayout::ForwardE5m2>(static_cast<float*>(ops.D), ops.A[k], da, ops.B[k], db, s.M, s.N, s.K, accumulate,
                                      nullptr, tile);
  else if (s.layout == GemmLayout::ForwardE4m3)
    gemm_fp8<GemmLayout::ForwardE4m3>(static_cast<__nv_bfloat16*>(ops.D), ops.A[k], da, ops.B[k], db, s.M, s.N, s.K,
                                      false, nullptr, tile);
  else
    gemm_fp8<GemmLayout::ForwardE5m2>(static_cast<__nv_bfloat16*>(ops.D), ops.A[k], da, ops.B[k], db, s.M, s.N, s.K,
                                      false, nullptr, tile);
}

void run_cublas(const Fp8Shape& s, Fp8Operands& ops, int i, CublasLt& cublas, bool accumulate) {
  const int k = i % ops.sets;
  const Fp8Format a = s.layout == GemmLayout::ForwardE5m2 ? Fp8Format::E5M2 : Fp8Format::E4M3;
  if (s.fp32_out)
    cublas.gemm_fp8(static_cast<float*>(ops.D_ref), ops.A[k], a, ops.dq_a(), ops.B[k], Fp8Format::E4M3,
                    ops.dq_b(), s.M, s.N, s.K, accumulate, nullptr);
  else
    cublas.gemm_fp8(static_cast<__nv_bfloat16*>(ops.D_ref), ops.A[k], a, ops.dq_a(), ops.B[k], Fp8Format::E4M3,
                    ops.dq_b(), s.M, s.N, s.K, false, nullptr);
}

// Ours against cuBLASLt's on the first operand set, both overwriting.
double compare_with_cublas(const Fp8Shape& s, Fp8Operands& ops, CublasLt& cublas) {
  run_ours(s, ops, 0, GemmTile::Auto, false);
  run_cublas(s, ops, 0, cublas, false);
  CUDA_CHECK(cudaDeviceSynchronize());
  if (s.fp32_out) return testing::relative_error(static_cast<float*>(ops.D), static_cast<float*>(ops.D_ref), ops.d_elems);
  float *ours = nullptr, *theirs = nullptr;
  CUDA_CHECK(cudaMalloc(&ours, ops.d_elems * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&theirs, ops.d_elems * sizeof(float)));
  bf16_to_float_kernel<<<1024, 256>>>(ours, static_cast<__nv_bfloat16*>(ops.D), ops.d_elems);
  bf16_to_float_kernel<<<1024, 256>>>(theirs, static_cast<__nv_bfloat16*>(ops.D_ref), ops.d_elems);
  CUDA_CHECK_LAUNCH();
  const double err = testing::relative_error(ours, theirs, ops.d_elems);
  CUDA_CHECK(cudaFree(ours));
  CUDA_CHECK(cudaFree(theirs));
  return err;
}

}  // namespace

void bench_fp8(CublasLt& cublas) {
  std::printf("FP8 GEMMs (TFLOP/s): hand-written gemm_fp8 per tile and Auto against cuBLASLt FP8\n");
  std::printf("%-6s %-9s %-6s %6s %6s %6s | %8s %8s %8s | %-16s %6s | %9s\n", "model", "gemm", "pass", "M", "N", "K",
              "cublas", "coop256", "pp128", "auto", "ratio", "rel.err");
  double worst = 1e9;
  for (const Fp8Shape& s : fp8_shapes()) {
    Fp8Operands ops(s);
    const std::vector<GemmTile> tiles = gemm_tiles_compiled(s.layout, GemmEpilogue::Bare);
    std::vector<std::function<void(int)>> runs = {[&](int i) { run_cublas(s, ops, i, cublas, s.fp32_out); }};
    for (GemmTile tile : tiles) runs.push_back([&, tile](int i) { run_ours(s, ops, i, tile, s.fp32_out); });
    const std::vector<double> ms = bench::median_ms(g_timed_runs, runs);
    const GemmTile pick = gemm_choose_tile(s.layout, s.M, s.N, s.K, GemmEpilogue::Bare);
    const Shape as_bf16{s.model, s.name, GemmLayout::Forward, s.M, s.N, s.K};
    double t_auto = 0.0, t_tile[2] = {0.0, 0.0};
    for (size_t t = 0; t < tiles.size(); ++t) {
      const double value = tflops(as_bf16, ms[1 + t]);
      if (tiles[t] == pick) t_auto = value;
      if (tiles[t] == GemmTile::Cooperative128x256) t_tile[0] = value;
      if (tiles[t] == GemmTile::PingPong128x128) t_tile[1] = value;
    }
    const double t_cublas = tflops(as_bf16, ms[0]);
    const double err = compare_with_cublas(s, ops, cublas);
    worst = std::min(worst, t_auto / t_cublas);
    std::printf("%-6s %-9s %-6s %6d %6d %6d | %8.1f %8.1f %8.1f | %-16s %6.3f | %9.2e\n", s.model, s.name, s.pass, s.M,
                s.N, s.K, t_cublas, t_tile[0], t_tile[1], gemm_tile_name(pick), t_auto / t_cublas, err);
    std::fflush(stdout);
  }
  std::printf("worst auto/cublas FP8 ratio: %.3f\n\n", worst);
}

}  // namespace coda::gemm_bench
