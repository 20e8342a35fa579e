// CODA epilogue primitives: the vocabulary in which every non-attention operation of the trainer is
// written, as a short program that runs on a GEMM output tile while it is still in registers.
// A primitive has three hooks, begin_rows (per row block and N tile), visit (per Frag, in column order) and
// end_rows (per-row reductions, partials written); Program<P1, P2, ...> calls them in list order, so a program
// reads like the math: Program<RowBroadcast<Mul>, ColBroadcast<Add>, Elementwise<Gelu>> is gelu(r_i acc_ij + b_j).
// Every hook is __host__ __device__ and differs between the two evaluations only in its Lanes (a quad's
// shuffles on the GPU, nothing on the host), so tests/cpu/test_epilogue.cpp checks the code the GEMM runs.
// Reductions are per-tile partials, finished by their consumer: no global atomics.
// Details: docs/GEMM.md, "Epilogue primitives" and "Tile inputs through TMA"; the conventions beside Frag below.

#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__CUDACC__)
#include "kernels/sm90/sm90.cuh"
#endif

#if defined(__CUDACC__)
#define CODA_HD __host__ __device__ __forceinline__
#else
#define CODA_HD inline
#endif

namespace coda::epi {

// An unrolled loop in device code (a pragma the host compiler does not know).
#if defined(__CUDA_ARCH__)
#define CODA_UNROLL _Pragma("unroll")
#else
#define CODA_UNROLL
#endif

// The unit of work: two horizontally adjacent accumulator values (columns col, col+1) of one output row,
// what one thread holds per register pair after wgmma. Accumulator columns are the GEMM's N columns; a 2->1
// pairwise map halves the output width (stride 2), a 1->2 map (SwiGluBackward) doubles it (expand 2):
// output column = col * expand / stride (out_col). N is even, so a frag is valid iff col < N.
// Row partials are written per (row, N tile) to [M, tiles_n] (row-major, fp32); column partials per (16-row
// group, output column) to [ceil(M / 16), ld]; the consumer sums them (or merges them: merge_lse).
struct Frag {
  static constexpr int kMaxWidth = 4;
  int slot;    // which of the thread's rows (0 or 1)
  int row;     // global row
  int col;     // accumulator column of v[0] (even)
  int width;   // valid values in v: 2, or 1 after a 2->1 map
  int stride;  // accumulator columns per output column: 1, or 2 after a 2->1 map
  float v[4];  // v[2], v[3] only after a 1->2 map
  int expand = 1;  // output columns per accumulator column: 1, or 2 after a 1->2 map
  // GPU: the index of the fragment's 8-column accumulator group in the staged chunk, a compile-time
  // constant in the GEMM's unrolled chunk body (batches of four groups, kBatchGroups, are counted by it);
  // the host leaves it 0.
  int group = 0;
  // GPU: the fragment's 64-row block and N tile lie wholly inside the M x N accumulator, and before the
  // program's column ends (Program::acc_column_end: the LM head's vocabulary bound). For programs that
  // batch column groups the GEMM instantiates its chunk body twice, for such interior tiles (a constant
  // true: every row and column mask below folds away and the batched paths apply) and for the edge tiles
  // (gemm_kernel.cuh, kInteriorBody); the host leaves it false, so host evaluations always run the masks.
  bool interior = false;
  // GPU: the 8-column accumulator groups of a staged chunk (a constant of the chunk body: 8 for bf16
  // outputs of 2 -> 2 programs), so chunk c's group g starts at column n0 + 8 (c chunk_groups + g); a
  // primitive whose values repeat with a period that divides the chunk may cache them per group in
  // registers (Rope). 0 where that is not possible: on the host (no chunks) and on tiles whose
  // consumers hold two 64-row blocks (ping-pong 128x128: two program copies beside 128 accumulators,
  // where a cache of 32 registers per copy spilled).
  int chunk_groups = 0;
  // GPU: the program's column vectors were copied into shared memory as the tile's rows began (RowCtx::
  // column_stage, ColVectorOf), a constant of the GEMM's configuration; the host leaves it false.
  bool columns_staged = false;
};

// fn(i) for each value i < f.width of a fragment. The loop runs to the constant Frag::kMaxWidth, tests
// f.width and is unrolled: a loop to the run-time f.width that stays rolled (long programs exceed the
// unroller's budget) indexes f.v at run time, which puts the Frag, and with it the program's per-row
// state, in local memory.
template <class Fn>
CODA_HD void for_values(const Frag& f, Fn&& fn) {
  CODA_UNROLL for (int i = 0; i < Frag::kMaxWidth; ++i) {
    if (i < f.width) fn(i);
  }
}

// Output column of f.v[0].
CODA_HD int out_col(const Frag& f) { return f.col * f.expand / f.stride; }

// No column end: a primitive that masks no columns beyond N (Primitive::column_end).
constexpr int kNoColumnEnd = 0x7fffffff;

// GPU: batches of four 8-column groups. The GEMM visits a chunk's groups in order, each group's slot-0
// fragment and then its slot-1 fragment (the same columns, 8 rows down), so a primitive may keep a slot's
// values of four groups and finish them together at the fourth (ColDot's column sums, the batched
// log-sum-exp of RowReduce, StoreAux's 16-byte stores). Such primitives say so (kBatchesGroups), and the
// GEMM checks that its chunks hold whole batches.
constexpr int kBatchGroups = 4;
CODA_HD int group_in_batch(const Frag& f) { return f.group % kBatchGroups; }
CODA_HD bool ends_batch(const Frag& f) { return group_in_batch(f) == kBatchGroups - 1; }

// Rows per thread: on the GPU a thread owns two rows of each 64-row block (rows[0..1], "slots"), on the host
// one row at a time (one slot), so per-row state is kept per slot. A RowStage at the head of a program has a
// fourth hook, stage_rows: it finishes row values that several later primitives read (e.g. LayerNorm
// statistics) once per row, into the context they get.
struct RowCtx {
  static constexpr int kMaxSlots = 2;
  int rows[kMaxSlots];  // global rows of the slots
  int num_slots;        // 2 on the GPU, 1 on the host
  int n0;         // first accumulator column of the N tile
  int tile_n;     // index of the N tile: the partial-reduction column
  int tiles_n;    // number of N tiles: the partial buffer's row length
  int M, N;       // accumulator extents
  // GPU only: the staged chunk of tile input 0 (input k is kTileChunkBytes further), its first row and
  // output column, and its row length in bytes (128: bf16 output chunks; 64: fp32 ones).
  const uint8_t* tiles = nullptr;
  int tile_row0 = 0, tile_col0 = 0, tile_row_bytes = 128;
  int tile_cols = 0;  // accumulator columns of the N tile (GPU: BN; host: the tile width it evaluates)
  int lane_col = 0;   // GPU: the thread's first column in every 8-column group, 2 (lane % 4); host: 0
  // Output columns per accumulator column for the primitive whose begin_rows gets this context:
  // expand / stride, as in Frag (Program updates them along its list).
  int expand = 1, stride = 1;
  // GPU: where the next column vector of the program goes for this tile: shared memory that the
  // program's column vectors take one after the other (Program::begin_rows moves it on), or nullptr where
  // the configuration has no room for them (they are then read from global memory) and on the host.
  uint8_t* column_stage = nullptr;
  // Row values finished by a program's RowStage for the primitives after it (staged[k][slot], read
  // through RowOf<Staged<k>>): a statistic that several primitives read is finished once per row.
  static constexpr int kMaxStaged = 5;
  float staged[kMaxStaged][kMaxSlots] = {};
  // Slot s is in use. Loops over slots run to the constant kMaxSlots and test this, so the compiler
  // unrolls them and keeps per-slot state in registers (a loop to num_slots, around a loop of unknown
  // length such as a sum of partials, stayed rolled and put the state in local memory; around two such
  // loops, a constant-trip loop needs the unroll pragma too).
  CODA_HD bool has_slot(int s) const { return s < num_slots; }
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

CODA_HD float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// e^x as 2^(x log2 e) with the flush-to-zero hardware exp2 on the GPU: two instructions (__expf's
// non-ftz exp2 adds a range test and two multiplies per value for results below 2^-126, which every
// use here (softmax and log-sum-exp terms) can take as 0).
CODA_HD float fast_exp(float x) {
#if defined(__CUDA_ARCH__)
  return fast_exp2(x * 1.44269504f);
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

// 1 / (1 + e^-x) = (1 + tanh(x / 2)) / 2: one hardware tanh (abs. error ~2.5e-4 in the result, well
// below bf16's step) instead of an exp and a reciprocal. Special-function throughput is an eighth of the
// FMA pipes', so the SwiGLU backward's two per value were its limit.
CODA_HD float fast_sigmoid(float x) { return fmaf(0.5f, fast_tanh(0.5f * x), 0.5f); }

// sin and cos of x in [-pi, pi] (the hardware approximations on the GPU: abs. error ~5e-7 there).
CODA_HD void fast_sincos(float x, float* s, float* c) {
#if defined(__CUDA_ARCH__)
  __sincosf(x, s, c);
#else
  *s = std::sin(x);
  *c = std::cos(x);
#endif
}

// Reads of a program's column vectors go through the read-only data path on the GPU (ld.global.nc): that
// tells the compiler they cannot alias the epilogue's own stores, so the loads of a whole chunk of
// fragments can be issued together instead of costing one memory latency per fragment. A fragment's n
// values (1, 2 or 4, at a column that is a multiple of n) are one vector load: vectors must be 16-byte
// aligned (cudaMalloc, the parameter layout and the arena guarantee it).
CODA_HD void load_values(const float* p, int n, float* x) {
#if defined(__CUDA_ARCH__)
  if (n == 4) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else if (n == 2) {
    const float2 v = __ldg(reinterpret_cast<const float2*>(p));
    x[0] = v.x, x[1] = v.y;
  } else {
    x[0] = __ldg(p);
  }
#else
  for (int i = 0; i < n; ++i) x[i] = p[i];
#endif
}

#if defined(__CUDACC__)
// n bf16 values from raw bits (n = 1, 2 or 4; the first value in the low half of the first word).
__device__ __forceinline__ void unpack_bf16(const uint32_t* w, int n, float* x) {
  for (int i = 0; i < n; ++i) x[i] = __uint_as_float(i % 2 == 0 ? w[i / 2] << 16 : w[i / 2] & 0xffff0000u);
}
#endif

CODA_HD void load_values(const __nv_bfloat16* p, int n, float* x) {
#if defined(__CUDA_ARCH__)
  uint32_t w[2];
  if (n == 4) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x, w[1] = v.y;
  } else if (n == 2) {
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
  }
  unpack_bf16(w, n, x);
#else
  for (int i = 0; i < n; ++i) x[i] = __bfloat162float(p[i]);
#endif
}

// The stores of auxiliary outputs, one vector store of a fragment's n values (1, 2 or 4, at a column that
// is a multiple of n; rows of an even number of elements, 16-byte aligned matrices).
template <class T>
CODA_HD void store_values(T* p, int n, const float* x) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == 4)
      *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
    else if (n == 2)
      *reinterpret_cast<float2*>(p) = make_float2(x[0], x[1]);
    else
      *p = x[0];
  } else {
    if (n == 4) {
      const __nv_bfloat162 pairs[2] = {__floats2bfloat162_rn(x[0], x[1]), __floats2bfloat162_rn(x[2], x[3])};
      uint2 bits;
      memcpy(&bits, pairs, sizeof(bits));
      *reinterpret_cast<uint2*>(p) = bits;
    } else if (n == 2) {
      *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x[0], x[1]);
    } else {
      *p = __float2bfloat16_rn(x[0]);
    }
  }
}

