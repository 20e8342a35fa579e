// gemm_run(): the GEMM of gemm.cuh with an epilogue program. This header holds the host side only: tile
// choice, shape checks, tensor maps, and the call of GemmTileKernel<layout, output, program, tile>::launch,
// defined in gemm_instance.cuh, which only the files that compile kernels include (one generated
// translation unit per program and tile: CMakeLists.txt, CODA_GEMM_PROGRAMS; the tests' own programs in
// their test files). A program with no kernel for the tile is a link error; a tile this build does not
// compile for it (CODA_GEMM_TILE, or a forced tile) a run-time error that names it.
// Details: above gemm_run below; docs/GEMM.md.

#pragma once
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>

#include "kernels/common/kernel_profile.cuh"
#include "kernels/epilogue/epilogue.cuh"
#include "kernels/gemm/gemm.cuh"
#include "kernels/gemm/gemm_params.cuh"

namespace coda {

template <class Program>
constexpr GemmEpilogue gemm_epilogue_of() {
  if constexpr (std::is_same_v<Program, epi::Program<>>) return GemmEpilogue::Bare;
  return Program::kTileInputs >= 2 ? GemmEpilogue::TwoTileInputs : GemmEpilogue::Program;
}

// The kernel of one program on one tile (gemm_instance.cuh defines launch).
template <GemmLayout kLayout, class OutT, class Program, GemmTile kTile>
struct GemmTileKernel {
  static_assert(gemm_tile_compiled(kLayout, gemm_epilogue_of<Program>(), kTile),
                "this build compiles no kernel of this program for this tile (gemm_tile_compiled)");
  static void launch(const gemm_detail::Launch& l, const Program& program, cudaStream_t stream);
};

namespace gemm_detail {

// Validates the shape, builds the tensor maps (operands, output, the program's tile_inputs sources) and
// the schedule (gemm.cu).
Launch prepare(GemmLayout layout, GemmTile tile, bool out_fp32, int cols_per_out, int outs_per_col, void* D,
               const void* A, const void* B, int M, int N, int K, bool accumulate, bool may_split_k,
               const epi::TileSource* sources, int tile_inputs, cudaStream_t stream);

// "gemm fwd 32768x2304x768 pingpong128x128" (the profile's label of a launch).
std::string gemm_profile_label(GemmLayout layout, GemmTile tile, int M, int N, int K);

// The error of a tile that this build compiles no kernel of the program for.
[[noreturn]] void throw_tile_not_compiled(GemmTile tile, const char* program_type);

template <class Program>
using TileLauncher = void (*)(const Launch&, const Program&, cudaStream_t);

// The launch function of the program's kernel on kTile, or nullptr where this build compiles none.
template <GemmLayout kLayout, class OutT, class Program, GemmTile kTile>
constexpr TileLauncher<Program> launcher_if_compiled() {
  if constexpr (gemm_tile_compiled(kLayout, gemm_epilogue_of<Program>(), kTile))
    return &GemmTileKernel<kLayout, OutT, Program, kTile>::launch;
  return nullptr;
}

template <GemmLayout kLayout, class OutT, class Program>
TileLauncher<Program> tile_launcher(GemmTile tile) {
  using T = GemmTile;
  switch (tile) {
    case T::Cooperative128x256: return launcher_if_compiled<kLayout, OutT, Program, T::Cooperative128x256>();
    case T::PingPong128x128: return launcher_if_compiled<kLayout, OutT, Program, T::PingPong128x128>();
    case T::PingPong64x256: return launcher_if_compiled<kLayout, OutT, Program, T::PingPong64x256>();
    case T::Auto: break;
  }
  return nullptr;
}

}  // namespace gemm_detail

// Programs that change the output width store N * kOutsPerCol / kColsPerOut output columns (N / 2 after a
// 2->1 map, 2 N after a 1->2 map). Programs with partial reductions must see whole tiles, so they never
// run split over K (a bare GEMM may, as `split` allows); accumulate = true adds the program's output into D
// (TMA reduce-add). The program's tile inputs (collect_tiles) get tensor maps of their own (bf16, 16-byte
// aligned, row stride a multiple of 8 elements). gemm_run takes the bf16 layouts, gemm_run_fp8 the FP8 ones
// with the operands' dequantization factors (device pointers; the product scales the accumulators before
// the program sees them).
template <GemmLayout kLayout, class OutT, class Program>
void gemm_run_layout(GemmTile tile, OutT* D, const GemmOperand<kLayout>* A, const GemmOperand<kLayout>* B, int M, int N,
                     int K, bool accumulate, const Program& program, cudaStream_t stream, GemmKSplit split,
                     const float* dequant_a, const float* dequant_b) {
  using namespace gemm_detail;
  static_assert(std::is_same_v<OutT, float> || std::is_same_v<OutT, __nv_bfloat16>, "bf16 or fp32 output");
  constexpr GemmEpilogue kEpilogue = gemm_epilogue_of<Program>();
  if (tile == GemmTile::Auto) tile = gemm_choose_tile(kLayout, M, N, K, kEpilogue);
  const TileLauncher<Program> launch = tile_launcher<kLayout, OutT, Program>(tile);
  if (launch == nullptr) throw_tile_not_compiled(tile, typeid(Program).name());
  const profile::Region region(profile::enabled() ? gemm_profile_label(kLayout, tile, M, N, K) + " " +
                                                        profile::type_name(typeid(Program).name())
                                                  : std::string(),
                               profile::Work::Gemm, stream);
  epi::TileSource sources[epi::kMaxTileInputs];
  program.collect_tiles(sources);
  Launch l = prepare(kLayout, tile, std::is_same_v<OutT, float>, Program::kColsPerOut, Program::kOutsPerCol, D, A, B, M,
                     N, K, accumulate, kEpilogue == GemmEpilogue::Bare && split == GemmKSplit::Balanced, sources,
                     Program::kTileInputs, stream);
  l.p.dequant_a = dequant_a;
  l.p.dequant_b = dequant_b;
  launch(l, program, stream);
}

template <GemmLayout kLayout, class OutT, class Program>
void gemm_run(GemmTile tile, OutT* D, const __nv_bfloat16* A, const __nv_bfloat16* B, int M, int N, int K,
              bool accumulate, const Program& program, cudaStream_t stream,
              GemmKSplit split = GemmKSplit::Balanced) {
  static_assert(!gemm_layout_fp8(kLayout), "FP8 layouts run through gemm_run_fp8");
  gemm_run_layout<kLayout>(tile, D, A, B, M, N, K, accumulate, program, stream, split, nullptr, nullptr);
}

template <GemmLayout kLayout, class OutT, class Program>
void gemm_run_fp8(GemmTile tile, OutT* D, const uint8_t* A, const float* a_dequant, const uint8_t* B,
                  const float* b_dequant, int M, int N, int K, bool accumulate, const Program& program,
                  cudaStream_t stream, GemmKSplit split = GemmKSplit::Balanced) {
  static_assert(gemm_layout_fp8(kLayout), "bf16 layouts run through gemm_run");
  if (a_dequant == nullptr || b_dequant == nullptr)
    throw std::invalid_argument("gemm FP8: both dequantization factors are required");
  gemm_run_layout<kLayout>(tile, D, A, B, M, N, K, accumulate, program, stream, split, a_dequant, b_dequant);
}

}  // namespace coda
