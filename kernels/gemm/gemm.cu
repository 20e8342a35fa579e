// Host side of the hand-written GEMM: tensor maps, schedule, tile choice, and the identity-program
// entry points of gemm.cuh. See gemm_kernel.cuh for the kernel.
//
// Tensor maps (cuTensorMapEncodeTiled, through sm90::tensor_map_encoder(), so no libcuda link is needed):
// 2-D, innermost dimension first, 128B swizzle, zero fill out of bounds. Boxes: K-major operands
// {64 k, BM or BN rows}; MN-major operands {64 m|n, 64 k}; output {128 bytes of columns, 64 rows};
// a program's tile inputs {the output chunk's columns, 64 rows} (bf16: 128 bytes, or 64 with 64B swizzle
// beside a fp32 output).
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/gemm/gemm_launch.cuh"

namespace coda {
namespace gemm_detail {
namespace {

int num_sms() {
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("gemm: " + what);
}

// Row-major [outer, inner] matrix of elem_bytes elements with rows ld elements apart, read or written in
// boxes of [box_outer, box_inner], swizzled by the box's row length (128 or 64 bytes).
CUtensorMap make_map(const void* base, CUtensorMapDataType type, int elem_bytes, long long inner, long long outer,
                     long long ld, int box_inner, int box_outer, const std::string& name) {
  require(reinterpret_cast<uintptr_t>(base) % 16 == 0, name + " must be 16-byte aligned");
  require(ld * elem_bytes % 16 == 0, name + " row stride must be a multiple of 16 bytes (" + std::to_string(ld) +
                                         " elements)");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * elem_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_outer)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = sm90::tensor_map_encoder()(&map, type, 2, const_cast<void*>(base), dims, strides, box,
                                                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                box_inner * elem_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                                             : CU_TENSOR_MAP_SWIZZLE_128B,
                                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("gemm: cuTensorMapEncodeTiled failed for " + name + " (CUresult " +
                             std::to_string(static_cast<int>(r)) + ", " + std::to_string(outer) + " x " +
                             std::to_string(inner) + ")");
  return map;
}

// Number of K ranges per tile: the best product of wave efficiency (units over whole waves of SMs)
// and mainloop share (a unit's epilogue costs about two k-blocks: the reduce-add of a 128 x 256 fp32
// tile). Only splits that leave no K range empty are considered.
int choose_splits(int tiles, int k_blocks, int sms) {
  int best = 1;
  double best_efficiency = 0.0;
  for (int splits = 1; splits <= 64 && splits <= k_blocks; ++splits) {
    const int per_split = (k_blocks + splits - 1) / splits;
    if ((k_blocks + per_split - 1) / per_split != splits) continue;
    const long long units = static_cast<long long>(tiles) * splits;
    const long long waves = (units + sms - 1) / sms;
    const double efficiency = double(units) / double(waves * sms) * per_split / (per_split + 2.0);
    if (efficiency > best_efficiency + 1e-9) best = splits, best_efficiency = efficiency;
  }
  return best;
}

// CODA_GEMM_TILE=coop128x256, pingpong128x128 or pingpong64x256 forces every Auto choice (measurement: the trainer's
// CODA_PROFILE table then shows each program on that tile); unset or empty: the measured rule below.
GemmTile forced_tile() {
  static const GemmTile forced = [] {
    const char* v = std::getenv("CODA_GEMM_TILE");
    if (v == nullptr || *v == '\0') return GemmTile::Auto;
    for (GemmTile t : kGemmTiles)
      if (std::strcmp(v, gemm_tile_name(t)) == 0) return t;
    throw std::invalid_argument(std::string("CODA_GEMM_TILE=") + v +
                                ": expected coop128x256, pingpong128x128 or pingpong64x256");
  }();
  return forced;
}

}  // namespace

Launch prepare(GemmLayout layout, GemmTile tile, bool out_fp32, int cols_per_out, int outs_per_col, void* D,
               const void* A, const void* B, int M, int N, int K, bool accumulate, bool may_split_k,
               const epi::TileSource* sources, int tile_inputs, cudaStream_t stream) {
  require(M > 0 && N > 0 && K > 0, "empty shape M=" + std::to_string(M) + " N=" + std::to_string(N) +
                                       " K=" + std::to_string(K));
  require(N % (8 * cols_per_out) == 0, "N=" + std::to_string(N) + " must be a multiple of " +
                                           std::to_string(8 * cols_per_out));
  const int bm = gemm_tile_m(tile), bn = gemm_tile_n(tile);
  const auto bf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const bool fp8 = gemm_layout_fp8(layout);
  const int block_k = fp8 ? 128 : 64;  // elements of a 128-byte row
  Launch l{};
  if (fp8) {
    l.a = make_map(A, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, K, M, K, 128, bm, "fp8 A");
    l.b = make_map(B, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, K, N, K, 128, bn, "fp8 B");
  } else if (layout == GemmLayout::Wgrad) {
    l.a = make_map(A, bf16, 2, M, K, M, 64, 64, "wgrad dY");
    l.b = make_map(B, bf16, 2, N, K, N, 64, 64, "wgrad X");
  } else {
    l.a = make_map(A, bf16, 2, K, M, K, 64, bm, layout == GemmLayout::Forward ? "forward X" : "dgrad dY");
    if (layout == GemmLayout::Forward)
      l.b = make_map(B, bf16, 2, K, N, K, 64, bn, "forward W");
    else
      l.b = make_map(B, bf16, 2, N, K, N, 64, 64, "dgrad W");
  }
  const int out_bytes = out_fp32 ? 4 : 2;
  const int out_cols = N * outs_per_col / cols_per_out;
  l.d = make_map(D, out_fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : bf16, out_bytes, out_cols, M, out_cols,
                 128 / out_bytes, 64, "output");
  // Tile inputs are read at the output's positions, one staging chunk's columns at a time.
  for (int i = 0; i < tile_inputs; ++i) {
    const std::string name = "tile input " + std::to_string(i);
    require(sources[i].src != nullptr, name + " of the program is missing (tile inputs are numbered from 0)");
    require(sources[i].ld >= out_cols, name + " has row stride " + std::to_string(sources[i].ld) + " < " +
                                           std::to_string(out_cols) + " output columns");
    l.tiles.map[i] = make_map(sources[i].src, bf16, 2, out_cols, M, sources[i].ld, 128 / out_bytes, 64, name);
  }

  Params& p = l.p;
  p.M = M, p.N = N, p.K = K;
  p.k_blocks = (K + block_k - 1) / block_k;
  p.tiles_m = (M + bm - 1) / bm;
  p.tiles_n = (N + bn - 1) / bn;
  p.group_m = 1024 / bm;  // 1024 rows of A per L2 group
  const int tiles = p.tiles_m * p.tiles_n, sms = num_sms();
  // Split-K needs an output that can be summed in pieces (fp32, reduce-add) and a program without
  // reductions or nonlinear maps (may_split_k: the bare GEMM, where the caller allows it).
  p.splits = out_fp32 && may_split_k ? choose_splits(tiles, p.k_blocks, sms) : 1;
  p.kb_per_split = (p.k_blocks + p.splits - 1) / p.splits;
  if (p.splits > 1 && !accumulate) {
    CUDA_CHECK(cudaMemsetAsync(D, 0, static_cast<size_t>(M) * out_cols * out_bytes, stream));
    accumulate = true;
  }
  p.accumulate = accumulate ? 1 : 0;
  const int units = tiles * p.splits;
  l.grid = units < sms ? units : sms;
  return l;
}

void throw_tile_not_compiled(GemmTile tile, const char* program_type) {
  throw std::invalid_argument(std::string("gemm: this build compiles no ") + gemm_tile_name(tile) +
                              " kernel for the program " + profile::type_name(program_type) +
                              " (its tile rule never picks that tile; configure with -DCODA_ALL_TILES=ON to force "
                              "any tile)");
}

std::string gemm_profile_label(GemmLayout layout, GemmTile tile, int M, int N, int K) {
  const char* name = layout == GemmLayout::Forward       ? "fwd"
                     : layout == GemmLayout::Dgrad       ? "dgrad"
                     : layout == GemmLayout::Wgrad       ? "wgrad"
                     : layout == GemmLayout::ForwardE4m3 ? "fp8 e4m3"
                                                         : "fp8 e5m2";
  return std::string("gemm ") + name + " " + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) +
         " " + gemm_tile_name(tile);
}

}  // namespace gemm_detail

