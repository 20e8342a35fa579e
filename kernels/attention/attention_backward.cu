// Backward of causal grouped-query attention for Hopper (sm_90a), FlashAttention-3 shaped: TMA loads,
// wgmma products, a producer warpgroup and two consumer warpgroups. Contract and layouts: attention.cuh;
// the design, with its reasons: docs/ATTENTION.md ("Backward", "The CODA write-out"). Three kernels:
//  1. prologue: D = rowsum(dO * O) and lse * log2 e per (b, h, t) into [B, n_head, T_pad] (rows past T: D = 0,
//     lse = +inf, so their P is 0), and the clearing of the fp32 dQ accumulator;
//  2. main: one block = one kv head x 128 keys; transposed products (S^T = K Q^T, dP^T = V dO^T), so dK and dV
//     are register accumulators summed over the group's query heads without atomics; dS^T goes through a
//     double-buffered shared tile; dQ = dS K in 64 x 64 units per consumer, staged, added by TMA reduce-add
//     (DqSum::Ordered: stored by TMA into the key block's own slice of a [B*n_head*n_kblocks][T][HD] buffer,
//     which a pass then sums in key-block order into the accumulator);
//  3. dQ to bf16, or with a CODA write-out its pass over dqkv's q columns. The write-out is a hook
//     (kernels/coda/attention_writeout_kernels.cuh): the main kernel stages its inputs and finishes the k
//     and v columns with it where a write-out is given (kv.dots != nullptr).
// Tails: TMA zero-fills rows past T of a sequence ([B][T][cols] maps) and clips the dQ reduce-adds at T.

#include "kernels/attention/attention.cuh"
#include "kernels/attention/attention_device.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "kernels/coda/attention_writeout_kernels.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/sm90/sm90.cuh"

