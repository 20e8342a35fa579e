// Config files, command-line overrides and the error paths of the `coda` executable.
//
// The error-path tests run the built binary (CODA_BINARY) the way a user does and check three things:
// a non-zero exit, a message on stderr naming the offending key or file, and no run directory left behind.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <vector>

#include "backend.hpp"
#include "config.hpp"
#include "kernels/common/cuda_check.cuh"
#include "model.hpp"
#include "rng.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using coda::test::TempDir;

namespace {

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

CommandResult run_coda(const std::string& arguments) {
  const std::string command = std::string(CODA_BINARY) + " " + arguments + " 2>&1";
  CommandResult result;
  std::FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

// A config with every key away from its default, drawn from the seed.
coda::RunConfig random_config(uint64_t seed) {
  coda::Rng rng(seed);
  coda::RunConfig c;
  c.model.set_arch(coda::Arch::Llama);
  c.model.n_head = 2 + 2 * static_cast<int>(rng.below(4));
  c.model.n_kv_head = c.model.n_head / 2;
  c.model.d_model = c.model.n_head * 2 * (4 + static_cast<int>(rng.below(8)));
  c.model.n_layer = 1 + static_cast<int>(rng.below(12));
  c.model.d_ff = 1 + static_cast<int>(rng.below(4000));
  c.model.vocab_size = 2 + static_cast<int>(rng.below(200000));
  c.model.max_seq_len = 512 + static_cast<int>(rng.below(4096));
  c.model.rope_theta = static_cast<float>(1000.0 + rng.uniform() * 1e6);
  c.model.norm_eps = static_cast<float>(rng.uniform() * 1e-4);
  c.model.tied_head = false;
  c.train_data = "/tmp/some dir/train_*.bin";
  c.val_data = "";
  c.batch_size = 1 + static_cast<int>(rng.below(64));
  c.seq_len = 1 + static_cast<int>(rng.below(512));
  c.grad_accum = 1 + static_cast<int>(rng.below(8));
  c.global_batch = c.grad_accum == 1 ? static_cast<int>(rng.below(3)) * 256 : 0;  // one or the other
  c.steps = 1 + static_cast<int>(rng.below(100000));
  c.lr = static_cast<float>(rng.uniform() * 1e-2);
  c.min_lr_ratio = static_cast<float>(rng.uniform());
  c.warmup_steps = static_cast<int>(rng.below(1000));
  c.weight_decay = static_cast<float>(rng.uniform());
  c.beta1 = static_cast<float>(rng.uniform());
  c.beta2 = static_cast<float>(rng.uniform());
  c.adam_eps = static_cast<float>(rng.uniform() * 1e-6);
  c.grad_clip = static_cast<float>(rng.uniform() * 5);
  c.device = "cpu";
  c.kernels = "unfused";
  c.precision = "fp8";
  c.fp8_history = 1 + static_cast<int>(rng.below(64));
  c.fp8_margin = static_cast<int>(rng.below(4));
  c.fp8_linears = rng.below(2) ? "mlp_down,qkv" : "attn_proj";
  c.fp8_scaling = std::vector<std::string>{"block", "tensor", "mlp_down"}[rng.below(3)];
  if (c.fp8_scaling == "mlp_down") c.fp8_linears = "mlp_down,qkv";
  c.deterministic = true;
  c.out = "runs/x y";
  c.seed = rng.next_u64();
  c.log_every = 1 + static_cast<int>(rng.below(100));
  c.val_every = static_cast<int>(rng.below(1000));
  c.val_batches = 1 + static_cast<int>(rng.below(100));
  c.checkpoint_every = static_cast<int>(rng.below(1000));
  c.keep_checkpoints = static_cast<int>(rng.below(10));
  c.sample_every = 1 + static_cast<int>(rng.below(1000));
  c.init_from = "models/base \"x\"";
  return c;
}

void expect_same(const coda::RunConfig& a, const coda::RunConfig& b) {
  EXPECT_EQ(a.model.arch, b.model.arch);
  EXPECT_EQ(a.model.n_layer, b.model.n_layer);
  EXPECT_EQ(a.model.d_model, b.model.d_model);
  EXPECT_EQ(a.model.n_head, b.model.n_head);
  EXPECT_EQ(a.model.n_kv_head, b.model.n_kv_head);
  EXPECT_EQ(a.model.d_ff, b.model.d_ff);
  EXPECT_EQ(a.model.vocab_size, b.model.vocab_size);
  EXPECT_EQ(a.model.max_seq_len, b.model.max_seq_len);
  EXPECT_EQ(a.model.rope_theta, b.model.rope_theta);
  EXPECT_EQ(a.model.norm_eps, b.model.norm_eps);
  EXPECT_EQ(a.model.tied_head, b.model.tied_head);
  EXPECT_EQ(a.train_data, b.train_data);
  EXPECT_EQ(a.val_data, b.val_data);
  EXPECT_EQ(a.batch_size, b.batch_size);
  EXPECT_EQ(a.seq_len, b.seq_len);
  EXPECT_EQ(a.grad_accum, b.grad_accum);
  EXPECT_EQ(a.global_batch, b.global_batch);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.lr, b.lr);
  EXPECT_EQ(a.min_lr_ratio, b.min_lr_ratio);
  EXPECT_EQ(a.warmup_steps, b.warmup_steps);
  EXPECT_EQ(a.weight_decay, b.weight_decay);
  EXPECT_EQ(a.beta1, b.beta1);
  EXPECT_EQ(a.beta2, b.beta2);
  EXPECT_EQ(a.adam_eps, b.adam_eps);
  EXPECT_EQ(a.grad_clip, b.grad_clip);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.kernels, b.kernels);
  EXPECT_EQ(a.precision, b.precision);
  EXPECT_EQ(a.fp8_history, b.fp8_history);
  EXPECT_EQ(a.fp8_margin, b.fp8_margin);
  EXPECT_EQ(a.fp8_linears, b.fp8_linears);
  EXPECT_EQ(a.fp8_scaling, b.fp8_scaling);
  EXPECT_EQ(a.deterministic, b.deterministic);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.log_every, b.log_every);
  EXPECT_EQ(a.val_every, b.val_every);
  EXPECT_EQ(a.val_batches, b.val_batches);
  EXPECT_EQ(a.checkpoint_every, b.checkpoint_every);
  EXPECT_EQ(a.keep_checkpoints, b.keep_checkpoints);
  EXPECT_EQ(a.sample_every, b.sample_every);
  EXPECT_EQ(a.resume, b.resume);
  EXPECT_EQ(a.init_from, b.init_from);
}

