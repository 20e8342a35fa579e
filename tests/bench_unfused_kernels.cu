// Bandwidth of every memory-bound kernel of the unfused mode on the shapes of gpt2-124m (B=32, T=1024) and
// llama3.2-1b (B=8, T=2048), against a device-to-device copy measured in the same run.
//
// Bytes are the tensors each kernel must read and write, each counted once (a gathered embedding row
// once per token, a parameter vector once). Every launch is timed alone with CUDA events, after a 512 MB
// memset that evicts the L2 (so no run reads its inputs from the previous run's cache), 5 warm-up and
// 25 timed launches; the median is reported. Target: >= 80% of 4.2 TB/s (ANCHORS.md) for each kernel.
//
// Usage: bench_unfused_kernels [gpt2|llama|all]
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "model.hpp"
#include "rng.hpp"

namespace {

namespace uf = coda::unfused;
using uf::bf16;

constexpr double kAnchorBytesPerSecond = 4.2e12;

// Deterministic pseudo-random fill on the device: scale * (uniform in [-1, 1)) + offset.
__global__ void fill_kernel(bf16* out, size_t n, float scale, float offset, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    out[i] = __float2bfloat16(offset + scale * (static_cast<float>(h & 0xffffff) / 8388608.0f - 1.0f));
  }
}

__global__ void fill_kernel(float* out, size_t n, float scale, float offset, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    out[i] = offset + scale * (static_cast<float>(h & 0xffffff) / 8388608.0f - 1.0f);
  }
}

// Device allocations of one benchmark, freed together.
class Pool {
 public:
  ~Pool() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <typename T>
  T* alloc(size_t n) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    CUDA_CHECK(cudaMemset(p, 0, n * sizeof(T)));
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  T* random(size_t n, float scale = 1.0f, float offset = 0.0f) {
    T* p = alloc<T>(n);
    fill_kernel<<<1024, 256>>>(p, n, scale, offset, seed_++);
    CUDA_CHECK_LAUNCH();
    return p;
  }
  template <typename T>
  T* upload(const std::vector<T>& v) {
    T* p = alloc<T>(v.size());
    CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }

 private:
  std::vector<void*> blocks_;
  uint32_t seed_ = 1;
};

struct Timer {
  Timer() {
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    CUDA_CHECK(cudaMalloc(&flush, kFlushBytes));
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaFree(flush);
  }
  // Median milliseconds of one launch.
  double median_ms(const std::function<void()>& launch) {
    std::vector<double> ms;
    for (int i = 0; i < kWarmup + kTimed; ++i) {
      CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes));
      CUDA_CHECK(cudaEventRecord(start));
      launch();
      CUDA_CHECK(cudaEventRecord(stop));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float elapsed = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
      if (i >= kWarmup) ms.push_back(elapsed);
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    return ms[ms.size() / 2];
  }
  static constexpr size_t kFlushBytes = size_t{512} << 20;
  static constexpr int kWarmup = 5, kTimed = 25;
  cudaEvent_t start, stop;
  void* flush = nullptr;
};

struct Row {
  std::string model, kernel;
  double bytes, ms;
};

std::vector<Row> rows;

void report(Timer& timer, const std::string& model, const std::string& kernel, double bytes,
            const std::function<void()>& launch) {
  const double ms = timer.median_ms(launch);
  rows.push_back({model, kernel, bytes, ms});
  std::printf("%-6s %-34s %9.1f MB %9.1f us %8.0f GB/s %6.1f%%\n", model.c_str(), kernel.c_str(), bytes / 1e6,
              ms * 1e3, bytes / ms / 1e6, 100.0 * bytes / ms / 1e-3 / kAnchorBytesPerSecond);
  std::fflush(stdout);
}

