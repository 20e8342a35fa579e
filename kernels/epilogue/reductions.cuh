// Partial reductions: per (row, N tile) reductions of the values (sums, sums of squares, maxima, the
// online log-sum-exp) and row and column dots against an operand. Reductions are per-tile partials,
// finished by their consumer (merge_lse, norm_stats.cuh, the CODA passes): no global atomics.

#pragma once
#include <cmath>

#include "kernels/epilogue/fragment.cuh"
#include "kernels/epilogue/functions.cuh"
#include "kernels/epilogue/operands.cuh"
#include "kernels/epilogue/primitives.cuh"

namespace coda::epi {

// A reduction kind: a two-float state, its identity, how a fragment's values enter it (n of them; a
// value that takes no part is given as masked()), how two states merge, and how it is written to the
// partial buffer (float per entry, float2 for log-sum-exp).

struct Sum {
  using Out = float;
  static constexpr bool kBatched = false;
  CODA_HD static float masked() { return 0.0f; }
  CODA_HD static void init(float& a, float& b) { a = 0.0f, b = 0.0f; }
  CODA_HD static void add(float& a, float&, const float* x, int n) {
    CODA_UNROLL for (int i = 0; i < Frag::kMaxWidth; ++i) if (i < n) a += x[i];
  }
  CODA_HD static void merge(float& a, float&, float a2, float) { a += a2; }
  CODA_HD static Out result(float a, float) { return a; }
};

struct SumSquares {
  using Out = float;
  static constexpr bool kBatched = false;
  CODA_HD static float masked() { return 0.0f; }
  CODA_HD static void init(float& a, float& b) { a = 0.0f, b = 0.0f; }
  CODA_HD static void add(float& a, float&, const float* x, int n) {
    CODA_UNROLL for (int i = 0; i < Frag::kMaxWidth; ++i) if (i < n) a = fmaf(x[i], x[i], a);
  }
  CODA_HD static void merge(float& a, float&, float a2, float) { a += a2; }
  CODA_HD static Out result(float a, float) { return a; }
};

struct Max {
  using Out = float;
  static constexpr bool kBatched = false;
  CODA_HD static float masked() { return -INFINITY; }
  CODA_HD static void init(float& a, float& b) { a = -INFINITY, b = 0.0f; }
  CODA_HD static void add(float& a, float&, const float* x, int n) {
    CODA_UNROLL for (int i = 0; i < Frag::kMaxWidth; ++i) if (i < n) a = fmaxf(a, x[i]);
  }
  CODA_HD static void merge(float& a, float&, float a2, float) { a = fmaxf(a, a2); }
  CODA_HD static Out result(float a, float) { return a; }
};

// The largest |x|, NaN once any value is NaN (the amax of FP8 delayed scaling: a NaN must reach the scale
// update, which refuses it; fmaxf would drop it).
struct AbsMax {
  using Out = float;
  static constexpr bool kBatched = false;
  CODA_HD static float masked() { return 0.0f; }
  CODA_HD static void init(float& a, float& b) { a = 0.0f, b = 0.0f; }
  CODA_HD static float nan_max(float a, float x) { return (x > a || x != x) ? x : a; }
  CODA_HD static void add(float& a, float&, const float* x, int n) {
    CODA_UNROLL for (int i = 0; i < Frag::kMaxWidth; ++i) if (i < n) a = nan_max(a, fabsf(x[i]));
  }
  CODA_HD static void merge(float& a, float&, float a2, float) { a = nan_max(a, a2); }
  CODA_HD static Out result(float a, float) { return a; }
};

// Online log-sum-exp: state (m, s) = (running max, sum of exp(x - m)); a partial is (m, s) and the
// full-row value is merge_lse over the partials. A value enters with ONE exp and no branch: with
// d = x - m and e = exp(-|d|), a new maximum (d > 0) rescales the sum, s = s e + 1, otherwise
// s = s + e; both are computed and one is selected (a branch per value split the unrolled epilogue into
// a basic block per value, one dependency chain at a time). The first value of a row (m = -inf) gives
// d = inf, e = 0, s = 1. Masked values (-inf) are skipped by the select (d would be NaN when m = -inf).
// On the GPU, RowReduce hands it a batch of a row's values at once instead (kBatched, add_batch): the
// batch's maximum first, then one exp per value against it and one rescale of the state per batch,
// about 4.5 instructions per value instead of 9-10 and no select chain through s.
struct LogSumExp {
  static constexpr bool kBatched = true;
  struct Out {
    float max, sum;
  };
  CODA_HD static float masked() { return -INFINITY; }
  // n values at once (masked ones -inf): m becomes max(m, x), s is rescaled once and gets one
  // 2^(x log2 e - m log2 e) per value (a multiply-add and the hardware exp2), summed pairwise. A batch
  // with every value masked leaves an empty state empty (the shift is then taken against 0).
  template <int kN>
  CODA_HD static void add_batch(float& m, float& s, const float (&x)[kN]) {
    constexpr float kLog2e = 1.44269504f;
    float mx = m;
    CODA_UNROLL for (int i = 0; i < kN; ++i) mx = fmaxf(mx, x[i]);
    const float shift = (mx == -INFINITY ? 0.0f : mx) * kLog2e;
    float e[kN];
    CODA_UNROLL for (int i = 0; i < kN; ++i) e[i] = fast_exp2(fmaf(x[i], kLog2e, -shift));
    CODA_UNROLL for (int step = 1; step < kN; step *= 2)
      CODA_UNROLL for (int i = 0; i + step < kN; i += 2 * step) e[i] += e[i + step];
    s = fmaf(s, fast_exp2(fmaf(m, kLog2e, -shift)), e[0]);
    m = mx;
  }
  CODA_HD static void init(float& m, float& s) { m = -INFINITY, s = 0.0f; }
  CODA_HD static void add(float& m, float& s, const float* x, int n) {
    CODA_UNROLL for (int i = 0; i < Frag::kMaxWidth; ++i) if (i < n) {
      const float d = x[i] - m, e = fast_exp(-fabsf(d));
      const float next = d > 0.0f ? fmaf(s, e, 1.0f) : s + e;
      s = x[i] == -INFINITY ? s : next;
      m = fmaxf(m, x[i]);
    }
  }
  CODA_HD static void merge(float& m, float& s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) {
      m = m2, s = s2;
      return;
    }
    const float mx = fmaxf(m, m2);
    s = s * fast_exp(m - mx) + s2 * fast_exp(m2 - mx);
    m = mx;
  }
  CODA_HD static Out result(float m, float s) { return Out{m, s}; }
};

