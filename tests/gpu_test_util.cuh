// Shared helpers of the GPU tests: random bf16-exact inputs, device buffers that are poisoned (NaN) before
// a kernel writes them, and the relative-norm error against the CPU reference.
//
// Inputs are drawn as floats and rounded to bf16, so the CPU reference sees exactly the values the GPU
// sees and the remaining error is the kernel's own. A buffer filled with 0xFF bytes is NaN in both bf16
// and fp32, so an element a kernel forgets to write makes the error NaN, and NaN never passes.
#pragma once
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/common/cuda_check.cuh"
#include "src/rng.hpp"

namespace coda::test {

#define SKIP_WITHOUT_GPU() \
  if (!::coda::cuda_device_available()) GTEST_SKIP() << "no CUDA device"

// N(0, sigma) values rounded to bf16.
inline std::vector<float> random_bf16_values(size_t n, float sigma, Rng& rng) {
  std::vector<float> v(n);
  for (auto& x : v) x = __bfloat162float(__float2bfloat16(static_cast<float>(rng.normal()) * sigma));
  return v;
}

inline std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

// A device allocation of n elements of T, freed on destruction.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { CUDA_CHECK(cudaMalloc(&ptr_, n * sizeof(T))); }
  // bf16 buffers upload float values (rounded); other types upload as they are.
  explicit DeviceBuffer(const std::vector<float>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void poison() { CUDA_CHECK(cudaMemset(ptr_, 0xFF, n_ * sizeof(T))); }
  void upload(const std::vector<float>& host) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const std::vector<__nv_bfloat16> converted = to_bf16(host);
      CUDA_CHECK(cudaMemcpy(ptr_, converted.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    } else {
      static_assert(std::is_same_v<T, float>, "upload(std::vector<float>) needs a float or bf16 buffer");
      CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    }
  }
  // Synchronizes, then returns the contents as they are (FP8 codes, flags).
  std::vector<T> download_raw() const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> raw(n_);
    CUDA_CHECK(cudaMemcpy(raw.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return raw;
  }
  // Synchronizes, then returns the contents as floats.
  std::vector<float> download() const {
    const std::vector<T> raw = download_raw();
    std::vector<float> out(n_);
    for (size_t i = 0; i < n_; ++i) out[i] = static_cast<float>(raw[i]);
    return out;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// A device copy of host data of any trivially copyable type (token ids, decay flags, tables).
template <typename T>
class DeviceCopy : public DeviceBuffer<T> {
 public:
  explicit DeviceCopy(const std::vector<T>& host) : DeviceBuffer<T>(host.size()) {
    CUDA_CHECK(cudaMemcpy(this->get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
};

// An output buffer, poisoned (NaN) before the kernel writes it.
template <typename T>
class OutputBuffer : public DeviceBuffer<T> {
 public:
  explicit OutputBuffer(size_t n) : DeviceBuffer<T>(n) { this->poison(); }
};

inline float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// n values mean + scale * N(0, 1), rounded to bf16 (exact in both bf16 and fp32 buffers).
inline std::vector<float> random_values(size_t n, Rng& rng, float scale = 1.0f, float mean = 0.0f) {
  std::vector<float> v = random_bf16_values(n, scale, rng);
  for (auto& x : v) x = round_bf16(x + mean);
  return v;
}

// n ids uniform in [0, below).
inline std::vector<int32_t> random_ids(size_t n, int below, Rng& rng) {
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng.below(below));
  return ids;
}

// ||gpu - ref|| / ||ref|| over columns [col0, col0 + ncols) of rows of `width` elements (all columns by
// default). Where the reference is exactly zero, the RMS of gpu. NaN anywhere gives NaN.
inline double rel_error(const std::vector<float>& gpu, const std::vector<float>& ref, size_t width = 0,
                        size_t col0 = 0, size_t ncols = 0) {
  if (width == 0) width = ref.size(), ncols = ref.size();
  double diff = 0, norm = 0;
  size_t count = 0;
  for (size_t row = 0; row < ref.size() / width; ++row)
    for (size_t c = col0; c < col0 + ncols; ++c, ++count) {
      const double g = gpu[row * width + c], r = ref[row * width + c];
      diff += (g - r) * (g - r);
      norm += r * r;
    }
  return std::sqrt(diff / (norm > 0 ? norm : static_cast<double>(count)));
}

// rel_error limits of a kernel against the fp32 CPU reference: outputs stored in bf16 (about 2^-8 per
// value, with room for the inputs' own rounding), and fp32 outputs (reduction order only).
constexpr double kBf16Tol = 1e-2;
constexpr double kFp32Tol = 1e-4;

}  // namespace coda::test
