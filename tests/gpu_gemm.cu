// The hand-written GEMM against a plain fp32 GPU reference on random data: every layout, both tile
// configurations, shapes with M, N and K tails, more tiles than SMs, split-K, accumulation; and
// epilogue programs on the GPU against their host evaluation (kernels/epilogue/epilogue.cuh) of the
// reference accumulators. Outputs are poisoned with NaN first, so an unwritten element fails.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/gemm/gemm_launch.cuh"
#include "tests/gemm_reference.cuh"

namespace {

using namespace coda;
using coda::testing::fill_uniform;
using coda::testing::reference_gemm;
using coda::testing::relative_error;

template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) { CUDA_CHECK(cudaMalloc(&p, count * sizeof(T))); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void poison() { CUDA_CHECK(cudaMemset(p, 0xFF, n * sizeof(T))); }  // NaN in bf16 and fp32
  std::vector<T> to_host() const {
    std::vector<T> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

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
  fill_uniform(A.p, a_elems, 11 + c.M);
  fill_uniform(B.p, b_elems, 23 + c.N);
  reference_gemm(c.layout, ref.p, A.p, B.p, c.M, c.N, c.K);
  if (c.layout == GemmLayout::Wgrad) {
    DeviceBuffer<float> D(d_elems), D0(d_elems);
    if (c.accumulate) {
      fill_uniform(D0.p, d_elems, 5, -20.0f, 20.0f);
      CUDA_CHECK(cudaMemcpy(D.p, D0.p, d_elems * sizeof(float), cudaMemcpyDeviceToDevice));
    } else {
      D.poison();
    }
    gemm_wgrad(D.p, A.p, B.p, c.M, c.N, c.K, c.accumulate, nullptr, tile);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(relative_error(D.p, ref.p, d_elems, c.accumulate ? D0.p : nullptr), 1e-5);
  } else {
    DeviceBuffer<__nv_bfloat16> D(d_elems);
    D.poison();
    if (c.layout == GemmLayout::Forward)
      gemm_forward(D.p, A.p, B.p, c.M, c.N, c.K, nullptr, tile);
    else
      gemm_dgrad(D.p, A.p, B.p, c.M, c.N, c.K, nullptr, tile);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(relative_error(D.p, ref.p, d_elems), 1e-2);  // bf16 output rounding: about 3e-3
  }
}

void check_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases)
    for (GemmTile tile : {GemmTile::Cooperative128x256, GemmTile::PingPong128x128}) check_case(c, tile);
}

TEST(GpuGemm, SmallShapesAllLayouts) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  check_cases({{GemmLayout::Forward, 136, 264, 200, false},
               {GemmLayout::Dgrad, 136, 264, 200, false},
               {GemmLayout::Wgrad, 136, 264, 200, false},
               {GemmLayout::Wgrad, 136, 264, 200, true}});
}

TEST(GpuGemm, ForwardTailsAndManyTiles) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  check_cases({{GemmLayout::Forward, 1000, 776, 1000, false},
               {GemmLayout::Forward, 4160, 2312, 776, false},
               {GemmLayout::Forward, 200, 50304, 768, false}});
}

TEST(GpuGemm, DgradTailsAndManyTiles) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  check_cases({{GemmLayout::Dgrad, 1000, 776, 1000, false},
               {GemmLayout::Dgrad, 4160, 2312, 776, false},
               {GemmLayout::Dgrad, 264, 768, 50304, false}});
}

TEST(GpuGemm, WgradSplitKAndAccumulate) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
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
    fill_uniform(X.p, X.n, 101);
    fill_uniform(W.p, W.n, 202);
    DeviceBuffer<float> ref(size_t(m) * n);
    reference_gemm(GemmLayout::Forward, ref.p, X.p, W.p, m, n, k);
    acc = ref.to_host();
  }
};

