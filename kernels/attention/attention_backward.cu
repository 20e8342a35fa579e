// Backward of causal grouped-query attention, FlashAttention-2 style, on tensor cores (mma.sync
// m16n8k16, bf16 operands, fp32 accumulate). Contract and layouts: attention.cuh; forward:
// attention_forward.cu (it saves lse, the natural-log sum-exp of each query's scaled scores).
//
// D = rowsum(dO * O) first (one small kernel; it also clears the fp32 dQ accumulator). Then one thread
// block = one kv head x one block of 64 keys (16 per warp, 4 warps); it loops over every query head of
// the kv head's group and every query block at or below the diagonal (blocks above it are skipped),
// 64 queries at a time:
//     P^T  = exp(scale*S^T - lse)         S^T = K Q^T (keys x queries, warp-local rows)
//     dV  += P^T dO
//     dP^T = V dO^T
//     dS^T = P^T * (dP^T - D)
//     dK  += dS^T Q                         (times scale at the end)
//     dQ  += dS K                           (dS^T goes through shared memory; fp32 atomics into a buffer)
// Summing over the group's query heads inside the block gives dK, dV of a kv head without atomics; dQ
// is shared between kv blocks, hence the fp32 accumulator, converted (times scale) into dqkv at the end.
// P^T and dS^T stay in registers as mma accumulators and are re-packed to bf16 as the A operand of the
// next product. The Q/dO tiles of the next step are loaded (cp.async, double-buffered) while the
// current one computes. Key blocks are scheduled by increasing key index (most query blocks first).
//
// The CODA write-out (writeout != nullptr; the contract and the math are in attention.cuh and
// kernels/coda/fused.cuh) replaces the dQ conversion by a per-row pass that finishes whole packed rows of
// dqkv: one block = one group of kGroupRows consecutive token rows (the column-partial group), its threads
// over 8-column chunks of the row, each chunk walked down the group's rows. Per element: dz = scale * dQ
// accumulator (q columns) or dk, dv as the main kernel stored them (bf16, read back in place); the row
// dot <dz, z> against the stored qkv (taken BEFORE the inverse rotation: the rotation is orthogonal, so
// <R^T g, R^T z> = <g, z> with no need to rotate z); the inverse RoPE rotation of the q and k pairs (the
// forward's angle math, epilogue.cuh); the LayerNorm dots <dz, c>, <dz, b'> and the column partials
// (sum dz, sum r mu dz) kept per thread over the group's rows, so each group's partial row is written once
// without atomics; finally dqkv = r dz in bf16. Row dots are summed per thread over its chunks, then over
// the warp (shuffles), then over the warps in a fixed order: deterministic, count 1.
//
// Tails: tiles are loaded with zero fill past row T. Zero keys past T are masked by causality for every
// real query; query rows past T have zero dO and D, so they contribute nothing to dK, dV, and their dQ
// is never stored.
//
// Shared-memory tiles are row-major with 16-byte chunks XOR-swizzled by the row (chunk ^ row%8), so the
// 8 row addresses of every ldmatrix (and the bf16x2 stores of dS) hit distinct banks.
#include "kernels/attention/attention.cuh"
#include "kernels/attention/attention_device.cuh"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/kernel_profile.cuh"
#include "kernels/sm90/sm90.cuh"

