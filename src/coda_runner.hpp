// The CODA mode: every non-attention operation of the forward and backward pass runs in the epilogue of a
// GEMM (kernels/coda/*_programs.cuh on the GEMM of kernels/gemm), next to the attention kernels and the
// few passes of kernels/coda/passes.cuh. docs/CODA.md explains each program. CodaRunner holds what both
// families share; CodaLayerNormRunner (coda_layernorm.cu) and CodaRmsNormRunner (coda_rmsnorm.cu) run
// the blocks and the head.
// The saved activations are what the fused math keeps, not the plain norm outputs of the unfused mode:
//   layers_[l].h    the residual stream entering layer l (aux output of the previous residual epilogue,
//                   or of the embedding)
//   layers_[l].o1   O1 = h (.) gamma1, what the QKV GEMM reads (main output of the same epilogue); the
//                   LayerNorm backward overwrites it with u / r for the QKV weight gradient
//   layers_[l].h2   the residual stream after attention (aux output of the out-projection)
//   layers_[l].o2   O2 = h2 (.) gamma2, what the MLP's up GEMM reads (main output of the out-projection)
//   h_final_, o_final_   h and O of the final norm
// and the norm statistics as row partials (NormStatsBuffers) instead of finished mean / rstd vectors.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "kernels/coda/attention_writeout.cuh"
#include "kernels/coda/norm_stats.cuh"
#include "kernels/coda/passes.cuh"
#include "kernels/epilogue/epilogue.cuh"
#include "kernels/gemm/cublaslt.cuh"
#include "kernels/gemm/gemm.cuh"
#include "step_runner.hpp"

namespace coda {

class CodaRunner : public StepRunner {
 public:
  // Throws std::invalid_argument with coda_unsupported_reason (backend.hpp) for a model it does not cover.
  CodaRunner(DeviceState& state, bool deterministic);
  std::string mode() const override { return "coda"; }
  void embedding_forward(int B, int T) override;  // h, O1 and the statistics of layer 0's first norm
  void loss_forward(int B, int T) override;       // losses and lse from the head epilogue's partials
  void embedding_backward(int B, int T) override;

 protected:
  struct LayerActivations {
    bf16* h = nullptr;     // [N, C]
    bf16* o1 = nullptr;    // [N, C]
    bf16* qkv = nullptr;   // [N, qkv_dim]: what attention reads
    bf16* attn = nullptr;  // [N, C]
    float* lse = nullptr;  // [B, n_head, T]
    bf16* h2 = nullptr;    // [N, C]
    bf16* o2 = nullptr;    // [N, C]
    bf16* up = nullptr;    // [N, mlp_up_rows]: the GELU input, or the interleaved (g, u)
    bf16* act = nullptr;   // [N, d_ff]: the down projection's input
  };
  // The row partials of one norm's input (sum: LayerNorm only), [N, max_count] each; count is set by
  // the producer of each step (the embedding: 1; a residual epilogue: its GEMM's N tiles).
  struct NormStatsBuffers {
    float* sum = nullptr;
    float* sumsq = nullptr;
    int count = 0;
  };

  // The activations, statistics, loss partials and gradient buffers both families use; a family's
  // plan_buffers calls this first, then adds its own.
  void plan_buffers(ArenaPlan& plan) override;
  prog::NormPartials norm_partials(const NormStatsBuffers& stats) const;
  // The dlogits pass over the logits in place, with the final norm's statistics and <dz, z> into dot_z:
  // what both families pass (LayerNorm adds its vectors and dots).
  passes::DlogitsArgs dlogits_args(int N, float dloss, float* dot_z) const;
  // The residual stream leaving layer l: the next layer's h, or h_final_ after the last.
  bf16* layer_output(int layer) const { return layer + 1 < config_.n_layer ? layers_[layer + 1].h : h_final_; }
  // The statistics a layer's residual epilogues write: norm2 of the same layer, or norm1 of the next one
  // (or the final norm after the last layer).
  NormStatsBuffers& next_norm_stats(int layer);
  // The GEMMs without a program: dW[M, N] += dY[K, M]^T X[K, N] (fp32; split over K unless the runner is
  // deterministic) and dX[M, N] = dY[M, K] W[K, N]. With no epilogue to fuse they run on cuBLASLt, whose
  // mainloop spends fewer joules at the power cap (docs/PERFORMANCE.md); CODA_BARE_GEMMS=handwritten in the
  // environment puts them on the hand-written GEMM, to measure the difference in the step.
  void wgrad(float* dW, const bf16* dY, const bf16* X, int M, int N, int K) const;
  void bare_dgrad(bf16* dX, const bf16* dY, const bf16* W, int M, int N, int K) const;
  // Row partials of a GEMM of this shape run with the Auto tile (gemm_row_partials).
  static int row_partials(GemmLayout layout, int M, int N, int K) { return gemm_row_partials(layout, M, N, K); }
  // Row partials of a producer with N columns at most: one per 128 columns (the narrowest N tile).
  static int max_row_partials(int N) { return (N + 127) / 128; }

  std::vector<LayerActivations> layers_;
  bf16* h_final_ = nullptr;  // [N, C]
  bf16* o_final_ = nullptr;  // [N, C]
  std::vector<NormStatsBuffers> norm1_stats_, norm2_stats_;  // per layer
  NormStatsBuffers normf_stats_;
  float* target_logit_ = nullptr;                // [N]
  epi::LogSumExp::Out* lse_partials_ = nullptr;  // [N, Vp / 128]
  int lse_count_ = 0;                            // set by the head forward
  bf16* d_residual_ = nullptr;  // gradient of the residual stream [N, C]
  bf16* d_attn_ = nullptr;      // [N, C]
  bf16* d_qkv_ = nullptr;       // [N, qkv_dim], scaled (dz' = r dz)
  bf16* d_up_ = nullptr;        // [N, mlp_up_rows], scaled
  void* attention_workspace_ = nullptr;
  std::unique_ptr<CublasLt> bare_cublas_;  // null with CODA_BARE_GEMMS=handwritten
};

}  // namespace coda