coda::AppFactory key_factory() {
  return [](coda::RunConfig& config) {
    auto app = std::make_shared<CLI::App>("test", "test");
    coda::add_config_options(*app, config);
    return app;
  };
}

}  // namespace

TEST(Config, TomlRoundTripKeepsEveryValueExactly) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    const coda::RunConfig original = random_config(seed);
    const std::string toml = coda::config_to_toml(original);
    const coda::RunConfig parsed = coda::parse_config_text(toml, "round trip");
    expect_same(original, parsed);
    EXPECT_EQ(coda::config_to_toml(parsed), toml);
  }
}

// resume says how one process started, not what the run is: a saved config that kept it would, read
// back, silently continue the run it was saved from.
TEST(Config, SavedConfigLeavesRunControlKeysOut) {
  coda::RunConfig original = random_config(3);
  original.resume = "runs/old/step_5";
  const std::string toml = coda::config_to_toml(original);
  EXPECT_EQ(toml.find("resume"), std::string::npos) << toml;
  const coda::RunConfig parsed = coda::parse_config_text(toml, "saved");
  EXPECT_EQ(parsed.resume, "");
  original.resume.clear();
  expect_same(original, parsed);
}

TEST(Config, WrittenFileReadsBackThroughConfigFlag) {
  TempDir dir("coda_config");
  const coda::RunConfig original = random_config(7);
  write_text(dir / "run.toml", coda::config_to_toml(original));
  const coda::RunConfig parsed = coda::resolve_config(key_factory(), dir / "run.toml", {});
  expect_same(original, parsed);
}

TEST(Config, CommandLineOverridesConfigFile) {
  TempDir dir("coda_config");
  write_text(dir / "c.toml", "[model]\nn_layer = 3\nd_model = 96\n[optim]\nlr = 0.002\nsteps = 50\n");
  const coda::RunConfig from_file = coda::resolve_config(key_factory(), dir / "c.toml", {});
  EXPECT_EQ(from_file.model.n_layer, 3);
  EXPECT_EQ(from_file.lr, 0.002f);
  const coda::RunConfig overridden =
      coda::resolve_config(key_factory(), dir / "c.toml", {"--lr", "5e-4", "--n_layer=5", "--seed", "99"});
  EXPECT_EQ(overridden.model.n_layer, 5);
  EXPECT_EQ(overridden.model.d_model, 96);  // from the file, untouched
  EXPECT_EQ(overridden.lr, 5e-4f);
  EXPECT_EQ(overridden.steps, 50);
  EXPECT_EQ(overridden.seed, 99u);
}

