// The CODA programs of kernels/coda/ evaluated through the host path (evaluate_on_host: the same
// __host__ __device__ primitives the GEMM runs) and compared with the plain math of the CPU reference
// (ref::*). For each program: random inputs of realistic scale; the GEMM accumulator computed on the host
// as the plain product the GEMM would produce (from the reparameterized input, e.g. O = h (.) gamma);
// the program's main output, aux outputs and partials finished with prog::* against the reference's
// unfused chain (norm, matmul, activation, loss, and their backward). Tensors the GPU keeps in bf16
// (h, saved pre-activations, (g, u)) are rounded to bf16 first, so both sides see the same values;
// aux outputs written in bf16 are compared at bf16 precision, everything else at fp32 precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/coda/gpt2_programs.cuh"
#include "kernels/coda/llama_programs.cuh"
#include "kernels/gemm/gemm.cuh"
#include "src/ref_ops.hpp"

namespace {

using namespace coda;
using Vec = std::vector<float>;
using Bf16Vec = std::vector<__nv_bfloat16>;

constexpr int kB = 2, kT = 20, kM = kB * kT, kD = 64, kTile = 32;  // kM = 40: a partial 16-row group
constexpr float kEps = 1e-5f;
constexpr double kFp32Tol = 2e-5, kBf16Tol = 8e-3;

Vec random_vec(size_t n, float lo, float hi, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Values exactly representable in bf16 (what the GPU keeps) and their bf16 copy.
Vec round_bf16(Vec v) {
  for (float& x : v) x = __bfloat162float(__float2bfloat16_rn(x));
  return v;
}
Bf16Vec to_bf16(const Vec& v) {
  Bf16Vec b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = __float2bfloat16_rn(v[i]);
  return b;
}
Vec to_float(const Bf16Vec& b) {
  Vec v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = __bfloat162float(b[i]);
  return v;
}

// ||a - b|| / ||b||; NaN fails every comparison.
double rel_err(const Vec& a, const Vec& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / den);
}
#define EXPECT_CLOSE(a, b, tol) EXPECT_LT(rel_err(a, b), tol) << #a " vs " #b

int tiles(int n) { return (n + kTile - 1) / kTile; }

// Row partials per N tile of sum_j f(i, j), as a RowReduce / RowDot of the producing GEMM writes them.
template <class F>
Vec tile_row_sums(int M, int N, F f) {
  Vec p(size_t(M) * tiles(N), 0.0f);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) p[size_t(i) * tiles(N) + j / kTile] += f(i, j);
  return p;
}

Vec mul_cols(const Vec& x, const Vec& gamma, int M, int N) {  // x (.) gamma, row by row
  Vec y(x.size());
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) y[size_t(i) * N + j] = x[size_t(i) * N + j] * gamma[j];
  return y;
}

// The dgrad GEMM's accumulator dY W (dY [M, OC], W [OC, IC]).
Vec dgrad_acc(const Vec& dy, const Vec& w, int M, int IC, int OC) {
  Vec acc(size_t(M) * IC, 0.0f);
  ref::matmul_backward(acc.data(), nullptr, nullptr, dy.data(), nullptr, w.data(), M, IC, OC);
  return acc;
}

Vec column_sums(const Vec& partials, int M, int N) {
  Vec s(N);
  for (int j = 0; j < N; ++j) s[j] = prog::sum_column_partials(partials.data(), prog::column_partial_groups(M), N, j);
  return s;
}

// ---- Llama --------------------------------------------------------------------------------------------
// gamma is a bf16 parameter vector (the weight copy the GPU reads), so the reference uses its bf16 value.

// The row partials of h^2 an RMSNorm's producer writes (per N tile), as the NormPartials the programs
// finish, and the rstd per row they give.
struct RmsPartials {
  Vec sumsq;
  explicit RmsPartials(const Vec& h)
      : sumsq(tile_row_sums(kM, kD, [&](int i, int j) { return h[i * kD + j] * h[i * kD + j]; })) {}
  prog::NormPartials stats() const { return {nullptr, sumsq.data(), tiles(kD), kD, kEps}; }
  Vec rstd() const {
    Vec r(kM);
    for (int i = 0; i < kM; ++i) r[i] = stats().rms_rstd(i);
    return r;
  }
};

// sum_partials takes four partials per step and the last 0-3 predicated: every count from 0 to 13 (a
// row of 13 partials also starting at an odd offset) against a plain double sum.
TEST(CodaNormStats, SumPartialsOverEveryRemainder) {
  const Vec p = random_vec(14, -3.0f, 3.0f, 77);
  for (int first = 0; first < 2; ++first)
    for (int count = 0; first + count <= 14; ++count) {
      double expect = 0.0;
      for (int i = 0; i < count; ++i) expect += p[first + i];
      EXPECT_NEAR(prog::sum_partials(p.data() + first, count), expect, 1e-5) << "count " << count;
    }
}

