// CODA_PROFILE=1: GPU time of every kernel launch of the trainer's kernels in both modes (the CODA programs,
// attention, the unfused kernels, cuBLASLt's GEMMs), aggregated by label and printed as a table when the
// process exits (sorted by total time). Each timed launch is bracketed by two CUDA events on its stream, so
// the numbers are device time, with the launches still asynchronous; the events cost ~2 us per launch, so
// use it to find where the time goes, not for the headline step time.
// Without the variable a region costs one cached getenv check.
#pragma once
#include <cuda_runtime.h>

#include <string>

namespace coda::profile {

bool enabled();

// Whether regions record (default: yes). `coda bench` turns it off for its warm-up steps, so that the table
// holds only the timed steps and not the first launches (module loading, cuBLASLt's plans).
void set_recording(bool on);

// Times the launches enqueued on `stream` between construction and destruction under `label`.
class Region {
 public:
  Region(std::string label, cudaStream_t stream);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

 private:
  std::string label_;
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr;
};

// A readable name of a type (demangled, namespaces of the epilogue dropped), for labels of templates.
std::string type_name(const char* mangled);

}  // namespace coda::profile
