// Tests of the fp32 CPU reference ops (ref_ops.hpp): each forward against a property or value it must
// have, each backward against central differences of its forward (ref_gradcheck.hpp), on random data
// with odd sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "ref_gradcheck.hpp"
#include "ref_ops.hpp"
#include "rng.hpp"

namespace {

using coda::Rng;
using coda::test::grad_matches;
using coda::test::GradBuffer;
using coda::test::project;
using coda::test::random_vector;
using coda::test::sample_indices;
namespace ref = coda::ref;

// Step and tolerance of the finite-difference checks on O(1) data: eps balances the O(eps^2) truncation
// error against fp32 rounding of the outputs divided by eps.
constexpr float kEps = 1e-2f;
constexpr double kTol = 1e-3;
constexpr size_t kSamples = 60;  // entries checked per input tensor

TEST(RefOps, Embedding) {
  Rng rng(1);
  const int B = 2, T = 5, C = 16, V = 11;
  std::vector<int32_t> tokens(B * T);
  for (auto& token : tokens) token = static_cast<int32_t>(rng.below(V));
  tokens[7] = tokens[2];  // a repeated token: its gradient rows must sum
  auto wte = random_vector(V * C, rng), wpe = random_vector(T * C, rng);
  std::vector<float> x(B * T * C);
  ref::embedding_forward(x.data(), tokens.data(), wte.data(), nullptr, B, T, C);
  for (int n = 0; n < B * T; ++n)
    for (int c = 0; c < C; ++c) ASSERT_EQ(x[n * C + c], wte[tokens[n] * C + c]);
  ref::embedding_forward(x.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  for (int n = 0; n < B * T; ++n)
    for (int c = 0; c < C; ++c) ASSERT_EQ(x[n * C + c], wte[tokens[n] * C + c] + wpe[(n % T) * C + c]);

  const auto r = random_vector(x.size(), rng);
  GradBuffer dwte(wte.size(), rng), dwpe(wpe.size(), rng);
  ref::embedding_backward(dwte.ptr(), dwpe.ptr(), r.data(), tokens.data(), B, T, C);
  auto loss = [&] {
    ref::embedding_forward(x.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return project(x.data(), r);
  };
  EXPECT_TRUE(grad_matches("embedding dwte", wte.data(), dwte.added(), loss, kEps,
                           sample_indices(wte.size(), 1000, rng), kTol));
  EXPECT_TRUE(grad_matches("embedding dwpe", wpe.data(), dwpe.added(), loss, kEps,
                           sample_indices(wpe.size(), 1000, rng), kTol));
}

TEST(RefOps, Matmul) {
  Rng rng(2);
  const int N = 13, IC = 24, OC = 19;
  auto x = random_vector(N * IC, rng), w = random_vector(OC * IC, rng, 0.2f), b = random_vector(OC, rng);
  std::vector<float> y(N * OC);
  ref::matmul_forward(y.data(), x.data(), w.data(), b.data(), N, IC, OC);
  for (int n : {0, 5, N - 1})
    for (int o : {0, 7, OC - 1}) {
      double expected = b[o];
      for (int i = 0; i < IC; ++i) expected += static_cast<double>(x[n * IC + i]) * w[o * IC + i];
      EXPECT_NEAR(y[n * OC + o], expected, 1e-5);
    }

  const auto r = random_vector(y.size(), rng);
  GradBuffer dx(x.size(), rng), dw(w.size(), rng), db(b.size(), rng);
  ref::matmul_backward(dx.ptr(), dw.ptr(), db.ptr(), r.data(), x.data(), w.data(), N, IC, OC);
  auto loss = [&] {
    ref::matmul_forward(y.data(), x.data(), w.data(), b.data(), N, IC, OC);
    return project(y.data(), r);
  };
  EXPECT_TRUE(
      grad_matches("matmul dx", x.data(), dx.added(), loss, kEps, sample_indices(x.size(), kSamples, rng), kTol));
  EXPECT_TRUE(
      grad_matches("matmul dw", w.data(), dw.added(), loss, kEps, sample_indices(w.size(), kSamples, rng), kTol));
  EXPECT_TRUE(
      grad_matches("matmul db", b.data(), db.added(), loss, kEps, sample_indices(b.size(), kSamples, rng), kTol));
}

// Both norms, forward properties and gradients; `layer` selects LayerNorm (else RMSNorm).
void check_norm(bool layer, uint64_t seed) {
  Rng rng(seed);
  const int N = 11, C = 40;
  const float eps = 1e-5f;
  auto x = random_vector(N * C, rng, 2.0f, 0.5f), w = random_vector(C, rng, 0.3f, 1.0f), b = random_vector(C, rng);
  std::vector<float> y(N * C), mean(N), rstd(N);
  auto forward = [&] {
    if (layer)
      ref::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, eps);
    else
      ref::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  };
  forward();
  // The saved statistics are those of the row, and undoing the gain (and bias) leaves rows of mean 0
  // (LayerNorm) and mean square ~1.
  for (int n = 0; n < N; ++n) {
    double x_sum = 0.0, x_squares = 0.0, xhat_sum = 0.0, xhat_squares = 0.0;
    for (int c = 0; c < C; ++c) {
      x_sum += x[n * C + c];
      x_squares += static_cast<double>(x[n * C + c]) * x[n * C + c];
      const double xhat = (y[n * C + c] - (layer ? b[c] : 0.0f)) / w[c];
      xhat_sum += xhat;
      xhat_squares += xhat * xhat;
    }
    const double x_mean = layer ? x_sum / C : 0.0;
    EXPECT_NEAR(rstd[n], 1.0 / std::sqrt(x_squares / C - x_mean * x_mean + eps), 1e-5 * rstd[n]);
    EXPECT_NEAR(xhat_squares / C, 1.0, 1e-4);
    if (layer) {
      EXPECT_NEAR(mean[n], x_mean, 1e-5);
      EXPECT_NEAR(xhat_sum / C, 0.0, 1e-5);
    }
  }

  const auto r = random_vector(y.size(), rng);
  GradBuffer dx(x.size(), rng), dw(w.size(), rng), db(b.size(), rng);
  if (layer)
    ref::layernorm_backward(dx.ptr(), dw.ptr(), db.ptr(), r.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  else
    ref::rmsnorm_backward(dx.ptr(), dw.ptr(), r.data(), x.data(), w.data(), rstd.data(), N, C);
  auto loss = [&] {
    forward();
    return project(y.data(), r);
  };
  const std::string name = layer ? "layernorm" : "rmsnorm";
  EXPECT_TRUE(
      grad_matches(name + " dx", x.data(), dx.added(), loss, kEps, sample_indices(x.size(), kSamples, rng), kTol));
  EXPECT_TRUE(
      grad_matches(name + " dw", w.data(), dw.added(), loss, kEps, sample_indices(w.size(), kSamples, rng), kTol));
  if (layer) {
    EXPECT_TRUE(
        grad_matches(name + " db", b.data(), db.added(), loss, kEps, sample_indices(b.size(), kSamples, rng), kTol));
  }
}

TEST(RefOps, LayerNorm) { check_norm(true, 3); }
TEST(RefOps, RmsNorm) { check_norm(false, 4); }

TEST(RefOps, Gelu) {
  Rng rng(5);
  auto x = random_vector(301, rng, 2.0f);
  std::vector<float> y(x.size());
  ref::gelu_forward(y.data(), x.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    // The tanh approximation stays within 1e-3 of the exact GELU x Phi(x).
    const double exact = 0.5 * x[i] * (1.0 + std::erf(x[i] / std::sqrt(2.0)));
    EXPECT_NEAR(y[i], exact, 1e-3);
    const double v = x[i], tanh_form = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(y[i], tanh_form, 1e-6 * (1.0 + std::fabs(v)));
  }
  const auto r = random_vector(y.size(), rng);
  GradBuffer dx(x.size(), rng);
  ref::gelu_backward(dx.ptr(), r.data(), x.data(), x.size());
  auto loss = [&] {
    ref::gelu_forward(y.data(), x.data(), x.size());
    return project(y.data(), r);
  };
  EXPECT_TRUE(grad_matches("gelu dx", x.data(), dx.added(), loss, kEps, sample_indices(x.size(), 1000, rng), kTol));
}

TEST(RefOps, SwiGlu) {
  Rng rng(6);
  const int N = 7, F = 9;
  auto gu = random_vector(N * 2 * F, rng, 2.0f);
  std::vector<float> y(N * F);
  ref::swiglu_forward(y.data(), gu.data(), N, F);
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < F; ++j) {
      const double g = gu[(n * F + j) * 2], u = gu[(n * F + j) * 2 + 1];
      EXPECT_NEAR(y[n * F + j], g / (1.0 + std::exp(-g)) * u, 1e-5 * (1.0 + std::fabs(g * u)));
    }
  const auto r = random_vector(y.size(), rng);
  GradBuffer dgu(gu.size(), rng);
  ref::swiglu_backward(dgu.ptr(), r.data(), gu.data(), N, F);
  auto loss = [&] {
    ref::swiglu_forward(y.data(), gu.data(), N, F);
    return project(y.data(), r);
  };
  EXPECT_TRUE(
      grad_matches("swiglu dgu", gu.data(), dgu.added(), loss, kEps, sample_indices(gu.size(), 1000, rng), kTol));
}

struct HeadShape {
  int B, T, n_head, n_kv_head, hd;
  int row_width() const { return (n_head + 2 * n_kv_head) * hd; }
  int N() const { return B * T; }
};

TEST(RefOps, Rope) {
  Rng rng(7);
  const HeadShape s{2, 9, 4, 2, 8};
  const float theta = 500.0f;
  const int W = s.row_width(), hd = s.hd;
  const auto original = random_vector(s.N() * W, rng);
  auto qkv = original;
  ref::rope_forward(qkv.data(), s.B, s.T, s.n_head, s.n_kv_head, hd, theta);
  for (int n = 0; n < s.N(); ++n) {
    const int t = n % s.T;
    for (int col = 0; col < W; col += 2) {
      const float* before = &original[n * W + col];
      const float* after = &qkv[n * W + col];
      if (col >= (s.n_head + s.n_kv_head) * hd || t == 0) {  // v, and every head at position 0: untouched
        EXPECT_EQ(after[0], before[0]);
        EXPECT_EQ(after[1], before[1]);
        continue;
      }
      // Pair i of a head turns by t * theta^(-2i/hd): compare the angle and the length.
      const int i = (col % hd) / 2;
      const double angle = t * std::pow(static_cast<double>(theta), -2.0 * i / hd);
      const double turned = std::atan2(after[1], after[0]) - std::atan2(before[1], before[0]);
      EXPECT_NEAR(std::remainder(turned - angle, 2.0 * M_PI), 0.0, 1e-4);
      EXPECT_NEAR(std::hypot(after[0], after[1]), std::hypot(before[0], before[1]), 1e-5);
    }
  }
  // Relative position: <rope(q, t1), rope(k, t2)> depends only on t1 - t2. Same q and k contents at
  // positions (2, 0) and (8, 6) of one sequence.
  std::vector<float> pair(s.T * W * s.B);
  for (int n = 0; n < s.N(); ++n)
    for (int c = 0; c < W; ++c) pair[n * W + c] = original[(n % 2) * W + c];  // rows alternate two contents
  ref::rope_forward(pair.data(), s.B, s.T, s.n_head, s.n_kv_head, hd, theta);
  auto q_dot_k = [&](int tq, int tk) {
    double sum = 0.0;  // query head 1 against kv head 0
    for (int d = 0; d < hd; ++d) sum += static_cast<double>(pair[tq * W + hd + d]) * pair[tk * W + s.n_head * hd + d];
    return sum;
  };
  EXPECT_NEAR(q_dot_k(2, 0), q_dot_k(8, 6), 1e-5);
  EXPECT_NEAR(q_dot_k(3, 1), q_dot_k(7, 5), 1e-5);
  EXPECT_GT(std::fabs(q_dot_k(2, 0) - q_dot_k(4, 0)), 1e-3);  // and does depend on the offset

  // Inverse: backward undoes forward.
  ref::rope_backward(qkv.data(), s.B, s.T, s.n_head, s.n_kv_head, hd, theta);
  for (size_t i = 0; i < qkv.size(); ++i) EXPECT_NEAR(qkv[i], original[i], 1e-5);

  // Gradient: the backward applied to dy is the gradient of <r, rope(x)>.
  auto x = original;
  auto grad = random_vector(x.size(), rng);
  const auto r = grad;
  ref::rope_backward(grad.data(), s.B, s.T, s.n_head, s.n_kv_head, hd, theta);
  std::vector<float> y(x.size());
  auto loss = [&] {
    y = x;
    ref::rope_forward(y.data(), s.B, s.T, s.n_head, s.n_kv_head, hd, theta);
    return project(y.data(), r);
  };
  EXPECT_TRUE(grad_matches("rope dx", x.data(), grad, loss, kEps, sample_indices(x.size(), 200, rng), kTol));
}

// Attention forward: lse normalises the softmax, position 0 sees only itself, the output is causal.
TEST(RefOps, AttentionForwardProperties) {
  Rng rng(8);
  const HeadShape s{2, 7, 4, 2, 8};
  const int W = s.row_width(), C = s.n_head * s.hd, group = s.n_head / s.n_kv_head;
  auto qkv = random_vector(s.N() * W, rng);
  std::vector<float> out(s.N() * C), lse(s.B * s.n_head * s.T);
  ref::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.n_head, s.n_kv_head, s.hd);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.hd));
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.n_head; ++h)
      for (int t = 0; t < s.T; ++t) {
        const int k_col = (s.n_head + h / group) * s.hd, v_col = k_col + s.n_kv_head * s.hd;
        const float row_lse = lse[(b * s.n_head + h) * s.T + t];
        double p_sum = 0.0;
        std::vector<double> o(s.hd, 0.0);
        for (int u = 0; u <= t; ++u) {
          double score = 0.0;
          for (int d = 0; d < s.hd; ++d)
            score += static_cast<double>(qkv[(b * s.T + t) * W + h * s.hd + d]) * qkv[(b * s.T + u) * W + k_col + d];
          const double p = std::exp(score * scale - row_lse);
          p_sum += p;
          for (int d = 0; d < s.hd; ++d) o[d] += p * qkv[(b * s.T + u) * W + v_col + d];
        }
        EXPECT_NEAR(p_sum, 1.0, 1e-5);
        for (int d = 0; d < s.hd; ++d) EXPECT_NEAR(out[(b * s.T + t) * C + h * s.hd + d], o[d], 1e-5);
        if (t == 0) {
          for (int d = 0; d < s.hd; ++d) EXPECT_EQ(out[b * s.T * C + h * s.hd + d], qkv[b * s.T * W + v_col + d]);
        }
      }
  // Causality: changing the last token's q, k, v leaves every earlier output unchanged.
  auto changed = qkv;
  for (int c = 0; c < W; ++c) changed[(s.T - 1) * W + c] += 1.0f;
  std::vector<float> out2(out.size()), lse2(lse.size());
  ref::attention_forward(out2.data(), lse2.data(), changed.data(), s.B, s.T, s.n_head, s.n_kv_head, s.hd);
  for (int n = 0; n < s.N(); ++n)
    for (int c = 0; c < C; ++c) {
      if (n == s.T - 1)
        EXPECT_NE(out2[n * C + c], out[n * C + c]);
      else
        EXPECT_EQ(out2[n * C + c], out[n * C + c]);
    }
}

