// The CODA passes outside the GEMMs (kernels/coda/passes.cuh) against host computations on random data:
// embedding_forward, loss_from_partials, dlogits (RMSNorm in place, LayerNorm out of place),
// ln_weight_vectors and add_column_partials; the cases each covers: above its check function below.
// Outputs are poisoned with NaN before every launch (an unwritten element fails). Errors are relative
// Frobenius norms (rel_error). Tolerances: values rounded to bf16 once 1e-2; fp32 results of fp32 sums in
// another order (and the GPU's fast exp) 1e-4; the embedding's h and O, which both sides compute with
// identical fp32 operations and one rounding, 1e-6.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <vector>

#include "kernels/coda/passes.cuh"
#include "kernels/common/cuda_check.cuh"
#include "src/ref_ops.hpp"
#include "src/rng.hpp"
#include "tests/gpu_test_util.cuh"

namespace {

namespace passes = coda::passes;
using namespace coda::test;
using passes::bf16;

constexpr double kExactTol = 1e-6;

// ---- embedding_forward ---------------------------------------------------------------------------------

// embedding_forward: h against the CPU reference's embedding (rounded to bf16 as stored), O = h (.) gamma,
// and the norm's row partials (sum, sum of squares) of the stored h.
void check_embedding(int B, int T, int C, bool positions) {
  SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C) +
               (positions ? " with wpe" : " no wpe"));
  coda::Rng rng(11 + C + positions);
  const int V = 517, N = B * T;
  const std::vector<float> wte = random_values(static_cast<size_t>(V) * C, rng, 0.5f, 0.1f);
  const std::vector<float> wpe = random_values(static_cast<size_t>(T) * C, rng, 0.3f);
  const std::vector<float> gamma = random_values(C, rng, 0.2f, 1.0f);
  const std::vector<int32_t> tokens = random_ids(N, V, rng);

  std::vector<float> h(static_cast<size_t>(N) * C), O(h.size()), sum(N), sumsq(N);
  coda::ref::embedding_forward(h.data(), tokens.data(), wte.data(), positions ? wpe.data() : nullptr, B, T, C);
  for (int n = 0; n < N; ++n) {
    double s = 0, ss = 0;
    for (int j = 0; j < C; ++j) {
      float& x = h[static_cast<size_t>(n) * C + j];
      x = round_bf16(x);
      s += x;
      ss += static_cast<double>(x) * x;
      O[static_cast<size_t>(n) * C + j] = round_bf16(x * gamma[j]);
    }
    sum[n] = static_cast<float>(s);
    sumsq[n] = static_cast<float>(ss);
  }

  DeviceBuffer<bf16> d_wte(wte), d_wpe(wpe), d_gamma(gamma);
  DeviceCopy<int32_t> d_tokens(tokens);
  OutputBuffer<bf16> d_h(h.size()), d_O(h.size());
  OutputBuffer<float> d_sum(N), d_sumsq(N);
  passes::embedding_forward(d_h.get(), d_O.get(), d_sum.get(), d_sumsq.get(), d_tokens.get(), d_wte.get(),
                           positions ? d_wpe.get() : nullptr, d_gamma.get(), B, T, C, 0);
  EXPECT_LT(rel_error(d_h.download(), h), kExactTol);
  EXPECT_LT(rel_error(d_O.download(), O), kExactTol);
  EXPECT_LT(rel_error(d_sum.download(), sum), kFp32Tol);
  EXPECT_LT(rel_error(d_sumsq.download(), sumsq), kFp32Tol);

  // RMSNorm: no sum partials.
  d_sumsq.poison();
  passes::embedding_forward(d_h.get(), d_O.get(), nullptr, d_sumsq.get(), d_tokens.get(), d_wte.get(),
                           positions ? d_wpe.get() : nullptr, d_gamma.get(), B, T, C, 0);
  EXPECT_LT(rel_error(d_sumsq.download(), sumsq), kFp32Tol);
}

