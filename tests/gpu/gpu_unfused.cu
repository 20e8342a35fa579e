// The unfused mode's kernels on the GPU against the fp32 CPU reference (ref_ops.hpp):
//  * every kernel of kernels/unfused on random bf16-representable inputs of model-like shapes (row lengths
//    768 and 2048, row counts that are not multiples of any block size, tails of column tiles);
//  * the cuBLASLt wrapper's three layouts (forward, dgrad, wgrad with accumulate), bf16 and fp32 outputs.
// The whole model in this mode (and in the coda mode) is tested in gpu_model.cu.
// Inputs are drawn in fp32 and rounded to bf16 once, so both sides compute on identical values; outputs
// are poisoned with NaN before every launch, so an unwritten element fails the check. Errors are relative
// Frobenius norms ||gpu - ref|| / ||ref||, which are NaN-proof (a NaN makes the error NaN and the
// EXPECT_LT fail). Tolerances: bf16 outputs 1e-2 (one bf16 rounding is 2^-9 relative at most, about 2e-3
// in norm), fp32 outputs of fp32 arithmetic 1e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/common/cuda_check.cuh"
#include "kernels/gemm/cublaslt.cuh"
#include "kernels/unfused/unfused.cuh"
#include "src/ref_ops.hpp"
#include "src/rng.hpp"
#include "tests/gpu_test_util.cuh"

namespace {

namespace uf = coda::unfused;
using namespace coda::test;
using uf::bf16;

struct ColumnSums {
  explicit ColumnSums(int max_cols)
      : max_cols(max_cols), partials(uf::column_sum_partials_floats(max_cols)), tickets(uf::column_sum_tickets(max_cols)) {
    CUDA_CHECK(cudaMemset(tickets.get(), 0, tickets.size() * sizeof(unsigned int)));
  }
  uf::ColumnSumWorkspace ws() const { return {partials.get(), tickets.get(), max_cols}; }
  int max_cols;
  DeviceBuffer<float> partials;
  DeviceBuffer<unsigned int> tickets;
};

// ---- kernels ----

TEST(GpuUnfused, EmbeddingForwardBackward) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(1);
  const int B = 4, T = 96, V = 200;  // few ids: many repeats per bucket
  for (auto [C, positions] : {std::pair<int, bool>{768, true}, {768, false}, {2048, false}}) {
    SCOPED_TRACE("C=" + std::to_string(C) + (positions ? " with positions" : ""));
    const auto tokens = random_ids(static_cast<size_t>(B) * T, V, rng);
    const auto wte = random_values(static_cast<size_t>(V) * C, rng), wpe = random_values(static_cast<size_t>(T) * C, rng);
    const auto dx = random_values(static_cast<size_t>(B) * T * C, rng);
    auto dwte0 = random_values(wte.size(), rng, 0.1f), dwpe0 = random_values(wpe.size(), rng, 0.1f);
    std::vector<float> x_ref(dx.size()), dwte_ref = dwte0, dwpe_ref = dwpe0;
    coda::ref::embedding_forward(x_ref.data(), tokens.data(), wte.data(), positions ? wpe.data() : nullptr, B, T, C);
    coda::ref::embedding_backward(dwte_ref.data(), positions ? dwpe_ref.data() : nullptr, dx.data(), tokens.data(), B,
                                  T, C);

    DeviceCopy<int32_t> d_tokens(tokens);
    DeviceBuffer<bf16> d_wte(wte), d_wpe(wpe), d_dx(dx);
    DeviceBuffer<float> d_dwte(dwte0), d_dwpe(dwpe0);
    OutputBuffer<bf16> d_x(dx.size());
    uf::embedding_forward(d_x.get(), d_tokens.get(), d_wte.get(), positions ? d_wpe.get() : nullptr, B, T, C, 0);
    const uf::TokenBuckets buckets = uf::group_rows_by_token(tokens.data(), B * T, V);
    DeviceCopy<int32_t> d_buckets(buckets.packed);
    uf::embedding_backward(d_dwte.get(), positions ? d_dwpe.get() : nullptr, d_dx.get(), d_buckets.get(),
                           buckets.num_buckets, B, T, C, 0);
    EXPECT_LT(rel_error(d_x.download(), x_ref), kBf16Tol);
    EXPECT_LT(rel_error(d_dwte.download(), dwte_ref), kFp32Tol);
    EXPECT_LT(rel_error(d_dwpe.download(), dwpe_ref), kFp32Tol);
  }
}

