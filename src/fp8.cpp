// The FP8 codecs and delayed scaling; see fp8.hpp. A finite value's code is found with exact arithmetic:
// scaled by a power of two so that its mantissa bits are the integer part, rounded to nearest even
// (std::nearbyint under the default rounding mode), and added to its binade's first code; a carry out of
// the mantissa moves into the exponent by itself, and subnormals are the codes whose exponent field is 0.
#include "fp8.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace coda {

namespace {

struct Layout {
  int mantissa_bits, bias;
  uint8_t largest_code, nan_code;  // without the sign bit
};

Layout layout(Fp8Format format) {
  return format == Fp8Format::E4M3 ? Layout{3, 7, 0x7E, 0x7F} : Layout{2, 15, 0x7B, 0x7F};
}

}  // namespace

const char* fp8_format_name(Fp8Format format) { return format == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }

float fp8_largest(Fp8Format format) { return fp8_max_finite(format); }

float fp8_decode(uint8_t code, Fp8Format format) {
  const Layout l = layout(format);
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code & 0x7F) >> l.mantissa_bits, mantissa = code & ((1 << l.mantissa_bits) - 1);
  const int max_exponent = (0x7F >> l.mantissa_bits);
  float value;
  if (format == Fp8Format::E4M3 && (code & 0x7F) == l.nan_code)
    value = std::nanf("");
  else if (format == Fp8Format::E5M2 && exponent == max_exponent)
    value = mantissa == 0 ? INFINITY : std::nanf("");
  else if (exponent == 0)
    value = std::ldexp(static_cast<float>(mantissa), 1 - l.bias - l.mantissa_bits);
  else
    value = std::ldexp(static_cast<float>((1 << l.mantissa_bits) + mantissa), exponent - l.bias - l.mantissa_bits);
  return negative ? -value : value;
}

uint8_t fp8_encode(float x, Fp8Format format) {
  const Layout l = layout(format);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | l.nan_code;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= fp8_largest(format)) return sign | l.largest_code;
  // The unit in the last place of a, that of the subnormals below the smallest normal; then the code is
  // (exponent field - 1) << mbits plus the number of units, for normals and subnormals alike.
  const int min_exponent = 1 - l.bias;
  const int exponent = a == 0.0 ? min_exponent : std::max(std::ilogb(a), min_exponent);
  const double units = std::nearbyint(std::ldexp(a, l.mantissa_bits - exponent));  // exact, then RNE
  const int code = ((exponent - min_exponent) << l.mantissa_bits) + static_cast<int>(units);
  return sign | static_cast<uint8_t>(code);  // a < largest: the rounding cannot pass the largest code
}

const char* fp8_linear_name(int linear) {
  static const char* const names[kFp8Head + 1] = {"qkv", "attn_proj", "mlp_up", "mlp_down", "lm_head"};
  if (linear < 0 || linear > kFp8Head) throw std::out_of_range("fp8 linear " + std::to_string(linear));
  return names[linear];
}

unsigned parse_fp8_linears(const std::string& names, const std::string& key) {
  const auto refuse = [&](const std::string& why) {
    return std::invalid_argument(key + " = \"" + names + "\": " + why +
                                 "; give a comma-separated list of qkv, attn_proj, mlp_up, mlp_down, lm_head");
  };
  unsigned linears = 0;
  size_t begin = 0;
  while (begin <= names.size()) {
    const size_t end = std::min(names.find(',', begin), names.size());
    const std::string name = names.substr(begin, end - begin);
    int linear = 0;
    while (linear <= kFp8Head && name != fp8_linear_name(linear)) ++linear;
    if (linear > kFp8Head) throw refuse(name.empty() ? "an empty name" : "\"" + name + "\" is not one of them");
    if ((linears >> linear) & 1u) throw refuse("\"" + name + "\" is listed twice");
    linears |= 1u << linear;
    begin = end + 1;
  }
  return linears;
}

std::string Fp8Tensors::name(int index) const {
  static const char* const roles[3] = {"input", "weight", "output gradient"};
  const int per_role = kFp8Linears * layers();
  const int layer = index % per_role / kFp8Linears, linear = index % kFp8Linears;
  if (index < 0 || index >= count() || (layer == n_layer && linear != 0))
    throw std::out_of_range("fp8 tensor " + std::to_string(index) + " of a model of " + std::to_string(n_layer) +
                            " layers" + (head ? " and its LM head" : ""));
  const std::string role = roles[index / per_role];
  if (layer == n_layer) return std::string(fp8_linear_name(kFp8Head)) + " " + role;
  return "layer " + std::to_string(layer) + " " + fp8_linear_name(linear) + " " + role;
}

unsigned parse_fp8_scaling(const std::string& value) {
  if (value == "tensor") return 0;
  if (value == "block") return (1u << (kFp8Head + 1)) - 1;
  try {
    return parse_fp8_linears(value, "fp8_scaling");
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(e.what()) + " (the linears with block scales), or tensor or block");
  }
}

