// Tests of the CPU reference model (ref_model.hpp), the CPU backend and CPU AdamW: whole-model gradients
// against central differences of the loss for both architectures (GQA and an untied head for Llama),
// the padded vocabulary, causality, determinism, the Backend contract, a hand-computed AdamW update
// and a few optimizer steps that must lower the loss.
#include <gtest/gtest.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "adamw.hpp"
#include "backend.hpp"
#include "ref_gradcheck.hpp"
#include "ref_model.hpp"
#include "rng.hpp"

namespace {

using coda::Arch;
using coda::ModelConfig;
using coda::ParamLayout;
using coda::ParamTensor;
using coda::Rng;
using coda::test::grad_matches;
using coda::test::random_vector;
namespace ref = coda::ref;

ModelConfig gpt2_config() {
  ModelConfig c;
  c.set_arch(Arch::GPT2);
  c.n_layer = 2;
  c.d_model = 32;
  c.n_head = 4;
  c.n_kv_head = 4;
  c.d_ff = 128;
  c.vocab_size = 100;  // padded to 128
  c.max_seq_len = 7;   // so every wpe row is used by the T = 7 batches below
  return c;
}

ModelConfig llama_config() {
  ModelConfig c;
  c.set_arch(Arch::Llama);
  c.n_layer = 2;
  c.d_model = 32;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.d_ff = 48;
  c.vocab_size = 100;
  c.max_seq_len = 16;
  c.rope_theta = 1000.0f;
  c.tied_head = false;
  return c;
}

// Llama's shape with Qwen2's features (the QKV bias), its RoPE base and a tied head.
ModelConfig qwen2_config() {
  ModelConfig c = llama_config();
  c.set_arch(Arch::Qwen2);
  c.rope_theta = 1e6f;
  c.tied_head = true;
  return c;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch random_batch(int B, int T, int V, Rng& rng) {
  Batch batch{std::vector<int32_t>(B * T), std::vector<int32_t>(B * T)};
  for (int n = 0; n < B * T; ++n) {
    batch.tokens[n] = static_cast<int32_t>(rng.below(V));
    batch.targets[n] = static_cast<int32_t>(rng.below(V));
  }
  return batch;
}

// Rows of a tensor that carry real parameters (the padded vocabulary rows stay zero).
size_t real_rows(const ParamTensor& tensor, const ModelConfig& c) {
  return tensor.name == "wte" || tensor.name == "lm_head" ? c.vocab_size : static_cast<size_t>(tensor.shape[0]);
}

// Parameters of a trained-looking scale, so every path carries signal: matrices ~ 1/sqrt(fan-in),
// norm gains around 1, non-zero biases, O(1) logits.
void randomize(ref::RefModel& model, Rng& rng) {
  for (const ParamTensor& tensor : model.layout.tensors) {
    const size_t cols = tensor.shape.size() > 1 ? tensor.shape[1] : 1;
    const bool norm_gain = tensor.name.find("norm") != std::string::npos && tensor.name.back() == 'w';
    const bool vector = tensor.shape.size() == 1;
    const bool embedding = tensor.name == "wte" || tensor.name == "wpe" || tensor.name == "lm_head";
    const float stddev = norm_gain || vector ? 0.2f : embedding ? 0.4f : 0.7f / std::sqrt(static_cast<float>(cols));
    for (size_t i = 0; i < real_rows(tensor, model.config) * cols; ++i)
      model.params[tensor.offset + i] = (norm_gain ? 1.0f : 0.0f) + stddev * static_cast<float>(rng.normal());
  }
}

// Central differences of the mean loss (summed in double) on random elements of EVERY tensor.
void check_model_gradient(const ModelConfig& config, uint64_t seed) {
  Rng rng(seed);
  const int B = 2, T = 7;
  ref::RefModel model(config, B, T);
  randomize(model, rng);
  const Batch batch = random_batch(B, T, config.vocab_size, rng);
  model.zero_grad();
  model.forward(batch.tokens.data(), batch.targets.data(), B, T);
  model.backward(1.0f);
  auto loss = [&] {
    model.forward(batch.tokens.data(), batch.targets.data(), B, T);
    double sum = 0.0;
    for (int n = 0; n < B * T; ++n) sum += model.acts.losses[n];
    return sum / (B * T);
  };
  for (const ParamTensor& tensor : model.layout.tensors) {
    const size_t cols = tensor.shape.size() > 1 ? tensor.shape[1] : 1;
    std::vector<size_t> indices;
    for (size_t k : coda::test::sample_indices(real_rows(tensor, config) * cols, 8, rng))
      indices.push_back(tensor.offset + k);
    EXPECT_TRUE(grad_matches(tensor.name, model.params.data(), model.grads, loss, 1e-2f, indices, 1e-2));
  }
}

TEST(RefModel, Gpt2GradientMatchesFiniteDifferences) { check_model_gradient(gpt2_config(), 21); }
TEST(RefModel, LlamaGqaUntiedGradientMatchesFiniteDifferences) { check_model_gradient(llama_config(), 22); }
// Qwen2: RMSNorm, SwiGLU, RoPE and a bias on q, k and v (added before the rotation), tied head.
TEST(RefModel, Qwen2QkvBiasGradientMatchesFiniteDifferences) { check_model_gradient(qwen2_config(), 24); }

// Padded vocabulary rows and the alignment padding between tensors never receive gradient.
TEST(RefModel, PaddingGetsNoGradient) {
  for (const ModelConfig& config : {gpt2_config(), llama_config(), qwen2_config()}) {
    Rng rng(23);
    ref::RefModel model(config, 2, 7);
    randomize(model, rng);
    const Batch batch = random_batch(2, 7, config.vocab_size, rng);
    model.zero_grad();
    model.forward(batch.tokens.data(), batch.targets.data(), 2, 7);
    model.backward(1.0f);
    std::vector<bool> real(model.layout.total, false);
    for (const ParamTensor& tensor : model.layout.tensors) {
      const size_t cols = tensor.shape.size() > 1 ? tensor.shape[1] : 1;
      for (size_t i = 0; i < real_rows(tensor, config) * cols; ++i) real[tensor.offset + i] = true;
    }
    size_t nonzero_real = 0;
    for (size_t i = 0; i < model.layout.total; ++i) {
      if (real[i])
        nonzero_real += model.grads[i] != 0.0f;
      else
        ASSERT_EQ(model.grads[i], 0.0f) << "padding element " << i;
    }
    EXPECT_GT(nonzero_real, model.layout.num_parameters() / 2);
  }
}

// The logits of position t depend on tokens 0..t only.
TEST(RefModel, Causal) {
  for (const ModelConfig& config : {gpt2_config(), llama_config(), qwen2_config()}) {
    Rng rng(24);
    const int B = 2, T = 7, Vp = config.padded_vocab();
    ref::RefModel model(config, B, T);
    randomize(model, rng);
    Batch batch = random_batch(B, T, config.vocab_size, rng);
    model.forward(batch.tokens.data(), nullptr, B, T);
    const std::vector<float> before = model.acts.logits;
    batch.tokens[T + 4] = (batch.tokens[T + 4] + 1) % config.vocab_size;  // sequence 1, position 4
    model.forward(batch.tokens.data(), nullptr, B, T);
    for (int n = 0; n < B * T; ++n) {
      const bool may_change = n >= T + 4;
      bool changed = false;
      for (int v = 0; v < Vp; ++v) changed |= model.acts.logits[n * Vp + v] != before[n * Vp + v];
      EXPECT_EQ(changed, may_change) << arch_name(config.arch) << " row " << n;
    }
  }
}

TEST(RefModel, SameSeedIsBitIdentical) {
  for (const ModelConfig& config : {gpt2_config(), llama_config(), qwen2_config()}) {
    const int B = 2, T = 7;
    Rng rng(25);
    const Batch batch = random_batch(B, T, config.vocab_size, rng);
    auto run = [&](uint64_t seed, std::vector<float>* grads) {
      ref::RefModel model(config, B, T);
      model.init(seed);
      const float loss = model.forward(batch.tokens.data(), batch.targets.data(), B, T);
      model.backward(1.0f);
      *grads = model.grads;
      return loss;
    };
    std::vector<float> grads_a, grads_b, grads_c;
    const float loss_a = run(7, &grads_a), loss_b = run(7, &grads_b), loss_c = run(8, &grads_c);
    EXPECT_EQ(std::memcmp(&loss_a, &loss_b, sizeof(float)), 0);
    EXPECT_EQ(grads_a, grads_b);
    EXPECT_NE(loss_a, loss_c);
    EXPECT_NEAR(loss_a, std::log(static_cast<float>(config.vocab_size)), 0.1);  // small init: near uniform
  }
}

// init_params draws every element from a counter-based stream: the same values on one thread as on
// several, the standard deviations the recipe asks for, and different values for another seed.
TEST(RefModel, InitIsThreadCountIndependentWithTheRecipesStatistics) {
  ModelConfig config = gpt2_config();
  config.n_layer = 4;
  config.d_model = 256;
  config.d_ff = 1024;
  config.vocab_size = 1000;
  const ParamLayout layout = coda::make_param_layout(config);
  std::vector<float> parallel(layout.total), serial(layout.total), other(layout.total);
  coda::init_params(config, layout, 3, parallel.data());
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
  coda::init_params(config, layout, 3, serial.data());
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif
  coda::init_params(config, layout, 4, other.data());
  EXPECT_EQ(parallel, serial);
  EXPECT_NE(parallel, other);
  auto stddev_of = [&](const char* name) {
    for (const ParamTensor& t : layout.tensors)
      if (t.name == name) {
        double sum = 0.0, sumsq = 0.0;
        const size_t n = real_rows(t, config) * (t.shape.size() > 1 ? t.shape[1] : 1);
        for (size_t i = 0; i < n; ++i) {
          const double x = parallel[t.offset + i];
          sum += x;
          sumsq += x * x;
        }
        const double stddev = std::sqrt(sumsq / n);
        EXPECT_NEAR(sum / n, 0.0, 5.0 * stddev / std::sqrt(double(n))) << name;  // the mean within 5 sigma
        return stddev;
      }
    ADD_FAILURE() << "no tensor " << name;
    return 0.0;
  };
  EXPECT_NEAR(stddev_of("wte"), 0.02, 0.02 * 0.02);
  EXPECT_NEAR(stddev_of("h.0.attn_proj_w"), 0.02 / std::sqrt(8.0), 0.02 / std::sqrt(8.0) * 0.02);
}

// Backend contract: loss of forward_backward and forward_loss agree, gradients scale with grad_scale and
// accumulate across calls, last_logits and grad_norm read what the model computed.
TEST(CpuBackend, Contract) {
  const ModelConfig config = llama_config();
  const int B = 3, T = 5, V = config.vocab_size;
  Rng rng(26);
  ref::RefModel model(config, B, T);
  randomize(model, rng);
  const Batch batch = random_batch(B, T, V, rng);
  auto backend = coda::make_cpu_backend(config, B, T);
  EXPECT_EQ(backend->name(), "cpu");
  backend->load_params(model.params.data());
  std::vector<float> read(model.layout.total);
  backend->read_params(read.data());
  EXPECT_EQ(read, model.params);

  const float loss = model.forward(batch.tokens.data(), batch.targets.data(), B, T);
  model.zero_grad();
  model.backward(1.0f);
  backend->zero_grad();
  EXPECT_EQ(backend->forward_backward(batch.tokens.data(), batch.targets.data(), B, T, 0.5f), loss);
  EXPECT_EQ(backend->forward_backward(batch.tokens.data(), batch.targets.data(), B, T, 0.5f), loss);
  EXPECT_EQ(backend->forward_loss(batch.tokens.data(), batch.targets.data(), B, T), loss);
  std::vector<float> grads(model.layout.total);
  backend->read_grads(grads.data());
  double sum = 0.0, diff = 0.0;  // two halves accumulate to the whole gradient, up to rounding
  for (size_t i = 0; i < grads.size(); ++i) {
    sum += static_cast<double>(model.grads[i]) * model.grads[i];
    diff += (static_cast<double>(grads[i]) - model.grads[i]) * (grads[i] - model.grads[i]);
  }
  EXPECT_LT(std::sqrt(diff / sum), 1e-6);
  EXPECT_NEAR(backend->grad_norm(), std::sqrt(sum), 1e-6 * std::sqrt(sum));

  std::vector<float> last(B * V);
  backend->last_logits(batch.tokens.data(), B, T, last.data());
  for (int b = 0; b < B; ++b)
    for (int v = 0; v < V; ++v)
      ASSERT_EQ(last[b * V + v], model.acts.logits[((b * T + T - 1) * config.padded_vocab()) + v]);

  EXPECT_THROW(backend->forward_loss(batch.tokens.data(), batch.targets.data(), B, T + 1), std::invalid_argument);
  std::vector<int32_t> bad = batch.tokens;
  bad[2] = V;
  EXPECT_THROW(backend->forward_loss(bad.data(), batch.targets.data(), B, T), std::invalid_argument);
}

// Two AdamW steps on a few elements against the formula evaluated in double, with the decay mask.
TEST(AdamW, MatchesHandComputedUpdate) {
  const ModelConfig config = llama_config();
  const coda::ParamLayout layout = coda::make_param_layout(config);
  Rng rng(27);
  const size_t n = layout.total;
  auto params = random_vector(n, rng, 0.5f), grads1 = random_vector(n, rng), grads2 = random_vector(n, rng);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  const auto initial = params;
  coda::AdamWHyper hyper;
  hyper.lr = 0.01f;
  hyper.beta1 = 0.8f;
  hyper.beta2 = 0.9f;
  hyper.eps = 1e-6f;
  hyper.weight_decay = 0.2f;
  const float grad_scale = 0.5f;
  coda::adamw_update(layout, params.data(), grads1.data(), m.data(), v.data(), hyper, 1, grad_scale);
  coda::adamw_update(layout, params.data(), grads2.data(), m.data(), v.data(), hyper, 2, grad_scale);

  struct Element {
    const char* tensor;
    size_t index;
    bool decays;
  };
  for (const Element& e : {Element{"h.0.qkv_w", 5, true}, Element{"lm_head", 77, true},
                           Element{"h.1.norm2_w", 3, false}, Element{"wte", 40, false}}) {
    const ParamTensor& tensor = layout.find(e.tensor);
    ASSERT_EQ(tensor.weight_decay, e.decays) << e.tensor;
    const size_t i = tensor.offset + e.index;
    double p = initial[i], mom = 0.0, var = 0.0;
    for (int step = 1; step <= 2; ++step) {
      const double g = grad_scale * static_cast<double>(step == 1 ? grads1[i] : grads2[i]);
      mom = hyper.beta1 * mom + (1.0 - hyper.beta1) * g;
      var = hyper.beta2 * var + (1.0 - hyper.beta2) * g * g;
      const double m_hat = mom / (1.0 - std::pow(hyper.beta1, step)), v_hat = var / (1.0 - std::pow(hyper.beta2, step));
      p -= hyper.lr * (m_hat / (std::sqrt(v_hat) + hyper.eps) + (e.decays ? hyper.weight_decay * p : 0.0));
    }
    EXPECT_NEAR(params[i], p, 1e-6) << e.tensor;
    EXPECT_NEAR(m[i], mom, 1e-6) << e.tensor;
    EXPECT_NEAR(v[i], var, 1e-6) << e.tensor;
  }
  // Alignment padding after a norm gain (32 elements, aligned to 64) is left alone.
  const ParamTensor& norm = layout.find("h.0.norm1_w");
  ASSERT_LT(norm.numel, coda::kParamAlign);
  EXPECT_EQ(params[norm.offset + norm.numel], initial[norm.offset + norm.numel]);
  EXPECT_EQ(m[norm.offset + norm.numel], 0.0f);
  EXPECT_THROW(coda::adamw_update(layout, params.data(), grads1.data(), m.data(), v.data(), hyper, 0, 1.0f),
               std::invalid_argument);
}

// A few AdamW steps on one fixed batch must fit it: the loss falls well below its starting value.
TEST(CpuBackend, AdamWStepsLowerTheLossOnAFixedBatch) {
  for (const ModelConfig& config : {gpt2_config(), llama_config(), qwen2_config()}) {
    const int B = 2, T = 7;
    Rng rng(28);
    const Batch batch = random_batch(B, T, config.vocab_size, rng);
    ref::RefModel init(config, B, T);
    init.init(28);
    auto backend = coda::make_cpu_backend(config, B, T);
    backend->load_params(init.params.data());
    coda::AdamWHyper hyper;
    hyper.lr = 1e-2f;
    std::vector<float> losses;
    for (int step = 1; step <= 12; ++step) {
      backend->zero_grad();
      losses.push_back(backend->forward_backward(batch.tokens.data(), batch.targets.data(), B, T, 1.0f));
      backend->adamw_step(hyper, step, 1.0f);
    }
    for (size_t k = 1; k < losses.size(); ++k) EXPECT_LT(losses[k], losses[k - 1]) << "step " << k + 1;
    EXPECT_LT(losses.back(), 0.7f * losses.front());
  }
}

}  // namespace

// 15 AdamW steps on one fixed batch from the same weights, fp32 (no recipe) or emulated FP8: the losses,
// and whether the FP8 state was empty at the end.
struct Fp8Run {
  std::vector<float> losses;
  bool state_empty = true;
};
Fp8Run fp8_training_run(const ModelConfig& config, const std::optional<coda::Fp8Recipe>& recipe) {
  const int B = 2, T = 7, steps = 15;
  Rng rng(31);
  const Batch batch = random_batch(B, T, config.vocab_size, rng);
  ref::RefModel model(config, B, T);
  model.init(31);
  if (recipe) model.enable_fp8(*recipe);
  std::vector<float> m(model.layout.total, 0.0f), v(model.layout.total, 0.0f);
  coda::AdamWHyper hyper;
  hyper.lr = 2e-3f;
  Fp8Run run;
  for (int step = 1; step <= steps; ++step) {
    model.zero_grad();
    run.losses.push_back(model.forward(batch.tokens.data(), batch.targets.data(), B, T, true));
    model.backward(1.0f);
    if (recipe) model.fp8_end_step(step - 1);
    coda::adamw_update(model.layout, model.params.data(), model.grads.data(), m.data(), v.data(), hyper, step, 1.0f);
  }
  run.state_empty = model.fp8_state().empty();
  return run;
}

// FP8 emulation (RefModel::enable_fp8), the specification of the FP8 training mode: every architecture
// trained in fp32 and in emulated FP8 (delayed scaling, history 16, margin 0), the four block linears and
// the four with the LM head. The first step calibrates (fp32, the amax recorded: the same loss); from the
// second the quantization is really there (the losses differ), and the FP8 run ends within 0.5% of the fp32
// loss, both well below where they started.
TEST(RefModel, Fp8EmulationTracksFp32Training) {
  for (const ModelConfig& config : {gpt2_config(), llama_config(), qwen2_config()}) {
    const std::vector<float> fp32 = fp8_training_run(config, std::nullopt).losses;
    for (unsigned linears : {0xFu, 0xFu | 1u << coda::kFp8Head}) {
      const Fp8Run fp8 = fp8_training_run(config, coda::Fp8Recipe{16, 0, linears});
      const std::string name = std::string(arch_name(config.arch)) + " linears " + std::to_string(linears);
      EXPECT_EQ(fp8.losses[0], fp32[0]) << name << ": the calibration step computes in fp32";
      EXPECT_NE(fp8.losses[1], fp32[1]) << name << ": from the second step the linears are FP8";
      EXPECT_FALSE(fp8.state_empty) << name;
      EXPECT_LT(fp32.back(), fp32.front() - 1.0f) << name;
      EXPECT_NEAR(fp8.losses.back(), fp32.back(), 0.005 * fp32.back()) << name;
    }
  }
}

// Block scaling (Fp8Recipe::block): FP8 from the first step on (no calibration, so the first loss already
// differs from fp32's), no state kept, and the run ends within 0.5% of the fp32 loss, as the delayed
// recipe does.
TEST(RefModel, Fp8BlockScalingTracksFp32Training) {
  for (const ModelConfig& config : {gpt2_config(), llama_config(), qwen2_config()}) {
    const std::vector<float> fp32 = fp8_training_run(config, std::nullopt).losses;
    const Fp8Run fp8 = fp8_training_run(config, coda::Fp8Recipe{16, 0, 0xF, 0xF});
    const std::string name = arch_name(config.arch);
    EXPECT_NE(fp8.losses[0], fp32[0]) << name << ": block scaling quantizes from the first step";
    EXPECT_TRUE(fp8.state_empty) << name << ": block scaling keeps no state between steps";
    EXPECT_NEAR(fp8.losses.back(), fp32.back(), 0.005 * fp32.back()) << name;
  }
}

// Block scaling takes no delayed-scaling state (a checkpoint of a tensor-scaled run is refused with the
// reason), and a value that is not finite in a copied tensor stops the forward with the tensor's name.
TEST(RefModel, Fp8BlockScalingRefusesDelayedStateAndNonFiniteValues) {
  const ModelConfig config = llama_config();
  const int B = 2, T = 7;
  Rng rng(9);
  const Batch batch = random_batch(B, T, config.vocab_size, rng);
  ref::RefModel tensor_scaled(config, B, T);
  tensor_scaled.init(9);
  tensor_scaled.enable_fp8(coda::Fp8Recipe{4, 0});
  tensor_scaled.forward(batch.tokens.data(), batch.targets.data(), B, T, true);
  tensor_scaled.backward(1.0f);
  tensor_scaled.fp8_end_step(0);
  ref::RefModel block(config, B, T);
  block.init(9);
  block.enable_fp8(coda::Fp8Recipe{4, 0, 0xF, 0xF});
  try {
    block.load_fp8_state(tensor_scaled.fp8_state());
    ADD_FAILURE() << "a delayed-scaling state was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_scaling = block"), std::string::npos) << e.what();
  }
  block.load_fp8_state({});
  block.params[block.layout.layers[0].norm1_w] = std::nanf("");
  try {
    block.forward(batch.tokens.data(), batch.targets.data(), B, T, true);
    ADD_FAILURE() << "a NaN reached the FP8 copies unreported";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0 qkv input"), std::string::npos) << e.what();
  }
}

