// safetensors reading and writing; the format and the checks are described in safetensors.hpp.
#include "safetensors.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace coda {

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit

size_t dtype_bytes(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"I64", 8},     {"U64", 8}, {"F64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

// Product of the extents times the element size, or throws when it does not fit in 64 bits.
uint64_t byte_size(const std::vector<int64_t>& shape, size_t element_bytes, const std::string& where) {
  uint64_t bytes = element_bytes;
  for (int64_t extent : shape) {
    if (extent < 0) throw std::runtime_error(where + ": negative extent in shape");
    if (extent != 0 && bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(extent))
      throw std::runtime_error(where + ": shape too large");
    bytes *= static_cast<uint64_t>(extent);
  }
  return bytes;
}

}  // namespace

float half_bits_to_float(uint16_t bits) {
  const float sign = (bits & 0x8000u) ? -1.0f : 1.0f;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  if (exponent == 0x1f) return mantissa ? std::numeric_limits<float>::quiet_NaN() : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);  // zero and subnormals
  return sign * std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
}

float bf16_bits_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsOutput>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& tensor : tensors) {
    if (tensor.name.empty() || tensor.name == "__metadata__" || header.contains(tensor.name))
      throw std::invalid_argument(path + ": bad or duplicate tensor name \"" + tensor.name + "\"");
    const uint64_t bytes = byte_size(tensor.shape, sizeof(float), path + ": tensor " + tensor.name);
    header[tensor.name] = {{"dtype", "F32"}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned

  // Checked after every call, while errno still holds the reason (No space left on device, ...).
  errno = 0;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const auto check = [&](const char* what) {
    if (!out) throw std::runtime_error(path + ": " + what + ": " + (errno != 0 ? std::strerror(errno) : "I/O error"));
  };
  check("cannot open for writing");
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(length), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  check("write failed");
  std::vector<float> buffer;
  for (const auto& tensor : tensors) {
    buffer.assign(byte_size(tensor.shape, 1, path), 0.0f);
    tensor.fill(buffer.data());
    out.write(reinterpret_cast<const char*>(buffer.data()), static_cast<std::streamsize>(buffer.size() * sizeof(float)));
    check("write failed");
  }
  out.flush();
  check("write failed");
}

size_t SafetensorsFile::Entry::numel() const {
  size_t n = 1;
  for (int64_t extent : shape) n *= static_cast<size_t>(extent);
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error(path + ": cannot open");
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  unsigned char length_bytes[8];
  if (file_size < 8 || !in.read(reinterpret_cast<char*>(length_bytes), 8))
    throw std::runtime_error(path + ": truncated (no header length)");
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= static_cast<uint64_t>(length_bytes[i]) << (8 * i);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_size - 8)
    throw std::runtime_error(path + ": header length " + std::to_string(header_bytes) + " exceeds the file (" +
                             std::to_string(file_size) + " bytes)");
  std::string text(header_bytes, '\0');
  if (!in.read(&text[0], static_cast<std::streamsize>(header_bytes)))
    throw std::runtime_error(path + ": truncated header");
  data_start_ = 8 + header_bytes;
  const uint64_t data_bytes = file_size - data_start_;

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) throw std::runtime_error(path + ": header is not a JSON object");

  for (const auto& item : header.items()) {
    const std::string where = path + ": tensor " + item.key();
    const nlohmann::json& value = item.value();
    if (item.key() == "__metadata__") {
      if (!value.is_object()) throw std::runtime_error(path + ": __metadata__ is not an object");
      for (const auto& field : value.items()) {
        if (!field.value().is_string())
          throw std::runtime_error(path + ": __metadata__ value of \"" + field.key() + "\" is not a string");
        metadata_[field.key()] = field.value().get<std::string>();
      }
      continue;
    }
    if (!value.is_object() || !value.contains("dtype") || !value["dtype"].is_string() || !value.contains("shape") ||
        !value["shape"].is_array() || !value.contains("data_offsets") || !value["data_offsets"].is_array() ||
        value["data_offsets"].size() != 2)
      throw std::runtime_error(where + ": needs dtype, shape and data_offsets [begin, end]");
    Entry entry;
    entry.dtype = value["dtype"].get<std::string>();
    const size_t element_bytes = dtype_bytes(entry.dtype);
    if (element_bytes == 0) throw std::runtime_error(where + ": unknown dtype " + entry.dtype);
    for (const auto& extent : value["shape"]) {
      if (!extent.is_number_integer()) throw std::runtime_error(where + ": shape holds a non-integer");
      entry.shape.push_back(extent.get<int64_t>());
    }
    for (const auto& bound : value["data_offsets"])
      if (!bound.is_number_unsigned()) throw std::runtime_error(where + ": data_offsets must be unsigned integers");
    entry.begin = value["data_offsets"][0].get<uint64_t>();
    entry.end = value["data_offsets"][1].get<uint64_t>();
    if (entry.begin > entry.end || entry.end > data_bytes)
      throw std::runtime_error(where + ": data_offsets [" + std::to_string(entry.begin) + ", " +
                               std::to_string(entry.end) + ") out of the data's " + std::to_string(data_bytes) +
                               " bytes (truncated file?)");
    const uint64_t expected = byte_size(entry.shape, element_bytes, where);
    if (entry.end - entry.begin != expected)
      throw std::runtime_error(where + ": holds " + std::to_string(entry.end - entry.begin) + " bytes but " +
                               entry.dtype + " of its shape needs " + std::to_string(expected));
    tensors_.emplace(item.key(), entry);
  }

  std::vector<std::pair<uint64_t, std::string>> by_offset;
  for (const auto& tensor : tensors_) by_offset.emplace_back(tensor.second.begin, tensor.first);
  std::sort(by_offset.begin(), by_offset.end());
  uint64_t covered = 0;
  for (const auto& item : by_offset) {
    const Entry& entry = tensors_.at(item.second);
    if (entry.begin != covered)
      throw std::runtime_error(path + ": tensor " + item.second + ": data_offsets begin at " +
                               std::to_string(entry.begin) + " but the previous tensor ends at " +
                               std::to_string(covered) + " (overlap or gap)");
    covered = entry.end;
  }
  if (covered != data_bytes)
    throw std::runtime_error(path + ": tensors cover " + std::to_string(covered) + " bytes of data but the file holds " +
                             std::to_string(data_bytes) + " (truncated or trailing bytes)");
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) throw std::runtime_error(path_ + ": no tensor named " + name);
  return it->second;
}

std::vector<float> SafetensorsFile::read(const std::string& name) const {
  const Entry& e = entry(name);
  if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16")
    throw std::runtime_error(path_ + ": tensor " + name + ": dtype " + e.dtype + " cannot be read as fp32");
  std::vector<char> bytes(e.end - e.begin);
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_start_ + e.begin));
  if (!in || !in.read(bytes.data(), static_cast<std::streamsize>(bytes.size())))
    throw std::runtime_error(path_ + ": tensor " + name + ": read failed");
  std::vector<float> values(e.numel());
  if (e.dtype == "F32") {
    std::memcpy(values.data(), bytes.data(), bytes.size());
    return values;
  }
  const bool bf16 = e.dtype == "BF16";
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, bytes.data() + 2 * i, 2);
    values[i] = bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
  }
  return values;
}

}  // namespace coda
