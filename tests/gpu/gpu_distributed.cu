// The NCCL communicator and ZeRO-1 on real GPUs, for any number of ranks: run as part of gpu_tests on
// one GPU, or as
//   mpirun -np N ./build/gpu_tests --gtest_filter='Communicator.*:Zero*'
// on N GPUs. Every rank fills its buffers from a seed that depends on its rank, so each rank can compute
// on the host what the collective must return (the sum or mean over all ranks' data) and compare. The
// Communicator tests end with the CUDA backend's data-parallel backward; the Zero1 tests check the
// sharded optimizer (make_cuda_backend with a communicator) against the CPU AdamW and against the
// replicated optimizer, its checkpoint I/O, and (one rank) coda train's loop with zero1 on and off.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "adamw.hpp"
#include "backend.hpp"
#include "checkpoint.hpp"
#include "config.hpp"
#include "dist_plan.hpp"
#include "distributed.hpp"
#include "kernels/common/cuda_check.cuh"
#include "model.hpp"
#include "prepare.hpp"
#include "rng.hpp"
#include "tests/test_util.hpp"
#include "train.hpp"

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
  c.set_arch(Arch::Llama);
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
    model.set_arch(arch);
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


// ---- ZeRO-1 (the cuda backend made with a communicator: make_cuda_backend(..., {&comm}))

// A model whose attention the kernels take (head_dim 64).
ModelConfig zero1_model(Arch arch, int T, int n_layer, int d_model, int vocab_size) {
  ModelConfig model;
  model.set_arch(arch);
  model.n_layer = n_layer;
  model.d_model = d_model;
  model.n_head = d_model / 64;
  model.n_kv_head = arch == Arch::GPT2 ? model.n_head : 1;
  model.d_ff = arch == Arch::GPT2 ? 4 * d_model : 344;
  model.vocab_size = vocab_size;
  model.max_seq_len = T;
  model.tied_head = arch == Arch::GPT2;
  return model;
}

// B sequences of T + 1 random tokens, drawn from (rank, step, micro).
std::vector<int32_t> zero1_tokens(const ModelConfig& model, int B, int T, int rank, int step, int micro) {
  Rng rng(7000 + 100 * static_cast<uint64_t>(rank) + 10 * static_cast<uint64_t>(step) + static_cast<uint64_t>(micro));
  std::vector<int32_t> sequence(static_cast<size_t>(B) * T + 1);
  for (int32_t& token : sequence) token = static_cast<int32_t>(rng.below(model.vocab_size));
  return sequence;
}

// The mean over ranks of every rank's gradients, assembled on every rank: under ZeRO-1 each rank's
// gradient buffer holds that mean on its own shard only, so each contributes its shard and the rest is summed.
std::vector<float> assembled_mean_gradient(Backend& backend, Communicator& comm, const ZeroPartition& partition) {
  std::vector<float> grads(partition.total);
  backend.read_grads(grads.data());
  const ZeroShard& shard = partition.shards[comm.rank()];
  for (size_t i = 0; i < partition.total; ++i)
    if (i < shard.begin || i >= shard.end) grads[i] = 0.0f;
  DeviceBuffer buffer(partition.total * sizeof(float));
  CUDA_CHECK(cudaMemcpy(buffer.ptr, grads.data(), partition.total * sizeof(float), cudaMemcpyHostToDevice));
  comm.all_reduce(buffer.f32(), partition.total, ReduceOp::Sum);
  comm.synchronize();
  return download(buffer.f32(), partition.total);
}

// Elements where |got - want| > rel * |want| + abs; prints the first.
size_t count_mismatches(const std::vector<float>& got, const std::vector<float>& want, double rel, double abs,
                        const std::string& what) {
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= rel * std::fabs(want[i]) + abs) && bad++ == 0)
      ADD_FAILURE() << what << " element " << i << ": " << got[i] << " vs " << want[i];
  return bad;
}

