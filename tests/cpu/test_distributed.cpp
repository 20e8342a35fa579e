// Data-parallel groundwork on the CPU: launcher detection from (faked) environments, device and bootstrap
// choices with their error messages, gradient buckets and ZeRO-1 shards over real and random layouts,
// batch and throughput arithmetic. The NCCL communicator itself is exercised by tests/gpu_distributed.cu.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "dist_plan.hpp"
#include "distributed.hpp"
#include "model.hpp"
#include "rng.hpp"

namespace coda {
namespace {

// Clears every variable the launch code reads and restores the original values afterwards, so the tests
// see exactly the environment they set (also when the test binary itself runs under mpirun or srun).
class EnvGuard {
 public:
  EnvGuard() {
    for (const char* name : kNames) {
      const char* value = std::getenv(name);
      if (value != nullptr) saved_[name] = value;
      unsetenv(name);
    }
  }
  ~EnvGuard() {
    for (const char* name : kNames) {
      auto it = saved_.find(name);
      if (it != saved_.end())
        setenv(name, it->second.c_str(), 1);
      else
        unsetenv(name);
    }
  }
  void set(const char* name, const std::string& value) { setenv(name, value.c_str(), 1); }

 private:
  static constexpr const char* kNames[] = {
      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
      "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "SLURM_PROCID", "SLURM_NTASKS",
      "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID",
      "SLURM_JOB_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "CODA_RUN_ID",
      "CODA_BOOTSTRAP_DIR", "CODA_NCCL_TIMEOUT_S", "CUDA_VISIBLE_DEVICES"};
  std::map<std::string, std::string> saved_;
};

void set_openmpi(EnvGuard& env, int rank, int size, int local_rank, int local_size) {
  env.set("OMPI_COMM_WORLD_RANK", std::to_string(rank));
  env.set("OMPI_COMM_WORLD_SIZE", std::to_string(size));
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local_rank));
  env.set("OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(local_size));
}

// Expects `body` to throw an exception of type E whose message contains `needle`.
template <typename E, typename F>
void expect_error(F body, const std::string& needle) {
  try {
    body();
    ADD_FAILURE() << "expected an error containing \"" << needle << "\"";
  } catch (const E& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos)
        << "message \"" << error.what() << "\" lacks \"" << needle << "\"";
  }
}

// Expects detect_launch() in the current environment to report exactly these values.
void expect_launch(Launcher launcher, int rank, int world_size, int local_rank, int local_size) {
  const LaunchInfo info = detect_launch();
  EXPECT_EQ(info.launcher, launcher);
  EXPECT_EQ(info.rank, rank);
  EXPECT_EQ(info.world_size, world_size);
  EXPECT_EQ(info.local_rank, local_rank);
  EXPECT_EQ(info.local_size, local_size);
}

TEST(Launch, SingleProcessWithoutLauncher) {
  EnvGuard env;
  expect_launch(Launcher::None, 0, 1, 0, 1);
}

TEST(Launch, OpenMpi) {
  EnvGuard env;
  set_openmpi(env, 13, 16, 5, 8);
  expect_launch(Launcher::Mpirun, 13, 16, 5, 8);
}

TEST(Launch, HydraMpirun) {
  EnvGuard env;
  env.set("PMI_RANK", "3");
  env.set("PMI_SIZE", "4");
  env.set("MPI_LOCALRANKID", "1");
  env.set("MPI_LOCALNRANKS", "2");
  expect_launch(Launcher::Mpirun, 3, 4, 1, 2);
}

TEST(Launch, Srun) {
  EnvGuard env;
  env.set("SLURM_PROCID", "9");
  env.set("SLURM_STEP_NUM_TASKS", "12");
  env.set("SLURM_NTASKS", "12");
  env.set("SLURM_LOCALID", "1");
  env.set("SLURM_STEP_TASKS_PER_NODE", "4(x2),2(x2)");
  env.set("SLURM_NODEID", "3");
  expect_launch(Launcher::Slurm, 9, 12, 1, 2);
}