TEST(GpuUnfused, NormsForwardBackward) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(2);
  ColumnSums column_sums(2048);
  OutputBuffer<float> partials(uf::norm_backward_partials_floats(2048));
  for (bool layernorm : {true, false})
    for (int C : {64, 768, 2048}) {
      SCOPED_TRACE(std::string(layernorm ? "layernorm" : "rmsnorm") + " C=" + std::to_string(C));
      const int N = 1001;  // odd: the forward's second row of a warp runs off the end
      const float eps = 1e-5f;
      const auto x = random_values(static_cast<size_t>(N) * C, rng, 1.5f, 0.3f);
      const auto w = random_values(C, rng, 0.2f, 1.0f), b = random_values(C, rng, 0.2f);
      const auto dy = random_values(x.size(), rng), dx0 = random_values(x.size(), rng);
      auto dw0 = random_values(C, rng), db0 = random_values(C, rng);
      std::vector<float> y_ref(x.size()), mean_ref(N), rstd_ref(N), dx_ref = dx0, dw_ref = dw0, db_ref = db0;
      if (layernorm) {
        coda::ref::layernorm_forward(y_ref.data(), mean_ref.data(), rstd_ref.data(), x.data(), w.data(), b.data(), N, C,
                                     eps);
        coda::ref::layernorm_backward(dx_ref.data(), dw_ref.data(), db_ref.data(), dy.data(), x.data(), w.data(),
                                      mean_ref.data(), rstd_ref.data(), N, C);
      } else {
        coda::ref::rmsnorm_forward(y_ref.data(), rstd_ref.data(), x.data(), w.data(), N, C, eps);
        coda::ref::rmsnorm_backward(dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(), rstd_ref.data(), N, C);
      }
      DeviceBuffer<bf16> d_x(x), d_w(w), d_b(b), d_dy(dy);
      DeviceBuffer<bf16> d_dx(dx0);
      DeviceBuffer<float> d_dw(dw0), d_db(db0);
      OutputBuffer<bf16> d_y(x.size());
      OutputBuffer<float> d_mean(N), d_rstd(N);
      if (layernorm)
        uf::layernorm_forward(d_y.get(), d_mean.get(), d_rstd.get(), d_x.get(), d_w.get(), d_b.get(), N, C, eps, 0);
      else
        uf::rmsnorm_forward(d_y.get(), d_rstd.get(), d_x.get(), d_w.get(), N, C, eps, 0);
      EXPECT_LT(rel_error(d_y.download(), y_ref), kBf16Tol);
      EXPECT_LT(rel_error(d_rstd.download(), rstd_ref), kFp32Tol);
      if (layernorm) EXPECT_LT(rel_error(d_mean.download(), mean_ref), kFp32Tol);
      // The backward gets the reference statistics, so it is checked on its own.
      DeviceBuffer<float> d_mean_ref(mean_ref), d_rstd_ref(rstd_ref);
      if (layernorm)
        uf::layernorm_backward(d_dx.get(), d_dw.get(), d_db.get(), d_dy.get(), d_x.get(), d_w.get(),
                               d_mean_ref.get(), d_rstd_ref.get(), N, C, true, partials.get(), column_sums.ws(), 0);
      else
        uf::rmsnorm_backward(d_dx.get(), d_dw.get(), d_dy.get(), d_x.get(), d_w.get(), d_rstd_ref.get(), N, C,
                             true, partials.get(), column_sums.ws(), 0);
      EXPECT_LT(rel_error(d_dx.download(), dx_ref), kBf16Tol);
      EXPECT_LT(rel_error(d_dw.download(), dw_ref), kFp32Tol);
      if (layernorm) EXPECT_LT(rel_error(d_db.download(), db_ref), kFp32Tol);
      // Without accumulation dx is written, not added: against the reference's dx - dx0.
      d_dx.poison();
      if (layernorm)
        uf::layernorm_backward(d_dx.get(), d_dw.get(), d_db.get(), d_dy.get(), d_x.get(), d_w.get(),
                               d_mean_ref.get(), d_rstd_ref.get(), N, C, false, partials.get(), column_sums.ws(), 0);
      else
        uf::rmsnorm_backward(d_dx.get(), d_dw.get(), d_dy.get(), d_x.get(), d_w.get(), d_rstd_ref.get(), N, C,
                             false, partials.get(), column_sums.ws(), 0);
      std::vector<float> dx_only(x.size(), 0.0f), unused_dw(C, 0.0f), unused_db(C, 0.0f);
      if (layernorm)
        coda::ref::layernorm_backward(dx_only.data(), unused_dw.data(), unused_db.data(), dy.data(), x.data(), w.data(),
                                      mean_ref.data(), rstd_ref.data(), N, C);
      else
        coda::ref::rmsnorm_backward(dx_only.data(), unused_dw.data(), dy.data(), x.data(), w.data(), rstd_ref.data(), N,
                                    C);
      EXPECT_LT(rel_error(d_dx.download(), dx_only), kBf16Tol);
    }
}

