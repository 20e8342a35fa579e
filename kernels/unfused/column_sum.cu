// Column sums out[j] += sum_n x[n, j] of a bf16 matrix: the bias gradients (db = column sums of dY).
//
// The grid is (column tiles of 256, row slabs). In a block, lane l of each of the 8 warps owns 8
// adjacent columns (one 16-byte load per row) and the warps take interleaved rows of the slab, 16
// rows in flight at a time, all their loads issued before any is added (past the slab's end a
// lane reloads its last row and drops it, so no branch splits the loads); the warps' sums meet in shared
// memory and the slab's partial row goes to the workspace. Then each block takes an integer ticket for its
// column tile (one acquire-release atomic per block, see ticket_add in vec.cuh); the block that draws the
// last ticket sums the slabs' partials in slab order and adds them to `out`. The float additions therefore
// happen in an order fixed by the launch shape alone: results are bitwise reproducible. Slabs are sized so
// the grid is exactly the blocks that fit on the device at once: one wave (a second, partial wave of a few
// blocks cost 15% at [N, 2304]), and the last block's serial work stays short: it reads every slab's partial
// in one round of loads (12 per warp; 8, two rounds at the 88 slabs of [N, 768], cost 0.6 us more).
//
// What [N, 768] (GPT-2's 50 MB bias gradients) costs, H200, PDL launches back to back (docs/PERFORMANCE.md,
// session 5): the main pass with its partial stores 14.4 us (83% of 4.2 TB/s), the finish 1.9 us more (a
// ticket round trip to L2, one round of partial loads, the store), 16.4 us in all (73%). A deterministic
// cross-block sum needs those two L2 round trips after the last block's main pass; variants that shortened
// the chain (clusters summing 4 or 8 slabs through distributed shared memory first, whole rows per block,
// the partials as their own ready flags polled by one block: 21.7 us, session 12) were slower.
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

constexpr int kWarps = 8;
constexpr int kTileCols = 256;  // 32 lanes x 8 columns
constexpr int kMaxSlabs = 96;
constexpr int kRowsInFlight = 16;  // per warp (16 bytes per lane each)
constexpr int kSlabsInFlight = 12;  // per warp, when the last block sums the partials: all kMaxSlabs in one round

// One 16-byte packet of the summed matrix, with the L2 told to fetch the whole aligned 256 bytes around it
// from DRAM (.L2::256B: the warp wants all 512 bytes of its row piece anyway). Bitwise the same result;
// measured at [N, 768] 19.1 -> 18.5 us.
__device__ __forceinline__ uint4 load_packet_l2_256(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A lane's 8 partial sums of one slab (two 16-byte loads), kept as loaded until they are added.
struct PartialPacket {
  float4 a, b;
  __device__ __forceinline__ void add_to(float (&acc)[8]) const {
    acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w, acc[4] += b.x, acc[5] += b.y, acc[6] += b.z,
        acc[7] += b.w;
  }
};

// Each thread t of the block returns the sum over warps of column t of the per-warp values.
__device__ __forceinline__ float sum_over_warps(float (&red)[kWarps][kTileCols], const float (&acc)[8]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  store_f32x8(&red[warp][lane * 8], acc);
  __syncthreads();
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red[w][threadIdx.x];
  return sum;
}

__global__ void __launch_bounds__(kWarps * 32) column_sum_kernel(float* out, const bf16* x, int rows, int cols, int ld,
                                                                 int rows_per_slab, float* partials,
                                                                 unsigned int* tickets) {
  start_after_previous_kernel();
  __shared__ __align__(16) float red[kWarps][kTileCols];
  __shared__ bool last_block;
  const int tile = blockIdx.x, slab = blockIdx.y, slabs = gridDim.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col = tile * kTileCols + lane * 8;  // this lane's first column
  const bool active = col < cols;
  const int row_end = min(rows, (slab + 1) * rows_per_slab);

  // The value this thread will add to, read now so that the finishing block does not wait for it at the end
  // (only the finishing block of this launch writes `out`, after every block has read it).
  const int out_col = tile * kTileCols + threadIdx.x;  // the column this thread finishes
  const float out_before = out_col < cols ? out[out_col] : 0.0f;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active)
    for (int row = slab * rows_per_slab + warp; row < row_end; row += kRowsInFlight * kWarps) {
      // Past the slab's end a lane reloads its last row (a cache hit) and drops it: no branch between the loads.
      uint4 v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        v[u] = load_packet_l2_256(x + static_cast<size_t>(min(row + u * kWarps, row_end - 1)) * ld + col);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (row + u * kWarps < row_end) {
          float f[8];
          unpack_bf16x8(f, v[u]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += f[i];
        }
    }
  const float slab_sum = sum_over_warps(red, acc);
  if (slabs == 1) {
    if (out_col < cols) out[out_col] = out_before + slab_sum;
    return;
  }
  if (out_col < cols) partials[static_cast<size_t>(slab) * cols + out_col] = slab_sum;
  __syncthreads();
  if (threadIdx.x == 0) last_block = ticket_add(&tickets[tile], 1u) == static_cast<unsigned int>(slabs - 1);
  __syncthreads();
  if (!last_block) return;

  // The partials of other blocks are read through L2 (__ldcg): this block's L1 never held them.
  float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active)
    for (int s = warp; s < slabs; s += kSlabsInFlight * kWarps) {
      PartialPacket v[kSlabsInFlight];
#pragma unroll
      for (int u = 0; u < kSlabsInFlight; ++u) {
        const size_t slab_row = static_cast<size_t>(min(s + u * kWarps, slabs - 1));
        const float4* p = reinterpret_cast<const float4*>(partials + slab_row * cols + col);
        v[u].a = __ldcg(p), v[u].b = __ldcg(p + 1);
      }
#pragma unroll
      for (int u = 0; u < kSlabsInFlight; ++u)
        if (s + u * kWarps < slabs) v[u].add_to(total);
    }
  __syncthreads();  // every thread has read red[] of the first round
  const float sum = sum_over_warps(red, total);
  if (out_col < cols) out[out_col] = out_before + sum;
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
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, column_sum_kernel, kWarps * 32, 0));
  const int target_slabs = std::max(1, std::max(1, per_sm) * sm_count() / tiles);
  const int slabs_wanted = std::max(1, std::min({target_slabs, rows / (kRowsInFlight * kWarps), kMaxSlabs}));
  const int rows_per_slab = (rows + slabs_wanted - 1) / slabs_wanted;
  const int slabs = (rows + rows_per_slab - 1) / rows_per_slab;
  launch_kernel(column_sum_kernel, after_previous(dim3(tiles, slabs), kWarps * 32), stream, out, x, rows, cols, ld,
                rows_per_slab, ws.partials, ws.tickets);
}

}  // namespace coda::unfused
