// Column sums out[j] += sum_n x[n, j] of a bf16 matrix: the bias gradients (db = column sums of dY).
//
// The rows are cut into slabs of consecutive rows, one block per slab, so that a block streams one
// contiguous stretch of memory. A block spans whole rows: a row lane of cols/8 threads (rounded up to
// whole warps, at most 512: wider matrices get a second grid dimension of column tiles) owns 8 adjacent
// columns per thread, and the block's row lanes take interleaved rows of the slab, 16 rows in flight per
// thread, all their loads issued before any is added (past the slab's end a thread reloads its last row
// and drops it, so no branch splits the loads). The row lanes' sums meet in shared memory in lane order,
// each block writes its slab's partial row, and the last blocks to finish sum the partial rows in slab
// order in the same launch (block_partials.cuh): bitwise reproducible, no float atomics. The grid is
// exactly the blocks that fit on the device at once (one wave, and the in-kernel finish relies on it).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/unfused/block_partials.cuh"
#include "kernels/unfused/unfused.cuh"
#include "kernels/unfused/vec.cuh"

namespace coda::unfused {

namespace {

constexpr int kMaxThreads = 512;   // per block
constexpr int kRowsInFlight = 16;  // per thread (16 bytes each)
constexpr int kMaxSlabs = 512;

// partials: [slabs][cols]; blockIdx.x is the slab, blockIdx.y the column tile of tile_cols columns.
__global__ void __launch_bounds__(kMaxThreads) column_sum_kernel(float* out, const bf16* x, int rows, int cols, int ld,
                                                                 int lane_threads, int rows_per_slab, float* partials,
                                                                 unsigned int* counters) {
  __shared__ __align__(16) float lane_sums[kMaxThreads * 8];  // [lanes][tile columns]
  const int lanes = blockDim.x / lane_threads, lane = threadIdx.x / lane_threads, t = threadIdx.x % lane_threads;
  const int tile_cols = 8 * lane_threads, tile_begin = blockIdx.y * tile_cols;
  const int tile_width = min(tile_cols, cols - tile_begin);
  const int col = tile_begin + 8 * t;  // this thread's first column
  const bool active = 8 * t < tile_width;
  const int row_begin = blockIdx.x * rows_per_slab, row_end = min(rows, row_begin + rows_per_slab);

  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active)
    for (int row = row_begin + lane; row < row_end; row += kRowsInFlight * lanes) {
      uint4 v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        v[u] = load_packet(x + static_cast<size_t>(min(row + u * lanes, row_end - 1)) * ld + col);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (row + u * lanes < row_end) {
          float f[8];
          unpack_bf16x8(f, v[u]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += f[i];
        }
    }
  if (active) store_f32x8(lane_sums + lane * tile_width + 8 * t, acc);
  __syncthreads();
  for (int c = threadIdx.x; c < tile_width; c += blockDim.x) {
    float sum = 0.0f;
    for (int l = 0; l < lanes; ++l) sum += lane_sums[l * tile_width + c];
    partials[static_cast<size_t>(blockIdx.x) * cols + tile_begin + c] = sum;
  }
  finish_block_partials(partials, gridDim.x, 1, cols, out, nullptr, counters, reinterpret_cast<float4*>(lane_sums));
}

}  // namespace

size_t column_sum_partials_floats(int max_cols) { return static_cast<size_t>(kMaxSlabs) * max_cols; }
size_t column_sum_tickets(int) { return 2; }

void column_sum(float* out, const bf16* x, int rows, int cols, int ld, const ColumnSumWorkspace& ws,
                cudaStream_t stream) {
  if (cols % 8 != 0 || ld % 8 != 0 || ld < cols || cols > ws.max_cols)
    throw std::invalid_argument("column_sum: cols (" + std::to_string(cols) + ") and ld (" + std::to_string(ld) +
                                ") must be multiples of 8 with cols <= ld and cols <= the workspace's " +
                                std::to_string(ws.max_cols));
  if (rows <= 0) return;
  const int lane_threads = std::min(kMaxThreads, (cols / 8 + 31) / 32 * 32);
  const int lanes = kMaxThreads / lane_threads, threads = lanes * lane_threads;
  const int tiles = (cols + 8 * lane_threads - 1) / (8 * lane_threads);
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, column_sum_kernel, threads, 0));
  const int slabs_wanted = std::max(1, std::min({std::max(1, per_sm) * sm_count() / tiles, kMaxSlabs,
                                                 (rows + lanes - 1) / lanes}));
  const int rows_per_slab = (rows + slabs_wanted - 1) / slabs_wanted;
  const int slabs = (rows + rows_per_slab - 1) / rows_per_slab;
  column_sum_kernel<<<dim3(slabs, tiles), threads, 0, stream>>>(out, x, rows, cols, ld, lane_threads, rows_per_slab,
                                                                ws.partials, ws.tickets);
  CUDA_CHECK_LAUNCH();
}

}  // namespace coda::unfused
