// Token (and GPT-2 position) embedding, forward and backward.
//
// Forward: x[n, :] = wte[tokens[n], :] + wpe[n % T, :], one 16-byte packet per thread.
//
// Backward: a scatter-add of the rows of dx into dwte (by token) and dwpe (by position), fp32.
// Atomics would make the sums depend on scheduling. Instead the host groups the rows of the batch by
// token with a counting sort (O(N + vocab), run while the GPU computes the forward pass), and the kernel
// gives every distinct token one block that sums that token's rows in ascending row order and adds the
// sum into its dwte row: one writer per row, a fixed order, no atomics. The same launch gives each
// position t one more block for dwpe[t] = sum over b of dx[b*T + t]. A token that fills a large part of
// the batch makes one long block; with natural text the longest buckets are a few percent of the rows.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "kernels/unfused/vec.cuh"

namespace coda::unfused {

namespace {

__global__ void embedding_forward_kernel(bf16* x, const int32_t* tokens, const bf16* wte, const bf16* wpe, int N,
                                         int T, int C) {
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int chunks = C / 8;
  if (idx >= static_cast<size_t>(N) * chunks) return;
  const int n = static_cast<int>(idx / chunks), col = static_cast<int>(idx % chunks) * 8;
  float v[8];
  load_bf16x8(v, wte + static_cast<size_t>(tokens[n]) * C + col);
  if (wpe != nullptr) {
    float p[8];
    load_bf16x8(p, wpe + static_cast<size_t>(n % T) * C + col);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] += p[j];
  }
  store_bf16x8(x + static_cast<size_t>(n) * C + col, v);
}

// Adds the sum of dx rows row_at(0..count) into dst (one fp32 row of C), columns split over the block.
template <typename RowAt>
__device__ void add_rows(float* dst, const bf16* dx, int count, int C, RowAt row_at) {
  for (int col = threadIdx.x * 8; col < C; col += blockDim.x * 8) {
    float acc[8];
    load_f32x8(acc, dst + col);
    int i = 0;
    for (; i + 3 < count; i += 4) {
      float v[4][8];
#pragma unroll
      for (int u = 0; u < 4; ++u) load_bf16x8(v[u], dx + static_cast<size_t>(row_at(i + u)) * C + col);
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += v[u][j];
    }
    for (; i < count; ++i) {
      float v[8];
      load_bf16x8(v, dx + static_cast<size_t>(row_at(i)) * C + col);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += v[j];
    }
    store_f32x8(dst + col, acc);
  }
}

// Blocks [0, num_buckets): one token each; blocks [num_buckets, num_buckets + T): one position each.
__global__ void embedding_backward_kernel(float* dwte, float* dwpe, const bf16* dx, const int32_t* buckets,
                                          int num_buckets, int B, int T, int C) {
  const int N = B * T;
  const int32_t* rows = buckets;
  const int32_t* start = buckets + N;
  const int32_t* token = start + num_buckets + 1;
  const int block = blockIdx.x;
  if (block < num_buckets) {
    const int32_t* bucket_rows = rows + start[block];
    add_rows(dwte + static_cast<size_t>(token[block]) * C, dx, start[block + 1] - start[block], C,
             [&](int i) { return bucket_rows[i]; });
  } else {
    const int t = block - num_buckets;
    add_rows(dwpe + static_cast<size_t>(t) * C, dx, B, C, [&](int b) { return b * T + t; });
  }
}

}  // namespace

void embedding_forward(bf16* x, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                       cudaStream_t stream) {
  if (C % 8 != 0) throw std::invalid_argument("embedding_forward: C = " + std::to_string(C) + " must be a multiple of 8");
  const size_t threads = static_cast<size_t>(B) * T * (C / 8);
  embedding_forward_kernel<<<blocks_for(threads, 256), 256, 0, stream>>>(x, tokens, wte, wpe, B * T, T, C);
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
  if (C % 8 != 0)
    throw std::invalid_argument("embedding_backward: C = " + std::to_string(C) + " must be a multiple of 8");
  const int blocks = num_buckets + (dwpe != nullptr ? T : 0);
  if (blocks == 0) return;
  const int threads = std::min(256, (C / 8 + 31) / 32 * 32);
  embedding_backward_kernel<<<blocks, threads, 0, stream>>>(dwte, dwpe, dx, buckets, num_buckets, B, T, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace coda::unfused
