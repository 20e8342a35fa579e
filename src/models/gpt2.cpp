// GPT-2: LayerNorm, biases on every projection, GELU, learned positions, the head tied to the token
// embedding, multi-head attention (n_kv_head = n_head). HF class GPT2LMHeadModel: its Conv1D keeps the
// weights as [in, out], so c_attn, c_proj, c_fc and mlp.c_proj are our [out, in] matrices transposed; its
// q/k/v split and head order match our packed qkv rows already. Files from transformers name the tensors
// transformer.*; the original OpenAI conversion has no prefix (both load). The causal-mask buffers
// attn.bias / attn.masked_bias that old files carry are ignored.
#include <stdexcept>
#include <string>

#include "models/architecture.hpp"

namespace coda {

namespace {

class Gpt2 final : public Architecture {
 public:
  Arch arch() const override { return Arch::GPT2; }
  const char* name() const override { return "gpt2"; }
  const char* hf_model_type() const override { return "gpt2"; }

  void set_features(ModelConfig& c) const override {
    c.norm = Norm::Layer;
    c.mlp = Mlp::Gelu;
    c.positions = Positions::Learned;
    c.qkv_bias = c.proj_bias = c.mlp_bias = true;
  }

  nlohmann::json hf_config(const ModelConfig& c) const override {
    return {{"model_type", "gpt2"},
            {"architectures", {"GPT2LMHeadModel"}},
            {"n_embd", c.d_model},
            {"n_layer", c.n_layer},
            {"n_head", c.n_head},
            {"n_positions", c.max_seq_len},
            {"n_ctx", c.max_seq_len},
            {"vocab_size", c.vocab_size},
            {"n_inner", c.d_ff},
            {"activation_function", "gelu_new"},
            {"layer_norm_epsilon", shortest_decimal(c.norm_eps)},
            {"tie_word_embeddings", true},
            {"bos_token_id", c.vocab_size - 1},
            {"eos_token_id", c.vocab_size - 1},
            {"attn_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"resid_pdrop", 0.0},
            {"torch_dtype", "float32"}};
  }

  ModelConfig from_hf_config(const JsonReader& in) const override {
    ModelConfig c = model_config(Arch::GPT2);
    c.d_model = in.get_int("n_embd");
    c.n_layer = in.get_int("n_layer");
    c.n_head = in.get_int("n_head");
    c.n_kv_head = c.n_head;
    c.max_seq_len = in.get_int("n_positions");
    c.vocab_size = in.get_int("vocab_size");
    c.d_ff = in.get_int("n_inner", 4 * c.d_model);
    c.norm_eps = in.get_float("layer_norm_epsilon", 1e-5f);
    const std::string activation = in.get_string("activation_function", "gelu_new");
    in.require("activation_function", activation == "gelu_new" || activation == "gelu_pytorch_tanh",
               "must be gelu_new (GELU, tanh approximation), got " + activation);
    in.require("tie_word_embeddings", in.get_bool("tie_word_embeddings", true), "must be true for gpt2");
    in.require("scale_attn_weights", in.get_bool("scale_attn_weights", true), "must be true (scores / sqrt(hd))");
    in.require("scale_attn_by_inverse_layer_idx", !in.get_bool("scale_attn_by_inverse_layer_idx", false),
               "must be false");
    c.tied_head = true;
    return c;
  }

  std::vector<HfTensor> hf_tensors(const ModelConfig& c, const ParamLayout& layout,
                                   const std::string& prefix) const override {
    const int64_t C = c.d_model, F = c.d_ff, QKV = c.qkv_dim();
    std::vector<HfTensor> list;
    auto rows = [&](const std::string& name, std::vector<int64_t> shape, size_t offset) {
      list.push_back({prefix + name, shape, offset, false, identity_rows()});
    };
    auto conv1d = [&](const std::string& name, int64_t in, int64_t out, size_t offset) {
      list.push_back({prefix + name, {in, out}, offset, true, nullptr});
    };
    rows("wte.weight", {c.vocab_size, C}, layout.wte);
    rows("wpe.weight", {c.max_seq_len, C}, layout.wpe);
    for (int l = 0; l < c.n_layer; ++l) {
      const LayerParams& lp = layout.layers[l];
      const std::string h = "h." + std::to_string(l) + ".";
      rows(h + "ln_1.weight", {C}, lp.norm1_w);
      rows(h + "ln_1.bias", {C}, lp.norm1_b);
      conv1d(h + "attn.c_attn.weight", C, QKV, lp.qkv_w);
      rows(h + "attn.c_attn.bias", {QKV}, lp.qkv_b);
      conv1d(h + "attn.c_proj.weight", C, C, lp.attn_proj_w);
      rows(h + "attn.c_proj.bias", {C}, lp.attn_proj_b);
      rows(h + "ln_2.weight", {C}, lp.norm2_w);
      rows(h + "ln_2.bias", {C}, lp.norm2_b);
      conv1d(h + "mlp.c_fc.weight", C, F, lp.mlp_up_w);
      rows(h + "mlp.c_fc.bias", {F}, lp.mlp_up_b);
      conv1d(h + "mlp.c_proj.weight", F, C, lp.mlp_down_w);
      rows(h + "mlp.c_proj.bias", {C}, lp.mlp_down_b);
    }
    rows("ln_f.weight", {C}, layout.normf_w);
    rows("ln_f.bias", {C}, layout.normf_b);
    return list;
  }

  std::string tensor_prefix(const std::function<bool(const std::string&)>& stored) const override {
    if (stored && stored("wte.weight") && !stored("transformer.wte.weight")) return "";
    return "transformer.";
  }

  bool ignorable_tensor(const std::string& name) const override {
    return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias");
  }

 protected:
  void validate_shape(const ModelConfig& c) const override {
    if (c.n_kv_head != c.n_head) throw std::invalid_argument("n_kv_head must equal n_head for gpt2");
    if (!c.tied_head) throw std::invalid_argument("tied_head must be true for gpt2");
  }
};

}  // namespace

const Architecture& gpt2_architecture() {
  static const Gpt2 gpt2;
  return gpt2;
}

}  // namespace coda
