// SwiGLU inside the GEMM (forward layout) against its host evaluation with an fp32 output, four values
// of a 2 -> 1 map per staged chunk row (tests/gpu/swiglu_check.cuh; bf16 outputs in gpu_epilogue_swiglu.cu).
#include <gtest/gtest.h>

#include "tests/gpu/swiglu_check.cuh"

namespace {

TEST(GpuEpilogue, SwiGluHalvesTheWidthWithFp32Output) {
  SKIP_WITHOUT_GPU();
  coda::test::swiglu::check_swiglu_program<true>();
}

}  // namespace
