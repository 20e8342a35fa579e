// `coda bench`: wall-clock time of whole training steps (grad_accum forward+backward micro-batches,
// gradient norm, AdamW) of every backend this build and machine can run, on random tokens of the
// configured shape: the median of the timed steps after `warmup` untimed ones, with MFU, per-phase device
// times where the backend records them, and energy (energy.hpp): at the power cap a step's time follows its
// energy, so joules per step are what a change to the kernels is judged by. Under a launcher every rank runs
// the same loop, so the step time includes the communication the backward does not hide.
// Details: above bench() below.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "dist_plan.hpp"
#include "distributed.hpp"
#include "energy.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "model.hpp"
#include "rng.hpp"
#include "train.hpp"

namespace coda {

namespace {

double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + static_cast<long>(values.size() / 2), values.end());
  return values[values.size() / 2];
}

double device_memory_in_use_gib() {
  size_t free = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<double>(total - free) / (1024.0 * 1024.0 * 1024.0);
}

}  // namespace

double time_gradient_all_reduce(Communicator& comm, size_t count, int repeats) {
  float* gradient = nullptr;
  CUDA_CHECK(cudaMalloc(&gradient, count * sizeof(float)));
  CUDA_CHECK(cudaMemset(gradient, 0, count * sizeof(float)));
  std::vector<double> ms;
  for (int i = 0; i < repeats + 1; ++i) {  // the first one sets NCCL's buffers up: not timed
    const auto start = std::chrono::steady_clock::now();
    comm.all_reduce(gradient, count, ReduceOp::Average);
    comm.synchronize();
    if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  CUDA_CHECK(cudaFree(gradient));
  return median(ms);
}

// Each timed step ends with one more grad_norm call, whose value comes back to the host, so the time
// includes the AdamW update that a GPU backend queued. The median is robust to the odd slow step on a
// shared machine. MFU = flops_per_token * tokens/s / the device's peak (model.hpp counts the FLOPs). A
// backend that times its phases on the device (Backend::last_phase_times) also gets the median forward,
// backward (summed over the micro-batches) and optimizer times. Under CODA_PROFILE=1 only the timed steps'
// launches are profiled (kernels/common/kernel_profile.cuh).
// Under a launcher (mpirun -np N) every rank runs on its own random tokens, with the gradient average armed
// before the last micro-batch exactly as train() does; tokens/s counts the job, tokens/s per GPU and MFU one
// GPU. Scaling = tokens/s per GPU at N ranks over the figure of a one-GPU run. time_gradient_all_reduce gives
// the communication's whole cost for comparison: an all-reduce of the gradient's size with nothing to overlap.
// Energy: on a GPU whose NVML energy counter can be read, the joules per step on this rank's GPU, their
// mean power and SM clock, and tokens per joule, over the timed steps and as many more as make the window
// at least energy_seconds long. The counter moves in steps of about 100 ms (energy.hpp), one of which is
// 5% of thirty gpt2-124m steps; the meter reads from update to update, which leaves the idle tail after
// the last step (under 100 ms at the idle card's power: under 0.5% of a 5 s window at the cap). Every
// rank runs the largest count any rank needs (each step all-reduces).
std::vector<BenchResult> bench(const RunConfig& config, int steps, int warmup, Communicator* comm,
                               double energy_seconds) {
  if (steps < 1) throw std::invalid_argument("steps must be >= 1");
  if (warmup < 0) throw std::invalid_argument("warmup must be >= 0");
  if (!(energy_seconds >= 0.0)) throw std::invalid_argument("energy_seconds must be >= 0");
  config.validate();
  const ModelConfig& model = config.model;
  const int world_size = comm != nullptr ? comm->world_size() : 1, rank = comm != nullptr ? comm->rank() : 0;
  if (config.zero1 && comm == nullptr) throw std::invalid_argument("bench: zero1 = true needs a communicator");
  const BatchPlan plan = batch_plan(config, world_size);
  const int B = plan.micro_batch, T = plan.seq_len, A = plan.grad_accum;
  const ParamLayout layout = make_param_layout(model);
  std::vector<float> params(layout.total);
  init_params(model, layout, config.seed, params.data());
  Rng rng(config.seed + static_cast<uint64_t>(rank));
  std::vector<int32_t> tokens(static_cast<size_t>(A) * B * T), targets(tokens.size());
  for (auto& token : tokens) token = static_cast<int32_t>(rng.below(model.vocab_size));
  for (auto& token : targets) token = static_cast<int32_t>(rng.below(model.vocab_size));

  std::vector<BenchResult> results;
  // --kernels coda|unfused times that mode alone; auto times every mode of this build side by side, all in
  // bf16; --deterministic times each GPU mode once more with its fixed-order sums, after the default one;
  // --precision fp8 adds the FP8 unfused mode after them (the bf16 figures beside it).
  std::vector<std::pair<std::string, std::string>> backends = available_backends(config.device);
  if (config.kernels != "auto") {
    backends.erase(std::remove_if(backends.begin(), backends.end(),
                                  [&](const auto& b) { return b.second != config.kernels; }),
                   backends.end());
    if (backends.empty())
      throw std::invalid_argument("bench: kernels \"" + config.kernels + "\" is not available for " +
                                  arch_name(model.arch) + " on this machine");
  }
  struct Timed {
    std::string device, kernels, precision;
    bool deterministic;
  };
  std::vector<Timed> timed;
  for (const auto& [device, kernels] : backends) {
    timed.push_back({device, kernels, "bf16", false});
    if (config.deterministic && device == "cuda") timed.push_back({device, kernels, "bf16", true});
  }
  if (config.precision == "fp8")
    timed.push_back({backends.front().first, backends.front().first == "cuda" ? "unfused" : "auto", "fp8", false});
  for (const Timed& mode : timed) {
    RunConfig run = config;
    run.device = mode.device;
    run.kernels = mode.kernels;
    run.precision = mode.precision;
    run.deterministic = mode.deterministic;
    const std::string& device = mode.device;
    require_data_parallel_device(run, world_size);
    std::unique_ptr<Backend> backend = make_backend(run, run.zero1 ? comm : nullptr);
    backend->load_params(params.data());
    std::vector<double> ms, forward_ms, backward_ms, optimizer_ms;
    const std::unique_ptr<EnergyMeter> meter = device == "cuda" ? EnergyMeter::for_current_device() : nullptr;
    // One optimizer step; its wall time, forward and backward phases into the medians when timed.
    auto run_step = [&](int step, bool timed) {
      const auto start = std::chrono::steady_clock::now();
      backend->zero_grad();
      PhaseTimes phases;
      for (int micro = 0; micro < A; ++micro) {
        const size_t at = static_cast<size_t>(micro) * B * T;
        if (comm != nullptr && micro == A - 1) backend->average_grads_in_next_backward(*comm);
        backend->forward_backward(tokens.data() + at, targets.data() + at, B, T, 1.0f / static_cast<float>(A));
        const PhaseTimes micro_phases = backend->last_phase_times();
        phases.forward_ms += micro_phases.forward_ms;
        phases.backward_ms += micro_phases.backward_ms;
      }
      const float norm = backend->grad_norm();
      const float clip = run.grad_clip > 0.0f && norm > run.grad_clip ? run.grad_clip / norm : 1.0f;
      backend->adamw_step({lr_at(run, step), run.beta1, run.beta2, run.adam_eps, run.weight_decay}, step + 1, clip);
      backend->grad_norm();
      if (timed) {
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
        forward_ms.push_back(phases.forward_ms);
        backward_ms.push_back(phases.backward_ms);
        optimizer_ms.push_back(backend->last_phase_times().optimizer_ms);
      }
    };
    profile::set_recording(false);
    for (int step = 0; step < warmup; ++step) run_step(step, false);
    profile::set_recording(true);
    if (meter != nullptr) meter->start();  // the warm-up's last step ended on the host's sync
    const auto timed_start = std::chrono::steady_clock::now();
    for (int step = warmup; step < warmup + steps; ++step) run_step(step, true);
    profile::set_recording(false);
    const double timed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - timed_start).count();
    // Untimed steps until the window is energy_seconds long, in rounds: a count estimated from the steps so
    // far can fall short (the first timed steps of a small model run slower than the later ones), so the
    // elapsed time is checked again after each round; every rank runs the largest count of any rank.
    int extra_steps = 0;
    for (double elapsed_s = timed_s; meter != nullptr;) {
      const double per_step_s = elapsed_s / (steps + extra_steps);
      const float wanted =
          elapsed_s < energy_seconds ? static_cast<float>(std::ceil((energy_seconds - elapsed_s) / per_step_s)) : 0.0f;
      const int round = static_cast<int>(comm != nullptr ? comm->all_reduce_scalar(wanted, ReduceOp::Max) : wanted);
      if (round == 0) break;
      for (int step = warmup + steps + extra_steps; step < warmup + steps + extra_steps + round; ++step)
        run_step(step, false);
      extra_steps += round;
      elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - timed_start).count();
    }
    BenchResult result;
    if (meter != nullptr) {
      const EnergyReading energy = meter->stop();
      const int energy_steps = steps + extra_steps;
      result.joules_per_step = energy.joules / energy_steps;
      result.energy_steps = energy_steps;
      result.energy_window_s = energy.seconds;
      result.mean_power_w = energy.mean_power_w;
      result.mean_sm_clock_mhz = energy.mean_sm_clock_mhz;
      if (energy.joules > 0.0)
        result.tokens_per_joule = static_cast<double>(tokens.size()) * energy_steps / energy.joules;
    }
    result.backend = backend->name();
    result.steps = steps;
    result.world_size = world_size;
    result.median_ms = median(ms);
    result.forward_ms = median(forward_ms);
    result.backward_ms = median(backward_ms);
    result.optimizer_ms = median(optimizer_ms);
    const double peak = peak_flops(result.backend);
    const JobThroughput throughput =
        job_throughput(plan, result.median_ms / 1000.0, flops_per_token(model, T), peak > 0.0 ? peak : 1.0);
    result.tokens_per_s = throughput.tokens_per_second;
    result.tokens_per_s_per_gpu = throughput.tokens_per_second_per_gpu;
    result.mfu = peak > 0.0 ? throughput.mfu : 0.0;
    if (device == "cuda") result.memory_gib = device_memory_in_use_gib();
    results.push_back(result);
  }
  return results;
}

}  // namespace coda
