// FP8 on the host: the reference codecs of the two OCP 8-bit formats the H200's tensor cores multiply, and
// per-tensor delayed scaling. This is the specification the FP8 kernels are tested against (their
// quantization emulated here), and the scaling state a run saves.
//   e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity, S.1111.111 is NaN; largest 448.
//   e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like infinities and NaNs; largest 57344.
// Encoding rounds to nearest, ties to even, and saturates: a value beyond the largest finite one (an
// infinity too) becomes the largest finite one of its sign, which is what the GPU's satfinite converts do;
// NaN stays NaN.
// Delayed scaling: a tensor is stored as encode(x * scale) and read as decode(q) / scale; the scale comes
// from the largest |x| seen over the last `history` steps (amax history), scale = largest_finite /
// (amax * 2^margin), so this step's values are quantized with a scale known before they exist.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/fp8_format.cuh"

namespace coda {

const char* fp8_format_name(Fp8Format format);
float fp8_largest(Fp8Format format);  // the largest finite value
uint8_t fp8_encode(float x, Fp8Format format);
float fp8_decode(uint8_t code, Fp8Format format);

class Fp8DelayedScale {
 public:
  // history >= 1 steps of amax; margin: powers of two of headroom below the largest finite value.
  Fp8DelayedScale(Fp8Format format, int history, int margin = 0);

  // Records the largest |x| of a tensor quantized in step `step`: the step's amax is the max over its
  // records (the micro-batches of gradient accumulation), and the history keeps the last `history` steps
  // (a step without a record leaves its slot as it was). A non-finite amax is refused (std::runtime_error
  // naming `what` and the step), so an overflow never reaches the scale or the weights.
  void record(float amax, int step, const std::string& what);
  // The scale for the next step, from the history (1 while nothing non-zero was seen).
  void update();
  float scale() const { return scale_; }
  const std::vector<float>& history() const { return history_; }

 private:
  Fp8Format format_;
  int margin_;
  std::vector<float> history_;  // the amax of step s at s % history: the last `history` steps
  int recorded_step_ = -1;      // the step of the latest record
  float scale_ = 1.0f;
};

}  // namespace coda
