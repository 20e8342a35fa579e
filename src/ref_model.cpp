// The fp32 CPU reference model (see ref_model.hpp for the math) and the CPU backend built on it.
//
// Backward walks the forward in reverse with one residual-gradient buffer d_residual: every branch's
// backward ADDS its input gradient into it (the ref_ops convention), which is exactly the sum that
// the residual connection h_out = h_in + branch(norm(h_in)) asks for. Scratch gradients of branch
// internals are zeroed before each use. The tied LM head adds its weight gradient into dwte, on top of
// the embedding's scatter.
#include "ref_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "adamw.hpp"
#include "backend.hpp"
#include "ref_ops.hpp"

namespace coda::ref {

RefModel::RefModel(const ModelConfig& model_config, int max_batch, int max_seq_len)
    : config(model_config),
      layout(make_param_layout(model_config)),
      params(layout.total, 0.0f),
      grads(layout.total, 0.0f),
      max_batch_(max_batch),
      max_seq_len_(max_seq_len) {
  if (max_batch < 1) throw std::invalid_argument("RefModel: max_batch must be >= 1, got " + std::to_string(max_batch));
  if (max_seq_len < 1 || max_seq_len > config.max_seq_len)
    throw std::invalid_argument("RefModel: max_seq_len " + std::to_string(max_seq_len) + " outside [1, " +
                                std::to_string(config.max_seq_len) + "]");
  const size_t N = static_cast<size_t>(max_batch) * max_seq_len, C = config.d_model;
  const bool layer_norm = config.norm == Norm::Layer;
  // A norm's output and the statistics its backward reads (the mean only for LayerNorm).
  const auto size_norm = [&](std::vector<float>& y, std::vector<float>& mean, std::vector<float>& rstd) {
    y.resize(N * C);
    mean.resize(layer_norm ? N : 0);
    rstd.resize(N);
  };
  acts.layers.resize(config.n_layer);
  for (auto& layer : acts.layers) {
    layer.residual_in.resize(N * C);
    size_norm(layer.norm1, layer.norm1_mean, layer.norm1_rstd);
    layer.qkv.resize(N * config.qkv_dim());
    layer.attn_out.resize(N * C);
    layer.lse.resize(N * config.n_head);
    layer.residual_mid.resize(N * C);
    size_norm(layer.norm2, layer.norm2_mean, layer.norm2_rstd);
    layer.mlp_pre.resize(N * config.mlp_up_rows());
    layer.mlp_act.resize(N * config.d_ff);
  }
  acts.residual_final.resize(N * C);
  size_norm(acts.normf, acts.normf_mean, acts.normf_rstd);
  acts.logits.resize(N * config.padded_vocab());
  acts.losses.resize(N);
  d_residual_.resize(N * C);
  d_norm_.resize(N * C);
  d_qkv_.resize(N * config.qkv_dim());
  d_attn_out_.resize(N * C);
  d_mlp_pre_.resize(N * config.mlp_up_rows());
  d_mlp_act_.resize(N * config.d_ff);
  d_logits_.resize(N * config.padded_vocab());
}

void RefModel::init(uint64_t seed) { init_params(config, layout, seed, params.data()); }

void RefModel::zero_grad() { std::fill(grads.begin(), grads.end(), 0.0f); }

// The model's norm: LayerNorm (mean non-null) or RMSNorm.
static void norm_forward(const ModelConfig& c, float* y, float* mean, float* rstd, const float* x, const float* w,
                         const float* b, int N) {
  if (c.norm == Norm::Layer)
    layernorm_forward(y, mean, rstd, x, w, b, N, c.d_model, c.norm_eps);
  else
    rmsnorm_forward(y, rstd, x, w, N, c.d_model, c.norm_eps);
}

static void norm_backward(const ModelConfig& c, float* dx, float* dw, float* db, const float* dy, const float* x,
                          const float* w, const float* mean, const float* rstd, int N) {
  if (c.norm == Norm::Layer)
    layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, N, c.d_model);
  else
    rmsnorm_backward(dx, dw, dy, x, w, rstd, N, c.d_model);
}

