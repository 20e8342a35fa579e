// The CUDA backend in the unfused mode; see cuda_backend.hpp for the structure.
// The host computes the embedding backward's token grouping (a counting sort) while the GPU runs the
// forward pass; the only synchronisation of a step is reading back the per-row losses at its end.
#include "cuda_backend.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "coda_backend.hpp"
#include "distributed.hpp"
#include "kernels/cuda_check.cuh"

namespace coda {

namespace {

constexpr size_t kArenaAlign = 256;
constexpr size_t kHeadroomBytes = size_t{512} << 20;  // CUDA context, cuBLASLt, and the odd library buffer
constexpr size_t kZeroStagingFloats = size_t{1} << 20;  // ZeRO-1 checkpoint chunks: 4 MiB per transfer

double gib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

float bf16_bits_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

}  // namespace

// ---- ArenaPlan ----

void ArenaPlan::add(void** slot, size_t bytes, const std::string& group) {
  total_ = (total_ + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
  entries_.push_back({slot, total_, bytes, group});
  total_ += bytes;
}

std::vector<std::pair<std::string, size_t>> ArenaPlan::group_bytes() const {
  std::vector<std::pair<std::string, size_t>> groups;
  for (const Entry& entry : entries_) {
    auto found = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == entry.group; });
    if (found == groups.end())
      groups.emplace_back(entry.group, entry.bytes);
    else
      found->second += entry.bytes;
  }
  return groups;
}

void ArenaPlan::assign(char* base) const {
  for (const Entry& entry : entries_) *entry.slot = base + entry.offset;
}

// ---- construction and memory ----

CudaBackend::CudaBackend(const ModelConfig& config, int max_batch, int max_seq_len)
    : config_(config),
      layout_(make_param_layout(config)),
      max_batch_(max_batch),
      max_seq_len_(max_seq_len),
      gpt2_(config.arch == Arch::GPT2),
      gradient_buckets_(gradient_buckets(layout_)) {
  if (max_batch < 1 || max_seq_len < 1)
    throw std::invalid_argument("cuda backend: batch size and sequence length must be >= 1, got B=" +
                                std::to_string(max_batch) + " T=" + std::to_string(max_seq_len));
  if (max_seq_len > config.max_seq_len)
    throw std::invalid_argument("cuda backend: seq_len " + std::to_string(max_seq_len) + " exceeds max_seq_len " +
                                std::to_string(config.max_seq_len));
  if (config.d_model % 8 != 0 || config.d_ff % 8 != 0 || config.head_dim() % 8 != 0)
    throw std::invalid_argument("cuda backend: d_model, d_ff and head_dim must be multiples of 8 (got " +
                                std::to_string(config.d_model) + ", " + std::to_string(config.d_ff) + ", " +
                                std::to_string(config.head_dim()) + ")");
  if (!cuda_device_available()) throw std::runtime_error("cuda backend: no CUDA device");
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  cublas_ = std::make_unique<CublasLt>();
  for (cudaEvent_t& event : events_) CUDA_CHECK(cudaEventCreate(&event));
  CUDA_CHECK(cudaEventCreateWithFlags(&comm_ready_, cudaEventDisableTiming));
  const size_t N = static_cast<size_t>(max_batch) * max_seq_len;
  CUDA_CHECK(cudaMallocHost(&host_tokens_, 2 * N * sizeof(int32_t)));
  CUDA_CHECK(cudaMallocHost(&host_buckets_, (3 * N + 1) * sizeof(int32_t)));
  CUDA_CHECK(cudaMallocHost(&host_losses_, N * sizeof(float)));
  CUDA_CHECK(cudaMallocHost(&host_scalar_, sizeof(float)));
}

