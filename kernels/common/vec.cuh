// Device helpers shared by the unfused kernels, the CODA passes and attention: 16-byte vector access to
// bf16 and fp32 data, warp / block sums, the completion tickets of the last-block reductions, grid sizes.
//
// Every memory-bound kernel of the unfused mode moves data in 16-byte packets (8 bf16 or 4 fp32 values),
// one packet per thread per step, so a warp touches 512 contiguous bytes: fully coalesced, and the
// fewest load/store instructions per byte. Arithmetic is always fp32; only storage is bf16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/common/cuda_check.cuh"

namespace coda {

// A 16-byte packet of 8 bf16 values, widened to fp32.
__device__ __forceinline__ void unpack_bf16x8(float (&out)[8], const uint4& raw) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ uint4 load_packet(const __nv_bfloat16* p) { return *reinterpret_cast<const uint4*>(p); }

// 8 bf16 values at a 16-byte aligned address, widened to fp32.
__device__ __forceinline__ void load_bf16x8(float (&out)[8], const __nv_bfloat16* p) { unpack_bf16x8(out, load_packet(p)); }

// Rounds 8 fp32 values to bf16 (round to nearest even) and stores them at a 16-byte aligned address.
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* p, const float (&in)[8]) {
  uint4 raw;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// 8 fp32 values at a 16-byte aligned address (two 16-byte packets), and back.
__device__ __forceinline__ void load_f32x8(float (&out)[8], const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ __forceinline__ void store_f32x8(float* p, const float (&in)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// `scratch` holds 32 floats of shared memory; the call contains __syncthreads, so every thread must reach it.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(x);
}

// The "last block finishes" pattern of the reductions (column_sum, the norm backwards): after a
// __syncthreads that follows the block's partial stores, one thread takes a ticket with a gpu-scope
// acquire-release atomic, which publishes the whole block's stores (the barrier orders them before it) and,
// for the block that draws the last ticket, makes every other block's published stores visible; a waiting
// thread polls with acquire loads, and a __syncthreads passes that on to the rest of its block. This
// replaces __threadfence() in every thread (MEMBAR.SC.GPU plus an L1 invalidation, CCTL.IVALL, in the
// SASS, twice on the finishing block's path).
__device__ __forceinline__ unsigned int ticket_add(unsigned int* counter, unsigned int value) {
  unsigned int old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(value) : "memory");
  return old;
}

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* counter) {
  unsigned int value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}

// Grid size for a launch of `threads` threads in blocks of `block` threads.
inline unsigned int blocks_for(size_t threads, int block) {
  return static_cast<unsigned int>((threads + block - 1) / block);
}

// Rows of C values held in registers, one warp per row: each lane owns kChunks packets of 8 (packet
// lane + 32 i). Calls f(std::integral_constant<int, kChunks>) with the smallest instantiated kChunks that
// covers C; C must be a multiple of 8 in [8, 4096].
template <typename F>
void dispatch_chunks(int C, const char* what, F&& f) {
  if (C % 8 != 0 || C < 8 || C > 4096)
    throw std::invalid_argument(std::string(what) + ": C = " + std::to_string(C) +
                                " must be a multiple of 8 in [8, 4096]");
  const int needed = (C / 8 + 31) / 32;
  if (needed <= 1) return f(std::integral_constant<int, 1>{});
  if (needed <= 2) return f(std::integral_constant<int, 2>{});
  if (needed <= 3) return f(std::integral_constant<int, 3>{});
  if (needed <= 4) return f(std::integral_constant<int, 4>{});
  if (needed <= 8) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 16>{});
}

// Multiprocessors of the current device (queried once per process), for sizing persistent-style grids.
inline int sm_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  }();
  return count;
}

}  // namespace coda
