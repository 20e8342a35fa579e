// FP8 quantization with the amax of delayed scaling in the same pass (unfused.cuh). The conversion is the
// hardware's (cvt.rn.satfinite e4m3x2 / e5m2x2 through cuda_fp8.h), two values per instruction; the amax is
// the block's NaN-propagating max of |x|, one integer atomic max per block on the float's bits (for
// non-negative floats the bit order is the value order, and NaN's bits sort above infinity's).
// Flat: one 16-byte packet of 8 bf16 in, 8 bytes out per thread and step, grid-stride over the tensor.
// Transposed: a 64 x 64 tile per block through shared memory (fp32, a padded row of 65 so the column
// reads do not all hit one bank), read as 16-byte row packets, written as 8-byte column packets of qt, and
// as row packets of q from the same read when both copies are wanted.
// Delayed scaling: one thread per tensor, the same float operations as the host's Fp8DelayedScale.
// Block scaling: a 128 x 128 tile per block, read once as row packets (kept in registers for the row
// copy, whose 1 x 128 amax is a half-warp reduction over the 16 threads of a row) and into shared memory
// as bf16 (rows of 130, so the column reads of the transposed copy spread over the banks); each column's
// 128 x 1 amax from two threads of 64 rows. The scale rule is fp8_block_scale_exponent (fp8_format.cuh).

#include <cuda_fp8.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda::unfused {

namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;

// max(a, |x|), NaN once either is NaN.
__device__ __forceinline__ float max_abs(float a, float x) {
  const float m = fabsf(x);
  return (m > a || m != m) ? m : a;
}

__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

// The block's NaN-propagating max, returned to every thread (blockDim.x == kThreads).
__device__ __forceinline__ float block_max(float local) {
  __shared__ float warps[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) local = nan_max(local, __shfl_xor_sync(0xffffffffu, local, offset));
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = local;
  __syncthreads();
  float m = warps[0];
  for (int w = 1; w < kThreads / 32; ++w) m = nan_max(m, warps[w]);
  return m;
}

// The block's max into *amax_bits.
__device__ __forceinline__ void block_amax(float local, unsigned int* amax_bits) {
  const float m = block_max(local);
  if (threadIdx.x == 0) atomicMax(amax_bits, __float_as_uint(m));
}

template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ unsigned short fp8x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFormat);
}

// 8 values times scale as 8 fp8 bytes, first value in the lowest byte.
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint2 pack_fp8x8(const float (&v)[8], float scale) {
  uint2 out;
  out.x = fp8x2<kFormat>(v[0] * scale, v[1] * scale) | (static_cast<unsigned int>(fp8x2<kFormat>(v[2] * scale, v[3] * scale)) << 16);
  out.y = fp8x2<kFormat>(v[4] * scale, v[5] * scale) | (static_cast<unsigned int>(fp8x2<kFormat>(v[6] * scale, v[7] * scale)) << 16);
  return out;
}

template <__nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(uint8_t* __restrict__ q, unsigned int* amax_bits, const bf16* __restrict__ x, size_t packets,
                    const float* scale_ptr) {
  start_after_previous_kernel();
  const float scale = *scale_ptr;
  float local = 0.0f;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packets;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v[8];
    load_bf16x8(v, x + 8 * i);
#pragma unroll
    for (int j = 0; j < 8; ++j) local = max_abs(local, v[j]);
    *reinterpret_cast<uint2*>(q + 8 * i) = pack_fp8x8<kFormat>(v, scale);
  }
  block_amax(local, amax_bits);
}

template <__nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads)
    quantize_transposed_kernel(uint8_t* __restrict__ qt, uint8_t* __restrict__ q, unsigned int* amax_bits,
                               const bf16* __restrict__ x, int rows, int cols, const float* scale_ptr) {
  __shared__ float tile[kTile][kTile + 1];
  start_after_previous_kernel();
  const float scale = *scale_ptr;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  float local = 0.0f;
  for (int p = threadIdx.x; p < kTile * kTile / 8; p += kThreads) {  // row packets: 8 per tile row
    const int r = p / (kTile / 8), c = p % (kTile / 8) * 8;
    float v[8] = {};
    if (row0 + r < rows && col0 + c < cols) {
      const size_t at = static_cast<size_t>(row0 + r) * cols + col0 + c;
      load_bf16x8(v, x + at);
      if (q != nullptr) *reinterpret_cast<uint2*>(q + at) = pack_fp8x8<kFormat>(v, scale);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      tile[r][c + j] = v[j];
      local = max_abs(local, v[j]);
    }
  }
  __syncthreads();
  for (int p = threadIdx.x; p < kTile * kTile / 8; p += kThreads) {  // column packets: 8 per tile column
    const int c = p / (kTile / 8), r = p % (kTile / 8) * 8;
    if (col0 + c >= cols || row0 + r >= rows) continue;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = tile[r + j][c];
    *reinterpret_cast<uint2*>(qt + static_cast<size_t>(col0 + c) * rows + row0 + r) = pack_fp8x8<kFormat>(v, scale);
  }
  block_amax(local, amax_bits);
}

