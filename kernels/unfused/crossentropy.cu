// Softmax cross-entropy over the LM head's logits: one read of the logits forward, one read and one write
// backward (the framework chain log_softmax -> nll -> backward moves the [N, Vp] tensor twice as often).
//
// Forward, one block per row: every thread keeps an online (running max m, sum of exp(x - m)) pair over
// its 16-byte packets, rescaling once per packet; the pairs meet through warp shuffles and shared memory.
// lse = m + log(sum), loss = lse - x[target]. lse is kept for the backward. Padded columns (>= V) are
// excluded.
// Backward, elementwise over the whole [N, Vp] tensor: dlogit = (exp(x - lse) - [j == target]) * dloss,
// 0 in the padded columns; it may overwrite the logits in place.
#include <cmath>

#include "kernels/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "kernels/unfused/vec.cuh"

namespace coda::unfused {

namespace {

constexpr int kForwardThreads = 256;

struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__global__ void __launch_bounds__(kForwardThreads) crossentropy_forward_kernel(float* losses, float* lse_out,
                                                                              const bf16* logits,
                                                                              const int32_t* targets, int V, int Vp) {
  __shared__ MaxSum warp_results[kForwardThreads / 32];
  const int n = blockIdx.x;
  const bf16* row = logits + static_cast<size_t>(n) * Vp;
  const int packets = Vp / 8;
  MaxSum acc{-INFINITY, 0.0f};
  auto absorb = [&](const float (&v)[8], int col) {
    float packet_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) packet_max = col + j < V ? fmaxf(packet_max, v[j]) : packet_max;
    if (packet_max == -INFINITY) return;
    if (packet_max > acc.m) {
      acc.s *= __expf(acc.m - packet_max);
      acc.m = packet_max;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) acc.s += col + j < V ? __expf(v[j] - acc.m) : 0.0f;
  };
  int k = threadIdx.x;
  for (; k + 3 * kForwardThreads < packets; k += 4 * kForwardThreads) {
    float v[4][8];
#pragma unroll
    for (int u = 0; u < 4; ++u) load_bf16x8(v[u], row + 8 * (k + u * kForwardThreads));
#pragma unroll
    for (int u = 0; u < 4; ++u) absorb(v[u], 8 * (k + u * kForwardThreads));
  }
  for (; k < packets; k += kForwardThreads) {
    float v[8];
    load_bf16x8(v, row + 8 * k);
    absorb(v, 8 * k);
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
  crossentropy_forward_kernel<<<N, kForwardThreads, 0, stream>>>(losses, lse, logits, targets, V, Vp);
  CUDA_CHECK_LAUNCH();
}

void crossentropy_backward(bf16* dlogits, const bf16* logits, const float* lse, const int32_t* targets, float dloss,
                           int N, int V, int Vp, cudaStream_t stream) {
  const size_t threads = static_cast<size_t>(N) * (Vp / 8);
  if (threads == 0) return;
  crossentropy_backward_kernel<<<blocks_for(threads, 256), 256, 0, stream>>>(dlogits, logits, lse, targets, dloss, N,
                                                                             V, Vp);
  CUDA_CHECK_LAUNCH();
}

}  // namespace coda::unfused
