// ZeRO-1 on the CPU: the planning the sharded optimizer relies on, and the option that turns it on.
//  * the bf16 all-gather: every rank sends shard_size elements from slot(r) of the padded buffer; put
//    together, the shards rebuild the whole buffer, and the padding past `total` stays zero;
//  * the gradient norm: each rank's sum of squares over its own shard, summed over ranks, is the sum of
//    squares of the whole buffer;
//  * the checkpoint chunks (shard_chunks): contiguous, in order, inside one shard each, never longer than
//    the staging buffer, aligned so that the bf16 conversion's 8-element packets never straddle two;
//  * the zero1 key: a bare --zero1 flag, --zero1 false, a config file's [run] zero1 = true, and the
//    written config reading back; ZeRO-1 on the cpu backend is refused naming the device.
// The sharded optimizer itself runs in tests/gpu_distributed.cu (Zero1.*).
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "config.hpp"
#include "dist_plan.hpp"
#include "model.hpp"
#include "rng.hpp"
#include "tests/test_util.hpp"
#include "train.hpp"

namespace coda {
namespace {

// Layouts of random tensor counts and sizes (some smaller than world * kParamAlign, so trailing shards
// are empty), plus two real model layouts.
std::vector<ParamLayout> test_layouts() {
  std::vector<ParamLayout> layouts;
  ModelConfig gpt2;
  gpt2.n_layer = 2;
  gpt2.d_model = 96;
  gpt2.n_head = 3;
  gpt2.n_kv_head = 3;
  gpt2.d_ff = 384;
  gpt2.vocab_size = 1000;
  layouts.push_back(make_param_layout(gpt2));
  ModelConfig llama = gpt2;
  llama.set_arch(Arch::Llama);
  llama.n_kv_head = 1;
  llama.d_ff = 200;
  llama.tied_head = false;
  layouts.push_back(make_param_layout(llama));
  Rng rng(77);
  for (int trial = 0; trial < 60; ++trial) {
    ParamLayout layout;
    const int n_tensors = 1 + static_cast<int>(rng.below(30));
    const size_t max_numel = trial % 4 == 0 ? 90 : 30'000;
    for (int t = 0; t < n_tensors; ++t) {
      ParamTensor tensor;
      tensor.name = "t" + std::to_string(t);
      tensor.numel = 1 + rng.below(max_numel);
      tensor.shape = {static_cast<int64_t>(tensor.numel)};
      tensor.offset = layout.total;
      layout.total += (tensor.numel + kParamAlign - 1) / kParamAlign * kParamAlign;
      layout.tensors.push_back(tensor);
    }
    layouts.push_back(layout);
  }
  return layouts;
}

// A flat buffer with random values in the tensors and zeros in the layout padding.
std::vector<float> random_buffer(const ParamLayout& layout, Rng& rng) {
  std::vector<float> buffer(layout.total, 0.0f);
  for (const ParamTensor& tensor : layout.tensors)
    for (size_t i = tensor.offset; i < tensor.offset + tensor.numel; ++i) buffer[i] = static_cast<float>(rng.normal());
  return buffer;
}

TEST(Zero1Plan, AllGatherSlotsRebuildTheBuffer) {
  Rng rng(1);
  for (const ParamLayout& layout : test_layouts()) {
    const std::vector<float> full = random_buffer(layout, rng);
    for (int world = 1; world <= 8; ++world) {
      const ZeroPartition partition = make_zero_partition(layout, world);
      SCOPED_TRACE("world " + std::to_string(world) + ", total " + std::to_string(layout.total));
      // What each rank holds after its update: its shard at the start of a shard_size buffer, zero after.
      std::vector<float> gathered(partition.padded_total, -1.0f);
      for (int r = 0; r < world; ++r) {
        const ZeroShard& shard = partition.shards[r];
        if (shard.begin < shard.end) {
          EXPECT_EQ(partition.slot(r), shard.begin) << "rank " << r;
        }
        ASSERT_LE(partition.slot(r) + partition.shard_size, partition.padded_total);
        std::vector<float> mine(partition.shard_size, 0.0f);
        std::copy(full.begin() + shard.begin, full.begin() + shard.end, mine.begin());
        std::copy(mine.begin(), mine.end(), gathered.begin() + partition.slot(r));
      }
      for (size_t i = 0; i < partition.padded_total; ++i)
        ASSERT_EQ(gathered[i], i < layout.total ? full[i] : 0.0f) << "element " << i;
    }
  }
}

TEST(Zero1Plan, ShardSumsOfSquaresComposeTheNorm) {
  Rng rng(2);
  for (const ParamLayout& layout : test_layouts()) {
    const std::vector<float> grads = random_buffer(layout, rng);
    double whole = 0.0;
    for (float g : grads) whole += static_cast<double>(g) * g;
    for (int world = 1; world <= 8; ++world) {
      const ZeroPartition partition = make_zero_partition(layout, world);
      double composed = 0.0;  // the all-reduce (sum) of every rank's sum over its own shard
      for (const ZeroShard& shard : partition.shards) {
        double own = 0.0;
        for (size_t i = shard.begin; i < shard.end; ++i) own += static_cast<double>(grads[i]) * grads[i];
        composed += own;
      }
      EXPECT_NEAR(std::sqrt(composed), std::sqrt(whole), 1e-12 * std::sqrt(whole))
          << "world " << world << ", total " << layout.total;
    }
  }
}

TEST(Zero1Plan, ShardChunksTileTheShards) {
  Rng rng(3);
  for (const ParamLayout& layout : test_layouts()) {
    for (int world = 1; world <= 8; ++world) {
      const ZeroPartition partition = make_zero_partition(layout, world);
      const size_t max_counts[] = {kParamAlign, 3 * kParamAlign, kParamAlign * (1 + rng.below(400)), size_t{1} << 20};
      for (size_t max_count : max_counts) {
        SCOPED_TRACE("world " + std::to_string(world) + ", max_count " + std::to_string(max_count));
        size_t cursor = 0;
        std::vector<size_t> per_rank(world, 0);
        for (const OwnedRange& chunk : shard_chunks(partition, max_count)) {
          ASSERT_EQ(chunk.begin, cursor);
          ASSERT_LT(chunk.begin, chunk.end);
          ASSERT_LE(chunk.end - chunk.begin, max_count);
          ASSERT_EQ(chunk.begin % kParamAlign, 0u);
          ASSERT_EQ((chunk.end - chunk.begin) % 8, 0u);
          const ZeroShard& shard = partition.shards.at(chunk.rank);
          ASSERT_GE(chunk.begin, shard.begin);
          ASSERT_LE(chunk.end, shard.end);
          per_rank[chunk.rank] += chunk.end - chunk.begin;
          cursor = chunk.end;
        }
        EXPECT_EQ(cursor, layout.total);
        for (int r = 0; r < world; ++r) {
          const size_t owned = partition.shards[r].end - partition.shards[r].begin;
          EXPECT_EQ(per_rank[r], owned) << "rank " << r;
        }
      }
    }
  }
  const ZeroPartition partition = make_zero_partition(test_layouts().front(), 2);
  EXPECT_THROW(shard_chunks(partition, 0), std::invalid_argument);
  EXPECT_THROW(shard_chunks(partition, 100), std::invalid_argument);
}

// ---- the zero1 key

RunConfig resolve(const std::string& config_file, const std::vector<std::string>& args) {
  const AppFactory make_app = [](RunConfig& config) {
    auto app = std::make_shared<CLI::App>("test", "train");
    add_config_options(*app, config);
    return app;
  };
  return resolve_config(make_app, config_file, args);
}

TEST(Zero1Config, FlagConfigFileAndRoundTrip) {
  EXPECT_FALSE(resolve("", {}).zero1);
  EXPECT_TRUE(resolve("", {"--zero1"}).zero1);
  EXPECT_TRUE(resolve("", {"--zero1", "--steps", "7"}).zero1);
  EXPECT_EQ(resolve("", {"--zero1", "--steps", "7"}).steps, 7);
  EXPECT_FALSE(resolve("", {"--zero1", "false"}).zero1);
  EXPECT_TRUE(resolve("", {"--zero1", "true"}).zero1);

  test::TempDir dir("coda_zero1");
  const std::string file = dir / "run.toml";
  std::ofstream(file) << "[run]\nzero1 = true\n[optim]\nsteps = 5\n";
  const RunConfig from_file = resolve(file, {});
  EXPECT_TRUE(from_file.zero1);
  EXPECT_EQ(from_file.steps, 5);
  EXPECT_FALSE(resolve(file, {"--zero1", "false"}).zero1);  // the command line wins

  const std::string written = config_to_toml(from_file);
  EXPECT_NE(written.find("zero1 = true"), std::string::npos) << written;
  EXPECT_TRUE(parse_config_text(written, "written").zero1);
  EXPECT_FALSE(parse_config_text(config_to_toml(RunConfig{}), "defaults").zero1);

  std::ofstream(file) << "zero1 = maybe\n";
  EXPECT_THROW(resolve(file, {}), std::runtime_error);
}

TEST(Zero1Config, CpuBackendRefused) {
  RunConfig config;
  config.zero1 = true;
  config.device = "cpu";
  try {
    require_data_parallel_device(config, 1);
    ADD_FAILURE() << "zero1 on the cpu was accepted";
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("zero1"), std::string::npos) << message;
    EXPECT_NE(message.find("device = cpu"), std::string::npos) << message;
  }
  config.zero1 = false;
  EXPECT_NO_THROW(require_data_parallel_device(config, 1));
}

}  // namespace
}  // namespace coda