template <class T>
double host_relative_error(const std::vector<T>& got, const std::vector<float>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = static_cast<float>(got[i]);
    if (!std::isfinite(g)) return INFINITY;
    diff += (g - want[i]) * (g - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

std::vector<float> random_host(size_t n, float lo, float hi, unsigned seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = lo + (hi - lo) * static_cast<float>(coda::testing::splitmix64(seed * 7919ull + i) >> 40) / 16777216.0f;
  return v;
}

template <class T>
void upload(DeviceBuffer<T>& d, const std::vector<T>& h) {
  CUDA_CHECK(cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

TEST(GpuGemm, NormGeluProgramMatchesHostEvaluation) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ForwardProblem prob(1000, 1040, 776);
  const int M = prob.M, N = prob.N;
  const auto r = random_host(M, 0.5f, 2.0f, 1), bias = random_host(N, -1.0f, 1.0f, 2);
  DeviceBuffer<float> r_d(M), bias_d(N);
  upload(r_d, r);
  upload(bias_d, bias);
  for (GemmTile tile : {GemmTile::Cooperative128x256, GemmTile::PingPong128x128}) {
    SCOPED_TRACE(gemm_tile_name(tile));
    const int tiles_n = (N + gemm_tile_n(tile) - 1) / gemm_tile_n(tile);
    DeviceBuffer<__nv_bfloat16> out(size_t(M) * N), pre(size_t(M) * N);
    DeviceBuffer<float> partials(size_t(M) * tiles_n);
    out.poison(), pre.poison(), partials.poison();
    using namespace coda::epi;
    auto device_program = make_program(RowBroadcast<Mul>(r_d.p), ColBroadcast<Add>(bias_d.p),
                                       StoreAux<__nv_bfloat16>(pre.p, N), Elementwise<Gelu>(),
                                       RowReduce<SumSquares>(partials.p));
    gemm_run<GemmLayout::Forward>(tile, out.p, prob.X.p, prob.W.p, M, N, prob.K, false, device_program, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    std::vector<float> want_out(size_t(M) * N), want_pre(size_t(M) * N), want_partials(size_t(M) * tiles_n);
    evaluate_on_host(make_program(RowBroadcast<Mul>(r.data()), ColBroadcast<Add>(bias.data()),
                                  StoreAux<float>(want_pre.data(), N), Elementwise<Gelu>(),
                                  RowReduce<SumSquares>(want_partials.data())),
                     prob.acc.data(), M, N, gemm_tile_n(tile), want_out.data());
    EXPECT_LT(host_relative_error(out.to_host(), want_out), 1e-2);
    EXPECT_LT(host_relative_error(pre.to_host(), want_pre), 1e-2);
    EXPECT_LT(host_relative_error(partials.to_host(), want_partials), 1e-4);
  }
}

TEST(GpuGemm, RopeProgramMatchesHostEvaluation) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  // Two sequences of 2048 tokens (angles up to 2047 rad), head_dim 64, q and k heads in the first 512 columns.
  ForwardProblem prob(4096, 768, 512);
  const int M = prob.M, N = prob.N;
  const auto r = random_host(M, 0.5f, 2.0f, 3);
  DeviceBuffer<float> r_d(M);
  upload(r_d, r);
  using namespace coda::epi;
  const Rope rope{2048, 64, 512, 13.287712f};
  for (GemmTile tile : {GemmTile::Cooperative128x256, GemmTile::PingPong128x128}) {
    SCOPED_TRACE(gemm_tile_name(tile));
    const int tiles_n = (N + gemm_tile_n(tile) - 1) / gemm_tile_n(tile);
    DeviceBuffer<__nv_bfloat16> out(size_t(M) * N);
    DeviceBuffer<float> sumsq(size_t(M) * tiles_n);
    out.poison(), sumsq.poison();
    gemm_run<GemmLayout::Forward>(tile, out.p, prob.X.p, prob.W.p, M, N, prob.K, false,
                                  make_program(RowBroadcast<Mul>(r_d.p), Pairwise<Rope>(rope),
                                               RowReduce<SumSquares>(sumsq.p)),
                                  nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> want_out(size_t(M) * N), want_sumsq(size_t(M) * tiles_n);
    evaluate_on_host(make_program(RowBroadcast<Mul>(r.data()), Pairwise<Rope>(rope),
                                  RowReduce<SumSquares>(want_sumsq.data())),
                     prob.acc.data(), M, N, gemm_tile_n(tile), want_out.data());
    EXPECT_LT(host_relative_error(out.to_host(), want_out), 1e-2);
    EXPECT_LT(host_relative_error(sumsq.to_host(), want_sumsq), 1e-4);
  }
}

TEST(GpuGemm, LogitsLseAndSwiGluProgramMatchesHostEvaluation) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ForwardProblem prob(520, 1296, 1024);
  const int M = prob.M, N = prob.N;
  std::vector<int32_t> target(M);
  for (int i = 0; i < M; ++i) target[i] = static_cast<int32_t>(coda::testing::splitmix64(i) % N);
  DeviceBuffer<int32_t> target_d(M);
  upload(target_d, target);
  for (GemmTile tile : {GemmTile::Cooperative128x256, GemmTile::PingPong128x128}) {
    SCOPED_TRACE(gemm_tile_name(tile));
    using namespace coda::epi;
    const int tiles_n = (N + gemm_tile_n(tile) - 1) / gemm_tile_n(tile);
    DeviceBuffer<__nv_bfloat16> out(size_t(M) * N / 2);
    DeviceBuffer<LogSumExp::Out> lse(size_t(M) * tiles_n);
    DeviceBuffer<float> picked(M), sumsq(size_t(M) * tiles_n);
    out.poison(), lse.poison(), picked.poison(), sumsq.poison();
    auto device_program = make_program(RowPick(target_d.p, picked.p), RowReduce<LogSumExp>(lse.p),
                                       Pairwise<SwiGlu>(), RowReduce<SumSquares>(sumsq.p));
    gemm_run<GemmLayout::Forward>(tile, out.p, prob.X.p, prob.W.p, M, N, prob.K, false, device_program, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    std::vector<float> want_out(size_t(M) * N / 2), want_picked(M), want_sumsq(size_t(M) * tiles_n);
    std::vector<LogSumExp::Out> want_lse(size_t(M) * tiles_n);
    evaluate_on_host(make_program(RowPick(target.data(), want_picked.data()), RowReduce<LogSumExp>(want_lse.data()),
                                  Pairwise<SwiGlu>(), RowReduce<SumSquares>(want_sumsq.data())),
                     prob.acc.data(), M, N, gemm_tile_n(tile), want_out.data());
    EXPECT_LT(host_relative_error(out.to_host(), want_out), 1e-2);
    EXPECT_LT(host_relative_error(picked.to_host(), want_picked), 1e-5);
    EXPECT_LT(host_relative_error(sumsq.to_host(), want_sumsq), 1e-3);  // after tanh.approx (rel. err 5e-4)
    const auto got_lse = lse.to_host();
    std::vector<float> got_rows(M), want_rows(M);
    for (int i = 0; i < M; ++i) {
      got_rows[i] = merge_lse(&got_lse[size_t(i) * tiles_n], tiles_n);
      want_rows[i] = merge_lse(&want_lse[size_t(i) * tiles_n], tiles_n);
    }
    EXPECT_LT(host_relative_error(got_rows, want_rows), 1e-5);
  }
}

}  // namespace