// Full-row log-sum-exp from the row's partials.
CODA_HD float merge_lse(const LogSumExp::Out* partials, int count) {
  float m = -INFINITY, s = 0.0f;
  for (int i = 0; i < count; ++i) LogSumExp::merge(m, s, partials[i].max, partials[i].sum);
  return m + logf(s);
}

// Per (row, N tile) partial of the current values: out[row * ctx.tiles_n + ctx.tile_n]. Columns >= N
// (tile padding) and output columns >= col_end are left out (masked, not branched around: see
// in_columns).
// A batched kind (Kind::kBatched, the log-sum-exp) gets a slot's values of a batch of four 8-column
// groups (kBatchGroups) at once on the GPU. The host visits one fragment per row at a time and adds it
// directly.
template <class Kind>
struct RowReduce : Primitive {
  static constexpr bool kBatchesGroups = Kind::kBatched;
  static constexpr int kBatch = Kind::kBatched ? kBatchGroups * Frag::kMaxWidth : 1;
  typename Kind::Out* out;
  int col_end;
  float a[2] = {0.0f, 0.0f}, b[2] = {0.0f, 0.0f};
  float pending[2][kBatch] = {};  // GPU, batched kinds: the slot's values of the current four groups
  CODA_HD explicit RowReduce(typename Kind::Out* o, int end = kNoColumnEnd) : out(o), col_end(end) {}
  CODA_HD int column_end() const { return col_end; }
  CODA_HD void begin_rows(const RowCtx&) {
    for (int s = 0; s < RowCtx::kMaxSlots; ++s) Kind::init(a[s], b[s]);
  }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    const int c = out_col(f);
    const bool in = in_columns(f, ctx);
    float x[Frag::kMaxWidth] = {};
    for_values(f, [&](int i) {
      x[i] = f.interior || (in && c + i < col_end) ? f.v[i] : Kind::masked();
    });
#if defined(__CUDA_ARCH__)
    if constexpr (Kind::kBatched) {
      for_values(f, [&](int i) { pending[f.slot][group_in_batch(f) * f.width + i] = x[i]; });
      if (!ends_batch(f)) return;
      if (f.width == 1)
        add_pending<4>(f.slot);
      else if (f.width == 2)
        add_pending<8>(f.slot);
      else
        add_pending<16>(f.slot);
      return;
    }
#endif
    Kind::add(a[f.slot], b[f.slot], x, f.width);
  }
  template <int kN>
  CODA_HD void add_pending(int slot) {
    float batch[kN];
    CODA_UNROLL for (int i = 0; i < kN; ++i) batch[i] = pending[slot][i];
    Kind::add_batch(a[slot], b[slot], batch);
  }
  template <class Lanes>
  CODA_HD void end_rows(const RowCtx& ctx, const Lanes& lanes) {
    for (int s = 0; s < RowCtx::kMaxSlots; ++s) {
      if (!ctx.has_slot(s)) break;
      for (int mask = 1; mask < lanes.count(); mask <<= 1) {
        const float a2 = lanes.xor_shuffle(a[s], mask), b2 = lanes.xor_shuffle(b[s], mask);
        Kind::merge(a[s], b[s], a2, b2);
      }
      if (lanes.leader() && ctx.rows[s] < ctx.M)
        out[static_cast<size_t>(ctx.rows[s]) * ctx.tiles_n + ctx.tile_n] = Kind::result(a[s], b[s]);
    }
  }
};