// ---- tile inputs ------------------------------------------------------------------------------------

constexpr int kMaxTileInputs = 2;
constexpr int kTileChunkBytes = 64 * 128;  // one staged chunk of a tile input (64 rows x 128 bytes at most)

// Tile inputs: extra bf16 matrices laid out like the output (residual stream, saved pre-activations, the saved
// SwiGLU pairs), numbered k = 0, 1 (TileOf<k>, TileLoad<Op, k>, SwiGluBackward<T, k>). The host reads the
// arrays; on the GPU the GEMM brings each chunk into shared memory by TMA before the epilogue visits it and
// the primitives read it there (load_tile). Program::collect_tiles names the matrices to the launch, which
// builds their tensor maps (gemm_launch.cuh).
// A tile input as the launch sees it: the matrix and its row stride (elements).
struct TileSource {
  const __nv_bfloat16* src = nullptr;
  int ld = 0;
};

// Host side of collect_tiles: records that tile input `slot` is (src, ld); one slot, one matrix.
inline void add_tile_source(TileSource* sources, int slot, const __nv_bfloat16* src, int ld) {
  if (sources[slot].src != nullptr && (sources[slot].src != src || sources[slot].ld != ld))
    throw std::invalid_argument("epilogue program: tile input " + std::to_string(slot) +
                                " is given two different matrices (number the second one 1)");
  sources[slot] = TileSource{src, ld};
}

