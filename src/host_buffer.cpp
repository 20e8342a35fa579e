// Page-locked host arrays; see host_buffer.hpp.
#include "host_buffer.hpp"

#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <new>

#include "kernels/common/cuda_check.cuh"

namespace coda {

HostFloats::~HostFloats() { release(); }

void HostFloats::release() {
  if (pinned_)
    cudaFreeHost(data_);  // teardown: an error here cannot be reported usefully
  else
    delete[] data_;
  data_ = nullptr;
  size_ = 0;
  pinned_ = false;
}

void HostFloats::resize(size_t count) {
  if (count == size_) return;
  release();
  if (count == 0) return;
  if (cuda_device_available()) {
    void* p = nullptr;
    const cudaError_t e = cudaMallocHost(&p, count * sizeof(float));
    if (e == cudaSuccess) {
      data_ = static_cast<float*>(p), size_ = count, pinned_ = true;
      return;
    }
    cudaGetLastError();  // clear the error: the pageable fallback below is the answer to it
    spdlog::warn("page-locked host buffer of {:.2f} GiB failed ({}); using pageable memory (slower copies)",
                 static_cast<double>(count * sizeof(float)) / (1 << 30), cudaGetErrorString(e));
  }
  data_ = new float[count];
  size_ = count;
}

}  // namespace coda
