// The LM head's primitives inside the GEMM (forward layout) against their host evaluation: target pick, online
// log-sum-exp and max partials, a row dot with a column vector, column sums. Harness:
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

}  // namespace
