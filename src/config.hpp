// Run configuration: every key of a config file is also a command-line flag of the same name, and the
// command line wins. Config files are TOML-style (CLI11's reader): `key = value` lines, optionally
// grouped under [model], [data], [optim], [run] sections; a key under the wrong section, an unknown
// key, a value of the wrong type or out of range is an error that names the key and the file.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp8.hpp"
#include "model.hpp"

namespace CLI {
class App;
}

namespace coda {

struct RunConfig {
  ModelConfig model;

  // [data]
  std::string train_data = "data/synthetic/train_*.bin";  // glob of token shards
  std::string val_data = "auto";  // glob; auto: the val shards beside train_data; empty: no validation
  int batch_size = 8;    // sequences per micro-batch (per GPU)
  int seq_len = 64;
  int grad_accum = 1;    // micro-batches per optimizer step
  int global_batch = 0;  // sequences per optimizer step over all ranks; 0: ranks x batch_size x grad_accum.
                         // Set, it fixes the step whatever the number of GPUs: grad_accum follows from it
                         // (batch_plan in train.hpp) and must be left at 1.

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
  std::string precision = "bf16";  // bf16 | fp8 (the block linears in FP8, docs/FP8.md; unfused mode)
  int fp8_history = 16;          // fp8: steps of amax history behind each scale
  int fp8_margin = 0;            // fp8: powers of two of headroom below the format's largest value
  std::string fp8_linears = "qkv,attn_proj,mlp_up,mlp_down";  // fp8: the linears run in FP8 (lm_head too if named)
  std::string fp8_scaling = "tensor";  // fp8: tensor | block | the linears with block scales (parse_fp8_scaling)
  bool deterministic = false;    // cuda: every sum in a fixed order, bitwise reproducible steps (slower)
  std::string out = "runs/default";
  uint64_t seed = 1337;
  int log_every = 10;
  int val_every = 100;           // 0: never
  int val_batches = 8;
  int checkpoint_every = 0;      // 0: only at the end
  int keep_checkpoints = 3;      // newest step_N checkpoints kept in out; 0: all
  int sample_every = 0;          // print a sample every N steps (0: never)
  std::string resume;            // checkpoint directory to continue from (run control: never saved)
  std::string init_from;         // HF model directory whose weights (and shape) a fresh run starts from
  bool zero1 = false;            // ZeRO-1: shard the fp32 master weights and AdamW moments over the ranks

  // Throws std::invalid_argument naming the key when a value is out of range or inconsistent. With
  // init_from set the model keys are not checked: the run takes its model from there.
  void validate() const;
  // The FP8 recipe when precision = fp8, nullopt for bf16.
  std::optional<Fp8Recipe> fp8() const;
};

// Registers every key of RunConfig as an option of `app` (with its default shown in --help).
void add_config_options(CLI::App& app, RunConfig& config);

// The effective configuration as a config file that parse_config_text() and --config read back. Run
// control keys (resume) are left out: they say how this process started, not what the run is, and a
// saved config read back must start the run it describes, not continue another one.
std::string config_to_toml(const RunConfig& config);

// A config text (what config_to_toml writes, or a config file's contents) over the defaults, not yet
// validated; errors are std::runtime_error starting with label.
RunConfig parse_config_text(const std::string& text, const std::string& label);

// Builds a fresh App of one command with its options bound to config (add_config_options) and to the
// command's own variables. A command may replace a key's option with its own of the same name.
using AppFactory = std::function<std::shared_ptr<CLI::App>(RunConfig& config)>;

// The validated configuration of one command: defaults, then config_file (if not empty), then args (the
// command line after the subcommand name; it wins). Errors: std::runtime_error "config FILE: ..." for the
// file, CLI::ParseError for the command line, std::invalid_argument naming the key for invalid values.
RunConfig resolve_config(const AppFactory& make_app, const std::string& config_file,
                         const std::vector<std::string>& args);

}  // namespace coda
