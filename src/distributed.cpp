// Launch detection, bootstrap of the NCCL unique id, and the NCCL communicator with its watchdog; see
// distributed.hpp for the rules. MPI is used for nothing but MPI_Init, one broadcast of 128 bytes, the
// node-local rank, MPI_Abort and MPI_Finalize.
#include "distributed.hpp"

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <thread>

#ifdef CODA_HAVE_MPI
#include <mpi.h>
#endif

#include "kernels/common/cuda_check.cuh"

namespace coda {

namespace {

// What abort_job() needs when no DistContext is at hand (an exception escaped init_distributed).
int g_rank = 0;
int g_world_size = 1;
bool g_mpi_initialized = false;

constexpr char kIdFileMagic[8] = {'C', 'O', 'D', 'A', 'N', 'C', 'C', 'L'};

const char* env_value(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

int parse_int(const std::string& text, const std::string& what) {
  size_t used = 0;
  int value = 0;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw std::runtime_error(what + " = \"" + text + "\" is not an integer");
  return value;
}

int env_int(const char* name, const char* launcher) {
  const char* value = env_value(name);
  if (value == nullptr) throw std::runtime_error(std::string(launcher) + " launch: environment variable " + name + " is not set");
  return parse_int(value, std::string("environment variable ") + name);
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

ncclDataType_t nccl_type(DType type) { return type == DType::F32 ? ncclFloat32 : ncclBfloat16; }
ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Average: break;
  }
  return ncclAvg;
}

void write_id_file(const std::string& path, const ncclUniqueId& id, int world_size) {
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(kIdFileMagic, sizeof kIdFileMagic);
    out.write(reinterpret_cast<const char*>(&world_size), sizeof world_size);
    out.write(reinterpret_cast<const char*>(&id), sizeof id);
    if (!out) throw std::runtime_error("bootstrap: cannot write " + temp + " (CODA_BOOTSTRAP_DIR)");
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("bootstrap: cannot rename " + temp + " to " + path + ": " + std::strerror(errno));
}

ncclUniqueId read_id_file(const std::string& path, int world_size, int rank, double timeout_s) {
  const Clock::time_point start = Clock::now();
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      char magic[sizeof kIdFileMagic] = {};
      int file_world_size = 0;
      ncclUniqueId id{};
      in.read(magic, sizeof magic);
      in.read(reinterpret_cast<char*>(&file_world_size), sizeof file_world_size);
      in.read(reinterpret_cast<char*>(&id), sizeof id);
      if (!in || std::memcmp(magic, kIdFileMagic, sizeof magic) != 0)
        throw std::runtime_error("bootstrap: " + path + " is not a CODA NCCL id file");
      if (file_world_size != world_size)
        throw std::runtime_error("bootstrap: " + path + " was written by a launch of " + std::to_string(file_world_size) +
                                 " ranks, this one has " + std::to_string(world_size) +
                                 " (stale file? CODA_RUN_ID must be unique per launch)");
      return id;
    }
    if (seconds_since(start) > timeout_s)
      throw std::runtime_error("bootstrap: rank " + std::to_string(rank) + " waited " + std::to_string(timeout_s) +
                               " s for rank 0 to write " + path +
                               " (is CODA_BOOTSTRAP_DIR on a file system shared by every node? did rank 0 start?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Rank 0 creates the id; every rank returns the same one.
ncclUniqueId share_unique_id(const DistContext& context, double timeout_s) {
  ncclUniqueId id{};
  if (context.rank == 0) {
    const ncclResult_t result = ncclGetUniqueId(&id);
    if (result != ncclSuccess)
      throw std::runtime_error(std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(result) + " (" +
                               ncclGetLastError(nullptr) + ")");
  }
  switch (context.bootstrap) {
    case Bootstrap::Local:
      if (context.world_size != 1) throw std::logic_error("Bootstrap::Local with more than one rank");
      break;
    case Bootstrap::Mpi:
#ifdef CODA_HAVE_MPI
      MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
#else
      throw std::logic_error("Bootstrap::Mpi in a build without MPI");
#endif
      break;
    case Bootstrap::File:
      if (context.rank == 0)
        write_id_file(context.bootstrap_file, id, context.world_size);
      else
        id = read_id_file(context.bootstrap_file, context.world_size, context.rank, timeout_s);
      break;
  }
  return id;
}

}  // namespace

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::Mpirun: return "mpirun";
    case Launcher::Slurm: return "srun";
    case Launcher::None: break;
  }
  return "none";
}

