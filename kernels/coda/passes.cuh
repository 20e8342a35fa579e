// The CODA mode's kernels outside the GEMMs (docs/CODA.md, "What stays outside the GEMMs"): each is one
// pass the GEMM epilogues cannot absorb, and each also does the small per-row or per-column work of the
// norms around it: embedding_forward (layer 0's h and its norm statistics), loss_from_partials (the loss
// from the LM head's log-sum-exp partials), dlogits (softmax - onehot with the final norm's row dots),
// ln_weight_vectors (LayerNorm's c = W gamma, b' = W beta + bias, once per step), add_column_partials.
// Scaled-gradient convention: the gradient dz of a GEMM that follows a norm travels as dz' = r dz, so the
// weight gradient is a plain GEMM (RMSNorm: dz'^T O; LayerNorm: dz'^T (u / r), stored by the dgrad) and the
// dgrad accumulator is D' = dz' W = r du; row dots for the norm backward (<dz, z>, <dz, c>, <dz, b'>) are
// taken on the UNSCALED dz. Partials follow kernels/epilogue/fragment.cuh: row partials [N, count], column partials
// [groups, ld] (fp32). Every function enqueues on `stream` and checks its launch.

#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "kernels/coda/norm_stats.cuh"

namespace coda::passes {

using bf16 = __nv_bfloat16;

// h[row] = wte[tokens[row]] (+ wpe[row % T] when wpe != nullptr); O = h (.) gamma (the first QKV GEMM's
// input); row partials with count 1: sum[row] = sum_j h (when sum != nullptr, LayerNorm) and
// sumsq[row] = sum_j h^2, computed from the bf16-rounded h (what the backward's norm reads). [B*T, C].
void embedding_forward(bf16* h, bf16* O, float* sum, float* sumsq, const int32_t* tokens, const bf16* wte,
                       const bf16* wpe, const bf16* gamma, int B, int T, int C, cudaStream_t stream);

// lse[row] = merge_lse of the row's `count` log-sum-exp partials (the LM head epilogue's), and
// losses[row] = lse[row] - target_logit[row].
void loss_from_partials(float* losses, float* lse, const epi::LogSumExp::Out* lse_partials, int count,
                        const float* target_logit, int N, cudaStream_t stream);

// The head's backward pass over the logits [N, Vp] (in place: dlogits may equal logits):
//   dz = dloss * (softmax(logits) - onehot(target)) on columns < vocab, 0 on the padded columns;
//   dot_z[row] = <dz, logits>, and for LayerNorm (c != nullptr) dot_c[row] = <dz, c>,
//   dot_b[row] = <dz, b'> (c, b' [Vp]: the head's weight-derived vectors) — row partials, count 1;
//   dlogits = r dz with r = stats.rstd(row) (the scaled-gradient convention above). No column partials:
//   the head's weight gradient needs none (gpt2_programs.cuh, ln_backward_program).
struct DlogitsArgs {
  bf16* dlogits = nullptr;
  const bf16* logits = nullptr;
  const float* lse = nullptr;          // [N], from loss_from_partials
  const int32_t* targets = nullptr;    // [N]
  float dloss = 0.0f;                  // gradient of the loss sum per row (grad_scale / N)
  int N = 0, vocab = 0, Vp = 0;
  prog::NormPartials stats;            // the final norm's
  float* dot_z = nullptr;
  const float* c = nullptr;            // LayerNorm only, from here on
  const float* b_prime = nullptr;
  float* dot_c = nullptr;
  float* dot_b = nullptr;
};
void dlogits(const DlogitsArgs& args, cudaStream_t stream);

// c[n] = sum_k gamma[k] W[n, k],  b'[n] = sum_k beta[k] W[n, k] + bias[n] (bias may be nullptr), n < rows,
// W [rows, d] bf16: the LayerNorm weight-derived vectors of the linear layer LN(h) W^T + bias.
void ln_weight_vectors(float* c, float* b_prime, const bf16* W, int rows, int d, const bf16* gamma,
                       const bf16* beta, const bf16* bias, cudaStream_t stream);

// grad[j] += scale * sum over g < groups of partials[g * ld + j], j < n (deterministic order), for each of
// up to three pairs in one launch (pairs with grad == nullptr are skipped).
struct ColumnPartials {
  float* grad;
  const float* partials;
};
void add_column_partials(std::initializer_list<ColumnPartials> sums, int groups, int ld, int n, float scale,
                         cudaStream_t stream);

}  // namespace coda::passes
