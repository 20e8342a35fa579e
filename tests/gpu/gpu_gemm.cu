// The hand-written GEMM against references on random data: the fp32 CPU reference (src/ref_ops.hpp) on
// small shapes of every layout, a plain fp32 GPU reference (tests/gemm_reference.cuh) on shapes with M, N
// and K tails, more tiles than SMs, split-K and accumulation (epilogue programs: gpu_gemm_programs.cu).
// Outputs are poisoned with NaN first, so an unwritten element fails.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/gemm/gemm.cuh"
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

// GemmKSplit::Never on a shape that Balanced splits many ways (18 tiles of gpt2-124m's attention-output
// weight gradient over 32768 tokens): the reference's result, and the same bits on every run. One unit
// sums all 32768 products of an element in the tensor cores' accumulators, whose additions round less
// exactly than fp32's, so the whole-K sum sits further from the reference than split-K's short chains
// joined by fp32 reduce-adds (measured 3.7e-5 on H100 against split-K's under 1e-5).
TEST(GpuGemm, WgradWithoutSplitKGivesTheSameBitsEveryRun) {
  SKIP_WITHOUT_GPU();
  const int M = 768, N = 768, K = 32768;
  const size_t a_elems = size_t(K) * M, b_elems = size_t(K) * N, d_elems = size_t(M) * N;
  DeviceBuffer<__nv_bfloat16> A(a_elems), B(b_elems);
  DeviceBuffer<float> ref(d_elems), D0(d_elems), D(d_elems);
  fill_uniform(A.get(), a_elems, 31);
  fill_uniform(B.get(), b_elems, 37);
  fill_uniform(D0.get(), d_elems, 41, -20.0f, 20.0f);
  reference_gemm(GemmLayout::Wgrad, ref.get(), A.get(), B.get(), M, N, K);
  std::vector<float> runs[2];
  for (std::vector<float>& run : runs) {
    CUDA_CHECK(cudaMemcpy(D.get(), D0.get(), d_elems * sizeof(float), cudaMemcpyDeviceToDevice));
    gemm_wgrad(D.get(), A.get(), B.get(), M, N, K, true, nullptr, GemmTile::Auto, GemmKSplit::Never);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(relative_error(D.get(), ref.get(), d_elems, D0.get()), 1e-4);
    run = D.download();
  }
  EXPECT_EQ(runs[0], runs[1]);
}

}  // namespace