TEST(GpuUnfused, BiasAddAndBiasGradient) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(3);
  ColumnSums column_sums(3072);
  for (auto [N, OC] : {std::pair<int, int>{4096, 768}, {3000, 3072}, {40, 72}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " OC=" + std::to_string(OC));
    const auto y = random_values(static_cast<size_t>(N) * OC, rng), b = random_values(OC, rng);
    std::vector<float> y_ref(y.size());
    for (size_t i = 0; i < y.size(); ++i) y_ref[i] = y[i] + b[i % OC];
    DeviceBuffer<bf16> d_y(y), d_b(b);
    uf::bias_add(d_y.get(), d_b.get(), N, OC, 0);
    EXPECT_LT(rel_error(d_y.download(), y_ref), kBf16Tol);

    // db += column sums of dy, twice in a row (the second launch finds the tickets reset by the first), with
    // dy's rows padded to ld = OC + 8 on the device. [4096, 768] and [40, 72] take the cluster finish,
    // [3000, 3072] the last block's (column_sum.cu).
    const int ld = OC + 8;
    const auto dy = random_values(y.size(), rng), db0 = random_values(OC, rng);
    std::vector<float> db_ref = db0, dy_padded(static_cast<size_t>(N) * ld, 1e4f);
    coda::ref::matmul_backward(nullptr, nullptr, db_ref.data(), dy.data(), nullptr, nullptr, N, 1, OC);
    coda::ref::matmul_backward(nullptr, nullptr, db_ref.data(), dy.data(), nullptr, nullptr, N, 1, OC);
    for (int n = 0; n < N; ++n)
      std::copy(dy.begin() + static_cast<size_t>(n) * OC, dy.begin() + static_cast<size_t>(n + 1) * OC,
                dy_padded.begin() + static_cast<size_t>(n) * ld);
    DeviceBuffer<bf16> d_dy(dy_padded);
    DeviceBuffer<float> d_db(db0);
    uf::column_sum(d_db.get(), d_dy.get(), N, OC, ld, column_sums.ws(), 0);
    uf::column_sum(d_db.get(), d_dy.get(), N, OC, ld, column_sums.ws(), 0);
    const std::vector<float> db = d_db.download();
    EXPECT_LT(rel_error(db, db_ref), kFp32Tol);
    // The additions happen in an order fixed by the shape: the same launches give the same bits.
    d_db.upload(db0);
    uf::column_sum(d_db.get(), d_dy.get(), N, OC, ld, column_sums.ws(), 0);
    uf::column_sum(d_db.get(), d_dy.get(), N, OC, ld, column_sums.ws(), 0);
    EXPECT_EQ(std::memcmp(d_db.download().data(), db.data(), db.size() * sizeof(float)), 0);
  }
}