// n (1, 2 or 4) values of tile input kSlot at (f.row, col), col an output column and a multiple of n.
// GPU: from the staged chunk (swizzled as TMA writes it: the 16-byte unit index XORed with bits 7.. of
// the linear offset, i.e. the row mod 8 for 128-byte rows, row / 2 mod 4 for 64-byte rows; the 8 rows
// of a warp's quads then fall in different banks); rows >= M and columns past the matrix were
// zero-filled by TMA. Host: from the matrix.
template <int kSlot>
CODA_HD void load_tile(const TileSource& t, const Frag& f, [[maybe_unused]] const RowCtx& ctx, int col, int n,
                       float* x) {
#if defined(__CUDA_ARCH__)
  const int linear = (f.row - ctx.tile_row0) * ctx.tile_row_bytes + (col - ctx.tile_col0) * 2;
  const int swizzled = linear ^ (((linear >> 7) & (ctx.tile_row_bytes / 16 - 1)) << 4);
  const uint8_t* p = ctx.tiles + kSlot * kTileChunkBytes + swizzled;
  uint32_t w[2];
  if (n == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else if (n == 2) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    w[0] = *reinterpret_cast<const uint16_t*>(p);
  }
  unpack_bf16(w, n, x);
#else
  for (int i = 0; i < n; ++i) x[i] = __bfloat162float(t.src[static_cast<size_t>(f.row) * t.ld + col + i]);
#endif
}

