// Error checking for every CUDA runtime, driver and cuBLASLt call: a failed call throws
// std::runtime_error with the call, file and line, so host code can report it and exit cleanly.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace coda {

[[noreturn]] inline void cuda_fail(const std::string& what, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + what);
}

// True when at least one CUDA device is usable (GPU tests skip themselves otherwise).
inline bool cuda_device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace coda

#define CUDA_CHECK(call)                                                                      \
  do {                                                                                        \
    const cudaError_t cuda_check_status_ = (call);                                            \
    if (cuda_check_status_ != cudaSuccess)                                                    \
      ::coda::cuda_fail(cudaGetErrorString(cuda_check_status_), #call, __FILE__, __LINE__);    \
  } while (0)

// After every kernel launch.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
