// The training loop end to end on the CPU reference: the learning-rate schedule, learning on the
// synthetic corpus, determinism from the seed, exact resume, and eval / sample / bench on its checkpoints.
#include <gtest/gtest.h>

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "background_job.hpp"
#include "checkpoint.hpp"
#include "data.hpp"
#include "prepare.hpp"
#include "stop_signal.hpp"
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

// A sampled byte as the terminal should see it: printable ASCII, newline and tab raw, the rest \xNN.
std::string shown_byte(int32_t token) {
  if (token == '\n' || token == '\t' || (token >= 32 && token <= 126)) return std::string(1, static_cast<char>(token));
  const char* digits = "0123456789abcdef";
  return std::string("\\x") + digits[(token >> 4) & 15] + digits[token & 15];
}

// Runs the built coda binary with arguments, stdout and stderr into log; returns its process id.
pid_t start_coda(const std::vector<std::string>& arguments, const std::string& log) {
  std::vector<std::string> words = {CODA_BINARY};
  words.insert(words.end(), arguments.begin(), arguments.end());
  std::vector<char*> argv;
  for (std::string& word : words) argv.push_back(word.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {  // only async-signal-safe calls between fork and exec
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// The exit code of a finished process; -N when signal N killed it (so 130 means it exited by itself).
int exit_code(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

std::string read_text(const fs::path& path) {
  std::ifstream file(path);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

std::vector<std::string> checkpoint_names(const fs::path& out) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(out))
    if (entry.path().filename().string().rfind("step_", 0) == 0) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

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
    c.model.set_arch(arch);
    c.model.n_layer = 2;
    c.model.d_model = 64;
    c.model.n_head = 4;
    c.model.n_kv_head = arch == coda::Arch::GPT2 ? 4 : 2;
    c.model.d_ff = arch == coda::Arch::GPT2 ? 256 : 192;
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

  static float learn(coda::Arch arch, int steps, const std::string& precision = "bf16");
  static void expect_fp8_tracks(coda::Arch arch, int steps, float full_val_loss);

  static inline std::optional<coda::test::TempDir> root_;
};

}  // namespace

// Trains a one-layer model for `steps` steps; returns its validation loss after checking that it
// started from the uniform distribution's loss.
float Training::learn(coda::Arch arch, int steps, const std::string& precision) {
  coda::RunConfig c = tiny(arch, std::string("learn_") + coda::arch_name(arch) + (precision == "bf16" ? "" : "_" + precision));
  c.precision = precision;
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

// precision = fp8 (the CPU backend emulates it: RefModel::enable_fp8) follows the full-precision run of the
// same seed: its validation loss within 1%; the first step is the calibration (the same loss), the second
// already differs.
void Training::expect_fp8_tracks(coda::Arch arch, int steps, float full_val_loss) {
  const float fp8 = learn(arch, steps, "fp8");
  const std::string name = coda::arch_name(arch);
  EXPECT_NEAR(fp8, full_val_loss, 0.01 * full_val_loss) << name;
  const std::vector<float> full = losses(*root_ / ("learn_" + name)), quantized = losses(*root_ / ("learn_" + name + "_fp8"));
  EXPECT_EQ(quantized[0], full[0]) << name;
  EXPECT_NE(quantized[1], full[1]) << name;
}

// The corpus's stages (prepare.hpp): uniform ln 256 = 5.55, the bigram table's best ln 8 = 2.08, the
// entropy rate ln 4 = 1.39 (the previous token's bit, found through attention). No model beats the last.
// Each architecture learns the same in fp8.
TEST_F(Training, Gpt2LossFallsToTheBigramBound) {
  const float val_loss = learn(coda::Arch::GPT2, 150);
  EXPECT_LT(val_loss, std::log(8.0) + 0.15);
  EXPECT_GT(val_loss, coda::synthetic_entropy_rate() - 0.02);
  expect_fp8_tracks(coda::Arch::GPT2, 150, val_loss);
}

TEST_F(Training, LlamaLossFallsPastTheBigramBoundTowardTheEntropyRate) {
  const float val_loss = learn(coda::Arch::Llama, 200);  // RoPE finds the previous token sooner
  EXPECT_LT(val_loss, std::log(8.0) - 0.2);
  EXPECT_GT(val_loss, coda::synthetic_entropy_rate() - 0.02);
  expect_fp8_tracks(coda::Arch::Llama, 200, val_loss);
}

// Qwen2 (Llama's features plus the QKV bias) learns as Llama does, and its checkpoint read as a bare HF
// Qwen2ForCausalLM directory (config.json + model.safetensors, what `coda eval` gets from transformers)
// gives the same loss.
TEST_F(Training, Qwen2LearnsAndItsHfDirectoryEvaluatesTheSame) {
  const float val_loss = learn(coda::Arch::Qwen2, 200);
  EXPECT_LT(val_loss, std::log(8.0) - 0.2);
  EXPECT_GT(val_loss, coda::synthetic_entropy_rate() - 0.02);
  expect_fp8_tracks(coda::Arch::Qwen2, 200, val_loss);
  const fs::path checkpoint = fs::path(*root_ / "learn_qwen2") / "step_200", hf = *root_ / "hf_qwen2";
  fs::create_directories(hf);
  for (const char* file : {"config.json", "model.safetensors"}) fs::copy_file(checkpoint / file, hf / file);
  EXPECT_EQ(nlohmann::json::parse(read_text(hf / "config.json")).at("architectures")[0], "Qwen2ForCausalLM");
  const std::string val = *root_ / "data/val_*.bin";
  EXPECT_EQ(coda::evaluate({hf.string(), val, 16, 32, 16, "cpu"}), val_loss);
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

// Both architectures in bf16, and Llama in fp8, whose checkpoint carries the amax histories that the next
// steps' scales come from; that checkpoint resumed with another fp8_history, or with the LM head added to
// the FP8 linears, is refused with the reason; with block scaling it continues without them.
TEST_F(Training, ResumeReproducesTheUninterruptedRunExactly) {
  for (const auto& [arch, precision] : {std::pair{coda::Arch::GPT2, "bf16"}, std::pair{coda::Arch::Llama, "bf16"},
                                        std::pair{coda::Arch::Llama, "fp8"}}) {
    const std::string name = std::string(coda::arch_name(arch)) + "_" + precision;
    coda::RunConfig c = tiny(arch, "whole_" + name);
    c.precision = precision;
    c.fp8_history = 4;
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
    EXPECT_EQ(a.state.fp8.amax, b.state.fp8.amax) << name;
    EXPECT_EQ(a.state.fp8.empty(), c.precision == "bf16") << name;
    if (c.precision == "fp8") {
      resumed_config.steps = 14;
      resumed_config.fp8_linears = c.fp8_linears + ",lm_head";  // a state with the head's tensors too
      try {
        coda::train(resumed_config);
        ADD_FAILURE() << "a resume that adds the LM head to the FP8 linears was accepted";
      } catch (const std::runtime_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("lm_head"), std::string::npos) << what;
        EXPECT_EQ(what.find("resume with fp8_history"), std::string::npos) << "the history is not the reason: " << what;
      }
      resumed_config.fp8_linears = c.fp8_linears;
      resumed_config.fp8_history = 8;
      try {
        coda::train(resumed_config);
        ADD_FAILURE() << "a resume with another fp8_history was accepted";
      } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("fp8_history = 4"), std::string::npos) << e.what();
      }
      resumed_config.fp8_scaling = "block";  // keeps no state: the checkpoint's histories are left unused
      const coda::TrainResult switched = coda::train(resumed_config);
      EXPECT_EQ(switched.step, 14) << name;
      EXPECT_TRUE(coda::load_checkpoint(switched.checkpoint).state.fp8.empty()) << name;
    }
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
    std::string text(256, '\0');
    text.resize(std::fread(text.data(), 1, text.size(), out));
    std::fclose(out);
    std::string expected = "ab";
    for (int32_t token : tokens) expected += shown_byte(token);
    EXPECT_EQ(text, expected + "\n");
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
  ASSERT_EQ(results.size(), coda::available_backends(c.device).size());
  EXPECT_EQ(results.front().backend, "cpu") << "--device cpu times the CPU alone, GPU or not";
  for (const auto& r : results) {
    EXPECT_GT(r.median_ms, 0.0);
    EXPECT_NEAR(r.tokens_per_s * r.median_ms / 1000.0, 2.0 * 8 * 16, 1e-6 * r.tokens_per_s);
    EXPECT_EQ(r.world_size, 1);
    EXPECT_DOUBLE_EQ(r.tokens_per_s_per_gpu, r.tokens_per_s);
    if (r.backend == "cpu") {
      EXPECT_EQ(r.energy_steps, 0) << "no energy meter on the CPU, no energy steps";
    }
  }
  EXPECT_FALSE(fs::exists(c.out)) << "bench writes no run directory";
  c.precision = "fp8";
  const std::vector<coda::BenchResult> with_fp8 = coda::bench(c, 1, 0);
  ASSERT_EQ(with_fp8.size(), results.size() + 1) << "fp8 adds its mode after the bf16 ones";
  EXPECT_EQ(with_fp8.back().backend, "cpu-fp8");
  c.fp8_scaling = "block";
  EXPECT_EQ(coda::bench(c, 1, 0).back().backend, "cpu-fp8-block") << "the recipe is in the name";
  c.fp8_scaling = "mlp_down";
  EXPECT_EQ(coda::bench(c, 1, 0).back().backend, "cpu-fp8-block-mlp_down");
  c.fp8_scaling = "tensor";
  c.precision = "bf16";
  EXPECT_THROW(coda::bench(c, 1, 0, nullptr, -1.0), std::invalid_argument) << "a negative energy window";
  EXPECT_THROW(coda::bench(c, 1, 0, nullptr, std::nan("")), std::invalid_argument) << "a NaN energy window";
  c.zero1 = true;
  EXPECT_THROW(coda::bench(c, 1, 0), std::invalid_argument) << "ZeRO-1 without a communicator";
}

// ---- a run the user can trust and drive

// The checkpoint writer's contract: jobs run on another thread, one after another, and a job's error
// comes back, once, from the next wait() or start().
TEST(BackgroundJob, RunsJobsInOrderOnAnotherThreadAndRethrowsTheirErrors) {
  coda::BackgroundJob job;
  std::thread::id worker;
  std::atomic<bool> first_done{false};
  bool second_saw_first_done = false;
  job.start([&] {
    worker = std::this_thread::get_id();
    for (int i = 0; i < 1000; ++i) std::this_thread::yield();
    first_done = true;
  });
  job.start([&] { second_saw_first_done = first_done; });
  job.wait();
  EXPECT_NE(worker, std::this_thread::get_id());
  EXPECT_TRUE(second_saw_first_done) << "start() waits for the job before it";

  job.start([] { throw std::runtime_error("step_4: write failed: No space left on device"); });
  try {
    job.wait();
    ADD_FAILURE() << "the job's error was lost";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(job.wait()) << "an error is reported once";
  job.start([] { throw std::runtime_error("first"); });
  EXPECT_THROW(job.start([] {}), std::runtime_error) << "start() rethrows the previous job's error";
}

TEST(TokenText, EscapesBytesThatWouldDriveTheTerminal) {
  EXPECT_EQ(coda::token_text('a', true, true), "a");
  EXPECT_EQ(coda::token_text('\n', true, false), "\n");
  EXPECT_EQ(coda::token_text(27, true, false), "\\x1b");  // ESC
  EXPECT_EQ(coda::token_text(13, true, false), "\\x0d");
  EXPECT_EQ(coda::token_text(200, true, false), "\\xc8");
  EXPECT_EQ(coda::token_text(42, false, true), "42");
  EXPECT_EQ(coda::token_text(42, false, false), " 42");
}

// A bad id deep in a validation shard used to end the run at its first validation, with a run directory
// and no checkpoint; now the run stops before step 1 and writes nothing.
TEST_F(Training, ABadIdInAValidationShardStopsTheRunBeforeItWritesAnything) {
  coda::Rng rng(9);
  std::vector<uint32_t> tokens(4000);
  for (auto& token : tokens) token = static_cast<uint32_t>(rng.below(256));
  tokens[3500] = 999;
  fs::create_directories(*root_ / "bad_val");
  const std::string shard = *root_ / "bad_val/val_000.bin";
  coda::write_shard(shard, tokens, 65536);
  coda::RunConfig c = tiny(coda::Arch::GPT2, "bad_val_run");
  c.val_data = shard;
  try {
    coda::train(c);
    ADD_FAILURE() << "a validation shard with token id 999 was accepted for vocab_size 256";
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    for (const std::string& part : {shard, std::string("token id 999"), std::string("vocab_size 256")})
      EXPECT_NE(message.find(part), std::string::npos) << message;
  }
  EXPECT_FALSE(fs::exists(c.out));
}

TEST_F(Training, ValDataAutoIsTheValShardsBesideTheTrainShards) {
  EXPECT_EQ(coda::RunConfig().val_data, "auto");
  EXPECT_EQ(coda::resolve_val_data("auto", *root_ / "data/train_*.bin"), *root_ / "data/val_*.bin");
  EXPECT_EQ(coda::resolve_val_data("other/*.bin", *root_ / "data/train_*.bin"), "other/*.bin");
  EXPECT_EQ(coda::resolve_val_data("", *root_ / "data/train_*.bin"), "");
  fs::create_directories(*root_ / "train_only");
  fs::copy_file(coda::match_shards(*root_ / "data/train_*.bin").front(), *root_ / "train_only/train_000.bin");
  try {
    coda::resolve_val_data("auto", *root_ / "train_only/train_*.bin");
    ADD_FAILURE() << "no val shards beside the train shards, and no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("set val_data"), std::string::npos) << e.what();
  }
}

// A run that failed before its first checkpoint leaves config.toml and some metrics: nothing to resume,
// so a retry into the same directory starts afresh, and --resume says why it cannot continue.
TEST_F(Training, ARunThatFailedBeforeItsFirstCheckpointCanBeRetried) {
  coda::RunConfig c = tiny(coda::Arch::GPT2, "retry");
  c.steps = 4;
  c.val_every = 0;
  fs::create_directories(c.out);
  std::ofstream(fs::path(c.out) / "config.toml") << coda::config_to_toml(c);
  std::ofstream(fs::path(c.out) / "metrics.jsonl") << "{\"step\":1,\"loss\":5.5}\n{\"step\":2,\"loss\":5.4}\n";
  coda::RunConfig resume = c;
  resume.resume = c.out;
  try {
    coda::train(resume);
    ADD_FAILURE() << "resumed a run directory without a checkpoint";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("start the run again without --resume"), std::string::npos) << e.what();
  }
  EXPECT_EQ(coda::train(c).step, 4);
  EXPECT_EQ(metrics(c.out).size(), 4u);
}

// The saved config describes the run, not how its process started: read back into another directory it
// trains that run from the start, and a resume with nothing to do leaves the saved config alone.
TEST_F(Training, SavedConfigStartsItsOwnRunAndANoOpResumeWritesNothing) {
  coda::RunConfig c = tiny(coda::Arch::GPT2, "read_back");
  c.steps = 4;
  c.val_every = 0;
  coda::train(c);
  coda::RunConfig longer = c;
  longer.resume = c.out;
  longer.steps = 6;
  coda::train(longer);
  const std::string saved = read_text(fs::path(c.out) / "config.toml");
  coda::RunConfig read_back = coda::parse_config_text(saved, "config.toml");
  EXPECT_EQ(read_back.resume, "");
  EXPECT_EQ(read_back.steps, 6);
  read_back.out = *root_ / "read_back_copy";
  EXPECT_EQ(coda::train(read_back).step, 6);
  EXPECT_EQ(losses(read_back.out).size(), 6u) << "a fresh run of six steps, not a resume of the other run";

  coda::RunConfig no_op = c;
  no_op.resume = c.out;
  no_op.steps = 3;
  EXPECT_EQ(coda::train(no_op).step, 6);
  EXPECT_EQ(read_text(fs::path(c.out) / "config.toml"), saved);
  EXPECT_EQ(losses(c.out).size(), 6u);
}

TEST_F(Training, KeepsTheNewestCheckpointsAndClearsUnfinishedWrites) {
  coda::RunConfig c = tiny(coda::Arch::GPT2, "keep");
  c.steps = 10;
  c.checkpoint_every = 2;
  c.keep_checkpoints = 2;
  c.val_every = 0;
  fs::create_directories(fs::path(c.out) / "step_3.tmp");  // a write a crash interrupted
  std::ofstream(fs::path(c.out) / "step_3.tmp/model.safetensors") << "partial";
  coda::train(c);
  EXPECT_EQ(checkpoint_names(c.out), (std::vector<std::string>{"step_10", "step_8"}));
  // Resumed from step_8 (step_10 then belongs to an attempt that ran further): pruning looks only at the
  // checkpoints up to the one just written, so step_9 is kept and step_10 waits to be replaced.
  coda::RunConfig resumed = c;
  resumed.resume = fs::path(c.out) / "step_8";
  resumed.steps = 9;
  resumed.keep_checkpoints = 1;
  coda::train(resumed);
  EXPECT_EQ(checkpoint_names(c.out), (std::vector<std::string>{"step_10", "step_9"}));
  coda::RunConfig all = c;
  all.out = *root_ / "keep_all";
  all.keep_checkpoints = 0;
  coda::train(all);
  EXPECT_EQ(checkpoint_names(all.out).size(), 5u);
}

// Fine-tuning: a bare HF model directory (config.json + model.safetensors, as transformers writes them)
// gives the weights and the shape; the run starts at step 0 with fresh optimizer state and schedule.
TEST_F(Training, InitFromStartsAFreshRunFromAnHfModel) {
  coda::RunConfig base = tiny(coda::Arch::Llama, "init_base");
  base.steps = 40;
  base.lr = 1e-2f;
  base.val_every = 0;
  const coda::TrainResult trained = coda::train(base);
  const fs::path hf = *root_ / "hf_llama";
  fs::create_directories(hf);
  for (const char* file : {"config.json", "model.safetensors"})
    fs::copy_file(fs::path(trained.checkpoint) / file, hf / file);

  coda::RunConfig c = tiny(coda::Arch::GPT2, "init_run");  // its model keys give way to the HF config
  c.model.n_layer = 5;
  c.init_from = hf.string();
  c.steps = 2;
  c.lr = 1e-7f;
  c.warmup_steps = 0;
  c.weight_decay = 0.0f;
  c.val_every = 0;
  const coda::TrainResult result = coda::train(c);
  EXPECT_EQ(result.step, 2);
  const std::vector<nlohmann::json> records = metrics(c.out);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].at("step").get<int>(), 1) << "the run starts at step 0";
  EXPECT_FLOAT_EQ(records[0].at("lr").get<float>(), coda::lr_at(c, 0)) << "a fresh schedule";
  EXPECT_LT(records[0].at("loss").get<double>(), std::log(256.0) - 0.5) << "the trained weights were loaded";

  const coda::Checkpoint source = coda::load_checkpoint(trained.checkpoint);
  const coda::Checkpoint after = coda::load_checkpoint(result.checkpoint);
  EXPECT_EQ(after.model.arch, coda::Arch::Llama);
  EXPECT_EQ(after.model.n_layer, base.model.n_layer);
  EXPECT_EQ(after.state.step, 2);
  ASSERT_EQ(after.params.size(), source.params.size());
  float largest_change = 0.0f;
  for (size_t i = 0; i < after.params.size(); ++i)
    largest_change = std::max(largest_change, std::fabs(after.params[i] - source.params[i]));
  EXPECT_LT(largest_change, 1e-5f) << "two steps of lr 1e-7 barely move the loaded weights";
  const coda::RunConfig saved = coda::parse_config_text(read_text(fs::path(c.out) / "config.toml"), "config.toml");
  EXPECT_EQ(saved.model.arch, coda::Arch::Llama);
  EXPECT_EQ(saved.model.n_layer, base.model.n_layer);

  coda::RunConfig too_long = c;
  too_long.out = *root_ / "init_too_long";
  too_long.seq_len = 32;  // the HF model's max_seq_len is 16
  EXPECT_THROW(coda::train(too_long), std::invalid_argument);
  EXPECT_FALSE(fs::exists(too_long.out));
}

