// The definition of GemmTileKernel::launch (gemm_launch.cuh): the GEMM kernel (gemm_kernel.cuh) of one
// layout, output type, program and tile. Included only where kernels are compiled: the generated
// translation units of the trainer's programs (CMakeLists.txt, CODA_GEMM_PROGRAMS; each one explicitly
// instantiates GemmTileKernel for one program and tile) and the test files with programs of their own,
// which instantiate it implicitly through gemm_run.
#pragma once
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/gemm/gemm_kernel.cuh"
#include "kernels/gemm/gemm_launch.cuh"

namespace coda {
namespace gemm_detail {

// The kernel configuration of a tile: its shape and schedule (gemm.cuh, GemmTile), the layout (the operands'
// majorness and types), the output type, and the program's shared-memory needs.
template <GemmLayout kLayout, class OutT, class Program, GemmTile kTile>
struct TileConfig {
  static constexpr bool kPingPong = kTile != GemmTile::Cooperative128x256;
  using type = Config<gemm_tile_m(kTile), gemm_tile_n(kTile), kPingPong, kLayout, OutT, Program::kTileInputs,
                      Program::column_bytes()>;
};

}  // namespace gemm_detail

template <GemmLayout kLayout, class OutT, class Program, GemmTile kTile>
void GemmTileKernel<kLayout, OutT, Program, kTile>::launch(const gemm_detail::Launch& l, const Program& program,
                                                           cudaStream_t stream) {
  using Cfg = typename gemm_detail::TileConfig<kLayout, OutT, Program, kTile>::type;
  auto* kernel = gemm_detail::gemm_kernel<Cfg, Program>;
  static const bool configured = [kernel] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    return true;
  }();
  (void)configured;
  launch_kernel(kernel, after_previous(l.grid, 384, Cfg::kSmemBytes), stream, l.a, l.b, l.d, l.tiles, l.p, program);
}

}  // namespace coda
