// The FP8 quantize kernels (kernels/unfused/fp8.cu) against the host codec (src/fp8.hpp, itself checked
// against CUDA's host conversions): every byte equal, flat and transposed, both formats, on random bf16 data
// over many binades with a scale that pushes the largest values past the format's range (saturation), a
// tail shape that is not a multiple of the 64 x 64 tile, and the amax equal to the host's max |x| (NaN in,
// NaN out). cuBLASLt's FP8 GEMM (CublasLt::gemm_fp8) against the host product of the decoded operands with
// their dequantization factors, for e4m3 x e4m3 and e4m3 x e5m2, bf16 and accumulated fp32 outputs. The
// device's delayed scaling against the host's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/common/cuda_check.cuh"
#include "kernels/gemm/cublaslt.cuh"
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

// Delayed scaling on the device, three tensors over six steps, against the host's Fp8DelayedScale: the
// same scales bit for bit; a NaN amax of tensor 1 at step 3 leaves its scale and names it in *bad.
TEST(GpuFp8, UpdateScalesFollowsTheHostDelayedScale) {
  SKIP_WITHOUT_GPU();
  const int count = 3, history = 4, margin = 1, steps = 6;
  const float amax[steps][count] = {{2.0f, 0.5f, 0.0f}, {8.0f, 0.25f, 0.0f}, {1.0f, 3.0f, 7.0f},
                                    {0.5f, NAN, 1.0f},  {0.1f, 0.1f, 0.1f},  {0.2f, 0.3f, 0.4f}};
  std::vector<coda::Fp8DelayedScale> host(count, coda::Fp8DelayedScale(Fp8Format::E4M3, history, margin));
  float *scale = nullptr, *dequant = nullptr, *ring = nullptr, *damax = nullptr;
  unsigned int* bad = nullptr;
  CUDA_CHECK(cudaMalloc(&scale, count * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&dequant, count * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&ring, count * history * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&damax, count * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&bad, sizeof(unsigned int)));
  const std::vector<float> ones(count, 1.0f);
  CUDA_CHECK(cudaMemcpy(scale, ones.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dequant, ones.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(ring, 0, count * history * sizeof(float)));
  for (int step = 0; step < steps; ++step) {
    CUDA_CHECK(cudaMemset(bad, 0, sizeof(unsigned int)));
    CUDA_CHECK(cudaMemcpy(damax, amax[step], count * sizeof(float), cudaMemcpyHostToDevice));
    coda::unfused::fp8_update_scales(scale, dequant, ring, damax, count, history, step, margin, Fp8Format::E4M3, bad,
                                     nullptr);
    float got[count], got_dequant[count], left[count];
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
      EXPECT_EQ(got_dequant[t], 1.0f / host[t].scale()) << "step " << step << " tensor " << t;
      EXPECT_EQ(left[t], 0.0f) << "the update zeroes the amax for the next step's quantize calls";
    }
    EXPECT_EQ(flagged, expected_flag) << "step " << step;
  }
  for (void* p : {static_cast<void*>(scale), static_cast<void*>(dequant), static_cast<void*>(ring),
                  static_cast<void*>(damax), static_cast<void*>(bad)})
    CUDA_CHECK(cudaFree(p));
}

TEST(GpuFp8, CublasLtFp8GemmEqualsTheDecodedProduct) {
  SKIP_WITHOUT_GPU();
  const int M = 256, N = 192, K = 320;
  coda::Rng rng(9);
  auto codes = [&](size_t n, Fp8Format format) {
    std::vector<uint8_t> q(n);
    for (auto& c : q) c = coda::fp8_encode(static_cast<float>(rng.normal()) * 0.3f * coda::fp8_largest(format), format);
    return q;
  };
  coda::CublasLt cublas;
  // The format pairs the FP8 linears use: forward e4m3 x e4m3, dgrad and wgrad e5m2 (gradient) x e4m3.
  const std::pair<Fp8Format, Fp8Format> pairs[] = {
      {Fp8Format::E4M3, Fp8Format::E4M3}, {Fp8Format::E4M3, Fp8Format::E5M2}, {Fp8Format::E5M2, Fp8Format::E4M3}};
  for (const auto& [a_format, b_format] : pairs) {
    const std::string formats = std::string(coda::fp8_format_name(a_format)) + " x " + coda::fp8_format_name(b_format);
    const std::vector<uint8_t> a = codes(static_cast<size_t>(M) * K, a_format), b = codes(static_cast<size_t>(N) * K, b_format);
    const float dequant[2] = {1.0f / 300.0f, 1.0f / 7000.0f};
    std::vector<double> expected(static_cast<size_t>(M) * N), magnitude(expected.size());
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) {
          const double term = static_cast<double>(coda::fp8_decode(a[m * K + k], a_format)) *
                              coda::fp8_decode(b[n * K + k], b_format) * dequant[0] * dequant[1];
          expected[m * N + n] += term;
          magnitude[m * N + n] += std::fabs(term);
        }
    uint8_t *da = nullptr, *db = nullptr;
    float *dd = nullptr, *dscale = nullptr;
    bf16* dh = nullptr;
    CUDA_CHECK(cudaMalloc(&da, a.size()));
    CUDA_CHECK(cudaMalloc(&db, b.size()));
    CUDA_CHECK(cudaMalloc(&dd, expected.size() * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&dh, expected.size() * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dscale, 2 * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(da, a.data(), a.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db, b.data(), b.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dscale, dequant, sizeof(dequant), cudaMemcpyHostToDevice));
    const std::vector<float> start(expected.size(), 0.5f);  // fp32 D accumulates onto it
    CUDA_CHECK(cudaMemcpy(dd, start.data(), start.size() * sizeof(float), cudaMemcpyHostToDevice));
    cublas.gemm_fp8(dd, da, a_format, dscale, db, b_format, dscale + 1, M, N, K, true, nullptr);
    cublas.gemm_fp8(dh, da, a_format, dscale, db, b_format, dscale + 1, M, N, K, false, nullptr);
    std::vector<float> d(expected.size());
    std::vector<bf16> h(expected.size());
    CUDA_CHECK(cudaMemcpy(d.data(), dd, d.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h.data(), dh, h.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    double worst_fp32 = 0.0, worst_bf16 = 0.0;
    for (size_t i = 0; i < expected.size(); ++i) {
      worst_fp32 = std::fmax(worst_fp32, std::fabs(d[i] - 0.5 - expected[i]) / (magnitude[i] + 1e-30));
      worst_bf16 = std::fmax(worst_bf16, std::fabs(__bfloat162float(h[i]) - expected[i]) / (magnitude[i] + 1e-30));
    }
    EXPECT_LT(worst_fp32, 1e-4) << formats;  // fp32 accumulation, relative to sum |terms|
    EXPECT_LT(worst_bf16, 8e-3) << formats;  // plus bf16's rounding of the output
    for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(dd), static_cast<void*>(dh),
                    static_cast<void*>(dscale)})
      CUDA_CHECK(cudaFree(p));
  }
  uint8_t* none = nullptr;
  float* dummy = nullptr;
  EXPECT_THROW(cublas.gemm_fp8(dummy, none, Fp8Format::E5M2, dummy, none, Fp8Format::E5M2, dummy, 16, 16, 16, false,
                               nullptr),
               std::invalid_argument);
}

}  // namespace