void bench_model(Timer& timer, const std::string& name, const coda::ModelConfig& c, int B, int T) {
  Pool pool;
  const bool gpt2 = c.arch == coda::Arch::GPT2;
  const int N = B * T, C = c.d_model, F = c.d_ff, U = c.mlp_up_rows(), Q = c.qkv_dim(), V = c.vocab_size,
            Vp = c.padded_vocab(), hd = c.head_dim();
  const size_t NC = static_cast<size_t>(N) * C;
  coda::Rng rng(42);
  std::vector<int32_t> tokens(N), targets(N);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.below(V));
  for (auto& t : targets) t = static_cast<int32_t>(rng.below(V));
  int32_t* d_tokens = pool.upload(tokens);
  int32_t* d_targets = pool.upload(targets);
  const int max_cols = std::max({C, F, Q, U});
  uf::ColumnSumWorkspace ws{pool.alloc<float>(uf::column_sum_partials_floats(max_cols)),
                            pool.alloc<unsigned int>(uf::column_sum_tickets(max_cols))};
  float* norm_partials = pool.alloc<float>(uf::norm_backward_partials_floats(C));

  // Embedding.
  bf16* wte = pool.random<bf16>(static_cast<size_t>(Vp) * C, 0.02f);
  bf16* wpe = gpt2 ? pool.random<bf16>(static_cast<size_t>(T) * C, 0.02f) : nullptr;
  bf16* x = pool.alloc<bf16>(NC);
  const double pos_bytes = gpt2 ? static_cast<double>(T) * C * 2 : 0.0;
  report(timer, name, "embedding_forward", 4.0 * N + 2.0 * NC * 2 + pos_bytes,
         [&] { uf::embedding_forward(x, d_tokens, wte, wpe, B, T, C, 0); });
  const uf::TokenBuckets buckets = uf::group_rows_by_token(tokens.data(), N, V);
  int32_t* d_buckets = pool.upload(buckets.packed);
  float* dwte = pool.alloc<float>(static_cast<size_t>(Vp) * C);
  float* dwpe = gpt2 ? pool.alloc<float>(static_cast<size_t>(T) * C) : nullptr;
  bf16* dx = pool.random<bf16>(NC);
  report(timer, name, "embedding_backward (" + std::to_string(buckets.num_buckets) + " ids)",
         4.0 * buckets.packed.size() + NC * 2.0 + 8.0 * buckets.num_buckets * C + 4.0 * pos_bytes,
         [&] { uf::embedding_backward(dwte, dwpe, dx, d_buckets, buckets.num_buckets, B, T, C, 0); });

  // Norms.
  bf16* h = pool.random<bf16>(NC, 2.0f);
  bf16* y = pool.alloc<bf16>(NC);
  bf16* w = pool.random<bf16>(C, 0.2f, 1.0f);
  bf16* b = pool.random<bf16>(C, 0.2f);
  float* mean = pool.alloc<float>(N);
  float* rstd = pool.alloc<float>(N);
  float* dw = pool.alloc<float>(C);
  float* db = pool.alloc<float>(C);
  bf16* dy = pool.random<bf16>(NC);
  bf16* dres = pool.random<bf16>(NC);
  const std::string norm = gpt2 ? "layernorm" : "rmsnorm";
  report(timer, name, norm + "_forward", 2.0 * NC * 2 + (gpt2 ? 8.0 : 4.0) * N, [&] {
    if (gpt2)
      uf::layernorm_forward(y, mean, rstd, h, w, b, N, C, 1e-5f, 0);
    else
      uf::rmsnorm_forward(y, rstd, h, w, N, C, 1e-5f, 0);
  });
  report(timer, name, norm + "_backward (+= dres, dw, db)", 4.0 * NC * 2 + (gpt2 ? 8.0 : 4.0) * N, [&] {
    if (gpt2)
      uf::layernorm_backward(dres, dw, db, dy, h, w, mean, rstd, N, C, true, norm_partials, ws, 0);
    else
      uf::rmsnorm_backward(dres, dw, dy, h, w, rstd, N, C, true, norm_partials, ws, 0);
  });
  report(timer, name, "residual_add", 3.0 * NC * 2, [&] { uf::residual_add(y, h, dy, NC, 0); });

  // MLP activations and biases.
  const size_t NF = static_cast<size_t>(N) * F;
  bf16* up = pool.random<bf16>(static_cast<size_t>(N) * U, 2.0f);
  bf16* act = pool.alloc<bf16>(NF);
  bf16* d_act = pool.random<bf16>(NF);
  bf16* d_up = pool.alloc<bf16>(static_cast<size_t>(N) * U);
  if (gpt2) {
    bf16* bias = pool.random<bf16>(F);
    float* dbias = pool.alloc<float>(F);
    report(timer, name, "bias_add [N, 3072]", 2.0 * NF * 2, [&] { uf::bias_add(up, bias, N, F, 0); });
    report(timer, name, "bias_add [N, 768]", 2.0 * NC * 2, [&] { uf::bias_add(y, bias, N, C, 0); });
    report(timer, name, "bias_grad [N, 3072]", NF * 2.0, [&] { uf::column_sum(dbias, d_act, N, F, F, ws, 0); });
    report(timer, name, "bias_grad [N, 2304]", static_cast<double>(N) * Q * 2,
           [&] { uf::column_sum(dbias, d_act, N, Q, Q, ws, 0); });
    report(timer, name, "bias_grad [N, 768]", NC * 2.0, [&] { uf::column_sum(dbias, dy, N, C, C, ws, 0); });
    report(timer, name, "gelu_forward", 2.0 * NF * 2, [&] { uf::gelu_forward(act, up, NF, 0); });
    report(timer, name, "gelu_backward", 3.0 * NF * 2, [&] { uf::gelu_backward(d_up, d_act, up, NF, 0); });
  } else {
    report(timer, name, "swiglu_forward", 3.0 * NF * 2, [&] { uf::swiglu_forward(act, up, N, F, 0); });
    report(timer, name, "swiglu_backward", 5.0 * NF * 2, [&] { uf::swiglu_backward(d_up, d_act, up, N, F, 0); });
    const std::vector<float2> table = uf::rope_table(T, hd, c.rope_theta);
    float2* d_table = pool.upload(table);
    bf16* qkv = pool.random<bf16>(static_cast<size_t>(N) * Q);
    const double rotated = static_cast<double>(N) * (c.n_head + c.n_kv_head) * hd;
    report(timer, name, "rope (q and k, in place)", 2.0 * rotated * 2 + table.size() * 8.0,
           [&] { uf::rope(qkv, d_table, B, T, c.n_head, c.n_kv_head, hd, false, 0); });
  }

  // Cross-entropy.
  const size_t NV = static_cast<size_t>(N) * Vp;
  bf16* logits = pool.random<bf16>(NV, 4.0f);
  float* losses = pool.alloc<float>(N);
  float* lse = pool.alloc<float>(N);
  report(timer, name, "crossentropy_forward", NV * 2.0 + 12.0 * N,
         [&] { uf::crossentropy_forward(losses, lse, logits, d_targets, N, V, Vp, 0); });
  report(timer, name, "crossentropy_backward (in place)", 2.0 * NV * 2 + 8.0 * N,
         [&] { uf::crossentropy_backward(logits, logits, lse, d_targets, 1.0f / N, N, V, Vp, 0); });
}

