// Operands: the second factor of a broadcast, a dot or a scaled subtraction (per-row values, column
// vectors, tile inputs, their differences), and the tile inputs' contract with the GEMM (TileSource,
// load_tile). On the GPU a column vector is staged in shared memory per tile where the GEMM's
// configuration has room, else read from global memory after an L1 prefetch; tile inputs arrive in
// shared memory by TMA.

#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#include "kernels/sm90/sm90.cuh"
#endif

#include "kernels/epilogue/fragment.cuh"

namespace coda::epi {

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

// ---- operands: the second factor of a broadcast, a dot or a scaled subtraction --------------------
// load(f, ctx, x): the operand at (f.row, out_col(f) + i) for the fragment's values i; begin_rows
// loads per-row data; kTileInputs and collect_tiles: the tile inputs it reads (the tile inputs above).

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

// Row value k of the program's RowStage (primitives.cuh), as the stage left it in the context.
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

}  // namespace coda::epi