TEST(Config, CommandLineCanRepairAnInvalidFileValue) {
  TempDir dir("coda_config");
  write_text(dir / "c.toml", "[model]\nd_model = 66\n");
  EXPECT_THROW(coda::resolve_config(key_factory(), dir / "c.toml", {}), std::invalid_argument);
  EXPECT_EQ(coda::resolve_config(key_factory(), dir / "c.toml", {"--d_model", "96"}).model.d_model, 96);
}

TEST(Config, KeysAtTheTopLevelAreAccepted) {
  const coda::RunConfig c = coda::parse_config_text("n_layer = 4\nlr = 0.25\n", "top");
  EXPECT_EQ(c.model.n_layer, 4);
  EXPECT_EQ(c.lr, 0.25f);
}

// The coda programs cover every shipped config; a head size or a feature they lack is named (kernels =
// auto then runs the unfused mode, kernels = coda refuses).
TEST(Config, CodaCoverageNamesWhatItLacks) {
  for (const auto& entry : fs::directory_iterator(fs::path(CODA_SOURCE_DIR) / "configs"))
    EXPECT_EQ(coda::coda_unsupported_reason(coda::resolve_config(key_factory(), entry.path().string(), {}).model), "")
        << entry.path();
  coda::ModelConfig small_heads = coda::model_config(coda::Arch::Llama);
  small_heads.d_model = 64, small_heads.n_head = 2, small_heads.n_kv_head = 2;  // head_dim 32
  EXPECT_NE(coda::coda_unsupported_reason(small_heads).find("head_dim"), std::string::npos);
  coda::ModelConfig no_bias = coda::model_config(coda::Arch::GPT2);
  no_bias.proj_bias = false;
  EXPECT_NE(coda::coda_unsupported_reason(no_bias).find("a bias on every projection"), std::string::npos);
}

// Every shipped config resolves, and `arch` alone picks the model's features (the architectures' files,
// src/models/): a Qwen2 config is RMSNorm + SwiGLU + RoPE with the QKV bias and no other.
TEST(Config, ShippedConfigsGetTheirArchitecturesFeatures) {
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(CODA_SOURCE_DIR) / "configs")) {
    const coda::RunConfig c = coda::resolve_config(key_factory(), entry.path().string(), {});
    const coda::ModelConfig expected = coda::model_config(c.model.arch);
    EXPECT_EQ(c.model.norm, expected.norm) << entry.path();
    EXPECT_EQ(c.model.mlp, expected.mlp) << entry.path();
    EXPECT_EQ(c.model.positions, expected.positions) << entry.path();
    EXPECT_EQ(c.model.qkv_bias, expected.qkv_bias) << entry.path();
    EXPECT_EQ(c.model.proj_bias, expected.proj_bias) << entry.path();
    EXPECT_EQ(c.model.mlp_bias, expected.mlp_bias) << entry.path();
    if (c.model.arch == coda::Arch::Qwen2) {
      EXPECT_EQ(c.model.norm, coda::Norm::RMS);
      EXPECT_TRUE(c.model.qkv_bias && !c.model.proj_bias && !c.model.mlp_bias);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2);  // tiny-qwen2.toml and qwen2.5-0.5b.toml
  // A model whose features are not its architecture's is refused, naming the feature.
  coda::ModelConfig mixed = coda::model_config(coda::Arch::Llama);
  mixed.qkv_bias = true;
  try {
    mixed.validate();
    ADD_FAILURE() << "a llama with a QKV bias validated";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("QKV bias"), std::string::npos) << e.what();
  }
}

