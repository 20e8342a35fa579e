// Checkpoints in Hugging Face's format (see checkpoint.hpp for the files).
// One table drives both directions: hf_tensors() lists, for a model shape, every tensor that HF's
// GPT2LMHeadModel or LlamaForCausalLM stores, with its HF name and shape and how each of its elements is
// found in our flat buffer; saving gathers each HF tensor from the buffer, loading scatters it back, so
// load is the exact inverse of save by construction. Resume state: trainer_state.json and
// optimizer.safetensors (fp32 master weights and AdamW moments), which must decode to the same weights as
// model.safetensors, bit for bit. A checkpoint is replaced atomically (save_checkpoint).
#include "checkpoint.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>

#include "safetensors.hpp"

namespace coda {

namespace fs = std::filesystem;

namespace {

// One HF tensor and where its elements live in the flat buffer. 1-D tensors are [n] rows of one column.
// Row-mapped: HF row r (a contiguous run of `cols` values) is our row source_row(r) of the tensor at
// `offset`. Transposed: the HF tensor is [in, out] and ours [out, in] at `offset`.
struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset = 0;
  bool transposed = false;
  std::function<int64_t(int64_t)> source_row;

  size_t rows() const { return static_cast<size_t>(shape[0]); }
  size_t cols() const { return shape.size() > 1 ? static_cast<size_t>(shape[1]) : 1; }