TEST(CodaLlama, QkvRowScaleAndRopeEqualRmsNormMatmulRope) {
  constexpr int n_head = 2, n_kv = 1, hd = 16, N = (n_head + 2 * n_kv) * hd;
  const float theta = 10000.0f;
  const Vec h = random_vec(kM * kD, -2.0f, 2.0f, 1), gamma = round_bf16(random_vec(kD, 0.5f, 1.5f, 2));
  const Vec w = random_vec(N * kD, -0.15f, 0.15f, 3);
  Vec u(kM * kD), rstd_ref(kM), z(kM * N);
  ref::rmsnorm_forward(u.data(), rstd_ref.data(), h.data(), gamma.data(), kM, kD, kEps);
  ref::matmul_forward(z.data(), u.data(), w.data(), nullptr, kM, kD, N);
  ref::rope_forward(z.data(), kB, kT, n_head, n_kv, hd, theta);

  Vec acc(kM * N), out(kM * N, NAN);
  ref::matmul_forward(acc.data(), mul_cols(h, gamma, kM, kD).data(), w.data(), nullptr, kM, kD, N);
  const RmsPartials partials(h);
  const epi::Rope<hd> rope{kT, (n_head + n_kv) * hd, std::log2(theta)};
  epi::evaluate_on_host(prog::llama::qkv_program(partials.stats(), rope), acc.data(), kM, N, kTile, out.data());
  EXPECT_CLOSE(out, z, kFp32Tol);
  EXPECT_CLOSE(partials.rstd(), rstd_ref, kFp32Tol);
}

// Qwen2: the bias goes in after the norm's row scale and before the rotation, as in the model.
TEST(CodaLlama, QkvBiasAddedBeforeRopeEqualsRmsNormMatmulBiasRope) {
  constexpr int n_head = 2, n_kv = 1, hd = 16, N = (n_head + 2 * n_kv) * hd;
  const float theta = 1e6f;
  const Vec h = random_vec(kM * kD, -2.0f, 2.0f, 11), gamma = round_bf16(random_vec(kD, 0.5f, 1.5f, 12));
  const Vec w = random_vec(N * kD, -0.15f, 0.15f, 13), bias = round_bf16(random_vec(N, -1.0f, 1.0f, 14));
  Vec u(kM * kD), rstd_ref(kM), z(kM * N);
  ref::rmsnorm_forward(u.data(), rstd_ref.data(), h.data(), gamma.data(), kM, kD, kEps);
  ref::matmul_forward(z.data(), u.data(), w.data(), bias.data(), kM, kD, N);
  ref::rope_forward(z.data(), kB, kT, n_head, n_kv, hd, theta);

  Vec acc(kM * N), out(kM * N, NAN);
  ref::matmul_forward(acc.data(), mul_cols(h, gamma, kM, kD).data(), w.data(), nullptr, kM, kD, N);
  const RmsPartials partials(h);
  const epi::Rope<hd> rope{kT, (n_head + n_kv) * hd, std::log2(theta)};
  const Bf16Vec bias_b = to_bf16(bias);
  epi::evaluate_on_host(prog::llama::qkv_bias_program(partials.stats(), bias_b.data(), rope), acc.data(), kM, N, kTile,
                        out.data());
  EXPECT_CLOSE(out, z, kFp32Tol);
}

TEST(CodaLlama, ResidualAddWritesGammaScaledOutputAndRmsPartials) {
  const Vec x = random_vec(kM * kD, -1.0f, 1.0f, 4), w = random_vec(kD * kD, -0.15f, 0.15f, 5);
  const Vec res = round_bf16(random_vec(kM * kD, -2.0f, 2.0f, 6)), gamma = round_bf16(random_vec(kD, 0.5f, 1.5f, 7));
  Vec acc(kM * kD), h(kM * kD), u(kM * kD), rstd_ref(kM);
  ref::matmul_forward(acc.data(), x.data(), w.data(), nullptr, kM, kD, kD);
  for (size_t i = 0; i < h.size(); ++i) h[i] = acc[i] + res[i];
  ref::rmsnorm_forward(u.data(), rstd_ref.data(), h.data(), gamma.data(), kM, kD, kEps);

  const Bf16Vec res_b = to_bf16(res), gamma_b = to_bf16(gamma);
  Bf16Vec h_aux(kM * kD);
  Vec sumsq(kM * tiles(kD), NAN), O(kM * kD, NAN), rstd(kM), u_coda(kM * kD);
  epi::evaluate_on_host(prog::llama::residual_program(res_b.data(), h_aux.data(), kD, gamma_b.data(), sumsq.data()),
                        acc.data(), kM, kD, kTile, O.data());
  const prog::NormPartials stats{nullptr, sumsq.data(), tiles(kD), kD, kEps};
  for (int i = 0; i < kM; ++i) rstd[i] = prog::RmsRstd{stats}(i);
  for (int i = 0; i < kM * kD; ++i) u_coda[i] = rstd[i / kD] * O[i];  // what the next GEMM's row scale makes of O
  EXPECT_CLOSE(to_float(h_aux), h, kBf16Tol);
  EXPECT_CLOSE(O, mul_cols(h, gamma, kM, kD), kFp32Tol);
  EXPECT_CLOSE(rstd, rstd_ref, kFp32Tol);
  EXPECT_CLOSE(u_coda, u, kFp32Tol);
}

