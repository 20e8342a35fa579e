// The safetensors file format (Hugging Face), just what checkpoints need: an 8-byte little-endian header
// length N, N bytes of JSON ("name": {"dtype", "shape", "data_offsets": [b, e]}, optional "__metadata__"),
// then the data. We write only F32; we read F32, BF16 and F16, converting to fp32. The reader checks the
// whole layout when it opens a file and names the file and the tensor in every error.
// Details: above SafetensorsFile below.

#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace coda {

// One tensor to write: `fill` writes its numel fp32 values (row-major) into the buffer it is given, so a
// tensor can be produced (transposed, permuted...) just before it is written, one at a time.
struct SafetensorsOutput {
  std::string name;
  std::vector<int64_t> shape;
  std::function<void(float* out)> fill;
};

// Writes the tensors, in the order given, as F32. Throws std::runtime_error naming the file on I/O errors.
void write_safetensors(const std::string& path, const std::vector<SafetensorsOutput>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Layout of a file:
//   8 bytes   N, the header length, unsigned little-endian
//   N bytes   a JSON object: for each tensor  "name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}
//             and optionally "__metadata__": {string: string}; padded with spaces so data starts 8-aligned
//   the data  each tensor's bytes, row-major little-endian, at [b, e) relative to the start of the data
// A valid file's tensors tile the data exactly: sorted by offset, each begins where the previous one ends
// and the last ends at the end of the file; e - b equals the dtype size times the product of the shape.
// bf16 is the top half of an fp32; f16 is widened exactly, subnormals, infinities and NaN included. Host
// byte order is little-endian.
class SafetensorsFile {
 public:
  struct Entry {
    std::string dtype;           // as in the file: "F32", "BF16", "F16", "I64", ...
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0; // byte offsets relative to the start of the data
    size_t numel() const;
  };

  // Reads and validates the header; throws std::runtime_error naming the file (and tensor) on any error.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const Entry& entry(const std::string& name) const;  // throws naming the file and the tensor
  // The tensor's values as fp32 (F32, BF16 or F16 in the file; any other dtype is an error).
  std::vector<float> read(const std::string& name) const;

 private:
  std::string path_;
  uint64_t data_start_ = 0;  // file offset of the data
  std::map<std::string, Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// fp32 value of an IEEE half (binary16) and of a bfloat16, given as raw bits.
float half_bits_to_float(uint16_t bits);
float bf16_bits_to_float(uint16_t bits);

}  // namespace coda
