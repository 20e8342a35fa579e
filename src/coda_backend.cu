// The pieces of the CODA mode that both architectures share; see coda_backend.hpp.
#include "coda_backend.hpp"

#include <stdexcept>
#include <string>

#include "kernels/coda/fused.cuh"

namespace coda {

CodaBackend::CodaBackend(const ModelConfig& config, int max_batch, int max_seq_len)
    : CudaBackend(config, max_batch, max_seq_len),
      norm1_stats_(config.n_layer),
      norm2_stats_(config.n_layer) {}

void CodaBackend::plan_buffers(ArenaPlan& plan) {
  plan_shared_buffers(plan);
  const size_t N = static_cast<size_t>(max_batch_) * max_seq_len_;
  const size_t count = max_row_partials(config_.d_model);
  const std::string group = "coda norm statistics (partials)";
  auto reserve_stats = [&](NormStatsBuffers& stats) {
    if (gpt2_) plan.reserve(&stats.sum, N * count, group);
    plan.reserve(&stats.sumsq, N * count, group);
  };
  for (int l = 0; l < config_.n_layer; ++l) {
    reserve_stats(norm1_stats_[l]);
    reserve_stats(norm2_stats_[l]);
  }
  reserve_stats(normf_stats_);
  plan.reserve(&target_logit_, N, "coda loss partials");
  plan.reserve(&lse_partials_, N * max_row_partials(config_.padded_vocab()), "coda loss partials");
}

prog::NormPartials CodaBackend::norm_partials(const NormStatsBuffers& stats) const {
  prog::NormPartials p;
  p.sum = stats.sum;
  p.sumsq = stats.sumsq;
  p.count = stats.count;
  p.d = config_.d_model;
  p.eps = config_.norm_eps;
  return p;
}

fused::DlogitsArgs CodaBackend::dlogits_args(int N, float dloss, float* dot_z) const {
  fused::DlogitsArgs args;
  args.dlogits = acts_.logits;
  args.logits = acts_.logits;
  args.lse = acts_.logits_lse;
  args.targets = acts_.targets;
  args.dloss = dloss;
  args.N = N;
  args.vocab = config_.vocab_size;
  args.Vp = config_.padded_vocab();
  args.stats = norm_partials(normf_stats_);
  args.dot_z = dot_z;
  return args;
}

CodaBackend::NormStatsBuffers& CodaBackend::next_norm_stats(int layer) {
  return layer + 1 < config_.n_layer ? norm1_stats_[layer + 1] : normf_stats_;
}

void CodaBackend::embedding_forward(int B, int T) {
  LayerActivations& a = acts_.layers[0];
  NormStatsBuffers& stats = norm1_stats_[0];
  fused::embedding_forward(a.input, a.norm1, stats.sum, stats.sumsq, acts_.tokens, weight(layout_.wte),
                           weight(layout_.wpe), weight(layout_.layers[0].norm1_w), B, T, config_.d_model, stream_);
  stats.count = 1;
}

void CodaBackend::loss_forward(int B, int T) {
  fused::loss_from_partials(acts_.losses, acts_.logits_lse, lse_partials_, lse_count_, target_logit_, B * T,
                            stream_);
}

std::unique_ptr<CudaBackend> make_coda_backend(const ModelConfig& config, int max_batch, int max_seq_len,
                                               Communicator* zero1) {
  std::unique_ptr<CudaBackend> backend = config.arch == Arch::Llama
                                             ? make_coda_llama_backend(config, max_batch, max_seq_len)
                                             : make_coda_gpt2_backend(config, max_batch, max_seq_len);
  if (zero1 != nullptr) backend->shard_optimizer_state(*zero1);
  backend->allocate();
  return backend;
}

}  // namespace coda
