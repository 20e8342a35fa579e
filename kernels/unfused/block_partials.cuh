// Per-block partial rows (column sums of a block's share of the rows) finished in the launch that wrote
// them: the norm backwards' dw/db and the bias gradients (column_sum).
//
// Every block writes its partial row and takes an integer ticket. The last `finishers` blocks to take one
// wait until every block has, then each sums slices of 32 columns over all partial rows, in row order,
// and adds them to the output. No float atomics: the order of the additions depends on the launch shape
// only, so results are bitwise reproducible. The alternatives cost more: a second launch costs 2.5-3 us,
// and a single last block that sums everything serializes the reads of all partials in one SM.
// Waiting is safe because every grid that uses this never exceeds the blocks that fit on the device at
// once: a waiting block never keeps a block it waits for from starting.
#pragma once
#include <cuda_runtime.h>

namespace coda::unfused {

// partials: [stats][partial_rows][cols] fp32; out[s][c] += sum over r of partials[s][r][c], for out[0]
// and (stats == 2) out[1]. The caller's threads have written their partials; every thread of every block
// of the grid calls this (it contains __syncthreads). counters: two unsigned ints, zero at entry and left
// zero. scratch: blockDim.x float4 of shared memory that the caller no longer reads. blockDim.x is a
// multiple of 8.
__device__ __forceinline__ void finish_block_partials(const float* partials, int partial_rows, int stats, int cols,
                                                      float* out0, float* out1, unsigned int* counters,
                                                      float4* scratch) {
  __shared__ unsigned int ticket;
  const unsigned int blocks = gridDim.x * gridDim.y * gridDim.z;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicAdd(&counters[0], 1u);
  __syncthreads();
  const int slices = (stats * cols + 31) / 32, finishers = min(static_cast<int>(blocks), slices);
  const int finisher = static_cast<int>(ticket) - (static_cast<int>(blocks) - finishers);
  if (finisher < 0) return;
  if (threadIdx.x == 0)
    while (*reinterpret_cast<volatile unsigned int*>(&counters[0]) < blocks) __nanosleep(64);
  __syncthreads();
  __threadfence();
  // Thread (part, q) sums float4 q of the slice over partial rows part, part + parts, ... (read through
  // L2: this block's L1 never held the other blocks' rows); then part 0 adds the parts in order.
  const int q = threadIdx.x % 8, part = threadIdx.x / 8, parts = blockDim.x / 8;
  for (int slice = finisher; slice < slices; slice += finishers) {
    const int c = slice * 32 + 4 * q, stat = c / cols, col = c % cols;
    const bool valid = c < stats * cols;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (valid)
#pragma unroll 4
      for (int r = part; r < partial_rows; r += parts) {
        const float4 v =
            __ldcg(reinterpret_cast<const float4*>(partials + (static_cast<size_t>(stat) * partial_rows + r) * cols + col));
        acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
      }
    scratch[part * 8 + q] = acc;
    __syncthreads();
    if (part == 0 && valid) {
      float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int p = 0; p < parts; ++p) {
        const float4 v = scratch[p * 8 + q];
        total.x += v.x, total.y += v.y, total.z += v.z, total.w += v.w;
      }
      float* out = (stat == 0 ? out0 : out1) + col;
      out[0] += total.x, out[1] += total.y, out[2] += total.z, out[3] += total.w;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && atomicAdd(&counters[1], 1u) == static_cast<unsigned int>(finishers - 1)) {
    counters[0] = 0u;
    counters[1] = 0u;
  }
}

}  // namespace coda::unfused