TEST(CodaLlama, GateUpRowScaleSwiGluKeepsGateAndUp) {
  const int F = 48;
  const Vec h = random_vec(kM * kD, -2.0f, 2.0f, 8), gamma = round_bf16(random_vec(kD, 0.5f, 1.5f, 9));
  const Vec w = random_vec(2 * F * kD, -0.2f, 0.2f, 10);
  Vec u(kM * kD), rstd_ref(kM), gu(kM * 2 * F), a(kM * F);
  ref::rmsnorm_forward(u.data(), rstd_ref.data(), h.data(), gamma.data(), kM, kD, kEps);
  ref::matmul_forward(gu.data(), u.data(), w.data(), nullptr, kM, kD, 2 * F);
  ref::swiglu_forward(a.data(), gu.data(), kM, F);

  Vec acc(kM * 2 * F), out(kM * F, NAN);
  ref::matmul_forward(acc.data(), mul_cols(h, gamma, kM, kD).data(), w.data(), nullptr, kM, kD, 2 * F);
  const RmsPartials partials(h);
  Bf16Vec gu_aux(kM * 2 * F);
  epi::evaluate_on_host(prog::llama::gate_up_program(partials.stats(), gu_aux.data(), 2 * F), acc.data(), kM, 2 * F,
                        kTile, out.data());
  EXPECT_CLOSE(out, a, kFp32Tol);
  EXPECT_CLOSE(to_float(gu_aux), gu, kBf16Tol);
}

// The head's GEMM runs over the padded vocabulary (Vp columns, the padded rows of the weight are live
// values here so that leaving them out of the log-sum-exp is what makes the loss right).
TEST(CodaLlama, LmHeadLossFromLsePartialsBelowTheVocabularyLimit) {
  const int V = 83, Vp = 128;
  const Vec h = random_vec(kM * kD, -2.0f, 2.0f, 11), gamma = round_bf16(random_vec(kD, 0.5f, 1.5f, 12));
  const Vec w = random_vec(Vp * kD, -0.3f, 0.3f, 13);
  std::vector<int32_t> targets(kM);
  std::mt19937 rng(14);
  for (auto& t : targets) t = int32_t(rng() % V);
  Vec u(kM * kD), rstd_ref(kM), logits(kM * Vp), losses(kM);
  ref::rmsnorm_forward(u.data(), rstd_ref.data(), h.data(), gamma.data(), kM, kD, kEps);
  ref::matmul_forward(logits.data(), u.data(), w.data(), nullptr, kM, kD, Vp);
  ref::crossentropy_forward(losses.data(), logits.data(), targets.data(), kM, V, Vp);

  Vec acc(kM * Vp), out(kM * Vp, NAN), target_logit(kM, NAN), loss(kM);
  ref::matmul_forward(acc.data(), mul_cols(h, gamma, kM, kD).data(), w.data(), nullptr, kM, kD, Vp);
  const RmsPartials partials(h);
  std::vector<epi::LogSumExp::Out> lse(kM * tiles(Vp));
  epi::evaluate_on_host(prog::llama::lm_head_program(partials.stats(), targets.data(), target_logit.data(),
                                                     lse.data(), V),
                        acc.data(), kM, Vp, kTile, out.data());
  for (int i = 0; i < kM; ++i) loss[i] = epi::merge_lse(&lse[size_t(i) * tiles(Vp)], tiles(Vp)) - target_logit[i];
  EXPECT_CLOSE(out, logits, kFp32Tol);
  EXPECT_CLOSE(loss, losses, kFp32Tol);
}

// The dgrad of a normed GEMM gets dz' = r dz (the scaled-gradient convention), the <dz, z> partials of
// the unscaled dz, and must give the RMSNorm backward of du = dz W.
TEST(CodaLlama, NormBackwardDgradOfScaledGradientThroughDzZIdentity) {
  const int N = 96;  // the normed GEMM's output width (e.g. qkv)
  const Vec h = round_bf16(random_vec(kM * kD, -2.0f, 2.0f, 15)), gamma = round_bf16(random_vec(kD, 0.5f, 1.5f, 16));
  const Vec w = random_vec(N * kD, -0.15f, 0.15f, 17), dz = random_vec(kM * N, -1.0f, 1.0f, 18);
  Vec u(kM * kD), rstd_ref(kM), z(kM * N), dh0 = random_vec(kM * kD, -0.5f, 0.5f, 19), dgamma(kD, 0.0f);
  ref::rmsnorm_forward(u.data(), rstd_ref.data(), h.data(), gamma.data(), kM, kD, kEps);
  ref::matmul_forward(z.data(), u.data(), w.data(), nullptr, kM, kD, N);
  Vec dh = dh0;
  ref::rmsnorm_backward(dh.data(), dgamma.data(), dgrad_acc(dz, w, kM, kD, N).data(), h.data(), gamma.data(),
                        rstd_ref.data(), kM, kD);

  const RmsPartials partials(h);
  const Vec rstd = partials.rstd();
  const Vec dot = tile_row_sums(kM, N, [&](int i, int j) { return dz[i * N + j] * z[i * N + j]; });
  Vec dz_scaled(dz.size());
  for (size_t i = 0; i < dz.size(); ++i) dz_scaled[i] = rstd[i / N] * dz[i];
  const Bf16Vec h_b = to_bf16(h), gamma_b = to_bf16(gamma);
  Vec out(kM * kD, NAN), dgamma_p(prog::column_partial_groups(kM) * kD, NAN);
  epi::evaluate_on_host(prog::llama::norm_backward_program(partials.stats(), dot.data(), tiles(N), h_b.data(), kD,
                                                           gamma_b.data(), dgamma_p.data()),
                        dgrad_acc(dz_scaled, w, kM, kD, N).data(), kM, kD, kTile, out.data());
  for (size_t i = 0; i < out.size(); ++i) out[i] += dh0[i];  // the GEMM adds into the residual gradient
  EXPECT_CLOSE(out, dh, kFp32Tol);
  EXPECT_CLOSE(column_sums(dgamma_p, kM, kD), dgamma, kFp32Tol);
}

