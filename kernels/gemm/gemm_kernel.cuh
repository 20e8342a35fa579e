// The CODA GEMM mainloop (sm_90a): D[M, N] = A B with bf16 operands (or FP8 ones, both K-major, the
// accumulators then times the two dequantization factors), fp32 accumulation, and an epilogue program
// (kernels/epilogue/epilogue.cuh) applied to the accumulators before they are stored.
// One persistent CTA per SM, 384 threads: warpgroup 0 is the producer (one thread streams A and B tiles by TMA
// into a ring of stages with full/empty mbarriers), warpgroups 1 and 2 the consumers (wgmma from the swizzled
// stages, then the epilogue chunk by chunk through swizzled staging buffers and TMA stores). Cooperative: both
// consumers on every tile; ping-pong: alternate tiles, so one consumer's epilogue runs under the other's MMAs.
// Work units (tile, k range) in grouped tile order; weight gradients split K, split-major, summed by TMA
// reduce-add. TMA zero-fills and clips the tails. Launched with PDL (kernels/common/launch.cuh).
// Details: docs/GEMM.md, "Design" (tiles, schedule, epilogue, tile inputs) and "Why it is built this way".

#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/launch.cuh"
#include "kernels/epilogue/epilogue.cuh"
#include "kernels/gemm/gemm.cuh"
#include "kernels/gemm/gemm_params.cuh"
#include "kernels/sm90/sm90.cuh"

