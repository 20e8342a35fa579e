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

#include <glob.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "background_job.hpp"
#include "checkpoint.hpp"
#include "cuda_backend.hpp"
#include "data.hpp"
#include "dist_plan.hpp"
#include "host_buffer.hpp"
#include "distributed.hpp"
#include "kernels/common/cuda_check.cuh"
#include "prepare.hpp"
#include "rng.hpp"
#include "stop_signal.hpp"

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
// when there is one; --kernels auto is the CODA mode there, or the unfused mode for a model the CODA
// programs do not cover (docs/PERFORMANCE.md says how the modes compare today; `coda bench` times both).
namespace {
bool use_cuda(const std::string& device) { return device == "cuda" || (device == "auto" && cuda_device_available()); }
}  // namespace

void require_device_available(const RunConfig& config) {
  if (config.device == "cuda" && !cuda_device_available())
    throw std::runtime_error("device = cuda, but this machine has no usable CUDA GPU (use --device cpu or auto)");
  if (!use_cuda(config.device) && config.kernels != "auto")
    throw std::invalid_argument("kernels = " + config.kernels + " selects GPU kernels, but the run is on the cpu" +
                                (config.device == "auto" ? " (no GPU found)" : "") +
                                "; leave kernels = auto there, or use --device cuda");
}

std::unique_ptr<Backend> make_backend(const RunConfig& config, Communicator* zero1) {
  require_device_available(config);
  if (use_cuda(config.device))
    return make_cuda_backend(config.model, config.kernels, config.batch_size, config.seq_len,
                             {zero1, config.fp8(), config.deterministic});
  if (zero1 != nullptr) throw std::logic_error("make_backend: ZeRO-1 on the cpu backend (checked earlier)");
  return make_cpu_backend(config.model, config.batch_size, config.seq_len, config.fp8());
}

std::vector<std::pair<std::string, std::string>> available_backends(const std::string& device) {
  if (!use_cuda(device)) return {{"cpu", "auto"}};
  return {{"cuda", "unfused"}, {"cuda", "coda"}};
}

double peak_flops(const std::string& backend_name) {
  return backend_name.rfind("cuda", 0) == 0 ? 989e12 : 0.0;  // H100/H200 dense bf16
}
// ----

namespace {
// The step of a checkpoint directory name "step_N", or -1 for any other name ("step_N.tmp" included).
long checkpoint_step(const std::string& name) {
  const std::string digits = name.rfind("step_", 0) == 0 ? name.substr(5) : "";
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stol(digits);
}
}  // namespace

std::string find_checkpoint(const std::string& path) {
  if (!fs::is_directory(path)) throw std::runtime_error("checkpoint " + path + ": no such directory");
  if (fs::exists(fs::path(path) / "config.json")) return path;
  long newest = -1;
  for (const auto& entry : fs::directory_iterator(path))
    if (entry.is_directory()) newest = std::max(newest, checkpoint_step(entry.path().filename().string()));
  if (newest < 0 && fs::exists(fs::path(path) / "config.toml"))
    throw std::runtime_error("checkpoint " + path +
                             ": this run directory holds no step_N checkpoint (its run stopped before the first "
                             "one); start the run again without --resume");
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

// A run directory blocks a fresh run only when it holds a checkpoint, the one thing --resume needs: a run
// that failed before its first checkpoint leaves config.toml and metrics.jsonl, which a retry replaces.
bool holds_checkpoint(const std::string& out) {
  if (!fs::is_directory(out)) return false;
  for (const auto& entry : fs::directory_iterator(out))
    if (entry.is_directory() && checkpoint_step(entry.path().filename().string()) >= 0) return true;
  return false;
}

// A crash or a signal while a checkpoint was written leaves step_N.tmp behind: nothing reads it, and on a
// nearly full disk it holds the space the next checkpoint needs.
void remove_stale_checkpoint_writes(const fs::path& out) {
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 &&
        checkpoint_step(name.substr(0, name.size() - 4)) >= 0) {
      spdlog::info("removing {}, a checkpoint whose write never finished", entry.path().string());
      fs::remove_all(entry.path());
    }
  }
}

