// Model shapes and the parameter layout shared by every backend, the checkpoint code and the optimizer.
// All parameters live in ONE flat fp32 buffer (bf16 copies on the GPU mirror it), each tensor at an offset
// aligned to kParamAlign elements (16-byte vector and TMA access on any tensor; the padding stays zero,
// its gradient being zero). Order: embedding(s), layer 0 .. L-1 (each layer contiguous, so data
// parallelism can reduce one layer's gradients at a time), final norm, untied LM head. Matrices are
// [out_features, in_features], row-major: a linear layer is y = x W^T (+ b).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace coda {

// Conventions chosen so that one layout serves the CPU reference, the unfused and the CODA kernels:
//  * attention projections are one fused matrix qkv_w with rows [q heads | k heads | v heads],
//    (n_head + 2 n_kv_head) * head_dim rows; its output row per token is the "packed qkv" layout that
//    the attention kernels read directly (token-major, head h of q at column h*head_dim).
//  * RoPE rotates ADJACENT pairs (2i, 2i+1) of each head (Meta's original convention). Hugging Face's
//    rotate-half convention is a fixed permutation of the q and k rows (and of their biases), applied on
//    export/import.
//  * SwiGLU's gate and up projections are one matrix mlp_up_w of 2*d_ff rows, INTERLEAVED:
//    row 2j is gate_j, row 2j+1 is up_j, so SwiGLU is a function of adjacent output columns.
//  * The vocabulary is padded to a multiple of 128 (padded_vocab); padded rows of the embedding stay
//    zero and padded logits are excluded from the softmax.
// A model is its features (norm, biases, MLP, positions, tied head): the CPU reference, the backends and
// the checkpoint code test those, never the architecture. The architecture (src/models/) picks the
// features, validates the shapes it allows and knows its Hugging Face names.
enum class Arch { GPT2, Llama, Qwen2 };
enum class Norm { Layer, RMS };            // LayerNorm (gain and bias) or RMSNorm (gain only)
enum class Mlp { Gelu, SwiGLU };           // GELU (tanh form) or SwiGLU on interleaved gate/up rows
enum class Positions { Learned, Rope };    // a learned table wpe added to the embedding, or RoPE on q, k

struct ModelConfig {
  Arch arch = Arch::GPT2;
  // Features, set by set_arch (the defaults here are GPT-2's).
  Norm norm = Norm::Layer;
  Mlp mlp = Mlp::Gelu;
  Positions positions = Positions::Learned;
  bool qkv_bias = true;      // bias of the QKV projection (added before RoPE)
  bool proj_bias = true;     // bias of the attention output projection
  bool mlp_bias = true;      // biases of the MLP's up and down projections
  // Shape.
  int n_layer = 2;
  int d_model = 64;
  int n_head = 4;
  int n_kv_head = 4;    // GPT-2: equal to n_head
  int d_ff = 256;       // MLP hidden width (GELU: 4*d_model for GPT-2; SwiGLU: the gate and up width)
  int vocab_size = 256;
  int max_seq_len = 256;
  float rope_theta = 10000.0f;  // RoPE positions only
  float norm_eps = 1e-5f;
  bool tied_head = true;        // the LM head is the token embedding

  // The architecture and its features (src/models/).
  void set_arch(Arch a);
  int head_dim() const { return d_model / n_head; }
  int padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  int qkv_dim() const { return (n_head + 2 * n_kv_head) * head_dim(); }
  int mlp_up_rows() const { return mlp == Mlp::SwiGLU ? 2 * d_ff : d_ff; }
  bool norm_bias() const { return norm == Norm::Layer; }
  bool rope() const { return positions == Positions::Rope; }
  // Throws std::invalid_argument naming the offending key when the shape is inconsistent, or when the
  // features are not the architecture's.
  void validate() const;
};

const char* arch_name(Arch arch);
Arch parse_arch(const std::string& name);  // "gpt2", "llama" or "qwen2"; throws std::invalid_argument
// The config of an architecture with its features and the shape fields at their defaults.
ModelConfig model_config(Arch arch);

constexpr size_t kParamAlign = 64;          // elements
constexpr size_t kAbsent = static_cast<size_t>(-1);

struct ParamTensor {
  std::string name;            // e.g. "h.3.qkv_w"
  std::vector<int64_t> shape;  // [rows, cols] for matrices, [n] for vectors
  size_t offset = 0;           // in elements, into the flat buffer
  size_t numel = 0;
  bool weight_decay = false;   // AdamW decay: matrices yes; norms, biases, embeddings no
};

// Offsets of one layer's tensors; kAbsent where the features have no such tensor.
struct LayerParams {
  size_t norm1_w = kAbsent, norm1_b = kAbsent;          // ln_1 / attention RMSNorm
  size_t qkv_w = kAbsent, qkv_b = kAbsent;              // [qkv_dim, C], [qkv_dim]
  size_t attn_proj_w = kAbsent, attn_proj_b = kAbsent;  // [C, C], [C]
  size_t norm2_w = kAbsent, norm2_b = kAbsent;          // ln_2 / MLP RMSNorm
  size_t mlp_up_w = kAbsent, mlp_up_b = kAbsent;        // [mlp_up_rows, C], [mlp_up_rows]
  size_t mlp_down_w = kAbsent, mlp_down_b = kAbsent;    // [C, d_ff], [C]
};

struct ParamLayout {
  size_t wte = kAbsent;      // [padded_vocab, C]
  size_t wpe = kAbsent;      // [max_seq_len, C], learned positions only
  std::vector<LayerParams> layers;
  size_t normf_w = kAbsent, normf_b = kAbsent;
  size_t lm_head = kAbsent;  // [padded_vocab, C] when untied; otherwise the head reads wte
  std::vector<ParamTensor> tensors;  // every tensor, in buffer order
  size_t total = 0;                  // elements in the flat buffer, padding included

  size_t head_weight() const { return lm_head == kAbsent ? wte : lm_head; }
  const ParamTensor& find(const std::string& name) const;  // throws std::out_of_range
  size_t num_parameters() const;                           // sum of numel, padding excluded
};

ParamLayout make_param_layout(const ModelConfig& config);

// Standard initialisation, reproducible from the seed: weights N(0, 0.02), the residual projections
// (attn_proj_w, mlp_down_w) N(0, 0.02/sqrt(2 n_layer)), biases 0, norm gains 1, padded vocab rows 0.
// Each element is drawn from a counter-based stream (seed, tensor, index), so the tensors fill in
// parallel (OpenMP) with the same values on any number of threads: llama3.2-1b in about a second.
void init_params(const ModelConfig& config, const ParamLayout& layout, uint64_t seed, float* params);

// Model FLOPs per token of one training step (forward + backward), for MFU: 6 * (matmul params) +
// 6 * attention (causal, so half of 4*T*C per layer forward, times 3 for backward).
double flops_per_token(const ModelConfig& config, int seq_len);

}  // namespace coda
