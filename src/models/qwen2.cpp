// Qwen2 (and Qwen2.5): a member of the Llama family (llama_family.hpp) with a bias on q, k and v, none
// elsewhere, RoPE theta 1e6 in the released models, a tied head in the small ones. HF class
// Qwen2ForCausalLM, model_type "qwen2"; the q and k biases are permuted per head like their weight rows.
// Sliding-window attention (use_sliding_window) is not supported: the released models have it off.
#include "models/llama_family.hpp"

namespace coda {

namespace {

class Qwen2 final : public LlamaFamily {
 public:
  Arch arch() const override { return Arch::Qwen2; }
  const char* name() const override { return "qwen2"; }
  const char* hf_model_type() const override { return "qwen2"; }
  void set_features(ModelConfig& c) const override {
    c.norm = Norm::RMS;
    c.mlp = Mlp::SwiGLU;
    c.positions = Positions::Rope;
    c.qkv_bias = true;
    c.proj_bias = c.mlp_bias = false;
  }

 protected:
  const char* hf_class() const override { return "Qwen2ForCausalLM"; }
  void add_hf_keys(const ModelConfig& c, nlohmann::json& json) const override {
    json["use_sliding_window"] = false;
    json["sliding_window"] = c.max_seq_len;
    json["max_window_layers"] = c.n_layer;
  }
  void check_hf_keys(const JsonReader& in) const override {
    in.require("use_sliding_window", !in.get_bool("use_sliding_window", false),
               "must be false (sliding-window attention is not supported)");
  }
};

}  // namespace

const Architecture& qwen2_architecture() {
  static const Qwen2 qwen2;
  return qwen2;
}

}  // namespace coda