TEST(GpuPasses, EmbeddingForward) {
  SKIP_WITHOUT_GPU();
  check_embedding(3, 37, 768, true);     // GPT-2: three packets per lane
  check_embedding(2, 45, 200, true);     // 25 packets: lanes without a packet
  check_embedding(4, 19, 2048, false);   // Llama: no positions, 8 packets per lane (two rounds of loads)
}

// ---- loss_from_partials --------------------------------------------------------------------------------

// loss_from_partials: per-tile (max, sum exp) partials of random logits, with a tile wholly in the padded
// vocabulary, against the CPU reference's cross-entropy.
TEST(GpuPasses, LossFromPartials) {
  SKIP_WITHOUT_GPU();
  coda::Rng rng(5);
  const int N = 203, V = 900, Vp = 1152, tile = 192, count = Vp / tile;  // the last tile is all padding
  const std::vector<float> logits = random_values(static_cast<size_t>(N) * Vp, rng, 2.0f);
  const std::vector<int32_t> targets = random_ids(N, V, rng);
  std::vector<float> partials(static_cast<size_t>(N) * count * 2), target_logit(N);
  for (int n = 0; n < N; ++n) {
    const float* row = &logits[static_cast<size_t>(n) * Vp];
    for (int t = 0; t < count; ++t) {
      float m = -INFINITY;
      for (int j = t * tile; j < (t + 1) * tile && j < V; ++j) m = std::max(m, row[j]);
      double s = 0;
      for (int j = t * tile; j < (t + 1) * tile && j < V; ++j) s += std::exp(static_cast<double>(row[j]) - m);
      partials[(static_cast<size_t>(n) * count + t) * 2] = m;
      partials[(static_cast<size_t>(n) * count + t) * 2 + 1] = static_cast<float>(s);
    }
    target_logit[n] = row[targets[n]];
  }
  std::vector<float> losses(N);
  coda::ref::crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp);
  std::vector<float> lse(N);
  for (int n = 0; n < N; ++n) lse[n] = losses[n] + target_logit[n];

  DeviceBuffer<float> d_partials(partials), d_target_logit(target_logit);
  OutputBuffer<float> d_losses(N), d_lse(N);
  passes::loss_from_partials(d_losses.get(), d_lse.get(),
                            reinterpret_cast<const coda::epi::LogSumExp::Out*>(d_partials.get()), count,
                            d_target_logit.get(), N, 0);
  EXPECT_LT(rel_error(d_losses.download(), losses), kFp32Tol);
  EXPECT_LT(rel_error(d_lse.download(), lse), kFp32Tol);
}

// ---- dlogits -------------------------------------------------------------------------------------------

// The final norm's row partials (count 3) of rows with mean about `mean_scale` and RMS about 1.5; the
// host's r and mu from plain math.
struct NormRows {
  std::vector<float> sum, sumsq, rstd, mean;
};
constexpr int kNormCount = 3, kNormD = 768;
constexpr float kNormEps = 1e-5f;

NormRows random_norm_rows(int N, bool layer_norm, coda::Rng& rng) {
  NormRows s;
  s.sum.resize(static_cast<size_t>(N) * kNormCount);
  s.sumsq.resize(s.sum.size());
  for (int n = 0; n < N; ++n) {
    double total = 0, total_sq = 0;
    for (int i = 0; i < kNormCount; ++i) {
      const size_t at = static_cast<size_t>(n) * kNormCount + i;
      s.sum[at] = layer_norm ? static_cast<float>(rng.normal() * 20.0) : 0.0f;
      s.sumsq[at] = static_cast<float>(kNormD * (0.5 + 1.5 * rng.uniform()) / kNormCount);
      total += s.sum[at];
      total_sq += s.sumsq[at];
    }
    const double mu = layer_norm ? total / kNormD : 0.0;
    s.mean.push_back(static_cast<float>(mu));
    s.rstd.push_back(static_cast<float>(1.0 / std::sqrt(total_sq / kNormD - mu * mu + kNormEps)));
  }
  return s;
}