// A real `coda train` process: the first SIGINT ends it after the step in progress with a checkpoint of
// that step and exit code 130; resuming from the run directory then finishes the run.
TEST_F(Training, SigintStopsWithACheckpointAndTheRunResumes) {
  coda::RunConfig c = tiny(coda::Arch::GPT2, "sigint");
  c.steps = 400;  // far more than it runs before the signal, and finite should the signal be ignored
  c.val_every = 0;
  c.log_every = 1;
  const std::string config = *root_ / "sigint.toml", log = *root_ / "sigint.log";
  std::ofstream(config) << coda::config_to_toml(c);
  const pid_t pid = start_coda({"train", "--config", config}, log);
  // Wait (while it runs) for three complete metrics lines: the loop, and so the handler, is running.
  const fs::path metrics_path = fs::path(c.out) / "metrics.jsonl";
  while (count_of(read_text(metrics_path), "\n") < 3 && ::waitpid(pid, nullptr, WNOHANG) == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_EQ(::kill(pid, SIGINT), 0) << "the run ended by itself: " << read_text(log);
  EXPECT_EQ(exit_code(pid), 130) << read_text(log);
  const int steps_done = static_cast<int>(metrics(c.out).size());
  ASSERT_GE(steps_done, 3) << read_text(log);
  EXPECT_NE(read_text(log).find("stopped by SIGINT after step " + std::to_string(steps_done)), std::string::npos)
      << read_text(log);
  const coda::Checkpoint saved = coda::load_checkpoint(coda::find_checkpoint(c.out));
  EXPECT_EQ(saved.state.step, steps_done);

  const std::string finish = std::to_string(steps_done + 2);
  const pid_t resumed = start_coda({"train", "--config", c.out + "/config.toml", "--resume", c.out, "--steps", finish},
                                   *root_ / "sigint_resume.log");
  EXPECT_EQ(exit_code(resumed), 0) << read_text(*root_ / "sigint_resume.log");
  EXPECT_EQ(coda::load_checkpoint(coda::find_checkpoint(c.out)).state.step, steps_done + 2);
  EXPECT_EQ(static_cast<int>(metrics(c.out).size()), steps_done + 2);
}

// Under Open MPI's mpirun the ranks get odls_base_sigkill_timeout seconds (1 unless set) between the
// SIGTERM that carries a Ctrl-C and SIGKILL: under kStopGraceSeconds, training starts with a warning that
// names the setting and the other way to stop.
TEST(StopSignal, MpirunWarnsWhenItsKillTimeoutLeavesNoTimeToSave) {
  for (const char* timeout : {static_cast<const char*>(nullptr), "1", "59", "ten", "", "30s"}) {
    const std::string warning = coda::mpirun_stop_warning(timeout);
    EXPECT_NE(warning.find("--mca odls_base_sigkill_timeout"), std::string::npos) << (timeout ? timeout : "unset");
  }
  EXPECT_NE(coda::mpirun_stop_warning(nullptr).find("ranks 1 s between"), std::string::npos);
  EXPECT_NE(coda::mpirun_stop_warning("ten").find("unreadable"), std::string::npos);
  EXPECT_EQ(coda::mpirun_stop_warning("60"), "");
  EXPECT_EQ(coda::mpirun_stop_warning("300"), "");
}

// What the console shows around the loop: sample_every's samples and the closing summary.
TEST_F(Training, ConsoleShowsSamplesAndAFinalSummary) {
  coda::RunConfig c = tiny(coda::Arch::GPT2, "console");
  c.steps = 4;
  c.sample_every = 2;
  c.val_every = 2;
  const std::string config = *root_ / "console.toml", log = *root_ / "console.log";
  std::ofstream(config) << coda::config_to_toml(c);
  EXPECT_EQ(exit_code(start_coda({"train", "--config", config}, log)), 0) << read_text(log);
  const std::string text = read_text(log);
  EXPECT_EQ(count_of(text, "| sample: "), 2u) << text;
  EXPECT_NE(text.find("done: 4 steps (0 to 4)"), std::string::npos) << text;
  EXPECT_NE(text.find(", 512 tokens; final loss "), std::string::npos) << text;
  EXPECT_EQ(text.find("val_loss -"), std::string::npos) << "the run validated: " << text;
}