TEST(Launch, SlurmBatchScriptIsOneProcess) {
  EnvGuard env;  // what sbatch exports to the script itself: the job's task count, but no step
  env.set("SLURM_PROCID", "0");
  env.set("SLURM_NTASKS", "8");
  env.set("SLURM_LOCALID", "0");
  env.set("SLURM_TASKS_PER_NODE", "4(x2)");
  env.set("SLURM_JOB_ID", "4242");
  const LaunchInfo info = detect_launch();
  EXPECT_EQ(info.launcher, Launcher::None);
  EXPECT_EQ(info.world_size, 1);
}

TEST(Launch, MpirunInsideSlurmAllocationUsesMpiVariables) {
  EnvGuard env;
  env.set("SLURM_PROCID", "0");  // mpirun's daemon was started by srun, one per node
  env.set("SLURM_STEP_NUM_TASKS", "2");
  env.set("SLURM_LOCALID", "0");
  env.set("SLURM_STEP_TASKS_PER_NODE", "1(x2)");
  set_openmpi(env, 6, 8, 2, 4);
  expect_launch(Launcher::Mpirun, 6, 8, 2, 4);
}

TEST(Launch, BadEnvironmentsNameTheProblem) {
  {
    EnvGuard env;
    set_openmpi(env, 4, 4, 0, 1);
    expect_error<std::runtime_error>([] { detect_launch(); }, "rank is not in [0, world size)");
  }
  {
    EnvGuard env;
    set_openmpi(env, 0, 4, 2, 2);
    expect_error<std::runtime_error>([] { detect_launch(); }, "local rank or local size is inconsistent");
  }
  {
    EnvGuard env;
    set_openmpi(env, 0, 2, 0, 4);
    expect_error<std::runtime_error>([] { detect_launch(); }, "local rank or local size is inconsistent");
  }
  {
    EnvGuard env;
    set_openmpi(env, 0, 4, 0, 1);
    env.set("OMPI_COMM_WORLD_RANK", "three");
    expect_error<std::runtime_error>([] { detect_launch(); }, "OMPI_COMM_WORLD_RANK = \"three\" is not an integer");
  }
  {
    EnvGuard env;
    set_openmpi(env, 0, 4, 0, 1);
    unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    expect_error<std::runtime_error>([] { detect_launch(); }, "OMPI_COMM_WORLD_LOCAL_RANK is not set");
  }
  {
    EnvGuard env;
    env.set("SLURM_PROCID", "1");
    env.set("SLURM_STEP_NUM_TASKS", "2");
    env.set("SLURM_LOCALID", "1");
    expect_error<std::runtime_error>([] { detect_launch(); }, "SLURM_STEP_TASKS_PER_NODE");
  }
  {
    EnvGuard env;
    env.set("SLURM_PROCID", "1");
    env.set("SLURM_STEP_NUM_TASKS", "4");
    env.set("SLURM_LOCALID", "1");
    env.set("SLURM_STEP_TASKS_PER_NODE", "2(x2)");
    env.set("SLURM_NODEID", "2");
    expect_error<std::runtime_error>([] { detect_launch(); }, "none for node index 2");
  }
}

TEST(Launch, SlurmTasksPerNodeExpansion) {
  Rng rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int> expanded;
    std::string text;
    const int items = 1 + static_cast<int>(rng.next_u64() % 5);
    for (int i = 0; i < items; ++i) {
      const int count = 1 + static_cast<int>(rng.next_u64() % 8);
      const int repeat = 1 + static_cast<int>(rng.next_u64() % 4);
      if (!text.empty()) text += ",";
      text += std::to_string(count);
      if (repeat > 1 || rng.next_u64() % 2 == 0) text += "(x" + std::to_string(repeat) + ")";
      expanded.insert(expanded.end(), repeat, count);
    }
    for (size_t node = 0; node < expanded.size(); ++node)
      ASSERT_EQ(slurm_tasks_on_node(text, static_cast<int>(node)), expanded[node]) << text << " node " << node;
    EXPECT_THROW(slurm_tasks_on_node(text, static_cast<int>(expanded.size())), std::runtime_error) << text;
  }
  for (const char* bad : {"", "2(x", "2(x3", "a", "2(xb)", "0", "3(x0)", "2,,1"})
    EXPECT_THROW(slurm_tasks_on_node(bad, 0), std::runtime_error) << bad;
}