void RefModel::enable_fp8(const Fp8Recipe& recipe) {
  fp8_scales_.clear();
  const Fp8Tensors tensors(config.n_layer, recipe);
  for (int t = 0; t < tensors.count() && recipe.any_tensor(); ++t)
    fp8_scales_.emplace_back(tensors.format(t), recipe.history, recipe.margin);
  fp8_copies_.assign(kFp8Linears * tensors.layers(), {});
  fp8_recipe_ = recipe;
  fp8_calibrated_ = false;
}

Fp8DelayedScale& RefModel::fp8_scale(Fp8Role role, int layer, int linear) {
  return fp8_scales_[fp8_tensors().index(role, layer, linear)];
}

void RefModel::fp8_end_step(int step) {
  for (Fp8DelayedScale& scale : fp8_scales_) scale.update(step);
  fp8_calibrated_ = !fp8_scales_.empty();
}

Fp8ScalingState RefModel::fp8_state() const {
  Fp8ScalingState state;
  if (!fp8_calibrated_) return state;
  state.history = fp8_recipe_.history;
  for (const Fp8DelayedScale& scale : fp8_scales_)
    state.amax.insert(state.amax.end(), scale.history().begin(), scale.history().end());
  return state;
}

void RefModel::load_fp8_state(const Fp8ScalingState& state) {
  if (!fp8_recipe_.any_tensor() && !state.empty())
    throw std::invalid_argument("fp8 scaling state of delayed scaling given to a run with fp8_scaling = block");
  check_fp8_state(state, fp8_scales_.empty() ? std::nullopt : std::optional<int>(fp8_recipe_.history), fp8_tensors());
  if (state.empty()) return;
  for (size_t t = 0; t < fp8_scales_.size(); ++t) fp8_scales_[t].restore(state.amax.data() + t * state.history);
  fp8_calibrated_ = true;
}

std::vector<float> RefModel::fp8_copy(const float* x, size_t n, Fp8Role role, int layer, int linear) {
  Fp8DelayedScale& scale = fp8_scale(role, layer, linear);
  if (fp8_recording_) {
    float amax = 0.0f;
    for (size_t i = 0; i < n; ++i) amax = std::isnan(x[i]) ? x[i] : std::max(amax, std::fabs(x[i]));
    scale.record(amax, fp8_tensors().name(fp8_tensors().index(role, layer, linear)));
  }
  if (!fp8_calibrated_) return std::vector<float>(x, x + n);
  const Fp8Format format = fp8_role_format(role);
  const float s = scale.scale();
  std::vector<float> copy(n);
  for (size_t i = 0; i < n; ++i) copy[i] = fp8_round(x[i] * s, format) / s;
  return copy;
}

std::vector<float> RefModel::fp8_block_copy(const float* x, int rows, int cols, int block_rows, int block_cols,
                                            Fp8Role role, int layer, int linear) const {
  std::vector<float> copy(static_cast<size_t>(rows) * cols);
  if (!coda::fp8_block_copy(copy.data(), x, rows, cols, block_rows, block_cols, Fp8Format::E4M3))
    throw std::runtime_error("fp8 block scaling: a value that is not finite in " +
                             fp8_tensors().name(fp8_tensors().index(role, layer, linear)));
  return copy;
}

void RefModel::linear_forward(int layer, int linear, float* y, const float* x, size_t w, size_t b, int N, int IC,
                              int OC) {
  if (!fp8_recipe_.covers(linear)) return matmul_forward(y, x, param(w), param(b), N, IC, OC);
  Fp8Copies& q = fp8_copies_[fp8_tensors().slot(layer, linear)];
  if (fp8_recipe_.block(linear)) {
    q.x = fp8_block_copy(x, N, IC, 1, kFp8Block, Fp8Role::Input, layer, linear);
    q.x_t = fp8_block_copy(x, N, IC, kFp8Block, 1, Fp8Role::Input, layer, linear);
    q.w = fp8_block_copy(param(w), OC, IC, kFp8Block, kFp8Block, Fp8Role::Weight, layer, linear);
    return matmul_forward(y, q.x.data(), q.w.data(), param(b), N, IC, OC);
  }
  q.x = fp8_copy(x, static_cast<size_t>(N) * IC, Fp8Role::Input, layer, linear);
  q.w = fp8_copy(param(w), static_cast<size_t>(OC) * IC, Fp8Role::Weight, layer, linear);
  matmul_forward(y, q.x.data(), q.w.data(), param(b), N, IC, OC);
}

