// What Llama and the architectures built like it (Qwen2) share: RMSNorm, SwiGLU, RoPE, grouped-query
// attention, a tied or untied head, and HF's LlamaForCausalLM naming (model.layers.N.self_attn.q_proj
// ...), config.json keys and rotate-half RoPE. A member of the family adds its own features and keys.
#pragma once
#include "models/architecture.hpp"

namespace coda {

class LlamaFamily : public Architecture {
 public:
  nlohmann::json hf_config(const ModelConfig& c) const override;
  ModelConfig from_hf_config(const JsonReader& in) const override;
  std::vector<HfTensor> hf_tensors(const ModelConfig& c, const ParamLayout& layout,
                                   const std::string& prefix) const override;
  bool ignorable_tensor(const std::string& name) const override;

 protected:
  virtual const char* hf_class() const = 0;  // "LlamaForCausalLM"
  // The member's own config.json keys: written (added to `json`) and checked on read.
  virtual void add_hf_keys(const ModelConfig& c, nlohmann::json& json) const = 0;
  virtual void check_hf_keys(const JsonReader& in) const = 0;
};

}  // namespace coda