TEST(Config, HelpListsEveryKeyWithItsDefault) {
  const CommandResult help = run_coda("train --help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  const coda::RunConfig defaults;
  std::istringstream toml(coda::config_to_toml(defaults));
  int keys = 0;
  for (std::string line; std::getline(toml, line);) {
    const size_t equals = line.find(" = ");
    if (equals == std::string::npos) continue;
    std::string value = line.substr(equals + 3);
    if (value.size() >= 2 && value.front() == '"') value = value.substr(1, value.size() - 2);
    const std::string shown = "--" + line.substr(0, equals) + (value.empty() ? "" : " ");
    EXPECT_NE(help.output.find(shown), std::string::npos) << "help misses " << shown;
    if (!value.empty()) {
      EXPECT_NE(help.output.find("=" + value), std::string::npos) << "help misses default " << line;
    }
    ++keys;
  }
  EXPECT_GT(keys, 30);
  for (const char* section : {"model:", "data:", "optim:", "run:"}) EXPECT_NE(help.output.find(section), std::string::npos);
}

// ---- error paths of `coda train`

struct BadInput {
  const char* name;
  const char* config;      // config file contents (nullptr: no file is written)
  const char* arguments;   // extra command-line arguments
  const char* must_name;   // text the error message must contain
};

void PrintTo(const BadInput& bad, std::ostream* os) { *os << bad.name; }

class TrainRejects : public testing::TestWithParam<BadInput> {};

TEST_P(TrainRejects, WithAClearMessageAndNoRunDirectory) {
  const BadInput& bad = GetParam();
  TempDir dir("coda_config");
  const fs::path config = dir / "bad.toml";
  if (bad.config != nullptr) write_text(config, bad.config);
  const fs::path out = dir / "run";
  const CommandResult result = run_coda("train --config " + config.string() + " --out " + out.string() +
                                        " --device cpu " + bad.arguments);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("error: "), std::string::npos) << result.output;
  EXPECT_NE(result.output.find(bad.must_name), std::string::npos) << "message should name " << bad.must_name << ":\n"
                                                                  << result.output;
  EXPECT_FALSE(fs::exists(out)) << "a run directory was left behind";
}

INSTANTIATE_TEST_SUITE_P(
    Config, TrainRejects,
    testing::Values(
        BadInput{"UnknownKey", "[model]\nn_layers = 2\n", "", "unknown key 'n_layers'"},
        BadInput{"UnknownTopLevelKey", "learning_rate = 2\n", "", "unknown key 'learning_rate'"},
        BadInput{"WrongSection", "[optim]\nd_model = 64\n", "", "'d_model' belongs in [model]"},
        BadInput{"UnknownSection", "[training]\nsteps = 3\n", "", "unknown section [training]"},
        BadInput{"WrongTypeInFile", "[model]\nn_layer = two\n", "", "--n_layer"},
        BadInput{"FractionForInteger", "[data]\nbatch_size = 2.5\n", "", "--batch_size"},
        BadInput{"BadArch", "[model]\narch = \"bert\"\n", "", "arch"},
        BadInput{"HeadsDoNotDivideWidth", "[model]\nd_model = 66\nn_head = 4\n", "", "d_model (66) must be divisible by n_head (4)"},
        BadInput{"SeqLenBeyondModel", "[data]\nseq_len = 512\n[model]\nmax_seq_len = 256\n", "", "seq_len (512)"},
        BadInput{"NegativeLr", "[optim]\nlr = -0.1\n", "", "lr must be > 0"},
        BadInput{"InfiniteLr", "[optim]\nlr = inf\n", "", "--lr: must be a finite number"},
        BadInput{"NanOnCommandLine", "", "--grad_clip nan", "--grad_clip: must be a finite number"},
        BadInput{"BooleanThree", "[model]\ntied_head = 3\n", "", "--tied_head: must be true or false"},
        BadInput{"NegativeSeed", "", "--seed -1", "--seed: must be >= 0"},
        BadInput{"GpuKernelsOnTheCpu", "", "--kernels coda", "kernels = coda selects GPU kernels"},
        BadInput{"NegativeKeepCheckpoints", "", "--keep_checkpoints -1", "keep_checkpoints must be >= 0"},
        BadInput{"GlobalBatchAndGradAccum", "[data]\nglobal_batch = 64\ngrad_accum = 2\n", "",
                 "set global_batch or grad_accum, not both"},
        BadInput{"GlobalBatchNotAMultiple", "[data]\nglobal_batch = 10\nbatch_size = 4\n", "",
                 "a global batch of 10 sequences cannot be split over 1 ranks x batch_size 4"},
        BadInput{"BadKernels", "[run]\nkernels = \"fast\"\n", "", "kernels"},
        BadInput{"BadPrecision", "", "--precision fp16", "precision must be bf16 or fp8"},
        BadInput{"Fp8InTheCodaMode", "[run]\nprecision = \"fp8\"\nkernels = \"coda\"\n", "",
                 "precision = fp8 runs in the unfused mode"},
        BadInput{"Fp8HistoryZero", "", "--precision fp8 --fp8_history 0", "fp8_history must be in [1, 1024]"},
        BadInput{"Fp8LinearUnknown", "", "--fp8_linears qkv,mlp", "fp8_linears = \"qkv,mlp\": \"mlp\" is not one of them"},
        BadInput{"Fp8LinearTwice", "[run]\nfp8_linears = \"mlp_up,mlp_up\"\n", "", "\"mlp_up\" is listed twice"},
        BadInput{"Fp8LinearsEmpty", "", "--fp8_linears ''", "an empty name"},
        BadInput{"Fp8ScalingUnknown", "[run]\nfp8_scaling = \"row\"\n", "",
                 "fp8_scaling = \"row\": \"row\" is not one of them"},
        BadInput{"Fp8BlockScalingOnABf16Linear", "", "--fp8_linears qkv --fp8_scaling mlp_down",
                 "fp8_scaling = \"mlp_down\" names a linear that fp8_linears = \"qkv\" keeps in bf16"},
        BadInput{"BadDevice", "", "--device tpu", "device"},
        BadInput{"FileErrorsNameTheFile", "[model]\nbogus = 1\n", "", "bad.toml"},
        BadInput{"MissingConfigFile", nullptr, "", "bad.toml: file not found"},
        BadInput{"WrongTypeOnCommandLine", "", "--steps many", "--steps"},
        BadInput{"UnknownFlag", "", "--stepz 3", "--stepz"},
        BadInput{"OutOfRangeOnCommandLine", "", "--n_head 5", "n_head"},
        BadInput{"MissingData", "", "--train_data /nonexistent/shard_*.bin", "/nonexistent/shard_*.bin"},
        BadInput{"MissingResumeCheckpoint", "", "--resume /nonexistent/run", "/nonexistent/run"}),
    [](const testing::TestParamInfo<BadInput>& info) { return std::string(info.param.name); });

