// The arithmetic of data parallelism, as pure functions (no MPI, NCCL or CUDA), so it is tested on the CPU.
//
// Gradient buckets. Backward visits the model in reverse: LM head and final norm first, then layer L-1
// down to layer 0, then the embeddings. ParamLayout stores every layer contiguously and in forward order
// (model.hpp), so each of these groups is one contiguous range of the flat gradient buffer and the
// backend can start the all-reduce of a bucket on the communication stream as soon as the backward of
// that group has finished, while the backward of the layers below continues. The embedding bucket comes
// last: with a tied head, wte receives gradient both from the head (first) and from the embedding
// backward (last), so it is complete only at the very end. Buckets are reduced only on the last
// micro-batch of a gradient-accumulation step.
//
// ZeRO-1 partition. Ranks own contiguous shards of the flat buffer for the fp32 master weights and the
// AdamW moments. NCCL's reduce-scatter and all-gather exchange equal counts per rank, so every shard has
// the same capacity shard_size = ceil(total / world) rounded up to kParamAlign elements, and the buffers
// handed to those collectives hold padded_total = world * shard_size elements (the tail past `total` is
// zero padding). Shard r covers [r * shard_size, min((r + 1) * shard_size, total)); the last shards may be
// shorter or empty. Each shard lists the pieces of the tensors it overlaps, which is what the sharded
// AdamW needs for its weight-decay mask. A bucket can also be reduced straight to the shards' owners
// (one ncclReduce per owner, grouped), which keeps the backward overlap under ZeRO-1: bucket_owners().
// In the padded buffers of the collectives, rank r's shard sits at slot(r) = r * shard_size (equal to
// its begin unless the shard is empty), so the in-place all-gather of the bf16 weights sends
// shard_size elements from buffer + slot(r); the tail of a short shard is padding that the optimizer
// never writes (zero). The global gradient norm composes from the shards: they partition [0, total), so
// the sum over ranks of each rank's sum of squares over its own shard (one all-reduce of a scalar) is
// the sum of squares of the whole averaged gradient. Checkpoints hold the full state: it is gathered
// to every rank in chunks (shard_chunks: pieces of at most one staging buffer, each inside one shard,
// broadcast by its owner), and scattered on load by every rank copying its own shard out of the full
// arrays it read.
//
// Batch arithmetic. Each rank runs grad_accum micro-batches of B sequences per optimizer step, so the
// global batch is world * B * grad_accum sequences. Every rank scales its micro-batch losses by
// 1 / grad_accum and the gradients are AVERAGED over ranks: with equal token counts per rank that is the
// gradient of the mean loss over the global batch, the same as one process running the whole batch.
// When a run asks for a fixed global batch (for example resuming on a different number of GPUs),
// grad_accum follows from it and must come out whole.
//
// Data position across a change of the global batch (resuming on another number of ranks, or with another
// batch_size). The loader's position is (epoch, batch) counted in global batches of G windows, and the
// order of the windows within an epoch does not depend on G (data.hpp). A run saved after `batch` batches
// of G_saved windows has consumed the first batch * G_saved windows of its epoch; it continues with the
// first batch of G windows that starts at or after that point. No window of the epoch is read twice, at
// most G - 1 are skipped (none when G divides the windows consumed, e.g. when world * batch_size stays
// the same), and past the epoch's last whole batch the next epoch begins.
//
// Throughput. Data-parallel ranks step in lockstep (the all-reduce synchronises them), so the wall time
// of a step on rank 0 is the job's step time; job tokens/s = global tokens per step / step time, and MFU
// = flops_per_token * job tokens/s / (world * peak FLOP/s of one GPU).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model.hpp"

