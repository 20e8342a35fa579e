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
// At the end the block sums its warps' slices and writes one partial row per block, and column_sum
// finishes dw/db over the blocks in a fixed order (deterministic). The grid is two blocks per
// multiprocessor, so the partials are a few hundred rows (about 1% of the bytes of the main pass).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "kernels/unfused/vec.cuh"

namespace coda::unfused {

namespace {

constexpr int kMaxC = 4096;
constexpr int kMaxBackwardBlocks = 1024;
constexpr int kForwardWarps = 8;
constexpr size_t kBackwardSmemBudget = 96 * 1024;

template <int kChunks, bool kLayerNorm>
__global__ void __launch_bounds__(kForwardWarps * 32) norm_forward_kernel(bf16* y, float* mean_out, float* rstd_out,
                                                                          const bf16* x, const bf16* w, const bf16* b,
                                                                          int N, int C, float eps) {
  const int row = blockIdx.x * kForwardWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const int chunks = C / 8;
  const bf16* xr = x + static_cast<size_t>(row) * C;
  float v[kChunks][8];
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int k = lane + 32 * i;
    if (k < chunks) {
      load_bf16x8(v[i], xr + 8 * k);
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += v[i][j];
    }
  }
  const float mean = kLayerNorm ? warp_sum(sum) / C : 0.0f;
  float sumsq = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
    if (lane + 32 * i < chunks)
#pragma unroll
      for (int j = 0; j < 8; ++j) sumsq += (v[i][j] - mean) * (v[i][j] - mean);
  const float rstd = rsqrtf(warp_sum(sumsq) / C + eps);
  bf16* yr = y + static_cast<size_t>(row) * C;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int k = lane + 32 * i;
    if (k < chunks) {
      float wv[8], bv[8], out[8];
      load_bf16x8(wv, w + 8 * k);
      if (kLayerNorm) load_bf16x8(bv, b + 8 * k);
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = (v[i][j] - mean) * rstd * wv[j] + (kLayerNorm ? bv[j] : 0.0f);
      store_bf16x8(yr + 8 * k, out);
    }
  }
  if (lane == 0) {
    if (kLayerNorm) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

__device__ __forceinline__ void unpack_bf16x8(float (&out)[8], const uint4& raw) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// partials: [kStats][gridDim.x][C] (dw partials, then db partials).
template <int kChunks, bool kLayerNorm>
__global__ void __launch_bounds__(256) norm_backward_kernel(bf16* dx, float* partials, const bf16* dy, const bf16* x,
                                                            const bf16* w, const float* mean, const float* rstd,
                                                            int N, int C, int rows_per_block, bool accumulate) {
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
    uint4 dy_raw[kChunks], x_raw[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (k < chunks) {
        dy_raw[i] = *reinterpret_cast<const uint4*>(dy + base + 8 * k);
        x_raw[i] = *reinterpret_cast<const uint4*>(x + base + 8 * k);
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
        float dyv[8], xv[8], wv[8], out[8];
        unpack_bf16x8(dyv, dy_raw[i]);
        unpack_bf16x8(xv, x_raw[i]);
        load_bf16x8(wv, w + 8 * k);
        if (accumulate) load_bf16x8(out, dx + base + 8 * k);
        float dw[8], db[8];
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

// Calls f(std::integral_constant<int, kChunks>) with the smallest supported kChunks that covers C.
template <typename F>
void dispatch_chunks(int C, const char* what, F&& f) {
  if (C % 8 != 0 || C < 8 || C > kMaxC)
    throw std::invalid_argument(std::string(what) + ": C = " + std::to_string(C) +
                                " must be a multiple of 8 in [8, 4096]");
  const int needed = (C / 8 + 31) / 32;
  if (needed <= 1) return f(std::integral_constant<int, 1>{});
  if (needed <= 2) return f(std::integral_constant<int, 2>{});
  if (needed <= 3) return f(std::integral_constant<int, 3>{});
  if (needed <= 4) return f(std::integral_constant<int, 4>{});
  if (needed <= 8) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 16>{});
}

template <bool kLayerNorm>
void launch_forward(bf16* y, float* mean, float* rstd, const bf16* x, const bf16* w, const bf16* b, int N, int C,
                    float eps, cudaStream_t stream) {
  dispatch_chunks(C, kLayerNorm ? "layernorm_forward" : "rmsnorm_forward", [&](auto chunks) {
    norm_forward_kernel<decltype(chunks)::value, kLayerNorm>
        <<<blocks_for(N, kForwardWarps), kForwardWarps * 32, 0, stream>>>(y, mean, rstd, x, w, b, N, C, eps);
    CUDA_CHECK_LAUNCH();
  });
}

template <bool kLayerNorm>
void launch_backward(bf16* dx, float* dw, float* db, const bf16* dy, const bf16* x, const bf16* w, const float* mean,
                     const float* rstd, int N, int C, bool accumulate, float* partials, const ColumnSumWorkspace& ws,
                     cudaStream_t stream) {
  constexpr int kStats = kLayerNorm ? 2 : 1;
  const size_t row_bytes = static_cast<size_t>(kStats) * C * sizeof(float);
  const int warps = static_cast<int>(std::max<size_t>(1, std::min<size_t>(8, kBackwardSmemBudget / row_bytes)));
  const size_t smem = warps * row_bytes;
  const int blocks = std::max(1, std::min({2 * sm_count(), (N + warps - 1) / warps, kMaxBackwardBlocks}));
  const int rows_per_block = (N + blocks - 1) / blocks;
  dispatch_chunks(C, kLayerNorm ? "layernorm_backward" : "rmsnorm_backward", [&](auto chunks) {
    auto kernel = norm_backward_kernel<decltype(chunks)::value, kLayerNorm>;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<blocks, warps * 32, smem, stream>>>(dx, partials, dy, x, w, mean, rstd, N, C, rows_per_block, accumulate);
    CUDA_CHECK_LAUNCH();
  });
  column_sum(dw, partials, blocks, C, C, ws, stream);
  if (kLayerNorm) column_sum(db, partials + static_cast<size_t>(blocks) * C, blocks, C, C, ws, stream);
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