// Row dot partial: per (row, N tile) sum of v * x (<dz, z> and the other row statistics of a norm
// backward, taken on dz against a tile or a weight-derived vector).
template <class X>
struct RowDot : RowReduce<Sum> {
  static constexpr int kTileInputs = X::kTileInputs;
  static constexpr int kColumnBytes = X::kColumnBytes;
  X x;
  CODA_HD RowDot(const X& x_, float* o) : RowReduce<Sum>(o), x(x_) {}
  void collect_tiles(TileSource* sources) const { x.collect_tiles(sources); }
  CODA_HD void begin_rows(const RowCtx& ctx) {
    RowReduce<Sum>::begin_rows(ctx);
    x.begin_rows(ctx);
  }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    const bool in = in_columns(f, ctx);
    float xs[Frag::kMaxWidth];
    x.load(f, ctx, xs);
    for_values(f, [&](int i) { a[f.slot] = fmaf(in ? f.v[i] : 0.0f, xs[i], a[f.slot]); });
  }
};

// Column dot partial: out[(row / 16) * ld + output column] = sum over the group's 16 rows of v * x
// (bias gradients with x = Ones, gamma gradients with x a Tile or a RowVector). 16 rows are one warp's
// share of a 64-row block on the GPU: each thread holds 2 rows (slots 0 and 1, visited one after the
// other for the same columns) and the 8 lanes with the same lane % 4 hold the other rows. A warp
// finishes a batch of four 8-column groups (kBatchGroups) at once (4 x width values per thread once its
// two rows are added): a butterfly reduce-scatter over the 8 lanes, each of the three shuffle steps halving the
// values a lane keeps (7 shuffles for 8 values instead of 3 per value), leaves each lane its own
// finished columns, and the warp writes the four groups as one coalesced store. N % 8 == 0. The host
// runs one row at a time, in order: the group's first row writes, the others add.
template <class X>
struct ColDot : Primitive {
  static constexpr bool kBatchesGroups = true;
  static constexpr int kRows = 16;
  static constexpr int kTileInputs = X::kTileInputs;
  static constexpr int kColumnBytes = X::kColumnBytes;
  X x;
  float* out;
  int ld;
  float first[Frag::kMaxWidth] = {};     // GPU: slot 0's products of the current group
  float quad[kBatchGroups * Frag::kMaxWidth] = {};  // GPU: the two rows' sums of a batch, group_in_batch * width + value
  CODA_HD ColDot(const X& x_, float* o, int l) : x(x_), out(o), ld(l) {}
  void collect_tiles(TileSource* sources) const { x.collect_tiles(sources); }
  CODA_HD void begin_rows(const RowCtx& ctx) { x.begin_rows(ctx); }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    const bool in = in_columns(f, ctx) && in_rows(f, ctx);
    float xs[Frag::kMaxWidth], y[Frag::kMaxWidth];
    x.load(f, ctx, xs);
    for_values(f, [&](int i) { y[i] = in ? f.v[i] * xs[i] : 0.0f; });
#if defined(__CUDA_ARCH__)
    if (f.slot == 0) {
      for_values(f, [&](int i) { first[i] = y[i]; });
      return;
    }
    for_values(f, [&](int i) { quad[group_in_batch(f) * f.width + i] = y[i] + first[i]; });
    if (ends_batch(f)) write_quad(f, ctx);
#else
    float* p = out + static_cast<size_t>(f.row / kRows) * ld + out_col(f);
    for_values(f, [&](int i) { p[i] = (f.row % kRows == 0 ? 0.0f : p[i]) + y[i]; });
#endif
  }
#if defined(__CUDA_ARCH__)
  // f: the slot-1 fragment of the quad's last group. At each step (lane bits 4, 3, 2: the row lanes) a
  // lane keeps the half of its values that its bit selects and adds its partner's copy of that half;
  // with fewer than 8 values (width 1) the last step is a plain sum and lanes 4 apart hold the same value.
  __device__ __forceinline__ void write_quad(const Frag& f, const RowCtx& ctx) const {
    const int lane = threadIdx.x & 31;
    float v[4 * Frag::kMaxWidth];
    CODA_UNROLL for (int k = 0; k < 4 * Frag::kMaxWidth; ++k) v[k] = quad[k];
    int count = 4 * f.width, index = 0;  // the lane keeps values index .. index + count - 1
    CODA_UNROLL for (int bit = 16; bit >= 4; bit >>= 1) {
      const bool upper = (lane & bit) != 0;
      if (count > 1) {
        count /= 2;
        CODA_UNROLL for (int k = 0; k < 2 * Frag::kMaxWidth; ++k) if (k < count)
          v[k] = (upper ? v[k + count] : v[k]) + __shfl_xor_sync(0xffffffffu, upper ? v[k] : v[k + count], bit);
        index += upper ? count : 0;
      } else {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], bit);
      }
    }
    const int group = index / f.width, value = index % f.width;
    const int col = out_col(f) + (group - 3) * 8 * f.expand / f.stride + value;
    const bool writer = 4 * f.width >= 8 || (lane & 4) == 0;
    if (writer && (f.interior || (col < ctx.N * f.expand / f.stride && (f.row / kRows) * kRows < ctx.M)))
      store_values(out + static_cast<size_t>(f.row / kRows) * ld + col, count, v);
  }
#endif
};

}  // namespace coda::epi
