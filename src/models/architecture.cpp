// The table of architectures and what every architecture shares: the feature check of validate, the
// name lookups, and ModelConfig::set_arch.
#include "models/architecture.hpp"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace coda {

namespace {

const char* norm_name(Norm norm) { return norm == Norm::Layer ? "LayerNorm" : "RMSNorm"; }
const char* mlp_name(Mlp mlp) { return mlp == Mlp::Gelu ? "GELU" : "SwiGLU"; }
const char* positions_name(Positions positions) { return positions == Positions::Learned ? "learned" : "RoPE"; }
const char* yes_no(bool flag) { return flag ? "with" : "without"; }

}  // namespace

const std::vector<const Architecture*>& architectures() {
  static const std::vector<const Architecture*> table = {&gpt2_architecture(), &llama_architecture(),
                                                         &qwen2_architecture()};
  return table;
}

const Architecture& architecture(Arch arch) {
  for (const Architecture* a : architectures())
    if (a->arch() == arch) return *a;
  throw std::logic_error("architecture: unknown Arch value " + std::to_string(static_cast<int>(arch)));
}

const Architecture* architecture_for_hf(const std::string& model_type) {
  for (const Architecture* a : architectures())
    if (model_type == a->hf_model_type()) return a;
  return nullptr;
}

void Architecture::validate(const ModelConfig& c) const {
  ModelConfig expected = c;
  set_features(expected);
  const std::string arch = name();
  auto require = [&](bool same, const std::string& feature, const std::string& got, const std::string& want) {
    if (!same)
      throw std::invalid_argument("arch " + arch + " has " + want + " " + feature + ", but the model config has " +
                                  got);
  };
  require(c.norm == expected.norm, "norms", norm_name(c.norm), norm_name(expected.norm));
  require(c.mlp == expected.mlp, "MLP", mlp_name(c.mlp), mlp_name(expected.mlp));
  require(c.positions == expected.positions, "positions", positions_name(c.positions),
          positions_name(expected.positions));
  require(c.qkv_bias == expected.qkv_bias, "QKV bias", yes_no(c.qkv_bias), yes_no(expected.qkv_bias));
  require(c.proj_bias == expected.proj_bias, "output-projection bias", yes_no(c.proj_bias),
          yes_no(expected.proj_bias));
  require(c.mlp_bias == expected.mlp_bias, "MLP biases", yes_no(c.mlp_bias), yes_no(expected.mlp_bias));
  validate_shape(c);
}

void ModelConfig::set_arch(Arch a) {
  arch = a;
  architecture(a).set_features(*this);
}

ModelConfig model_config(Arch arch) {
  ModelConfig c;
  c.set_arch(arch);
  return c;
}

const char* arch_name(Arch arch) { return architecture(arch).name(); }

Arch parse_arch(const std::string& name) {
  std::string known;
  for (const Architecture* a : architectures()) {
    if (name == a->name()) return a->arch();
    known += std::string(known.empty() ? "" : ", ") + "\"" + a->name() + "\"";
  }
  throw std::invalid_argument("arch: expected one of " + known + ", got \"" + name + "\"");
}

double shortest_decimal(float value) {
  for (int precision = 1; precision <= 9; ++precision) {
    char text[32];
    std::snprintf(text, sizeof text, "%.*g", precision, static_cast<double>(value));
    const double parsed = std::strtod(text, nullptr);
    if (static_cast<float>(parsed) == value) return parsed;
  }
  return value;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace coda
