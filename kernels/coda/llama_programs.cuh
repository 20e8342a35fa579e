// The CODA programs of a Llama block (RMSNorm, RoPE, SwiGLU), each the epilogue of one GEMM.
// Notation (docs/CODA.md): residual stream h [M, d]; RMSNorm u = (h r) (.) gamma with
// r = 1 / sqrt(mean(h^2) + eps) per row; next GEMM z = u W^T. Reparameterized forward:
//   z = diag(r) ((h (.) gamma) W^T) = diag(r) (O W^T),   O = h (.) gamma,
// so the GEMM that produces h writes O as its main output (the next GEMM's input) and the partial sums
// of h^2 from which the next GEMM's epilogue gets r (prog::rms_rstd). Backward: D = dz W = du and
//   dh = r (D (.) gamma) - (r^2 <dz, z> / d) h,   dgamma = sum over rows of r D (.) h,
// where <dz, z> = <du, u> is taken as partials by whoever produces dz (prog::rms_backward_coef).
// The program type each function returns is the one the GEMM kernel is instantiated with (gemm_run).
// Aux outputs are bf16 (what the trainer keeps); main outputs are the GEMM's store (bf16, or accumulate).
#pragma once
#include "kernels/coda/norm_stats.cuh"

namespace coda::prog::llama {

using bf16 = __nv_bfloat16;
using namespace coda::epi;

// QKV projection: qkv = rope(diag(r) (O Wqkv^T)). RoPE rotates the pairs (2i, 2i + 1) of the q and k
// heads (Wqkv's rows are permuted on import so rotation pairs are adjacent, model.hpp).
inline auto qkv_program(const float* rstd, const Rope& rope) {
  return make_program(RowBroadcast<Mul>(rstd), Pairwise<Rope>(rope));
}

// Out projection and down projection: h = x W^T + res (the residual add, res loaded as a tile), kept as
// aux output h; partial sums of h^2 for the next norm; main output O = h (.) gamma_next.
inline auto residual_program(const bf16* res, bf16* h, int d, const float* gamma_next, float* sumsq_partials) {
  return make_program(TileLoad<Add>(res, d), StoreAux<bf16>(h, d), RowReduce<SumSquares>(sumsq_partials),
                      ColBroadcast<Mul>(gamma_next));
}

// Gate/up projection (rows of Wgu interleaved gate, up): (g, u) = diag(r) (O Wgu^T), kept as aux output
// gu [M, 2F] for the backward; main output silu(g) u [M, F].
inline auto gate_up_program(const float* rstd, bf16* gu, int two_f) {
  return make_program(RowBroadcast<Mul>(rstd), StoreAux<bf16>(gu, two_f), Pairwise<SwiGlu>());
}

// LM head with the final norm: logits = diag(r) (O Wv^T); the target logit and per-N-tile online
// log-sum-exp partials, so loss = merge_lse(partials) - target logit needs no second pass.
inline auto lm_head_program(const float* rstd, const int32_t* targets, float* target_logit,
                            LogSumExp::Out* lse_partials) {
  return make_program(RowBroadcast<Mul>(rstd), RowPick(targets, target_logit), RowReduce<LogSumExp>(lse_partials));
}

// Dgrad of a normed GEMM (QKV or gate/up) with the RMSNorm backward: accumulator D = dz W = du;
//   v = r D            -> column partials of v (.) h: dgamma
//   v = r D (.) gamma - k h,  k = r^2 <dz, z> / d (prog::rms_backward_coef)
// main output accumulated into the residual gradient (dres += dh).
inline auto norm_backward_program(const float* rstd, const bf16* h, int d, const float* gamma, const float* k,
                                  float* dgamma_partials) {
  return make_program(RowBroadcast<Mul>(rstd), ColDot<Tile>(Tile{h, d}, dgamma_partials, d),
                      ColBroadcast<Mul>(gamma), SubScaled<Tile>(k, Tile{h, d}));
}

// Down-projection dgrad with the SwiGLU backward: accumulator da = dres Wdown, the gradient of
// a = silu(g) u [M, F];
// loads the saved (g, u), writes interleaved dz = (dg, du) [M, 2F] (the gate/up dgrad's input), the
// recomputed silu(g) u (the down projection's weight-gradient input) and the <dz, z> partials of the
// norm backward in the gate/up dgrad (z = (g, u)).
inline auto swiglu_backward_program(const bf16* gu, int two_f, bf16* act, float* dot_partials) {
  return make_program(SwiGluBackward<bf16>(gu, two_f, act, two_f / 2), RowDot<Tile>(Tile{gu, two_f}, dot_partials));
}

}  // namespace coda::prog::llama
