// The scalar functions of the epilogue's maps: the fast math they are written in (the GPU's hardware
// approximations, the standard library on the host), the binary operators of broadcasts and tile loads
// (Mul, Add), the activations (Gelu, GeluGradMul) and the pairwise maps (SwiGlu, Rope) with the RoPE angle
// math that the attention backward's inverse rotation shares. Each takes the form that costs the fewest
// instructions per value; the comments beside them say why.

#pragma once
#include <cmath>

#include "kernels/epilogue/fragment.cuh"

namespace coda::epi {

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
// (kernels/coda/attention_writeout_kernels.cuh): pair i of a head turns by position * theta^(-2i / head_dim). Angles are kept in
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

}  // namespace coda::epi
