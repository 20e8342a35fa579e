// The fp32 CPU reference of every operation (contract and conventions in ref_ops.hpp).
//
// Written to be read: one plain loop nest per operation, llm.c style. The heavy loops carry
// `#pragma omp parallel for` over an index whose outputs no other iteration touches, so results are
// bit-identical with any number of threads (and without OpenMP); loops too small to gain run serially.
// Long sums whose precision sets the accuracy of the reference (norm statistics, softmax normalisers)
// accumulate in double.
#include "ref_ops.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace coda::ref {

// Threads pay off only above some work per loop (in multiply-adds or elements); tiny shapes run serially.
[[maybe_unused]] static bool worth_threads(size_t work) { return work >= (size_t{1} << 16); }

void embedding_forward(float* x, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(B) * T * C))
  for (int n = 0; n < B * T; ++n) {
    const float* token_row = wte + static_cast<size_t>(tokens[n]) * C;
    const float* position_row = wpe ? wpe + static_cast<size_t>(n % T) * C : nullptr;
    float* out = x + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; ++c) out[c] = token_row[c] + (position_row ? position_row[c] : 0.0f);
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dx, const int32_t* tokens, int B, int T, int C) {
  // Serial: several tokens may share an embedding row (cheap next to everything else).
  for (int n = 0; n < B * T; ++n) {
    const float* d = dx + static_cast<size_t>(n) * C;
    float* token_row = dwte + static_cast<size_t>(tokens[n]) * C;
    for (int c = 0; c < C; ++c) token_row[c] += d[c];
    if (dwpe) {
      float* position_row = dwpe + static_cast<size_t>(n % T) * C;
      for (int c = 0; c < C; ++c) position_row[c] += d[c];
    }
  }
}

void matmul_forward(float* y, const float* x, const float* w, const float* b, int N, int IC, int OC) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * IC * OC))
  for (int n = 0; n < N; ++n) {
    const float* x_row = x + static_cast<size_t>(n) * IC;
    for (int o = 0; o < OC; ++o) {
      const float* w_row = w + static_cast<size_t>(o) * IC;
      float sum = b ? b[o] : 0.0f;
      for (int i = 0; i < IC; ++i) sum += x_row[i] * w_row[i];
      y[static_cast<size_t>(n) * OC + o] = sum;
    }
  }
}

// Backward math, per operation (d is the gradient of the loss):
//  * matmul: dx = dy W, dW = dy^T x, db = sum_n dy.
//  * layernorm: with xhat = (x - mean) rstd and g = dy * w,
//      dx = rstd (g - mean(g) - xhat mean(g xhat)), dw = sum_n dy xhat, db = sum_n dy.
//  * rmsnorm: with xhat = x rstd and g = dy * w, dx = rstd (g - xhat mean(g xhat)), dw = sum_n dy xhat.
//  * attention (per query t, p_s = exp(scale q.k_s - lse)): dv_s = p_s dout, dp_s = dout.v_s,
//      ds_s = p_s (dp_s - D) with D = dout.out (= sum_s p_s dp_s), dq = scale sum_s ds_s k_s,
//      dk_s = scale ds_s q.
//  * swiglu: y = g sigmoid(g) u, dg = dy u sigmoid(g) (1 + g (1 - sigmoid(g))), du = dy g sigmoid(g).
//  * cross-entropy: dlogits = softmax - onehot.
void matmul_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w, int N, int IC,
                     int OC) {
  if (dx) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * IC * OC))
    for (int n = 0; n < N; ++n) {
      float* dx_row = dx + static_cast<size_t>(n) * IC;
      for (int o = 0; o < OC; ++o) {
        const float d = dy[static_cast<size_t>(n) * OC + o];
        const float* w_row = w + static_cast<size_t>(o) * IC;
        for (int i = 0; i < IC; ++i) dx_row[i] += d * w_row[i];
      }
    }
  }
  if (dw || db) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * IC * OC))
    for (int o = 0; o < OC; ++o) {
      float* dw_row = dw ? dw + static_cast<size_t>(o) * IC : nullptr;
      float bias_sum = 0.0f;
      for (int n = 0; n < N; ++n) {
        const float d = dy[static_cast<size_t>(n) * OC + o];
        bias_sum += d;
        if (dw_row) {
          const float* x_row = x + static_cast<size_t>(n) * IC;
          for (int i = 0; i < IC; ++i) dw_row[i] += d * x_row[i];
        }
      }
      if (db) db[o] += bias_sum;
    }
  }
}

