// Per-program benchmark: each CODA program of the trainer, at the model's shape, against
//   (a) CODA   gemm_run with the program exactly as the trainer builds it (gpt2_programs.cuh, llama_programs.cuh;
//              Auto tile), the GEMM kernel alone (not the kernels that finish column partials afterwards),
//   (b) bare   the identity program of the same shape, layout and tile (the mainloop's own cost),
//   (c) chain  what the unfused mode (src/cuda_backend.cu) runs for the same operations: the cuBLASLt GEMM
//              and the unfused kernels before and after it, timed as a whole and part by part.
// Overhead = CODA / bare - 1; speedup = chain / CODA; energy per launch of CODA, bare, the chain and the chain's
// cuBLASLt GEMM: at the power cap the step follows joules, so a program must cost fewer joules than its chain,
// not only less time. Epilogue mJ = CODA - bare is what the program's epilogue spends; removed mJ = chain -
// cuBLASLt is what the unfused kernels it replaces spend. Fusion saves joules where epilogue < removed +
// (cuBLASLt - bare).
// Method: bench_util.cuh; correctness is gpu_tests' business. Shapes and inputs: above kAct below.
// After the table, per model, these differences summed over a step (each program times its launches): the
// mainloops' joules against cuBLASLt's and the epilogues' against the kernels they remove.
// --tiles: every program on each tile it is compiled for (all three in a -DCODA_ALL_TILES=ON build), one row per
// tile, each against the same chain: which tile spends the fewest joules for a program's mainloop and epilogue.
// --only TEXT: only the programs whose name contains TEXT (e.g. "LM head").
// Usage: bench_programs [--runs N] [--model gpt2|llama] [--tiles] [--only TEXT]   (default: 25 timed runs, both
// models, every program, the tile the trainer picks)

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/coda/gpt2_programs.cuh"
#include "kernels/coda/llama_programs.cuh"
#include "kernels/gemm/cublaslt.cuh"
#include "kernels/gemm/gemm_launch.cuh"
#include "kernels/unfused/unfused.cuh"
#include "tests/bench/bench_util.cuh"
#include "tests/gemm_reference.cuh"

namespace {

using namespace coda;
using bf16 = __nv_bfloat16;

int g_timed_runs = 25;
bool g_every_tile = false;
std::string g_only;  // --only: a part of the names of the programs to run

// A model's step summed over the programs benchmarked (rows on the trainer's tiles only): each row's
// differences times its launches per step (n_layer for the block programs, 1 for the head's, set by run()
// before its cases). Mainloop = bare - cuBLASLt, epilogue = (CODA - bare) - (chain - cuBLASLt).
struct StepEnergy {
  std::string model;
  int layers = 0, launches = 0;  // launches per step of the programs reported next
  double mainloop_mj = 0.0, epilogue_mj = 0.0;
  bool complete = true;  // every row read its energy
};
std::vector<StepEnergy> g_steps;
uint64_t g_seed = 1;

// The device allocations of one benchmark case, freed together.
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <class T>
  T* alloc(size_t n) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }
  // n values uniform in [lo, hi) (bf16 or fp32).
  template <class T>
  T* random(size_t n, float lo, float hi) {
    T* p = alloc<T>(n);
    testing::fill_uniform(p, n, g_seed++, lo, hi);
    return p;
  }

 private:
  std::vector<void*> blocks_;
};

// Shapes: gpt2-124m B=32 T=1024 (M = 32768 rows, d 768, d_ff 3072, qkv 2304, vocabulary 50257 padded to
// 50304) and llama3.2-1b B=8 T=2048 (M = 16384, d 2048, d_ff 8192 with gate/up interleaved (N = 16384),
// qkv 3072, vocabulary 128256). Norm statistics come as the row partials a producer writes (one per N tile
// of the producing GEMM, as many as the trainer's producer writes); they are filled so that each row's
// variance is near 1 (sum of h near 0, sum of h^2 near d), so no rstd is huge and nothing becomes NaN/Inf.
// Other inputs are uniform of realistic scale: activations +-1, weights +-0.05, gradients +-0.01. Every
// buffer has the size the program addresses (row partials sized for the narrowest N tile, 128). The GEMM
// operands rotate through copies (>= 150 MB in the rotation), so the timed runs do not find them in L2.
constexpr float kAct = 1.0f, kWeight = 0.05f, kGrad = 0.01f;

