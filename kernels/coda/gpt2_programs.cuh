// The CODA programs of a GPT-2 block (LayerNorm, biases, GELU), each the epilogue of one GEMM; the
// derivations are in docs/CODA.md ("GPT-2"). Residual stream h [M, d]; LayerNorm u = (h - mu) r (.) gamma
// + beta; next GEMM z = u W^T + bias, W [n, d]. Forward: z = r (O W^T - mu c) + b' with O = h (.) gamma,
// c = W gamma, b' = W beta + bias (passes::ln_weight_vectors), mu and r finished from the producer's
// partials once per row (RowStage, norm_stats.cuh). Backward in the scaled form of passes.cuh:
// dh = D' (.) gamma - k h + e with k = r^2 S2 / d, e = k mu - r S1 / d, S1 = <dz, c>, S2 = <dz, z> -
// <dz, b'> (row dots of the unscaled dz); the dgrad stores u / r over O, so dW = dz'^T (u / r); the
// residual gradient's column sums on the way out are the bias gradient of the projection below.
// Parameter vectors (gamma, beta, biases) are bf16, weight-derived vectors fp32. Each function's program
// type is named below it: the kernels are compiled for those (CMakeLists.txt, CODA_GEMM_PROGRAMS).
#pragma once
#include "kernels/coda/norm_stats.cuh"