TEST(CodaLlama, SwiGluBackwardInDownDgradWritesScaledInterleavedGradAndDzZ) {
  const int F = 48;
  const Vec gu = round_bf16(random_vec(kM * 2 * F, -3.0f, 3.0f, 20));
  const Vec dres = random_vec(kM * kD, -1.0f, 1.0f, 21), w_down = random_vec(kD * F, -0.2f, 0.2f, 22);
  const Vec h2 = random_vec(kM * kD, -2.0f, 2.0f, 23);  // norm2's input: r scales the handed-on gradient
  const Vec da = dgrad_acc(dres, w_down, kM, F, kD);
  Vec dgu(kM * 2 * F, 0.0f);
  ref::swiglu_backward(dgu.data(), da.data(), gu.data(), kM, F);
  Vec dot_ref(kM, 0.0f);
  for (int i = 0; i < kM * 2 * F; ++i) dot_ref[i / (2 * F)] += dgu[i] * gu[i];
  const RmsPartials partials(h2);
  const Vec rstd = partials.rstd();
  Vec dgu_scaled(dgu.size());
  for (size_t i = 0; i < dgu.size(); ++i) dgu_scaled[i] = rstd[i / (2 * F)] * dgu[i];

  const Bf16Vec gu_b = to_bf16(gu);
  Vec out(kM * 2 * F, NAN), dot_p(kM * tiles(F), NAN), dot(kM);
  auto program = prog::llama::swiglu_backward_program(gu_b.data(), 2 * F, partials.stats(), dot_p.data());
  static_assert(decltype(program)::kOutsPerCol == 2, "1 -> 2 map doubles the output");
  epi::evaluate_on_host(program, da.data(), kM, F, kTile, out.data());
  for (int i = 0; i < kM; ++i) dot[i] = prog::sum_partials(&dot_p[size_t(i) * tiles(F)], tiles(F));
  EXPECT_CLOSE(out, dgu_scaled, kFp32Tol);
  EXPECT_CLOSE(dot, dot_ref, kFp32Tol);
}

// ---- GPT-2 --------------------------------------------------------------------------------------------

// The row partials of h and h^2 per N tile that the producer of h writes for the LayerNorm after it.
struct LnPartials {
  Vec sum, sumsq;
  explicit LnPartials(const Vec& h)
      : sum(tile_row_sums(kM, kD, [&](int i, int j) { return h[i * kD + j]; })),
        sumsq(tile_row_sums(kM, kD, [&](int i, int j) { return h[i * kD + j] * h[i * kD + j]; })) {}
  prog::NormPartials view() const { return {sum.data(), sumsq.data(), tiles(kD), kD, kEps}; }
};

// A LayerNorm-ed linear layer: h (bf16 values) with a nonzero row mean and its partials; the parameter
// vectors gamma, beta, bias (bf16 values, as the GPU reads them); W [n, d] with rows >= real_rows zero
// (the padded vocabulary of the LM head); the weight-derived vectors c, b'.
struct LnLinear {
  int N;
  Vec h, gamma, beta, w, bias, c, b_prime;
  Bf16Vec h_b, gamma_b;
  LnPartials partials;
  LnLinear(int n, unsigned seed, bool with_bias = true, int real_rows = -1)
      : N(n),
        h(round_bf16(random_vec(kM * kD, -1.7f, 2.3f, seed))),
        gamma(round_bf16(random_vec(kD, 0.5f, 1.5f, seed + 1))),
        beta(round_bf16(random_vec(kD, -0.3f, 0.3f, seed + 2))),
        w(random_vec(n * kD, -0.15f, 0.15f, seed + 3)),
        bias(with_bias ? round_bf16(random_vec(n, -0.2f, 0.2f, seed + 4)) : Vec()),
        c(n),
        b_prime(n),
        h_b(to_bf16(h)),
        gamma_b(to_bf16(gamma)),
        partials(h) {
    if (real_rows >= 0) std::fill(w.begin() + size_t(real_rows) * kD, w.end(), 0.0f);
    for (int j = 0; j < n; ++j)
      prog::ln_weight_vectors(j, w.data(), kD, gamma.data(), beta.data(), with_bias ? bias.data() : nullptr,
                              c.data(), b_prime.data());
  }
  prog::NormPartials stats() const { return partials.view(); }
  // Reference forward: u = LN(h), z = u W^T + bias; mean and rstd saved.
  void reference(Vec& u, Vec& mean, Vec& rstd, Vec& z) const {
    u.resize(kM * kD), mean.resize(kM), rstd.resize(kM), z.resize(kM * N);
    ref::layernorm_forward(u.data(), mean.data(), rstd.data(), h.data(), gamma.data(), beta.data(), kM, kD, kEps);
    ref::matmul_forward(z.data(), u.data(), w.data(), bias.empty() ? nullptr : bias.data(), kM, kD, N);
  }
  // The GEMM's accumulator in CODA mode: O W^T with O = h (.) gamma.
  Vec accumulator() const {
    Vec acc(kM * N);
    ref::matmul_forward(acc.data(), mul_cols(h, gamma, kM, kD).data(), w.data(), nullptr, kM, kD, N);
    return acc;
  }
  // dz' = r dz, the scaled gradient handed to the dgrad and wgrad GEMMs (passes.cuh).
  Vec scaled(const Vec& dz) const {
    Vec s(dz.size());
    for (size_t i = 0; i < dz.size(); ++i) s[i] = stats().ln_stats(int(i / N)).rstd * dz[i];
    return s;
  }
};

