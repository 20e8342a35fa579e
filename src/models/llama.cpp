// Llama (RMSNorm, SwiGLU, RoPE, no biases) and the HF form the Llama family shares (llama_family.hpp).
// Mappings to HF's LlamaForCausalLM:
//  * q_proj and k_proj rows (and their biases, where the member has them) are permuted per head. We
//    rotate adjacent pairs (2i, 2i+1) by the frequency of pair i; HF rotates (i, i + hd/2) with the same
//    frequency, so within a head HF row half*(hd/2) + i is our row 2i + half. v_proj is a plain slice of
//    the qkv rows.
//  * Our interleaved SwiGLU rows (2j gate_j, 2j+1 up_j) become gate_proj (even rows) and up_proj (odd).
//  * Embeddings and an untied head are stored unpadded ([vocab_size, C]); on load the padded rows stay
//    zero. A tied head is not stored (HF ties lm_head.weight to the embedding itself).
//  * Only plain RoPE (rope_type "default") loads; HF's rotary inv_freq buffer is ignored.
#include <stdexcept>
#include <string>

#include "models/llama_family.hpp"

namespace coda {

nlohmann::json LlamaFamily::hf_config(const ModelConfig& c) const {
  const double theta = shortest_decimal(c.rope_theta);
  nlohmann::json json = {{"model_type", hf_model_type()},
                         {"architectures", {hf_class()}},
                         {"hidden_size", c.d_model},
                         {"intermediate_size", c.d_ff},
                         {"num_attention_heads", c.n_head},
                         {"num_key_value_heads", c.n_kv_head},
                         {"num_hidden_layers", c.n_layer},
                         {"head_dim", c.head_dim()},
                         {"rms_norm_eps", shortest_decimal(c.norm_eps)},
                         {"rope_theta", theta},  // transformers 4.x reads this key, 5.x rope_parameters
                         {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", theta}}},
                         {"max_position_embeddings", c.max_seq_len},
                         {"vocab_size", c.vocab_size},
                         {"tie_word_embeddings", c.tied_head},
                         {"hidden_act", "silu"},
                         {"attention_dropout", 0.0},
                         {"torch_dtype", "float32"}};
  add_hf_keys(c, json);
  return json;
}

ModelConfig LlamaFamily::from_hf_config(const JsonReader& in) const {
  ModelConfig c = model_config(arch());
  c.d_model = in.get_int("hidden_size");
  c.d_ff = in.get_int("intermediate_size");
  c.n_layer = in.get_int("num_hidden_layers");
  c.n_head = in.get_int("num_attention_heads");
  c.n_kv_head = in.get_int("num_key_value_heads", c.n_head);
  c.max_seq_len = in.get_int("max_position_embeddings");
  c.vocab_size = in.get_int("vocab_size");
  c.norm_eps = in.get_float("rms_norm_eps", 1e-6f);
  c.tied_head = in.get_bool("tie_word_embeddings", false);
  c.rope_theta = in.get_float("rope_theta", 10000.0f);
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!in.has(key)) continue;
    const nlohmann::json& rope = in.json.at(key);
    in.require(key, rope.is_object(), "must be an object");
    const JsonReader rope_in{rope, in.file + " (" + key + ")"};
    const std::string type = rope_in.get_string("rope_type", rope_in.get_string("type", "default"));
    in.require(key, type == "default", "has rope_type \"" + type + "\"; only plain RoPE (\"default\") is supported");
    c.rope_theta = rope_in.get_float("rope_theta", c.rope_theta);
  }
  in.require("head_dim", in.get_int("head_dim", c.d_model / c.n_head) * c.n_head == c.d_model,
             "must equal hidden_size / num_attention_heads");
  in.require("hidden_act", in.get_string("hidden_act", "silu") == "silu", "must be silu");
  check_hf_keys(in);
  return c;
}