  // hf[k] <-> params[index(k)] for every k, visited as (hf pointer, buffer pointer, run length).
  template <typename Visit>
  void for_each_run(Visit visit) const {
    if (transposed) {
      const size_t in = rows(), out = cols();
      for (size_t i = 0; i < in; ++i)
        for (size_t j = 0; j < out; ++j) visit(i * out + j, offset + j * in + i, 1);
      return;
    }
    for (size_t r = 0; r < rows(); ++r)
      visit(r * cols(), offset + static_cast<size_t>(source_row(static_cast<int64_t>(r))) * cols(), cols());
  }
  void gather(const float* params, float* hf) const {
    for_each_run([&](size_t k, size_t p, size_t n) { std::memcpy(hf + k, params + p, n * sizeof(float)); });
  }
  void scatter(const float* hf, float* params) const {
    for_each_run([&](size_t k, size_t p, size_t n) { std::memcpy(params + p, hf + k, n * sizeof(float)); });
  }
};

std::function<int64_t(int64_t)> identity_rows() {
  return [](int64_t r) { return r; };
}

// The mappings:
//  * GPT-2's Conv1D keeps weights as [in, out]: c_attn, c_proj, c_fc and mlp.c_proj are our [out, in]
//    matrices transposed. Its q/k/v split and head order match our packed qkv rows already.
//  * Llama's q_proj and k_proj rows are permuted per head. We rotate adjacent pairs (2i, 2i+1) by the
//    frequency of pair i; HF rotates (i, i + hd/2) with the same frequency, so within a head HF row
//    half*(hd/2) + i is our row 2i + half. v_proj is a plain slice of the qkv rows.
//  * Our interleaved SwiGLU rows (2j gate_j, 2j+1 up_j) become gate_proj (even rows) and up_proj (odd).
//  * Embeddings and the untied head are stored unpadded ([vocab_size, C]); on load the padded rows stay
//    zero. Tied heads are not stored (HF ties lm_head.weight to the embedding itself).
// On load of a plain HF directory, tensors HF keeps as buffers (GPT-2's attn.bias causal mask, Llama's
// rotary inv_freq) and a stored copy of a tied head are ignored; any other unknown tensor is an error.
std::vector<HfTensor> gpt2_tensors(const ModelConfig& c, const ParamLayout& layout, const std::string& prefix) {
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

std::vector<HfTensor> llama_tensors(const ModelConfig& c, const ParamLayout& layout) {
  const int64_t C = c.d_model, F = c.d_ff, hd = c.head_dim();
  const int64_t q_rows = c.n_head * hd, kv_rows = c.n_kv_head * hd;
  std::vector<HfTensor> list;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, size_t offset,
                 std::function<int64_t(int64_t)> source_row) {
    list.push_back({name, shape, offset, false, source_row});
  };
  // HF row r of a rotate-half projection whose heads start at our row `first`.
  auto rope_rows = [hd](int64_t first) {
    return [hd, first](int64_t r) {
      const int64_t head = r / hd, within = r % hd, half = within / (hd / 2), pair = within % (hd / 2);
      return first + head * hd + 2 * pair + half;
    };
  };
  add("model.embed_tokens.weight", {c.vocab_size, C}, layout.wte, identity_rows());
  for (int l = 0; l < c.n_layer; ++l) {
    const LayerParams& lp = layout.layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {C}, lp.norm1_w, identity_rows());
    add(p + "self_attn.q_proj.weight", {q_rows, C}, lp.qkv_w, rope_rows(0));
    add(p + "self_attn.k_proj.weight", {kv_rows, C}, lp.qkv_w, rope_rows(q_rows));
    add(p + "self_attn.v_proj.weight", {kv_rows, C}, lp.qkv_w, [=](int64_t r) { return q_rows + kv_rows + r; });
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

// Tensors a plain HF directory may hold that the model does not need.
bool ignorable_tensor(const ModelConfig& c, const std::string& name) {
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (name == "lm_head.weight") return c.tied_head;
  if (c.arch == Arch::GPT2) return ends_with(".attn.bias") || ends_with(".attn.masked_bias");
  return ends_with(".rotary_emb.inv_freq");
}

// The float as the shortest decimal that reads back as the same float (1e-5f is written 1e-05, not
// 9.999999747378752e-06), so config.json is readable and the value round-trips exactly.
double shortest_decimal(float value) {
  for (int precision = 1; precision <= 9; ++precision) {
    char text[32];
    std::snprintf(text, sizeof text, "%.*g", precision, static_cast<double>(value));
    const double parsed = std::strtod(text, nullptr);
    if (static_cast<float>(parsed) == value) return parsed;
  }
  return value;
}

nlohmann::json config_json(const ModelConfig& c) {
  if (c.arch == Arch::GPT2)
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
  const double theta = shortest_decimal(c.rope_theta);
  return {{"model_type", "llama"},
          {"architectures", {"LlamaForCausalLM"}},
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
          {"attention_bias", false},
          {"mlp_bias", false},
          {"attention_dropout", 0.0},
          {"torch_dtype", "float32"}};
}

// Typed access to config.json keys with errors that name the file and the key.
struct JsonReader {
  const nlohmann::json& json;
  std::string file;

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw std::runtime_error(file + ": key \"" + key + "\" " + what);
  }
  bool has(const std::string& key) const { return json.contains(key) && !json.at(key).is_null(); }
  int get_int(const std::string& key) const {
    if (!has(key)) fail(key, "is missing");
    if (!json.at(key).is_number_integer()) fail(key, "must be an integer, got " + json.at(key).dump());
    return json.at(key).get<int>();
  }
  int get_int(const std::string& key, int fallback) const { return has(key) ? get_int(key) : fallback; }
  float get_float(const std::string& key, float fallback) const {
    if (!has(key)) return fallback;
    if (!json.at(key).is_number()) fail(key, "must be a number, got " + json.at(key).dump());
    return static_cast<float>(json.at(key).get<double>());
  }
  bool get_bool(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!json.at(key).is_boolean()) fail(key, "must be true or false, got " + json.at(key).dump());
    return json.at(key).get<bool>();
  }
  std::string get_string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!json.at(key).is_string()) fail(key, "must be a string, got " + json.at(key).dump());
    return json.at(key).get<std::string>();
  }
  void require(const std::string& key, bool ok, const std::string& what) const {
    if (!ok) fail(key, what);
  }
};

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": missing or unreadable");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": not valid JSON: " + e.what());
  }
}

