// The unfused mode's kernels: one launch per operation of a Transformer training step, the way a framework
// runs eagerly, written to run at memory bandwidth. This is the baseline the CODA mode is measured against,
// so each kernel is as fast as a standalone kernel can be: 16-byte vector access, coalesced rows, one pass
// over each tensor where the math allows, fp32 arithmetic and statistics, deterministic reductions (never
// float atomics), launched with PDL (kernels/common/launch.cuh). Conventions: row-major bf16 activations with
// N = B*T token rows; fp32 parameter gradients in the flat layout of model.hpp; every row length (C, OC, F,
// qkv_dim, Vp) and pointer a multiple of 8 elements / 16 bytes. Functions named *_backward ADD into their
// parameter gradients (dw, db, dwte, dwpe), as ref_ops.hpp does, so gradient accumulation needs no extra pass.
// The math of each operation is the CPU reference's; see the .cu file beside each group.

#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/common/fp8_format.cuh"

namespace coda::unfused {

using bf16 = __nv_bfloat16;

// ---- column sums (bias gradients; column_sum.cu) -------------------------------------------------------
// out[j] += sum over n < rows of x[n * ld + j], for j < cols. One launch: blocks write fp32 partials of
// their row slab to the workspace; the last block of each column tile to finish (an integer ticket, not a
// float atomic) sums the partials in slab order, so the result is deterministic.
struct ColumnSumWorkspace {
  float* partials = nullptr;          // column_sum_partials_floats(max_cols)
  unsigned int* tickets = nullptr;    // column_sum_tickets(max_cols) (at least 2: the norm backwards' counters),
                                      // zeroed once; each launch leaves it zero
  int max_cols = 0;                   // the widest matrix it serves
};
size_t column_sum_partials_floats(int max_cols);
size_t column_sum_tickets(int max_cols);
void column_sum(float* out, const bf16* x, int rows, int cols, int ld, const ColumnSumWorkspace& ws,
                cudaStream_t stream);

// ---- FP8 quantization (fp8.cu) ---------------------------------------------------------------------------
// q = fp8(x * scale) with the format's satfinite conversion (round to nearest even, saturating; the host
// specification is src/fp8.hpp), scale read from the device, and *amax = max(*amax, max |x|) (NaN once x
// holds a NaN): the amax of delayed scaling, found in the same pass and gathered over every quantize call
// of the step (the micro-batches of gradient accumulation) until fp8_update_scales takes it and zeroes it.
// An integer atomic max on the bits of non-negative floats, so the result does not depend on the blocks'
// order. n a multiple of 8.
void quantize_fp8(uint8_t* q, float* amax, const bf16* x, size_t n, const float* scale, Fp8Format format,
                  cudaStream_t stream);
// The same for x [rows, cols] (row-major), stored transposed: qt [cols, rows], the K-major copy an FP8
// GEMM needs of an operand that the other GEMMs read N-major; with q not null, the row-major copy too, from
// the same read of x (an activation the forward and the weight gradient both take). rows and cols
// multiples of 8.
void quantize_fp8_transposed(uint8_t* qt, uint8_t* q, float* amax, const bf16* x, int rows, int cols,
                             const float* scale, Fp8Format format, cudaStream_t stream);

// Block scaling (src/fp8.hpp: fp8_block_copy is the specification, fp8_block_scale_exponent the shared scale
// rule): x [rows, cols] (multiples of 128) into the e4m3 copies a block-scaled GEMM reads, both from one read
// of x: q [rows, cols] with one dequantization factor (1 / scale, a power of two) per 1 x 128 block of its
// rows; qt [cols, rows] with one per 1 x 128 block of its rows, i.e. per 128 x 1 block of x. With `tile`
// (weights) one factor per 128 x 128 tile instead. The factors are laid out as cuBLASLt reads them
// (Fp8Scales, cublaslt.cuh): row blocks as [K / 128, rows] with the row fastest (q_dequant [cols / 128,
// rows], qt_dequant [rows / 128, cols]); tiles as [rows / 128, fp8_tile_factor_row(K / 128)] (q_dequant
// [rows / 128, fp8_tile_factor_row(cols / 128)], qt_dequant [cols / 128, fp8_tile_factor_row(rows / 128)]),
// the padding never written. Either copy may be null.
// A tile holding a value that is not finite is not written, and *bad becomes max(*bad, bad_value) (a
// positive bad_value names the tensor; an atomic max, so the result does not depend on the blocks' order).
constexpr int fp8_tile_factor_row(int k_blocks) { return (k_blocks + 3) / 4 * 4; }
struct Fp8BlockCopies {
  uint8_t* q = nullptr;
  float* q_dequant = nullptr;
  uint8_t* qt = nullptr;
  float* qt_dequant = nullptr;
  unsigned int* bad = nullptr;
  unsigned int bad_value = 1;
};
void quantize_fp8_blocks(const Fp8BlockCopies& out, const bf16* x, int rows, int cols, bool tile, cudaStream_t stream);

// Delayed scaling of `count` tensors in one launch (Fp8DelayedScale of src/fp8.hpp is the host
// specification), the first e4m3_count of them e4m3 and the rest e5m2 (the order of Fp8Tensors): each
// tensor's amax of this step (amax[t], gathered by its quantize calls; zeroed here for the next step) goes
// into its history ring (history[t * history_len + step % history_len]), and scale[t] = its format's largest
// / (max of the history * 2^margin), dequant[t * kFp8DequantSlot] = 1 / scale[t], for the next step (each
// factor in its own 16-byte slot: cuBLASLt refuses an FP8 GEMM whose scale pointer is not 16-byte aligned,
// with CUBLAS_STATUS_NOT_SUPPORTED from cublasLtMatmul after its heuristic accepted the plan); a history of
// zeros keeps the scale. A non-finite amax keeps the tensor's scale and history and sets *bad to t + 1 (the
// first such tensor), which the host reads with the step's loss: no inf or NaN reaches a scale, and the
// report names the tensor.
constexpr int kFp8DequantSlot = 4;
void fp8_update_scales(float* scale, float* dequant, float* history, float* amax, int count, int e4m3_count,
                       int history_len, int step, int margin, unsigned int* bad, cudaStream_t stream);

// ---- embedding (embedding.cu) --------------------------------------------------------------------------
// x[b*T + t, :] = wte[tokens[b*T + t], :] (+ wpe[t, :] when wpe is not null)
void embedding_forward(bf16* x, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                       cudaStream_t stream);

// The rows of a batch grouped by token id, computed on the host (a counting sort) while the GPU runs the
// forward pass; it lets the backward scatter-add run with one block per distinct token and no atomics.
// packed = [rows (N) | bucket_start (num_buckets + 1) | bucket_token (num_buckets)].
struct TokenBuckets {
  std::vector<int32_t> packed;
  int num_rows = 0, num_buckets = 0;
};
TokenBuckets group_rows_by_token(const int32_t* tokens, int N, int vocab_size);

// dwte[tok, :] += sum of dx over the rows holding tok; dwpe[t, :] += sum over b of dx[b*T + t, :] (when
// dwpe is not null). `buckets` is the device copy of TokenBuckets::packed. Deterministic: each
// destination row is owned by one block, which sums its rows in a fixed order.
void embedding_backward(float* dwte, float* dwpe, const bf16* dx, const int32_t* buckets, int num_buckets, int B,
                        int T, int C, cudaStream_t stream);

// ---- LayerNorm and RMSNorm (norm.cu) ---------------------------------------------------------------
// Row lengths up to 4096. mean / rstd are [N] fp32 (saved for the backward).
void layernorm_forward(bf16* y, float* mean, float* rstd, const bf16* x, const bf16* w, const bf16* b, int N, int C,
                       float eps, cudaStream_t stream);
void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* w, int N, int C, float eps, cudaStream_t stream);