namespace coda::gemm_detail {

// Layout of A and B in shared memory: TMA boxes with 128-byte inner rows, 128B swizzle.
//  * K-major operand (forward X and W, dgrad dY): one box {64 k, rows}: row r at r*128 B; FP8 operands
//    (always K-major) {128 k, rows}, the same bytes, which the k32 FP8 wgmma steps through 32 bytes at a
//    time as the k16 bf16 one does.
//  * MN-major operand (dgrad W, wgrad dY and X): boxes {64 m|n, 64 k}, one per 64 columns, 8 KiB apart;
//    wgmma reads them transposed (imm-trans = 1).
template <int kBM_, int kBN_, bool kPingPong_, GemmLayout kLayout_, class OutT_, int kTileInputs_, int kColumnBytes_>
struct Config {
  using OutT = OutT_;
  static constexpr GemmLayout kLayout = kLayout_;
  static constexpr bool kFp8 = gemm_layout_fp8(kLayout);
  static constexpr bool kAKMajor = kLayout != GemmLayout::Wgrad, kBKMajor = gemm_layout_forward(kLayout);
  static constexpr int kBM = kBM_, kBN = kBN_;
  static constexpr int kBK = kFp8 ? 128 : 64;  // elements of one 128-byte swizzle row
  static constexpr int kKSteps = 4;            // wgmma k steps per block: 32 bytes of K each
  static constexpr bool kPingPong = kPingPong_;
  static constexpr int kABytes = kBM * 128, kBBytes = kBN * 128, kStageBytes = kABytes + kBBytes;
  static constexpr int kBlockBytes = 64 * 128;               // one 64-row x 128-byte box
  static constexpr int kStagingBytes = 2 * 2 * kBlockBytes;  // 2 consumers x 2 buffers
  static constexpr int kBarrierBytes = 256;
  static constexpr int kSmemLimit = 232448;                  // sm_90 opt-in maximum per block (227 KiB)
  static constexpr int kTileInputs = kTileInputs_;           // the program's tile inputs
  static constexpr int stages_with(int input_buffers) {
    return (kSmemLimit - 1024 - kStagingBytes - kBarrierBytes - 2 * input_buffers * kTileInputs * kBlockBytes) /
           kStageBytes;
  }
  // A program's single bf16 tile input beside a bf16 output comes into the output's own staging buffers
  // (the input chunk and the output chunk cover the same 64 rows x 128 bytes, and every thread reads the
  // input exactly where it then writes its output) where buffers of its own would cost a ring stage: the
  // cooperative tile keeps its fourth stage (with two input buffers per consumer it would have three, and a
  // program that only adds a tile input would run far behind the bare GEMM), ping-pong
  // 128x128 its sixth. Where no stage is lost (ping-pong 64x256) the separate buffers stay: in staging a
  // chunk's input can only be loaded once the previous chunk's store has read the buffer, and the llama
  // down dgrad (short chunks of a 1 -> 2 map) waits for it. Otherwise the inputs have chunk
  // buffers of their own: two per consumer, one where two would leave fewer than three stages.
  static constexpr bool kInputInStaging =
      kTileInputs == 1 && std::is_same_v<OutT, __nv_bfloat16> && stages_with(0) > stages_with(2);
  static constexpr int kInputBuffers = kInputInStaging ? 0 : stages_with(2) >= 3 ? 2 : 1;  // per consumer
  static constexpr int kInputBarriers = kInputInStaging ? 2 : kInputBuffers;                // per consumer
  static constexpr int kInputBytes = 2 * kInputBuffers * kTileInputs * kBlockBytes;
  static constexpr int kStages = stages_with(kInputBuffers);
  static constexpr int kSubs = kPingPong ? kBM / 64 : 1;     // m64 sub-blocks per consumer and tile
  // The program's column vectors (Program::column_bytes per accumulator column) are copied per tile into
  // shared memory where that costs no ring stage (kernels/epilogue/operands.cuh, copy_columns), one copy per consumer (a
  // consumer synchronizes only its own threads): on the ping-pong 64x256 tile (34 KB left beside its four
  // stages), and on the cooperative tile where the two copies take at most the 1.75 KB it has left (one
  // bf16 vector; the LayerNorm programs' fp32 c and b' need 4 KB). Not on ping-pong 128x128, whose two
  // 64-row blocks have a program copy each: both would copy the same entries, two unordered asynchronous
  // writes to the same bytes (compute-sanitizer racecheck).
  static constexpr int kColumnStageBytes = kColumnBytes_ * kBN;  // per consumer
  static constexpr bool kColumnStaging =
      kColumnStageBytes > 0 && kSubs == 1 &&
      1024 + kStages * kStageBytes + kStagingBytes + kInputBytes + 2 * kColumnStageBytes + kBarrierBytes <= kSmemLimit;
  static constexpr int kColumnBytes = kColumnStaging ? 2 * kColumnStageBytes : 0;
  static constexpr int kSmemBytes =
      1024 + kStages * kStageBytes + kStagingBytes + kInputBytes + kColumnBytes + kBarrierBytes;
  static constexpr int kAcc = kBN / 2;                       // fp32 accumulators per thread and sub-block
  static constexpr int kEmptyArrivals = kPingPong ? 4 : 8;   // lane 0 of each consuming warp
  static constexpr int kTurnArrivals = 4;                    // lane 0 of each warp of the other consumer
  static_assert(kBN == 128 || kBN == 256, "wgmma wrappers exist for n = 128 and 256");
  static_assert(kPingPong ? (kBM == 64 || kBM == 128) : kBM == 128, "cooperative: 64 rows per consumer");
  static_assert(kStages >= 3, "shared memory ring too shallow");
  static_assert((2 * kStages + 2 + 2 * kInputBarriers) * 8 <= kBarrierBytes, "barrier area too small");
  static_assert(kBlockBytes == epi::kTileChunkBytes, "tile input chunks are staging-sized");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "stages must keep 1024-byte alignment");
};

struct Unit {
  int m_tile, n_tile, kb_begin, kb_end;
};

// This CTA's units, in order. Producer and consumers each walk the same sequence.
class Scheduler {
 public:
  __device__ explicit Scheduler(const Params& p)
      : k_blocks_(p.k_blocks), kb_per_split_(p.kb_per_split), tiles_m_(p.tiles_m), tiles_n_(p.tiles_n),
        group_m_(p.group_m), tiles_(p.tiles_m * p.tiles_n), next_(blockIdx.x), end_(p.tiles_m * p.tiles_n * p.splits) {}