void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, int N, int C,
                       float eps) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * C))
  for (int n = 0; n < N; ++n) {
    const float* x_row = x + static_cast<size_t>(n) * C;
    double sum = 0.0;
    for (int c = 0; c < C; ++c) sum += x_row[c];
    const double m = sum / C;
    double squares = 0.0;
    for (int c = 0; c < C; ++c) squares += (x_row[c] - m) * (x_row[c] - m);
    const double s = 1.0 / std::sqrt(squares / C + eps);
    float* y_row = y + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; ++c) y_row[c] = static_cast<float>((x_row[c] - m) * s) * w[c] + b[c];
    mean[n] = static_cast<float>(m);
    rstd[n] = static_cast<float>(s);
  }
}

// The parameter gradients of both norms: dw[c] += sum_n dy[n,c] xhat[n,c], db[c] += sum_n dy[n,c];
// one column per iteration so threads never share an output. mean is null for RMSNorm.
static void norm_param_grads(float* dw, float* db, const float* dy, const float* x, const float* mean,
                             const float* rstd, int N, int C) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * C))
  for (int c = 0; c < C; ++c) {
    double w_sum = 0.0, b_sum = 0.0;
    for (int n = 0; n < N; ++n) {
      const float d = dy[static_cast<size_t>(n) * C + c];
      const float xhat = (x[static_cast<size_t>(n) * C + c] - (mean ? mean[n] : 0.0f)) * rstd[n];
      w_sum += d * xhat;
      b_sum += d;
    }
    if (dw) dw[c] += static_cast<float>(w_sum);
    if (db) db[c] += static_cast<float>(b_sum);
  }
}

// dx of both norms: dx += rstd (g - mean(g) - xhat mean(g xhat)), g = dy w; RMSNorm (mean null) has no
// mean(g) term since its output does not subtract the mean.
static void norm_input_grad(float* dx, const float* dy, const float* x, const float* w, const float* mean,
                            const float* rstd, int N, int C) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * C))
  for (int n = 0; n < N; ++n) {
    const float* dy_row = dy + static_cast<size_t>(n) * C;
    const float* x_row = x + static_cast<size_t>(n) * C;
    const float m = mean ? mean[n] : 0.0f;
    double g_sum = 0.0, g_xhat_sum = 0.0;
    for (int c = 0; c < C; ++c) {
      const float g = dy_row[c] * w[c];
      g_sum += g;
      g_xhat_sum += g * ((x_row[c] - m) * rstd[n]);
    }
    const float g_mean = mean ? static_cast<float>(g_sum / C) : 0.0f;
    const float g_xhat_mean = static_cast<float>(g_xhat_sum / C);
    float* dx_row = dx + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; ++c) {
      const float xhat = (x_row[c] - m) * rstd[n];
      dx_row[c] += rstd[n] * (dy_row[c] * w[c] - g_mean - xhat * g_xhat_mean);
    }
  }
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int N, int C) {
  if (dx) norm_input_grad(dx, dy, x, w, mean, rstd, N, C);
  norm_param_grads(dw, db, dy, x, mean, rstd, N, C);
}

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int N, int C, float eps) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * C))
  for (int n = 0; n < N; ++n) {
    const float* x_row = x + static_cast<size_t>(n) * C;
    double squares = 0.0;
    for (int c = 0; c < C; ++c) squares += static_cast<double>(x_row[c]) * x_row[c];
    const double s = 1.0 / std::sqrt(squares / C + eps);
    float* y_row = y + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; ++c) y_row[c] = static_cast<float>(x_row[c] * s) * w[c];
    rstd[n] = static_cast<float>(s);
  }
}

void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd, int N,
                      int C) {
  if (dx) norm_input_grad(dx, dy, x, w, nullptr, rstd, N, C);
  norm_param_grads(dw, nullptr, dy, x, nullptr, rstd, N, C);
}

// GELU(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi).
static constexpr float kGeluScale = 0.7978845608028654f;

