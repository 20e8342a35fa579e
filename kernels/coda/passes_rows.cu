// The CODA passes that work one row at a time: the embedding (layer 0's input and its norm partials),
// the loss from the LM head's log-sum-exp partials, and LayerNorm's weight-derived vectors.
// embedding_forward and ln_weight_vectors give each row one warp: lane l walks the row's 16-byte packets
// l, l + 32, ... with four packets' loads issued together, and the row's sums meet with warp shuffles, so
// each value is read once and no shared memory or second pass is needed. The embedding rounds
// h = wte + wpe to bf16 first and derives everything else from the rounded h (the stored h is what the
// norm's backward reads, so its statistics must be those of the stored values): O = bf16(h (.) gamma),
// sum = sum_j h, sumsq = sum_j h^2 (row partials with count 1).
// ln_weight_vectors reads each row of W once for both dot products (c = W gamma, b' = W beta + bias).
// loss_from_partials is one warp per row over the row's (max, sum) partials (one per LM-head N tile).

#include <stdexcept>
#include <string>

#include "kernels/coda/passes.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/vec.cuh"

namespace coda::passes {

namespace {

constexpr int kRowWarps = 8;  // rows per 256-thread block
constexpr int kInFlight = 4;  // packets per lane whose loads are issued together

// Rounds v to bf16 in place and returns the rounded values as one 16-byte packet.
__device__ __forceinline__ uint4 round_bf16x8(float (&v)[8]) {
  uint4 raw;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    pairs[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    const float2 rounded = __bfloat1622float2(pairs[i]);
    v[2 * i] = rounded.x;
    v[2 * i + 1] = rounded.y;
  }
  return raw;
}

__global__ void __launch_bounds__(kRowWarps * 32)
    embedding_forward_kernel(bf16* __restrict__ h, bf16* __restrict__ O, float* __restrict__ sum,
                             float* __restrict__ sumsq, const int32_t* __restrict__ tokens,
                             const bf16* __restrict__ wte, const bf16* __restrict__ wpe,
                             const bf16* __restrict__ gamma, int N, int T, int C) {
  const int row = blockIdx.x * kRowWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const bf16* word = wte + static_cast<size_t>(tokens[row]) * C;
  const bf16* position = wpe != nullptr ? wpe + static_cast<size_t>(row % T) * C : nullptr;
  const size_t out = static_cast<size_t>(row) * C;
  const int packets = C / 8;
  float s = 0.0f, ss = 0.0f;
  for (int first = lane; first < packets; first += 32 * kInFlight) {
    uint4 w[kInFlight], p[kInFlight], g[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int k = first + 32 * u;
      if (k >= packets) continue;
      w[u] = load_packet(word + 8 * k);
      if (position != nullptr) p[u] = load_packet(position + 8 * k);
      g[u] = load_packet(gamma + 8 * k);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int k = first + 32 * u;
      if (k >= packets) continue;
      float v[8], scale[8];
      unpack_bf16x8(v, w[u]);
      if (position != nullptr) {
        float pv[8];
        unpack_bf16x8(pv, p[u]);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] += pv[j];
      }
      *reinterpret_cast<uint4*>(h + out + 8 * k) = round_bf16x8(v);
      unpack_bf16x8(scale, g[u]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s += v[j];
        ss += v[j] * v[j];
        scale[j] *= v[j];
      }
      store_bf16x8(O + out + 8 * k, scale);
    }
  }
  s = warp_sum(s);
  ss = warp_sum(ss);
  if (lane == 0) {
    if (sum != nullptr) sum[row] = s;
    sumsq[row] = ss;
  }
}

// One warp per row: lane l merges partials l, l + 32, ... (coalesced 8-byte loads), then the lanes' pairs
// meet in a fixed butterfly order.
__global__ void __launch_bounds__(kRowWarps * 32)
    loss_from_partials_kernel(float* losses, float* lse, const epi::LogSumExp::Out* partials, int count,
                              const float* target_logit, int N) {
  const int row = blockIdx.x * kRowWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const epi::LogSumExp::Out* mine = partials + static_cast<size_t>(row) * count;
  float m = -INFINITY, s = 0.0f;
  for (int i = lane; i < count; i += 32) {
    const epi::LogSumExp::Out p = mine[i];
    epi::LogSumExp::merge(m, s, p.max, p.sum);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    epi::LogSumExp::merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
  if (lane == 0) {
    const float row_lse = m + logf(s);
    lse[row] = row_lse;
    losses[row] = row_lse - target_logit[row];
  }
}

__global__ void __launch_bounds__(kRowWarps * 32)
    ln_weight_vectors_kernel(float* __restrict__ c, float* __restrict__ b_prime, const bf16* __restrict__ W,
                             int rows, int d, const bf16* __restrict__ gamma, const bf16* __restrict__ beta,
                             const bf16* __restrict__ bias) {
  const int n = blockIdx.x * kRowWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (n >= rows) return;
  const bf16* w_row = W + static_cast<size_t>(n) * d;
  const int packets = d / 8;
  float sc = 0.0f, sb = 0.0f;
  for (int first = lane; first < packets; first += 32 * kInFlight) {
    uint4 w[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (first + 32 * u < packets) w[u] = load_packet(w_row + 8 * (first + 32 * u));
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int k = first + 32 * u;
      if (k >= packets) continue;
      float wv[8], gv[8], bv[8];
      unpack_bf16x8(wv, w[u]);
      load_bf16x8(gv, gamma + 8 * k);
      load_bf16x8(bv, beta + 8 * k);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        sc += gv[j] * wv[j];
        sb += bv[j] * wv[j];
      }
    }
  }
  sc = warp_sum(sc);
  sb = warp_sum(sb);
  if (lane == 0) {
    c[n] = sc;
    b_prime[n] = sb + (bias != nullptr ? __bfloat162float(bias[n]) : 0.0f);
  }
}

void require_packets(int length, const char* what, const char* name) {
  if (length % 8 != 0)
    throw std::invalid_argument(std::string(what) + ": " + name + " = " + std::to_string(length) +
                                " must be a multiple of 8");
}

}  // namespace

