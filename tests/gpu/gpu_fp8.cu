// The FP8 quantize kernels (kernels/unfused/fp8.cu) against the host codec (src/fp8.hpp, itself checked
// against CUDA's host conversions): every byte equal, flat and transposed, both formats, on random bf16 data
// over many binades with a scale that pushes the largest values past the format's range (saturation), a
// tail shape that is not a multiple of the 64 x 64 tile, and the amax equal to the host's max |x| (NaN in,
// NaN out). cuBLASLt's FP8 GEMM (CublasLt::gemm_fp8) and the hand-written one (gemm_fp8, every compiled
// tile, with tails) against the host product of the decoded operands with their dequantization factors,
// for the format pairs used, bf16 and accumulated fp32 outputs. The device's delayed scaling against the
// host's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/common/cuda_check.cuh"
#include "kernels/gemm/cublaslt.cuh"
#include "kernels/gemm/gemm.cuh"
#include "kernels/unfused/unfused.cuh"
#include "src/fp8.hpp"
#include "src/rng.hpp"
#include "tests/gpu_test_util.cuh"

namespace {

using coda::Fp8Format;
using bf16 = __nv_bfloat16;

struct Quantized {
  std::vector<uint8_t> q, qt;  // row-major; transposed (the transposed call writes both)
  float amax = 0.0f;
};

// Random bf16 magnitudes over 2^-20 .. 2^11 of both signs, as the device will read them.
std::vector<bf16> random_bf16(size_t n, uint64_t seed) {
  coda::Rng rng(seed);
  std::vector<bf16> x(n);
  for (size_t i = 0; i < n; ++i) {
    const float m = std::ldexp(static_cast<float>(rng.uniform()) + 0.5f, static_cast<int>(rng.below(32)) - 20);
    x[i] = __float2bfloat16(i % 3 == 0 ? -m : m);
  }
  return x;
}

// One quantize call onto an amax that holds start_amax (what earlier calls of the step left).
Quantized run(const std::vector<bf16>& x, int rows, int cols, bool transposed, float scale, Fp8Format format,
              float start_amax = 0.0f) {
  bf16* dx = nullptr;
  uint8_t *dq = nullptr, *dqt = nullptr;
  float *damax = nullptr, *dscale = nullptr;
  CUDA_CHECK(cudaMalloc(&dx, x.size() * sizeof(bf16)));
  CUDA_CHECK(cudaMalloc(&dq, x.size()));
  CUDA_CHECK(cudaMalloc(&dqt, x.size()));
  CUDA_CHECK(cudaMalloc(&damax, sizeof(float)));
  CUDA_CHECK(cudaMalloc(&dscale, sizeof(float)));
  CUDA_CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dscale, &scale, sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(damax, &start_amax, sizeof(float), cudaMemcpyHostToDevice));
  if (transposed)
    coda::unfused::quantize_fp8_transposed(dqt, dq, damax, dx, rows, cols, dscale, format, nullptr);
  else
    coda::unfused::quantize_fp8(dq, damax, dx, x.size(), dscale, format, nullptr);
  Quantized out;
  out.q.resize(x.size());
  CUDA_CHECK(cudaMemcpy(out.q.data(), dq, x.size(), cudaMemcpyDeviceToHost));
  if (transposed) {
    out.qt.resize(x.size());
    CUDA_CHECK(cudaMemcpy(out.qt.data(), dqt, x.size(), cudaMemcpyDeviceToHost));
  }
  CUDA_CHECK(cudaMemcpy(&out.amax, damax, sizeof(float), cudaMemcpyDeviceToHost));
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(dq), static_cast<void*>(dqt), static_cast<void*>(damax),
                  static_cast<void*>(dscale)})
    CUDA_CHECK(cudaFree(p));
  return out;
}

TEST(GpuFp8, QuantizeFlatAndTransposedEqualTheHostCodec) {
  SKIP_WITHOUT_GPU();
  const int rows = 200, cols = 136;  // 4 x 3 tiles, the last ones partial
  const std::vector<bf16> x = random_bf16(static_cast<size_t>(rows) * cols, 7);
  float amax = 0.0f;
  for (bf16 v : x) amax = std::fmax(amax, std::fabs(__bfloat162float(v)));
  for (Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    const float scale = 2.0f * coda::fp8_largest(format) / amax;  // the largest values saturate
    for (bool transposed : {false, true}) {
      const Quantized q = run(x, rows, cols, transposed, scale, format);
      EXPECT_EQ(q.amax, amax) << coda::fp8_format_name(format) << (transposed ? " transposed" : "");
      size_t mismatches = 0, mismatches_t = 0;
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
          const uint8_t expected = coda::fp8_encode(__bfloat162float(x[static_cast<size_t>(r) * cols + c]) * scale, format);
          mismatches += q.q[static_cast<size_t>(r) * cols + c] != expected;
          if (transposed) mismatches_t += q.qt[static_cast<size_t>(c) * rows + r] != expected;
        }
      EXPECT_EQ(mismatches, 0u) << coda::fp8_format_name(format) << (transposed ? " transposed call" : "");
      EXPECT_EQ(mismatches_t, 0u) << coda::fp8_format_name(format) << " transposed copy";
      // The amax gathers over the step's calls: a larger one already there stays.
      EXPECT_EQ(run(x, rows, cols, transposed, scale, format, 3.0f * amax).amax, 3.0f * amax);
    }
  }
}