// dlogits' = r dz against r times the CPU reference's softmax gradient, exact zeros in the padded columns and
// the row dots, on a small vocabulary and on GPT-2's (50257 of 50304: the multi-slice clusters), with N not a
// multiple of the row group; the LayerNorm run is repeated and must match bitwise (no atomics).
void check_dlogits(int N, int vocab, int Vp, bool layer_norm) {
  SCOPED_TRACE("N=" + std::to_string(N) + " vocab=" + std::to_string(vocab) + " Vp=" + std::to_string(Vp) +
               (layer_norm ? " LayerNorm" : " RMSNorm"));
  coda::Rng rng(101 + vocab + layer_norm);
  const size_t NV = static_cast<size_t>(N) * Vp;
  const std::vector<float> logits = random_values(NV, rng, 3.0f);
  const std::vector<int32_t> targets = random_ids(N, vocab, rng);
  const std::vector<float> c = random_values(Vp, rng, 0.5f), b_prime = random_values(Vp, rng, 0.5f);
  const NormRows norm = random_norm_rows(N, layer_norm, rng);
  const float dloss = 1.0f / N;

  // Reference: dz from the CPU reference's cross-entropy backward; lse from its forward.
  std::vector<float> losses(N), dz(NV), lse(N);
  coda::ref::crossentropy_forward(losses.data(), logits.data(), targets.data(), N, vocab, Vp);
  coda::ref::crossentropy_backward(dz.data(), logits.data(), targets.data(), dloss, N, vocab, Vp);
  for (int n = 0; n < N; ++n) lse[n] = losses[n] + logits[static_cast<size_t>(n) * Vp + targets[n]];
  std::vector<float> dlogits_ref(NV), dot_z(N), dot_c(N), dot_b(N);
  for (int n = 0; n < N; ++n) {
    double zz = 0, zc = 0, zb = 0;
    for (int j = 0; j < Vp; ++j) {
      const size_t at = static_cast<size_t>(n) * Vp + j;
      zz += static_cast<double>(dz[at]) * logits[at];
      zc += static_cast<double>(dz[at]) * c[j];
      zb += static_cast<double>(dz[at]) * b_prime[j];
      dlogits_ref[at] = norm.rstd[n] * dz[at];
    }
    dot_z[n] = static_cast<float>(zz), dot_c[n] = static_cast<float>(zc), dot_b[n] = static_cast<float>(zb);
  }

  DeviceBuffer<bf16> d_logits(logits);
  DeviceCopy<int32_t> d_targets(targets);
  DeviceBuffer<float> d_lse(lse), d_c(c), d_b_prime(b_prime), d_sum(norm.sum), d_sumsq(norm.sumsq);
  OutputBuffer<bf16> d_out(NV);
  OutputBuffer<float> d_dot_z(N), d_dot_c(N), d_dot_b(N);
  passes::DlogitsArgs args;
  args.dlogits = layer_norm ? d_out.get() : d_logits.get();  // RMSNorm in place, LayerNorm out of place
  args.logits = d_logits.get();
  args.lse = d_lse.get();
  args.targets = d_targets.get();
  args.dloss = dloss;
  args.N = N, args.vocab = vocab, args.Vp = Vp;
  args.stats.sum = layer_norm ? d_sum.get() : nullptr;
  args.stats.sumsq = d_sumsq.get();
  args.stats.count = kNormCount, args.stats.d = kNormD, args.stats.eps = kNormEps;
  args.dot_z = d_dot_z.get();
  if (layer_norm) {
    args.c = d_c.get(), args.b_prime = d_b_prime.get();
    args.dot_c = d_dot_c.get(), args.dot_b = d_dot_b.get();
  }
  passes::dlogits(args, 0);

  const std::vector<float> got = layer_norm ? d_out.download() : d_logits.download();
  EXPECT_LT(rel_error(got, dlogits_ref), kBf16Tol);
  size_t nonzero_padding = 0;
  for (int n = 0; n < N; ++n)
    for (int j = vocab; j < Vp; ++j) nonzero_padding += got[static_cast<size_t>(n) * Vp + j] != 0.0f;
  EXPECT_EQ(nonzero_padding, 0u);
  const std::vector<float> got_dot_z = d_dot_z.download();
  EXPECT_LT(rel_error(got_dot_z, dot_z), kFp32Tol);
  if (!layer_norm) return;
  const std::vector<float> got_dot_c = d_dot_c.download(), got_dot_b = d_dot_b.download();
  EXPECT_LT(rel_error(got_dot_c, dot_c), kFp32Tol);
  EXPECT_LT(rel_error(got_dot_b, dot_b), kFp32Tol);

  // A second run gives bitwise the same results.
  for (auto* buffer : {&d_dot_z, &d_dot_c, &d_dot_b}) buffer->poison();
  passes::dlogits(args, 0);
  const std::vector<float> again = d_out.download();
  EXPECT_EQ(std::memcmp(again.data(), got.data(), got.size() * sizeof(float)), 0);
  for (const auto& [buffer, first] : {std::make_pair(&d_dot_z, &got_dot_z), std::make_pair(&d_dot_c, &got_dot_c),
                                      std::make_pair(&d_dot_b, &got_dot_b)}) {
    const std::vector<float> second = buffer->download();
    EXPECT_EQ(std::memcmp(second.data(), first->data(), first->size() * sizeof(float)), 0);
  }
}