constexpr int kBlock = 128;                 // kFp8Block of src/fp8.hpp
constexpr int kBlockRowWords = kBlock / 2 + 1;  // 32-bit words per shared row: 130 bf16

__global__ void __launch_bounds__(kThreads)
    quantize_blocks_kernel(Fp8BlockCopies out, const bf16* __restrict__ x, int rows, int cols, bool tile_scale) {
  __shared__ uint32_t tile[kBlock * kBlockRowWords];
  start_after_previous_kernel();
  const int row0 = blockIdx.y * kBlock, col0 = blockIdx.x * kBlock;
  const int q_tile_row = fp8_tile_factor_row(cols / kBlock), qt_tile_row = fp8_tile_factor_row(rows / kBlock);
  constexpr int kPackets = kBlock * kBlock / 8 / kThreads;  // row packets per thread
  float v[kPackets][8], row_amax[kPackets];
  bool finite = true;
#pragma unroll
  for (int k = 0; k < kPackets; ++k) {
    const int p = threadIdx.x + k * kThreads, r = p / (kBlock / 8), c = p % (kBlock / 8) * 8;
    const uint4 raw = load_packet(x + static_cast<size_t>(row0 + r) * cols + col0 + c);
    uint32_t* words = tile + r * kBlockRowWords + c / 2;
    words[0] = raw.x, words[1] = raw.y, words[2] = raw.z, words[3] = raw.w;
    unpack_bf16x8(v[k], raw);
    float a = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      finite = finite && isfinite(v[k][j]);
      a = fmaxf(a, fabsf(v[k][j]));
    }
#pragma unroll
    for (int offset = kBlock / 16; offset > 0; offset /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
    row_amax[k] = a;
  }
  if (!__syncthreads_or(!finite)) {
    int tile_exponent = 0;
    if (tile_scale) {
      float a = 0.0f;
#pragma unroll
      for (int k = 0; k < kPackets; ++k) a = fmaxf(a, row_amax[k]);
      tile_exponent = fp8_block_scale_exponent(block_max(a), Fp8Format::E4M3);
      if (threadIdx.x == 0) {
        if (out.q != nullptr) out.q_dequant[blockIdx.y * q_tile_row + blockIdx.x] = fp8_power_of_two(-tile_exponent);
        if (out.qt != nullptr) out.qt_dequant[blockIdx.x * qt_tile_row + blockIdx.y] = fp8_power_of_two(-tile_exponent);
      }
    }
    if (out.q != nullptr) {
#pragma unroll
      for (int k = 0; k < kPackets; ++k) {
        const int p = threadIdx.x + k * kThreads, r = p / (kBlock / 8), c = p % (kBlock / 8) * 8;
        const int e = tile_scale ? tile_exponent : fp8_block_scale_exponent(row_amax[k], Fp8Format::E4M3);
        *reinterpret_cast<uint2*>(out.q + static_cast<size_t>(row0 + r) * cols + col0 + c) =
            pack_fp8x8<__NV_E4M3>(v[k], fp8_power_of_two(e));
        if (!tile_scale && c == 0) out.q_dequant[static_cast<size_t>(blockIdx.x) * rows + row0 + r] = fp8_power_of_two(-e);
      }
    }
    if (out.qt != nullptr) {  // column c of the tile, its rows half * 64 ...: one 64-byte run of qt's row
      const int c = threadIdx.x / 2, half = threadIdx.x % 2;
      const __nv_bfloat16* column = reinterpret_cast<const __nv_bfloat16*>(tile) + c;
      float w[kBlock / 16][8];  // the thread's 64 values of the column, read from shared memory once
      float a = 0.0f;
#pragma unroll
      for (int j = 0; j < kBlock / 16; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          w[j][i] = __bfloat162float(column[(half * kBlock / 2 + 8 * j + i) * 2 * kBlockRowWords]);
          a = fmaxf(a, fabsf(w[j][i]));
        }
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
      const int e = tile_scale ? tile_exponent : fp8_block_scale_exponent(a, Fp8Format::E4M3);
      uint8_t* dst = out.qt + static_cast<size_t>(col0 + c) * rows + row0 + half * kBlock / 2;
#pragma unroll
      for (int j = 0; j < kBlock / 16; ++j)
        *reinterpret_cast<uint2*>(dst + 8 * j) = pack_fp8x8<__NV_E4M3>(w[j], fp8_power_of_two(e));
      if (!tile_scale && half == 0) out.qt_dequant[static_cast<size_t>(blockIdx.y) * cols + col0 + c] = fp8_power_of_two(-e);
    }
  } else if (threadIdx.x == 0) {
    atomicMax(out.bad, out.bad_value);
  }
}

