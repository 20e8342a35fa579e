// The energy meter (src/energy.hpp) on a real GPU: over about 300 ms of a busy kernel it reads a
// positive energy whose mean power and SM clock lie in the ranges a GPU of this class can have, an idle
// interval costs less per second than the busy one, and every interval runs from one counter update to
// another: even an empty one spans an update and reads energy (two plain reads a moment apart read the
// same counter value almost always).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "src/energy.hpp"
#include "tests/gpu_test_util.cuh"

namespace {

__global__ void spin(float* out, int iterations) {
  float x = threadIdx.x * 1e-3f;
  for (int i = 0; i < iterations; ++i) x = fmaf(x, 0.999f, 1e-3f);
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

TEST(EnergyMeter, ReadsTheEnergyOfBusyAndIdleIntervals) {
  SKIP_WITHOUT_GPU();
  const auto meter = coda::EnergyMeter::for_current_device();
  if (meter == nullptr) GTEST_SKIP() << "this GPU or driver has no readable energy counter";
  coda::test::DeviceBuffer<float> out(1024 * 256);
  meter->start();
  const auto begin = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - begin < std::chrono::milliseconds(300)) {
    spin<<<1024, 256>>>(out.get(), 1 << 16);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  const coda::EnergyReading busy = meter->stop();
  EXPECT_GT(busy.joules, 0.0);
  EXPECT_GT(busy.seconds, 0.25);
  EXPECT_GT(busy.mean_power_w, 20.0);
  EXPECT_LT(busy.mean_power_w, 1500.0);
  EXPECT_GT(busy.clock_samples, 5);
  EXPECT_GT(busy.mean_sm_clock_mhz, 100.0);
  EXPECT_LT(busy.mean_sm_clock_mhz, 3000.0);

  meter->start();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const coda::EnergyReading idle = meter->stop();
  EXPECT_LT(idle.mean_power_w, busy.mean_power_w);

  for (int i = 0; i < 3; ++i) {
    meter->start();
    const coda::EnergyReading empty = meter->stop();
    EXPECT_GT(empty.joules, 0.0) << "interval " << i;
    EXPECT_GT(empty.seconds, 0.0) << "interval " << i;
    EXPECT_LT(empty.seconds, 1.0) << "interval " << i;
  }
}

}  // namespace
