// The unfused mode: cuBLASLt GEMMs (no epilogue) and one kernel of kernels/unfused/ per operation, for
// every model the features describe. Its activations are the plain ones of the CPU reference (norm
// outputs and statistics, qkv after bias and RoPE, the MLP's pre-activation and activation), so it is the
// mode to compare the CODA mode with, step for step. With an FP8 recipe the linears it covers (the block
// linears, and the LM head where named) run as FP8 GEMMs (fp8_linears.hpp); everything else stays as it is.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kernels/attention/attention.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/gemm/cublaslt.cuh"
#include "fp8_linears.hpp"
#include "kernels/unfused/unfused.cuh"
#include "step_runner.hpp"

namespace coda {

namespace {

class UnfusedRunner final : public StepRunner {
 public:
  UnfusedRunner(DeviceState& state, const RunnerOptions& options)
      : StepRunner(state, options.deterministic), cublas_(std::make_unique<CublasLt>()) {
    if (options.fp8) fp8_ = std::make_unique<Fp8Linears>(state, *cublas_, *options.fp8);
  }
  std::string mode() const override {
    return fp8_ == nullptr ? "unfused" : std::string("unfused-") + fp8_->recipe().name();
  }
  void upload_tables() override;

  void embedding_forward(int B, int T) override;
  void block_forward(int layer, int B, int T) override;
  void head_forward(int B, int T) override;
  void loss_forward(int B, int T) override;
  void head_backward(int B, int T, float dloss) override;
  void block_backward(int layer, int B, int T) override;
  void embedding_backward(int B, int T) override;

  void close_fp8_step(int step, Communicator* comm) override {
    if (fp8_ != nullptr) fp8_->close_step(step, comm);
  }
  Fp8ScalingState read_fp8_state() override { return fp8_ != nullptr ? fp8_->read_state() : Fp8ScalingState{}; }
  void load_fp8_state(const Fp8ScalingState& state) override {
    if (fp8_ != nullptr)
      fp8_->load_state(state);
    else
      StepRunner::load_fp8_state(state);
  }

 protected:
  void plan_buffers(ArenaPlan& plan) override;

 private:
  struct LayerActivations {
    bf16* input = nullptr;         // residual stream entering the layer [N, C]
    bf16* norm1 = nullptr;         // [N, C]
    float* norm1_mean = nullptr;   // [N] (LayerNorm only)
    float* norm1_rstd = nullptr;   // [N]
    bf16* qkv = nullptr;           // [N, qkv_dim], after bias and RoPE: what attention reads
    bf16* attn = nullptr;          // [N, C]
    float* lse = nullptr;          // [B, n_head, T]
    bf16* mid = nullptr;           // residual stream after the attention half [N, C]
    bf16* norm2 = nullptr;         // [N, C]
    float* norm2_mean = nullptr;
    float* norm2_rstd = nullptr;
    bf16* up = nullptr;            // [N, mlp_up_rows]: GELU input, or interleaved (g, u)
    bf16* act = nullptr;           // [N, d_ff]: input of the down projection
  };
  struct Scratch {
    bf16* proj = nullptr;          // output of a residual-branch projection before its add [N, C]
    bf16* d_residual = nullptr;    // gradient of the residual stream [N, C]
    bf16* d_norm = nullptr;        // gradient of a norm output [N, C]
    bf16* d_attn = nullptr;        // [N, C]
    bf16* d_qkv = nullptr;         // [N, qkv_dim]
    bf16* d_act = nullptr;         // [N, d_ff]
    bf16* d_up = nullptr;          // [N, mlp_up_rows] (GELU: the same buffer as d_act, GELU runs in place)
    void* attention_workspace = nullptr;
    float* norm_partials = nullptr;           // the norm backward's dw/db partials
    unfused::ColumnSumWorkspace column_sums;  // bias gradients (and the norm backward's tickets)
    float2* rope_table = nullptr;             // RoPE: [max_T, head_dim / 2]
  };

  bf16* layer_output(int layer) const;
  void norm_forward(bf16* y, float* mean, float* rstd, const bf16* x, size_t w, size_t b, int N);
  void norm_backward(bf16* dx, const bf16* dy, const bf16* x, size_t w, size_t b, const float* mean,
                     const float* rstd, int N, bool accumulate);
  // Y[N, OC] = X[N, IC] W^T; backward dX = dY W, dW += dY^T X (fp32, accumulating). `linear` names the
  // linear in Fp8Linears' numbering (0 qkv .. 3 MLP down of block `layer`, kFp8Head the LM head), which runs
  // in FP8 where the runner's recipe covers it.
  void linear_forward(bf16* y, const bf16* x, size_t w, int N, int IC, int OC, int layer, int linear);
  void linear_backward(bf16* dx, const bf16* dy, const bf16* x, size_t w, int N, int IC, int OC, int layer,
                       int linear);

