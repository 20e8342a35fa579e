// Column sums out[j] += sum_n x[n, j]: bias gradients (db = column sums of dY) and the finishing step of
// every per-block partial (norm dgamma / dbeta).
//
// The grid is (column tiles of 256, row slabs, matrices). In a block, lane l of each of the 8 warps owns 8
// adjacent columns (one 16-byte load per row) and the warps take interleaved rows of the slab, eight rows
// in flight at a time; the warps' sums meet in shared memory and the slab's partial row goes to the
// workspace. Then each block takes an integer ticket for its column tile; the block that draws the last
// ticket sums the slabs' partials in slab order and adds them to `out`. The float additions therefore
// happen in an order fixed by the launch shape alone: results are bitwise reproducible. Slabs are sized so
// the grid holds about 16 warps per multiprocessor (with 8 rows in flight per warp, enough bytes to
// saturate memory) while keeping the last block's serial work short.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "kernels/unfused/vec.cuh"

namespace coda::unfused {

namespace {

constexpr int kWarps = 8;
constexpr int kTileCols = 256;  // 32 lanes x 8 columns
constexpr int kMaxSlabs = 128;
constexpr int kMaxMatrices = 2;
constexpr int kRowsInFlight = 8;

__device__ __forceinline__ void load8(float (&out)[8], const bf16* p) { load_bf16x8(out, p); }
__device__ __forceinline__ void load8(float (&out)[8], const float* p) { load_f32x8(out, p); }

// The matrices of one launch (blockIdx.z picks one).
template <typename T>
struct Matrices {
  float* out[kMaxMatrices];
  const T* x[kMaxMatrices];
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

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) column_sum_kernel(Matrices<T> matrices, int rows, int cols, int ld,
                                                                 int rows_per_slab, float* partials,
                                                                 unsigned int* tickets) {
  __shared__ __align__(16) float red[kWarps][kTileCols];
  __shared__ bool last_block;
  const int tile = blockIdx.x, slab = blockIdx.y, slabs = gridDim.y, matrix = blockIdx.z;
  const T* x = matrix == 0 ? matrices.x[0] : matrices.x[1];  // no dynamic index into the parameter
  float* out = matrix == 0 ? matrices.out[0] : matrices.out[1];
  partials += static_cast<size_t>(matrix) * slabs * cols;
  tickets += static_cast<size_t>(matrix) * gridDim.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col = tile * kTileCols + lane * 8;  // this lane's first column
  const bool active = col < cols;
  const int row_end = min(rows, (slab + 1) * rows_per_slab);

  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active) {
    int row = slab * rows_per_slab + warp;
    for (; row + (kRowsInFlight - 1) * kWarps < row_end; row += kRowsInFlight * kWarps) {
      float v[kRowsInFlight][8];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) load8(v[u], x + static_cast<size_t>(row + u * kWarps) * ld + col);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += v[u][i];
    }
    for (; row < row_end; row += kWarps) {
      float v[8];
      load8(v, x + static_cast<size_t>(row) * ld + col);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
  }
  const int out_col = tile * kTileCols + threadIdx.x;  // the column this thread finishes
  const float slab_sum = sum_over_warps(red, acc);
  if (slabs == 1) {
    if (out_col < cols) out[out_col] += slab_sum;
    return;
  }
  if (out_col < cols) partials[static_cast<size_t>(slab) * cols + out_col] = slab_sum;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_block = atomicAdd(&tickets[tile], 1u) == static_cast<unsigned int>(slabs - 1);
  __syncthreads();
  if (!last_block) return;
  __threadfence();

  // The partials of other blocks are read through L2 (__ldcg): this block's L1 never held them.
  float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active) {
    int s = warp;
    for (; s + 3 * kWarps < slabs; s += 4 * kWarps) {
      float4 v[4][2];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float4* p = reinterpret_cast<const float4*>(partials + static_cast<size_t>(s + u * kWarps) * cols + col);
        v[u][0] = __ldcg(p), v[u][1] = __ldcg(p + 1);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        total[0] += v[u][0].x, total[1] += v[u][0].y, total[2] += v[u][0].z, total[3] += v[u][0].w;
        total[4] += v[u][1].x, total[5] += v[u][1].y, total[6] += v[u][1].z, total[7] += v[u][1].w;
      }
    }
    for (; s < slabs; s += kWarps) {
      const float4* p = reinterpret_cast<const float4*>(partials + static_cast<size_t>(s) * cols + col);
      const float4 a = __ldcg(p), b = __ldcg(p + 1);
      total[0] += a.x, total[1] += a.y, total[2] += a.z, total[3] += a.w;
      total[4] += b.x, total[5] += b.y, total[6] += b.z, total[7] += b.w;
    }
  }
  __syncthreads();  // every thread has read red[] of the first round
  const float sum = sum_over_warps(red, total);
  if (out_col < cols) out[out_col] += sum;
  if (threadIdx.x == 0) tickets[tile] = 0u;
}

template <typename T>
void launch_column_sum(const Matrices<T>& matrices, int count, int rows, int cols, int ld,
                       const ColumnSumWorkspace& ws, cudaStream_t stream) {
  if (cols % 8 != 0 || ld % 8 != 0 || ld < cols || cols > ws.max_cols)
    throw std::invalid_argument("column_sum: cols (" + std::to_string(cols) + ") and ld (" + std::to_string(ld) +
                                ") must be multiples of 8 with cols <= ld and cols <= the workspace's " +
                                std::to_string(ws.max_cols));
  if (rows <= 0) return;
  const int tiles = (cols + kTileCols - 1) / kTileCols;
  const int target_slabs = (sm_count() * 16 + count * tiles * kWarps - 1) / (count * tiles * kWarps);
  const int slabs_wanted = std::max(1, std::min({target_slabs, rows / (kRowsInFlight * kWarps), kMaxSlabs}));
  const int rows_per_slab = (rows + slabs_wanted - 1) / slabs_wanted;
  const int slabs = (rows + rows_per_slab - 1) / rows_per_slab;
  column_sum_kernel<T><<<dim3(tiles, slabs, count), kWarps * 32, 0, stream>>>(matrices, rows, cols, ld, rows_per_slab,
                                                                             ws.partials, ws.tickets);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t column_sum_partials_floats(int max_cols) { return static_cast<size_t>(kMaxMatrices) * kMaxSlabs * max_cols; }
size_t column_sum_tickets(int max_cols) {
  return static_cast<size_t>(kMaxMatrices) * ((max_cols + kTileCols - 1) / kTileCols);
}

void column_sum(float* out, const bf16* x, int rows, int cols, int ld, const ColumnSumWorkspace& ws,
                cudaStream_t stream) {
  launch_column_sum(Matrices<bf16>{{out, nullptr}, {x, nullptr}}, 1, rows, cols, ld, ws, stream);
}

void column_sum(float* out, const float* x, int rows, int cols, int ld, const ColumnSumWorkspace& ws,
                cudaStream_t stream) {
  launch_column_sum(Matrices<float>{{out, nullptr}, {x, nullptr}}, 1, rows, cols, ld, ws, stream);
}

void column_sum2(float* out0, const float* x0, float* out1, const float* x1, int rows, int cols, int ld,
                 const ColumnSumWorkspace& ws, cudaStream_t stream) {
  launch_column_sum(Matrices<float>{{out0, out1}, {x0, x1}}, 2, rows, cols, ld, ws, stream);
}

}  // namespace coda::unfused