// The sharded optimizer step against the CPU AdamW on the gradients the backend reduced: the norm composed
// from the shards, the update of every shard (gathered back with read_params / read_optimizer_state), and
// the all-gathered bf16 copy, which must give the very loss of a replicated backend loaded with the
// gathered master weights. Three steps of two micro-batches, the second one reducing; the update is
// scaled by 0.5 / norm so the composed norm drives it.
// coda bench under a launcher: every rank runs the timed steps with the gradient average armed (plain and
// ZeRO-1); the job's tokens/s is world_size times one GPU's. The plain run also reads its energy over a
// 0.3 s window, which takes untimed steps beyond the timed ones, as many on every rank.
TEST(Communicator, BenchRunsOnEveryRank) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  spdlog::set_level(spdlog::level::warn);
  RunConfig config;
  config.model = zero1_model(Arch::GPT2, 64, 2, 128, 1000);
  config.batch_size = 2;
  config.seq_len = 64;
  config.grad_accum = 2;
  config.device = "cuda";
  config.kernels = "coda";
  for (bool zero1 : {false, true}) {
    SCOPED_TRACE(zero1 ? "zero1" : "plain");
    config.zero1 = zero1;
    const std::vector<BenchResult> results = bench(config, 2, 1, &comm, zero1 ? 0.0 : 0.3);
    ASSERT_EQ(results.size(), 1u);
    const BenchResult& r = results.front();
    EXPECT_EQ(r.world_size, comm.world_size());
    EXPECT_NEAR(r.tokens_per_s * r.median_ms / 1000.0, 2.0 * 2 * 64 * comm.world_size(), 1e-6 * r.tokens_per_s);
    EXPECT_NEAR(r.tokens_per_s, r.tokens_per_s_per_gpu * comm.world_size(), 1e-9 * r.tokens_per_s);
    EXPECT_GT(r.memory_gib, 0.0);
    if (r.joules_per_step > 0.0) {  // a GPU whose energy counter NVML reads
      EXPECT_GT(r.mean_power_w, 20.0);
      EXPECT_LT(r.mean_power_w, 1500.0);
      if (!zero1) {
        EXPECT_GT(r.energy_steps, 2) << "two timed steps of a tiny model take far less than 0.3 s";
        EXPECT_GE(r.energy_window_s, 0.3);
      }
    }
  }
  EXPECT_GT(time_gradient_all_reduce(comm, size_t{1} << 20, 2), 0.0);
}

TEST(Zero1, OptimizerStepMatchesReference) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  const int rank = comm.rank();
  const int B = 2, T = 64;
  for (Arch arch : {Arch::GPT2, Arch::Llama}) {
    SCOPED_TRACE(arch_name(arch));
    const ModelConfig model = zero1_model(arch, T, 2, 128, 1000);
    const ParamLayout layout = make_param_layout(model);
    const ZeroPartition partition = make_zero_partition(layout, comm.world_size());
    std::vector<float> params(layout.total), m(layout.total, 0.0f), v(layout.total, 0.0f);
    init_params(model, layout, 9, params.data());
    std::unique_ptr<Backend> sharded = make_cuda_backend(model, "unfused", B, T, {&comm, std::nullopt, false});
    sharded->load_params(params.data());
    sharded->load_optimizer_state(m.data(), v.data());
    const AdamWHyper hyper{2e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
    for (int step = 1; step <= 3; ++step) {
      sharded->zero_grad();
      for (int micro = 0; micro < 2; ++micro) {
        const std::vector<int32_t> tokens = zero1_tokens(model, B, T, rank, step, micro);
        if (micro == 1) sharded->average_grads_in_next_backward(comm);
        sharded->forward_backward(tokens.data(), tokens.data() + 1, B, T, 0.5f);
      }
      const std::vector<float> grads = assembled_mean_gradient(*sharded, comm, partition);
      double sumsq = 0.0;
      for (float g : grads) sumsq += static_cast<double>(g) * g;
      const float norm = sharded->grad_norm();
      EXPECT_NEAR(norm, std::sqrt(sumsq), 1e-5 * std::sqrt(sumsq)) << "step " << step;
      sharded->adamw_step(hyper, step, 0.5f / norm);
      adamw_update(layout, params.data(), grads.data(), m.data(), v.data(), hyper, step, 0.5f / norm);
    }
    std::vector<float> got_params(layout.total), got_m(layout.total), got_v(layout.total);
    sharded->read_params(got_params.data());
    sharded->read_optimizer_state(got_m.data(), got_v.data());
    EXPECT_EQ(count_mismatches(got_params, params, 1e-5, 1e-5 * hyper.lr, "params"), 0u);
    EXPECT_EQ(count_mismatches(got_m, m, 1e-4, 1e-9, "adam m"), 0u);
    EXPECT_EQ(count_mismatches(got_v, v, 1e-4, 1e-12, "adam v"), 0u);

    std::unique_ptr<Backend> replicated = make_cuda_backend(model, "unfused", B, T);
    replicated->load_params(got_params.data());
    const std::vector<int32_t> tokens = zero1_tokens(model, B, T, rank, 9, 0);
    EXPECT_EQ(sharded->forward_loss(tokens.data(), tokens.data() + 1, B, T),
              replicated->forward_loss(tokens.data(), tokens.data() + 1, B, T));
  }
}