// GQA is multi-head attention with each kv head repeated for the query heads of its group.
TEST(RefOps, AttentionGqaEqualsRepeatedKvHeads) {
  Rng rng(9);
  const HeadShape gqa{2, 5, 4, 2, 8}, mha{2, 5, 4, 4, 8};
  const auto qkv = random_vector(gqa.N() * gqa.row_width(), rng);
  std::vector<float> expanded(mha.N() * mha.row_width());
  for (int n = 0; n < gqa.N(); ++n) {
    const float* src = &qkv[n * gqa.row_width()];
    float* dst = &expanded[n * mha.row_width()];
    for (int c = 0; c < gqa.n_head * gqa.hd; ++c) dst[c] = src[c];
    for (int h = 0; h < mha.n_head; ++h)
      for (int d = 0; d < gqa.hd; ++d) {
        const int g = h / 2;
        dst[(mha.n_head + h) * gqa.hd + d] = src[(gqa.n_head + g) * gqa.hd + d];
        dst[(2 * mha.n_head + h) * gqa.hd + d] = src[(gqa.n_head + gqa.n_kv_head + g) * gqa.hd + d];
      }
  }
  const int C = gqa.n_head * gqa.hd;
  std::vector<float> out_gqa(gqa.N() * C), out_mha(gqa.N() * C), lse_gqa(gqa.B * gqa.n_head * gqa.T),
      lse_mha(lse_gqa.size());
  ref::attention_forward(out_gqa.data(), lse_gqa.data(), qkv.data(), gqa.B, gqa.T, gqa.n_head, gqa.n_kv_head, gqa.hd);
  ref::attention_forward(out_mha.data(), lse_mha.data(), expanded.data(), mha.B, mha.T, mha.n_head, mha.n_kv_head,
                         mha.hd);
  EXPECT_EQ(out_gqa, out_mha);
  EXPECT_EQ(lse_gqa, lse_mha);
}