// The GEMM of a program: layout and shape in gemm.cuh's terms, A [M, K] (activations or gradients),
// B the weight ([N, K] forward, [K, N] dgrad), both rotated through `sets` copies.
struct Gemm {
  GemmLayout layout;
  int M, N, K;
  int sets = 1;
  std::vector<const bf16*> A, B;
  Gemm(Arena& arena, GemmLayout layout_, int M_, int N_, int K_, float a_scale)
      : layout(layout_), M(M_), N(N_), K(K_) {
    sets = bench::rotation_sets((size_t(M) * K + size_t(N) * K) * sizeof(bf16));
    for (int i = 0; i < sets; ++i) {
      A.push_back(arena.random<bf16>(size_t(M) * K, -a_scale, a_scale));
      B.push_back(arena.random<bf16>(size_t(N) * K, -kWeight, kWeight));
    }
  }
  const bf16* a(int i) const { return A[i % sets]; }
  const bf16* b(int i) const { return B[i % sets]; }
  // The tile Auto picks for the program (as the trainer runs it), and the row partial count per row.
  template <class Program>
  GemmTile tile(const Program&) const { return gemm_choose_tile(layout, M, N, K, gemm_epilogue_of<Program>()); }
  int row_partials() const { return gemm_row_partials(layout, M, N, K); }
  // The cuBLASLt GEMM of the unfused mode: Y = X W^T (forward) or dX = dY W (dgrad), into D [M, N].
  void cublas(CublasLt& lt, bf16* D, int i) const {
    lt.gemm(D, a(i), Op::N, b(i), layout == GemmLayout::Forward ? Op::T : Op::N, M, N, K, false, nullptr);
  }
  // The identity program on a program's tile, into D [M, N].
  void bare(bf16* D, GemmTile tile, int i) const {
    if (layout == GemmLayout::Forward)
      gemm_forward(D, a(i), b(i), M, N, K, nullptr, tile);
    else
      gemm_dgrad(D, a(i), b(i), M, N, K, nullptr, tile);
  }
  // gemm_run with the program on `tile`, into D (its width as the program maps the N columns).
  template <GemmLayout kLayout, class Program>
  void coda(GemmTile tile, bf16* D, bool accumulate, const Program& program, int i) const {
    gemm_run<kLayout>(tile, D, a(i), b(i), M, N, K, accumulate, program, nullptr);
  }
};

// Row partials of a norm's input h [M, count], as a producer writes them: sum of h (LayerNorm only) and
// sum of h^2, filled so the row has mean near 0 and variance near 1.
prog::NormPartials norm_partials(Arena& arena, int M, int d, int count, bool layer_norm) {
  prog::NormPartials p;
  const size_t n = size_t(M) * count;
  const float share = static_cast<float>(d) / count;
  if (layer_norm) p.sum = arena.random<float>(n, -std::sqrt(share), std::sqrt(share));
  p.sumsq = arena.random<float>(n, 0.8f * share, 1.2f * share);
  p.count = count;
  p.d = d;
  p.eps = 1e-5f;
  return p;
}

// Row partial buffers: at most one entry per 128 columns.
int max_row_partials(int N) { return (N + 127) / 128; }

// Unfused-mode scratch shared by every case: the column-sum / norm-backward workspace.
struct Unfused {
  CublasLt lt;
  unfused::ColumnSumWorkspace ws;
  float* norm_partials = nullptr;
  Arena arena;
  explicit Unfused(int max_cols) {
    ws.partials = arena.alloc<float>(unfused::column_sum_partials_floats(max_cols));
    ws.tickets = arena.alloc<unsigned int>(unfused::column_sum_tickets(max_cols));
    CUDA_CHECK(cudaMemset(ws.tickets, 0, unfused::column_sum_tickets(max_cols) * sizeof(unsigned int)));
    ws.max_cols = max_cols;
    norm_partials = arena.alloc<float>(unfused::norm_backward_partials_floats(4096));
  }
};

struct Part {
  std::string name;
  std::function<void(int)> run;
};

// The LM head's loss: targets spread over the real vocabulary V, the program's outputs (target logit, one
// log-sum-exp partial per N tile of the M x N logits), and the chain's cross-entropy forward over the
// unfused logits y [M, Vp].
struct HeadLoss {
  int32_t* targets = nullptr;
  float* target_logit = nullptr;
  epi::LogSumExp::Out* lse_partials = nullptr;
  float* losses = nullptr;
  float* lse = nullptr;
  HeadLoss(Arena& arena, int M, int N, int V) {
    std::vector<int32_t> host_targets(M);
    for (int r = 0; r < M; ++r) host_targets[r] = static_cast<int32_t>((size_t(r) * 7919) % V);
    targets = arena.alloc<int32_t>(M);
    CUDA_CHECK(cudaMemcpy(targets, host_targets.data(), M * sizeof(int32_t), cudaMemcpyHostToDevice));
    target_logit = arena.alloc<float>(M);
    lse_partials = arena.alloc<epi::LogSumExp::Out>(size_t(M) * max_row_partials(N));
    losses = arena.alloc<float>(M);
    lse = arena.alloc<float>(M);
  }
  Part crossentropy(const bf16* y, int M, int V, int Vp) const {
    return {"crossentropy_forward", [l = *this, y, M, V, Vp](int) {
              unfused::crossentropy_forward(l.losses, l.lse, y, l.targets, M, V, Vp, nullptr);
            }};
  }
};