// ---- scalar functions used by maps ----------------------------------------------------------------

struct Mul {
  CODA_HD float operator()(float a, float b) const { return a * b; }
};
struct Add {
  CODA_HD float operator()(float a, float b) const { return a + b; }
};
// GPT-2's GELU, tanh approximation: gelu(x) = x (1 + tanh(u)) / 2, u = k (x + c x^3), k = sqrt(2 / pi),
// c = 0.044715; gelu'(x) = (1 + t) / 2 + (1 - t^2) x (k / 2) (1 + 3 c x^2), t = tanh(u). Both are written
// in multiply-adds of the constants folded by hand (the compiler may not reassociate float math): the
// backward takes 9 instructions and a tanh per value instead of 16 (of the 41 per value of the gpt2 proj
// dgrad's epilogue, ncu).
struct GeluConstants {
  static constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float kc = k * 0.044715f;       // k c
  CODA_HD static float tanh_arg(float x, float x2) { return x * fmaf(kc, x2, k); }
};
struct Gelu : GeluConstants {
  CODA_HD float operator()(float x) const {
    const float half_x = 0.5f * x;
    return fmaf(half_x, fast_tanh(tanh_arg(x, x * x)), half_x);
  }
};
// GELU backward as a tile-load op: dy * gelu'(x), x the saved pre-activation.
struct GeluGradMul : GeluConstants {
  CODA_HD float operator()(float dy, float x) const {
    const float x2 = x * x;
    const float t = fast_tanh(tanh_arg(x, x2));
    const float slope = x * fmaf(1.5f * kc, x2, 0.5f * k);  // x (k / 2) (1 + 3 c x^2)
    return dy * fmaf(fmaf(-t, t, 1.0f), slope, fmaf(0.5f, t, 0.5f));
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

// The RoPE angle math, shared by the forward (Rope below) and the attention backward's inverse rotation
// (kernels/attention): pair i of a head turns by position * theta^(-2i / head_dim). Angles are kept in
// turns (angle / 2 pi: the 1 / 2 pi folds into the exponent of the frequency) and reduced to
// [-1/2, 1/2] turn by subtracting the nearest integer before the hardware sine and cosine. Angle error
// ~2e-7 * |angle| on the GPU (the hardware exp2; 4e-4 rad at position 2047), far below bf16's 4e-3.
// Turns per position of the pair whose first column is two_i (= 2i); log2_freq_step = -log2(theta) / head_dim.
CODA_HD float rope_turns_per_position(float two_i, float log2_freq_step) {
  const float kLog2TwoPi = 2.65149613f;
  return fast_exp2(fmaf(two_i, log2_freq_step, -kLog2TwoPi));
}
CODA_HD void sincos_turns(float turns, float* s, float* c) {
  const float kTwoPi = 6.28318531f;
  fast_sincos(kTwoPi * (turns - rintf(turns)), s, c);
}

// RoPE on adjacent pairs (2i, 2i+1) of each head of the first rot_cols columns (q and k heads of the
// packed qkv row); position = row % seq_len, angle = position * theta^(-2i / kHeadDim). 2 -> 2.
// kHeadDim is a power of two (64 or 128 in the trainer: the attention kernels' head sizes). Columns >=
// rot_cols (v heads) are computed too and then replaced by the input: a select instead of a branch, so
// the compiler can interleave the fragments' dependency chains (with a branch per fragment the RoPE
// epilogue runs one chain at a time).
// GPU: computed per fragment, RoPE is bound by the special-function unit (an exp2, a sine and a cosine
// per pair; 16 such operations per clock per SM). But a pair's angle depends only on its row and on its column modulo kHeadDim, and where
// a chunk's columns are whole heads (8 chunk_groups % kHeadDim == 0: heads of <= 64 columns in the
// 64-column chunks of bf16 outputs) a thread's fragment of group g meets the same pair index in every
// chunk. Its 2 rows x 8 groups of (sin, cos) are then computed once per tile in begin_rows (under the
// first MMAs, with the same formula, so the values are the ones the per-fragment path would compute)
// and the chunk bodies only rotate, at half RoPE's per-fragment cost. Wider heads, ping-pong 128x128 tiles (Frag::chunk_groups) and the host compute
// per fragment.
template <int kHeadDim>
struct Rope {
  static_assert(kHeadDim >= 8 && (kHeadDim & (kHeadDim - 1)) == 0, "head_dim: a power of two");
  static constexpr int kOut = 2;
  static constexpr int kCachedGroups = 8;  // the 64-column chunks of bf16 outputs
  int seq_len, rot_cols;
  float log2_theta;  // log2(theta)
  float position[2] = {0.0f, 0.0f};
  float log2_freq_step = 0.0f;  // log2 of theta^(-1 / head_dim)
  float sin_cached[2][kCachedGroups] = {}, cos_cached[2][kCachedGroups] = {};  // [slot][group], GPU only
  CODA_HD Rope(int seq_len_, int rot_cols_, float log2_theta_)
      : seq_len(seq_len_), rot_cols(rot_cols_), log2_theta(log2_theta_) {}
  // The fragment's (sin, cos) are in the per-tile cache.
  static CODA_HD bool cached(const Frag& f) {
    return f.chunk_groups > 0 && f.chunk_groups <= kCachedGroups && 8 * f.chunk_groups % kHeadDim == 0;
  }
  CODA_HD void angle(int slot, int two_i, float* s, float* c) const {
    const float turns = rope_turns_per_position(static_cast<float>(two_i), log2_freq_step);
    sincos_turns(position[slot] * turns, s, c);
  }
  CODA_HD void begin_rows(const RowCtx& ctx) {
    for (int s = 0; s < RowCtx::kMaxSlots; ++s)
      if (ctx.has_slot(s)) position[s] = static_cast<float>(ctx.rows[s] % seq_len);
    log2_freq_step = -log2_theta / static_cast<float>(kHeadDim);
#if defined(__CUDA_ARCH__)
    if constexpr (8 * kCachedGroups % kHeadDim == 0) {
#pragma unroll
      for (int s = 0; s < RowCtx::kMaxSlots; ++s)
#pragma unroll
        for (int g = 0; g < kCachedGroups; ++g)
          angle(s, (ctx.n0 + 8 * g + ctx.lane_col) & (kHeadDim - 1), &sin_cached[s][g], &cos_cached[s][g]);
    }
#endif
  }
  CODA_HD void operator()(const Frag& f, float a, float b, float* out) const {
    float s, c;
    if (cached(f)) {
      s = sin_cached[f.slot][f.group], c = cos_cached[f.slot][f.group];
    } else {
      angle(f.slot, f.col & (kHeadDim - 1), &s, &c);
    }
    const bool rotate = f.col < rot_cols;
    out[0] = rotate ? a * c - b * s : a;
    out[1] = rotate ? a * s + b * c : b;
  }
};

// The output column of a fragment's column-vector entries, clamped into the vector for fragments past
// N (the last N tile's padding: their values are never stored or reduced). Reading unconditionally
// keeps the loads out of branches, so the compiler can issue the loads of a whole chunk together.
CODA_HD int input_col(const Frag& f, const RowCtx& ctx) {
  if (f.interior) return out_col(f);
  const int last = ctx.N * f.expand / f.stride - f.width;
  return out_col(f) < last ? out_col(f) : last;
}

// The fragment is inside the accumulator's N columns (not the last N tile's padding). Primitives turn
// this into a mask on values and stores, never an early return: a branch per fragment splits the
// unrolled epilogue into one basic block per fragment, and the scheduler then runs one fragment's
// dependency chain (loads, shuffles, exps) at a time instead of interleaving a chunk's fragments.
CODA_HD bool in_columns(const Frag& f, const RowCtx& ctx) { return f.interior || f.col < ctx.N; }
// The fragment's row is one of the accumulator's M rows (not the last M tile's padding).
CODA_HD bool in_rows(const Frag& f, const RowCtx& ctx) { return f.interior || f.row < ctx.M; }

// ---- operands: the second factor of a broadcast, a dot or a scaled subtraction --------------------
// load(f, ctx, x): the operand at (f.row, out_col(f) + i) for the fragment's values i; begin_rows
// loads per-row data; kTileInputs and collect_tiles: the tile inputs it reads (see the top).

struct NoTiles {
  static constexpr int kTileInputs = 0;
  static constexpr int kColumnBytes = 0;  // bytes per output column of the column vectors it reads
  void collect_tiles(TileSource*) const {}
};

struct Ones : NoTiles {
  CODA_HD void begin_rows(const RowCtx&) {}
  CODA_HD void load(const Frag& f, const RowCtx&, float* x) const {
    for_values(f, [&](int i) { x[i] = 1.0f; });
  }
};

// GPU: asks L1 for the lines of a column vector that the N tile's epilogue will read, as the tile's rows
// begin (under the first MMAs): the epilogue's loads then hit L1 instead of waiting on L2 (those waits
// were a third of the LM head's epilogue stalls, ncu). One 128-byte line per thread of the warpgroup.
// For configurations without room to stage the vector in shared memory (copy_columns).
template <class T>
CODA_HD void prefetch_columns([[maybe_unused]] const T* vec, [[maybe_unused]] const RowCtx& ctx) {
#if defined(__CUDA_ARCH__)
  constexpr int kLine = 128 / static_cast<int>(sizeof(T));  // vector entries per line
  const int first = ctx.n0 * ctx.expand / ctx.stride;
  const int end = min(ctx.n0 + ctx.tile_cols, ctx.N) * ctx.expand / ctx.stride;
  const int col = first / kLine * kLine + static_cast<int>(threadIdx.x % 128) * kLine;
  if (col < end) asm volatile("prefetch.global.L1 [%0];" ::"l"(vec + col));
#endif
}

#if defined(__CUDA_ARCH__)
// GPU: copies the N tile's entries of a column vector into shared memory at ctx.column_stage (one pair of
// entries per thread of the warpgroup and round), as the tile's rows begin: on the ping-pong tiles that
// is under the other consumer's mainloop, and the epilogue reads the copy at shared-memory latency. The
// copies are asynchronous (cp.async: the thread goes on to its turn without waiting for the loads; the
// GEMM waits for them before the tile's first chunk, gemm_kernel.cuh). With the L1 prefetch alone, the
// loads of c and b' still wait on L2 (ncu): L1 is what the 200+ KB of shared memory leave of 256 KB. The first
// chunk's named barrier orders the copy before every read; the last chunk's, every read of a tile before
// the next tile's copy. Returns the shared address of the vector's entry 0 (its tile's entries at their
// own columns).
template <class T>
__device__ __forceinline__ uint32_t copy_columns(const T* vec, const RowCtx& ctx) {
  const int first = ctx.n0 * ctx.expand / ctx.stride;
  const int end = min(ctx.n0 + ctx.tile_cols, ctx.N) * ctx.expand / ctx.stride;
  const int cols = ctx.tile_cols * ctx.expand / ctx.stride;  // a constant of the GEMM: a constant trip count
  T* dst = reinterpret_cast<T*>(ctx.column_stage);
  for (int i = 2 * static_cast<int>(threadIdx.x % 128); i < cols; i += 256) {
    if (first + i + 1 < end)
      sm90::cp_async<2 * sizeof(T)>(dst + i, vec + first + i);
    else if (first + i < end)  // an odd end (a vector read after a 2 -> 1 map)
      dst[i] = vec[first + i];
  }
  return static_cast<uint32_t>(__cvta_generic_to_shared(dst)) - first * static_cast<uint32_t>(sizeof(T));
}

// n (1, 2 or 4) entries of a staged column vector at shared address `addr`.
__device__ __forceinline__ void load_staged(uint32_t addr, int n, float* x) {
  if (n == 4)
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(addr));
  else if (n == 2)
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(x[0]), "=f"(x[1]) : "r"(addr));
  else
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x[0]) : "r"(addr));
}
__device__ __forceinline__ void load_staged_bf16(uint32_t addr, int n, float* x) {
  uint32_t w[2];
  if (n == 4)
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(addr));
  else if (n == 2)
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[0]) : "r"(addr));
  else
    asm volatile("{ .reg .b16 h; ld.shared.b16 h, [%1]; cvt.u32.u16 %0, h; }" : "=r"(w[0]) : "r"(addr));
  unpack_bf16(w, n, x);
}
#endif

