// Hopper (sm_90a) building blocks of the GEMM (kernels/gemm) and the attention kernels (kernels/attention),
// one thin inline-PTX wrapper per hardware mechanism, with the hardware's rules written next to each:
// mbarriers, TMA and bulk copies, wgmma, setmaxnreg, and on the host tensor_map_encoder() (the driver's
// cuTensorMapEncodeTiled). They live in their own folder because both kernels use them; everything those
// kernels need and nothing more.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <stdexcept>

#include "kernels/common/cuda_check.cuh"
#include "kernels/sm90/wgmma_ops.cuh"

namespace coda::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier -------------------------------------------------------------------------------------
// A 64-bit shared-memory barrier with a phase bit. A phase completes when the expected number of arrivals
// AND the expected number of transaction bytes (TMA writes) have both arrived; waiters poll for "the phase
// of parity P has completed". A fresh barrier is in phase 0, and a wait for parity 1 on it succeeds at
// once: producers start waiting on their "slot empty" barriers with parity 1, consumers on "slot full"
// with parity 0.
// Barrier and TMA-load calls take 32-bit shared-window addresses (smem_u32), as the attention forward
// computes them, or generic pointers, as the GEMM holds them; the pointer forms convert and forward.

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) { mbar_init(smem_u32(bar), arrivals); }

// Makes initialized barriers visible to the async proxy (TMA) before any thread uses them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  mbar_arrive_expect_tx(smem_u32(bar), bytes);
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { mbar_arrive(smem_u32(bar)); }

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) { mbar_wait(smem_u32(bar), parity); }

// ---- TMA ------------------------------------------------------------------------------------------
// cp.async.bulk.tensor: the copy engine moves a box of a 2-D or 3-D tensor between global and shared
// memory, described by a CUtensorMap (made on the host, passed as a __grid_constant__ parameter). Loads
// complete on an mbarrier (complete_tx counts the FULL box; out-of-bounds elements are written as zeros
// and counted too); stores and reduce-adds are tracked by bulk groups of the issuing thread and clip
// out-of-bounds elements. Shared-memory side of a 128B-swizzled box: 1024-byte aligned.
// Coordinates are element indices, innermost (contiguous) dimension first.

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  tma_load_2d(smem_u32(dst), map, smem_u32(bar), c0, c1);
}
// Asks the L2 to fetch the box at (c0, c1) from DRAM, with no destination and no completion to wait for: a
// later tma_load_2d of the same box then waits on an L2 hit instead of a DRAM round trip.
__device__ __forceinline__ void tma_prefetch_l2_2d(const CUtensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(map), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
          dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// 1-D bulk copy of `bytes` contiguous bytes (a multiple of 16; both addresses 16-byte aligned), completing
// on an mbarrier like a tensor load.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// Element-wise global += shared, performed by the copy engine in L2 (atomic per element).
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Wait until at most N bulk groups of this thread still READ shared memory (their buffers are reusable).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// A global -> shared copy of kBytes (4, 8 or 16) that the thread does not wait for (LDGSTS); it waits for
// all of its copies with cp_async_wait_all (not for bulk groups: those have their own waits).
template <int kBytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_u32(dst)), "l"(src), "n"(kBytes) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Wait until at most N bulk groups of this thread are still in flight (writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Ordinary shared-memory stores become visible to the async proxy (a following TMA store) only after
// this fence in each writing thread, followed by a barrier among the writers and the issuing thread.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// ---- warpgroup ------------------------------------------------------------------------------------
// wgmma: a warpgroup (4 consecutive warps, the first warp index divisible by 4) multiplies tiles described
// by shared-memory matrix descriptors (A may instead come from registers, in the layout of an accumulator
// fragment); accumulators stay in registers and may not be touched between issue and wgmma.wait_group.
// setmaxnreg moves registers between warpgroups; it needs a register cap at entry
// (__launch_bounds__(threads, 1)) and each role in one branch of one if/else.

// Barrier among `threads` threads (a multiple of 32) on hardware barrier `id` (0 is __syncthreads').
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <int kRegs>
__device__ __forceinline__ void regs_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void regs_claim() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Orders register accesses before the following wgmma (required when accumulators were touched).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads of accumulator registers above a wgmma wait.
template <int kN>
__device__ __forceinline__ void fence_registers(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for the bf16x2 A fragments of register-A wgmma: they are read asynchronously until the wait.
template <int kN>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Shared-memory matrix descriptor of a 128B-swizzled tile (layout type 1 in bits 62-63). Addresses and
// offsets are in bytes and encoded >> 4 in 14-bit fields, so a tile must live below 256 KiB.
//  * K-major tile (rows of 64 bf16 = 128 B along K): the stride between 8-row groups is 1024 B; the
//    leading offset is unused for swizzled K-major layouts. Stepping K by 16 inside the 128-B row moves
//    the start address by 32 B (the hardware applies the swizzle to absolute address bits, so the tile
//    base must be 1024-B aligned).
//  * MN-major tile (rows of 64 bf16 = 128 B along M or N, one row per k): "leading" = offset between
//    64-element MN atoms, "stride" = offset between groups of 8 k-rows (1024 B). Stepping K by 16
//    moves the start address by 16 rows = 2048 B.
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t smem_address, uint32_t leading_bytes,
                                                     uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}

// Byte offset of byte `b` (0..127) of row `r` inside a 128B-swizzled box: the 16-byte chunk index is
// XORed with the row index mod 8. This is the layout TMA reads and writes with CU_TENSOR_MAP_SWIZZLE_128B,
// and it spreads the 8 rows a warp touches over all 32 banks.
__device__ __forceinline__ uint32_t sw128_offset(int r, int b) {
  return static_cast<uint32_t>(r * 128 + ((((b >> 4) ^ r) & 7) << 4) + (b & 15));
}

// ---- host: tensor maps -----------------------------------------------------------------------------

// The driver's cuTensorMapEncodeTiled, looked up once through the runtime, so nothing links libcuda
// (binaries must start, and list their tests, on machines without a GPU driver).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status));
    if (status != cudaDriverEntryPointSuccess || ptr == nullptr)
      throw std::runtime_error("kernels/sm90/sm90.cuh: driver entry point cuTensorMapEncodeTiled not found");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace coda::sm90
