// Kernel launches with programmatic dependent launch (PDL) and, optionally, thread-block clusters (sm_90).
// A stream normally starts a kernel only after the previous grid has finished and been torn down: a fixed
// cost per launch that is a large share of a short memory-bound kernel. With PDL the next grid's blocks are
// scheduled early and park in griddepcontrol.wait until the previous grid has COMPLETED and its memory is
// visible, so the data order is exactly the stream's; only the launch and the block distribution overlap.
// Contract: a kernel launched with `after_previous` calls start_after_previous_kernel() before its first
// global memory access. Details: above start_after_previous_kernel() below.

#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "kernels/common/cuda_check.cuh"

namespace coda {

// A grid may be scheduled as soon as every block of the previous grid has called allow_next_kernel() (or
// exited); its blocks then take the multiprocessors' free slots and wait here. Calling this before the first
// global memory access (read or write) also keeps the order transitive: a grid cannot complete before its
// blocks have waited for the grid before it. A kernel that does not follow the contract must be launched
// without PDL (a plain <<<>>> launch, cuBLASLt, a memcpy: the stream order is then the usual one). Calling
// it in a kernel launched without PDL is harmless (the wait returns at once).
//
// Waits until the previous kernel of the stream has completed and its writes are visible, then lets the
// next kernel's blocks be scheduled (allowing it after the wait, not before, keeps at most one grid
// parked behind the running one).
__device__ __forceinline__ void start_after_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

struct LaunchShape {
  dim3 grid, block;
  size_t shared_bytes = 0;
  unsigned int cluster_x = 1;  // blocks per cluster along x (grid.x a multiple of it); 1: no clusters
  bool after_previous = false;  // PDL: the kernel calls start_after_previous_kernel() first
};

// The shape of a launch with PDL and no clusters.
inline LaunchShape after_previous(dim3 grid, dim3 block, size_t shared_bytes = 0) {
  return {grid, block, shared_bytes, 1, true};
}

// Launches kernel(args...) with `shape` on `stream` and checks the launch.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), const LaunchShape& shape, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = shape.grid;
  config.blockDim = shape.block;
  config.dynamicSmemBytes = shape.shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  unsigned int count = 0;
  if (shape.cluster_x > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = shape.cluster_x;
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  if (shape.after_previous) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace coda
