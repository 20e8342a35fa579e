// Program<P1, P2, ...>: a list of primitives whose hooks it calls in list order, so a program reads like
// the math: Program<RowBroadcast<Mul>, ColBroadcast<Add>, Elementwise<Gelu>> is gelu(r_i acc_ij + b_j). It
// also carries what the GEMM's configuration needs to know of its primitives at compile time (width
// changes, tile inputs, column-vector bytes, column ends). evaluate_on_host runs a program over a plain
// accumulator array, as the CPU tests do.

#pragma once
#include <cstddef>

#include "kernels/epilogue/fragment.cuh"
#include "kernels/epilogue/operands.cuh"
#include "kernels/epilogue/primitives.cuh"

namespace coda::epi {

template <class... Ps>
struct Program;

// The empty program (the end of every program's list, and the plain GEMM): the empty hooks of Primitive.
template <>
struct Program<> : Primitive {
  static constexpr int kLength = 0;
  static constexpr int column_bytes(int = 1, int = 1) { return 0; }
  CODA_HD int acc_column_end(int = 1, int = 1) const { return kNoColumnEnd; }
};

template <class P, class... Rest>
struct Program<P, Rest...> {
  static constexpr int kLength = (P::kVisits ? 1 : 0) + Program<Rest...>::kLength;  // primitives that visit
  static constexpr int kColsPerOut = P::kColsPerOut * Program<Rest...>::kColsPerOut;
  static constexpr int kOutsPerCol = P::kOutsPerCol * Program<Rest...>::kOutsPerCol;
  static constexpr int kTileInputs = max_of(P::kTileInputs, Program<Rest...>::kTileInputs);
  static constexpr bool kBatchesGroups = P::kBatchesGroups || Program<Rest...>::kBatchesGroups;
  static_assert(kTileInputs <= kMaxTileInputs, "a program reads at most kMaxTileInputs tile inputs");
  // Bytes per accumulator column of the program's column vectors (the GPU stages an N tile's entries of
  // each in shared memory where the GEMM's configuration has room: RowCtx::column_stage); expand / stride:
  // output columns per accumulator column where the head stands.
  static constexpr int column_bytes(int expand = 1, int stride = 1) {
    return P::kColumnBytes * expand / stride +
           Program<Rest...>::column_bytes(expand * P::kOutsPerCol, stride * P::kColsPerOut);
  }
  P head;
  Program<Rest...> tail;
  Program() = default;
  CODA_HD Program(const P& p, const Rest&... rest) : head(p), tail(rest...) {}
  // Host: fills sources[k] with tile input k (the launch's tensor maps).
  void collect_tiles(TileSource* sources) const {
    head.collect_tiles(sources);
    tail.collect_tiles(sources);
  }
  // The first accumulator column at which some primitive's column_end() masks values (kNoColumnEnd:
  // none); expand / stride: output columns per accumulator column where the head stands.
  CODA_HD int acc_column_end(int expand = 1, int stride = 1) const {
    const int own = head.column_end() == kNoColumnEnd ? kNoColumnEnd : head.column_end() * stride / expand;
    const int rest = tail.acc_column_end(expand * P::kOutsPerCol, stride * P::kColsPerOut);
    return own < rest ? own : rest;
  }
  CODA_HD void begin_rows(const RowCtx& ctx) {
    RowCtx next = ctx;
    head.stage_rows(next);
    head.begin_rows(next);
    if (next.column_stage != nullptr) next.column_stage += P::kColumnBytes * next.tile_cols * next.expand / next.stride;
    next.expand *= P::kOutsPerCol;
    next.stride *= P::kColsPerOut;
    tail.begin_rows(next);
  }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    head.visit(f, ctx);
    tail.visit(f, ctx);
  }
  template <class Lanes>
  CODA_HD void end_rows(const RowCtx& ctx, const Lanes& lanes) {
    head.end_rows(ctx, lanes);
    tail.end_rows(ctx, lanes);
  }
};

template <class... Ps>
CODA_HD Program<Ps...> make_program(const Ps&... ps) {
  return Program<Ps...>(ps...);
}

// Host evaluation over a plain fp32 accumulator array acc[M, N] (row-major), N tiles of tile_n columns
// as in the GEMM that will run the program: out[M, N * kOutsPerCol / kColsPerOut] receives the main
// output. Rows run in order (column partial reductions rely on it).
template <class Prog>
void evaluate_on_host(Prog program, const float* acc, int M, int N, int tile_n, float* out) {
  const int out_cols = N * Prog::kOutsPerCol / Prog::kColsPerOut;
  const int tiles_n = (N + tile_n - 1) / tile_n;
  for (int row = 0; row < M; ++row) {
    for (int t = 0; t < tiles_n; ++t) {
      RowCtx ctx{{row, row}, 1, t * tile_n, t, tiles_n, M, N};
      ctx.tile_cols = tile_n;
      program.begin_rows(ctx);
      const int end = ctx.n0 + tile_n < N ? ctx.n0 + tile_n : N;
      for (int col = ctx.n0; col < end; col += 2) {
        const float* a = acc + static_cast<size_t>(row) * N + col;
        Frag f{0, row, col, 2, 1, {a[0], a[1]}};
        program.visit(f, ctx);
        float* o = out + static_cast<size_t>(row) * out_cols + out_col(f);
        for (int i = 0; i < f.width; ++i) o[i] = f.v[i];
      }
      program.end_rows(ctx, HostLanes{});
    }
  }
}

}  // namespace coda::epi