// Row partials of the three dots a LayerNorm backward needs, as their producer writes them.
struct DotPartials {
  Vec z, c, b;
  explicit DotPartials(int n) : z(kM * tiles(n), NAN), c(kM * tiles(n), NAN), b(kM * tiles(n), NAN) {}
  prog::LnDots view(int count) { return {z.data(), c.data(), b.data(), count}; }
};

// Column partials [16-row groups, n].
Vec column_partials(int n) { return Vec(size_t(prog::column_partial_groups(kM)) * n, NAN); }

TEST(CodaGpt2, LnReparamLinearAndFcGeluEqualLayerNormMatmulGelu) {
  const LnLinear L(96, 30);
  Vec u, mean, rstd_ref, pre;
  L.reference(u, mean, rstd_ref, pre);
  Vec act(pre.size());
  ref::gelu_forward(act.data(), pre.data(), pre.size());

  const Vec acc = L.accumulator();
  Vec z(kM * L.N, NAN), out(kM * L.N, NAN);
  Bf16Vec pre_aux(kM * L.N);
  epi::evaluate_on_host(prog::gpt2::ln_linear_program(L.stats(), L.c.data(), L.b_prime.data()), acc.data(), kM, L.N,
                        kTile, z.data());
  epi::evaluate_on_host(prog::gpt2::fc_program(L.stats(), L.c.data(), L.b_prime.data(), pre_aux.data(), L.N),
                        acc.data(), kM, L.N, kTile, out.data());
  EXPECT_CLOSE(z, pre, kFp32Tol);
  EXPECT_CLOSE(out, act, kFp32Tol);
  EXPECT_CLOSE(to_float(pre_aux), pre, kBf16Tol);
}

TEST(CodaGpt2, LmHeadWithFinalLayerNormLossOverTheRealVocabulary) {
  const int vocab = 75, Vp = 96;  // the limit splits a column pair and a tile; padded rows of W are zero
  const LnLinear L(Vp, 40, false, vocab);
  Vec u, mean, rstd_ref, logits, losses(kM);
  L.reference(u, mean, rstd_ref, logits);
  std::vector<int32_t> targets(kM);
  std::mt19937 rng(41);
  for (auto& t : targets) t = int32_t(rng() % vocab);
  targets[3] = vocab - 1;
  ref::crossentropy_forward(losses.data(), logits.data(), targets.data(), kM, vocab, Vp);

  const Vec acc = L.accumulator();
  Vec out(kM * Vp, NAN), target_logit(kM, NAN), loss(kM);
  std::vector<epi::LogSumExp::Out> lse(kM * tiles(Vp));
  epi::evaluate_on_host(prog::gpt2::lm_head_program(L.stats(), L.c.data(), L.b_prime.data(), targets.data(),
                                                    target_logit.data(), lse.data(), vocab),
                        acc.data(), kM, Vp, kTile, out.data());
  for (int i = 0; i < kM; ++i) loss[i] = epi::merge_lse(&lse[size_t(i) * tiles(Vp)], tiles(Vp)) - target_logit[i];
  EXPECT_CLOSE(out, logits, kFp32Tol);
  EXPECT_CLOSE(loss, losses, kFp32Tol);
}

TEST(CodaGpt2, ResidualAddWithBiasWritesLayerNormPartials) {
  const Vec x = random_vec(kM * kD, -1.0f, 1.0f, 50), w = random_vec(kD * kD, -0.15f, 0.15f, 51);
  const Vec bias = round_bf16(random_vec(kD, -0.3f, 0.3f, 52)), gamma = round_bf16(random_vec(kD, 0.5f, 1.5f, 53));
  const Vec res = round_bf16(random_vec(kM * kD, -1.5f, 2.5f, 54)), beta(kD, 0.1f);
  Vec acc(kM * kD), h(kM * kD), u(kM * kD), mean_ref(kM), rstd_ref(kM);
  ref::matmul_forward(acc.data(), x.data(), w.data(), nullptr, kM, kD, kD);
  ref::matmul_forward(h.data(), x.data(), w.data(), bias.data(), kM, kD, kD);
  for (size_t i = 0; i < h.size(); ++i) h[i] += res[i];
  ref::layernorm_forward(u.data(), mean_ref.data(), rstd_ref.data(), h.data(), gamma.data(), beta.data(), kM, kD, kEps);

  const Bf16Vec res_b = to_bf16(res), bias_b = to_bf16(bias), gamma_b = to_bf16(gamma);
  Bf16Vec h_aux(kM * kD);
  Vec sum(kM * tiles(kD), NAN), sumsq(kM * tiles(kD), NAN), O(kM * kD, NAN), mean(kM), rstd(kM);
  epi::evaluate_on_host(prog::gpt2::residual_program(res_b.data(), bias_b.data(), h_aux.data(), kD, gamma_b.data(),
                                                     sum.data(), sumsq.data()),
                        acc.data(), kM, kD, kTile, O.data());
  const prog::NormPartials stats{sum.data(), sumsq.data(), tiles(kD), kD, kEps};
  for (int i = 0; i < kM; ++i) mean[i] = stats.ln_stats(i).mean, rstd[i] = stats.ln_stats(i).rstd;
  EXPECT_CLOSE(to_float(h_aux), h, kBf16Tol);
  EXPECT_CLOSE(O, mul_cols(h, gamma, kM, kD), kFp32Tol);
  EXPECT_CLOSE(mean, mean_ref, kFp32Tol);
  EXPECT_CLOSE(rstd, rstd_ref, kFp32Tol);
}

