// The CUDA backend; see cuda_backend.hpp for the structure.
// The host computes the embedding backward's token grouping (a counting sort) while the GPU runs the
// forward pass; the only synchronisation of a step is reading back the per-row losses at its end.
#include "cuda_backend.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "distributed.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda {

namespace {

using bf16 = __nv_bfloat16;

float bf16_bits_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

}  // namespace

CudaBackend::CudaBackend(const ModelConfig& config, int max_batch, int max_seq_len, Communicator* zero1,
                         const RunnerFactory& make_runner)
    : state_(config, max_batch, max_seq_len), config_(state_.config()), stream_(state_.stream()) {
  if (zero1 != nullptr) state_.shard_optimizer_state(*zero1);
  runner_ = make_runner(state_);
  state_.allocate(runner_->mode(), [this](ArenaPlan& plan) { runner_->plan(plan); });
  runner_->upload_tables();
  for (cudaEvent_t& event : events_) CUDA_CHECK(cudaEventCreate(&event));
  const size_t N = static_cast<size_t>(max_batch) * max_seq_len;
  CUDA_CHECK(cudaMallocHost(&host_tokens_, 2 * N * sizeof(int32_t)));
  CUDA_CHECK(cudaMallocHost(&host_buckets_, (3 * N + 1) * sizeof(int32_t)));
  CUDA_CHECK(cudaMallocHost(&host_losses_, N * sizeof(float)));
}

CudaBackend::~CudaBackend() {
  // Teardown must not throw: errors here cannot be reported usefully.
  cudaStreamSynchronize(stream_);
  cudaFreeHost(host_tokens_);
  cudaFreeHost(host_buckets_);
  cudaFreeHost(host_losses_);
  for (cudaEvent_t event : events_)
    if (event != nullptr) cudaEventDestroy(event);
}

void CudaBackend::forward(int B, int T) {
  runner_->embedding_forward(B, T);
  for (int layer = 0; layer < config_.n_layer; ++layer) runner_->block_forward(layer, B, T);
  runner_->head_forward(B, T);
}

void CudaBackend::check_shape(int B, int T, const char* what) const {
  if (B < 1 || T < 1 || B > state_.max_batch() || T > state_.max_seq_len())
    throw std::invalid_argument(std::string("cuda backend ") + what + ": B=" + std::to_string(B) +
                                " T=" + std::to_string(T) + " outside the allocated B <= " +
                                std::to_string(state_.max_batch()) + ", T <= " + std::to_string(state_.max_seq_len()));
}