  __device__ bool next(Unit& u) {
    if (next_ >= end_) return false;
    const int split = next_ / tiles_, t = next_ - split * tiles_;
    u.kb_begin = split * kb_per_split_;
    u.kb_end = u.kb_begin + kb_per_split_ < k_blocks_ ? u.kb_begin + kb_per_split_ : k_blocks_;
    next_ += gridDim.x;
    // Grouped order: group_m tile rows at a time, the row index fastest.
    const int span = group_m_ * tiles_n_;
    const int first_m = t / span * group_m_;
    const int rows = tiles_m_ - first_m < group_m_ ? tiles_m_ - first_m : group_m_;
    const int r = t % span;
    u.m_tile = first_m + r % rows;
    u.n_tile = r / rows;
    return true;
  }

 private:
  int k_blocks_, kb_per_split_, tiles_m_, tiles_n_, group_m_, tiles_, next_, end_;
};

template <class Cfg>
__device__ __forceinline__ void produce(const CUtensorMap* map_a, const CUtensorMap* map_b, const Params& p,
                                        uint8_t* ring, uint64_t* full, uint64_t* empty) {
  Scheduler sched(p);
  Unit u;
  uint32_t it = 0;
  while (sched.next(u)) {
    const int m0 = u.m_tile * Cfg::kBM, n0 = u.n_tile * Cfg::kBN;
    for (int kb = u.kb_begin; kb < u.kb_end; ++kb, ++it) {
      const uint32_t slot = it % Cfg::kStages, parity = (it / Cfg::kStages) & 1;
      sm90::mbar_wait(&empty[slot], parity ^ 1);
      uint8_t* a = ring + slot * Cfg::kStageBytes;
      uint8_t* b = a + Cfg::kABytes;
      sm90::mbar_arrive_expect_tx(&full[slot], Cfg::kStageBytes);
      const int k0 = kb * Cfg::kBK;
      if constexpr (Cfg::kAKMajor) {
        sm90::tma_load_2d(a, map_a, &full[slot], k0, m0);
      } else {
#pragma unroll
        for (int j = 0; j < Cfg::kBM / 64; ++j) sm90::tma_load_2d(a + j * Cfg::kBlockBytes, map_a, &full[slot], m0 + 64 * j, k0);
      }
      if constexpr (Cfg::kBKMajor) {
        sm90::tma_load_2d(b, map_b, &full[slot], k0, n0);
      } else {
#pragma unroll
        for (int j = 0; j < Cfg::kBN / 64; ++j) sm90::tma_load_2d(b + j * Cfg::kBlockBytes, map_b, &full[slot], n0 + 64 * j, k0);
      }
    }
  }
}

template <class Cfg>
__device__ __forceinline__ void mma(float (&acc)[Cfg::kAcc], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  constexpr int kTransA = Cfg::kAKMajor ? 0 : 1, kTransB = Cfg::kBKMajor ? 0 : 1;
  if constexpr (Cfg::kLayout == GemmLayout::ForwardE4m3) {
    if constexpr (Cfg::kBN == 256)
      sm90::wgmma_m64n256k32_e4m3_e4m3(acc, desc_a, desc_b, accumulate);
    else
      sm90::wgmma_m64n128k32_e4m3_e4m3(acc, desc_a, desc_b, accumulate);
  } else if constexpr (Cfg::kLayout == GemmLayout::ForwardE5m2) {
    if constexpr (Cfg::kBN == 256)
      sm90::wgmma_m64n256k32_e5m2_e4m3(acc, desc_a, desc_b, accumulate);
    else
      sm90::wgmma_m64n128k32_e5m2_e4m3(acc, desc_a, desc_b, accumulate);
  } else if constexpr (Cfg::kBN == 256) {
    sm90::wgmma_m64n256k16<kTransA, kTransB>(acc, desc_a, desc_b, accumulate);
  } else {
    sm90::wgmma_m64n128k16<kTransA, kTransB>(acc, desc_a, desc_b, accumulate);
  }
}

// Descriptor of k step `k` (16 bf16 or 32 FP8 elements: 32 bytes) of a 64-row (A) or BN-row (B) operand
// block at `base`.
template <bool kKMajor>
__device__ __forceinline__ uint64_t operand_descriptor(uint32_t base, int k) {
  if constexpr (kKMajor) return sm90::sw128_descriptor(base + k * 32, 16, 1024);
  return sm90::sw128_descriptor(base + k * 2048, 64 * 128, 1024);
}