void RefModel::linear_backward(int layer, int linear, float* dx, const float* dy, const float* x, size_t w, size_t b,
                               int N, int IC, int OC) {
  if (!fp8_recipe_.covers(linear)) return matmul_backward(dx, grad(w), grad(b), dy, x, param(w), N, IC, OC);
  const Fp8Copies& q = fp8_copies_[fp8_tensors().slot(layer, linear)];
  if (fp8_recipe_.block(linear)) {
    const std::vector<float> dy_rows = fp8_block_copy(dy, N, OC, 1, kFp8Block, Fp8Role::OutputGrad, layer, linear);
    const std::vector<float> dy_cols = fp8_block_copy(dy, N, OC, kFp8Block, 1, Fp8Role::OutputGrad, layer, linear);
    matmul_backward(dx, nullptr, nullptr, dy_rows.data(), nullptr, q.w.data(), N, IC, OC);
    matmul_backward(nullptr, grad(w), nullptr, dy_cols.data(), q.x_t.data(), q.w.data(), N, IC, OC);
  } else {
    const std::vector<float> dyq = fp8_copy(dy, static_cast<size_t>(N) * OC, Fp8Role::OutputGrad, layer, linear);
    matmul_backward(dx, grad(w), nullptr, dyq.data(), q.x.data(), q.w.data(), N, IC, OC);
  }
  if (b != kAbsent) matmul_backward(nullptr, nullptr, grad(b), dy, x, param(w), N, IC, OC);
}

float RefModel::forward(const int32_t* tokens, const int32_t* targets, int B, int T, bool training) {
  fp8_recording_ = training;
  if (B < 1 || B > max_batch_ || T < 1 || T > max_seq_len_)
    throw std::invalid_argument("RefModel::forward: shape B=" + std::to_string(B) + " T=" + std::to_string(T) +
                                " outside the limits B<=" + std::to_string(max_batch_) +
                                " T<=" + std::to_string(max_seq_len_));
  const int N = B * T, C = config.d_model, hd = config.head_dim(), NH = config.n_head, NKV = config.n_kv_head;
  const int F = config.d_ff, up_rows = config.mlp_up_rows(), V = config.vocab_size, Vp = config.padded_vocab();
  for (int n = 0; n < N; ++n)
    if (tokens[n] < 0 || tokens[n] >= V)
      throw std::invalid_argument("RefModel::forward: token " + std::to_string(tokens[n]) + " outside [0, " +
                                  std::to_string(V) + ")");
  B_ = B;
  T_ = T;
  tokens_.assign(tokens, tokens + N);
  have_targets_ = targets != nullptr;
  if (have_targets_) targets_.assign(targets, targets + N);

  embedding_forward(acts.layers[0].residual_in.data(), tokens, param(layout.wte), param(layout.wpe), B, T, C);
  for (int l = 0; l < config.n_layer; ++l) {
    const LayerParams& p = layout.layers[l];
    RefLayerActivations& a = acts.layers[l];
    norm_forward(config, a.norm1.data(), a.norm1_mean.data(), a.norm1_rstd.data(), a.residual_in.data(),
                 param(p.norm1_w), param(p.norm1_b), N);
    linear_forward(l, 0, a.qkv.data(), a.norm1.data(), p.qkv_w, p.qkv_b, N, C, config.qkv_dim());
    if (config.rope()) rope_forward(a.qkv.data(), B, T, NH, NKV, hd, config.rope_theta);
    attention_forward(a.attn_out.data(), a.lse.data(), a.qkv.data(), B, T, NH, NKV, hd);
    linear_forward(l, 1, a.residual_mid.data(), a.attn_out.data(), p.attn_proj_w, p.attn_proj_b, N, C, C);
    for (size_t i = 0; i < static_cast<size_t>(N) * C; ++i) a.residual_mid[i] += a.residual_in[i];

    norm_forward(config, a.norm2.data(), a.norm2_mean.data(), a.norm2_rstd.data(), a.residual_mid.data(),
                 param(p.norm2_w), param(p.norm2_b), N);
    linear_forward(l, 2, a.mlp_pre.data(), a.norm2.data(), p.mlp_up_w, p.mlp_up_b, N, C, up_rows);
    if (config.mlp == Mlp::Gelu)
      gelu_forward(a.mlp_act.data(), a.mlp_pre.data(), static_cast<size_t>(N) * F);
    else
      swiglu_forward(a.mlp_act.data(), a.mlp_pre.data(), N, F);
    float* residual_out = l + 1 < config.n_layer ? acts.layers[l + 1].residual_in.data() : acts.residual_final.data();
    linear_forward(l, 3, residual_out, a.mlp_act.data(), p.mlp_down_w, p.mlp_down_b, N, F, C);
    for (size_t i = 0; i < static_cast<size_t>(N) * C; ++i) residual_out[i] += a.residual_mid[i];
  }
  norm_forward(config, acts.normf.data(), acts.normf_mean.data(), acts.normf_rstd.data(), acts.residual_final.data(),
               param(layout.normf_w), param(layout.normf_b), N);
  linear_forward(0, kFp8Head, acts.logits.data(), acts.normf.data(), layout.head_weight(), kAbsent, N, C, Vp);
  if (!have_targets_) return std::numeric_limits<float>::quiet_NaN();
  crossentropy_forward(acts.losses.data(), acts.logits.data(), targets, N, V, Vp);
  double sum = 0.0;
  for (int n = 0; n < N; ++n) sum += acts.losses[n];
  return static_cast<float>(sum / N);
}

