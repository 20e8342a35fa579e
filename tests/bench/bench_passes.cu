// Bandwidth of the CODA passes outside the GEMMs (kernels/coda/passes.cuh) on gpt2-124m's shapes (B=32, T=1024:
// N = 32768, C = 768, Vp = 50304), against competitors in the same run: a device-to-device copy of the
// same bytes and, for dlogits, the unfused mode's cross-entropy backward (the same [N, Vp] read and write
// without the row dots).
// Bytes are the tensors a kernel must read and write, each once. Timing: CUDA events around one launch after a 512 MB memset that evicts the L2, median of
// 15 runs after 3 warm-ups. Target: dlogits within ~10% of the copy (about 4 TB/s on an H200).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "kernels/coda/passes.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "tests/bench/bench_util.cuh"

namespace {

using coda::passes::bf16;

__global__ void fill_kernel(bf16* out, size_t n, float scale, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    out[i] = __float2bfloat16(scale * (static_cast<float>(h & 0xffffff) / 8388608.0f - 1.0f));
  }
}

// Device allocations of the benchmark: bf16 filled with values in [-scale, scale), fp32 with `value`.
class Pool {
 public:
  ~Pool() {
    for (void* p : blocks_) cudaFree(p);
  }
  bf16* bf16s(size_t n, float scale) {
    bf16* p = static_cast<bf16*>(alloc(n * sizeof(bf16)));
    fill_kernel<<<1024, 256>>>(p, n, scale, static_cast<uint32_t>(blocks_.size()));
    CUDA_CHECK_LAUNCH();
    return p;
  }
  float* floats(size_t n, float value) {
    std::vector<float> host(n, value);
    float* p = static_cast<float*>(alloc(n * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    return p;
  }
  template <typename T>
  T* zeros(size_t n) {
    T* p = static_cast<T*>(alloc(n * sizeof(T)));
    CUDA_CHECK(cudaMemset(p, 0, n * sizeof(T)));
    return p;
  }

 private:
  void* alloc(size_t bytes) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    blocks_.push_back(p);
    return p;
  }
  std::vector<void*> blocks_;
};

}  // namespace

int main() {
  const int N = 32768, C = 768, vocab = 50257, Vp = 50304, F = 4 * C;
  const size_t NV = static_cast<size_t>(N) * Vp;
  Pool pool;
  const coda::bench::L2Flush flush;
  auto report = [&](const char* name, double bytes, const std::function<void()>& launch) {
    const double ms = coda::bench::median_ms_each([&](int) { launch(); }, 15, 3, std::cref(flush));
    std::printf("%-44s %9.1f us %8.0f GB/s\n", name, ms * 1e3, bytes / (ms * 1e-3) / 1e9);
  };

  bf16* logits = pool.bf16s(NV, 4.0f);
  bf16* copy = pool.zeros<bf16>(NV);
  const std::vector<int32_t> host_targets(N, 1234);
  int32_t* targets = pool.zeros<int32_t>(N);
  CUDA_CHECK(cudaMemcpy(targets, host_targets.data(), N * sizeof(int32_t), cudaMemcpyHostToDevice));
  float* lse = pool.floats(N, 12.0f);
  const int count = 6;
  float* sum = pool.floats(static_cast<size_t>(N) * count, 1.0f);
  float* sumsq = pool.floats(static_cast<size_t>(N) * count, C / count);
  float* c = pool.floats(Vp, 0.5f);
  float* b_prime = pool.floats(Vp, 0.1f);
  float* dots = pool.zeros<float>(3 * static_cast<size_t>(N));

  coda::passes::DlogitsArgs args;
  args.dlogits = logits, args.logits = logits, args.lse = lse, args.targets = targets, args.dloss = 1.0f / N;
  args.N = N, args.vocab = vocab, args.Vp = Vp;
  args.stats.sumsq = sumsq, args.stats.count = count, args.stats.d = C, args.stats.eps = 1e-5f;
  args.dot_z = dots;
  const double logit_bytes = 2.0 * NV * 2;
  report("copy of the logits (D2D)", logit_bytes, [&] {
    CUDA_CHECK(cudaMemcpyAsync(copy, logits, NV * sizeof(bf16), cudaMemcpyDeviceToDevice));
  });
  report("unfused crossentropy_backward (in place)", logit_bytes + 8.0 * N, [&] {
    coda::unfused::crossentropy_backward(logits, logits, lse, targets, 1.0f / N, N, vocab, Vp, 0);
  });
  report("dlogits RMSNorm (in place)", logit_bytes + 12.0 * N, [&] { coda::passes::dlogits(args, 0); });
  coda::passes::DlogitsArgs ln = args;
  ln.stats.sum = sum, ln.c = c, ln.b_prime = b_prime, ln.dot_c = dots + N, ln.dot_b = dots + 2 * N;
  report("dlogits LayerNorm (in place)", logit_bytes + 20.0 * N,
         [&] { coda::passes::dlogits(ln, 0); });

  bf16* h = pool.zeros<bf16>(static_cast<size_t>(N) * C);
  bf16* O = pool.zeros<bf16>(static_cast<size_t>(N) * C);
  bf16* wte = pool.bf16s(static_cast<size_t>(Vp) * C, 0.1f);
  bf16* wpe = pool.bf16s(1024 * static_cast<size_t>(C), 0.1f);
  bf16* gamma = pool.bf16s(F, 1.0f);
  report("embedding_forward (h, O, sum, sumsq)", 3.0 * N * C * 2 + 12.0 * N, [&] {
    coda::passes::embedding_forward(h, O, sum, sumsq, targets, wte, wpe, gamma, 32, 1024, C, 0);
  });
  report("ln_weight_vectors (head, Vp x C)", 2.0 * Vp * C + 8.0 * Vp,
         [&] { coda::passes::ln_weight_vectors(c, b_prime, wte, Vp, C, gamma, gamma, nullptr, 0); });

  const int gemm_groups = N / 16;
  float* partials = pool.floats(static_cast<size_t>(gemm_groups) * C, 0.01f);
  float* grad = pool.zeros<float>(C);
  report("add_column_partials [2048, 768]", 4.0 * gemm_groups * C,
         [&] { coda::passes::add_column_partials({{grad, partials}}, gemm_groups, C, C, 1.0f, 0); });
  CUDA_CHECK(cudaDeviceSynchronize());
  return 0;
}
