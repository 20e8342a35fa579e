// The NCCL communicator on real GPUs, for any number of ranks: run as part of gpu_tests on one GPU, or as
//   mpirun -np N ./build/gpu_tests --gtest_filter='Communicator.*'
// on N GPUs. Every rank fills its buffers from a seed that depends on its rank, so each rank can compute
// on the host what the collective must return (the sum or mean over all ranks' data) and compare. The
// last test does the same with the CUDA backend's data-parallel backward.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "backend.hpp"
#include "dist_plan.hpp"
#include "distributed.hpp"
#include "kernels/cuda_check.cuh"
#include "model.hpp"
#include "rng.hpp"

namespace coda {
namespace {

// One distributed context for the whole test binary (MPI may be initialised only once per process).
DistContext& context() {
  static DistContext* instance = [] {
    auto* created = new DistContext(init_distributed());
    std::atexit([] { finalize_distributed(context()); });
    return created;
  }();
  return *instance;
}

std::vector<float> rank_data(size_t count, int rank, uint64_t seed) {
  Rng rng(seed * 1000 + static_cast<uint64_t>(rank));
  std::vector<float> data(count);
  for (float& x : data) x = static_cast<float>(rng.normal());
  return data;
}

// Sum over ranks, and the sum of magnitudes for the tolerance of the fp32 reduction order.
void expected_sum(size_t count, int world_size, uint64_t seed, std::vector<double>& sum, std::vector<double>& scale) {
  sum.assign(count, 0.0);
  scale.assign(count, 0.0);
  for (int r = 0; r < world_size; ++r) {
    const std::vector<float> data = rank_data(count, r, seed);
    for (size_t i = 0; i < count; ++i) {
      sum[i] += data[i];
      scale[i] += std::fabs(data[i]);
    }
  }
}

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  void* ptr = nullptr;
  float* f32() const { return static_cast<float*>(ptr); }
};

std::vector<float> download(const float* device, size_t count) {
  std::vector<float> host(count);
  CUDA_CHECK(cudaMemcpy(host.data(), device, count * sizeof(float), cudaMemcpyDeviceToHost));
  return host;
}

ModelConfig small_llama() {
  ModelConfig c;
  c.arch = Arch::Llama;
  c.n_layer = 3;
  c.d_model = 192;
  c.n_head = 6;
  c.n_kv_head = 2;
  c.d_ff = 512;
  c.vocab_size = 1000;
  c.tied_head = false;
  return c;
}

TEST(Communicator, AllReduceSumAndAverage) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  const int rank = comm.rank(), world = comm.world_size();
  const size_t count = (1u << 20) + 37;
  std::vector<double> sum, scale;
  expected_sum(count, world, 1, sum, scale);
  const std::vector<float> mine = rank_data(count, rank, 1);
  DeviceBuffer buffer(count * sizeof(float));
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
    CUDA_CHECK(cudaMemcpy(buffer.ptr, mine.data(), count * sizeof(float), cudaMemcpyHostToDevice));
    comm.all_reduce(buffer.f32(), count, op);
    comm.synchronize();
    const std::vector<float> got = download(buffer.f32(), count);
    const double divisor = op == ReduceOp::Sum ? 1.0 : world;
    for (size_t i = 0; i < count; ++i)
      ASSERT_NEAR(got[i], sum[i] / divisor, 1e-6 * scale[i] / divisor + 1e-7) << "element " << i;
  }
}

// Buckets written one after another on a compute stream (as backward does), each reduced as soon as its
// event fires; the compute stream then continues after join().
TEST(Communicator, BucketsReducedBehindCompute) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  const int rank = comm.rank(), world = comm.world_size();
  const ParamLayout layout = make_param_layout(small_llama());
  std::vector<double> sum, scale;
  expected_sum(layout.total, world, 2, sum, scale);
  const std::vector<float> mine = rank_data(layout.total, rank, 2);
  DeviceBuffer grads(layout.total * sizeof(float));
  CUDA_CHECK(cudaMemset(grads.ptr, 0xFF, layout.total * sizeof(float)));  // NaN until "backward" writes it
  cudaStream_t compute;
  CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  const std::vector<GradBucket> buckets = gradient_buckets(layout);
  std::vector<cudaEvent_t> ready(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    const GradBucket& bucket = buckets[b];
    const size_t count = bucket.end - bucket.begin;
    CUDA_CHECK(cudaMemcpyAsync(grads.f32() + bucket.begin, mine.data() + bucket.begin, count * sizeof(float),
                               cudaMemcpyHostToDevice, compute));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready[b], cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(ready[b], compute));
    comm.wait_event(ready[b]);
    comm.all_reduce(grads.f32() + bucket.begin, count, ReduceOp::Average);
  }
  comm.join(compute);
  std::vector<float> got(layout.total);
  CUDA_CHECK(cudaMemcpyAsync(got.data(), grads.ptr, layout.total * sizeof(float), cudaMemcpyDeviceToHost, compute));
  comm.wait(compute);
  for (size_t i = 0; i < layout.total; ++i)
    ASSERT_NEAR(got[i], sum[i] / world, 1e-6 * scale[i] / world + 1e-7) << "element " << i;
  for (cudaEvent_t event : ready) CUDA_CHECK(cudaEventDestroy(event));
  CUDA_CHECK(cudaStreamDestroy(compute));
}

