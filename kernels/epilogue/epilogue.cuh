// CODA epilogue primitives: the vocabulary in which every non-attention operation of the trainer is
// written, as a short program that runs on a GEMM output tile while it is still in registers.
//
// The unit of work is a Frag: two horizontally adjacent accumulator values (columns col, col+1) of one
// output row, exactly what one thread holds per register pair after wgmma. A primitive is a small object
// with three hooks:
//   begin_rows(ctx)        once per (row block, N tile): load per-row data, reset per-row state;
//   visit(frag, ctx)       once per Frag of those rows, in column order: transform the values;
//   end_rows(ctx, lanes)   after the last Frag: finish per-row reductions and write partials.
// A Program<P1, P2, ...> calls the hooks of its primitives in list order, so a program reads like the
// math: Program<RowBroadcast<Mul>, ColBroadcast<Add>, Elementwise<Gelu>> is gelu(r_i * acc_ij + b_j).
// After the program, the GEMM stores the frag values as the main output (plain or accumulate-store).
//
// Rows per thread: on the GPU a thread owns two rows of each 64-row block (ctx.rows[0..1], "slots"); on
// the host one row at a time (one slot). Per-row state is therefore kept per slot. Lanes abstracts the
// threads that share a row: on the GPU the 4 lanes of a quad, combined with shuffles; on the host there
// is nothing to combine. This is the ONLY difference between the two evaluations: every hook below is
// __host__ __device__, so tests/test_epilogue.cpp checks the same code that runs in the GEMM.
//
// Conventions: accumulator columns are the GEMM's N columns; a 2->1 pairwise map halves the output width
// (frag.stride becomes 2, output column = col / stride); N is even, so a frag is valid iff col < N.
// Partial reductions are written per (row, N tile) to a buffer [M, tiles_n] (row-major, fp32); whoever
// consumes them finishes them (sum of partials, or merge_lse for log-sum-exp). No global atomics.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define CODA_HD __host__ __device__ __forceinline__
#else
#define CODA_HD inline
#endif

namespace coda::epi {

struct Frag {
  int slot;    // which of the thread's rows (0 or 1)
  int row;     // global row
  int col;     // accumulator column of v[0] (even)
  int width;   // valid values in v: 2, or 1 after a 2->1 map
  int stride;  // accumulator columns per output column: 1, or 2 after a 2->1 map
  float v[2];
};

struct RowCtx {
  int rows[2];    // global rows of the slots
  int num_slots;  // 2 on the GPU, 1 on the host
  int n0;         // first accumulator column of the N tile
  int tile_n;     // index of the N tile: the partial-reduction column
  int tiles_n;    // number of N tiles: the partial buffer's row length
  int M, N;       // accumulator extents
};

// Threads sharing a row, host side: a single thread owns the whole row.
struct HostLanes {
  CODA_HD float xor_shuffle(float x, int) const { return x; }
  CODA_HD int count() const { return 1; }
  CODA_HD bool leader() const { return true; }
};

#if defined(__CUDACC__)
// Threads sharing a row on the GPU: the 4 lanes of a quad (wgmma's accumulator layout).
struct QuadLanes {
  int lane;
  __device__ __forceinline__ float xor_shuffle(float x, int mask) const { return __shfl_xor_sync(0xffffffffu, x, mask); }
  __device__ __forceinline__ int count() const { return 4; }
  __device__ __forceinline__ bool leader() const { return (lane & 3) == 0; }
};
#endif

CODA_HD float fast_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return std::exp(x);
#endif
}

CODA_HD float fast_tanh(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::tanh(x);
#endif
}

// ---- scalar functions used by maps ----------------------------------------------------------------

struct Mul {
  CODA_HD float operator()(float a, float b) const { return a * b; }
};
struct Add {
  CODA_HD float operator()(float a, float b) const { return a + b; }
};
// GPT-2's GELU, tanh approximation.
struct Gelu {
  CODA_HD float operator()(float x) const {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + fast_tanh(k * (x + 0.044715f * x * x * x)));
  }
};

