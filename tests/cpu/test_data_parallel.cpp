// Data parallelism on the CPU: the data position carried across a change of the global batch (resuming on
// another number of ranks) with real loaders, and the refusal of a multi-rank launch that would train on
// the CPU, both through train's check and through the `coda` binary under a faked launcher environment.
//
// The corpus is one shard holding the tokens 0, 1, 2, ...: window w starts with token w * T, so the first
// token of a window names it. A loader of one rank and batch 1 reads an epoch's windows one by one, in the
// epoch's order, which is the reference every other (rank, world size, batch size) must slice.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <sys/wait.h>
#include <vector>

#include "data.hpp"
#include "dist_plan.hpp"
#include "kernels/common/cuda_check.cuh"
#include "rng.hpp"
#include "tests/test_util.hpp"
#include "train.hpp"

namespace fs = std::filesystem;

namespace {

constexpr int kT = 8;
constexpr size_t kWindows = 500;
constexpr uint64_t kSeed = 77;

class DataParallelResume : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_.emplace("coda_dp");
    std::vector<uint32_t> tokens(kWindows * kT + 1);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i);
    coda::write_shard(*root_ / "train_000.bin", tokens, 65536);
  }
  static void TearDownTestSuite() { root_.reset(); }

  static std::unique_ptr<coda::DataLoader> loader(int B, int rank, int world_size) {
    return std::make_unique<coda::DataLoader>(*root_ / "train_*.bin", B, kT, rank, world_size, true, kSeed, 65536);
  }

  // Window ids of the next `batches` global batches read by the ranks of one job, in global order.
  static std::vector<size_t> read_job(std::vector<std::unique_ptr<coda::DataLoader>>& ranks, int B, size_t batches) {
    std::vector<size_t> ids;
    std::vector<int32_t> tokens(static_cast<size_t>(B) * kT), targets(tokens.size());
    for (size_t k = 0; k < batches; ++k)
      for (auto& rank : ranks) {
        rank->next_batch(tokens.data(), targets.data());
        for (int b = 0; b < B; ++b) ids.push_back(static_cast<size_t>(tokens[static_cast<size_t>(b) * kT]) / kT);
      }
    return ids;
  }

  static std::vector<std::unique_ptr<coda::DataLoader>> job(int B, int world_size) {
    std::vector<std::unique_ptr<coda::DataLoader>> ranks;
    for (int r = 0; r < world_size; ++r) ranks.push_back(loader(B, r, world_size));
    return ranks;
  }

  static inline std::optional<coda::test::TempDir> root_;
};

}  // namespace

TEST_F(DataParallelResume, RescaledPositionContinuesTheEpochWithoutRereadingAWindow) {
  // The reference order of epochs 0 and 1.
  auto single = job(1, 1);
  const std::vector<size_t> order = read_job(single, 1, 2 * kWindows);

  coda::Rng rng(2024);
  for (int trial = 0; trial < 40; ++trial) {
    const int saved_world = 1 + static_cast<int>(rng.below(4)), saved_B = 1 + static_cast<int>(rng.below(6));
    const int world = 1 + static_cast<int>(rng.below(4)), B = 1 + static_cast<int>(rng.below(6));
    const size_t saved_G = static_cast<size_t>(saved_world) * saved_B, G = static_cast<size_t>(world) * B;
    const size_t saved_per_epoch = kWindows / saved_G;
    // Stop anywhere in the epoch, the last batches included (where the new size may not fit any more).
    const size_t read = trial % 4 == 0 ? saved_per_epoch - 1 : rng.below(saved_per_epoch);
    SCOPED_TRACE("saved " + std::to_string(saved_world) + " x " + std::to_string(saved_B) + " after " +
                 std::to_string(read) + " batches, resumed " + std::to_string(world) + " x " + std::to_string(B));

    auto saved_job = job(saved_B, saved_world);
    const std::vector<size_t> before = read_job(saved_job, saved_B, read);
    ASSERT_EQ(before, std::vector<size_t>(order.begin(), order.begin() + static_cast<long>(read * saved_G)))
        << "the ranks of one job read consecutive slices of the epoch's order";

    auto resumed_job = job(B, world);
    const nlohmann::json saved = saved_job.front()->position();
    const coda::LoaderPosition to = coda::rescale_loader_position(
        {saved.at("epoch").get<size_t>(), saved.at("batch").get<size_t>()}, saved_G, G,
        resumed_job.front()->batches_per_epoch());
    nlohmann::json position = saved;
    position["global_batch"] = G;
    position["epoch"] = to.epoch;
    position["batch"] = to.batch;
    for (auto& rank : resumed_job) rank->restore(position);
    const std::vector<size_t> after = read_job(resumed_job, B, 1);

    const size_t consumed = read * saved_G;
    if (to.epoch == 0) {
      const size_t first = to.batch * G;
      EXPECT_GE(first, consumed) << "no window is read twice";
      EXPECT_LT(first - consumed, G) << "fewer than one new global batch is skipped";
      if (consumed % G == 0) {
        EXPECT_EQ(first, consumed);
      }
      EXPECT_EQ(after, std::vector<size_t>(order.begin() + static_cast<long>(first),
                                           order.begin() + static_cast<long>(first + G)));
    } else {
      EXPECT_EQ(to.epoch, 1u);
      EXPECT_EQ(to.batch, 0u);
      EXPECT_GT(consumed + G, kWindows / G * G) << "the epoch moves on only when no whole batch is left";
      EXPECT_EQ(after, std::vector<size_t>(order.begin() + static_cast<long>(kWindows),
                                           order.begin() + static_cast<long>(kWindows + G)));
    }
  }
}