// The kernels are launched with programmatic dependent launch (kernels/common/launch.cuh): each may be scheduled
// while the previous one still runs and must wait for it before touching memory. A chain in which every
// launch reads what the one before wrote (x += 1, then out += column sums of x, 32 times, 3 MB per launch)
// on small integers, where every sum is exact in bf16 and fp32, so any launch that ran early shows.
TEST(GpuUnfused, BackToBackLaunchesKeepStreamOrder) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(9);
  const int N = 4096, C = 768, rounds = 32;
  ColumnSums column_sums(C);
  std::vector<float> x(static_cast<size_t>(N) * C), ones(x.size(), 1.0f), out(C, 0.0f);
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng.below(9)) - 4);
  DeviceBuffer<bf16> d_x(x), d_ones(ones);
  DeviceBuffer<float> d_out(out);
  for (int k = 1; k <= rounds; ++k) {
    uf::residual_add(d_x.get(), d_x.get(), d_ones.get(), x.size(), 0);
    uf::column_sum(d_out.get(), d_x.get(), N, C, C, column_sums.ws(), 0);
    for (size_t i = 0; i < x.size(); ++i) out[i % C] += x[i] + static_cast<float>(k);
  }
  const std::vector<float> got = d_out.download();
  int wrong = 0;
  for (int j = 0; j < C; ++j) wrong += got[j] != out[j];
  EXPECT_EQ(wrong, 0) << "column 0: " << got[0] << " vs " << out[0];
}

TEST(GpuUnfused, ResidualGeluSwiglu) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(4);
  const int N = 777, F = 1024;
  const size_t n = static_cast<size_t>(N) * F;
  const auto a = random_values(n, rng, 2.0f), b = random_values(n, rng), dy = random_values(n, rng);
  DeviceBuffer<bf16> d_a(a), d_b(b), d_dy(dy);
  OutputBuffer<bf16> d_out(n), d_out2(2 * n);

  std::vector<float> ref(n);
  for (size_t i = 0; i < n; ++i) ref[i] = a[i] + b[i];
  uf::residual_add(d_out.get(), d_a.get(), d_b.get(), n, 0);
  EXPECT_LT(rel_error(d_out.download(), ref), kBf16Tol);

  coda::ref::gelu_forward(ref.data(), a.data(), n);
  d_out.poison();
  uf::gelu_forward(d_out.get(), d_a.get(), n, 0);
  EXPECT_LT(rel_error(d_out.download(), ref), kBf16Tol);
  std::fill(ref.begin(), ref.end(), 0.0f);
  coda::ref::gelu_backward(ref.data(), dy.data(), a.data(), n);
  d_out.poison();
  uf::gelu_backward(d_out.get(), d_dy.get(), d_a.get(), n, 0);
  EXPECT_LT(rel_error(d_out.download(), ref), kBf16Tol);

  const auto gu = random_values(2 * n, rng, 2.0f);
  DeviceBuffer<bf16> d_gu(gu);
  coda::ref::swiglu_forward(ref.data(), gu.data(), N, F);
  d_out.poison();
  uf::swiglu_forward(d_out.get(), d_gu.get(), N, F, 0);
  EXPECT_LT(rel_error(d_out.download(), ref), kBf16Tol);
  std::vector<float> dgu_ref(2 * n, 0.0f);
  coda::ref::swiglu_backward(dgu_ref.data(), dy.data(), gu.data(), N, F);
  uf::swiglu_backward(d_out2.get(), d_dy.get(), d_gu.get(), N, F, 0);
  EXPECT_LT(rel_error(d_out2.download(), dgu_ref), kBf16Tol);
}

TEST(GpuUnfused, Rope) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(5);
  const int B = 3, T = 200, nh = 8, nkv = 2;
  for (auto [hd, theta] : {std::pair<int, float>{64, 10000.0f}, {128, 500000.0f}}) {
    SCOPED_TRACE("hd=" + std::to_string(hd));
    const int row = (nh + 2 * nkv) * hd;
    const auto qkv = random_values(static_cast<size_t>(B) * T * row, rng);
    const std::vector<float2> table = uf::rope_table(T, hd, theta);
    DeviceCopy<float2> d_table(table);
    for (bool inverse : {false, true}) {
      std::vector<float> ref = qkv;
      if (inverse)
        coda::ref::rope_backward(ref.data(), B, T, nh, nkv, hd, theta);
      else
        coda::ref::rope_forward(ref.data(), B, T, nh, nkv, hd, theta);
      DeviceBuffer<bf16> d_qkv(qkv);
      uf::rope(d_qkv.get(), d_table.get(), B, T, nh, nkv, hd, inverse, 0);
      EXPECT_LT(rel_error(d_qkv.download(), ref), kBf16Tol);
    }
  }
}