namespace coda {
namespace {

using namespace attention_detail;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockK = 16 * kWarps;  // keys per block (16 per warp)
constexpr int kStepQ = 64;    // queries per inner step

// Byte offset of element (row, col) of a swizzled row-major bf16 tile with COLS columns.
template <int COLS>
__device__ __forceinline__ uint32_t swz(int row, int col) {
  static_assert(COLS == 64 || COLS == 128, "tile rows are 128 or 256 bytes");
  return static_cast<uint32_t>((row * COLS + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7)) * 2);
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b, m16n8k16, a row-major 16x16, b "column" 16x8, c 16x8 fp32.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Lane addresses for ldmatrix.x4 (lane l, i = l / 8 picks the 8x8 matrix, r = l % 8 its row). Operands of
// m16n8k16: A is m x k (16x16), B is k x n (16 x 16 = two n8 tiles, fragments b[0],b[1] | b[2],b[3]).
//   A from a tile stored [m][k] (plain):      row m = r + (i%2)*8, col k = (i/2)*8
//   A from a tile stored [k][m] (transposed): row k = r + (i/2)*8, col m = (i%2)*8
//   B from a tile stored [n][k] (plain):      row n = r + (i/2)*8, col k = (i%2)*8
//   B from a tile stored [k][n] (transposed): row k = r + (i%2)*8, col n = (i/2)*8
struct Lane {
  int r, i;
  __device__ Lane() : r(threadIdx.x & 7), i((threadIdx.x >> 3) & 3) {}
  __device__ int a_row() const { return r + (i & 1) * 8; }
  __device__ int a_col() const { return (i >> 1) * 8; }
  __device__ int at_row() const { return r + (i >> 1) * 8; }
  __device__ int at_col() const { return (i & 1) * 8; }
  __device__ int b_row() const { return r + (i >> 1) * 8; }
  __device__ int b_col() const { return (i & 1) * 8; }
  __device__ int bt_row() const { return r + (i & 1) * 8; }
  __device__ int bt_col() const { return (i >> 1) * 8; }
};

// acc (this warp's 16 rows x kStepQ columns) += A[warp rows][HD] B[kStepQ][HD]^T: the two keys x queries
// products S^T = K Q^T and dP^T = V dO^T (A = K or V, B = Q or dO, swizzled [rows][HD] tiles).
template <int HD>
__device__ __forceinline__ void warp_rows_times_bt(float (&acc)[kStepQ / 8][4], uint32_t a_tile, uint32_t b_tile,
                                                   int warp, const Lane& ln) {
#pragma unroll
  for (int kc = 0; kc < HD / 16; ++kc) {
    uint32_t a[4];
    ldsm_x4(a, a_tile + swz<HD>(warp * 16 + ln.a_row(), kc * 16 + ln.a_col()));
#pragma unroll
    for (int np = 0; np < kStepQ / 16; ++np) {
      uint32_t b[4];
      ldsm_x4(b, b_tile + swz<HD>(np * 16 + ln.b_row(), kc * 16 + ln.b_col()));
      mma(acc[2 * np], a, b[0], b[1]);
      mma(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// The bf16 A fragment (16 x 16) of queries kc*16.. of a keys x queries accumulator (P^T or dS^T).
__device__ __forceinline__ void a_fragment(uint32_t (&a)[4], const float (&acc)[kStepQ / 8][4], int kc) {
  a[0] = pack_bf16(acc[2 * kc][0], acc[2 * kc][1]);
  a[1] = pack_bf16(acc[2 * kc][2], acc[2 * kc][3]);
  a[2] = pack_bf16(acc[2 * kc + 1][0], acc[2 * kc + 1][1]);
  a[3] = pack_bf16(acc[2 * kc + 1][2], acc[2 * kc + 1][3]);
}

// acc (16 x HD) += a (16 x 16) B[kc*16 .. kc*16+16][HD]: dV += P^T dO and dK += dS^T Q, one k step
// (B = dO or Q, a swizzled [queries][HD] tile, read transposed).
template <int HD>
__device__ __forceinline__ void warp_a_times_b_rows(float (&acc)[HD / 8][4], const uint32_t (&a)[4], uint32_t b_tile,
                                                    int kc, const Lane& ln) {
#pragma unroll
  for (int np = 0; np < HD / 16; ++np) {
    uint32_t b[4];
    ldsm_x4_trans(b, b_tile + swz<HD>(kc * 16 + ln.bt_row(), np * 16 + ln.bt_col()));
    mma(acc[2 * np], a, b[0], b[1]);
    mma(acc[2 * np + 1], a, b[2], b[3]);
  }
}

// Loads rows [row0, row0 + ROWS) x COLS of a strided bf16 matrix with `rows` rows into a swizzled tile;
// rows past the end are zero-filled (their source address is clamped to a valid row).
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile(uint32_t tile, const bf16* src, size_t stride, int row0, int rows) {
  constexpr int kChunks = COLS / 8;
  for (int c = threadIdx.x; c < ROWS * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int row = row0 + r;
    const bool valid = row < rows;
    cp_async_16(tile + swz<COLS>(r, col), src + static_cast<size_t>(valid ? row : rows - 1) * stride + col, valid);
  }
}

// Writes one warp's 16 x HD accumulator (fragments acc[n-tile][4], times `scale`) as bf16 into rows
// [row0, row0+16) of a swizzled tile, then copies those rows to global rows [grow0, ...) < rows with
// 16-byte stores. Only this warp's rows of the tile are touched.
template <int HD>
__device__ __forceinline__ void store_warp_rows(const float (&acc)[HD / 8][4], float scale_lo, float scale_hi,
                                                unsigned char* tile, int row0, bf16* dst, size_t stride, int grow0,
                                                int rows) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < HD / 8; ++nt) {
    *reinterpret_cast<uint32_t*>(tile + swz<HD>(row0 + g, nt * 8 + 2 * t)) =
        pack_bf16(acc[nt][0] * scale_lo, acc[nt][1] * scale_lo);
    *reinterpret_cast<uint32_t*>(tile + swz<HD>(row0 + g + 8, nt * 8 + 2 * t)) =
        pack_bf16(acc[nt][2] * scale_hi, acc[nt][3] * scale_hi);
  }
  __syncwarp();
  constexpr int kChunks = HD / 8;
#pragma unroll
  for (int c = lane; c < 16 * kChunks; c += 32) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    if (grow0 + r < rows)
      *reinterpret_cast<int4*>(dst + static_cast<size_t>(grow0 + r) * stride + col) =
          *reinterpret_cast<const int4*>(tile + swz<HD>(row0 + r, col));
  }
}

// D[b, h, t] = sum_d dO * O (fp32), one warp per (token, head) row; also clears the dQ accumulator.
template <int HD>
__global__ void attention_backward_prologue_kernel(float* dsum, float* dq_accum, const bf16* dout, const bf16* out,
                                                   int B, int T, int n_head) {
  const size_t row = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // (b*T + t)*n_head + h
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<size_t>(B) * T * n_head) return;
  constexpr int kPerLane = HD / 32;
  const bf16* o_row = out + row * HD + lane * kPerLane;
  const bf16* d_row = dout + row * HD + lane * kPerLane;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; i += 2) {
    const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o_row + i));
    const float2 d = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d_row + i));
    acc += o.x * d.x + o.y * d.y;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  const size_t bt = row / n_head, b = bt / T, t = bt % T, h = row % n_head;
  const size_t head_row = (b * n_head + h) * T + t;  // [B, n_head, T]
  if (lane == 0) dsum[head_row] = acc;
  float* dq = dq_accum + head_row * HD + lane * kPerLane;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) dq[i] = 0.f;
}