void write_json(const std::string& path, const nlohmann::json& json) {
  errno = 0;
  std::ofstream out(path, std::ios::trunc);
  out << json.dump(2) << "\n";
  out.flush();
  if (!out) throw std::runtime_error(path + ": write failed: " + (errno != 0 ? std::strerror(errno) : "I/O error"));
}

ModelConfig parse_config(const std::string& path) {
  const nlohmann::json json = read_json(path);
  if (!json.is_object()) throw std::runtime_error(path + ": not a JSON object");
  const JsonReader in{json, path};
  const std::string model_type = in.get_string("model_type", "");
  ModelConfig c;
  if (model_type == "gpt2") {
    c.arch = Arch::GPT2;
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
  } else if (model_type == "llama") {
    c.arch = Arch::Llama;
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
      const nlohmann::json& rope = json.at(key);
      in.require(key, rope.is_object(), "must be an object");
      const JsonReader rope_in{rope, path + " (" + key + ")"};
      const std::string type = rope_in.get_string("rope_type", rope_in.get_string("type", "default"));
      in.require(key, type == "default", "has rope_type \"" + type + "\"; only plain RoPE (\"default\") is supported");
      c.rope_theta = rope_in.get_float("rope_theta", c.rope_theta);
    }
    in.require("head_dim", in.get_int("head_dim", c.d_model / c.n_head) * c.n_head == c.d_model,
               "must equal hidden_size / num_attention_heads");
    in.require("hidden_act", in.get_string("hidden_act", "silu") == "silu", "must be silu");
    in.require("attention_bias", !in.get_bool("attention_bias", false), "must be false");
    in.require("mlp_bias", !in.get_bool("mlp_bias", false), "must be false");
  } else {
    throw std::runtime_error(path + ": model_type must be \"gpt2\" or \"llama\", got \"" + model_type + "\"");
  }
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
  return c;
}

// trainer_state.json: step, data position, RNG words as decimal strings (JSON readers often hold numbers as
// doubles) and the run config.
nlohmann::json state_json(const TrainerState& state) {
  nlohmann::json rng = nlohmann::json::array();
  for (uint64_t word : state.rng) rng.push_back(std::to_string(word));
  return {{"format", "coda-trainer-state"},
          {"version", 1},
          {"step", state.step},
          {"data_position", state.data_position},
          {"rng", rng},
          {"run_config", state.run_config}};
}

TrainerState parse_state(const std::string& path) {
  const nlohmann::json json = read_json(path);
  if (!json.is_object()) throw std::runtime_error(path + ": not a JSON object");
  const JsonReader in{json, path};
  in.require("format", in.get_string("format", "") == "coda-trainer-state", "must be \"coda-trainer-state\"");
  in.require("version", in.get_int("version") == 1, "must be 1");
  TrainerState state;
  state.step = in.get_int("step");
  in.require("data_position", json.contains("data_position"), "is missing");
  state.data_position = json.at("data_position");
  state.run_config = in.get_string("run_config", "");
  in.require("rng", in.has("rng") && json.at("rng").is_array() && json.at("rng").size() == 4,
             "must be an array of 4 decimal strings");
  for (size_t i = 0; i < 4; ++i) {
    const nlohmann::json& word = json.at("rng")[i];
    in.require("rng", word.is_string(), "must hold decimal strings, got " + word.dump());
    const std::string text = word.get<std::string>();
    char* end = nullptr;
    errno = 0;
    const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
    in.require("rng", !text.empty() && text[0] != '-' && *end == '\0' && errno == 0,
               "holds \"" + text + "\", not an unsigned 64-bit decimal");
    state.rng[i] = static_cast<uint64_t>(value);
  }
  return state;
}