TEST(Launch, DeviceSelection) {
  const LaunchInfo single{};
  EXPECT_EQ(select_device(single, 0, false), -1);  // CPU training
  EXPECT_EQ(select_device(single, 4, false), 0);
  for (int local_size = 1; local_size <= 8; ++local_size)
    for (int local_rank = 0; local_rank < local_size; ++local_rank) {
      const LaunchInfo launch{Launcher::Mpirun, local_rank + 8, 16, local_rank, local_size};
      EXPECT_EQ(select_device(launch, 8, false), local_rank);
      EXPECT_EQ(select_device(launch, 1, true), local_size == 1 ? local_rank : 0);  // bound by the launcher
    }
  const LaunchInfo eight{Launcher::Mpirun, 1, 8, 1, 8};
  expect_error<std::runtime_error>([&] { select_device(eight, 4, false); }, "8 ranks on this node but only 4 GPUs");
  expect_error<std::runtime_error>([&] { select_device(eight, 1, false); }, "8 ranks on this node but only 1 GPUs");
  // rank 0 fails too, so no rank waits for the missing ones
  const LaunchInfo eight_rank0{Launcher::Mpirun, 0, 8, 0, 8};
  expect_error<std::runtime_error>([&] { select_device(eight_rank0, 4, false); }, "only 4 GPUs");
  const LaunchInfo two{Launcher::Slurm, 0, 2, 0, 1};
  expect_error<std::runtime_error>([&] { select_device(two, 0, false); }, "1 ranks on this node but only 0 GPUs");
}

TEST(Launch, BootstrapChoice) {
  const LaunchInfo none{};
  const LaunchInfo mpirun1{Launcher::Mpirun, 0, 1, 0, 1};
  const LaunchInfo mpirun8{Launcher::Mpirun, 3, 8, 3, 8};
  const LaunchInfo srun1{Launcher::Slurm, 0, 1, 0, 1};
  const LaunchInfo srun8{Launcher::Slurm, 3, 8, 3, 4};
  for (bool mpi : {false, true}) {
    EXPECT_EQ(choose_bootstrap(none, mpi, ""), Bootstrap::Local);
    EXPECT_EQ(choose_bootstrap(srun1, mpi, ""), Bootstrap::Local);
    EXPECT_EQ(choose_bootstrap(srun8, mpi, "/shared"), Bootstrap::File);
  }
  EXPECT_EQ(choose_bootstrap(mpirun1, true, ""), Bootstrap::Mpi);
  EXPECT_EQ(choose_bootstrap(mpirun1, false, ""), Bootstrap::Local);
  EXPECT_EQ(choose_bootstrap(mpirun8, true, "/shared"), Bootstrap::Mpi);
  EXPECT_EQ(choose_bootstrap(mpirun8, false, "/shared"), Bootstrap::File);
  EXPECT_EQ(choose_bootstrap(srun8, true, ""), Bootstrap::Mpi);
  expect_error<std::runtime_error>([&] { choose_bootstrap(mpirun8, false, ""); }, "this build has no MPI");
  expect_error<std::runtime_error>([&] { choose_bootstrap(srun8, false, ""); }, "CODA_BOOTSTRAP_DIR");
}

TEST(Launch, BootstrapFileNamesTheLaunch) {
  EnvGuard env;
  expect_error<std::runtime_error>([] { bootstrap_file_path("/shared"); }, "CODA_RUN_ID");
  env.set("OMPI_MCA_ess_base_jobid", "2891513857");
  EXPECT_EQ(bootstrap_file_path("/shared"), "/shared/coda-nccl-id.2891513857");
  env.set("PMIX_NAMESPACE", "prterun-node1-123@1");
  EXPECT_EQ(bootstrap_file_path("/shared"), "/shared/coda-nccl-id.prterun-node1-123_1");
  env.set("SLURM_JOB_ID", "777");
  env.set("SLURM_STEP_ID", "3");
  EXPECT_EQ(bootstrap_file_path("/shared"), "/shared/coda-nccl-id.777.3");
  env.set("CODA_RUN_ID", "my run/1");
  EXPECT_EQ(bootstrap_file_path("/d"), "/d/coda-nccl-id.my_run_1");
}

