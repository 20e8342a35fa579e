// Buckets, ZeRO-1 shards, batch and throughput arithmetic; see dist_plan.hpp for the reasoning.
#include "dist_plan.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace coda {

namespace {

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// The first element of a layer: the smallest offset among its tensors.
size_t layer_begin(const LayerParams& lp) {
  const size_t offsets[] = {lp.norm1_w,     lp.norm1_b,     lp.qkv_w,    lp.qkv_b,    lp.attn_proj_w, lp.attn_proj_b,
                            lp.norm2_w,     lp.norm2_b,     lp.mlp_up_w, lp.mlp_up_b, lp.mlp_down_w,  lp.mlp_down_b};
  size_t begin = kAbsent;
  for (size_t offset : offsets) begin = std::min(begin, offset);
  return begin;
}

void require_positive(int64_t value, const char* name) {
  if (value < 1) throw std::invalid_argument(std::string(name) + " must be >= 1, got " + std::to_string(value));
}

}  // namespace

std::vector<GradBucket> gradient_buckets(const ParamLayout& layout) {
  const int n_layer = static_cast<int>(layout.layers.size());
  if (n_layer == 0 || layout.normf_w == kAbsent)
    throw std::logic_error("gradient_buckets: the layout has no layers or no final norm");
  std::vector<size_t> begins(n_layer + 1);
  for (int l = 0; l < n_layer; ++l) begins[l] = layer_begin(layout.layers[l]);
  begins[n_layer] = layout.normf_w;  // the tail: final norm, then the untied head
  for (int l = 0; l < n_layer; ++l)
    if (begins[l] == kAbsent || begins[l] >= begins[l + 1])
      throw std::logic_error("gradient_buckets: layer " + std::to_string(l) +
                             " is not contiguous before the next layer / final norm in the layout");

  std::vector<GradBucket> buckets;
  buckets.push_back({"head", -1, layout.normf_w, layout.total});
  for (int l = n_layer - 1; l >= 0; --l) buckets.push_back({"h." + std::to_string(l), l, begins[l], begins[l + 1]});
  if (begins[0] > 0) buckets.push_back({"embeddings", -1, 0, begins[0]});
  return buckets;
}

ZeroPartition make_zero_partition(const ParamLayout& layout, int world_size) {
  require_positive(world_size, "world_size");
  ZeroPartition partition;
  partition.world_size = world_size;
  partition.total = layout.total;
  const size_t world = static_cast<size_t>(world_size);
  partition.shard_size = round_up((layout.total + world - 1) / world, kParamAlign);
  partition.padded_total = world * partition.shard_size;
  for (size_t r = 0; r < world; ++r) {
    ZeroShard shard;
    shard.begin = std::min(r * partition.shard_size, layout.total);
    shard.end = std::min((r + 1) * partition.shard_size, layout.total);
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      const ParamTensor& tensor = layout.tensors[t];
      const size_t begin = std::max(tensor.offset, shard.begin);
      const size_t end = std::min(tensor.offset + tensor.numel, shard.end);
      if (begin < end) shard.pieces.push_back({t, begin, end, tensor.weight_decay});
    }
    partition.shards.push_back(std::move(shard));
  }
  return partition;
}

std::vector<OwnedRange> bucket_owners(const GradBucket& bucket, const ZeroPartition& partition) {
  std::vector<OwnedRange> owned;
  for (int r = 0; r < partition.world_size; ++r) {
    const ZeroShard& shard = partition.shards[r];
    const size_t begin = std::max(bucket.begin, shard.begin);
    const size_t end = std::min(bucket.end, shard.end);
    if (begin < end) owned.push_back({r, begin, end});
  }
  return owned;
}

std::vector<OwnedRange> shard_chunks(const ZeroPartition& partition, size_t max_count) {
  if (max_count == 0 || max_count % kParamAlign != 0)
    throw std::invalid_argument("shard_chunks: max_count = " + std::to_string(max_count) +
                                " must be a positive multiple of " + std::to_string(kParamAlign));
  std::vector<OwnedRange> chunks;
  for (int r = 0; r < partition.world_size; ++r) {
    const ZeroShard& shard = partition.shards[r];
    for (size_t begin = shard.begin; begin < shard.end; begin += max_count)
      chunks.push_back({r, begin, std::min(begin + max_count, shard.end)});
  }
  return chunks;
}

BatchPlan plan_batch(int world_size, int micro_batch, int seq_len, int grad_accum) {
  require_positive(world_size, "world_size");
  require_positive(micro_batch, "batch_size");
  require_positive(seq_len, "seq_len");
  require_positive(grad_accum, "grad_accum");
  return BatchPlan{world_size, micro_batch, seq_len, grad_accum};
}

BatchPlan plan_batch_for_global(int world_size, int micro_batch, int seq_len, int64_t global_batch) {
  require_positive(world_size, "world_size");
  require_positive(micro_batch, "batch_size");
  require_positive(global_batch, "global batch");
  const int64_t per_micro_step = int64_t{world_size} * micro_batch;
  if (global_batch % per_micro_step != 0)
    throw std::invalid_argument(
        "a global batch of " + std::to_string(global_batch) + " sequences cannot be split over " +
        std::to_string(world_size) + " ranks x batch_size " + std::to_string(micro_batch) + " (" +
        std::to_string(per_micro_step) + " sequences per micro-step): it is not a multiple; choose batch_size " +
        "and the number of ranks so that world_size * batch_size divides " + std::to_string(global_batch));
  const int64_t grad_accum = global_batch / per_micro_step;
  if (grad_accum > std::numeric_limits<int>::max())
    throw std::invalid_argument("grad_accum = " + std::to_string(grad_accum) + " is too large");
  return plan_batch(world_size, micro_batch, seq_len, static_cast<int>(grad_accum));
}

LoaderPosition rescale_loader_position(const LoaderPosition& saved, size_t saved_global_batch, size_t global_batch,
                                       size_t batches_per_epoch) {
  if (saved_global_batch == 0 || global_batch == 0 || batches_per_epoch == 0)
    throw std::invalid_argument("rescale_loader_position: global batches (" + std::to_string(saved_global_batch) +
                                ", " + std::to_string(global_batch) + ") and batches per epoch (" +
                                std::to_string(batches_per_epoch) + ") must be >= 1");
  const size_t consumed = saved.batch * saved_global_batch;
  const size_t batch = (consumed + global_batch - 1) / global_batch;
  if (batch >= batches_per_epoch) return {saved.epoch + 1, 0};
  return {saved.epoch, batch};
}

JobThroughput job_throughput(const BatchPlan& plan, double step_seconds, double flops_per_token,
                             double peak_flops_per_gpu) {
  if (!(step_seconds > 0.0)) throw std::invalid_argument("step time must be > 0 s, got " + std::to_string(step_seconds));
  if (!(peak_flops_per_gpu > 0.0))
    throw std::invalid_argument("peak FLOP/s per GPU must be > 0, got " + std::to_string(peak_flops_per_gpu));
  JobThroughput throughput;
  throughput.tokens_per_second = static_cast<double>(plan.tokens_per_step()) / step_seconds;
  throughput.tokens_per_second_per_gpu = throughput.tokens_per_second / plan.world_size;
  throughput.mfu = flops_per_token * throughput.tokens_per_second / (plan.world_size * peak_flops_per_gpu);
  return throughput;
}

}  // namespace coda
