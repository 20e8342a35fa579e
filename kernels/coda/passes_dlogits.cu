// The LM head's backward over the logits: dz = dloss (softmax - onehot), written back as dz' = r dz with
// the row dots of the final norm's backward, in one read and one write of the [N, Vp] logits (the largest
// tensor of a step: this pass must stream at memory bandwidth); logits are streamed (evict-first) and the
// next row's packets load before the current one is processed. RMSNorm (<dz, z> only): one block per row,
// kRowPackets loads in flight per thread, the dot summed over the block in a fixed order (count 1).
// LayerNorm (also <dz, c>, <dz, b'>): a block owns kGroupRows rows and a column slice, its threads keeping
// their packets' entries of c and b' in registers across the rows; the slices of a row group form a cluster
// and each row's dots are summed over them in rank order through distributed shared memory (kernels/common/cluster.cuh):
// deterministic, no atomics. The slice count trades passes over the rows against waves of blocks
// (dlogits_slices); two packets per thread keep two blocks per SM.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/coda/passes.cuh"
#include "kernels/common/cluster.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/vec.cuh"

namespace coda::passes {

namespace {

// dz of one packet (8 columns from col0) of a row: dloss (exp(z - lse) - [col == target]), 0 on the
// padded columns (col >= vocab).
__device__ __forceinline__ void dz_packet(float (&dz)[8], const float (&z)[8], int col0, float lse, int target,
                                          const DlogitsArgs& args) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = col0 + j;
    dz[j] = col < args.vocab ? args.dloss * (epi::fast_exp(z[j] - lse) - (col == target ? 1.0f : 0.0f)) : 0.0f;
  }
}

__device__ __forceinline__ uint4 pack_scaled(const float (&dz)[8], float rstd) {
  uint4 out;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(rstd * dz[2 * i], rstd * dz[2 * i + 1]);
  return out;
}

// ---- RMSNorm: one block per row ----
constexpr int kRowThreads = 256;
constexpr int kRowPackets = 4;  // loads in flight per thread

__global__ void __launch_bounds__(kRowThreads) dlogits_row_kernel(DlogitsArgs args) {
  __shared__ float scratch[32];
  const int row = blockIdx.x, packets = args.Vp / 8;
  const float lse = args.lse[row], rstd = args.stats.rms_rstd(row);
  const int target = args.targets[row];
  const uint4* src = reinterpret_cast<const uint4*>(args.logits + static_cast<size_t>(row) * args.Vp);
  uint4* dst = reinterpret_cast<uint4*>(args.dlogits + static_cast<size_t>(row) * args.Vp);
  float dot = 0.0f;
  for (int first = threadIdx.x; first < packets; first += kRowThreads * kRowPackets) {
    uint4 raw[kRowPackets];
#pragma unroll
    for (int k = 0; k < kRowPackets; ++k) {
      const int packet = first + k * kRowThreads;
      if (packet < packets) raw[k] = __ldcs(src + packet);
    }
#pragma unroll
    for (int k = 0; k < kRowPackets; ++k) {
      const int packet = first + k * kRowThreads;
      if (packet >= packets) continue;
      float z[8], dz[8];
      unpack_bf16x8(z, raw[k]);
      dz_packet(dz, z, 8 * packet, lse, target, args);
#pragma unroll
      for (int j = 0; j < 8; ++j) dot += dz[j] * z[j];
      __stcs(dst + packet, pack_scaled(dz, rstd));
    }
  }
  dot = block_sum(dot, scratch);
  if (threadIdx.x == 0) args.dot_z[row] = dot;
}

// ---- LayerNorm: row groups walked by column slices ----
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kGroupRows = 128;
constexpr int kDots = 3;                 // dot_z, dot_c, dot_b
constexpr int kPackets = 2;              // packets per thread and row
constexpr int kChunk = kPackets * kThreads;  // packets a block covers per pass over its rows

