// GPU attention (kernels/attention) against the fp32 CPU reference (ref::attention_forward/backward) on the
// same bf16-rounded random inputs: forward out and lse, backward dq, dk, dv. Shapes cover head dims 64 and
// 128, GQA ratios 1, 2 and 4, B > 1, T not a multiple of any block size, and T = 1. The CODA write-out is
// checked the same way (above WriteoutCase below). Every output buffer is poisoned (NaN) before the kernel
// runs, so an element the kernel fails to write poisons the error norms. Errors are relative Frobenius norms
// ||gpu - ref|| / ||ref|| (lse: max absolute error); bf16 outputs and bf16 P / dS operands put them around
// 2e-3 (measured on H200: 1.8e-3 out, 2.3e-3..3.3e-3 gradients). The backward runs with both dQ sums
// (DqSum): the ordered one must also give the same bits twice.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/attention/attention.cuh"
#include "kernels/coda/attention_writeout.cuh"
#include "src/ref_ops.hpp"
#include "tests/gpu_test_util.cuh"

namespace {

using coda::AttentionShape;
using coda::test::DeviceBuffer;
using coda::test::rel_error;

struct Case {
  int B, T, n_head, n_kv_head, head_dim;
};

class GpuAttention : public ::testing::TestWithParam<Case> {};

TEST_P(GpuAttention, MatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  AttentionShape s;
  s.B = c.B, s.T = c.T, s.n_head = c.n_head, s.n_kv_head = c.n_kv_head, s.head_dim = c.head_dim;
  const size_t rows = static_cast<size_t>(s.B) * s.T, out_dim = static_cast<size_t>(s.n_head) * s.head_dim;

  coda::Rng rng(1234 + c.T * 7 + c.head_dim + c.n_kv_head);
  // q, k with sigma 1.5 give scores of std ~2.25 after the 1/sqrt(hd) scale: peaked, not one-hot softmax.
  const std::vector<float> qkv = coda::test::random_bf16_values(rows * s.qkv_dim(), 1.5f, rng);
  const std::vector<float> dout = coda::test::random_bf16_values(rows * out_dim, 1.0f, rng);
  std::vector<float> ref_out(rows * out_dim), ref_lse(static_cast<size_t>(s.B) * s.n_head * s.T);
  std::vector<float> ref_dqkv(rows * s.qkv_dim(), 0.0f);
  coda::ref::attention_forward(ref_out.data(), ref_lse.data(), qkv.data(), s.B, s.T, s.n_head, s.n_kv_head, s.head_dim);
  coda::ref::attention_backward(ref_dqkv.data(), dout.data(), qkv.data(), ref_out.data(), ref_lse.data(), s.B, s.T,
                                s.n_head, s.n_kv_head, s.head_dim);

  DeviceBuffer<__nv_bfloat16> d_qkv(qkv), d_dout(dout), d_out(rows * out_dim), d_dqkv(rows * s.qkv_dim());
  DeviceBuffer<float> d_lse(ref_lse.size());
  DeviceBuffer<unsigned char> d_work(coda::attention_backward_workspace_bytes(s));
  d_out.poison(), d_dqkv.poison(), d_lse.poison(), d_work.poison();

  coda::attention_forward(d_out.get(), d_lse.get(), d_qkv.get(), s, nullptr);
  CUDA_CHECK_LAUNCH();
  coda::attention_backward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), d_work.get(), s, nullptr);
  CUDA_CHECK_LAUNCH();
  const std::vector<float> out = d_out.download(), dqkv = d_dqkv.download(), lse = d_lse.download();

  double lse_err = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    const double e = std::fabs(lse[i] - ref_lse[i]);
    lse_err = std::isnan(e) ? INFINITY : std::max(lse_err, e);
  }
  const int hd = s.head_dim, QKV = s.qkv_dim();
  const double out_err = rel_error(out, ref_out);
  const double dq_err = rel_error(dqkv, ref_dqkv, QKV, 0, s.n_head * hd);
  const double dk_err = rel_error(dqkv, ref_dqkv, QKV, s.n_head * hd, s.n_kv_head * hd);
  const double dv_err = rel_error(dqkv, ref_dqkv, QKV, (s.n_head + s.n_kv_head) * hd, s.n_kv_head * hd);
  std::printf("attention B=%d T=%d heads=%d/%d hd=%d: out %.2e lse(abs) %.2e dq %.2e dk %.2e dv %.2e\n", s.B, s.T,
              s.n_head, s.n_kv_head, hd, out_err, lse_err, dq_err, dk_err, dv_err);
  EXPECT_LT(out_err, 1e-2);
  EXPECT_LT(lse_err, 1e-3);
  EXPECT_LT(dq_err, 1e-2);
  EXPECT_LT(dk_err, 1e-2);
  EXPECT_LT(dv_err, 1e-2);

  // DqSum::Ordered: the same gradient up to the order of dQ's fp32 sums, and twice the same bits. Its
  // workspace is poisoned too: the sum must read only the key blocks' parts that the main kernel wrote.
  DeviceBuffer<unsigned char> d_ordered_work(coda::attention_backward_workspace_bytes(s, coda::DqSum::Ordered));
  std::vector<float> ordered[2];
  for (std::vector<float>& result : ordered) {
    d_dqkv.poison(), d_ordered_work.poison();
    coda::attention_backward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), d_ordered_work.get(),
                             s, nullptr, nullptr, coda::DqSum::Ordered);
    CUDA_CHECK_LAUNCH();
    result = d_dqkv.download();
  }
  EXPECT_LT(rel_error(ordered[0], ref_dqkv, QKV, 0, s.n_head * hd), 1e-2);
  EXPECT_LT(rel_error(ordered[0], dqkv), 1e-3) << "ordered against atomic dQ sums";
  EXPECT_EQ(ordered[0], ordered[1]) << "two ordered backward passes differ";
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttention,
                         ::testing::Values(Case{2, 97, 4, 4, 64}, Case{2, 200, 4, 2, 64}, Case{1, 257, 8, 2, 64},
                                           Case{3, 64, 4, 1, 64}, Case{1, 1, 2, 1, 64}, Case{2, 130, 4, 1, 128},
                                           Case{1, 300, 4, 2, 128}, Case{2, 128, 2, 2, 128},
                                           Case{1, 1000, 2, 1, 128}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" +
                                  std::to_string(c.n_head) + "_KV" + std::to_string(c.n_kv_head) + "_hd" +
                                  std::to_string(c.head_dim);
                         });