std::string Fp8Recipe::name() const {
  const std::string head = covers(kFp8Head) ? "-head" : "";
  if (!any_block()) return "fp8" + head;
  if (!any_tensor()) return "fp8-block" + head;
  std::string name = "fp8-block";
  char separator = '-';
  for (int linear = 0; linear <= kFp8Head; ++linear)
    if (block(linear)) {
      name += separator;
      name += fp8_linear_name(linear);
      separator = '+';
    }
  return name + head;
}

float fp8_block_scale(float amax, Fp8Format format) {
  return fp8_power_of_two(fp8_block_scale_exponent(amax, format));
}

bool fp8_block_copy(float* copy, const float* x, int rows, int cols, int block_rows, int block_cols,
                    Fp8Format format) {
  for (int r0 = 0; r0 < rows; r0 += block_rows)
    for (int c0 = 0; c0 < cols; c0 += block_cols) {
      const int r1 = std::min(rows, r0 + block_rows), c1 = std::min(cols, c0 + block_cols);
      float amax = 0.0f;
      for (int r = r0; r < r1; ++r)
        for (int c = c0; c < c1; ++c) {
          const float v = x[static_cast<size_t>(r) * cols + c];
          if (!std::isfinite(v)) return false;
          amax = std::max(amax, std::fabs(v));
        }
      const float s = fp8_block_scale(amax, format);
      for (int r = r0; r < r1; ++r)
        for (int c = c0; c < c1; ++c) {
          const size_t i = static_cast<size_t>(r) * cols + c;
          copy[i] = fp8_round(x[i] * s, format) / s;
        }
    }
  return true;
}

void check_fp8_state(const Fp8ScalingState& state, std::optional<int> history, const Fp8Tensors& tensors) {
  if (state.empty()) return;
  if (!history)
    throw std::invalid_argument("fp8 scaling state given to a run without FP8 (precision = bf16)");
  if (state.history != *history)
    throw std::invalid_argument("fp8 scaling state of " + std::to_string(state.history) +
                                " steps of history, but this run's fp8_history is " + std::to_string(*history));
  const size_t expected = static_cast<size_t>(tensors.count()) * state.history;
  if (state.amax.size() != expected)
    throw std::invalid_argument(
        "fp8 scaling state holds " + std::to_string(state.amax.size()) + " amax values; a model of " +
        std::to_string(tensors.n_layer) + " layers " + (tensors.head ? "with" : "without") +
        " the LM head in fp8_linears has " + std::to_string(expected) + " (" + std::to_string(tensors.count()) +
        " tensors x " + std::to_string(state.history) +
        " steps): the model differs, or lm_head is in one run's fp8_linears and not the other's");
}

float fp8_round(float x, Fp8Format format) {
  if (std::isnan(x)) return x;
  const Layout l = layout(format);
  const float a = std::fabs(x), largest = fp8_largest(format);
  if (a >= largest) return std::copysign(largest, x);
  const int min_exponent = 1 - l.bias;
  float r;
  if (a < std::ldexp(1.0f, min_exponent)) {  // the subnormals' fixed unit; scaling by powers of two is exact
    r = std::ldexp(std::nearbyint(std::ldexp(a, l.mantissa_bits - min_exponent)), min_exponent - l.mantissa_bits);
  } else {  // round the float's mantissa to mantissa_bits, ties to even; a carry moves into the exponent
    uint32_t bits = fp8_float_bits(a);
    const int drop = 23 - l.mantissa_bits;
    bits += (1u << (drop - 1)) - 1 + ((bits >> drop) & 1u);
    bits &= ~((1u << drop) - 1);
    r = fp8_bits_float(bits);
  }
  return std::copysign(r, x);  // below largest, the rounding cannot pass it
}

Fp8DelayedScale::Fp8DelayedScale(Fp8Format format, int history, int margin)
    : format_(format), margin_(margin), history_(history > 0 ? history : 0, 0.0f) {
  if (history < 1) throw std::invalid_argument("fp8 delayed scaling: history must be >= 1, got " + std::to_string(history));
  if (margin < 0) throw std::invalid_argument("fp8 delayed scaling: margin must be >= 0, got " + std::to_string(margin));
}

void Fp8DelayedScale::record(float amax, const std::string& what) {
  if (!std::isfinite(amax) || amax < 0.0f)
    throw std::runtime_error("fp8: " + what + " has amax " + std::to_string(amax) +
                             " (an overflow or NaN upstream; the scale is kept)");
  step_amax_ = std::max(step_amax_, amax);
}

void Fp8DelayedScale::update(int step) {
  if (step < 0) throw std::invalid_argument("fp8 delayed scaling: step must be >= 0, got " + std::to_string(step));
  history_[static_cast<size_t>(step) % history_.size()] = step_amax_;
  step_amax_ = 0.0f;
  rescale();
}

void Fp8DelayedScale::restore(const float* history) {
  std::copy_n(history, history_.size(), history_.begin());
  step_amax_ = 0.0f;
  rescale();
}

void Fp8DelayedScale::rescale() {
  const float amax = *std::max_element(history_.begin(), history_.end());
  if (amax > 0.0f) scale_ = std::ldexp(fp8_largest(format_) / amax, -margin_);
}

}  // namespace coda
