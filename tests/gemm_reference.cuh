// GPU helpers shared by the GEMM tests and benchmark: random fill, a plain fp32 reference GEMM (shared-
// memory tiles, one output per thread, any operand strides) and a relative-error measure.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/common/cuda_check.cuh"
#include "kernels/gemm/gemm.cuh"

namespace coda::testing {
namespace {

__host__ __device__ inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <class T>
__global__ void fill_uniform_kernel(T* p, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(splitmix64(seed * 0x100000001B3ull + i) >> 40) * (1.0f / 16777216.0f);
    p[i] = static_cast<T>(lo + (hi - lo) * u);
  }
}

// p[0, n) = uniform in [lo, hi), a deterministic function of seed.
template <class T>
void fill_uniform(T* p, size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  fill_uniform_kernel<<<1024, 256>>>(p, n, seed, lo, hi);
  CUDA_CHECK_LAUNCH();
}

// C[m, n] = sum_k A(m, k) B(k, n) in fp32, A(m, k) = A[m * sam + k * sak], B(k, n) = B[k * sbk + n * sbn].
__global__ void reference_gemm_kernel(float* C, const __nv_bfloat16* A, long long sam, long long sak,
                                      const __nv_bfloat16* B, long long sbk, long long sbn, int M, int N, int K) {
  __shared__ float As[16][17], Bs[16][17];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int m = blockIdx.y * 16 + ty, n = blockIdx.x * 16 + tx;
  const int am = blockIdx.y * 16 + tx;  // A is loaded transposed when M is its contiguous dimension
  float acc = 0.0f;
  for (int k0 = 0; k0 < K; k0 += 16) {
    if (sak == 1) {
      As[ty][tx] = m < M && k0 + tx < K ? __bfloat162float(A[m * sam + (k0 + tx)]) : 0.0f;
    } else {
      As[tx][ty] = am < M && k0 + ty < K ? __bfloat162float(A[am * sam + (k0 + ty) * sak]) : 0.0f;
    }
    Bs[ty][tx] = k0 + ty < K && n < N ? __bfloat162float(B[(k0 + ty) * sbk + n * sbn]) : 0.0f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 16; ++k) acc += As[ty][k] * Bs[k][tx];
    __syncthreads();
  }
  if (m < M && n < N) C[static_cast<size_t>(m) * N + n] = acc;
}

// The reference of one of the three GEMM layouts of gemm.cuh (operands as gemm_forward/dgrad/wgrad take them).
void reference_gemm(GemmLayout layout, float* C, const __nv_bfloat16* A, const __nv_bfloat16* B, int M, int N, int K) {
  long long sam = K, sak = 1, sbk = 1, sbn = K;  // forward: A = X [M, K], B(k, n) = W[n, k]
  if (layout == GemmLayout::Dgrad) sbk = N, sbn = 1;                        // W [K, N]
  if (layout == GemmLayout::Wgrad) sam = 1, sak = M, sbk = N, sbn = 1;      // dY [K, M], X [K, N]
  reference_gemm_kernel<<<dim3((N + 15) / 16, (M + 15) / 16), dim3(16, 16)>>>(C, A, sam, sak, B, sbk, sbn, M, N, K);
  CUDA_CHECK_LAUNCH();
}

template <class T>
__global__ void error_kernel(const T* x, const float* ref, const float* base, size_t n, double* sums) {
  double diff = 0.0, norm = 0.0, bad = 0.0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(x[i]) - (base ? base[i] : 0.0f);
    if (!isfinite(v)) bad += 1.0;
    const double d = double(v) - ref[i];
    diff += d * d;
    norm += double(ref[i]) * ref[i];
  }
  atomicAdd(&sums[0], diff);
  atomicAdd(&sums[1], norm);
  atomicAdd(&sums[2], bad);
}

// ||(x - base) - ref|| / ||ref||, or +inf if any x is not finite (poisoned outputs are NaN).
template <class T>
double relative_error(const T* x, const float* ref, size_t n, const float* base = nullptr) {
  double* sums = nullptr;
  CUDA_CHECK(cudaMalloc(&sums, 3 * sizeof(double)));
  CUDA_CHECK(cudaMemset(sums, 0, 3 * sizeof(double)));
  error_kernel<<<512, 256>>>(x, ref, base, n, sums);
  CUDA_CHECK_LAUNCH();
  double h[3];
  CUDA_CHECK(cudaMemcpy(h, sums, sizeof(h), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(sums));
  if (h[2] > 0.0) return INFINITY;
  return std::sqrt(h[0] / (h[1] > 0.0 ? h[1] : 1.0));
}

}  // namespace
}  // namespace coda::testing