TEST(DataParallelPlan, RescaleKeepsAnUnchangedBatchAndRejectsEmptyOnes) {
  for (size_t batch : {size_t{0}, size_t{7}, size_t{41}})
    EXPECT_EQ(coda::rescale_loader_position({3, batch}, 12, 12, 42).batch, batch);
  EXPECT_THROW(coda::rescale_loader_position({0, 1}, 0, 4, 10), std::invalid_argument);
  EXPECT_THROW(coda::rescale_loader_position({0, 1}, 4, 0, 10), std::invalid_argument);
  EXPECT_THROW(coda::rescale_loader_position({0, 1}, 4, 4, 0), std::invalid_argument);
}

// ---- a multi-rank launch needs the cuda device

TEST(DataParallelDevice, TrainRefusesSeveralRanksOnTheCpu) {
  coda::RunConfig config;
  config.device = "cpu";
  EXPECT_NO_THROW(coda::require_data_parallel_device(config, 1));
  try {
    coda::require_data_parallel_device(config, 2);
    ADD_FAILURE() << "two ranks on the CPU should be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--device cuda"), std::string::npos) << e.what();
  }
  config.device = "auto";
  if (coda::cuda_device_available())
    EXPECT_NO_THROW(coda::require_data_parallel_device(config, 4));
  else
    EXPECT_THROW(coda::require_data_parallel_device(config, 4), std::invalid_argument);
}

TEST(DataParallelDevice, CliUnderALauncherRefusesTheCpuBeforeStartingAnything) {
  const coda::test::TempDir tmp("coda_dp_cli");
  const std::string out = tmp / "run";
  // Each launcher's variables for rank 1 of 2 on one node; nothing is started, so faking them is safe.
  const std::vector<std::string> launchers = {
      "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=1 OMPI_COMM_WORLD_LOCAL_SIZE=2",
      "SLURM_PROCID=1 SLURM_STEP_NUM_TASKS=2 SLURM_LOCALID=1 SLURM_STEP_TASKS_PER_NODE=2 SLURM_NODEID=0"};
  for (const std::string& launcher : launchers) {
    const std::string command =
        "env " + launcher + " " + CODA_BINARY + " train --device cpu --steps 2 --out " + out + " 2>&1";
    std::FILE* pipe = popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string output;
    char buffer[4096];
    for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) output.append(buffer, n);
    const int status = pclose(pipe);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << "a configuration error: " << launcher << "\n"
                                                               << output;
    EXPECT_NE(output.find("error: device = cpu"), std::string::npos) << output;
    EXPECT_NE(output.find("2 ranks"), std::string::npos) << output;
    EXPECT_FALSE(fs::exists(out)) << "nothing is written";
  }
}
