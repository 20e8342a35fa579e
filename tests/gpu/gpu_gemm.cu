// The hand-written GEMM against references on random data: the fp32 CPU reference (src/ref_ops.hpp) on
// small shapes of every layout, a plain fp32 GPU reference (tests/gemm_reference.cuh) on shapes with M, N
// and K tails, more tiles than SMs, split-K and accumulation; and epilogue programs on the GPU against
// their host evaluation (kernels/epilogue/epilogue.cuh) of the reference accumulators. Outputs are
// poisoned with NaN first, so an unwritten element fails.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/gemm/gemm_instance.cuh"
#include "src/ref_ops.hpp"
#include "src/rng.hpp"
#include "tests/gemm_reference.cuh"
#include "tests/gpu_test_util.cuh"

namespace {

using namespace coda;
using coda::test::DeviceBuffer;
using coda::test::rel_error;
using coda::testing::fill_uniform;
using coda::testing::reference_gemm;
using coda::testing::relative_error;

struct Case {
  GemmLayout layout;
  int M, N, K;
  bool accumulate;  // wgrad only
};

std::string describe(const Case& c, GemmTile tile) {
  static const char* names[] = {"forward", "dgrad", "wgrad"};
  return std::string(names[static_cast<int>(c.layout)]) + " M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) +
         " K=" + std::to_string(c.K) + (c.accumulate ? " accumulate " : " ") + gemm_tile_name(tile);
}

void check_case(const Case& c, GemmTile tile) {
  SCOPED_TRACE(describe(c, tile));
  const size_t a_elems = size_t(c.M) * c.K, b_elems = size_t(c.K) * c.N, d_elems = size_t(c.M) * c.N;
  DeviceBuffer<__nv_bfloat16> A(a_elems), B(b_elems);
  DeviceBuffer<float> ref(d_elems);
  fill_uniform(A.get(), a_elems, 11 + c.M);
  fill_uniform(B.get(), b_elems, 23 + c.N);
  reference_gemm(c.layout, ref.get(), A.get(), B.get(), c.M, c.N, c.K);
  if (c.layout == GemmLayout::Wgrad) {
    DeviceBuffer<float> D(d_elems), D0(d_elems);
    if (c.accumulate) {
      fill_uniform(D0.get(), d_elems, 5, -20.0f, 20.0f);
      CUDA_CHECK(cudaMemcpy(D.get(), D0.get(), d_elems * sizeof(float), cudaMemcpyDeviceToDevice));
    } else {
      D.poison();
    }
    gemm_wgrad(D.get(), A.get(), B.get(), c.M, c.N, c.K, c.accumulate, nullptr, tile);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(relative_error(D.get(), ref.get(), d_elems, c.accumulate ? D0.get() : nullptr), 1e-5);
  } else {
    DeviceBuffer<__nv_bfloat16> D(d_elems);
    D.poison();
    if (c.layout == GemmLayout::Forward)
      gemm_forward(D.get(), A.get(), B.get(), c.M, c.N, c.K, nullptr, tile);
    else
      gemm_dgrad(D.get(), A.get(), B.get(), c.M, c.N, c.K, nullptr, tile);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(relative_error(D.get(), ref.get(), d_elems), 1e-2);  // bf16 output rounding: about 3e-3
  }
}

void check_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases)
    for (GemmTile tile : gemm_tiles_compiled(c.layout, GemmEpilogue::Bare)) check_case(c, tile);
}