template <int HD>
__global__ void __launch_bounds__(kThreads) attention_backward_kernel(bf16* dqkv, float* dq_accum, const bf16* dout,
                                                                       const bf16* qkv, const float* lse,
                                                                       const float* dsum, int T, int n_head,
                                                                       int n_kv_head, float scale_log2) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTileKV = kBlockK * HD * 2, kTileQ = kStepQ * HD * 2, kTileS = kBlockK * kStepQ * 2;
  unsigned char* k_tile = smem;
  unsigned char* v_tile = smem + kTileKV;
  const uint32_t sK = sm90::smem_u32(smem), sV = sK + kTileKV, sQ0 = sV + kTileKV, sdO0 = sQ0 + 2 * kTileQ,
                 sdS = sdO0 + 2 * kTileQ, sStat0 = sdS + kTileS;  // stats: [buf][lse | D][kStepQ] fp32
  const float* stats = reinterpret_cast<const float*>(smem + 2 * kTileKV + 4 * kTileQ + kTileS);

  const int group = n_head / n_kv_head;
  const int b = blockIdx.x / n_kv_head, kvh = blockIdx.x % n_kv_head;
  const int k0 = blockIdx.y * kBlockK;  // small key blocks (most queries) first
  const size_t qkv_dim = static_cast<size_t>(n_head + 2 * n_kv_head) * HD;
  const size_t out_dim = static_cast<size_t>(n_head) * HD;
  const bf16* seq = qkv + static_cast<size_t>(b) * T * qkv_dim;
  const bf16* dout_seq = dout + static_cast<size_t>(b) * T * out_dim;
  const int first_step = k0 / kStepQ, steps_per_head = (T + kStepQ - 1) / kStepQ - first_step;
  const int n_steps = group * steps_per_head;

  auto load_step = [&](int step, int buf) {
    const int h = kvh * group + step / steps_per_head, q0 = (first_step + step % steps_per_head) * kStepQ;
    load_tile<kStepQ, HD>(sQ0 + buf * kTileQ, seq + static_cast<size_t>(h) * HD, qkv_dim, q0, T);
    load_tile<kStepQ, HD>(sdO0 + buf * kTileQ, dout_seq + static_cast<size_t>(h) * HD, out_dim, q0, T);
    const size_t head_row0 = (static_cast<size_t>(b) * n_head + h) * T;
    for (int i = threadIdx.x; i < 2 * kStepQ; i += kThreads) {
      const int q = q0 + (i % kStepQ);
      const float* src = (i < kStepQ ? lse : dsum) + head_row0 + (q < T ? q : T - 1);
      cp_async_4(sStat0 + (buf * 2 * kStepQ + i) * 4, src, q < T);
    }
  };

  load_tile<kBlockK, HD>(sK, seq + static_cast<size_t>(n_head + kvh) * HD, qkv_dim, k0, T);
  load_tile<kBlockK, HD>(sV, seq + static_cast<size_t>(n_head + n_kv_head + kvh) * HD, qkv_dim, k0, T);
  load_step(0, 0);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const Lane ln;
  const int key_lo = k0 + warp * 16 + g;  // this thread's keys: key_lo, key_lo + 8
  float dk[HD / 8][4] = {}, dv[HD / 8][4] = {};
  // dQ = dS K of a step (kStepQ x HD) is split over the warps as a grid of 4 column strips x row strips.
  constexpr int kDqCols = HD / 4, kDqRows = kStepQ * 4 / kWarps;
  const int dq_row0 = (warp / 4) * kDqRows, dq_col0 = (warp % 4) * kDqCols;

  for (int step = 0; step < n_steps; ++step) {
    const int buf = step & 1;
    if (step + 1 < n_steps) load_step(step + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // this step's Q, dO, lse, D landed
    const int h = kvh * group + step / steps_per_head, q0 = (first_step + step % steps_per_head) * kStepQ;
    const uint32_t sQ = sQ0 + buf * kTileQ, sdO = sdO0 + buf * kTileQ;
    const float* s_lse = stats + buf * 2 * kStepQ;
    const float* s_d = s_lse + kStepQ;

    // S^T = K Q^T, then P^T in place.
    float p[kStepQ / 8][4] = {};
    warp_rows_times_bt<HD>(p, sK, sQ, warp, ln);
    const bool diagonal = q0 < k0 + kBlockK - 1;
#pragma unroll
    for (int nt = 0; nt < kStepQ / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * 8 + 2 * t + (e & 1);
        const float v = exp2f(p[nt][e] * scale_log2 - s_lse[qi] * kLog2e);
        p[nt][e] = (diagonal && key_lo + (e >> 1) * 8 > q0 + qi) ? 0.f : v;
      }

    // dV += P^T dO
#pragma unroll
    for (int kc = 0; kc < kStepQ / 16; ++kc) {
      uint32_t pa[4];
      a_fragment(pa, p, kc);
      warp_a_times_b_rows<HD>(dv, pa, sdO, kc, ln);
    }

    // dP^T = V dO^T, then dS^T = P^T (dP^T - D) into p.
    {
      float dp[kStepQ / 8][4] = {};
      warp_rows_times_bt<HD>(dp, sV, sdO, warp, ln);
#pragma unroll
      for (int nt = 0; nt < kStepQ / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[nt][e] *= dp[nt][e] - s_d[nt * 8 + 2 * t + (e & 1)];
    }

    // dK += dS^T Q; dS^T (bf16) also goes to shared memory for dQ.
#pragma unroll
    for (int kc = 0; kc < kStepQ / 16; ++kc) {
      uint32_t da[4];
      a_fragment(da, p, kc);
      unsigned char* ds_tile = smem + (sdS - sK);
      *reinterpret_cast<uint32_t*>(ds_tile + swz<kStepQ>(warp * 16 + g, kc * 16 + 2 * t)) = da[0];
      *reinterpret_cast<uint32_t*>(ds_tile + swz<kStepQ>(warp * 16 + g + 8, kc * 16 + 2 * t)) = da[1];
      *reinterpret_cast<uint32_t*>(ds_tile + swz<kStepQ>(warp * 16 + g, kc * 16 + 8 + 2 * t)) = da[2];
      *reinterpret_cast<uint32_t*>(ds_tile + swz<kStepQ>(warp * 16 + g + 8, kc * 16 + 8 + 2 * t)) = da[3];
      warp_a_times_b_rows<HD>(dk, da, sQ, kc, ln);
    }
    __syncthreads();  // dS^T complete

    // dQ[:, warp's columns] += dS K, added into the fp32 accumulator.
    {
      float dq[kDqRows / 16][kDqCols / 8][4] = {};
#pragma unroll
      for (int kc = 0; kc < kBlockK / 16; ++kc) {
        uint32_t kb[kDqCols / 16][4];
#pragma unroll
        for (int np = 0; np < kDqCols / 16; ++np)
          ldsm_x4_trans(kb[np], sK + swz<HD>(kc * 16 + ln.bt_row(), dq_col0 + np * 16 + ln.bt_col()));
#pragma unroll
        for (int mt = 0; mt < kDqRows / 16; ++mt) {
          uint32_t da[4];
          ldsm_x4_trans(da, sdS + swz<kStepQ>(kc * 16 + ln.at_row(), dq_row0 + mt * 16 + ln.at_col()));
#pragma unroll
          for (int np = 0; np < kDqCols / 16; ++np) {
            mma(dq[mt][2 * np], da, kb[np][0], kb[np][1]);
            mma(dq[mt][2 * np + 1], da, kb[np][2], kb[np][3]);
          }
        }
      }
      float* dq_head = dq_accum + (static_cast<size_t>(b) * n_head + h) * T * HD + dq_col0;
#pragma unroll
      for (int mt = 0; mt < kDqRows / 16; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int q = q0 + dq_row0 + mt * 16 + g + half * 8;
          if (q < T) {
#pragma unroll
            for (int nt = 0; nt < kDqCols / 8; ++nt)
              atomicAdd(reinterpret_cast<float2*>(dq_head + static_cast<size_t>(q) * HD + nt * 8 + 2 * t),
                        make_float2(dq[mt][nt][2 * half], dq[mt][nt][2 * half + 1]));
          }
        }
    }
    __syncthreads();  // every warp is done with this step's buffers and dS^T
  }

  const float scale = scale_log2 / kLog2e;
  bf16* dseq = dqkv + static_cast<size_t>(b) * T * qkv_dim;
  store_warp_rows<HD>(dk, scale, scale, k_tile, warp * 16, dseq + static_cast<size_t>(n_head + kvh) * HD, qkv_dim,
                      k0 + warp * 16, T);
  store_warp_rows<HD>(dv, 1.f, 1.f, v_tile, warp * 16, dseq + static_cast<size_t>(n_head + n_kv_head + kvh) * HD,
                      qkv_dim, k0 + warp * 16, T);
}

// dqkv[:, q heads] = scale * dQ accumulator ([B, n_head, T, HD] fp32), 8 elements per thread.
template <int HD>
__global__ void attention_backward_epilogue_kernel(bf16* dqkv, const float* dq_accum, int B, int T, int n_head,
                                                   int n_kv_head, float scale) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // chunk of 8 in [B, T, n_head, HD]
  if (i >= static_cast<size_t>(B) * T * n_head * HD / 8) return;
  const size_t col = (i * 8) % (static_cast<size_t>(n_head) * HD), bt = (i * 8) / (static_cast<size_t>(n_head) * HD);
  const size_t h = col / HD, d = col % HD, b = bt / T, t = bt % T;
  const float4* src = reinterpret_cast<const float4*>(dq_accum + ((b * n_head + h) * T + t) * HD + d);
  const float4 lo = src[0], hi = src[1];
  const uint4 packed = make_uint4(pack_bf16(lo.x * scale, lo.y * scale), pack_bf16(lo.z * scale, lo.w * scale),
                                  pack_bf16(hi.x * scale, hi.y * scale), pack_bf16(hi.z * scale, hi.w * scale));
  *reinterpret_cast<uint4*>(dqkv + bt * (static_cast<size_t>(n_head + 2 * n_kv_head) * HD) + col) = packed;
}

