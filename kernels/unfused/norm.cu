// LayerNorm (GPT-2) and RMSNorm (Llama), forward and backward: one template serves both, `kLayerNorm`
// switches the mean subtraction and the bias.
//
// Forward, per row of C: mu = mean(x) (LayerNorm only, else 0), r = 1/sqrt(mean((x - mu)^2) + eps),
// y = (x - mu) r w (+ b). One warp owns a row and keeps it in registers (kChunks 16-byte packets per lane,
// C <= 256 kChunks), so x is read once; the variance is taken around the mean (two register passes),
// which is exact where E[x^2] - mu^2 would cancel. The grid is persistent and each warp prefetches its
// next row while it reduces the current one.
//
// Backward, with xhat = (x - mu) r and g = dy w:
//   dx = r (g - mean(g) - xhat mean(g xhat))      (RMSNorm: no mean(g) term)
//   dw = sum over rows of dy xhat,  db = sum over rows of dy.
// dx is added to the residual gradient in the same pass (read dx, add, write), the accumulation a
// framework does in a separate add. Here a row is spread over a row group of C/8 threads (rounded up to
// whole warps), one 16-byte packet of dy, x and the residual gradient per thread, so a thread's state is
// small: it prefetches its packets of the next row while the current row's two sums meet in shared
// memory, and it accumulates dw/db for its own 8 columns in registers. A block holds several row groups
// and walks rows with a persistent stride; at the end it writes one partial row of dw (and db), and one
// column_sum launch finishes them over the blocks in a fixed order (deterministic). The grid fills the
// device once, so the partials are about a hundred rows (well under 1% of the bytes of the main pass).
// Measured against the warp-per-row backward with every row's loads issued up front: 69.7 -> 72% (GPT-2)
// and 70.1 -> 77% (Llama) of 4.2 TB/s; shared-memory (cp.async) row pipelines were slower than both.
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
constexpr int kBackwardThreads = 512;  // at most, per block: as many row groups as fit

