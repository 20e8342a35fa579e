// The CODA programs of a Llama block (RMSNorm, RoPE, SwiGLU), each the epilogue of one GEMM. RMSNorm
// u = (h r) (.) gamma, r = 1 / sqrt(mean(h^2) + eps), is reparameterized: z = u W^T = diag(r) (O W^T) with
// O = h (.) gamma, so the GEMM that produces h writes O and the row partials of h^2 (NormPartials), and the
// next GEMM's epilogue finishes r as its rows begin (RmsRstd). Backward in the scaled form of passes.cuh
// (dz' = r dz): dh = D' (.) gamma - k h, k = r^2 <dz, z> / d, <dz, z> taken on the UNSCALED dz as row
// partials by whoever produces dz. The program type each function returns (named below it) is the one the
// GEMM kernel is compiled for (CMakeLists.txt, CODA_GEMM_PROGRAMS). Parameter vectors (gamma) are the bf16
// weight copy; aux outputs are bf16; main outputs are the GEMM's store (bf16, plain or accumulate).
// Details: docs/CODA.md, "Llama".

#pragma once
#include "kernels/coda/norm_stats.cuh"

namespace coda::prog::llama {

using bf16 = __nv_bfloat16;
using namespace coda::epi;

using RowScale = RowBroadcast<Mul, RowOf<RmsRstd>>;

// QKV projection: qkv = rope(diag(r) (O Wqkv^T)), r from the partials of norm1's input. RoPE rotates the
// pairs (2i, 2i + 1) of the q and k heads (adjacent pairs, model.hpp).
template <int kHeadDim>
inline auto qkv_program(const NormPartials& stats, const Rope<kHeadDim>& rope) {
  return make_program(RowScale(RmsRstd{stats}), Pairwise<Rope<kHeadDim>>(rope));
}
template <int kHeadDim>
using QkvProgram = decltype(qkv_program(NormPartials{}, Rope<kHeadDim>(0, 0, 0.0f)));

// QKV projection with a bias (Qwen2): qkv = rope(diag(r) (O Wqkv^T) + b), the bias added before the
// rotation, as in the model; b is the bf16 weight copy. Its gradient is the column sums of the unrotated
// dz, which the attention backward's write-out leaves as column partials (attention_writeout.cuh).
template <int kHeadDim>
inline auto qkv_bias_program(const NormPartials& stats, const bf16* bias, const Rope<kHeadDim>& rope) {
  return make_program(RowScale(RmsRstd{stats}), ColBroadcast<Add, bf16>(bias), Pairwise<Rope<kHeadDim>>(rope));
}
template <int kHeadDim>
using QkvBiasProgram = decltype(qkv_bias_program(NormPartials{}, nullptr, Rope<kHeadDim>(0, 0, 0.0f)));

// Out projection and down projection: h = x W^T + res (the residual add, res loaded as a tile), kept as
// aux output h; partial sums of h^2 for the next norm; main output O = h (.) gamma_next.
inline auto residual_program(const bf16* res, bf16* h, int d, const bf16* gamma_next, float* sumsq_partials) {
  return make_program(TileLoad<Add>(res, d), StoreAux<bf16>(h, d), RowReduce<SumSquares>(sumsq_partials),
                      ColBroadcast<Mul, bf16>(gamma_next));
}
using ResidualProgram = decltype(residual_program(nullptr, nullptr, 0, nullptr, nullptr));

// Gate/up projection (rows of Wgu interleaved gate, up): (g, u) = diag(r) (O Wgu^T), kept as aux output
// gu [M, 2F] for the backward; main output silu(g) u [M, F] (saved: the down projection's input and
// weight-gradient operand).
inline auto gate_up_program(const NormPartials& stats, bf16* gu, int two_f) {
  return make_program(RowScale(RmsRstd{stats}), StoreAux<bf16>(gu, two_f), Pairwise<SwiGlu>());
}
using GateUpProgram = decltype(gate_up_program({}, nullptr, 0));

// LM head with the final norm: logits = diag(r) (O Wv^T) over the padded vocabulary; the target logit
// and per-N-tile online log-sum-exp partials over the columns < vocab, so loss = merge_lse(partials) -
// target logit needs no second pass over the logits (passes::loss_from_partials).
inline auto lm_head_program(const NormPartials& stats, const int32_t* targets, float* target_logit,
                            LogSumExp::Out* lse_partials, int vocab) {
  return make_program(RowScale(RmsRstd{stats}), RowPick(targets, target_logit),
                      RowReduce<LogSumExp>(lse_partials, vocab));
}
using LmHeadProgram = decltype(lm_head_program({}, nullptr, nullptr, nullptr, 0));

// Dgrad of a normed GEMM (QKV, gate/up, LM head) with the RMSNorm backward, accumulator D' = dz' W = r du:
//   column partials of D' (.) h: dgamma;   dh = D' (.) gamma - k h,   k = r^2 <dz, z> / d
// (<dz, z> partials [M, dot_count]). The main output is added into the residual gradient (or written
// fresh by the LM head's dgrad).
inline auto norm_backward_program(const NormPartials& stats, const float* dot_partials, int dot_count, const bf16* h,
                                  int d, const bf16* gamma, float* dgamma_partials) {
  return make_program(ColDot<Tile>(Tile{h, d}, dgamma_partials, d), ColBroadcast<Mul, bf16>(gamma),
                      SubScaled<Tile, RowOf<RmsBackwardCoef>>(RmsBackwardCoef{stats, dot_partials, dot_count},
                                                              Tile{h, d}));
}
using NormBackwardProgram = decltype(norm_backward_program({}, nullptr, 0, nullptr, 0, nullptr, nullptr));

// Down-projection dgrad with the SwiGLU backward: accumulator da = dres Wdown, the gradient of
// a = silu(g) u [M, F]. From the saved (g, u) it makes the interleaved dz = (dg, du) [M, 2F], takes the
// <dz, z> partials of the gate/up dgrad's norm backward (z = (g, u), dz unscaled), and hands on
// dz' = r dz (r of norm2, the scaled-gradient convention). act is not stored again: the forward saved it.
inline auto swiglu_backward_program(const bf16* gu, int two_f, const NormPartials& stats, float* dot_partials) {
  return make_program(SwiGluBackward<bf16>(gu, two_f, nullptr, two_f / 2),
                      RowDot<Tile>(Tile{gu, two_f}, dot_partials), RowScale(RmsRstd{stats}));
}
using SwigluBackwardProgram = decltype(swiglu_backward_program(nullptr, 0, {}, nullptr));

}  // namespace coda::prog::llama
