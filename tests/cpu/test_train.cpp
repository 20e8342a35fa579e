// The training loop end to end on the CPU reference: the learning-rate schedule, learning on the
// synthetic corpus, determinism from the seed, exact resume, and eval / sample / bench on its checkpoints.
#include <gtest/gtest.h>

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint.hpp"
#include "prepare.hpp"
#include "tests/test_util.hpp"
#include "train.hpp"

namespace fs = std::filesystem;

namespace {

coda::RunConfig schedule(int steps, int warmup, float lr, float min_lr_ratio) {
  coda::RunConfig c;
  c.steps = steps;
  c.warmup_steps = warmup;
  c.lr = lr;
  c.min_lr_ratio = min_lr_ratio;
  return c;
}

}  // namespace

TEST(LrSchedule, WarmupRisesLinearlyToThePeak) {
  const coda::RunConfig c = schedule(1000, 40, 6e-4f, 0.1f);
  for (int step = 0; step < c.warmup_steps; ++step) {
    EXPECT_FLOAT_EQ(coda::lr_at(c, step), c.lr * static_cast<float>(step + 1) / c.warmup_steps);
    if (step > 0) {
      EXPECT_GT(coda::lr_at(c, step), coda::lr_at(c, step - 1));
    }
  }
  EXPECT_FLOAT_EQ(coda::lr_at(c, c.warmup_steps - 1), c.lr);
}

TEST(LrSchedule, CosineFallsFromThePeakToTheFloorSymmetrically) {
  for (const auto& c : {schedule(1001, 100, 3e-3f, 0.1f), schedule(301, 0, 1e-3f, 0.0f), schedule(51, 10, 1.0f, 0.5f)}) {
    const int first = c.warmup_steps, last = c.steps - 1;
    const float floor = c.lr * c.min_lr_ratio;
    EXPECT_FLOAT_EQ(coda::lr_at(c, first), c.lr);
    EXPECT_NEAR(coda::lr_at(c, last), floor, 1e-6f * c.lr);
    for (int step = first + 1; step <= last; ++step) EXPECT_LT(coda::lr_at(c, step), coda::lr_at(c, step - 1));
    // cos(pi p) = -cos(pi (1 - p)): steps mirrored around the middle sum to peak + floor.
    for (int k = 0; k <= (last - first) / 2; ++k)
      EXPECT_NEAR(coda::lr_at(c, first + k) + coda::lr_at(c, last - k), c.lr + floor, 1e-5f * c.lr);
  }
}

// ---- training on the synthetic corpus

namespace {

class Training : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    spdlog::set_level(spdlog::level::warn);
    root_.emplace("coda_train");
    coda::prepare_synthetic(*root_ / "data", 400000, 20000, 4242, 150000);
  }
  static void TearDownTestSuite() { root_.reset(); }

  // A tiny model of either architecture on the prepared corpus.
  static coda::RunConfig tiny(coda::Arch arch, const std::string& out) {
    coda::RunConfig c;
    c.model.arch = arch;
    c.model.n_layer = 2;
    c.model.d_model = 64;
    c.model.n_head = 4;
    c.model.n_kv_head = arch == coda::Arch::Llama ? 2 : 4;
    c.model.d_ff = arch == coda::Arch::Llama ? 192 : 256;
    c.model.vocab_size = coda::kByteVocabSize;
    c.model.max_seq_len = 16;
    c.model.tied_head = arch == coda::Arch::GPT2;
    c.train_data = *root_ / "data/train_*.bin";
    c.val_data = *root_ / "data/val_*.bin";
    c.batch_size = 8;
    c.seq_len = 16;
    c.steps = 12;
    c.lr = 3e-3f;
    c.warmup_steps = 4;
    c.device = "cpu";
    c.out = *root_ / out;
    c.log_every = 1000;
    c.val_every = 6;
    c.val_batches = 2;
    return c;
  }

  static std::vector<nlohmann::json> metrics(const std::string& out) {
    std::vector<nlohmann::json> records;
    std::ifstream file(fs::path(out) / "metrics.jsonl");
    for (std::string line; std::getline(file, line);) records.push_back(nlohmann::json::parse(line));
    return records;
  }

  static std::vector<float> losses(const std::string& out) {
    std::vector<float> values;
    for (const auto& record : metrics(out)) values.push_back(record.at("loss").get<float>());
    return values;
  }

  static float learn(coda::Arch arch, int steps);

  static inline std::optional<coda::test::TempDir> root_;
};

}  // namespace

// Trains a one-layer model for `steps` steps; returns its validation loss after checking that it
// started from the uniform distribution's loss.
float Training::learn(coda::Arch arch, int steps) {
  coda::RunConfig c = tiny(arch, std::string("learn_") + coda::arch_name(arch));
  c.model.n_layer = 1;
  c.steps = steps;
  c.batch_size = 32;
  c.lr = 1e-2f;
  c.warmup_steps = 10;
  c.val_every = 0;
  const coda::TrainResult result = coda::train(c);
  const std::vector<nlohmann::json> records = metrics(c.out);
  EXPECT_EQ(static_cast<int>(records.size()), steps);
  EXPECT_NEAR(records.front().at("loss").get<double>(), std::log(256.0), 0.1) << "an untrained model is uniform";
  return coda::evaluate({result.checkpoint, c.val_data, 16, 32, 16, "cpu"});
}

