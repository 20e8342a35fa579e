// The `coda` executable: CLI11 subcommands train, eval, sample, bench and prepare (prepare.cpp).
//
// train and bench take a config file (--config) plus every config key as a flag. The command line is
// parsed once here (help, unknown flags, wrong types); resolve_config() then builds the effective
// configuration from fresh Apps made by the same factory (config.cpp explains the phases).
// Progress and logs go to stderr, results (val_loss, samples, the bench table) to stdout.
// Errors end the program with one line on stderr: "error: ..." and exit code 2 for command-line misuse,
// 1 for everything else (bad config file, bad values, missing files, failures while running).
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.hpp"
#include "distributed.hpp"
#include "prepare.hpp"
#include "train.hpp"

namespace {

constexpr int kUsageError = 2, kRuntimeError = 1;

int fail(const std::string& message, int code) {
  std::fflush(stdout);
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return code;
}

// A configuration error: it carries the exit code of the command line's mistakes.
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

coda::RunConfig resolve(const coda::AppFactory& make_app, const std::string& config_file,
                        const std::vector<std::string>& args) {
  try {
    return coda::resolve_config(make_app, config_file, args);
  } catch (const CLI::ParseError& e) {
    throw ConfigError(std::string(e.what()) + " (see --help)");
  } catch (const std::exception& e) {
    throw ConfigError(e.what());
  }
}

// One line per backend; "vs first" is the first backend's step time over this one's (the speedup), "J vs
// first" this one's energy per step over the first one's. A figure the backend has no measurement of
// (the CPU's phases, memory and energy) prints as "-" and is null in the JSON.
// all_reduce_ms: time_gradient_all_reduce over the ranks (0: one rank).
void print_bench(const std::vector<coda::BenchResult>& results, const coda::RunConfig& config, double all_reduce_ms,
                 const std::string& json_path) {
  const int world_size = results.front().world_size;
  if (world_size > 1)
    std::printf("%d ranks (data parallel%s), batch_size %d per rank\n", world_size, config.zero1 ? ", ZeRO-1" : "",
                config.batch_size);
  std::printf("%-16s %14s %12s %12s %8s %9s %9s %9s %8s %8s %7s %7s %9s %9s %9s\n", "backend", "median ms/step",
              "tokens/s", "tokens/s/GPU", "MFU", "fwd ms", "bwd ms", "optim ms", "mem GiB", "J/step", "W", "SM MHz",
              "tokens/J", "vs first", "J vs first");
  const auto figure = [](double value, int width, int precision) {
    char text[32];
    if (value > 0.0)
      std::snprintf(text, sizeof(text), "%*.*f", width, precision, value);
    else
      std::snprintf(text, sizeof(text), "%*s", width, "-");
    return std::string(text);
  };
  const auto measured = [](double value) { return value > 0.0 ? nlohmann::json(value) : nlohmann::json(); };
  nlohmann::json records = nlohmann::json::array();
  const coda::BenchResult& first = results.front();
  for (const auto& r : results) {
    const double speedup = first.median_ms / r.median_ms;
    const double energy_ratio = first.joules_per_step > 0.0 ? r.joules_per_step / first.joules_per_step : 0.0;
    std::printf("%-16s %14.2f %12.0f %12.0f %8s %s %s %s %s %s %s %s %s %8.2fx %s\n", r.backend.c_str(), r.median_ms,
                r.tokens_per_s, r.tokens_per_s_per_gpu, (figure(100.0 * r.mfu, 7, 2) + (r.mfu > 0.0 ? "%" : " ")).c_str(),
                figure(r.forward_ms, 9, 2).c_str(), figure(r.backward_ms, 9, 2).c_str(),
                figure(r.optimizer_ms, 9, 2).c_str(), figure(r.memory_gib, 8, 1).c_str(),
                figure(r.joules_per_step, 8, 2).c_str(), figure(r.mean_power_w, 7, 0).c_str(),
                figure(r.mean_sm_clock_mhz, 7, 0).c_str(), figure(r.tokens_per_joule, 9, 0).c_str(), speedup,
                (figure(energy_ratio, 9, 3)).c_str());
    records.push_back({{"backend", r.backend}, {"steps", r.steps}, {"median_ms", r.median_ms},
                       {"tokens_per_s", r.tokens_per_s}, {"tokens_per_s_per_gpu", r.tokens_per_s_per_gpu},
                       {"mfu", measured(r.mfu)}, {"forward_ms", measured(r.forward_ms)},
                       {"backward_ms", measured(r.backward_ms)}, {"optimizer_ms", measured(r.optimizer_ms)},
                       {"memory_gib", measured(r.memory_gib)}, {"joules_per_step", measured(r.joules_per_step)},
                       {"mean_power_w", measured(r.mean_power_w)}, {"mean_sm_clock_mhz", measured(r.mean_sm_clock_mhz)},
                       {"tokens_per_joule", measured(r.tokens_per_joule)}, {"speedup_vs_first", speedup},
                       {"energy_vs_first", measured(energy_ratio)}, {"energy_steps", r.energy_steps},
                       {"energy_window_s", measured(r.energy_window_s)}, {"world_size", world_size},
                       {"zero1", config.zero1}, {"gradient_all_reduce_ms", all_reduce_ms},
                       {"batch_size", config.batch_size}, {"seq_len", config.seq_len}, {"grad_accum", config.grad_accum},
                       {"global_batch", config.global_batch},
                       {"arch", coda::arch_name(config.model.arch)}, {"n_layer", config.model.n_layer},
                       {"d_model", config.model.d_model}});
  }
  for (const auto& r : results)
    if (r.energy_steps > 0)
      std::printf("%s: energy over %d steps in %.1f s (the timed ones and untimed ones up to --energy_seconds)\n",
                  r.backend.c_str(), r.energy_steps, r.energy_window_s);
  if (world_size > 1)
    std::printf("gradient all-reduce alone (%.0f MB fp32 over %d ranks, nothing to overlap): %.2f ms\n",
                4.0 * static_cast<double>(coda::make_param_layout(config.model).total) / 1e6, world_size, all_reduce_ms);
  if (json_path.empty()) return;
  std::ofstream file(json_path);
  file << records.dump(2) << "\n";
  if (!file.flush()) throw std::runtime_error("json " + json_path + ": cannot write");
}

}  // namespace