// ---- the CODA write-out --------------------------------------------------------------------------
constexpr int kGroupRows = 16;           // rows per block = rows per column-partial group
constexpr int kWriteoutMaxThreads = 256;

__device__ __forceinline__ void unpack_bf16x8(float (&v)[8], const bf16* src) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load_float8(float (&v)[8], const float* src) {
  const float4 lo = reinterpret_cast<const float4*>(src)[0], hi = reinterpret_cast<const float4*>(src)[1];
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

__device__ __forceinline__ void store_float8(float* dst, const float (&v)[8]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// One block per group of kGroupRows rows of dqkv [N = B*T, qkv_dim] (header comment). kDots: 1 (<dz, z>)
// or 3 (LayerNorm: also <dz, c>, <dz, b'>). The q and k heads (columns < rot_cols) are inverse-rotated.
template <int HD, int kDots>
__global__ void __launch_bounds__(kWriteoutMaxThreads)
    attention_backward_writeout_kernel(bf16* __restrict__ dqkv, const float* __restrict__ dq_accum,
                                       const bf16* __restrict__ qkv, const AttentionWriteout w, int N, int T,
                                       int n_head, int n_kv_head, float scale, int rot_cols, float log2_freq_step) {
  __shared__ float s_rstd[kGroupRows], s_rstd_mean[kGroupRows];
  __shared__ float s_dots[kWriteoutMaxThreads / 32][kGroupRows * kDots];
  const int row0 = blockIdx.x * kGroupRows;
  if (threadIdx.x < kGroupRows) {
    const int row = row0 + threadIdx.x;
    float rstd = 0.f, rstd_mean = 0.f;
    if (row < N) {
      if (w.stats.sum != nullptr) {
        const prog::LnStats st = w.stats.ln_stats(row);
        rstd = st.rstd, rstd_mean = st.rstd * st.mean;
      } else {
        rstd = w.stats.rms_rstd(row);
      }
    }
    s_rstd[threadIdx.x] = rstd, s_rstd_mean[threadIdx.x] = rstd_mean;
  }
  __syncthreads();

  const int qkv_dim = (n_head + 2 * n_kv_head) * HD, q_cols = n_head * HD;
  float dots[kGroupRows][kDots] = {};
  for (int chunk = threadIdx.x; chunk < qkv_dim / 8; chunk += blockDim.x) {
    const int col = chunk * 8, head = col / HD, d = col % HD;
    const bool rotate = col < rot_cols;
    float freq[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) freq[p] = epi::rope_turns_per_position(static_cast<float>(d + 2 * p), log2_freq_step);
    float c[8], b_prime[8];
    if constexpr (kDots == 3) {
      load_float8(c, w.c + col);
      load_float8(b_prime, w.b_prime + col);
    }
    float col_a[8] = {}, col_b[8] = {};
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r) {
      const int row = row0 + r;
      if (row < N) {
        const int b = row / T, t = row % T;
        bf16* dst = dqkv + static_cast<size_t>(row) * qkv_dim + col;
        float dz[8], z[8];
        if (col < q_cols) {
          load_float8(dz, dq_accum + ((static_cast<size_t>(b) * n_head + head) * T + t) * HD + d);
#pragma unroll
          for (int i = 0; i < 8; ++i) dz[i] *= scale;
        } else {
          unpack_bf16x8(dz, dst);
        }
        unpack_bf16x8(z, qkv + static_cast<size_t>(row) * qkv_dim + col);
#pragma unroll
        for (int i = 0; i < 8; ++i) dots[r][0] += dz[i] * z[i];
        if (rotate) {
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            float sin_a, cos_a;
            epi::sincos_turns(static_cast<float>(t) * freq[p], &sin_a, &cos_a);
            const float x0 = dz[2 * p], x1 = dz[2 * p + 1];
            dz[2 * p] = x0 * cos_a + x1 * sin_a;
            dz[2 * p + 1] = x1 * cos_a - x0 * sin_a;
          }
        }
        if constexpr (kDots == 3) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            dots[r][1] += dz[i] * c[i];
            dots[r][2] += dz[i] * b_prime[i];
          }
        }
        if (w.col_a != nullptr) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            col_b[i] += dz[i];
            col_a[i] += s_rstd_mean[r] * dz[i];
          }
        }
        const float rs = s_rstd[r];
        *reinterpret_cast<uint4*>(dst) = make_uint4(pack_bf16(rs * dz[0], rs * dz[1]), pack_bf16(rs * dz[2], rs * dz[3]),
                                                    pack_bf16(rs * dz[4], rs * dz[5]), pack_bf16(rs * dz[6], rs * dz[7]));
      }
    }
    if (w.col_a != nullptr) {
      store_float8(w.col_a + static_cast<size_t>(blockIdx.x) * qkv_dim + col, col_a);
      store_float8(w.col_b + static_cast<size_t>(blockIdx.x) * qkv_dim + col, col_b);
    }
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < kGroupRows; ++r)
#pragma unroll
    for (int k = 0; k < kDots; ++k) {
      float v = dots[r][k];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0) s_dots[warp][r * kDots + k] = v;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < kGroupRows * kDots; i += blockDim.x) {
    const int row = row0 + i / kDots, k = i % kDots;
    float sum = 0.f;
    for (int wp = 0; wp < static_cast<int>(blockDim.x / 32); ++wp) sum += s_dots[wp][i];
    if (row < N) (k == 0 ? w.dot_z : k == 1 ? w.dot_c : w.dot_b)[row] = sum;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void validate_writeout(const AttentionWriteout& w) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("attention_backward: AttentionWriteout " + what);
  };
  if (!(w.rope_theta >= 0.0f) || std::isinf(w.rope_theta))
    fail("rope_theta=" + std::to_string(w.rope_theta) + " (0: no RoPE, > 0: RoPE)");
  if (w.stats.sumsq == nullptr || w.stats.count <= 0 || w.stats.d <= 0)
    fail("stats: sumsq, count=" + std::to_string(w.stats.count) + " and d=" + std::to_string(w.stats.d) +
         " are required");
  if (w.dot_z == nullptr) fail("dot_z is required");
  const bool ln_dots = w.c != nullptr;
  if (ln_dots != (w.b_prime != nullptr) || ln_dots != (w.dot_c != nullptr) || ln_dots != (w.dot_b != nullptr))
    fail("c, b_prime, dot_c, dot_b: all or none");
  if ((w.col_a != nullptr) != (w.col_b != nullptr)) fail("col_a, col_b: both or none");
  if (w.col_a != nullptr && w.stats.sum == nullptr) fail("col_a needs stats.sum (the LayerNorm mean)");
  if (!aligned16(w.c) || !aligned16(w.b_prime) || !aligned16(w.col_a) || !aligned16(w.col_b))
    fail("c, b_prime, col_a, col_b must be 16-byte aligned");
}