TEST(Launch, NcclTimeoutFromEnvironment) {
  EnvGuard env;
  EXPECT_EQ(nccl_timeout_seconds(), 300.0);
  env.set("CODA_NCCL_TIMEOUT_S", "12.5");
  EXPECT_EQ(nccl_timeout_seconds(), 12.5);
  for (const char* bad : {"abc", "0", "-3", "5s"}) {
    env.set("CODA_NCCL_TIMEOUT_S", bad);
    expect_error<std::invalid_argument>([] { nccl_timeout_seconds(); }, "CODA_NCCL_TIMEOUT_S");
  }
}

TEST(Launch, InitDistributedSingleProcess) {
  EnvGuard env;
  DistContext context = init_distributed();
  EXPECT_EQ(context.rank, 0);
  EXPECT_EQ(context.world_size, 1);
  EXPECT_EQ(context.launcher, Launcher::None);
  EXPECT_EQ(context.bootstrap, Bootstrap::Local);
  EXPECT_EQ(context.device, -1);
  EXPECT_FALSE(context.mpi_initialized);
  EXPECT_TRUE(context.is_root());
  finalize_distributed(context);
}

TEST(Launch, InitDistributedRefusesMoreRanksThanGpus) {
  EnvGuard env;  // checked before MPI_Init, so the fake mpirun environment never reaches MPI
  set_openmpi(env, 3, 64, 3, 64);
  expect_error<std::runtime_error>([] { init_distributed(); }, "64 ranks on this node but only");
}

// ---------------------------------------------------------------------------------------------------------
// Layouts: the two reference models, an untied Llama, and random small shapes.

ModelConfig gpt2_124m() {
  ModelConfig c;
  c.set_arch(Arch::GPT2);
  c.n_layer = 12;
  c.d_model = 768;
  c.n_head = 12;
  c.n_kv_head = 12;
  c.d_ff = 3072;
  c.vocab_size = 50257;
  c.max_seq_len = 1024;
  return c;
}

ModelConfig llama32_1b() {
  ModelConfig c;
  c.set_arch(Arch::Llama);
  c.n_layer = 16;
  c.d_model = 2048;
  c.n_head = 32;
  c.n_kv_head = 8;
  c.d_ff = 8192;
  c.vocab_size = 128256;
  c.max_seq_len = 2048;
  c.rope_theta = 500000.0f;
  c.tied_head = true;
  return c;
}

std::vector<ModelConfig> test_configs() {
  std::vector<ModelConfig> configs = {gpt2_124m(), llama32_1b()};
  ModelConfig untied = llama32_1b();
  untied.n_layer = 3;
  untied.tied_head = false;
  configs.push_back(untied);
  Rng rng(11);
  for (int i = 0; i < 12; ++i) {
    ModelConfig c;
    c.set_arch(i % 2 == 0 ? Arch::GPT2 : Arch::Llama);
    c.n_head = 1 << (rng.next_u64() % 3);
    c.n_kv_head = c.arch == Arch::GPT2 ? c.n_head : std::max(1, c.n_head >> (rng.next_u64() % 2));
    c.d_model = c.n_head * 2 * static_cast<int>(1 + rng.next_u64() % 20);
    c.n_layer = 1 + static_cast<int>(rng.next_u64() % 5);
    c.d_ff = 1 + static_cast<int>(rng.next_u64() % 300);
    c.vocab_size = 2 + static_cast<int>(rng.next_u64() % 1000);
    c.max_seq_len = 1 + static_cast<int>(rng.next_u64() % 200);
    c.tied_head = c.arch == Arch::GPT2 || rng.next_u64() % 2 == 0;
    configs.push_back(c);
  }
  return configs;
}

// The bucket a tensor must land in, from its name alone.
std::string expected_bucket(const std::string& tensor) {
  if (tensor.rfind("h.", 0) == 0) return tensor.substr(0, tensor.find('.', 2));
  if (tensor == "wte" || tensor == "wpe") return "embeddings";
  return "head";
}

