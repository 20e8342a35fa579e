// CODA_PROFILE=1: GPU time of every kernel launch of the trainer's kernels in both modes (the CODA programs,
// attention, the unfused kernels, cuBLASLt's GEMMs), aggregated by label and printed as a table when the
// process exits (sorted by total time). Each timed launch is bracketed by two CUDA events on its stream, so
// the numbers are device time, with the launches still asynchronous; the events cost ~2 us per launch, so
// use it to find where the time goes, not for the headline step time. Without the variable a region costs
// one cached getenv check. The table ends with the time per kind of work and the fusion bound (above Work).

#pragma once
#include <cuda_runtime.h>

#include <string>

namespace coda::profile {

bool enabled();

// Whether regions record (default: yes). `coda bench` turns it off for its warm-up steps, so that the table
// holds only the timed steps and not the first launches (module loading, cuBLASLt's plans).
void set_recording(bool on);

// In the unfused mode the time per kind answers how much any fusion can buy at these GEMM and attention
// speeds: the kernels of kind Epilogue (norms, activations, bias and residual adds, RoPE, bias gradients, the
// loss's forward pass) are what a CODA program moves into a GEMM epilogue, so a step whose epilogues cost
// nothing and whose GEMMs and attention ran as fast as these would take (total - epilogue work) of GPU time;
// the table prints total / (total - epilogue work), the most fusion can speed this step up (generous, if
// anything: the events' ~2 us per launch weigh most on the short epilogue kernels).
// What a kernel's time is spent on.
enum class Work {
  Gemm,       // a matrix product: cuBLASLt's, or the CODA GEMM with its epilogue program
  Attention,  // the attention kernels (in the coda mode with the write-out of dqkv)
  Epilogue,   // an unfused kernel of an operation that a CODA program runs in a GEMM epilogue
  Other,      // the rest: embedding, cross-entropy backward or dlogits, optimizer, coda's column-partial sums
};
constexpr int kWorkKinds = 4;

// Times the launches enqueued on `stream` between construction and destruction under `label`.
class Region {
 public:
  Region(std::string label, Work work, cudaStream_t stream);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

 private:
  std::string label_;
  Work work_;
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr;
};

// The table's last lines: the time per kind of work and, where there is epilogue work, the bound
// total / (total - epilogue work). `ms` is indexed by Work.
std::string work_summary(const double (&ms)[kWorkKinds]);

// A readable name of a type (demangled, namespaces of the epilogue dropped), for labels of templates.
std::string type_name(const char* mangled);

}  // namespace coda::profile
