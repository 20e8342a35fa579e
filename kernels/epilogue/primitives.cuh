// The primitives that transform the values of a fragment: row stages, row and column broadcasts, tile
// loads, elementwise and pairwise maps, auxiliary stores, the row pick of cross-entropy, the scaled
// subtraction of the norms and the SwiGLU backward. A primitive has three hooks, begin_rows (per row
// block and N tile), visit (per Frag, in column order) and end_rows (per-row reductions, partials
// written); Primitive gives the empty ones.

#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/common/fp8_format.cuh"
#include "kernels/epilogue/fragment.cuh"
#include "kernels/epilogue/functions.cuh"
#include "kernels/epilogue/operands.cuh"

namespace coda::epi {

// Empty hooks; each primitive overrides the ones it needs. kColsPerOut: accumulator columns per output
// column after this primitive (2 for a 2->1 map); kOutsPerCol: output columns per accumulator column
// (2 for a 1->2 map); kTileInputs: 1 + the highest tile input it reads (0: none).
// kVisits: whether it works on fragments (false for a RowStage). stage_rows: see RowStage.
struct Primitive : NoTiles {
  static constexpr int kColsPerOut = 1;
  static constexpr int kOutsPerCol = 1;
  static constexpr bool kVisits = true;
  static constexpr bool kBatchesGroups = false;  // gathers four column groups on the GPU (kBatchGroups)
  // The output column (at the primitive's place in the program) from which on it masks values, beyond
  // the accumulator's N: RowReduce's col_end (the LM head's vocabulary bound). Tiles before every such
  // end of the program are interior (Program::acc_column_end, Frag::interior), so their masks fold.
  CODA_HD int column_end() const { return kNoColumnEnd; }
  CODA_HD void stage_rows(RowCtx&) const {}
  CODA_HD void begin_rows(const RowCtx&) {}
  CODA_HD void visit(Frag&, const RowCtx&) {}
  template <class Lanes>
  CODA_HD void end_rows(const RowCtx&, const Lanes&) {}
};

// Row stage: finishes Stat's kValues row values once per row (stat(row, values); 0 on rows >= M) into
// ctx.staged for the primitives after it, which read value k as RowOf<Staged<k>> (the LayerNorm
// statistics and backward coefficients, each read by several primitives: finished once instead of once
// per reader, norm_stats.cuh). Its stat's loads are all issued before their sums.
template <class Stat>
struct RowStage : Primitive {
  static constexpr bool kVisits = false;
  static_assert(Stat::kValues <= RowCtx::kMaxStaged, "RowCtx::kMaxStaged staged row values at most");
  Stat stat;
  CODA_HD explicit RowStage(const Stat& s) : stat(s) {}
  CODA_HD void stage_rows(RowCtx& ctx) const {
    CODA_UNROLL for (int s = 0; s < RowCtx::kMaxSlots; ++s) if (ctx.has_slot(s)) {
      float values[Stat::kValues] = {};
      if (ctx.rows[s] < ctx.M) stat(ctx.rows[s], values);
      CODA_UNROLL for (int k = 0; k < Stat::kValues; ++k) ctx.staged[k][s] = values[k];
    }
  }
};

// Row broadcast: v = op(v, x[row]) for a row operand x (operands.cuh): a loaded vector (RowVector: RMSNorm
// rstd, LayerNorm mean, ...) or a statistic finished from partials as the rows begin (norm_stats.cuh).
template <class Op, class X = RowVector>
struct RowBroadcast : Primitive {
  static constexpr int kTileInputs = X::kTileInputs;
  static constexpr int kColumnBytes = X::kColumnBytes;
  X x;
  template <class V>
  CODA_HD explicit RowBroadcast(const V& v) : x(v) {}
  void collect_tiles(TileSource* sources) const { x.collect_tiles(sources); }
  CODA_HD void begin_rows(const RowCtx& ctx) { x.begin_rows(ctx); }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    float xs[Frag::kMaxWidth];
    x.load(f, ctx, xs);
    for_values(f, [&](int i) { f.v[i] = Op()(f.v[i], xs[i]); });
  }
};