namespace coda {
namespace {

using namespace attention_detail;

// Per (b, h, t) row of [B, n_head, T_pad] (T_pad: T rounded up to whole query steps): D = sum_d dO * O and
// lse * log2 e, both fp32; rows past T get D = 0 and lse = +inf (so their P is exactly 0). A streaming
// pass: each thread owns one 8-column chunk of a row (16-byte loads of dO and O, two 16-byte zero stores of
// its part of the row of the dQ accumulator [B, n_head, T, HD], which rows below T clear), the row's HD / 8
// threads are adjacent lanes and sum D with shuffles (16-byte accesses: the pass is bandwidth-bound).
template <int HD>
__global__ void attention_backward_prologue_kernel(float* lse2, float* dsum, float* dq_accum, const bf16* dout,
                                                   const bf16* out, const float* lse, int B, int T, int T_pad,
                                                   int n_head) {
  constexpr int kRowThreads = HD / 8;  // 8 or 16: a power of two that divides the warp
  const size_t chunk = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t row = chunk / kRowThreads;  // (b*n_head + h)*T_pad + t
  const int d = static_cast<int>(chunk % kRowThreads) * 8;
  if (row >= static_cast<size_t>(B) * n_head * T_pad) return;
  const size_t bh = row / T_pad, t = row % T_pad;
  if (t >= static_cast<size_t>(T)) {
    if (d == 0) dsum[row] = 0.f, lse2[row] = INFINITY;
    return;
  }
  const size_t b = bh / n_head, h = bh % n_head, head_row = bh * T + t;  // [B, n_head, T]
  const size_t token_head = ((b * T + t) * n_head + h) * HD + d;         // [B, T, n_head, HD]
  float o[8], g[8];
  load_bf16x8(o, out + token_head);
  load_bf16x8(g, dout + token_head);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc += o[i] * g[i];
  // The row's lanes only: a warp's other rows may be past T (returned above).
  const unsigned row_lanes = ((1u << kRowThreads) - 1) << (threadIdx.x % 32 / kRowThreads * kRowThreads);
#pragma unroll
  for (int off = kRowThreads / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(row_lanes, acc, off);
  if (d == 0) dsum[row] = acc, lse2[row] = lse[head_row] * kLog2e;
  const float zeros[8] = {};
  store_f32x8(dq_accum + head_row * HD + d, zeros);
}

// ---- the main kernel: TMA + wgmma, a producer warpgroup and two consumer warpgroups --------------------
constexpr int kKeysPerWg = 64;              // keys of one consumer warpgroup (one wgmma M tile)
constexpr int kBlockKeys = 2 * kKeysPerWg;  // keys per thread block
constexpr int kDqRows = 64;                 // query rows of one dQ unit (one wgmma M tile)
constexpr int kPadQ = 128;                  // T_pad: T rounded up to a multiple of every query step
constexpr int kThreads = 384;               // producer warpgroup + 2 consumer warpgroups

// The query step per head dim, and the block order (see the kernel), chosen by measurement against the
// alternatives (docs/LOG.md). hd 64: 128-query steps (one wgmma N = 128 per product, half the steps and
// barriers), blocks in their natural order. hd 128: 64-query steps (registers), blocks in groups of 4
// (batch, kv head) pairs, so that blocks running together share Q, dO and dQ rows in L2. Two stages each.
template <int HD>
struct Tuning;
template <>
struct Tuning<64> {
  static constexpr int kStepQ = 128, kGroupPairs = 0;  // 0: all pairs in one group
};
template <>
struct Tuning<128> {
  static constexpr int kStepQ = 64, kGroupPairs = 4;
};

template <int HD, int kStepQ>
struct Layout {
  static constexpr int kStages = 2;                        // Q / dO / lse / D ring
  static constexpr int kKVBytes = kBlockKeys * HD * 2;     // the K (or V) tile: HD/64 boxes of [128 keys][64]
  static constexpr int kStepBytes = kStepQ * HD * 2;       // the Q (or dO) tile of a step: HD/64 boxes [kStepQ][64]
  static constexpr int kDsBytes = kBlockKeys * kStepQ * 2;  // dS^T of a step: kStepQ/64 boxes [128 keys][64]
  static constexpr int kDqBytes = kDqRows * 64 * 4;        // one warpgroup's dQ unit: 2 fp32 boxes [64][32]
  static constexpr int kStatBytes = 2 * kStepQ * 4;        // lse * log2 e | D of a step
  static constexpr int kRowBytes = kBlockKeys * 4;         // CODA write-out: r of the block's keys
  static constexpr int kVecBytes = 4 * HD * 4;             // CODA write-out: c, b' of the k and v columns
  static constexpr int kK = 0, kV = kKVBytes, kQ = 2 * kKVBytes, kDO = kQ + kStages * kStepBytes,
                       kDS = kDO + kStages * kStepBytes, kDQ = kDS + 2 * kDsBytes, kStat = kDQ + 2 * kDqBytes,
                       kRows = kStat + kStages * kStatBytes, kVecs = kRows + kRowBytes, kBar = kVecs + kVecBytes;
  static constexpr int kSmem = kBar + 8 * (1 + 2 * kStages) + 1024;  // + slack to align the base to 1024
};

// acc[64 keys x kStepQ queries] = A[64 keys][HD] B[kStepQ queries][HD]^T, both K-major swizzled tiles:
// S^T = K Q^T and dP^T = V dO^T (a_rows: the warpgroup's first key row in box 0 of K or V).
template <int HD, int kStepQ>
__device__ __forceinline__ void keys_times_queries(float (&acc)[kStepQ / 2], uint32_t a_rows, uint32_t b_tile) {
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const uint32_t box = kk / 4, kbyte = (kk % 4) * 32;
    const uint64_t desc_a = sm90::sw128_descriptor(a_rows + box * kBlockKeys * 128 + kbyte, 16, 1024);
    const uint64_t desc_b = sm90::sw128_descriptor(b_tile + box * kStepQ * 128 + kbyte, 16, 1024);
    if constexpr (kStepQ == 128)
      sm90::wgmma_m64n128k16<0, 0>(acc, desc_a, desc_b, kk > 0);
    else
      sm90::wgmma_m64n64k16<0, 0>(acc, desc_a, desc_b, kk > 0);
  }
}

// acc[64 keys x HD] += a[64 keys x kStepQ queries] (bf16 fragments in registers) B[kStepQ queries][HD]
// (MN-major): dV += P^T dO and dK += dS^T Q.
template <int HD, int kStepQ>
__device__ __forceinline__ void keys_times_step(float (&acc)[HD / 2], const uint32_t (&a)[kStepQ / 16][4],
                                                uint32_t b_tile) {
#pragma unroll
  for (int kc = 0; kc < kStepQ / 16; ++kc) {
    const uint64_t desc = sm90::sw128_descriptor(b_tile + kc * 16 * 128, kStepQ * 128, 1024);
    if constexpr (HD == 128)
      sm90::wgmma_m64n128k16_rs<1>(acc, a[kc], desc);
    else
      sm90::wgmma_m64n64k16_rs<1>(acc, a[kc], desc);
  }
}

// The bf16 A fragments of a keys x queries accumulator (P^T or dS^T): 16 queries per fragment.
template <int kStepQ>
__device__ __forceinline__ void pack_fragments(uint32_t (&a)[kStepQ / 16][4], const float (&acc)[kStepQ / 2]) {
#pragma unroll
  for (int kc = 0; kc < kStepQ / 16; ++kc)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kc][i] = pack_bf16(acc[8 * kc + 2 * i], acc[8 * kc + 2 * i + 1]);
}

template <int HD, int kStepQ, bool kOrderedDq>
__global__ void __launch_bounds__(kThreads, 1)
    attention_backward_kernel(const __grid_constant__ CUtensorMap qkv_map, const __grid_constant__ CUtensorMap dout_map,
                              const __grid_constant__ CUtensorMap dq_map, bf16* dqkv,
                              const attention_writeout::KvWriteout kv,
                              const float* lse2, const float* dsum, int T, int T_pad, int n_head, int n_kv_head,
                              float scale_log2, int group_pairs) {
  using L = Layout<HD, kStepQ>;
  constexpr int S = L::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (sm90::smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t base = sm90::smem_u32(smem);
  const uint32_t bar_kv = base + L::kBar, bar_full = bar_kv + 8, bar_empty = bar_full + 8 * S;

  const int group = n_head / n_kv_head;
  // Block order: groups of group_pairs (batch, kv head) pairs; inside a group, key block by key block
  // (small key blocks, most query steps, first), the group's pairs side by side. Blocks running at the
  // same time then share their pairs' Q, dO and dQ rows in L2.
  const int n_kblocks = (T + kBlockKeys - 1) / kBlockKeys, n_pairs = gridDim.x / n_kblocks;
  const int group_first = blockIdx.x / (group_pairs * n_kblocks) * group_pairs;
  const int pairs_here = min(group_pairs, n_pairs - group_first);
  const int in_group = blockIdx.x - group_first * n_kblocks;
  const int pair = group_first + in_group % pairs_here;
  const int b = pair / n_kv_head, kvh = pair % n_kv_head;
  const int k0 = in_group / pairs_here * kBlockKeys;
  const int first_step = k0 / kStepQ, steps_per_head = (T + kStepQ - 1) / kStepQ - first_step;
  const int n_steps = group * steps_per_head;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    sm90::mbar_init(bar_kv, 1);
    for (int s = 0; s < S; ++s) {
      sm90::mbar_init(bar_full + 8 * s, 1);
      sm90::mbar_init(bar_empty + 8 * s, 256);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    sm90::regs_release<24>();
    if (threadIdx.x == 0) {
      sm90::mbar_arrive_expect_tx(bar_kv, 2 * L::kKVBytes);
      for (int box = 0; box < HD / 64; ++box)
        for (int part = 0; part < kBlockKeys / kStepQ; ++part) {  // boxes of kStepQ rows
          const uint32_t off = box * kBlockKeys * 128 + part * kStepQ * 128;
          const int key = k0 + part * kStepQ;
          sm90::tma_load_3d(base + L::kK + off, &qkv_map, bar_kv, (n_head + kvh) * HD + box * 64, key, b);
          sm90::tma_load_3d(base + L::kV + off, &qkv_map, bar_kv, (n_head + n_kv_head + kvh) * HD + box * 64, key, b);
        }
      for (int step = 0; step < n_steps; ++step) {
        const int s = step % S;
        if (step >= S) sm90::mbar_wait(bar_empty + 8 * s, ((step / S) - 1) & 1);
        const int h = kvh * group + step / steps_per_head, q0 = (first_step + step % steps_per_head) * kStepQ;
        const uint32_t full = bar_full + 8 * s;
        sm90::mbar_arrive_expect_tx(full, 2 * L::kStepBytes + L::kStatBytes);
        for (int box = 0; box < HD / 64; ++box) {
          const uint32_t off = s * L::kStepBytes + box * kStepQ * 128;
          sm90::tma_load_3d(base + L::kQ + off, &qkv_map, full, h * HD + box * 64, q0, b);
          sm90::tma_load_3d(base + L::kDO + off, &dout_map, full, h * HD + box * 64, q0, b);
        }
        const size_t stat_row = (static_cast<size_t>(b) * n_head + h) * T_pad + q0;
        const uint32_t stat = base + L::kStat + s * L::kStatBytes;
        sm90::bulk_load(stat, lse2 + stat_row, kStepQ * 4, full);
        sm90::bulk_load(stat + kStepQ * 4, dsum + stat_row, kStepQ * 4, full);
      }
    }
    return;
  }
  sm90::regs_claim<240>();

  const int c = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool dq_issuer = (threadIdx.x & 127) == 0;  // issues this warpgroup's dQ reduce-adds
  const int key0 = k0 + c * kKeysPerWg;     // this warpgroup's first key
  const int key_lo = key0 + warp * 16 + g;  // this thread's keys: key_lo, key_lo + 8
  const uint32_t k_rows = base + L::kK + c * kKeysPerWg * 128, v_rows = base + L::kV + c * kKeysPerWg * 128;
  unsigned char* dq_stage = smem + L::kDQ + c * L::kDqBytes;
  float dk[HD / 2] = {}, dv[HD / 2] = {};
  float* writeout_rows = reinterpret_cast<float*>(smem + L::kRows);
  float* writeout_vecs = reinterpret_cast<float*>(smem + L::kVecs);
  if (kv.dots != nullptr)
    attention_writeout::stage_writeout_inputs<HD, kBlockKeys, kThreads - 128>(
        kv, writeout_rows, writeout_vecs, threadIdx.x - 128, k0, b, T, kvh, n_head, n_kv_head);
  sm90::mbar_wait(bar_kv, 0);

  for (int step = 0; step < n_steps; ++step) {
    const int s = step % S;
    const int h = kvh * group + step / steps_per_head, q0 = (first_step + step % steps_per_head) * kStepQ;
    const uint32_t q_tile = base + L::kQ + s * L::kStepBytes, do_tile = base + L::kDO + s * L::kStepBytes;
    const uint32_t ds_tile = base + L::kDS + (step & 1) * L::kDsBytes;  // double-buffered across steps
    const float* stat = reinterpret_cast<const float*>(smem + L::kStat + s * L::kStatBytes);
    // When all of warpgroup 1's keys come after all the step's queries (the first step of a head with
    // 64-query steps), it skips its products and stores a zero dS^T.
    const bool skipped = c == 1 && q0 + kStepQ - 1 < key0;
    sm90::mbar_wait(bar_full + 8 * s, (step / S) & 1);

    uint32_t pa[kStepQ / 16][4] = {}, ds[kStepQ / 16][4] = {};
    if (!skipped) {
      float p[kStepQ / 2], dp[kStepQ / 2];
      sm90::wgmma_fence();
      keys_times_queries<HD, kStepQ>(p, k_rows, q_tile);
      sm90::wgmma_commit();
      keys_times_queries<HD, kStepQ>(dp, v_rows, do_tile);
      sm90::wgmma_commit();

      // P^T = exp2(S^T scale log2 e - lse log2 e), zero above the diagonal (key > query).
      sm90::wgmma_wait<1>();
      sm90::fence_registers(p);
      const bool diagonal = q0 < key0 + kKeysPerWg - 1;
#pragma unroll
      for (int i = 0; i < kStepQ / 2; ++i) {
        const int qi = 8 * (i >> 2) + 2 * t + (i & 1);
        const float v = exp2f(p[i] * scale_log2 - stat[qi]);
        p[i] = (diagonal && key_lo + 8 * ((i >> 1) & 1) > q0 + qi) ? 0.f : v;
      }
      pack_fragments<kStepQ>(pa, p);
      sm90::wgmma_fence();
      keys_times_step<HD, kStepQ>(dv, pa, do_tile);
      sm90::wgmma_commit();

      // dS^T = P^T (dP^T - D): in registers the A of dK; also stored to this warpgroup's rows of dS^T.
      sm90::wgmma_wait<1>();
      sm90::fence_registers(dp);
#pragma unroll
      for (int i = 0; i < kStepQ / 2; ++i) p[i] *= dp[i] - stat[kStepQ + 8 * (i >> 2) + 2 * t + (i & 1)];
      pack_fragments<kStepQ>(ds, p);
    }
#pragma unroll
    for (int kc = 0; kc < kStepQ / 16; ++kc)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        *reinterpret_cast<uint32_t*>(smem + (ds_tile - base) +
                                     box_offset(kBlockKeys, c * kKeysPerWg + warp * 16 + g + 8 * (i & 1),
                                                kc * 16 + 8 * (i >> 1) + 2 * t)) = ds[kc][i];
    sm90::fence_proxy_async_smem();
    if (!skipped) {
      sm90::wgmma_fence();
      keys_times_step<HD, kStepQ>(dk, ds, q_tile);
      sm90::wgmma_commit();
    }
    // The previous step's dQ reduce-add has read its staging tile.
    if (dq_issuer) sm90::bulk_wait_read<0>();
    sm90::named_barrier(1, 256);  // dS^T of both warpgroups is in shared memory

    // dQ[step] += dS K over the block's 128 keys, in units of 64 queries x 64 columns (two per step: hd 64
    // with 128-query steps, hd 128 with 64-query steps), one unit per warpgroup.
    constexpr int kColUnits = HD / 64;
    static_assert(kStepQ / kDqRows * kColUnits == 2, "two dQ units per step, one per consumer warpgroup");
    const int unit = (c + step) & 1;
    const int mt = unit / kColUnits, n = unit % kColUnits;
    float dq[32];
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockKeys / 16; ++kk)
      sm90::wgmma_m64n64k16<1, 1>(
          dq, sm90::sw128_descriptor(ds_tile + mt * kBlockKeys * 128 + kk * 16 * 128, kBlockKeys * 128, 1024),
          sm90::sw128_descriptor(base + L::kK + n * kBlockKeys * 128 + kk * 16 * 128, kBlockKeys * 128, 1024),
          kk > 0);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();  // every product that reads the stage (and dS^T) is done
    sm90::fence_registers(dq);
#pragma unroll
    for (int kc = 0; kc < kStepQ / 16; ++kc) {
      sm90::fence_registers(pa[kc]);
      sm90::fence_registers(ds[kc]);
    }
    sm90::mbar_arrive(bar_empty + 8 * s);

    // Staged as 2 fp32 boxes [64 queries][32 columns] (128-byte swizzle), added into the accumulator by
    // the copy engine; rows past T are clipped by the [B*n_head][T][HD] tensor map.
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int row = warp * 16 + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t;
      *reinterpret_cast<float2*>(dq_stage + (col >> 5) * kDqRows * 128 + sm90::sw128_offset(row, (col & 31) * 4)) =
          make_float2(dq[i], dq[i + 1]);
    }
    sm90::fence_proxy_async_smem();
    sm90::named_barrier(2 + c, 128);
    if (dq_issuer) {
      for (int box = 0; box < 2; ++box)
        if constexpr (kOrderedDq)
          sm90::tma_store_3d(&dq_map, dq_stage + box * kDqRows * 128, n * 64 + box * 32, q0 + mt * kDqRows,
                             (b * n_head + h) * n_kblocks + k0 / kBlockKeys);
        else
          sm90::tma_reduce_add_3d(&dq_map, dq_stage + box * kDqRows * 128, n * 64 + box * 32, q0 + mt * kDqRows,
                                  b * n_head + h);
      sm90::bulk_commit();
    }
  }
  if (dq_issuer) sm90::bulk_wait<0>();
  sm90::fence_registers(dk);
  sm90::fence_registers(dv);

