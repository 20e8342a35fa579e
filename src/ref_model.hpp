// The fp32 CPU reference model: forward and backward of every model the features describe, built from the
// ops of ref_ops.hpp.
// It is the spec of the whole trainer; the GPU backends are tested against its activations, loss and
// gradients.
// Every activation the backward needs is kept in RefActivations, with the first B*T rows valid after a
// forward of shape (B, T) (lse is [B, n_head, T] for that B and T).
#pragma once
#include <cstdint>
#include <vector>

#include "fp8.hpp"
#include "model.hpp"

namespace coda::ref {

// Per token row, h the residual stream, each feature of ModelConfig where it applies:
//   h = wte[token] (+ wpe[t], learned positions)
//   per layer: h += attn_proj(attention(RoPE(qkv(norm1(h)))));  h += mlp_down(act(mlp_up(norm2(h))))
//   logits = normf(h) W^T, W = wte (tied) or lm_head
// norm: LayerNorm or RMSNorm; act: GELU or SwiGLU; RoPE only with RoPE positions, applied after the qkv
// bias; each projection with or without its bias.
// Loss: mean over the B*T tokens of cross-entropy against the targets, over the real vocabulary only.
struct RefLayerActivations {
  std::vector<float> residual_in;   // [N, C] residual stream entering the layer
  std::vector<float> norm1;         // [N, C] normed input of the qkv projection
  std::vector<float> norm1_mean;    // [N] LayerNorm mean (empty for RMSNorm)
  std::vector<float> norm1_rstd;    // [N]
  std::vector<float> qkv;           // [N, qkv_dim] packed q|k|v, after the bias and RoPE
  std::vector<float> attn_out;      // [N, C] attention output, input of attn_proj
  std::vector<float> lse;           // [B, n_head, T]
  std::vector<float> residual_mid;  // [N, C] residual after the attention block
  std::vector<float> norm2;         // [N, C] normed input of mlp_up
  std::vector<float> norm2_mean;    // [N] (LayerNorm only)
  std::vector<float> norm2_rstd;    // [N]
  std::vector<float> mlp_pre;       // [N, mlp_up_rows] mlp_up output: GELU input, or interleaved (g, u)
  std::vector<float> mlp_act;       // [N, d_ff] GELU / SwiGLU output, input of mlp_down
};

struct RefActivations {
  std::vector<RefLayerActivations> layers;
  std::vector<float> residual_final;  // [N, C] residual stream after the last layer
  std::vector<float> normf;           // [N, C] final norm output, input of the LM head
  std::vector<float> normf_mean;      // [N] (LayerNorm only)
  std::vector<float> normf_rstd;      // [N]
  std::vector<float> logits;          // [N, padded_vocab]; padded columns are logits of zero rows
  std::vector<float> losses;          // [N] per-token cross-entropy (valid when targets were given)
};

class RefModel {
 public:
  // Parameters start at zero; call init(seed) or fill params directly.
  RefModel(const ModelConfig& config, int max_batch, int max_seq_len);

  void init(uint64_t seed);  // init_params() of model.hpp
  void zero_grad();

  // Runs the forward pass of B sequences of T tokens (host arrays of B*T ids). With targets, computes
  // the per-token losses and returns their mean; without (null), returns NaN and only the logits are
  // meaningful. Throws std::invalid_argument on a shape beyond the limits or a token out of range.
  // training: FP8 records amax (see enable_fp8).
  float forward(const int32_t* tokens, const int32_t* targets, int B, int T, bool training = false);
  // Adds d(grad_scale * mean_loss)/d(params) into grads, for the last forward (which had targets).
  void backward(float grad_scale);

