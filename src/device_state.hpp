// What every CUDA mode shares on one GPU: the device arena, the parameter state (bf16 working copy of the
// weights, fp32 master weights, gradients and AdamW moments, in ParamLayout order), the optimizer step,
// the gradient norm, ZeRO-1 and the gradient buckets of data parallelism, and the host I/O of the state.
// A step runner (step_runner.hpp) adds its own buffers to the same arena; CudaBackend (cuda_backend.hpp)
// puts the two together.
// ZeRO-1 (docs/DISTRIBUTED.md) keeps master weights and moments for this rank's shard only, reduces the
// buckets to their owners and all-gathers the bf16 shards after AdamW; every host wait goes through the
// communicator's watchdog.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <vector>

#include "dist_plan.hpp"
#include "model.hpp"

namespace coda {

class Communicator;  // distributed.hpp
struct AdamWHyper;    // backend.hpp

// Named device buffers carved from one allocation.
class ArenaPlan {
 public:
  // Reserves `count` elements of T for *slot, assigned by allocate(); group is the line of the memory log.
  template <typename T>
  void reserve(T** slot, size_t count, const std::string& group) {
    add(reinterpret_cast<void**>(slot), count * sizeof(T), group);
  }
  size_t total_bytes() const { return total_; }
  // Bytes per group, in the order groups first appeared.
  std::vector<std::pair<std::string, size_t>> group_bytes() const;
  // Points every reserved slot into `base` (which holds total_bytes()).
  void assign(char* base) const;

 private:
  struct Entry {
    void** slot;
    size_t offset, bytes;
    std::string group;
  };
  void add(void** slot, size_t bytes, const std::string& group);
  std::vector<Entry> entries_;
  size_t total_ = 0;
};

class DeviceState {
 public:
  using bf16 = __nv_bfloat16;
  DeviceState(const ModelConfig& config, int max_batch, int max_seq_len);
  ~DeviceState();
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  // ZeRO-1 over comm's ranks; before allocate(). comm must outlive this.
  void shard_optimizer_state(Communicator& comm);
  // Plans the state's buffers and then the runner's (plan_more), checks the plan against the free device
  // memory (throws with the numbers), logs it under `mode`, allocates and zeroes the arena.
  void allocate(const std::string& mode, const std::function<void(ArenaPlan&)>& plan_more);

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  int max_batch() const { return max_batch_; }
  int max_seq_len() const { return max_seq_len_; }
  cudaStream_t stream() const { return stream_; }
  // Parameter tensors by offset (model.hpp): bf16 working copy, fp32 gradient; null for kAbsent.
  const bf16* weight(size_t offset) const { return offset == kAbsent ? nullptr : params_bf16_ + offset; }
  float* grad(size_t offset) const { return offset == kAbsent ? nullptr : grads_ + offset; }

  // The state in and out as flat fp32 host arrays (backend.hpp); collective under ZeRO-1 where it says so.
  void load_params(const float* params);
  void read_params(float* params);
  void load_optimizer_state(const float* m, const float* v);
  void read_optimizer_state(float* m, float* v);
  void read_grads(float* grads);
  void zero_grad();
  float grad_norm();
  void adamw_step(const AdamWHyper& hyper, int step, float grad_scale);

  // Data parallelism: the gradient buckets in backward order, and the reduction of one of them (the
  // all-reduce, or under ZeRO-1 the reduces to its owners) on comm's stream once stream() has finished it.
  size_t num_buckets() const { return gradient_buckets_.size(); }
  void reduce_bucket(Communicator& comm, size_t bucket);
  Communicator* zero1_comm() const { return zero1_.comm; }
  // data[0, count) = its max over comm's ranks, after the work enqueued on stream() and before what follows.
  void all_reduce_max(Communicator& comm, float* data, size_t count);
  // The host waits for stream(); through the ZeRO-1 communicator's watchdog when sharded.
  void wait_stream();

 private:
  void plan_buffers(ArenaPlan& plan);
  // comm's stream waits for everything enqueued on stream() so far.
  void hand_to_comm(Communicator& comm);
  // ZeRO-1: host[0, total) = the full buffer whose shards the ranks hold in `shard` (collective).
  void gather_shards(const float* shard, float* host);

  ModelConfig config_;
  ParamLayout layout_;
  int max_batch_, max_seq_len_;
  cudaStream_t stream_ = nullptr;
  void* arena_ = nullptr;

  bf16* params_bf16_ = nullptr;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  float* adam_m_ = nullptr;
  float* adam_v_ = nullptr;
  uint8_t* decay_ = nullptr;          // one byte per 64 parameters: AdamW weight decay on / off
  float* sumsq_partials_ = nullptr;   // the gradient norm's
  unsigned int* sumsq_ticket_ = nullptr;
  float* sumsq_ = nullptr;
  float* host_scalar_ = nullptr;      // pinned [1]

  std::vector<GradBucket> gradient_buckets_;
  cudaEvent_t comm_ready_ = nullptr;  // recorded on stream_ before the communicator's stream reads

  struct Zero1 {
    Communicator* comm = nullptr;  // null: every rank keeps the whole optimizer state
    ZeroPartition partition;
    ZeroShard shard;               // this rank's: params_, adam_m_, adam_v_ hold [shard.begin, shard.end)
    size_t slot = 0;               // partition.slot(rank): this rank's part of the bf16 all-gather
    size_t staging_count = 0;      // elements of staging / host_staging (checkpoint chunks)
    float* staging = nullptr;      // device
    float* host_staging = nullptr; // pinned
  } zero1_;
};

}  // namespace coda
