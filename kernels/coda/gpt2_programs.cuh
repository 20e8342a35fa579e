// The CODA programs of a GPT-2 block (LayerNorm, biases, GELU), each the epilogue of one GEMM.
// Notation (docs/CODA.md): residual stream h [M, d]; LayerNorm u = (h - mu) r (.) gamma + beta per row
// (mean mu, r = 1 / sqrt(var + eps)); next GEMM z = u W^T + bias, W [n, d]. Reparameterized forward:
//   z = r (O W^T) - (r mu) c + b',   O = h (.) gamma,  c = W gamma,  b' = W beta + bias,
// with the weight-derived vectors c, b' computed once per step (prog::ln_weight_vectors) and mu, r from
// the partial sums of h and h^2 written by the GEMM that produced h (prog::ln_stats). Backward, with
// D = dz W = du and x_hat = (h - mu) r:
//   dh = r (D (.) gamma) - k h + e,  k = r^2 S2 / d,  e = k mu - r S1 / d,
//   S1 = <dz, c>,  S2 = <dz, z> - <dz, b'>   (row dots of dz, taken by the producer of dz),
//   dgamma = sum over rows of r D (.) h - (r mu) D,   dbeta = sum over rows of D.
// The program type each function returns is the one the GEMM kernel is instantiated with (gemm_run).
#pragma once
#include "kernels/coda/norm_stats.cuh"

namespace coda::prog::gpt2 {

using bf16 = __nv_bfloat16;
using namespace coda::epi;

// A linear layer after a LayerNorm (QKV, and the LM head with b' = W beta):
// z = r (O W^T) - (r mu) c + b'.
inline auto ln_linear_program(const float* rstd, const float* rstd_mean, const float* c, const float* b_prime) {
  return make_program(RowBroadcast<Mul>(rstd), SubScaled<ColVector>(rstd_mean, ColVector{c}),
                      ColBroadcast<Add>(b_prime));
}

// fc: pre = r (O Wfc^T) - (r mu) c + b' kept as aux output [M, F]; main output gelu(pre).
inline auto fc_program(const float* rstd, const float* rstd_mean, const float* c, const float* b_prime, bf16* pre,
                       int f) {
  return make_program(RowBroadcast<Mul>(rstd), SubScaled<ColVector>(rstd_mean, ColVector{c}),
                      ColBroadcast<Add>(b_prime), StoreAux<bf16>(pre, f), Elementwise<Gelu>());
}

// Attention out projection and MLP proj: h = x W^T + bias + res, kept as aux output h; partial sums of
// h and h^2 for the next LayerNorm; main output O = h (.) gamma_next.
inline auto residual_program(const bf16* res, const float* bias, bf16* h, int d, const float* gamma_next,
                             float* sum_partials, float* sumsq_partials) {
  return make_program(TileLoad<Add>(res, d), ColBroadcast<Add>(bias), StoreAux<bf16>(h, d),
                      RowReduce<Sum>(sum_partials), RowReduce<SumSquares>(sumsq_partials),
                      ColBroadcast<Mul>(gamma_next));
}

// LM head (tied wte, no bias) with the final LayerNorm, the target logit and log-sum-exp partials.
inline auto lm_head_program(const float* rstd, const float* rstd_mean, const float* c, const float* b_prime,
                            const int32_t* targets, float* target_logit, LogSumExp::Out* lse_partials) {
  return make_program(RowBroadcast<Mul>(rstd), SubScaled<ColVector>(rstd_mean, ColVector{c}),
                      ColBroadcast<Add>(b_prime), RowPick(targets, target_logit),
                      RowReduce<LogSumExp>(lse_partials));
}

// proj dgrad with the GELU backward: accumulator D = dres Wproj = d gelu(pre); dz = D gelu'(pre) is the
// main output (the fc dgrad's input); column partials of dz: the fc bias gradient; row partials of
// <dz, pre>, <dz, c_fc>, <dz, b'_fc>: the LayerNorm-backward statistics S2 = <dz, z> - <dz, b'> (z = pre)
// and S1 = <dz, c> of the fc dgrad.
inline auto proj_dgrad_program(const bf16* pre, int f, float* dbias_partials, const float* c, const float* b_prime,
                               float* dot_z, float* dot_c, float* dot_b) {
  return make_program(TileLoad<GeluGradMul>(pre, f), ColDot<Ones>(Ones{}, dbias_partials, f),
                      RowDot<Tile>(Tile{pre, f}, dot_z), RowDot<ColVector>(ColVector{c}, dot_c),
                      RowDot<ColVector>(ColVector{b_prime}, dot_b));
}

// Dgrad of a LayerNormed GEMM (QKV or fc) with the LayerNorm backward: accumulator D = dz W = du;
//   column partials of D: dbeta;  of (r mu) D: dgamma's mean term q;
//   v = r D            -> column partials of v (.) h: dgamma's main term p (dgamma = p - q);
//   v = r D (.) gamma - k h + e     (prog::ln_backward_coefs)
// main output accumulated into the residual gradient (dres += dh).
inline auto ln_backward_program(const float* rstd, const float* rstd_mean, const bf16* h, int d, const float* gamma,
                                const float* k, const float* e, float* dbeta_partials, float* q_partials,
                                float* p_partials) {
  return make_program(ColDot<Ones>(Ones{}, dbeta_partials, d), ColDot<RowVector>(RowVector(rstd_mean), q_partials, d),
                      RowBroadcast<Mul>(rstd), ColDot<Tile>(Tile{h, d}, p_partials, d), ColBroadcast<Mul>(gamma),
                      SubScaled<Tile>(k, Tile{h, d}), RowBroadcast<Add>(e));
}

}  // namespace coda::prog::gpt2