TEST(Buckets, CoverTheLayoutInBackwardOrder) {
  for (const ModelConfig& config : test_configs()) {
    const ParamLayout layout = make_param_layout(config);
    const std::vector<GradBucket> buckets = gradient_buckets(layout);
    ASSERT_EQ(buckets.size(), static_cast<size_t>(config.n_layer) + 2);
    EXPECT_EQ(buckets.front().name, "head");
    EXPECT_EQ(buckets.back().name, "embeddings");
    // backward order: each bucket ends where the previous one (in memory: the next) begins
    EXPECT_EQ(buckets.front().end, layout.total);
    EXPECT_EQ(buckets.back().begin, 0u);
    for (size_t i = 0; i < buckets.size(); ++i) {
      EXPECT_LT(buckets[i].begin, buckets[i].end) << buckets[i].name;
      EXPECT_EQ(buckets[i].begin % kParamAlign, 0u) << buckets[i].name;
      if (i > 0) {
        EXPECT_EQ(buckets[i].end, buckets[i - 1].begin) << buckets[i].name;
      }
      if (i >= 1 && i + 1 < buckets.size()) {
        const int layer = config.n_layer - static_cast<int>(i);
        EXPECT_EQ(buckets[i].layer, layer);
        EXPECT_EQ(buckets[i].name, "h." + std::to_string(layer));
      }
    }
    for (const ParamTensor& tensor : layout.tensors) {
      int holders = 0;
      for (const GradBucket& bucket : buckets)
        if (tensor.offset >= bucket.begin && tensor.offset + tensor.numel <= bucket.end) {
          ++holders;
          EXPECT_EQ(bucket.name, expected_bucket(tensor.name)) << tensor.name;
        }
      EXPECT_EQ(holders, 1) << tensor.name;
    }
  }
}

// Checks one partition against the layout: alignment, exact coverage, piece bounds and decay flags.
void check_partition(const ParamLayout& layout, int world_size, bool check_every_element) {
  const ZeroPartition partition = make_zero_partition(layout, world_size);
  SCOPED_TRACE("world_size " + std::to_string(world_size) + ", total " + std::to_string(layout.total));
  ASSERT_EQ(partition.shards.size(), static_cast<size_t>(world_size));
  EXPECT_EQ(partition.total, layout.total);
  EXPECT_EQ(partition.shard_size % kParamAlign, 0u);
  EXPECT_EQ(partition.padded_total, partition.shard_size * world_size);
  EXPECT_GE(partition.padded_total, layout.total);
  EXPECT_LT((partition.shard_size - kParamAlign) * world_size, layout.total);  // no rounding beyond one align step
  size_t expected_begin = 0;
  size_t piece_elements = 0;
  std::vector<std::vector<std::pair<size_t, size_t>>> by_tensor(layout.tensors.size());
  for (int r = 0; r < world_size; ++r) {
    const ZeroShard& shard = partition.shards[r];
    EXPECT_EQ(shard.begin, expected_begin) << "rank " << r;
    EXPECT_EQ(shard.begin % kParamAlign, 0u) << "rank " << r;
    EXPECT_LE(shard.end - shard.begin, partition.shard_size);
    if (shard.end < layout.total) {
      EXPECT_EQ(shard.end - shard.begin, partition.shard_size) << "rank " << r;
    }
    expected_begin = shard.end;
    size_t previous_end = shard.begin;
    for (const ShardPiece& piece : shard.pieces) {
      const ParamTensor& tensor = layout.tensors.at(piece.tensor);
      EXPECT_GE(piece.begin, previous_end);
      EXPECT_LT(piece.begin, piece.end);
      EXPECT_LE(piece.end, shard.end);
      EXPECT_GE(piece.begin, tensor.offset);
      EXPECT_LE(piece.end, tensor.offset + tensor.numel);
      EXPECT_EQ(piece.weight_decay, tensor.weight_decay) << tensor.name;
      previous_end = piece.end;
      piece_elements += piece.end - piece.begin;
      by_tensor[piece.tensor].push_back({piece.begin, piece.end});
    }
  }
  EXPECT_EQ(expected_begin, layout.total);
  EXPECT_EQ(piece_elements, layout.num_parameters());
  for (size_t t = 0; t < layout.tensors.size(); ++t) {  // every tensor tiled exactly once by its pieces
    auto& ranges = by_tensor[t];
    std::sort(ranges.begin(), ranges.end());
    size_t cursor = layout.tensors[t].offset;
    for (const auto& range : ranges) {
      EXPECT_EQ(range.first, cursor) << layout.tensors[t].name;
      cursor = range.second;
    }
    EXPECT_EQ(cursor, layout.tensors[t].offset + layout.tensors[t].numel) << layout.tensors[t].name;
  }
  if (check_every_element) {  // independent check: one owner per element, pieces exactly on tensor elements
    std::vector<int> owner(layout.total, -1), piece_owner(layout.total, -1);
    size_t owned_twice = 0;
    for (int r = 0; r < world_size; ++r) {
      for (size_t i = partition.shards[r].begin; i < partition.shards[r].end; ++i) {
        owned_twice += owner[i] != -1;
        owner[i] = r;
      }
      for (const ShardPiece& piece : partition.shards[r].pieces)
        for (size_t i = piece.begin; i < piece.end; ++i) piece_owner[i] = r;
    }
    std::vector<char> in_tensor(layout.total, 0);
    for (const ParamTensor& tensor : layout.tensors)
      std::fill(in_tensor.begin() + tensor.offset, in_tensor.begin() + tensor.offset + tensor.numel, 1);
    size_t unowned = 0, wrong_piece = 0;
    for (size_t i = 0; i < layout.total; ++i) {
      unowned += owner[i] == -1;
      wrong_piece += piece_owner[i] != (in_tensor[i] ? owner[i] : -1);
    }
    EXPECT_EQ(owned_twice, 0u);
    EXPECT_EQ(unowned, 0u);
    EXPECT_EQ(wrong_piece, 0u);
  }
}

