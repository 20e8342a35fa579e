// The SwiGLU program check shared by gpu_epilogue_swiglu.cu (bf16 outputs) and gpu_epilogue_swiglu_fp32.cu.
#pragma once
#include <gtest/gtest.h>

#include <iterator>
#include <vector>

#include "tests/gpu/epilogue_check.cuh"

namespace coda::test::swiglu {

using namespace coda;
using namespace coda::epi;
using namespace coda::test::epilogue;

// SwiGLU on interleaved (gate, up) columns (2 -> 1, half the output width) after a row scale, the scaled
// pair kept (bf16 aux), the sum of squares and a column dot with a bf16 tile of the half-width output;
// the bf16 output modes (kFp32 false) or the fp32 output, each in its own test file so that the two sets
// of kernels compile in parallel.
template <bool kFp32>
void check_swiglu_program() {
  const Problem<GemmLayout::Forward> p(936, 784, 328);
  const int M = p.M, N = p.N, groups = prog::column_partial_groups(M);
  Mirrored<float> r(M, 0.5f, 2.0f, 9);
  Mirrored<bf16> t(size_t(M) * N / 2, -1.0f, 1.0f, 10);
  const std::vector<Output> modes = kFp32 ? std::vector<Output>{Output::Fp32}
                                          : std::vector<Output>(std::begin(kBf16Outputs), std::end(kBf16Outputs));
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program))
    for (Output mode : modes) {
      SCOPED_TRACE(describe(p, tile, mode));
      Mirrored<bf16> gu(size_t(M) * N);
      Mirrored<float> sumsq(size_t(M) * p.tiles_n(tile)), column_dots(size_t(groups) * N / 2);
      auto make = [&](bool dev) {
        return make_program(RowBroadcast<Mul>(r.at(dev)), StoreAux<bf16>(gu.at(dev), N), Pairwise<SwiGlu>(),
                            RowReduce<SumSquares>(sumsq.at(dev)),
                            ColDot<Tile>(Tile{t.at(dev), N / 2}, column_dots.at(dev), N / 2));
      };
      if constexpr (kFp32)
        run_both_fp32(p, tile, make, 2e-3);  // tanh.approx: relative error ~5e-4
      else
        run_both_bf16(p, tile, mode, make);
      expect_match("gate/up aux", gu, 5e-3);
      expect_match("row sums of squares", sumsq, 2e-3);
      expect_match("column dots", column_dots, 2e-3);
    }
}

}  // namespace coda::test::swiglu