namespace coda {

struct GradBucket {
  std::string name;   // "head" (final norm + untied LM head), "h.<l>", "embeddings"
  int layer = -1;     // layer index for "h.<l>", -1 otherwise
  size_t begin = 0;   // [begin, end) in elements of the flat buffer
  size_t end = 0;
};

// Buckets in backward order; together they cover [0, layout.total) exactly once.
std::vector<GradBucket> gradient_buckets(const ParamLayout& layout);

struct ShardPiece {
  size_t tensor = 0;   // index into ParamLayout::tensors
  size_t begin = 0;    // [begin, end): flat-buffer offsets, inside both the tensor and the shard
  size_t end = 0;
  bool weight_decay = false;
};

struct ZeroShard {
  size_t begin = 0;    // [begin, end) of the flat buffer; begin is a multiple of kParamAlign
  size_t end = 0;
  std::vector<ShardPiece> pieces;  // in buffer order; the elements between pieces are layout padding
};

struct ZeroPartition {
  int world_size = 1;
  size_t total = 0;         // layout.total
  size_t shard_size = 0;    // capacity of every shard, a multiple of kParamAlign
  size_t padded_total = 0;  // world_size * shard_size >= total: length of reduce-scatter/all-gather buffers
  std::vector<ZeroShard> shards;  // one per rank
  // Offset of rank's shard in the padded reduce-scatter / all-gather buffers.
  size_t slot(int rank) const { return static_cast<size_t>(rank) * shard_size; }
};

ZeroPartition make_zero_partition(const ParamLayout& layout, int world_size);

// The part of a bucket that each rank owns under ZeRO-1, in buffer order (ranks without overlap omitted).
struct OwnedRange {
  int rank = 0;
  size_t begin = 0;
  size_t end = 0;
};
std::vector<OwnedRange> bucket_owners(const GradBucket& bucket, const ZeroPartition& partition);
// Pieces of at most max_count elements that cover [0, partition.total) in buffer order, each inside the
// shard of `rank`: the transfers through a staging buffer of max_count elements that gather or scatter
// the sharded state. Throws std::invalid_argument when max_count is not a positive multiple of kParamAlign.
std::vector<OwnedRange> shard_chunks(const ZeroPartition& partition, size_t max_count);

struct BatchPlan {
  int world_size = 1;
  int micro_batch = 1;   // B: sequences per micro-batch per rank
  int seq_len = 1;       // T
  int grad_accum = 1;    // micro-batches per optimizer step
  int64_t global_batch() const { return int64_t{world_size} * micro_batch * grad_accum; }  // sequences
  int64_t tokens_per_step() const { return global_batch() * seq_len; }
};

// Throws std::invalid_argument naming the value when an input is not positive.
BatchPlan plan_batch(int world_size, int micro_batch, int seq_len, int grad_accum);
// grad_accum chosen so that the global batch is `global_batch` sequences; throws std::invalid_argument
// with the numbers when global_batch is not a multiple of world_size * micro_batch.
BatchPlan plan_batch_for_global(int world_size, int micro_batch, int seq_len, int64_t global_batch);

struct LoaderPosition {
  size_t epoch = 0;
  size_t batch = 0;  // global batches already read in this epoch
};
// The position under global batches of global_batch windows (batches_per_epoch of them per epoch) that
// continues `saved`, taken under global batches of saved_global_batch windows; throws std::invalid_argument
// when a batch size is 0.
LoaderPosition rescale_loader_position(const LoaderPosition& saved, size_t saved_global_batch, size_t global_batch,
                                       size_t batches_per_epoch);

struct JobThroughput {
  double tokens_per_second = 0.0;          // whole job
  double tokens_per_second_per_gpu = 0.0;
  double mfu = 0.0;                        // fraction of world_size * peak
};

// step_seconds: wall time of one optimizer step; flops_per_token: model FLOPs of a training token
// (flops_per_token() in model.hpp); peak_flops_per_gpu: dense peak of one GPU in FLOP/s.
JobThroughput job_throughput(const BatchPlan& plan, double step_seconds, double flops_per_token,
                             double peak_flops_per_gpu);

}  // namespace coda