TEST(ZeroPartition, ModelLayoutsForWorldSizesOneToEight) {
  for (const ModelConfig& config : test_configs()) {
    const ParamLayout layout = make_param_layout(config);
    for (int world_size = 1; world_size <= 8; ++world_size)
      check_partition(layout, world_size, layout.total < 2'000'000);
  }
}

// Synthetic layouts of random tensor counts and sizes, including ones smaller than world * kParamAlign
// (where trailing shards are empty).
TEST(ZeroPartition, RandomLayouts) {
  Rng rng(2024);
  for (int trial = 0; trial < 100; ++trial) {
    ParamLayout layout;
    const int n_tensors = 1 + static_cast<int>(rng.next_u64() % 40);
    const size_t max_numel = trial % 3 == 0 ? 100 : 20'000;
    for (int t = 0; t < n_tensors; ++t) {
      ParamTensor tensor;
      tensor.name = "t" + std::to_string(t);
      tensor.numel = 1 + rng.next_u64() % max_numel;
      tensor.shape = {static_cast<int64_t>(tensor.numel)};
      tensor.offset = layout.total;
      tensor.weight_decay = rng.next_u64() % 2 == 0;
      layout.total += (tensor.numel + kParamAlign - 1) / kParamAlign * kParamAlign;
      layout.tensors.push_back(tensor);
    }
    for (int world_size = 1; world_size <= 8; ++world_size) check_partition(layout, world_size, true);
  }
  EXPECT_THROW(make_zero_partition(make_param_layout(ModelConfig{}), 0), std::invalid_argument);
}