void bench_optimizer(Timer& timer, const std::string& name, const coda::ModelConfig& c) {
  Pool pool;
  const size_t P = coda::make_param_layout(c).total;
  float* params = pool.random<float>(P, 0.05f);
  float* grads = pool.random<float>(P, 0.01f);
  float* m = pool.random<float>(P, 0.001f);
  float* v = pool.random<float>(P, 1e-5f, 1e-5f);
  bf16* params_bf16 = pool.alloc<bf16>(P);
  uint8_t* decay = pool.alloc<uint8_t>(P / 64);
  float* partials = pool.alloc<float>(uf::grad_sumsq_partials_floats());
  unsigned int* ticket = pool.alloc<unsigned int>(1);
  float* result = pool.alloc<float>(1);
  int step = 1;
  report(timer, name, "adamw (" + std::to_string(P / 1000000) + "M params)", 30.0 * P + P / 64.0, [&] {
    uf::adamw(params, params_bf16, m, v, grads, decay, P, {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, step++}, 0);
  });
  report(timer, name, "grad_sumsq", 4.0 * P, [&] { uf::grad_sumsq(result, grads, P, partials, ticket, 0); });
}

coda::ModelConfig gpt2_124m() {
  coda::ModelConfig c;
  c.arch = coda::Arch::GPT2, c.n_layer = 12, c.d_model = 768, c.n_head = 12, c.n_kv_head = 12, c.d_ff = 3072;
  c.vocab_size = 50257, c.max_seq_len = 1024;
  return c;
}

coda::ModelConfig llama_1b() {
  coda::ModelConfig c;
  c.arch = coda::Arch::Llama, c.n_layer = 16, c.d_model = 2048, c.n_head = 32, c.n_kv_head = 8, c.d_ff = 8192;
  c.vocab_size = 128256, c.max_seq_len = 2048, c.rope_theta = 500000.0f;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "all";
  if (which != "gpt2" && which != "llama" && which != "all") {
    std::fprintf(stderr, "usage: %s [gpt2|llama|all]\n", argv[0]);
    return 2;
  }
  try {
    if (!coda::cuda_device_available()) {
      std::fprintf(stderr, "no CUDA device\n");
      return 1;
    }
    Timer timer;
    {
      const size_t bytes = size_t{2} << 30;
      void *a = nullptr, *b = nullptr;
      CUDA_CHECK(cudaMalloc(&a, bytes));
      CUDA_CHECK(cudaMalloc(&b, bytes));
      CUDA_CHECK(cudaMemset(a, 1, bytes));
      report(timer, "device", "cudaMemcpy D2D 2 GiB (the ceiling)", 2.0 * bytes,
             [&] { CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
      cudaFree(a);
      cudaFree(b);
    }
    if (which != "llama") {
      bench_model(timer, "gpt2", gpt2_124m(), 32, 1024);
      bench_optimizer(timer, "gpt2", gpt2_124m());
    }
    if (which != "gpt2") {
      bench_model(timer, "llama", llama_1b(), 8, 2048);
      bench_optimizer(timer, "llama", llama_1b());
    }
    const double copy = rows.front().bytes / rows.front().ms;
    std::printf("\nsummary: %% of 4.2 TB/s (and of this run's copy); kernels under 80%% of 4.2 TB/s marked *\n");
    for (const Row& r : rows) {
      const double rate = r.bytes / r.ms;
      std::printf("  %s %-6s %-34s %6.1f%% (%5.1f%% of copy)\n", rate / 1e-3 < 0.8 * kAnchorBytesPerSecond ? "*" : " ",
                  r.model.c_str(), r.kernel.c_str(), 100.0 * rate / 1e-3 / kAnchorBytesPerSecond, 100.0 * rate / copy);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
