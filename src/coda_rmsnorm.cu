// The CODA mode of the RMSNorm family (Llama, Qwen2): every RMSNorm, RoPE, SwiGLU, residual add, the QKV
// bias and the loss run in the epilogues of its GEMMs (kernels/coda/llama_programs.cuh), next to the
// attention kernels and the passes of kernels/coda/passes.cuh. Buffers as in coda_runner.hpp. Program types,
// each one GEMM kernel instantiation per tile: qkv (with or without the bias), residual (out-proj and
// down), gate/up, LM head, norm backward (head, gate/up and QKV dgrads), SwiGLU backward. Gradients travel
// scaled (dz' = r dz, passes.cuh); the QKV bias gradient is the attention write-out's column partials.
// Details: docs/CODA.md, "Llama"; the program of each GEMM above block_forward and block_backward below.

#include <cmath>
#include <stdexcept>
#include <string>

#include "coda_runner.hpp"
#include "kernels/coda/passes.cuh"
#include "kernels/coda/llama_programs.cuh"
#include "kernels/gemm/gemm_launch.cuh"

namespace coda {

namespace {

using prog::llama::lm_head_program;
using prog::llama::norm_backward_program;
using prog::llama::qkv_bias_program;
using prog::llama::qkv_program;
using prog::llama::residual_program;
using prog::llama::swiglu_backward_program;

class CodaRmsNormRunner : public CodaRunner {
 public:
  CodaRmsNormRunner(DeviceState& state, bool deterministic);
  void block_forward(int layer, int B, int T) override;
  void head_forward(int B, int T) override;
  void head_backward(int B, int T, float dloss) override;
  void block_backward(int layer, int B, int T) override;

 protected:
  void plan_buffers(ArenaPlan& plan) override;

 private:
  // The RMSNorm backward in the dgrad of a normed GEMM: d_residual (+)= norm backward of the accumulator
  // dz' W, with the norm's statistics, the <dz, z> partials left in dot_z_ (dot_count per row), the norm's
  // input h and gamma; then grad(gamma) += its column partials.
  void norm_backward_dgrad(const bf16* dz_scaled, size_t w, int N, int K, const NormStatsBuffers& stats,
                           int dot_count, const bf16* h, size_t gamma, bool accumulate);

