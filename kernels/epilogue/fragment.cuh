// The contract between the GEMM and an epilogue program: the fragment a primitive visits (Frag), the
// context of a thread's rows (RowCtx), the lanes that share a row (HostLanes, QuadLanes), the masks of the
// tile padding, and a fragment's vector loads and stores. The conventions of output columns and of the
// partial buffers are beside Frag. Every hook of a primitive is __host__ __device__ (CODA_HD) and differs
// between the two evaluations only in its Lanes (a quad's shuffles on the GPU, nothing on the host), so
// tests/cpu/test_epilogue.cpp checks the code the GEMM runs.

#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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
  // true: every row and column mask folds away and the batched paths apply) and for the edge tiles
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

}  // namespace coda::epi