// The rule, from measurements of every bare GEMM and every CODA program on each tile (docs/GEMM.md, docs/LOG.md).
// Bare GEMMs: ping-pong 128x128 where the epilogue is a noticeable share of a tile (K up to a few thousand) unless
// N is narrow; the cooperative tile for long K and for the weight gradients of large outputs, ping-pong 128x128
// for those of outputs under 2048 x 2048. Programs: the cooperative tile for short K (K <= 1024), long K
// (K >= 8192) and the two-input LayerNorm backward (three ring stages on the 64x256 tile); ping-pong 128x128 for
// the other narrow forward programs (N = d_model <= 2048, K <= 4096); ping-pong 64x256 for the rest (its
// consumers finish their per-row work before they wait for their turn, gemm_kernel.cuh). The short-K branch is
// chosen by joules, not time: at the power cap the step follows energy, and a gpt2-124m step (d = 768) with
// every program on the cooperative tile spent 44.03 J against 44.99 J with these on ping-pong (H200, docs/PERFORMANCE.md):
// the 64x256 tile streams 1.7x the cooperative tile's operand bytes per FLOP. The 64x256 tile has the
// cooperative tile's N width, so a program's row partial count (gemm_row_partials) is the same on either.
std::vector<GemmTile> gemm_tiles_compiled(GemmLayout layout, GemmEpilogue epilogue) {
  std::vector<GemmTile> tiles;
  for (GemmTile t : kGemmTiles)
    if (gemm_tile_compiled(layout, epilogue, t)) tiles.push_back(t);
  return tiles;
}

