// The small pieces around the CODA programs: finishing partials into row statistics and backward
// coefficients (per row, where a row-broadcast primitive or a tiny kernel needs them), finishing column
// partials into parameter gradients, and the LayerNorm weight-derived vectors (once per step).
// All __host__ __device__: the host tests call the same functions the GPU path will.
//
// Row partials are rows of a [M, count] buffer (one entry per N tile of the producing GEMM); column
// partials are [groups, ld] (one row per 16-row group of the producing GEMM), see kernels/epilogue/fragment.cuh.
#pragma once
#include <cuda_bf16.h>

#include <cmath>

#include "kernels/epilogue/epilogue.cuh"

namespace coda::prog {

// Four partials per step with four sums, the last 0-3 as predicated loads: a step's loads are issued
// together instead of one load latency per partial (the LayerNorm statistics of a 3-tile producer are
// one step).
CODA_HD float sum_partials(const float* row_partials, int count) {
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int i = 0;
  for (; i + 4 <= count; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += row_partials[i + j];
  for (int j = 0; j < 3; ++j)
    if (i + j < count) s[j] += row_partials[i + j];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// RMSNorm: r = 1 / sqrt(sum(h^2) / d + eps) from the partial sums of h^2.
CODA_HD float rms_rstd(const float* sumsq_partials, int count, int d, float eps) {
  return 1.0f / sqrtf(sum_partials(sumsq_partials, count) / static_cast<float>(d) + eps);
}

// LayerNorm: mu = sum(h) / d, r = 1 / sqrt(sum(h^2) / d - mu^2 + eps) from partial sums of h and h^2.
struct LnStats {
  float mean, rstd;
};
CODA_HD LnStats ln_stats(const float* sum_p, const float* sumsq_p, int count, int d, float eps) {
  const float mean = sum_partials(sum_p, count) / static_cast<float>(d);
  const float var = fmaxf(sum_partials(sumsq_p, count) / static_cast<float>(d) - mean * mean, 0.0f);
  return {mean, 1.0f / sqrtf(var + eps)};
}

// RMSNorm backward: dh = r (D (.) gamma) - k h with k = r^2 <dz, z> / d, from the <dz, z> partials.
CODA_HD float rms_backward_coef(const float* dot_partials, int count, float rstd, int d) {
  return rstd * rstd * sum_partials(dot_partials, count) / static_cast<float>(d);
}

// LayerNorm backward: dh = r (D (.) gamma) - k h + e, with
//   S1 = sum_j dx_hat_j = <du, gamma> = <dz, c>,
//   S2 = sum_j dx_hat_j x_hat_j = <du, u - beta> = <dz, z - b'>   (z = u W^T + bias, b' = W beta + bias),
//   k = r^2 S2 / d,  e = k mu - r S1 / d,
// from the partials of <dz, c>, <dz, z> and <dz, b'>.
struct LnBackwardCoefs {
  float tile_coef, row_add;  // k, e
};
CODA_HD LnBackwardCoefs ln_backward_coefs(const float* dot_c, const float* dot_z, const float* dot_b, int count,
                                          LnStats st, int d) {
  const float s1 = sum_partials(dot_c, count), s2 = sum_partials(dot_z, count) - sum_partials(dot_b, count);
  const float k = st.rstd * st.rstd * s2 / static_cast<float>(d);
  return {k, k * st.mean - st.rstd * s1 / static_cast<float>(d)};
}

// The row partials of one norm's input as its producer wrote them: sum (LayerNorm; nullptr for RMSNorm)
// and sum of squares, each [M, count] (count: the producer's N tiles, gemm_row_partials; 1 from a
// per-row kernel such as the embedding). d: the row length (d_model); eps: the norm's epsilon.
struct NormPartials {
  const float* sum = nullptr;
  const float* sumsq = nullptr;
  int count = 0, d = 0;
  float eps = 0.0f;
  CODA_HD float rms_rstd(int row) const {
    return prog::rms_rstd(sumsq + static_cast<size_t>(row) * count, count, d, eps);
  }
  CODA_HD LnStats ln_stats(int row) const {
    const size_t at = static_cast<size_t>(row) * count;
    return prog::ln_stats(sum + at, sumsq + at, count, d, eps);
  }
  // The norm's rstd r, whichever norm it is.
  CODA_HD float rstd(int row) const { return sum == nullptr ? rms_rstd(row) : ln_stats(row).rstd; }
};

// ---- LayerNorm statistics as row values, finished once per row by a RowStage ----
// Forward: z = r (O W^T - mu c) + b' reads LnRstd and LnMean. Backward (scaled form, passes.cuh:
// the dgrad accumulator is D' = r du): dh = D' (.) gamma - k h + e reads LnBackwardK and LnBackwardE;
// dgamma = colsum(D' (.) (h - mu)) reads LnMean; dbeta = colsum(D' / r) reads LnInvRstd. A program that
// reads them starts with RowStage<LnRows> (or RowStage<LnBackwardRows> for k and e), which finishes the
// partials once per row (instead of every reader finishing them again, a large part of the LM head's time), and
// reads them as RowOf<LnRstd> etc.
using LnRstd = epi::Staged<0>;
using LnMean = epi::Staged<1>;
using LnInvRstd = epi::Staged<2>;
using LnBackwardK = epi::Staged<3>;
using LnBackwardE = epi::Staged<4>;

struct LnRows {
  static constexpr int kValues = 3;
  NormPartials stats;
  CODA_HD void operator()(int row, float* values) const {
    const LnStats st = stats.ln_stats(row);
    values[0] = st.rstd, values[1] = st.mean, values[2] = 1.0f / st.rstd;
  }
};

// The row partials of a LayerNorm backward's three dots, taken on the unscaled dz by its producer:
// <dz, z>, <dz, c>, <dz, b'>, each [M, count].
struct LnDots {
  float* z = nullptr;
  float* c = nullptr;
  float* b = nullptr;
  int count = 0;
};

struct LnBackwardRows {
  static constexpr int kValues = 5;
  NormPartials stats;
  LnDots dots;
  CODA_HD void operator()(int row, float* values) const {
    LnRows{stats}(row, values);
    const size_t at = static_cast<size_t>(row) * dots.count;
    const LnBackwardCoefs k = ln_backward_coefs(dots.c + at, dots.z + at, dots.b + at, dots.count,
                                                LnStats{values[1], values[0]}, stats.d);
    values[3] = k.tile_coef, values[4] = k.row_add;
  }
};

// Sum over the 16-row groups of a column partial buffer [groups, ld].
CODA_HD float sum_column_partials(const float* partials, int groups, int ld, int col) {
  float s = 0.0f;
  for (int g = 0; g < groups; ++g) s += partials[static_cast<size_t>(g) * ld + col];
  return s;
}

CODA_HD int column_partial_groups(int M) { return (M + epi::ColDot<epi::Ones>::kRows - 1) / epi::ColDot<epi::Ones>::kRows; }

// LayerNorm weight-derived vectors of the linear layer y = LN(h) W^T + bias, W [out, in]; entry n:
//   c[n] = sum_k gamma[k] W[n, k],   b'[n] = sum_k beta[k] W[n, k] + bias[n]   (bias nullable).
template <class T>
CODA_HD void ln_weight_vectors(int n, const T* W, int in, const float* gamma, const float* beta, const float* bias,
                               float* c, float* b_prime) {
  float sc = 0.0f, sb = 0.0f;
  for (int k = 0; k < in; ++k) {
    const float w = static_cast<float>(W[static_cast<size_t>(n) * in + k]);
    sc += gamma[k] * w;
    sb += beta[k] * w;
  }
  c[n] = sc;
  b_prime[n] = sb + (bias ? bias[n] : 0.0f);
}

// ---- RMSNorm row operands (RowOf<Stat> in kernels/epilogue/operands.cuh): statistics finished from partials as a GEMM
// epilogue's rows begin ----

// r = 1 / sqrt(mean(h^2) + eps): the row scale of the GEMM after an RMSNorm, and of its gradient dz' = r dz.
struct RmsRstd {
  NormPartials stats;
  CODA_HD float operator()(int row) const { return stats.rms_rstd(row); }
};

// k = r^2 <dz, z> / d: the coefficient of h in the RMSNorm backward dh = D' (.) gamma - k h, from the
// <dz, z> row partials [M, dot_count] of whoever produced dz.
struct RmsBackwardCoef {
  NormPartials stats;
  const float* dot;
  int dot_count;
  CODA_HD float operator()(int row) const {
    return rms_backward_coef(dot + static_cast<size_t>(row) * dot_count, dot_count, stats.rms_rstd(row), stats.d);
  }
};

}  // namespace coda::prog
