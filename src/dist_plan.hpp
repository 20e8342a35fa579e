// The arithmetic of data parallelism, as pure functions (no MPI, NCCL or CUDA), so it is tested on the CPU
// (what it serves: docs/DISTRIBUTED.md):
//  * gradient buckets: head and final norm, layers L-1 .. 0, embeddings (last: a tied wte also gets the
//    embedding backward's gradient), each one contiguous range of the flat buffer (model.hpp orders layers
//    contiguously), so a bucket's reduction can start as soon as its backward is enqueued;
//  * the ZeRO-1 partition: equal shards of shard_size = ceil(total / world) rounded up to kParamAlign
//    (NCCL's collectives exchange equal counts; padded_total = world * shard_size), the tensor pieces of
//    each shard (for AdamW's decay mask), a bucket's owners, the checkpoint chunks (shard_chunks);
//  * the batch plan (global batch world * B * grad_accum, gradients averaged over ranks), the data position
//    when it changes (continued_position: no window read twice, fewer than one batch skipped), throughput, MFU.

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