// 2: the command line or the configuration is wrong, wherever the mistake sits; 1: running failed.
TEST(Config, ConfigurationErrorsExitWithTwoAndRuntimeFailuresWithOne) {
  EXPECT_EQ(run_coda("train --stepz 3").exit_code, 2);
  EXPECT_EQ(run_coda("frobnicate").exit_code, 2);
  EXPECT_EQ(run_coda("").exit_code, 2);
  TempDir dir("coda_config");
  write_text(dir / "bad.toml", "bogus = 1\n");
  write_text(dir / "bad_value.toml", "[optim]\nsteps = many\n");
  const std::string out = " --device cpu --out " + (dir / "run");
  EXPECT_EQ(run_coda("train --config " + (dir / "bad.toml") + out).exit_code, 2) << "unknown key in a file";
  EXPECT_EQ(run_coda("train --config " + (dir / "bad_value.toml") + out).exit_code, 2) << "bad value in a file";
  EXPECT_EQ(run_coda("train --steps many" + out).exit_code, 2) << "the same bad value on the command line";
  EXPECT_EQ(run_coda("train --n_head 5" + out).exit_code, 2) << "an inconsistent value";
  EXPECT_EQ(run_coda("train --config " + (dir / "missing.toml") + out).exit_code, 2) << "no config file";
  EXPECT_EQ(run_coda("eval --batches 0 --checkpoint " + (dir / "run")).exit_code, 2) << "--batches 0";
  EXPECT_EQ(run_coda("train --train_data /nonexistent/train_*.bin --val_data ''" + out).exit_code, 1)
      << "missing data is a failure while running";
  EXPECT_EQ(run_coda("eval --checkpoint " + (dir / "run")).exit_code, 1) << "missing checkpoint";
}

// The CPU measures neither MFU nor phase times nor device memory: its row says '-' there, not 0.00.
TEST(Config, BenchTableMarksFiguresTheCpuDoesNotMeasure) {
  const CommandResult result = run_coda("bench --device cpu --steps 1 --warmup 0 --seq_len 16 --batch_size 2");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  std::istringstream lines(result.output);
  std::vector<std::string> row;
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("cpu ", 0) == 0) {
      std::istringstream words(line);
      for (std::string word; words >> word;) row.push_back(word);
    }
  // backend, ms, tokens/s, tokens/s/GPU, then MFU, fwd, bwd, optim, mem, J/step, W, SM MHz, tokens/J (the
  // CPU measures none of them), vs first, J vs first (no energy to compare).
  ASSERT_EQ(row.size(), 15u) << result.output;
  for (size_t column = 4; column <= 12; ++column)
    EXPECT_EQ(row[column], "-") << "column " << column << ": " << result.output;
  EXPECT_EQ(row[14], "-") << result.output;
  EXPECT_NE(row[1], "-") << "the step time is measured";
}

TEST(Config, BenchOnCudaWithoutAGpuFailsInsteadOfTimingTheCpu) {
  if (coda::cuda_device_available()) GTEST_SKIP() << "this machine has a GPU";
  const CommandResult result = run_coda("bench --device cuda --steps 1 --warmup 0");
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("device = cuda, but this machine has no usable CUDA GPU"), std::string::npos)
      << result.output;
  EXPECT_EQ(result.output.find("median ms/step"), std::string::npos) << "no table: " << result.output;
}