__global__ void __launch_bounds__(kThreads, 2) dlogits_kernel(DlogitsArgs args, int slice_packets) {
  __shared__ float row_lse[kGroupRows], row_rstd[kGroupRows];
  __shared__ int row_target[kGroupRows];
  __shared__ float warp_dots[kDots][kWarps][kGroupRows];
  __shared__ float block_dots[kDots][kGroupRows];
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int group = blockIdx.y, row0 = group * kGroupRows, rows = min(kGroupRows, args.N - row0);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  start_after_previous_kernel();

  for (int r = threadIdx.x; r < rows; r += kThreads) {
    const int row = row0 + r;
    row_lse[r] = args.lse[row];
    row_target[r] = args.targets[row];
    row_rstd[r] = args.stats.ln_stats(row).rstd;
  }
  for (int i = threadIdx.x; i < kDots * kWarps * kGroupRows; i += kThreads) (&warp_dots[0][0][0])[i] = 0.0f;
  __syncthreads();

  const int begin = static_cast<int>(cluster.block_rank()) * slice_packets;
  const int end = min(args.Vp / 8, begin + slice_packets);
  for (int chunk = begin; chunk < end; chunk += kChunk) {
    int packet[kPackets];
    bool valid[kPackets];
#pragma unroll
    for (int k = 0; k < kPackets; ++k) {
      packet[k] = chunk + threadIdx.x + k * kThreads;
      valid[k] = packet[k] < end;
    }
    float c[kPackets][8], b_prime[kPackets][8];  // the packets' entries, the same in every row
#pragma unroll
    for (int k = 0; k < kPackets; ++k)
      if (valid[k]) {
        load_f32x8(c[k], args.c + 8 * packet[k]);
        load_f32x8(b_prime[k], args.b_prime + 8 * packet[k]);
      }
    uint4 next[kPackets];
    auto load_row = [&](int r) {
      const uint4* src = reinterpret_cast<const uint4*>(args.logits + static_cast<size_t>(row0 + r) * args.Vp);
#pragma unroll
      for (int k = 0; k < kPackets; ++k)
        if (valid[k]) next[k] = __ldcs(src + packet[k]);
    };
    load_row(0);
    for (int r = 0; r < rows; ++r) {
      uint4 current[kPackets];
#pragma unroll
      for (int k = 0; k < kPackets; ++k) current[k] = next[k];
      if (r + 1 < rows) load_row(r + 1);
      const float lse = row_lse[r], rstd = row_rstd[r];
      const int target = row_target[r];
      uint4* dst = reinterpret_cast<uint4*>(args.dlogits + static_cast<size_t>(row0 + r) * args.Vp);
      float dots[kDots] = {};
#pragma unroll
      for (int k = 0; k < kPackets; ++k) {
        if (!valid[k]) continue;
        const int col0 = 8 * packet[k];
        float z[8], dz[8];
        unpack_bf16x8(z, current[k]);
        dz_packet(dz, z, col0, lse, target, args);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          dots[0] += dz[j] * z[j];
          dots[1] += dz[j] * c[k][j];
          dots[2] += dz[j] * b_prime[k][j];
        }
        __stcs(dst + packet[k], pack_scaled(dz, rstd));
      }
#pragma unroll
      for (int d = 0; d < kDots; ++d) {
        const float total = warp_sum(dots[d]);
        if (lane == 0) warp_dots[d][warp][r] += total;
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kDots * rows; i += kThreads) {
    const int d = i / rows, r = i % rows;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += warp_dots[d][w][r];
    block_dots[d][r] = sum;
  }
  cluster.sync();  // every slice's block_dots are complete
  const int share = (rows + cluster.num_blocks() - 1) / cluster.num_blocks();
  const int first = static_cast<int>(cluster.block_rank()) * share;
  for (int i = threadIdx.x; i < kDots * share; i += kThreads) {
    const int d = i / share, r = first + i % share;
    float* out = d == 0 ? args.dot_z : d == 1 ? args.dot_c : args.dot_b;
    if (r < rows) out[row0 + r] = sum_over_cluster(&block_dots[d][r]);
  }
  cluster.sync();  // the other slices have read this block's block_dots
}

// Cluster size (column slices per row group). Modelled cost of a slice count: the waves of blocks the GPU
// runs (resident blocks: SMs x occupancy) times the passes (chunks) each block makes over its rows; ties
// go to the fewest idle packet slots, then to more slices. For gpt2-124m (N = 32768, Vp = 50304) this is
// one slice (256 blocks, all resident).
int dlogits_slices(int packets, int groups) {
  static const int resident = [] {
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dlogits_kernel, kThreads, 0));
    return std::max(1, per_sm) * sm_count();
  }();
  int best = 1;
  long best_cost = 0, best_waste = 0;
  for (int slices = 1; slices <= kMaxClusterBlocks; ++slices) {
    const int slice = (packets + slices - 1) / slices, chunks = (slice + kChunk - 1) / kChunk;
    const long waves = (static_cast<long>(slices) * groups + resident - 1) / resident;
    const long cost = waves * chunks, waste = static_cast<long>(slices) * chunks * kChunk - packets;
    if (slices == 1 || cost < best_cost || (cost == best_cost && waste <= best_waste))
      best = slices, best_cost = cost, best_waste = waste;
  }
  return best;
}

void launch_dlogits_layernorm(const DlogitsArgs& args, cudaStream_t stream) {
  const int packets = args.Vp / 8, groups = (args.N + kGroupRows - 1) / kGroupRows;
  const int slices = dlogits_slices(packets, groups);
  const int slice_packets = (packets + slices - 1) / slices;
  launch_clustered(dlogits_kernel, slices, groups, kThreads, stream, args, slice_packets);
}

}  // namespace

void dlogits(const DlogitsArgs& args, cudaStream_t stream) {
  const profile::Region region("dlogits", profile::Work::Other, stream);
  if (args.Vp % 8 != 0 || args.vocab < 1 || args.vocab > args.Vp)
    throw std::invalid_argument("passes::dlogits: Vp = " + std::to_string(args.Vp) + " must be a multiple of 8 and vocab = " +
                                std::to_string(args.vocab) + " in [1, Vp]");
  if (args.dot_z == nullptr || args.stats.sumsq == nullptr)
    throw std::invalid_argument("passes::dlogits: dot_z and the final norm's sumsq partials are required");
  const bool layer_norm = args.c != nullptr;
  const bool all_ln = args.b_prime && args.dot_c && args.dot_b && args.stats.sum;
  const bool any_ln = args.b_prime || args.dot_c || args.dot_b;
  if (layer_norm ? !all_ln : any_ln)
    throw std::invalid_argument(
        "passes::dlogits: LayerNorm needs c, b_prime, dot_c, dot_b and the sum partials together; RMSNorm none of "
        "c, b_prime, dot_c, dot_b");
  if (args.N == 0 || args.Vp == 0) return;
  if (layer_norm) {
    launch_dlogits_layernorm(args, stream);
  } else {
    dlogits_row_kernel<<<args.N, kRowThreads, 0, stream>>>(args);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace coda::passes
