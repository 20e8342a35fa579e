// Column sums out[j] += sum_n x[n, j] of a bf16 matrix: the bias gradients (db = column sums of dY).
//
// The grid is (column tiles of 128, row slabs). In a block, 16 threads own a row's 128 columns (8 adjacent
// columns each, one 16-byte load per row) and the block's 16 row groups take interleaved rows of the slab,
// 16 rows in flight per thread, all their loads issued before any is added (past the slab's end a thread
// reloads its last row and drops it, so no branch splits the loads); the groups' sums meet in shared memory
// and the slab's partial row goes to the workspace. Then each block takes an integer ticket for its column
// tile (one acquire-release atomic per block, see ticket_add in vec.cuh); the block that draws the last
// ticket sums the slabs' partials in slab order and adds them to `out`. The float additions therefore
// happen in an order fixed by the launch shape alone: results are bitwise reproducible. Slabs are sized so
// the grid is exactly the blocks that fit on the device at once: one wave (a second, partial wave of a few
// blocks cost 15% at [N, 2304]), and the last block's serial work stays short: it reads every slab's partial
// in one round of loads, 128 columns of them (256-column tiles put 4x the bytes, 90 KB at [N, 768], through
// the one finishing block of each tile).
//
// What [N, 768] (GPT-2's 50 MB bias gradients) costs, H200, PDL launches back to back (docs/PERFORMANCE.md,
// sessions 5 and 15): the main pass with its partial stores about 14.4 us (83% of 4.2 TB/s), the finish
// (a ticket round trip to L2, one round of partial loads, the store) 1.4 us more, 15.8 us in all (76%). A
// deterministic cross-block sum needs those two L2 round trips after the last block's main pass; variants
// that shortened the chain (clusters summing 4 or 8 slabs through distributed shared memory first, whole
// rows per block, the partials as their own ready flags polled by one block: 21.7 us, session 12) were
// slower, and so were 64-column tiles, 16 warps per block and 8 or 12 rows in flight (session 15).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/kernel_profile.cuh"
#include "kernels/launch.cuh"
#include "kernels/unfused/unfused.cuh"
#include "kernels/unfused/vec.cuh"