TEST(ZeroPartition, BucketOwnersTileBucketsAndShards) {
  for (const ModelConfig& config : test_configs()) {
    const ParamLayout layout = make_param_layout(config);
    const std::vector<GradBucket> buckets = gradient_buckets(layout);
    for (int world_size = 1; world_size <= 8; ++world_size) {
      const ZeroPartition partition = make_zero_partition(layout, world_size);
      std::vector<size_t> owned_per_rank(world_size, 0);
      for (const GradBucket& bucket : buckets) {
        size_t cursor = bucket.begin;
        int previous_rank = -1;
        for (const OwnedRange& range : bucket_owners(bucket, partition)) {
          EXPECT_EQ(range.begin, cursor) << bucket.name;
          EXPECT_GT(range.rank, previous_rank);
          EXPECT_GE(range.begin, partition.shards[range.rank].begin);
          EXPECT_LE(range.end, partition.shards[range.rank].end);
          owned_per_rank[range.rank] += range.end - range.begin;
          cursor = range.end;
          previous_rank = range.rank;
        }
        EXPECT_EQ(cursor, bucket.end) << bucket.name << " world " << world_size;
      }
      for (int r = 0; r < world_size; ++r)
        EXPECT_EQ(owned_per_rank[r], partition.shards[r].end - partition.shards[r].begin) << "rank " << r;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------

TEST(BatchPlan, GlobalBatchArithmetic) {
  Rng rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    const int world = 1 + static_cast<int>(rng.next_u64() % 64);
    const int micro = 1 + static_cast<int>(rng.next_u64() % 64);
    const int seq = 1 + static_cast<int>(rng.next_u64() % 4096);
    const int accum = 1 + static_cast<int>(rng.next_u64() % 32);
    const BatchPlan plan = plan_batch(world, micro, seq, accum);
    const int64_t global = int64_t{world} * micro * accum;
    EXPECT_EQ(plan.global_batch(), global);
    EXPECT_EQ(plan.tokens_per_step(), global * seq);
    const BatchPlan from_global = plan_batch_for_global(world, micro, seq, global);
    EXPECT_EQ(from_global.grad_accum, accum);
    EXPECT_EQ(from_global.tokens_per_step(), plan.tokens_per_step());
    // the same global batch on another number of ranks, when it divides
    const int other_world = 1 + static_cast<int>(rng.next_u64() % 16);
    if (global % (int64_t{other_world} * micro) == 0)
      EXPECT_EQ(plan_batch_for_global(other_world, micro, seq, global).global_batch(), global);
    else
      expect_error<std::invalid_argument>([&] { plan_batch_for_global(other_world, micro, seq, global); },
                                          "cannot be split over " + std::to_string(other_world) + " ranks");
  }
  expect_error<std::invalid_argument>([] { plan_batch_for_global(3, 8, 64, 64); },
                                      "a global batch of 64 sequences cannot be split over 3 ranks x batch_size 8");
  expect_error<std::invalid_argument>([] { plan_batch(0, 8, 64, 1); }, "world_size must be >= 1, got 0");
  expect_error<std::invalid_argument>([] { plan_batch(2, -1, 64, 1); }, "batch_size must be >= 1");
  expect_error<std::invalid_argument>([] { plan_batch(2, 8, 0, 1); }, "seq_len must be >= 1");
  expect_error<std::invalid_argument>([] { plan_batch(2, 8, 64, 0); }, "grad_accum must be >= 1");
  expect_error<std::invalid_argument>([] { plan_batch_for_global(2, 8, 64, 0); }, "global batch must be >= 1");
}

TEST(Throughput, WholeJobTokensAndMfu) {
  const ModelConfig config = gpt2_124m();
  const double per_token = flops_per_token(config, 1024);
  const double peak = 989e12;
  Rng rng(9);
  for (int trial = 0; trial < 100; ++trial) {
    const int world = 1 + static_cast<int>(rng.next_u64() % 8);
    const BatchPlan plan = plan_batch(world, 32, 1024, 1 + static_cast<int>(rng.next_u64() % 4));
    const double seconds = 0.02 + rng.uniform();
    const JobThroughput job = job_throughput(plan, seconds, per_token, peak);
    const double tokens = double(world) * 32 * 1024 * plan.grad_accum;
    EXPECT_NEAR(job.tokens_per_second, tokens / seconds, 1e-9 * tokens / seconds);
    EXPECT_NEAR(job.tokens_per_second_per_gpu * world, job.tokens_per_second, 1e-6 * job.tokens_per_second);
    EXPECT_NEAR(job.mfu, per_token * tokens / seconds / (world * peak), 1e-12);
    // perfect scaling: N ranks with the same step time as one have the single-GPU MFU
    const JobThroughput one = job_throughput(plan_batch(1, 32, 1024, plan.grad_accum), seconds, per_token, peak);
    EXPECT_NEAR(job.mfu, one.mfu, 1e-12);
    EXPECT_NEAR(job.tokens_per_second, world * one.tokens_per_second, 1e-6 * job.tokens_per_second);
  }
  const BatchPlan plan = plan_batch(2, 8, 64, 1);
  EXPECT_THROW(job_throughput(plan, 0.0, per_token, peak), std::invalid_argument);
  EXPECT_THROW(job_throughput(plan, 1.0, per_token, 0.0), std::invalid_argument);
}

}  // namespace
}  // namespace coda
