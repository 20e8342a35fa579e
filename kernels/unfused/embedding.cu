// Token (and GPT-2 position) embedding, forward and backward.
//
// Forward: x[n, :] = wte[tokens[n], :] + wpe[n % T, :], four 16-byte packets per thread in flight.
//
// Backward: a scatter-add of the rows of dx into dwte (by token) and dwpe (by position), fp32.
// Atomics would make the sums depend on scheduling. Instead the host groups the rows of the batch by
// token with a counting sort (O(N + vocab), run while the GPU computes the forward pass), and the kernel
// gives every distinct token one warp that sums that token's rows in ascending row order and adds the
// sum into its dwte row: one writer per row, a fixed order, no atomics. The same launch gives each
// position t one more warp for dwpe[t] = sum over b of dx[b*T + t]. A token that fills a large part of
// the batch makes one long warp; with natural text the longest buckets are a few percent of the rows.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "kernels/unfused/vec.cuh"

namespace coda::unfused {

namespace {

constexpr int kForwardILP = 4;  // packets per thread, their loads issued together
constexpr int kBackwardWarps = 8;

// A persistent grid: thread i handles packets i, i + stride, ... in groups of kForwardILP, the group's
// token ids first, then all its gathers.
__global__ void __launch_bounds__(256) embedding_forward_kernel(bf16* __restrict__ x, const int32_t* __restrict__ tokens,
                                                                const bf16* __restrict__ wte,
                                                                const bf16* __restrict__ wpe, int N, int T, int C) {
  const int chunks = C / 8;
  const size_t total = static_cast<size_t>(N) * chunks, stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; first < total;
       first += kForwardILP * stride) {
    int token[kForwardILP];
#pragma unroll
    for (int u = 0; u < kForwardILP; ++u) {
      const size_t idx = first + u * stride;
      token[u] = idx < total ? tokens[idx / chunks] : 0;
    }
    uint4 word[kForwardILP], position[kForwardILP];
#pragma unroll
    for (int u = 0; u < kForwardILP; ++u) {
      const size_t idx = first + u * stride;
      if (idx >= total) continue;
      const int n = static_cast<int>(idx / chunks), col = static_cast<int>(idx % chunks) * 8;
      word[u] = load_packet(wte + static_cast<size_t>(token[u]) * C + col);
      if (wpe != nullptr) position[u] = load_packet(wpe + static_cast<size_t>(n % T) * C + col);
    }
#pragma unroll
    for (int u = 0; u < kForwardILP; ++u) {
      const size_t idx = first + u * stride;
      if (idx >= total) continue;
      float v[8];
      unpack_bf16x8(v, word[u]);
      if (wpe != nullptr) {
        float p[8];
        unpack_bf16x8(p, position[u]);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] += p[j];
      }
      store_bf16x8(x + 8 * idx, v);
    }
  }
}

// One warp adds the sum of dx rows row_at(0..count) into dst (one fp32 row of C); lane l owns packets
// l + 32 i. The destination is read once, rows are added two at a time (all their loads in flight), and
// the destination is written once.
template <int kChunks, typename RowAt>
__device__ void add_rows(float* __restrict__ dst, const bf16* __restrict__ dx, int count, int C, RowAt row_at) {
  const int lane = threadIdx.x % 32, chunks = C / 8;
  float acc[kChunks][8];
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
    if (lane + 32 * i < chunks) load_f32x8(acc[i], dst + 8 * (lane + 32 * i));
  int r = 0;
  for (; r < count; r += 2) {
    const bool second = r + 1 < count;
    const size_t row_a = static_cast<size_t>(row_at(r)) * C, row_b = second ? static_cast<size_t>(row_at(r + 1)) * C : 0;
    uint4 a[kChunks], b[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int k = lane + 32 * i;
      if (k < chunks) {
        a[i] = load_packet(dx + row_a + 8 * k);
        if (second) b[i] = load_packet(dx + row_b + 8 * k);
      }
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      if (lane + 32 * i < chunks) {
        float va[8], vb[8];
        unpack_bf16x8(va, a[i]);
        if (second) unpack_bf16x8(vb, b[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] += second ? va[j] + vb[j] : va[j];
      }
  }
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
    if (lane + 32 * i < chunks) store_f32x8(dst + 8 * (lane + 32 * i), acc[i]);
}

// Warps [0, num_buckets): one token each; warps [num_buckets, num_buckets + T): one position each.
template <int kChunks>
__global__ void __launch_bounds__(kBackwardWarps * 32) embedding_backward_kernel(float* __restrict__ dwte,
                                                                                 float* __restrict__ dwpe,
                                                                                 const bf16* __restrict__ dx,
                                                                                 const int32_t* __restrict__ buckets,
                                                                                 int num_buckets, int B, int T, int C) {
  const int N = B * T;
  const int32_t* rows = buckets;
  const int32_t* start = buckets + N;
  const int32_t* token = start + num_buckets + 1;
  const int item = blockIdx.x * kBackwardWarps + threadIdx.x / 32;
  if (item < num_buckets) {
    const int32_t* bucket_rows = rows + start[item];
    add_rows<kChunks>(dwte + static_cast<size_t>(token[item]) * C, dx, start[item + 1] - start[item], C,
                      [&](int i) { return bucket_rows[i]; });
  } else if (dwpe != nullptr && item < num_buckets + T) {
    const int t = item - num_buckets;
    add_rows<kChunks>(dwpe + static_cast<size_t>(t) * C, dx, B, C, [&](int b) { return b * T + t; });
  }
}

}  // namespace

void embedding_forward(bf16* x, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                       cudaStream_t stream) {
  if (C % 8 != 0) throw std::invalid_argument("embedding_forward: C = " + std::to_string(C) + " must be a multiple of 8");
  const size_t packets = static_cast<size_t>(B) * T * (C / 8);
  if (packets == 0) return;
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, embedding_forward_kernel, 256, 0));
  const size_t blocks = std::min<size_t>(static_cast<size_t>(std::max(1, per_sm)) * sm_count(),
                                         blocks_for((packets + kForwardILP - 1) / kForwardILP, 256));
  embedding_forward_kernel<<<static_cast<unsigned int>(blocks), 256, 0, stream>>>(x, tokens, wte, wpe, B * T, T, C);
  CUDA_CHECK_LAUNCH();
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

void embedding_backward(float* dwte, float* dwpe, const bf16* dx, const int32_t* buckets, int num_buckets, int B,
                        int T, int C, cudaStream_t stream) {
  const int items = num_buckets + (dwpe != nullptr ? T : 0);
  if (items == 0) return;
  dispatch_chunks(C, "embedding_backward", [&](auto chunks) {
    embedding_backward_kernel<decltype(chunks)::value>
        <<<blocks_for(items, kBackwardWarps), kBackwardWarps * 32, 0, stream>>>(dwte, dwpe, dx, buckets, num_buckets,
                                                                               B, T, C);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace coda::unfused
