// HostFloats: kept across resizes to the same size (what lets every checkpoint reuse one set of copies),
// reallocated on a new size, page-locked exactly where a GPU is present.
#include <gtest/gtest.h>

#include "host_buffer.hpp"
#include "kernels/common/cuda_check.cuh"

TEST(HostFloats, KeptAcrossSameSizeResizesAndPageLockedOnAGpu) {
  coda::HostFloats buffer;
  EXPECT_EQ(buffer.data(), nullptr);
  buffer.resize(1000);
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(buffer.size(), 1000u);
  EXPECT_EQ(buffer.pinned(), coda::cuda_device_available());
  for (size_t i = 0; i < buffer.size(); ++i) buffer.data()[i] = static_cast<float>(i);
  float* const first = buffer.data();
  buffer.resize(1000);
  EXPECT_EQ(buffer.data(), first);
  EXPECT_EQ(buffer.data()[999], 999.0f);
  buffer.resize(10);
  EXPECT_EQ(buffer.size(), 10u);
  buffer.data()[9] = 1.0f;
  buffer.resize(0);
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_FALSE(buffer.pinned());
}
