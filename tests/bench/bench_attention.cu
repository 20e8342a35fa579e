// Attention throughput: causal bf16, 16k tokens per batch (B = 16384 / T), T = 1k, 2k, 4k, 8k.
// TFLOP/s use FlashAttention's counting: forward 4 * T^2 * hd * heads * B / 2 (causal), backward 2.5x
// the forward (the backward time includes its D = rowsum(dO * O) prologue and dQ conversion).
// Shapes: hd 128 with 16 heads (heads * hd = 2048, as the reference rows in docs/PERFORMANCE.md), hd 64 with 32
// heads (2048, their hd64 row), hd 64 with 32 query / 8 kv heads (Llama-3.2-1B), hd 64 with 12 heads (GPT-2 124M,
// 768). Times: CUDA events, median of 20 runs after 3 warm-up runs. Inputs: a pool of 2^20 N(0, 1) values
// repeated over the buffers (drawing ~100M normals per shape on the host took most of the run time).
// Usage: bench_attention
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/attention/attention.cuh"
#include "kernels/common/cuda_check.cuh"
#include "tests/bench/bench_util.cuh"


int main() {
  struct Model {
    const char* name;
    int n_head, n_kv_head, head_dim;
  };
  const Model models[] = {{"hd128 16/16 heads", 16, 16, 128},
                          {"hd64 32/32 heads", 32, 32, 64},
                          {"hd64 32/8 heads (llama 1B)", 32, 8, 64},
                          {"hd64 12/12 heads (gpt2 124M)", 12, 12, 64}};
  const int tokens = 16384;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<__nv_bfloat16> pool(1 << 20);
  for (auto& x : pool) x = __float2bfloat16(dist(rng));

  std::printf("%-30s %6s %4s %10s %10s %10s %10s\n", "shape", "T", "B", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s");
  for (const Model& m : models) {
    for (int T : {1024, 2048, 4096, 8192}) {
      coda::AttentionShape s;
      s.B = tokens / T, s.T = T, s.n_head = m.n_head, s.n_kv_head = m.n_kv_head, s.head_dim = m.head_dim;
      const size_t qkv_n = static_cast<size_t>(tokens) * s.qkv_dim(), out_n = static_cast<size_t>(tokens) * s.n_head * s.head_dim;
      std::vector<__nv_bfloat16> host(std::max(qkv_n, out_n));
      for (size_t i = 0; i < host.size(); i += pool.size())
        std::copy_n(pool.begin(), std::min(pool.size(), host.size() - i), host.begin() + i);
      __nv_bfloat16 *qkv, *dqkv, *out, *dout;
      float* lse;
      void* work;
      CUDA_CHECK(cudaMalloc(&qkv, qkv_n * 2));
      CUDA_CHECK(cudaMalloc(&dqkv, qkv_n * 2));
      CUDA_CHECK(cudaMalloc(&out, out_n * 2));
      CUDA_CHECK(cudaMalloc(&dout, out_n * 2));
      CUDA_CHECK(cudaMalloc(&lse, static_cast<size_t>(tokens) * s.n_head * 4));
      CUDA_CHECK(cudaMalloc(&work, coda::attention_backward_workspace_bytes(s)));
      CUDA_CHECK(cudaMemcpy(qkv, host.data(), qkv_n * 2, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(dout, host.data(), out_n * 2, cudaMemcpyHostToDevice));

      const double fwd_ms =
          coda::bench::median_ms_each([&](int) { coda::attention_forward(out, lse, qkv, s, nullptr); }, 20, 3);
      const double bwd_ms = coda::bench::median_ms_each(
          [&](int) { coda::attention_backward(dqkv, dout, qkv, out, lse, work, s, nullptr); }, 20, 3);
      const double fwd_flops = 4.0 * T * T * s.head_dim * s.n_head * s.B / 2;
      std::printf("%-30s %6d %4d %10.3f %10.1f %10.3f %10.1f\n", m.name, T, s.B, fwd_ms, fwd_flops / fwd_ms * 1e-9,
                  bwd_ms, 2.5 * fwd_flops / bwd_ms * 1e-9);
      CUDA_CHECK(cudaFree(qkv));
      CUDA_CHECK(cudaFree(dqkv));
      CUDA_CHECK(cudaFree(out));
      CUDA_CHECK(cudaFree(dout));
      CUDA_CHECK(cudaFree(lse));
      CUDA_CHECK(cudaFree(work));
    }
  }
  return 0;
}