template <int HD>
void launch_writeout(bf16* dqkv, const float* dq_accum, const bf16* qkv, const AttentionWriteout& w,
                     const AttentionShape& s, float scale, cudaStream_t stream) {
  const int chunks = s.qkv_dim() / 8;
  const int per_thread = (chunks + kWriteoutMaxThreads - 1) / kWriteoutMaxThreads;
  const int threads = ((chunks + per_thread - 1) / per_thread + 31) / 32 * 32;
  const int rows = s.B * s.T, blocks = (rows + kGroupRows - 1) / kGroupRows;
  const bool rope = w.rope_theta > 0.0f;
  const int rot_cols = rope ? (s.n_head + s.n_kv_head) * HD : 0;
  const float log2_freq_step = rope ? -std::log2(w.rope_theta) / static_cast<float>(HD) : 0.0f;
  if (w.c != nullptr)
    attention_backward_writeout_kernel<HD, 3><<<blocks, threads, 0, stream>>>(
        dqkv, dq_accum, qkv, w, rows, s.T, s.n_head, s.n_kv_head, scale, rot_cols, log2_freq_step);
  else
    attention_backward_writeout_kernel<HD, 1><<<blocks, threads, 0, stream>>>(
        dqkv, dq_accum, qkv, w, rows, s.T, s.n_head, s.n_kv_head, scale, rot_cols, log2_freq_step);
  CUDA_CHECK_LAUNCH();
}