void CudaBackend::upload_batch(const int32_t* tokens, const int32_t* targets, int B, int T) {
  const size_t N = static_cast<size_t>(B) * T;
  const int32_t V = config_.vocab_size;
  for (size_t n = 0; n < N; ++n)
    if (tokens[n] < 0 || tokens[n] >= V || (targets != nullptr && (targets[n] < 0 || targets[n] >= V)))
      throw std::invalid_argument("cuda backend: token or target id at position " + std::to_string(n) +
                                  " is outside the vocabulary of " + std::to_string(V));
  std::memcpy(host_tokens_, tokens, N * sizeof(int32_t));
  CUDA_CHECK(cudaMemcpyAsync(runner_->io.tokens, host_tokens_, N * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  if (targets != nullptr) {
    std::memcpy(host_tokens_ + N, targets, N * sizeof(int32_t));
    CUDA_CHECK(
        cudaMemcpyAsync(runner_->io.targets, host_tokens_ + N, N * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  }
}

float CudaBackend::mean_loss(int N) {
  CUDA_CHECK(cudaMemcpyAsync(host_losses_, runner_->io.losses, N * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  state_.wait_stream();
  double sum = 0.0;
  for (int n = 0; n < N; ++n) sum += host_losses_[n];
  return static_cast<float>(sum / N);
}

float CudaBackend::forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T, float grad_scale) {
  check_shape(B, T, "forward_backward");
  const int N = B * T;
  upload_batch(tokens, targets, B, T);
  CUDA_CHECK(cudaEventRecord(events_[kForwardStart], stream_));
  runner_->io.training = true;
  forward(B, T);
  runner_->loss_forward(B, T);
  CUDA_CHECK(cudaEventRecord(events_[kForwardEnd], stream_));

  const unfused::TokenBuckets buckets = unfused::group_rows_by_token(tokens, N, config_.vocab_size);
  std::copy(buckets.packed.begin(), buckets.packed.end(), host_buckets_);
  CUDA_CHECK(cudaMemcpyAsync(runner_->io.token_buckets, host_buckets_, buckets.packed.size() * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  runner_->io.num_token_buckets = buckets.num_buckets;

  Communicator* comm = std::exchange(reduce_comm_, nullptr);
  size_t bucket = 0;
  runner_->head_backward(B, T, grad_scale / static_cast<float>(N));
  reduce_next_bucket(comm, bucket);
  for (int layer = config_.n_layer - 1; layer >= 0; --layer) {
    runner_->block_backward(layer, B, T);
    reduce_next_bucket(comm, bucket);
  }
  runner_->embedding_backward(B, T);
  reduce_next_bucket(comm, bucket);
  if (comm != nullptr) {
    if (bucket != state_.num_buckets()) throw std::logic_error("cuda backend: gradient buckets left unreduced");
    comm->join(stream_);
  }
  CUDA_CHECK(cudaEventRecord(events_[kBackwardEnd], stream_));
  step_timed_ = true;
  if (comm != nullptr) comm->wait(stream_);
  return mean_loss(N);
}

void CudaBackend::average_grads_in_next_backward(Communicator& comm) {
  if (state_.zero1_comm() != nullptr && &comm != state_.zero1_comm())
    throw std::logic_error("cuda backend: ZeRO-1 reduces gradients over the communicator it was sharded with");
  reduce_comm_ = &comm;
  data_parallel_comm_ = &comm;
}

void CudaBackend::reduce_next_bucket(Communicator* comm, size_t& bucket) {
  if (comm != nullptr) state_.reduce_bucket(*comm, bucket++);
}

float CudaBackend::forward_loss(const int32_t* tokens, const int32_t* targets, int B, int T) {
  check_shape(B, T, "forward_loss");
  upload_batch(tokens, targets, B, T);
  runner_->io.training = false;
  forward(B, T);
  runner_->loss_forward(B, T);
  return mean_loss(B * T);
}

void CudaBackend::last_logits(const int32_t* tokens, int B, int T, float* out) {
  check_shape(B, T, "last_logits");
  upload_batch(tokens, nullptr, B, T);
  runner_->io.training = false;
  forward(B, T);
  const size_t Vp = config_.padded_vocab();
  std::vector<uint16_t> rows(static_cast<size_t>(B) * Vp);
  CUDA_CHECK(cudaMemcpy2DAsync(rows.data(), Vp * sizeof(bf16), runner_->io.logits + (T - 1) * Vp,
                               static_cast<size_t>(T) * Vp * sizeof(bf16), Vp * sizeof(bf16), B,
                               cudaMemcpyDeviceToHost, stream_));
  state_.wait_stream();
  for (int b = 0; b < B; ++b)
    for (int v = 0; v < config_.vocab_size; ++v)
      out[static_cast<size_t>(b) * config_.vocab_size + v] = bf16_bits_to_float(rows[b * Vp + v]);
}

void CudaBackend::adamw_step(const AdamWHyper& hyper, int step, float grad_scale) {
  runner_->close_fp8_step(step - 1, data_parallel_comm_);
  CUDA_CHECK(cudaEventRecord(events_[kOptimizerStart], stream_));
  state_.adamw_step(hyper, step, grad_scale);
  CUDA_CHECK(cudaEventRecord(events_[kOptimizerEnd], stream_));
  optimizer_timed_ = true;
}

PhaseTimes CudaBackend::last_phase_times() {
  PhaseTimes times;
  float ms = 0.0f;
  if (step_timed_) {
    CUDA_CHECK(cudaEventSynchronize(events_[kBackwardEnd]));
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_[kForwardStart], events_[kForwardEnd]));
    times.forward_ms = ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_[kForwardEnd], events_[kBackwardEnd]));
    times.backward_ms = ms;
  }
  if (optimizer_timed_) {
    CUDA_CHECK(cudaEventSynchronize(events_[kOptimizerEnd]));
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_[kOptimizerStart], events_[kOptimizerEnd]));
    times.optimizer_ms = ms;
  }
  return times;
}

std::unique_ptr<Backend> make_cuda_backend(const ModelConfig& config, const std::string& kernels, int max_batch,
                                           int max_seq_len, const CudaBackendOptions& options) {
  const std::optional<Fp8Recipe>& fp8 = options.fp8;
  std::string mode = kernels;
  if (fp8 && kernels == "coda")
    throw std::invalid_argument(
        "precision = fp8 runs in the unfused mode (the coda programs are bf16): use kernels = unfused or auto");
  if (kernels == "auto" && fp8) {
    mode = "unfused";
  } else if (kernels == "auto") {
    const std::string reason = coda_unsupported_reason(config);
    if (!reason.empty()) spdlog::warn("kernels auto: {}; running the unfused mode", reason);
    mode = reason.empty() ? "coda" : "unfused";
  }
  std::unique_ptr<StepRunner> (*make)(DeviceState&, const RunnerOptions&) = nullptr;
  if (mode == "unfused")
    make = make_unfused_runner;
  else if (mode == "coda")
    make = config.norm == Norm::Layer ? make_coda_layernorm_runner : make_coda_rmsnorm_runner;
  else
    throw std::invalid_argument("kernels: unknown mode \"" + kernels +
                                "\" for the cuda backend (this build has: auto, unfused, coda)");
  const RunnerOptions runner{fp8, options.deterministic};
  return std::make_unique<CudaBackend>(config, max_batch, max_seq_len, options.zero1,
                                       [make, runner](DeviceState& state) { return make(state, runner); });
}

}  // namespace coda
