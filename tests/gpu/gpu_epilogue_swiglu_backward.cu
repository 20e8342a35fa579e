// SwiGLU backward inside the GEMM (dgrad layout) against its host evaluation: the 1 -> 2 map that doubles the
// output width (four values per fragment staged), with and without its act store; fp32 output too. Harness:
// tests/gpu/epilogue_check.cuh (shapes with M and N tails, every compiled tile, bf16 output stored and
// accumulate-stored).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/gpu/epilogue_check.cuh"

namespace {

using namespace coda;
using namespace coda::epi;
using namespace coda::test::epilogue;

// Llama's down-projection dgrad: dy -> interleaved (dg, du) [M, 2N] from the saved (g, u), the
// recomputed activation, <dz, z> partials against (g, u), then the norm's row scale.
TEST(GpuEpilogue, SwiGluBackwardWritesInterleavedGradients) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Dgrad> p(1000, 776, 328);
  const int M = p.M, N = p.N, kCount = 2;
  Mirrored<bf16> gu(size_t(M) * 2 * N, -3.0f, 3.0f, 11);
  Mirrored<float> sumsq_in(size_t(M) * kCount, 100.0f, 400.0f, 12);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Dgrad, GemmEpilogue::Program))
    for (Output mode : kOutputs) {
      SCOPED_TRACE(describe(p, tile, mode));
      Mirrored<bf16> act(size_t(M) * N);
      Mirrored<float> dots(size_t(M) * p.tiles_n(tile));
      auto make = [&](bool dev) {
        const prog::NormPartials stats{nullptr, sumsq_in.at(dev), kCount, N, 1e-5f};
        return make_program(SwiGluBackward<bf16>(gu.at(dev), 2 * N, act.at(dev), N),
                            RowDot<Tile>(Tile{gu.at(dev), 2 * N}, dots.at(dev)),
                            RowBroadcast<Mul, RowOf<RstdOfPartials>>(RstdOfPartials{stats}));
      };
      run_both(p, tile, mode, make, 1e-4);  // __expf and the accumulation order
      expect_match("act", act, 5e-3);
      expect_match("<dz, z> partials", dots, 1e-4);
    }
}

// Without the act store (the forward saved act): same main output, act memory untouched.
TEST(GpuEpilogue, SwiGluBackwardWithoutActStore) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Dgrad> p(936, 784, 328);
  const int M = p.M, N = p.N;
  Mirrored<bf16> gu(size_t(M) * 2 * N, -3.0f, 3.0f, 13);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Dgrad, GemmEpilogue::Program)) {
    SCOPED_TRACE(describe(p, tile, Output::Bf16));
    Mirrored<bf16> act(size_t(M) * N);  // poisoned; must stay so
    auto make = [&](bool dev) { return make_program(SwiGluBackward<bf16>(gu.at(dev), 2 * N, nullptr, N)); };
    run_both_bf16(p, tile, Output::Bf16, make);
    const std::vector<float> untouched = act.device.download();
    size_t written = 0;
    for (float x : untouched) written += std::isnan(x) ? 0 : 1;
    EXPECT_EQ(written, 0u) << "act written although act == nullptr";
  }
}

}  // namespace
