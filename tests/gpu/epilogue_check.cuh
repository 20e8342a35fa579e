// Harness of the epilogue-primitive GPU tests (tests/gpu/gpu_epilogue_*.cu): a program runs INSIDE gemm_run on
// random data, and the same program is evaluated on the host (evaluate_on_host, the same hooks) over the
// fp32 accumulators of a reference GEMM (tests/gemm_reference.cuh). Every array a program reads or
// writes exists twice (Mirrored: host and device), so one factory `make(on_device)` builds both
// programs, and every output (main output, auxiliary stores, partial buffers) is compared.
//
// Main output modes: bf16 stored, bf16 accumulate-stored (TMA reduce-add into random bf16 contents), and
// fp32 stored. Device outputs are poisoned (NaN) first and host outputs start as NaN, so an element that
// either side forgets to write fails the comparison.
#pragma once
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/coda/norm_stats.cuh"
#include "kernels/gemm/gemm_instance.cuh"
#include "src/rng.hpp"
#include "tests/gemm_reference.cuh"
#include "tests/gpu_test_util.cuh"

namespace coda::test::epilogue {

using bf16 = __nv_bfloat16;

// An array on the host and on the device; at(on_device) is what a program built for that side uses.
// Mirrored(n): an output, NaN on the host and poisoned on the device. Mirrored(n, lo, hi, seed): an
// input, uniform in [lo, hi) rounded to T (bf16 inputs are exact on both sides; int32: [lo, hi) indices).
template <class T>
struct Mirrored {
  std::vector<T> host;
  DeviceBuffer<T> device;
  explicit Mirrored(size_t n) : host(n, static_cast<T>(NAN)), device(n) { device.poison(); }
  Mirrored(size_t n, float lo, float hi, uint64_t seed) : host(n), device(n) {
    Rng rng(seed);
    for (auto& x : host) x = static_cast<T>(lo + (hi - lo) * static_cast<float>(rng.uniform()));
    CUDA_CHECK(cudaMemcpy(device.get(), host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  T* at(bool on_device) { return on_device ? device.get() : host.data(); }
  std::vector<float> host_floats() const {
    std::vector<float> out(host.size());
    for (size_t i = 0; i < host.size(); ++i) out[i] = static_cast<float>(host[i]);
    return out;
  }
};

// Device contents against host contents, relative norm error.
template <class T>
void expect_match(const char* name, const Mirrored<T>& m, double tolerance) {
  const double err = rel_error(m.device.download(), m.host_floats());
  EXPECT_LT(err, tolerance) << name;
}

// A row statistic finished from row partials where the rows begin, the RMSNorm rstd: the row operand
// RowOf<Stat> of the tests.
struct RstdOfPartials {
  prog::NormPartials partials;
  CODA_HD float operator()(int row) const { return partials.rms_rstd(row); }
};

enum class Output { Bf16, Bf16Accumulate, Fp32 };
inline const char* output_name(Output o) {
  return o == Output::Bf16 ? "bf16" : o == Output::Bf16Accumulate ? "bf16 accumulate" : "fp32";
}
// Every output mode, for programs whose width change decides the staging geometry (2 -> 2, 2 -> 1,
// 1 -> 2); the bf16 ones for the others (each output type is one more kernel to compile).
constexpr Output kOutputs[] = {Output::Bf16, Output::Bf16Accumulate, Output::Fp32};
constexpr Output kBf16Outputs[] = {Output::Bf16, Output::Bf16Accumulate};

// Operands of one GEMM of layout kLayout on random data and its fp32 reference accumulators [M, N], on
// the host. The layout is a template parameter so that each program is compiled for one layout only.
template <GemmLayout kLayout>
struct Problem {
  int M, N, K;
  DeviceBuffer<bf16> A, B;
  std::vector<float> acc;
  Problem(int m, int n, int k) : M(m), N(n), K(k), A(size_t(m) * k), B(size_t(k) * n) {
    testing::fill_uniform(A.get(), A.size(), 31 + m);
    testing::fill_uniform(B.get(), B.size(), 47 + n);
    DeviceBuffer<float> ref(size_t(m) * n);
    testing::reference_gemm(kLayout, ref.get(), A.get(), B.get(), m, n, k);
    acc = ref.download();
  }
  int tiles_n(GemmTile tile) const { return (N + gemm_tile_n(tile) - 1) / gemm_tile_n(tile); }
  template <class OutT, class Program>
  void launch(GemmTile tile, OutT* D, bool accumulate, const Program& program) const {
    gemm_run<kLayout>(tile, D, A.get(), B.get(), M, N, K, accumulate, program, nullptr);
  }
};

// Host evaluation of make(false) over p.acc: the expected main output.
template <class P, class Make>
std::vector<float> evaluate(const P& p, GemmTile tile, Make&& make) {
  using Program = decltype(make(false));
  const size_t out_cols = size_t(p.N) * Program::kOutsPerCol / Program::kColsPerOut;
  std::vector<float> want(size_t(p.M) * out_cols, NAN);
  epi::evaluate_on_host(make(false), p.acc.data(), p.M, p.N, gemm_tile_n(tile), want.data());
  return want;
}

// Runs make(true) in the GEMM with a bf16 output (stored, or accumulate-stored into random contents) and
// make(false) on the host over p.acc, and compares the main outputs (tolerance: bf16 rounding). The
// caller compares the program's other outputs afterwards.
template <class P, class Make>
void run_both_bf16(const P& p, GemmTile tile, Output mode, Make&& make) {
  std::vector<float> want = evaluate(p, tile, make);
  DeviceBuffer<bf16> D(want.size());
  if (mode == Output::Bf16Accumulate) {
    const Mirrored<bf16> start(want.size(), -2.0f, 2.0f, 99);
    CUDA_CHECK(cudaMemcpy(D.get(), start.device.get(), want.size() * sizeof(bf16), cudaMemcpyDeviceToDevice));
    for (size_t i = 0; i < want.size(); ++i) want[i] += static_cast<float>(start.host[i]);
  } else {
    D.poison();
  }
  p.launch(tile, D.get(), mode == Output::Bf16Accumulate, make(true));
  EXPECT_LT(rel_error(D.download(), want), 5e-3) << "main output";
}

// The same for every output mode; fp32 output: tolerance fp32_tolerance, set by the program's
// approximate functions.
template <class P, class Make>
void run_both_fp32(const P& p, GemmTile tile, Make&& make, double fp32_tolerance) {
  const std::vector<float> want = evaluate(p, tile, make);
  DeviceBuffer<float> D(want.size());
  D.poison();
  p.launch(tile, D.get(), false, make(true));
  EXPECT_LT(rel_error(D.download(), want), fp32_tolerance) << "main output";
}
template <class P, class Make>
void run_both(const P& p, GemmTile tile, Output mode, Make&& make, double fp32_tolerance) {
  if (mode != Output::Fp32) return run_both_bf16(p, tile, mode, make);
  run_both_fp32(p, tile, make, fp32_tolerance);
}

// The trace line of one case.
template <GemmLayout kLayout>
std::string describe(const Problem<kLayout>& p, GemmTile tile, Output mode) {
  return std::string(kLayout == GemmLayout::Forward ? "forward" : kLayout == GemmLayout::Dgrad ? "dgrad" : "wgrad") +
         " M=" + std::to_string(p.M) + " N=" + std::to_string(p.N) + " K=" + std::to_string(p.K) + " " +
         gemm_tile_name(tile) + " " + output_name(mode);
}

}  // namespace coda::test::epilogue
