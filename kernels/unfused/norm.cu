// LayerNorm (GPT-2) and RMSNorm (Llama), forward and backward: one template serves both, `kLayerNorm`
// switches the mean subtraction and the bias.
//
// Forward, per row of C: mu = mean(x) (LayerNorm only, else 0), r = 1/sqrt(mean((x - mu)^2) + eps),
// y = (x - mu) r w (+ b). One warp owns a row and keeps it in registers (kChunks 16-byte packets per lane,
// C <= 256 kChunks), so x is read once; the variance is taken around the mean (two register passes),
// which is exact where E[x^2] - mu^2 would cancel.
//
// Backward, with xhat = (x - mu) r and g = dy w:
//   dx = r (g - mean(g) - xhat mean(g xhat))      (RMSNorm: no mean(g) term)
//   dw = sum over rows of dy xhat,  db = sum over rows of dy.
// dx is added to the residual gradient in the same pass (read dx, add, write), the accumulation a
// framework does in a separate add. A warp owns a row at a time, holding dy and x packed in registers;
// each warp accumulates its dw/db in its own slice of shared memory (no atomics: a lane owns its columns).
// At the end the block sums its warps' slices and writes one partial row per block, and one column_sum
// launch finishes dw (and db) over the blocks in a fixed order (deterministic). The grid fills the
// device once, so the partials are a few hundred rows (about 1% of the bytes of the main pass).
// Forward, a persistent grid whose warps prefetch their next row while reducing the current one;
// backward, all three input rows (dy, x, the residual gradient) are requested before the reductions:
// latency hiding by bytes in flight.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "kernels/unfused/vec.cuh"