constexpr size_t kWorkspaceAlign = 256;
size_t dq_accum_bytes(const AttentionShape& s) {
  const size_t bytes = static_cast<size_t>(s.B) * s.n_head * s.T * s.head_dim * sizeof(float);
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

template <int HD>
void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, void* workspace,
              const AttentionShape& s, cudaStream_t stream, const AttentionWriteout* writeout) {
  float* dq_accum = static_cast<float*>(workspace);
  float* dsum = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + dq_accum_bytes(s));
  const size_t rows = static_cast<size_t>(s.B) * s.T * s.n_head;
  attention_backward_prologue_kernel<HD>
      <<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream>>>(dsum, dq_accum, dout, out, s.B, s.T, s.n_head);
  CUDA_CHECK_LAUNCH();

  constexpr int kSmem = (2 * kBlockK * HD + 4 * kStepQ * HD + kBlockK * kStepQ) * 2 + 4 * kStepQ * 4;
  CUDA_CHECK(cudaFuncSetAttribute(attention_backward_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid(s.B * s.n_kv_head, (s.T + kBlockK - 1) / kBlockK);
  const float scale = 1.f / std::sqrt(static_cast<float>(HD));
  attention_backward_kernel<HD><<<grid, kThreads, kSmem, stream>>>(dqkv, dq_accum, dout, qkv, lse, dsum, s.T, s.n_head,
                                                                   s.n_kv_head, scale * kLog2e);
  CUDA_CHECK_LAUNCH();

  if (writeout != nullptr) {
    launch_writeout<HD>(dqkv, dq_accum, qkv, *writeout, s, scale, stream);
    return;
  }
  const size_t chunks = rows * HD / 8;
  attention_backward_epilogue_kernel<HD><<<static_cast<unsigned>((chunks + 255) / 256), 256, 0, stream>>>(
      dqkv, dq_accum, s.B, s.T, s.n_head, s.n_kv_head, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t attention_backward_workspace_bytes(const AttentionShape& shape) {
  validate_attention_shape(shape);
  return dq_accum_bytes(shape) + static_cast<size_t>(shape.B) * shape.n_head * shape.T * sizeof(float);
}

void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                        void* workspace, const AttentionShape& shape, cudaStream_t stream,
                        const AttentionWriteout* writeout) {
  const profile::Region region("attention backward", stream);
  validate_attention_shape(shape);
  if (writeout != nullptr) validate_writeout(*writeout);
  if (shape.head_dim == 64)
    backward<64>(dqkv, dout, qkv, out, lse, workspace, shape, stream, writeout);
  else
    backward<128>(dqkv, dout, qkv, out, lse, workspace, shape, stream, writeout);
}

int attention_writeout_group_rows() { return kGroupRows; }

}  // namespace coda
