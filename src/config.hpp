// Run configuration: every key of a config file is also a command-line flag of the same name, and the
// command line wins. Config files are TOML-style (CLI11's reader): `key = value` lines, optionally
// grouped under [model], [data], [optim], [run] sections; a key under the wrong section, an unknown
// key, a value of the wrong type or out of range is an error that names the key and the file.
#pragma once
#include <cstdint>
#include <string>

#include "model.hpp"

namespace CLI {
class App;
}

namespace coda {

struct RunConfig {
  ModelConfig model;

  // [data]
  std::string train_data = "data/synthetic/train_*.bin";  // glob of token shards
  std::string val_data = "data/synthetic/val_*.bin";      // empty: no validation
  int batch_size = 8;    // sequences per micro-batch (per GPU)
  int seq_len = 64;
  int grad_accum = 1;    // micro-batches per optimizer step

  // [optim]
  int steps = 200;
  float lr = 1e-3f;
  float min_lr_ratio = 0.1f;  // cosine decays to lr * min_lr_ratio
  int warmup_steps = 20;
  float weight_decay = 0.1f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float adam_eps = 1e-8f;
  float grad_clip = 1.0f;     // 0 disables clipping

  // [run]
  std::string device = "auto";   // auto | cpu | cuda
  std::string kernels = "auto";  // auto | coda | unfused (cuda only)
  std::string out = "runs/default";
  uint64_t seed = 1337;
  int log_every = 10;
  int val_every = 100;           // 0: never
  int val_batches = 8;
  int checkpoint_every = 0;      // 0: only at the end
  std::string resume;            // checkpoint directory to continue from

  // Throws std::invalid_argument naming the key when a value is out of range or inconsistent.
  void validate() const;
};

// Registers every key of RunConfig as an option of `app` (with its default shown in --help).
void add_config_options(CLI::App& app, RunConfig& config);

// The effective configuration as a config file that load_config_file() reads back.
std::string config_to_toml(const RunConfig& config);

}  // namespace coda
