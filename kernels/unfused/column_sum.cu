// Column sums out[j] += sum_n x[n, j] of a bf16 matrix: the bias gradients (db = column sums of dY).
// The grid is (column tiles, row slabs); a thread reads 8 adjacent columns per row (16-byte loads), 16 rows
// in flight, all loads of a batch issued before any is added (past the slab's end a thread reloads its
// last row and drops it, so no branch splits the loads); the block's row groups meet in shared memory as
// the slab's partial row. The slabs' partials are added in an order fixed by the launch shape alone
// (bitwise reproducible on a given device), in one of two ways:
//  * narrow matrices whose 64-column tiles all fit at once as clusters of 16 blocks ([N, 768]): a cluster per
//    tile; block 0 adds the 16 partials through distributed shared memory in slab order, no global round trip;
//  * otherwise the last block to end: 128-column tiles, a grid of exactly one wave, each block stores its
//    partial and takes a ticket (ticket_add, kernels/common/vec.cuh); the last one sums the partials in one round of loads.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/common/cluster.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda::unfused {

namespace {

constexpr int kThreads = 256;
constexpr int kRowsInFlight = 16;  // per thread (16 bytes each)

// The last-block-to-end finish: 128-column tiles, at most kMaxSlabs slabs.
constexpr int kTicketTileCols = 128;
constexpr int kMaxSlabs = 96;
// The cluster finish: 64-column tiles (one 128-byte line of each row), a cluster of 16 slabs (the
// largest cluster Hopper allows, a non-portable size).
constexpr int kClusterTileCols = 64;
constexpr int kClusterSlabs = 16;

// The layout of a block over a tile of kTileCols columns.
template <int kTileCols>
struct TileLayout {
  static constexpr int kLanesPerRow = kTileCols / 8;          // threads that read one row of the tile
  static constexpr int kRowGroups = kThreads / kLanesPerRow;  // rows read at once by the block
  using Scratch = float[kRowGroups][kTileCols];                // the groups' sums meet here
};

// One 16-byte packet of the summed matrix, with the L2 told to fetch the aligned 128 bytes around it
// (.L2::128B): faster than .L2::256B at every width (docs/LOG.md), bitwise the same result.
__device__ __forceinline__ uint4 load_packet_l2_128(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Thread t < kTileCols returns the sum over row groups of column t of the groups' values (each thread
// holds 8 columns of its group).
template <int kTileCols>
__device__ __forceinline__ float sum_over_groups(typename TileLayout<kTileCols>::Scratch& red, const float (&acc)[8]) {
  using L = TileLayout<kTileCols>;
  store_f32x8(&red[threadIdx.x / L::kLanesPerRow][threadIdx.x % L::kLanesPerRow * 8], acc);
  __syncthreads();
  float sum = 0.0f;
  if (threadIdx.x < kTileCols)
#pragma unroll
    for (int g = 0; g < L::kRowGroups; ++g) sum += red[g][threadIdx.x];
  return sum;
}

// The main pass: thread t < kTileCols returns the sum over rows [row_begin, row_end) of column
// tile * kTileCols + t (0 past the matrix's columns).
template <int kTileCols>
__device__ __forceinline__ float slab_column_sum(typename TileLayout<kTileCols>::Scratch& red, const bf16* x,
                                                 int row_begin, int row_end, int cols, int ld, int tile) {
  using L = TileLayout<kTileCols>;
  const int group = threadIdx.x / L::kLanesPerRow;                       // rows row_begin + group + kRowGroups i
  const int col = tile * kTileCols + threadIdx.x % L::kLanesPerRow * 8;  // this thread's first column
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (col < cols)
    for (int row = row_begin + group; row < row_end; row += kRowsInFlight * L::kRowGroups) {
      // Past the slab's end a thread reloads its last row (a cache hit) and drops it: no branch between the loads.
      uint4 v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        v[u] = load_packet_l2_128(x + static_cast<size_t>(min(row + u * L::kRowGroups, row_end - 1)) * ld + col);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (row + u * L::kRowGroups < row_end) {
          float f[8];
          unpack_bf16x8(f, v[u]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += f[i];
        }
    }
  return sum_over_groups<kTileCols>(red, acc);
}

// Grid (kClusterSlabs, tiles), clusters of kClusterSlabs blocks along x: block s of cluster t sums slab s of
// column tile t.
__global__ void __launch_bounds__(kThreads) column_sum_cluster_kernel(float* out, const bf16* x, int rows, int cols,
                                                                      int ld, int rows_per_slab) {
  start_after_previous_kernel();
  __shared__ __align__(16) TileLayout<kClusterTileCols>::Scratch red;
  __shared__ float slab_partial[kClusterTileCols];
  const int slab = blockIdx.x, tile = blockIdx.y;
  const int out_col = tile * kClusterTileCols + threadIdx.x;  // the column this thread finishes
  const bool finishes = slab == 0 && threadIdx.x < kClusterTileCols && out_col < cols;
  const float out_before = finishes ? out[out_col] : 0.0f;  // read early: not waited for at the end
  const int row_begin = min(rows, slab * rows_per_slab), row_end = min(rows, row_begin + rows_per_slab);
  const float sum = slab_column_sum<kClusterTileCols>(red, x, row_begin, row_end, cols, ld, tile);
  if (threadIdx.x < kClusterTileCols) slab_partial[threadIdx.x] = sum;
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // every slab's partial is in its block's shared memory
  if (finishes) out[out_col] = out_before + sum_over_cluster<kClusterSlabs>(&slab_partial[threadIdx.x]);
  cluster.sync();  // no block leaves (and takes its shared memory along) before block 0 has read it
}

__global__ void __launch_bounds__(kThreads) column_sum_ticket_kernel(float* out, const bf16* x, int rows, int cols,
                                                                     int ld, int rows_per_slab, float* partials,
                                                                     unsigned int* tickets) {
  using L = TileLayout<kTicketTileCols>;
  constexpr int kSlabsPerGroup = (kMaxSlabs + L::kRowGroups - 1) / L::kRowGroups;  // the finish: one round of loads
  start_after_previous_kernel();
  __shared__ __align__(16) L::Scratch red;
  __shared__ bool last_block;
  const int tile = blockIdx.x, slab = blockIdx.y, slabs = gridDim.y;
  const int out_col = tile * kTicketTileCols + threadIdx.x;  // the column this thread finishes
  const bool finishes = threadIdx.x < kTicketTileCols && out_col < cols;
  // Read now so that the finishing block does not wait for it at the end (only the finishing block of this
  // launch writes `out`, after every block has read it).
  const float out_before = finishes ? out[out_col] : 0.0f;
  const float slab_sum = slab_column_sum<kTicketTileCols>(red, x, slab * rows_per_slab,
                                                          min(rows, (slab + 1) * rows_per_slab), cols, ld, tile);
  if (slabs == 1) {
    if (finishes) out[out_col] = out_before + slab_sum;
    return;
  }
  if (finishes) partials[static_cast<size_t>(slab) * cols + out_col] = slab_sum;
  __syncthreads();
  if (threadIdx.x == 0) last_block = ticket_add(&tickets[tile], 1u) == static_cast<unsigned int>(slabs - 1);
  __syncthreads();
  if (!last_block) return;

  // Row group g sums slabs g, g + kRowGroups, ... (all in one round of loads), then the groups meet in shared
  // memory as in the main pass. The partials of other blocks are read through L2 (__ldcg): this block's L1
  // never held them.
  const int group = threadIdx.x / L::kLanesPerRow;
  const int col = tile * kTicketTileCols + threadIdx.x % L::kLanesPerRow * 8;
  float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (col < cols) {
    float4 lo[kSlabsPerGroup], hi[kSlabsPerGroup];
#pragma unroll
    for (int u = 0; u < kSlabsPerGroup; ++u) {
      const size_t s = static_cast<size_t>(min(group + u * L::kRowGroups, slabs - 1));
      const float4* p = reinterpret_cast<const float4*>(partials + s * cols + col);
      lo[u] = __ldcg(p), hi[u] = __ldcg(p + 1);
    }
#pragma unroll
    for (int u = 0; u < kSlabsPerGroup; ++u)
      if (group + u * L::kRowGroups < slabs) {
        total[0] += lo[u].x, total[1] += lo[u].y, total[2] += lo[u].z, total[3] += lo[u].w;
        total[4] += hi[u].x, total[5] += hi[u].y, total[6] += hi[u].z, total[7] += hi[u].w;
      }
  }
  __syncthreads();  // every thread has read red[] of the main pass
  const float sum = sum_over_groups<kTicketTileCols>(red, total);
  if (finishes) out[out_col] = out_before + sum;
  if (threadIdx.x == 0) tickets[tile] = 0u;
}

// How many clusters of kClusterSlabs blocks of column_sum_cluster_kernel the device holds at once (asked
// once; it also allows the kernel the non-portable cluster size).
int cluster_capacity() {
  static const int capacity = [] {
    CUDA_CHECK(cudaFuncSetAttribute(column_sum_cluster_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(kClusterSlabs, 1);
    config.blockDim = dim3(kThreads);
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kClusterSlabs;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    int clusters = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, column_sum_cluster_kernel, &config));
    return clusters;
  }();
  return capacity;
}

}  // namespace

size_t column_sum_partials_floats(int max_cols) { return static_cast<size_t>(kMaxSlabs) * max_cols; }
size_t column_sum_tickets(int max_cols) {
  return static_cast<size_t>(std::max(2, (max_cols + kTicketTileCols - 1) / kTicketTileCols));
}

void column_sum(float* out, const bf16* x, int rows, int cols, int ld, const ColumnSumWorkspace& ws,
                cudaStream_t stream) {
  if (cols % 8 != 0 || ld % 8 != 0 || ld < cols || cols > ws.max_cols)
    throw std::invalid_argument("column_sum: cols (" + std::to_string(cols) + ") and ld (" + std::to_string(ld) +
                                ") must be multiples of 8 with cols <= ld and cols <= the workspace's " +
                                std::to_string(ws.max_cols));
  if (rows <= 0) return;
  const profile::Region region("column sum (bias gradient)", profile::Work::Epilogue, stream);
  const int cluster_tiles = (cols + kClusterTileCols - 1) / kClusterTileCols;
  if (cluster_tiles <= cluster_capacity()) {
    LaunchShape shape = after_previous(dim3(kClusterSlabs, cluster_tiles), kThreads);
    shape.cluster_x = kClusterSlabs;
    launch_kernel(column_sum_cluster_kernel, shape, stream, out, x, rows, cols, ld,
                  (rows + kClusterSlabs - 1) / kClusterSlabs);
    return;
  }
  const int tiles = (cols + kTicketTileCols - 1) / kTicketTileCols;
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, column_sum_ticket_kernel, kThreads, 0));
  const int target_slabs = std::max(1, std::max(1, per_sm) * sm_count() / tiles);
  const int rows_per_round = kRowsInFlight * TileLayout<kTicketTileCols>::kRowGroups;
  const int slabs_wanted = std::max(1, std::min({target_slabs, rows / rows_per_round, kMaxSlabs}));
  const int rows_per_slab = (rows + slabs_wanted - 1) / slabs_wanted;
  const int slabs = (rows + rows_per_slab - 1) / rows_per_slab;
  launch_kernel(column_sum_ticket_kernel, after_previous(dim3(tiles, slabs), kThreads), stream, out, x, rows, cols,
                ld, rows_per_slab, ws.partials, ws.tickets);
}

}  // namespace coda::unfused
