// The CUDA backend in the unfused mode: one model on one GPU, bf16 weights and activations, fp32 master
// weights, gradients and AdamW moments, cuBLASLt GEMMs and one kernel per operation (kernels/unfused/).
// Everything lives in ONE device arena of named buffers sized up front (parameter state in ParamLayout
// order, activations saved per layer, scratch), so a run that does not fit fails at start with the numbers.
// The step is split into overridable pieces (embedding, block forward, head, their backwards); the CODA
// mode derives from this class and overrides the pieces it fuses (docs/ARCHITECTURE.md).
// Data parallelism (docs/DISTRIBUTED.md): in the backward that reduces, each gradient bucket's all-reduce
// starts on the communicator's stream as soon as its piece is enqueued (an event), while the layers below
// continue; ZeRO-1 keeps master weights and moments for this rank's shard only, reduces buckets to their
// owners and all-gathers the bf16 shards after AdamW; every host wait goes through the communicator's watchdog.

#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "dist_plan.hpp"
#include "kernels/attention/attention.cuh"
#include "kernels/gemm/cublaslt.cuh"
#include "kernels/unfused/unfused.cuh"
#include "model.hpp"

namespace coda {

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

class CudaBackend : public Backend {
 public:
  using bf16 = __nv_bfloat16;
  CudaBackend(const ModelConfig& config, int max_batch, int max_seq_len);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // Plans (plan_buffers), checks the plan against the free device memory (throws with the numbers),
  // logs it and allocates. Called once by the factory, after construction (so overrides take part).
  void allocate();
  // ZeRO-1 over comm's ranks (see above); the factory calls it before allocate(). comm must outlive this.
  void shard_optimizer_state(Communicator& comm);

  std::string name() const override { return "cuda-unfused"; }
  void load_params(const float* params) override;
  void read_params(float* params) override;
  void load_optimizer_state(const float* m, const float* v) override;
  void read_optimizer_state(float* m, float* v) override;
  void read_grads(float* grads) override;
  void zero_grad() override;
  float forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T, float grad_scale) override;
  float forward_loss(const int32_t* tokens, const int32_t* targets, int B, int T) override;
  void last_logits(const int32_t* tokens, int B, int T, float* out) override;
  float grad_norm() override;
  void adamw_step(const AdamWHyper& hyper, int step, float grad_scale) override;
  PhaseTimes last_phase_times() override;
  void average_grads_in_next_backward(Communicator& comm) override;

 protected:
  struct LayerActivations {
    bf16* input = nullptr;         // residual stream entering the layer [N, C]
    bf16* norm1 = nullptr;         // [N, C]
    float* norm1_mean = nullptr;   // [N] (LayerNorm only)
    float* norm1_rstd = nullptr;   // [N]
    bf16* qkv = nullptr;           // [N, qkv_dim], after bias / RoPE: what attention reads
    bf16* attn = nullptr;          // [N, C]
    float* lse = nullptr;          // [B, n_head, T]
    bf16* mid = nullptr;           // residual stream after the attention half [N, C]
    bf16* norm2 = nullptr;         // [N, C]
    float* norm2_mean = nullptr;
    float* norm2_rstd = nullptr;
    bf16* up = nullptr;            // [N, mlp_up_rows]: GELU input, or interleaved (g, u)
    bf16* act = nullptr;           // [N, d_ff]: input of the down projection
  };
  struct Activations {
    std::vector<LayerActivations> layers;
    bf16* output = nullptr;        // residual stream after the last layer [N, C]
    bf16* normf = nullptr;         // [N, C]
    float* normf_mean = nullptr;
    float* normf_rstd = nullptr;
    bf16* logits = nullptr;        // [N, Vp]; the backward overwrites it with dlogits
    float* losses = nullptr;       // [N]
    float* logits_lse = nullptr;   // [N]
    int32_t* tokens = nullptr;     // [N]
    int32_t* targets = nullptr;    // [N]
    int32_t* token_buckets = nullptr;  // [3N + 1], unfused::TokenBuckets::packed
    int num_token_buckets = 0;         // of the current batch
  };
  struct Scratch {
    bf16* proj = nullptr;          // unfused: output of a residual-branch projection before its add [N, C]
    bf16* d_residual = nullptr;    // gradient of the residual stream [N, C]
    bf16* d_norm = nullptr;        // unfused: gradient of a norm output [N, C]
    bf16* d_attn = nullptr;        // [N, C]
    bf16* d_qkv = nullptr;         // [N, qkv_dim]
    bf16* d_act = nullptr;         // [N, d_ff]
    bf16* d_up = nullptr;          // [N, mlp_up_rows] (GPT-2: the same buffer as d_act, GELU runs in place)
    void* attention_workspace = nullptr;
    float* norm_partials = nullptr;  // unfused: norm backward's dw/db partials
    unfused::ColumnSumWorkspace column_sums;  // unfused: bias gradients (and the norm backward's tickets)
    float* sumsq_partials = nullptr;
    unsigned int* sumsq_ticket = nullptr;
    float* sumsq = nullptr;
    float2* rope_table = nullptr;  // Llama: [max_T, head_dim / 2]
    uint8_t* decay = nullptr;      // one byte per 64 parameters: AdamW weight decay on / off
  };