TEST(CodaGpt2, ProjDgradGeluBackwardScaledGradientAndLnStatistics) {
  const int F = 96;
  const LnLinear L(F, 60);  // the fc layer whose output gradient this program produces
  const Vec pre = round_bf16(random_vec(kM * F, -3.0f, 3.0f, 65));
  const Vec dres = random_vec(kM * kD, -1.0f, 1.0f, 66), w_proj = random_vec(kD * F, -0.15f, 0.15f, 67);
  const Vec dact = dgrad_acc(dres, w_proj, kM, F, kD);
  Vec dpre(kM * F, 0.0f), col_b_ref(F, 0.0f);
  Vec dot_z_ref(kM, 0.0f), dot_c_ref(kM, 0.0f), dot_b_ref(kM, 0.0f);
  ref::gelu_backward(dpre.data(), dact.data(), pre.data(), dpre.size());
  for (int i = 0; i < kM * F; ++i) {
    col_b_ref[i % F] += dpre[i];
    dot_z_ref[i / F] += dpre[i] * pre[i];
    dot_c_ref[i / F] += dpre[i] * L.c[i % F];
    dot_b_ref[i / F] += dpre[i] * L.b_prime[i % F];
  }

  const Bf16Vec pre_b = to_bf16(pre);
  DotPartials dots(F);
  Vec out(kM * F, NAN), col_b = column_partials(F);
  epi::evaluate_on_host(prog::gpt2::proj_dgrad_program(pre_b.data(), F, L.stats(), L.c.data(), L.b_prime.data(),
                                                       dots.view(tiles(F)), col_b.data()),
                        dact.data(), kM, F, kTile, out.data());
  Vec dot_z(kM), dot_c(kM), dot_b(kM);
  for (int i = 0; i < kM; ++i) {
    dot_z[i] = prog::sum_partials(&dots.z[size_t(i) * tiles(F)], tiles(F));
    dot_c[i] = prog::sum_partials(&dots.c[size_t(i) * tiles(F)], tiles(F));
    dot_b[i] = prog::sum_partials(&dots.b[size_t(i) * tiles(F)], tiles(F));
  }
  EXPECT_CLOSE(out, L.scaled(dpre), kFp32Tol);
  EXPECT_CLOSE(column_sums(col_b, kM, F), col_b_ref, kFp32Tol);
  EXPECT_CLOSE(dot_z, dot_z_ref, kFp32Tol);
  EXPECT_CLOSE(dot_c, dot_c_ref, kFp32Tol);
  EXPECT_CLOSE(dot_b, dot_b_ref, kFp32Tol);
}

// The LayerNorm backward program on D' = dz' W: the new residual gradient, dgamma, dbeta, the residual
// gradient's column sums and u / r (bf16, widened); with the reference's dh, dgamma, dbeta from du = dz W.
struct LnBackwardResult {
  Vec out, dgamma, dbeta, residual_colsum, norm_out_over_rstd;
};
LnBackwardResult run_ln_backward(const LnLinear& L, const Vec& dz_scaled, prog::LnDots dots, const Vec& d_residual) {
  const Vec acc = dgrad_acc(dz_scaled, L.w, kM, kD, L.N);
  const Bf16Vec dres_b = to_bf16(d_residual), beta_b = to_bf16(L.beta);
  Vec dgamma = column_partials(kD), dbeta = column_partials(kD), res = column_partials(kD);
  Bf16Vec over_rstd(kM * kD, __float2bfloat16_rn(NAN));
  LnBackwardResult r{Vec(kM * kD, NAN), {}, {}, {}, {}};
  epi::evaluate_on_host(prog::gpt2::ln_backward_program(L.stats(), dots, L.h_b.data(), kD, L.gamma_b.data(),
                                                        beta_b.data(), dres_b.data(),
                                                        {dgamma.data(), dbeta.data(), res.data()}, over_rstd.data()),
                        acc.data(), kM, kD, kTile, r.out.data());
  r.dgamma = column_sums(dgamma, kM, kD);
  r.dbeta = column_sums(dbeta, kM, kD);
  r.residual_colsum = column_sums(res, kM, kD);
  r.norm_out_over_rstd = to_float(over_rstd);
  return r;
}

// The reference LayerNorm backward from du = dz W, added to the incoming residual gradient.
struct LnBackwardReference {
  Vec d_residual, dgamma, dbeta, residual_colsum;
};
LnBackwardReference reference_ln_backward(const LnLinear& L, const Vec& mean, const Vec& rstd, const Vec& dz,
                                          const Vec& d_residual) {
  const Vec du = dgrad_acc(dz, L.w, kM, kD, L.N);
  LnBackwardReference r{d_residual, Vec(kD, 0.0f), Vec(kD, 0.0f), Vec(kD, 0.0f)};
  ref::layernorm_backward(r.d_residual.data(), r.dgamma.data(), r.dbeta.data(), du.data(), L.h.data(),
                          L.gamma.data(), mean.data(), rstd.data(), kM, kD);
  for (int i = 0; i < kM * kD; ++i) r.residual_colsum[i % kD] += r.d_residual[i];
  return r;
}