  // FP8 training, emulated: the specification of the FP8 mode (docs/FP8.md). Each linear of the recipe's
  // (by default the four of every block: qkv, attention output, MLP up and down; the LM head where the
  // recipe names it; the others stay fp32) runs its forward on e4m3 copies of its input and weight, and its
  // dgrad and wgrad on an e5m2 copy of its output gradient with those e4m3 copies (bias gradients from the
  // unquantized one); a copy is decode(encode(x * scale)) / scale with per-tensor delayed scaling (fp8.hpp):
  // the scale from the amax history of the steps before. A training forward and every backward
  // record their tensors' amax; an evaluation forward quantizes with the scales as they are. Until the
  // first step has closed there is no history: that step computes in fp32 and only records (calibration).
  // The norms, attention and loss stay fp32. fp8_end_step(step) closes optimizer step `step`
  // (0-based, after its micro-batches): every scale is updated for the next one.
  // A linear with block scaling (Fp8Recipe::block) has every copy in e4m3 with a scale per block
  // (fp8_block_copy): the forward reads the input in 1 x 128 blocks and the weight in 128 x 128 tiles, the
  // dgrad the output gradient in 1 x 128 blocks and the same weight copy, the wgrad the output gradient and
  // the input in 128 x 1 blocks (K = the tokens). It records no amax (its histories stay 0), runs in FP8 from
  // the first step on, and a non-finite value in one of its copies is a std::runtime_error naming it; a
  // recipe with block scaling on every linear keeps no state.
  void enable_fp8(const Fp8Recipe& recipe);
  void fp8_end_step(int step);
  // The scaling state between steps (empty before the first step closes), and back (check_fp8_state).
  Fp8ScalingState fp8_state() const;
  void load_fp8_state(const Fp8ScalingState& state);

  const ModelConfig config;
  const ParamLayout layout;
  std::vector<float> params;  // flat, layout order, layout.total elements
  std::vector<float> grads;   // same layout
  RefActivations acts;

 private:
  const float* param(size_t offset) const { return offset == kAbsent ? nullptr : params.data() + offset; }
  float* grad(size_t offset) { return offset == kAbsent ? nullptr : grads.data() + offset; }

  // The linears, in the fp32 or the emulated FP8 form (linear = 0 qkv, 1 attention output, 2 MLP up, 3 MLP
  // down of block `layer`; kFp8Head the LM head): y = x W^T + b, and dx += dy W, dW += dy^T x, db += colsum(dy).
  // b may be kAbsent.
  void linear_forward(int layer, int linear, float* y, const float* x, size_t w, size_t b, int N, int IC, int OC);
  void linear_backward(int layer, int linear, float* dx, const float* dy, const float* x, size_t w, size_t b, int N,
                       int IC, int OC);
  // x times the scale of its tensor through the role's format and back (x itself before calibration);
  // records max |x| while recording.
  std::vector<float> fp8_copy(const float* x, size_t n, Fp8Role role, int layer, int linear);
  // Block scaling: the copy of the [rows, cols] tensor `role` of a linear in blocks of block_rows x block_cols.
  std::vector<float> fp8_block_copy(const float* x, int rows, int cols, int block_rows, int block_cols, Fp8Role role,
                                    int layer, int linear) const;
  Fp8DelayedScale& fp8_scale(Fp8Role role, int layer, int linear);
  Fp8Tensors fp8_tensors() const { return Fp8Tensors(config.n_layer, fp8_recipe_); }

  std::vector<Fp8DelayedScale> fp8_scales_;  // Fp8Tensors order when FP8 is on, empty otherwise
  struct Fp8Copies {  // the forward's FP8 copies of a linear's input and weight; block scaling: x_t, the
    std::vector<float> x, w, x_t;  // input's copy in 128 x 1 blocks for the weight gradient
  };
  std::vector<Fp8Copies> fp8_copies_;        // [Fp8Tensors::layers() * 4], by Fp8Tensors::slot
  Fp8Recipe fp8_recipe_{0, 0, 0};            // no linear in FP8 until enable_fp8
  bool fp8_calibrated_ = false;
  bool fp8_recording_ = false;
  int max_batch_, max_seq_len_;
  int B_ = 0, T_ = 0;
  bool have_targets_ = false;
  std::vector<int32_t> tokens_, targets_;
  // Backward scratch, [N, width] each.
  std::vector<float> d_residual_, d_norm_, d_qkv_, d_attn_out_, d_mlp_pre_, d_mlp_act_, d_logits_;
};

}  // namespace coda::ref
