// The commands of the `coda` executable on top of a Backend: train, eval, sample and bench.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "config.hpp"
#include "dist_plan.hpp"

namespace coda {

// Learning rate of optimizer step `step` (0-based): linear warmup from lr/warmup_steps to lr over the
// first warmup_steps steps, then a cosine from lr down to lr * min_lr_ratio at the last step.
float lr_at(const RunConfig& config, int step);

// The one place that knows which backends this build has: the model of config on config.device
// ("cpu", "cuda", or "auto": the best one this machine runs) with config.kernels, sized for
// config.batch_size sequences of config.seq_len tokens. zero1: shard the optimizer state over its ranks
// (cuda only; config.zero1 itself is read by train(), which passes its communicator here).
std::unique_ptr<Backend> make_backend(const RunConfig& config, Communicator* zero1 = nullptr);
// (device, kernels) of every backend this build and machine can run, in the order `coda bench` times
// them (the unfused mode first, so the bench's "vs first" column is coda's speedup).
std::vector<std::pair<std::string, std::string>> available_backends();
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
};

// Trains config (validated) into the run directory config.out:
//   config.toml     the effective configuration (`coda train --config` reads it back)
//   metrics.jsonl   one JSON object per step: step, loss, lr, grad_norm, ms, tokens_per_s (+ val_loss)
//   step_N/         checkpoints (checkpoint.hpp) every checkpoint_every steps and at the end
// A fresh run refuses a directory that already holds a run; --resume continues one exactly.
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
// Generates options.tokens tokens after the prompt, writing each to out as it comes (bytes for the byte
// tokenizer, " id" otherwise); returns the generated token ids.
std::vector<int32_t> sample(const SampleOptions& options, std::FILE* out);

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
  // The timed steps' energy on this rank's GPU (energy.hpp; zeros where NVML cannot read it): joules per
  // step, mean power, mean SM clock, and tokens per joule of this GPU.
  double joules_per_step = 0.0, mean_power_w = 0.0, mean_sm_clock_mhz = 0.0, tokens_per_joule = 0.0;
};
// Times `steps` training steps after `warmup` untimed ones on random tokens, for every available backend
// (the --kernels one only when config.kernels is not auto). With comm (a launcher started several ranks,
// or zero1) every rank runs the same steps on its own tokens and the gradients are averaged over the
// ranks as in train(); config.zero1 shards the optimizer state over comm.
std::vector<BenchResult> bench(const RunConfig& config, int steps, int warmup, Communicator* comm = nullptr);
// Median wall time of an all-reduce of `count` fp32 values over comm, alone (nothing to overlap with):
// the cost the backward hides when it reduces a gradient of that size bucket by bucket.
double time_gradient_all_reduce(Communicator& comm, size_t count, int repeats);

}  // namespace coda