  std::unique_ptr<CublasLt> cublas_;
  std::unique_ptr<Fp8Linears> fp8_;  // null in bf16
  std::vector<LayerActivations> layers_;
  bf16* output_ = nullptr;        // residual stream after the last layer [N, C]
  bf16* normf_ = nullptr;         // [N, C]
  float* normf_mean_ = nullptr;
  float* normf_rstd_ = nullptr;
  Scratch scratch_;
};

void UnfusedRunner::plan_buffers(ArenaPlan& plan) {
  const ModelConfig& c = config_;
  const size_t N = max_rows(), C = c.d_model, Q = c.qkv_dim(), F = c.d_ff, U = c.mlp_up_rows();
  const std::string saved = "activations saved for backward", scratch = "scratch";
  // A norm's output and the statistics its backward reads (the mean only for LayerNorm).
  const auto reserve_norm = [&](bf16** y, float** mean, float** rstd) {
    plan.reserve(y, N * C, saved);
    if (c.norm == Norm::Layer) plan.reserve(mean, N, saved);
    plan.reserve(rstd, N, saved);
  };
  layers_.assign(c.n_layer, LayerActivations{});
  for (LayerActivations& a : layers_) {
    plan.reserve(&a.input, N * C, saved);
    reserve_norm(&a.norm1, &a.norm1_mean, &a.norm1_rstd);
    plan.reserve(&a.qkv, N * Q, saved);
    plan.reserve(&a.attn, N * C, saved);
    plan.reserve(&a.lse, N * c.n_head, saved);
    plan.reserve(&a.mid, N * C, saved);
    reserve_norm(&a.norm2, &a.norm2_mean, &a.norm2_rstd);
    plan.reserve(&a.up, N * U, saved);
    plan.reserve(&a.act, N * F, saved);
  }
  plan.reserve(&output_, N * C, saved);
  reserve_norm(&normf_, &normf_mean_, &normf_rstd_);

  plan.reserve(&scratch_.proj, N * C, scratch);
  plan.reserve(&scratch_.d_residual, N * C, scratch);
  plan.reserve(&scratch_.d_norm, N * C, scratch);
  plan.reserve(&scratch_.d_attn, N * C, scratch);
  plan.reserve(&scratch_.d_qkv, N * Q, scratch);
  plan.reserve(&scratch_.d_act, N * F, scratch);
  if (c.mlp == Mlp::SwiGLU) plan.reserve(&scratch_.d_up, N * U, scratch);
  plan.reserve(reinterpret_cast<char**>(&scratch_.attention_workspace), attention_workspace_bytes(), scratch);
  const int max_cols = std::max({c.d_model, c.qkv_dim(), c.mlp_up_rows()});
  plan.reserve(&scratch_.norm_partials, unfused::norm_backward_partials_floats(c.d_model), scratch);
  plan.reserve(&scratch_.column_sums.partials, unfused::column_sum_partials_floats(max_cols), scratch);
  plan.reserve(&scratch_.column_sums.tickets, unfused::column_sum_tickets(max_cols), scratch);
  scratch_.column_sums.max_cols = max_cols;
  if (c.rope()) plan.reserve(&scratch_.rope_table, static_cast<size_t>(state_.max_seq_len()) * c.head_dim() / 2, scratch);
  if (fp8_ != nullptr) fp8_->plan(plan);
}

void UnfusedRunner::upload_tables() {
  if (fp8_ != nullptr) fp8_->upload_initial_scales();
  if (!config_.rope()) return;
  const std::vector<float2> table = unfused::rope_table(state_.max_seq_len(), config_.head_dim(), config_.rope_theta);
  CUDA_CHECK(cudaMemcpyAsync(scratch_.rope_table, table.data(), table.size() * sizeof(float2), cudaMemcpyHostToDevice,
                             stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

UnfusedRunner::bf16* UnfusedRunner::layer_output(int layer) const {
  return layer + 1 < config_.n_layer ? layers_[layer + 1].input : output_;
}

void UnfusedRunner::norm_forward(bf16* y, float* mean, float* rstd, const bf16* x, size_t w, size_t b, int N) {
  if (config_.norm == Norm::Layer)
    unfused::layernorm_forward(y, mean, rstd, x, weight(w), weight(b), N, config_.d_model, config_.norm_eps, stream_);
  else
    unfused::rmsnorm_forward(y, rstd, x, weight(w), N, config_.d_model, config_.norm_eps, stream_);
}

void UnfusedRunner::norm_backward(bf16* dx, const bf16* dy, const bf16* x, size_t w, size_t b, const float* mean,
                                  const float* rstd, int N, bool accumulate) {
  if (config_.norm == Norm::Layer)
    unfused::layernorm_backward(dx, grad(w), grad(b), dy, x, weight(w), mean, rstd, N, config_.d_model, accumulate,
                                scratch_.norm_partials, scratch_.column_sums, stream_);
  else
    unfused::rmsnorm_backward(dx, grad(w), dy, x, weight(w), rstd, N, config_.d_model, accumulate,
                              scratch_.norm_partials, scratch_.column_sums, stream_);
}

void UnfusedRunner::linear_forward(bf16* y, const bf16* x, size_t w, int N, int IC, int OC, int layer, int linear) {
  if (fp8_ != nullptr && fp8_->covers(linear)) return fp8_->forward(y, x, layer, linear, w, N, IC, OC, io.training);
  cublas_->gemm(y, x, Op::N, weight(w), Op::T, N, OC, IC, false, stream_);
}

void UnfusedRunner::linear_backward(bf16* dx, const bf16* dy, const bf16* x, size_t w, int N, int IC, int OC,
                                    int layer, int linear) {
  if (fp8_ != nullptr && fp8_->covers(linear)) return fp8_->backward(dx, dy, x, layer, linear, w, N, IC, OC);
  cublas_->gemm(dx, dy, Op::N, weight(w), Op::N, N, IC, OC, false, stream_);
  cublas_->gemm(grad(w), dy, Op::T, x, Op::N, OC, IC, N, true, stream_);
}

void UnfusedRunner::embedding_forward(int B, int T) {
  unfused::embedding_forward(layers_[0].input, io.tokens, weight(layout_.wte), weight(layout_.wpe), B, T,
                             config_.d_model, stream_);
}

// One block, forward (norm: LayerNorm or RMSNorm; each "+ b" where the model has that bias; RoPE with
// RoPE positions; act: GELU, or SwiGLU on the interleaved gate/up columns):
//   norm1 = norm(input);        qkv = RoPE(norm1 Wqkv^T + b);   attn = attention(qkv)
//   mid = input + (attn Wproj^T + b)
//   norm2 = norm(mid);          up = norm2 Wup^T + b;           act = act(up)
//   output = mid + (act Wdown^T + b)
// Every GEMM is one cuBLASLt call (no epilogue), every other operation one kernel of kernels/unfused/.
// Backward, d_residual carries the gradient of the residual stream from the top down; each norm
// backward adds its input gradient into it (the residual branch's gradient is the identity). Weight
// gradients accumulate into the fp32 gradient buffer straight from cuBLASLt (D fp32, beta = 1), bias
// gradients through column sums, so gradient accumulation over micro-batches costs nothing extra.
// The LM head's dlogits overwrite the logits in place (they are not needed afterwards).
void UnfusedRunner::block_forward(int layer, int B, int T) {
  const int N = B * T, C = config_.d_model, Q = config_.qkv_dim(), F = config_.d_ff, U = config_.mlp_up_rows();
  LayerActivations& a = layers_[layer];
  const LayerParams& p = layout_.layers[layer];
  bf16* proj = scratch_.proj;

  norm_forward(a.norm1, a.norm1_mean, a.norm1_rstd, a.input, p.norm1_w, p.norm1_b, N);
  linear_forward(a.qkv, a.norm1, p.qkv_w, N, C, Q, layer, 0);
  if (config_.qkv_bias) unfused::bias_add(a.qkv, weight(p.qkv_b), N, Q, stream_);
  if (config_.rope())
    unfused::rope(a.qkv, scratch_.rope_table, B, T, config_.n_head, config_.n_kv_head, config_.head_dim(), false,
                  stream_);
  attention_forward(a.attn, a.lse, a.qkv, attention_shape(B, T), stream_);
  linear_forward(proj, a.attn, p.attn_proj_w, N, C, C, layer, 1);
  if (config_.proj_bias) unfused::bias_add(proj, weight(p.attn_proj_b), N, C, stream_);
  unfused::residual_add(a.mid, a.input, proj, static_cast<size_t>(N) * C, stream_);

  norm_forward(a.norm2, a.norm2_mean, a.norm2_rstd, a.mid, p.norm2_w, p.norm2_b, N);
  linear_forward(a.up, a.norm2, p.mlp_up_w, N, C, U, layer, 2);
  if (config_.mlp_bias) unfused::bias_add(a.up, weight(p.mlp_up_b), N, U, stream_);
  if (config_.mlp == Mlp::Gelu)
    unfused::gelu_forward(a.act, a.up, static_cast<size_t>(N) * F, stream_);
  else
    unfused::swiglu_forward(a.act, a.up, N, F, stream_);
  linear_forward(proj, a.act, p.mlp_down_w, N, F, C, layer, 3);
  if (config_.mlp_bias) unfused::bias_add(proj, weight(p.mlp_down_b), N, C, stream_);
  unfused::residual_add(layer_output(layer), a.mid, proj, static_cast<size_t>(N) * C, stream_);
}

void UnfusedRunner::head_forward(int B, int T) {
  const int N = B * T;
  norm_forward(normf_, normf_mean_, normf_rstd_, output_, layout_.normf_w, layout_.normf_b, N);
  linear_forward(io.logits, normf_, layout_.head_weight(), N, config_.d_model, config_.padded_vocab(), 0, kFp8Head);
}

void UnfusedRunner::loss_forward(int B, int T) {
  unfused::crossentropy_forward(io.losses, io.logits_lse, io.logits, io.targets, B * T,
                                config_.vocab_size, config_.padded_vocab(), stream_);
}

void UnfusedRunner::head_backward(int B, int T, float dloss) {
  const int N = B * T, C = config_.d_model, V = config_.padded_vocab();
  unfused::crossentropy_backward(io.logits, io.logits, io.logits_lse, io.targets, dloss, N,
                                 config_.vocab_size, V, stream_);
  const bf16* dlogits = io.logits;
  linear_backward(scratch_.d_norm, dlogits, normf_, layout_.head_weight(), N, C, V, 0, kFp8Head);
  norm_backward(scratch_.d_residual, scratch_.d_norm, output_, layout_.normf_w, layout_.normf_b,
                normf_mean_, normf_rstd_, N, false);
}

void UnfusedRunner::block_backward(int layer, int B, int T) {
  const int N = B * T, C = config_.d_model, Q = config_.qkv_dim(), F = config_.d_ff, U = config_.mlp_up_rows();
  const LayerActivations& a = layers_[layer];
  const LayerParams& p = layout_.layers[layer];
  bf16* d_residual = scratch_.d_residual;  // holds the gradient of this layer's output

  linear_backward(scratch_.d_act, d_residual, a.act, p.mlp_down_w, N, F, C, layer, 3);
  if (config_.mlp_bias) unfused::column_sum(grad(p.mlp_down_b), d_residual, N, C, C, scratch_.column_sums, stream_);
  bf16* d_up = config_.mlp == Mlp::Gelu ? scratch_.d_act : scratch_.d_up;
  if (config_.mlp == Mlp::Gelu)
    unfused::gelu_backward(d_up, scratch_.d_act, a.up, static_cast<size_t>(N) * F, stream_);
  else
    unfused::swiglu_backward(d_up, scratch_.d_act, a.up, N, F, stream_);
  linear_backward(scratch_.d_norm, d_up, a.norm2, p.mlp_up_w, N, C, U, layer, 2);
  if (config_.mlp_bias) unfused::column_sum(grad(p.mlp_up_b), d_up, N, U, U, scratch_.column_sums, stream_);
  norm_backward(d_residual, scratch_.d_norm, a.mid, p.norm2_w, p.norm2_b, a.norm2_mean, a.norm2_rstd, N, true);

  linear_backward(scratch_.d_attn, d_residual, a.attn, p.attn_proj_w, N, C, C, layer, 1);
  if (config_.proj_bias) unfused::column_sum(grad(p.attn_proj_b), d_residual, N, C, C, scratch_.column_sums, stream_);
  attention_backward(scratch_.d_qkv, scratch_.d_attn, a.qkv, a.attn, a.lse, scratch_.attention_workspace,
                     attention_shape(B, T), stream_, nullptr, dq_sum());
  if (config_.rope())
    unfused::rope(scratch_.d_qkv, scratch_.rope_table, B, T, config_.n_head, config_.n_kv_head, config_.head_dim(),
                  true, stream_);
  linear_backward(scratch_.d_norm, scratch_.d_qkv, a.norm1, p.qkv_w, N, C, Q, layer, 0);
  if (config_.qkv_bias) unfused::column_sum(grad(p.qkv_b), scratch_.d_qkv, N, Q, Q, scratch_.column_sums, stream_);
  norm_backward(d_residual, scratch_.d_norm, a.input, p.norm1_w, p.norm1_b, a.norm1_mean, a.norm1_rstd, N, true);
}

void UnfusedRunner::embedding_backward(int B, int T) { embedding_backward_from(scratch_.d_residual, B, T); }

}  // namespace

std::unique_ptr<StepRunner> make_unfused_runner(DeviceState& state, const RunnerOptions& options) {
  return std::make_unique<UnfusedRunner>(state, options);
}

}  // namespace coda
