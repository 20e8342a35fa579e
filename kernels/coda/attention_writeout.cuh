// The contract of the CODA mode's write-out of the attention backward (AttentionWriteout) and its
// column-partial groups. The backward runs the write-out as a hook, whose device code is in
// attention_writeout_kernels.cuh; the layouts are attention.cuh's. Design: docs/ATTENTION.md,
// "The CODA write-out".

#pragma once
#include "kernels/attention/attention.cuh"
#include "kernels/coda/norm_stats.cuh"

namespace coda {

// The CODA mode's write-out of dqkv (kernels/coda/passes.cuh explains the scaled-gradient convention):
// what the backward does to each finished packed row dz of dqkv before it is stored.
//   1. Llama (rope_theta > 0): the inverse RoPE rotation of the q and k heads (adjacent pairs, position
//      row % T, the forward's angles), giving the gradient of the QKV GEMM's output.
//   2. Row dots of the QKV GEMM's norm backward on that unscaled dz, row partials with count 1:
//      dot_z = <dz, z>, z = qkv as the forward stored it (RoPE is orthogonal, so the rotated pair
//      gives the same dot); LayerNorm (c != nullptr): dot_c = <dz, c>, dot_b = <dz, b'> ([qkv_dim]).
//      RMSNorm with a qkv bias (bias != nullptr, Qwen2): the norm backward needs <dz, z - bias>, the
//      GEMM's own output, so <dz, bias> on the unrotated dz is taken off dot_z (LayerNorm folds its bias
//      into b' instead).
//   3. A qkv bias (col_b != nullptr): column partials col_b[g, j] = sum of dz over the rows of group g
//      (the bias gradient), ld = qkv_dim; a group is 16 consecutive positions of one sequence (the last
//      one of a sequence shorter), group b * ceil(T / 16) + t / 16, attention_writeout_groups(shape)
//      groups in all.
//   4. The row scale: dqkv = r dz with r = stats.rstd(row), the norm's rstd.
struct AttentionWriteout {
  float rope_theta = 0.0f;
  prog::NormPartials stats;
  float* dot_z = nullptr;
  const float* c = nullptr;
  const float* b_prime = nullptr;
  float* dot_c = nullptr;
  float* dot_b = nullptr;
  float* col_b = nullptr;
  const __nv_bfloat16* bias = nullptr;  // [qkv_dim], the bf16 weight copy
};

namespace attention_writeout {
constexpr int kGroupRows = 16;  // rows of a column-partial group: 16 positions of one sequence
inline int groups_per_sequence(int T) { return (T + kGroupRows - 1) / kGroupRows; }
}  // namespace attention_writeout

// The column-partial groups of col_b for `shape` (item 3 above).
inline int attention_writeout_groups(const AttentionShape& shape) {
  return shape.B * attention_writeout::groups_per_sequence(shape.T);
}

}  // namespace coda
