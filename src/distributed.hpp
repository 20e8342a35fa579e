// Process setup for data parallelism and the NCCL communicator (docs/DISTRIBUTED.md).
// Launch: one process per GPU; rank, world size and local rank come from Open MPI's mpirun, Hydra's
// (MPICH, Intel MPI), Slurm's srun (SLURM_STEP_NUM_TASKS, so that a batch script is one process), or none
// (rank 0 of 1); mpirun is tested first, since inside Slurm it starts its daemons through srun.
// Bootstrap: MPI, or a file in CODA_BOOTSTRAP_DIR, only hands NCCL's unique id from rank 0 to the others
// (choose_bootstrap); every collective afterwards is NCCL's. Rank r of a node uses GPU local_rank (device
// 0 when the launcher binds one GPU per process).
// Faults: communicators are non-blocking; every host wait polls ncclCommGetAsyncError and aborts the
// communicator on an error or after CODA_NCCL_TIMEOUT_S, then abort_job() exits non-zero (MPI_Abort when
// MPI is up). NCCL_NVLS_ENABLE is set to 0 unless the user set it.

#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <string>

namespace coda {

enum class Launcher { None, Mpirun, Slurm };
const char* launcher_name(Launcher launcher);

struct LaunchInfo {
  Launcher launcher = Launcher::None;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;   // index of this process among those on its node
  int local_size = 1;   // processes on this node
};

// Reads the launcher variables listed above from the environment; throws std::runtime_error naming the
// variable when one is malformed or the values are inconsistent (rank >= size, ...).
LaunchInfo detect_launch();

// Slurm's compressed per-node task counts, e.g. "2(x3),1" = 2,2,2,1: the count of node `node_index`.
int slurm_tasks_on_node(const std::string& tasks_per_node, int node_index);

// The CUDA device of this rank, or -1 for a single process on a machine without GPUs (CPU training).
// Throws std::runtime_error "N ranks on this node but only M GPUs" when the node has too few GPUs.
// one_gpu_per_process: the launcher restricted this process to one GPU (CUDA_VISIBLE_DEVICES).
int select_device(const LaunchInfo& launch, int visible_gpus, bool one_gpu_per_process);

enum class Bootstrap { Local, Mpi, File };
const char* bootstrap_name(Bootstrap bootstrap);
// Throws std::runtime_error explaining the fix when more than one rank has no way to share the id.
Bootstrap choose_bootstrap(const LaunchInfo& launch, bool have_mpi, const std::string& bootstrap_dir);
// bootstrap_dir + "/coda-nccl-id." + launch key (see above); throws when no launch key is set.
std::string bootstrap_file_path(const std::string& bootstrap_dir);

// CODA_NCCL_TIMEOUT_S (seconds, > 0), 300 when unset; throws std::invalid_argument on a bad value.
double nccl_timeout_seconds();

struct DistContext {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;
  int device = -1;                   // CUDA device of this rank; -1: not selected (a single process
                                     // without launcher keeps the default device, or has no GPU)
  Launcher launcher = Launcher::None;
  Bootstrap bootstrap = Bootstrap::Local;
  std::string bootstrap_file;        // Bootstrap::File only
  bool mpi_initialized = false;      // MPI_Init was called by init_distributed
  bool is_root() const { return rank == 0; }
};

// Detects the launch, validates it, initialises MPI when it bootstraps, selects this rank's GPU.
DistContext init_distributed();
// MPI_Finalize when init_distributed called MPI_Init. Destroy every Communicator first.
void finalize_distributed(DistContext& context);
// Prints "[rank r/N] message" to stderr and ends the process with a non-zero status; with MPI up and
// several ranks it calls MPI_Abort so the launcher stops the others too.
[[noreturn]] void abort_job(const std::string& message);

enum class ReduceOp { Sum, Average, Max };
enum class DType { F32, BF16 };

// One NCCL communicator over all ranks, with its own CUDA stream. Construction is collective (every rank
// constructs it). All collectives are enqueued on stream() and return at once; the caller orders them
// after compute with wait_event() and orders later compute after them with join(). Any NCCL failure
// aborts the communicator and throws std::runtime_error.
class Communicator {
 public:
  explicit Communicator(const DistContext& context);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  cudaStream_t stream() const { return stream_; }

  // In place over `count` fp32 values (a gradient bucket).
  void all_reduce(float* data, size_t count, ReduceOp op);
  // recv (count values on `root`, unused elsewhere) = op over ranks of send; recv may equal send.
  void reduce(const float* send, float* recv, size_t count, int root, ReduceOp op);
  // send holds world_size * shard_count values; recv gets this rank's shard of op over ranks. In place
  // when recv == send + rank * shard_count (elements).
  void reduce_scatter(const void* send, void* recv, size_t shard_count, DType type, ReduceOp op);
  // recv (world_size * shard_count values) = the shards of all ranks in rank order. In place when
  // send == recv + rank * shard_count (elements).
  void all_gather(const void* send, void* recv, size_t shard_count, DType type);
  void broadcast(void* data, size_t count, DType type, int root);
  // recv (count values, every rank, root included) = send of root; send is read on root only.
  void broadcast(const void* send, void* recv, size_t count, DType type, int root);
  // Calls between group_start() and group_end() are issued as one NCCL group (e.g. the per-owner
  // reduces of one bucket under ZeRO-1).
  void group_start();
  void group_end();

  // The communication stream waits for `event` (recorded on a compute stream) before later collectives.
  void wait_event(cudaEvent_t event);
  // `compute` waits for every collective enqueued so far.
  void join(cudaStream_t compute);
  // The host waits for `stream` to drain, polling NCCL's async error with the timeout (the watchdog).
  void wait(cudaStream_t stream);
  void synchronize() { wait(stream_); }
  // op over ranks of one host value (logged loss, validation loss); synchronises.
  float all_reduce_scalar(float value, ReduceOp op);

 private:
  void check(ncclResult_t result, const char* call);
  void wait_until_ready(const char* call);
  [[noreturn]] void fail(const std::string& what);

  int rank_ = 0;
  int world_size_ = 1;
  double timeout_s_ = 300.0;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;  // recorded by join()
  float* scalar_ = nullptr;       // device scratch of all_reduce_scalar
  float* host_scalar_ = nullptr;  // pinned, so the copy back is asynchronous and the watchdog waits for it
};

}  // namespace coda