  float* dot_z_ = nullptr;             // <dz, z> row partials of the norm backward in flight [N, F / 128]
  float* dgamma_partials_ = nullptr;   // column partials of a gamma gradient [N / 16, C]
  float* dbias_partials_ = nullptr;    // QKV bias: the write-out's column partials [groups, qkv_dim]
};

CodaRmsNormRunner::CodaRmsNormRunner(DeviceState& state, bool deterministic) : CodaRunner(state, deterministic) {}

void CodaRmsNormRunner::plan_buffers(ArenaPlan& plan) {
  CodaRunner::plan_buffers(plan);
  const size_t N = max_rows();
  const std::string group = "coda backward partials";
  plan.reserve(&dot_z_, N * max_row_partials(config_.d_ff), group);
  plan.reserve(&dgamma_partials_, static_cast<size_t>(prog::column_partial_groups(static_cast<int>(N))) *
                                      config_.d_model, group);
  if (config_.qkv_bias)
    plan.reserve(&dbias_partials_,
                 static_cast<size_t>(attention_writeout_groups(attention_shape(state_.max_batch(), state_.max_seq_len()))) *
                     config_.qkv_dim(),
                 group);
}

// Forward of layer l (N = B*T rows, C = d_model, Q = qkv_dim, F = d_ff, Vp = padded vocabulary; h = input,
// its norm1 statistics and O1 = h (.) gamma1 already written by the embedding or the previous layer's down
// projection):
//   QKV       qkv = rope(r1 (O1 Wqkv^T) (+ b, Qwen2))                              -> attention
//   out-proj  h2 = attn Wo^T + h: aux h2, h2^2 partials (norm2), main O2 = h2 (.) gamma2
//   gate/up   (g, u) = r2 (O2 Wgu^T): aux gu (up), main act = silu(g) u
//   down      h' = act Wdown^T + h2: aux h' (the next layer's h), h'^2 partials, main O' = h' (.) gamma' (gamma of
//             the next layer's norm1, or of the final norm after the last layer)
// Head: logits = rf (Of Wv^T), the target logit and log-sum-exp partials over the columns < vocab.
void CodaRmsNormRunner::block_forward(int layer, int B, int T) {
  const int N = B * T, C = config_.d_model, Q = config_.qkv_dim(), F = config_.d_ff;
  LayerActivations& a = layers_[layer];
  const LayerParams& p = layout_.layers[layer];
  const bool last = layer + 1 == config_.n_layer;
  NormStatsBuffers& stats2 = norm2_stats_[layer];
  NormStatsBuffers& next = next_norm_stats(layer);
  const GemmTile tile = GemmTile::Auto;

  auto qkv = [&](auto rope) {
    const prog::NormPartials stats1 = norm_partials(norm1_stats_[layer]);
    if (config_.qkv_bias)
      gemm_run<GemmLayout::Forward>(tile, a.qkv, a.o1, weight(p.qkv_w), N, Q, C, false,
                                    qkv_bias_program(stats1, weight(p.qkv_b), rope), stream_);
    else
      gemm_run<GemmLayout::Forward>(tile, a.qkv, a.o1, weight(p.qkv_w), N, Q, C, false, qkv_program(stats1, rope),
                                    stream_);
  };
  const int rot_cols = (config_.n_head + config_.n_kv_head) * config_.head_dim();
  const float log2_theta = std::log2(config_.rope_theta);
  if (config_.head_dim() == 64)
    qkv(epi::Rope<64>{T, rot_cols, log2_theta});
  else
    qkv(epi::Rope<128>{T, rot_cols, log2_theta});
  attention_forward(a.attn, a.lse, a.qkv, attention_shape(B, T), stream_);
  gemm_run<GemmLayout::Forward>(tile, a.o2, a.attn, weight(p.attn_proj_w), N, C, C, false,
                                residual_program(a.h, a.h2, C, weight(p.norm2_w), stats2.sumsq), stream_);
  stats2.count = row_partials(GemmLayout::Forward, N, C, C);
  gemm_run<GemmLayout::Forward>(tile, a.act, a.o2, weight(p.mlp_up_w), N, 2 * F, C, false,
                                prog::llama::gate_up_program(norm_partials(stats2), a.up, 2 * F), stream_);
  bf16* O_next = last ? o_final_ : layers_[layer + 1].o1;
  const size_t gamma_next = last ? layout_.normf_w : layout_.layers[layer + 1].norm1_w;
  gemm_run<GemmLayout::Forward>(tile, O_next, a.act, weight(p.mlp_down_w), N, C, F, false,
                                residual_program(a.h2, layer_output(layer), C, weight(gamma_next), next.sumsq),
                                stream_);
  next.count = row_partials(GemmLayout::Forward, N, C, F);
}

void CodaRmsNormRunner::head_forward(int B, int T) {
  const int N = B * T, C = config_.d_model, Vp = config_.padded_vocab();
  gemm_run<GemmLayout::Forward>(GemmTile::Auto, io.logits, o_final_, weight(layout_.head_weight()), N, Vp, C,
                                false,
                                lm_head_program(norm_partials(normf_stats_), io.targets, target_logit_,
                                                lse_partials_, config_.vocab_size),
                                stream_);
  lse_count_ = row_partials(GemmLayout::Forward, N, Vp, C);
}

void CodaRmsNormRunner::norm_backward_dgrad(const bf16* dz_scaled, size_t w, int N, int K,
                                           const NormStatsBuffers& stats, int dot_count, const bf16* h, size_t gamma,
                                           bool accumulate) {
  const int C = config_.d_model;
  gemm_run<GemmLayout::Dgrad>(GemmTile::Auto, d_residual_, dz_scaled, weight(w), N, C, K, accumulate,
                              norm_backward_program(norm_partials(stats), dot_z_, dot_count, h, C, weight(gamma),
                                                    dgamma_partials_),
                              stream_);
  passes::add_column_partials({{grad(gamma), dgamma_partials_}}, prog::column_partial_groups(N), C, C, 1.0f, stream_);
}

// Backward (scaled-gradient convention, passes.cuh): d_residual holds the gradient of the stream above.
//   head      dlogits' = rf dz in place, with <dz, logits>; dgrad d_residual = norm backward (written
//             fresh); wgrad += dlogits'^T Of; final-norm gamma from column partials
//   down      dgrad d_up = rf2 (SwiGLU backward of d_residual Wdown) with <dz, (g, u)>; wgrad += d_res^T act
//   gate/up   dgrad d_residual += norm2 backward of d_up' Wgu; wgrad += d_up'^T O2; gamma2
//   out-proj  plain dgrad d_attn = d_residual Wo; wgrad += d_residual^T attn
//   attention backward with the write-out: inverse RoPE, <dz, qkv>, d_qkv' = r1 dz
//   QKV       dgrad d_residual += norm1 backward of d_qkv' Wqkv; wgrad += d_qkv'^T O1; gamma1
void CodaRmsNormRunner::head_backward(int B, int T, float dloss) {
  const int N = B * T, C = config_.d_model, Vp = config_.padded_vocab();
  passes::dlogits(dlogits_args(N, dloss, dot_z_), stream_);
  norm_backward_dgrad(io.logits, layout_.head_weight(), N, Vp, normf_stats_, 1, h_final_, layout_.normf_w,
                      false);
  wgrad(grad(layout_.head_weight()), io.logits, o_final_, Vp, C, N);
}

void CodaRmsNormRunner::block_backward(int layer, int B, int T) {
  const int N = B * T, C = config_.d_model, Q = config_.qkv_dim(), F = config_.d_ff;
  const LayerActivations& a = layers_[layer];
  const LayerParams& p = layout_.layers[layer];
  const NormStatsBuffers& stats1 = norm1_stats_[layer];
  const NormStatsBuffers& stats2 = norm2_stats_[layer];
  bf16* d_residual = d_residual_;  // holds the gradient of this layer's output

  gemm_run<GemmLayout::Dgrad>(GemmTile::Auto, d_up_, d_residual, weight(p.mlp_down_w), N, F, C, false,
                              swiglu_backward_program(a.up, 2 * F, norm_partials(stats2), dot_z_), stream_);
  wgrad(grad(p.mlp_down_w), d_residual, a.act, C, F, N);
  norm_backward_dgrad(d_up_, p.mlp_up_w, N, 2 * F, stats2, row_partials(GemmLayout::Dgrad, N, F, C), a.h2,
                      p.norm2_w, true);
  wgrad(grad(p.mlp_up_w), d_up_, a.o2, 2 * F, C, N);

  bare_dgrad(d_attn_, d_residual, weight(p.attn_proj_w), N, C, C);
  wgrad(grad(p.attn_proj_w), d_residual, a.attn, C, C, N);
  AttentionWriteout writeout;
  writeout.rope_theta = config_.rope_theta;
  writeout.stats = norm_partials(stats1);
  writeout.dot_z = dot_z_;
  writeout.bias = weight(p.qkv_b);
  writeout.col_b = config_.qkv_bias ? dbias_partials_ : nullptr;
  attention_backward(d_qkv_, d_attn_, a.qkv, a.attn, a.lse, attention_workspace_,
                     attention_shape(B, T), stream_, &writeout, dq_sum());
  norm_backward_dgrad(d_qkv_, p.qkv_w, N, Q, stats1, 1, a.h, p.norm1_w, true);
  wgrad(grad(p.qkv_w), d_qkv_, a.o1, Q, C, N);
  if (config_.qkv_bias)
    passes::add_column_partials({{grad(p.qkv_b), dbias_partials_}}, attention_writeout_groups(attention_shape(B, T)), Q,
                                Q, 1.0f, stream_);
}

}  // namespace

std::unique_ptr<StepRunner> make_coda_rmsnorm_runner(DeviceState& state, const RunnerOptions& options) {
  return std::make_unique<CodaRmsNormRunner>(state, options.deterministic);
}

}  // namespace coda
