// The CODA mode of the LayerNorm family (GPT-2): every LayerNorm, bias, GELU, residual add and the loss run
// in the epilogues of its GEMMs (kernels/coda/gpt2_programs.cuh), next to the attention kernels and the
// passes of kernels/coda/passes.cuh. Buffers as in coda_runner.hpp. LayerNorm is reparameterized through the weight
// vectors c = W gamma, b' = W beta + bias; gradients travel scaled (dz' = r dz) and the weight gradients of
// normed layers read u / r, which the LayerNorm-backward dgrad stores. Every piece finishes its own layer's
// gradients, so the data-parallel bucket overlap of CudaBackend holds (step_runner.hpp).
// Details: docs/CODA.md, "GPT-2"; the program of each GEMM above the forward and the backward below.

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "coda_runner.hpp"
#include "kernels/coda/passes.cuh"
#include "kernels/coda/gpt2_programs.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/gemm/gemm_launch.cuh"

namespace coda {

namespace {

class CodaLayerNormRunner : public CodaRunner {
 public:
  CodaLayerNormRunner(DeviceState& state, bool deterministic);
  void embedding_forward(int B, int T) override;  // also the weight-derived vectors of this forward
  void block_forward(int layer, int B, int T) override;
  void head_forward(int B, int T) override;
  void head_backward(int B, int T, float dloss) override;
  void block_backward(int layer, int B, int T) override;

 protected:
  void plan_buffers(ArenaPlan& plan) override;

 private:
  // The weight-derived vectors of a LayerNormed linear layer LN(h) W^T + bias, fp32 [rows of W]:
  // c = W gamma, b' = W beta + bias (recomputed at the start of every forward, from the bf16 weights).
  struct LnVectors {
    float* c = nullptr;
    float* b_prime = nullptr;
  };
  void weight_vectors();
  // d_residual += the LayerNorm backward of a norm (its partials, input h, parameters at norm_w, norm_b)
  // from the scaled gradient dz' [N, K] of the GEMM after it (weight W [K, C]) and the row dots of dz;
  // adds dgamma, dbeta and the column sums of the new d_residual (the gradient of residual_bias, the
  // bias of the projection below; kAbsent below the first layer) into the gradients, in one launch; and
  // stores the norm's u / r [N, C] over norm_out_over_rstd (O, which the forward's GEMM read).
  void ln_backward(const bf16* dz_scaled, size_t W, int K, const NormStatsBuffers& stats, const prog::LnDots& dots,
                   const bf16* h, size_t norm_w, size_t norm_b, size_t residual_bias, int N, bf16* norm_out_over_rstd);
  // dW += dz'^T (u / r) and dbias += the column sums of col_b_ in `groups` row groups (W [rows, C]).
  void ln_linear_wgrad(size_t W, size_t bias, const bf16* dz_scaled, const bf16* norm_out_over_rstd, int rows, int N,
                       int groups);

