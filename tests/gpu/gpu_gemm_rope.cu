// The RoPE program inside the hand-written GEMM against its host evaluation at both head sizes, every
// compiled tile (the other programs: gpu_gemm_programs.cu).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/gpu/forward_problem.cuh"

namespace {

using namespace coda;
using coda::test::DeviceBuffer;
using coda::test::rel_error;
using coda::testing::fill_uniform;
using coda::testing::reference_gemm;

using coda::test::ForwardProblem;
using coda::test::random_host;

// Head dim 64: (sin, cos) cached per tile on the GPU (a 64-column chunk is one head); 128: per fragment.
template <int kHeadDim>
void expect_rope_program_matches_host_evaluation() {
  // Two sequences of 2048 tokens (angles up to 2047 rad), q and k heads in the first 512 columns.
  ForwardProblem prob(4096, 768, 512);
  const int M = prob.M, N = prob.N;
  const auto r = random_host(M, 0.5f, 2.0f, 3);
  DeviceBuffer<float> r_d(r);
  using namespace coda::epi;
  const Rope<kHeadDim> rope{2048, 512, 13.287712f};
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program)) {
    SCOPED_TRACE(std::string(gemm_tile_name(tile)) + ", head_dim " + std::to_string(kHeadDim));
    const int tiles_n = (N + gemm_tile_n(tile) - 1) / gemm_tile_n(tile);
    DeviceBuffer<__nv_bfloat16> out(size_t(M) * N);
    DeviceBuffer<float> sumsq(size_t(M) * tiles_n);
    out.poison(), sumsq.poison();
    gemm_run<GemmLayout::Forward>(tile, out.get(), prob.X.get(), prob.W.get(), M, N, prob.K, false,
                                  make_program(RowBroadcast<Mul>(r_d.get()), Pairwise<Rope<kHeadDim>>(rope),
                                               RowReduce<SumSquares>(sumsq.get())),
                                  nullptr);
    std::vector<float> want_out(size_t(M) * N), want_sumsq(size_t(M) * tiles_n);
    evaluate_on_host(make_program(RowBroadcast<Mul>(r.data()), Pairwise<Rope<kHeadDim>>(rope),
                                  RowReduce<SumSquares>(want_sumsq.data())),
                     prob.acc.data(), M, N, gemm_tile_n(tile), want_out.data());
    EXPECT_LT(rel_error(out.download(), want_out), 1e-2);
    EXPECT_LT(rel_error(sumsq.download(), want_sumsq), 1e-4);
  }
}

TEST(GpuGemm, RopeProgramMatchesHostEvaluation) {
  SKIP_WITHOUT_GPU();
  expect_rope_program_matches_host_evaluation<64>();
  expect_rope_program_matches_host_evaluation<128>();
}

}  // namespace