class AttentionGradient : public ::testing::TestWithParam<HeadShape> {};

TEST_P(AttentionGradient, MatchesFiniteDifferences) {
  const HeadShape s = GetParam();
  Rng rng(10 + s.n_kv_head);
  const int C = s.n_head * s.hd;
  auto qkv = random_vector(s.N() * s.row_width(), rng);
  std::vector<float> out(s.N() * C), lse(s.B * s.n_head * s.T);
  ref::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.n_head, s.n_kv_head, s.hd);
  const auto r = random_vector(out.size(), rng);
  GradBuffer dqkv(qkv.size(), rng);
  ref::attention_backward(dqkv.ptr(), r.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.n_head, s.n_kv_head,
                          s.hd);
  auto loss = [&] {
    ref::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.n_head, s.n_kv_head, s.hd);
    return project(out.data(), r);
  };
  // Check q, k and v columns separately so none can hide behind the others.
  const int W = s.row_width(), q_end = C, k_end = (s.n_head + s.n_kv_head) * s.hd;
  for (auto [name, begin, end] : {std::tuple{"q", 0, q_end}, {"k", q_end, k_end}, {"v", k_end, W}}) {
    std::vector<size_t> indices;
    for (size_t k : sample_indices(static_cast<size_t>(s.N()) * (end - begin), kSamples, rng))
      indices.push_back(k / (end - begin) * W + begin + k % (end - begin));
    EXPECT_TRUE(grad_matches(std::string("attention d") + name, qkv.data(), dqkv.added(), loss, kEps, indices, kTol));
  }
}

