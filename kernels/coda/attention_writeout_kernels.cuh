// The device code of the CODA write-out (the contract: attention_writeout.cuh), the hooks that the attention
// backward (kernels/attention/attention_backward.cu) runs with a write-out: its main kernel stages the
// write-out's inputs before its first product (stage_writeout_inputs) and finishes the k and v columns on
// the dK, dV it holds (finish_kv_rows), and the pass over the q columns (launch_writeout) replaces its dQ
// conversion. finish_kv_rows reads the K and V tiles in the backward's shared-memory layout (HD / 64
// swizzled boxes of kTileKeys rows, box_offset). Design: docs/ATTENTION.md, "The CODA write-out".

#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/attention/attention_device.cuh"
#include "kernels/coda/attention_writeout.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/epilogue/functions.cuh"

namespace coda::attention_writeout {

using attention_detail::bf16;
using attention_detail::box_offset;
using attention_detail::pack_bf16;

// Reduce-scatter of kValues values per lane over the lanes that differ in the top log2(kValues) lane bits
// (offsets 16, 8, ...): at each step a lane keeps one half of its values, adds the partner's copy of that
// half and sends the other, about kValues shuffles in all. Leaves in v[0] of each lane the sum of its
// value lane / (32 / kValues) over those lanes. One step per template instance, so that every loop has a
// constant trip count and unrolls (v must stay in registers).
template <int kHalf, int kOffset, int kValues>
__device__ __forceinline__ void scatter_halves(float (&v)[kValues], int lane) {
  if constexpr (kHalf >= 1) {
    const bool upper = (lane & kOffset) != 0;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float keep = upper ? v[i + kHalf] : v[i], send = upper ? v[i] : v[i + kHalf];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kOffset);
    }
    scatter_halves<kHalf / 2, kOffset / 2>(v, lane);
  }
}

template <int kValues>
__device__ __forceinline__ float sum_scattered(float (&v)[kValues], int lane) {
  static_assert(kValues >= 1 && kValues <= 32 && (kValues & (kValues - 1)) == 0, "a power of two up to 32");
  scatter_halves<kValues / 2, 16>(v, lane);
  return v[0];
}