TEST(GpuUnfused, CrossEntropy) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(6);
  for (auto [N, V] : {std::pair<int, int>{300, 1000}, {24, 50257}}) {
    SCOPED_TRACE("V=" + std::to_string(V));
    const int Vp = (V + 127) / 128 * 128;
    auto logits = random_values(static_cast<size_t>(N) * Vp, rng, 3.0f);
    for (int n = 0; n < N; ++n)
      for (int j = V; j < Vp; ++j) logits[static_cast<size_t>(n) * Vp + j] = 0.0f;  // padded rows of the head
    const auto targets = random_ids(N, V, rng);
    const float dloss = 1.0f / N;
    std::vector<float> losses_ref(N), dlogits_ref(logits.size());
    coda::ref::crossentropy_forward(losses_ref.data(), logits.data(), targets.data(), N, V, Vp);
    coda::ref::crossentropy_backward(dlogits_ref.data(), logits.data(), targets.data(), dloss, N, V, Vp);
    DeviceBuffer<bf16> d_logits(logits);
    DeviceCopy<int32_t> d_targets(targets);
    OutputBuffer<float> d_losses(N), d_lse(N);
    uf::crossentropy_forward(d_losses.get(), d_lse.get(), d_logits.get(), d_targets.get(), N, V, Vp, 0);
    EXPECT_LT(rel_error(d_losses.download(), losses_ref), kFp32Tol);
    uf::crossentropy_backward(d_logits.get(), d_logits.get(), d_lse.get(), d_targets.get(), dloss, N, V, Vp, 0);
    const auto dlogits = d_logits.download();
    EXPECT_LT(rel_error(dlogits, dlogits_ref), kBf16Tol);
    for (int n = 0; n < N; ++n)
      for (int j = V; j < Vp; ++j) ASSERT_EQ(dlogits[static_cast<size_t>(n) * Vp + j], 0.0f);
  }
}

TEST(GpuUnfused, AdamWAndGradNorm) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(7);
  const size_t n = 64 * 3001;
  const auto p0 = random_values(n, rng, 0.05f), g = random_values(n, rng, 0.01f);
  const auto m0 = random_values(n, rng, 0.001f);
  std::vector<float> v0 = random_values(n, rng, 1e-5f);
  for (auto& x : v0) x = std::fabs(x);
  std::vector<uint8_t> decay(n / 64);
  for (auto& d : decay) d = static_cast<uint8_t>(rng.below(2));
  const uf::AdamWStep step{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, 5};
  std::vector<float> p_ref = p0, m_ref = m0, v_ref = v0;
  for (size_t i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]) * step.grad_scale;
    m_ref[i] = static_cast<float>(step.beta1 * m0[i] + (1.0 - step.beta1) * gi);
    v_ref[i] = static_cast<float>(step.beta2 * v0[i] + (1.0 - step.beta2) * gi * gi);
    const double mhat = m_ref[i] / (1.0 - std::pow(step.beta1, step.step));
    const double vhat = v_ref[i] / (1.0 - std::pow(step.beta2, step.step));
    const double wd = decay[i / 64] ? step.weight_decay : 0.0;
    p_ref[i] = static_cast<float>(p0[i] - step.lr * (mhat / (std::sqrt(vhat) + step.eps) + wd * p0[i]));
  }
  DeviceBuffer<float> d_p(p0), d_m(m0), d_v(v0), d_g(g);
  DeviceCopy<uint8_t> d_decay(decay);
  OutputBuffer<bf16> d_p16(n);
  uf::adamw(d_p.get(), d_p16.get(), d_m.get(), d_v.get(), d_g.get(), d_decay.get(), n, step, 0);
  // Compare the update p - p0 (the parameters themselves hide errors of the small step).
  const auto p_gpu = d_p.download();
  std::vector<float> delta_gpu(n), delta_ref(n);
  for (size_t i = 0; i < n; ++i) delta_gpu[i] = p_gpu[i] - p0[i], delta_ref[i] = p_ref[i] - p0[i];
  EXPECT_LT(rel_error(delta_gpu, delta_ref), 1e-3);
  EXPECT_LT(rel_error(d_m.download(), m_ref), kFp32Tol);
  EXPECT_LT(rel_error(d_v.download(), v_ref), kFp32Tol);
  EXPECT_LT(rel_error(d_p16.download(), p_ref), kBf16Tol);

  // Sum of squares, twice (the ticket must be reset by the first launch).
  OutputBuffer<float> partials(uf::grad_sumsq_partials_floats()), result(1);
  OutputBuffer<unsigned int> ticket(1);
  CUDA_CHECK(cudaMemset(ticket.get(), 0, sizeof(unsigned int)));
  double sumsq = 0.0;
  for (float x : g) sumsq += static_cast<double>(x) * x;
  for (int round = 0; round < 2; ++round) {
    result.poison();
    uf::grad_sumsq(result.get(), d_g.get(), n, partials.get(), ticket.get(), 0);
    EXPECT_NEAR(result.download()[0], sumsq, 1e-5 * sumsq);
  }
}