// Keeps the newest `keep` step_N checkpoints of out up to step `written` (the one just written); 0 keeps
// all. Later steps are left alone: they belong to an earlier attempt that ran further than the checkpoint
// this run resumed from, and this run replaces them when it gets there.
void prune_checkpoints(const fs::path& out, int keep, long written) {
  if (keep <= 0) return;
  std::vector<std::pair<long, fs::path>> checkpoints;
  for (const auto& entry : fs::directory_iterator(out)) {
    const long step = checkpoint_step(entry.path().filename().string());
    if (entry.is_directory() && step >= 0 && step <= written) checkpoints.emplace_back(step, entry.path());
  }
  if (checkpoints.size() <= static_cast<size_t>(keep)) return;
  std::sort(checkpoints.begin(), checkpoints.end());
  for (size_t i = 0; i + keep < checkpoints.size(); ++i) fs::remove_all(checkpoints[i].second);
}

void write_file_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    errno = 0;
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    file << text;
    if (!file.flush())
      throw std::runtime_error(tmp.string() + ": write failed: " + (errno != 0 ? std::strerror(errno) : "I/O error"));
  }
  fs::rename(tmp, path);
}

// The stop signal every rank agrees on: the largest received by any (one Max all-reduce of a scalar per
// step), so all ranks leave the loop after the same step; one process asks nobody.
int agreed_stop_signal(const StopOnSignal& signals, Communicator* comm) {
  const int local = signals.pending();
  if (comm == nullptr) return local;
  return static_cast<int>(comm->all_reduce_scalar(static_cast<float>(local), ReduceOp::Max));
}

// sample_every: 32 tokens after the first 8 of the step's last micro-batch, drawn with a generator of
// their own (from seed and step) so that sampling leaves the run's random stream untouched.
std::string training_sample(Backend& backend, const RunConfig& config, const std::vector<int32_t>& batch, int step) {
  const size_t prompt = std::min<size_t>(8, static_cast<size_t>(config.seq_len));
  const std::vector<int32_t> context(batch.begin(), batch.begin() + static_cast<long>(prompt));
  const bool bytes = config.model.vocab_size == kByteVocabSize;
  std::string text;
  for (int32_t token : context) text += token_text(token, bytes, text.empty());
  text += bytes ? " | " : " |";
  Rng rng(config.seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(step)));
  generate(backend, config.model.vocab_size, context, 32, 1.0f, 0, config.seq_len, rng,
           [&](int32_t token) { text += token_text(token, bytes, false); });
  return text;
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

RunConfig effective_run_config(const RunConfig& requested) {
  RunConfig config = requested;
  if (!config.init_from.empty()) {  // resuming, the checkpoint has that shape and init_from may be gone
    const std::string& source = config.resume.empty() ? config.init_from : config.resume;
    config.model = load_model_config(find_checkpoint(source));
    if (config.seq_len > config.model.max_seq_len)
      throw std::invalid_argument("seq_len (" + std::to_string(config.seq_len) + ") must be <= max_seq_len (" +
                                  std::to_string(config.model.max_seq_len) + ") of the model in " + source);
  }
  config.val_data = resolve_val_data(config.val_data, config.train_data);
  config.validate();
  return config;
}

std::string resolve_val_data(const std::string& val_data, const std::string& train_data) {
  if (val_data != "auto") return val_data;
  const fs::path train(train_data);
  const std::string name = train.filename().string();
  const size_t at = name.find("train");
  const std::string beside =
      at == std::string::npos ? ""
                              : (train.parent_path() / (name.substr(0, at) + "val" + name.substr(at + 5))).string();
  const auto matches_files = [](const std::string& pattern) {
    glob_t matches{};
    const bool found = !pattern.empty() && ::glob(pattern.c_str(), 0, nullptr, &matches) == 0 && matches.gl_pathc > 0;
    ::globfree(&matches);
    return found;
  };
  // Without training data there is nothing to validate; the training loader names the missing files.
  if (matches_files(beside) || !matches_files(train_data)) return beside;
  throw std::invalid_argument("val_data = \"auto\" validates on the val shards beside train_data, but " +
                              (beside.empty() ? "train_data \"" + train_data + "\" has no \"train\" in its file name"
                                              : "no file matches \"" + beside + "\"") +
                              "; set val_data to a glob of validation shards, or to \"\" for no validation");
}

namespace {
// A resumed run's FP8 scaling state: continued when the run is fp8 with the same history; a bf16 checkpoint
// resumed in fp8 starts with a calibration step, and an fp8 one resumed in bf16 or with block scaling (which
// keeps no state) leaves its state unused.
void load_fp8_state(Backend& backend, const RunConfig& config, const Fp8ScalingState& state, const std::string& dir) {
  if (!config.fp8()) {
    if (!state.empty()) spdlog::info("resume {}: precision = bf16, the checkpoint's fp8 scaling state is not used", dir);
    return;
  }
  if (!config.fp8()->any_tensor()) {
    if (!state.empty())
      spdlog::info("resume {}: fp8_scaling = block keeps no state, the checkpoint's per-tensor scaling state is not used",
                   dir);
    return;
  }
  if (state.empty()) spdlog::info("resume {}: no fp8 scaling state (a bf16 run); the first step calibrates", dir);
  try {
    backend.load_fp8_state(state);
  } catch (const std::invalid_argument& e) {
    const std::string hint = state.history != config.fp8_history
                                 ? " (resume with fp8_history = " + std::to_string(state.history) + ")"
                                 : "";
    throw std::runtime_error("resume " + dir + ": " + e.what() + hint);
  }
}
}  // namespace