CudaBackend::~CudaBackend() {
  // Teardown must not throw: errors here cannot be reported usefully.
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  cudaFree(arena_);
  cudaFreeHost(host_tokens_);
  cudaFreeHost(host_buckets_);
  cudaFreeHost(host_losses_);
  cudaFreeHost(host_scalar_);
  cudaFreeHost(zero1_.host_staging);
  for (cudaEvent_t event : events_)
    if (event != nullptr) cudaEventDestroy(event);
  if (comm_ready_ != nullptr) cudaEventDestroy(comm_ready_);
  cublas_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CudaBackend::plan_buffers(ArenaPlan& plan) {
  plan_shared_buffers(plan);
  const size_t N = static_cast<size_t>(max_batch_) * max_seq_len_, C = config_.d_model;
  const std::string scratch = "scratch";
  plan.reserve(&scratch_.proj, N * C, scratch);
  plan.reserve(&scratch_.d_norm, N * C, scratch);
  const int max_cols = std::max({config_.d_model, config_.qkv_dim(), config_.d_ff});
  plan.reserve(&scratch_.norm_partials, unfused::norm_backward_partials_floats(config_.d_model), scratch);
  plan.reserve(&scratch_.column_sums.partials, unfused::column_sum_partials_floats(max_cols), scratch);
  plan.reserve(&scratch_.column_sums.tickets, unfused::column_sum_tickets(max_cols), scratch);
  scratch_.column_sums.max_cols = max_cols;
}

void CudaBackend::plan_shared_buffers(ArenaPlan& plan) {
  const ModelConfig& c = config_;
  const size_t P = layout_.total, N = static_cast<size_t>(max_batch_) * max_seq_len_;
  const size_t C = c.d_model, Q = c.qkv_dim(), F = c.d_ff, U = c.mlp_up_rows(), V = c.padded_vocab();
  const std::string state = "parameter state", saved = "activations saved for backward", scratch = "scratch";
  const bool sharded = zero1_.comm != nullptr;
  const size_t owned = sharded ? zero1_.partition.shard_size : P;  // fp32 master and moments of this rank
  plan.reserve(&params_bf16_, sharded ? zero1_.partition.padded_total : P, state);
  plan.reserve(&params_, owned, state);
  plan.reserve(&grads_, P, state);
  plan.reserve(&adam_m_, owned, state);
  plan.reserve(&adam_v_, owned, state);
  plan.reserve(&scratch_.decay, P / kParamAlign, state);
  if (sharded) plan.reserve(&zero1_.staging, zero1_.staging_count, state);

  // A norm's output and the statistics its backward reads (the mean only for LayerNorm).
  const auto reserve_norm = [&](bf16** y, float** mean, float** rstd) {
    plan.reserve(y, N * C, saved);
    if (gpt2_) plan.reserve(mean, N, saved);
    plan.reserve(rstd, N, saved);
  };
  acts_.layers.assign(c.n_layer, LayerActivations{});
  for (LayerActivations& a : acts_.layers) {
    plan.reserve(&a.input, N * C, saved);
    reserve_norm(&a.norm1, &a.norm1_mean, &a.norm1_rstd);
    plan.reserve(&a.qkv, N * Q, saved);
    plan.reserve(&a.attn, N * C, saved);
    plan.reserve(&a.lse, N * c.n_head, saved);
    plan.reserve(&a.mid, N * C, saved);
    reserve_norm(&a.norm2, &a.norm2_mean, &a.norm2_rstd);
    plan.reserve(&a.up, N * U, saved);
    plan.reserve(&a.act, N * F, saved);
  }
  plan.reserve(&acts_.output, N * C, saved);
  reserve_norm(&acts_.normf, &acts_.normf_mean, &acts_.normf_rstd);
  plan.reserve(&acts_.logits, N * V, "logits / dlogits");
  plan.reserve(&acts_.losses, N, scratch);
  plan.reserve(&acts_.logits_lse, N, scratch);
  plan.reserve(&acts_.tokens, N, scratch);
  plan.reserve(&acts_.targets, N, scratch);
  plan.reserve(&acts_.token_buckets, 3 * N + 1, scratch);

  plan.reserve(&scratch_.d_residual, N * C, scratch);
  plan.reserve(&scratch_.d_attn, N * C, scratch);
  plan.reserve(&scratch_.d_qkv, N * Q, scratch);
  plan.reserve(&scratch_.d_act, N * F, scratch);
  if (!gpt2_) plan.reserve(&scratch_.d_up, N * U, scratch);
  plan.reserve(reinterpret_cast<char**>(&scratch_.attention_workspace),
               attention_backward_workspace_bytes(attention_shape(max_batch_, max_seq_len_)), scratch);
  plan.reserve(&scratch_.sumsq_partials, unfused::grad_sumsq_partials_floats(), scratch);
  plan.reserve(&scratch_.sumsq_ticket, 1, scratch);
  plan.reserve(&scratch_.sumsq, 1, scratch);
  if (!gpt2_) plan.reserve(&scratch_.rope_table, static_cast<size_t>(max_seq_len_) * c.head_dim() / 2, scratch);
}

void CudaBackend::allocate() {
  if (arena_ != nullptr) throw std::logic_error("cuda backend: allocate() called twice");
  ArenaPlan plan;
  plan_buffers(plan);
  size_t free_bytes = 0, device_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &device_bytes));
  spdlog::info("cuda backend ({} mode): {} {} layers, {:.1f}M parameters, up to B={} T={}: device memory plan",
               name(), arch_name(config_.arch), config_.n_layer, layout_.num_parameters() / 1e6, max_batch_,
               max_seq_len_);
  for (const auto& [group, bytes] : plan.group_bytes()) spdlog::info("  {:<32} {:8.2f} GiB", group, gib(bytes));
  if (zero1_.comm != nullptr) {
    const ZeroPartition& z = zero1_.partition;
    const size_t replicated = 3 * layout_.total * sizeof(float);
    const size_t sharded = 3 * z.shard_size * sizeof(float) + zero1_.staging_count * sizeof(float) +
                           (z.padded_total - z.total) * sizeof(bf16);
    spdlog::info("  ZeRO-1 over {} rank(s): fp32 master weights and AdamW moments of {} of {} elements on this GPU: "
                 "{:.2f} GiB with staging and padding instead of {:.2f} GiB replicated ({:+.2f} GiB)",
                 z.world_size, z.shard_size, z.total, gib(sharded), gib(replicated), gib(sharded) - gib(replicated));
  }
  spdlog::info("  {:<32} {:8.2f} GiB of {:.2f} GiB free ({:.2f} GiB device)", "total", gib(plan.total_bytes()),
               gib(free_bytes), gib(device_bytes));
  if (plan.total_bytes() + kHeadroomBytes > free_bytes) {
    char message[512];
    std::snprintf(message, sizeof(message),
                  "cuda backend: the model and batch need %.2f GiB of device memory (plus %.2f GiB headroom) but "
                  "only %.2f GiB of %.2f GiB are free: lower batch_size (now %d) or seq_len (now %d)",
                  gib(plan.total_bytes()), gib(kHeadroomBytes), gib(free_bytes), gib(device_bytes), max_batch_,
                  max_seq_len_);
    throw std::runtime_error(message);
  }
  CUDA_CHECK(cudaMalloc(&arena_, plan.total_bytes()));
  plan.assign(static_cast<char*>(arena_));
  CUDA_CHECK(cudaMemsetAsync(arena_, 0, plan.total_bytes(), stream_));

  std::vector<uint8_t> decay(layout_.total / kParamAlign, 0);
  for (const ParamTensor& tensor : layout_.tensors)
    if (tensor.weight_decay)
      std::fill(decay.begin() + tensor.offset / kParamAlign,
                decay.begin() + (tensor.offset + tensor.numel + kParamAlign - 1) / kParamAlign, 1);
  CUDA_CHECK(cudaMemcpyAsync(scratch_.decay, decay.data(), decay.size(), cudaMemcpyHostToDevice, stream_));
  if (!gpt2_) {
    const std::vector<float2> table = unfused::rope_table(max_seq_len_, config_.head_dim(), config_.rope_theta);
    CUDA_CHECK(cudaMemcpyAsync(scratch_.rope_table, table.data(), table.size() * sizeof(float2),
                               cudaMemcpyHostToDevice, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::shard_optimizer_state(Communicator& comm) {
  if (arena_ != nullptr) throw std::logic_error("cuda backend: shard_optimizer_state() after allocate()");
  zero1_.comm = &comm;
  zero1_.partition = make_zero_partition(layout_, comm.world_size());
  zero1_.shard = zero1_.partition.shards[comm.rank()];
  zero1_.slot = zero1_.partition.slot(comm.rank());
  zero1_.staging_count = std::min(kZeroStagingFloats, zero1_.partition.shard_size);
  CUDA_CHECK(cudaMallocHost(&zero1_.host_staging, zero1_.staging_count * sizeof(float)));
}

// ---- the pieces of a step ----

AttentionShape CudaBackend::attention_shape(int B, int T) const {
  return AttentionShape{B, T, config_.n_head, config_.n_kv_head, config_.head_dim()};
}

CudaBackend::bf16* CudaBackend::layer_output(int layer) const {
  return layer + 1 < config_.n_layer ? acts_.layers[layer + 1].input : acts_.output;
}

void CudaBackend::norm_forward(bf16* y, float* mean, float* rstd, const bf16* x, size_t w, size_t b, int N) {
  if (gpt2_)
    unfused::layernorm_forward(y, mean, rstd, x, weight(w), weight(b), N, config_.d_model, config_.norm_eps, stream_);
  else
    unfused::rmsnorm_forward(y, rstd, x, weight(w), N, config_.d_model, config_.norm_eps, stream_);
}

void CudaBackend::norm_backward(bf16* dx, const bf16* dy, const bf16* x, size_t w, size_t b, const float* mean,
                                const float* rstd, int N, bool accumulate) {
  if (gpt2_)
    unfused::layernorm_backward(dx, grad(w), grad(b), dy, x, weight(w), mean, rstd, N, config_.d_model, accumulate,
                                scratch_.norm_partials, scratch_.column_sums, stream_);
  else
    unfused::rmsnorm_backward(dx, grad(w), dy, x, weight(w), rstd, N, config_.d_model, accumulate,
                              scratch_.norm_partials, scratch_.column_sums, stream_);
}

void CudaBackend::linear_forward(bf16* y, const bf16* x, size_t w, int N, int IC, int OC) {
  cublas_->gemm(y, x, Op::N, weight(w), Op::T, N, OC, IC, false, stream_);
}

void CudaBackend::linear_dgrad(bf16* dx, const bf16* dy, size_t w, int N, int IC, int OC) {
  cublas_->gemm(dx, dy, Op::N, weight(w), Op::N, N, IC, OC, false, stream_);
}

void CudaBackend::linear_wgrad(size_t w, const bf16* dy, const bf16* x, int N, int IC, int OC) {
  cublas_->gemm(grad(w), dy, Op::T, x, Op::N, OC, IC, N, true, stream_);
}

void CudaBackend::embedding_forward(int B, int T) {
  unfused::embedding_forward(acts_.layers[0].input, acts_.tokens, weight(layout_.wte), weight(layout_.wpe), B, T,
                             config_.d_model, stream_);
}

// One block, forward (GPT-2; Llama swaps LayerNorm for RMSNorm, drops the biases, rotates q and k with
// RoPE after the QKV GEMM, and uses SwiGLU on interleaved gate/up columns instead of GELU):
//   norm1 = LN(input);          qkv = norm1 Wqkv^T + b;         attn = attention(qkv)
//   mid = input + (attn Wproj^T + b)
//   norm2 = LN(mid);            up = norm2 Wup^T + b;           act = gelu(up)
//   output = mid + (act Wdown^T + b)
// Every GEMM is one cuBLASLt call (no epilogue), every other operation one kernel of kernels/unfused/.
// Backward, d_residual carries the gradient of the residual stream from the top down; each norm
// backward adds its input gradient into it (the residual branch's gradient is the identity). Weight
// gradients accumulate into the fp32 gradient buffer straight from cuBLASLt (D fp32, beta = 1), bias
// gradients through column sums, so gradient accumulation over micro-batches costs nothing extra.
// The LM head's dlogits overwrite the logits in place (they are not needed afterwards).
void CudaBackend::block_forward(int layer, int B, int T) {
  const int N = B * T, C = config_.d_model, Q = config_.qkv_dim(), F = config_.d_ff, U = config_.mlp_up_rows();
  LayerActivations& a = acts_.layers[layer];
  const LayerParams& p = layout_.layers[layer];
  bf16* proj = scratch_.proj;

  norm_forward(a.norm1, a.norm1_mean, a.norm1_rstd, a.input, p.norm1_w, p.norm1_b, N);
  linear_forward(a.qkv, a.norm1, p.qkv_w, N, C, Q);
  if (gpt2_)
    unfused::bias_add(a.qkv, weight(p.qkv_b), N, Q, stream_);
  else
    unfused::rope(a.qkv, scratch_.rope_table, B, T, config_.n_head, config_.n_kv_head, config_.head_dim(), false,
                  stream_);
  attention_forward(a.attn, a.lse, a.qkv, attention_shape(B, T), stream_);
  linear_forward(proj, a.attn, p.attn_proj_w, N, C, C);
  if (gpt2_) unfused::bias_add(proj, weight(p.attn_proj_b), N, C, stream_);
  unfused::residual_add(a.mid, a.input, proj, static_cast<size_t>(N) * C, stream_);

  norm_forward(a.norm2, a.norm2_mean, a.norm2_rstd, a.mid, p.norm2_w, p.norm2_b, N);
  linear_forward(a.up, a.norm2, p.mlp_up_w, N, C, U);
  if (gpt2_) {
    unfused::bias_add(a.up, weight(p.mlp_up_b), N, U, stream_);
    unfused::gelu_forward(a.act, a.up, static_cast<size_t>(N) * F, stream_);
  } else {
    unfused::swiglu_forward(a.act, a.up, N, F, stream_);
  }
  linear_forward(proj, a.act, p.mlp_down_w, N, F, C);
  if (gpt2_) unfused::bias_add(proj, weight(p.mlp_down_b), N, C, stream_);
  unfused::residual_add(layer_output(layer), a.mid, proj, static_cast<size_t>(N) * C, stream_);
}

void CudaBackend::head_forward(int B, int T) {
  const int N = B * T;
  norm_forward(acts_.normf, acts_.normf_mean, acts_.normf_rstd, acts_.output, layout_.normf_w, layout_.normf_b, N);
  linear_forward(acts_.logits, acts_.normf, layout_.head_weight(), N, config_.d_model, config_.padded_vocab());
}

void CudaBackend::loss_forward(int B, int T) {
  unfused::crossentropy_forward(acts_.losses, acts_.logits_lse, acts_.logits, acts_.targets, B * T,
                                config_.vocab_size, config_.padded_vocab(), stream_);
}

void CudaBackend::head_backward(int B, int T, float dloss) {
  const int N = B * T, C = config_.d_model, V = config_.padded_vocab();
  unfused::crossentropy_backward(acts_.logits, acts_.logits, acts_.logits_lse, acts_.targets, dloss, N,
                                 config_.vocab_size, V, stream_);
  const bf16* dlogits = acts_.logits;
  linear_dgrad(scratch_.d_norm, dlogits, layout_.head_weight(), N, C, V);
  linear_wgrad(layout_.head_weight(), dlogits, acts_.normf, N, C, V);
  norm_backward(scratch_.d_residual, scratch_.d_norm, acts_.output, layout_.normf_w, layout_.normf_b,
                acts_.normf_mean, acts_.normf_rstd, N, false);
}

void CudaBackend::block_backward(int layer, int B, int T) {
  const int N = B * T, C = config_.d_model, Q = config_.qkv_dim(), F = config_.d_ff, U = config_.mlp_up_rows();
  const LayerActivations& a = acts_.layers[layer];
  const LayerParams& p = layout_.layers[layer];
  bf16* d_residual = scratch_.d_residual;  // holds the gradient of this layer's output

  linear_dgrad(scratch_.d_act, d_residual, p.mlp_down_w, N, F, C);
  linear_wgrad(p.mlp_down_w, d_residual, a.act, N, F, C);
  bf16* d_up = gpt2_ ? scratch_.d_act : scratch_.d_up;
  if (gpt2_) {
    unfused::column_sum(grad(p.mlp_down_b), d_residual, N, C, C, scratch_.column_sums, stream_);
    unfused::gelu_backward(d_up, scratch_.d_act, a.up, static_cast<size_t>(N) * F, stream_);
  } else {
    unfused::swiglu_backward(d_up, scratch_.d_act, a.up, N, F, stream_);
  }
  linear_dgrad(scratch_.d_norm, d_up, p.mlp_up_w, N, C, U);
  linear_wgrad(p.mlp_up_w, d_up, a.norm2, N, C, U);
  if (gpt2_) unfused::column_sum(grad(p.mlp_up_b), d_up, N, U, U, scratch_.column_sums, stream_);
  norm_backward(d_residual, scratch_.d_norm, a.mid, p.norm2_w, p.norm2_b, a.norm2_mean, a.norm2_rstd, N, true);

  linear_dgrad(scratch_.d_attn, d_residual, p.attn_proj_w, N, C, C);
  linear_wgrad(p.attn_proj_w, d_residual, a.attn, N, C, C);
  if (gpt2_) unfused::column_sum(grad(p.attn_proj_b), d_residual, N, C, C, scratch_.column_sums, stream_);
  attention_backward(scratch_.d_qkv, scratch_.d_attn, a.qkv, a.attn, a.lse, scratch_.attention_workspace,
                     attention_shape(B, T), stream_);
  if (!gpt2_)
    unfused::rope(scratch_.d_qkv, scratch_.rope_table, B, T, config_.n_head, config_.n_kv_head, config_.head_dim(),
                  true, stream_);
  linear_dgrad(scratch_.d_norm, scratch_.d_qkv, p.qkv_w, N, C, Q);
  linear_wgrad(p.qkv_w, scratch_.d_qkv, a.norm1, N, C, Q);
  if (gpt2_) unfused::column_sum(grad(p.qkv_b), scratch_.d_qkv, N, Q, Q, scratch_.column_sums, stream_);
  norm_backward(d_residual, scratch_.d_norm, a.input, p.norm1_w, p.norm1_b, a.norm1_mean, a.norm1_rstd, N, true);
}

void CudaBackend::embedding_backward(int B, int T) {
  unfused::embedding_backward(grad(layout_.wte), grad(layout_.wpe), scratch_.d_residual, acts_.token_buckets,
                              acts_.num_token_buckets, B, T, config_.d_model, stream_);
}

// ---- the Backend interface ----

void CudaBackend::check_shape(int B, int T, const char* what) const {
  if (arena_ == nullptr) throw std::logic_error("cuda backend: allocate() was not called");
  if (B < 1 || T < 1 || B > max_batch_ || T > max_seq_len_)
    throw std::invalid_argument(std::string("cuda backend ") + what + ": B=" + std::to_string(B) +
                                " T=" + std::to_string(T) + " outside the allocated B <= " +
                                std::to_string(max_batch_) + ", T <= " + std::to_string(max_seq_len_));
}

void CudaBackend::upload_batch(const int32_t* tokens, const int32_t* targets, int B, int T) {
  const size_t N = static_cast<size_t>(B) * T;
  const int32_t V = config_.vocab_size;
  for (size_t n = 0; n < N; ++n)
    if (tokens[n] < 0 || tokens[n] >= V || (targets != nullptr && (targets[n] < 0 || targets[n] >= V)))
      throw std::invalid_argument("cuda backend: token or target id at position " + std::to_string(n) +
                                  " is outside the vocabulary of " + std::to_string(V));
  std::memcpy(host_tokens_, tokens, N * sizeof(int32_t));
  CUDA_CHECK(cudaMemcpyAsync(acts_.tokens, host_tokens_, N * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  if (targets != nullptr) {
    std::memcpy(host_tokens_ + N, targets, N * sizeof(int32_t));
    CUDA_CHECK(
        cudaMemcpyAsync(acts_.targets, host_tokens_ + N, N * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  }
}

void CudaBackend::wait_stream() {
  if (zero1_.comm != nullptr)
    zero1_.comm->wait(stream_);
  else
    CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::hand_to_comm(Communicator& comm) {
  CUDA_CHECK(cudaEventRecord(comm_ready_, stream_));
  comm.wait_event(comm_ready_);
}

float CudaBackend::mean_loss(int N) {
  CUDA_CHECK(cudaMemcpyAsync(host_losses_, acts_.losses, N * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_stream();
  double sum = 0.0;
  for (int n = 0; n < N; ++n) sum += host_losses_[n];
  return static_cast<float>(sum / N);
}

float CudaBackend::forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T, float grad_scale) {
  check_shape(B, T, "forward_backward");
  const int N = B * T;
  upload_batch(tokens, targets, B, T);
  CUDA_CHECK(cudaEventRecord(events_[kForwardStart], stream_));
  embedding_forward(B, T);
  for (int layer = 0; layer < config_.n_layer; ++layer) block_forward(layer, B, T);
  head_forward(B, T);
  loss_forward(B, T);
  CUDA_CHECK(cudaEventRecord(events_[kForwardEnd], stream_));

  const unfused::TokenBuckets buckets = unfused::group_rows_by_token(tokens, N, config_.vocab_size);
  std::copy(buckets.packed.begin(), buckets.packed.end(), host_buckets_);
  CUDA_CHECK(cudaMemcpyAsync(acts_.token_buckets, host_buckets_, buckets.packed.size() * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  acts_.num_token_buckets = buckets.num_buckets;

  Communicator* comm = std::exchange(reduce_comm_, nullptr);
  size_t bucket = 0;
  head_backward(B, T, grad_scale / static_cast<float>(N));
  reduce_next_bucket(comm, bucket);
  for (int layer = config_.n_layer - 1; layer >= 0; --layer) {
    block_backward(layer, B, T);
    reduce_next_bucket(comm, bucket);
  }
  embedding_backward(B, T);
  reduce_next_bucket(comm, bucket);
  if (comm != nullptr) {
    if (bucket != gradient_buckets_.size()) throw std::logic_error("cuda backend: gradient buckets left unreduced");
    comm->join(stream_);
  }
  CUDA_CHECK(cudaEventRecord(events_[kBackwardEnd], stream_));
  step_timed_ = true;
  if (comm != nullptr) comm->wait(stream_);
  return mean_loss(N);
}

void CudaBackend::average_grads_in_next_backward(Communicator& comm) {
  if (zero1_.comm != nullptr && &comm != zero1_.comm)
    throw std::logic_error("cuda backend: ZeRO-1 reduces gradients over the communicator it was sharded with");
  reduce_comm_ = &comm;
}

void CudaBackend::reduce_next_bucket(Communicator* comm, size_t& bucket) {
  if (comm == nullptr) return;
  if (bucket == gradient_buckets_.size()) throw std::logic_error("cuda backend: more backward pieces than buckets");
  const GradBucket& b = gradient_buckets_[bucket++];
  hand_to_comm(*comm);
  if (zero1_.comm == nullptr) {
    comm->all_reduce(grads_ + b.begin, b.end - b.begin, ReduceOp::Average);
    return;
  }
  comm->group_start();
  for (const OwnedRange& range : bucket_owners(b, zero1_.partition))
    comm->reduce(grads_ + range.begin, grads_ + range.begin, range.end - range.begin, range.rank, ReduceOp::Average);
  comm->group_end();
}

float CudaBackend::forward_loss(const int32_t* tokens, const int32_t* targets, int B, int T) {
  check_shape(B, T, "forward_loss");
  upload_batch(tokens, targets, B, T);
  embedding_forward(B, T);
  for (int layer = 0; layer < config_.n_layer; ++layer) block_forward(layer, B, T);
  head_forward(B, T);
  loss_forward(B, T);
  return mean_loss(B * T);
}

void CudaBackend::last_logits(const int32_t* tokens, int B, int T, float* out) {
  check_shape(B, T, "last_logits");
  upload_batch(tokens, nullptr, B, T);
  embedding_forward(B, T);
  for (int layer = 0; layer < config_.n_layer; ++layer) block_forward(layer, B, T);
  head_forward(B, T);
  const size_t Vp = config_.padded_vocab();
  std::vector<uint16_t> rows(static_cast<size_t>(B) * Vp);
  CUDA_CHECK(cudaMemcpy2DAsync(rows.data(), Vp * sizeof(bf16), acts_.logits + (T - 1) * Vp,
                               static_cast<size_t>(T) * Vp * sizeof(bf16), Vp * sizeof(bf16), B,
                               cudaMemcpyDeviceToHost, stream_));
  wait_stream();
  for (int b = 0; b < B; ++b)
    for (int v = 0; v < config_.vocab_size; ++v)
      out[static_cast<size_t>(b) * config_.vocab_size + v] = bf16_bits_to_float(rows[b * Vp + v]);
}

float CudaBackend::grad_norm() {
  if (arena_ == nullptr) throw std::logic_error("cuda backend: allocate() was not called");
  Communicator* comm = zero1_.comm;
  const size_t begin = comm != nullptr ? zero1_.shard.begin : 0, end = comm != nullptr ? zero1_.shard.end : layout_.total;
  unfused::grad_sumsq(scratch_.sumsq, grads_ + begin, end - begin, scratch_.sumsq_partials, scratch_.sumsq_ticket,
                      stream_);
  if (comm != nullptr) {  // the shards partition the buffer: their sums of squares add up to the whole
    hand_to_comm(*comm);
    comm->all_reduce(scratch_.sumsq, 1, ReduceOp::Sum);
    comm->join(stream_);
  }
  CUDA_CHECK(cudaMemcpyAsync(host_scalar_, scratch_.sumsq, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_stream();
  return std::sqrt(*host_scalar_);
}

void CudaBackend::adamw_step(const AdamWHyper& hyper, int step, float grad_scale) {
  if (arena_ == nullptr) throw std::logic_error("cuda backend: allocate() was not called");
  CUDA_CHECK(cudaEventRecord(events_[kOptimizerStart], stream_));
  const unfused::AdamWStep update{hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, grad_scale, step};
  Communicator* comm = zero1_.comm;
  if (comm == nullptr) {
    unfused::adamw(params_, params_bf16_, adam_m_, adam_v_, grads_, scratch_.decay, layout_.total, update, stream_);
  } else {
    const size_t begin = zero1_.shard.begin, count = zero1_.shard.end - begin;
    if (count > 0)
      unfused::adamw(params_, params_bf16_ + begin, adam_m_, adam_v_, grads_ + begin, scratch_.decay + begin / kParamAlign,
                     count, update, stream_);
    hand_to_comm(*comm);
    comm->all_gather(params_bf16_ + zero1_.slot, params_bf16_, zero1_.partition.shard_size, DType::BF16);
    comm->join(stream_);
  }
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

// Without ZeRO-1 the device holds the whole state at the host's offsets. With it, params_, adam_m_ and
// adam_v_ hold [shard.begin, shard.end): loading copies that range of the full host arrays; the whole bf16
// copy is rebuilt from the host array chunk by chunk through the staging buffer (every rank has read the
// same checkpoint, so no communication is needed); reading gathers the shards from their owners.
void CudaBackend::load_params(const float* params) {
  if (arena_ == nullptr) throw std::logic_error("cuda backend: allocate() was not called");
  if (zero1_.comm == nullptr) {
    CUDA_CHECK(cudaMemcpyAsync(params_, params, layout_.total * sizeof(float), cudaMemcpyHostToDevice, stream_));
    unfused::convert_to_bf16(params_bf16_, params_, layout_.total, stream_);
    wait_stream();
    return;
  }
  const ZeroShard& shard = zero1_.shard;
  CUDA_CHECK(cudaMemcpyAsync(params_, params + shard.begin, (shard.end - shard.begin) * sizeof(float),
                             cudaMemcpyHostToDevice, stream_));
  for (const OwnedRange& chunk : shard_chunks(zero1_.partition, zero1_.staging_count)) {
    const size_t count = chunk.end - chunk.begin;
    wait_stream();  // the previous chunk has left host_staging
    std::memcpy(zero1_.host_staging, params + chunk.begin, count * sizeof(float));
    CUDA_CHECK(cudaMemcpyAsync(zero1_.staging, zero1_.host_staging, count * sizeof(float), cudaMemcpyHostToDevice,
                               stream_));
    unfused::convert_to_bf16(params_bf16_ + chunk.begin, zero1_.staging, count, stream_);
  }
  wait_stream();
}

void CudaBackend::read_params(float* params) {
  if (zero1_.comm != nullptr) return gather_shards(params_, params);
  CUDA_CHECK(cudaMemcpyAsync(params, params_, layout_.total * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_stream();
}

void CudaBackend::load_optimizer_state(const float* m, const float* v) {
  const size_t begin = zero1_.comm != nullptr ? zero1_.shard.begin : 0;
  const size_t count = (zero1_.comm != nullptr ? zero1_.shard.end : layout_.total) - begin;
  CUDA_CHECK(cudaMemcpyAsync(adam_m_, m + begin, count * sizeof(float), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(adam_v_, v + begin, count * sizeof(float), cudaMemcpyHostToDevice, stream_));
  wait_stream();
}

void CudaBackend::read_optimizer_state(float* m, float* v) {
  if (zero1_.comm != nullptr) {
    gather_shards(adam_m_, m);
    gather_shards(adam_v_, v);
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(m, adam_m_, layout_.total * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaMemcpyAsync(v, adam_v_, layout_.total * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_stream();
}

// One broadcast per chunk from its owner into every rank's staging buffer, then to the host; the watchdog
// waits for each chunk, so a dead peer ends in an error here too.
void CudaBackend::gather_shards(const float* shard, float* host) {
  Communicator& comm = *zero1_.comm;
  hand_to_comm(comm);
  for (const OwnedRange& chunk : shard_chunks(zero1_.partition, zero1_.staging_count)) {
    const size_t count = chunk.end - chunk.begin;
    const float* send = chunk.rank == comm.rank() ? shard + (chunk.begin - zero1_.shard.begin) : zero1_.staging;
    comm.broadcast(send, zero1_.staging, count, DType::F32, chunk.rank);
    CUDA_CHECK(cudaMemcpyAsync(zero1_.host_staging, zero1_.staging, count * sizeof(float), cudaMemcpyDeviceToHost,
                               comm.stream()));
    comm.synchronize();
    std::memcpy(host + chunk.begin, zero1_.host_staging, count * sizeof(float));
  }
}

void CudaBackend::read_grads(float* grads) {
  CUDA_CHECK(cudaMemcpyAsync(grads, grads_, layout_.total * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_stream();
}

void CudaBackend::zero_grad() {
  CUDA_CHECK(cudaMemsetAsync(grads_, 0, layout_.total * sizeof(float), stream_));
}

std::unique_ptr<Backend> make_cuda_backend(const ModelConfig& config, const std::string& kernels, int max_batch,
                                           int max_seq_len, Communicator* zero1) {
  if (kernels == "coda") return make_coda_backend(config, max_batch, max_seq_len, zero1);
  if (kernels != "unfused")
    throw std::invalid_argument("kernels: unknown mode \"" + kernels +
                                "\" for the cuda backend (this build has: unfused, coda)");
  auto backend = std::make_unique<CudaBackend>(config, max_batch, max_seq_len);
  if (zero1 != nullptr) backend->shard_optimizer_state(*zero1);
  backend->allocate();
  return backend;
}

}  // namespace coda
