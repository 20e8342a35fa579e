// Timing helpers shared by the benchmarks: median_ms (contenders interleaved run by run), median_ms_each
// (one contender, optionally after an L2 flush), median_millijoules (energy from the GPU's counter), and
// input rotation (rotation_sets) so that a run's operands are not still in L2 from the run before.
// Interleaving matters: under sustained load the card sits at its power cap and the SM clock drops, and
// timing contenders one after the other favoured whoever ran first by up to 20%. Details: above each below.

#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "kernels/common/cuda_check.cuh"
#include "src/energy.hpp"

namespace coda::bench {

// median_ms (bench_gemm, bench_programs): contenders of one shape run interleaved, run by run, so all of them
// see the same clocks. Each contender is a function of the run index i, which it uses to rotate between input
// sets (rotation_sets). CUDA events around each run after 5 warm-up rounds; the median.
// Median time in ms of each contender over `timed_runs` runs; contender j's run i is runs[j](i).
inline std::vector<double> median_ms(int timed_runs, const std::vector<std::function<void(int)>>& runs) {
  const int n = static_cast<int>(runs.size());
  for (int i = 0; i < 5; ++i)
    for (const auto& run : runs) run(i);
  std::vector<cudaEvent_t> ev(2 * timed_runs * n);
  for (auto& e : ev) CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < timed_runs; ++i)
    for (int j = 0; j < n; ++j) {
      CUDA_CHECK(cudaEventRecord(ev[2 * (i * n + j)]));
      runs[j](i);
      CUDA_CHECK(cudaEventRecord(ev[2 * (i * n + j) + 1]));
    }
  CUDA_CHECK(cudaEventSynchronize(ev.back()));
  std::vector<double> medians(n);
  for (int j = 0; j < n; ++j) {
    std::vector<float> ms(timed_runs);
    for (int i = 0; i < timed_runs; ++i)
      CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * (i * n + j)], ev[2 * (i * n + j) + 1]));
    std::nth_element(ms.begin(), ms.begin() + timed_runs / 2, ms.end());
    medians[j] = ms[timed_runs / 2];
  }
  for (auto& e : ev) CUDA_CHECK(cudaEventDestroy(e));
  return medians;
}

// median_millijoules (bench_programs): energy per run of each contender from the GPU's energy counter
// (src/energy.hpp). The counter sees the whole card, so each contender runs alone, in blocks of back-to-
// back runs of about a second, the contenders' blocks alternating (A B A B ...) so that all see the same
// clocks; the median over the blocks. The counter moves about every 100 ms and a block's interval runs
// from one update to another, so a block holds up to one period of idle card beside its runs: at a
// second of runs that is about 1% (blocks of 100 ms would read zero, one or two updates).
// Median millijoules per run of each contender, runs[j](i) taking about ms[j] milliseconds (median_ms);
// empty where the energy counter cannot be read.
inline std::vector<double> median_millijoules(const std::vector<std::function<void(int)>>& runs,
                                              const std::vector<double>& ms, int blocks = 3,
                                              double block_ms = 1000.0) {
  const std::unique_ptr<EnergyMeter> meter = EnergyMeter::for_current_device();
  if (meter == nullptr) return {};
  const int n = static_cast<int>(runs.size());
  std::vector<std::vector<double>> per_run(n);
  for (int b = 0; b < blocks; ++b)
    for (int j = 0; j < n; ++j) {
      const int count = std::max(1, static_cast<int>(std::ceil(block_ms / std::max(ms[j], 1e-3))));
      CUDA_CHECK(cudaDeviceSynchronize());
      meter->start();
      for (int i = 0; i < count; ++i) runs[j](i);
      CUDA_CHECK(cudaDeviceSynchronize());
      per_run[j].push_back(1e3 * meter->stop().joules / count);
    }
  std::vector<double> medians(n);
  for (int j = 0; j < n; ++j) {
    std::nth_element(per_run[j].begin(), per_run[j].begin() + blocks / 2, per_run[j].end());
    medians[j] = per_run[j][blocks / 2];
  }
  return medians;
}

// median_ms_each (bench_attention, bench_passes, bench_unfused_kernels): one contender, each run timed on
// its own, optionally after an untimed preparation such as L2Flush (a kernel's time with its inputs in
// DRAM, as in a training step where the tensors are far larger than the L2).
// Median ms over `timed_runs` runs of run(i), after `warmup` untimed ones; before(i), if given, runs
// ahead of each, outside the events.
inline double median_ms_each(const std::function<void(int)>& run, int timed_runs, int warmup,
                             const std::function<void(int)>& before = {}) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < warmup + timed_runs; ++i) {
    if (before) before(i);
    CUDA_CHECK(cudaEventRecord(start));
    run(i);
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    if (i >= warmup) ms.push_back(elapsed);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

// A 512 MB memset, ten times the H200's L2: called before a timed run, it evicts that run's inputs.
struct L2Flush {
  static constexpr size_t kBytes = size_t{512} << 20;
  void* buffer = nullptr;
  L2Flush() { CUDA_CHECK(cudaMalloc(&buffer, kBytes)); }
  ~L2Flush() { cudaFree(buffer); }
  L2Flush(const L2Flush&) = delete;
  L2Flush& operator=(const L2Flush&) = delete;
  void operator()(int i) const { CUDA_CHECK(cudaMemsetAsync(buffer, i & 0xff, kBytes)); }
};

// How many copies of a set of operands of `set_bytes` to rotate through so that the rotation holds at
// least 150 MB (three times the H200's 50 MB L2), at most 8.
inline int rotation_sets(size_t set_bytes) {
  return static_cast<int>(std::min<size_t>(8, std::max<size_t>(1, (size_t{150} << 20) / set_bytes + 1)));
}

}  // namespace coda::bench