const char* bootstrap_name(Bootstrap bootstrap) {
  switch (bootstrap) {
    case Bootstrap::Mpi: return "mpi";
    case Bootstrap::File: return "file";
    case Bootstrap::Local: break;
  }
  return "local";
}

int slurm_tasks_on_node(const std::string& tasks_per_node, int node_index) {
  const std::string what = "SLURM_STEP_TASKS_PER_NODE = \"" + tasks_per_node + "\"";
  int nodes = 0, tasks = 0;
  size_t pos = 0;
  do {  // the whole list is parsed so that a malformed one fails for every node
    size_t comma = tasks_per_node.find(',', pos);
    if (comma == std::string::npos) comma = tasks_per_node.size();
    const std::string item = tasks_per_node.substr(pos, comma - pos);
    const size_t paren = item.find("(x");
    int count = 0, repeat = 1;
    if (paren == std::string::npos) {
      count = parse_int(item, what);
    } else {
      if (item.back() != ')') throw std::runtime_error(what + " is malformed at \"" + item + "\"");
      count = parse_int(item.substr(0, paren), what);
      repeat = parse_int(item.substr(paren + 2, item.size() - paren - 3), what);
    }
    if (count < 1 || repeat < 1) throw std::runtime_error(what + " has a non-positive entry \"" + item + "\"");
    if (node_index >= nodes && node_index < nodes + repeat) tasks = count;
    nodes += repeat;
    pos = comma + 1;
  } while (pos <= tasks_per_node.size());
  if (tasks == 0)
    throw std::runtime_error(what + " lists " + std::to_string(nodes) + " nodes, none for node index " +
                             std::to_string(node_index) + " (SLURM_NODEID)");
  return tasks;
}

LaunchInfo detect_launch() {
  LaunchInfo info;
  if (env_value("OMPI_COMM_WORLD_SIZE") != nullptr) {
    const char* name = "mpirun (Open MPI)";
    info = {Launcher::Mpirun, env_int("OMPI_COMM_WORLD_RANK", name), env_int("OMPI_COMM_WORLD_SIZE", name),
            env_int("OMPI_COMM_WORLD_LOCAL_RANK", name), env_int("OMPI_COMM_WORLD_LOCAL_SIZE", name)};
  } else if (env_value("PMI_SIZE") != nullptr && env_value("MPI_LOCALNRANKS") != nullptr) {
    const char* name = "mpirun (Hydra)";
    info = {Launcher::Mpirun, env_int("PMI_RANK", name), env_int("PMI_SIZE", name), env_int("MPI_LOCALRANKID", name),
            env_int("MPI_LOCALNRANKS", name)};
  } else if (env_value("SLURM_STEP_NUM_TASKS") != nullptr && env_value("SLURM_PROCID") != nullptr) {
    const char* name = "srun";
    const char* tasks_per_node = env_value("SLURM_STEP_TASKS_PER_NODE");
    if (tasks_per_node == nullptr) tasks_per_node = env_value("SLURM_TASKS_PER_NODE");
    if (tasks_per_node == nullptr)
      throw std::runtime_error("srun launch: neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set");
    const char* node_id = env_value("SLURM_NODEID");
    info = {Launcher::Slurm, env_int("SLURM_PROCID", name), env_int("SLURM_STEP_NUM_TASKS", name),
            env_int("SLURM_LOCALID", name),
            slurm_tasks_on_node(tasks_per_node, node_id ? parse_int(node_id, "SLURM_NODEID") : 0)};
  } else {
    return info;
  }
  const std::string where = std::string(launcher_name(info.launcher)) + " launch: rank " + std::to_string(info.rank) +
                            " of " + std::to_string(info.world_size) + ", local rank " +
                            std::to_string(info.local_rank) + " of " + std::to_string(info.local_size);
  if (info.world_size < 1 || info.rank < 0 || info.rank >= info.world_size)
    throw std::runtime_error(where + ": the rank is not in [0, world size)");
  if (info.local_size < 1 || info.local_size > info.world_size || info.local_rank < 0 ||
      info.local_rank >= info.local_size)
    throw std::runtime_error(where + ": the local rank or local size is inconsistent");
  return info;
}