// Times CODA (the program on `tile`, run by `coda`), bare (the identity program on the same tile, into
// bare_out), the chain and each of its parts interleaved; prints one table row. A launch that throws (a
// shape the GEMM refuses) is reported in the row and the next case still runs.
void report_on_tile(const std::string& name, const Gemm& g, GemmTile tile, const std::function<void(int)>& coda,
                    bf16* bare_out, const std::vector<Part>& chain) {
  const auto bare = [&](int i) { g.bare(bare_out, tile, i); };
  std::vector<std::function<void(int)>> runs{coda, bare, [&](int i) {
                                               for (const Part& p : chain) p.run(i);
                                             }};
  for (const Part& p : chain) runs.push_back(p.run);
  std::vector<double> ms;
  try {
    ms = bench::median_ms(g_timed_runs, runs);
  } catch (const std::exception& e) {
    std::printf("| %s | failed: %s |\n", name.c_str(), e.what());
    return;
  }
  // Energy of CODA, bare, the whole chain and the chain's cuBLASLt GEMM (the parts' times say where the
  // chain's time goes). The program's epilogue costs CODA - bare; the kernels it removes cost chain - cuBLASLt.
  const size_t gemm_part = static_cast<size_t>(
      std::find_if(chain.begin(), chain.end(), [](const Part& p) { return p.name == "cublas"; }) - chain.begin());
  if (gemm_part == chain.size()) throw std::logic_error(name + ": the chain has no cublas part");
  const std::vector<double> mj = bench::median_millijoules({runs[0], runs[1], runs[2], runs[3 + gemm_part]},
                                                           {ms[0], ms[1], ms[2], ms[3 + gemm_part]});
  if (!g_every_tile && !g_steps.empty()) {
    StepEnergy& step = g_steps.back();
    step.complete = step.complete && !mj.empty();
    if (!mj.empty()) {
      step.mainloop_mj += step.launches * (mj[1] - mj[3]);
      step.epilogue_mj += step.launches * ((mj[0] - mj[1]) - (mj[2] - mj[3]));
    }
  }
  char energy[160] = "- | - | - | - | - | - | -";
  if (!mj.empty())
    std::snprintf(energy, sizeof energy, "%.2f | %.2f | %.2f | %.2f | %.2fx | %.2f | %.2f", mj[0], mj[1], mj[2],
                  mj[3], mj[2] / mj[0], mj[0] - mj[1], mj[2] - mj[3]);
  std::string parts;
  for (size_t j = 0; j < chain.size(); ++j) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s%s %.0f", j ? " + " : "", chain[j].name.c_str(), 1e3 * ms[3 + j]);
    parts += buf;
  }
  char row[640];
  std::snprintf(row, sizeof row, "| %s | %s %dx%dx%d | %s | %.0f | %.0f | %+.1f%% | %.0f | %.2fx | %s | %s |",
                name.c_str(), g.layout == GemmLayout::Forward ? "fwd" : "dgrad", g.M, g.N, g.K,
                gemm_tile_name(tile), 1e3 * ms[0], 1e3 * ms[1], 100.0 * (ms[0] / ms[1] - 1.0), 1e3 * ms[2],
                ms[2] / ms[0], parts.c_str(), energy);
  std::printf("%s\n", row);
  std::fflush(stdout);
}

// The program into out (accumulated there or not): one row on the tile the trainer picks for it, or with
// --tiles one per tile it is compiled for.
template <GemmLayout kLayout, class Program>
void report(const std::string& name, const Gemm& g, const Program& program, bf16* out, bool accumulate,
            bf16* bare_out, const std::vector<Part>& chain) {
  if (name.find(g_only) == std::string::npos) {
    if (!g_steps.empty()) g_steps.back().complete = false;  // a step sum needs every program
    return;
  }
  const std::vector<GemmTile> tiles =
      g_every_tile ? gemm_tiles_compiled(kLayout, gemm_epilogue_of<Program>()) : std::vector<GemmTile>{g.tile(program)};
  for (GemmTile tile : tiles)
    report_on_tile(name, g, tile, [&](int i) { g.coda<kLayout>(tile, out, accumulate, program, i); }, bare_out,
                   chain);
}