void gelu_forward(float* y, const float* x, size_t n) {
#pragma omp parallel for if (worth_threads(n))
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + std::tanh(kGeluScale * (v + 0.044715f * v * v * v)));
  }
}

void gelu_backward(float* dx, const float* dy, const float* x, size_t n) {
#pragma omp parallel for if (worth_threads(n))
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float th = std::tanh(kGeluScale * (v + 0.044715f * v * v * v));
    const float dth = (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * 0.044715f * v * v);
    dx[i] += dy[i] * (0.5f * (1.0f + th) + 0.5f * v * dth);
  }
}

static float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

void swiglu_forward(float* y, const float* gu, int N, int F) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * F))
  for (int n = 0; n < N; ++n) {
    for (int j = 0; j < F; ++j) {
      const float g = gu[(static_cast<size_t>(n) * F + j) * 2], u = gu[(static_cast<size_t>(n) * F + j) * 2 + 1];
      y[static_cast<size_t>(n) * F + j] = g * sigmoid(g) * u;
    }
  }
}

void swiglu_backward(float* dgu, const float* dy, const float* gu, int N, int F) {
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * F))
  for (int n = 0; n < N; ++n) {
    for (int j = 0; j < F; ++j) {
      const size_t pair = (static_cast<size_t>(n) * F + j) * 2;
      const float g = gu[pair], u = gu[pair + 1], d = dy[static_cast<size_t>(n) * F + j];
      const float sg = sigmoid(g);
      dgu[pair] += d * u * sg * (1.0f + g * (1.0f - sg));
      dgu[pair + 1] += d * g * sg;
    }
  }
}

// Rotates pair i of every q and k head of token (b, t) by direction * t * theta^(-2i/hd). The q heads
// and k heads are contiguous in the packed row, so they are the first n_head + n_kv_head heads.
static void rope_rotate(float* qkv, int B, int T, int n_head, int n_kv_head, int hd, float theta, int direction) {
  const size_t row_width = static_cast<size_t>(n_head + 2 * n_kv_head) * hd;
#pragma omp parallel for if (worth_threads(static_cast<size_t>(B) * T * row_width))
  for (int n = 0; n < B * T; ++n) {
    const int t = n % T;
    for (int head = 0; head < n_head + n_kv_head; ++head) {
      float* x = qkv + n * row_width + static_cast<size_t>(head) * hd;
      for (int i = 0; i < hd / 2; ++i) {
        const double angle = t * std::pow(static_cast<double>(theta), -2.0 * i / hd);
        const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(direction * std::sin(angle));
        const float x0 = x[2 * i], x1 = x[2 * i + 1];
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x0 * s + x1 * c;
      }
    }
  }
}

void rope_forward(float* qkv, int B, int T, int n_head, int n_kv_head, int hd, float theta) {
  rope_rotate(qkv, B, T, n_head, n_kv_head, hd, theta, +1);
}

void rope_backward(float* dqkv, int B, int T, int n_head, int n_kv_head, int hd, float theta) {
  rope_rotate(dqkv, B, T, n_head, n_kv_head, hd, theta, -1);
}

