// See kernel_profile.cuh.
#include "kernels/common/kernel_profile.cuh"

#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/common/cuda_check.cuh"

namespace coda::profile {
namespace {

struct Record {
  std::string label;
  Work work;
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
    double all = 0.0, by_work[kWorkKinds] = {};
    for (const Record& r : records_) {
      float ms = 0.0f;
      if (cudaEventSynchronize(r.end) != cudaSuccess || cudaEventElapsedTime(&ms, r.start, r.end) != cudaSuccess)
        continue;
      totals[r.label].calls++;
      totals[r.label].ms += ms;
      by_work[static_cast<int>(r.work)] += ms;
      all += ms;
    }
    std::vector<std::pair<std::string, Total>> rows(totals.begin(), totals.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    std::printf("\nCODA_PROFILE: GPU time by kernel (%.2f ms in %zu launches)\n", all, records_.size());
    std::printf("%10s %6s %10s %6s  %s\n", "total ms", "calls", "us/call", "share", "kernel");
    for (const auto& [label, t] : rows)
      std::printf("%10.3f %6d %10.1f %5.1f%%  %s\n", t.ms, t.calls, 1e3 * t.ms / t.calls, 100.0 * t.ms / all,
                  label.c_str());
    std::printf("%s", work_summary(by_work).c_str());
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

const char* work_name(Work work) {
  switch (work) {
    case Work::Gemm: return "GEMMs";
    case Work::Attention: return "attention";
    case Work::Epilogue: return "unfused epilogue operations";
    case Work::Other: return "other";
  }
  return "?";
}

}  // namespace

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CODA_PROFILE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return on;
}

void set_recording(bool on) { recording = on; }

std::string work_summary(const double (&ms)[kWorkKinds]) {
  double all = 0.0;
  for (double t : ms) all += t;
  if (all <= 0.0) return "";
  std::string out = "by kind of work:";
  char line[160];
  for (int w = 0; w < kWorkKinds; ++w) {
    std::snprintf(line, sizeof line, "%s %s %.3f ms (%.1f%%)", w == 0 ? "" : ",", work_name(static_cast<Work>(w)),
                  ms[w], 100.0 * ms[w] / all);
    out += line;
  }
  out += "\n";
  const double epilogue = ms[static_cast<int>(Work::Epilogue)];
  if (epilogue > 0.0 && epilogue < all) {
    std::snprintf(line, sizeof line,
                  "fusion bound: with free epilogues and these GEMMs and attention, at most %.3fx faster\n",
                  all / (all - epilogue));
    out += line;
  }
  return out;
}

Region::Region(std::string label, Work work, cudaStream_t stream)
    : label_(std::move(label)), work_(work), stream_(stream) {
  if (!enabled() || !recording) return;
  registry();  // constructed before any event, so destroyed after the records are complete
  CUDA_CHECK(cudaEventCreate(&start_));
  CUDA_CHECK(cudaEventRecord(start_, stream_));
}

Region::~Region() {
  if (start_ == nullptr) return;
  cudaEvent_t end = nullptr;
  if (cudaEventCreate(&end) != cudaSuccess || cudaEventRecord(end, stream_) != cudaSuccess) return;
  registry().add({std::move(label_), work_, start_, end});
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
