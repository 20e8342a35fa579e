// A host array of floats that the device copies into: page-locked (cudaMallocHost) where a GPU is present,
// so a device-to-host copy of the whole model state (15 GB for llama3.2-1b with its AdamW moments) runs at
// the link's speed instead of through the driver's pageable staging, and the training thread that waits
// for it is back sooner. Pageable where there is no GPU, or where the page-locked allocation fails (a
// warning says so). Allocated on the first resize to a new size and kept: reusing it costs nothing.
#pragma once
#include <cstddef>

namespace coda {

class HostFloats {
 public:
  HostFloats() = default;
  ~HostFloats();
  HostFloats(const HostFloats&) = delete;
  HostFloats& operator=(const HostFloats&) = delete;

  void resize(size_t count);  // contents are not kept across a change of size
  float* data() const { return data_; }
  size_t size() const { return size_; }
  bool pinned() const { return pinned_; }

 private:
  void release();
  float* data_ = nullptr;
  size_t size_ = 0;
  bool pinned_ = false;
};

}  // namespace coda