// An evaluation forward quantizes with the scales as they are and records nothing: the state after it is
// the state before, and the scaling state read back and loaded into a fresh model continues identically.
TEST(RefModel, Fp8EvaluationLeavesTheScalesAndTheStateRoundTrips) {
  const ModelConfig config = llama_config();
  const int B = 2, T = 7;
  Rng rng(8);
  const Batch batch = random_batch(B, T, config.vocab_size, rng), other = random_batch(B, T, config.vocab_size, rng);
  ref::RefModel model(config, B, T);
  model.init(8);
  model.enable_fp8(coda::Fp8Recipe{4, 1});
  EXPECT_TRUE(model.fp8_state().empty()) << "no state before the first step closes";
  for (int step = 0; step < 3; ++step) {
    model.forward(batch.tokens.data(), batch.targets.data(), B, T, true);
    model.backward(1.0f);
    model.fp8_end_step(step);
  }
  const coda::Fp8ScalingState state = model.fp8_state();
  ASSERT_EQ(state.amax.size(), static_cast<size_t>(coda::Fp8Tensors(config.n_layer, false).count()) * 4);
  const float eval_loss = model.forward(other.tokens.data(), other.targets.data(), B, T);
  model.fp8_end_step(3);  // a step in which only an evaluation ran records zeros
  coda::Fp8ScalingState after_eval = model.fp8_state();
  for (size_t t = 0; t < after_eval.amax.size(); t += 4) EXPECT_EQ(after_eval.amax[t + 3], 0.0f) << "tensor " << t / 4;

  ref::RefModel restored(config, B, T);
  restored.params = model.params;
  restored.enable_fp8(coda::Fp8Recipe{4, 1});
  restored.load_fp8_state(after_eval);
  EXPECT_EQ(restored.fp8_state().amax, after_eval.amax);
  const float again = model.forward(other.tokens.data(), other.targets.data(), B, T);
  EXPECT_EQ(again, eval_loss) << "the evaluation changed the scales";
  EXPECT_EQ(restored.forward(other.tokens.data(), other.targets.data(), B, T), again);

  coda::Fp8ScalingState wrong = state;
  wrong.history = 8;
  EXPECT_THROW(restored.load_fp8_state(wrong), std::invalid_argument);
  wrong = state;
  wrong.amax.pop_back();
  EXPECT_THROW(restored.load_fp8_state(wrong), std::invalid_argument);
  ref::RefModel fp32(config, B, T);
  EXPECT_THROW(fp32.load_fp8_state(state), std::invalid_argument);
}