// Column broadcast: v = op(v, vec[output column]) (bias, gamma: T = bf16 parameters; weight-derived
// vectors: T = float).
template <class Op, class T = float>
struct ColBroadcast : Primitive {
  static constexpr int kColumnBytes = ColVectorOf<T>::kColumnBytes;
  ColVectorOf<T> vec;
  CODA_HD explicit ColBroadcast(const T* v) : vec(v) {}
  CODA_HD void begin_rows(const RowCtx& ctx) { vec.begin_rows(ctx); }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    float xs[Frag::kMaxWidth];
    vec.load(f, ctx, xs);
    for_values(f, [&](int i) { f.v[i] = Op()(f.v[i], xs[i]); });
  }
};

// Tile load: v = op(v, src[row, output column]) for tile input kSlot (residual stream, saved
// pre-activations). ld: row stride of src in elements.
template <class Op, int kSlot = 0>
struct TileLoad : Primitive {
  static constexpr int kTileInputs = kSlot + 1;
  TileOf<kSlot> tile;
  CODA_HD TileLoad(const __nv_bfloat16* s, int l) : tile{s, l} {}
  void collect_tiles(TileSource* sources) const { tile.collect_tiles(sources); }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    float xs[Frag::kMaxWidth];
    tile.load(f, ctx, xs);
    for_values(f, [&](int i) { f.v[i] = Op()(f.v[i], xs[i]); });
  }
};

// Elementwise map, 1 -> 1 (GELU, ...).
template <class F>
struct Elementwise : Primitive {
  F fn;
  CODA_HD explicit Elementwise(const F& f = F()) : fn(f) {}
  CODA_HD void visit(Frag& f, const RowCtx&) {
    for_values(f, [&](int i) { f.v[i] = fn(f.v[i]); });
  }
};

// Pairwise map of the adjacent pair (v0, v1): 2 -> 2 (RoPE) or 2 -> 1 (SwiGLU). Needs a full pair.
template <class F>
struct Pairwise : Primitive {
  static constexpr int kColsPerOut = 2 / F::kOut;
  F fn;
  CODA_HD explicit Pairwise(const F& f = F()) : fn(f) {}
  CODA_HD void begin_rows(const RowCtx& ctx) { fn.begin_rows(ctx); }
  CODA_HD void visit(Frag& f, const RowCtx&) {
    float out[2];
    fn(f, f.v[0], f.v[1], out);
    f.v[0] = out[0];
    if constexpr (F::kOut == 2) f.v[1] = out[1];
    f.width = F::kOut;
    f.stride *= kColsPerOut;
  }
};

// Auxiliary store of the current values (e.g. the pre-activation kept for backward) to dst[row, output
// column], row stride ld. The main output is stored by the GEMM after the program.
// GPU, bf16 pairs on interior tiles: the four lanes of a quad hold a row's 8 columns of each group, one
// 32-bit pair each. One 4-byte store per fragment had a warp write 8 rows x 16 bytes per instruction
// (half sectors), and cost nearly half the bare GEMM's time again at gpt2's fc shape (bench_gemm
// --epilogues, "aux store only"). So a slot's pairs of a batch of four groups (kBatchGroups) are kept, transposed across the
// quad in two butterfly rounds of two shuffles, after which lane l holds the 8 columns of the batch's
// group l, and stored 16 bytes per lane: 8 rows x 64 contiguous bytes per warp instruction. Edge tiles and
// other widths store per fragment. bf16 rows must be 16-byte aligned (ld a multiple of 8).
template <class T>
struct StoreAux : Primitive {
  static constexpr bool kBatchesGroups = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kBatchGroups == 4, "the quad transpose gives each of a quad's four lanes one group of the batch");
  T* dst;
  int ld;
  uint32_t pending[2][kBatchGroups] = {};  // GPU, bf16: the slot's packed pairs of the current batch
  CODA_HD StoreAux(T* d, int l) : dst(d), ld(l) {
#if !defined(__CUDA_ARCH__)
    if (std::is_same_v<T, __nv_bfloat16> && (l % 8 != 0 || reinterpret_cast<uintptr_t>(d) % 16 != 0))
      throw std::invalid_argument("StoreAux<bf16>: rows must be 16-byte aligned (ld " + std::to_string(l) +
                                  " must be a multiple of 8, the matrix 16-byte aligned)");
#endif
  }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