TEST(GpuFp8, AmaxIsNanWhenTheTensorHoldsANan) {
  SKIP_WITHOUT_GPU();
  std::vector<bf16> x = random_bf16(64 * 64, 8);
  x[1234] = __float2bfloat16(std::nanf(""));
  for (bool transposed : {false, true})
    EXPECT_TRUE(std::isnan(run(x, 64, 64, transposed, 1.0f, Fp8Format::E4M3).amax)) << transposed;
}

// Delayed scaling on the device, three tensors over six steps (two e4m3, then one e5m2, in one launch),
// against the host's Fp8DelayedScale: the same scales bit for bit; a NaN amax of tensor 1 at step 3 and of
// the e5m2 tensor 2 at step 4 leaves its scale and names it in *bad by its index in the whole array.
TEST(GpuFp8, UpdateScalesFollowsTheHostDelayedScale) {
  SKIP_WITHOUT_GPU();
  const int count = 3, e4m3_count = 2, history = 4, margin = 1, steps = 6;
  const float amax[steps][count] = {{2.0f, 0.5f, 0.0f}, {8.0f, 0.25f, 0.0f}, {1.0f, 3.0f, 7.0f},
                                    {0.5f, NAN, 1.0f},  {0.1f, 0.1f, NAN},   {0.2f, 0.3f, 0.4f}};
  std::vector<coda::Fp8DelayedScale> host;
  for (int t = 0; t < count; ++t)
    host.emplace_back(t < e4m3_count ? Fp8Format::E4M3 : Fp8Format::E5M2, history, margin);
  float *scale = nullptr, *dequant = nullptr, *ring = nullptr, *damax = nullptr;
  unsigned int* bad = nullptr;
  CUDA_CHECK(cudaMalloc(&scale, count * sizeof(float)));
  constexpr int slot = coda::unfused::kFp8DequantSlot;
  CUDA_CHECK(cudaMalloc(&dequant, count * slot * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&ring, count * history * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&damax, count * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&bad, sizeof(unsigned int)));
  const std::vector<float> ones(count * slot, 1.0f);
  CUDA_CHECK(cudaMemcpy(scale, ones.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dequant, ones.data(), count * slot * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(ring, 0, count * history * sizeof(float)));
  for (int step = 0; step < steps; ++step) {
    CUDA_CHECK(cudaMemset(bad, 0, sizeof(unsigned int)));
    CUDA_CHECK(cudaMemcpy(damax, amax[step], count * sizeof(float), cudaMemcpyHostToDevice));
    coda::unfused::fp8_update_scales(scale, dequant, ring, damax, count, e4m3_count, history, step, margin, bad,
                                     nullptr);
    float got[count], got_dequant[count * slot], left[count];
    unsigned int flagged = 0;
    CUDA_CHECK(cudaMemcpy(left, damax, sizeof(left), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got, scale, sizeof(got), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_dequant, dequant, sizeof(got_dequant), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&flagged, bad, sizeof(flagged), cudaMemcpyDeviceToHost));
    unsigned int expected_flag = 0;
    for (int t = 0; t < count; ++t) {
      try {
        host[t].record(amax[step][t], "tensor " + std::to_string(t));
        host[t].update(step);
      } catch (const std::runtime_error&) {
        if (expected_flag == 0) expected_flag = t + 1;
      }
      EXPECT_EQ(got[t], host[t].scale()) << "step " << step << " tensor " << t;
      EXPECT_EQ(got_dequant[t * slot], 1.0f / host[t].scale()) << "step " << step << " tensor " << t;
      EXPECT_EQ(left[t], 0.0f) << "the update zeroes the amax for the next step's quantize calls";
    }
    EXPECT_EQ(flagged, expected_flag) << "step " << step;
  }
  for (void* p : {static_cast<void*>(scale), static_cast<void*>(dequant), static_cast<void*>(ring),
                  static_cast<void*>(damax), static_cast<void*>(bad)})
    CUDA_CHECK(cudaFree(p));
}

// An FP8 product D[M, N] = dq_a dq_b (A[M, K] B[N, K]^T) on random codes spread over each format's range:
// the operands on the device, the expected product and its magnitude sum |terms| (fp64) on the host.
struct Fp8Product {
  static constexpr float kFactors[2] = {1.0f / 300.0f, 1.0f / 7000.0f};
  int M, N, K;
  Fp8Format a_format, b_format;
  std::vector<uint8_t> host_a, host_b;
  coda::test::DeviceCopy<uint8_t> a, b;
  coda::test::DeviceBuffer<float> dequant;  // dq_a and dq_b, each in a 16-byte slot as the trainer keeps them
  std::vector<double> expected, magnitude;

  static std::vector<uint8_t> codes(size_t count, Fp8Format format, uint64_t seed) {
    coda::Rng rng(seed);
    std::vector<uint8_t> q(count);
    for (auto& c : q) c = coda::fp8_encode(static_cast<float>(rng.normal()) * 0.3f * coda::fp8_largest(format), format);
    return q;
  }
  Fp8Product(int m, int n, int k, Fp8Format af, Fp8Format bf, uint64_t seed)
      : M(m), N(n), K(k), a_format(af), b_format(bf), host_a(codes(size_t(m) * k, af, seed)),
        host_b(codes(size_t(n) * k, bf, seed + 1)), a(host_a), b(host_b),
        dequant(slotted_factors()),
        expected(size_t(m) * n, 0.0), magnitude(expected.size(), 0.0) {
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j)
        for (int kk = 0; kk < K; ++kk) {
          const double term = static_cast<double>(coda::fp8_decode(host_a[size_t(i) * K + kk], af)) *
                              coda::fp8_decode(host_b[size_t(j) * K + kk], bf) * kFactors[0] * kFactors[1];
          expected[size_t(i) * N + j] += term;
          magnitude[size_t(i) * N + j] += std::fabs(term);
        }
  }
  static std::vector<float> slotted_factors() {
    std::vector<float> slots(2 * coda::unfused::kFp8DequantSlot, 0.0f);
    slots[0] = kFactors[0], slots[coda::unfused::kFp8DequantSlot] = kFactors[1];
    return slots;
  }
  const float* dq_a() const { return dequant.get(); }
  const float* dq_b() const { return dequant.get() + coda::unfused::kFp8DequantSlot; }
  std::string formats() const {
    return std::string(coda::fp8_format_name(a_format)) + " x " + coda::fp8_format_name(b_format);
  }
  // The largest |got - (start + expected)| relative to the magnitude (NaN-proof).
  double worst(const std::vector<float>& got, float start) const {
    double w = 0.0;
    for (size_t i = 0; i < expected.size(); ++i) {
      const double e = std::fabs(got[i] - start - expected[i]) / (magnitude[i] + 1e-30);
      w = std::isnan(e) ? INFINITY : std::fmax(w, e);
    }
    return w;
  }
};