// ---- GPT-2 (gpt2-124m, B=32 T=1024) ----
namespace gpt2 {

constexpr int B = 32, T = 1024, M = B * T, C = 768, F = 3072, Q = 2304, V = 50257, Vp = 50304;
constexpr float kEps = 1e-5f;

// The producers of the norms' statistics: norm1 and the final norm after a proj GEMM (K = F), norm2 after
// the out-projection (K = C).
int after_proj() { return gemm_row_partials(GemmLayout::Forward, M, C, F); }
int after_out_proj() { return gemm_row_partials(GemmLayout::Forward, M, C, C); }

// QKV, fc, LM head: LN(h) W^T + bias with the LayerNorm reparameterized; the chain is layernorm_forward +
// GEMM + (bias add, GELU | bias add | cross-entropy).
enum class LnLinear { Qkv, Fc, Head };

void ln_linear(Unfused& u, LnLinear kind) {
  using namespace prog::gpt2;
  Arena arena;
  const int N = kind == LnLinear::Qkv ? Q : kind == LnLinear::Fc ? F : Vp;
  const Gemm g(arena, GemmLayout::Forward, M, N, C, kAct);
  const prog::NormPartials stats = norm_partials(arena, M, C, kind == LnLinear::Fc ? after_out_proj() : after_proj(), true);
  const float* c = arena.random<float>(N, -0.5f, 0.5f);
  const float* b_prime = arena.random<float>(N, -0.5f, 0.5f);
  bf16* out = arena.alloc<bf16>(size_t(M) * N);
  bf16* bare_out = arena.alloc<bf16>(size_t(M) * N);
  // unfused: h (rotated with the GEMM's A), its LayerNorm output, mean / rstd, the GEMM output
  const bf16* gamma = arena.random<bf16>(C, 0.8f, 1.2f);
  const bf16* beta = arena.random<bf16>(C, -0.1f, 0.1f);
  const bf16* bias = arena.random<bf16>(N, -0.1f, 0.1f);
  bf16* normed = arena.alloc<bf16>(size_t(M) * C);
  float* mean = arena.alloc<float>(M);
  float* rstd = arena.alloc<float>(M);
  bf16* y = arena.alloc<bf16>(size_t(M) * N);
  std::vector<Part> chain{{"layernorm_forward", [&](int i) {
                             unfused::layernorm_forward(normed, mean, rstd, g.a(i), gamma, beta, M, C, kEps, nullptr);
                           }},
                          {"cublas", [&](int i) {
                             u.lt.gemm(y, normed, Op::N, g.b(i), Op::T, M, N, C, false, nullptr);
                           }}};
  if (kind == LnLinear::Qkv) {
    chain.push_back({"bias_add", [&](int) { unfused::bias_add(y, bias, M, N, nullptr); }});
    const auto program = ln_linear_program(stats, c, b_prime);
    report<GemmLayout::Forward>("gpt2 QKV forward", g, program, out, false, bare_out, chain);
  } else if (kind == LnLinear::Fc) {
    bf16* pre = arena.alloc<bf16>(size_t(M) * F);
    bf16* act = arena.alloc<bf16>(size_t(M) * F);
    chain.push_back({"bias_add", [&](int) { unfused::bias_add(y, bias, M, N, nullptr); }});
    chain.push_back({"gelu_forward", [&](int) { unfused::gelu_forward(act, y, size_t(M) * F, nullptr); }});
    const auto program = fc_program(stats, c, b_prime, pre, F);
    report<GemmLayout::Forward>("gpt2 fc forward", g, program, out, false, bare_out, chain);
  } else {
    const HeadLoss loss(arena, M, N, V);
    chain.push_back(loss.crossentropy(y, M, V, Vp));
    const auto program = lm_head_program(stats, c, b_prime, loss.targets, loss.target_logit, loss.lse_partials, V);
    report<GemmLayout::Forward>("gpt2 LM head", g, program, out, false, bare_out, chain);
  }
}

// MLP projection forward: h' = act Wproj^T + bias + h2, aux h', partials of h' and h'^2, O' = h' (.) gamma.
void residual(Unfused& u) {
  Arena arena;
  const Gemm g(arena, GemmLayout::Forward, M, C, F, kAct);
  const bf16* res = arena.random<bf16>(size_t(M) * C, -kAct, kAct);
  const bf16* bias = arena.random<bf16>(C, -0.1f, 0.1f);
  const bf16* gamma = arena.random<bf16>(C, 0.8f, 1.2f);
  bf16* h = arena.alloc<bf16>(size_t(M) * C);
  bf16* out = arena.alloc<bf16>(size_t(M) * C);
  bf16* bare_out = arena.alloc<bf16>(size_t(M) * C);
  float* sum = arena.alloc<float>(size_t(M) * max_row_partials(C));
  float* sumsq = arena.alloc<float>(size_t(M) * max_row_partials(C));
  bf16* proj = arena.alloc<bf16>(size_t(M) * C);
  bf16* h_unfused = arena.alloc<bf16>(size_t(M) * C);
  const auto program = prog::gpt2::residual_program(res, bias, h, C, gamma, sum, sumsq);
  const std::vector<Part> chain{
      {"cublas", [&](int i) { g.cublas(u.lt, proj, i); }},
      {"bias_add", [&](int) { unfused::bias_add(proj, bias, M, C, nullptr); }},
      {"residual_add", [&](int) { unfused::residual_add(h_unfused, res, proj, size_t(M) * C, nullptr); }}};
  report<GemmLayout::Forward>("gpt2 residual (proj) forward", g, program, out, false, bare_out, chain);
}

// MLP projection dgrad + GELU backward (+ the fc bias gradient and the row dots of the fc's
// LayerNorm backward); the chain: GEMM dgrad + gelu_backward + column_sum (fc bias).
void proj_dgrad(Unfused& u) {
  Arena arena;
  const Gemm g(arena, GemmLayout::Dgrad, M, F, C, kGrad);
  const bf16* pre = arena.random<bf16>(size_t(M) * F, -3.0f, 3.0f);
  const prog::NormPartials stats = norm_partials(arena, M, C, after_out_proj(), true);
  const float* c = arena.random<float>(F, -0.5f, 0.5f);
  const float* b_prime = arena.random<float>(F, -0.5f, 0.5f);
  const int dot_count = g.row_partials();
  const size_t dots = size_t(M) * max_row_partials(F);
  const prog::LnDots ln_dots{arena.alloc<float>(dots), arena.alloc<float>(dots), arena.alloc<float>(dots), dot_count};
  float* col_b = arena.alloc<float>(size_t(prog::column_partial_groups(M)) * F);
  bf16* out = arena.alloc<bf16>(size_t(M) * F);
  bf16* bare_out = arena.alloc<bf16>(size_t(M) * F);
  bf16* d_act = arena.alloc<bf16>(size_t(M) * F);
  bf16* d_up = arena.alloc<bf16>(size_t(M) * F);
  float* d_bias = arena.alloc<float>(F);
  CUDA_CHECK(cudaMemset(d_bias, 0, F * sizeof(float)));
  const auto program = prog::gpt2::proj_dgrad_program(pre, F, stats, c, b_prime, ln_dots, col_b);
  const std::vector<Part> chain{
      {"cublas", [&](int i) { g.cublas(u.lt, d_act, i); }},
      {"gelu_backward", [&](int) { unfused::gelu_backward(d_up, d_act, pre, size_t(M) * F, nullptr); }},
      {"column_sum", [&](int) { unfused::column_sum(d_bias, d_up, M, F, F, u.ws, nullptr); }}};
  report<GemmLayout::Dgrad>("gpt2 proj dgrad + GELU backward", g, program, out, false, bare_out, chain);
}

// The dgrad of a LayerNormed GEMM (weight [K, C]) with the LayerNorm backward, in place on d_residual, and
// u / r for the GEMM's weight gradient;
// stats_count: the norm statistics' producer; dot_count: the row dots' producer (the proj dgrad for fc,
// 1 for the attention write-out and dlogits).
// The chain: GEMM dgrad + layernorm_backward (accumulating, or writing fresh after the head) + column_sum
// of the new d_residual (the bias gradient of the projection below, which the program's last column dot
// replaces).
void ln_backward(Unfused& u, const std::string& name, int K, int stats_count, int dot_count, bool accumulate) {
  Arena arena;
  const Gemm g(arena, GemmLayout::Dgrad, M, C, K, kGrad);
  const prog::NormPartials stats = norm_partials(arena, M, C, stats_count, true);
  const size_t dots = size_t(M) * dot_count;
  const prog::LnDots ln_dots{arena.random<float>(dots, -0.1f, 0.1f), arena.random<float>(dots, -0.1f, 0.1f),
                             arena.random<float>(dots, -0.1f, 0.1f), dot_count};
  const bf16* h = arena.random<bf16>(size_t(M) * C, -kAct, kAct);
  const bf16* gamma = arena.random<bf16>(C, 0.8f, 1.2f);
  const bf16* beta = arena.random<bf16>(C, -0.2f, 0.2f);
  bf16* d_residual = arena.random<bf16>(size_t(M) * C, -kGrad, kGrad);
  bf16* norm_out_over_rstd = arena.alloc<bf16>(size_t(M) * C);
  const size_t cols = size_t(prog::column_partial_groups(M)) * C;
  const prog::gpt2::LnBackwardColumns ln_cols{arena.alloc<float>(cols), arena.alloc<float>(cols),
                                              arena.alloc<float>(cols)};
  bf16* bare_out = arena.alloc<bf16>(size_t(M) * C);
  bf16* d_norm = arena.alloc<bf16>(size_t(M) * C);
  bf16* d_residual_unfused = arena.random<bf16>(size_t(M) * C, -kGrad, kGrad);
  const float* mean = arena.random<float>(M, -0.1f, 0.1f);
  const float* rstd = arena.random<float>(M, 0.5f, 2.0f);
  float* d_gamma = arena.alloc<float>(C);
  float* d_beta = arena.alloc<float>(C);
  float* d_bias = arena.alloc<float>(C);
  for (float* p : {d_gamma, d_beta, d_bias}) CUDA_CHECK(cudaMemset(p, 0, C * sizeof(float)));
  const auto program =
      prog::gpt2::ln_backward_program(stats, ln_dots, h, C, gamma, beta, d_residual, ln_cols, norm_out_over_rstd);
  const std::vector<Part> chain{
      {"cublas", [&](int i) { g.cublas(u.lt, d_norm, i); }},
      {"layernorm_backward",
       [&](int) {
         unfused::layernorm_backward(d_residual_unfused, d_gamma, d_beta, d_norm, h, gamma, mean, rstd, M, C,
                                     accumulate, u.norm_partials, u.ws, nullptr);
       }},
      {"column_sum", [&](int) { unfused::column_sum(d_bias, d_residual_unfused, M, C, C, u.ws, nullptr); }}};
  report<GemmLayout::Dgrad>(name, g, program, d_residual, false, bare_out, chain);
}

void run(Unfused& u) {
  g_steps.push_back({"gpt2-124m", 12, 12});
  ln_linear(u, LnLinear::Qkv);
  ln_linear(u, LnLinear::Fc);
  residual(u);
  proj_dgrad(u);
  ln_backward(u, "gpt2 LN-backward dgrad (fc)", F, after_out_proj(), gemm_row_partials(GemmLayout::Dgrad, M, F, C),
              true);
  ln_backward(u, "gpt2 LN-backward dgrad (QKV)", Q, after_proj(), 1, true);
  g_steps.back().launches = 1;
  ln_backward(u, "gpt2 LN-backward dgrad (LM head)", Vp, after_proj(), 1, false);
  ln_linear(u, LnLinear::Head);
}

}  // namespace gpt2

