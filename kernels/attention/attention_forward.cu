// Forward of causal grouped-query attention for Hopper (sm_90a), FlashAttention-3 shaped: TMA loads,
// wgmma products, a producer warp and two consumer warpgroups. Contract: attention.cuh; design:
// docs/ATTENTION.md ("Forward"); backward: attention_backward.cu.
// One block = one query head x 128 query rows. The producer loads Q once and the K, V tiles of every key
// block up to the diagonal (never above it) into a ring of stages ("K full", "V full", "empty" mbarriers).
// Each consumer warpgroup owns 64 rows and runs FlashAttention's online softmax in fp32 registers:
// S = Q K^T from shared memory, P = exp2 of the scaled, max-shifted S, O += P V with P as wgmma's register
// A operand (the S accumulator fragment re-packed to bf16, so P never touches shared memory).
// Key blocks start at key 0, which every query sees, so each row's first maximum is finite. Tiles are
// TMA's 128-byte swizzle; Q, K are read K-major, V MN-major. qkv is a 3-D TMA tensor [B][T][qkv_dim], so
// rows past T are zero-filled; query blocks are scheduled longest first.
#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/attention/attention.cuh"
#include "kernels/attention/attention_device.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/sm90/sm90.cuh"

namespace coda {
namespace {

using namespace attention_detail;

constexpr int kRows = 128;  // query rows per block, 64 per consumer warpgroup
constexpr int kKeys = 128;  // keys per pipeline stage
constexpr int kThreads = 384;

template <int HD>
struct Layout {
  static constexpr int kStages = HD == 128 ? 2 : 3;
  static constexpr int kQBytes = kRows * HD * 2, kKVBytes = kKeys * HD * 2;
  static constexpr int kK = kQBytes, kV = kK + kStages * kKVBytes, kBar = kV + kStages * kKVBytes;
  static constexpr int kSmem = kBar + 8 * (1 + 3 * kStages) + 1024;  // + slack to align the base to 1024
};

// O (m64 x HD, fp32) += P V; P in registers, V MN-major in shared memory.
template <int HD>
__device__ __forceinline__ void wgmma_pv(float (&o)[HD / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (HD == 128)
    sm90::wgmma_m64n128k16_rs<1>(o, a, desc_b);
  else
    sm90::wgmma_m64n64k16_rs<1>(o, a, desc_b);
}

template <int HD>
__global__ void __launch_bounds__(kThreads, 1)
    attention_forward_kernel(const __grid_constant__ CUtensorMap qkv_map, bf16* out, float* lse, int T,
                                  int n_head, int n_kv_head, float scale_log2) {
  using L = Layout<HD>;
  constexpr int S = L::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (sm90::smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t base = sm90::smem_u32(smem);
  const uint32_t bar_q = base + L::kBar, bar_k = bar_q + 8, bar_v = bar_k + 8 * S, bar_empty = bar_v + 8 * S;

  const int n_qblocks = (T + kRows - 1) / kRows;
  const int q0 = (n_qblocks - 1 - blockIdx.y) * kRows;
  const int b = blockIdx.x / n_head, h = blockIdx.x % n_head, kvh = h / (n_head / n_kv_head);
  const int n_kblocks = min((q0 + kRows + kKeys - 1) / kKeys, (T + kKeys - 1) / kKeys);
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    sm90::mbar_init(bar_q, 1);
    for (int s = 0; s < S; ++s) {
      sm90::mbar_init(bar_k + 8 * s, 1);
      sm90::mbar_init(bar_v + 8 * s, 1);
      sm90::mbar_init(bar_empty + 8 * s, 256);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    sm90::regs_release<24>();
    if (threadIdx.x == 0) {
      sm90::mbar_arrive_expect_tx(bar_q, L::kQBytes);
      for (int box = 0; box < HD / 64; ++box)
        sm90::tma_load_3d(base + box * kRows * 128, &qkv_map, bar_q, h * HD + box * 64, q0, b);
      for (int j = 0; j < n_kblocks; ++j) {
        const int s = j % S;
        if (j >= S) sm90::mbar_wait(bar_empty + 8 * s, ((j / S) - 1) & 1);
        sm90::mbar_arrive_expect_tx(bar_k + 8 * s, L::kKVBytes);
        for (int box = 0; box < HD / 64; ++box)
          sm90::tma_load_3d(base + L::kK + s * L::kKVBytes + box * kKeys * 128, &qkv_map, bar_k + 8 * s,
                            (n_head + kvh) * HD + box * 64, j * kKeys, b);
        sm90::mbar_arrive_expect_tx(bar_v + 8 * s, L::kKVBytes);
        for (int box = 0; box < HD / 64; ++box)
          sm90::tma_load_3d(base + L::kV + s * L::kKVBytes + box * kKeys * 128, &qkv_map, bar_v + 8 * s,
                            (n_head + n_kv_head + kvh) * HD + box * 64, j * kKeys, b);
      }
    }
    return;
  }
  sm90::regs_claim<240>();

  const int cw = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row0 = q0 + cw * 64;           // this warpgroup's first row
  const int row_lo = row0 + warp * 16 + g;  // this thread's rows: row_lo, row_lo + 8
  float o[HD / 2] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  sm90::mbar_wait(bar_q, 0);

  for (int j = 0; j < n_kblocks; ++j) {
    const int s = j % S;
    const uint32_t parity = (j / S) & 1;
    float sc[kKeys / 2];
    sm90::mbar_wait(bar_k + 8 * s, parity);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t box = kk / 4, kbyte = (kk % 4) * 32;
      const uint64_t desc_q = sm90::sw128_descriptor(base + box * kRows * 128 + cw * 64 * 128 + kbyte, 16, 1024);
      const uint64_t desc_k =
          sm90::sw128_descriptor(base + L::kK + s * L::kKVBytes + box * kKeys * 128 + kbyte, 16, 1024);
      sm90::wgmma_m64n128k16<0, 0>(sc, desc_q, desc_k, kk > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_registers(sc);

    if ((j + 1) * kKeys - 1 > row0) {
#pragma unroll
      for (int i = 0; i < kKeys / 2; ++i)
        if (j * kKeys + 8 * (i >> 2) + 2 * t + (i & 1) > row_lo + 8 * ((i >> 1) & 1)) sc[i] = -INFINITY;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = m[half];
#pragma unroll
      for (int i = 0; i < kKeys / 2; i += 4) mx = fmaxf(mx, fmaxf(sc[i + 2 * half], sc[i + 2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mx_scaled = mx * scale_log2;
      const float corr = exp2f(m[half] * scale_log2 - mx_scaled);
      m[half] = mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < kKeys / 2; i += 4) {
        sc[i + 2 * half] = exp2f(sc[i + 2 * half] * scale_log2 - mx_scaled);
        sc[i + 2 * half + 1] = exp2f(sc[i + 2 * half + 1] * scale_log2 - mx_scaled);
        sum += sc[i + 2 * half] + sc[i + 2 * half + 1];
      }
      l[half] = l[half] * corr + sum;
#pragma unroll
      for (int i = 0; i < HD / 2; i += 4) {
        o[i + 2 * half] *= corr;
        o[i + 2 * half + 1] *= corr;
      }
    }
    uint32_t pa[kKeys / 16][4];
#pragma unroll
    for (int kc = 0; kc < kKeys / 16; ++kc) {
      pa[kc][0] = pack_bf16(sc[8 * kc + 0], sc[8 * kc + 1]);
      pa[kc][1] = pack_bf16(sc[8 * kc + 2], sc[8 * kc + 3]);
      pa[kc][2] = pack_bf16(sc[8 * kc + 4], sc[8 * kc + 5]);
      pa[kc][3] = pack_bf16(sc[8 * kc + 6], sc[8 * kc + 7]);
    }

    sm90::mbar_wait(bar_v + 8 * s, parity);
    sm90::fence_registers(o);
    sm90::wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < kKeys / 16; ++kc)
      wgmma_pv<HD>(o, pa[kc],
                   sm90::sw128_descriptor(base + L::kV + s * L::kKVBytes + kc * 16 * 128, kKeys * 128, 1024));
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_registers(o);
    sm90::mbar_arrive(bar_empty + 8 * s);
  }

  // Epilogue: lse, O / l staged (bf16) in this warp's rows of the Q tile, then 16-byte stores.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    const int row = row_lo + half * 8;
    if (t == 0 && row < T)
      lse[(static_cast<size_t>(b) * n_head + h) * T + row] = (m[half] * scale_log2 + log2f(l[half])) / kLog2e;
  }
  const float inv[2] = {1.f / l[0], 1.f / l[1]};
  const int tile_row = cw * 64 + warp * 16 + g;
#pragma unroll
  for (int i = 0; i < HD / 2; i += 2) {
    const int half = (i >> 1) & 1, col = 8 * (i >> 2) + 2 * t;
    *reinterpret_cast<uint32_t*>(smem + box_offset(kRows, tile_row + 8 * half, col)) =
        pack_bf16(o[i] * inv[half], o[i + 1] * inv[half]);
  }
  __syncwarp();
  const size_t out_stride = static_cast<size_t>(n_head) * HD;
  bf16* dst = out + static_cast<size_t>(b) * T * out_stride + static_cast<size_t>(h) * HD;
  constexpr int kChunks = HD / 8;
#pragma unroll
  for (int c = lane; c < 16 * kChunks; c += 32) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int row = row0 + warp * 16 + r;
    if (row < T)
      *reinterpret_cast<int4*>(dst + static_cast<size_t>(row) * out_stride + col) =
          *reinterpret_cast<const int4*>(smem + box_offset(kRows, cw * 64 + warp * 16 + r, col));
  }
}

template <int HD>
void forward(bf16* out, float* lse, const bf16* qkv, const AttentionShape& s, cudaStream_t stream) {
  const CUtensorMap map = sequence_tensor_map(qkv, s.qkv_dim(), s.T, s.B, kRows, "qkv");
  constexpr int kSmem = Layout<HD>::kSmem;
  CUDA_CHECK(cudaFuncSetAttribute(attention_forward_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid(s.B * s.n_head, (s.T + kRows - 1) / kRows);
  attention_forward_kernel<HD><<<grid, kThreads, kSmem, stream>>>(map, out, lse, s.T, s.n_head, s.n_kv_head,
                                                                       kLog2e / std::sqrt(static_cast<float>(HD)));
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_forward(bf16* out, float* lse, const bf16* qkv, const AttentionShape& shape, cudaStream_t stream) {
  const profile::Region region("attention forward", profile::Work::Attention, stream);
  validate_attention_shape(shape);
  if (shape.head_dim == 64)
    forward<64>(out, lse, qkv, shape, stream);
  else
    forward<128>(out, lse, qkv, shape, stream);
}
}  // namespace coda