// A persistent grid (as many blocks as fit, no waves): each warp walks rows warp, warp + all warps, ...,
// and requests the packets of its next row before it reduces the current one. Rows of 1025..2048 values
// (kChunks 8) also keep w (and b) in registers instead of reloading them from L1 for every row: measured on
// Llama's 2048-wide rows, 79% -> 85% of 4.2 TB/s; at 768 it does not help, and at kChunks 16 it would spill.
template <int kChunks, bool kLayerNorm>
__global__ void __launch_bounds__(kForwardWarps * 32) norm_forward_kernel(bf16* y, float* mean_out, float* rstd_out,
                                                                          const bf16* x, const bf16* w, const bf16* b,
                                                                          int N, int C, float eps) {
  constexpr bool kHoist = kChunks == 8;
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
  uint4 w_raw[kChunks], b_raw[kChunks];
  if (kHoist)
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      if (lane + 32 * i < chunks) {
        w_raw[i] = load_packet(w + 8 * (lane + 32 * i));
        if (kLayerNorm) b_raw[i] = load_packet(b + 8 * (lane + 32 * i));
      }
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
      if (kHoist) {
        unpack_bf16x8(wv, w_raw[i]);
        if (kLayerNorm) unpack_bf16x8(bv, b_raw[i]);
      } else {
        load_bf16x8(wv, w + 8 * k);
        if (kLayerNorm) load_bf16x8(bv, b + 8 * k);
      }
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

// One row's inputs for one thread of its row group: its packet of dy, x and the residual gradient, and
// the row's statistics.
struct RowPacket {
  uint4 dy, x, dres;
  float mu, r;
};

// Row group g of a block holds rows blockIdx.x * groups + g + k * (all groups), k = 0, 1, ...; thread t of
// the group owns packet t (columns 8t .. 8t + 7). partials: [kStats][gridDim.x][C].
template <bool kLayerNorm>
__global__ void __launch_bounds__(kBackwardThreads) norm_backward_kernel(bf16* dx, float* partials, const bf16* dy,
                                                                         const bf16* x, const bf16* w,
                                                                         const float* mean, const float* rstd, int N,
                                                                         int C, int group_threads, bool accumulate) {
  constexpr int kStats = kLayerNorm ? 2 : 1;
  __shared__ float2 warp_sums[2][kBackwardThreads / 32];                     // by round parity
  __shared__ __align__(16) float column_sums[kStats * kBackwardThreads * 8];  // [kStats][groups][C]
  const int groups = blockDim.x / group_threads, group = threadIdx.x / group_threads, t = threadIdx.x % group_threads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps_per_group = group_threads / 32;
  const int all_groups = gridDim.x * groups;
  const bool active = t < C / 8;
  const float inv_c = 1.0f / C;
  const auto load_row = [&](RowPacket& p, int row) {
    if (row < N && active) {
      const size_t offset = static_cast<size_t>(row) * C + 8 * t;
      p.dy = load_packet(dy + offset);
      p.x = load_packet(x + offset);
      if (accumulate) p.dres = load_packet(dx + offset);
      p.mu = kLayerNorm ? mean[row] : 0.0f;
      p.r = rstd[row];
    }
  };
  uint4 w_raw = make_uint4(0u, 0u, 0u, 0u);
  if (active) w_raw = load_packet(w + 8 * t);
  float dw[8], db[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) dw[j] = db[j] = 0.0f;
  RowPacket next;
  load_row(next, blockIdx.x * groups + group);
  // Every thread of the block takes the same number of rounds (a row past N is skipped, not left), since
  // each round has a __syncthreads. The sums of round k go to buffer k % 2: it is rewritten two rounds
  // later, after the barrier of round k + 1, by which time every thread has read it.
  for (int base = blockIdx.x * groups, parity = 0; base < N; base += all_groups, parity ^= 1) {
    const int row = base + group;
    const bool valid = row < N && active;
    const RowPacket cur = next;
    load_row(next, row + all_groups);
    // Calls f(j, dy_j, xhat_j, g_j) for this thread's 8 values of the row.
    const auto for_each_value = [&](auto&& f) {
      float dyv[8], xv[8], wv[8];
      unpack_bf16x8(dyv, cur.dy);
      unpack_bf16x8(xv, cur.x);
      unpack_bf16x8(wv, w_raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) f(j, dyv[j], (xv[j] - cur.mu) * cur.r, dyv[j] * wv[j]);
    };
    float sum_g = 0.0f, sum_gx = 0.0f;
    if (valid)
      for_each_value([&](int, float, float xhat, float g) {
        sum_g += g;
        sum_gx += g * xhat;
      });
    sum_g = warp_sum(sum_g);
    sum_gx = warp_sum(sum_gx);
    if (lane == 0) warp_sums[parity][warp] = make_float2(sum_g, sum_gx);
    __syncthreads();
    if (!valid) continue;
    float total_g = 0.0f, total_gx = 0.0f;
    for (int i = 0; i < warps_per_group; ++i) {
      const float2 v = warp_sums[parity][group * warps_per_group + i];
      total_g += v.x, total_gx += v.y;
    }
    const float mean_g = kLayerNorm ? total_g * inv_c : 0.0f, mean_gx = total_gx * inv_c;
    float out[8];
    if (accumulate) unpack_bf16x8(out, cur.dres);
    for_each_value([&](int j, float dyv, float xhat, float g) {
      const float d = cur.r * (g - mean_g - xhat * mean_gx);
      out[j] = accumulate ? out[j] + d : d;
      dw[j] += dyv * xhat;
      if (kLayerNorm) db[j] += dyv;
    });
    store_bf16x8(dx + static_cast<size_t>(row) * C + 8 * t, out);
  }
  if (active) {
    store_f32x8(column_sums + static_cast<size_t>(group) * C + 8 * t, dw);
    if (kLayerNorm) store_f32x8(column_sums + static_cast<size_t>(groups + group) * C + 8 * t, db);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kStats * C; c += blockDim.x) {
    const int stat = c / C, col = c % C;
    float sum = 0.0f;
    for (int g = 0; g < groups; ++g) sum += column_sums[static_cast<size_t>(stat * groups + g) * C + col];
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

// As many blocks as fit on the device at once, each with as many row groups as fit in kBackwardThreads.
template <bool kLayerNorm>
void launch_backward(bf16* dx, float* dw, float* db, const bf16* dy, const bf16* x, const bf16* w, const float* mean,
                     const float* rstd, int N, int C, bool accumulate, float* partials, const ColumnSumWorkspace& ws,
                     cudaStream_t stream) {
  if (C % 8 != 0 || C < 8 || C > 4096)
    throw std::invalid_argument(std::string(kLayerNorm ? "layernorm_backward" : "rmsnorm_backward") + ": C = " +
                                std::to_string(C) + " must be a multiple of 8 in [8, 4096]");
  if (N <= 0) return;
  const int group_threads = (C / 8 + 31) / 32 * 32;
  const int groups = kBackwardThreads / group_threads, threads = groups * group_threads;
  auto kernel = norm_backward_kernel<kLayerNorm>;
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int blocks = std::max(1, std::min({std::max(1, per_sm) * sm_count(), (N + groups - 1) / groups,
                                           kMaxBackwardBlocks}));
  kernel<<<blocks, threads, 0, stream>>>(dx, partials, dy, x, w, mean, rstd, N, C, group_threads, accumulate);
  CUDA_CHECK_LAUNCH();
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