  // dK (times scale) and dV -- with a CODA write-out, the k and v columns' finished dz' (finish_kv_rows) --
  // as bf16 into this warp's rows of the K and V tiles, then 16-byte stores of the rows below T. The other
  // warpgroup may still read K for dQ: wait until both are done.
  sm90::named_barrier(1, 256);
  const int tile_row = c * kKeysPerWg + warp * 16 + g;
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk[i] *= scale_log2 / kLog2e;
  if (kv.dots != nullptr)
    attention_writeout::finish_kv_rows<HD, kBlockKeys>(dk, dv, kv, smem + L::kK, smem + L::kV, writeout_rows,
                                                       writeout_vecs, tile_row, b, T, kvh, n_head, n_kv_head,
                                                       key0 + warp * 16, lane);
#pragma unroll
  for (int i = 0; i < HD / 2; i += 2) {
    const int row = tile_row + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t;
    *reinterpret_cast<uint32_t*>(smem + L::kK + box_offset(kBlockKeys, row, col)) = pack_bf16(dk[i], dk[i + 1]);
    *reinterpret_cast<uint32_t*>(smem + L::kV + box_offset(kBlockKeys, row, col)) = pack_bf16(dv[i], dv[i + 1]);
  }
  __syncwarp();
  const size_t qkv_dim = static_cast<size_t>(n_head + 2 * n_kv_head) * HD;
  bf16* dk_dst = dqkv + static_cast<size_t>(b) * T * qkv_dim + static_cast<size_t>(n_head + kvh) * HD;
  bf16* dv_dst = dk_dst + static_cast<size_t>(n_kv_head) * HD;
  constexpr int kChunks = HD / 8;
#pragma unroll
  for (int i = lane; i < 16 * kChunks; i += 32) {
    const int r = i / kChunks, col = (i % kChunks) * 8;
    const int key = key0 + warp * 16 + r, row = c * kKeysPerWg + warp * 16 + r;
    if (key < T) {
      *reinterpret_cast<int4*>(dk_dst + static_cast<size_t>(key) * qkv_dim + col) =
          *reinterpret_cast<const int4*>(smem + L::kK + box_offset(kBlockKeys, row, col));
      *reinterpret_cast<int4*>(dv_dst + static_cast<size_t>(key) * qkv_dim + col) =
          *reinterpret_cast<const int4*>(smem + L::kV + box_offset(kBlockKeys, row, col));
    }
  }
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

// DqSum::Ordered: dq_accum[bh][t] = the sum over key blocks kb = 0 .. t / 128 (those whose keys row t sees,
// and so the slices the main kernel stored row t into) of parts[bh * n_kblocks + kb][t], in that order;
// 8 elements per thread.
template <int HD>
__global__ void attention_backward_sum_dq_kernel(float* dq_accum, const float* parts, int BH, int T, int n_kblocks) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // chunk of 8 in [BH, T, HD]
  if (i >= static_cast<size_t>(BH) * T * HD / 8) return;
  const size_t d = (i * 8) % HD, row = (i * 8) / HD, bh = row / T, t = row % T;
  float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
  for (int kb = 0; kb <= static_cast<int>(t) / kBlockKeys; ++kb) {
    const float4* src = reinterpret_cast<const float4*>(parts + ((bh * n_kblocks + kb) * T + t) * HD + d);
    const float4 a = src[0], b = src[1];
    lo = make_float4(lo.x + a.x, lo.y + a.y, lo.z + a.z, lo.w + a.w);
    hi = make_float4(hi.x + b.x, hi.y + b.y, hi.z + b.z, hi.w + b.w);
  }
  float4* dst = reinterpret_cast<float4*>(dq_accum + row * HD + d);
  dst[0] = lo;
  dst[1] = hi;
}