void embedding_forward(bf16* h, bf16* O, float* sum, float* sumsq, const int32_t* tokens, const bf16* wte,
                       const bf16* wpe, const bf16* gamma, int B, int T, int C, cudaStream_t stream) {
  const profile::Region region("embedding forward (coda)", profile::Work::Other, stream);
  require_packets(C, "passes::embedding_forward", "C");
  const int N = B * T;
  if (N == 0) return;
  embedding_forward_kernel<<<blocks_for(N, kRowWarps), kRowWarps * 32, 0, stream>>>(
      h, O, sum, sumsq, tokens, wte, wpe, gamma, N, T, C);
  CUDA_CHECK_LAUNCH();
}

void loss_from_partials(float* losses, float* lse, const epi::LogSumExp::Out* lse_partials, int count,
                        const float* target_logit, int N, cudaStream_t stream) {
  const profile::Region region("loss from partials", profile::Work::Other, stream);
  if (count < 1) throw std::invalid_argument("passes::loss_from_partials: count = " + std::to_string(count));
  if (N == 0) return;
  loss_from_partials_kernel<<<blocks_for(N, kRowWarps), kRowWarps * 32, 0, stream>>>(
      losses, lse, lse_partials, count, target_logit, N);
  CUDA_CHECK_LAUNCH();
}

void ln_weight_vectors(float* c, float* b_prime, const bf16* W, int rows, int d, const bf16* gamma,
                       const bf16* beta, const bf16* bias, cudaStream_t stream) {
  const profile::Region region("ln weight vectors", profile::Work::Other, stream);
  require_packets(d, "passes::ln_weight_vectors", "d");
  if (rows == 0) return;
  ln_weight_vectors_kernel<<<blocks_for(rows, kRowWarps), kRowWarps * 32, 0, stream>>>(
      c, b_prime, W, rows, d, gamma, beta, bias);
  CUDA_CHECK_LAUNCH();
}

}  // namespace coda::passes