// Two training steps of the small llama on one batch (plain gradient steps of 1e-2), FP8 per the recipe if
// any: their losses, and the scaling state after them.
struct TwoSteps {
  ModelConfig config = llama_config();
  int B = 2, T = 7;
  uint64_t seed;
  Batch batch;
  explicit TwoSteps(uint64_t s) : seed(s) {
    Rng rng(s);
    batch = random_batch(B, T, config.vocab_size, rng);
  }
  std::vector<float> operator()(std::optional<coda::Fp8Recipe> recipe, coda::Fp8ScalingState* state = nullptr) const {
    ref::RefModel model(config, B, T);
    model.init(seed);
    if (recipe) model.enable_fp8(*recipe);
    std::vector<float> losses;
    for (int step = 0; step < 2; ++step) {
      model.zero_grad();
      losses.push_back(model.forward(batch.tokens.data(), batch.targets.data(), B, T, true));
      model.backward(1.0f);
      if (recipe) model.fp8_end_step(step);
      for (size_t i = 0; i < model.params.size(); ++i) model.params[i] -= 1e-2f * model.grads[i];
    }
    if (state != nullptr) *state = model.fp8_state();
    return losses;
  }
  // The two-step histories of a state of the tensors `tensors`: some amax recorded for exactly the tensors of
  // the `recording` linears.
  void expect_recorded(const coda::Fp8ScalingState& state, unsigned recording, const coda::Fp8Tensors& tensors) const {
    ASSERT_EQ(state.amax.size(), static_cast<size_t>(tensors.count()) * 2);
    for (coda::Fp8Role role : {coda::Fp8Role::Input, coda::Fp8Role::Weight, coda::Fp8Role::OutputGrad})
      for (int layer = 0; layer < tensors.layers(); ++layer)
        for (int linear = 0; linear < coda::kFp8Linears; ++linear) {
          const bool head = layer == config.n_layer;
          const int t = tensors.index(role, 0, 0) + coda::kFp8Linears * layer + linear;
          const bool recorded = std::max(state.amax[2 * t], state.amax[2 * t + 1]) > 0.0f;
          const bool expected = ((recording >> (head ? coda::kFp8Head : linear)) & 1u) != 0 && (!head || linear == 0);
          EXPECT_EQ(recorded, expected) << "role " << static_cast<int>(role) << " layer " << layer << " linear " << linear;
        }
  }
};