// Limits relative to sum |terms|: fp32 accumulation, and bf16's rounding of the output on top. Hopper's FP8
// wgmma keeps fewer bits than fp32 while it adds a k32 group's products into its accumulator (they are
// aligned to the largest exponent and truncated), so the hand-written FP8 GEMM, which reads the
// accumulators after the last k block, is held to kFp8WgmmaLimit (measured 2.1e-4 on H100, e5m2 x e4m3,
// K = 272); cuBLASLt without fast accumulation adds its partial sums in fp32.
constexpr double kFp32Limit = 1e-4, kFp8WgmmaLimit = 1e-3, kBf16Limit = 8e-3;

// The format pairs the FP8 linears use: forward e4m3 x e4m3, dgrad and wgrad e5m2 (gradient) x e4m3.
TEST(GpuFp8, CublasLtFp8GemmEqualsTheDecodedProduct) {
  SKIP_WITHOUT_GPU();
  coda::CublasLt cublas;
  const std::pair<Fp8Format, Fp8Format> pairs[] = {
      {Fp8Format::E4M3, Fp8Format::E4M3}, {Fp8Format::E4M3, Fp8Format::E5M2}, {Fp8Format::E5M2, Fp8Format::E4M3}};
  for (const auto& [a_format, b_format] : pairs) {
    Fp8Product f(256, 192, 320, a_format, b_format, 9);
    coda::test::DeviceBuffer<float> d(std::vector<float>(f.expected.size(), 0.5f));  // fp32 D accumulates onto it
    coda::test::DeviceBuffer<bf16> h(f.expected.size());
    h.poison();
    cublas.gemm_fp8(d.get(), f.a.get(), a_format, f.dq_a(), f.b.get(), b_format, f.dq_b(), f.M, f.N,
                    f.K, true, nullptr);
    cublas.gemm_fp8(h.get(), f.a.get(), a_format, f.dq_a(), f.b.get(), b_format, f.dq_b(), f.M, f.N,
                    f.K, false, nullptr);
    EXPECT_LT(f.worst(d.download(), 0.5f), kFp32Limit) << f.formats();
    EXPECT_LT(f.worst(h.download(), 0.0f), kBf16Limit) << f.formats();
  }
  uint8_t* none = nullptr;
  float* dummy = nullptr;
  EXPECT_THROW(cublas.gemm_fp8(dummy, none, Fp8Format::E5M2, dummy, none, Fp8Format::E5M2, dummy, 16, 16, 16, false,
                               nullptr),
               std::invalid_argument);
  Fp8Product f(64, 64, 32, Fp8Format::E4M3, Fp8Format::E4M3, 3);
  coda::test::DeviceBuffer<bf16> out(64 * 64);
  EXPECT_THROW(cublas.gemm_fp8(out.get(), f.a.get(), Fp8Format::E4M3, f.dq_a() + 1, f.b.get(), Fp8Format::E4M3,
                               f.dq_b(), 64, 64, 32, false, nullptr),
               std::invalid_argument)
      << "a factor 4 bytes past a 16-byte boundary, which cublasLtMatmul would refuse as not supported";
}

