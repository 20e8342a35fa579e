// The hand-written Hopper GEMM (gemm_kernel.cuh) behind a small host API, in the trainer's row-major
// conventions (the same as cublaslt.cuh). The three GEMMs of a linear layer y = x W^T, W [out, in]:
//   forward  Y[M, N]  = X[M, K] W[N, K]^T          bf16 out          (M tokens, N = out, K = in)
//   dgrad    dX[M, N] = dY[M, K] W[K, N]           bf16 out          (M tokens, N = in,  K = out)
//   wgrad    dW[M, N] (+)= dY[K, M]^T X[K, N]      fp32 out          (M = out, N = in,   K tokens)
// Every matrix is dense row-major (leading dimension = its column count). Requirements (TMA): row
// strides multiples of 16 bytes, i.e. K, and the columns of W (dgrad) or of dY and X (wgrad), multiples
// of 8; N a multiple of 8; pointers 16-byte aligned. Any M, N, K tails beyond that are handled.
// gemm_run() (gemm_launch.cuh) is the same GEMM with an epilogue program; the functions here are the
// identity program. A GemmTile may be forced (benchmarks, tests); Auto picks per shape.
// FP8 (gemm_fp8): Hopper's FP8 wgmma reads both operands K-major, so FP8 has the forward layout only,
//   D[M, N] (+)= dq_a dq_b (A[M, K] B[N, K]^T)      A e4m3 or e5m2, B e4m3, fp32 accumulation
// with dq_a, dq_b the operands' dequantization factors (1 / their quantization scales) read from the device
// and applied to the accumulators before the program: a dgrad or wgrad in FP8 is this GEMM on transposed
// FP8 copies of its operands. K a multiple of 16 (16-byte rows); 128 K elements per stage.

#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace coda {

// Forward, Dgrad, Wgrad: bf16 operands as above. ForwardE4m3 (A and B e4m3) and ForwardE5m2 (A e5m2, B
// e4m3): the forward layout on FP8 operands.
enum class GemmLayout { Forward, Dgrad, Wgrad, ForwardE4m3, ForwardE5m2 };
constexpr bool gemm_layout_fp8(GemmLayout layout) {
  return layout == GemmLayout::ForwardE4m3 || layout == GemmLayout::ForwardE5m2;
}
// The layouts whose both operands are K-major (the forward, in bf16 or FP8).
constexpr bool gemm_layout_forward(GemmLayout layout) { return layout == GemmLayout::Forward || gemm_layout_fp8(layout); }
// The element type of a layout's operands.
template <GemmLayout kLayout>
using GemmOperand = std::conditional_t<gemm_layout_fp8(kLayout), uint8_t, __nv_bfloat16>;

// Cooperative128x256: both consumer warpgroups on one 128 x 256 tile (4-stage ring; 3 with two tile
// inputs), for long K (bare GEMMs and programs) and the programs with two tile inputs. PingPong128x128:
// each consumer warpgroup its own 128 x 128 tile (6-stage ring; 5 or 4 with tile inputs), so epilogues
// hide under the other warpgroup's MMAs; for short-K bare GEMMs and the narrow forward programs.
// PingPong64x256: ping-pong on 64 x 256 tiles (4-stage ring; 3 with two tile inputs): each consumer's
// epilogue is exactly a cooperative consumer's (64 rows x 256 columns, per-row work over 256 columns),
// overlapped with the other's MMAs; for the other programs (gemm_choose_tile).
enum class GemmTile { Auto, Cooperative128x256, PingPong128x128, PingPong64x256 };
inline constexpr GemmTile kGemmTiles[] = {GemmTile::Cooperative128x256, GemmTile::PingPong128x128,
                                          GemmTile::PingPong64x256};

// What the epilogue is, for the tile choice: a bare GEMM's store, a program, or a program with two tile
// inputs (whose chunk buffers leave the ping-pong 64x256 tile three ring stages).
enum class GemmEpilogue { Bare, Program, TwoTileInputs };