// dx = (accumulate ? dx : 0) + d(norm)/dx applied to dy (the residual-gradient accumulation of the
// backward pass); dw += sum over rows of dy * xhat, db += sum of dy. The per-block dw/db partials go to
// `partials` (norm_backward_partials_floats(C) floats) and are finished in the same launch, in a fixed
// order; ws.tickets[0..1] serve as its counters (left zero, like column_sum leaves them).
size_t norm_backward_partials_floats(int C);
void layernorm_backward(bf16* dx, float* dw, float* db, const bf16* dy, const bf16* x, const bf16* w,
                        const float* mean, const float* rstd, int N, int C, bool accumulate, float* partials,
                        const ColumnSumWorkspace& ws, cudaStream_t stream);
void rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w, const float* rstd, int N,
                      int C, bool accumulate, float* partials, const ColumnSumWorkspace& ws, cudaStream_t stream);

// ---- elementwise (elementwise.cu) ----------------------------------------------------------------------
// y[n, j] += b[j], in place on y [N, OC].
void bias_add(bf16* y, const bf16* b, int N, int OC, cudaStream_t stream);
// out = a + b, n elements (out may alias a or b).
void residual_add(bf16* out, const bf16* a, const bf16* b, size_t n, cudaStream_t stream);
// GELU, tanh approximation. The backward writes dx = dy * gelu'(x) (dx may alias dy).
void gelu_forward(bf16* y, const bf16* x, size_t n, cudaStream_t stream);
void gelu_backward(bf16* dx, const bf16* dy, const bf16* x, size_t n, cudaStream_t stream);
// y [N, F] = silu(g) * u over interleaved gu [N, 2F]; the backward WRITES dgu [N, 2F].
void swiglu_forward(bf16* y, const bf16* gu, int N, int F, cudaStream_t stream);
void swiglu_backward(bf16* dgu, const bf16* dy, const bf16* gu, int N, int F, cudaStream_t stream);