// S1 = <dz, c>, S2 = <dz, z> - <dz, b'> on the unscaled dz [M, L.N]: the partials its producer writes.
DotPartials gradient_dots(const LnLinear& L, const Vec& dz, const Vec& z) {
  const int N = L.N;
  DotPartials dots(N);
  dots.z = tile_row_sums(kM, N, [&](int i, int j) { return dz[i * N + j] * z[i * N + j]; });
  dots.c = tile_row_sums(kM, N, [&](int i, int j) { return dz[i * N + j] * L.c[j]; });
  dots.b = tile_row_sums(kM, N, [&](int i, int j) { return dz[i * N + j] * L.b_prime[j]; });
  return dots;
}

TEST(CodaGpt2, LayerNormBackwardScaledDgradAddsIntoTheResidualGradient) {
  const LnLinear L(96, 70);
  Vec u, mean, rstd, z;
  L.reference(u, mean, rstd, z);
  const Vec dz = random_vec(kM * L.N, -1.0f, 1.0f, 71), d_residual = round_bf16(random_vec(kM * kD, -0.5f, 0.5f, 72));
  const LnBackwardReference expect = reference_ln_backward(L, mean, rstd, dz, d_residual);

  DotPartials dots = gradient_dots(L, dz, z);
  const LnBackwardResult got = run_ln_backward(L, L.scaled(dz), dots.view(tiles(L.N)), d_residual);
  EXPECT_CLOSE(got.out, expect.d_residual, kFp32Tol);
  EXPECT_CLOSE(got.dgamma, expect.dgamma, kFp32Tol);
  EXPECT_CLOSE(got.dbeta, expect.dbeta, kFp32Tol);
  EXPECT_CLOSE(got.residual_colsum, expect.residual_colsum, kFp32Tol);
}

// The LayerNorm backward's u / r = (h - mu) (.) gamma + beta / r, stored [M, d] (bf16), makes the weight
// gradient of the GEMM after the norm the plain dz'^T (u / r), equal to the reference dz^T u to bf16
// precision (here without a bias, as at the LM head).
TEST(CodaGpt2, LayerNormBackwardStoresNormOutputOverRstdForAPlainWeightGradient) {
  const LnLinear L(96, 75, /*with_bias=*/false);
  Vec u, mean, rstd, z;
  L.reference(u, mean, rstd, z);
  const Vec dz = random_vec(kM * L.N, -1.0f, 1.0f, 76), d_residual = round_bf16(random_vec(kM * kD, -0.5f, 0.5f, 77));
  DotPartials dots = gradient_dots(L, dz, z);
  const Vec dz_scaled = L.scaled(dz);
  const LnBackwardResult got = run_ln_backward(L, dz_scaled, dots.view(tiles(L.N)), d_residual);
  const LnBackwardReference expect = reference_ln_backward(L, mean, rstd, dz, d_residual);
  EXPECT_CLOSE(got.out, expect.d_residual, kFp32Tol);

  Vec u_over_rstd(kM * kD);
  for (int i = 0; i < kM * kD; ++i) u_over_rstd[i] = u[i] / rstd[i / kD];
  EXPECT_CLOSE(got.norm_out_over_rstd, u_over_rstd, kBf16Tol);
  Vec dw(size_t(L.N) * kD, 0.0f), dw_ref(dw.size(), 0.0f);
  ref::matmul_backward(nullptr, dw.data(), nullptr, dz_scaled.data(), got.norm_out_over_rstd.data(), L.w.data(), kM,
                       kD, L.N);
  ref::matmul_backward(nullptr, dw_ref.data(), nullptr, dz.data(), u.data(), L.w.data(), kM, kD, L.N);
  EXPECT_CLOSE(dw, dw_ref, kBf16Tol);
}

