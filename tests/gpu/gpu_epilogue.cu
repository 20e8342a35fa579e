// Every epilogue primitive run inside the GEMM (forward layout) against its host evaluation, on shapes with
// M and N tails (M not a multiple of 64 or 128, the last N tile partly outside N), both tile
// configurations, bf16 output stored and accumulate-stored, and fp32 output for the width-changing maps
// (RoPE 2 -> 2, SwiGLU 2 -> 1); the auxiliary stores and the partial buffers are compared too. The dgrad-layout programs (SwiGluBackward, the norm-backward pieces)
// are in gpu_epilogue_dgrad.cu. Harness: tests/gpu/epilogue_check.cuh.
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

// RoPE (rows wrap at seq_len; v-head columns beyond rot_cols pass through) after a loaded row scale, the
// rotated values kept in fp32, their sum of squares.
TEST(GpuEpilogue, RopeAfterRowScaleWithFp32AuxAndSumSquares) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Forward> p(936, 776, 328);
  const int M = p.M, N = p.N;
  const Rope<64> rope{600, 512, 13.287712f};  // theta = 10000
  Mirrored<float> r(M, 0.5f, 2.0f, 5);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program))
    for (Output mode : kOutputs) {
      SCOPED_TRACE(describe(p, tile, mode));
      Mirrored<float> aux(size_t(M) * N), sumsq(size_t(M) * p.tiles_n(tile));
      auto make = [&](bool dev) {
        return make_program(RowBroadcast<Mul>(r.at(dev)), Pairwise<Rope<64>>(rope), StoreAux<float>(aux.at(dev), N),
                            RowReduce<SumSquares>(sumsq.at(dev)));
      };
      run_both(p, tile, mode, make, 3e-4);  // angles up to 599 rad through the hardware exp2 and sincos
      expect_match("fp32 aux", aux, 3e-4);
      expect_match("row sums of squares", sumsq, 1e-4);
    }
}

// The LM head's pieces: row scale from partials, target pick, online log-sum-exp and max partials, a row
// dot with a fp32 column vector, column sums per 16-row group.
TEST(GpuEpilogue, TargetPickLogSumExpRowDotAndColumnSums) {
  SKIP_WITHOUT_GPU();
  const Problem<GemmLayout::Forward> p(1000, 1288, 328);
  const int M = p.M, N = p.N, kCount = 2, groups = prog::column_partial_groups(M);
  Mirrored<float> sumsq_in(size_t(M) * kCount, 200.0f, 600.0f, 6), c(N, -1.0f, 1.0f, 7);
  Mirrored<int32_t> target(M, 0.0f, static_cast<float>(N), 8);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program))
    for (Output mode : kBf16Outputs) {
      SCOPED_TRACE(describe(p, tile, mode));
      const int tiles_n = p.tiles_n(tile);
      Mirrored<float> picked(M), lse(2 * size_t(M) * tiles_n), maxima(size_t(M) * tiles_n), dots(size_t(M) * tiles_n);
      Mirrored<float> column_sums(size_t(groups) * N);
      auto make = [&](bool dev) {
        const prog::NormPartials stats{nullptr, sumsq_in.at(dev), kCount, 2048, 1e-5f};
        return make_program(RowBroadcast<Mul, RowOf<RstdOfPartials>>(RstdOfPartials{stats}),
                            RowPick(target.at(dev), picked.at(dev)),
                            RowReduce<LogSumExp>(reinterpret_cast<LogSumExp::Out*>(lse.at(dev))),
                            RowReduce<Max>(maxima.at(dev)), RowDot<ColVector>(ColVector{c.at(dev)}, dots.at(dev)),
                            ColDot<Ones>(Ones{}, column_sums.at(dev), N));
      };
      run_both_bf16(p, tile, mode, make);
      expect_match("picked target values", picked, 1e-5);
      expect_match("log-sum-exp partials (max, sum)", lse, 1e-4);
      expect_match("max partials", maxima, 1e-5);
      expect_match("row dot partials", dots, 1e-4);
      expect_match("column sums", column_sums, 1e-4);
      // The full-row log-sum-exp from the partials, as the loss computes it.
      const std::vector<float> got = lse.device.download();
      std::vector<float> got_rows(M), want_rows(M);
      for (int i = 0; i < M; ++i) {
        std::vector<LogSumExp::Out> g(tiles_n), w(tiles_n);
        std::memcpy(g.data(), &got[2 * size_t(i) * tiles_n], tiles_n * sizeof(LogSumExp::Out));
        std::memcpy(w.data(), &lse.host[2 * size_t(i) * tiles_n], tiles_n * sizeof(LogSumExp::Out));
        got_rows[i] = merge_lse(g.data(), tiles_n);
        want_rows[i] = merge_lse(w.data(), tiles_n);
      }
      EXPECT_LT(coda::test::rel_error(got_rows, want_rows), 1e-5) << "merged log-sum-exp";
    }
}

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
