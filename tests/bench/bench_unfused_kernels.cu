// Bandwidth of every memory-bound kernel of the unfused mode on the shapes of gpt2-124m (B=32, T=1024) and
// llama3.2-1b (B=8, T=2048), against a device-to-device copy measured in the same run. Bytes are the tensors
// each kernel must read and write, each counted once (a gathered embedding row once per token, a parameter
// vector once). The headline timing is back-to-back with PDL, as a training step runs the kernels; a run of 12
// and an isolated launch are printed beside it (how each is measured: above measure() below).
// Target: back-to-back >= 80% of 4.2 TB/s (the copy bandwidth in docs/PERFORMANCE.md) for each kernel.
// Usage: bench_unfused_kernels [gpt2|llama|all] [FILTER]   (FILTER: only kernels whose name contains it)

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/common/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"
#include "model.hpp"
#include "rng.hpp"
#include "tests/bench/bench_util.cuh"

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

// Copies of an input, enough that rotating over them defeats the L2 (at least 200 MB in all, at most 4).
int input_sets(double input_bytes) { return std::max(1, std::min(4, static_cast<int>(std::ceil(200e6 / input_bytes)))); }

// Timings per kernel, all medians after warm-up:
//  * back-to-back: the cost of one more launch in a run of launches, (time of 24 launches in a row - time of
//    12) / 12, each run between two events after an L2 flush; the launches rotate over enough copies of the
//    inputs (>= 200 MB in all) that no launch finds its inputs in the 50 MB L2. The kernels are launched with
//    programmatic dependent launch (kernels/common/launch.cuh), so each launch's scheduling overlaps the previous
//    launch's tail, as it does in a step wherever an unfused kernel follows another (after a cuBLASLt GEMM or
//    an attention kernel, launched without PDL, only the launch itself overlaps). The difference leaves out
//    what only the first launch of a run pays: its launch latency and the write-back of the dirty lines the
//    flush's memset left in L2;
//  * run of 12: the time of the 12 launches divided by 12 (it charges every kernel the first launch's latency);
//  * isolated: one launch between two events after a 512 MB memset that evicts the L2; this adds the
//    launch latency (a few microseconds), which dominates the smallest kernels.
struct Timing {
  double isolated_ms, run_ms, ms;  // isolated, a run of 12 divided by 12, back-to-back (one more launch)
};

// Median milliseconds of one launch: isolated (after an L2 flush), over a run of 12, and back-to-back.
Timing measure(const std::function<void(int)>& launch, int sets) {
  static const coda::bench::L2Flush flush;
  constexpr int kRun = 12;
  const auto run_ms = [&](int launches) {
    return coda::bench::median_ms_each(
        [&](int) {
          for (int r = 0; r < launches; ++r) launch(r % sets);
        },
        7, 2, std::cref(flush));
  };
  const double isolated = coda::bench::median_ms_each([&](int i) { launch(i % sets); }, 15, 3, std::cref(flush));
  const double run = run_ms(kRun), double_run = run_ms(2 * kRun);
  return {isolated, run / kRun, (double_run - run) / kRun};
}

struct Row {
  std::string model, kernel;
  double bytes;
  Timing t;
};

std::vector<Row> rows;
std::string kernel_filter;  // only kernels whose name contains it (empty: all)

double percent(double bytes, double ms) { return 100.0 * bytes / (ms * 1e-3) / kAnchorBytesPerSecond; }

void report(const std::string& model, const std::string& kernel, double bytes, int sets,
            const std::function<void(int)>& launch) {
  if (model != "device" && kernel.find(kernel_filter) == std::string::npos) return;
  const Timing t = measure(launch, sets);
  rows.push_back({model, kernel, bytes, t});
  std::printf("%-6s %-36s %9.1f MB %9.1f us %8.0f GB/s %6.1f%%   run of 12 %9.1f us %6.1f%%   isolated %9.1f us "
              "%6.1f%%\n",
              model.c_str(), kernel.c_str(), bytes / 1e6, t.ms * 1e3, bytes / t.ms / 1e6, percent(bytes, t.ms),
              t.run_ms * 1e3, percent(bytes, t.run_ms), t.isolated_ms * 1e3, percent(bytes, t.isolated_ms));
  std::fflush(stdout);
}