// ZeRO-1 on and off over the same ranks and batches: the same losses, norms and weights after a few
// steps, up to the summation order of the reductions (and of attention's dQ reduce-adds). With more than
// two ranks the all-reduce and the reduce-scatter add in different orders, and some gradients are
// rounding noise (GPT-2's key bias: exactly zero in exact arithmetic, softmax being shift-invariant);
// AdamW with a small epsilon turns such noise into full steps of random sign (docs/DISTRIBUTED.md,
// "Checks on several GPUs"). So this test's epsilon (1e-4, above the gradients of these tiny models) keeps the update
// close to linear in the gradient, and noise stays noise; Zero1.OptimizerStepMatchesReference checks the
// sharded AdamW itself at the usual epsilon.
TEST(Zero1, TrainsLikeTheReplicatedOptimizer) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  const int rank = comm.rank();
  const int B = 2, T = 64;
  for (Arch arch : {Arch::GPT2, Arch::Llama}) {
    SCOPED_TRACE(arch_name(arch));
    const ModelConfig model = zero1_model(arch, T, 3, 128, 1000);
    const ParamLayout layout = make_param_layout(model);
    std::vector<float> initial(layout.total);
    init_params(model, layout, 5, initial.data());
    std::unique_ptr<Backend> backends[2] = {make_cuda_backend(model, "unfused", B, T),
                                            make_cuda_backend(model, "unfused", B, T, {&comm, std::nullopt, false})};
    const AdamWHyper hyper{1e-3f, 0.9f, 0.95f, 1e-4f, 0.1f};
    for (auto& backend : backends) backend->load_params(initial.data());
    for (int step = 1; step <= 4; ++step) {
      float loss[2], norm[2];
      for (int k = 0; k < 2; ++k) {
        Backend& backend = *backends[k];
        backend.zero_grad();
        loss[k] = 0.0f;
        for (int micro = 0; micro < 2; ++micro) {
          const std::vector<int32_t> tokens = zero1_tokens(model, B, T, rank, step, micro);
          if (micro == 1) backend.average_grads_in_next_backward(comm);
          loss[k] += 0.5f * backend.forward_backward(tokens.data(), tokens.data() + 1, B, T, 0.5f);
        }
        norm[k] = backend.grad_norm();
        backend.adamw_step(hyper, step, std::min(1.0f, 0.5f / norm[k]));
      }
      EXPECT_NEAR(loss[1], loss[0], 1e-4 * loss[0]) << "step " << step;
      EXPECT_NEAR(norm[1], norm[0], 1e-4 * norm[0]) << "step " << step;
    }
    std::vector<float> params[2], m[2], v[2];
    for (int k = 0; k < 2; ++k) {
      params[k].resize(layout.total);
      m[k].resize(layout.total);
      v[k].resize(layout.total);
      backends[k]->read_params(params[k].data());
      backends[k]->read_optimizer_state(m[k].data(), v[k].data());
    }
    // The change of the weights, compared tensor by tensor in relative L2 norm.
    for (const ParamTensor& tensor : layout.tensors) {
      double diff = 0.0, moved = 0.0, m_diff = 0.0, m_norm = 0.0;
      for (size_t i = tensor.offset; i < tensor.offset + tensor.numel; ++i) {
        diff += std::pow(params[1][i] - params[0][i], 2);
        moved += std::pow(params[0][i] - initial[i], 2);
        m_diff += std::pow(m[1][i] - m[0][i], 2);
        m_norm += std::pow(m[0][i], 2);
      }
      EXPECT_GT(moved, 0.0) << tensor.name;
      EXPECT_LE(std::sqrt(diff), 1e-2 * std::sqrt(moved)) << tensor.name;
      EXPECT_LE(std::sqrt(m_diff), 1e-3 * std::sqrt(m_norm)) << tensor.name;
    }
  }
}