// gemm.cuh's three layouts in the CPU reference's terms (tokens T, in IC, out OC):
//   forward  Y[T, OC]  = X[T, IC] W[OC, IC]^T    matmul_forward
//   dgrad    dX[T, IC] = dY[T, OC] W[OC, IC]     matmul_backward (dx)
//   wgrad    dW[OC, IC] += dY[T, OC]^T X[T, IC]   matmul_backward (dw)
void check_against_cpu_reference(GemmLayout layout, int M, int N, int K, bool accumulate, GemmTile tile) {
  SCOPED_TRACE(describe({layout, M, N, K, accumulate}, tile));
  Rng rng(1000 + M + N + K);
  const auto A = coda::test::random_bf16_values(size_t(M) * K, 1.0f, rng);
  const auto B = coda::test::random_bf16_values(size_t(K) * N, 1.0f, rng);
  DeviceBuffer<__nv_bfloat16> A_d(A), B_d(B);
  std::vector<float> want(size_t(M) * N, 0.0f);
  if (layout == GemmLayout::Forward) {
    ref::matmul_forward(want.data(), A.data(), B.data(), nullptr, M, K, N);
  } else if (layout == GemmLayout::Dgrad) {
    ref::matmul_backward(want.data(), nullptr, nullptr, A.data(), nullptr, B.data(), M, N, K);
  } else {
    if (accumulate) want = coda::test::random_bf16_values(want.size(), 10.0f, rng);
    const std::vector<float> start = want;
    ref::matmul_backward(nullptr, want.data(), nullptr, A.data(), B.data(), nullptr, K, N, M);
    DeviceBuffer<float> D(start);
    if (!accumulate) D.poison();
    gemm_wgrad(D.get(), A_d.get(), B_d.get(), M, N, K, accumulate, nullptr, tile);
    EXPECT_LT(rel_error(D.download(), want), 1e-5);
    return;
  }
  DeviceBuffer<__nv_bfloat16> D(size_t(M) * N);
  D.poison();
  if (layout == GemmLayout::Forward)
    gemm_forward(D.get(), A_d.get(), B_d.get(), M, N, K, nullptr, tile);
  else
    gemm_dgrad(D.get(), A_d.get(), B_d.get(), M, N, K, nullptr, tile);
  EXPECT_LT(rel_error(D.download(), want), 1e-2);
}

TEST(GpuGemm, SmallShapesAgainstCpuReference) {
  SKIP_WITHOUT_GPU();
  for (GemmLayout layout : {GemmLayout::Forward, GemmLayout::Dgrad, GemmLayout::Wgrad})
    for (GemmTile tile : gemm_tiles_compiled(layout, GemmEpilogue::Bare)) {
      check_against_cpu_reference(layout, 136, 264, 200, false, tile);
      check_against_cpu_reference(layout, 392, 520, 712, false, tile);
      if (layout == GemmLayout::Wgrad) check_against_cpu_reference(layout, 264, 136, 1480, true, tile);
    }
}

TEST(GpuGemm, ForwardTailsAndManyTiles) {
  SKIP_WITHOUT_GPU();
  check_cases({{GemmLayout::Forward, 1000, 776, 1000, false},
               {GemmLayout::Forward, 4160, 2312, 776, false},
               {GemmLayout::Forward, 200, 50304, 768, false}});
}

TEST(GpuGemm, DgradTailsAndManyTiles) {
  SKIP_WITHOUT_GPU();
  check_cases({{GemmLayout::Dgrad, 1000, 776, 1000, false},
               {GemmLayout::Dgrad, 4160, 2312, 776, false},
               {GemmLayout::Dgrad, 264, 768, 50304, false}});
}

TEST(GpuGemm, WgradSplitKAndAccumulate) {
  SKIP_WITHOUT_GPU();
  check_cases({{GemmLayout::Wgrad, 776, 520, 3000, false},
               {GemmLayout::Wgrad, 776, 520, 3000, true},
               {GemmLayout::Wgrad, 2312, 776, 4104, true},
               {GemmLayout::Wgrad, 768, 768, 32768, true}});
}

// ---- epilogue programs on the GPU vs their host evaluation -----------------------------------------

// Reference accumulators of a forward GEMM on random data, on the host.
struct ForwardProblem {
  int M, N, K;
  DeviceBuffer<__nv_bfloat16> X, W;
  std::vector<float> acc;
  ForwardProblem(int m, int n, int k) : M(m), N(n), K(k), X(size_t(m) * k), W(size_t(n) * k) {
    fill_uniform(X.get(), X.size(), 101);
    fill_uniform(W.get(), W.size(), 202);
    DeviceBuffer<float> ref(size_t(m) * n);
    reference_gemm(GemmLayout::Forward, ref.get(), X.get(), W.get(), m, n, k);
    acc = ref.download();
  }
};

std::vector<float> random_host(size_t n, float lo, float hi, unsigned seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = lo + (hi - lo) * static_cast<float>(rng.uniform());
  return v;
}

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