// ---- cuBLASLt wrapper: the three GEMMs of a linear layer ----

TEST(GpuUnfused, CublasLtLayouts) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(8);
  const int N = 384, IC = 256, OC = 320;
  const auto x = random_values(static_cast<size_t>(N) * IC, rng), w = random_values(static_cast<size_t>(OC) * IC, rng);
  const auto dy = random_values(static_cast<size_t>(N) * OC, rng), dw0 = random_values(w.size(), rng);
  std::vector<float> y_ref(static_cast<size_t>(N) * OC), dx_ref(x.size(), 0.0f), dw_ref = dw0;
  coda::ref::matmul_forward(y_ref.data(), x.data(), w.data(), nullptr, N, IC, OC);
  coda::ref::matmul_backward(dx_ref.data(), dw_ref.data(), nullptr, dy.data(), x.data(), w.data(), N, IC, OC);

  coda::CublasLt cublas;
  DeviceBuffer<bf16> d_x(x), d_w(w), d_dy(dy);
  OutputBuffer<bf16> d_y(y_ref.size()), d_dx(x.size());
  OutputBuffer<float> d_y32(y_ref.size()), d_dx32(x.size());
  DeviceBuffer<float> d_dw(dw0);
  cublas.gemm(d_y.get(), d_x.get(), coda::Op::N, d_w.get(), coda::Op::T, N, OC, IC, false, 0);
  cublas.gemm(d_y32.get(), d_x.get(), coda::Op::N, d_w.get(), coda::Op::T, N, OC, IC, false, 0);
  cublas.gemm(d_dx.get(), d_dy.get(), coda::Op::N, d_w.get(), coda::Op::N, N, IC, OC, false, 0);
  cublas.gemm(d_dx32.get(), d_dy.get(), coda::Op::N, d_w.get(), coda::Op::N, N, IC, OC, false, 0);
  cublas.gemm(d_dw.get(), d_dy.get(), coda::Op::T, d_x.get(), coda::Op::N, OC, IC, N, true, 0);
  EXPECT_LT(rel_error(d_y.download(), y_ref), kBf16Tol);
  EXPECT_LT(rel_error(d_y32.download(), y_ref), kFp32Tol);
  EXPECT_LT(rel_error(d_dx.download(), dx_ref), kBf16Tol);
  EXPECT_LT(rel_error(d_dx32.download(), dx_ref), kFp32Tol);
  EXPECT_LT(rel_error(d_dw.download(), dw_ref), kFp32Tol);

  // bf16 accumulation into an existing output: y += x W^T.
  DeviceBuffer<bf16> d_acc(y_ref);
  cublas.gemm(d_acc.get(), d_x.get(), coda::Op::N, d_w.get(), coda::Op::T, N, OC, IC, true, 0);
  std::vector<float> twice(y_ref.size());
  for (size_t i = 0; i < y_ref.size(); ++i) twice[i] = round_bf16(y_ref[i]) + y_ref[i];
  EXPECT_LT(rel_error(d_acc.download(), twice), kBf16Tol);
}

}  // namespace
