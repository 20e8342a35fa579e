// Parameter layout and initialisation; see model.hpp for the conventions.
#include "model.hpp"

#include <cmath>
#include <stdexcept>

#include "models/architecture.hpp"


namespace coda {

void ModelConfig::validate() const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  require(n_layer >= 1, "n_layer must be >= 1");
  require(d_model >= 1, "d_model must be >= 1");
  require(n_head >= 1, "n_head must be >= 1");
  require(d_model % n_head == 0, "d_model (" + std::to_string(d_model) + ") must be divisible by n_head (" +
                                     std::to_string(n_head) + ")");
  require(head_dim() % 2 == 0, "head_dim = d_model / n_head must be even");
  require(n_kv_head >= 1 && n_head % n_kv_head == 0,
          "n_kv_head (" + std::to_string(n_kv_head) + ") must divide n_head (" + std::to_string(n_head) + ")");
  require(d_ff >= 1, "d_ff must be >= 1");
  require(vocab_size >= 2, "vocab_size must be >= 2");
  require(max_seq_len >= 1, "max_seq_len must be >= 1");
  require(rope_theta > 0.0f, "rope_theta must be > 0");
  require(norm_eps > 0.0f, "norm_eps must be > 0");
  architecture(arch).validate(*this);
}

const ParamTensor& ParamLayout::find(const std::string& name) const {
  for (const auto& tensor : tensors)
    if (tensor.name == name) return tensor;
  throw std::out_of_range("no parameter tensor named " + name);
}

size_t ParamLayout::num_parameters() const {
  size_t n = 0;
  for (const auto& tensor : tensors) n += tensor.numel;
  return n;
}

ParamLayout make_param_layout(const ModelConfig& c) {
  c.validate();
  ParamLayout layout;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool decay) {
    ParamTensor tensor{name, shape, layout.total, 1, decay};
    for (int64_t extent : shape) tensor.numel *= static_cast<size_t>(extent);
    layout.total += (tensor.numel + kParamAlign - 1) / kParamAlign * kParamAlign;
    layout.tensors.push_back(tensor);
    return tensor.offset;
  };
  const int64_t C = c.d_model, V = c.padded_vocab(), F = c.d_ff;
  const int64_t U = c.mlp_up_rows();
  layout.wte = add("wte", {V, C}, false);
  if (!c.rope()) layout.wpe = add("wpe", {c.max_seq_len, C}, false);
  for (int l = 0; l < c.n_layer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    LayerParams lp;
    lp.norm1_w = add(p + "norm1_w", {C}, false);
    if (c.norm_bias()) lp.norm1_b = add(p + "norm1_b", {C}, false);
    lp.qkv_w = add(p + "qkv_w", {c.qkv_dim(), C}, true);
    if (c.qkv_bias) lp.qkv_b = add(p + "qkv_b", {c.qkv_dim()}, false);
    lp.attn_proj_w = add(p + "attn_proj_w", {C, C}, true);
    if (c.proj_bias) lp.attn_proj_b = add(p + "attn_proj_b", {C}, false);
    lp.norm2_w = add(p + "norm2_w", {C}, false);
    if (c.norm_bias()) lp.norm2_b = add(p + "norm2_b", {C}, false);
    lp.mlp_up_w = add(p + "mlp_up_w", {U, C}, true);
    if (c.mlp_bias) lp.mlp_up_b = add(p + "mlp_up_b", {U}, false);
    lp.mlp_down_w = add(p + "mlp_down_w", {C, F}, true);
    if (c.mlp_bias) lp.mlp_down_b = add(p + "mlp_down_b", {C}, false);
    layout.layers.push_back(lp);
  }
  layout.normf_w = add("normf_w", {C}, false);
  if (c.norm_bias()) layout.normf_b = add("normf_b", {C}, false);
  if (!c.tied_head) layout.lm_head = add("lm_head", {V, C}, true);
  return layout;
}

namespace {

uint64_t mix64(uint64_t z) {  // splitmix64's finalizer: a bijection that scatters every input bit
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// N(0, 1) for element `index` of the stream `key`: Box-Muller over two uniforms hashed from the counter,
// so every element is a function of (seed, tensor, index) alone and the tensors fill in parallel with
// the same values on any number of threads.
float counter_normal(uint64_t key, uint64_t index) {
  const uint64_t a = mix64(key + 2 * index * 0x9E3779B97F4A7C15ull), b = mix64(a ^ (key + 0x632BE59BD9B4E019ull));
  const double u1 = (static_cast<double>(a >> 11) + 0.5) * 0x1.0p-53;  // (0, 1): log(u1) is finite
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace

void init_params(const ModelConfig& c, const ParamLayout& layout, uint64_t seed, float* params) {
  const float residual_std = 0.02f / std::sqrt(2.0f * static_cast<float>(c.n_layer));
  const long long total = static_cast<long long>(layout.total);
#pragma omp parallel for schedule(static)
  for (long long i = 0; i < total; ++i) params[i] = 0.0f;
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const auto& tensor = layout.tensors[t];
    float* p = params + tensor.offset;
    const std::string& name = tensor.name;
    if (ends_with(name, "_b")) continue;  // biases start at zero
    if (ends_with(name, "norm1_w") || ends_with(name, "norm2_w") || name == "normf_w") {
      for (size_t i = 0; i < tensor.numel; ++i) p[i] = 1.0f;
      continue;
    }
    const float stddev = (ends_with(name, "attn_proj_w") || ends_with(name, "mlp_down_w")) ? residual_std : 0.02f;
    // Embedding-shaped tensors: only the real vocabulary rows are drawn; padded rows stay zero.
    const size_t rows_drawn = (name == "wte" || name == "lm_head")
                                  ? static_cast<size_t>(c.vocab_size)
                                  : static_cast<size_t>(tensor.shape[0]);
    const size_t cols = tensor.shape.size() > 1 ? static_cast<size_t>(tensor.shape[1]) : 1;
    const uint64_t key = mix64(seed * 0x9E3779B97F4A7C15ull + mix64(t + 1));
    const long long drawn = static_cast<long long>(rows_drawn * cols);
#pragma omp parallel for schedule(static)
    for (long long i = 0; i < drawn; ++i) p[i] = counter_normal(key, static_cast<uint64_t>(i)) * stddev;
  }
}

double flops_per_token(const ModelConfig& c, int seq_len) {
  const ParamLayout layout = make_param_layout(c);
  double matmul_params = 0.0;  // every 2-D tensor used as a matmul: wpe never, wte only as the tied head
  for (const auto& tensor : layout.tensors)
    if (tensor.shape.size() == 2 && tensor.name != "wpe" && (tensor.name != "wte" || c.tied_head))
      matmul_params += static_cast<double>(tensor.numel);
  const double attention = static_cast<double>(c.n_layer) * seq_len * c.d_model;  // causal: QK^T + PV halved
  return 6.0 * matmul_params + 6.0 * attention;
}

}  // namespace coda
