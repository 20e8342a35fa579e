// Epilogue programs inside the hand-written GEMM against their host evaluation (kernels/epilogue/epilogue.cuh)
// of the reference accumulators (tests/gemm_reference.cuh): norm scale, bias, aux store, GELU and row sums;
// the LM head's target pick and log-sum-exp with SwiGLU (RoPE: gpu_gemm_rope.cu). Every compiled tile;
// outputs poisoned with NaN first, so an unwritten element fails.
#include <gtest/gtest.h>

#include <cstring>
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

TEST(GpuGemm, NormGeluProgramMatchesHostEvaluation) {
  SKIP_WITHOUT_GPU();
  ForwardProblem prob(1000, 1040, 776);
  const int M = prob.M, N = prob.N;
  const auto r = random_host(M, 0.5f, 2.0f, 1), bias = random_host(N, -1.0f, 1.0f, 2);
  DeviceBuffer<float> r_d(r), bias_d(bias);
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program)) {
    SCOPED_TRACE(gemm_tile_name(tile));
    const int tiles_n = (N + gemm_tile_n(tile) - 1) / gemm_tile_n(tile);
    DeviceBuffer<__nv_bfloat16> out(size_t(M) * N), pre(size_t(M) * N);
    DeviceBuffer<float> partials(size_t(M) * tiles_n);
    out.poison(), pre.poison(), partials.poison();
    using namespace coda::epi;
    auto device_program = make_program(RowBroadcast<Mul>(r_d.get()), ColBroadcast<Add>(bias_d.get()),
                                       StoreAux<__nv_bfloat16>(pre.get(), N), Elementwise<Gelu>(),
                                       RowReduce<SumSquares>(partials.get()));
    gemm_run<GemmLayout::Forward>(tile, out.get(), prob.X.get(), prob.W.get(), M, N, prob.K, false, device_program,
                                  nullptr);

    std::vector<float> want_out(size_t(M) * N), want_pre(size_t(M) * N), want_partials(size_t(M) * tiles_n);
    evaluate_on_host(make_program(RowBroadcast<Mul>(r.data()), ColBroadcast<Add>(bias.data()),
                                  StoreAux<float>(want_pre.data(), N), Elementwise<Gelu>(),
                                  RowReduce<SumSquares>(want_partials.data())),
                     prob.acc.data(), M, N, gemm_tile_n(tile), want_out.data());
    EXPECT_LT(rel_error(out.download(), want_out), 1e-2);
    EXPECT_LT(rel_error(pre.download(), want_pre), 1e-2);
    EXPECT_LT(rel_error(partials.download(), want_partials), 1e-4);
  }
}

TEST(GpuGemm, LogitsLseAndSwiGluProgramMatchesHostEvaluation) {
  SKIP_WITHOUT_GPU();
  ForwardProblem prob(520, 1296, 1024);
  const int M = prob.M, N = prob.N;
  std::vector<int32_t> target(M);
  Rng rng(4);
  for (auto& t : target) t = static_cast<int32_t>(rng.below(N));
  DeviceBuffer<int32_t> target_d(M);
  CUDA_CHECK(cudaMemcpy(target_d.get(), target.data(), M * sizeof(int32_t), cudaMemcpyHostToDevice));
  for (GemmTile tile : gemm_tiles_compiled(GemmLayout::Forward, GemmEpilogue::Program)) {
    SCOPED_TRACE(gemm_tile_name(tile));
    using namespace coda::epi;
    const int tiles_n = (N + gemm_tile_n(tile) - 1) / gemm_tile_n(tile);
    DeviceBuffer<__nv_bfloat16> out(size_t(M) * N / 2);
    DeviceBuffer<float> lse(2 * size_t(M) * tiles_n);  // (max, sum) pairs: LogSumExp::Out
    DeviceBuffer<float> picked(M), sumsq(size_t(M) * tiles_n);
    out.poison(), lse.poison(), picked.poison(), sumsq.poison();
    auto* lse_partials = reinterpret_cast<LogSumExp::Out*>(lse.get());
    auto device_program = make_program(RowPick(target_d.get(), picked.get()), RowReduce<LogSumExp>(lse_partials),
                                       Pairwise<SwiGlu>(), RowReduce<SumSquares>(sumsq.get()));
    gemm_run<GemmLayout::Forward>(tile, out.get(), prob.X.get(), prob.W.get(), M, N, prob.K, false, device_program,
                                  nullptr);

    std::vector<float> want_out(size_t(M) * N / 2), want_picked(M), want_sumsq(size_t(M) * tiles_n);
    std::vector<LogSumExp::Out> want_lse(size_t(M) * tiles_n);
    evaluate_on_host(make_program(RowPick(target.data(), want_picked.data()), RowReduce<LogSumExp>(want_lse.data()),
                                  Pairwise<SwiGlu>(), RowReduce<SumSquares>(want_sumsq.data())),
                     prob.acc.data(), M, N, gemm_tile_n(tile), want_out.data());
    EXPECT_LT(rel_error(out.download(), want_out), 1e-2);
    EXPECT_LT(rel_error(picked.download(), want_picked), 1e-5);
    EXPECT_LT(rel_error(sumsq.download(), want_sumsq), 1e-3);  // after tanh.approx (rel. err 5e-4)
    const std::vector<float> lse_flat = lse.download();
    std::vector<LogSumExp::Out> got_lse(want_lse.size());
    std::memcpy(got_lse.data(), lse_flat.data(), lse_flat.size() * sizeof(float));
    std::vector<float> got_rows(M), want_rows(M);
    for (int i = 0; i < M; ++i) {
      got_rows[i] = merge_lse(&got_lse[size_t(i) * tiles_n], tiles_n);
      want_rows[i] = merge_lse(&want_lse[size_t(i) * tiles_n], tiles_n);
    }
    EXPECT_LT(rel_error(got_rows, want_rows), 1e-5);
  }
}

}  // namespace
