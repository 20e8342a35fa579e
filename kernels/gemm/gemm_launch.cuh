// gemm_run(): the GEMM of gemm.cuh with an epilogue program, instantiated in the caller's translation
// unit (one kernel per layout, tile configuration, output type and program). Include this only from
// .cu files that launch CODA kernels; everything non-template lives in gemm.cu.
//
// Programs that change the output width store N * kOutsPerCol / kColsPerOut output columns (N / 2 after a
// 2->1 map, 2 N after a 1->2 map). Programs with
// partial reductions must see whole tiles, so they never run split over K; accumulate = true adds the
// program's output into D (TMA reduce-add). The program's tile inputs (collect_tiles) get tensor maps of
// their own (bf16, 16-byte aligned, row stride a multiple of 8 elements).
#pragma once
#include <cuda.h>

#include <string>
#include <typeinfo>

#include "kernels/cuda_check.cuh"
#include "kernels/epilogue/epilogue.cuh"
#include "kernels/gemm/gemm.cuh"
#include "kernels/gemm/gemm_kernel.cuh"
#include "kernels/kernel_profile.cuh"
#include "kernels/launch.cuh"

namespace coda {
namespace gemm_detail {

struct Launch {
  CUtensorMap a, b, d;
  TileMaps tiles;
  Params p;
  int grid;
};

// Validates the shape, builds the tensor maps (operands, output, the program's tile_inputs sources) and
// the schedule (gemm.cu).
Launch prepare(GemmLayout layout, GemmTile tile, bool out_fp32, int cols_per_out, int outs_per_col, void* D, const void* A,
               const void* B, int M, int N, int K, bool accumulate, bool identity_program,
               const epi::TileSource* sources, int tile_inputs, cudaStream_t stream);

template <class Cfg, class Program>
void launch(const Launch& l, const Program& program, cudaStream_t stream) {
  auto* kernel = gemm_kernel<Cfg, Program>;
  static const bool configured = [kernel] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    return true;
  }();
  (void)configured;
  launch_kernel(kernel, after_previous(l.grid, 384, Cfg::kSmemBytes), stream, l.a, l.b, l.d, l.tiles, l.p, program);
}

// "gemm fwd 32768x2304x768 pingpong128x128" (the profile's label of a launch).
std::string gemm_profile_label(GemmLayout layout, GemmTile tile, int M, int N, int K);

template <class Program>
constexpr bool is_identity = std::is_same_v<Program, epi::Program<>>;

}  // namespace gemm_detail

template <class Program>
constexpr GemmEpilogue gemm_epilogue_of() {
  if constexpr (gemm_detail::is_identity<Program>) return GemmEpilogue::Bare;
  return Program::kTileInputs >= 2 ? GemmEpilogue::TwoTileInputs : GemmEpilogue::Program;
}

template <GemmLayout kLayout, class OutT, class Program>
void gemm_run(GemmTile tile, OutT* D, const __nv_bfloat16* A, const __nv_bfloat16* B, int M, int N, int K,
              bool accumulate, const Program& program, cudaStream_t stream) {
  using namespace gemm_detail;
  static_assert(std::is_same_v<OutT, float> || std::is_same_v<OutT, __nv_bfloat16>, "bf16 or fp32 output");
  constexpr bool kAKMajor = kLayout != GemmLayout::Wgrad;
  constexpr bool kBKMajor = kLayout == GemmLayout::Forward;
  if (tile == GemmTile::Auto) tile = gemm_choose_tile(kLayout, M, N, K, gemm_epilogue_of<Program>());
  const profile::Region region(profile::enabled() ? gemm_profile_label(kLayout, tile, M, N, K) + " " +
                                                        profile::type_name(typeid(Program).name())
                                                  : std::string(),
                               profile::Work::Gemm, stream);
  epi::TileSource sources[epi::kMaxTileInputs];
  program.collect_tiles(sources);
  const Launch l = prepare(kLayout, tile, std::is_same_v<OutT, float>, Program::kColsPerOut, Program::kOutsPerCol, D,
                           A, B, M, N, K, accumulate, is_identity<Program>, sources, Program::kTileInputs, stream);
  constexpr int kInputs = Program::kTileInputs, kColumnBytes = Program::column_bytes();
  if (tile == GemmTile::Cooperative128x256)
    launch<Config<128, 256, false, kAKMajor, kBKMajor, OutT, kInputs, kColumnBytes>>(l, program, stream);
  else if (tile == GemmTile::PingPong64x256)
    launch<Config<64, 256, true, kAKMajor, kBKMajor, OutT, kInputs, kColumnBytes>>(l, program, stream);
  else
    launch<Config<128, 128, true, kAKMajor, kBKMajor, OutT, kInputs, kColumnBytes>>(l, program, stream);
}

}  // namespace coda
