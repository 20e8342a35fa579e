// GPU attention (kernels/attention) against an fp64 CPU evaluation of the same math on the same
// bf16-rounded random inputs: forward out and lse, backward dq, dk, dv. Shapes cover head dims 64 and 128,
// GQA ratios 1, 2 and 4, B > 1, T not a multiple of any block size, and T = 1.
//
// Every output buffer is filled with NaN before the kernel runs, so an element the kernel fails to write
// poisons the error norms. Errors are relative Frobenius norms ||gpu - ref|| / ||ref|| (lse: max absolute
// error); bf16 outputs and bf16 P / dS operands put them around 2e-3 (measured on H200: 1.8e-3 out,
// 2.3e-3..3.3e-3 gradients).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/attention/attention.cuh"
#include "kernels/cuda_check.cuh"

namespace {

using coda::AttentionShape;

// fp64 causal GQA attention, forward and backward, in the packed layouts of attention.cuh.
struct Reference {
  std::vector<double> out, lse, dqkv;
};

Reference reference_attention(const std::vector<float>& qkv, const std::vector<float>& dout, const AttentionShape& s) {
  const int hd = s.head_dim, C = s.n_head * hd, QKV = s.qkv_dim(), group = s.n_head / s.n_kv_head;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  Reference r;
  r.out.assign(static_cast<size_t>(s.B) * s.T * C, 0.0);
  r.lse.assign(static_cast<size_t>(s.B) * s.n_head * s.T, 0.0);
  r.dqkv.assign(static_cast<size_t>(s.B) * s.T * QKV, 0.0);
  std::vector<double> p(s.T), dp(s.T);
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.n_head; ++h) {
      const int kvh = h / group;
      auto q = [&](int t, int d) { return static_cast<double>(qkv[(static_cast<size_t>(b) * s.T + t) * QKV + h * hd + d]); };
      auto k = [&](int t, int d) {
        return static_cast<double>(qkv[(static_cast<size_t>(b) * s.T + t) * QKV + (s.n_head + kvh) * hd + d]);
      };
      auto v = [&](int t, int d) {
        return static_cast<double>(qkv[(static_cast<size_t>(b) * s.T + t) * QKV + (s.n_head + s.n_kv_head + kvh) * hd + d]);
      };
      for (int t = 0; t < s.T; ++t) {
        double mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += q(t, d) * k(u, d);
          p[u] = dot * scale;
          mx = std::max(mx, p[u]);
        }
        double sum = 0;
        for (int u = 0; u <= t; ++u) sum += (p[u] = std::exp(p[u] - mx));
        for (int u = 0; u <= t; ++u) p[u] /= sum;
        r.lse[(static_cast<size_t>(b) * s.n_head + h) * s.T + t] = mx + std::log(sum);
        const size_t orow = (static_cast<size_t>(b) * s.T + t) * C + h * hd;
        for (int d = 0; d < hd; ++d) {
          double acc = 0;
          for (int u = 0; u <= t; ++u) acc += p[u] * v(u, d);
          r.out[orow + d] = acc;
        }
        // backward of row t: dp = dO V^T, ds = p (dp - <dO, O>), dq = scale ds K, dk += scale ds q, dv += p dO
        double dsum = 0;
        for (int d = 0; d < hd; ++d) dsum += dout[orow + d] * r.out[orow + d];
        for (int u = 0; u <= t; ++u) {
          double acc = 0;
          for (int d = 0; d < hd; ++d) acc += dout[orow + d] * v(u, d);
          dp[u] = p[u] * (acc - dsum);
        }
        double* dq = &r.dqkv[(static_cast<size_t>(b) * s.T + t) * QKV + h * hd];
        for (int u = 0; u <= t; ++u) {
          double* dk = &r.dqkv[(static_cast<size_t>(b) * s.T + u) * QKV + (s.n_head + kvh) * hd];
          double* dv = &r.dqkv[(static_cast<size_t>(b) * s.T + u) * QKV + (s.n_head + s.n_kv_head + kvh) * hd];
          for (int d = 0; d < hd; ++d) {
            dq[d] += scale * dp[u] * k(u, d);
            dk[d] += scale * dp[u] * q(t, d);
            dv[d] += p[u] * dout[orow + d];
          }
        }
      }
    }
  return r;
}

// Random N(0, sigma) values rounded to bf16, as floats (the exact values the GPU sees).
std::vector<float> random_bf16(size_t n, float sigma, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = __bfloat162float(__float2bfloat16(dist(rng)));
  return v;
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, host.size() * sizeof(T)));
  CUDA_CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

std::vector<float> from_device_bf16(const __nv_bfloat16* d, size_t n) {
  std::vector<__nv_bfloat16> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = __bfloat162float(h[i]);
  return out;
}

// ||gpu - ref|| / ||ref|| over the columns [col0, col0 + ncols) of rows of width `width`. Where the exact
// result is zero (T = 1: the softmax of one score has zero gradient, so dq = dk = 0), the RMS of gpu.
double rel_error(const std::vector<float>& gpu, const std::vector<double>& ref, int width, int col0, int ncols) {
  double diff = 0, norm = 0;
  size_t count = 0;
  for (size_t row = 0; row < ref.size() / width; ++row)
    for (int c = col0; c < col0 + ncols; ++c, ++count) {
      const double g = gpu[row * width + c], r = ref[row * width + c];
      diff += (g - r) * (g - r);
      norm += r * r;
    }
  return std::sqrt(diff / (norm > 0 ? norm : static_cast<double>(count)));
}

struct Case {
  int B, T, n_head, n_kv_head, head_dim;
};