// The tiles gemm_choose_tile can pick for some shape of this layout and epilogue: the cooperative tile
// always; ping-pong 128x128 for bare GEMMs and forward programs with at most one tile input; ping-pong
// 64x256 for programs with at most one tile input.
constexpr bool gemm_tile_can_be_chosen(GemmLayout layout, GemmEpilogue epilogue, GemmTile tile) {
  switch (tile) {
    case GemmTile::Cooperative128x256: return true;
    case GemmTile::PingPong128x128:
      return epilogue == GemmEpilogue::Bare || (epilogue == GemmEpilogue::Program && gemm_layout_forward(layout));
    case GemmTile::PingPong64x256: return epilogue == GemmEpilogue::Program;
    case GemmTile::Auto: break;
  }
  return false;
}

// The tiles this build compiles a GEMM kernel for: those the rule can pick, or every tile where the build
// is configured with CODA_ALL_TILES (benchmarks and tests of every tile, CODA_GEMM_TILE).
#ifndef CODA_ALL_TILES
#error "CODA_ALL_TILES must be defined (0 or 1) by the build, the same for every file"
#endif
inline constexpr bool kGemmAllTiles = CODA_ALL_TILES != 0;
constexpr bool gemm_tile_compiled(GemmLayout layout, GemmEpilogue epilogue, GemmTile tile) {
  return tile != GemmTile::Auto && (kGemmAllTiles || gemm_tile_can_be_chosen(layout, epilogue, tile));
}
// The compiled tiles as a list (tests and benchmarks loop over it).
std::vector<GemmTile> gemm_tiles_compiled(GemmLayout layout, GemmEpilogue epilogue);

// The tile Auto picks for a GEMM of this shape and epilogue (always one of gemm_tile_can_be_chosen's), or
// the tile CODA_GEMM_TILE forces.
GemmTile gemm_choose_tile(GemmLayout layout, int M, int N, int K, GemmEpilogue epilogue);
// N tile width (row partials of a program come per tile_n columns) and M tile height; the kernel's
// configuration of a tile (gemm_instance.cuh) takes its shape from these too.
constexpr int gemm_tile_n(GemmTile tile) {
  if (tile == GemmTile::Auto) throw std::invalid_argument("gemm_tile_n: GemmTile::Auto has no width, choose a tile");
  return tile == GemmTile::PingPong128x128 ? 128 : 256;
}
constexpr int gemm_tile_m(GemmTile tile) {
  if (tile == GemmTile::Auto) throw std::invalid_argument("gemm_tile_m: GemmTile::Auto has no height, choose a tile");
  return tile == GemmTile::PingPong64x256 ? 64 : 128;
}
// N tiles of the tile Auto picks for a program of this shape: the count of its row partials ([M, count]).
int gemm_row_partials(GemmLayout layout, int M, int N, int K);
const char* gemm_tile_name(GemmTile tile);

void gemm_forward(__nv_bfloat16* Y, const __nv_bfloat16* X, const __nv_bfloat16* W, int M, int N, int K,
                  cudaStream_t stream, GemmTile tile = GemmTile::Auto);
void gemm_dgrad(__nv_bfloat16* dX, const __nv_bfloat16* dY, const __nv_bfloat16* W, int M, int N, int K,
                cudaStream_t stream, GemmTile tile = GemmTile::Auto);
// Whether a GEMM with an fp32 output and no program may split K over several units whose partial tiles the
// copy engine adds into the output (Balanced: where that fills the SMs better; the order of the adds, and
// so the last bits, then vary from run to run), or never (Never: every tile summed by one unit in K order,
// bitwise reproducible).
enum class GemmKSplit { Balanced, Never };

// Split over K (reduce-add of partial tiles) as `split` allows; accumulate = false zeroes dW first then.
void gemm_wgrad(float* dW, const __nv_bfloat16* dY, const __nv_bfloat16* X, int M, int N, int K, bool accumulate,
                cudaStream_t stream, GemmTile tile = GemmTile::Auto, GemmKSplit split = GemmKSplit::Balanced);
// The FP8 GEMM with the identity program: layout ForwardE4m3 or ForwardE5m2, D bf16 (overwritten) or fp32
// (accumulate: D += the product).
template <GemmLayout kLayout, class OutT>
void gemm_fp8(OutT* D, const uint8_t* A, const float* a_dequant, const uint8_t* B, const float* b_dequant, int M,
              int N, int K, bool accumulate, cudaStream_t stream, GemmTile tile = GemmTile::Auto);

}  // namespace coda