// Pairwise functions (used through Pairwise<F>): kOut outputs from the pair (a, b) of a Frag, and a
// begin_rows hook for per-row setup.

// SwiGLU on an interleaved (gate, up) pair: silu(g) * u. 2 -> 1. Written with sigmoid(g) =
// (1 + tanh(g / 2)) / 2: one hardware tanh per pair instead of an exp and a reciprocal, which halves
// the epilogue's special-function work (the limit of this program on short-K GEMMs).
struct SwiGlu {
  static constexpr int kOut = 1;
  CODA_HD void begin_rows(const RowCtx&) {}
  CODA_HD void operator()(const Frag&, float g, float u, float* out) const {
    const float half_g = 0.5f * g;
    out[0] = fmaf(half_g, fast_tanh(half_g), half_g) * u;
  }
};

// RoPE on adjacent pairs (2i, 2i+1) of each head of the first rot_cols columns (q and k heads of the
// packed qkv row); position = row % seq_len, angle = position * theta^(-2i / head_dim). 2 -> 2.
// head_dim is a power of two. On the GPU the angle is reduced to [-pi, pi] (2 pi split in two floats,
// error ~1e-7 * |angle|) before the hardware sine and cosine.
struct Rope {
  static constexpr int kOut = 2;
  int seq_len, head_dim, rot_cols;
  float log2_theta;  // log2(theta)
  float position[2] = {0.0f, 0.0f};
  float log2_freq_step = 0.0f;  // log2 of theta^(-1 / head_dim)
  CODA_HD void begin_rows(const RowCtx& ctx) {
    for (int s = 0; s < ctx.num_slots; ++s) position[s] = static_cast<float>(ctx.rows[s] % seq_len);
    log2_freq_step = -log2_theta / static_cast<float>(head_dim);
  }
  CODA_HD void operator()(const Frag& f, float a, float b, float* out) const {
    if (f.col >= rot_cols) {
      out[0] = a;
      out[1] = b;
      return;
    }
    const float two_i = static_cast<float>(f.col & (head_dim - 1));
    const float angle = position[f.slot] * exp2f(two_i * log2_freq_step);
    float s, c;
#if defined(__CUDA_ARCH__)
    const float turns = rintf(angle * 0.159154943f);
    const float r = fmaf(-turns, -1.7484555e-7f, fmaf(-turns, 6.28318548f, angle));
    __sincosf(r, &s, &c);
#else
    s = std::sin(angle);
    c = std::cos(angle);
#endif
    out[0] = a * c - b * s;
    out[1] = a * s + b * c;
  }
};

// ---- primitives -----------------------------------------------------------------------------------

// Empty hooks; each primitive overrides the ones it needs. kColsPerOut: accumulator columns per output
// column after this primitive (2 for a 2->1 map).
struct Primitive {
  static constexpr int kColsPerOut = 1;
  CODA_HD void begin_rows(const RowCtx&) {}
  CODA_HD void visit(Frag&, const RowCtx&) {}
  template <class Lanes>
  CODA_HD void end_rows(const RowCtx&, const Lanes&) {}
};

// Row broadcast: v = op(v, vec[row]) (RMSNorm rstd scale, LayerNorm mean, ...).
template <class Op>
struct RowBroadcast : Primitive {
  const float* vec;
  float value[2] = {0.0f, 0.0f};
  CODA_HD explicit RowBroadcast(const float* v) : vec(v) {}
  CODA_HD void begin_rows(const RowCtx& ctx) {
    for (int s = 0; s < ctx.num_slots; ++s) value[s] = ctx.rows[s] < ctx.M ? vec[ctx.rows[s]] : 0.0f;
  }
  CODA_HD void visit(Frag& f, const RowCtx&) {
    for (int i = 0; i < f.width; ++i) f.v[i] = Op()(f.v[i], value[f.slot]);
  }
};