TEST(GpuPasses, DlogitsRmsNorm) {
  SKIP_WITHOUT_GPU();
  check_dlogits(300, 1000, 1024, false);
  check_dlogits(133, 50257, 50304, false);
}

TEST(GpuPasses, DlogitsLayerNorm) {
  SKIP_WITHOUT_GPU();
  check_dlogits(300, 1000, 1024, true);
  check_dlogits(133, 50257, 50304, true);
}

// ---- ln_weight_vectors ---------------------------------------------------------------------------------

// ln_weight_vectors with and without a bias.
void check_ln_weight_vectors(int rows, int d, bool with_bias) {
  SCOPED_TRACE("rows=" + std::to_string(rows) + " d=" + std::to_string(d) + (with_bias ? " bias" : " no bias"));
  coda::Rng rng(23 + d + with_bias);
  const std::vector<float> W = random_values(static_cast<size_t>(rows) * d, rng, 0.02f);
  const std::vector<float> gamma = random_values(d, rng, 0.1f, 1.0f), beta = random_values(d, rng, 0.1f);
  const std::vector<float> bias = random_values(rows, rng, 0.1f);
  std::vector<float> c(rows), b_prime(rows);
  for (int n = 0; n < rows; ++n) {
    double sc = 0, sb = with_bias ? bias[n] : 0.0;
    for (int k = 0; k < d; ++k) {
      sc += static_cast<double>(gamma[k]) * W[static_cast<size_t>(n) * d + k];
      sb += static_cast<double>(beta[k]) * W[static_cast<size_t>(n) * d + k];
    }
    c[n] = static_cast<float>(sc), b_prime[n] = static_cast<float>(sb);
  }
  DeviceBuffer<bf16> d_W(W), d_gamma(gamma), d_beta(beta), d_bias(bias);
  OutputBuffer<float> d_c(rows), d_b_prime(rows);
  passes::ln_weight_vectors(d_c.get(), d_b_prime.get(), d_W.get(), rows, d, d_gamma.get(), d_beta.get(),
                           with_bias ? d_bias.get() : nullptr, 0);
  EXPECT_LT(rel_error(d_c.download(), c), kFp32Tol);
  EXPECT_LT(rel_error(d_b_prime.download(), b_prime), kFp32Tol);
}

TEST(GpuPasses, LnWeightVectors) {
  SKIP_WITHOUT_GPU();
  check_ln_weight_vectors(2307, 768, true);    // QKV-like, rows not a multiple of the block's 8 rows
  check_ln_weight_vectors(1003, 1600, false);  // the head: no bias, 200 packets per row
}

// ---- add_column_partials ------------------------------------------------------------------------------