__global__ void __launch_bounds__(kThreads)
    update_scales_kernel(float* scale, float* dequant, float* history, float* amax, int count, int e4m3_count,
                         int history_len, int step, int margin, unsigned int* bad) {
  start_after_previous_kernel();
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= count) return;
  const float a = amax[t];
  amax[t] = 0.0f;
  if (!(a >= 0.0f) || isinf(a)) {
    atomicCAS(bad, 0u, static_cast<unsigned int>(t + 1));
    return;
  }
  const float largest = fp8_max_finite(t < e4m3_count ? Fp8Format::E4M3 : Fp8Format::E5M2);
  float* ring = history + static_cast<size_t>(t) * history_len;
  ring[step % history_len] = a;
  float m = 0.0f;
  for (int i = 0; i < history_len; ++i) m = fmaxf(m, ring[i]);
  if (m > 0.0f) {
    scale[t] = ldexpf(largest / m, -margin);
    dequant[t * kFp8DequantSlot] = 1.0f / scale[t];
  }
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

}  // namespace

void quantize_fp8(uint8_t* q, float* amax, const bf16* x, size_t n, const float* scale, Fp8Format format,
                  cudaStream_t stream) {
  require(n % 8 == 0, "quantize_fp8: size " + std::to_string(n) + " must be a multiple of 8");
  if (n == 0) return;
  const profile::Region region("quantize_fp8", profile::Work::Epilogue, stream);
  const size_t packets = n / 8;
  const unsigned int blocks = std::min<unsigned int>(blocks_for(packets, kThreads), 8u * sm_count());
  unsigned int* bits = reinterpret_cast<unsigned int*>(amax);
  if (format == Fp8Format::E4M3)
    launch_kernel(quantize_kernel<__NV_E4M3>, after_previous(blocks, kThreads), stream, q, bits, x, packets, scale);
  else
    launch_kernel(quantize_kernel<__NV_E5M2>, after_previous(blocks, kThreads), stream, q, bits, x, packets, scale);
}

void quantize_fp8_transposed(uint8_t* qt, uint8_t* q, float* amax, const bf16* x, int rows, int cols,
                             const float* scale, Fp8Format format, cudaStream_t stream) {
  require(rows % 8 == 0 && cols % 8 == 0 && rows >= 0 && cols >= 0,
          "quantize_fp8_transposed: rows " + std::to_string(rows) + " and cols " + std::to_string(cols) +
              " must be multiples of 8");
  if (rows == 0 || cols == 0) return;
  const profile::Region region("quantize_fp8_transposed", profile::Work::Epilogue, stream);
  const dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile);
  unsigned int* bits = reinterpret_cast<unsigned int*>(amax);
  if (format == Fp8Format::E4M3)
    launch_kernel(quantize_transposed_kernel<__NV_E4M3>, after_previous(grid, kThreads), stream, qt, q, bits, x,
                  rows, cols, scale);
  else
    launch_kernel(quantize_transposed_kernel<__NV_E5M2>, after_previous(grid, kThreads), stream, qt, q, bits, x,
                  rows, cols, scale);
}

void quantize_fp8_blocks(const Fp8BlockCopies& out, const bf16* x, int rows, int cols, bool tile,
                        cudaStream_t stream) {
  require(rows % kBlock == 0 && cols % kBlock == 0 && rows >= 0 && cols >= 0,
          "quantize_fp8_blocks: rows " + std::to_string(rows) + " and cols " + std::to_string(cols) +
              " must be multiples of 128");
  require((out.q == nullptr || out.q_dequant != nullptr) && (out.qt == nullptr || out.qt_dequant != nullptr) &&
              out.bad != nullptr,
          "quantize_fp8_blocks: each copy needs its dequantization factors, and the flag is required");
  if (rows == 0 || cols == 0 || (out.q == nullptr && out.qt == nullptr)) return;
  const profile::Region region("quantize_fp8_blocks", profile::Work::Epilogue, stream);
  launch_kernel(quantize_blocks_kernel, after_previous(dim3(cols / kBlock, rows / kBlock), kThreads), stream, out, x,
                rows, cols, tile);
}

void fp8_update_scales(float* scale, float* dequant, float* history, float* amax, int count, int e4m3_count,
                       int history_len, int step, int margin, unsigned int* bad, cudaStream_t stream) {
  require(count >= 0 && e4m3_count >= 0 && e4m3_count <= count && history_len >= 1 && step >= 0 && margin >= 0,
          "fp8_update_scales: count " + std::to_string(count) + ", e4m3 " + std::to_string(e4m3_count) +
              ", history " + std::to_string(history_len) + ", step " + std::to_string(step) + ", margin " +
              std::to_string(margin));
  if (count == 0) return;
  launch_kernel(update_scales_kernel, after_previous(blocks_for(count, kThreads), kThreads), stream, scale, dequant,
                history, amax, count, e4m3_count, history_len, step, margin, bad);
}

}  // namespace coda::unfused
