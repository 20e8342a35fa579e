// The CODA mode: the CUDA backend in which every non-attention operation of the forward and backward
// pass runs in the epilogue of a GEMM (kernels/coda/*_programs.cuh on the GEMM of kernels/gemm), next to
// the attention kernels and the few passes of kernels/coda/fused.cuh. docs/CODA.md explains each program.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "cuda_backend.hpp"
#include "kernels/coda/fused.cuh"
#include "kernels/coda/norm_stats.cuh"
#include "kernels/epilogue/epilogue.cuh"
#include "kernels/gemm/gemm.cuh"

namespace coda {

// CodaBackend holds what both architectures share and derives from CudaBackend, reusing its parameter
// state, optimizer, data parallelism, I/O and most of its activation buffers, with new meanings where the
// fused math keeps different tensors:
//   layers[l].input   h, the residual stream entering layer l        (aux output of the previous residual
//                                                                        epilogue, or the embedding)
//   layers[l].norm1   O1 = h (.) gamma1: what the QKV GEMM reads       (main output of the same)
//   layers[l].mid     h2, the residual stream after attention          (aux output of the out-projection)
//   layers[l].norm2   O2 = h2 (.) gamma2: what the MLP's up GEMM reads (main output of the out-projection)
//   acts_.output / acts_.normf   h and O of the final norm
// (GPT-2: each LayerNorm backward overwrites its O, norm1, norm2 or normf, with u / r for the weight
// gradient of the GEMM that read it, coda_gpt2.cu)
// and the norm statistics as row partials (NormStatsBuffers) instead of finished mean/rstd vectors.
// CodaLlamaBackend (coda_llama.cu) and CodaGpt2Backend (coda_gpt2.cu) run the blocks and the head.
class CodaBackend : public CudaBackend {
 public:
  CodaBackend(const ModelConfig& config, int max_batch, int max_seq_len);
  std::string name() const override { return "cuda-coda"; }

 protected:
  // The row partials of one norm's input (sum: LayerNorm only), [N, max_count] each; count is set by
  // the producer of each step (the embedding: 1; a residual epilogue: its GEMM's N tiles).
  struct NormStatsBuffers {
    float* sum = nullptr;
    float* sumsq = nullptr;
    int count = 0;
  };

  void plan_buffers(ArenaPlan& plan) override;
  void embedding_forward(int B, int T) override;  // h, O1 and the statistics of layer 0's first norm
  void loss_forward(int B, int T) override;       // losses and lse from the head epilogue's partials

  prog::NormPartials norm_partials(const NormStatsBuffers& stats) const;
  // The dlogits pass over the logits in place, with the final norm's statistics and <dz, z> into dot_z:
  // what both architectures pass (LayerNorm adds its vectors and dots).
  fused::DlogitsArgs dlogits_args(int N, float dloss, float* dot_z) const;
  // The statistics a layer's residual epilogues write: norm2 of the same layer, or norm1 of the next one
  // (or the final norm after the last layer).
  NormStatsBuffers& next_norm_stats(int layer);
  // Row partials of a GEMM of this shape run with the Auto tile (gemm_row_partials).
  static int row_partials(GemmLayout layout, int M, int N, int K) { return gemm_row_partials(layout, M, N, K); }
  // Row partials of a producer with N columns at most: one per 128 columns (the narrowest N tile).
  static int max_row_partials(int N) { return (N + 127) / 128; }

  std::vector<NormStatsBuffers> norm1_stats_, norm2_stats_;  // per layer
  NormStatsBuffers normf_stats_;
  float* target_logit_ = nullptr;                   // [N]
  epi::LogSumExp::Out* lse_partials_ = nullptr;     // [N, Vp / 128]
  int lse_count_ = 0;                               // set by the head forward
};

// The CODA backend of config.arch, allocated; with zero1, its optimizer state sharded over zero1's ranks.
std::unique_ptr<CudaBackend> make_coda_backend(const ModelConfig& config, int max_batch, int max_seq_len,
                                               Communicator* zero1 = nullptr);

// The architectures' CODA backends, not allocated yet (coda_llama.cu, coda_gpt2.cu).
std::unique_ptr<CudaBackend> make_coda_llama_backend(const ModelConfig& config, int max_batch, int max_seq_len);
std::unique_ptr<CudaBackend> make_coda_gpt2_backend(const ModelConfig& config, int max_batch, int max_seq_len);

}  // namespace coda