// The tensors of a model: model.safetensors, or the shards that model.safetensors.index.json lists.
class TensorFiles {
 public:
  explicit TensorFiles(const fs::path& dir) {
    const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
    if (fs::exists(single)) {
      add(single.string());
      return;
    }
    if (!fs::exists(index))
      throw std::runtime_error(single.string() + ": missing (and no " + index.filename().string() + ")");
    const nlohmann::json json = read_json(index.string());
    if (!json.contains("weight_map") || !json.at("weight_map").is_object())
      throw std::runtime_error(index.string() + ": key \"weight_map\" is missing or not an object");
    std::map<std::string, const SafetensorsFile*> opened;
    for (const auto& item : json.at("weight_map").items()) {
      if (!item.value().is_string())
        throw std::runtime_error(index.string() + ": weight_map entry " + item.key() + " is not a file name");
      const std::string shard = (dir / item.value().get<std::string>()).string();
      if (!opened.count(shard)) opened[shard] = add(shard);
      if (!opened[shard]->contains(item.key()))
        throw std::runtime_error(shard + ": no tensor named " + item.key() + " (listed in " + index.string() + ")");
    }
  }
  // The file that holds `name`, or null.
  const SafetensorsFile* find(const std::string& name) const {
    for (const auto& file : files_)
      if (file->contains(name)) return file.get();
    return nullptr;
  }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  const SafetensorsFile* add(const std::string& path) {
    files_.push_back(std::make_unique<SafetensorsFile>(path));
    return files_.back().get();
  }
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Reads a tensor that must have exactly `shape`.
std::vector<float> read_tensor(const SafetensorsFile& file, const std::string& name,
                               const std::vector<int64_t>& shape) {
  const auto& entry = file.entry(name);
  if (entry.shape != shape)
    throw std::runtime_error(file.path() + ": tensor " + name + " has shape " + shape_text(entry.shape) +
                             ", expected " + shape_text(shape));
  return file.read(name);
}

fs::path normalized(const std::string& dir) {
  fs::path path(dir);
  if (!path.has_filename()) path = path.parent_path();  // "runs/x/" -> "runs/x"
  if (path.empty()) throw std::runtime_error("checkpoint directory name is empty");
  return path;
}

std::vector<HfTensor> hf_tensors(const ModelConfig& c, const ParamLayout& layout, const std::string& gpt2_prefix) {
  return c.arch == Arch::GPT2 ? gpt2_tensors(c, layout, gpt2_prefix) : llama_tensors(c, layout);
}

}  // namespace

// Atomic replace: write DIR.tmp (a stale one from a crash is removed first); then, if DIR exists, rename
// it to DIR.old, rename DIR.tmp to DIR, and remove DIR.old. At every instant either DIR or DIR.old holds
// a complete checkpoint.
void save_checkpoint(const std::string& dir, const ModelConfig& model, const float* params, const float* adam_m,
                     const float* adam_v, const TrainerState& state) {
  if (!params || !adam_m || !adam_v)
    throw std::invalid_argument(dir + ": save_checkpoint needs params, adam_m and adam_v (got a null pointer)");
  const ParamLayout layout = make_param_layout(model);
  const fs::path final_dir = normalized(dir);
  const fs::path tmp = final_dir.string() + ".tmp", old = final_dir.string() + ".old";
  try {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  } catch (const fs::filesystem_error& e) {
    throw std::runtime_error(tmp.string() + ": cannot create: " + e.what());
  }

  try {
    write_json((tmp / "config.json").string(), config_json(model));
    std::vector<SafetensorsOutput> weights;
    for (const HfTensor& tensor : hf_tensors(model, layout, "transformer."))
      weights.push_back({tensor.name, tensor.shape, [tensor, params](float* out) { tensor.gather(params, out); }});
    write_safetensors((tmp / "model.safetensors").string(), weights, {{"format", "pt"}});

    const std::vector<int64_t> flat = {static_cast<int64_t>(layout.total)};
    auto copy_of = [&layout](const float* source) {
      return [&layout, source](float* out) { std::memcpy(out, source, layout.total * sizeof(float)); };
    };
    write_safetensors((tmp / "optimizer.safetensors").string(),
                      {{"master", flat, copy_of(params)}, {"adam_m", flat, copy_of(adam_m)},
                       {"adam_v", flat, copy_of(adam_v)}},
                      {{"format", "coda-optimizer"}, {"total", std::to_string(layout.total)}});
    write_json((tmp / "trainer_state.json").string(), state_json(state));
  } catch (const std::exception&) {
    std::error_code ignored;  // a full disk gets its space back; the error says what failed
    fs::remove_all(tmp, ignored);
    throw;
  }

  try {
    if (fs::exists(final_dir)) {
      fs::remove_all(old);
      fs::rename(final_dir, old);
      fs::rename(tmp, final_dir);
      fs::remove_all(old);
    } else {
      fs::rename(tmp, final_dir);
    }
  } catch (const fs::filesystem_error& e) {
    throw std::runtime_error(final_dir.string() + ": cannot replace with " + tmp.string() + ": " + e.what());
  }
}

