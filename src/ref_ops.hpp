// The fp32 CPU reference of every operation: the executable spec that every GPU kernel (unfused and
// CODA) is tested against. Plain loops, written to be read. Conventions for every function here:
//  * row-major; N = B*T rows (tokens), C = d_model; a linear layer is y = x W^T (+ b), W is [OC, IC];
//  * backward functions ADD into their gradient outputs (dx, dw, db, ...): callers zero them first.
//    This one rule gives gradient accumulation, residual-gradient sums and tied weights for free;
//  * nullable bias / gradient pointers mean "absent"; qkv is the packed layout of model.hpp;
//  * cross-entropy runs over the first V (real) columns of the Vp (padded) logits.
// Attention's layout and lse: above attention_forward below.

#pragma once
#include <cstddef>
#include <cstdint>

namespace coda::ref {

// x[b,t,:] = wte[tokens[b,t], :] (+ wpe[t, :] when wpe is given)
void embedding_forward(float* x, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C);
void embedding_backward(float* dwte, float* dwpe, const float* dx, const int32_t* tokens, int B, int T, int C);

// y[N, OC] = x[N, IC] W[OC, IC]^T + b[OC]
void matmul_forward(float* y, const float* x, const float* w, const float* b, int N, int IC, int OC);
// dx += dy W; dw += dy^T x; db += column sums of dy. Any of dx, dw, db may be null.
void matmul_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w, int N, int IC,
                     int OC);

// y = (x - mean) * rstd * w + b, per row; mean and rstd [N] are saved for backward.
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, int N, int C,
                       float eps);
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int N, int C);

// y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps), per row.
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int N, int C, float eps);
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd, int N,
                      int C);

// GELU, tanh approximation (GPT-2's).
void gelu_forward(float* y, const float* x, size_t n);
void gelu_backward(float* dx, const float* dy, const float* x, size_t n);

// y[n, j] = silu(g) * u with (g, u) = (gu[n, 2j], gu[n, 2j+1]); gu is [N, 2F], y is [N, F].
void swiglu_forward(float* y, const float* gu, int N, int F);
void swiglu_backward(float* dgu, const float* dy, const float* gu, int N, int F);

// In place on the q and k heads of packed qkv rows [B*T, qkv_dim]: each adjacent pair (2i, 2i+1) of a
// head is rotated by angle t * theta^(-2i/hd), t the position within the sequence. v is untouched.
void rope_forward(float* qkv, int B, int T, int n_head, int n_kv_head, int hd, float theta);
// In place: the inverse rotation, which is the backward of the forward (rotations are orthogonal).
void rope_backward(float* dqkv, int B, int T, int n_head, int n_kv_head, int hd, float theta);

// Packed qkv: each token row holds [q heads | k heads | v heads], head h of q at column h*hd, k-head g at
// (n_head + g)*hd, v-head g at (n_head + n_kv_head + g)*hd; query head h uses kv head h / (n_head / n_kv_head).
// Attention is causal with scale 1/sqrt(hd); lse[b, h, t] is the natural-log sum-exp of the scaled scores
// of query t (saved for backward, as FlashAttention does).
// out [B*T, n_head*hd]; lse [B, n_head, T].
void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int n_head, int n_kv_head, int hd);
// dqkv += gradient through causal attention (dq, dk, dv in the packed layout).
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int n_head, int n_kv_head, int hd);

// losses[n] = logsumexp(logits[n, :V]) - logits[n, targets[n]]; logits is [N, Vp].
void crossentropy_forward(float* losses, const float* logits, const int32_t* targets, int N, int V, int Vp);
// dlogits[n, :] = (softmax(logits[n, :V]) - onehot(targets[n])) * dloss; padded columns get 0.
// This one WRITES dlogits (it is the start of the backward pass).
void crossentropy_backward(float* dlogits, const float* logits, const int32_t* targets, float dloss, int N, int V,
                           int Vp);

}  // namespace coda::ref
