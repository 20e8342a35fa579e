// The commands of the `coda` executable on top of a Backend: train, eval, sample and bench.
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "config.hpp"
#include "dist_plan.hpp"
#include "rng.hpp"

namespace coda {

// Learning rate of optimizer step `step` (0-based): linear warmup from lr/warmup_steps to lr over the
// first warmup_steps steps, then a cosine from lr down to lr * min_lr_ratio at the last step.
float lr_at(const RunConfig& config, int step);

// The one place that knows which backends this build has: the model of config on config.device
// ("cpu", "cuda", or "auto": the best one this machine runs) with config.kernels, sized for
// config.batch_size sequences of config.seq_len tokens. zero1: shard the optimizer state over its ranks
// (cuda only; config.zero1 itself is read by train(), which passes its communicator here).
std::unique_ptr<Backend> make_backend(const RunConfig& config, Communicator* zero1 = nullptr);
// What make_backend checks first: device = cuda needs a GPU (std::runtime_error), and kernels other
// than auto need the cuda backend (std::invalid_argument), rather than silently running on the CPU.
void require_device_available(const RunConfig& config);
// (device, kernels) of every backend this build and machine can run on `device` (auto: the GPU when
// there is one), in the order `coda bench` times them (the unfused mode first, so the bench's "vs first"
// column is coda's speedup).
std::vector<std::pair<std::string, std::string>> available_backends(const std::string& device = "auto");
// Peak dense FLOP/s of the device a backend (by its name()) runs on, for MFU; 0 when unknown.
double peak_flops(const std::string& backend_name);

// A checkpoint directory, or a run directory: then its newest step_N checkpoint. Throws naming path.
std::string find_checkpoint(const std::string& path);

// Data parallelism and ZeRO-1 train on GPUs only: throws std::invalid_argument naming the device key when
// world_size > 1 or config.zero1, and config.device does not resolve to the cuda backend.
void require_data_parallel_device(const RunConfig& config, int world_size);

// The batch of one optimizer step on world_size ranks: ranks x batch_size x grad_accum, or, with
// global_batch set, the grad_accum that makes it global_batch (std::invalid_argument with the numbers
// when ranks x batch_size does not divide it).
BatchPlan batch_plan(const RunConfig& config, int world_size);

struct TrainResult {
  int step = 0;             // optimizer steps completed
  float loss = 0.0f;        // training loss of the last step
  float val_loss = 0.0f;    // last validation loss (NaN when there was none)
  std::string checkpoint;   // the last checkpoint written
  int stop_signal = 0;      // SIGINT / SIGTERM when a signal stopped the run early (with a checkpoint)
};

// The configuration a run trains with: with init_from, the model keys of that directory's config.json
// (of the resume checkpoint's when resuming; the config's own are ignored); val_data "auto" resolved
// (resolve_val_data). Validated.
RunConfig effective_run_config(const RunConfig& config);
// val_data "auto": the shards beside train_data whose file names say "val" where train_data's say
// "train" (data/x/train_*.bin -> data/x/val_*.bin) when such files exist; throws std::invalid_argument
// asking for val_data otherwise. Any other value is returned as it is ("" = no validation).
std::string resolve_val_data(const std::string& val_data, const std::string& train_data);

// Trains config into the run directory config.out:
//   config.toml     the effective configuration (`coda train --config` reads it back)
//   metrics.jsonl   one JSON object per step: step, loss, lr, grad_norm, ms, tokens_per_s (+ val_loss)
//   step_N/         checkpoints (checkpoint.hpp) every checkpoint_every steps and at the end; only the
//                   newest keep_checkpoints stay
// A fresh run refuses a directory that holds a checkpoint; --resume continues it exactly. A resume that
// has nothing to do (already at config.steps) writes nothing. SIGINT or SIGTERM during the loop stops it
// after the current step with a checkpoint (TrainResult::stop_signal; all ranks stop at the same step).
// comm: data parallelism over comm's ranks (every rank calls train with the same config); null: one
// process. With several ranks, rank r reads slice r of every global batch, gradients and the logged loss
// are averaged over ranks, and rank 0 alone writes the run directory and validates; on the others
// TrainResult::checkpoint stays empty and val_loss NaN. tokens_per_s counts the whole job.
// config.zero1 needs comm (of any size, 1 included): the backend then shards its optimizer state over it.
TrainResult train(const RunConfig& config, Communicator* comm = nullptr);

struct EvalOptions {
  std::string checkpoint;   // checkpoint or run directory
  std::string data;         // shard glob; empty: the val_data of the run that wrote the checkpoint
  int batches = 0;          // 0: that run's val_batches
  int batch_size = 0;       // 0: that run's batch_size
  int seq_len = 0;          // 0: that run's seq_len
  std::string device = "auto";
};
// Mean loss over the first batches of the data (sequential, the way validation reads it).
float evaluate(const EvalOptions& options);

struct SampleOptions {
  std::string checkpoint;
  std::string prompt;       // text for the byte tokenizer (vocab 256), else token ids "15496 11 995"
  int tokens = 200;         // tokens to generate
  float temperature = 1.0f; // 0: greedy
  int top_k = 0;            // 0: the whole vocabulary
  uint64_t seed = 1337;
  std::string device = "auto";
};
// Generates options.tokens tokens after the prompt, writing each to out as it comes (token_text);
// returns the generated token ids.
std::vector<int32_t> sample(const SampleOptions& options, std::FILE* out);
// How a generated token is shown: for the byte tokenizer (bytes) printable ASCII, newline and tab as
// they are and any other byte as \xNN (a raw control byte would drive the terminal); otherwise the id,
// after a space unless it is the first.
std::string token_text(int32_t token, bool bytes, bool first);
// Generates `tokens` tokens after context with backend (a model of vocab_size, fed at most max_window
// tokens), calling emit with each as it comes; returns them. Temperature 0 is greedy; top_k 0: all.
std::vector<int32_t> generate(Backend& backend, int vocab_size, std::vector<int32_t> context, int tokens,
                              float temperature, int top_k, int max_window, Rng& rng,
                              const std::function<void(int32_t)>& emit);

struct BenchResult {
  std::string backend;
  int steps = 0;
  int world_size = 1;         // ranks that ran the steps together (data parallelism)
  double median_ms = 0.0;     // one optimizer step (grad_accum micro-batches, clipping, AdamW)
  double tokens_per_s = 0.0;  // whole job
  double tokens_per_s_per_gpu = 0.0;
  double mfu = 0.0;           // per GPU; 0 when the device's peak is unknown
  // Median device time per phase of one optimizer step (Backend::last_phase_times; zeros for the CPU).
  double forward_ms = 0.0, backward_ms = 0.0, optimizer_ms = 0.0;
  double memory_gib = 0.0;    // device memory in use on rank 0 after the steps (0 for the CPU)
  // The energy on this rank's GPU (energy.hpp; zeros where NVML cannot read it): joules per step, mean
  // power, mean SM clock, and tokens per joule of this GPU, read over energy_steps steps (the timed ones
  // and the untimed ones after them) in a window of energy_window_s seconds.
  double joules_per_step = 0.0, mean_power_w = 0.0, mean_sm_clock_mhz = 0.0, tokens_per_joule = 0.0;
  int energy_steps = 0;
  double energy_window_s = 0.0;
};
// Times `steps` training steps after `warmup` untimed ones on random tokens, for every available backend
// in bf16 (the --kernels one only when config.kernels is not auto; with config.deterministic each GPU
// one twice, without and with it), then with config.precision = fp8 the FP8 unfused mode (the CPU's
// emulation there). With comm (a launcher started several ranks,
// or zero1) every rank runs the same steps on its own tokens and the gradients are averaged over the
// ranks as in train(); config.zero1 shards the optimizer state over comm. The energy is read over the timed
// steps and as many untimed ones as make the window at least energy_seconds long (bench.cpp says why).
constexpr double kBenchEnergySeconds = 5.0;
std::vector<BenchResult> bench(const RunConfig& config, int steps, int warmup, Communicator* comm = nullptr,
                               double energy_seconds = kBenchEnergySeconds);
// Median wall time of an all-reduce of `count` fp32 values over comm, alone (nothing to overlap with):
// the cost the backward hides when it reduces a gradient of that size bucket by bucket.
double time_gradient_all_reduce(Communicator& comm, size_t count, int repeats);

}  // namespace coda