static float dot(const float* a, const float* b, int n) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int n_head, int n_kv_head, int hd) {
  const size_t row_width = static_cast<size_t>(n_head + 2 * n_kv_head) * hd, C = static_cast<size_t>(n_head) * hd;
  const int group = n_head / n_kv_head;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for collapse(2) if (worth_threads(static_cast<size_t>(B) * n_head * T * T * hd))
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < n_head; ++h) {
      const size_t k_col = static_cast<size_t>(n_head + h / group) * hd, v_col = k_col + n_kv_head * hd;
      std::vector<double> p(T);
      for (int t = 0; t < T; ++t) {
        const float* q = qkv + (static_cast<size_t>(b) * T + t) * row_width + static_cast<size_t>(h) * hd;
        float max_score = -std::numeric_limits<float>::infinity();
        for (int s = 0; s <= t; ++s) {
          p[s] = scale * dot(q, qkv + (static_cast<size_t>(b) * T + s) * row_width + k_col, hd);
          max_score = std::max(max_score, static_cast<float>(p[s]));
        }
        double sum = 0.0;
        for (int s = 0; s <= t; ++s) {
          p[s] = std::exp(p[s] - max_score);
          sum += p[s];
        }
        lse[(static_cast<size_t>(b) * n_head + h) * T + t] = static_cast<float>(max_score + std::log(sum));
        float* o = out + (static_cast<size_t>(b) * T + t) * C + static_cast<size_t>(h) * hd;
        for (int d = 0; d < hd; ++d) {
          double acc = 0.0;
          for (int s = 0; s <= t; ++s) acc += p[s] * qkv[(static_cast<size_t>(b) * T + s) * row_width + v_col + d];
          o[d] = static_cast<float>(acc / sum);
        }
      }
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int n_head, int n_kv_head, int hd) {
  const size_t row_width = static_cast<size_t>(n_head + 2 * n_kv_head) * hd, C = static_cast<size_t>(n_head) * hd;
  const int group = n_head / n_kv_head;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // One iteration per (sequence, kv head): it owns dk and dv of that kv head and dq of its query heads.
#pragma omp parallel for collapse(2) if (worth_threads(static_cast<size_t>(B) * n_head * T * T * hd))
  for (int b = 0; b < B; ++b) {
    for (int g = 0; g < n_kv_head; ++g) {
      const size_t k_col = static_cast<size_t>(n_head + g) * hd, v_col = k_col + n_kv_head * hd;
      for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int t = 0; t < T; ++t) {
          const size_t row = (static_cast<size_t>(b) * T + t);
          const float* q = qkv + row * row_width + static_cast<size_t>(h) * hd;
          float* dq = dqkv + row * row_width + static_cast<size_t>(h) * hd;
          const float* dout_row = dout + row * C + static_cast<size_t>(h) * hd;
          const float D = dot(dout_row, out + row * C + static_cast<size_t>(h) * hd, hd);
          const float row_lse = lse[(static_cast<size_t>(b) * n_head + h) * T + t];
          for (int s = 0; s <= t; ++s) {
            const size_t key_row = (static_cast<size_t>(b) * T + s) * row_width;
            const float* k = qkv + key_row + k_col;
            const float* v = qkv + key_row + v_col;
            const float p = std::exp(scale * dot(q, k, hd) - row_lse);
            const float ds = p * (dot(dout_row, v, hd) - D);
            for (int d = 0; d < hd; ++d) {
              dqkv[key_row + v_col + d] += p * dout_row[d];
              dq[d] += scale * ds * k[d];
              dqkv[key_row + k_col + d] += scale * ds * q[d];
            }
          }
        }
      }
    }
  }
}

static void check_target(int32_t target, int V) {
  if (target < 0 || target >= V)
    throw std::invalid_argument("crossentropy: target " + std::to_string(target) + " outside [0, " + std::to_string(V) +
                                ")");
}

// Natural-log sum-exp of row[0..V).
static double logsumexp(const float* row, int V) {
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int v = 0; v < V; ++v) max_logit = std::max(max_logit, row[v]);
  double sum = 0.0;
  for (int v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - max_logit);
  return max_logit + std::log(sum);
}

void crossentropy_forward(float* losses, const float* logits, const int32_t* targets, int N, int V, int Vp) {
  for (int n = 0; n < N; ++n) check_target(targets[n], V);
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * Vp))
  for (int n = 0; n < N; ++n) {
    const float* row = logits + static_cast<size_t>(n) * Vp;
    losses[n] = static_cast<float>(logsumexp(row, V) - row[targets[n]]);
  }
}

void crossentropy_backward(float* dlogits, const float* logits, const int32_t* targets, float dloss, int N, int V,
                           int Vp) {
  for (int n = 0; n < N; ++n) check_target(targets[n], V);
#pragma omp parallel for if (worth_threads(static_cast<size_t>(N) * Vp))
  for (int n = 0; n < N; ++n) {
    const float* row = logits + static_cast<size_t>(n) * Vp;
    float* d = dlogits + static_cast<size_t>(n) * Vp;
    const double lse = logsumexp(row, V);
    for (int v = 0; v < Vp; ++v) {
      const double softmax = v < V ? std::exp(row[v] - lse) : 0.0;
      const double onehot = v == targets[n] ? 1.0 : 0.0;
      d[v] = static_cast<float>((softmax - onehot) * dloss);
    }
  }
}

}  // namespace coda::ref