// The CODA write-out (AttentionWriteout) against a host computation of its contract: the reference gradient
// g, dz = inverse-RoPE(g) (Llama style) or g (GPT-2 style), dqkv = r dz, the row dots <dz, z> (z = the
// inverse-rotated stored qkv: the kernel takes the dot before rotating, so this also checks that shortcut),
// <dz, c>, <dz, b'>, and the column partials over groups of 16 positions of one sequence
// (attention_writeout_groups); r and mu from random norm partials.
struct WriteoutCase {
  int B, T, n_head, n_kv_head, head_dim;
  bool layernorm;    // GPT-2 style (c, b', column partials, no RoPE); else Llama style (RMSNorm, RoPE)
  float rope_theta;  // Llama style only
};

class GpuAttentionWriteout : public ::testing::TestWithParam<WriteoutCase> {};

// Random norm partials (count per row) of rows of length d: RMSNorm mean squares in [0.1, 1.4]; LayerNorm
// means ~N(0, 0.5) and variances in [0.2, 1.5]. Returns r per row (fp64, from the partials).
void random_norm_partials(std::vector<float>& sum, std::vector<float>& sumsq, std::vector<double>& rstd, int N,
                          int count, int d, float eps, bool layernorm, coda::Rng& rng) {
  sum.assign(static_cast<size_t>(N) * count, 0.0f), sumsq.assign(sum.size(), 0.0f);
  rstd.assign(N, 0.0);
  const float share = static_cast<float>(d) / count;
  for (int row = 0; row < N; ++row) {
    float* s = &sum[static_cast<size_t>(row) * count];
    float* sq = &sumsq[static_cast<size_t>(row) * count];
    double total = 0, total_sq = 0;
    for (int i = 0; i < count; ++i) total += s[i] = layernorm ? share * 0.5f * static_cast<float>(rng.normal()) : 0.0f;
    const double mu = total / d;
    for (int i = 0; i < count; ++i)
      total_sq += sq[i] = share * static_cast<float>(mu * mu + (layernorm ? 0.2 : 0.1) + 1.3 * rng.uniform());
    rstd[row] = 1.0 / std::sqrt(total_sq / d - mu * mu + eps);
  }
}

