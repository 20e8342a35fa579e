// The reference accumulators of a forward GEMM on random data, for the program tests of gpu_gemm_programs.cu
// and gpu_gemm_rope.cu.
#pragma once
#include <gtest/gtest.h>

#include <vector>

#include "kernels/gemm/gemm_instance.cuh"
#include "src/rng.hpp"
#include "tests/gemm_reference.cuh"
#include "tests/gpu_test_util.cuh"

namespace coda::test {

// Reference accumulators of a forward GEMM on random data, on the host.
struct ForwardProblem {
  int M, N, K;
  DeviceBuffer<__nv_bfloat16> X, W;
  std::vector<float> acc;
  ForwardProblem(int m, int n, int k) : M(m), N(n), K(k), X(size_t(m) * k), W(size_t(n) * k) {
    coda::testing::fill_uniform(X.get(), X.size(), 101);
    coda::testing::fill_uniform(W.get(), W.size(), 202);
    DeviceBuffer<float> ref(size_t(m) * n);
    coda::testing::reference_gemm(GemmLayout::Forward, ref.get(), X.get(), W.get(), m, n, k);
    acc = ref.download();
  }
};

inline std::vector<float> random_host(size_t n, float lo, float hi, unsigned seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = lo + (hi - lo) * static_cast<float>(rng.uniform());
  return v;
}

}  // namespace coda::test
