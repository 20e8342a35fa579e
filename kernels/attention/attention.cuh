// Causal multi-head attention with grouped-query heads, bf16 in and out, fp32 softmax statistics.
// The contract shared by the unfused and the CODA modes (the implementation lives beside this file).
// Layouts (see src/model.hpp, "packed qkv"):
//   qkv  [B*T, (n_head + 2*n_kv_head) * head_dim]: per token [q heads | k heads | v heads];
//        query head h reads kv head h / (n_head / n_kv_head).
//   out  [B*T, n_head * head_dim]: token-major, the input layout of the output projection.
//   lse  [B, n_head, T] fp32: natural-log sum-exp of the scaled scores (scale 1/sqrt(head_dim)).
//   dqkv [B*T, qkv_dim]: gradient in the packed layout, fully WRITTEN by the backward (dk, dv summed over
//        the query heads of each group).
// The fp32 CPU reference of the same math is coda::ref::attention_forward / attention_backward.

#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace coda {

struct AttentionShape {
  int B = 0, T = 0, n_head = 0, n_kv_head = 0, head_dim = 0;
  int qkv_dim() const { return (n_head + 2 * n_kv_head) * head_dim; }
};

void attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, const AttentionShape& shape,
                       cudaStream_t stream);

// How the backward sums dQ over the key blocks, which separate thread blocks compute:
//   Atomic   each key block's part is added into one fp32 accumulator by the copy engine (TMA reduce-add);
//            the order of the adds, and so the last bits of dQ, vary from run to run once T > 128.
//   Ordered  each key block's part is stored apart and a pass sums them in key-block order: bitwise
//            reproducible, for the cost of writing and reading the parts (a query row of key block
//            kb's T / 128 has kb + 1 of them: (T / 128 + 1) / 2 accumulators' worth on average).
enum class DqSum { Atomic, Ordered };

// Scratch the backward needs (fp32 dQ accumulators, row dot products D = rowsum(dO * O), the write-out's
// per-(token, kv head) row dots of the k and v columns, the key blocks' dQ parts when Ordered).
size_t attention_backward_workspace_bytes(const AttentionShape& shape, DqSum dq_sum = DqSum::Atomic);

// The CODA mode's write-out of dqkv (kernels/coda/attention_writeout.cuh).
struct AttentionWriteout;

// writeout == nullptr: dqkv is the plain gradient (the unfused mode); else the write-out's d_qkv'. The
// workspace is attention_backward_workspace_bytes(shape, dq_sum).
void attention_backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                        const __nv_bfloat16* out, const float* lse, void* workspace, const AttentionShape& shape,
                        cudaStream_t stream, const AttentionWriteout* writeout = nullptr,
                        DqSum dq_sum = DqSum::Atomic);

}  // namespace coda
