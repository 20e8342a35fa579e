// RoPE inside the GEMM (forward layout) against its host evaluation, after a row scale, with an fp32 aux store
// and row sums of squares; fp32 output too (a width-keeping 2 -> 2 map). Harness: tests/gpu/epilogue_check.cuh
// (shapes with M and N tails, every compiled tile, bf16 output stored and accumulate-stored; the auxiliary
// stores and partial buffers are compared too).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "tests/gpu/epilogue_check.cuh"

namespace {

using namespace coda;
using namespace coda::epi;
using namespace coda::test::epilogue;

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

}  // namespace