constexpr size_t kWorkspaceAlign = 256;
size_t aligned(size_t bytes) { return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }
size_t dq_accum_bytes(const AttentionShape& s) {
  return aligned(static_cast<size_t>(s.B) * s.n_head * s.T * s.head_dim * sizeof(float));
}
int key_blocks(const AttentionShape& s) { return (s.T + kBlockKeys - 1) / kBlockKeys; }

int padded_T(const AttentionShape& s) { return (s.T + kPadQ - 1) / kPadQ * kPadQ; }

// The workspace: the dQ accumulator, D and lse * log2 e, the write-out's kv dots, and when Ordered the key
// blocks' dQ parts (each part 256-byte aligned, as TMA wants its global addresses).
struct Workspace {
  float *dq_accum, *dsum, *lse2, *kv_dots, *dq_parts;
};
size_t stat_rows(const AttentionShape& s) { return static_cast<size_t>(s.B) * s.n_head * padded_T(s); }
size_t kv_dots_bytes(const AttentionShape& s) {
  return aligned(3 * static_cast<size_t>(s.B) * s.T * s.n_kv_head * sizeof(float));
}
Workspace carve(void* base, const AttentionShape& s) {
  unsigned char* bytes = static_cast<unsigned char*>(base);
  Workspace w;
  w.dq_accum = reinterpret_cast<float*>(bytes);
  w.dsum = reinterpret_cast<float*>(bytes + dq_accum_bytes(s));
  w.lse2 = w.dsum + stat_rows(s);
  w.kv_dots = w.lse2 + stat_rows(s);  // [B*T][n_kv_head][1 or 3], with a write-out
  w.dq_parts = reinterpret_cast<float*>(bytes + dq_accum_bytes(s) + aligned(2 * stat_rows(s) * sizeof(float)) +
                                        kv_dots_bytes(s));
  return w;
}