int select_device(const LaunchInfo& launch, int visible_gpus, bool one_gpu_per_process) {
  if (visible_gpus <= 0 && launch.world_size == 1) return -1;
  if (launch.local_size <= visible_gpus) return launch.local_rank;
  if (one_gpu_per_process && visible_gpus == 1) return 0;
  throw std::runtime_error(std::to_string(launch.local_size) + " ranks on this node but only " +
                           std::to_string(visible_gpus) + " GPUs (one process per GPU: start at most " +
                           std::to_string(visible_gpus) + " processes per node, or check CUDA_VISIBLE_DEVICES)");
}

Bootstrap choose_bootstrap(const LaunchInfo& launch, bool have_mpi, const std::string& bootstrap_dir) {
  const bool several = launch.world_size > 1;
  const std::string ranks = std::to_string(launch.world_size) + " ranks";
  switch (launch.launcher) {
    case Launcher::None:
      return Bootstrap::Local;
    case Launcher::Mpirun:
      if (have_mpi) return Bootstrap::Mpi;
      if (!several) return Bootstrap::Local;
      if (!bootstrap_dir.empty()) return Bootstrap::File;
      throw std::runtime_error("started by mpirun with " + ranks +
                               ", but this build has no MPI (CMake did not find it): install MPI and rebuild, or "
                               "set CODA_BOOTSTRAP_DIR to a directory every rank can read and write");
    case Launcher::Slurm:
      if (!several) return Bootstrap::Local;
      if (!bootstrap_dir.empty()) return Bootstrap::File;
      if (have_mpi) return Bootstrap::Mpi;
      throw std::runtime_error("started by srun with " + ranks +
                               ", but this build has no MPI: set CODA_BOOTSTRAP_DIR to a directory on a file "
                               "system shared by every node, or rebuild with MPI and use srun --mpi=pmix");
  }
  throw std::logic_error("choose_bootstrap: unknown launcher");
}

std::string bootstrap_file_path(const std::string& bootstrap_dir) {
  std::string key;
  if (const char* run_id = env_value("CODA_RUN_ID")) {
    key = run_id;
  } else if (const char* job = env_value("SLURM_JOB_ID")) {
    const char* step = env_value("SLURM_STEP_ID");
    key = std::string(job) + "." + (step ? step : "0");
  } else if (const char* ns = env_value("PMIX_NAMESPACE")) {
    key = ns;
  } else if (const char* job_id = env_value("OMPI_MCA_ess_base_jobid")) {
    key = job_id;
  } else {
    throw std::runtime_error("CODA_BOOTSTRAP_DIR is set but nothing identifies this launch: set CODA_RUN_ID to a "
                             "value unique to the launch (same on every rank)");
  }
  for (char& c : key)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_')) c = '_';
  return bootstrap_dir + "/coda-nccl-id." + key;
}

double nccl_timeout_seconds() {
  const char* value = env_value("CODA_NCCL_TIMEOUT_S");
  if (value == nullptr) return 300.0;
  char* end = nullptr;
  const double seconds = std::strtod(value, &end);
  if (end == value || *end != '\0' || !(seconds > 0.0))
    throw std::invalid_argument(std::string("CODA_NCCL_TIMEOUT_S = \"") + value + "\" must be a number of seconds > 0");
  return seconds;
}