// Column sums of [groups, ld] partials, columns < n, in double.
std::vector<double> column_sums(const std::vector<float>& partials, int groups, int ld, int n) {
  std::vector<double> s(n, 0.0);
  for (int g = 0; g < groups; ++g)
    for (int j = 0; j < n; ++j) s[j] += partials[static_cast<size_t>(g) * ld + j];
  return s;
}

// add_column_partials with group counts that make clusters of one and of several blocks with uneven shares,
// column counts that end in a partial tile, and gradients that already hold values (the function adds).
//
// `arrays` (gradient, partials) pairs in one launch, with a pair without gradient among them (skipped).
void check_add_column_partials(int groups, int ld, int n, int arrays) {
  SCOPED_TRACE("groups=" + std::to_string(groups) + " ld=" + std::to_string(ld) + " n=" + std::to_string(n) +
               " arrays=" + std::to_string(arrays));
  coda::Rng rng(31 + groups + arrays);
  const float scale = 0.75f;
  std::vector<std::vector<float>> grads, expected;
  std::deque<DeviceBuffer<float>> d_partials, d_grads;  // a deque: the buffers do not move
  for (int a = 0; a < arrays; ++a) {
    const std::vector<float> partials = random_values(static_cast<size_t>(groups) * ld, rng, 0.3f, 0.05f);
    grads.push_back(random_values(n, rng, 2.0f));
    const std::vector<double> sums = column_sums(partials, groups, ld, n);
    expected.emplace_back(n);
    for (int j = 0; j < n; ++j) expected[a][j] = static_cast<float>(grads[a][j] + scale * sums[j]);
    d_partials.emplace_back(partials);
    d_grads.emplace_back(grads[a]);
  }
  auto run = [&] {
    if (arrays == 1) passes::add_column_partials({{d_grads[0].get(), d_partials[0].get()}}, groups, ld, n, scale, 0);
    if (arrays == 2)
      passes::add_column_partials({{d_grads[0].get(), d_partials[0].get()}, {nullptr, d_partials[0].get()},
                                  {d_grads[1].get(), d_partials[1].get()}},
                                 groups, ld, n, scale, 0);
    if (arrays == 3)
      passes::add_column_partials({{d_grads[0].get(), d_partials[0].get()}, {d_grads[1].get(), d_partials[1].get()},
                                  {d_grads[2].get(), d_partials[2].get()}},
                                 groups, ld, n, scale, 0);
  };
  run();
  std::vector<std::vector<float>> got;
  for (int a = 0; a < arrays; ++a) {
    got.push_back(d_grads[a].download());
    EXPECT_LT(rel_error(got[a], expected[a]), kFp32Tol) << "array " << a;
    d_grads[a].upload(grads[a]);
  }
  run();
  for (int a = 0; a < arrays; ++a) {
    const std::vector<float> again = d_grads[a].download();
    EXPECT_EQ(std::memcmp(again.data(), got[a].data(), got[a].size() * sizeof(float)), 0) << "array " << a;
  }
}

TEST(GpuPasses, AddColumnPartials) {
  SKIP_WITHOUT_GPU();
  check_add_column_partials(2053, 776, 764, 1);  // a GEMM's 16-row groups: clusters of 8, a partial last tile
  check_add_column_partials(100, 3072, 3072, 1); // one block per cluster
  check_add_column_partials(700, 52, 36, 1);     // clusters of 3, one and a bit tiles
  check_add_column_partials(2053, 776, 764, 3);  // the LayerNorm backward's three: dgamma, dbeta, a bias
  check_add_column_partials(700, 52, 36, 2);     // two, and a pair without gradient skipped
}

TEST(GpuPasses, AddColumnPartialsRejectsFourArrays) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<float> d(std::vector<float>(64, 0.0f));
  EXPECT_THROW(passes::add_column_partials({{d.get(), d.get()}, {d.get(), d.get()}, {d.get(), d.get()},
                                           {d.get(), d.get()}},
                                          1, 64, 64, 1.0f, 0),
               std::invalid_argument);
}

}  // namespace
