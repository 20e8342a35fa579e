// The pieces of Hugging Face's checkpoint format that the architectures describe and the checkpoint code
// (src/checkpoint.cpp) moves: one HF tensor and where its elements live in our flat buffer, and typed
// reads of config.json keys with errors that name the file and the key.
// Row-mapped tensors: HF row r (a contiguous run of `cols` values) is our row source_row(r) of the tensor
// at `offset`; a 1-D tensor is [n] rows of one column. Transposed: the HF tensor is [in, out] (GPT-2's
// Conv1D) and ours [out, in] at `offset`. Saving gathers each HF tensor, loading scatters it back, so load
// is the exact inverse of save by construction.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace coda {

struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset = 0;
  bool transposed = false;
  std::function<int64_t(int64_t)> source_row;

  size_t rows() const { return static_cast<size_t>(shape[0]); }
  size_t cols() const { return shape.size() > 1 ? static_cast<size_t>(shape[1]) : 1; }

  // hf[k] <-> params[index(k)] for every k, visited as (hf index, buffer index, run length).
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

inline std::function<int64_t(int64_t)> identity_rows() {
  return [](int64_t r) { return r; };
}

// The float as the shortest decimal that reads back as the same float (1e-5f is written 1e-05, not
// 9.999999747378752e-06), so config.json is readable and the value round-trips exactly.
double shortest_decimal(float value);

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

}  // namespace coda
