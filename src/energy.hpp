// Energy, power and SM clock of a GPU over an interval, read from NVML. On the H200 every training step
// runs at the 700 W power cap, so the clock falls until the power fits: a step then costs about
// 700 W x its time, and its energy is the objective that time follows. NVML's total-energy counter
// (millijoules since the driver loaded) moves in steps: on an H100, 20-step totals of one bench fell on
// values 70 J apart at about 700 W, an update every 100 ms or so. Two plain reads would miss up to a step at
// either end, so start() and stop() each wait for the counter's next update: the interval then runs from one
// update to another and holds exactly the energy the counter counted in it, plus the idle time between the
// last kernel and the update at the end (under one period; bench.cpp makes the interval long enough that
// this stays small). The SM clock is sampled every 10 ms by a thread beside it.
// NVML comes with the driver, not with the toolkit, so it is opened at run time (dlopen of
// libnvidia-ml.so.1) and its few entry points are declared here: the same binary runs on a machine
// without a driver or GPU, where no meter is made.

#pragma once
#include <atomic>
#include <memory>
#include <thread>
#include <utility>

namespace coda {

struct EnergyReading {
  double joules = 0.0;
  double seconds = 0.0;
  double mean_power_w = 0.0;       // joules / seconds
  double mean_sm_clock_mhz = 0.0;  // mean of the samples
  int clock_samples = 0;
};

class EnergyMeter {
 public:
  // The meter of the current CUDA device; nullptr where NVML, the device or its energy counter is missing.
  static std::unique_ptr<EnergyMeter> for_current_device();
  ~EnergyMeter();
  EnergyMeter(const EnergyMeter&) = delete;
  EnergyMeter& operator=(const EnergyMeter&) = delete;

  void start();          // waits for a counter update, starts the clock sampler
  EnergyReading stop();  // waits for a counter update, stops the sampler

  struct Nvml;  // the opened library and the device handle (energy.cpp)

 private:
  explicit EnergyMeter(std::unique_ptr<Nvml> nvml);
  unsigned long long energy_mj() const;
  // The counter's next value and the time it appeared (the current ones after kMaxUpdateWait without one).
  std::pair<unsigned long long, double> next_update() const;
  unsigned sm_clock_mhz() const;

  std::unique_ptr<Nvml> nvml_;
  std::thread sampler_;
  std::atomic<bool> sampling_{false};
  double clock_sum_ = 0.0;
  int clock_samples_ = 0;
  unsigned long long start_mj_ = 0;
  double start_s_ = 0.0;
};

}  // namespace coda