// The hand-written GEMM's FP8 layouts (gemm_fp8) on every compiled tile against the decoded product, as
// cuBLASLt above: M, N and K tails (K not a multiple of the 128-element stage), bf16 output overwritten,
// fp32 output accumulated (the weight gradient's form).
TEST(GpuFp8, HandWrittenFp8GemmEqualsTheDecodedProduct) {
  SKIP_WITHOUT_GPU();
  using coda::GemmLayout;
  for (const auto& [M, N, K] : {std::tuple{300, 200, 272}, std::tuple{512, 768, 1024}}) {
    for (GemmLayout layout : {GemmLayout::ForwardE4m3, GemmLayout::ForwardE5m2}) {
      const Fp8Format a_format = layout == GemmLayout::ForwardE4m3 ? Fp8Format::E4M3 : Fp8Format::E5M2;
      Fp8Product f(M, N, K, a_format, Fp8Format::E4M3, 17 + M);
      for (coda::GemmTile tile : coda::gemm_tiles_compiled(layout, coda::GemmEpilogue::Bare)) {
        const std::string what = f.formats() + " " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                                 std::to_string(K) + " " + coda::gemm_tile_name(tile);
        coda::test::DeviceBuffer<bf16> h(f.expected.size());
        h.poison();
        if (layout == GemmLayout::ForwardE4m3)
          coda::gemm_fp8<GemmLayout::ForwardE4m3>(h.get(), f.a.get(), f.dq_a(), f.b.get(), f.dq_b(),
                                                  M, N, K, false, nullptr, tile);
        else
          coda::gemm_fp8<GemmLayout::ForwardE5m2>(h.get(), f.a.get(), f.dq_a(), f.b.get(), f.dq_b(),
                                                  M, N, K, false, nullptr, tile);
        EXPECT_LT(f.worst(h.download(), 0.0f), kBf16Limit) << what;
        if (layout == GemmLayout::ForwardE5m2) {
          coda::test::DeviceBuffer<float> d(std::vector<float>(f.expected.size(), 0.5f));
          coda::gemm_fp8<GemmLayout::ForwardE5m2>(d.get(), f.a.get(), f.dq_a(), f.b.get(), f.dq_b(),
                                                  M, N, K, true, nullptr, tile);
          EXPECT_LT(f.worst(d.download(), 0.5f), kFp8WgmmaLimit) << what;
        }
      }
    }
  }
  Fp8Product f(64, 64, 32, Fp8Format::E4M3, Fp8Format::E4M3, 5);
  coda::test::DeviceBuffer<bf16> out(64 * 64);
  EXPECT_THROW(coda::gemm_fp8<GemmLayout::ForwardE4m3>(out.get(), f.a.get(), nullptr, f.b.get(), nullptr, 64, 64, 32,
                                                       false, nullptr),
               std::invalid_argument)
      << "the dequantization factors are missing";
  EXPECT_THROW(coda::gemm_fp8<GemmLayout::ForwardE4m3>(out.get(), f.a.get(), f.dq_a(), f.b.get(),
                                                       f.dq_b(), 64, 64, 24, false, nullptr),
               std::invalid_argument)
      << "K = 24: rows of 24 bytes are not a multiple of 16";
}

}  // namespace