#if defined(__CUDA_ARCH__)
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (f.interior && f.width == 2 && f.stride == 1 && f.expand == 1) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(f.v[0], f.v[1]);
        pending[f.slot][group_in_batch(f)] = *reinterpret_cast<const uint32_t*>(&pair);
        if (ends_batch(f)) store_four_groups(f);
        return;
      }
    }
#endif
    if (in_columns(f, ctx) && in_rows(f, ctx))
      store_values(dst + static_cast<size_t>(f.row) * ld + out_col(f), f.width, f.v);
  }
#if defined(__CUDACC__)
  // Round `d` (1, 2) of the quad transpose: the lanes whose bit d is set trade their pairs of groups
  // without that bit for their partner's pairs of groups with it.
  __device__ static void transpose_round(uint32_t (&w)[kBatchGroups], int lane_in_quad, int d) {
    const bool high = (lane_in_quad & d) != 0;
#pragma unroll
    for (int g = 0; g < kBatchGroups; ++g)
      if ((g & d) == 0) {
        const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? w[g] : w[g + d], d);
        if (high)
          w[g] = got;
        else
          w[g + d] = got;
      }
  }
  // After the slot's fourth group (fragment f): lane l of the quad stores the 8 columns of group l.
  __device__ void store_four_groups(const Frag& f) {
    const int lane_in_quad = (f.col >> 1) & 3;  // f.col = n0 + 8 group + 2 lane_in_quad
    uint32_t(&w)[kBatchGroups] = pending[f.slot];
    transpose_round(w, lane_in_quad, 1);
    transpose_round(w, lane_in_quad, 2);
    // The batch's first column (f.col is this lane's column of the fourth group), then this lane's group.
    const int first_col = f.col - 2 * lane_in_quad - 8 * (kBatchGroups - 1) + 8 * lane_in_quad;
    *reinterpret_cast<uint4*>(dst + static_cast<size_t>(f.row) * ld + first_col) = make_uint4(w[0], w[1], w[2], w[3]);
  }
#endif
};

// Auxiliary store of operand X's values (not the current ones, which pass on unchanged), in StoreAux's
// layout: a tensor that the program derives from its inputs for a later GEMM (the final LayerNorm's
// output over its row scale, for the LM head's weight gradient).
template <class T, class X>
struct StoreAuxOf : StoreAux<T> {
  static constexpr int kTileInputs = X::kTileInputs;
  static constexpr int kColumnBytes = X::kColumnBytes;
  X x;
  CODA_HD StoreAuxOf(const X& x_, T* d, int l) : StoreAux<T>(d, l), x(x_) {}
  void collect_tiles(TileSource* sources) const { x.collect_tiles(sources); }
  CODA_HD void begin_rows(const RowCtx& ctx) { x.begin_rows(ctx); }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    Frag values = f;
    x.load(f, ctx, values.v);
    StoreAux<T>::visit(values, ctx);
  }
};

// The satfinite FP8 conversion with a tensor's delayed-scaling scale, read from the device once per row
// block: fp8(v * scale) in kFormat (round to nearest even, saturating; src/fp8.hpp is its specification, and
// CUDA's conversion runs on the host and the GPU alike). The FP8 stores below are built on it.
template <Fp8Format kFormat>
struct Fp8Quantizer : Primitive {
  static constexpr __nv_fp8_interpretation_t kInterpretation = kFormat == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  const float* scale_ptr;
  float scale = 1.0f;
  CODA_HD explicit Fp8Quantizer(const float* s) : scale_ptr(s) {}
  CODA_HD void begin_rows(const RowCtx&) { scale = *scale_ptr; }
  CODA_HD uint8_t quantize(float v) const { return __nv_cvt_float_to_fp8(v * scale, __NV_SATFINITE, kInterpretation); }
};

