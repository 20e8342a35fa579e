// Finishing column partials ([groups, ld] fp32, one row per row group of their producer: a GEMM
// epilogue's ColDot, the attention write-out) into parameter gradients:
//   add_column_partials   grad[j] += scale * sum_g partials[g, j]  (norm gammas and betas, biases), for up
//                         to three (grad, partials) pairs of the same shape in one launch.
// A block owns a tile of 32 columns (8 threads of one 16-byte load each per partial row, so a warp reads
// four 128-byte rows) and 32 partial rows at a time. The partial rows may be many (a GEMM's 16-row
// groups: N / 16, e.g. 2048) over few columns (d_model), so one block per tile would leave most of the
// GPU idle: the groups are split over the blocks of a thread-block cluster (up to 8, about 256 groups
// each), each block sums its share into shared memory in a fixed order, and the totals are the sum of the
// cluster's shares in rank order (kernels/common/cluster.cuh). Deterministic, no atomics, no workspace.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/coda/passes.cuh"
#include "kernels/common/cluster.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"

namespace coda::passes {

namespace {

constexpr int kThreads = 256;
constexpr int kTileCols = 32;
constexpr int kQuads = kTileCols / 4;           // threads per partial row (one float4 each)
constexpr int kRowLanes = kThreads / kQuads;    // partial rows read at a time
constexpr int kGroupsPerBlock = 256;            // the share of the groups that makes a cluster grow

// The (gradient, partials) pairs of one launch, as kernel parameters.
template <int kArrays>
struct ColumnSums {
  float* grad[kArrays];
  const float* partials[kArrays];
};

// Shared memory of the tile's column sums of kArrays partial buffers: sums[a][t] is this block's share
// of column col0 + t, summed over its groups.
template <int kArrays>
struct TileSums {
  float lanes[kArrays][kRowLanes][kTileCols + 1];
  float sums[kArrays][kTileCols];
};

// This block's share of the column sums of the tile [col0, col0 + 32) (columns < n) of kArrays partial
// buffers [groups, ld], into tile.sums; ends with the cluster barrier that publishes them.
template <int kArrays>
__device__ void tile_column_sums(TileSums<kArrays>& tile, const float* const (&partials)[kArrays], int groups, int ld,
                                 int col0, int n) {
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int share = (groups + cluster.num_blocks() - 1) / cluster.num_blocks();
  const int g_begin = static_cast<int>(cluster.block_rank()) * share, g_end = min(groups, g_begin + share);
  const int quad = threadIdx.x % kQuads, lane = threadIdx.x / kQuads, col = col0 + 4 * quad;
  float4 acc[kArrays];
#pragma unroll
  for (int a = 0; a < kArrays; ++a) acc[a] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (col < n) {
#pragma unroll 4
    for (int g = g_begin + lane; g < g_end; g += kRowLanes)
#pragma unroll
      for (int a = 0; a < kArrays; ++a) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(partials[a] + static_cast<size_t>(g) * ld + col));
        acc[a].x += v.x, acc[a].y += v.y, acc[a].z += v.z, acc[a].w += v.w;
      }
  }
#pragma unroll
  for (int a = 0; a < kArrays; ++a) {
    float* dst = &tile.lanes[a][lane][4 * quad];
    dst[0] = acc[a].x, dst[1] = acc[a].y, dst[2] = acc[a].z, dst[3] = acc[a].w;
  }
  __syncthreads();
  if (threadIdx.x < kTileCols)
#pragma unroll
    for (int a = 0; a < kArrays; ++a) {
      float sum = 0.0f;
      for (int l = 0; l < kRowLanes; ++l) sum += tile.lanes[a][l][threadIdx.x];
      tile.sums[a][threadIdx.x] = sum;
    }
  cluster.sync();
}

template <int kArrays>
__global__ void __launch_bounds__(kThreads) add_column_partials_kernel(ColumnSums<kArrays> sums, int groups, int ld,
                                                                       int n, float scale) {
  __shared__ TileSums<kArrays> tile;
  const int col0 = blockIdx.y * kTileCols;
  start_after_previous_kernel();
  tile_column_sums<kArrays>(tile, sums.partials, groups, ld, col0, n);
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (cluster.block_rank() == 0 && threadIdx.x < kTileCols && col0 + threadIdx.x < n)
#pragma unroll
    for (int a = 0; a < kArrays; ++a) sums.grad[a][col0 + threadIdx.x] += scale * sum_over_cluster(&tile.sums[a][threadIdx.x]);
  cluster.sync();
}

// Blocks per cluster for `groups` partial rows: about kGroupsPerBlock each, at most kMaxClusterBlocks.
int cluster_blocks_for(int groups) {
  return std::clamp((groups + kGroupsPerBlock - 1) / kGroupsPerBlock, 1, kMaxClusterBlocks);
}

void require_float4_columns(const char* what, int n, int ld) {
  if (n % 4 != 0 || ld % 4 != 0 || n > ld)
    throw std::invalid_argument(std::string(what) + ": columns " + std::to_string(n) + " and leading dimension " +
                                std::to_string(ld) + " must be multiples of 4 with columns <= leading dimension");
}

constexpr int kMaxArrays = 3;  // (gradient, partials) pairs in one add_column_partials launch

template <int kArrays>
void launch_add_column_partials(const ColumnSums<kMaxArrays>& all, int groups, int ld, int n, float scale,
                                cudaStream_t stream) {
  ColumnSums<kArrays> sums;
  for (int a = 0; a < kArrays; ++a) sums.grad[a] = all.grad[a], sums.partials[a] = all.partials[a];
  launch_clustered(add_column_partials_kernel<kArrays>, cluster_blocks_for(groups), (n + kTileCols - 1) / kTileCols,
                   kThreads, stream, sums, groups, ld, n, scale);
}

}  // namespace

void add_column_partials(std::initializer_list<ColumnPartials> sums, int groups, int ld, int n, float scale,
                         cudaStream_t stream) {
  const profile::Region region("column partials", profile::Work::Other, stream);
  require_float4_columns("passes::add_column_partials", n, ld);
  ColumnSums<kMaxArrays> list{};
  int count = 0;
  for (const ColumnPartials& s : sums) {
    if (s.grad == nullptr) continue;
    if (count == kMaxArrays)
      throw std::invalid_argument("passes::add_column_partials: more than " + std::to_string(kMaxArrays) +
                                  " partial buffers in one launch");
    list.grad[count] = s.grad, list.partials[count++] = s.partials;
  }
  if (groups <= 0 || n == 0 || count == 0) return;
  if (count == 1) return launch_add_column_partials<1>(list, groups, ld, n, scale, stream);
  if (count == 2) return launch_add_column_partials<2>(list, groups, ld, n, scale, stream);
  launch_add_column_partials<3>(list, groups, ld, n, scale, stream);
}

}  // namespace coda::passes