// kWidth output values (2; 1 after a 2->1 program; 4 after a 1->2 program) into the swizzled staging
// buffer. out_col is a multiple of kWidth, so the values stay inside one 16-byte chunk of the swizzle.
template <class OutT, int kWidth>
__device__ __forceinline__ void stage_values(uint8_t* buf, int row, int out_col, const float* v) {
  uint8_t* dst = buf + sm90::sw128_offset(row, out_col * static_cast<int>(sizeof(OutT)));
  if constexpr (std::is_same_v<OutT, float>) {
    if constexpr (kWidth == 4)
      *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
    else if constexpr (kWidth == 2)
      *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
    else
      *reinterpret_cast<float*>(dst) = v[0];
  } else {
    if constexpr (kWidth == 4) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
      *reinterpret_cast<uint2*>(dst) =
          make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
    } else if constexpr (kWidth == 2) {
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v[0], v[1]);
    } else {
      *reinterpret_cast<__nv_bfloat16*>(dst) = __float2bfloat16_rn(v[0]);
    }
  }
}

template <class Cfg, class Program>
__device__ __forceinline__ void consume(int cw, int t, const CUtensorMap* map_d, const TileMaps& tile_maps,
                                        const Params& p, const Program& program, uint8_t* ring, uint8_t* staging,
                                        uint8_t* inputs, uint8_t* columns, uint64_t* full, uint64_t* empty,
                                        uint64_t* turn, uint64_t* input_full) {
  using OutT = typename Cfg::OutT;
  // Output columns per accumulator column: kExpand / kRatio (1, 1/2 after a 2->1 map, 2 after a 1->2 map).
  constexpr int kRatio = Program::kColsPerOut;
  constexpr int kExpand = Program::kOutsPerCol;
  constexpr int kWidth = 2 * kExpand / kRatio;                    // output values per fragment
  constexpr int kOutCols = 128 / static_cast<int>(sizeof(OutT));  // output columns per staged chunk
  constexpr int kChunkAccCols = kOutCols * kRatio / kExpand;      // accumulator columns per chunk
  constexpr int kChunkGroups = kChunkAccCols / 8;                 // 8-column accumulator groups per chunk
  constexpr int kChunks = Cfg::kBN / kChunkAccCols;
  static_assert((kRatio == 1 || kRatio == 2) && (kExpand == 1 || kExpand == 2) && kRatio * kExpand <= 2,
                "programs map 2 -> 2, 2 -> 1 or 1 -> 2");
  static_assert(kChunkGroups >= 1 && kChunks >= 1 && Cfg::kBN % kChunkAccCols == 0, "tile must hold whole chunks");
  static_assert(!Program::kBatchesGroups || kChunkGroups % epi::kBatchGroups == 0,
                "the program gathers batches of four column groups: a chunk must hold whole batches");

  const int warp = t / 32, lane = t % 32;
  const int r0 = warp * 16 + lane / 4;  // row of slot 0 inside a 64-row block; slot 1 is r0 + 8
  const int out_cols = p.N * kExpand / kRatio;
  // The chunk body is compiled twice, for interior blocks (rows and columns inside M x N and before the
  // program's column end: Frag::interior is the constant true, the masks fold away and the batched
  // primitives take their fast paths, such as StoreAux's 16-byte stores) and for the edge blocks, where
  // that pays: for programs that batch column groups (kBatchesGroups), on tiles with one 64-row block per
  // consumer (batches need it). Measured with bench_programs, the interior body took 12-13% off gpt2's fc
  // and llama's gate/up programs and 3-4% off gpt2's LM head and proj dgrad, and nothing off the others;
  // elsewhere the edge body alone runs everywhere, at half the compile time.
  constexpr bool kInteriorBody = Program::kBatchesGroups && Cfg::kSubs == 1;
  // N tiles that end at or before this column run the interior chunk body.
  const int interior_n = min(p.N, program.acc_column_end());
  uint8_t* my_staging = staging + cw * 2 * Cfg::kBlockBytes;
  const uint32_t ring_base = sm90::smem_u32(ring);
  // Tile inputs: buffer b of this consumer holds chunk input k at my_inputs + (b * kInputs + k) * kBlockBytes;
  // in staging (Config::kInputInStaging) buffer b is staging buffer b, the one chunk b's output goes to.
  constexpr int kInputs = Cfg::kTileInputs;
  constexpr bool kInStaging = Cfg::kInputInStaging;
  constexpr int kBuffers = kInStaging ? 2 : Cfg::kInputBuffers;
  constexpr uint32_t kInputChunkBytes = 64 * kOutCols * 2;  // 64 rows x the chunk's columns, bf16
  uint8_t* my_inputs = kInStaging ? my_staging : inputs + cw * kBuffers * kInputs * Cfg::kBlockBytes;
  uint64_t* my_input_full = input_full + cw * Cfg::kInputBarriers;
  uint32_t inputs_issued = 0, inputs_used = 0;  // chunks issued (thread 0) and visited (every thread)

  float acc[Cfg::kSubs][Cfg::kAcc];
#pragma unroll
  for (int s = 0; s < Cfg::kSubs; ++s)
#pragma unroll
    for (int i = 0; i < Cfg::kAcc; ++i) acc[s][i] = 0.0f;

  Scheduler sched(p);
  Unit u;
  uint32_t it = 0;
  int unit_index = 0, my_units = 0, chunk_count = 0;
  while (sched.next(u)) {
    const int k_blocks = u.kb_end - u.kb_begin;
    if constexpr (Cfg::kPingPong) {
      if ((unit_index++ & 1) != cw) {  // the other consumer's tile: skip its stages
        it += k_blocks;
        continue;
      }
    }
    const int n0 = u.n_tile * Cfg::kBN;
    const int out_col_first = n0 * kExpand / kRatio;

    // The tile's chunks in visiting order: 64-row block, then chunk of output columns. Blocks past M and
    // chunks past the output's last column are not visited, so they are not loaded either.
    const int block_chunks = min(kChunks, (out_cols - out_col_first + kOutCols - 1) / kOutCols);
    auto block_row = [&](int s) { return u.m_tile * Cfg::kBM + (Cfg::kPingPong ? s : cw) * 64; };
    const int tile_chunks = block_chunks * (block_row(0) >= p.M ? 0 : (Cfg::kSubs == 2 && block_row(1) < p.M) ? 2 : 1);
    auto chunk_col = [&](int k) { return out_col_first + k % block_chunks * kOutCols; };  // chunk k's box
    auto chunk_row = [&](int k) { return block_row(k / block_chunks); };
    auto issue_inputs = [&](int k) {  // chunk k of this tile, into the next buffer
      const uint32_t b = inputs_issued++ % kBuffers;
      uint8_t* dst = my_inputs + b * kInputs * Cfg::kBlockBytes;
      sm90::mbar_arrive_expect_tx(&my_input_full[b], kInputs * kInputChunkBytes);
#pragma unroll
      for (int i = 0; i < kInputs; ++i)
        sm90::tma_load_2d(dst + i * Cfg::kBlockBytes, &tile_maps.map[i], &my_input_full[b], chunk_col(k),
                          chunk_row(k));
    };
    auto issue_first_inputs = [&] {  // thread 0: the tile's first chunks (in staging, the others asked of L2)
      for (int k = 0; k < kBuffers && k < tile_chunks; ++k) issue_inputs(k);
      if constexpr (kInStaging)
        for (int k = kBuffers; k < tile_chunks; ++k)
          sm90::tma_prefetch_l2_2d(&tile_maps.map[0], chunk_col(k), chunk_row(k));  // the single input
    };
    if constexpr (kInputs > 0 && !kInStaging) {
      // The previous tile's chunks were all visited (its last named barrier): every buffer is free.
      if (t == 0) issue_first_inputs();
    }

    // The program's per-row work (row operands finished from partials, targets, column-vector
    // prefetches) runs where its loads' latency is hidden under MMAs: on the ping-pong tiles before the
    // consumer waits for its turn, under the other consumer's mainloop; on the cooperative tile right
    // after the first k-block's MMAs are issued. (Before the cooperative mainloop, the loads' latency
    // stalls the consumers while the tensor cores wait; just before wgmma.wait_group 0, ptxas moves most
    // of the loads below the wait. On the ping-pong tiles after the first MMAs, the wait for the loads
    // holds up the second k-block's MMAs.) Costs a few registers across
    // the mainloop.
    auto block_ctx = [&](int s) {
      const int m_block = block_row(s);
      epi::RowCtx c{{m_block + r0, m_block + r0 + 8}, 2, n0, u.n_tile, p.tiles_n, p.M, p.N};
      c.tile_cols = Cfg::kBN;
      c.lane_col = 2 * (lane & 3);
      c.column_stage = Cfg::kColumnStaging ? columns + cw * Cfg::kColumnStageBytes : nullptr;
      return c;
    };
    const epi::RowCtx ctx0 = block_ctx(0), ctx1 = block_ctx(1);
    Program prog0 = program, prog1 = program;
    auto begin_rows = [&] {
      prog0.begin_rows(ctx0);
      if constexpr (Cfg::kSubs == 2) prog1.begin_rows(ctx1);
    };
    if constexpr (Cfg::kPingPong) {
      begin_rows();
      // Consumer 0's first turn is free (a wait for parity 1 on a fresh barrier succeeds at once).
      sm90::mbar_wait(&turn[cw], (my_units++ & 1) ^ (cw == 0 ? 1 : 0));
    }

    // ---- mainloop ----
    uint32_t prev_slot = 0;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const uint32_t slot = it % Cfg::kStages, parity = (it / Cfg::kStages) & 1;
      sm90::mbar_wait(&full[slot], parity);
      const uint32_t a_base = ring_base + slot * Cfg::kStageBytes, b_base = a_base + Cfg::kABytes;
      sm90::wgmma_fence();
#pragma unroll
      for (int k = 0; k < Cfg::kKSteps; ++k) {
        const uint64_t desc_b = operand_descriptor<Cfg::kBKMajor>(b_base, k);
#pragma unroll
        for (int s = 0; s < Cfg::kSubs; ++s) {
          const int block = Cfg::kPingPong ? s : cw;
          const uint64_t desc_a = operand_descriptor<Cfg::kAKMajor>(a_base + block * Cfg::kBlockBytes, k);
          mma<Cfg>(acc[s], desc_a, desc_b, (kb > 0 || k > 0) ? 1 : 0);
        }
      }
      sm90::wgmma_commit();
      if (kb == 0) {
        if constexpr (kInStaging) {
          // The previous tile's last stores must have read the staging buffers before its inputs land
          // there; by now (after this tile's first MMAs are issued) they normally have.
          if (t == 0) {
            sm90::bulk_wait_read<0>();
            issue_first_inputs();
          }
        }
        if constexpr (!Cfg::kPingPong) begin_rows();
      }
      sm90::wgmma_wait<1>();  // the previous stage's MMAs are done: release it
      if (kb > 0 && lane == 0) sm90::mbar_arrive(&empty[prev_slot]);
      prev_slot = slot;
    }
    if (Cfg::kPingPong && lane == 0) sm90::mbar_arrive(&turn[cw ^ 1]);  // all my stages waited on: your turn

    sm90::wgmma_wait<0>();
    if (lane == 0) sm90::mbar_arrive(&empty[prev_slot]);
#pragma unroll
    for (int s = 0; s < Cfg::kSubs; ++s) sm90::fence_registers(acc[s]);
    if constexpr (Cfg::kFp8) {  // D = dq_a dq_b (A B^T): the product the program sees
      const float dequant = *p.dequant_a * *p.dequant_b;
#pragma unroll
      for (int s = 0; s < Cfg::kSubs; ++s)
#pragma unroll
        for (int i = 0; i < Cfg::kAcc; ++i) acc[s][i] *= dequant;
    }
    // The tile's column-vector copies (cp.async in begin_rows, operands.cuh copy_columns) have landed;
    // the first chunk's barrier makes them visible to the whole consumer.
    if constexpr (Cfg::kColumnStaging) sm90::cp_async_wait_all();

    // ---- epilogue ----
    // One 64-row block: its program copy, its rows, its accumulators (separate variables per block, not
    // arrays indexed by the block: with arrays the compiler kept some programs' per-row state in local
    // memory). Long programs (kRolledFrom primitives or more) run the chunk loop rolled: unrolled, their
    // epilogues (12-20k instructions, 200-300 KB) do not fit the instruction cache and stall on
    // instruction fetch. A rolled chunk visits the first kChunkAcc accumulators and then shifts the rest down
    // (register moves; the accumulators are overwritten by the next tile's first MMA), so every index is
    // a compile-time constant and the accumulators stay in registers; it runs to the run-time chunk count
    // (with the constant one, the compiler unrolled the two-input programs' loop all the same). Short
    // programs keep the loop unrolled and index chunk c's accumulators directly: the moves are real there
    // too (the shifted values flow into the next tile's MMAs), and slow the identity program's epilogue.
    int tile_chunk = 0;  // chunks of this tile visited so far
    auto store_block = [&](Program& prog, const epi::RowCtx& ctx, float(&a)[Cfg::kAcc]) {
      constexpr int kChunkAcc = 4 * kChunkGroups;  // accumulators per thread in one chunk
      constexpr int kRolledFrom = 6;
      constexpr bool kRolled = Program::kLength >= kRolledFrom;
      const int m_block = ctx.rows[0] - r0;
      if (m_block >= p.M) return;
      const int chunks = kRolled ? block_chunks : kChunks;
      // The chunk loop, instantiated for interior and edge blocks where kInteriorBody says so.
      auto visit_chunks = [&](auto interior) {
#pragma unroll(kRolled ? 1 : kChunks)
        for (int c = 0; c < chunks; ++c) {
          const int out_col0 = out_col_first + c * kOutCols;
          if (out_col0 >= out_cols) break;
          uint8_t* buf = my_staging + (chunk_count++ & 1) * Cfg::kBlockBytes;
          epi::RowCtx chunk_ctx = ctx;
          if constexpr (kInputs > 0) {
            const uint32_t b = inputs_used % kBuffers;
            sm90::mbar_wait(&my_input_full[b], (inputs_used++ / kBuffers) & 1);
            chunk_ctx.tiles = my_inputs + b * kInputs * Cfg::kBlockBytes;
            chunk_ctx.tile_row0 = m_block;
            chunk_ctx.tile_col0 = out_col0;
            chunk_ctx.tile_row_bytes = kOutCols * 2;
          }
          // The store that last read `buf` is done with it (in staging: its read ended before this
          // chunk's input was loaded into buf).
          if (!kInStaging && t == 0) sm90::bulk_wait_read<1>();
          sm90::named_barrier(1 + cw, 128);
#pragma unroll
          for (int g = 0; g < kChunkGroups; ++g) {
            const int col = n0 + (c * kChunkGroups + g) * 8 + 2 * (lane & 3);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i = (kRolled ? 0 : c * kChunkAcc) + 4 * g + 2 * h;  // a constant either way
              epi::Frag f{h, m_block + r0 + 8 * h, col, 2, 1, {a[i], a[i + 1]},
                          1, g, decltype(interior)::value, Cfg::kSubs == 1 ? kChunkGroups : 0, Cfg::kColumnStaging};
              prog.visit(f, chunk_ctx);
              // The fragment's output column inside the chunk, written from the constant g and the lane
              // (not as col - n0: the compiler kept that a run-time subtraction and recomputed the swizzle
              // from it, five integer instructions per fragment).
              stage_values<OutT, kWidth>(buf, r0 + 8 * h, (g * 8 + 2 * (lane & 3)) * kExpand / kRatio, f.v);
            }
            // In staging, chunk tile_chunk + 1 goes to the buffer of the previous chunk, whose store was
            // issued just before this chunk began: halfway through this chunk its read is normally over,
            // and the load has the second half of the chunk to land (from L2: issue_first_inputs).
            if constexpr (kInStaging) {
              if (g == kChunkGroups / 2 && t == 0 && tile_chunk >= 1 && tile_chunk + 1 < tile_chunks) {
                sm90::bulk_wait_read<0>();
                issue_inputs(tile_chunk + 1);
              }
            }
          }
          if constexpr (kRolled) {
#pragma unroll
            for (int i = 0; i + kChunkAcc < Cfg::kAcc; ++i) a[i] = a[i + kChunkAcc];
          }
          sm90::fence_proxy_async_smem();
          sm90::named_barrier(1 + cw, 128);
          if (t == 0) {
            if (p.accumulate)
              sm90::tma_reduce_add_2d(map_d, buf, out_col0, m_block);
            else
              sm90::tma_store_2d(map_d, buf, out_col0, m_block);
            sm90::bulk_commit();
            // Every thread has visited this chunk: its input buffer takes the chunk kBuffers ahead.
            if (kInputs > 0 && !kInStaging && tile_chunk + kBuffers < tile_chunks)
              issue_inputs(tile_chunk + kBuffers);
          }
          ++tile_chunk;
        }
      };
      if constexpr (kInteriorBody) {
        if (m_block + 64 <= p.M && n0 + Cfg::kBN <= interior_n)
          visit_chunks(std::true_type{});
        else
          visit_chunks(std::false_type{});
      } else {
        visit_chunks(std::false_type{});
      }
      prog.end_rows(ctx, epi::QuadLanes{lane});
    };
    store_block(prog0, ctx0, acc[0]);
    if constexpr (Cfg::kSubs == 2) store_block(prog1, ctx1, acc[1]);
  }
  if (t == 0) sm90::bulk_wait<0>();
}

