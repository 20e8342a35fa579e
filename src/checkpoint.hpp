// Checkpoints. A checkpoint is a directory that Hugging Face transformers loads as it is:
//   config.json          GPT2LMHeadModel / LlamaForCausalLM names, unpadded vocabulary
//   model.safetensors    fp32 weights in HF names and layouts (GPT-2 Conv1D matrices transposed, Llama q/k
//                        rows permuted to HF's rotate-half RoPE convention, gate/up split, vocab unpadded)
//   trainer_state.json   step, data-loader position, RNG state, the effective run config, and in FP8 the
//                        amax histories of delayed scaling
//   optimizer.safetensors  fp32 master weights and AdamW moments in the trainer's flat layout
// It is written atomically: everything goes to DIR.tmp, then DIR.tmp is renamed to DIR (an older DIR is
// replaced only after the new one is complete).

#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fp8.hpp"
#include "model.hpp"

namespace coda {

struct TrainerState {
  int step = 0;                     // optimizer steps completed
  nlohmann::json data_position;     // DataLoader::position()
  std::array<uint64_t, 4> rng{};    // Rng::state()
  std::string run_config;           // config_to_toml() of the run that wrote it
  Fp8ScalingState fp8;              // empty for a bf16 run
};

struct Checkpoint {
  ModelConfig model;
  std::vector<float> params;        // flat, ParamLayout order (padded vocab rows zero)
  bool has_trainer_state = false;   // false for a bare HF model directory
  std::vector<float> adam_m, adam_v;
  TrainerState state;
};

void save_checkpoint(const std::string& dir, const ModelConfig& model, const float* params, const float* adam_m,
                     const float* adam_v, const TrainerState& state);
// Loads a directory written by save_checkpoint, or a plain HF GPT-2 / Llama directory (F32, BF16 or F16
// safetensors; then has_trainer_state is false). Throws std::runtime_error naming the file on any error.
Checkpoint load_checkpoint(const std::string& dir);
// The model shape of a checkpoint or HF directory (its config.json alone), validated.
ModelConfig load_model_config(const std::string& dir);

}  // namespace coda