// The corpus's stages (prepare.hpp): uniform ln 256 = 5.55, the bigram table's best ln 8 = 2.08, the
// entropy rate ln 4 = 1.39 (the previous token's bit, found through attention). No model beats the last.
TEST_F(Training, Gpt2LossFallsToTheBigramBound) {
  const float val_loss = learn(coda::Arch::GPT2, 150);
  EXPECT_LT(val_loss, std::log(8.0) + 0.15);
  EXPECT_GT(val_loss, coda::synthetic_entropy_rate() - 0.02);
}

TEST_F(Training, LlamaLossFallsPastTheBigramBoundTowardTheEntropyRate) {
  const float val_loss = learn(coda::Arch::Llama, 200);  // RoPE finds the previous token sooner
  EXPECT_LT(val_loss, std::log(8.0) - 0.2);
  EXPECT_GT(val_loss, coda::synthetic_entropy_rate() - 0.02);
}

TEST_F(Training, OneSeedGivesIdenticalRunsAndAnotherSeedDoesNot) {
  coda::RunConfig c = tiny(coda::Arch::Llama, "seed_a");
  coda::train(c);
  c.out = *root_ / "seed_b";
  coda::train(c);
  c.out = *root_ / "seed_c";
  c.seed += 1;
  coda::train(c);
  const std::vector<float> a = losses(*root_ / "seed_a"), b = losses(*root_ / "seed_b"),
                           other = losses(*root_ / "seed_c");
  ASSERT_EQ(a.size(), 12u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
}

TEST_F(Training, ResumeReproducesTheUninterruptedRunExactly) {
  for (coda::Arch arch : {coda::Arch::GPT2, coda::Arch::Llama}) {
    const std::string name = coda::arch_name(arch);
    coda::RunConfig c = tiny(arch, "whole_" + name);
    c.grad_accum = 2;
    c.checkpoint_every = 6;
    const coda::TrainResult whole = coda::train(c);
    ASSERT_EQ(whole.step, 12);

    // Interrupted after step 6: the run directory as it was then, continued in place.
    const fs::path interrupted = *root_ / ("interrupted_" + name);
    fs::create_directories(interrupted);
    fs::copy(fs::path(c.out) / "step_6", interrupted / "step_6", fs::copy_options::recursive);
    std::ofstream partial(interrupted / "metrics.jsonl");
    for (const auto& record : metrics(c.out))
      if (record.at("step").get<int>() <= 9) partial << record.dump() << "\n";  // it ran on to step 9
    partial.close();
    coda::RunConfig resumed_config = c;
    resumed_config.out = interrupted.string();
    resumed_config.resume = interrupted.string();  // the run directory: its newest checkpoint
    const coda::TrainResult resumed = coda::train(resumed_config);

    EXPECT_EQ(resumed.step, 12);
    EXPECT_EQ(resumed.loss, whole.loss) << name;
    EXPECT_EQ(resumed.val_loss, whole.val_loss) << name;
    EXPECT_EQ(losses(resumed_config.out), losses(c.out)) << name;
    const coda::Checkpoint a = coda::load_checkpoint(whole.checkpoint), b = coda::load_checkpoint(resumed.checkpoint);
    EXPECT_EQ(a.params, b.params) << name;
    EXPECT_EQ(a.adam_m, b.adam_m) << name;
    EXPECT_EQ(a.adam_v, b.adam_v) << name;
    EXPECT_EQ(a.state.data_position, b.state.data_position) << name;
  }
}

// Resuming on another number of GPUs changes the loader's global batch (ranks x batch_size). Here one
// process resumes a run of batch_size 8 with batch_size 4 and twice the accumulation: every step reads the
// same 8 windows as before, so the stream continues exactly and the losses follow the uninterrupted run up
// to the summation order of the smaller micro-batches.
TEST_F(Training, ResumeWithAnotherGlobalBatchContinuesTheDataStream) {
  coda::RunConfig c = tiny(coda::Arch::GPT2, "whole_batch8");
  c.checkpoint_every = 6;
  coda::train(c);
  const nlohmann::json whole_position = coda::load_checkpoint((fs::path(c.out) / "step_12").string()).state.data_position;

  const fs::path interrupted = *root_ / "resumed_batch4";
  fs::create_directories(interrupted);
  fs::copy(fs::path(c.out) / "step_6", interrupted / "step_6", fs::copy_options::recursive);
  coda::RunConfig resumed = c;
  resumed.batch_size = 4;
  resumed.grad_accum = 2;
  resumed.out = interrupted.string();
  resumed.resume = interrupted.string();
  const coda::TrainResult result = coda::train(resumed);
  ASSERT_EQ(result.step, 12);

  const std::vector<float> whole = losses(c.out), continued = losses(resumed.out);
  ASSERT_EQ(continued.size(), 6u);
  for (size_t i = 0; i < continued.size(); ++i) EXPECT_NEAR(continued[i], whole[6 + i], 2e-4f) << "step " << 7 + i;
  const nlohmann::json position = coda::load_checkpoint(result.checkpoint).state.data_position;
  EXPECT_EQ(position.at("global_batch").get<int>(), 4);
  EXPECT_EQ(position.at("epoch"), whole_position.at("epoch"));
  EXPECT_EQ(position.at("batch").get<int>(), 2 * whole_position.at("batch").get<int>()) << "the same windows were read";
}

// global_batch = 8 over batch_size 4 on one process is grad_accum 2: the same run, and the saved
// config keeps global_batch (not the derived grad_accum), so it resumes on any number of GPUs.
TEST_F(Training, GlobalBatchDerivesGradAccum) {
  coda::RunConfig accum = tiny(coda::Arch::GPT2, "accum_4x2");
  accum.batch_size = 4;
  accum.grad_accum = 2;
  accum.steps = 4;
  accum.val_every = 0;
  coda::train(accum);
  coda::RunConfig global = accum;
  global.grad_accum = 1;
  global.global_batch = 8;
  global.out = *root_ / "global_8";
  coda::train(global);
  EXPECT_EQ(losses(global.out), losses(accum.out));
  std::ifstream file(fs::path(global.out) / "config.toml");
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const coda::RunConfig saved = coda::parse_config_text(text, "config.toml");
  EXPECT_EQ(saved.global_batch, 8);
  EXPECT_EQ(saved.grad_accum, 1);
  EXPECT_EQ(coda::batch_plan(global, 2).grad_accum, 1);
  EXPECT_EQ(coda::batch_plan(global, 1).grad_accum, 2);
  EXPECT_THROW(coda::batch_plan(global, 4), std::invalid_argument) << "4 ranks x 4 sequences exceed 8";
}

TEST_F(Training, RefusesToOverwriteARunOrResumeADifferentModel) {
  coda::RunConfig c = tiny(coda::Arch::GPT2, "guarded");
  c.steps = 2;
  coda::train(c);
  try {
    coda::train(c);
    ADD_FAILURE() << "a second fresh run into the same directory should be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("already holds a run"), std::string::npos) << e.what();
  }
  coda::RunConfig other = c;
  other.model.n_layer = 3;
  other.resume = c.out;
  try {
    coda::train(other);
    ADD_FAILURE() << "resuming with another model shape should be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("n_layer"), std::string::npos) << e.what();
  }
}

TEST_F(Training, EvalMatchesValidationAndSampleIsReproducible) {
  coda::RunConfig c = tiny(coda::Arch::GPT2, "eval_sample");
  const coda::TrainResult result = coda::train(c);
  EXPECT_EQ(coda::evaluate({c.out, "", 0, 0, 0, "cpu"}), result.val_loss);

  const auto generate = [&](uint64_t seed, float temperature) {
    std::FILE* out = std::tmpfile();
    coda::SampleOptions options{result.checkpoint, "ab", 20, temperature, 8, seed, "cpu"};
    const std::vector<int32_t> tokens = coda::sample(options, out);
    std::rewind(out);
    std::string text(64, '\0');
    text.resize(std::fread(text.data(), 1, text.size(), out));
    std::fclose(out);
    EXPECT_EQ(text.size(), 2 + tokens.size() + 1);
    EXPECT_EQ(text.substr(0, 2), "ab");
    for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(static_cast<unsigned char>(text[2 + i]), tokens[i]);
    return tokens;
  };
  const std::vector<int32_t> first = generate(5, 1.0f);
  ASSERT_EQ(first.size(), 20u);
  EXPECT_EQ(generate(5, 1.0f), first);
  EXPECT_NE(generate(6, 1.0f), first);
  EXPECT_EQ(generate(1, 0.0f), generate(2, 0.0f));  // greedy ignores the seed
}

TEST_F(Training, BenchTimesEveryAvailableBackend) {
  coda::RunConfig c = tiny(coda::Arch::Llama, "bench");
  c.grad_accum = 2;
  const std::vector<coda::BenchResult> results = coda::bench(c, 3, 1);
  ASSERT_EQ(results.size(), coda::available_backends().size());
  for (const auto& r : results) {
    EXPECT_GT(r.median_ms, 0.0);
    EXPECT_NEAR(r.tokens_per_s * r.median_ms / 1000.0, 2.0 * 8 * 16, 1e-6 * r.tokens_per_s);
    EXPECT_EQ(r.world_size, 1);
    EXPECT_DOUBLE_EQ(r.tokens_per_s_per_gpu, r.tokens_per_s);
  }
  EXPECT_FALSE(fs::exists(c.out)) << "bench writes no run directory";
  c.zero1 = true;
  EXPECT_THROW(coda::bench(c, 1, 0), std::invalid_argument) << "ZeRO-1 without a communicator";
}