INSTANTIATE_TEST_SUITE_P(RefOps, AttentionGradient,
                         ::testing::Values(HeadShape{2, 7, 4, 4, 8}, HeadShape{2, 7, 4, 2, 8},
                                           HeadShape{1, 9, 4, 1, 8}),
                         [](const auto& info) { return "kv_heads_" + std::to_string(info.param.n_kv_head); });

TEST(RefOps, CrossEntropy) {
  Rng rng(11);
  const int N = 9, V = 37, Vp = 128;
  auto logits = random_vector(N * Vp, rng, 2.0f);
  std::vector<int32_t> targets(N);
  for (auto& target : targets) target = static_cast<int32_t>(rng.below(V));
  targets[0] = V - 1;
  std::vector<float> losses(N);
  ref::crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp);
  for (int n = 0; n < N; ++n) {
    double sum = 0.0;
    for (int v = 0; v < V; ++v) sum += std::exp(static_cast<double>(logits[n * Vp + v]));
    EXPECT_NEAR(losses[n], std::log(sum) - logits[n * Vp + targets[n]], 1e-5);
  }
  // Padded columns do not enter: huge values there change nothing, and they get zero gradient.
  auto padded = logits;
  for (int n = 0; n < N; ++n)
    for (int v = V; v < Vp; ++v) padded[n * Vp + v] = 1e4f;
  std::vector<float> padded_losses(N);
  ref::crossentropy_forward(padded_losses.data(), padded.data(), targets.data(), N, V, Vp);
  EXPECT_EQ(padded_losses, losses);

  const float dloss = 0.37f;
  std::vector<float> dlogits(N * Vp, 123.0f);  // WRITTEN, not accumulated
  ref::crossentropy_backward(dlogits.data(), padded.data(), targets.data(), dloss, N, V, Vp);
  for (int n = 0; n < N; ++n) {
    double row_sum = 0.0;
    for (int v = 0; v < Vp; ++v) row_sum += dlogits[n * Vp + v];
    EXPECT_NEAR(row_sum, 0.0, 1e-6);
    for (int v = V; v < Vp; ++v) EXPECT_EQ(dlogits[n * Vp + v], 0.0f);
  }
  auto loss = [&] {
    ref::crossentropy_forward(losses.data(), padded.data(), targets.data(), N, V, Vp);
    double sum = 0.0;
    for (float l : losses) sum += dloss * static_cast<double>(l);
    return sum;
  };
  std::vector<size_t> indices;  // every target logit plus random others
  for (int n = 0; n < N; ++n) indices.push_back(n * Vp + targets[n]);
  for (size_t k : sample_indices(N * V, kSamples, rng)) indices.push_back(k / V * Vp + k % V);
  EXPECT_TRUE(grad_matches("crossentropy dlogits", padded.data(), dlogits, loss, kEps, indices, kTol));

  targets[3] = V;  // a padded column is not a valid target
  EXPECT_THROW(ref::crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp),
               std::invalid_argument);
}

}  // namespace