// FP8 store of the current values for a later FP8 GEMM (docs/FP8.md): dst[row, output column] =
// fp8(v * scale) (Fp8Quantizer); the values pass on unchanged. A pair is one two-byte store (rows and the
// matrix 2-byte aligned: ld even). Its amax partials come from a RowReduce<AbsMax> beside it.
template <Fp8Format kFormat>
struct StoreFp8 : Fp8Quantizer<kFormat> {
  uint8_t* dst;
  int ld;
  CODA_HD StoreFp8(uint8_t* d, int l, const float* s) : Fp8Quantizer<kFormat>(s), dst(d), ld(l) {
#if !defined(__CUDA_ARCH__)
    if (l % 2 != 0 || reinterpret_cast<uintptr_t>(d) % 2 != 0)
      throw std::invalid_argument("StoreFp8: rows must be 2-byte aligned (ld " + std::to_string(l) + " must be even)");
#endif
  }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    if (!(in_columns(f, ctx) && in_rows(f, ctx))) return;
    uint8_t* p = dst + static_cast<size_t>(f.row) * ld + out_col(f);
    if (f.width == 2) {
      const float s = this->scale;
      const __nv_fp8x2_storage_t pair =
          __nv_cvt_float2_to_fp8x2(make_float2(f.v[0] * s, f.v[1] * s), __NV_SATFINITE, this->kInterpretation);
      memcpy(p, &pair, sizeof(pair));
      return;
    }
    for_values(f, [&](int i) { p[i] = this->quantize(f.v[i]); });
  }
};

// Transposed FP8 store for the operand that a later FP8 GEMM reads along this GEMM's rows (the weight
// gradient's, K = the tokens: Hopper's FP8 wgmma takes both operands K-major): dst[output column, row] =
// fp8(v * scale), as StoreFp8 otherwise (the same conversion and scale, amax partials from a RowReduce<AbsMax>,
// the values pass on). The copy's rows are K-major operand rows, so they must be 16-byte aligned (ld a
// multiple of 16) for the tensor map that reads them. One byte store per value: the eight lanes that hold a
// column's rows in a warp write eight adjacent bytes, so a store instruction writes four 8-byte pieces; a tile
// transposed through shared memory would store whole rows instead.
template <Fp8Format kFormat>
struct StoreFp8Transposed : Fp8Quantizer<kFormat> {
  uint8_t* dst;
  int ld;
  CODA_HD StoreFp8Transposed(uint8_t* d, int l, const float* s) : Fp8Quantizer<kFormat>(s), dst(d), ld(l) {
#if !defined(__CUDA_ARCH__)
    if (l % 16 != 0 || reinterpret_cast<uintptr_t>(d) % 16 != 0)
      throw std::invalid_argument("StoreFp8Transposed: rows of the transposed copy must be 16-byte aligned (ld " +
                                  std::to_string(l) + " must be a multiple of 16, the matrix 16-byte aligned)");
#endif
  }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    if (!(in_columns(f, ctx) && in_rows(f, ctx))) return;
    uint8_t* p = dst + static_cast<size_t>(out_col(f)) * ld + f.row;
    for_values(f, [&](int i) { p[static_cast<size_t>(i) * ld] = this->quantize(f.v[i]); });
  }
};

// a where mask is 0, b where it is all ones, bit by bit (one LOP3 on the GPU, no predicate).
CODA_HD float bit_select(float a, float b, uint32_t mask) {
  uint32_t ua, ub;
  memcpy(&ua, &a, sizeof ua);
  memcpy(&ub, &b, sizeof ub);
  const uint32_t r = (ua & ~mask) | (ub & mask);
  float out;
  memcpy(&out, &r, sizeof out);
  return out;
}

// Row pick: out[row] = v at accumulator column idx[row] (the target logit of cross-entropy). Before any
// width change only (a frag is then the pair col, col + 1). The value is selected, not indexed: f.v[d]
// with a run-time d would put every Frag of the program in local memory. The target's pair column, a
// mask of its parity and the row's output address are kept per row, so a fragment costs its column, a
// compare, a bitwise select (one LOP3) and the store predicated on the compare (with the parity as a
// bool, its test and a float select took two more, ~250 instructions of the gpt2 LM head's ~5100;
// computed per fragment from the target and the row, the offset, the two-way test and the address took
// ~7, with a load of the output pointer, ~3.5 per value of the LM head's ~15).
struct RowPick : Primitive {
  const int32_t* idx;
  float* out;
  int target_pair[2] = {-1, -1};  // the target's even column (-1: no target, rows >= M)
  uint32_t odd_mask[2] = {0u, 0u};  // all ones where the target is the pair's second column
  float* row_out[2] = {nullptr, nullptr};
  CODA_HD RowPick(const int32_t* i, float* o) : idx(i), out(o) {}
  CODA_HD void begin_rows(const RowCtx& ctx) {
    for (int s = 0; s < RowCtx::kMaxSlots; ++s)
      if (ctx.has_slot(s) && ctx.rows[s] < ctx.M) {
        const int target = idx[ctx.rows[s]];
        target_pair[s] = target & ~1;
        odd_mask[s] = 0u - static_cast<uint32_t>(target & 1);
        row_out[s] = out + ctx.rows[s];
      }
  }
  CODA_HD void visit(Frag& f, const RowCtx&) {
    if (f.stride == 1 && f.expand == 1 && f.col == target_pair[f.slot])
      *row_out[f.slot] = bit_select(f.v[0], f.v[1], odd_mask[f.slot]);
  }
};