// Column broadcast: v = op(v, vec[output column]) (bias, gamma, weight-derived vectors).
template <class Op>
struct ColBroadcast : Primitive {
  const float* vec;
  CODA_HD explicit ColBroadcast(const float* v) : vec(v) {}
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    if (f.col >= ctx.N) return;
    const int c = f.col / f.stride;
    for (int i = 0; i < f.width; ++i) f.v[i] = Op()(f.v[i], vec[c + i]);
  }
};

// Tile load: v = op(v, src[row, output column]) for an extra bf16 input of the output's shape (residual
// stream, saved pre-activations). ld: row stride of src in elements.
template <class Op>
struct TileLoad : Primitive {
  const __nv_bfloat16* src;
  int ld;
  CODA_HD TileLoad(const __nv_bfloat16* s, int l) : src(s), ld(l) {}
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    if (f.col >= ctx.N || f.row >= ctx.M) return;
    const __nv_bfloat16* p = src + static_cast<size_t>(f.row) * ld + f.col / f.stride;
    for (int i = 0; i < f.width; ++i) f.v[i] = Op()(f.v[i], __bfloat162float(p[i]));
  }
};

// Elementwise map, 1 -> 1 (GELU, ...).
template <class F>
struct Elementwise : Primitive {
  F fn;
  CODA_HD explicit Elementwise(const F& f = F()) : fn(f) {}
  CODA_HD void visit(Frag& f, const RowCtx&) {
    for (int i = 0; i < f.width; ++i) f.v[i] = fn(f.v[i]);
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
template <class T>
struct StoreAux : Primitive {
  T* dst;
  int ld;
  CODA_HD StoreAux(T* d, int l) : dst(d), ld(l) {}
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    if (f.col >= ctx.N || f.row >= ctx.M) return;
    T* p = dst + static_cast<size_t>(f.row) * ld + f.col / f.stride;
    for (int i = 0; i < f.width; ++i) p[i] = static_cast<T>(f.v[i]);
  }
};

// Row pick: out[row] = v at accumulator column idx[row] (the target logit of cross-entropy).
struct RowPick : Primitive {
  const int32_t* idx;
  float* out;
  int target[2] = {-1, -1};
  CODA_HD RowPick(const int32_t* i, float* o) : idx(i), out(o) {}
  CODA_HD void begin_rows(const RowCtx& ctx) {
    for (int s = 0; s < ctx.num_slots; ++s) target[s] = ctx.rows[s] < ctx.M ? idx[ctx.rows[s]] : -1;
  }
  CODA_HD void visit(Frag& f, const RowCtx&) {
    const int d = target[f.slot] - f.col;
    if (f.stride == 1 && d >= 0 && d < f.width) out[f.row] = f.v[d];
  }
};

// ---- partial reductions ---------------------------------------------------------------------------
// A reduction kind: a two-float state, its identity, how a value enters it, how two states merge, and
// how it is written to the partial buffer (float per entry, float2 for log-sum-exp).

struct Sum {
  using Out = float;
  CODA_HD static void init(float& a, float& b) { a = 0.0f, b = 0.0f; }
  CODA_HD static void add(float& a, float&, float x) { a += x; }
  CODA_HD static void merge(float& a, float&, float a2, float) { a += a2; }
  CODA_HD static Out result(float a, float) { return a; }
};

struct SumSquares {
  using Out = float;
  CODA_HD static void init(float& a, float& b) { a = 0.0f, b = 0.0f; }
  CODA_HD static void add(float& a, float&, float x) { a += x * x; }
  CODA_HD static void merge(float& a, float&, float a2, float) { a += a2; }
  CODA_HD static Out result(float a, float) { return a; }
};

struct Max {
  using Out = float;
  CODA_HD static void init(float& a, float& b) { a = -INFINITY, b = 0.0f; }
  CODA_HD static void add(float& a, float&, float x) { a = fmaxf(a, x); }
  CODA_HD static void merge(float& a, float&, float a2, float) { a = fmaxf(a, a2); }
  CODA_HD static Out result(float a, float) { return a; }
};

// Online log-sum-exp: state (m, s) = (running max, sum of exp(x - m)); a partial is (m, s) and the
// full-row value is merge_lse over the partials.
struct LogSumExp {
  struct Out {
    float max, sum;
  };
  CODA_HD static void init(float& m, float& s) { m = -INFINITY, s = 0.0f; }
  CODA_HD static void add(float& m, float& s, float x) {
    if (x > m) {
      s = s * fast_exp(m - x) + 1.0f;
      m = x;
    } else {
      s += fast_exp(x - m);
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
// (tile padding) are left out.
template <class Kind>
struct RowReduce : Primitive {
  typename Kind::Out* out;
  float a[2] = {0.0f, 0.0f}, b[2] = {0.0f, 0.0f};
  CODA_HD explicit RowReduce(typename Kind::Out* o) : out(o) {}
  CODA_HD void begin_rows(const RowCtx& ctx) {
    for (int s = 0; s < ctx.num_slots; ++s) Kind::init(a[s], b[s]);
  }
  CODA_HD void visit(Frag& f, const RowCtx& ctx) {
    if (f.col >= ctx.N) return;
    for (int i = 0; i < f.width; ++i) Kind::add(a[f.slot], b[f.slot], f.v[i]);
  }
  template <class Lanes>
  CODA_HD void end_rows(const RowCtx& ctx, const Lanes& lanes) {
    for (int s = 0; s < ctx.num_slots; ++s) {
      for (int mask = 1; mask < lanes.count(); mask <<= 1) {
        const float a2 = lanes.xor_shuffle(a[s], mask), b2 = lanes.xor_shuffle(b[s], mask);
        Kind::merge(a[s], b[s], a2, b2);
      }
      if (lanes.leader() && ctx.rows[s] < ctx.M)
        out[static_cast<size_t>(ctx.rows[s]) * ctx.tiles_n + ctx.tile_n] = Kind::result(a[s], b[s]);
    }
  }
};

// ---- programs -------------------------------------------------------------------------------------

template <class... Ps>
struct Program;

template <>
struct Program<> {
  static constexpr int kColsPerOut = 1;
  CODA_HD void begin_rows(const RowCtx&) {}
  CODA_HD void visit(Frag&, const RowCtx&) {}
  template <class Lanes>
  CODA_HD void end_rows(const RowCtx&, const Lanes&) {}
};

template <class P, class... Rest>
struct Program<P, Rest...> {
  static constexpr int kColsPerOut = P::kColsPerOut * Program<Rest...>::kColsPerOut;
  P head;
  Program<Rest...> tail;
  Program() = default;
  CODA_HD Program(const P& p, const Rest&... rest) : head(p), tail(rest...) {}
  CODA_HD void begin_rows(const RowCtx& ctx) {
    head.begin_rows(ctx);
    tail.begin_rows(ctx);
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
// as in the GEMM that will run the program: out[M, N / kColsPerOut] receives the main output.
template <class Prog>
void evaluate_on_host(Prog program, const float* acc, int M, int N, int tile_n, float* out) {
  const int out_cols = N / Prog::kColsPerOut;
  const int tiles_n = (N + tile_n - 1) / tile_n;
  for (int row = 0; row < M; ++row) {
    for (int t = 0; t < tiles_n; ++t) {
      const RowCtx ctx{{row, row}, 1, t * tile_n, t, tiles_n, M, N};
      program.begin_rows(ctx);
      const int end = ctx.n0 + tile_n < N ? ctx.n0 + tile_n : N;
      for (int col = ctx.n0; col < end; col += 2) {
        const float* a = acc + static_cast<size_t>(row) * N + col;
        Frag f{0, row, col, 2, 1, {a[0], a[1]}};
        program.visit(f, ctx);
        float* o = out + static_cast<size_t>(row) * out_cols + col / f.stride;
        for (int i = 0; i < f.width; ++i) o[i] = f.v[i];
      }
      program.end_rows(ctx, HostLanes{});
    }
  }
}

}  // namespace coda::epi