ModelConfig load_model_config(const std::string& dir) {
  return parse_config((normalized(dir) / "config.json").string());
}

Checkpoint load_checkpoint(const std::string& dir) {
  const fs::path path = normalized(dir);
  if (!fs::is_directory(path)) throw std::runtime_error(path.string() + ": not a directory");
  Checkpoint checkpoint;
  checkpoint.model = parse_config((path / "config.json").string());
  const ModelConfig& c = checkpoint.model;
  const ParamLayout layout = make_param_layout(c);
  checkpoint.params.assign(layout.total, 0.0f);

  const TensorFiles files(path);
  // GPT-2 files from transformers name tensors transformer.*; the original OpenAI conversion has no prefix.
  const std::string prefix = files.find("wte.weight") && !files.find("transformer.wte.weight") ? "" : "transformer.";
  std::set<std::string> expected;
  for (const HfTensor& tensor : hf_tensors(c, layout, prefix)) {
    const SafetensorsFile* file = files.find(tensor.name);
    if (!file) throw std::runtime_error(files.files().front()->path() + ": missing tensor " + tensor.name);
    tensor.scatter(read_tensor(*file, tensor.name, tensor.shape).data(), checkpoint.params.data());
    expected.insert(tensor.name);
  }
  for (const auto& file : files.files())
    for (const auto& item : file->tensors())
      if (!expected.count(item.first) && !ignorable_tensor(c, item.first))
        throw std::runtime_error(file->path() + ": unexpected tensor " + item.first + " for a " + arch_name(c.arch) +
                                 " model");

  const fs::path state_path = path / "trainer_state.json";
  if (!fs::exists(state_path)) return checkpoint;
  checkpoint.has_trainer_state = true;
  checkpoint.state = parse_state(state_path.string());
  const std::string optimizer_path = (path / "optimizer.safetensors").string();
  if (!fs::exists(optimizer_path))
    throw std::runtime_error(optimizer_path + ": missing (" + state_path.string() + " exists)");
  const SafetensorsFile optimizer(optimizer_path);
  const std::vector<int64_t> flat = {static_cast<int64_t>(layout.total)};
  const std::vector<float> master = read_tensor(optimizer, "master", flat);
  if (std::memcmp(master.data(), checkpoint.params.data(), layout.total * sizeof(float)) != 0)
    throw std::runtime_error(optimizer_path + ": master weights differ from " + (path / "model.safetensors").string() +
                             " (files from different checkpoints?)");
  checkpoint.adam_m = read_tensor(optimizer, "adam_m", flat);
  checkpoint.adam_v = read_tensor(optimizer, "adam_v", flat);
  return checkpoint;
}

}  // namespace coda