  std::vector<LnVectors> qkv_vectors_, fc_vectors_;  // per layer
  LnVectors head_vectors_;
  float* dot_z_ = nullptr;  // row dots of a LayerNormed GEMM's output gradient, [N, count]
  float* dot_c_ = nullptr;
  float* dot_b_ = nullptr;
  float* col_b_ = nullptr;                 // column partials of that gradient (the bias gradient), [groups, rows]
  prog::gpt2::LnBackwardColumns ln_cols_;  // the LayerNorm backward's column partials, [N / 16, C]
};

CodaLayerNormRunner::CodaLayerNormRunner(DeviceState& state, bool deterministic)
    : CodaRunner(state, deterministic), qkv_vectors_(config_.n_layer), fc_vectors_(config_.n_layer) {}

void CodaLayerNormRunner::plan_buffers(ArenaPlan& plan) {
  CodaRunner::plan_buffers(plan);
  const ModelConfig& c = config_;
  const int N = static_cast<int>(max_rows()), C = c.d_model, Q = c.qkv_dim(), F = c.d_ff, V = c.padded_vocab();
  const std::string vectors = "coda weight-derived vectors", partials = "coda gradient partials";
  auto reserve_vectors = [&](LnVectors& v, int rows) {
    plan.reserve(&v.c, rows, vectors);
    plan.reserve(&v.b_prime, rows, vectors);
  };
  for (int l = 0; l < c.n_layer; ++l) {
    reserve_vectors(qkv_vectors_[l], Q);
    reserve_vectors(fc_vectors_[l], F);
  }
  reserve_vectors(head_vectors_, V);
  // Row dots: the proj dgrad writes the most partials per row (the attention write-out and dlogits one).
  const size_t dots = static_cast<size_t>(N) * max_row_partials(F);
  plan.reserve(&dot_z_, dots, partials);
  plan.reserve(&dot_c_, dots, partials);
  plan.reserve(&dot_b_, dots, partials);
  plan.reserve(&col_b_,
               std::max(static_cast<size_t>(prog::column_partial_groups(N)) * F,
                        static_cast<size_t>(attention_writeout_groups(attention_shape(state_.max_batch(), state_.max_seq_len()))) * Q),
               partials);
  const size_t ln_cols = static_cast<size_t>(prog::column_partial_groups(N)) * C;
  for (float** cols : {&ln_cols_.dgamma, &ln_cols_.dbeta, &ln_cols_.residual})
    plan.reserve(cols, ln_cols, partials);
}

// ---- forward ----

// Forward, once: the weight-derived vectors c = W gamma, b' = W beta + bias of each LayerNormed linear
// layer (QKV, fc, the LM head) from the bf16 weights; the embedding writes layer 0's h, O1 = h (.) gamma1
// and the partials of h and h^2. Layer l (N rows, C = d_model, Q = qkv_dim, F = d_ff):
//   QKV       qkv = r (O1 Wqkv^T) - (r mu) c + b'                                  ln_linear_program
//   attention
//   out-proj  h2 = attn Wo^T + bias + h  (aux mid), O2 = h2 (.) gamma2 (norm2), partials of h2, h2^2
//   fc        pre = LN(h2) Wfc^T + bias (aux up), act = gelu(pre)                   fc_program
//   proj      h' = act Wproj^T + bias + h2 (aux: next input), O' = h' (.) gamma' (next norm1 or normf)
// Head: logits = LN(h) Wte^T with the target logit and the log-sum-exp partials (CodaRunner finishes
// the loss from them).
void CodaLayerNormRunner::weight_vectors() {
  const int C = config_.d_model;
  for (int l = 0; l < config_.n_layer; ++l) {
    const LayerParams& p = layout_.layers[l];
    passes::ln_weight_vectors(qkv_vectors_[l].c, qkv_vectors_[l].b_prime, weight(p.qkv_w), config_.qkv_dim(), C,
                             weight(p.norm1_w), weight(p.norm1_b), weight(p.qkv_b), stream_);
    passes::ln_weight_vectors(fc_vectors_[l].c, fc_vectors_[l].b_prime, weight(p.mlp_up_w), config_.d_ff, C,
                             weight(p.norm2_w), weight(p.norm2_b), weight(p.mlp_up_b), stream_);
  }
  passes::ln_weight_vectors(head_vectors_.c, head_vectors_.b_prime, weight(layout_.head_weight()),
                           config_.padded_vocab(), C, weight(layout_.normf_w), weight(layout_.normf_b), nullptr,
                           stream_);
}

void CodaLayerNormRunner::embedding_forward(int B, int T) {
  weight_vectors();
  CodaRunner::embedding_forward(B, T);
}

void CodaLayerNormRunner::block_forward(int layer, int B, int T) {
  using namespace prog::gpt2;
  const int N = B * T, C = config_.d_model, Q = config_.qkv_dim(), F = config_.d_ff;
  LayerActivations& a = layers_[layer];
  const LayerParams& p = layout_.layers[layer];
  const bool last = layer + 1 == config_.n_layer;

  gemm_run<GemmLayout::Forward>(GemmTile::Auto, a.qkv, a.o1, weight(p.qkv_w), N, Q, C, false,
                                ln_linear_program(norm_partials(norm1_stats_[layer]), qkv_vectors_[layer].c,
                                                  qkv_vectors_[layer].b_prime),
                                stream_);
  attention_forward(a.attn, a.lse, a.qkv, attention_shape(B, T), stream_);

  NormStatsBuffers& stats2 = norm2_stats_[layer];
  stats2.count = row_partials(GemmLayout::Forward, N, C, C);
  gemm_run<GemmLayout::Forward>(GemmTile::Auto, a.o2, a.attn, weight(p.attn_proj_w), N, C, C, false,
                                residual_program(a.h, weight(p.attn_proj_b), a.h2, C, weight(p.norm2_w),
                                                 stats2.sum, stats2.sumsq),
                                stream_);
  gemm_run<GemmLayout::Forward>(GemmTile::Auto, a.act, a.o2, weight(p.mlp_up_w), N, F, C, false,
                                fc_program(norm_partials(stats2), fc_vectors_[layer].c, fc_vectors_[layer].b_prime,
                                           a.up, F),
                                stream_);

  NormStatsBuffers& next = next_norm_stats(layer);
  next.count = row_partials(GemmLayout::Forward, N, C, F);
  bf16* next_O = last ? o_final_ : layers_[layer + 1].o1;
  const size_t next_gamma = last ? layout_.normf_w : layout_.layers[layer + 1].norm1_w;
  gemm_run<GemmLayout::Forward>(GemmTile::Auto, next_O, a.act, weight(p.mlp_down_w), N, C, F, false,
                                residual_program(a.h2, weight(p.mlp_down_b), layer_output(layer), C,
                                                 weight(next_gamma), next.sum, next.sumsq),
                                stream_);
}

void CodaLayerNormRunner::head_forward(int B, int T) {
  const int N = B * T, C = config_.d_model, V = config_.padded_vocab();
  lse_count_ = row_partials(GemmLayout::Forward, N, V, C);
  gemm_run<GemmLayout::Forward>(GemmTile::Auto, io.logits, o_final_, weight(layout_.head_weight()), N, V, C,
                                false,
                                prog::gpt2::lm_head_program(norm_partials(normf_stats_), head_vectors_.c,
                                                            head_vectors_.b_prime, io.targets, target_logit_,
                                                            lse_partials_, config_.vocab_size),
                                stream_);
}

// ---- backward ----

// Backward (scaled-gradient convention of passes.cuh; d_residual = gradient of the residual stream):
//   head      passes::dlogits -> dlogits' = r dz with the row dots of the final norm; d_residual = 0, then
//             the LayerNorm-backward dgrad (dlogits' Wte) adds the final norm's dh and stores u / r over
//             normf; wgrad += dlogits'^T (u / r) (no bias, so dlogits takes no column sums).
//   proj      dgrad d_act = dz' of the fc output (GELU backward, row dots, col_b: proj_dgrad_program);
//             wgrad += d_residual^T act; its bias gradient: the column sums that the LayerNorm backward
//             above it left (ln_cols_.residual)
//   fc        dgrad: LayerNorm backward of norm2 into d_residual (+ its column sums: the out-proj bias),
//             u / r over O2; wgrad += dz'^T (u / r), fc bias from col_b
//   out-proj  plain dgrad into d_attn, wgrad, bias from the column sums just written
//   attention backward with the LayerNorm write-out: d_qkv = r dz, row dots, col_b
//   QKV       dgrad: LayerNorm backward of norm1 into d_residual (+ column sums: the proj bias of the layer
//             below), u / r over O1; wgrad += d_qkv^T (u / r), qkv bias from col_b
void CodaLayerNormRunner::ln_backward(const bf16* dz_scaled, size_t W, int K, const NormStatsBuffers& stats,
                                  const prog::LnDots& dots, const bf16* h, size_t norm_w, size_t norm_b,
                                  size_t residual_bias, int N, bf16* norm_out_over_rstd) {
  const int C = config_.d_model, groups = prog::column_partial_groups(N);
  auto dgrad = [&](const auto& program) {
    gemm_run<GemmLayout::Dgrad>(GemmTile::Auto, d_residual_, dz_scaled, weight(W), N, C, K, false, program,
                                stream_);
  };
  dgrad(prog::gpt2::ln_backward_program(norm_partials(stats), dots, h, C, weight(norm_w), weight(norm_b),
                                        d_residual_, ln_cols_, norm_out_over_rstd));
  passes::add_column_partials({{grad(norm_w), ln_cols_.dgamma}, {grad(norm_b), ln_cols_.dbeta},
                              {grad(residual_bias), ln_cols_.residual}},
                             groups, C, C, 1.0f, stream_);
}

void CodaLayerNormRunner::ln_linear_wgrad(size_t W, size_t bias, const bf16* dz_scaled, const bf16* norm_out_over_rstd,
                                      int rows, int N, int groups) {
  wgrad(grad(W), dz_scaled, norm_out_over_rstd, rows, config_.d_model, N);
  passes::add_column_partials({{grad(bias), col_b_}}, groups, rows, rows, 1.0f, stream_);
}

void CodaLayerNormRunner::head_backward(int B, int T, float dloss) {
  const int N = B * T, C = config_.d_model, V = config_.padded_vocab();
  passes::DlogitsArgs args = dlogits_args(N, dloss, dot_z_);
  args.c = head_vectors_.c;
  args.b_prime = head_vectors_.b_prime;
  args.dot_c = dot_c_;
  args.dot_b = dot_b_;
  passes::dlogits(args, stream_);

  // The dgrad overwrites O of the final norm (read by the forward's LM head only) with u / r, and the
  // weight gradient is the plain dz'^T (u / r).
  CUDA_CHECK(cudaMemsetAsync(d_residual_, 0, static_cast<size_t>(N) * C * sizeof(bf16), stream_));
  ln_backward(io.logits, layout_.head_weight(), V, normf_stats_, {dot_z_, dot_c_, dot_b_, 1}, h_final_,
              layout_.normf_w, layout_.normf_b, layout_.layers.back().mlp_down_b, N, o_final_);
  wgrad(grad(layout_.head_weight()), io.logits, o_final_, V, C, N);
}

void CodaLayerNormRunner::block_backward(int layer, int B, int T) {
  const int N = B * T, C = config_.d_model, Q = config_.qkv_dim(), F = config_.d_ff;
  const int groups = prog::column_partial_groups(N);
  const LayerActivations& a = layers_[layer];
  const LayerParams& p = layout_.layers[layer];
  bf16* d_residual = d_residual_;  // holds the gradient of this layer's output; d_up_: dz' of the fc output

  const prog::LnDots fc_dots{dot_z_, dot_c_, dot_b_, row_partials(GemmLayout::Dgrad, N, F, C)};
  gemm_run<GemmLayout::Dgrad>(GemmTile::Auto, d_up_, d_residual, weight(p.mlp_down_w), N, F, C, false,
                              prog::gpt2::proj_dgrad_program(a.up, F, norm_partials(norm2_stats_[layer]),
                                                             fc_vectors_[layer].c, fc_vectors_[layer].b_prime,
                                                             fc_dots, col_b_),
                              stream_);
  wgrad(grad(p.mlp_down_w), d_residual, a.act, C, F, N);
  ln_backward(d_up_, p.mlp_up_w, F, norm2_stats_[layer], fc_dots, a.h2, p.norm2_w, p.norm2_b, p.attn_proj_b, N,
              a.o2);
  ln_linear_wgrad(p.mlp_up_w, p.mlp_up_b, d_up_, a.o2, F, N, groups);

  bare_dgrad(d_attn_, d_residual, weight(p.attn_proj_w), N, C, C);
  wgrad(grad(p.attn_proj_w), d_residual, a.attn, C, C, N);
  AttentionWriteout writeout;
  writeout.stats = norm_partials(norm1_stats_[layer]);
  writeout.dot_z = dot_z_;
  writeout.c = qkv_vectors_[layer].c;
  writeout.b_prime = qkv_vectors_[layer].b_prime;
  writeout.dot_c = dot_c_;
  writeout.dot_b = dot_b_;
  writeout.col_b = col_b_;
  attention_backward(d_qkv_, d_attn_, a.qkv, a.attn, a.lse, attention_workspace_,
                     attention_shape(B, T), stream_, &writeout, dq_sum());
  ln_backward(d_qkv_, p.qkv_w, Q, norm1_stats_[layer], {dot_z_, dot_c_, dot_b_, 1}, a.h, p.norm1_w,
              p.norm1_b, layer > 0 ? layout_.layers[layer - 1].mlp_down_b : kAbsent, N, a.o1);
  ln_linear_wgrad(p.qkv_w, p.qkv_b, d_qkv_, a.o1, Q, N, attention_writeout_groups(attention_shape(B, T)));
}

}  // namespace

std::unique_ptr<StepRunner> make_coda_layernorm_runner(DeviceState& state, const RunnerOptions& options) {
  return std::make_unique<CodaLayerNormRunner>(state, options.deterministic);
}

}  // namespace coda
