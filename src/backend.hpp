// The interface between the training loop and a compute backend. A backend owns one model's parameters
// (fp32 master copy plus whatever working precision it computes in), gradients and AdamW state on one
// device, and runs the pieces of a training step. The CPU reference backend is the spec; the GPU
// backends (unfused: cuBLASLt + one kernel per operation; coda: GEMM-epilogue programs) must match it
// within bf16 tolerances.
// All host-side buffers exchanged here are flat fp32 arrays in ParamLayout order (model.hpp), so the
// checkpoint code and the tests never see a backend's internal precision or placement.

#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "fp8.hpp"
#include "model.hpp"

namespace coda {

class Communicator;  // distributed.hpp

struct AdamWHyper {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // decoupled; applied only to tensors with ParamTensor::weight_decay
};

// Device time of the phases of the latest forward_backward (forward incl. loss, backward) and
// adamw_step (optimizer) calls, in milliseconds; zeros from a backend that does not measure them.
struct PhaseTimes {
  double forward_ms = 0.0, backward_ms = 0.0, optimizer_ms = 0.0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // Parameters, gradients and optimizer moments in and out, as flat fp32 host arrays of layout.total.
  virtual void load_params(const float* params) = 0;
  virtual void read_params(float* params) = 0;
  virtual void load_optimizer_state(const float* m, const float* v) = 0;
  virtual void read_optimizer_state(float* m, float* v) = 0;
  virtual void read_grads(float* grads) = 0;

  virtual void zero_grad() = 0;
  // One micro-batch (tokens and targets are host arrays of B*T ids): forward, loss, backward. Adds the
  // gradient of grad_scale * mean_loss into the gradient buffer and returns the mean loss.
  virtual float forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T, float grad_scale) = 0;
  // Forward only: mean loss over the B*T targets.
  virtual float forward_loss(const int32_t* tokens, const int32_t* targets, int B, int T) = 0;
  // Forward only: logits at the last position of each of the B sequences, out is [B, vocab_size].
  virtual void last_logits(const int32_t* tokens, int B, int T, float* out) = 0;

  // Global L2 norm of the gradient buffer.
  virtual float grad_norm() = 0;
  // One AdamW update (bias-corrected, step is 1-based) on grad_scale * gradients. It closes the step: in
  // FP8 the scales for the next step are updated first, and a non-finite amax of the step (an overflow
  // upstream) throws std::runtime_error naming the tensor and the step, before any weight changes.
  virtual void adamw_step(const AdamWHyper& hyper, int step, float grad_scale) = 0;

  // FP8 (precision = fp8, docs/FP8.md): the delayed-scaling state the next step quantizes with, for
  // checkpoints (empty in bf16 and before the first step), and back (check_fp8_state's rules).
  virtual Fp8ScalingState read_fp8_state() { return {}; }
  virtual void load_fp8_state(const Fp8ScalingState& state) { check_fp8_state(state, std::nullopt, Fp8Tensors(0, false)); }

  virtual PhaseTimes last_phase_times() { return {}; }

  // Data parallelism. The next forward_backward call (the last micro-batch of a step) also averages the
  // gradient buffer over the ranks of comm: when it returns, the buffer holds the mean over ranks of every
  // rank's accumulated gradients. A backend may start the reduction of finished parts while the rest of
  // that backward runs. Backends that cannot communicate (the CPU) refuse.
  virtual void average_grads_in_next_backward(Communicator& comm) {
    (void)comm;
    throw std::logic_error("backend " + name() +
                           " cannot average gradients across ranks (data parallelism needs the cuda backend)");
  }
};

// Why the coda programs of the model's norm family do not cover it (a feature they lack, its head size),
// or "" when they do (coda_runner.cu). The unfused mode covers every model.
std::string coda_unsupported_reason(const ModelConfig& config);

// The fp32 CPU reference backend (ref_model.hpp); with fp8, the block linears in emulated FP8.
std::unique_ptr<Backend> make_cpu_backend(const ModelConfig& config, int max_batch, int max_seq_len,
                                          const std::optional<Fp8Recipe>& fp8 = std::nullopt);

// The CUDA backend (cuda_backend.hpp) on the current device, kernels = "unfused" (cuBLASLt GEMMs plus one
// kernel per operation, any model), "coda" (GEMM-epilogue programs, coda_runner.hpp, for the model's norm
// family) or "auto" (coda where coda_unsupported_reason is empty, else unfused with a warning that gives
// the reason). With fp8, the block linears run as cuBLASLt FP8 GEMMs (docs/FP8.md) in the unfused mode,
// which auto then picks. Throws std::invalid_argument for an unknown kernels mode, kernels = coda on a
// model it does not cover or with fp8, and std::runtime_error, with the numbers, when the model and batch
// do not fit in the free device memory.
// options.zero1: ZeRO-1 over its ranks (docs/DISTRIBUTED.md). Each rank keeps the fp32 master weights and
// AdamW moments of its shard only; the interface stays the same, with full flat arrays in and out, but
// grad_norm, adamw_step, read_params and read_optimizer_state become collective (every rank calls them,
// in the same order), average_grads_in_next_backward must be given zero1's communicator and reduces each
// gradient to its shard's owner only (read_grads shows the mean over ranks on the own shard alone), and
// load_params / load_optimizer_state take every rank's copy of the full state and keep the own shard.
struct CudaBackendOptions {
  Communicator* zero1 = nullptr;    // ZeRO-1 over its ranks, or none
  std::optional<Fp8Recipe> fp8;     // precision = fp8: the block linears as FP8 GEMMs (unfused mode)
  bool deterministic = false;       // every sum in a fixed order: bitwise reproducible steps (docs/CODA.md)
};
std::unique_ptr<Backend> make_cuda_backend(const ModelConfig& config, const std::string& kernels, int max_batch,
                                           int max_seq_len, const CudaBackendOptions& options = {});

}  // namespace coda
