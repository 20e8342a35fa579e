// Checkpoints in Hugging Face's format (see checkpoint.hpp for the files).
// One table drives both directions: the architecture (src/models/) lists, for a model shape, every tensor
// that its HF class stores, with its HF name and shape and how each of its elements is found in our flat
// buffer; saving gathers each HF tensor from the buffer, loading scatters it back, so load is the exact
// inverse of save by construction. Resume state: trainer_state.json and
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

#include "models/architecture.hpp"
#include "safetensors.hpp"

namespace coda {

namespace fs = std::filesystem;

namespace {

// A tied head stored anyway, and the buffers the architecture ignores.
bool ignorable_tensor(const ModelConfig& c, const std::string& name) {
  if (name == "lm_head.weight") return c.tied_head;
  return architecture(c.arch).ignorable_tensor(name);
}

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
  const Architecture* arch = architecture_for_hf(model_type);
  if (arch == nullptr) {
    std::string known;
    for (const Architecture* a : architectures())
      known += std::string(known.empty() ? "" : ", ") + "\"" + a->hf_model_type() + "\"";
    throw std::runtime_error(path + ": model_type must be one of " + known + ", got \"" + model_type + "\"");
  }
  ModelConfig c = arch->from_hf_config(in);
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
  return c;
}

// trainer_state.json: step, data position, RNG words as decimal strings (JSON readers often hold numbers as
// doubles), the run config, and "fp8": {"history": H, "amax": [...]} when there is a scaling state (a
// float's JSON number is its double, which reads back to the same float).
nlohmann::json state_json(const TrainerState& state) {
  nlohmann::json rng = nlohmann::json::array();
  for (uint64_t word : state.rng) rng.push_back(std::to_string(word));
  nlohmann::json json = {{"format", "coda-trainer-state"},
                         {"version", 1},
                         {"step", state.step},
                         {"data_position", state.data_position},
                         {"rng", rng},
                         {"run_config", state.run_config}};
  if (!state.fp8.empty()) json["fp8"] = {{"history", state.fp8.history}, {"amax", state.fp8.amax}};
  return json;
}

Fp8ScalingState parse_fp8_state(const nlohmann::json& json, const std::string& path) {
  const JsonReader in{json, path + " fp8"};
  Fp8ScalingState state;
  state.history = in.get_int("history");
  in.require("history", state.history >= 1, "must be >= 1");
  in.require("amax", in.has("amax") && json.at("amax").is_array() && !json.at("amax").empty() &&
                         json.at("amax").size() % state.history == 0,
             "must be a non-empty array of tensors x history numbers");
  for (const nlohmann::json& value : json.at("amax")) {
    in.require("amax", value.is_number() && std::isfinite(value.get<double>()) && value.get<double>() >= 0.0,
               "must hold finite non-negative numbers, got " + value.dump());
    state.amax.push_back(value.get<float>());
  }
  return state;
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
  if (json.contains("fp8")) {
    in.require("fp8", json.at("fp8").is_object(), "must be an object");
    state.fp8 = parse_fp8_state(json.at("fp8"), path);
  }
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

std::vector<HfTensor> hf_tensors(const ModelConfig& c, const ParamLayout& layout, const std::string& prefix) {
  return architecture(c.arch).hf_tensors(c, layout, prefix);
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
    write_json((tmp / "config.json").string(), architecture(model.arch).hf_config(model));
    std::vector<SafetensorsOutput> weights;
    for (const HfTensor& tensor : hf_tensors(model, layout, architecture(model.arch).tensor_prefix(nullptr)))
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
  const std::string prefix =
      architecture(c.arch).tensor_prefix([&files](const std::string& name) { return files.find(name) != nullptr; });
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