// ---- Llama (llama3.2-1b, B=8 T=2048) ----
namespace llama {

constexpr int B = 8, T = 2048, M = B * T, C = 2048, F = 8192, n_head = 32, n_kv_head = 8, hd = 64;
constexpr int Q = (n_head + 2 * n_kv_head) * hd, V = 128256, Vp = 128256;
constexpr float kEps = 1e-5f, kTheta = 500000.0f;

int after_down() { return gemm_row_partials(GemmLayout::Forward, M, C, F); }
int after_out_proj() { return gemm_row_partials(GemmLayout::Forward, M, C, C); }

// QKV + RoPE, gate/up + SwiGLU, LM head: diag(r) (O W^T) then the rest of the program; the chain is
// rmsnorm_forward + GEMM + (rope | swiglu_forward | crossentropy_forward).
enum class Normed { Qkv, GateUp, Head };

void normed(Unfused& u, Normed kind) {
  using namespace prog::llama;
  Arena arena;
  const int N = kind == Normed::Qkv ? Q : kind == Normed::GateUp ? 2 * F : Vp;
  const Gemm g(arena, GemmLayout::Forward, M, N, C, kAct);
  const prog::NormPartials stats =
      norm_partials(arena, M, C, kind == Normed::GateUp ? after_out_proj() : after_down(), false);
  bf16* bare_out = arena.alloc<bf16>(size_t(M) * N);
  const bf16* gamma = arena.random<bf16>(C, 0.8f, 1.2f);
  bf16* normed_h = arena.alloc<bf16>(size_t(M) * C);
  float* rstd = arena.alloc<float>(M);
  bf16* y = arena.alloc<bf16>(size_t(M) * N);
  std::vector<Part> chain{
      {"rmsnorm_forward",
       [&](int i) { unfused::rmsnorm_forward(normed_h, rstd, g.a(i), gamma, M, C, kEps, nullptr); }},
      {"cublas", [&](int i) { u.lt.gemm(y, normed_h, Op::N, g.b(i), Op::T, M, N, C, false, nullptr); }}};
  if (kind == Normed::Qkv) {
    const std::vector<float2> table = unfused::rope_table(T, hd, kTheta);
    auto* rope_table = arena.alloc<float2>(table.size());
    CUDA_CHECK(cudaMemcpy(rope_table, table.data(), table.size() * sizeof(float2), cudaMemcpyHostToDevice));
    bf16* out = arena.alloc<bf16>(size_t(M) * N);
    chain.push_back({"rope", [&](int) { unfused::rope(y, rope_table, B, T, n_head, n_kv_head, hd, false, nullptr); }});
    const auto program = qkv_program(stats, epi::Rope<hd>{T, (n_head + n_kv_head) * hd, std::log2(kTheta)});
    report<GemmLayout::Forward>("llama QKV + RoPE", g, program, out, false, bare_out, chain);
  } else if (kind == Normed::GateUp) {
    bf16* gu = arena.alloc<bf16>(size_t(M) * N);
    bf16* act = arena.alloc<bf16>(size_t(M) * F);
    bf16* act_unfused = arena.alloc<bf16>(size_t(M) * F);
    chain.push_back({"swiglu_forward", [&](int) { unfused::swiglu_forward(act_unfused, y, M, F, nullptr); }});
    const auto program = gate_up_program(stats, gu, N);
    report<GemmLayout::Forward>("llama gate/up + SwiGLU", g, program, act, false, bare_out, chain);
  } else {
    const HeadLoss loss(arena, M, N, V);
    bf16* out = arena.alloc<bf16>(size_t(M) * N);
    chain.push_back(loss.crossentropy(y, M, V, Vp));
    const auto program = lm_head_program(stats, loss.targets, loss.target_logit, loss.lse_partials, V);
    report<GemmLayout::Forward>("llama LM head", g, program, out, false, bare_out, chain);
  }
}

// Down projection forward: h' = act Wdown^T + h2, aux h', partials of h'^2, O' = h' (.) gamma.
void residual(Unfused& u) {
  Arena arena;
  const Gemm g(arena, GemmLayout::Forward, M, C, F, kAct);
  const bf16* res = arena.random<bf16>(size_t(M) * C, -kAct, kAct);
  const bf16* gamma = arena.random<bf16>(C, 0.8f, 1.2f);
  bf16* h = arena.alloc<bf16>(size_t(M) * C);
  bf16* out = arena.alloc<bf16>(size_t(M) * C);
  bf16* bare_out = arena.alloc<bf16>(size_t(M) * C);
  float* sumsq = arena.alloc<float>(size_t(M) * max_row_partials(C));
  bf16* proj = arena.alloc<bf16>(size_t(M) * C);
  bf16* h_unfused = arena.alloc<bf16>(size_t(M) * C);
  const auto program = prog::llama::residual_program(res, h, C, gamma, sumsq);
  const std::vector<Part> chain{
      {"cublas", [&](int i) { g.cublas(u.lt, proj, i); }},
      {"residual_add", [&](int) { unfused::residual_add(h_unfused, res, proj, size_t(M) * C, nullptr); }}};
  report<GemmLayout::Forward>("llama residual (down) forward", g, program, out, false, bare_out, chain);
}

// Down-projection dgrad + SwiGLU backward (1 -> 2 columns: writes d(g, u) [M, 2F]); chain: GEMM dgrad +
// swiglu_backward.
void down_dgrad(Unfused& u) {
  Arena arena;
  const Gemm g(arena, GemmLayout::Dgrad, M, F, C, kGrad);
  const bf16* gu = arena.random<bf16>(size_t(M) * 2 * F, -3.0f, 3.0f);
  const prog::NormPartials stats = norm_partials(arena, M, C, after_out_proj(), false);
  float* dots = arena.alloc<float>(size_t(M) * max_row_partials(2 * F));
  bf16* out = arena.alloc<bf16>(size_t(M) * 2 * F);
  bf16* bare_out = arena.alloc<bf16>(size_t(M) * F);
  bf16* d_act = arena.alloc<bf16>(size_t(M) * F);
  bf16* d_gu = arena.alloc<bf16>(size_t(M) * 2 * F);
  const auto program = prog::llama::swiglu_backward_program(gu, 2 * F, stats, dots);
  const std::vector<Part> chain{
      {"cublas", [&](int i) { g.cublas(u.lt, d_act, i); }},
      {"swiglu_backward", [&](int) { unfused::swiglu_backward(d_gu, d_act, gu, M, F, nullptr); }}};
  report<GemmLayout::Dgrad>("llama down dgrad + SwiGLU backward", g, program, out, false, bare_out, chain);
}

// The dgrad of a normed GEMM (weight [K, C]) with the RMSNorm backward, adding into d_residual (or writing
// it fresh after the head); stats_count, dot_count: the producers' partials per row. Chain: GEMM dgrad +
// rmsnorm_backward.
void norm_backward(Unfused& u, const std::string& name, int K, int stats_count, int dot_count, bool accumulate) {
  Arena arena;
  const Gemm g(arena, GemmLayout::Dgrad, M, C, K, kGrad);
  const prog::NormPartials stats = norm_partials(arena, M, C, stats_count, false);
  const float* dots = arena.random<float>(size_t(M) * dot_count, -0.1f, 0.1f);
  const bf16* h = arena.random<bf16>(size_t(M) * C, -kAct, kAct);
  const bf16* gamma = arena.random<bf16>(C, 0.8f, 1.2f);
  float* dgamma_partials = arena.alloc<float>(size_t(prog::column_partial_groups(M)) * C);
  bf16* d_residual = arena.random<bf16>(size_t(M) * C, -kGrad, kGrad);
  bf16* bare_out = arena.alloc<bf16>(size_t(M) * C);
  bf16* d_norm = arena.alloc<bf16>(size_t(M) * C);
  bf16* d_residual_unfused = arena.random<bf16>(size_t(M) * C, -kGrad, kGrad);
  const float* rstd = arena.random<float>(M, 0.5f, 2.0f);
  float* d_gamma = arena.alloc<float>(C);
  CUDA_CHECK(cudaMemset(d_gamma, 0, C * sizeof(float)));
  const auto program = prog::llama::norm_backward_program(stats, dots, dot_count, h, C, gamma, dgamma_partials);
  const std::vector<Part> chain{
      {"cublas", [&](int i) { g.cublas(u.lt, d_norm, i); }},
      {"rmsnorm_backward", [&](int) {
         unfused::rmsnorm_backward(d_residual_unfused, d_gamma, d_norm, h, gamma, rstd, M, C, accumulate,
                                   u.norm_partials, u.ws, nullptr);
       }}};
  report<GemmLayout::Dgrad>(name, g, program, d_residual, accumulate, bare_out, chain);
}

void run(Unfused& u) {
  g_steps.push_back({"llama3.2-1b", 16, 16});
  normed(u, Normed::Qkv);
  normed(u, Normed::GateUp);
  residual(u);
  down_dgrad(u);
  norm_backward(u, "llama norm-backward dgrad (gate/up)", 2 * F, after_out_proj(),
                gemm_row_partials(GemmLayout::Dgrad, M, F, C), true);
  norm_backward(u, "llama norm-backward dgrad (QKV)", Q, after_down(), 1, true);
  g_steps.back().launches = 1;
  norm_backward(u, "llama norm-backward dgrad (LM head)", Vp, after_down(), 1, false);
  normed(u, Normed::Head);
}

}  // namespace llama

}  // namespace

