// NVML through dlopen (energy.hpp says why). The declarations below are NVML's C interface as the
// driver exports it: every call returns 0 (NVML_SUCCESS) on success; a device is an opaque handle.
#include "energy.hpp"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <tuple>

namespace coda {

namespace {

using NvmlDevice = struct NvmlDeviceOpaque*;
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;  // nvmlClockType_t NVML_CLOCK_SM

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class Fn>
Fn symbol(void* library, const char* name) {
  return reinterpret_cast<Fn>(dlsym(library, name));
}

}  // namespace

struct EnergyMeter::Nvml {
  void* library = nullptr;
  NvmlDevice device = nullptr;
  int (*shutdown)() = nullptr;
  int (*total_energy)(NvmlDevice, unsigned long long*) = nullptr;  // millijoules
  int (*clock_info)(NvmlDevice, int, unsigned*) = nullptr;         // MHz
  ~Nvml() {
    if (shutdown != nullptr) shutdown();
    if (library != nullptr) dlclose(library);
  }
};

std::unique_ptr<EnergyMeter> EnergyMeter::for_current_device() {
  int cuda_device = 0;
  char bus_id[64] = {};
  if (cudaGetDevice(&cuda_device) != cudaSuccess ||
      cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_device) != cudaSuccess) {
    cudaGetLastError();  // no device: clear the error, make no meter
    return nullptr;
  }
  auto nvml = std::make_unique<Nvml>();
  nvml->library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml->library == nullptr) return nullptr;
  const auto init = symbol<int (*)()>(nvml->library, "nvmlInit_v2");
  const auto by_bus_id = symbol<int (*)(const char*, NvmlDevice*)>(nvml->library, "nvmlDeviceGetHandleByPciBusId_v2");
  nvml->total_energy =
      symbol<int (*)(NvmlDevice, unsigned long long*)>(nvml->library, "nvmlDeviceGetTotalEnergyConsumption");
  nvml->clock_info = symbol<int (*)(NvmlDevice, int, unsigned*)>(nvml->library, "nvmlDeviceGetClockInfo");
  if (init == nullptr || by_bus_id == nullptr || nvml->total_energy == nullptr || nvml->clock_info == nullptr ||
      init() != kNvmlSuccess)
    return nullptr;
  nvml->shutdown = symbol<int (*)()>(nvml->library, "nvmlShutdown");
  unsigned long long mj = 0;
  if (by_bus_id(bus_id, &nvml->device) != kNvmlSuccess || nvml->total_energy(nvml->device, &mj) != kNvmlSuccess)
    return nullptr;  // e.g. a GPU without the energy counter
  return std::unique_ptr<EnergyMeter>(new EnergyMeter(std::move(nvml)));
}

EnergyMeter::EnergyMeter(std::unique_ptr<Nvml> nvml) : nvml_(std::move(nvml)) {}

EnergyMeter::~EnergyMeter() {
  if (sampler_.joinable()) stop();
}

unsigned long long EnergyMeter::energy_mj() const {
  unsigned long long mj = 0;
  nvml_->total_energy(nvml_->device, &mj);
  return mj;
}

unsigned EnergyMeter::sm_clock_mhz() const {
  unsigned mhz = 0;
  return nvml_->clock_info(nvml_->device, kNvmlClockSm, &mhz) == kNvmlSuccess ? mhz : 0;
}

std::pair<unsigned long long, double> EnergyMeter::next_update() const {
  constexpr double kMaxUpdateWait = 0.5;  // seconds: several update periods
  const unsigned long long first = energy_mj();
  const double begin = now_s();
  unsigned long long mj = first;
  double t = begin;
  while (mj == first && t - begin < kMaxUpdateWait) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    mj = energy_mj();
    t = now_s();
  }
  return {mj, t};
}

void EnergyMeter::start() {
  if (sampler_.joinable()) stop();
  clock_sum_ = 0.0;
  clock_samples_ = 0;
  std::tie(start_mj_, start_s_) = next_update();
  sampling_ = true;
  sampler_ = std::thread([this] {
    while (sampling_) {
      if (const unsigned mhz = sm_clock_mhz(); mhz > 0) {
        clock_sum_ += mhz;
        ++clock_samples_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
}

EnergyReading EnergyMeter::stop() {
  sampling_ = false;  // the clock of the work, not of the idle wait for the counter's update
  if (sampler_.joinable()) sampler_.join();
  const auto [end_mj, end_s] = next_update();
  EnergyReading r;
  r.joules = static_cast<double>(end_mj - start_mj_) / 1000.0;
  r.seconds = end_s - start_s_;
  r.mean_power_w = r.seconds > 0.0 ? r.joules / r.seconds : 0.0;
  r.clock_samples = clock_samples_;
  r.mean_sm_clock_mhz = clock_samples_ > 0 ? clock_sum_ / clock_samples_ : 0.0;
  return r;
}

}  // namespace coda