void RefModel::backward(float grad_scale) {
  fp8_recording_ = true;
  if (!have_targets_) throw std::logic_error("RefModel::backward: the last forward had no targets");
  const int B = B_, T = T_, N = B * T, C = config.d_model, hd = config.head_dim(), NH = config.n_head;
  const int NKV = config.n_kv_head, F = config.d_ff, up_rows = config.mlp_up_rows(), Vp = config.padded_vocab();
  auto zero = [N](std::vector<float>& buffer, int width) {
    std::fill(buffer.begin(), buffer.begin() + static_cast<size_t>(N) * width, 0.0f);
  };

  crossentropy_backward(d_logits_.data(), acts.logits.data(), targets_.data(), grad_scale / N, N, config.vocab_size,
                        Vp);
  zero(d_norm_, C);
  linear_backward(0, kFp8Head, d_norm_.data(), d_logits_.data(), acts.normf.data(), layout.head_weight(), kAbsent, N,
                  C, Vp);
  zero(d_residual_, C);
  norm_backward(config, d_residual_.data(), grad(layout.normf_w), grad(layout.normf_b), d_norm_.data(),
                acts.residual_final.data(), param(layout.normf_w), acts.normf_mean.data(), acts.normf_rstd.data(), N);

  for (int l = config.n_layer - 1; l >= 0; --l) {
    const LayerParams& p = layout.layers[l];
    const RefLayerActivations& a = acts.layers[l];
    // MLP block: d_residual is the gradient of its output, and passes through to residual_mid.
    zero(d_mlp_act_, F);
    linear_backward(l, 3, d_mlp_act_.data(), d_residual_.data(), a.mlp_act.data(), p.mlp_down_w, p.mlp_down_b, N, F,
                    C);
    zero(d_mlp_pre_, up_rows);
    if (config.mlp == Mlp::Gelu)
      gelu_backward(d_mlp_pre_.data(), d_mlp_act_.data(), a.mlp_pre.data(), static_cast<size_t>(N) * F);
    else
      swiglu_backward(d_mlp_pre_.data(), d_mlp_act_.data(), a.mlp_pre.data(), N, F);
    zero(d_norm_, C);
    linear_backward(l, 2, d_norm_.data(), d_mlp_pre_.data(), a.norm2.data(), p.mlp_up_w, p.mlp_up_b, N, C, up_rows);
    norm_backward(config, d_residual_.data(), grad(p.norm2_w), grad(p.norm2_b), d_norm_.data(), a.residual_mid.data(),
                  param(p.norm2_w), a.norm2_mean.data(), a.norm2_rstd.data(), N);
    // Attention block: d_residual is now the gradient of residual_mid.
    zero(d_attn_out_, C);
    linear_backward(l, 1, d_attn_out_.data(), d_residual_.data(), a.attn_out.data(), p.attn_proj_w, p.attn_proj_b, N,
                    C, C);
    zero(d_qkv_, config.qkv_dim());
    attention_backward(d_qkv_.data(), d_attn_out_.data(), a.qkv.data(), a.attn_out.data(), a.lse.data(), B, T, NH, NKV,
                       hd);
    if (config.rope()) rope_backward(d_qkv_.data(), B, T, NH, NKV, hd, config.rope_theta);
    zero(d_norm_, C);
    linear_backward(l, 0, d_norm_.data(), d_qkv_.data(), a.norm1.data(), p.qkv_w, p.qkv_b, N, C, config.qkv_dim());
    norm_backward(config, d_residual_.data(), grad(p.norm1_w), grad(p.norm1_b), d_norm_.data(), a.residual_in.data(),
                  param(p.norm1_w), a.norm1_mean.data(), a.norm1_rstd.data(), N);
  }
  embedding_backward(grad(layout.wte), grad(layout.wpe), d_residual_.data(), tokens_.data(), B, T, C);
}

}  // namespace coda::ref

