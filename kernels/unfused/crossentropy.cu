// Softmax cross-entropy over the LM head's logits: one read of the logits forward, one read and one write
// backward (the framework chain log_softmax -> nll -> backward moves the [N, Vp] tensor twice as often).
// Forward, one block per row: every thread keeps an online (running max m, sum of exp(x - m)) pair over
// its 16-byte packets, four packets (32 values) in flight and one rescale per four packets; exponentials
// are the hardware exp2 (ex2.approx, relative error about 2^-22) on x log2e - m log2e. Only the last
// packets of a row, which may hold padded columns, pay for masking. The pairs meet through warp shuffles
// and shared memory; lse = m + log(sum) (kept for the backward), loss = lse - x[target], columns >= V excluded.
// Backward, elementwise over the whole [N, Vp] tensor: dlogit = (exp(x - lse) - [j == target]) * dloss,
// 0 in the padded columns; it may overwrite the logits in place.

#include <cmath>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda::unfused {

namespace {

constexpr int kForwardThreads = 256;
constexpr int kPacketsInFlight = 4;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Running (max, sum of exp(x - max)) of a thread's share of a row.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * exp2_approx((a.m - m) * kLog2e) + b.s * exp2_approx((b.m - m) * kLog2e)};
}

// Folds `count` values into acc with one rescale: exp(x - m) = 2^(x log2e - m log2e), one FFMA and one
// MUFU per value.
template <int kCount>
__device__ __forceinline__ void absorb(MaxSum& acc, const float (&v)[kCount]) {
  float m = acc.m;
#pragma unroll
  for (int j = 0; j < kCount; ++j) m = fmaxf(m, v[j]);
  if (m == -INFINITY) return;
  acc.s *= exp2_approx((acc.m - m) * kLog2e);
  acc.m = m;
  const float shift = m * kLog2e;
#pragma unroll
  for (int j = 0; j < kCount; ++j) acc.s += exp2_approx(fmaf(v[j], kLog2e, -shift));
}

__global__ void __launch_bounds__(kForwardThreads) crossentropy_forward_kernel(float* losses, float* lse_out,
                                                                              const bf16* logits,
                                                                              const int32_t* targets, int V, int Vp) {
  start_after_previous_kernel();
  __shared__ MaxSum warp_results[kForwardThreads / 32];
  const int n = blockIdx.x;
  const bf16* row = logits + static_cast<size_t>(n) * Vp;
  const int packets = Vp / 8, full_packets = V / 8;  // packets entirely inside the real vocabulary
  MaxSum acc{-INFINITY, 0.0f};
  int k = threadIdx.x;
  for (; k + (kPacketsInFlight - 1) * kForwardThreads < full_packets; k += kPacketsInFlight * kForwardThreads) {
    uint4 raw[kPacketsInFlight];
#pragma unroll
    for (int u = 0; u < kPacketsInFlight; ++u) raw[u] = load_packet(row + 8 * (k + u * kForwardThreads));
    float v[8 * kPacketsInFlight];
#pragma unroll
    for (int u = 0; u < kPacketsInFlight; ++u) {
      float p[8];
      unpack_bf16x8(p, raw[u]);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[8 * u + j] = p[j];
    }
    absorb(acc, v);
  }
  for (; k < packets; k += kForwardThreads) {  // the rest, padded columns masked to -inf
    float v[8];
    load_bf16x8(v, row + 8 * k);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = 8 * k + j < V ? v[j] : -INFINITY;
    absorb(acc, v);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    acc = combine(acc, {__shfl_xor_sync(0xffffffffu, acc.m, offset), __shfl_xor_sync(0xffffffffu, acc.s, offset)});
  if (threadIdx.x % 32 == 0) warp_results[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum total = warp_results[0];
    for (int w = 1; w < kForwardThreads / 32; ++w) total = combine(total, warp_results[w]);
    const float lse = total.m + logf(total.s);
    lse_out[n] = lse;
    losses[n] = lse - __bfloat162float(row[targets[n]]);
  }
}

__global__ void __launch_bounds__(256) crossentropy_backward_kernel(bf16* dlogits, const bf16* logits,
                                                                   const float* lse, const int32_t* targets,
                                                                   float dloss, int N, int V, int Vp) {
  start_after_previous_kernel();
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int packets = Vp / 8;
  if (idx >= static_cast<size_t>(N) * packets) return;
  const int n = static_cast<int>(idx / packets), col = static_cast<int>(idx % packets) * 8;
  const float row_lse = lse[n];
  const int target = targets[n];
  float v[8];
  load_bf16x8(v, logits + 8 * idx);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = col + j;
    v[j] = c < V ? (__expf(v[j] - row_lse) - (c == target ? 1.0f : 0.0f)) * dloss : 0.0f;
  }
  store_bf16x8(dlogits + 8 * idx, v);
}

}  // namespace

void crossentropy_forward(float* losses, float* lse, const bf16* logits, const int32_t* targets, int N, int V, int Vp,
                          cudaStream_t stream) {
  if (N == 0) return;
  const profile::Region region("cross-entropy forward", profile::Work::Epilogue, stream);
  launch_kernel(crossentropy_forward_kernel, after_previous(N, kForwardThreads), stream, losses, lse, logits, targets,
                V, Vp);
}

void crossentropy_backward(bf16* dlogits, const bf16* logits, const float* lse, const int32_t* targets, float dloss,
                           int N, int V, int Vp, cudaStream_t stream) {
  const size_t threads = static_cast<size_t>(N) * (Vp / 8);
  if (threads == 0) return;
  const profile::Region region("cross-entropy backward", profile::Work::Other, stream);
  launch_kernel(crossentropy_backward_kernel, after_previous(blocks_for(threads, 256), 256), stream, dlogits, logits,
                lse, targets, dloss, N, V, Vp);
}

}  // namespace coda::unfused
