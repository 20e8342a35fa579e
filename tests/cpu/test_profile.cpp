// The CODA_PROFILE summary (kernels/common/kernel_profile.cuh): the time per kind of work and the fusion bound,
// total / (total - epilogue work), the most that moving the unfused epilogue operations into GEMM
// epilogues can speed up a step at the same GEMM and attention speeds.
#include <gtest/gtest.h>

#include <string>

#include "kernels/common/kernel_profile.cuh"

namespace {

using coda::profile::work_summary;

TEST(Profile, SummaryGivesEachKindsShareAndTheFusionBound) {
  // GEMMs 30, attention 10, epilogue operations 15, other 5 ms: 60 ms, 45 without the epilogue operations.
  const double ms[coda::profile::kWorkKinds] = {30.0, 10.0, 15.0, 5.0};
  const std::string s = work_summary(ms);
  EXPECT_NE(s.find("GEMMs 30.000 ms (50.0%)"), std::string::npos) << s;
  EXPECT_NE(s.find("attention 10.000 ms (16.7%)"), std::string::npos) << s;
  EXPECT_NE(s.find("unfused epilogue operations 15.000 ms (25.0%)"), std::string::npos) << s;
  EXPECT_NE(s.find("other 5.000 ms (8.3%)"), std::string::npos) << s;
  EXPECT_NE(s.find("at most 1.333x faster"), std::string::npos) << s;
}

TEST(Profile, NoBoundWithoutEpilogueWork) {
  // The coda mode runs no unfused epilogue kernel: nothing left to fuse, no bound line.
  const double ms[coda::profile::kWorkKinds] = {40.0, 10.0, 0.0, 5.0};
  const std::string s = work_summary(ms);
  EXPECT_NE(s.find("unfused epilogue operations 0.000 ms (0.0%)"), std::string::npos) << s;
  EXPECT_EQ(s.find("fusion bound"), std::string::npos) << s;
  const double none[coda::profile::kWorkKinds] = {};
  EXPECT_EQ(work_summary(none), "");
}

}  // namespace