// A column vector (fp32 weight-derived vectors, bf16 parameters) at the fragment's output columns. On
// the GPU it is staged in shared memory per tile where the configuration has room (Frag::columns_staged),
// else read from global memory after an L1 prefetch.
template <class T>
struct ColVectorOf : NoTiles {
  static constexpr int kColumnBytes = sizeof(T);
  const T* vec;
  uint32_t stage = 0;  // GPU, staged: shared address of entry 0
  // GPU, staged: the entries of the group's slot-0 fragment, which its slot-1 fragment (the same columns,
  // visited next) reuses: the shared loads are volatile asm (kept below the chunk's barrier), so the
  // compiler does not merge the two, as it does the global ones.
  mutable float group_entries[Frag::kMaxWidth] = {};
  CODA_HD ColVectorOf(const T* v) : vec(v) {}
  CODA_HD void begin_rows(const RowCtx& ctx) {
#if defined(__CUDA_ARCH__)
    if (ctx.column_stage != nullptr) {
      stage = copy_columns(vec, ctx);
      return;
    }
#endif
    prefetch_columns(vec, ctx);
  }
  CODA_HD void load(const Frag& f, const RowCtx& ctx, float* x) const {
#if defined(__CUDA_ARCH__)
    if (f.columns_staged) {
      if (f.slot == 0) {
        const uint32_t addr = stage + static_cast<uint32_t>(input_col(f, ctx) * sizeof(T));
        if constexpr (sizeof(T) == 4)
          load_staged(addr, f.width, group_entries);
        else
          load_staged_bf16(addr, f.width, group_entries);
      }
      for_values(f, [&](int i) { x[i] = group_entries[i]; });
      return;
    }
#endif
    load_values(vec + input_col(f, ctx), f.width, x);
  }
};
using ColVector = ColVectorOf<float>;