DistContext init_distributed() {
  const LaunchInfo launch = detect_launch();
  DistContext context;
  context.rank = launch.rank;
  context.world_size = launch.world_size;
  context.local_rank = launch.local_rank;
  context.local_size = launch.local_size;
  context.launcher = launch.launcher;
  g_rank = launch.rank;
  g_world_size = launch.world_size;

  if (launch.launcher != Launcher::None) {
    int visible_gpus = 0;
    if (cudaGetDeviceCount(&visible_gpus) != cudaSuccess) {
      visible_gpus = 0;
      cudaGetLastError();  // clear the sticky "no device" status
    }
    const char* visible_list = env_value("CUDA_VISIBLE_DEVICES");
    const bool one_gpu = visible_list != nullptr && std::strchr(visible_list, ',') == nullptr;
    context.device = select_device(launch, visible_gpus, one_gpu);
  }

#ifdef CODA_HAVE_MPI
  const bool have_mpi = true;
#else
  const bool have_mpi = false;
#endif
  const char* bootstrap_dir = env_value("CODA_BOOTSTRAP_DIR");
  context.bootstrap = choose_bootstrap(launch, have_mpi, bootstrap_dir ? bootstrap_dir : "");
  if (context.bootstrap == Bootstrap::File) context.bootstrap_file = bootstrap_file_path(bootstrap_dir);

#ifdef CODA_HAVE_MPI
  if (context.bootstrap == Bootstrap::Mpi) {
    int already = 0;
    MPI_Initialized(&already);
    if (!already) {
      MPI_Init(nullptr, nullptr);
      context.mpi_initialized = true;
      g_mpi_initialized = true;
    }
    int mpi_rank = 0, mpi_size = 0, local_rank = 0, local_size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, mpi_rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    if (mpi_size != launch.world_size || mpi_rank != launch.rank || local_rank != launch.local_rank ||
        local_size != launch.local_size)
      throw std::runtime_error(
          std::string("MPI sees rank ") + std::to_string(mpi_rank) + " of " + std::to_string(mpi_size) +
          " (local " + std::to_string(local_rank) + " of " + std::to_string(local_size) + ") but " +
          launcher_name(launch.launcher) + " says rank " + std::to_string(launch.rank) + " of " +
          std::to_string(launch.world_size) + " (local " + std::to_string(launch.local_rank) + " of " +
          std::to_string(launch.local_size) +
          "): under srun use --mpi=pmix (or pmi2), or set CODA_BOOTSTRAP_DIR to bootstrap without MPI");
  }
#endif

  if (context.device >= 0) CUDA_CHECK(cudaSetDevice(context.device));
  return context;
}

void finalize_distributed(DistContext& context) {
#ifdef CODA_HAVE_MPI
  if (context.mpi_initialized) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
#endif
  context.mpi_initialized = false;
  g_mpi_initialized = false;
}

void abort_job(const std::string& message) {
  std::fprintf(stderr, "[rank %d/%d] %s\n", g_rank, g_world_size, message.c_str());
  std::fflush(stderr);
#ifdef CODA_HAVE_MPI
  if (g_mpi_initialized && g_world_size > 1) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::exit(EXIT_FAILURE);
}

Communicator::Communicator(const DistContext& context)
    : rank_(context.rank), world_size_(context.world_size), timeout_s_(nccl_timeout_seconds()) {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  if (context.device >= 0) CUDA_CHECK(cudaSetDevice(context.device));
  const ncclUniqueId id = share_unique_id(context, timeout_s_);
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  CUDA_CHECK(cudaMalloc(&scalar_, sizeof(float)));
  CUDA_CHECK(cudaMallocHost(&host_scalar_, sizeof(float)));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t result = ncclCommInitRankConfig(&comm_, world_size_, id, rank_, &config);
  if (comm_ == nullptr)
    throw std::runtime_error("[rank " + std::to_string(rank_) + "/" + std::to_string(world_size_) +
                             "] ncclCommInitRankConfig failed: " + ncclGetErrorString(result));
  check(result, "ncclCommInitRankConfig");
  // Every rank has read the id once the communicator exists.
  if (context.bootstrap == Bootstrap::File && rank_ == 0) std::remove(context.bootstrap_file.c_str());
}

Communicator::~Communicator() {
  if (comm_ != nullptr && !aborted_) {
    ncclResult_t state = ncclCommFinalize(comm_);
    const Clock::time_point start = Clock::now();
    while (state == ncclInProgress && seconds_since(start) < timeout_s_) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
    }
    if (state == ncclSuccess)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }
  if (host_scalar_ != nullptr) cudaFreeHost(host_scalar_);
  if (scalar_ != nullptr) cudaFree(scalar_);
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void Communicator::fail(const std::string& what) {
  std::string detail;
  if (comm_ != nullptr && !aborted_) {
    detail = ncclGetLastError(comm_);
    ncclCommAbort(comm_);
    aborted_ = true;
  }
  throw std::runtime_error("[rank " + std::to_string(rank_) + "/" + std::to_string(world_size_) + "] NCCL " + what +
                           (detail.empty() ? "" : " (" + detail + ")") + "; communicator aborted");
}

