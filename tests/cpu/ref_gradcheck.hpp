// Finite-difference gradient checks for the CPU reference tests.
//
// A function f with outputs y is checked through the scalar loss L = sum_i r_i y_i for a random
// projection r, accumulated in double: its gradient w.r.t. y is r, so the analytic gradient of L w.r.t.
// an input is the op's backward applied to dy = r. The numeric gradient is the central difference
// (L(x + eps) - L(x - eps)) / (2 eps) on chosen entries of x, divided by the step actually representable
// in fp32. Agreement is measured as a relative norm over all checked entries.
// Analytic gradients are taken from buffers pre-filled with random values (GradBuffer), so every check
// also checks that backward functions ADD into their outputs.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "rng.hpp"

namespace coda::test {

inline std::vector<float> random_vector(size_t n, Rng& rng, float stddev = 1.0f, float mean = 0.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = mean + stddev * static_cast<float>(rng.normal());
  return v;
}

// sum_i r_i y_i in double.
inline double project(const float* y, const std::vector<float>& r) {
  double sum = 0.0;
  for (size_t i = 0; i < r.size(); ++i) sum += static_cast<double>(r[i]) * y[i];
  return sum;
}

// A gradient output pre-filled with random values; added() is what a backward call added to it.
struct GradBuffer {
  GradBuffer(size_t n, Rng& rng) : base(random_vector(n, rng)), data(base) {}
  float* ptr() { return data.data(); }
  std::vector<float> added() const {
    std::vector<float> out(data.size());
    for (size_t i = 0; i < data.size(); ++i) out[i] = data[i] - base[i];
    return out;
  }
  std::vector<float> base, data;
};

// `count` random indices in [0, n), or all of them when n <= count.
inline std::vector<size_t> sample_indices(size_t n, size_t count, Rng& rng) {
  std::vector<size_t> indices;
  for (size_t k = 0; k < std::min(n, count); ++k) indices.push_back(n <= count ? k : rng.below(n));
  return indices;
}

struct GradCheckResult {
  double error = 0.0;         // ||numeric - analytic|| / ||numeric||
  double numeric_norm = 0.0;  // so a test can require a non-trivial gradient
};

// Checks analytic[i] against central differences of loss() in x[i] for i in indices; x is perturbed in
// place and restored exactly.
inline GradCheckResult gradcheck(float* x, const std::vector<float>& analytic, const std::function<double()>& loss,
                                 float eps, const std::vector<size_t>& indices) {
  double diff_sq = 0.0, numeric_sq = 0.0;
  for (size_t i : indices) {
    const float original = x[i];
    const float plus = original + eps, minus = original - eps;
    x[i] = plus;
    const double loss_plus = loss();
    x[i] = minus;
    const double loss_minus = loss();
    x[i] = original;
    const double numeric = (loss_plus - loss_minus) / (static_cast<double>(plus) - minus);
    diff_sq += (numeric - analytic[i]) * (numeric - analytic[i]);
    numeric_sq += numeric * numeric;
  }
  return {std::sqrt(diff_sq / numeric_sq), std::sqrt(numeric_sq)};
}

// gradcheck() as a gtest assertion: error below tol and a non-zero numeric gradient.
inline ::testing::AssertionResult grad_matches(const std::string& what, float* x, const std::vector<float>& analytic,
                                               const std::function<double()>& loss, float eps,
                                               const std::vector<size_t>& indices, double tol) {
  const GradCheckResult result = gradcheck(x, analytic, loss, eps, indices);
  if (result.error < tol && result.numeric_norm > 0.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": relative error " << result.error << " (tolerance " << tol
                                       << "), |numeric gradient| " << result.numeric_norm;
}

}  // namespace coda::test