template <class Cfg, class Program>
__global__ void __launch_bounds__(384, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                const __grid_constant__ CUtensorMap map_d, const __grid_constant__ TileMaps tile_maps, const Params p,
                const Program program) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_u32(smem_raw) & 1023)) & 1023);  // swizzle atoms
  uint8_t* ring = smem;
  uint8_t* staging = ring + Cfg::kStages * Cfg::kStageBytes;
  uint8_t* inputs = staging + Cfg::kStagingBytes;
  uint8_t* columns = inputs + Cfg::kInputBytes;  // [consumer][kColumnStageBytes] where staged
  uint64_t* full = reinterpret_cast<uint64_t*>(columns + Cfg::kColumnBytes);
  uint64_t* empty = full + Cfg::kStages;
  uint64_t* turn = empty + Cfg::kStages;
  uint64_t* input_full = turn + 2;  // [consumer][input buffer]

  const int warpgroup = threadIdx.x / 128, t = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    sm90::prefetch_tensor_map(&map_a);
    sm90::prefetch_tensor_map(&map_b);
    sm90::prefetch_tensor_map(&map_d);
    for (int i = 0; i < Cfg::kTileInputs; ++i) sm90::prefetch_tensor_map(&tile_maps.map[i]);
    for (int s = 0; s < Cfg::kStages; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], Cfg::kEmptyArrivals);
    }
    sm90::mbar_init(&turn[0], Cfg::kTurnArrivals);
    sm90::mbar_init(&turn[1], Cfg::kTurnArrivals);
    for (int i = 0; i < 2 * Cfg::kInputBarriers; ++i) sm90::mbar_init(&input_full[i], 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  // Launched with PDL (kernels/common/launch.cuh): the prologue above ran under the previous kernel's tail; no global
  // memory before this.
  start_after_previous_kernel();

  if (warpgroup == 0) {
    sm90::regs_release<40>();
    if (t == 0) produce<Cfg>(&map_a, &map_b, p, ring, full, empty);
  } else {
    sm90::regs_claim<232>();
    consume<Cfg>(warpgroup - 1, t, &map_d, tile_maps, p, program, ring, staging, inputs, columns, full, empty,
                 turn, input_full);
  }
}

}  // namespace coda::gemm_detail