// train and bench run data-parallel when a launcher (mpirun, srun) started several processes: init_distributed()
// finds this process's rank and GPU, a Communicator spans the ranks, and ranks other than 0 log only
// warnings. zero1 = true makes the communicator also for a single process (ZeRO-1 over one rank, which
// is how it is tested on one GPU). The device is checked before init_distributed, so a CPU run under a
// launcher fails with that message and not with MPI's. An error on one rank of several ends the whole job through abort_job
// (MPI_Abort when MPI is up), before the communicator is torn down: finalizing it would wait for peers
// that are blocked waiting for this rank.
int main(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("coda"));  // stdout carries results only
  spdlog::set_pattern("[%T] %^%v%$");
  CLI::App app{"coda: a C++/CUDA trainer for GPT-2 and Llama-style Transformers", "coda"};
  app.require_subcommand(1);

  std::string config_file;
  const auto add_config_file = [&config_file](CLI::App& command) {
    command.add_option("--config", config_file, "config file (TOML-style, sections [model] [data] [optim] [run])");
  };
  const coda::AppFactory make_train = [&](coda::RunConfig& config) {
    auto command = std::make_shared<CLI::App>("Train a model: config file, then command-line overrides", "train");
    add_config_file(*command);
    coda::add_config_options(*command, config);
    return command;
  };
  int bench_steps = 10, bench_warmup = 2;
  double bench_energy_seconds = coda::kBenchEnergySeconds;
  std::string bench_json;
  const coda::AppFactory make_bench = [&](coda::RunConfig& config) {
    auto command = std::make_shared<CLI::App>(
        "Time training steps of every backend in this build (or the --kernels one; --precision fp8 adds the FP8 "
        "unfused mode) on random tokens of the config's shape", "bench");
    add_config_file(*command);
    coda::add_config_options(*command, config);
    command->remove_option(command->get_option("--steps"));
    command->add_option("--steps", bench_steps, "timed steps")->capture_default_str()->group("bench");
    command->add_option("--warmup", bench_warmup, "untimed steps before them")->capture_default_str()->group("bench");
    command->add_option("--energy_seconds", bench_energy_seconds,
                        "read the energy over at least this many seconds, adding untimed steps after the timed ones "
                        "(NVML's counter moves about every 100 ms; 0: the timed steps alone)")
        ->capture_default_str()
        ->check(CLI::Range(0.0, 3600.0))
        ->group("bench");
    command->add_option("--json", bench_json, "also write the results to this JSON file")->group("bench");
    return command;
  };

  coda::RunConfig command_line_only;  // the real configuration comes from resolve_config below
  CLI::App* train_command = app.add_subcommand(make_train(command_line_only));
  CLI::App* bench_command = app.add_subcommand(make_bench(command_line_only));

  coda::EvalOptions eval_options;
  CLI::App* eval_command = app.add_subcommand("eval", "Print the loss of a checkpoint on token shards");
  eval_command->add_option("--checkpoint", eval_options.checkpoint, "checkpoint directory or run directory (newest)")
      ->required();
  eval_command->add_option("--data", eval_options.data, "shard glob (default: the run's val_data)");
  eval_command->add_option("--batches", eval_options.batches, "batches (default: the run's val_batches)")
      ->check(CLI::PositiveNumber);
  eval_command->add_option("--batch_size", eval_options.batch_size, "sequences per batch (default: the run's)")
      ->check(CLI::PositiveNumber);
  eval_command->add_option("--seq_len", eval_options.seq_len, "tokens per sequence (default: the run's)")
      ->check(CLI::PositiveNumber);
  eval_command->add_option("--device", eval_options.device, "auto | cpu | cuda")->capture_default_str();

  coda::SampleOptions sample_options;
  CLI::App* sample_command = app.add_subcommand("sample", "Generate text from a checkpoint");
  sample_command->add_option("--checkpoint", sample_options.checkpoint, "checkpoint directory or run directory (newest)")
      ->required();
  sample_command->add_option("--prompt", sample_options.prompt, "text (byte tokenizer) or token ids \"15496 11\"")
      ->required();
  sample_command->add_option("--tokens", sample_options.tokens, "tokens to generate")->capture_default_str();
  sample_command->add_option("--temperature", sample_options.temperature, "0: greedy")->capture_default_str();
  sample_command->add_option("--top_k", sample_options.top_k, "0: whole vocabulary")->capture_default_str();
  sample_command->add_option("--seed", sample_options.seed, "sampling seed")->capture_default_str();
  sample_command->add_option("--device", sample_options.device, "auto | cpu | cuda")->capture_default_str();

  coda::add_prepare_command(app);  // its callbacks run during parse

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    return fail(std::string(e.what()) + " (see --help)", kUsageError);
  } catch (const std::invalid_argument& e) {
    return fail(e.what(), kUsageError);
  } catch (const std::exception& e) {
    return fail(e.what(), kRuntimeError);
  }

  // The subcommand is argv[1]: the top level has no options of its own besides --help.
  const std::vector<std::string> args(argv + 2, argv + argc);
  coda::DistContext dist;
  std::unique_ptr<coda::Communicator> comm;
  try {
    // train and bench run on every rank a launcher started; the device is checked before MPI starts.
    const auto start_ranks = [&](const coda::RunConfig& config) {
      coda::require_device_available(config);
      coda::require_data_parallel_device(config, coda::detect_launch().world_size);
      dist = coda::init_distributed();
      if (!dist.is_root()) spdlog::set_level(spdlog::level::warn);
      if (dist.world_size > 1 || config.zero1) comm = std::make_unique<coda::Communicator>(dist);
    };
    const auto stop_ranks = [&] {
      comm.reset();
      coda::finalize_distributed(dist);
    };
    if (train_command->parsed()) {
      const coda::RunConfig config = resolve(make_train, config_file, args);
      start_ranks(config);
      const coda::TrainResult result = coda::train(config, comm.get());
      stop_ranks();
      if (result.stop_signal != 0) return 128 + result.stop_signal;
    } else if (bench_command->parsed()) {
      const coda::RunConfig config = resolve(make_bench, config_file, args);
      start_ranks(config);
      const std::vector<coda::BenchResult> results =
          coda::bench(config, bench_steps, bench_warmup, comm.get(), bench_energy_seconds);
      double all_reduce_ms = 0.0;
      if (dist.world_size > 1)
        all_reduce_ms = coda::time_gradient_all_reduce(*comm, coda::make_param_layout(config.model).total, 5);
      if (dist.is_root()) print_bench(results, config, all_reduce_ms, bench_json);
      stop_ranks();
    } else if (eval_command->parsed()) {
      std::printf("val_loss %.6f\n", coda::evaluate(eval_options));
    } else if (sample_command->parsed()) {
      coda::sample(sample_options, stdout);
    }
  } catch (const std::exception& e) {
    if (dist.world_size > 1) coda::abort_job(std::string("error: ") + e.what());
    coda::finalize_distributed(dist);
    const bool usage = dynamic_cast<const ConfigError*>(&e) != nullptr ||
                       dynamic_cast<const std::invalid_argument*>(&e) != nullptr;
    return fail(e.what(), usage ? kUsageError : kRuntimeError);
  }
  return 0;
}
