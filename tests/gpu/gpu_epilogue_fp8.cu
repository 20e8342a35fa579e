// The FP8 store and its amax partials inside the GEMM (forward layout) against their host evaluation: the
// epilogue that emits an FP8 operand for a later FP8 GEMM (docs/FP8.md). Harness: tests/gpu/epilogue_check.cuh
// (M and N tails, every compiled tile, the bf16 main output stored and accumulate-stored). The device's
// accumulators and the reference's differ in their fp32 summation order, so a value next to an FP8
// rounding boundary may land one FP8 unit away: the stored bytes are compared decoded, as a relative norm
// error (one e4m3 unit is 2^-3 relative; a few such elements stay far below the limit), the amax partials
// to fp32 accuracy.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "src/fp8.hpp"
#include "tests/gpu/epilogue_check.cuh"

namespace {

using namespace coda;
using namespace coda::epi;
using namespace coda::test::epilogue;

std::vector<float> decoded(const std::vector<uint8_t>& q, Fp8Format format) {
  std::vector<float> v(q.size());
  for (size_t i = 0; i < q.size(); ++i) v[i] = fp8_decode(q[i], format);
  return v;
}

TEST(GpuEpilogue, Fp8StoreAndAmaxPartials) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Forward> p(1000, 1288, 328);
  const size_t elems = size_t(p.M) * p.N;
  Mirrored<float> scale(1, 40.0f, 40.0f, 3);  // |acc| reaches about 10: the largest values saturate e4m3
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program))
    for (Output mode : kBf16Outputs) {
      SCOPED_TRACE(describe(p, tile, mode));
      Mirrored<float> amax(size_t(p.M) * p.tiles_n(tile));
      std::vector<uint8_t> host_q(elems, 0);
      coda::test::DeviceBuffer<uint8_t> device_q(elems);
      device_q.poison();
      auto make = [&](bool dev) {
        return make_program(StoreFp8<Fp8Format::E4M3>(dev ? device_q.get() : host_q.data(), p.N, scale.at(dev)),
                            RowReduce<AbsMax>(amax.at(dev)));
      };
      run_both_bf16(p, tile, mode, make);
      std::vector<uint8_t> got(elems);
      CUDA_CHECK(cudaMemcpy(got.data(), device_q.get(), elems, cudaMemcpyDeviceToHost));
      const std::vector<float> got_values = decoded(got, Fp8Format::E4M3), want = decoded(host_q, Fp8Format::E4M3);
      EXPECT_LT(coda::test::rel_error(got_values, want), 1e-2) << "FP8 copy";
      expect_match("amax partials", amax, 1e-5);
    }
}

// The transposed FP8 store (e5m2, the format of the output gradients whose transposed copies the weight
// gradients read) inside the GEMM: the copy's row j holds column j of the output, rows M..ld of it padding.
TEST(GpuEpilogue, TransposedFp8Store) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Forward> p(1000, 1288, 328);
  const int ld = 1008;  // M rounded up to 16: the copy's rows are K-major operand rows of a later FP8 GEMM
  const size_t elems = size_t(p.N) * ld;
  Mirrored<float> scale(1, 40.0f, 40.0f, 4);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program))
    for (Output mode : kBf16Outputs) {
      SCOPED_TRACE(describe(p, tile, mode));
      std::vector<uint8_t> host_q(elems, 0);
      coda::test::DeviceBuffer<uint8_t> device_q(elems);
      CUDA_CHECK(cudaMemset(device_q.get(), 0, elems));
      auto make = [&](bool dev) {
        return make_program(
            StoreFp8Transposed<Fp8Format::E5M2>(dev ? device_q.get() : host_q.data(), ld, scale.at(dev)));
      };
      run_both_bf16(p, tile, mode, make);
      std::vector<uint8_t> got(elems);
      CUDA_CHECK(cudaMemcpy(got.data(), device_q.get(), elems, cudaMemcpyDeviceToHost));
      EXPECT_LT(coda::test::rel_error(decoded(got, Fp8Format::E5M2), decoded(host_q, Fp8Format::E5M2)), 1e-2)
          << "transposed FP8 copy";
    }
}

}  // namespace
