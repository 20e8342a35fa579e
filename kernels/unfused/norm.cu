// LayerNorm (GPT-2) and RMSNorm (Llama), forward and backward: one template serves both, `kLayerNorm`
// switches the mean subtraction and the bias.
// Forward: one warp owns a row and keeps it in registers, so x is read once and the variance is taken
// around the mean (exact where E[x^2] - mu^2 would cancel); persistent grid, next row prefetched.
// Backward (xhat = (x - mu) r, g = dy w): dx = r (g - mean(g) - xhat mean(g xhat)) (RMSNorm: no mean(g)),
// added into the residual gradient in the same pass; dw = colsum(dy xhat), db = colsum(dy). A row is spread
// over a group of C/8 threads that streams its rows through a ring of shared-memory slots by cp.async.bulk
// (one mbarrier per slot), so the bytes in flight cost no registers (the forward keeps its register prefetch:
// the ring was slower there, docs/LOG.md). Each block writes one partial row of dw (db); the last blocks to
// take a ticket sum the partials in block order: deterministic, and no second launch.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/sm90/sm90.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda::unfused {

namespace {

constexpr int kMaxBackwardBlocks = 1024;
constexpr int kForwardWarps = 8;
constexpr int kBackwardThreads = 512;  // at most, per block: as many row groups as fit
constexpr int kMaxGroups = 8;         // row groups per block (each has a hardware barrier)
constexpr int kBackwardStages = 3;    // row slots per group

// A persistent grid (as many blocks as fit, no waves): each warp walks rows warp, warp + all warps, ...,
// and requests the packets of its next row before it reduces the current one. Rows of 1025..2048 values
// (kChunks 8) also keep w (and b) in registers instead of reloading them from L1 for every row (it pays at
// Llama's 2048-wide rows; at 768 it does not help, and at kChunks 16 it would spill).
template <int kChunks, bool kLayerNorm>
__global__ void __launch_bounds__(kForwardWarps * 32) norm_forward_kernel(bf16* y, float* mean_out, float* rstd_out,
                                                                          const bf16* x, const bf16* w, const bf16* b,
                                                                          int N, int C, float eps) {
  start_after_previous_kernel();
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

// Row group g of a block holds rows blockIdx.x * groups + g + k * (all groups), k = 0, 1, ...; thread t of
// the group owns packet t (columns 8t .. 8t + 7). Each group has a ring of kStages row slots in dynamic
// shared memory ([kStages][dy, x, dres][C] bf16); thread 0 of the group refills a slot with the row kStages
// rows ahead once the group's barrier shows that every thread has read it. partials: [kStats][gridDim.x][C];
// counters: two unsigned ints, zero at entry and left zero. The grid never exceeds the blocks that fit at
// once, so a finishing block that waits never keeps a block it waits for from starting.
template <bool kLayerNorm, int kStages>
__global__ void __launch_bounds__(kBackwardThreads) norm_backward_kernel(bf16* dx, float* partials, float* dw_out,
                                                                         float* db_out, unsigned int* counters,
                                                                         const bf16* dy, const bf16* x, const bf16* w,
                                                                         const float* mean, const float* rstd, int N,
                                                                         int C, int group_threads, bool accumulate) {
  start_after_previous_kernel();
  constexpr int kStats = kLayerNorm ? 2 : 1;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kMaxGroups][kStages];
  __shared__ float2 warp_sums[kStages][kBackwardThreads / 32];  // by slot: rewritten kStages rounds later
  __shared__ unsigned int ticket;
  const int groups = blockDim.x / group_threads, group = threadIdx.x / group_threads, t = threadIdx.x % group_threads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps_per_group = group_threads / 32;
  const int all_groups = gridDim.x * groups, first = blockIdx.x * groups + group;
  const bool active = t < C / 8;
  const float inv_c = 1.0f / C;
  const uint32_t row_bytes = static_cast<uint32_t>(C) * sizeof(bf16);
  bf16* ring = reinterpret_cast<bf16*>(smem) + static_cast<size_t>(group) * kStages * 3 * C;
  if (t == 0)
    for (int s = 0; s < kStages; ++s) sm90::mbar_init(&full[group][s], 1);
  sm90::fence_barrier_init();
  __syncthreads();
  const auto issue = [&](int s, int row) {
    const uint32_t bar = sm90::smem_u32(&full[group][s]);
    const size_t offset = static_cast<size_t>(row) * C;
    bf16* slot = ring + static_cast<size_t>(s) * 3 * C;
    sm90::mbar_arrive_expect_tx(bar, (accumulate ? 3 : 2) * row_bytes);
    sm90::bulk_load(sm90::smem_u32(slot), dy + offset, row_bytes, bar);
    sm90::bulk_load(sm90::smem_u32(slot + C), x + offset, row_bytes, bar);
    if (accumulate) sm90::bulk_load(sm90::smem_u32(slot + 2 * C), dx + offset, row_bytes, bar);
  };
  // The statistics of the row in each slot, loaded when the slot is filled.
  float mu[kStages], r[kStages];
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    const int row = first + s * all_groups;
    if (row < N) {
      if (t == 0) issue(s, row);
      mu[s] = kLayerNorm ? mean[row] : 0.0f;
      r[s] = rstd[row];
    }
  }
  uint4 w_raw = make_uint4(0u, 0u, 0u, 0u);
  if (active) w_raw = load_packet(w + 8 * t);
  float dw[8], db[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) dw[j] = db[j] = 0.0f;
  for (int base = first, phase = 0; base < N; base += kStages * all_groups, phase ^= 1) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      const int row = base + s * all_groups;
      if (row >= N) break;
      sm90::mbar_wait(sm90::smem_u32(&full[group][s]), phase);
      const bf16* slot = ring + static_cast<size_t>(s) * 3 * C;
      uint4 dy_raw = make_uint4(0u, 0u, 0u, 0u), x_raw = dy_raw, dres_raw = dy_raw;
      if (active) {
        dy_raw = *reinterpret_cast<const uint4*>(slot + 8 * t);
        x_raw = *reinterpret_cast<const uint4*>(slot + C + 8 * t);
        if (accumulate) dres_raw = *reinterpret_cast<const uint4*>(slot + 2 * C + 8 * t);
      }
      const float mu_row = mu[s], r_row = r[s];
      const int ahead = row + kStages * all_groups;
      if (ahead < N) {
        mu[s] = kLayerNorm ? mean[ahead] : 0.0f;
        r[s] = rstd[ahead];
      }
      float dyv[8], xhat[8], g[8];
      {
        float xv[8], wv[8];
        unpack_bf16x8(dyv, dy_raw);
        unpack_bf16x8(xv, x_raw);
        unpack_bf16x8(wv, w_raw);
#pragma unroll
        for (int j = 0; j < 8; ++j) xhat[j] = (xv[j] - mu_row) * r_row, g[j] = dyv[j] * wv[j];
      }
      float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum_g += g[j], sum_gx += g[j] * xhat[j];
      sum_g = warp_sum(sum_g);
      sum_gx = warp_sum(sum_gx);
      if (lane == 0) warp_sums[s][warp] = make_float2(sum_g, sum_gx);
      // Every thread of the group has read the slot and written its warp's sums.
      sm90::named_barrier(1 + group, group_threads);
      if (t == 0 && ahead < N) issue(s, ahead);
      float total_g = 0.0f, total_gx = 0.0f;
      for (int i = 0; i < warps_per_group; ++i) {
        const float2 v = warp_sums[s][group * warps_per_group + i];
        total_g += v.x, total_gx += v.y;
      }
      if (!active) continue;
      const float mean_g = kLayerNorm ? total_g * inv_c : 0.0f, mean_gx = total_gx * inv_c;
      float out[8];
      if (accumulate) unpack_bf16x8(out, dres_raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float d = r_row * (g[j] - mean_g - xhat[j] * mean_gx);
        out[j] = accumulate ? out[j] + d : d;
        dw[j] += dyv[j] * xhat[j];
        if (kLayerNorm) db[j] += dyv[j];
      }
      store_bf16x8(dx + static_cast<size_t>(row) * C + 8 * t, out);
    }
  }
  // Every issued copy has been waited for: the ring is free. [kStats][groups][C] fp32 sums over the groups.
  float* column_sums = reinterpret_cast<float*>(smem);
  __syncthreads();
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
  // The last `finishers` blocks to take a ticket each sum slices of 32 partial columns over all blocks,
  // once every block has taken one. The summation order depends on the launch shape only.
  __syncthreads();
  if (threadIdx.x == 0) ticket = ticket_add(&counters[0], 1u);
  __syncthreads();
  const int slices = (kStats * C + 31) / 32, finishers = min(static_cast<int>(gridDim.x), slices);
  const int finisher = static_cast<int>(ticket) - (static_cast<int>(gridDim.x) - finishers);
  if (finisher < 0) return;
  if (threadIdx.x == 0)
    while (load_acquire(&counters[0]) < gridDim.x) __nanosleep(64);
  __syncthreads();
  float4* lane_sums = reinterpret_cast<float4*>(smem);  // [blockDim.x / 8][8]
  const int q = threadIdx.x % 8, part = threadIdx.x / 8, parts = blockDim.x / 8;
  for (int slice = finisher; slice < slices; slice += finishers) {
    const int c = slice * 32 + 4 * q, stat = c / C, col = c % C;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (c < kStats * C)
#pragma unroll 4
      for (int b = part; b < static_cast<int>(gridDim.x); b += parts) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(
            partials + (static_cast<size_t>(stat) * gridDim.x + b) * C + col));
        acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
      }
    lane_sums[part * 8 + q] = acc;
    __syncthreads();
    if (part == 0 && c < kStats * C) {
      float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int p = 0; p < parts; ++p) {
        const float4 v = lane_sums[p * 8 + q];
        total.x += v.x, total.y += v.y, total.z += v.z, total.w += v.w;
      }
      float* out = (stat == 0 ? dw_out : db_out) + col;
      out[0] += total.x, out[1] += total.y, out[2] += total.z, out[3] += total.w;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && atomicAdd(&counters[1], 1u) == static_cast<unsigned int>(finishers - 1)) {
    counters[0] = 0u;
    counters[1] = 0u;
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
    const profile::Region region(kLayerNorm ? "layernorm forward" : "rmsnorm forward", profile::Work::Epilogue, stream);
    launch_kernel(kernel, after_previous(blocks, kForwardWarps * 32), stream, y, mean, rstd, x, w, b, N, C, eps);
  });
}