// Checkpoint I/O of a sharded backend: every rank loads the full state and keeps its shard, reading
// gathers the shards back bit for bit (a model large enough for several staging chunks), and the bf16
// copy rebuilt on load gives the loss of a replicated backend loaded with the same weights.
TEST(Zero1, LoadScattersAndReadGathersTheFullState) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  const int B = 2, T = 64;
  ModelConfig model = zero1_model(Arch::Llama, T, 3, 256, 4000);
  model.tied_head = false;
  const ParamLayout layout = make_param_layout(model);
  ASSERT_GT(layout.total, size_t{3} << 20);  // several 1M-element chunks
  std::vector<float> params(layout.total), m(layout.total, 0.0f), v(layout.total, 0.0f);
  init_params(model, layout, 21, params.data());
  Rng rng(22);
  for (const ParamTensor& tensor : layout.tensors)
    for (size_t i = tensor.offset; i < tensor.offset + tensor.numel; ++i) {
      m[i] = static_cast<float>(1e-3 * rng.normal());
      v[i] = static_cast<float>(1e-6 * rng.uniform());
    }
  std::unique_ptr<Backend> sharded = make_cuda_backend(model, "unfused", B, T, {&comm, std::nullopt, false});
  sharded->load_params(params.data());
  sharded->load_optimizer_state(m.data(), v.data());
  std::vector<float> got_params(layout.total, -1.0f), got_m(layout.total, -1.0f), got_v(layout.total, -1.0f);
  sharded->read_params(got_params.data());
  sharded->read_optimizer_state(got_m.data(), got_v.data());
  EXPECT_EQ(count_mismatches(got_params, params, 0.0, 0.0, "params"), 0u);
  EXPECT_EQ(count_mismatches(got_m, m, 0.0, 0.0, "adam m"), 0u);
  EXPECT_EQ(count_mismatches(got_v, v, 0.0, 0.0, "adam v"), 0u);

  std::unique_ptr<Backend> replicated = make_cuda_backend(model, "unfused", B, T);
  replicated->load_params(params.data());
  const std::vector<int32_t> tokens = zero1_tokens(model, B, T, comm.rank(), 0, 0);
  EXPECT_EQ(sharded->forward_loss(tokens.data(), tokens.data() + 1, B, T),
            replicated->forward_loss(tokens.data(), tokens.data() + 1, B, T));
}

