// The training loop, validation and `coda eval`.
// One optimizer step: zero the gradients; grad_accum micro-batches, each adding the gradient of
// mean_loss / grad_accum; the global L2 norm g and, when grad_clip > 0, an update scaled by
// min(1, grad_clip / g) inside AdamW; one AdamW step at the scheduled learning rate (linear warmup, then
// half a cosine down to lr * min_lr_ratio at the last step).
// One Rng seeded from `seed` draws the initialisation and data-order seeds; a checkpoint holds everything
// the loop's future depends on, so a resumed run reproduces the uninterrupted one on a deterministic
// backend. Nothing is written before every input (config, checkpoint, shards, run directory) is checked.
// Data parallelism and ZeRO-1 (docs/DISTRIBUTED.md): every rank builds the same model, reads slice r of
// each global batch and arms the backend to average gradients in the last micro-batch's backward; rank 0
// alone logs, validates and writes; saving is collective under ZeRO-1.
#include "train.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "checkpoint.hpp"
#include "coda_backend.hpp"
#include "data.hpp"
#include "dist_plan.hpp"
#include "distributed.hpp"
#include "kernels/cuda_check.cuh"
#include "rng.hpp"

namespace coda {

namespace fs = std::filesystem;

float lr_at(const RunConfig& c, int step) {
  if (step < c.warmup_steps) return c.lr * static_cast<float>(step + 1) / static_cast<float>(c.warmup_steps);
  const int decay_steps = std::max(1, c.steps - c.warmup_steps - 1);
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) / decay_steps);
  const double min_lr = static_cast<double>(c.lr) * c.min_lr_ratio;
  return static_cast<float>(min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (c.lr - min_lr));
}

// ---- Backend selection: the only code that knows which backends exist. --device auto takes the GPU
// when there is one; --kernels auto is the CODA mode there (docs/PERFORMANCE.md says how the modes
// compare today; `coda bench` times both).
namespace {
bool use_cuda(const std::string& device) { return device == "cuda" || (device == "auto" && cuda_device_available()); }
}  // namespace

std::unique_ptr<Backend> make_backend(const RunConfig& config, Communicator* zero1) {
  if (use_cuda(config.device)) {
    return make_cuda_backend(config.model, config.kernels == "auto" ? "coda" : config.kernels, config.batch_size,
                             config.seq_len, zero1);
  }
  if (zero1 != nullptr) throw std::logic_error("make_backend: ZeRO-1 on the cpu backend (checked earlier)");
  return make_cpu_backend(config.model, config.batch_size, config.seq_len);
}

std::vector<std::pair<std::string, std::string>> available_backends() {
  if (!use_cuda("auto")) return {{"cpu", "auto"}};
  return {{"cuda", "unfused"}, {"cuda", "coda"}};
}

double peak_flops(const std::string& backend_name) {
  return backend_name.rfind("cuda", 0) == 0 ? 989e12 : 0.0;  // H100/H200 dense bf16
}
// ----

std::string find_checkpoint(const std::string& path) {
  if (!fs::is_directory(path)) throw std::runtime_error("checkpoint " + path + ": no such directory");
  if (fs::exists(fs::path(path) / "config.json")) return path;
  long newest = -1;
  for (const auto& entry : fs::directory_iterator(path)) {
    const std::string name = entry.path().filename().string();
    const std::string digits = name.rfind("step_", 0) == 0 ? name.substr(5) : "";
    if (entry.is_directory() && !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos)
      newest = std::max(newest, std::stol(digits));
  }
  if (newest < 0)
    throw std::runtime_error("checkpoint " + path +
                             ": neither a checkpoint (no config.json) nor a run directory with step_N checkpoints");
  return (fs::path(path) / ("step_" + std::to_string(newest))).string();
}

namespace {

// Mean loss over the first `batches` batches of a sequential loader (fewer when the data is shorter).
float mean_loss(Backend& backend, DataLoader& data, int batches, int B, int T) {
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T), targets(tokens.size());
  const int n = static_cast<int>(std::min<size_t>(batches, data.batches_per_epoch()));
  data.reset();
  double sum = 0.0;
  for (int i = 0; i < n; ++i) {
    data.next_batch(tokens.data(), targets.data());
    sum += backend.forward_loss(tokens.data(), targets.data(), B, T);
  }
  return static_cast<float>(sum / n);
}

