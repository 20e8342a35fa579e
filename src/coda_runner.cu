// The pieces of the CODA mode that both families share; see coda_runner.hpp.
#include "coda_runner.hpp"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels/coda/passes.cuh"

namespace coda {

std::string coda_unsupported_reason(const ModelConfig& c) {
  const bool layer_norm = c.norm == Norm::Layer;
  const std::string family = layer_norm ? "LayerNorm" : "RMSNorm";
  auto gap = [&](const std::string& feature) {
    return "kernels coda: the " + family + " family's programs are built for " + feature + ", which this " +
           arch_name(c.arch) + " model does not match; run it with kernels = unfused";
  };
  if (layer_norm) {
    if (c.mlp != Mlp::Gelu) return gap("GELU");
    if (c.positions != Positions::Learned) return gap("learned positions");
    if (!(c.qkv_bias && c.proj_bias && c.mlp_bias)) return gap("a bias on every projection");
    return "";
  }
  if (c.mlp != Mlp::SwiGLU) return gap("SwiGLU");
  if (!c.rope()) return gap("RoPE positions");
  if (c.proj_bias || c.mlp_bias) return gap("no bias on the output and MLP projections (a QKV bias is one of its programs)");
  if (c.head_dim() != 64 && c.head_dim() != 128)
    return gap("head_dim 64 or 128 (the RoPE epilogue's and the attention kernels' head sizes), not " +
               std::to_string(c.head_dim()));
  return "";
}

CodaRunner::CodaRunner(DeviceState& state, bool deterministic)
    : StepRunner(state, deterministic), norm1_stats_(config_.n_layer), norm2_stats_(config_.n_layer) {
  const std::string reason = coda_unsupported_reason(config_);
  if (!reason.empty()) throw std::invalid_argument(reason);
  const char* bare = std::getenv("CODA_BARE_GEMMS");
  const std::string choice = bare != nullptr && *bare != '\0' ? bare : "cublaslt";
  if (choice != "cublaslt" && choice != "handwritten")
    throw std::invalid_argument("CODA_BARE_GEMMS=" + choice + ": the choices are cublaslt (unset) and handwritten");
  if (choice == "cublaslt") bare_cublas_ = std::make_unique<CublasLt>();
}

void CodaRunner::wgrad(float* dW, const bf16* dY, const bf16* X, int M, int N, int K) const {
  if (bare_cublas_ != nullptr)
    bare_cublas_->gemm(dW, dY, Op::T, X, Op::N, M, N, K, true, stream_);
  else
    gemm_wgrad(dW, dY, X, M, N, K, true, stream_, GemmTile::Auto,
               deterministic_ ? GemmKSplit::Never : GemmKSplit::Balanced);
}

void CodaRunner::bare_dgrad(bf16* dX, const bf16* dY, const bf16* W, int M, int N, int K) const {
  if (bare_cublas_ != nullptr)
    bare_cublas_->gemm(dX, dY, Op::N, W, Op::N, M, N, K, false, stream_);
  else
    gemm_dgrad(dX, dY, W, M, N, K, stream_);
}

void CodaRunner::plan_buffers(ArenaPlan& plan) {
  const ModelConfig& c = config_;
  const size_t N = max_rows(), C = c.d_model, Q = c.qkv_dim(), F = c.d_ff, U = c.mlp_up_rows();
  const std::string saved = "activations saved for backward", scratch = "scratch";
  layers_.assign(c.n_layer, LayerActivations{});
  for (LayerActivations& a : layers_) {
    plan.reserve(&a.h, N * C, saved);
    plan.reserve(&a.o1, N * C, saved);
    plan.reserve(&a.qkv, N * Q, saved);
    plan.reserve(&a.attn, N * C, saved);
    plan.reserve(&a.lse, N * c.n_head, saved);
    plan.reserve(&a.h2, N * C, saved);
    plan.reserve(&a.o2, N * C, saved);
    plan.reserve(&a.up, N * U, saved);
    plan.reserve(&a.act, N * F, saved);
  }
  plan.reserve(&h_final_, N * C, saved);
  plan.reserve(&o_final_, N * C, saved);

  const size_t count = max_row_partials(c.d_model);
  const std::string stats = "coda norm statistics (partials)";
  auto reserve_stats = [&](NormStatsBuffers& s) {
    if (c.norm == Norm::Layer) plan.reserve(&s.sum, N * count, stats);
    plan.reserve(&s.sumsq, N * count, stats);
  };
  for (int l = 0; l < c.n_layer; ++l) {
    reserve_stats(norm1_stats_[l]);
    reserve_stats(norm2_stats_[l]);
  }
  reserve_stats(normf_stats_);
  plan.reserve(&target_logit_, N, "coda loss partials");
  plan.reserve(&lse_partials_, N * max_row_partials(c.padded_vocab()), "coda loss partials");

  plan.reserve(&d_residual_, N * C, scratch);
  plan.reserve(&d_attn_, N * C, scratch);
  plan.reserve(&d_qkv_, N * Q, scratch);
  plan.reserve(&d_up_, N * U, scratch);
  plan.reserve(reinterpret_cast<char**>(&attention_workspace_), attention_workspace_bytes(), scratch);
}

prog::NormPartials CodaRunner::norm_partials(const NormStatsBuffers& stats) const {
  prog::NormPartials p;
  p.sum = stats.sum;
  p.sumsq = stats.sumsq;
  p.count = stats.count;
  p.d = config_.d_model;
  p.eps = config_.norm_eps;
  return p;
}

passes::DlogitsArgs CodaRunner::dlogits_args(int N, float dloss, float* dot_z) const {
  passes::DlogitsArgs args;
  args.dlogits = io.logits;
  args.logits = io.logits;
  args.lse = io.logits_lse;
  args.targets = io.targets;
  args.dloss = dloss;
  args.N = N;
  args.vocab = config_.vocab_size;
  args.Vp = config_.padded_vocab();
  args.stats = norm_partials(normf_stats_);
  args.dot_z = dot_z;
  return args;
}

CodaRunner::NormStatsBuffers& CodaRunner::next_norm_stats(int layer) {
  return layer + 1 < config_.n_layer ? norm1_stats_[layer + 1] : normf_stats_;
}

void CodaRunner::embedding_forward(int B, int T) {
  LayerActivations& a = layers_[0];
  NormStatsBuffers& stats = norm1_stats_[0];
  passes::embedding_forward(a.h, a.o1, stats.sum, stats.sumsq, io.tokens, weight(layout_.wte), weight(layout_.wpe),
                           weight(layout_.layers[0].norm1_w), B, T, config_.d_model, stream_);
  stats.count = 1;
}

void CodaRunner::loss_forward(int B, int T) {
  passes::loss_from_partials(io.losses, io.logits_lse, lse_partials_, lse_count_, target_logit_, B * T, stream_);
}

void CodaRunner::embedding_backward(int B, int T) { embedding_backward_from(d_residual_, B, T); }

}  // namespace coda