GemmTile gemm_choose_tile(GemmLayout layout, int M, int N, int K, GemmEpilogue epilogue) {
  if (gemm_detail::forced_tile() != GemmTile::Auto) return gemm_detail::forced_tile();
  if (epilogue != GemmEpilogue::Bare) {
    if (K <= 1024 || K >= 8192 || epilogue == GemmEpilogue::TwoTileInputs) return GemmTile::Cooperative128x256;
    if (gemm_layout_forward(layout) && N <= 2048 && K <= 4096) return GemmTile::PingPong128x128;
    return GemmTile::PingPong64x256;
  }
  if (layout == GemmLayout::Wgrad)
    return static_cast<int64_t>(M) * N < 2048 * 2048 ? GemmTile::PingPong128x128 : GemmTile::Cooperative128x256;
  if (K >= 8192 || (N <= 1024 && K >= 2048)) return GemmTile::Cooperative128x256;
  return GemmTile::PingPong128x128;
}

int gemm_row_partials(GemmLayout layout, int M, int N, int K) {
  const int bn = gemm_tile_n(gemm_choose_tile(layout, M, N, K, GemmEpilogue::Program));
  return (N + bn - 1) / bn;
}

const char* gemm_tile_name(GemmTile tile) {
  switch (tile) {
    case GemmTile::Cooperative128x256: return "coop128x256";
    case GemmTile::PingPong128x128: return "pingpong128x128";
    case GemmTile::PingPong64x256: return "pingpong64x256";
    case GemmTile::Auto: return "auto";
  }
  return "?";
}

void gemm_forward(__nv_bfloat16* Y, const __nv_bfloat16* X, const __nv_bfloat16* W, int M, int N, int K,
                  cudaStream_t stream, GemmTile tile) {
  gemm_run<GemmLayout::Forward>(tile, Y, X, W, M, N, K, false, epi::Program<>{}, stream);
}

void gemm_dgrad(__nv_bfloat16* dX, const __nv_bfloat16* dY, const __nv_bfloat16* W, int M, int N, int K,
                cudaStream_t stream, GemmTile tile) {
  gemm_run<GemmLayout::Dgrad>(tile, dX, dY, W, M, N, K, false, epi::Program<>{}, stream);
}

void gemm_wgrad(float* dW, const __nv_bfloat16* dY, const __nv_bfloat16* X, int M, int N, int K, bool accumulate,
                cudaStream_t stream, GemmTile tile, GemmKSplit split) {
  gemm_run<GemmLayout::Wgrad>(tile, dW, dY, X, M, N, K, accumulate, epi::Program<>{}, stream, split);
}

template <GemmLayout kLayout, class OutT>
void gemm_fp8(OutT* D, const uint8_t* A, const float* a_dequant, const uint8_t* B, const float* b_dequant, int M,
              int N, int K, bool accumulate, cudaStream_t stream, GemmTile tile) {
  gemm_run_fp8<kLayout>(tile, D, A, a_dequant, B, b_dequant, M, N, K, accumulate, epi::Program<>{}, stream);
}

template void gemm_fp8<GemmLayout::ForwardE4m3, __nv_bfloat16>(__nv_bfloat16*, const uint8_t*, const float*,
                                                                const uint8_t*, const float*, int, int, int, bool,
                                                                cudaStream_t, GemmTile);
template void gemm_fp8<GemmLayout::ForwardE5m2, __nv_bfloat16>(__nv_bfloat16*, const uint8_t*, const float*,
                                                                const uint8_t*, const float*, int, int, int, bool,
                                                                cudaStream_t, GemmTile);
template void gemm_fp8<GemmLayout::ForwardE5m2, float>(float*, const uint8_t*, const float*, const uint8_t*,
                                                        const float*, int, int, int, bool, cudaStream_t, GemmTile);

}  // namespace coda