// Every model key that differs names itself: the config_to_toml lines of the two shapes are compared.
void require_same_model(const ModelConfig& saved, const ModelConfig& wanted, const std::string& dir) {
  RunConfig a, b;
  a.model = saved;
  b.model = wanted;
  std::istringstream sa(config_to_toml(a)), sb(config_to_toml(b));
  for (std::string la, lb; std::getline(sa, la) && std::getline(sb, lb);)
    if (la != lb)
      throw std::runtime_error("resume " + dir + ": the checkpoint's model has " + la + " but the config has " + lb);
}

bool holds_run(const std::string& out) {
  if (!fs::is_directory(out)) return false;
  if (fs::exists(fs::path(out) / "metrics.jsonl")) return true;
  for (const auto& entry : fs::directory_iterator(out))
    if (entry.path().filename().string().rfind("step_", 0) == 0) return true;
  return false;
}

void write_file_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    file << text;
    if (!file.flush()) throw std::runtime_error(tmp.string() + ": write failed");
  }
  fs::rename(tmp, path);
}

// On resume, metrics.jsonl keeps the lines of the steps the checkpoint includes (a run that went on past
// its last checkpoint before it stopped wrote lines that the resumed run writes again).
void truncate_metrics(const fs::path& path, int step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::string kept;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, false);
    if (!record.is_discarded() && record.value("step", 0) <= step) kept += line + "\n";
  }
  write_file_atomic(path, kept);
}

// The resumed loader position: the saved one when the global batch (world_size * batch_size windows) is
// unchanged, else the one that continues the same stream of windows (rescale_loader_position).
nlohmann::json continued_position(const nlohmann::json& saved, const DataLoader& data, const BatchPlan& plan) {
  const size_t global_batch = static_cast<size_t>(plan.world_size) * static_cast<size_t>(plan.micro_batch);
  // A position without these keys is returned as it is, for DataLoader::restore to name what is missing.
  if (!saved.is_object() || !saved.contains("global_batch") || !saved.contains("epoch") || !saved.contains("batch"))
    return saved;
  const size_t saved_global_batch = saved.at("global_batch").get<size_t>();
  if (saved_global_batch == global_batch) return saved;
  const LoaderPosition from{saved.at("epoch").get<size_t>(), saved.at("batch").get<size_t>()};
  const LoaderPosition to = rescale_loader_position(from, saved_global_batch, global_batch, data.batches_per_epoch());
  spdlog::warn("resume: the global batch changed from {} to {} windows (ranks x batch_size): the data stream "
               "continues at epoch {} batch {} (was epoch {} batch {} of the old size)",
               saved_global_batch, global_batch, to.epoch, to.batch, from.epoch, from.batch);
  nlohmann::json position = saved;
  position["global_batch"] = global_batch;
  position["epoch"] = to.epoch;
  position["batch"] = to.batch;
  return position;
}

std::string duration_text(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char text[32];
  std::snprintf(text, sizeof(text), "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  return text;
}

}  // namespace

void require_data_parallel_device(const RunConfig& config, int world_size) {
  if (config.zero1 && !use_cuda(config.device))
    throw std::invalid_argument("device = " + config.device + (config.device == "auto" ? " (no GPU found)" : "") +
                                ": zero1 = true shards the optimizer state of the cuda backend; use --device "
                                "cuda or leave zero1 off");
  if (world_size > 1 && !use_cuda(config.device))
    throw std::invalid_argument("device = " + config.device + (config.device == "auto" ? " (no GPU found)" : "") +
                                ": data parallelism over " + std::to_string(world_size) +
                                " ranks trains on GPUs only, one per rank; use --device cuda");
}

BatchPlan batch_plan(const RunConfig& config, int world_size) {
  if (config.global_batch > 0)
    return plan_batch_for_global(world_size, config.batch_size, config.seq_len, config.global_batch);
  return plan_batch(world_size, config.batch_size, config.seq_len, config.grad_accum);
}