// Losses of metrics.jsonl by step.
std::map<int, float> logged_losses(const std::string& out) {
  std::map<int, float> losses;
  std::ifstream file(out + "/metrics.jsonl");
  for (std::string line; std::getline(file, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    losses[record.at("step").get<int>()] = record.at("loss").get<float>();
  }
  return losses;
}

// coda train's loop with zero1 on one rank: the same losses as without it,
// checkpoints holding the full state, and resuming across the modes (a ZeRO-1 checkpoint continued
// without ZeRO-1 and the other way round) ending where the uninterrupted runs end. Gradient clipping is
// on, so the composed norm takes part.
TEST(Zero1, TrainCheckpointsResumeAcrossModes) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Communicator comm(context());
  if (comm.world_size() != 1) GTEST_SKIP() << "one rank only: the ranks' temporary run directories differ";
  spdlog::set_level(spdlog::level::warn);
  test::TempDir root("coda_zero1_train");
  prepare_synthetic(root / "data", 200000, 0, 4242, 100000);
  RunConfig base;
  base.model = zero1_model(Arch::GPT2, 64, 2, 128, kByteVocabSize);
  base.train_data = root / "data/train_*.bin";
  base.val_data = "";
  base.batch_size = 4;
  base.seq_len = 64;
  base.grad_accum = 2;
  base.steps = 6;
  base.warmup_steps = 2;
  base.lr = 2e-3f;
  base.grad_clip = 0.5f;
  base.device = "cuda";
  // The unfused mode: its cuBLASLt weight gradients are deterministic, so ZeRO-1 and the plain run may
  // differ only by summation order. (The coda mode's split-K weight gradients sum their K ranges in
  // whatever order the TMA reduce-adds land, ~1e-7 relative, which AdamW turns into +-lr steps on the
  // elements whose gradient is near zero: 5e-4 of the parameter norm after 3 steps, measured.)
  base.kernels = "unfused";
  base.log_every = 1000;
  base.val_every = 0;
  base.checkpoint_every = 3;
  const auto run = [&](bool zero1, const std::string& out, const std::string& resume) {
    RunConfig config = base;
    config.zero1 = zero1;
    config.out = root / out;
    config.resume = resume.empty() ? "" : root / resume;
    return train(config, &comm);
  };
  run(false, "plain", "");
  run(true, "zero1", "");
  run(false, "plain_from_zero1", "zero1/step_3");
  run(true, "zero1_from_plain", "plain/step_3");

  const std::map<int, float> plain = logged_losses(root / "plain"), sharded = logged_losses(root / "zero1");
  ASSERT_EQ(plain.size(), 6u);
  ASSERT_EQ(sharded.size(), 6u);
  for (const auto& [step, loss] : plain) EXPECT_NEAR(sharded.at(step), loss, 1e-4 * loss) << "step " << step;
  for (const auto& [resumed, reference] : {std::pair{"plain_from_zero1", &sharded}, std::pair{"zero1_from_plain", &plain}}) {
    const std::map<int, float> losses = logged_losses(root / resumed);
    ASSERT_EQ(losses.size(), 3u) << resumed;
    for (const auto& [step, loss] : losses)
      EXPECT_NEAR(loss, reference->at(step), 1e-4 * loss) << resumed << " step " << step;
  }

  // The ZeRO-1 checkpoint holds the full state: that of the plain run up to summation order.
  const Checkpoint a = load_checkpoint(root / "plain/step_3"), b = load_checkpoint(root / "zero1/step_3");
  for (const auto& [want, got, what] : {std::tuple{&a.params, &b.params, "params"},
                                        std::tuple{&a.adam_m, &b.adam_m, "adam m"},
                                        std::tuple{&a.adam_v, &b.adam_v, "adam v"}}) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < want->size(); ++i) {
      diff += std::pow((*got)[i] - (*want)[i], 2);
      norm += std::pow((*want)[i], 2);
    }
    EXPECT_GT(norm, 0.0) << what;
    EXPECT_LE(std::sqrt(diff), 1e-4 * std::sqrt(norm)) << what;
  }
}

}  // namespace
}  // namespace coda