// Row value k of the program's RowStage (below), as the stage left it in the context.
template <int k>
struct Staged {
  static_assert(k < RowCtx::kMaxStaged, "RowCtx::kMaxStaged staged row values at most");
};
template <class Stat>
CODA_HD float row_value(const Stat& stat, const RowCtx& ctx, int s) { return stat(ctx.rows[s]); }
template <int k>
CODA_HD float row_value(const Staged<k>&, const RowCtx& ctx, int s) { return ctx.staged[k][s]; }

// A per-row value: stat(row) evaluated once per row as the rows begin (0 on rows >= M). Stat is a loaded
// vector (RowVector), a statistic finished from a producer's partials (norm_stats.cuh), or a value that
// the program's RowStage finished (Staged<k>).
template <class Stat>
struct RowOf : NoTiles {
  Stat stat;
  float value[2] = {0.0f, 0.0f};
  CODA_HD RowOf(const Stat& s) : stat(s) {}  // implicit: RowBroadcast<Op, RowOf<S>>(stat)
  CODA_HD void begin_rows(const RowCtx& ctx) {
    CODA_UNROLL for (int s = 0; s < RowCtx::kMaxSlots; ++s)
      if (ctx.has_slot(s)) value[s] = ctx.rows[s] < ctx.M ? row_value(stat, ctx, s) : 0.0f;
  }
  CODA_HD void load(const Frag& f, const RowCtx&, float* x) const {
    for_values(f, [&](int i) { x[i] = value[f.slot]; });
  }
};

