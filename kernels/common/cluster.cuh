// Thread-block clusters for deterministic reductions split over several blocks (Hopper, sm_90).
// Some kernels split one reduction over several blocks to have enough blocks in flight: dlogits splits
// each row over column slices (its row dots), the column-partial kernels split each column over slices
// of the row groups (kernels/coda), the unfused column sum of a narrow matrix splits each column over
// row slabs (kernels/unfused/column_sum.cu). Instead of float atomics, a second launch or a global
// workspace, the blocks that share a reduction form one cluster along x (grid.x = the cluster size: at
// most 8, the portable limit, through launch_clustered; column_sum's 16 are the non-portable maximum),
// each leaves its partial in its own shared memory, and after a cluster barrier the block that owns a
// result reads the cluster's partials through distributed shared memory in rank order: the result
// depends on the launch shape only, so it is bitwise reproducible.

#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/common/launch.cuh"

namespace coda {

constexpr int kMaxClusterBlocks = 8;

// Sum over the cluster's blocks, in rank order, of the shared-memory value at `local` (this block's
// address of it). Call between two cluster barriers: after the one that publishes the partials and
// before the one that lets their owners exit. kMaxBlocks bounds the cluster's size at compile time, so
// that every block's value is requested before the first is added.
template <int kMaxBlocks = kMaxClusterBlocks>
__device__ __forceinline__ float sum_over_cluster(float* local) {
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const unsigned int blocks = cluster.num_blocks();
  float values[kMaxBlocks];
#pragma unroll
  for (unsigned int rank = 0; rank < kMaxBlocks; ++rank)
    if (rank < blocks) values[rank] = *cluster.map_shared_rank(local, rank);
  float sum = 0.0f;
#pragma unroll
  for (unsigned int rank = 0; rank < kMaxBlocks; ++rank)
    if (rank < blocks) sum += values[rank];
  return sum;
}

// Launches kernel on a grid (cluster_blocks, blocks_y) of `threads`-thread blocks in clusters of
// (cluster_blocks, 1, 1) with PDL (kernels/common/launch.cuh: the kernel calls start_after_previous_kernel()
// before its first global memory access), and checks the launch.
template <typename... Params, typename... Args>
void launch_clustered(void (*kernel)(Params...), int cluster_blocks, int blocks_y, int threads, cudaStream_t stream,
                      Args&&... args) {
  if (blocks_y > 65535)
    throw std::invalid_argument("launch_clustered: " + std::to_string(blocks_y) + " blocks along y exceed 65535");
  launch_kernel(kernel,
                {dim3(static_cast<unsigned int>(cluster_blocks), static_cast<unsigned int>(blocks_y)),
                 dim3(static_cast<unsigned int>(threads)), 0, static_cast<unsigned int>(cluster_blocks), true},
                stream, std::forward<Args>(args)...);
}

}  // namespace coda