// A recipe that covers some of the block linears: only their tensors record an amax (the others' histories
// stay 0, their scales unused), and only their GEMMs are FP8: with mlp_down alone in FP8 the second step's
// loss differs from the fp32 one and from the one with every linear in FP8; with no linear it is fp32's.
TEST(RefModel, Fp8RecipeRunsOnlyTheLinearsItCovers) {
  const TwoSteps run(12);
  const unsigned mlp_down = coda::parse_fp8_linears("mlp_down");
  coda::Fp8ScalingState state;
  const float down_only = run(coda::Fp8Recipe{2, 0, mlp_down}, &state)[1];
  run.expect_recorded(state, mlp_down, coda::Fp8Tensors(run.config.n_layer, false));
  const float fp32 = run(std::nullopt)[1], all = run(coda::Fp8Recipe{2, 0})[1];
  EXPECT_NE(down_only, fp32);
  EXPECT_NE(down_only, all);
  EXPECT_EQ(run(coda::Fp8Recipe{2, 0, 0})[1], fp32) << "a recipe without linears is the fp32 model";
}

// Block scales on some linears (fp8_scaling = "mlp_down"), per-tensor scales on the others: the block-scaled
// linear is FP8 from the first step (which the others spend calibrating in fp32) and records no amax, so the
// state holds histories for the per-tensor linears only; the two steps' losses differ from those of the fp32
// model and of both uniform recipes, and a recipe with block scales everywhere refuses the mixed state.
TEST(RefModel, Fp8MixedScalingBlockScalesTheNamedLinearsOnly) {
  const TwoSteps run(13);
  const unsigned mlp_down = coda::parse_fp8_scaling("mlp_down");
  coda::Fp8ScalingState state;
  const std::vector<float> mixed = run(coda::Fp8Recipe{2, 0, 0xF, mlp_down}, &state);
  const std::vector<float> fp32 = run(std::nullopt), tensor = run(coda::Fp8Recipe{2, 0}),
                           block = run(coda::Fp8Recipe{2, 0, 0xF, 0xF});
  EXPECT_EQ(tensor[0], fp32[0]) << "per-tensor scales calibrate in fp32 in the first step";
  EXPECT_NE(mixed[0], fp32[0]) << "the block-scaled linear is FP8 from the first step";
  EXPECT_NE(mixed[0], block[0]) << "the others are not";
  EXPECT_NE(mixed[1], tensor[1]);
  EXPECT_NE(mixed[1], block[1]);
  run.expect_recorded(state, 0xFu & ~mlp_down, coda::Fp8Tensors(run.config.n_layer, false));
  ref::RefModel resumed(run.config, run.B, run.T);
  resumed.enable_fp8(coda::Fp8Recipe{2, 0, 0xF, mlp_down});
  resumed.load_fp8_state(state);
  EXPECT_EQ(resumed.fp8_state().amax, state.amax);
  ref::RefModel all_block(run.config, run.B, run.T);
  all_block.enable_fp8(coda::Fp8Recipe{2, 0, 0xF, 0xF});
  EXPECT_THROW(all_block.load_fp8_state(state), std::invalid_argument);
}

