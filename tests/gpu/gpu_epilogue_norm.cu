// Norm-forward primitives inside the GEMM (forward layout) against their host evaluation: a row scale from norm
// partials, gamma, a residual tile, the aux store of the new residual and its row sums. Harness:
// tests/gpu/epilogue_check.cuh (shapes with M and N tails, every compiled tile, bf16 output stored and
// accumulate-stored; the auxiliary stores and partial buffers are compared too).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "tests/gpu/epilogue_check.cuh"

namespace {

using namespace coda;
using namespace coda::epi;
using namespace coda::test::epilogue;

// Norm row scale, gamma (bf16 parameter vector), residual tile, the new residual kept (bf16 aux), its
// row sum and sum of squares (partials per N tile), then a fp32 bias.
TEST(GpuEpilogue, RowScaleGammaResidualAuxAndRowSums) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Forward> p(1000, 776, 328);
  const int M = p.M, N = p.N, kCount = 3;
  Mirrored<float> sumsq_in(size_t(M) * kCount, 100.0f, 400.0f, 1);
  Mirrored<bf16> gamma(N, 0.5f, 1.5f, 2), residual(size_t(M) * N, -2.0f, 2.0f, 3);
  Mirrored<float> bias(N, -1.0f, 1.0f, 4);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program))
    for (Output mode : kBf16Outputs) {
      SCOPED_TRACE(describe(p, tile, mode));
      Mirrored<bf16> aux(size_t(M) * N);
      Mirrored<float> sums(size_t(M) * p.tiles_n(tile)), sumsq(size_t(M) * p.tiles_n(tile));
      auto make = [&](bool dev) {
        const prog::NormPartials stats{nullptr, sumsq_in.at(dev), kCount, N, 1e-5f};
        return make_program(RowBroadcast<Mul, RowOf<RstdOfPartials>>(RstdOfPartials{stats}),
                            ColBroadcast<Mul, bf16>(gamma.at(dev)), TileLoad<Add>(residual.at(dev), N),
                            StoreAux<bf16>(aux.at(dev), N), RowReduce<Sum>(sums.at(dev)),
                            RowReduce<SumSquares>(sumsq.at(dev)), ColBroadcast<Add>(bias.at(dev)));
      };
      run_both_bf16(p, tile, mode, make);
      expect_match("aux", aux, 5e-3);
      expect_match("row sums", sums, 1e-4);
      expect_match("row sums of squares", sumsq, 1e-5);
    }
}

}  // namespace
