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
// Block scaling (fp8_scaling = "block", or a list of the linears that take it): one scale per block of 128
// values along the K of the GEMM that reads the copy, or per 128 x 128 tile of a weight; see fp8_block_copy.
// The FP8 training recipe (docs/FP8.md) runs the block linears (and, where named, the LM head) in FP8;
// Fp8Recipe holds its numbers, Fp8ScalingState what a checkpoint keeps of it, and Fp8Tensors the one order
// of the scaled tensors that the CPU reference, the GPU and the checkpoint share.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/common/fp8_format.cuh"

namespace coda {

const char* fp8_format_name(Fp8Format format);
float fp8_largest(Fp8Format format);  // the largest finite value
uint8_t fp8_encode(float x, Fp8Format format);
float fp8_decode(uint8_t code, Fp8Format format);
// fp8_decode(fp8_encode(x)) without the code, by rounding x's float bits: the emulation's inner loop.
float fp8_round(float x, Fp8Format format);

// The linears FP8 can cover, in fp8_linear_name's numbering: the four of every block (0 qkv, 1 attention
// output, 2 MLP up, 3 MLP down) and the LM head (kFp8Head, "lm_head": logits = normf Wv^T, its output
// gradient dlogits), which stays bf16 unless named.
constexpr int kFp8Linears = 4;  // per block
constexpr int kFp8Head = 4;

// precision = "fp8": on the linears whose bits are set in `linears` (bit i: linear i in fp8_linear_name's
// numbering; the others stay bf16, their scales unused), block scaling (fp8_block_copy: per-block current
// scaling) where `block_linears` has the bit too, delayed per-tensor scaling (Fp8DelayedScale) over `history`
// steps with `margin` powers of two of headroom elsewhere.
struct Fp8Recipe {
  int history = 16;
  int margin = 0;
  unsigned linears = 0xF;  // the four block linears; the LM head stays bf16
  unsigned block_linears = 0;
  bool covers(int linear) const { return linear >= 0 && linear < 32 && ((linears >> linear) & 1u); }
  bool block(int linear) const { return covers(linear) && ((block_linears >> linear) & 1u); }
  bool any_block() const { return (linears & block_linears) != 0; }
  bool any_tensor() const { return (linears & ~block_linears) != 0; }
  // In backend and mode names: "fp8" (per-tensor scales), "fp8-block" (block scales on every FP8 linear),
  // "fp8-block-mlp_down" (block scales on those linears, joined by '+'); "-head" after it where the LM head
  // is one of the FP8 linears ("fp8-head", "fp8-block-mlp_down-head").
  std::string name() const;
};

// Block scaling. Each copy of a tensor is quantized in blocks of kFp8Block values along the K of the GEMM that
// reads it: an input or output gradient in 1 x 128 blocks of its rows for the forward or dgrad (K = its
// columns) and in 128 x 1 blocks of its columns for the weight gradient (K = the tokens); a weight in
// 128 x 128 tiles, which serve the forward and, transposed, the dgrad alike. A block's scale comes from its
// own amax in the same pass (current scaling: no history, no calibration step) and is a power of two, so
// x s is exact and the GPU's copy is bit-identical to this one; every role is e4m3 (the block scale leaves no
// use for e5m2's range, and gradients keep a third mantissa bit).
constexpr int kFp8Block = 128;
// 2^k for the largest k with amax 2^k <= the format's largest finite value (k clamped to [-126, 126]; 1 for
// an amax of 0).
float fp8_block_scale(float amax, Fp8Format format);
// copy = the emulated FP8 copy of the row-major [rows, cols] matrix x in blocks of block_rows x block_cols
// (partial at the tails): decode(encode(x s)) / s with s the fp8_block_scale of the block's amax. False (the
// copy then unspecified) where a block holds a value that is not finite.
bool fp8_block_copy(float* copy, const float* x, int rows, int cols, int block_rows, int block_cols,
                    Fp8Format format);

// The scaled tensors of a model of n_layer blocks: for each of the four block linears its input (e4m3), its
// weight (e4m3) and its output gradient (e5m2), and where the recipe covers the LM head its three as linear 0
// of one more layer (layer n_layer; the other three slots of that layer stay unused). Grouped by role:
// index = (role * layers + layer) * 4 + linear, so the e4m3 tensors come first. This is the one order of the
// scaled tensors that the CPU reference, the GPU and the checkpoint share.
enum class Fp8Role { Input = 0, Weight = 1, OutputGrad = 2 };
inline Fp8Format fp8_role_format(Fp8Role role) { return role == Fp8Role::OutputGrad ? Fp8Format::E5M2 : Fp8Format::E4M3; }
struct Fp8Tensors {
  int n_layer = 0;
  bool head = false;
  Fp8Tensors(int layers, bool with_head) : n_layer(layers), head(with_head) {}
  Fp8Tensors(int layers, const Fp8Recipe& recipe) : Fp8Tensors(layers, recipe.covers(kFp8Head)) {}
  int layers() const { return n_layer + (head ? 1 : 0); }
  int count() const { return 3 * kFp8Linears * layers(); }
  int e4m3_count() const { return 2 * kFp8Linears * layers(); }  // the inputs and weights, first
  // The grid slot of a linear (the head's: layer n_layer, linear 0), as layer * 4 + linear.
  int slot(int layer, int linear) const { return linear == kFp8Head ? kFp8Linears * n_layer : kFp8Linears * layer + linear; }
  int index(Fp8Role role, int layer, int linear) const {
    return static_cast<int>(role) * kFp8Linears * layers() + slot(layer, linear);
  }
  Fp8Format format(int index) const { return fp8_role_format(static_cast<Fp8Role>(index / (kFp8Linears * layers()))); }
  std::string name(int index) const;  // "layer 3 mlp_down output gradient", "lm_head weight"
};
const char* fp8_linear_name(int linear);  // "qkv", "attn_proj", "mlp_up", "mlp_down", "lm_head"
// The bit set of a comma-separated list of those names ("qkv,mlp_up"); a name that is not one of them, a
// repeated one or an empty list is an std::invalid_argument that names the key and lists the names.
unsigned parse_fp8_linears(const std::string& names, const std::string& key = "fp8_linears");
// fp8_scaling: "tensor" (no linear with block scales), "block" (all of them) or the list of those with block
// scales ("mlp_down"); the Fp8Recipe::block_linears it names.
unsigned parse_fp8_scaling(const std::string& value);

// A run's delayed-scaling state between steps: each scaled tensor's amax history, [tensor][history] in
// fp8_tensor_index order. Empty: nothing recorded yet (a bf16 run, or an FP8 run before its first step).
struct Fp8ScalingState {
  int history = 0;
  std::vector<float> amax;
  bool empty() const { return amax.empty(); }
};
// Throws std::invalid_argument, with the numbers, unless `state` is empty or fits the scaled tensors of a run
// with FP8 and a history of `history` steps (nullopt: a bf16 run, which takes none).
void check_fp8_state(const Fp8ScalingState& state, std::optional<int> history, const Fp8Tensors& tensors);

class Fp8DelayedScale {
 public:
  // history >= 1 steps of amax; margin >= 0.
  Fp8DelayedScale(Fp8Format format, int history, int margin = 0);

  // Records the largest |x| of a tensor quantized in the current step: the step's amax is the max over its
  // records (the micro-batches of gradient accumulation). A non-finite amax is refused (std::runtime_error
  // naming `what`), so an overflow never reaches the scale or the weights.
  void record(float amax, const std::string& what);
  // Closes optimizer step `step` (0 for the first): its amax goes into history slot step % history (zero
  // when nothing was recorded), and the scale for the next step comes from the history (kept while the
  // history holds only zeros; 1 at the start). The GPU's fp8_update_scales does the same operations.
  void update(int step);
  // The history as a checkpoint keeps it (after update), and back; the scale follows from it.
  const std::vector<float>& history() const { return history_; }
  void restore(const float* history);
  float scale() const { return scale_; }

 private:
  void rescale();

  Fp8Format format_;
  int margin_;
  std::vector<float> history_;  // the amax of step s at s % history: the last `history` steps
  float step_amax_ = 0.0f;      // the max of the current step's records
  float scale_ = 1.0f;
};

}  // namespace coda