namespace coda {

namespace {

// The Backend interface over RefModel, with the AdamW moments beside it.
class CpuBackend final : public Backend {
 public:
  CpuBackend(const ModelConfig& config, int max_batch, int max_seq_len, const std::optional<Fp8Recipe>& fp8)
      : model_(config, max_batch, max_seq_len), m_(model_.layout.total, 0.0f), v_(model_.layout.total, 0.0f),
        fp8_(fp8) {
    if (fp8) model_.enable_fp8(*fp8);
  }

  std::string name() const override { return fp8_ ? std::string("cpu-") + fp8_->name() : "cpu"; }

  void load_params(const float* params) override { std::copy_n(params, total(), model_.params.data()); }
  void read_params(float* params) override { std::copy_n(model_.params.data(), total(), params); }
  void load_optimizer_state(const float* m, const float* v) override {
    std::copy_n(m, total(), m_.data());
    std::copy_n(v, total(), v_.data());
  }
  void read_optimizer_state(float* m, float* v) override {
    std::copy_n(m_.data(), total(), m);
    std::copy_n(v_.data(), total(), v);
  }
  void read_grads(float* grads) override { std::copy_n(model_.grads.data(), total(), grads); }
  void zero_grad() override { model_.zero_grad(); }

  float forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T, float grad_scale) override {
    const float loss = model_.forward(tokens, targets, B, T, true);
    model_.backward(grad_scale);
    return loss;
  }
  float forward_loss(const int32_t* tokens, const int32_t* targets, int B, int T) override {
    return model_.forward(tokens, targets, B, T);
  }
  void last_logits(const int32_t* tokens, int B, int T, float* out) override {
    model_.forward(tokens, nullptr, B, T);
    const int V = model_.config.vocab_size, Vp = model_.config.padded_vocab();
    for (int b = 0; b < B; ++b)
      std::copy_n(model_.acts.logits.data() + (static_cast<size_t>(b) * T + T - 1) * Vp, V,
                  out + static_cast<size_t>(b) * V);
  }

  float grad_norm() override {
    double sum = 0.0;
    for (float g : model_.grads) sum += static_cast<double>(g) * g;
    return static_cast<float>(std::sqrt(sum));
  }
  void adamw_step(const AdamWHyper& hyper, int step, float grad_scale) override {
    if (fp8_) model_.fp8_end_step(step - 1);
    adamw_update(model_.layout, model_.params.data(), model_.grads.data(), m_.data(), v_.data(), hyper, step,
                 grad_scale);
  }
  Fp8ScalingState read_fp8_state() override { return model_.fp8_state(); }
  void load_fp8_state(const Fp8ScalingState& state) override { model_.load_fp8_state(state); }

 private:
  size_t total() const { return model_.layout.total; }

  ref::RefModel model_;
  std::vector<float> m_, v_;
  std::optional<Fp8Recipe> fp8_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const ModelConfig& config, int max_batch, int max_seq_len,
                                          const std::optional<Fp8Recipe>& fp8) {
  return std::make_unique<CpuBackend>(config, max_batch, max_seq_len, fp8);
}

}  // namespace coda