void bench_model(const std::string& name, const coda::ModelConfig& c, int B, int T) {
  Pool pool;
  const bool learned_positions = !c.rope(), layer_norm = c.norm == coda::Norm::Layer;
  const int N = B * T, C = c.d_model, F = c.d_ff, U = c.mlp_up_rows(), Q = c.qkv_dim(), V = c.vocab_size,
            Vp = c.padded_vocab(), hd = c.head_dim();
  const size_t NC = static_cast<size_t>(N) * C, NF = static_cast<size_t>(N) * F, NV = static_cast<size_t>(N) * Vp;
  const auto random_sets = [&](int sets, size_t n, float scale = 1.0f, float offset = 0.0f) {
    std::vector<bf16*> copies;
    for (int i = 0; i < sets; ++i) copies.push_back(pool.random<bf16>(n, scale, offset));
    return copies;
  };
  const int max_cols = std::max({C, F, Q, U});
  uf::ColumnSumWorkspace ws{pool.alloc<float>(uf::column_sum_partials_floats(max_cols)),
                            pool.alloc<unsigned int>(uf::column_sum_tickets(max_cols)), max_cols};
  float* norm_partials = pool.alloc<float>(uf::norm_backward_partials_floats(C));

  // Embedding: 4 batches of random tokens (different rows of the table each launch).
  const int token_sets = 4;
  coda::Rng rng(42);
  std::vector<int32_t*> d_tokens;
  std::vector<int32_t*> d_buckets;
  std::vector<int> num_buckets;
  std::vector<int32_t> tokens(N), targets(N);
  for (int i = 0; i < token_sets; ++i) {
    for (auto& t : tokens) t = static_cast<int32_t>(rng.below(V));
    d_tokens.push_back(pool.upload(tokens));
    const uf::TokenBuckets buckets = uf::group_rows_by_token(tokens.data(), N, V);
    d_buckets.push_back(pool.upload(buckets.packed));
    num_buckets.push_back(buckets.num_buckets);
  }
  for (auto& t : targets) t = static_cast<int32_t>(rng.below(V));
  int32_t* d_targets = pool.upload(targets);
  bf16* wte = pool.random<bf16>(static_cast<size_t>(Vp) * C, 0.02f);
  bf16* wpe = learned_positions ? pool.random<bf16>(static_cast<size_t>(T) * C, 0.02f) : nullptr;
  bf16* x = pool.alloc<bf16>(NC);
  const double pos_bytes = learned_positions ? static_cast<double>(T) * C * 2 : 0.0;
  report(name, "embedding_forward", 4.0 * N + 2.0 * NC * 2 + pos_bytes, token_sets,
         [&](int s) { uf::embedding_forward(x, d_tokens[s], wte, wpe, B, T, C, 0); });
  float* dwte = pool.alloc<float>(static_cast<size_t>(Vp) * C);
  float* dwpe = learned_positions ? pool.alloc<float>(static_cast<size_t>(T) * C) : nullptr;
  const auto dx = random_sets(token_sets, NC);
  report(name, "embedding_backward (" + std::to_string(num_buckets[0]) + " ids)",
         4.0 * (3 * N + 1) + NC * 2.0 + 8.0 * num_buckets[0] * C + 4.0 * pos_bytes, token_sets, [&](int s) {
           uf::embedding_backward(dwte, dwpe, dx[s], d_buckets[s], num_buckets[s], B, T, C, 0);
         });

  // Norms and the residual add.
  const auto h = random_sets(input_sets(NC * 2.0), NC, 2.0f);
  const auto dy = random_sets(input_sets(2.0 * NC * 2), NC);
  bf16* y = pool.alloc<bf16>(NC);
  bf16* w = pool.random<bf16>(C, 0.2f, 1.0f);
  bf16* b = pool.random<bf16>(C, 0.2f);
  float* mean = pool.alloc<float>(N);
  float* rstd = pool.alloc<float>(N);
  float* dw = pool.alloc<float>(C);
  float* db = pool.alloc<float>(C);
  bf16* dres = pool.random<bf16>(NC);
  const std::string norm = layer_norm ? "layernorm" : "rmsnorm";
  report(name, norm + "_forward", 2.0 * NC * 2 + (layer_norm ? 8.0 : 4.0) * N, static_cast<int>(h.size()),
         [&](int s) {
           if (layer_norm)
             uf::layernorm_forward(y, mean, rstd, h[s], w, b, N, C, 1e-5f, 0);
           else
             uf::rmsnorm_forward(y, rstd, h[s], w, N, C, 1e-5f, 0);
         });
  const int pair_sets = static_cast<int>(std::min(h.size(), dy.size()));
  report(name, norm + "_backward (+= dres, dw, db)", 4.0 * NC * 2 + (layer_norm ? 8.0 : 4.0) * N, pair_sets,
         [&](int s) {
           if (layer_norm)
             uf::layernorm_backward(dres, dw, db, dy[s], h[s], w, mean, rstd, N, C, true, norm_partials, ws, 0);
           else
             uf::rmsnorm_backward(dres, dw, dy[s], h[s], w, rstd, N, C, true, norm_partials, ws, 0);
         });
  report(name, "residual_add", 3.0 * NC * 2, pair_sets, [&](int s) { uf::residual_add(y, h[s], dy[s], NC, 0); });
  // FP8 quantization of an activation with its amax, flat and transposed (the K-major copy).
  uint8_t* q8 = pool.alloc<uint8_t>(NC);
  uint8_t* q8t = pool.alloc<uint8_t>(NC);
  float* amax = pool.alloc<float>(1);
  float* scale = pool.upload(std::vector<float>{1.0f});
  report(name, "quantize_fp8 e4m3 (+ amax)", 3.0 * NC, static_cast<int>(h.size()),
         [&](int s) { uf::quantize_fp8(q8, amax, h[s], NC, scale, coda::Fp8Format::E4M3, 0); });
  report(name, "quantize_fp8 e4m3 transposed", 3.0 * NC, static_cast<int>(h.size()),
         [&](int s) { uf::quantize_fp8_transposed(q8t, nullptr, amax, h[s], N, C, scale, coda::Fp8Format::E4M3, 0); });
  report(name, "quantize_fp8 e4m3 both copies", 4.0 * NC, static_cast<int>(h.size()),
         [&](int s) { uf::quantize_fp8_transposed(q8t, q8, amax, h[s], N, C, scale, coda::Fp8Format::E4M3, 0); });
  // Block scaling's copies of the same activation: a factor per 1 x 128 row block and per 128 x 1 column block.
  float* row_factors = pool.alloc<float>(NC / 128);
  float* column_factors = pool.alloc<float>(NC / 128);
  unsigned int* bad = pool.alloc<unsigned int>(1);
  report(name, "quantize_fp8_blocks both copies", 4.0 * NC + 8.0 * NC / 128, static_cast<int>(h.size()),
         [&](int s) { uf::quantize_fp8_blocks({q8, row_factors, q8t, column_factors, bad, 1}, h[s], N, C, false, 0); });

  // MLP activations and biases.
  const auto up = random_sets(input_sets(static_cast<double>(N) * U * 2), static_cast<size_t>(N) * U, 2.0f);
  const auto d_act = random_sets(input_sets(2.0 * NF * 2), NF);
  const int mlp_sets = static_cast<int>(std::min(up.size(), d_act.size()));
  bf16* act = pool.alloc<bf16>(NF);
  bf16* d_up = pool.alloc<bf16>(static_cast<size_t>(N) * U);
  if (c.mlp_bias) {
    bf16* bias = pool.random<bf16>(F);
    float* dbias = pool.alloc<float>(F);
    const auto small = random_sets(input_sets(NC * 2.0), NC);
    report(name, "bias_add [N, 3072]", 2.0 * NF * 2, static_cast<int>(up.size()),
           [&](int s) { uf::bias_add(up[s], bias, N, F, 0); });
    report(name, "bias_add [N, 768]", 2.0 * NC * 2, static_cast<int>(small.size()),
           [&](int s) { uf::bias_add(small[s], bias, N, C, 0); });
    report(name, "bias_grad [N, 3072]", NF * 2.0, static_cast<int>(d_act.size()),
           [&](int s) { uf::column_sum(dbias, d_act[s], N, F, F, ws, 0); });
    report(name, "bias_grad [N, 2304]", static_cast<double>(N) * Q * 2, static_cast<int>(d_act.size()),
           [&](int s) { uf::column_sum(dbias, d_act[s], N, Q, Q, ws, 0); });
    report(name, "bias_grad [N, 768]", NC * 2.0, static_cast<int>(small.size()),
           [&](int s) { uf::column_sum(dbias, small[s], N, C, C, ws, 0); });
  }
  if (c.mlp == coda::Mlp::Gelu) {
    report(name, "gelu_forward", 2.0 * NF * 2, static_cast<int>(up.size()),
           [&](int s) { uf::gelu_forward(act, up[s], NF, 0); });
    report(name, "gelu_backward", 3.0 * NF * 2, mlp_sets,
           [&](int s) { uf::gelu_backward(d_up, d_act[s], up[s], NF, 0); });
  } else {
    report(name, "swiglu_forward", 3.0 * NF * 2, static_cast<int>(up.size()),
           [&](int s) { uf::swiglu_forward(act, up[s], N, F, 0); });
    report(name, "swiglu_backward", 5.0 * NF * 2, mlp_sets,
           [&](int s) { uf::swiglu_backward(d_up, d_act[s], up[s], N, F, 0); });
  }
  if (c.rope()) {
    const std::vector<float2> table = uf::rope_table(T, hd, c.rope_theta);
    float2* d_table = pool.upload(table);
    const double rotated = static_cast<double>(N) * (c.n_head + c.n_kv_head) * hd;
    const auto qkv = random_sets(input_sets(2.0 * rotated), static_cast<size_t>(N) * Q);
    report(name, "rope (q and k, in place)", 2.0 * rotated * 2 + table.size() * 8.0,
           static_cast<int>(qkv.size()),
           [&](int s) { uf::rope(qkv[s], d_table, B, T, c.n_head, c.n_kv_head, hd, false, 0); });
  }

  // Cross-entropy (the logits are far larger than the L2: one copy).
  bf16* logits = pool.random<bf16>(NV, 4.0f);
  float* losses = pool.alloc<float>(N);
  float* lse = pool.alloc<float>(N);
  report(name, "crossentropy_forward", NV * 2.0 + 12.0 * N, 1,
         [&](int) { uf::crossentropy_forward(losses, lse, logits, d_targets, N, V, Vp, 0); });
  report(name, "crossentropy_backward (in place)", 2.0 * NV * 2 + 8.0 * N, 1,
         [&](int) { uf::crossentropy_backward(logits, logits, lse, d_targets, 1.0f / N, N, V, Vp, 0); });
}