  // Reserves every buffer of this mode: the shared ones, then the unfused mode's own scratch (its norm
  // backward's and column sums' partials, the projection output and the norm-output gradient). A mode
  // that derives from this one calls plan_shared_buffers first, then adds its own.
  virtual void plan_buffers(ArenaPlan& plan);
  // Parameters, optimizer state, saved activations, the gradient buffers of the residual stream and the
  // layers, attention and grad-norm workspaces, the RoPE table: what every GPU mode uses.
  void plan_shared_buffers(ArenaPlan& plan);
  // The pieces of a step, on stream_ for B sequences of T tokens (N = B*T rows).
  virtual void embedding_forward(int B, int T);
  virtual void block_forward(int layer, int B, int T);
  virtual void head_forward(int B, int T);  // final norm and logits
  virtual void loss_forward(int B, int T);  // per-row losses and lse
  virtual void head_backward(int B, int T, float dloss);  // leaves d_residual = gradient of the output
  virtual void block_backward(int layer, int B, int T);
  virtual void embedding_backward(int B, int T);

  // Parameter tensors by offset (model.hpp): bf16 working copy, fp32 gradient.
  const bf16* weight(size_t offset) const { return offset == kAbsent ? nullptr : params_bf16_ + offset; }
  float* grad(size_t offset) const { return offset == kAbsent ? nullptr : grads_ + offset; }
  bf16* layer_output(int layer) const;
  void norm_forward(bf16* y, float* mean, float* rstd, const bf16* x, size_t w, size_t b, int N);
  void norm_backward(bf16* dx, const bf16* dy, const bf16* x, size_t w, size_t b, const float* mean,
                     const float* rstd, int N, bool accumulate);
  // Y[N, OC] = X[N, IC] W^T; dX = dY W; dW += dY^T X (fp32, accumulating).
  void linear_forward(bf16* y, const bf16* x, size_t w, int N, int IC, int OC);
  void linear_dgrad(bf16* dx, const bf16* dy, size_t w, int N, int IC, int OC);
  void linear_wgrad(size_t w, const bf16* dy, const bf16* x, int N, int IC, int OC);
  AttentionShape attention_shape(int B, int T) const;

  ModelConfig config_;
  ParamLayout layout_;
  int max_batch_, max_seq_len_;
  bool gpt2_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CublasLt> cublas_;
  void* arena_ = nullptr;

  bf16* params_bf16_ = nullptr;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  float* adam_m_ = nullptr;
  float* adam_v_ = nullptr;
  Activations acts_;
  Scratch scratch_;

 private:
  void check_shape(int B, int T, const char* what) const;
  void upload_batch(const int32_t* tokens, const int32_t* targets, int B, int T);
  float mean_loss(int N);  // waits for the stream
  // The host waits for stream_; through the ZeRO-1 communicator's watchdog when sharded.
  void wait_stream();
  // The communicator's stream waits for everything enqueued on stream_ so far.
  void hand_to_comm(Communicator& comm);
  // With a communicator armed: enqueues the all-reduce (ZeRO-1: the reduces to the owners) of the next
  // bucket of gradient_buckets_ once the compute stream has finished it.
  void reduce_next_bucket(Communicator* comm, size_t& bucket);
  // ZeRO-1: host[0, total) = the full buffer whose shards the ranks hold in `shard` (collective).
  void gather_shards(const float* shard, float* host);

  std::vector<GradBucket> gradient_buckets_;  // in backward order
  Communicator* reduce_comm_ = nullptr;       // armed by average_grads_in_next_backward for one backward
  cudaEvent_t comm_ready_ = nullptr;          // recorded on stream_ before the communicator's stream reads

  struct Zero1 {
    Communicator* comm = nullptr;  // null: every rank keeps the whole optimizer state
    ZeroPartition partition;
    ZeroShard shard;               // this rank's: params_, adam_m_, adam_v_ hold [shard.begin, shard.end)
    size_t slot = 0;               // partition.slot(rank): this rank's part of the bf16 all-gather
    size_t staging_count = 0;      // elements of staging / host_staging (checkpoint chunks)
    float* staging = nullptr;      // device
    float* host_staging = nullptr; // pinned
  } zero1_;

  // Pinned host staging for the per-step transfers.
  int32_t* host_tokens_ = nullptr;   // [N] tokens, [N] targets
  int32_t* host_buckets_ = nullptr;  // [3N + 1]
  float* host_losses_ = nullptr;     // [N]
  float* host_scalar_ = nullptr;     // [1]
  enum Event { kForwardStart, kForwardEnd, kBackwardEnd, kOptimizerStart, kOptimizerEnd, kEvents };
  cudaEvent_t events_[kEvents] = {};
  bool step_timed_ = false, optimizer_timed_ = false;
};

}  // namespace coda
