// The pieces of the norm backwards inside the GEMM (dgrad layout) against their host evaluation: a loaded-tile
// map, column dots per 16-row group, row dots against a tile and a column vector, row broadcasts and scaled
// subtractions with row-statistic operands. Harness: tests/gpu/epilogue_check.cuh (shapes with M and N tails,
// every compiled tile, bf16 output stored and accumulate-stored).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/gpu/epilogue_check.cuh"

namespace {

using namespace coda;
using namespace coda::epi;
using namespace coda::test::epilogue;

// GPT-2's projection dgrad and LayerNorm-backward pieces in one program: GELU backward from the saved
// pre-activation (tile map), bias-gradient column sums (ColDot<Ones>), a column dot with a row statistic
// (ColDot<RowOf>), <dz, pre> and <dz, c> row dots, the row scale, the rank-1 subtraction with a row
// statistic and a column vector, a scaled subtraction of a second bf16 tile (tile input 1), and a final GELU.
TEST(GpuEpilogue, NormBackwardPiecesColumnAndRowDotsScaledSubtractions) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Dgrad> p(936, 784, 328);
  const int M = p.M, N = p.N, kCount = 3, groups = prog::column_partial_groups(M);
  Mirrored<bf16> pre(size_t(M) * N, -3.0f, 3.0f, 14), h(size_t(M) * N, -2.0f, 2.0f, 15);
  Mirrored<float> sumsq_in(size_t(M) * kCount, 100.0f, 400.0f, 16), c(N, -1.0f, 1.0f, 17), alpha(M, -1.0f, 1.0f, 18);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Dgrad, GemmEpilogue::TwoTileInputs))
    for (Output mode : kBf16Outputs) {
      SCOPED_TRACE(describe(p, tile, mode));
      const int tiles_n = p.tiles_n(tile);
      Mirrored<float> col_b(size_t(groups) * N), col_a(size_t(groups) * N);
      Mirrored<float> dot_z(size_t(M) * tiles_n), dot_c(size_t(M) * tiles_n);
      auto make = [&](bool dev) {
        const RstdOfPartials rstd{prog::NormPartials{nullptr, sumsq_in.at(dev), kCount, N, 1e-5f}};
        return make_program(TileLoad<GeluGradMul>(pre.at(dev), N), ColDot<Ones>(Ones{}, col_b.at(dev), N),
                            ColDot<RowOf<RstdOfPartials>>(RowOf<RstdOfPartials>(rstd), col_a.at(dev), N),
                            RowDot<Tile>(Tile{pre.at(dev), N}, dot_z.at(dev)),
                            RowDot<ColVector>(ColVector{c.at(dev)}, dot_c.at(dev)),
                            RowBroadcast<Mul, RowOf<RstdOfPartials>>(rstd),
                            SubScaled<ColVector, RowOf<RstdOfPartials>>(rstd, ColVector{c.at(dev)}),
                            SubScaled<TileOf<1>>(alpha.at(dev), TileOf<1>{h.at(dev), N}), Elementwise<Gelu>());
      };
      run_both_bf16(p, tile, mode, make);
      expect_match("bias-gradient column sums", col_b, 2e-3);
      expect_match("column dots with rstd", col_a, 2e-3);
      expect_match("<dz, pre> partials", dot_z, 2e-3);
      expect_match("<dz, c> partials", dot_c, 2e-3);
    }
}

}  // namespace