TrainResult train(const RunConfig& config, Communicator* comm) {
  config.validate();
  const int world_size = comm != nullptr ? comm->world_size() : 1, rank = comm != nullptr ? comm->rank() : 0;
  const bool root = rank == 0;
  require_data_parallel_device(config, world_size);
  if (config.zero1 && comm == nullptr)
    throw std::invalid_argument("zero1 = true needs a communicator, also on one rank (coda train makes one)");
  const ModelConfig& model = config.model;
  const BatchPlan plan = batch_plan(config, world_size);
  const int B = plan.micro_batch, T = plan.seq_len, A = plan.grad_accum;

  Checkpoint resumed;
  std::string resume_dir;
  if (!config.resume.empty()) {
    resume_dir = find_checkpoint(config.resume);
    resumed = load_checkpoint(resume_dir);
    if (!resumed.has_trainer_state)
      throw std::runtime_error("resume " + resume_dir + ": no trainer state (a bare model cannot be resumed)");
    require_same_model(resumed.model, model, resume_dir);
  } else if (root && holds_run(config.out)) {
    throw std::runtime_error("out " + config.out + " already holds a run; continue it with --resume " + config.out +
                             " or choose another --out");
  }

  Rng rng(config.seed);
  const uint64_t init_seed = rng.next_u64(), data_seed = rng.next_u64();
  DataLoader train_data(config.train_data, B, T, rank, world_size, true, data_seed, model.vocab_size);
  std::unique_ptr<DataLoader> val_data;
  if (root && !config.val_data.empty())
    val_data = std::make_unique<DataLoader>(config.val_data, B, T, 0, 1, false, 0, model.vocab_size);

  std::unique_ptr<Backend> backend = make_backend(config, config.zero1 ? comm : nullptr);
  const ParamLayout layout = make_param_layout(model);
  int step = 0;
  if (resumed.has_trainer_state) {
    backend->load_params(resumed.params.data());
    backend->load_optimizer_state(resumed.adam_m.data(), resumed.adam_v.data());
    step = resumed.state.step;
    train_data.restore(continued_position(resumed.state.data_position, train_data, plan));
    rng.set_state(resumed.state.rng);
  } else {
    std::vector<float> params(layout.total);
    init_params(model, layout, init_seed, params.data());
    backend->load_params(params.data());
  }

  const fs::path out(config.out);
  const std::string effective = config_to_toml(config);
  const fs::path metrics_path = out / "metrics.jsonl";
  std::ofstream metrics;
  if (root) {
    fs::create_directories(out);
    write_file_atomic(out / "config.toml", effective);
    if (resumed.has_trainer_state)
      truncate_metrics(metrics_path, step);
    else
      write_file_atomic(metrics_path, "");
    metrics.open(metrics_path, std::ios::app);
  }

  spdlog::info("effective configuration (saved as {}):\n{}", (out / "config.toml").string(), effective);
  spdlog::info("model {}: {} parameters; backend {}; {} training tokens", arch_name(model.arch),
               layout.num_parameters(), backend->name(), train_data.total_tokens());
  spdlog::info("global batch {} sequences = {} ranks x batch_size {} x grad_accum {}; {} tokens per step",
               plan.global_batch(), world_size, B, A, plan.tokens_per_step());
  if (config.zero1) spdlog::info("ZeRO-1: fp32 master weights and AdamW moments sharded over {} ranks", world_size);
  if (!resume_dir.empty()) spdlog::info("resumed from {} at step {}", resume_dir, step);

  // Called on every rank; under ZeRO-1 the reads gather the shards and need every rank, otherwise the other
  // ranks have nothing to do. Returns the directory written (empty on ranks other than 0).
  const auto save = [&](int at_step) -> std::string {
    if (!root && !config.zero1) return {};
    std::vector<float> params(layout.total), m(layout.total), v(layout.total);
    backend->read_params(params.data());
    backend->read_optimizer_state(m.data(), v.data());
    if (!root) return {};
    TrainerState state;
    state.step = at_step;
    state.data_position = train_data.position();
    state.rng = rng.state();
    state.run_config = effective;
    const std::string dir = (out / ("step_" + std::to_string(at_step))).string();
    save_checkpoint(dir, model, params.data(), m.data(), v.data(), state);
    spdlog::info("checkpoint {}", dir);
    return dir;
  };

  TrainResult result;
  result.step = step;
  result.val_loss = std::numeric_limits<float>::quiet_NaN();
  const int first_step = step;
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T), targets(tokens.size());
  const double tokens_per_step = static_cast<double>(plan.tokens_per_step());
  const double flops = flops_per_token(model, T), peak = peak_flops(backend->name());
  double window_ms = 0.0;
  int window_steps = 0;
  using clock = std::chrono::steady_clock;
  while (step < config.steps) {
    const auto start = clock::now();
    const float lr = lr_at(config, step);
    backend->zero_grad();
    float loss = 0.0f;
    for (int micro = 0; micro < A; ++micro) {
      train_data.next_batch(tokens.data(), targets.data());
      if (comm != nullptr && micro == A - 1) backend->average_grads_in_next_backward(*comm);
      loss += backend->forward_backward(tokens.data(), targets.data(), B, T, 1.0f / static_cast<float>(A));
    }
    loss /= static_cast<float>(A);
    if (comm != nullptr) loss = comm->all_reduce_scalar(loss, ReduceOp::Average);
    if (!std::isfinite(loss))
      throw std::runtime_error("step " + std::to_string(step + 1) + ": loss is " + std::to_string(loss) +
                               " (training diverged; try a lower lr)");
    const float norm = backend->grad_norm();
    const float clip = config.grad_clip > 0.0f && norm > config.grad_clip ? config.grad_clip / norm : 1.0f;
    AdamWHyper hyper{lr, config.beta1, config.beta2, config.adam_eps, config.weight_decay};
    backend->adamw_step(hyper, step + 1, clip);
    ++step;
    const double ms = std::chrono::duration<double, std::milli>(clock::now() - start).count();
    const double tokens_per_s = tokens_per_step / (ms / 1000.0);
    result.step = step;
    result.loss = loss;
    const bool last = step == config.steps;
    const bool checkpoint_due = (config.checkpoint_every > 0 && step % config.checkpoint_every == 0) || last;
    if (!root) {
      if (checkpoint_due) save(step);
      continue;
    }

    nlohmann::json record = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}, {"ms", ms},
                             {"tokens_per_s", tokens_per_s}};
    if (val_data && config.val_every > 0 && (step % config.val_every == 0 || last)) {
      result.val_loss = mean_loss(*backend, *val_data, config.val_batches, B, T);
      record["val_loss"] = result.val_loss;
    }
    metrics << record.dump() << "\n" << std::flush;

    window_ms += ms;
    ++window_steps;
    if (step % config.log_every == 0 || last) {
      const double mean_ms = window_ms / window_steps;
      const std::string mfu =
          peak > 0.0 ? fmt::format("{:.1f}%", 100.0 * job_throughput(plan, mean_ms / 1000.0, flops, peak).mfu) : "-";
      spdlog::info("step {:>6}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:.1f} ms | {:.0f} tok/s | MFU {} | ETA {}",
                   step, config.steps, loss, lr, norm, mean_ms, tokens_per_step / (mean_ms / 1000.0), mfu,
                   duration_text((config.steps - step) * mean_ms / 1000.0));
      window_ms = 0.0;
      window_steps = 0;
    }
    if (record.contains("val_loss")) spdlog::info("step {:>6}/{} | val_loss {:.4f}", step, config.steps, result.val_loss);
    if (checkpoint_due) result.checkpoint = save(step);
  }
  if (first_step >= config.steps) spdlog::info("nothing to do: the run is already at step {} of {}", step, config.steps);
  return result;
}