std::vector<HfTensor> LlamaFamily::hf_tensors(const ModelConfig& c, const ParamLayout& layout,
                                              const std::string& prefix) const {
  const int64_t C = c.d_model, F = c.d_ff, hd = c.head_dim();
  const int64_t q_rows = c.n_head * hd, kv_rows = c.n_kv_head * hd;
  std::vector<HfTensor> list;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, size_t offset,
                 std::function<int64_t(int64_t)> source_row) {
    list.push_back({prefix + name, shape, offset, false, source_row});
  };
  // HF row r of a rotate-half projection whose heads start at our row `first`.
  auto rope_rows = [hd](int64_t first) {
    return [hd, first](int64_t r) {
      const int64_t head = r / hd, within = r % hd, half = within / (hd / 2), pair = within % (hd / 2);
      return first + head * hd + 2 * pair + half;
    };
  };
  auto v_rows = [=](int64_t r) { return q_rows + kv_rows + r; };
  add("model.embed_tokens.weight", {c.vocab_size, C}, layout.wte, identity_rows());
  for (int l = 0; l < c.n_layer; ++l) {
    const LayerParams& lp = layout.layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {C}, lp.norm1_w, identity_rows());
    add(p + "self_attn.q_proj.weight", {q_rows, C}, lp.qkv_w, rope_rows(0));
    add(p + "self_attn.k_proj.weight", {kv_rows, C}, lp.qkv_w, rope_rows(q_rows));
    add(p + "self_attn.v_proj.weight", {kv_rows, C}, lp.qkv_w, v_rows);
    if (c.qkv_bias) {
      add(p + "self_attn.q_proj.bias", {q_rows}, lp.qkv_b, rope_rows(0));
      add(p + "self_attn.k_proj.bias", {kv_rows}, lp.qkv_b, rope_rows(q_rows));
      add(p + "self_attn.v_proj.bias", {kv_rows}, lp.qkv_b, v_rows);
    }
    add(p + "self_attn.o_proj.weight", {C, C}, lp.attn_proj_w, identity_rows());
    add(p + "post_attention_layernorm.weight", {C}, lp.norm2_w, identity_rows());
    add(p + "mlp.gate_proj.weight", {F, C}, lp.mlp_up_w, [](int64_t r) { return 2 * r; });
    add(p + "mlp.up_proj.weight", {F, C}, lp.mlp_up_w, [](int64_t r) { return 2 * r + 1; });
    add(p + "mlp.down_proj.weight", {C, F}, lp.mlp_down_w, identity_rows());
  }
  add("model.norm.weight", {C}, layout.normf_w, identity_rows());
  if (!c.tied_head) add("lm_head.weight", {c.vocab_size, C}, layout.lm_head, identity_rows());
  return list;
}

bool LlamaFamily::ignorable_tensor(const std::string& name) const { return ends_with(name, ".rotary_emb.inv_freq"); }

namespace {

class Llama final : public LlamaFamily {
 public:
  Arch arch() const override { return Arch::Llama; }
  const char* name() const override { return "llama"; }
  const char* hf_model_type() const override { return "llama"; }
  void set_features(ModelConfig& c) const override {
    c.norm = Norm::RMS;
    c.mlp = Mlp::SwiGLU;
    c.positions = Positions::Rope;
    c.qkv_bias = c.proj_bias = c.mlp_bias = false;
  }

 protected:
  const char* hf_class() const override { return "LlamaForCausalLM"; }
  void add_hf_keys(const ModelConfig& c, nlohmann::json& json) const override {
    (void)c;
    json["attention_bias"] = false;
    json["mlp_bias"] = false;
  }
  void check_hf_keys(const JsonReader& in) const override {
    in.require("attention_bias", !in.get_bool("attention_bias", false), "must be false");
    in.require("mlp_bias", !in.get_bool("mlp_bias", false), "must be false");
  }
};

}  // namespace

const Architecture& llama_architecture() {
  static const Llama llama;
  return llama;
}

}  // namespace coda