// Scaled subtraction: v -= alpha[row] * x (the rank-1 term r mu c of the LayerNorm reparameterization
// with x a ColVector, the u_hat term of a norm backward with x a Tile).
template <class X, class A = RowVector>
struct SubScaled : Primitive {
  static constexpr int kTileInputs = max_of(X::kTileInputs, A::kTileInputs);
  static_assert(X::kColumnBytes == 0 || A::kColumnBytes == 0, "a primitive reads at most one column vector (the stage RowCtx::column_stage gives it)");
  static constexpr int kColumnBytes = X::kColumnBytes + A::kColumnBytes;
  A alpha;
  X x;
  template <class AV>
  CODA_HD SubScaled(const AV& a, const X& x_) : alpha(a), x(x_) {}
  void collect_tiles(TileSource* sources) const {
    alpha.collect_tiles(sources);
    x.collect_tiles(sources);
  }
  CODA_HD void begin_rows(const RowCtx& ctx) {
    alpha.begin_rows(ctx);
    x.begin_rows(ctx);
  }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    float as[Frag::kMaxWidth], xs[Frag::kMaxWidth];
    alpha.load(f, ctx, as);
    x.load(f, ctx, xs);
    for_values(f, [&](int i) { f.v[i] -= as[i] * xs[i]; });
  }
};

// SwiGLU backward, 1 -> 2. The accumulator is dy, the gradient of y = silu(g) u; with the saved
// interleaved pair (g, u) at gu[row, 2c], 2c + 1 (c the accumulator column: tile input kSlot, read at
// the output column 2c) it writes the interleaved (dg, du) = (dy u silu'(g), dy silu(g)),
// silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g), and, if act is not null, stores the recomputed
// y = silu(g) u to act[row, c] (the down projection's weight-gradient input; null where the forward
// saved it).
template <class T, int kSlot = 0>
struct SwiGluBackward : Primitive {
  static constexpr int kOutsPerCol = 2;
  static constexpr int kTileInputs = kSlot + 1;
  TileOf<kSlot> gu;
  T* act;
  int ld_act;
  CODA_HD SwiGluBackward(const __nv_bfloat16* g, int lg, T* a, int la) : gu{g, lg}, act(a), ld_act(la) {}
  void collect_tiles(TileSource* sources) const { gu.collect_tiles(sources); }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    float out[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pairs[4], y[Frag::kMaxWidth];
    const int c0 = out_col(f);
    load_tile<kSlot>(TileSource{gu.src, gu.ld}, f, ctx, 2 * c0, 2 * f.width, pairs);
    for_values(f, [&](int i) {
      const float g = pairs[2 * i], u = pairs[2 * i + 1];
      const float s = fast_sigmoid(g), silu = g * s;
      out[2 * i] = f.v[i] * u * fmaf(g, fmaf(-s, s, s), s);  // s (1 + g (1 - s))
      out[2 * i + 1] = f.v[i] * silu;
      y[i] = silu * u;
    });
    if (act != nullptr && in_columns(f, ctx) && in_rows(f, ctx))
      store_values(act + static_cast<size_t>(f.row) * ld_act + c0, f.width, y);
    f.width *= 2;
    f.expand *= 2;
    for_values(f, [&](int i) { f.v[i] = out[i]; });
  }
};

}  // namespace coda::epi