namespace coda::unfused {

namespace {

constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kTileCols = 128;                       // a block's columns: 16 lanes x 8 columns, 256 bytes a row
constexpr int kLanesPerRow = kTileCols / 8;          // 16
constexpr int kRowGroups = kThreads / kLanesPerRow;  // 16 rows read at once by the block (2 per warp)
constexpr int kMaxSlabs = 96;
constexpr int kRowsInFlight = 16;                                     // per thread (16 bytes each)
constexpr int kSlabsPerGroup = (kMaxSlabs + kRowGroups - 1) / kRowGroups;  // the finish: one round of loads

// One 16-byte packet of the summed matrix, with the L2 told to fetch the aligned 128 bytes around it
// (.L2::128B). Bitwise the same result; measured (session 15 harness, 256-byte row pieces): [N, 768]
// 16.12 -> 15.80 us, [N, 2304] 41.15 -> 39.87, [N, 3072] 51.74 -> 49.36 against .L2::256B.
__device__ __forceinline__ uint4 load_packet_l2_128(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Thread t < kTileCols returns the sum over row groups of column t of the groups' values (each thread
// holds 8 columns of its group).
__device__ __forceinline__ float sum_over_groups(float (&red)[kRowGroups][kTileCols], const float (&acc)[8]) {
  store_f32x8(&red[threadIdx.x / kLanesPerRow][threadIdx.x % kLanesPerRow * 8], acc);
  __syncthreads();
  float sum = 0.0f;
  if (threadIdx.x < kTileCols)
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) sum += red[g][threadIdx.x];
  return sum;
}

__global__ void __launch_bounds__(kThreads) column_sum_kernel(float* out, const bf16* x, int rows, int cols, int ld,
                                                              int rows_per_slab, float* partials,
                                                              unsigned int* tickets) {
  start_after_previous_kernel();
  __shared__ __align__(16) float red[kRowGroups][kTileCols];
  __shared__ bool last_block;
  const int tile = blockIdx.x, slab = blockIdx.y, slabs = gridDim.y;
  const int group = threadIdx.x / kLanesPerRow;                              // the row group: rows group + 16 i
  const int col = tile * kTileCols + threadIdx.x % kLanesPerRow * 8;         // this thread's first column
  const bool active = col < cols;
  const int row_end = min(rows, (slab + 1) * rows_per_slab);

  // The value this thread will add to, read now so that the finishing block does not wait for it at the end
  // (only the finishing block of this launch writes `out`, after every block has read it).
  const int out_col = tile * kTileCols + threadIdx.x;  // the column this thread finishes
  const bool finishes = threadIdx.x < kTileCols && out_col < cols;
  const float out_before = finishes ? out[out_col] : 0.0f;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active)
    for (int row = slab * rows_per_slab + group; row < row_end; row += kRowsInFlight * kRowGroups) {
      // Past the slab's end a thread reloads its last row (a cache hit) and drops it: no branch between the loads.
      uint4 v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        v[u] = load_packet_l2_128(x + static_cast<size_t>(min(row + u * kRowGroups, row_end - 1)) * ld + col);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (row + u * kRowGroups < row_end) {
          float f[8];
          unpack_bf16x8(f, v[u]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += f[i];
        }
    }
  const float slab_sum = sum_over_groups(red, acc);
  if (slabs == 1) {
    if (finishes) out[out_col] = out_before + slab_sum;
    return;
  }
  if (finishes) partials[static_cast<size_t>(slab) * cols + out_col] = slab_sum;
  __syncthreads();
  if (threadIdx.x == 0) last_block = ticket_add(&tickets[tile], 1u) == static_cast<unsigned int>(slabs - 1);
  __syncthreads();
  if (!last_block) return;

  // Row group g sums slabs g, g + 16, ... (all in one round of loads), then the groups meet in shared memory
  // as in the main pass. The partials of other blocks are read through L2 (__ldcg): this block's L1 never
  // held them.
  float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active) {
    float4 lo[kSlabsPerGroup], hi[kSlabsPerGroup];
#pragma unroll
    for (int u = 0; u < kSlabsPerGroup; ++u) {
      const size_t s = static_cast<size_t>(min(group + u * kRowGroups, slabs - 1));
      const float4* p = reinterpret_cast<const float4*>(partials + s * cols + col);
      lo[u] = __ldcg(p), hi[u] = __ldcg(p + 1);
    }
#pragma unroll
    for (int u = 0; u < kSlabsPerGroup; ++u)
      if (group + u * kRowGroups < slabs) {
        total[0] += lo[u].x, total[1] += lo[u].y, total[2] += lo[u].z, total[3] += lo[u].w;
        total[4] += hi[u].x, total[5] += hi[u].y, total[6] += hi[u].z, total[7] += hi[u].w;
      }
  }
  __syncthreads();  // every thread has read red[] of the main pass
  const float sum = sum_over_groups(red, total);
  if (finishes) out[out_col] = out_before + sum;
  if (threadIdx.x == 0) tickets[tile] = 0u;
}

}  // namespace

size_t column_sum_partials_floats(int max_cols) { return static_cast<size_t>(kMaxSlabs) * max_cols; }
size_t column_sum_tickets(int max_cols) {
  return static_cast<size_t>(std::max(2, (max_cols + kTileCols - 1) / kTileCols));
}

void column_sum(float* out, const bf16* x, int rows, int cols, int ld, const ColumnSumWorkspace& ws,
                cudaStream_t stream) {
  if (cols % 8 != 0 || ld % 8 != 0 || ld < cols || cols > ws.max_cols)
    throw std::invalid_argument("column_sum: cols (" + std::to_string(cols) + ") and ld (" + std::to_string(ld) +
                                ") must be multiples of 8 with cols <= ld and cols <= the workspace's " +
                                std::to_string(ws.max_cols));
  if (rows <= 0) return;
  const profile::Region region("column sum (bias gradient)", stream);
  const int tiles = (cols + kTileCols - 1) / kTileCols;
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, column_sum_kernel, kThreads, 0));
  const int target_slabs = std::max(1, std::max(1, per_sm) * sm_count() / tiles);
  const int slabs_wanted = std::max(1, std::min({target_slabs, rows / (kRowsInFlight * kRowGroups), kMaxSlabs}));
  const int rows_per_slab = (rows + slabs_wanted - 1) / slabs_wanted;
  const int slabs = (rows + rows_per_slab - 1) / rows_per_slab;
  launch_kernel(column_sum_kernel, after_previous(dim3(tiles, slabs), kThreads), stream, out, x, rows, cols, ld,
                rows_per_slab, ws.partials, ws.tickets);
}

}  // namespace coda::unfused