template <int HD>
void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, void* workspace,
              const AttentionShape& s, cudaStream_t stream, const AttentionWriteout* writeout, DqSum dq_sum) {
  const int T_pad = padded_T(s);
  const Workspace w = carve(workspace, s);
  float *dq_accum = w.dq_accum, *dsum = w.dsum, *lse2 = w.lse2, *kv_dots = w.kv_dots;
  const bool ordered = dq_sum == DqSum::Ordered;
  std::optional<profile::Region> region(std::in_place, "attention backward: prologue", profile::Work::Attention,
                                        stream);
  attention_backward_prologue_kernel<HD><<<static_cast<unsigned>((stat_rows(s) * (HD / 8) + 255) / 256), 256, 0, stream>>>(
      lse2, dsum, dq_accum, dout, out, lse, s.B, s.T, T_pad, s.n_head);
  CUDA_CHECK_LAUNCH();

  const float scale = 1.f / std::sqrt(static_cast<float>(HD));
  constexpr int kStepQ = Tuning<HD>::kStepQ;
  const CUtensorMap qkv_map = sequence_tensor_map(qkv, s.qkv_dim(), s.T, s.B, kStepQ, "qkv");
  const CUtensorMap dout_map = sequence_tensor_map(dout, s.n_head * HD, s.T, s.B, kStepQ, "dout");
  const int n_pairs = s.B * s.n_kv_head, n_kblocks = key_blocks(s);
  const CUtensorMap dq_map =
      ordered ? sequence_tensor_map(w.dq_parts, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, HD, s.T, s.B * s.n_head * n_kblocks,
                                    kDqRows, "dq parts")
              : sequence_tensor_map(dq_accum, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, HD, s.T, s.B * s.n_head, kDqRows,
                                    "dq accumulator");
  constexpr int kSmem = Layout<HD, kStepQ>::kSmem;
  auto* kernel = ordered ? attention_backward_kernel<HD, kStepQ, true> : attention_backward_kernel<HD, kStepQ, false>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int group_pairs = Tuning<HD>::kGroupPairs > 0 ? std::min(Tuning<HD>::kGroupPairs, n_pairs) : n_pairs;
  region.emplace("attention backward: main", profile::Work::Attention, stream);
  attention_writeout::KvWriteout kv;
  if (writeout != nullptr) {
    kv.w = *writeout, kv.dots = kv_dots;
    kv.log2_freq_step = attention_writeout::rope_log2_freq_step(*writeout, HD);
    kv.groups_per_seq = attention_writeout::groups_per_sequence(s.T);
  }
  kernel<<<n_pairs * n_kblocks, kThreads, kSmem, stream>>>(qkv_map, dout_map, dq_map, dqkv, kv, lse2, dsum, s.T,
                                                           T_pad, s.n_head, s.n_kv_head, scale * kLog2e, group_pairs);
  CUDA_CHECK_LAUNCH();
  if (ordered) {
    region.emplace("attention backward: ordered dq sum", profile::Work::Attention, stream);
    const size_t chunks = static_cast<size_t>(s.B) * s.n_head * s.T * HD / 8;
    attention_backward_sum_dq_kernel<HD><<<static_cast<unsigned>((chunks + 255) / 256), 256, 0, stream>>>(
        dq_accum, w.dq_parts, s.B * s.n_head, s.T, n_kblocks);
    CUDA_CHECK_LAUNCH();
  }

  if (writeout != nullptr) {
    region.emplace("attention backward: write-out", profile::Work::Attention, stream);
    attention_writeout::launch_writeout<HD>(dqkv, dq_accum, qkv, kv_dots, *writeout, s, scale, stream);
    return;
  }
  region.emplace("attention backward: dq conversion", profile::Work::Attention, stream);
  const size_t chunks = static_cast<size_t>(s.B) * s.T * s.n_head * HD / 8;
  attention_backward_epilogue_kernel<HD><<<static_cast<unsigned>((chunks + 255) / 256), 256, 0, stream>>>(
      dqkv, dq_accum, s.B, s.T, s.n_head, s.n_kv_head, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t attention_backward_workspace_bytes(const AttentionShape& shape, DqSum dq_sum) {
  validate_attention_shape(shape);
  const size_t parts = dq_sum == DqSum::Ordered ? static_cast<size_t>(key_blocks(shape)) * dq_accum_bytes(shape) : 0;
  return dq_accum_bytes(shape) + aligned(2 * stat_rows(shape) * sizeof(float)) + kv_dots_bytes(shape) + parts;
}

void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                        void* workspace, const AttentionShape& shape, cudaStream_t stream,
                        const AttentionWriteout* writeout, DqSum dq_sum) {
  validate_attention_shape(shape);
  if (writeout != nullptr) attention_writeout::validate_writeout(*writeout);
  if (shape.head_dim == 64)
    backward<64>(dqkv, dout, qkv, out, lse, workspace, shape, stream, writeout, dq_sum);
  else
    backward<128>(dqkv, dout, qkv, out, lse, workspace, shape, stream, writeout, dq_sum);
}

}  // namespace coda