int main(int argc, char** argv) {
  std::string model = "both";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--runs") == 0 && i + 1 < argc)
      g_timed_runs = std::max(1, std::atoi(argv[++i]));
    else if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc)
      model = argv[++i];
    else if (std::strcmp(argv[i], "--tiles") == 0)
      g_every_tile = true;
    else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc)
      g_only = argv[++i];
    else {
      std::fprintf(stderr,
                   "bench_programs: unknown argument %s (usage: bench_programs [--runs N] [--model gpt2|llama] "
                   "[--tiles] [--only TEXT])\n",
                   argv[i]);
      return 2;
    }
  }
  if (model != "both" && model != "gpt2" && model != "llama") {
    std::fprintf(stderr, "bench_programs: --model %s: expected gpt2 or llama\n", model.c_str());
    return 2;
  }
  try {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs; median of %d timed runs, microseconds\n", prop.name, prop.multiProcessorCount,
                g_timed_runs);
    std::printf("| program | GEMM M x N x K | tile | CODA | bare | overhead | unfused chain | chain / CODA | chain parts "
                "| CODA mJ | bare mJ | chain mJ | cuBLASLt mJ | chain J / CODA J | epilogue mJ | removed mJ |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    Unfused u(2 * llama::F);
    if (model != "llama") gpt2::run(u);
    if (model != "gpt2") llama::run(u);
    CUDA_CHECK(cudaDeviceSynchronize());
    for (const StepEnergy& step : g_steps)
      if (!g_every_tile && step.complete)
        std::printf("%s, a step of these programs (%d layers and the head): mainloops %+.2f J against cuBLASLt's, "
                    "epilogues %+.2f J against the kernels they remove\n",
                    step.model.c_str(), step.layers, 1e-3 * step.mainloop_mj, 1e-3 * step.epilogue_mj);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_programs: %s\n", e.what());
    return 1;
  }
  return 0;
}