// Warp sums of kValues values per lane: the reduce-scatter, then the remaining lanes' shuffles. Returns in
// each lane the warp's sum of value lane / (32 / kValues).
template <int kValues>
__device__ __forceinline__ float warp_sum_scattered(float (&v)[kValues], int lane) {
  float sum = sum_scattered<kValues>(v, lane);
#pragma unroll
  for (int offset = 16 / kValues; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

// The write-out's part for the k and v columns (attention_writeout.cuh), done by the backward's main kernel
// on the dK, dV it holds (dots == nullptr: none, the unfused mode).
struct KvWriteout {
  AttentionWriteout w;
  float* dots = nullptr;        // [B*T][n_kv_head][1 or 3]: <dz, z> (, <dz, c>, <dz, b'>) over the kv head's columns
  float log2_freq_step = 0.0f;  // RoPE: -log2(theta) / HD
  int groups_per_seq = 0;       // column-partial groups of a sequence, ceil(T / kGroupRows)
};

// The write-out's inputs of this block that are not tiles, staged in shared memory by the consumers
// before their first product, so that their loads overlap the K and V tiles' TMA instead of adding to the
// block's tail (one block per SM): r of the block's kTileKeys keys (rows[key]), and for LayerNorm c and b'
// of the kv head's k and v columns (vecs: c of k | c of v | b' of k | b' of v, HD each), or for RMSNorm
// with a qkv bias that bias in the b' slots. i: the consumer
// thread, 0 .. kConsumerThreads - 1.
template <int HD, int kTileKeys, int kConsumerThreads>
__device__ __forceinline__ void stage_writeout_inputs(const KvWriteout& kv, float* rows, float* vecs, int i, int k0,
                                                      int b, int T, int kvh, int n_head, int n_kv_head) {
  const AttentionWriteout& w = kv.w;
  if (i < kTileKeys) rows[i] = w.stats.rstd(b * T + min(k0 + i, T - 1));
  const int k_cols = (n_head + kvh) * HD, v_cols = k_cols + n_kv_head * HD;
  if (w.c != nullptr) {
    for (int j = i; j < 4 * HD; j += kConsumerThreads) {
      const int part = j / HD;
      vecs[j] = (part < 2 ? w.c : w.b_prime)[(part % 2 == 0 ? k_cols : v_cols) + j % HD];
    }
  } else if (w.bias != nullptr) {
    for (int j = i; j < 2 * HD; j += kConsumerThreads)
      vecs[2 * HD + j] = __bfloat162float(w.bias[(j < HD ? k_cols : v_cols) + j % HD]);
  }
}

// On this thread's dz values of two key rows (warp_key0 + g and + 8; dk already times scale, dv): the
// row dots <dz, z> against the k and v the K and V tiles still hold (as stored, rotated: the dot is the
// same before the inverse rotation), the inverse RoPE of dk, then on the unrotated dz the LayerNorm dots
// and the column partials (the warp's 16 keys are one group: two rows per thread, 8 lanes per column,
// a reduce-scatter over those lanes leaves each lane one of 32 consecutive columns), the row dots summed
// over the quad that holds the row and stored, and last the row scale: dz' = r dz.
template <int HD, int kTileKeys>
__device__ __forceinline__ void finish_kv_rows(float (&dk)[HD / 2], float (&dv)[HD / 2], const KvWriteout& kv,
                                               const unsigned char* k_tile, const unsigned char* v_tile,
                                               const float* rows, const float* vecs, int tile_row, int b, int T,
                                               int kvh, int n_head, int n_kv_head, int warp_key0, int lane) {
  const AttentionWriteout& w = kv.w;
  const int g = lane >> 2, t = lane & 3;
  const bool layernorm = w.c != nullptr;
  bool valid[2];
  float rstd[2], dots[3][2] = {};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    valid[h] = warp_key0 + g + 8 * h < T;
    rstd[h] = rows[tile_row + 8 * h];
  }
#pragma unroll
  for (int i = 0; i < HD / 2; i += 2) {
    const int h = (i >> 1) & 1, at = box_offset(kTileKeys, tile_row + 8 * h, 8 * (i >> 2) + 2 * t);
    const float2 kz = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(k_tile + at));
    const float2 vz = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(v_tile + at));
    dots[0][h] += dk[i] * kz.x + dk[i + 1] * kz.y + dv[i] * vz.x + dv[i + 1] * vz.y;
  }
  if (w.rope_theta > 0.0f) {
#pragma unroll
    for (int i = 0; i < HD / 2; i += 2) {
      const int h = (i >> 1) & 1, col = 8 * (i >> 2) + 2 * t;
      float sin_a, cos_a;
      epi::sincos_turns(static_cast<float>(warp_key0 + g + 8 * h) *
                            epi::rope_turns_per_position(static_cast<float>(col), kv.log2_freq_step),
                        &sin_a, &cos_a);
      const float x0 = dk[i], x1 = dk[i + 1];
      dk[i] = x0 * cos_a + x1 * sin_a;
      dk[i + 1] = x1 * cos_a - x0 * sin_a;
    }
  }
  const int qkv_dim = (n_head + 2 * n_kv_head) * HD, k_cols = (n_head + kvh) * HD, v_cols = k_cols + n_kv_head * HD;
  if (layernorm) {
#pragma unroll
    for (int i = 0; i < HD / 2; i += 2) {
      const int h = (i >> 1) & 1, col = 8 * (i >> 2) + 2 * t;
      const float2 ck = *reinterpret_cast<const float2*>(vecs + col);
      const float2 cv = *reinterpret_cast<const float2*>(vecs + HD + col);
      const float2 bk = *reinterpret_cast<const float2*>(vecs + 2 * HD + col);
      const float2 bv = *reinterpret_cast<const float2*>(vecs + 3 * HD + col);
      dots[1][h] += dk[i] * ck.x + dk[i + 1] * ck.y + dv[i] * cv.x + dv[i + 1] * cv.y;
      dots[2][h] += dk[i] * bk.x + dk[i + 1] * bk.y + dv[i] * bv.x + dv[i + 1] * bv.y;
    }
  }
  if (!layernorm && w.bias != nullptr) {  // <dz, bias> off <dz, z>: the norm backward reads z - bias
#pragma unroll
    for (int i = 0; i < HD / 2; i += 2) {
      const int h = (i >> 1) & 1, col = 8 * (i >> 2) + 2 * t;
      const float2 bk = *reinterpret_cast<const float2*>(vecs + 2 * HD + col);
      const float2 bv = *reinterpret_cast<const float2*>(vecs + 3 * HD + col);
      dots[0][h] -= dk[i] * bk.x + dk[i + 1] * bk.y + dv[i] * bv.x + dv[i + 1] * bv.y;
    }
  }
  if (w.col_b != nullptr && warp_key0 < T) {
    const size_t group_row = (static_cast<size_t>(b) * kv.groups_per_seq + warp_key0 / kGroupRows) * qkv_dim;
    auto column_partials = [&](const float (&dz)[HD / 2], int cols) {
#pragma unroll
      for (int block = 0; block < HD / 32; ++block) {  // 32 columns: 4 of the thread's pairs
        float sum_b[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          const int i = 4 * (4 * block + v / 2) + v % 2;  // row warp_key0 + g; i + 2: row + 8
          sum_b[v] = (valid[0] ? dz[i] : 0.f) + (valid[1] ? dz[i + 2] : 0.f);
        }
        w.col_b[group_row + cols + 32 * block + 8 * (g >> 1) + 2 * t + (g & 1)] = sum_scattered<8>(sum_b, lane);
      }
    };
    column_partials(dk, k_cols);
    column_partials(dv, v_cols);
  }
  const int dot_count = layernorm ? 3 : 1;