TEST_P(GpuAttentionWriteout, MatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  const WriteoutCase c = GetParam();
  AttentionShape s;
  s.B = c.B, s.T = c.T, s.n_head = c.n_head, s.n_kv_head = c.n_kv_head, s.head_dim = c.head_dim;
  const int N = s.B * s.T, QKV = s.qkv_dim(), hd = s.head_dim;
  const size_t out_dim = static_cast<size_t>(s.n_head) * hd;

  coda::Rng rng(99 + c.T * 3 + c.head_dim + c.n_head + (c.layernorm ? 1 : 0));
  const std::vector<float> qkv = coda::test::random_bf16_values(static_cast<size_t>(N) * QKV, 1.5f, rng);
  const std::vector<float> dout = coda::test::random_bf16_values(N * out_dim, 1.0f, rng);
  std::vector<float> ref_out(N * out_dim), ref_lse(static_cast<size_t>(s.B) * s.n_head * s.T);
  std::vector<float> dz(static_cast<size_t>(N) * QKV, 0.0f), z = qkv;
  coda::ref::attention_forward(ref_out.data(), ref_lse.data(), qkv.data(), s.B, s.T, s.n_head, s.n_kv_head, hd);
  coda::ref::attention_backward(dz.data(), dout.data(), qkv.data(), ref_out.data(), ref_lse.data(), s.B, s.T,
                                s.n_head, s.n_kv_head, hd);
  if (!c.layernorm) {
    coda::ref::rope_backward(dz.data(), s.B, s.T, s.n_head, s.n_kv_head, hd, c.rope_theta);
    coda::ref::rope_backward(z.data(), s.B, s.T, s.n_head, s.n_kv_head, hd, c.rope_theta);
  }

  const int count = 3, d = 384;
  const float eps = 1e-5f;
  std::vector<float> sum, sumsq;
  std::vector<double> rstd;
  random_norm_partials(sum, sumsq, rstd, N, count, d, eps, c.layernorm, rng);
  std::vector<float> c_vec(QKV), b_vec(QKV);
  for (int j = 0; j < QKV; ++j) c_vec[j] = static_cast<float>(rng.normal()), b_vec[j] = static_cast<float>(rng.normal());

  // The contract on the host, in fp64.
  const int groups_per_seq = (s.T + 15) / 16, groups = coda::attention_writeout_groups(s);
  ASSERT_EQ(groups, s.B * groups_per_seq);
  std::vector<float> ref_dqkv(dz.size()), ref_dot_z(N), ref_dot_c(N), ref_dot_b(N);
  std::vector<double> col_b_acc(static_cast<size_t>(groups) * QKV, 0.0);
  for (int row = 0; row < N; ++row) {
    double dot_z = 0, dot_c = 0, dot_b = 0;
    for (int j = 0; j < QKV; ++j) {
      const size_t at = static_cast<size_t>(row) * QKV + j;
      const double g = dz[at];
      dot_z += g * z[at], dot_c += g * c_vec[j], dot_b += g * b_vec[j];
      ref_dqkv[at] = static_cast<float>(rstd[row] * g);
      const size_t group = static_cast<size_t>(row / s.T) * groups_per_seq + row % s.T / 16;
      col_b_acc[group * QKV + j] += g;
    }
    ref_dot_z[row] = static_cast<float>(dot_z), ref_dot_c[row] = static_cast<float>(dot_c);
    ref_dot_b[row] = static_cast<float>(dot_b);
  }
  const std::vector<float> ref_col_b(col_b_acc.begin(), col_b_acc.end());

  DeviceBuffer<__nv_bfloat16> d_qkv(qkv), d_dout(dout), d_out(N * out_dim), d_dqkv(static_cast<size_t>(N) * QKV);
  DeviceBuffer<float> d_lse(ref_lse.size()), d_sum(sum), d_sumsq(sumsq), d_c(c_vec), d_b(b_vec);
  DeviceBuffer<float> d_dot_z(N), d_dot_c(N), d_dot_b(N), d_col_b(ref_col_b.size());
  DeviceBuffer<unsigned char> d_work(coda::attention_backward_workspace_bytes(s));
  d_dqkv.poison(), d_work.poison(), d_dot_z.poison(), d_dot_c.poison(), d_dot_b.poison();
  d_col_b.poison();

  coda::AttentionWriteout w;
  w.stats.sum = c.layernorm ? d_sum.get() : nullptr;
  w.stats.sumsq = d_sumsq.get();
  w.stats.count = count, w.stats.d = d, w.stats.eps = eps;
  w.dot_z = d_dot_z.get();
  if (c.layernorm) {
    w.c = d_c.get(), w.b_prime = d_b.get(), w.dot_c = d_dot_c.get(), w.dot_b = d_dot_b.get();
    w.col_b = d_col_b.get();
  } else {
    w.rope_theta = c.rope_theta;
  }
  coda::attention_forward(d_out.get(), d_lse.get(), d_qkv.get(), s, nullptr);
  CUDA_CHECK_LAUNCH();
  coda::attention_backward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), d_work.get(), s, nullptr,
                           &w);
  CUDA_CHECK_LAUNCH();

  const std::vector<float> dqkv = d_dqkv.download(), dot_z = d_dot_z.download();
  const double dq_err = rel_error(dqkv, ref_dqkv, QKV, 0, s.n_head * hd);
  const double dk_err = rel_error(dqkv, ref_dqkv, QKV, s.n_head * hd, s.n_kv_head * hd);
  const double dv_err = rel_error(dqkv, ref_dqkv, QKV, (s.n_head + s.n_kv_head) * hd, s.n_kv_head * hd);
  const double dot_z_err = rel_error(dot_z, ref_dot_z);
  std::printf("writeout %s B=%d T=%d heads=%d/%d hd=%d: dq %.2e dk %.2e dv %.2e dot_z %.2e", c.layernorm ? "LN" : "RoPE",
              s.B, s.T, s.n_head, s.n_kv_head, hd, dq_err, dk_err, dv_err, dot_z_err);
  EXPECT_LT(dq_err, 1e-2);
  EXPECT_LT(dk_err, 1e-2);
  EXPECT_LT(dv_err, 1e-2);
  EXPECT_LT(dot_z_err, 1e-2);
  if (c.layernorm) {
    const double dot_c_err = rel_error(d_dot_c.download(), ref_dot_c), dot_b_err = rel_error(d_dot_b.download(), ref_dot_b);
    const double col_b_err = rel_error(d_col_b.download(), ref_col_b);
    std::printf(" dot_c %.2e dot_b %.2e col_b %.2e", dot_c_err, dot_b_err, col_b_err);
    EXPECT_LT(dot_c_err, 1e-2);
    EXPECT_LT(dot_b_err, 1e-2);
    EXPECT_LT(col_b_err, 1e-2);
  }
  std::printf("\n");
}