// The LM head in FP8 (fp8_linears with lm_head): its input (the final norm's output), its weight and the
// dlogits take the three slots of one more layer of the scaling state and record an amax like the block
// linears, the second step's loss differs from that of the four block linears alone, and the states of the
// two recipes do not load into each other (the message says why).
TEST(RefModel, Fp8LmHeadRecordsItsTensorsAsOneMoreLayer) {
  const TwoSteps run(14);
  const unsigned with_head = 0xFu | 1u << coda::kFp8Head;
  coda::Fp8ScalingState head_state, block_state;
  const std::vector<float> head = run(coda::Fp8Recipe{2, 0, with_head}, &head_state);
  const std::vector<float> blocks = run(coda::Fp8Recipe{2, 0}, &block_state);
  EXPECT_EQ(head[0], blocks[0]) << "both calibrate in fp32";
  EXPECT_NE(head[1], blocks[1]);
  run.expect_recorded(head_state, with_head, coda::Fp8Tensors(run.config.n_layer, true));
  ref::RefModel resumed(run.config, run.B, run.T);
  resumed.enable_fp8(coda::Fp8Recipe{2, 0, with_head});
  resumed.load_fp8_state(head_state);
  EXPECT_EQ(resumed.fp8_state().amax, head_state.amax);
  try {
    resumed.load_fp8_state(block_state);
    ADD_FAILURE() << "a state without the head's tensors was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head"), std::string::npos) << e.what();
  }
}