namespace coda::prog::gpt2 {

using bf16 = __nv_bfloat16;
using namespace coda::epi;

// z = r (acc - mu c) + b' (the LayerNorm reparameterization), followed by the primitives `rest`. In this
// order the compiler contracts the row scale and the column add into one multiply-add: two per value,
// where r acc - (r mu) c + b' took three.
template <class... Rest>
inline auto ln_linear_then(const NormPartials& stats, const float* c, const float* b_prime, const Rest&... rest) {
  return make_program(RowStage<LnRows>(LnRows{stats}), SubScaled<ColVector, RowOf<LnMean>>(LnMean{}, ColVector{c}),
                      RowBroadcast<Mul, RowOf<LnRstd>>(LnRstd{}), ColBroadcast<Add>(b_prime), rest...);
}

// QKV: qkv = LN(h) Wqkv^T + bias.
inline auto ln_linear_program(const NormPartials& stats, const float* c, const float* b_prime) {
  return ln_linear_then(stats, c, b_prime);
}
using LnLinearProgram = decltype(ln_linear_program({}, nullptr, nullptr));

// fc: pre = LN(h) Wfc^T + bias kept as aux output [M, f]; main output gelu(pre).
inline auto fc_program(const NormPartials& stats, const float* c, const float* b_prime, bf16* pre, int f) {
  return ln_linear_then(stats, c, b_prime, StoreAux<bf16>(pre, f), Elementwise<Gelu>());
}
using FcProgram = decltype(fc_program({}, nullptr, nullptr, nullptr, 0));

// LM head (tied wte, no bias: b' = W beta) with the final LayerNorm: logits, the target logit and
// per-N-tile log-sum-exp partials over the first `vocab` columns (the padded ones take no part).
inline auto lm_head_program(const NormPartials& stats, const float* c, const float* b_prime, const int32_t* targets,
                            float* target_logit, LogSumExp::Out* lse_partials, int vocab) {
  return ln_linear_then(stats, c, b_prime, RowPick(targets, target_logit),
                        RowReduce<LogSumExp>(lse_partials, vocab));
}
using LmHeadProgram = decltype(lm_head_program({}, nullptr, nullptr, nullptr, nullptr, nullptr, 0));

// Attention out-projection and MLP projection: h = x W^T + bias + res, kept as aux output h [M, d];
// row partials of h and h^2 for the next LayerNorm (NormPartials); main output O = h (.) gamma_next.
inline auto residual_program(const bf16* res, const bf16* bias, bf16* h, int d, const bf16* gamma_next,
                             float* sum_partials, float* sumsq_partials) {
  return make_program(TileLoad<Add>(res, d), ColBroadcast<Add, bf16>(bias), StoreAux<bf16>(h, d),
                      RowReduce<Sum>(sum_partials), RowReduce<SumSquares>(sumsq_partials),
                      ColBroadcast<Mul, bf16>(gamma_next));
}
using ResidualProgram = decltype(residual_program(nullptr, nullptr, nullptr, 0, nullptr, nullptr, nullptr));

// MLP projection dgrad with the GELU backward and the fc's LayerNorm statistics: the accumulator
// D = dres Wproj is the gradient of gelu(pre); dz = D gelu'(pre) (the gradient of the fc output z = pre);
// its column partials col_b ([groups of 16 rows, f]: the fc bias gradient), its row dots <dz, pre>,
// <dz, c_fc>, <dz, b'_fc> (the fc dgrad's S1, S2); then dz' = r dz (stats: the LayerNorm before fc) as
// main output [M, f].
inline auto proj_dgrad_program(const bf16* pre, int f, const NormPartials& stats, const float* c,
                               const float* b_prime, const LnDots& dots, float* col_b) {
  return make_program(RowStage<LnRows>(LnRows{stats}), TileLoad<GeluGradMul>(pre, f), ColDot<Ones>(Ones{}, col_b, f),
                      RowDot<Tile>(Tile{pre, f}, dots.z), RowDot<ColVector>(ColVector{c}, dots.c),
                      RowDot<ColVector>(ColVector{b_prime}, dots.b), RowBroadcast<Mul, RowOf<LnRstd>>(LnRstd{}));
}
using ProjDgradProgram = decltype(proj_dgrad_program(nullptr, 0, {}, nullptr, nullptr, {}, nullptr));

// The column partials a LayerNorm backward writes ([groups of 16 rows, d] each): dgamma, dbeta, and the
// column sums of the new residual gradient (a projection's bias gradient).
struct LnBackwardColumns {
  float* dgamma = nullptr;    // colsum(D' (.) (h - mu))
  float* dbeta = nullptr;     // colsum(D' / r)
  float* residual = nullptr;  // colsum(d_residual + dh)
};

using Centered = Difference<Tile, RowOf<LnMean>>;  // h - mu, h tile input 0

// The LayerNorm output over its row scale, u / r = (h - mu) (.) gamma + beta / r, at the fragment's
// columns (h tile input 0; mu and 1 / r from a RowStage<LnBackwardRows>). Two column vectors, staged one
// after the other where the configuration stages them (Program::begin_rows gives the first's place).
struct LnOutputOverRstd {
  static constexpr int kTileInputs = 1;
  static constexpr int kColumnBytes = 2 * sizeof(bf16);
  Centered centered;
  RowOf<LnInvRstd> inv_rstd{LnInvRstd{}};
  ColVectorOf<bf16> gamma, beta;
  LnOutputOverRstd(const bf16* h, int d, const bf16* gamma_, const bf16* beta_)
      : centered(Tile{h, d}, LnMean{}), gamma(gamma_), beta(beta_) {}
  void collect_tiles(TileSource* sources) const { centered.collect_tiles(sources); }
  CODA_HD void begin_rows(const RowCtx& ctx) {
    centered.begin_rows(ctx);
    inv_rstd.begin_rows(ctx);
    gamma.begin_rows(ctx);
    RowCtx next = ctx;
    if (next.column_stage != nullptr) next.column_stage += sizeof(bf16) * next.tile_cols * next.expand / next.stride;
    beta.begin_rows(next);
  }
  CODA_HD void load(const Frag& f, const RowCtx& ctx, float* x) const {
    float g[Frag::kMaxWidth], b[Frag::kMaxWidth], s[Frag::kMaxWidth];
    centered.load(f, ctx, x);
    gamma.load(f, ctx, g);
    beta.load(f, ctx, b);
    inv_rstd.load(f, ctx, s);
    for_values(f, [&](int i) { x[i] = fmaf(x[i], g[i], b[i] * s[i]); });
  }
};

// Dgrad of a LayerNormed GEMM (QKV, fc, LM head) with the LayerNorm backward: accumulator D' = r du;
// d_residual [M, d] += D' (.) gamma - k h + e, stored in place (the GEMM's output is d_residual), and u / r
// [M, d] (bf16) for the GEMM's weight gradient dW = dz'^T (u / r). stats: the norm's partials; dots: the
// row dots of its input gradient dz; h: the norm's input (tile input 0), d_residual tile input 1.
inline auto ln_backward_program(const NormPartials& stats, const LnDots& dots, const bf16* h, int d, const bf16* gamma,
                                const bf16* beta, const bf16* d_residual, const LnBackwardColumns& cols,
                                bf16* norm_out_over_rstd) {
  return make_program(RowStage<LnBackwardRows>(LnBackwardRows{stats, dots}),
                      ColDot<RowOf<LnInvRstd>>(LnInvRstd{}, cols.dbeta, d),
                      ColDot<Centered>(Centered(Tile{h, d}, LnMean{}), cols.dgamma, d), ColBroadcast<Mul, bf16>(gamma),
                      SubScaled<Tile, RowOf<LnBackwardK>>(LnBackwardK{}, Tile{h, d}),
                      RowBroadcast<Add, RowOf<LnBackwardE>>(LnBackwardE{}), TileLoad<Add, 1>(d_residual, d),
                      ColDot<Ones>(Ones{}, cols.residual, d),
                      StoreAuxOf<bf16, LnOutputOverRstd>(LnOutputOverRstd(h, d, gamma, beta), norm_out_over_rstd, d));
}
using LnBackwardProgram =
    decltype(ln_backward_program({}, {}, nullptr, 0, nullptr, nullptr, nullptr, {}, nullptr));

}  // namespace coda::prog::gpt2
