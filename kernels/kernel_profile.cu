// See kernel_profile.cuh.
#include "kernels/kernel_profile.cuh"

#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/cuda_check.cuh"

namespace coda::profile {
namespace {

struct Record {
  std::string label;
  cudaEvent_t start, end;
};

// Collects the records and prints the table at exit (the CUDA context is still alive then: this object is
// destroyed in static destruction order, before the runtime's teardown of an exiting process).
class Registry {
 public:
  void add(Record r) {
    std::lock_guard<std::mutex> lock(mutex_);
    records_.push_back(std::move(r));
  }
  ~Registry() {
    if (records_.empty()) return;
    struct Total {
      int calls = 0;
      double ms = 0.0;
    };
    std::map<std::string, Total> totals;
    double all = 0.0;
    for (const Record& r : records_) {
      float ms = 0.0f;
      if (cudaEventSynchronize(r.end) != cudaSuccess || cudaEventElapsedTime(&ms, r.start, r.end) != cudaSuccess)
        continue;
      totals[r.label].calls++;
      totals[r.label].ms += ms;
      all += ms;
    }
    std::vector<std::pair<std::string, Total>> rows(totals.begin(), totals.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    std::printf("\nCODA_PROFILE: GPU time by kernel (%.2f ms in %zu launches)\n", all, records_.size());
    std::printf("%10s %6s %10s %6s  %s\n", "total ms", "calls", "us/call", "share", "kernel");
    for (const auto& [label, t] : rows)
      std::printf("%10.3f %6d %10.1f %5.1f%%  %s\n", t.ms, t.calls, 1e3 * t.ms / t.calls, 100.0 * t.ms / all,
                  label.c_str());
  }

 private:
  std::mutex mutex_;
  std::vector<Record> records_;
};

Registry& registry() {
  static Registry r;
  return r;
}

std::atomic<bool> recording{true};

}  // namespace

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CODA_PROFILE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return on;
}

void set_recording(bool on) { recording = on; }

Region::Region(std::string label, cudaStream_t stream) : label_(std::move(label)), stream_(stream) {
  if (!enabled() || !recording) return;
  registry();  // constructed before any event, so destroyed after the records are complete
  CUDA_CHECK(cudaEventCreate(&start_));
  CUDA_CHECK(cudaEventRecord(start_, stream_));
}

Region::~Region() {
  if (start_ == nullptr) return;
  cudaEvent_t end = nullptr;
  if (cudaEventCreate(&end) != cudaSuccess || cudaEventRecord(end, stream_) != cudaSuccess) return;
  registry().add({std::move(label_), start_, end});
}

std::string type_name(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  std::string name = status == 0 ? demangled.get() : mangled;
  for (const std::string drop : {"coda::epi::", "coda::prog::", "coda::", "__nv_bfloat16"}) {
    for (size_t at = name.find(drop); at != std::string::npos; at = name.find(drop, at))
      name.replace(at, drop.size(), drop == "__nv_bfloat16" ? "bf16" : "");
  }
  return name;
}

}  // namespace coda::profile
