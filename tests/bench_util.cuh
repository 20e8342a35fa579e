// Timing helpers shared by the benchmarks (bench_gemm, bench_programs).
//
// Contenders of one shape run interleaved, run by run, so all of them see the same clocks: under sustained
// load the card sits at its power cap and the SM clock drops, and timing contenders one after the other
// favoured whoever ran first by up to 20%. Each contender is a function of the run index i, which it uses
// to rotate between input sets (rotation_sets) so that its operands are not still in L2 from the run
// before. CUDA events around each run after 5 warm-up rounds; the median.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "kernels/cuda_check.cuh"

namespace coda::bench {

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

// How many copies of a set of operands of `set_bytes` to rotate through so that the rotation holds at
// least 150 MB (three times the H200's 50 MB L2), at most 8.
inline int rotation_sets(size_t set_bytes) {
  return static_cast<int>(std::min<size_t>(8, std::max<size_t>(1, (size_t{150} << 20) / set_bytes + 1)));
}

}  // namespace coda::bench
