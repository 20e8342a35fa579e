// The linears of the unfused mode in FP8 (precision = fp8, docs/FP8.md): the block linears, and the LM head
// where fp8_linears names it (x the final norm's output, W the head weight, dy the dlogits), with the CPU
// reference's emulation (RefModel::enable_fp8) as the specification. For a linear y = x W^T:
//   forward   x -> xq (e4m3, row-major, scratch) and xqT (e4m3, [IC, N], kept for the weight gradient),
//             W -> wq and wqT (e4m3), both from one read each;  y = dq_x dq_w (xq wq^T)
//   backward  dy -> dyq and dyqT (e5m2, from one read);  dx = dq_dy dq_w (dyq wqT^T),
//             dW += dq_dy dq_x (dyqT xqT^T)   (fp32, accumulating)
// Every GEMM is cuBLASLt's FP8 GEMM with both operands K-major (Hopper's only FP8 layout), which is why
// each operand that another GEMM reads along its other index has a transposed copy. Each quantize records
// its tensor's amax in the same pass (per-tensor delayed scaling: the scale comes from the history of the
// steps before); close_step turns a step's amax into the next step's scales on the device, and is the one
// place the host looks at them (a non-finite amax stops the run before the weights change).
// Before the first step has closed there is no history: that step quantizes only to record the amax and
// multiplies the bf16 operands (calibration), as the reference does. An evaluation forward quantizes
// with the current scales and records into a scratch amax, so it leaves the scaling state as it was.
// The weights are quantized at every forward (one read of the bf16 working copy): nothing can go stale
// when parameters are loaded or updated (estimated at 4 bytes per block parameter: about 1.2 ms per
// micro-batch for llama3.2-1b).
// Shapes: training needs N = B*T a multiple of 16 (the weight gradient's K); every IC and OC of the model a
// multiple of 16 (checked at construction). An evaluation forward takes any N.
// Block scaling (Fp8Recipe::block(linear): fp8_scaling = "block" for every linear, or a list of them): every
// copy e4m3 with a factor per block (unfused::quantize_fp8_blocks): x in 1 x 128 row blocks (xq) and 128 x 1
// column blocks (xqT), W in 128 x 128 tiles (wq and wqT the same tiles), dy likewise in both; the GEMMs take
// the factors as cuBLASLt's block scales. Such a linear records no amax, needs no calibration step and runs
// in FP8 from the first step; a tile with a value that is not finite flags its tensor, and close_step stops
// the run naming it. Its widths and the training N multiples of 128; an evaluation forward whose N is not
// runs that linear in bf16. The other linears of the recipe keep per-tensor delayed scaling, above.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "device_state.hpp"
#include "fp8.hpp"
#include "kernels/gemm/cublaslt.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda {

class Communicator;

class Fp8Linears {
 public:
  using bf16 = __nv_bfloat16;
  Fp8Linears(DeviceState& state, CublasLt& cublas, const Fp8Recipe& recipe);
  ~Fp8Linears();
  Fp8Linears(const Fp8Linears&) = delete;
  Fp8Linears& operator=(const Fp8Linears&) = delete;

  void plan(ArenaPlan& plan);
  bool covers(int linear) const { return recipe_.covers(linear); }  // runs in FP8 (the recipe's linears)
  const Fp8Recipe& recipe() const { return recipe_; }
  void upload_initial_scales();  // after allocation: every scale 1, no history

  // The four linears of a block (linear: 0 qkv, 1 attention output, 2 MLP up, 3 MLP down; layer its block)
  // and the LM head (linear kFp8Head, any layer) of y[N, OC] = x[N, IC] W^T, W the parameter at offset w, and
  // its backward (dx overwritten, dW accumulated; x, the forward's bf16 input, is read by the calibration
  // step's bf16 weight gradient only).
  void forward(bf16* y, const bf16* x, int layer, int linear, size_t w, int N, int IC, int OC, bool training);
  void backward(bf16* dx, const bf16* dy, const bf16* x, int layer, int linear, size_t w, int N, int IC, int OC);

  // Closes optimizer step `step` (0-based): with comm, the step's amax is first the max over its ranks (every
  // rank then quantizes alike, and one rank's checkpoint holds the job's state). Throws std::runtime_error
  // naming the first tensor whose amax was not finite.
  void close_step(int step, Communicator* comm);
  Fp8ScalingState read_state();
  void load_state(const Fp8ScalingState& state);

 private:
  int tensor(Fp8Role role, int layer, int linear) const { return tensors_.index(role, layer, linear); }
  const float* scale(int t) const { return scales_ + t; }
  const float* dequant(int t) const { return dequants_ + static_cast<size_t>(t) * unfused::kFp8DequantSlot; }
  float* amax(int t, bool training) const { return (training ? amax_ : eval_amax_) + t; }

  DeviceState& state_;
  CublasLt& cublas_;
  const Fp8Recipe recipe_;
  const Fp8Tensors tensors_;
  const int count_;  // tensors_.count()
  bool calibrated_ = false;

  float* scales_ = nullptr;        // [count]
  float* dequants_ = nullptr;      // [count, kFp8DequantSlot], 1 / scale in each slot's first float
  float* history_ = nullptr;       // [count, history]
  float* amax_ = nullptr;          // [count], this step's, gathered by the quantize calls
  float* eval_amax_ = nullptr;     // [count], what evaluation forwards record into (never read)
  unsigned int* bad_ = nullptr;    // [1], fp8_update_scales's first non-finite tensor + 1
  unsigned int* block_bad_ = nullptr;  // [1], block scaling: the float bits of the largest flagged tensor + 1
                                       // (a float, for all_reduce_max)
  unsigned int* host_bad_ = nullptr;  // pinned [2]: bad_ and block_bad_ as close_step reads them
  struct Linear {
    uint8_t* wq = nullptr;   // [OC, IC]
    uint8_t* wqT = nullptr;  // [IC, OC]
    uint8_t* xqT = nullptr;  // [IC, N], kept from the forward for the weight gradient
    float* wq_dequant = nullptr;   // block scaling: [OC / 128, IC / 128 padded] (Fp8BlockCopies gives the layouts)
    float* wqT_dequant = nullptr;  // block scaling: [IC / 128, OC / 128 padded]
    float* xqT_dequant = nullptr;  // block scaling: [N / 128, IC]
  };
  void forward_blocks(bf16* y, const bf16* x, int layer, int linear, size_t w, int N, int IC, int OC, bool training);
  void backward_blocks(bf16* dx, const bf16* dy, int layer, int linear, size_t w, int N, int IC, int OC);
  std::vector<Linear> linears_;  // [tensors_.layers() * 4], by Fp8Tensors::slot
  uint8_t* xq_ = nullptr;        // scratch [N, max IC]
  uint8_t* dyq_ = nullptr;       // scratch [N, max OC]
  uint8_t* dyqT_ = nullptr;      // scratch [max OC, N]
  float* xq_dequant_ = nullptr;    // block scaling, scratch [max IC / 128, N]
  float* dyq_dequant_ = nullptr;   // block scaling, scratch [max OC / 128, N]
  float* dyqT_dequant_ = nullptr;  // block scaling, scratch [N / 128, max OC]
};

}  // namespace coda
