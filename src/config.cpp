// Run configuration: one list of keys (add_config_options) serves the command line, --help, config files
// and config_to_toml, so a key cannot exist in one place and be missing in another.
// Config files are read with CLI11's TOML reader but NOT through App::set_config: CLI11 2.1 cannot attach
// a config file to a subcommand, and we want our own errors anyway. A file becomes a list of command-line
// tokens "--key" "value" (two tokens, so that an empty value stays a value), checked key by key: the key
// must be one of ours and sit in its own section ([model], [data], [optim], [run]) or at the top level.
// Then two parses, each on a fresh App: phase 1, the file's tokens alone on the plain key set (a bad value is
// reported as "config FILE: ..."); phase 2, the file's tokens and then the real command line on the command's
// own App. Every option keeps its last value (TakeLast), so the command line wins. Only then is the result
// validated, so a config that a command-line flag repairs is accepted.

#include "config.hpp"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include <CLI/CLI.hpp>

namespace coda {

namespace {

const char* const kSections[] = {"model", "data", "optim", "run"};
const char* const kRunControlKeys[] = {"resume"};  // not written by config_to_toml

bool is_run_control(const std::string& key) {
  for (const char* name : kRunControlKeys)
    if (key == name) return true;
  return false;
}

bool is_section(const std::string& name) {
  for (const char* section : kSections)
    if (name == section) return true;
  return false;
}

// Shortest decimal text that reads back as the same float.
std::string float_text(float value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

std::string quoted(const std::string& value) {
  const char quote = value.find('"') == std::string::npos ? '"' : '\'';
  return quote + value + quote;
}

// Value checks CLI11's conversions leave out (it reads "3" as true, "inf" as a float and wraps "-1" into
// a uint64); each returns the error text, empty when the value is fine.
std::string boolean_text(const std::string& value) {
  return value.empty() || value == "true" || value == "false" || value == "1" || value == "0"
             ? ""
             : "must be true or false, got " + value;
}
std::string finite_text(const std::string& value) {
  char* end = nullptr;
  const double parsed = std::strtod(value.c_str(), &end);
  return end != value.c_str() && !std::isfinite(parsed) ? "must be a finite number, got " + value : "";
}
std::string unsigned_text(const std::string& value) {
  return value.find('-') != std::string::npos ? "must be >= 0, got " + value : "";
}

// The key set alone: what config files are checked and parsed against in phase 1.
std::shared_ptr<CLI::App> make_key_app(RunConfig& config) {
  auto app = std::make_shared<CLI::App>("configuration keys");
  add_config_options(*app, config);
  return app;
}

// "--key" "value" token pairs of a config file (or text), each key checked against the keys of app.
std::vector<std::string> config_tokens(std::istream& input, const std::string& label, const CLI::App& app) {
  std::vector<CLI::ConfigItem> items;
  try {
    items = CLI::ConfigTOML().from_config(input);
  } catch (const CLI::Error& e) {
    throw std::runtime_error(label + ": " + e.what());
  }
  std::vector<std::string> tokens;
  for (const auto& item : items) {
    if ((item.name == "++" || item.name == "--") && item.inputs.empty()) continue;  // section open/close marks
    const std::string section = item.parents.empty() ? "" : CLI::detail::join(item.parents, ".");
    if (!section.empty() && !is_section(section))
      throw std::runtime_error(label + ": unknown section [" + section + "] (key '" + item.name +
                               "'); sections are [model], [data], [optim], [run]");
    const CLI::Option* option = app.get_option_no_throw("--" + item.name);
    if (option == nullptr || !is_section(option->get_group()))
      throw std::runtime_error(label + ": unknown key '" + item.name + "'" +
                               (section.empty() ? "" : " in [" + section + "]"));
    if (!section.empty() && section != option->get_group())
      throw std::runtime_error(label + ": key '" + item.name + "' belongs in [" + option->get_group() + "], not [" +
                               section + "]");
    if (item.inputs.size() != 1)
      throw std::runtime_error(label + ": key '" + item.name + "' takes one value, got " +
                               std::to_string(item.inputs.size()));
    tokens.push_back("--" + item.name);
    tokens.push_back(item.inputs[0]);
  }
  return tokens;
}

// Phase 1: the tokens alone, on the key set; a bad value is reported against label.
RunConfig parse_tokens(const std::vector<std::string>& tokens, const std::string& label) {
  RunConfig config;
  auto app = make_key_app(config);
  std::vector<std::string> reversed(tokens.rbegin(), tokens.rend());  // CLI11 consumes from the back
  try {
    app->parse(reversed);
  } catch (const std::exception& e) {
    throw std::runtime_error(label + ": " + e.what());
  }
  return config;
}

}  // namespace

void RunConfig::validate() const {
  const bool own_model = init_from.empty();  // otherwise the model comes from init_from (train.hpp)
  if (own_model) model.validate();
  const auto in = [](const std::string& value, std::initializer_list<const char*> allowed) {
    for (const char* name : allowed)
      if (value == name) return true;
    return false;
  };
  require(!train_data.empty(), "train_data must not be empty");
  require(batch_size >= 1, "batch_size must be >= 1");
  require(seq_len >= 1, "seq_len must be >= 1");
  require(!own_model || seq_len <= model.max_seq_len,
          "seq_len (" + std::to_string(seq_len) + ") must be <= max_seq_len (" + std::to_string(model.max_seq_len) + ")");
  require(grad_accum >= 1, "grad_accum must be >= 1");
  require(global_batch >= 0, "global_batch must be >= 0 (0: ranks x batch_size x grad_accum)");
  require(global_batch == 0 || grad_accum == 1,
          "set global_batch or grad_accum, not both (global_batch = " + std::to_string(global_batch) +
              " derives grad_accum from the number of ranks; grad_accum = " + std::to_string(grad_accum) + ")");
  require(steps >= 1, "steps must be >= 1");
  require(lr > 0.0f, "lr must be > 0");
  require(min_lr_ratio >= 0.0f && min_lr_ratio <= 1.0f, "min_lr_ratio must be in [0, 1]");
  require(warmup_steps >= 0, "warmup_steps must be >= 0");
  require(weight_decay >= 0.0f, "weight_decay must be >= 0");
  require(beta1 >= 0.0f && beta1 < 1.0f, "beta1 must be in [0, 1)");
  require(beta2 >= 0.0f && beta2 < 1.0f, "beta2 must be in [0, 1)");
  require(adam_eps > 0.0f, "adam_eps must be > 0");
  require(grad_clip >= 0.0f, "grad_clip must be >= 0 (0 disables clipping)");
  require(in(device, {"auto", "cpu", "cuda"}), "device must be auto, cpu or cuda, got \"" + device + "\"");
  require(in(kernels, {"auto", "coda", "unfused"}), "kernels must be auto, coda or unfused, got \"" + kernels + "\"");
  require(in(precision, {"bf16", "fp8"}), "precision must be bf16 or fp8, got \"" + precision + "\"");
  require(precision != "fp8" || kernels != "coda",
          "precision = fp8 runs in the unfused mode (the coda programs are bf16): set kernels = unfused or auto");
  require(fp8_history >= 1 && fp8_history <= 1024, "fp8_history must be in [1, 1024]");
  require(fp8_margin >= 0 && fp8_margin <= 16, "fp8_margin must be in [0, 16]");
  const unsigned fp8_covered = parse_fp8_linears(fp8_linears), fp8_block = parse_fp8_scaling(fp8_scaling);
  require(fp8_scaling == "block" || (fp8_block & ~fp8_covered) == 0,
          "fp8_scaling = \"" + fp8_scaling + "\" names a linear that fp8_linears = \"" + fp8_linears +
              "\" keeps in bf16");
  require(!out.empty(), "out must not be empty");
  require(log_every >= 1, "log_every must be >= 1");
  require(val_every >= 0, "val_every must be >= 0 (0: never)");
  require(val_batches >= 1, "val_batches must be >= 1");
  require(checkpoint_every >= 0, "checkpoint_every must be >= 0 (0: only at the end)");
  require(keep_checkpoints >= 0, "keep_checkpoints must be >= 0 (0: keep all)");
  require(sample_every >= 0, "sample_every must be >= 0 (0: never)");
}

std::optional<Fp8Recipe> RunConfig::fp8() const {
  if (precision != "fp8") return std::nullopt;
  return Fp8Recipe{fp8_history, fp8_margin, parse_fp8_linears(fp8_linears), parse_fp8_scaling(fp8_scaling)};
}

void add_config_options(CLI::App& app, RunConfig& c) {
  // Floats show (and are written) in their shortest exact form, booleans as true/false, the rest as CLI11
  // prints it. A boolean also works as a bare flag (--zero1 means --zero1 true): expected(0) marks the
  // option flag-like, so CLI11 takes "true" when no value follows, and expected(0, 1) then still accepts
  // one value (the config file's "--key" "value" tokens, or --key false).
  const auto key = [&app](const char* section, const char* name, auto& variable, const std::string& help) {
    CLI::Option* option = app.add_option(std::string("--") + name, variable, help)
                              ->group(section)
                              ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    using Type = std::remove_reference_t<decltype(variable)>;
    if constexpr (std::is_same_v<Type, bool>)
      option->default_str(variable ? "true" : "false")->expected(0)->expected(0, 1)->check(boolean_text);
    else if constexpr (std::is_floating_point_v<Type>)
      option->default_str(float_text(variable))->check(finite_text);
    else if constexpr (std::is_unsigned_v<Type>)
      option->capture_default_str()->check(unsigned_text);
    else
      option->capture_default_str();
  };
  ModelConfig& m = c.model;
  app.add_option_function<std::string>(
         "--arch",
         [&m](const std::string& name) {
           try {
             m.set_arch(parse_arch(name));
           } catch (const std::invalid_argument& e) {
             throw CLI::ValidationError("--arch", e.what());
           }
         },
         "architecture, which picks the features: gpt2 | llama | qwen2 (src/models/)")
      ->group("model")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->default_str(arch_name(m.arch));
  key("model", "n_layer", m.n_layer, "transformer blocks");
  key("model", "d_model", m.d_model, "residual width");
  key("model", "n_head", m.n_head, "attention heads");
  key("model", "n_kv_head", m.n_kv_head, "key/value heads (gpt2: = n_head; fewer: grouped-query attention)");
  key("model", "d_ff", m.d_ff, "MLP hidden width (GELU: 4*d_model for gpt2; SwiGLU: gate and up width)");
  key("model", "vocab_size", m.vocab_size, "vocabulary size (padded to a multiple of 128 inside)");
  key("model", "max_seq_len", m.max_seq_len, "longest sequence the model takes (learned positions: the table size)");
  key("model", "rope_theta", m.rope_theta, "RoPE base (llama, qwen2)");
  key("model", "norm_eps", m.norm_eps, "LayerNorm / RMSNorm epsilon");
  key("model", "tied_head", m.tied_head, "LM head shares the token embedding (gpt2: always)");

  key("data", "train_data", c.train_data, "glob of training token shards");
  key("data", "val_data", c.val_data,
      "glob of validation shards (auto: train_data's with val for train; empty: no validation)");
  key("data", "batch_size", c.batch_size, "sequences per micro-batch");
  key("data", "seq_len", c.seq_len, "tokens per sequence");
  key("data", "grad_accum", c.grad_accum, "micro-batches per optimizer step");
  key("data", "global_batch", c.global_batch,
      "sequences per optimizer step over all GPUs (0: off); grad_accum = global_batch / (GPUs x batch_size)");

  key("optim", "steps", c.steps, "optimizer steps");
  key("optim", "lr", c.lr, "peak learning rate");
  key("optim", "min_lr_ratio", c.min_lr_ratio, "cosine decays to lr * min_lr_ratio");
  key("optim", "warmup_steps", c.warmup_steps, "linear warmup steps");
  key("optim", "weight_decay", c.weight_decay, "AdamW decoupled weight decay (matrices only)");
  key("optim", "beta1", c.beta1, "AdamW beta1");
  key("optim", "beta2", c.beta2, "AdamW beta2");
  key("optim", "adam_eps", c.adam_eps, "AdamW epsilon");
  key("optim", "grad_clip", c.grad_clip, "global gradient-norm clip (0: off)");

  key("run", "device", c.device, "auto | cpu | cuda");
  key("run", "kernels", c.kernels, "auto (coda where its programs cover the model, else unfused) | coda | unfused (cuda only)");
  key("run", "precision", c.precision, "bf16 | fp8 (block linears as FP8 GEMMs, unfused mode; docs/FP8.md)");
  key("run", "fp8_history", c.fp8_history, "fp8: steps of amax history behind each scale");
  key("run", "fp8_margin", c.fp8_margin, "fp8: powers of two of headroom below the format's largest value");
  key("run", "fp8_linears", c.fp8_linears,
      "fp8: the linears in FP8 (comma-separated: qkv, attn_proj, mlp_up, mlp_down of every block; lm_head)");
  key("run", "fp8_scaling", c.fp8_scaling,
      "fp8: tensor (delayed per-tensor scales) | block (a scale per 128-value block; widths and B*T multiples of "
      "128) | the linears with block scales, the others per tensor (comma-separated, e.g. mlp_down)");
  key("run", "deterministic", c.deterministic,
      "cuda: sums in a fixed order, so a seed gives bitwise the same run (no split-K, ordered attention dQ)");
  key("run", "out", c.out, "run directory (metrics, config, checkpoints)");
  key("run", "seed", c.seed, "seed of initialisation and data order");
  key("run", "log_every", c.log_every, "console progress every N steps");
  key("run", "val_every", c.val_every, "validation every N steps and at the end (0: never)");
  key("run", "val_batches", c.val_batches, "batches per validation");
  key("run", "checkpoint_every", c.checkpoint_every, "checkpoint every N steps (0: only at the end)");
  key("run", "keep_checkpoints", c.keep_checkpoints, "newest step_N checkpoints kept (0: all)");
  key("run", "sample_every", c.sample_every, "print a sample from the model every N steps (0: never)");
  key("run", "resume", c.resume, "checkpoint directory (or run directory) to continue from");
  key("run", "init_from", c.init_from,
      "fine-tune: start from this HF model directory's weights and shape (fresh optimizer and schedule)");
  key("run", "zero1", c.zero1, "ZeRO-1: shard fp32 master weights and AdamW moments over the ranks (cuda)");
}

std::string config_to_toml(const RunConfig& config) {
  RunConfig copy = config;
  auto app = make_key_app(copy);  // defaults captured at registration = the values of config
  std::ostringstream out;
  for (const char* section : kSections) {
    out << "[" << section << "]\n";
    for (const CLI::Option* option : app->get_options())
      if (option->get_group() == section && !is_run_control(option->get_name().substr(2))) {
        const std::string value = option->get_default_str();
        const bool text = option->get_type_name() == "TEXT" || option->get_name() == "--arch";
        out << option->get_name().substr(2) << " = " << (text ? quoted(value) : value) << "\n";
      }
    out << "\n";
  }
  return out.str();
}

RunConfig parse_config_text(const std::string& text, const std::string& label) {
  RunConfig keys;
  std::istringstream input(text);
  return parse_tokens(config_tokens(input, label, *make_key_app(keys)), label);
}

RunConfig resolve_config(const AppFactory& make_app, const std::string& config_file,
                         const std::vector<std::string>& args) {
  std::vector<std::string> file_tokens;
  if (!config_file.empty()) {
    const std::string label = "config " + config_file;
    if (!std::filesystem::is_regular_file(config_file)) throw std::runtime_error(label + ": file not found");
    std::ifstream input(config_file);
    if (!input) throw std::runtime_error(label + ": cannot read the file");
    RunConfig keys;
    file_tokens = config_tokens(input, label, *make_key_app(keys));
    parse_tokens(file_tokens, label);
  }
  RunConfig config;
  auto app = make_app(config);
  std::vector<std::string> tokens;
  for (size_t i = 0; i < file_tokens.size(); i += 2) {  // keys the command replaced are left out
    const CLI::Option* option = app->get_option_no_throw(file_tokens[i]);
    if (option != nullptr && is_section(option->get_group()))
      tokens.insert(tokens.end(), {file_tokens[i], file_tokens[i + 1]});
  }
  tokens.insert(tokens.end(), args.begin(), args.end());
  std::vector<std::string> reversed(tokens.rbegin(), tokens.rend());
  app->parse(reversed);
  try {
    config.validate();
  } catch (const std::invalid_argument& e) {
    const std::string where = config_file.empty() ? "command line"
                              : args.empty()      ? "config " + config_file
                                                  : "config " + config_file + " with command-line overrides";
    throw std::invalid_argument(where + ": " + e.what());
  }
  return config;
}

}  // namespace coda