#pragma unroll
  for (int d = 0; d < 3; ++d)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float dot = dots[d][h];
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      const int key = warp_key0 + g + 8 * h;
      if (d < dot_count && t == 0 && key < T)
        kv.dots[((static_cast<size_t>(b) * T + key) * n_kv_head + kvh) * dot_count + d] = dot;
    }
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) {
    const float r = rstd[(i >> 1) & 1];
    dk[i] *= r;
    dv[i] *= r;
  }
}

constexpr int kBatchRows = 4;            // rows whose loads a thread issues together
constexpr int kWriteoutMaxThreads = 256;

// One block per column-partial group (kGroupRows consecutive positions of one sequence; the last group of
// a sequence may be shorter) of the q columns of dqkv [B*T, qkv_dim] (attention_writeout.cuh); its threads take
// the row's 8-column chunks in turn, each chunk down the group's rows, kBatchRows rows' loads issued
// together (a streaming pass: enough loads must be in flight). kDots: 1 (<dz, z>) or 3 (LayerNorm: also
// <dz, c>, <dz, b'>), kept per row of a batch and summed over the warp when the batch is done; the warps'
// sums meet in shared memory with the row's k and v parts (kv_dots, one per kv head) in a fixed order.
template <int HD, int kDots>
__global__ void __launch_bounds__(kWriteoutMaxThreads)
    attention_backward_writeout_kernel(bf16* __restrict__ dqkv, const float* __restrict__ dq_accum,
                                       const bf16* __restrict__ qkv, const float* __restrict__ kv_dots,
                                       const AttentionWriteout w, int T, int groups_per_seq, int n_head,
                                       int n_kv_head, float scale, bool rope, float log2_freq_step) {
  constexpr int kDotSlots = kDots == 3 ? 4 : 1;            // per row, a power of two
  constexpr int kBatchValues = kBatchRows * kDotSlots;     // dot values per thread and batch
  constexpr int kLanesPerValue = 32 / kBatchValues;
  __shared__ float s_rstd[kGroupRows];
  __shared__ float s_dots[kWriteoutMaxThreads / 32][kGroupRows * kDotSlots];
  const int b = blockIdx.x / groups_per_seq, t0 = blockIdx.x % groups_per_seq * kGroupRows;
  const int row0 = b * T + t0, rows = min(kGroupRows, T - t0), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kGroupRows)
    s_rstd[threadIdx.x] = static_cast<int>(threadIdx.x) < rows ? w.stats.rstd(row0 + threadIdx.x) : 0.f;
  for (int i = threadIdx.x; i < kWriteoutMaxThreads / 32 * kGroupRows * kDotSlots; i += blockDim.x)
    (&s_dots[0][0])[i] = 0.f;

  const int qkv_dim = (n_head + 2 * n_kv_head) * HD, chunks = n_head * HD / 8;
  // Every thread runs every pass (the shuffles need whole warps); past the last chunk it runs on chunk 0
  // and drops its results.
  for (int pass = 0; pass < chunks; pass += blockDim.x) {
    const bool active = pass + static_cast<int>(threadIdx.x) < chunks;
    const int col = active ? (pass + threadIdx.x) * 8 : 0, head = col / HD, d = col % HD;
    float freq[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) freq[p] = epi::rope_turns_per_position(static_cast<float>(d + 2 * p), log2_freq_step);
    float c[8], b_prime[8];
    if constexpr (kDots == 3) {
      load_f32x8(c, w.c + col);
      load_f32x8(b_prime, w.b_prime + col);
    } else if (w.bias != nullptr) {  // the qkv bias, in b_prime (RMSNorm: <dz, bias> comes off <dz, z>)
      unpack_bf16x8(b_prime, __ldg(reinterpret_cast<const uint4*>(w.bias + col)));
    }
    float col_b[8] = {};
#pragma unroll 1
    for (int r0 = 0; r0 < kGroupRows; r0 += kBatchRows) {
      // The batch's loads: dz (the scaled dQ accumulator) and z (the stored q).
      float dz[kBatchRows][8];
      uint4 z_raw[kBatchRows];
#pragma unroll
      for (int r = 0; r < kBatchRows; ++r) {
        const int t = t0 + min(r0 + r, rows - 1);
        load_f32x8(dz[r], dq_accum + ((static_cast<size_t>(b) * n_head + head) * T + t) * HD + d);
        z_raw[r] = __ldg(reinterpret_cast<const uint4*>(qkv + (static_cast<size_t>(b) * T + t) * qkv_dim + col));
      }
      if (pass == 0 && r0 == 0) __syncthreads();  // s_rstd and the zeroed s_dots are ready
      float dots[kBatchValues] = {};
#pragma unroll
      for (int r = 0; r < kBatchRows; ++r) {
        const int t = t0 + r0 + r;
        const bool valid = active && r0 + r < rows;
        float z[8];
        unpack_bf16x8(z, z_raw[r]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dz[r][i] *= valid ? scale : 0.f;
          dots[r * kDotSlots] += dz[r][i] * z[i];
        }
        if (rope) {
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            float sin_a, cos_a;
            epi::sincos_turns(static_cast<float>(t) * freq[p], &sin_a, &cos_a);
            const float x0 = dz[r][2 * p], x1 = dz[r][2 * p + 1];
            dz[r][2 * p] = x0 * cos_a + x1 * sin_a;
            dz[r][2 * p + 1] = x1 * cos_a - x0 * sin_a;
          }
        }
        if constexpr (kDots == 3) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            dots[r * kDotSlots + 1] += dz[r][i] * c[i];
            dots[r * kDotSlots + 2] += dz[r][i] * b_prime[i];
          }
        } else if (w.bias != nullptr) {
#pragma unroll
          for (int i = 0; i < 8; ++i) dots[r * kDotSlots] -= dz[r][i] * b_prime[i];
        }
        if (w.col_b != nullptr) {
#pragma unroll
          for (int i = 0; i < 8; ++i) col_b[i] += dz[r][i];
        }
        const float rs = s_rstd[r0 + r];
        if (valid)
          *reinterpret_cast<uint4*>(dqkv + static_cast<size_t>(row0 + r0 + r) * qkv_dim + col) =
              make_uint4(pack_bf16(rs * dz[r][0], rs * dz[r][1]), pack_bf16(rs * dz[r][2], rs * dz[r][3]),
                         pack_bf16(rs * dz[r][4], rs * dz[r][5]), pack_bf16(rs * dz[r][6], rs * dz[r][7]));
      }
      const float warp_total = warp_sum_scattered<kBatchValues>(dots, lane);
      if (lane % kLanesPerValue == 0) s_dots[warp][r0 * kDotSlots + lane / kLanesPerValue] += warp_total;
    }
    if (w.col_b != nullptr && active)
      store_f32x8(w.col_b + static_cast<size_t>(blockIdx.x) * qkv_dim + col, col_b);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * kDots; i += blockDim.x) {
    const int r = i / kDots, k = i % kDots, row = row0 + r;
    float sum = 0.f;
    for (int wp = 0; wp < static_cast<int>(blockDim.x / 32); ++wp) sum += s_dots[wp][r * kDotSlots + k];
    for (int kvh = 0; kvh < n_kv_head; ++kvh) sum += kv_dots[(static_cast<size_t>(row) * n_kv_head + kvh) * kDots + k];
    (k == 0 ? w.dot_z : k == 1 ? w.dot_c : w.dot_b)[row] = sum;
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline void validate_writeout(const AttentionWriteout& w) {
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
  if (ln_dots && w.bias != nullptr) fail("bias: LayerNorm folds the qkv bias into b_prime");
  if (!aligned16(w.c) || !aligned16(w.b_prime) || !aligned16(w.col_b) || !aligned16(w.bias))
    fail("c, b_prime, col_b, bias must be 16-byte aligned");
}

inline float rope_log2_freq_step(const AttentionWriteout& w, int HD) {
  return w.rope_theta > 0.0f ? -std::log2(w.rope_theta) / static_cast<float>(HD) : 0.0f;
}

template <int HD>
void launch_writeout(bf16* dqkv, const float* dq_accum, const bf16* qkv, const float* kv_dots,
                     const AttentionWriteout& w, const AttentionShape& s, float scale, cudaStream_t stream) {
  // Threads: whole warps that divide the q columns' chunks evenly where they can (gpt2-124m: 96 chunks, 96
  // threads; llama3.2-1b: 256, 128), so no lane idles; small blocks, so that several fill an SM.
  const int chunks = s.n_head * HD / 8;
  int threads = std::min(kWriteoutMaxThreads, (chunks + 31) / 32 * 32);
  for (int warps = 6; warps >= 1 && chunks % 32 == 0; --warps)
    if (chunks / 32 % warps == 0) {
      threads = 32 * warps;
      break;
    }
  const int groups_per_seq = groups_per_sequence(s.T), blocks = s.B * groups_per_seq;
  const bool rope = w.rope_theta > 0.0f;
  const float log2_freq_step = rope_log2_freq_step(w, HD);
  if (w.c != nullptr)
    attention_backward_writeout_kernel<HD, 3><<<blocks, threads, 0, stream>>>(
        dqkv, dq_accum, qkv, kv_dots, w, s.T, groups_per_seq, s.n_head, s.n_kv_head, scale, rope, log2_freq_step);
  else
    attention_backward_writeout_kernel<HD, 1><<<blocks, threads, 0, stream>>>(
        dqkv, dq_accum, qkv, kv_dots, w, s.T, groups_per_seq, s.n_head, s.n_kv_head, scale, rope, log2_freq_step);
  CUDA_CHECK_LAUNCH();
}

}  // namespace coda::attention_writeout