TrainResult train(const RunConfig& requested, Communicator* comm) {
  const RunConfig config = effective_run_config(requested);
  const int world_size = comm != nullptr ? comm->world_size() : 1, rank = comm != nullptr ? comm->rank() : 0;
  const bool root = rank == 0;
  require_data_parallel_device(config, world_size);
  if (config.zero1 && comm == nullptr)
    throw std::invalid_argument("zero1 = true needs a communicator, also on one rank (coda train makes one)");
  const ModelConfig& model = config.model;
  const BatchPlan plan = batch_plan(config, world_size);
  const int B = plan.micro_batch, T = plan.seq_len, A = plan.grad_accum;

  TrainResult result;
  result.val_loss = std::numeric_limits<float>::quiet_NaN();
  Checkpoint resumed;
  std::string resume_dir;
  if (!config.resume.empty()) {
    resume_dir = find_checkpoint(config.resume);
    resumed = load_checkpoint(resume_dir);
    if (!resumed.has_trainer_state)
      throw std::runtime_error("resume " + resume_dir + ": no trainer state (a bare model cannot be resumed)");
    require_same_model(resumed.model, model, resume_dir);
    if (resumed.state.step >= config.steps) {
      spdlog::info("nothing to do: {} is already at step {} of {} (raise --steps to train longer)", resume_dir,
                   resumed.state.step, config.steps);
      result.step = resumed.state.step;
      result.checkpoint = resume_dir;
      return result;
    }
  } else if (root && holds_checkpoint(config.out)) {
    throw std::runtime_error("out " + config.out + " already holds a run with checkpoints; continue it with --resume " +
                             config.out + " or choose another --out");
  }
  Checkpoint initial;
  if (!config.init_from.empty() && resume_dir.empty()) initial = load_checkpoint(find_checkpoint(config.init_from));

  Rng rng(config.seed);
  const uint64_t init_seed = rng.next_u64(), data_seed = rng.next_u64();
  DataLoader train_data(config.train_data, B, T, rank, world_size, true, data_seed, model.vocab_size);
  std::unique_ptr<DataLoader> val_data;
  if (!config.val_data.empty()) {  // every rank checks it, so a bad shard stops all of them before step 1
    auto loader = std::make_unique<DataLoader>(config.val_data, B, T, 0, 1, false, 0, model.vocab_size);
    if (root) val_data = std::move(loader);
  }

  std::unique_ptr<Backend> backend = make_backend(config, config.zero1 ? comm : nullptr);
  const ParamLayout layout = make_param_layout(model);
  int step = 0;
  if (resumed.has_trainer_state) {
    backend->load_params(resumed.params.data());
    backend->load_optimizer_state(resumed.adam_m.data(), resumed.adam_v.data());
    load_fp8_state(*backend, config, resumed.state.fp8, resume_dir);
    step = resumed.state.step;
    train_data.restore(continued_position(resumed.state.data_position, train_data, plan));
    rng.set_state(resumed.state.rng);
  } else if (!initial.params.empty()) {
    backend->load_params(initial.params.data());
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
    remove_stale_checkpoint_writes(out);
    if (!resumed.has_trainer_state && fs::exists(metrics_path) && fs::file_size(metrics_path) > 0)
      spdlog::warn("out {}: replacing the metrics of an earlier run that stopped before its first checkpoint",
                   config.out);
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
  if (!initial.params.empty())
    spdlog::info("initialised from {} (fresh optimizer state and schedule)", config.init_from);

  // Called on every rank; under ZeRO-1 the reads gather the shards and need every rank, otherwise the other
  // ranks have nothing to do. The state is copied to the host here; rank 0 then writes the files on
  // `writer`'s thread while training goes on (the previous write is waited for first, so one set of
  // copies is in flight). Returns the directory being written (empty on ranks other than 0); it is
  // complete once writer.wait() returns. The host copies are allocated once and reused by every save
  // (the write that read them has finished by then): llama3.2-1b's are 15 GB, whose allocation would
  // otherwise stall every checkpoint; on a GPU they are page-locked, so the copies run at the link's speed.
  HostFloats saved_params, saved_m, saved_v;  // before writer: its job reads them until it ends
  BackgroundJob writer;
  const auto save = [&](int at_step) -> std::string {
    if (!root && !config.zero1) return {};
    if (root) writer.wait();
    saved_params.resize(layout.total);
    saved_m.resize(layout.total);
    saved_v.resize(layout.total);
    backend->read_params(saved_params.data());
    backend->read_optimizer_state(saved_m.data(), saved_v.data());
    if (!root) return {};
    TrainerState state;
    state.step = at_step;
    state.data_position = train_data.position();
    state.rng = rng.state();
    state.run_config = effective;
    state.fp8 = backend->read_fp8_state();
    const std::string dir = (out / ("step_" + std::to_string(at_step))).string();
    writer.start([dir, model, state, out, keep = config.keep_checkpoints, params = saved_params.data(),
                  m = saved_m.data(), v = saved_v.data()] {
      save_checkpoint(dir, model, params, m, v, state);
      spdlog::info("checkpoint {}", dir);
      prune_checkpoints(out, keep, state.step);
    });
    return dir;
  };

  result.step = step;
  const int first_step = step;
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T), targets(tokens.size());
  const double tokens_per_step = static_cast<double>(plan.tokens_per_step());
  const double flops = flops_per_token(model, T), peak = peak_flops(backend->name());
  double window_ms = 0.0;
  int window_steps = 0;
  using clock = std::chrono::steady_clock;
  const auto run_start = clock::now();
  const StopOnSignal signals;
  if (root && std::getenv("OMPI_COMM_WORLD_RANK") != nullptr) {
    const std::string warning = mpirun_stop_warning(std::getenv("OMPI_MCA_odls_base_sigkill_timeout"));
    if (!warning.empty()) spdlog::warn("{}", warning);
  }
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
    const int stop = last ? 0 : agreed_stop_signal(signals, comm);  // the last step ends the run anyway
    if (!root) {
      if (checkpoint_due || stop != 0) save(step);
      if (stop != 0) {
        result.stop_signal = stop;
        break;
      }
      continue;
    }

    nlohmann::json record = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}, {"ms", ms},
                             {"tokens_per_s", tokens_per_s}};
    if (val_data && config.val_every > 0 && (step % config.val_every == 0 || last)) {
      result.val_loss = mean_loss(*backend, *val_data, config.val_batches, B, T);
      record["val_loss"] = result.val_loss;
    }
    metrics << record.dump() << "\n" << std::flush;
    if (!metrics) throw std::runtime_error(metrics_path.string() + ": write failed: " + std::strerror(errno));

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
    if (config.sample_every > 0 && step % config.sample_every == 0)
      spdlog::info("step {:>6}/{} | sample: {}", step, config.steps, training_sample(*backend, config, tokens, step));
    if (checkpoint_due || stop != 0) result.checkpoint = save(step);
    if (stop != 0) {
      result.stop_signal = stop;
      writer.wait();
      spdlog::warn("stopped by {} after step {}: checkpoint {}; continue with --resume {}", stop_signal_name(stop),
                   step, result.checkpoint, config.out);
      break;
    }
  }
  writer.wait();
  if (root) {
    const double seconds = std::chrono::duration<double>(clock::now() - run_start).count();
    spdlog::info("{} {} steps ({} to {}) in {}, {:.0f} tokens; final loss {:.4f}, val_loss {}",
                 result.stop_signal != 0 ? "stopped after" : "done:", step - first_step, first_step, step,
                 duration_text(seconds), (step - first_step) * tokens_per_step, result.loss,
                 std::isnan(result.val_loss) ? std::string("-") : fmt::format("{:.4f}", result.val_loss));
  }
  return result;
}

float evaluate(const EvalOptions& options) {
  const std::string dir = find_checkpoint(options.checkpoint);
  const Checkpoint checkpoint = load_checkpoint(dir);
  RunConfig run;
  if (checkpoint.has_trainer_state) run = parse_config_text(checkpoint.state.run_config, dir + "/trainer_state.json");
  run.model = checkpoint.model;
  run.device = options.device;
  if (!use_cuda(run.device)) run.kernels = "auto";  // the training run's GPU kernels mean nothing here
  if (!options.data.empty()) {
    run.val_data = options.data;
  } else {
    try {
      run.val_data = resolve_val_data(run.val_data, run.train_data);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("eval: no --data given, and ") + e.what());
    }
  }
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
