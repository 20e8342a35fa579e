// An architecture is a name for a set of model features plus what Hugging Face calls it: one file per
// architecture (gpt2.cpp, llama.cpp, qwen2.cpp) holds its features, the shapes it allows, its HF tensor
// names and its config.json in both directions. Nothing else in the trainer tests the architecture: the
// CPU reference, the backends and the checkpoint code read the features of ModelConfig (model.hpp).
// Adding a variant: docs/ARCHITECTURE.md, "Add a model variant".
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "model.hpp"
#include "models/hf_format.hpp"

namespace coda {

class Architecture {
 public:
  virtual ~Architecture() = default;
  virtual Arch arch() const = 0;
  virtual const char* name() const = 0;           // the config value: "gpt2"
  virtual const char* hf_model_type() const = 0;  // config.json's model_type
  // Sets the features of c (norm, MLP, positions, biases) to the architecture's.
  virtual void set_features(ModelConfig& c) const = 0;
  // Checks that c has the architecture's features and a shape it allows; throws std::invalid_argument.
  void validate(const ModelConfig& c) const;

  // config.json of a model, and the model config read back from one (validated by the caller).
  virtual nlohmann::json hf_config(const ModelConfig& c) const = 0;
  virtual ModelConfig from_hf_config(const JsonReader& in) const = 0;
  // Every tensor HF stores for the model, with the name prefix `prefix`.
  virtual std::vector<HfTensor> hf_tensors(const ModelConfig& c, const ParamLayout& layout,
                                           const std::string& prefix) const = 0;
  // The prefix of the tensor names: to write (stored == nullptr), or as found in a directory whose
  // tensors `stored` tells.
  virtual std::string tensor_prefix(const std::function<bool(const std::string&)>& stored) const {
    (void)stored;
    return "";
  }
  // Tensors a plain HF directory may hold that the model does not need (buffers such as causal masks or
  // rotary frequencies); a stored copy of a tied head is ignored by the caller.
  virtual bool ignorable_tensor(const std::string& name) const = 0;

 protected:
  // Shape rules of the architecture beyond ModelConfig's own (throws std::invalid_argument).
  virtual void validate_shape(const ModelConfig& c) const { (void)c; }
};

const Architecture& architecture(Arch arch);
// The architecture whose hf_model_type is model_type, or null.
const Architecture* architecture_for_hf(const std::string& model_type);
// Every architecture, in Arch order.
const std::vector<const Architecture*>& architectures();

// The architectures (one file each).
const Architecture& gpt2_architecture();
const Architecture& llama_architecture();
const Architecture& qwen2_architecture();

bool ends_with(const std::string& text, const std::string& suffix);

}  // namespace coda