void bench_optimizer(const std::string& name, const coda::ModelConfig& c) {
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
  report(name, "adamw (" + std::to_string(P / 1000000) + "M params)", 30.0 * P + P / 64.0, 1, [&](int) {
    uf::adamw(params, params_bf16, m, v, grads, decay, P, {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, step++}, 0);
  });
  report(name, "grad_sumsq", 4.0 * P, 1, [&](int) { uf::grad_sumsq(result, grads, P, partials, ticket, 0); });
}

coda::ModelConfig gpt2_124m() {
  coda::ModelConfig c;
  c.set_arch(coda::Arch::GPT2);
  c.n_layer = 12, c.d_model = 768, c.n_head = 12, c.n_kv_head = 12, c.d_ff = 3072;
  c.vocab_size = 50257, c.max_seq_len = 1024;
  return c;
}

coda::ModelConfig llama_1b() {
  coda::ModelConfig c;
  c.set_arch(coda::Arch::Llama);
  c.n_layer = 16, c.d_model = 2048, c.n_head = 32, c.n_kv_head = 8, c.d_ff = 8192;
  c.vocab_size = 128256, c.max_seq_len = 2048, c.rope_theta = 500000.0f;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "all";
  if (argc > 2) kernel_filter = argv[2];
  if (which != "gpt2" && which != "llama" && which != "all") {
    std::fprintf(stderr, "usage: %s [gpt2|llama|all] [FILTER]\n", argv[0]);
    return 2;
  }
  try {
    if (!coda::cuda_device_available()) {
      std::fprintf(stderr, "no CUDA device\n");
      return 1;
    }
        {
      const size_t bytes = size_t{2} << 30;
      void *a = nullptr, *b = nullptr;
      CUDA_CHECK(cudaMalloc(&a, bytes));
      CUDA_CHECK(cudaMalloc(&b, bytes));
      CUDA_CHECK(cudaMemset(a, 1, bytes));
      report("device", "cudaMemcpy D2D 2 GiB (the ceiling)", 2.0 * bytes, 1,
             [&](int) { CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
      cudaFree(a);
      cudaFree(b);
    }
    if (which != "llama") {
      bench_model("gpt2", gpt2_124m(), 32, 1024);
      bench_optimizer("gpt2", gpt2_124m());
    }
    if (which != "gpt2") {
      bench_model("llama", llama_1b(), 8, 2048);
      bench_optimizer("llama", llama_1b());
    }
    const double copy = rows.front().bytes / rows.front().t.ms;
    std::printf("\nsummary: back-to-back %% of 4.2 TB/s (of this run's copy; run of 12; isolated launch); under 80%% "
                "marked *\n");
    for (const Row& r : rows) {
      const double pct = percent(r.bytes, r.t.ms);
      std::printf("  %s %-6s %-36s %6.1f%% (%5.1f%% of copy; run of 12 %5.1f%%; isolated %5.1f%%)\n",
                  pct < 80.0 ? "*" : " ", r.model.c_str(), r.kernel.c_str(), pct, 100.0 * r.bytes / r.t.ms / copy,
                  percent(r.bytes, r.t.run_ms), percent(r.bytes, r.t.isolated_ms));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
