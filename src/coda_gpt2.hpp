// The GPT-2 CODA backend: every LayerNorm, bias, GELU and residual add of a GPT-2 block, forward and
// backward, runs in the epilogue of a GEMM (kernels/coda/gpt2_programs.cuh), next to the attention
// kernels and the passes of kernels/coda/fused.cuh. coda_gpt2.cu walks through one step; docs/CODA.md
// explains each program with its identity.
#pragma once
#include <vector>

#include "coda_backend.hpp"
#include "kernels/coda/gpt2_programs.cuh"

namespace coda {

class CodaGpt2Backend : public CodaBackend {
 public:
  CodaGpt2Backend(const ModelConfig& config, int max_batch, int max_seq_len);

 protected:
  void plan_buffers(ArenaPlan& plan) override;
  void embedding_forward(int B, int T) override;  // also the weight-derived vectors of this forward
  void block_forward(int layer, int B, int T) override;
  void head_forward(int B, int T) override;
  void head_backward(int B, int T, float dloss) override;
  void block_backward(int layer, int B, int T) override;

 private:
  // The weight-derived vectors of a LayerNormed linear layer LN(h) W^T + bias, fp32 [rows of W]:
  // c = W gamma, b' = W beta + bias (recomputed at the start of every forward, from the bf16 weights).
  struct LnVectors {
    float* c = nullptr;
    float* b_prime = nullptr;
  };
  void weight_vectors();
  // d_residual += the LayerNorm backward of a norm (its partials, input h, parameters at norm_w, norm_b)
  // from the scaled gradient dz' [N, K] of the GEMM after it (weight W [K, C]) and the row dots of dz;
  // adds dgamma and dbeta into the gradients and leaves the column sums of the new d_residual (the bias
  // gradient of the projection below) in ln_cols_.residual.
  void ln_backward(const bf16* dz_scaled, size_t W, int K, const NormStatsBuffers& stats, const prog::LnDots& dots,
                   const bf16* h, size_t norm_w, size_t norm_b, int N);
  // dW += dz'^T O - a gamma^T + b beta^T and dbias += b (W [rows, C] after the norm at norm_w, norm_b;
  // a, b from col_a_, col_b_ in `groups` row groups).
  void ln_linear_wgrad(size_t W, size_t bias, const bf16* dz_scaled, const bf16* O, int rows, int N, int groups,
                       size_t norm_w, size_t norm_b);

  std::vector<LnVectors> qkv_vectors_, fc_vectors_;  // per layer
  LnVectors head_vectors_;
  float* dot_z_ = nullptr;  // row dots of a LayerNormed GEMM's output gradient, [N, count]
  float* dot_c_ = nullptr;
  float* dot_b_ = nullptr;
  prog::gpt2::LnGradColumns grad_cols_;   // col_a, col_b of that gradient, [groups, rows]
  prog::gpt2::LnBackwardColumns ln_cols_;  // the LayerNorm backward's column partials, [N / 16, C]
};

}  // namespace coda