// The MLP backward as the CODA mode chains it: the proj dgrad program hands on dz' = r dz with the
// column partials of dz and the row dots; the fc dgrad's LayerNorm backward runs on those dots and stores
// u / r, and the fc weight gradient is the plain dz'^T (u / r), the bias gradient the column sums of dz.
// dgamma, dbeta and the bias gradient match the reference to fp32 precision; dh to bf16 precision, because
// S2 = <dz, z - b'> reads the saved bf16 pre-activation where the reference has the exact one; the weight
// gradient to bf16 precision (u / r is stored in bf16).
TEST(CodaGpt2, MlpBackwardChainWeightGradientAndLayerNormBackward) {
  const int F = 96;
  const LnLinear L(F, 80);
  Vec u, mean, rstd, z;
  L.reference(u, mean, rstd, z);
  const Vec pre = round_bf16(z);
  const Vec dres = random_vec(kM * kD, -1.0f, 1.0f, 81), w_proj = random_vec(kD * F, -0.15f, 0.15f, 82);
  const Vec dact = dgrad_acc(dres, w_proj, kM, F, kD);
  Vec dpre(kM * F, 0.0f), dw_ref(F * kD, 0.0f), db_ref(F, 0.0f);
  ref::gelu_backward(dpre.data(), dact.data(), pre.data(), dpre.size());
  ref::matmul_backward(nullptr, dw_ref.data(), db_ref.data(), dpre.data(), u.data(), L.w.data(), kM, kD, F);
  const LnBackwardReference expect = reference_ln_backward(L, mean, rstd, dpre, dres);

  const Bf16Vec pre_b = to_bf16(pre);
  DotPartials dots(F);
  Vec dz_scaled(kM * F, NAN), col_b = column_partials(F);
  epi::evaluate_on_host(prog::gpt2::proj_dgrad_program(pre_b.data(), F, L.stats(), L.c.data(), L.b_prime.data(),
                                                       dots.view(tiles(F)), col_b.data()),
                        dact.data(), kM, F, kTile, dz_scaled.data());
  const LnBackwardResult got = run_ln_backward(L, dz_scaled, dots.view(tiles(F)), dres);
  EXPECT_CLOSE(got.out, expect.d_residual, kBf16Tol);
  EXPECT_CLOSE(got.dgamma, expect.dgamma, kFp32Tol);
  EXPECT_CLOSE(got.dbeta, expect.dbeta, kFp32Tol);
  EXPECT_CLOSE(got.residual_colsum, expect.residual_colsum, kBf16Tol);

  Vec dw(F * kD, 0.0f);
  ref::matmul_backward(nullptr, dw.data(), nullptr, dz_scaled.data(), got.norm_out_over_rstd.data(), L.w.data(), kM,
                       kD, F);
  EXPECT_CLOSE(dw, dw_ref, kBf16Tol);
  EXPECT_CLOSE(column_sums(col_b, kM, F), db_ref, kFp32Tol);
}

// The tile rule of the programs and the weight gradients (gemm_choose_tile; gemm_epilogue_of maps a program with two tile inputs
// to GemmEpilogue::TwoTileInputs): the two-input LayerNorm backward and the short- and long-K programs go to the
// cooperative tile, the other narrow forward programs to ping-pong 128x128, the rest to ping-pong 64x256.
TEST(CodaTiles, ProgramsTakeTheTileOfTheirShapeAndTileInputs) {
  const auto ln_backward = prog::gpt2::ln_backward_program({}, {}, nullptr, 768, nullptr, nullptr, nullptr, {}, nullptr);
  const auto norm_backward = prog::llama::norm_backward_program({}, nullptr, 1, nullptr, 2048, nullptr, nullptr);
  EXPECT_EQ(decltype(ln_backward)::kTileInputs, 2);   // h and d_residual
  EXPECT_EQ(decltype(norm_backward)::kTileInputs, 1);  // h (the residual gradient is reduce-added)
  const auto pick = [](GemmLayout layout, int M, int N, int K, GemmEpilogue e) {
    return gemm_choose_tile(layout, M, N, K, e);
  };
  EXPECT_EQ(pick(GemmLayout::Dgrad, 32768, 768, 3072, GemmEpilogue::TwoTileInputs), GemmTile::Cooperative128x256);
  EXPECT_EQ(pick(GemmLayout::Dgrad, 16384, 2048, 3072, GemmEpilogue::Program), GemmTile::PingPong64x256);
  EXPECT_EQ(pick(GemmLayout::Dgrad, 16384, 2048, 128256, GemmEpilogue::Program), GemmTile::Cooperative128x256);
  EXPECT_EQ(pick(GemmLayout::Forward, 32768, 768, 3072, GemmEpilogue::Program), GemmTile::PingPong128x128);
  EXPECT_EQ(pick(GemmLayout::Forward, 16384, 2048, 8192, GemmEpilogue::Program), GemmTile::Cooperative128x256);
  EXPECT_EQ(pick(GemmLayout::Forward, 16384, 3072, 2048, GemmEpilogue::Program), GemmTile::PingPong64x256);
  EXPECT_EQ(pick(GemmLayout::Forward, 16384, 2048, 2048, GemmEpilogue::Program), GemmTile::PingPong128x128);
  // d_model 768: the QKV, fc and head forwards and the proj dgrad (K = 768) on the cooperative tile.
  EXPECT_EQ(pick(GemmLayout::Forward, 32768, 2304, 768, GemmEpilogue::Program), GemmTile::Cooperative128x256);
  EXPECT_EQ(pick(GemmLayout::Forward, 32768, 50304, 768, GemmEpilogue::Program), GemmTile::Cooperative128x256);
  EXPECT_EQ(pick(GemmLayout::Dgrad, 32768, 3072, 768, GemmEpilogue::Program), GemmTile::Cooperative128x256);
  EXPECT_EQ(pick(GemmLayout::Forward, 32768, 3072, 768, GemmEpilogue::Bare), GemmTile::PingPong128x128);
  // Weight gradients: ping-pong 128x128 for outputs under 2048 x 2048, cooperative from there on.
  EXPECT_EQ(pick(GemmLayout::Wgrad, 768, 3072, 32768, GemmEpilogue::Bare), GemmTile::PingPong128x128);
  EXPECT_EQ(pick(GemmLayout::Wgrad, 2048, 2048, 16384, GemmEpilogue::Bare), GemmTile::Cooperative128x256);
  EXPECT_EQ(pick(GemmLayout::Wgrad, 50304, 768, 32768, GemmEpilogue::Bare), GemmTile::Cooperative128x256);
  // Both tiles a program may take besides the narrow one have the same N width: the same row partials.
  EXPECT_EQ(gemm_tile_n(GemmTile::Cooperative128x256), gemm_tile_n(GemmTile::PingPong64x256));
}

}  // namespace