void Communicator::wait_until_ready(const char* call) {
  const Clock::time_point start = Clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm_, &state);
    if (query != ncclSuccess) fail(std::string("ncclCommGetAsyncError failed after ") + call);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail(std::string(call) + " failed: " + ncclGetErrorString(state));
    if (seconds_since(start) > timeout_s_)
      fail(std::string(call) + " did not complete within " + std::to_string(timeout_s_) +
           " s (CODA_NCCL_TIMEOUT_S): another rank probably failed or never started");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Communicator::check(ncclResult_t result, const char* call) {
  if (aborted_) throw std::runtime_error(std::string(call) + " on an aborted NCCL communicator");
  if (result == ncclSuccess) return;
  if (result == ncclInProgress) return wait_until_ready(call);
  fail(std::string(call) + " failed: " + ncclGetErrorString(result));
}

void Communicator::all_reduce(float* data, size_t count, ReduceOp op) {
  check(ncclAllReduce(data, data, count, ncclFloat32, nccl_op(op), comm_, stream_), "ncclAllReduce");
}

void Communicator::reduce(const float* send, float* recv, size_t count, int root, ReduceOp op) {
  check(ncclReduce(send, recv, count, ncclFloat32, nccl_op(op), root, comm_, stream_), "ncclReduce");
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t shard_count, DType type, ReduceOp op) {
  check(ncclReduceScatter(send, recv, shard_count, nccl_type(type), nccl_op(op), comm_, stream_), "ncclReduceScatter");
}

void Communicator::all_gather(const void* send, void* recv, size_t shard_count, DType type) {
  check(ncclAllGather(send, recv, shard_count, nccl_type(type), comm_, stream_), "ncclAllGather");
}

void Communicator::broadcast(void* data, size_t count, DType type, int root) { broadcast(data, data, count, type, root); }

void Communicator::broadcast(const void* send, void* recv, size_t count, DType type, int root) {
  check(ncclBroadcast(send, recv, count, nccl_type(type), root, comm_, stream_), "ncclBroadcast");
}

void Communicator::group_start() { check(ncclGroupStart(), "ncclGroupStart"); }
void Communicator::group_end() { check(ncclGroupEnd(), "ncclGroupEnd"); }

void Communicator::wait_event(cudaEvent_t event) { CUDA_CHECK(cudaStreamWaitEvent(stream_, event, 0)); }

void Communicator::join(cudaStream_t compute) {
  CUDA_CHECK(cudaEventRecord(done_, stream_));
  CUDA_CHECK(cudaStreamWaitEvent(compute, done_, 0));
}

void Communicator::wait(cudaStream_t stream) {
  const Clock::time_point start = Clock::now();
  for (;;) {
    const cudaError_t status = cudaStreamQuery(stream);
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) fail("ncclCommGetAsyncError failed while waiting");
    if (state != ncclSuccess && state != ncclInProgress)
      fail(std::string("asynchronous error: ") + ncclGetErrorString(state));
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) fail(std::string("wait: CUDA error ") + cudaGetErrorString(status));
    if (seconds_since(start) > timeout_s_)
      fail("collectives did not complete within " + std::to_string(timeout_s_) +
           " s (CODA_NCCL_TIMEOUT_S): another rank probably failed or stalled");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

float Communicator::all_reduce_scalar(float value, ReduceOp op) {
  *host_scalar_ = value;
  CUDA_CHECK(cudaMemcpyAsync(scalar_, host_scalar_, sizeof(float), cudaMemcpyHostToDevice, stream_));
  all_reduce(scalar_, 1, op);
  CUDA_CHECK(cudaMemcpyAsync(host_scalar_, scalar_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return *host_scalar_;
}

}  // namespace coda
