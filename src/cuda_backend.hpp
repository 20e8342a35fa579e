// The CUDA backend: one model on one GPU, bf16 weights and activations, fp32 master weights, gradients
// and AdamW moments. It is the device state (device_state.hpp: arena, parameters, optimizer, ZeRO-1,
// gradient buckets) plus a step runner (step_runner.hpp: the unfused mode, or the CODA mode of the
// model's family), put together by make_cuda_backend (backend.hpp), the one place that picks the runner.
// A step: upload the batch, the runner's forward pieces, the token grouping of the embedding backward on
// the host meanwhile, the backward pieces each followed by its gradient bucket's all-reduce on the
// communicator's stream (data parallelism, docs/DISTRIBUTED.md), and the per-row losses read back: the
// only host wait of a micro-batch.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "backend.hpp"
#include "device_state.hpp"
#include "step_runner.hpp"

namespace coda {

class CudaBackend final : public Backend {
 public:
  // The state and the runner that `make_runner` makes on it; with zero1, the optimizer state sharded
  // over its ranks; allocated.
  using RunnerFactory = std::function<std::unique_ptr<StepRunner>(DeviceState&)>;
  CudaBackend(const ModelConfig& config, int max_batch, int max_seq_len, Communicator* zero1,
              const RunnerFactory& make_runner);
  ~CudaBackend() override;

  std::string name() const override {
    return "cuda-" + runner_->mode() + (runner_->deterministic() ? "-deterministic" : "");
  }
  void load_params(const float* params) override { state_.load_params(params); }
  void read_params(float* params) override { state_.read_params(params); }
  void load_optimizer_state(const float* m, const float* v) override { state_.load_optimizer_state(m, v); }
  void read_optimizer_state(float* m, float* v) override { state_.read_optimizer_state(m, v); }
  void read_grads(float* grads) override { state_.read_grads(grads); }
  void zero_grad() override { state_.zero_grad(); }
  float forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T, float grad_scale) override;
  float forward_loss(const int32_t* tokens, const int32_t* targets, int B, int T) override;
  void last_logits(const int32_t* tokens, int B, int T, float* out) override;
  float grad_norm() override { return state_.grad_norm(); }
  void adamw_step(const AdamWHyper& hyper, int step, float grad_scale) override;
  PhaseTimes last_phase_times() override;
  void average_grads_in_next_backward(Communicator& comm) override;
  Fp8ScalingState read_fp8_state() override { return runner_->read_fp8_state(); }
  void load_fp8_state(const Fp8ScalingState& state) override { runner_->load_fp8_state(state); }

 private:
  void check_shape(int B, int T, const char* what) const;
  void upload_batch(const int32_t* tokens, const int32_t* targets, int B, int T);
  void forward(int B, int T);  // embedding, blocks, head
  float mean_loss(int N);      // waits for the stream
  // With a communicator armed: the reduction of the next gradient bucket, once the stream has finished it.
  void reduce_next_bucket(Communicator* comm, size_t& bucket);

  DeviceState state_;
  std::unique_ptr<StepRunner> runner_;
  const ModelConfig& config_;
  const cudaStream_t stream_;
  Communicator* reduce_comm_ = nullptr;  // armed by average_grads_in_next_backward for one backward
  Communicator* data_parallel_comm_ = nullptr;  // the latest one armed: the ranks FP8's amax is shared by

  // Pinned host staging for the per-step transfers.
  int32_t* host_tokens_ = nullptr;   // [N] tokens, [N] targets
  int32_t* host_buckets_ = nullptr;  // [3N + 1]
  float* host_losses_ = nullptr;     // [N]
  enum Event { kForwardStart, kForwardEnd, kBackwardEnd, kOptimizerStart, kOptimizerEnd, kEvents };
  cudaEvent_t events_[kEvents] = {};
  bool step_timed_ = false, optimizer_timed_ = false;
};

}  // namespace coda