class GpuAttention : public ::testing::TestWithParam<Case> {};

TEST_P(GpuAttention, MatchesFp64Reference) {
  if (!coda::cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const Case c = GetParam();
  AttentionShape s;
  s.B = c.B, s.T = c.T, s.n_head = c.n_head, s.n_kv_head = c.n_kv_head, s.head_dim = c.head_dim;
  const size_t rows = static_cast<size_t>(s.B) * s.T, out_dim = static_cast<size_t>(s.n_head) * s.head_dim;

  std::mt19937 rng(1234 + c.T * 7 + c.head_dim + c.n_kv_head);
  // q, k with sigma 1.5 give scores of std ~2.25 after the 1/sqrt(hd) scale: peaked, not one-hot softmax.
  std::vector<float> qkv = random_bf16(rows * s.qkv_dim(), 1.5f, rng);
  const std::vector<float> dout = random_bf16(rows * out_dim, 1.0f, rng);
  const Reference ref = reference_attention(qkv, dout, s);

  __nv_bfloat16* d_qkv = device_copy(to_bf16(qkv));
  __nv_bfloat16* d_dout = device_copy(to_bf16(dout));
  __nv_bfloat16 *d_out = nullptr, *d_dqkv = nullptr;
  float* d_lse = nullptr;
  void* d_work = nullptr;
  const size_t work_bytes = coda::attention_backward_workspace_bytes(s);
  CUDA_CHECK(cudaMalloc(&d_out, rows * out_dim * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMalloc(&d_dqkv, rows * s.qkv_dim() * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMalloc(&d_lse, static_cast<size_t>(s.B) * s.n_head * s.T * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&d_work, work_bytes));
  // 0xFF bytes are NaN in both bf16 and fp32: unwritten outputs (and unwritten workspace) show up.
  CUDA_CHECK(cudaMemset(d_out, 0xFF, rows * out_dim * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMemset(d_dqkv, 0xFF, rows * s.qkv_dim() * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMemset(d_lse, 0xFF, static_cast<size_t>(s.B) * s.n_head * s.T * sizeof(float)));
  CUDA_CHECK(cudaMemset(d_work, 0xFF, work_bytes));

  coda::attention_forward(d_out, d_lse, d_qkv, s, nullptr);
  coda::attention_backward(d_dqkv, d_dout, d_qkv, d_out, d_lse, d_work, s, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<float> out = from_device_bf16(d_out, rows * out_dim);
  const std::vector<float> dqkv = from_device_bf16(d_dqkv, rows * s.qkv_dim());
  std::vector<float> lse(ref.lse.size());
  CUDA_CHECK(cudaMemcpy(lse.data(), d_lse, lse.size() * sizeof(float), cudaMemcpyDeviceToHost));

  double lse_err = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    const double e = std::fabs(lse[i] - ref.lse[i]);
    lse_err = std::isnan(e) ? INFINITY : std::max(lse_err, e);
  }
  const int hd = s.head_dim, QKV = s.qkv_dim();
  const double out_err = rel_error(out, ref.out, static_cast<int>(out_dim), 0, static_cast<int>(out_dim));
  const double dq_err = rel_error(dqkv, ref.dqkv, QKV, 0, s.n_head * hd);
  const double dk_err = rel_error(dqkv, ref.dqkv, QKV, s.n_head * hd, s.n_kv_head * hd);
  const double dv_err = rel_error(dqkv, ref.dqkv, QKV, (s.n_head + s.n_kv_head) * hd, s.n_kv_head * hd);
  std::printf("attention B=%d T=%d heads=%d/%d hd=%d: out %.2e lse(abs) %.2e dq %.2e dk %.2e dv %.2e\n", s.B, s.T,
              s.n_head, s.n_kv_head, hd, out_err, lse_err, dq_err, dk_err, dv_err);
  EXPECT_LT(out_err, 1e-2);
  EXPECT_LT(lse_err, 1e-3);
  EXPECT_LT(dq_err, 1e-2);
  EXPECT_LT(dk_err, 1e-2);
  EXPECT_LT(dv_err, 1e-2);

  CUDA_CHECK(cudaFree(d_qkv));
  CUDA_CHECK(cudaFree(d_dout));
  CUDA_CHECK(cudaFree(d_out));
  CUDA_CHECK(cudaFree(d_dqkv));
  CUDA_CHECK(cudaFree(d_lse));
  CUDA_CHECK(cudaFree(d_work));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttention,
                         ::testing::Values(Case{2, 97, 4, 4, 64}, Case{2, 200, 4, 2, 64}, Case{1, 257, 8, 2, 64},
                                           Case{3, 64, 4, 1, 64}, Case{1, 1, 2, 1, 64}, Case{2, 130, 4, 1, 128},
                                           Case{1, 300, 4, 2, 128}, Case{2, 128, 2, 2, 128},
                                           Case{1, 1000, 2, 1, 128}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" +
                                  std::to_string(c.n_head) + "_KV" + std::to_string(c.n_kv_head) + "_hd" +
                                  std::to_string(c.head_dim);
                         });

TEST(GpuAttention, RejectsBadShapes) {
  AttentionShape s;
  s.B = 1, s.T = 16, s.n_head = 4, s.n_kv_head = 3, s.head_dim = 64;
  EXPECT_THROW(coda::attention_backward_workspace_bytes(s), std::invalid_argument);
  s.n_kv_head = 2, s.head_dim = 96;
  EXPECT_THROW(coda::attention_backward_workspace_bytes(s), std::invalid_argument);
}

}  // namespace
