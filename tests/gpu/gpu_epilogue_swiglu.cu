// SwiGLU inside the GEMM (forward layout) against its host evaluation, bf16 output stored and
// accumulate-stored: the 2 -> 1 map that halves the width, with an aux store, row sums of squares and a
// column dot (tests/gpu/swiglu_check.cuh; the fp32 output in gpu_epilogue_swiglu_fp32.cu).
#include <gtest/gtest.h>

#include "tests/gpu/swiglu_check.cuh"

namespace {

TEST(GpuEpilogue, SwiGluHalvesTheWidthWithAuxSumSquaresAndColumnDot) {
  SKIP_WITHOUT_GPU();
  coda::test::swiglu::check_swiglu_program<false>();
}

}  // namespace