namespace coda::unfused {

namespace {

constexpr int kMaxBackwardBlocks = 1024;
constexpr int kForwardWarps = 8;
constexpr int kBackwardWarps = 4;
constexpr size_t kBackwardSmemBudget = 96 * 1024;

// A persistent grid (as many blocks as fit, no waves): each warp walks rows warp, warp + all warps, ...,
// and requests the packets of its next row before it reduces the current one.
template <int kChunks, bool kLayerNorm>
__global__ void __launch_bounds__(kForwardWarps * 32) norm_forward_kernel(bf16* y, float* mean_out, float* rstd_out,
                                                                          const bf16* x, const bf16* w, const bf16* b,
                                                                          int N, int C, float eps) {
  const int lane = threadIdx.x % 32, all_warps = gridDim.x * kForwardWarps;
  const int chunks = C / 8;
  const auto load_row = [&](uint4 (&raw)[kChunks], int row) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (row < N && k < chunks) raw[i] = load_packet(x + static_cast<size_t>(row) * C + 8 * k);
    }
  };
  int row = blockIdx.x * kForwardWarps + threadIdx.x / 32;
  uint4 next[kChunks];
  load_row(next, row);
  for (; row < N; row += all_warps) {
    uint4 raw[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) raw[i] = next[i];
    load_row(next, row + all_warps);
    // Calls f(value) for each of this lane's values of the row, in a fixed order.
    const auto for_each_value = [&](auto&& f) {
#pragma unroll
      for (int i = 0; i < kChunks; ++i)
        if (lane + 32 * i < chunks) {
          float v[8];
          unpack_bf16x8(v, raw[i]);
#pragma unroll
          for (int j = 0; j < 8; ++j) f(v[j]);
        }
    };
    float sum = 0.0f;
    for_each_value([&](float v) { sum += v; });
    const float mean = kLayerNorm ? warp_sum(sum) / C : 0.0f;
    float sumsq = 0.0f;
    for_each_value([&](float v) { sumsq += (v - mean) * (v - mean); });
    const float rstd = rsqrtf(warp_sum(sumsq) / C + eps);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (k >= chunks) continue;
      float v[8], wv[8], bv[8];
      unpack_bf16x8(v, raw[i]);
      load_bf16x8(wv, w + 8 * k);
      if (kLayerNorm) load_bf16x8(bv, b + 8 * k);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = (v[j] - mean) * rstd * wv[j] + (kLayerNorm ? bv[j] : 0.0f);
      store_bf16x8(y + static_cast<size_t>(row) * C + 8 * k, v);
    }
    if (lane == 0) {
      if (kLayerNorm) mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// partials: [kStats][gridDim.x][C] (dw partials, then db partials).
template <int kChunks, bool kLayerNorm>
__global__ void __launch_bounds__(kBackwardWarps * 32) norm_backward_kernel(bf16* dx, float* partials, const bf16* dy,
                                                                            const bf16* x, const bf16* w,
                                                                            const float* mean, const float* rstd,
                                                                            int N, int C, int rows_per_block,
                                                                            bool accumulate) {
  constexpr int kStats = kLayerNorm ? 2 : 1;
  extern __shared__ __align__(16) float stats[];  // [warps][kStats][C]
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunks = C / 8;
  for (int i = threadIdx.x; i < warps * kStats * C; i += blockDim.x) stats[i] = 0.0f;
  __syncthreads();
  float* dw_acc = stats + static_cast<size_t>(warp) * kStats * C;
  float* db_acc = dw_acc + C;

  const int row_end = min(N, (blockIdx.x + 1) * rows_per_block);
  for (int row = blockIdx.x * rows_per_block + warp; row < row_end; row += warps) {
    const size_t base = static_cast<size_t>(row) * C;
    // Every load of the row (dy, x, and the residual gradient it adds to) is issued up front.
    uint4 dy_raw[kChunks], x_raw[kChunks], dx_raw[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (k < chunks) {
        dy_raw[i] = load_packet(dy + base + 8 * k);
        x_raw[i] = load_packet(x + base + 8 * k);
        if (accumulate) dx_raw[i] = load_packet(dx + base + 8 * k);
      }
    }
    const float mu = kLayerNorm ? mean[row] : 0.0f, r = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (k < chunks) {
        float dyv[8], xv[8], wv[8];
        unpack_bf16x8(dyv, dy_raw[i]);
        unpack_bf16x8(xv, x_raw[i]);
        load_bf16x8(wv, w + 8 * k);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float g = dyv[j] * wv[j];
          sum_g += g;
          sum_gx += g * (xv[j] - mu) * r;
        }
      }
    }
    const float mean_g = kLayerNorm ? warp_sum(sum_g) / C : 0.0f;
    const float mean_gx = warp_sum(sum_gx) / C;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (k < chunks) {
        float dyv[8], xv[8], wv[8], out[8], dw[8], db[8];
        unpack_bf16x8(dyv, dy_raw[i]);
        unpack_bf16x8(xv, x_raw[i]);
        load_bf16x8(wv, w + 8 * k);
        if (accumulate) unpack_bf16x8(out, dx_raw[i]);
        load_f32x8(dw, dw_acc + 8 * k);
        if (kLayerNorm) load_f32x8(db, db_acc + 8 * k);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xhat = (xv[j] - mu) * r;
          const float d = r * (dyv[j] * wv[j] - mean_g - xhat * mean_gx);
          out[j] = accumulate ? out[j] + d : d;
          dw[j] += dyv[j] * xhat;
          if (kLayerNorm) db[j] += dyv[j];
        }
        store_f32x8(dw_acc + 8 * k, dw);
        if (kLayerNorm) store_f32x8(db_acc + 8 * k, db);
        store_bf16x8(dx + base + 8 * k, out);
      }
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kStats * C; c += blockDim.x) {
    float sum = 0.0f;
    for (int w_ = 0; w_ < warps; ++w_) sum += stats[static_cast<size_t>(w_) * kStats * C + c];
    const int stat = c / C, col = c % C;
    partials[(static_cast<size_t>(stat) * gridDim.x + blockIdx.x) * C + col] = sum;
  }
}