float evaluate(const EvalOptions& options) {
  const std::string dir = find_checkpoint(options.checkpoint);
  const Checkpoint checkpoint = load_checkpoint(dir);
  RunConfig run;
  if (checkpoint.has_trainer_state) run = parse_config_text(checkpoint.state.run_config, dir + "/trainer_state.json");
  run.model = checkpoint.model;
  run.device = options.device;
  if (!options.data.empty()) run.val_data = options.data;
  if (options.batches > 0) run.val_batches = options.batches;
  if (options.batch_size > 0) run.batch_size = options.batch_size;
  if (options.seq_len > 0) run.seq_len = options.seq_len;
  if (run.val_data.empty()) throw std::invalid_argument("eval: no --data given and the checkpoint's run has no val_data");
  run.validate();
  DataLoader data(run.val_data, run.batch_size, run.seq_len, 0, 1, false, 0, run.model.vocab_size);
  std::unique_ptr<Backend> backend = make_backend(run);
  backend->load_params(checkpoint.params.data());
  spdlog::info("eval {} on {}: {} batches of {}x{} tokens, backend {}", dir, run.val_data,
               std::min<size_t>(run.val_batches, data.batches_per_epoch()), run.batch_size, run.seq_len,
               backend->name());
  return mean_loss(*backend, data, run.val_batches, run.batch_size, run.seq_len);
}

}  // namespace coda
