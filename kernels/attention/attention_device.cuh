// Pieces shared by the attention forward (attention_forward.cu) and backward (attention_backward.cu).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/attention/attention.cuh"

namespace coda {
namespace attention_detail {

using bf16 = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x * log2 e)

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

inline void validate_attention_shape(const AttentionShape& s) {
  if (s.B <= 0 || s.T <= 0 || s.n_head <= 0 || s.n_kv_head <= 0 || s.n_head % s.n_kv_head != 0)
    throw std::invalid_argument("attention: bad shape B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                                " n_head=" + std::to_string(s.n_head) + " n_kv_head=" + std::to_string(s.n_kv_head) +
                                " (n_kv_head must divide n_head)");
  if (s.head_dim != 64 && s.head_dim != 128)
    throw std::invalid_argument("attention: head_dim=" + std::to_string(s.head_dim) + " unsupported (64 or 128)");
}

}  // namespace attention_detail
}  // namespace coda
