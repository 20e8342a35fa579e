// The device state that every CUDA mode shares; see device_state.hpp.
#include "device_state.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "backend.hpp"
#include "distributed.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda {

namespace {

constexpr size_t kArenaAlign = 256;
constexpr size_t kHeadroomBytes = size_t{512} << 20;  // CUDA context, cuBLASLt, and the odd library buffer
constexpr size_t kZeroStagingFloats = size_t{1} << 20;  // ZeRO-1 checkpoint chunks: 4 MiB per transfer

double gib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

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

DeviceState::DeviceState(const ModelConfig& config, int max_batch, int max_seq_len)
    : config_(config),
      layout_(make_param_layout(config)),
      max_batch_(max_batch),
      max_seq_len_(max_seq_len),
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
  CUDA_CHECK(cudaEventCreateWithFlags(&comm_ready_, cudaEventDisableTiming));
  CUDA_CHECK(cudaMallocHost(&host_scalar_, sizeof(float)));
}

DeviceState::~DeviceState() {
  // Teardown must not throw: errors here cannot be reported usefully.
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  cudaFree(arena_);
  cudaFreeHost(host_scalar_);
  cudaFreeHost(zero1_.host_staging);
  if (comm_ready_ != nullptr) cudaEventDestroy(comm_ready_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void DeviceState::plan_buffers(ArenaPlan& plan) {
  const size_t P = layout_.total;
  const std::string state = "parameter state";
  const bool sharded = zero1_.comm != nullptr;
  const size_t owned = sharded ? zero1_.partition.shard_size : P;  // fp32 master and moments of this rank
  plan.reserve(&params_bf16_, sharded ? zero1_.partition.padded_total : P, state);
  plan.reserve(&params_, owned, state);
  plan.reserve(&grads_, P, state);
  plan.reserve(&adam_m_, owned, state);
  plan.reserve(&adam_v_, owned, state);
  plan.reserve(&decay_, P / kParamAlign, state);
  if (sharded) plan.reserve(&zero1_.staging, zero1_.staging_count, state);
  plan.reserve(&sumsq_partials_, unfused::grad_sumsq_partials_floats(), state);
  plan.reserve(&sumsq_ticket_, 1, state);
  plan.reserve(&sumsq_, 1, state);
}

void DeviceState::allocate(const std::string& mode, const std::function<void(ArenaPlan&)>& plan_more) {
  if (arena_ != nullptr) throw std::logic_error("cuda backend: allocate() called twice");
  ArenaPlan plan;
  plan_buffers(plan);
  plan_more(plan);
  size_t free_bytes = 0, device_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &device_bytes));
  spdlog::info("cuda backend ({} mode): {} {} layers, {:.1f}M parameters, up to B={} T={}: device memory plan",
               mode, arch_name(config_.arch), config_.n_layer, layout_.num_parameters() / 1e6, max_batch_,
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
  CUDA_CHECK(cudaMemcpyAsync(decay_, decay.data(), decay.size(), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DeviceState::shard_optimizer_state(Communicator& comm) {
  if (arena_ != nullptr) throw std::logic_error("cuda backend: shard_optimizer_state() after allocate()");
  zero1_.comm = &comm;
  zero1_.partition = make_zero_partition(layout_, comm.world_size());
  zero1_.shard = zero1_.partition.shards[comm.rank()];
  zero1_.slot = zero1_.partition.slot(comm.rank());
  zero1_.staging_count = std::min(kZeroStagingFloats, zero1_.partition.shard_size);
  CUDA_CHECK(cudaMallocHost(&zero1_.host_staging, zero1_.staging_count * sizeof(float)));
}

void DeviceState::wait_stream() {
  if (zero1_.comm != nullptr)
    zero1_.comm->wait(stream_);
  else
    CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DeviceState::hand_to_comm(Communicator& comm) {
  CUDA_CHECK(cudaEventRecord(comm_ready_, stream_));
  comm.wait_event(comm_ready_);
}

void DeviceState::all_reduce_max(Communicator& comm, float* data, size_t count) {
  hand_to_comm(comm);
  comm.all_reduce(data, count, ReduceOp::Max);
  comm.join(stream_);
}

void DeviceState::reduce_bucket(Communicator& comm, size_t bucket) {
  if (bucket >= gradient_buckets_.size()) throw std::logic_error("cuda backend: more backward pieces than buckets");
  const GradBucket& b = gradient_buckets_[bucket];
  hand_to_comm(comm);
  if (zero1_.comm == nullptr) {
    comm.all_reduce(grads_ + b.begin, b.end - b.begin, ReduceOp::Average);
    return;
  }
  comm.group_start();
  for (const OwnedRange& range : bucket_owners(b, zero1_.partition))
    comm.reduce(grads_ + range.begin, grads_ + range.begin, range.end - range.begin, range.rank, ReduceOp::Average);
  comm.group_end();
}

float DeviceState::grad_norm() {
  if (arena_ == nullptr) throw std::logic_error("cuda backend: allocate() was not called");
  Communicator* comm = zero1_.comm;
  const size_t begin = comm != nullptr ? zero1_.shard.begin : 0, end = comm != nullptr ? zero1_.shard.end : layout_.total;
  unfused::grad_sumsq(sumsq_, grads_ + begin, end - begin, sumsq_partials_, sumsq_ticket_,
                      stream_);
  if (comm != nullptr) {  // the shards partition the buffer: their sums of squares add up to the whole
    hand_to_comm(*comm);
    comm->all_reduce(sumsq_, 1, ReduceOp::Sum);
    comm->join(stream_);
  }
  CUDA_CHECK(cudaMemcpyAsync(host_scalar_, sumsq_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_stream();
  return std::sqrt(*host_scalar_);
}

void DeviceState::adamw_step(const AdamWHyper& hyper, int step, float grad_scale) {
  if (arena_ == nullptr) throw std::logic_error("cuda backend: allocate() was not called");
  const unfused::AdamWStep update{hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, grad_scale, step};
  Communicator* comm = zero1_.comm;
  if (comm == nullptr) {
    unfused::adamw(params_, params_bf16_, adam_m_, adam_v_, grads_, decay_, layout_.total, update, stream_);
  } else {
    const size_t begin = zero1_.shard.begin, count = zero1_.shard.end - begin;
    if (count > 0)
      unfused::adamw(params_, params_bf16_ + begin, adam_m_, adam_v_, grads_ + begin, decay_ + begin / kParamAlign,
                     count, update, stream_);
    hand_to_comm(*comm);
    comm->all_gather(params_bf16_ + zero1_.slot, params_bf16_, zero1_.partition.shard_size, DType::BF16);
    comm->join(stream_);
  }
}

// Without ZeRO-1 the device holds the whole state at the host's offsets. With it, params_, adam_m_ and
// adam_v_ hold [shard.begin, shard.end): loading copies that range of the full host arrays; the whole bf16
// copy is rebuilt from the host array chunk by chunk through the staging buffer (every rank has read the
// same checkpoint, so no communication is needed); reading gathers the shards from their owners.
void DeviceState::load_params(const float* params) {
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

void DeviceState::read_params(float* params) {
  if (zero1_.comm != nullptr) return gather_shards(params_, params);
  CUDA_CHECK(cudaMemcpyAsync(params, params_, layout_.total * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_stream();
}

void DeviceState::load_optimizer_state(const float* m, const float* v) {
  const size_t begin = zero1_.comm != nullptr ? zero1_.shard.begin : 0;
  const size_t count = (zero1_.comm != nullptr ? zero1_.shard.end : layout_.total) - begin;
  CUDA_CHECK(cudaMemcpyAsync(adam_m_, m + begin, count * sizeof(float), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(adam_v_, v + begin, count * sizeof(float), cudaMemcpyHostToDevice, stream_));
  wait_stream();
}

void DeviceState::read_optimizer_state(float* m, float* v) {
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
void DeviceState::gather_shards(const float* shard, float* host) {
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

void DeviceState::read_grads(float* grads) {
  CUDA_CHECK(cudaMemcpyAsync(grads, grads_, layout_.total * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_stream();
}

void DeviceState::zero_grad() {
  CUDA_CHECK(cudaMemsetAsync(grads_, 0, layout_.total * sizeof(float), stream_));
}

}  // namespace coda
