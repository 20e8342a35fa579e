// `coda bench`: wall-clock time of whole training steps (grad_accum forward+backward micro-batches,
// gradient norm, AdamW) of every backend this build and machine can run, on random tokens of the
// configured shape. The first `warmup` steps are not timed; the median of the timed ones is reported
// (robust to the odd slow step on a shared machine). Each timed step ends with one more grad_norm call,
// whose value comes back to the host, so the time includes the AdamW update that a GPU backend queued.
// MFU = flops_per_token * tokens/s / the device's peak (model.hpp counts the FLOPs). A backend that times
// its phases on the device (Backend::last_phase_times) also gets the median forward, backward (summed
// over the micro-batches) and optimizer times of the timed steps.
#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "rng.hpp"
#include "train.hpp"

namespace coda {

std::vector<BenchResult> bench(const RunConfig& config, int steps, int warmup) {
  if (steps < 1) throw std::invalid_argument("steps must be >= 1");
  if (warmup < 0) throw std::invalid_argument("warmup must be >= 0");
  config.validate();
  const ModelConfig& model = config.model;
  const int B = config.batch_size, T = config.seq_len, A = config.grad_accum;
  const ParamLayout layout = make_param_layout(model);
  std::vector<float> params(layout.total);
  init_params(model, layout, config.seed, params.data());
  Rng rng(config.seed);
  std::vector<int32_t> tokens(static_cast<size_t>(A) * B * T), targets(tokens.size());
  for (auto& token : tokens) token = static_cast<int32_t>(rng.below(model.vocab_size));
  for (auto& token : targets) token = static_cast<int32_t>(rng.below(model.vocab_size));

  std::vector<BenchResult> results;
  // --kernels coda|unfused times that mode alone; auto times every mode of this build side by side.
  std::vector<std::pair<std::string, std::string>> backends = available_backends();
  if (config.kernels != "auto") {
    backends.erase(std::remove_if(backends.begin(), backends.end(),
                                  [&](const auto& b) { return b.second != config.kernels; }),
                   backends.end());
    if (backends.empty())
      throw std::invalid_argument("bench: kernels \"" + config.kernels + "\" is not available for " +
                                  arch_name(model.arch) + " on this machine");
  }
  for (const auto& [device, kernels] : backends) {
    RunConfig run = config;
    run.device = device;
    run.kernels = kernels;
    std::unique_ptr<Backend> backend = make_backend(run);
    backend->load_params(params.data());
    std::vector<double> ms, forward_ms, backward_ms, optimizer_ms;
    for (int step = 0; step < warmup + steps; ++step) {
      const auto start = std::chrono::steady_clock::now();
      backend->zero_grad();
      PhaseTimes phases;
      for (int micro = 0; micro < A; ++micro) {
        const size_t at = static_cast<size_t>(micro) * B * T;
        backend->forward_backward(tokens.data() + at, targets.data() + at, B, T, 1.0f / static_cast<float>(A));
        const PhaseTimes micro_phases = backend->last_phase_times();
        phases.forward_ms += micro_phases.forward_ms;
        phases.backward_ms += micro_phases.backward_ms;
      }
      const float norm = backend->grad_norm();
      const float clip = run.grad_clip > 0.0f && norm > run.grad_clip ? run.grad_clip / norm : 1.0f;
      backend->adamw_step({lr_at(run, step), run.beta1, run.beta2, run.adam_eps, run.weight_decay}, step + 1, clip);
      backend->grad_norm();
      if (step >= warmup) {
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
        forward_ms.push_back(phases.forward_ms);
        backward_ms.push_back(phases.backward_ms);
        optimizer_ms.push_back(backend->last_phase_times().optimizer_ms);
      }
    }
    const auto median = [](std::vector<double>& values) {
      std::nth_element(values.begin(), values.begin() + static_cast<long>(values.size() / 2), values.end());
      return values[values.size() / 2];
    };
    BenchResult result;
    result.backend = backend->name();
    result.steps = steps;
    result.median_ms = median(ms);
    result.forward_ms = median(forward_ms);
    result.backward_ms = median(backward_ms);
    result.optimizer_ms = median(optimizer_ms);
    result.tokens_per_s = static_cast<double>(A) * B * T / (result.median_ms / 1000.0);
    const double peak = peak_flops(result.backend);
    result.mfu = peak > 0.0 ? flops_per_token(model, T) * result.tokens_per_s / peak : 0.0;
    results.push_back(result);
  }
  return results;
}

}  // namespace coda