// As many blocks as fit on the device at once (the in-kernel finish relies on it), each with as many row
// groups as fit in kBackwardThreads (at most kMaxGroups).
template <bool kLayerNorm>
void launch_backward(bf16* dx, float* dw, float* db, const bf16* dy, const bf16* x, const bf16* w, const float* mean,
                     const float* rstd, int N, int C, bool accumulate, float* partials, const ColumnSumWorkspace& ws,
                     cudaStream_t stream) {
  if (C % 8 != 0 || C < 8 || C > 4096)
    throw std::invalid_argument(std::string(kLayerNorm ? "layernorm_backward" : "rmsnorm_backward") + ": C = " +
                                std::to_string(C) + " must be a multiple of 8 in [8, 4096]");
  if (N <= 0) return;
  const profile::Region region(kLayerNorm ? "layernorm backward" : "rmsnorm backward", profile::Work::Epilogue, stream);
  const int group_threads = (C / 8 + 31) / 32 * 32;
  const int groups = std::min(kMaxGroups, kBackwardThreads / group_threads), threads = groups * group_threads;
  // The rings; after the rows, the same memory holds the groups' dw/db columns and the finishing sums.
  const size_t smem = std::max({static_cast<size_t>(groups) * kBackwardStages * 3 * C * sizeof(bf16),
                                static_cast<size_t>(kLayerNorm ? 2 : 1) * groups * C * sizeof(float),
                                static_cast<size_t>(threads) * sizeof(float4)});
  auto kernel = norm_backward_kernel<kLayerNorm, kBackwardStages>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int blocks = std::max(1, std::min({std::max(1, per_sm) * sm_count(), (N + groups - 1) / groups,
                                           kMaxBackwardBlocks}));
  launch_kernel(kernel, after_previous(blocks, threads, smem), stream, dx, partials, dw, db, ws.tickets, dy, x, w, mean,
                rstd, N, C, group_threads, accumulate);
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
