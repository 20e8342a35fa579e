// SwiGLU inside the GEMM (forward layout) against its host evaluation: the 2 -> 1 map that halves the width,
// with an aux store, row sums of squares and a column dot; fp32 output too. Harness:
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

// SwiGLU on interleaved (gate, up) columns (2 -> 1, half the output width) after a row scale, the scaled
// pair kept (bf16 aux), the sum of squares and a column dot with a bf16 tile of the half-width output.
TEST(GpuEpilogue, SwiGluHalvesTheWidthWithAuxSumSquaresAndColumnDot) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Forward> p(936, 784, 328);
  const int M = p.M, N = p.N, groups = prog::column_partial_groups(M);
  Mirrored<float> r(M, 0.5f, 2.0f, 9);
  Mirrored<bf16> t(size_t(M) * N / 2, -1.0f, 1.0f, 10);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program))
    for (Output mode : kOutputs) {
      SCOPED_TRACE(describe(p, tile, mode));
      Mirrored<bf16> gu(size_t(M) * N);
      Mirrored<float> sumsq(size_t(M) * p.tiles_n(tile)), column_dots(size_t(groups) * N / 2);
      auto make = [&](bool dev) {
        return make_program(RowBroadcast<Mul>(r.at(dev)), StoreAux<bf16>(gu.at(dev), N), Pairwise<SwiGlu>(),
                            RowReduce<SumSquares>(sumsq.at(dev)),
                            ColDot<Tile>(Tile{t.at(dev), N / 2}, column_dots.at(dev), N / 2));
      };
      run_both(p, tile, mode, make, 2e-3);  // tanh.approx: relative error ~5e-4
      expect_match("gate/up aux", gu, 5e-3);
      expect_match("row sums of squares", sumsq, 2e-3);
      expect_match("column dots", column_dots, 2e-3);
    }
}

}  // namespace