// T is never a multiple of the 16-position group (each sequence ends in a short group), and the last
// shape has more 8-column chunks of q per row (256) than a block has threads (the chunk loop).
INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttentionWriteout,
                         ::testing::Values(WriteoutCase{2, 97, 4, 2, 64, false, 10000.0f},
                                           WriteoutCase{2, 97, 4, 2, 64, true, 0.0f},
                                           WriteoutCase{1, 200, 4, 1, 128, false, 500000.0f},
                                           WriteoutCase{3, 70, 4, 2, 128, true, 0.0f},
                                           WriteoutCase{1, 77, 16, 2, 128, true, 0.0f},
                                           WriteoutCase{2, 45, 32, 8, 64, false, 10000.0f}),
                         [](const ::testing::TestParamInfo<WriteoutCase>& info) {
                           const WriteoutCase& c = info.param;
                           return std::string(c.layernorm ? "LN" : "RoPE") + "_B" + std::to_string(c.B) + "_T" +
                                  std::to_string(c.T) + "_H" + std::to_string(c.n_head) + "_KV" +
                                  std::to_string(c.n_kv_head) + "_hd" + std::to_string(c.head_dim);
                         });

// Inconsistent write-outs are refused before anything is launched (no GPU needed).
TEST(GpuAttention, RejectsBadWriteouts) {
  AttentionShape s;
  s.B = 1, s.T = 16, s.n_head = 4, s.n_kv_head = 2, s.head_dim = 64;
  alignas(16) float dummy[8] = {};
  auto refused = [&](const coda::AttentionWriteout& w) {
    EXPECT_THROW(coda::attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, s, nullptr, &w),
                 std::invalid_argument);
  };
  coda::AttentionWriteout w;
  w.stats.sumsq = dummy, w.stats.count = 1, w.stats.d = 64;
  refused(w);  // no dot_z
  w.dot_z = dummy;
  w.rope_theta = -1.0f;
  refused(w);
  w.rope_theta = 0.0f;
  w.c = dummy;
  refused(w);  // c without b', dot_c, dot_b
  w.c = nullptr, w.col_b = dummy + 1;
  refused(w);  // column partials not 16-byte aligned
  w.stats.count = 0, w.col_b = nullptr;
  refused(w);
}

TEST(GpuAttention, RejectsBadShapes) {
  AttentionShape s;
  s.B = 1, s.T = 16, s.n_head = 4, s.n_kv_head = 3, s.head_dim = 64;
  EXPECT_THROW(coda::attention_backward_workspace_bytes(s), std::invalid_argument);
  s.n_kv_head = 2, s.head_dim = 96;
  EXPECT_THROW(coda::attention_backward_workspace_bytes(s), std::invalid_argument);
}

}  // namespace
