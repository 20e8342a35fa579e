// Token (and GPT-2 position) embedding, forward and backward.
// Forward: x[n, :] = wte[tokens[n], :] + wpe[n % T, :], a warp per row with the next row's token id
// prefetched. Backward: a scatter-add of the rows of dx into dwte (by token) and dwpe (by position), fp32,
// without atomics (they would make the sums depend on scheduling): the host groups the rows by token and
// each distinct token's warp sums its rows in a fixed order. Details: above embedding_backward below.

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

constexpr int kForwardWarps = 8;
constexpr int kBackwardWarps = 4;  // small blocks: a block's slot frees as soon as its few warps finish

// A persistent grid: each warp walks rows warp, warp + all warps, ...; lane l gathers packets l + 32 i of the
// row. The token id of the warp's next row is loaded while the current row's gathers are in flight, so a
// row costs one memory round trip, not two (id, then row).
template <int kChunks, bool kPositions>
__global__ void __launch_bounds__(kForwardWarps * 32) embedding_forward_kernel(bf16* __restrict__ x,
                                                                               const int32_t* __restrict__ tokens,
                                                                               const bf16* __restrict__ wte,
                                                                               const bf16* __restrict__ wpe, int N,
                                                                               int T, int C) {
  start_after_previous_kernel();
  const int lane = threadIdx.x % 32, chunks = C / 8, all_warps = gridDim.x * kForwardWarps;
  int row = blockIdx.x * kForwardWarps + threadIdx.x / 32;
  int token = row < N ? tokens[row] : 0;
  for (; row < N; row += all_warps) {
    const int next_token = row + all_warps < N ? tokens[row + all_warps] : 0;
    const bf16* word_row = wte + static_cast<size_t>(token) * C;
    const bf16* position_row = wpe + static_cast<size_t>(row % T) * C;
    uint4 word[kChunks], position[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (k < chunks) {
        word[i] = load_packet(word_row + 8 * k);
        if (kPositions) position[i] = load_packet(position_row + 8 * k);
      }
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (k >= chunks) continue;
      float v[8];
      unpack_bf16x8(v, word[i]);
      if (kPositions) {
        float p[8];
        unpack_bf16x8(p, position[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] += p[j];
      }
      store_bf16x8(x + static_cast<size_t>(row) * C + 8 * k, v);
    }
    token = next_token;
  }
}

// Rows of dx a backward warp keeps in flight: as many as the registers allow next to its fp32 accumulator
// row (narrow rows, C <= 768, also keep 24 warps per multiprocessor: at most 80 registers).
constexpr int rows_in_flight(int chunks) { return chunks <= 3 ? 3 : chunks <= 8 ? 2 : 1; }

// One warp adds the sum of dx rows row_at(0..count) into dst (one fp32 row of C); lane l owns packets
// l + 32 i. The destination is read once, rows are added in order, kRows at a time with all their loads in
// flight (past the end a lane reloads the last row and drops it), and the destination is written once.
template <int kChunks, typename RowAt>
__device__ void add_rows(float* __restrict__ dst, const bf16* __restrict__ dx, int count, int C, RowAt row_at) {
  constexpr int kRows = rows_in_flight(kChunks);
  const int lane = threadIdx.x % 32, chunks = C / 8;
  float acc[kChunks][8];
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
    if (lane + 32 * i < chunks) load_f32x8(acc[i], dst + 8 * (lane + 32 * i));
  for (int r = 0; r < count; r += kRows) {
    uint4 v[kRows][kChunks];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const size_t row = static_cast<size_t>(row_at(min(r + u, count - 1))) * C;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int k = lane + 32 * i;
        if (k < chunks) v[u][i] = load_packet(dx + row + 8 * k);
      }
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      if (r + u < count)
#pragma unroll
        for (int i = 0; i < kChunks; ++i)
          if (lane + 32 * i < chunks) {
            float f[8];
            unpack_bf16x8(f, v[u][i]);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[i][j] += f[j];
          }
  }
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
    if (lane + 32 * i < chunks) store_f32x8(dst + 8 * (lane + 32 * i), acc[i]);
}