// ZeRO-1 round: in-place reduce-scatter of the gradients (and, separately, per-bucket reduces to the
// shard owners), then an in-place all-gather of bf16 shards.
TEST(Communicator, ZeroShardsReduceScatterAndAllGather) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  const int rank = comm.rank(), world = comm.world_size();
  const ParamLayout layout = make_param_layout(small_llama());
  const ZeroPartition partition = make_zero_partition(layout, world);
  const ZeroShard& shard = partition.shards[rank];
  std::vector<double> sum, scale;
  expected_sum(partition.padded_total, world, 3, sum, scale);
  const std::vector<float> mine = rank_data(partition.padded_total, rank, 3);
  DeviceBuffer grads(partition.padded_total * sizeof(float));

  CUDA_CHECK(cudaMemcpy(grads.ptr, mine.data(), partition.padded_total * sizeof(float), cudaMemcpyHostToDevice));
  float* my_shard = grads.f32() + rank * partition.shard_size;
  comm.reduce_scatter(grads.ptr, my_shard, partition.shard_size, DType::F32, ReduceOp::Sum);
  comm.synchronize();
  std::vector<float> got = download(my_shard, partition.shard_size);
  for (size_t i = 0; i < partition.shard_size; ++i) {
    const size_t g = rank * partition.shard_size + i;
    ASSERT_NEAR(got[i], sum[g], 1e-6 * scale[g] + 1e-7) << "element " << g;
  }

  CUDA_CHECK(cudaMemcpy(grads.ptr, mine.data(), partition.padded_total * sizeof(float), cudaMemcpyHostToDevice));
  for (const GradBucket& bucket : gradient_buckets(layout)) {
    comm.group_start();
    for (const OwnedRange& range : bucket_owners(bucket, partition))
      comm.reduce(grads.f32() + range.begin, grads.f32() + range.begin, range.end - range.begin, range.rank,
                  ReduceOp::Sum);
    comm.group_end();
  }
  comm.synchronize();
  got = download(grads.f32() + shard.begin, shard.end - shard.begin);
  for (size_t g = shard.begin; g < shard.end; ++g)
    ASSERT_NEAR(got[g - shard.begin], sum[g], 1e-6 * scale[g] + 1e-7) << "element " << g;

  // Each rank's shard of "updated weights" in bf16; after the all-gather every rank holds all of them.
  std::vector<__nv_bfloat16> full(partition.padded_total);
  for (int r = 0; r < world; ++r) {
    const std::vector<float> weights = rank_data(partition.shard_size, r, 4);
    for (size_t i = 0; i < partition.shard_size; ++i) full[r * partition.shard_size + i] = __float2bfloat16(weights[i]);
  }
  DeviceBuffer gathered(partition.padded_total * sizeof(__nv_bfloat16));
  __nv_bfloat16* gathered_bf16 = static_cast<__nv_bfloat16*>(gathered.ptr);
  CUDA_CHECK(cudaMemset(gathered.ptr, 0xFF, partition.padded_total * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMemcpy(gathered_bf16 + rank * partition.shard_size, full.data() + rank * partition.shard_size,
                        partition.shard_size * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  comm.all_gather(gathered_bf16 + rank * partition.shard_size, gathered.ptr, partition.shard_size, DType::BF16);
  comm.synchronize();
  std::vector<__nv_bfloat16> back(partition.padded_total);
  CUDA_CHECK(cudaMemcpy(back.data(), gathered.ptr, back.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(back.data(), full.data(), back.size() * sizeof(__nv_bfloat16)), 0);
}

TEST(Communicator, ScalarAndBroadcast) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  const int rank = comm.rank(), world = comm.world_size();
  const float value = 1.5f + 0.25f * rank;
  double expected = 0.0;
  for (int r = 0; r < world; ++r) expected += 1.5 + 0.25 * r;
  EXPECT_NEAR(comm.all_reduce_scalar(value, ReduceOp::Sum), expected, 1e-5 * expected);
  EXPECT_NEAR(comm.all_reduce_scalar(value, ReduceOp::Average), expected / world, 1e-5 * expected);

  const int root = world - 1;
  const size_t count = 4099;
  const std::vector<float> root_data = rank_data(count, root, 5);
  const std::vector<float> mine = rank_data(count, rank, 5);
  DeviceBuffer buffer(count * sizeof(float));
  CUDA_CHECK(cudaMemcpy(buffer.ptr, mine.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  comm.broadcast(buffer.ptr, count, DType::F32, root);
  comm.synchronize();
  EXPECT_EQ(download(buffer.f32(), count), root_data);
}

// The CUDA backend's data-parallel backward (Backend::average_grads_in_next_backward), which reduces each
// gradient bucket while the backward of the layers below runs. Two micro-batches per rank, the second one
// reducing: every rank must end with the mean over ranks of each rank's accumulated gradients. Each rank
// computes that reference itself, by running every rank's micro-batches without communication. Attention's
// dQ accumulates with atomics, so the comparison is tensor by tensor in relative L2 norm.
TEST(Communicator, BackendAveragesGradientsDuringBackward) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  const int rank = comm.rank(), world = comm.world_size();
  const int B = 2, T = 64;
  for (Arch arch : {Arch::GPT2, Arch::Llama}) {
    ModelConfig model;  // head_dim 64, as the attention kernels need
    model.arch = arch;
    model.n_layer = 3;
    model.d_model = 128;
    model.n_head = 2;
    model.n_kv_head = arch == Arch::GPT2 ? 2 : 1;
    model.d_ff = arch == Arch::GPT2 ? 512 : 344;
    model.vocab_size = 1000;
    model.max_seq_len = T;
    model.tied_head = arch == Arch::GPT2;
    const ParamLayout layout = make_param_layout(model);
    std::vector<float> params(layout.total);
    init_params(model, layout, 5, params.data());
    std::unique_ptr<Backend> backend = make_cuda_backend(model, "unfused", B, T);
    backend->load_params(params.data());

    const auto run_micro_batch = [&](int of_rank, int micro) {
      Rng rng(1000 + 10 * static_cast<uint64_t>(of_rank) + static_cast<uint64_t>(micro));
      std::vector<int32_t> sequence(static_cast<size_t>(B) * T + 1);
      for (int32_t& token : sequence) token = static_cast<int32_t>(rng.below(model.vocab_size));
      return backend->forward_backward(sequence.data(), sequence.data() + 1, B, T, 0.5f);
    };
    // Relative L2 error of got against want, tensor by tensor.
    const auto expect_close = [&](const std::vector<float>& got, const std::vector<double>& want, const char* what) {
      for (const ParamTensor& tensor : layout.tensors) {
        double diff = 0.0, norm = 0.0;
        for (size_t i = tensor.offset; i < tensor.offset + tensor.numel; ++i) {
          diff += (got[i] - want[i]) * (got[i] - want[i]);
          norm += want[i] * want[i];
        }
        EXPECT_GT(norm, 0.0) << tensor.name;
        EXPECT_LT(std::sqrt(diff), 1e-5 * std::sqrt(norm)) << arch_name(arch) << " " << what << " " << tensor.name;
      }
    };
    std::vector<double> mean(layout.total, 0.0), own(layout.total);
    std::vector<float> grads(layout.total);
    for (int r = 0; r < world; ++r) {
      backend->zero_grad();
      run_micro_batch(r, 0);
      run_micro_batch(r, 1);
      backend->read_grads(grads.data());
      for (size_t i = 0; i < layout.total; ++i) mean[i] += grads[i] / static_cast<double>(world);
      if (r == rank) own.assign(grads.begin(), grads.end());
    }
    backend->zero_grad();
    run_micro_batch(rank, 0);
    backend->average_grads_in_next_backward(comm);
    run_micro_batch(rank, 1);
    backend->read_grads(grads.data());
    expect_close(grads, mean, "averaged");
    // The reduction was armed for one backward only: the next step is local again.
    backend->zero_grad();
    run_micro_batch(rank, 0);
    run_micro_batch(rank, 1);
    backend->read_grads(grads.data());
    expect_close(grads, own, "local");
  }
}

}  // namespace
}  // namespace coda
