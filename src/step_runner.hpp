// A step runner runs the pieces of a training step of one mode and model family on the device state
// (device_state.hpp) and owns its activations: the unfused mode (unfused_runner.cu: cuBLASLt GEMMs plus
// one kernel per operation), the CODA mode of the LayerNorm family (coda_layernorm.cu) and of the RMSNorm
// family (coda_rmsnorm.cu). CudaBackend (cuda_backend.hpp) uploads the batch, calls the pieces in order
// (embedding, blocks, head, loss; head, blocks from the top down, embedding) and starts each gradient
// bucket's all-reduce as soon as the piece that finishes it is enqueued; every piece finishes its own
// layer's gradients, so that overlap holds for every runner.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>
#include <optional>
#include <string>

#include "device_state.hpp"
#include "fp8.hpp"
#include "kernels/attention/attention.cuh"

namespace coda {

// What a runner is asked for beyond the model: the block linears in FP8 (the unfused runner), and sums
// in a fixed order (deterministic: the attention backward's dQ over key blocks, and in the coda mode the
// weight gradients without split-K), so that a step is bitwise reproducible.
struct RunnerOptions {
  std::optional<Fp8Recipe> fp8;
  bool deterministic = false;
};

class StepRunner {
 public:
  using bf16 = __nv_bfloat16;
  // The buffers the backend writes (the batch) and reads (losses, logits) around the pieces.
  struct StepIO {
    int32_t* tokens = nullptr;         // [N]
    int32_t* targets = nullptr;        // [N]
    int32_t* token_buckets = nullptr;  // [3N + 1], unfused::TokenBuckets::packed
    int num_token_buckets = 0;         // of the current batch
    bf16* logits = nullptr;            // [N, Vp]; the backward may overwrite it with dlogits
    float* losses = nullptr;           // [N]
    float* logits_lse = nullptr;       // [N]
    bool training = false;             // the forward pieces belong to a training micro-batch
  };

  StepRunner(DeviceState& state, bool deterministic);
  virtual ~StepRunner() = default;
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  virtual std::string mode() const = 0;  // "unfused", "unfused-fp8", "unfused-fp8-block", "coda"
  bool deterministic() const { return deterministic_; }
  // Reserves the StepIO buffers and then the runner's own (plan_buffers).
  void plan(ArenaPlan& plan);
  // After allocation: tables the runner computes once (the RoPE table).
  virtual void upload_tables() {}

  // The pieces of a step, on the state's stream, for B sequences of T tokens (N = B*T rows).
  virtual void embedding_forward(int B, int T) = 0;
  virtual void block_forward(int layer, int B, int T) = 0;
  virtual void head_forward(int B, int T) = 0;  // final norm and logits
  virtual void loss_forward(int B, int T) = 0;  // per-row losses and lse
  virtual void head_backward(int B, int T, float dloss) = 0;
  virtual void block_backward(int layer, int B, int T) = 0;
  virtual void embedding_backward(int B, int T) = 0;

  // FP8 (fp8_linears.hpp), for a runner that has it: closes optimizer step `step` (0-based; comm: the
  // data-parallel ranks, or null), and the scaling state in and out. A bf16 runner has no state.
  virtual void close_fp8_step(int step, Communicator* comm) {
    (void)step;
    (void)comm;
  }
  virtual Fp8ScalingState read_fp8_state() { return {}; }
  virtual void load_fp8_state(const Fp8ScalingState& state) { check_fp8_state(state, std::nullopt, Fp8Tensors(0, false)); }

  StepIO io;

 protected:
  virtual void plan_buffers(ArenaPlan& plan) = 0;
  const bf16* weight(size_t offset) const { return state_.weight(offset); }
  float* grad(size_t offset) const { return state_.grad(offset); }
  AttentionShape attention_shape(int B, int T) const {
    return AttentionShape{B, T, config_.n_head, config_.n_kv_head, config_.head_dim()};
  }
  DqSum dq_sum() const { return deterministic_ ? DqSum::Ordered : DqSum::Atomic; }
  // The attention backward's workspace at the largest batch.
  size_t attention_workspace_bytes() const {
    return attention_backward_workspace_bytes(attention_shape(state_.max_batch(), state_.max_seq_len()), dq_sum());
  }
  size_t max_rows() const { return static_cast<size_t>(state_.max_batch()) * state_.max_seq_len(); }
  // The embedding backward from d_residual (the gradient of the residual stream entering layer 0) and
  // the batch's token buckets, into the gradients of wte (and wpe): one kernel every mode shares.
  void embedding_backward_from(const bf16* d_residual, int B, int T);

  DeviceState& state_;
  const ModelConfig& config_;
  const ParamLayout& layout_;
  const cudaStream_t stream_;
  const bool deterministic_;
};

// The runners, not yet planned (the backend plans and allocates them with the state). Only the unfused
// one takes options.fp8.
std::unique_ptr<StepRunner> make_unfused_runner(DeviceState& state, const RunnerOptions& options);
std::unique_ptr<StepRunner> make_coda_layernorm_runner(DeviceState& state, const RunnerOptions& options);
std::unique_ptr<StepRunner> make_coda_rmsnorm_runner(DeviceState& state, const RunnerOptions& options);

}  // namespace coda
