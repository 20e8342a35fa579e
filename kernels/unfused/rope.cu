// Rotary position embedding on the packed qkv rows, in place, forward and backward.
// Pair i = (2i, 2i+1) of every q and k head of the token at position t is rotated by the angle
// t * theta^(-2i/hd) (Meta's adjacent-pair convention, model.hpp):
//   (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos).
// The backward applies the transposed rotation (angle negated): rotations are orthogonal.
// The q heads and the k heads are contiguous at the start of the row, so the kernel walks the first
// (n_head + n_kv_head) * hd columns of each row in 16-byte packets (4 pairs) and leaves v alone.
// cos and sin come from a [T, hd/2] table computed once on the host in double precision: the table
// (at most a few MB, resident in L2) costs less than evaluating sincos for every element.

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda::unfused {

namespace {

__global__ void __launch_bounds__(256) rope_kernel(bf16* qkv, const float2* table, int N, int T, int rotated_packets,
                                                   int row_len, int hd, float direction) {
  start_after_previous_kernel();
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<size_t>(N) * rotated_packets) return;
  const int n = static_cast<int>(idx / rotated_packets), col = static_cast<int>(idx % rotated_packets) * 8;
  const int t = n % T, pair = (col % hd) / 2;
  const float4* angles = reinterpret_cast<const float4*>(table + static_cast<size_t>(t) * (hd / 2) + pair);
  const float4 a01 = angles[0], a23 = angles[1];  // (cos, sin) of the 4 pairs
  const float cs[4][2] = {{a01.x, a01.y}, {a01.z, a01.w}, {a23.x, a23.y}, {a23.z, a23.w}};
  bf16* p = qkv + static_cast<size_t>(n) * row_len + col;
  float v[8];
  load_bf16x8(v, p);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float c = cs[j][0], s = direction * cs[j][1];
    const float x0 = v[2 * j], x1 = v[2 * j + 1];
    v[2 * j] = x0 * c - x1 * s;
    v[2 * j + 1] = x0 * s + x1 * c;
  }
  store_bf16x8(p, v);
}

}  // namespace

std::vector<float2> rope_table(int max_T, int hd, float theta) {
  std::vector<float2> table(static_cast<size_t>(max_T) * (hd / 2));
  for (int t = 0; t < max_T; ++t)
    for (int i = 0; i < hd / 2; ++i) {
      const double angle = t * std::pow(static_cast<double>(theta), -2.0 * i / hd);
      table[static_cast<size_t>(t) * (hd / 2) + i] = make_float2(static_cast<float>(std::cos(angle)),
                                                                 static_cast<float>(std::sin(angle)));
    }
  return table;
}

void rope(bf16* qkv, const float2* table, int B, int T, int n_head, int n_kv_head, int hd, bool inverse,
          cudaStream_t stream) {
  if (hd % 8 != 0) throw std::invalid_argument("rope: head_dim = " + std::to_string(hd) + " must be a multiple of 8");
  const int rotated_packets = (n_head + n_kv_head) * hd / 8;
  const int row_len = (n_head + 2 * n_kv_head) * hd;
  const size_t threads = static_cast<size_t>(B) * T * rotated_packets;
  const profile::Region region(inverse ? "rope backward" : "rope forward", profile::Work::Epilogue, stream);
  launch_kernel(rope_kernel, after_previous(blocks_for(threads, 256), 256), stream, qkv, table, B * T, T,
                rotated_packets, row_len, hd, inverse ? -1.0f : 1.0f);
}

}  // namespace coda::unfused