struct Loaded {
  const float* vec;
  CODA_HD Loaded(const float* v) : vec(v) {}  // implicit: RowVector(pointer)
  CODA_HD float operator()(int row) const {
    float x;
    load_values(vec + row, 1, &x);
    return x;
  }
};

struct RowVector : RowOf<Loaded> {
  CODA_HD RowVector(const float* v) : RowOf<Loaded>(Loaded(v)) {}  // implicit: RowBroadcast<Op>(pointer)
};

// Tile input kSlot: a bf16 matrix of the output's shape (row stride ld); 0 on rows >= M.
template <int kSlot>
struct TileOf {
  static constexpr int kTileInputs = kSlot + 1;
  static constexpr int kColumnBytes = 0;
  const __nv_bfloat16* src;
  int ld;
  void collect_tiles(TileSource* sources) const { add_tile_source(sources, kSlot, src, ld); }
  CODA_HD void begin_rows(const RowCtx&) {}
  CODA_HD void load(const Frag& f, const RowCtx& ctx, float* x) const {
    load_tile<kSlot>(TileSource{src, ld}, f, ctx, out_col(f), f.width, x);
  }
};
using Tile = TileOf<0>;

constexpr int max_of(int a, int b) { return a > b ? a : b; }

// The difference of two operands, a - b (the centered norm input h - mu that the LayerNorm's dgamma is
// the column dot with).
template <class A, class B>
struct Difference {
  static constexpr int kTileInputs = max_of(A::kTileInputs, B::kTileInputs);
  static_assert(A::kColumnBytes == 0 || B::kColumnBytes == 0, "a primitive reads at most one column vector (the stage RowCtx::column_stage gives it)");
  static constexpr int kColumnBytes = A::kColumnBytes + B::kColumnBytes;
  A a;
  B b;
  CODA_HD Difference(const A& a_, const B& b_) : a(a_), b(b_) {}
  void collect_tiles(TileSource* sources) const {
    a.collect_tiles(sources);
    b.collect_tiles(sources);
  }
  CODA_HD void begin_rows(const RowCtx& ctx) {
    a.begin_rows(ctx);
    b.begin_rows(ctx);
  }
  CODA_HD void load(const Frag& f, const RowCtx& ctx, float* x) const {
    float y[Frag::kMaxWidth];
    a.load(f, ctx, x);
    b.load(f, ctx, y);
    for_values(f, [&](int i) { x[i] -= y[i]; });
  }
};

// ---- primitives -----------------------------------------------------------------------------------

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

// Row broadcast: v = op(v, x[row]) for a row operand x (above): a loaded vector (RowVector: RMSNorm
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

// ---- partial reductions ---------------------------------------------------------------------------
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

// ---- programs -------------------------------------------------------------------------------------

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