// Warps [0, P): one position each (P = T with dwpe, else 0); warps [P, P + num_buckets): one token each.
// The position warps sum B rows each, far more than a token's few, so they come first: the block scheduler
// starts them at once and the short token warps fill in around them, instead of a tail of long warps.
template <int kChunks>
__global__ void __launch_bounds__(kBackwardWarps * 32, kChunks <= 3 ? 24 / kBackwardWarps : 1)
    embedding_backward_kernel(float* __restrict__ dwte, float* __restrict__ dwpe, const bf16* __restrict__ dx,
                              const int32_t* __restrict__ buckets, int num_buckets, int B, int T, int C) {
  start_after_previous_kernel();
  const int N = B * T, positions = dwpe != nullptr ? T : 0;
  const int32_t* rows = buckets;
  const int32_t* start = buckets + N;
  const int32_t* token = start + num_buckets + 1;
  const int item = blockIdx.x * kBackwardWarps + threadIdx.x / 32;
  if (item < positions) {
    add_rows<kChunks>(dwpe + static_cast<size_t>(item) * C, dx, B, C, [&](int b) { return b * T + item; });
  } else if (item < positions + num_buckets) {
    const int bucket = item - positions;
    const int32_t* bucket_rows = rows + start[bucket];
    add_rows<kChunks>(dwte + static_cast<size_t>(token[bucket]) * C, dx, start[bucket + 1] - start[bucket], C,
                      [&](int i) { return bucket_rows[i]; });
  }
}

}  // namespace

void embedding_forward(bf16* x, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                       cudaStream_t stream) {
  const int N = B * T;
  dispatch_chunks(C, "embedding_forward", [&](auto chunks) {
    if (N == 0) return;
    const profile::Region region("embedding forward", profile::Work::Other, stream);
    auto kernel = wpe != nullptr ? embedding_forward_kernel<decltype(chunks)::value, true>
                                 : embedding_forward_kernel<decltype(chunks)::value, false>;
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kForwardWarps * 32, 0));
    const int blocks = std::max(1, std::min(std::max(1, per_sm) * sm_count(), (N + kForwardWarps - 1) / kForwardWarps));
    launch_kernel(kernel, after_previous(blocks, kForwardWarps * 32), stream, x, tokens, wte, wpe, N, T, C);
  });
}

TokenBuckets group_rows_by_token(const int32_t* tokens, int N, int vocab_size) {
  std::vector<int32_t> count(static_cast<size_t>(vocab_size) + 1, 0);
  for (int n = 0; n < N; ++n) {
    if (tokens[n] < 0 || tokens[n] >= vocab_size)
      throw std::invalid_argument("token id " + std::to_string(tokens[n]) + " at position " + std::to_string(n) +
                                  " is outside the vocabulary of " + std::to_string(vocab_size));
    ++count[tokens[n] + 1];
  }
  int buckets = 0;
  for (int v = 1; v <= vocab_size; ++v) buckets += count[v] > 0;
  TokenBuckets result;
  result.num_rows = N;
  result.num_buckets = buckets;
  result.packed.resize(static_cast<size_t>(N) + 2 * buckets + 1);
  int32_t* rows = result.packed.data();
  int32_t* start = rows + N;
  int32_t* token = start + buckets + 1;
  int bucket = 0;
  for (int v = 0; v < vocab_size; ++v) {  // count[v] becomes the first slot of token v
    const int occurrences = count[v + 1];
    if (occurrences > 0) {
      start[bucket] = count[v];
      token[bucket] = v;
      ++bucket;
    }
    count[v + 1] += count[v];
  }
  start[buckets] = N;
  for (int n = 0; n < N; ++n) rows[count[tokens[n]]++] = n;
  return result;
}

// The host groups the rows of the batch by token with a counting sort (O(N + vocab), run while the GPU
// computes the forward pass), and the kernel gives every distinct token one warp that sums that token's rows
// in ascending row order and adds the sum into its dwte row: one writer per row, a fixed order, no atomics.
// The same launch gives each position t one more warp for dwpe[t] = sum over b of dx[b*T + t] (these warps
// come first: they are the long ones). A token that fills a large part of the batch makes one long warp;
// with natural text the longest buckets are a few percent of the rows.
void embedding_backward(float* dwte, float* dwpe, const bf16* dx, const int32_t* buckets, int num_buckets, int B,
                        int T, int C, cudaStream_t stream) {
  const int items = num_buckets + (dwpe != nullptr ? T : 0);
  if (items == 0) return;
  dispatch_chunks(C, "embedding_backward", [&](auto chunks) {
    const profile::Region region("embedding backward", profile::Work::Other, stream);
    launch_kernel(embedding_backward_kernel<decltype(chunks)::value>,
                  after_previous(blocks_for(items, kBackwardWarps), kBackwardWarps * 32), stream, dwte, dwpe, dx,
                  buckets, num_buckets, B, T, C);
  });
}

}  // namespace coda::unfused
