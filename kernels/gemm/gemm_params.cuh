// What the host hands one launch of the GEMM kernel (gemm_kernel.cuh): the tensor maps, the program's tile
// input maps and the schedule. Kept apart from the kernel so that the files that launch GEMMs (through
// gemm_run, gemm_launch.cuh) never see the kernel's definition and never compile it.
#pragma once
#include <cuda.h>

#include "kernels/epilogue/epilogue.cuh"

namespace coda::gemm_detail {

// Runtime description of one launch (host fills it, every role of every CTA reads it).
struct Params {
  int M, N, K;         // accumulator shape
  int k_blocks;        // ceil(K / kBK): 64 bf16 or 128 FP8 elements per block
  int tiles_m, tiles_n;
  int group_m;         // tile rows per L2 group
  int splits;          // K ranges per tile (1: whole tiles)
  int kb_per_split;    // k-blocks per K range: ceil(k_blocks / splits)
  int accumulate;      // 1: D += result (TMA reduce-add); 0: D = result
  const float* dequant_a;  // FP8 layouts: the operands' dequantization factors (device); null otherwise
  const float* dequant_b;
};

// The tensor maps of a program's tile inputs (unused entries are left zero).
struct TileMaps {
  CUtensorMap map[epi::kMaxTileInputs];
};

struct Launch {
  CUtensorMap a, b, d;
  TileMaps tiles;
  Params p;
  int grid;
};

}  // namespace coda::gemm_detail
