// Pieces shared by the attention forward (attention_forward.cu) and backward (attention_backward.cu).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/attention/attention.cuh"
#include "kernels/sm90/sm90.cuh"

namespace coda {
namespace attention_detail {

using bf16 = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x * log2 e)

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Byte offset of (row, col) in a tile stored as HD/64 TMA boxes of [rows][64] bf16 with 128-byte swizzle.
__device__ __forceinline__ uint32_t box_offset(int rows, int row, int col) {
  return static_cast<uint32_t>((col >> 6) * rows * 128) + sm90::sw128_offset(row, (col & 63) * 2);
}

inline void validate_attention_shape(const AttentionShape& s) {
  if (s.B <= 0 || s.T <= 0 || s.n_head <= 0 || s.n_kv_head <= 0 || s.n_head % s.n_kv_head != 0)
    throw std::invalid_argument("attention: bad shape B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                                " n_head=" + std::to_string(s.n_head) + " n_kv_head=" + std::to_string(s.n_kv_head) +
                                " (n_kv_head must divide n_head)");
  if (s.head_dim != 64 && s.head_dim != 128)
    throw std::invalid_argument("attention: head_dim=" + std::to_string(s.head_dim) + " unsupported (64 or 128)");
}

// TMA map of a row-major tensor [batches][rows][cols] (bf16 or fp32) as a 3-D tensor, boxes of
// [box_rows][128 bytes] with 128-byte swizzle: loads are zero-filled and stores / reduce-adds clipped past
// row `rows` of each batch (qkv, out, dout: [B][T][...]; the backward's dQ accumulator: [B*n_head][T][HD]).
inline CUtensorMap sequence_tensor_map(const void* data, CUtensorMapDataType type, int elem_bytes, int cols, int rows,
                                       int batches, int box_rows, const char* what) {
  CUtensorMap map;
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(cols) * elem_bytes;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(batches)};
  const cuuint64_t strides[2] = {row_bytes, row_bytes * rows};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / elem_bytes), static_cast<cuuint32_t>(box_rows), 1},
                   elem_strides[3] = {1, 1, 1};
  const CUresult r = sm90::tensor_map_encoder()(&map, type, 3, const_cast<void*>(data), dims, strides, box,
                                                elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string("attention: cuTensorMapEncodeTiled(") + what + ") failed with CUresult " +
                             std::to_string(r));
  return map;
}

// The map of a bf16 sequence tensor [B][T][cols]: boxes of [box_rows][64].
inline CUtensorMap sequence_tensor_map(const bf16* data, int cols, int T, int B, int box_rows, const char* what) {
  return sequence_tensor_map(data, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, cols, T, B, box_rows, what);
}

}  // namespace attention_detail
}  // namespace coda