template <bool kLayerNorm>
void launch_forward(bf16* y, float* mean, float* rstd, const bf16* x, const bf16* w, const bf16* b, int N, int C,
                    float eps, cudaStream_t stream) {
  dispatch_chunks(C, kLayerNorm ? "layernorm_forward" : "rmsnorm_forward", [&](auto chunks) {
    auto kernel = norm_forward_kernel<decltype(chunks)::value, kLayerNorm>;
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kForwardWarps * 32, 0));
    const int blocks = static_cast<int>(std::min<size_t>(static_cast<size_t>(std::max(1, per_sm)) * sm_count(),
                                                         blocks_for(N, kForwardWarps)));
    if (blocks == 0) return;
    kernel<<<blocks, kForwardWarps * 32, 0, stream>>>(y, mean, rstd, x, w, b, N, C, eps);
    CUDA_CHECK_LAUNCH();
  });
}

// The grid fills the device once (as many blocks as fit per multiprocessor, given the registers the row
// data takes), so the per-block dw/db partials stay a few hundred rows.
template <bool kLayerNorm>
void launch_backward(bf16* dx, float* dw, float* db, const bf16* dy, const bf16* x, const bf16* w, const float* mean,
                     const float* rstd, int N, int C, bool accumulate, float* partials, const ColumnSumWorkspace& ws,
                     cudaStream_t stream) {
  constexpr int kStats = kLayerNorm ? 2 : 1;
  const size_t row_bytes = static_cast<size_t>(kStats) * C * sizeof(float);
  const int warps =
      static_cast<int>(std::max<size_t>(1, std::min<size_t>(kBackwardWarps, kBackwardSmemBudget / row_bytes)));
  const size_t smem = warps * row_bytes;
  int blocks = 0;
  dispatch_chunks(C, kLayerNorm ? "layernorm_backward" : "rmsnorm_backward", [&](auto chunks) {
    auto kernel = norm_backward_kernel<decltype(chunks)::value, kLayerNorm>;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps * 32, smem));
    blocks = std::max(1, std::min({std::max(1, per_sm) * sm_count(), (N + warps - 1) / warps, kMaxBackwardBlocks}));
    const int rows_per_block = (N + blocks - 1) / blocks;
    kernel<<<blocks, warps * 32, smem, stream>>>(dx, partials, dy, x, w, mean, rstd, N, C, rows_per_block, accumulate);
    CUDA_CHECK_LAUNCH();
  });
  if (kLayerNorm)
    column_sum2(dw, partials, db, partials + static_cast<size_t>(blocks) * C, blocks, C, C, ws, stream);
  else
    column_sum(dw, partials, blocks, C, C, ws, stream);
}

}  // namespace

size_t norm_backward_partials_floats(int C) { return static_cast<size_t>(2) * kMaxBackwardBlocks * C; }

void layernorm_forward(bf16* y, float* mean, float* rstd, const bf16* x, const bf16* w, const bf16* b, int N, int C,
                       float eps, cudaStream_t stream) {
  launch_forward<true>(y, mean, rstd, x, w, b, N, C, eps, stream);
}

void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* w, int N, int C, float eps, cudaStream_t stream) {
  launch_forward<false>(y, nullptr, rstd, x, w, nullptr, N, C, eps, stream);
}

void layernorm_backward(bf16* dx, float* dw, float* db, const bf16* dy, const bf16* x, const bf16* w,
                        const float* mean, const float* rstd, int N, int C, bool accumulate, float* partials,
                        const ColumnSumWorkspace& ws, cudaStream_t stream) {
  launch_backward<true>(dx, dw, db, dy, x, w, mean, rstd, N, C, accumulate, partials, ws, stream);
}

void rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w, const float* rstd, int N,
                      int C, bool accumulate, float* partials, const ColumnSumWorkspace& ws, cudaStream_t stream) {
  launch_backward<false>(dx, dw, nullptr, dy, x, w, nullptr, rstd, N, C, accumulate, partials, ws, stream);
}

}  // namespace coda::unfused