// ---- RoPE (rope.cu) ------------------------------------------------------------------------------------
// cos/sin of angle t * theta^(-2i/hd) for t < max_T, i < hd/2, as float2 (cos, sin), computed on the host in
// double precision; upload once.
std::vector<float2> rope_table(int max_T, int hd, float theta);
// In place on the q and k heads of packed qkv rows [B*T, (n_head + 2 n_kv_head) * hd]: the forward rotates
// each adjacent pair by +angle, the backward (inverse = true) by -angle.
void rope(bf16* qkv, const float2* table, int B, int T, int n_head, int n_kv_head, int hd, bool inverse,
          cudaStream_t stream);

// ---- cross-entropy (crossentropy.cu) -------------------------------------------------------------------
// Over the first V of Vp columns: losses[n] = lse[n] - logits[n, targets[n]], lse[n] = logsumexp(logits[n, :V]),
// both fp32, in one pass over the logits (online max / sum-exp).
void crossentropy_forward(float* losses, float* lse, const bf16* logits, const int32_t* targets, int N, int V, int Vp,
                          cudaStream_t stream);
// dlogits[n, j] = (exp(logits[n, j] - lse[n]) - [j == target]) * dloss for j < V, 0 for padded columns.
// May run in place (dlogits == logits).
void crossentropy_backward(bf16* dlogits, const bf16* logits, const float* lse, const int32_t* targets, float dloss,
                           int N, int V, int Vp, cudaStream_t stream);

// ---- optimizer (optimizer.cu) --------------------------------------------------------------------------
// Sum of squares of g[0..n) into *result (one float on the device). `partials` holds
// grad_sumsq_partials_floats() floats, `ticket` one zeroed unsigned int (left zero).
size_t grad_sumsq_partials_floats();
void grad_sumsq(float* result, const float* g, size_t n, float* partials, unsigned int* ticket, cudaStream_t stream);

// One AdamW step over the flat parameter buffer (n a multiple of 64): g = grad_scale * grads;
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd p), with wd
// applied where decay[i / 64] is nonzero; writes the fp32 master p and its bf16 copy.
struct AdamWStep {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  int step;  // 1-based
};
void adamw(float* params, bf16* params_bf16, float* m, float* v, const float* grads, const uint8_t* decay, size_t n,
           const AdamWStep& step, cudaStream_t stream);

// dst[i] = bf16(src[i]), n a multiple of 8.
void convert_to_bf16(bf16* dst, const float* src, size_t n, cudaStream_t stream);

}  // namespace coda::unfused
