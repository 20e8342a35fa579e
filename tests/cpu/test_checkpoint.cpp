// Tests of the safetensors reader/writer and of checkpoints: bit-exact save/load round trips for GPT-2
// and Llama (GQA, tied and untied heads), that the Hugging Face layout is really applied (checked on the
// raw model.safetensors against the mapping written out independently here), plain HF directories
// (bf16, no "transformer." prefix, sharded), errors that name the file, and the atomic replace.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint.hpp"
#include "model.hpp"
#include "ref_ops.hpp"
#include "rng.hpp"
#include "safetensors.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using coda::Arch;
using coda::Checkpoint;
using coda::ModelConfig;
using coda::ParamLayout;
using coda::SafetensorsFile;
using coda::test::TempDir;

namespace {

ModelConfig gpt2_config() {
  ModelConfig c;
  c.set_arch(Arch::GPT2);
  c.n_layer = 2;
  c.d_model = 48;
  c.n_head = 3;
  c.n_kv_head = 3;
  c.d_ff = 192;
  c.vocab_size = 301;  // padded to 384
  c.max_seq_len = 40;
  c.norm_eps = 1e-5f;
  return c;
}

ModelConfig llama_config(bool tied) {
  ModelConfig c;
  c.set_arch(Arch::Llama);
  c.n_layer = 2;
  c.d_model = 64;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.d_ff = 96;
  c.vocab_size = 250;  // padded to 256
  c.max_seq_len = 32;
  c.rope_theta = 500000.0f;
  c.norm_eps = 1e-6f;
  c.tied_head = tied;
  return c;
}

ModelConfig qwen2_config(bool tied) {
  ModelConfig c = llama_config(tied);
  c.set_arch(Arch::Qwen2);
  c.rope_theta = 1e6f;
  return c;
}

// init_params plus noise on every real element (so norms, biases and every row differ), padding zero.
std::vector<float> random_params(const ModelConfig& c, const ParamLayout& layout, uint64_t seed) {
  std::vector<float> params(layout.total);
  coda::init_params(c, layout, seed, params.data());
  coda::Rng rng(seed + 1);
  for (const auto& tensor : layout.tensors) {
    const bool vocab_rows = tensor.name == "wte" || tensor.name == "lm_head";
    const size_t n = vocab_rows ? static_cast<size_t>(c.vocab_size) * c.d_model : tensor.numel;
    for (size_t i = 0; i < n; ++i) params[tensor.offset + i] += 0.05f * static_cast<float>(rng.normal());
  }
  return params;
}

std::vector<float> random_vector(size_t n, uint64_t seed, bool positive) {
  coda::Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = positive ? static_cast<float>(rng.uniform()) * 1e-4f : static_cast<float>(rng.normal());
  return v;
}

coda::TrainerState sample_state() {
  coda::TrainerState state;
  state.step = 1234;
  state.data_position = {{"epoch", 3}, {"batch", 17}, {"order", {5, 1, 4}}};
  state.rng = {0xFFFFFFFFFFFFFFFFull, (1ull << 53) + 1, 0x8000000000000001ull, 42};
  state.run_config = "[optim]\nlr = 0.0003\nsteps = 5000\n";
  // FP8 amax histories, with values a decimal text must carry exactly: a third, a subnormal, the largest
  // float, zero.
  state.fp8.history = 2;
  state.fp8.amax = {1.0f / 3.0f, 1e-40f, std::numeric_limits<float>::max(), 0.0f, 448.0f, 6.1e-5f};
  return state;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.n_layer, b.n_layer);
  EXPECT_EQ(a.d_model, b.d_model);
  EXPECT_EQ(a.n_head, b.n_head);
  EXPECT_EQ(a.n_kv_head, b.n_kv_head);
  EXPECT_EQ(a.d_ff, b.d_ff);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_seq_len, b.max_seq_len);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.tied_head, b.tied_head);
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  if (a.rope()) {
    EXPECT_EQ(a.rope_theta, b.rope_theta);
  }
}

// Saves a random model with random optimizer state; returns the parameters.
struct Saved {
  ModelConfig config;
  ParamLayout layout;
  std::vector<float> params, adam_m, adam_v;
  coda::TrainerState state = sample_state();
};

Saved save_random(const std::string& dir, const ModelConfig& config, uint64_t seed) {
  Saved s{config, coda::make_param_layout(config), {}, {}, {}};
  s.params = random_params(config, s.layout, seed);
  s.adam_m = random_vector(s.layout.total, seed + 10, false);
  s.adam_v = random_vector(s.layout.total, seed + 20, true);
  coda::save_checkpoint(dir, config, s.params.data(), s.adam_m.data(), s.adam_v.data(), s.state);
  return s;
}

void expect_round_trip(const std::string& dir, const Saved& s) {
  const Checkpoint loaded = coda::load_checkpoint(dir);
  expect_same_config(loaded.model, s.config);
  EXPECT_TRUE(same_bits(loaded.params, s.params));
  ASSERT_TRUE(loaded.has_trainer_state);
  EXPECT_TRUE(same_bits(loaded.adam_m, s.adam_m));
  EXPECT_TRUE(same_bits(loaded.adam_v, s.adam_v));
  EXPECT_EQ(loaded.state.step, s.state.step);
  EXPECT_EQ(loaded.state.data_position, s.state.data_position);
  EXPECT_EQ(loaded.state.rng, s.state.rng);
  EXPECT_EQ(loaded.state.run_config, s.state.run_config);
  EXPECT_EQ(loaded.state.fp8.history, s.state.fp8.history);
  EXPECT_TRUE(same_bits(loaded.state.fp8.amax, s.state.fp8.amax));
}

// Expects `action` to throw std::runtime_error whose message contains every one of `parts`.
template <typename Action>
void expect_error(Action action, const std::vector<std::string>& parts) {
  try {
    action();
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file built by hand (not with write_safetensors): header text plus raw data bytes.
std::string handmade_file(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((static_cast<uint64_t>(header.size()) >> (8 * i)) & 0xff);
  return bytes + header + data;
}

template <typename T>
std::string raw(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

uint16_t to_bf16_bits(float x) {  // truncation: the value it stands for is exactly representable
  uint32_t word;
  std::memcpy(&word, &x, 4);
  return static_cast<uint16_t>(word >> 16);
}

}  // namespace

TEST(Safetensors, F32RoundTrip) {
  TempDir tmp("coda_ckpt");
  const std::string path = tmp / "t.safetensors";
  const std::vector<float> a = random_vector(7 * 13, 1, false), b = random_vector(5, 2, false);
  coda::write_safetensors(path,
                          {{"alpha", {7, 13}, [&](float* out) { std::memcpy(out, a.data(), a.size() * 4); }},
                           {"beta.x", {5}, [&](float* out) { std::memcpy(out, b.data(), b.size() * 4); }},
                           {"empty", {0, 3}, [](float*) {}}},
                          {{"format", "pt"}, {"note", "hello"}});
  const SafetensorsFile file(path);
  EXPECT_EQ(file.tensors().size(), 3u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.metadata().at("note"), "hello");
  EXPECT_EQ(file.entry("alpha").shape, (std::vector<int64_t>{7, 13}));
  EXPECT_EQ(file.entry("alpha").dtype, "F32");
  EXPECT_TRUE(same_bits(file.read("alpha"), a));
  EXPECT_TRUE(same_bits(file.read("beta.x"), b));
  EXPECT_TRUE(file.read("empty").empty());
  // The header is padded so the data starts 8-byte aligned.
  const std::string bytes = read_bytes(path);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  EXPECT_EQ((8 + header_bytes) % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_bytes + (a.size() + b.size()) * 4);
  expect_error([&] { file.read("gamma"); }, {path, "gamma"});
}

// A full disk is named as such (ENOSPC from /dev/full), not as a bare "write failed".
TEST(Safetensors, WriteErrorsCarryTheSystemsReason) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  const std::vector<float> a = random_vector(1 << 16, 3, false);
  expect_error([&] { coda::write_safetensors("/dev/full", {{"a", {1 << 16}, [&](float* out) {
                                                              std::memcpy(out, a.data(), a.size() * 4);
                                                            }}}); },
               {"/dev/full", "No space left on device"});
}

TEST(Safetensors, ReadsHandBuiltBf16AndF16) {
  TempDir tmp("coda_ckpt");
  const std::string path = tmp / "h.safetensors";
  // bf16: random floats truncated to bf16, whose values are known exactly.
  coda::Rng rng(7);
  std::vector<uint16_t> bf16_bits;
  std::vector<float> bf16_expected;
  for (int i = 0; i < 24; ++i) {
    const float x = static_cast<float>(rng.normal() * std::pow(10.0, static_cast<int>(rng.below(9)) - 4));
    bf16_bits.push_back(to_bf16_bits(x));
    uint32_t word = static_cast<uint32_t>(bf16_bits.back()) << 16;
    float value;
    std::memcpy(&value, &word, 4);
    bf16_expected.push_back(value);
  }
  // f16: special values plus random finite bit patterns, decoded here from the IEEE definition.
  std::vector<uint16_t> f16_bits = {0x3C00, 0xC100, 0x7BFF, 0x0001, 0x8400, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00};
  for (int i = 0; i < 30; ++i) {
    uint16_t bits = static_cast<uint16_t>(rng.below(65536));
    if (((bits >> 10) & 0x1f) == 0x1f) bits &= 0xBFFF;  // keep it finite
    f16_bits.push_back(bits);
  }
  auto ieee_half = [](uint16_t bits) {
    const double sign = (bits >> 15) ? -1.0 : 1.0;
    const int e = (bits >> 10) & 0x1f, m = bits & 0x3ff;
    if (e == 0x1f) return m ? NAN : sign * INFINITY;
    if (e == 0) return sign * m / 1024.0 * std::pow(2.0, -14);
    return sign * (1.0 + m / 1024.0) * std::pow(2.0, e - 15);
  };
  const size_t bf_bytes = bf16_bits.size() * 2, f_bytes = f16_bits.size() * 2;
  const std::string header =
      nlohmann::json{{"__metadata__", {{"format", "pt"}}},
                     {"w.bf", {{"dtype", "BF16"}, {"shape", {4, 6}}, {"data_offsets", {0, bf_bytes}}}},
                     {"w.f16", {{"dtype", "F16"}, {"shape", {f16_bits.size()}}, {"data_offsets", {bf_bytes, bf_bytes + f_bytes}}}},
                     {"ids", {{"dtype", "I64"}, {"shape", {2}}, {"data_offsets", {bf_bytes + f_bytes, bf_bytes + f_bytes + 16}}}}}
          .dump();
  write_bytes(path, handmade_file(header, raw(bf16_bits) + raw(f16_bits) + raw(std::vector<int64_t>{3, 4})));
  const SafetensorsFile file(path);
  EXPECT_TRUE(same_bits(file.read("w.bf"), bf16_expected));
  const std::vector<float> halves = file.read("w.f16");
  ASSERT_EQ(halves.size(), f16_bits.size());
  for (size_t i = 0; i < halves.size(); ++i) {
    const double expected = ieee_half(f16_bits[i]);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(halves[i])) << i;
    } else {
      EXPECT_EQ(static_cast<double>(halves[i]), expected) << "bits " << f16_bits[i];
      EXPECT_EQ(std::signbit(halves[i]), (f16_bits[i] >> 15) != 0) << i;
    }
  }
  expect_error([&] { file.read("ids"); }, {path, "ids", "I64"});
}

TEST(Safetensors, RejectsBadFiles) {
  TempDir tmp("coda_ckpt");
  const std::string path = tmp / "bad.safetensors";
  const std::string data = raw(random_vector(6, 3, false));
  auto header_with = [](const nlohmann::json& a_offsets, const nlohmann::json& a_shape, const char* dtype) {
    return nlohmann::json{{"a", {{"dtype", dtype}, {"shape", a_shape}, {"data_offsets", a_offsets}}},
                          {"b", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {16, 24}}}}}
        .dump();
  };
  struct Case {
    std::string bytes;
    std::vector<std::string> message_parts;
  };
  const std::vector<Case> cases = {
      {std::string("\x10\0\0", 3), {"truncated"}},
      {handmade_file(header_with({0, 16}, {4}, "F32"), data).substr(0, 20), {"header length"}},
      {handmade_file("{\"a\": [1, ", data), {"JSON"}},
      {handmade_file(header_with({0, 16}, {4}, "F32"), data.substr(0, 20)), {"tensor b", "out of"}},
      {handmade_file(header_with({0, 16}, {5}, "F32"), data), {"tensor a", "needs 20"}},
      {handmade_file(header_with({0, 16}, {4}, "Q7"), data), {"tensor a", "unknown dtype"}},
      {handmade_file(header_with({0, 20}, {5}, "F32"), data), {"tensor b", "overlap"}},
      {handmade_file(header_with({0, 16}, {4}, "F32"), data + "xxxx"), {"trailing"}},
      {handmade_file(header_with({0, 16}, {-4}, "F32"), data), {"tensor a", "negative"}},
      {handmade_file(nlohmann::json{{"a", {{"dtype", "F32"}, {"shape", {4}}}}}.dump(), data), {"tensor a", "data_offsets"}},
  };
  for (const Case& c : cases) {
    write_bytes(path, c.bytes);
    std::vector<std::string> parts = c.message_parts;
    parts.push_back(path);
    expect_error([&] { SafetensorsFile file(path); }, parts);
  }
  // The unbroken file is accepted, so the cases above fail for the reasons they name.
  write_bytes(path, handmade_file(header_with({0, 16}, {4}, "F32"), data));
  EXPECT_EQ(SafetensorsFile(path).read("b").size(), 2u);
  expect_error([&] { SafetensorsFile file(tmp / "absent.safetensors"); }, {"absent.safetensors"});
}

TEST(Checkpoint, RoundTripGpt2) {
  TempDir tmp("coda_ckpt");
  const Saved s = save_random(tmp / "ck", gpt2_config(), 11);
  expect_round_trip(tmp / "ck", s);
}

TEST(Checkpoint, RoundTripLlamaGqaUntied) {
  TempDir tmp("coda_ckpt");
  const Saved s = save_random(tmp / "ck", llama_config(false), 12);
  expect_round_trip(tmp / "ck", s);
}

TEST(Checkpoint, RoundTripLlamaTied) {
  TempDir tmp("coda_ckpt");
  const Saved s = save_random(tmp / "ck", llama_config(true), 13);
  expect_round_trip(tmp / "ck", s);
}

TEST(Checkpoint, RoundTripQwen2TiedAndUntied) {
  for (bool tied : {true, false}) {
    TempDir tmp("coda_ckpt");
    const Saved s = save_random(tmp / "ck", qwen2_config(tied), tied ? 14 : 15);
    expect_round_trip(tmp / "ck", s);
  }
}

TEST(Checkpoint, Gpt2UsesHfLayout) {
  TempDir tmp("coda_ckpt");
  const std::string dir = tmp / "ck";
  const Saved s = save_random(dir, gpt2_config(), 21);
  const ModelConfig& c = s.config;
  const int64_t C = c.d_model, F = c.d_ff, QKV = c.qkv_dim();
  const SafetensorsFile file(dir + "/model.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_FALSE(file.contains("lm_head.weight"));
  EXPECT_EQ(file.tensors().size(), 4u + 12u * c.n_layer);
  EXPECT_EQ(file.entry("transformer.wte.weight").shape, (std::vector<int64_t>{c.vocab_size, C}));
  EXPECT_EQ(file.entry("transformer.wpe.weight").shape, (std::vector<int64_t>{c.max_seq_len, C}));
  const std::vector<float> wte = file.read("transformer.wte.weight");
  EXPECT_TRUE(same_bits(wte, std::vector<float>(s.params.begin() + s.layout.wte,
                                                s.params.begin() + s.layout.wte + c.vocab_size * C)));
  // Conv1D weights are [in, out]: the transposes of our [out, in] matrices.
  struct Matrix {
    const char* name;
    size_t offset;
    int64_t out, in;
  };
  const auto& lp = s.layout.layers[1];
  for (const Matrix& m : {Matrix{"attn.c_attn", lp.qkv_w, QKV, C}, Matrix{"attn.c_proj", lp.attn_proj_w, C, C},
                          Matrix{"mlp.c_fc", lp.mlp_up_w, F, C}, Matrix{"mlp.c_proj", lp.mlp_down_w, C, F}}) {
    const std::string name = std::string("transformer.h.1.") + m.name + ".weight";
    ASSERT_EQ(file.entry(name).shape, (std::vector<int64_t>{m.in, m.out})) << name;
    const std::vector<float> hf = file.read(name);
    for (int64_t i = 0; i < m.in; ++i)
      for (int64_t o = 0; o < m.out; ++o)
        ASSERT_EQ(hf[i * m.out + o], s.params[m.offset + o * m.in + i]) << name << " " << i << "," << o;
  }
  const std::vector<float> qkv_b = file.read("transformer.h.1.attn.c_attn.bias");
  EXPECT_TRUE(same_bits(qkv_b, std::vector<float>(s.params.begin() + lp.qkv_b, s.params.begin() + lp.qkv_b + QKV)));
  const std::vector<float> ln2 = file.read("transformer.h.1.ln_2.bias");
  EXPECT_TRUE(same_bits(ln2, std::vector<float>(s.params.begin() + lp.norm2_b, s.params.begin() + lp.norm2_b + C)));

  std::ifstream in(dir + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  EXPECT_EQ(config["model_type"], "gpt2");
  EXPECT_EQ(config["architectures"], nlohmann::json::array({"GPT2LMHeadModel"}));
  EXPECT_EQ(config["n_embd"], C);
  EXPECT_EQ(config["n_inner"], F);
  EXPECT_EQ(config["vocab_size"], c.vocab_size);
  EXPECT_EQ(config["n_positions"], c.max_seq_len);
  EXPECT_EQ(config["activation_function"], "gelu_new");
  EXPECT_EQ(config["layer_norm_epsilon"].get<double>(), 1e-5);
  EXPECT_EQ(config["tie_word_embeddings"], true);
}

TEST(Checkpoint, LlamaUsesHfLayout) {
  TempDir tmp("coda_ckpt");
  const std::string dir = tmp / "ck";
  const Saved s = save_random(dir, llama_config(false), 22);
  const ModelConfig& c = s.config;
  const int64_t C = c.d_model, F = c.d_ff, hd = c.head_dim();
  const SafetensorsFile file(dir + "/model.safetensors");
  EXPECT_EQ(file.tensors().size(), 3u + 9u * c.n_layer);
  const auto& lp = s.layout.layers[0];
  auto our_row = [&](size_t offset, int64_t row) { return s.params.data() + offset + row * C; };
  auto expect_row = [&](const std::vector<float>& hf, int64_t hf_row, const float* ours, const std::string& what) {
    ASSERT_EQ(std::memcmp(hf.data() + hf_row * C, ours, C * sizeof(float)), 0) << what << " row " << hf_row;
  };
  // q and k: HF row head*hd + half*(hd/2) + i is our row head*hd + 2i + half of the head's block.
  struct Block {
    const char* name;
    int heads;
    int64_t first_row;
  };
  for (const Block& b : {Block{"q_proj", c.n_head, 0}, Block{"k_proj", c.n_kv_head, c.n_head * hd}}) {
    const std::string name = std::string("model.layers.0.self_attn.") + b.name + ".weight";
    ASSERT_EQ(file.entry(name).shape, (std::vector<int64_t>{b.heads * hd, C}));
    const std::vector<float> hf = file.read(name);
    for (int64_t head = 0; head < b.heads; ++head)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t i = 0; i < hd / 2; ++i)
          expect_row(hf, head * hd + half * (hd / 2) + i, our_row(lp.qkv_w, b.first_row + head * hd + 2 * i + half),
                     name);
  }
  const std::vector<float> v = file.read("model.layers.0.self_attn.v_proj.weight");
  for (int64_t r = 0; r < c.n_kv_head * hd; ++r)
    expect_row(v, r, our_row(lp.qkv_w, (c.n_head + c.n_kv_head) * hd + r), "v_proj");
  const std::vector<float> gate = file.read("model.layers.0.mlp.gate_proj.weight");
  const std::vector<float> up = file.read("model.layers.0.mlp.up_proj.weight");
  for (int64_t j = 0; j < F; ++j) {
    expect_row(gate, j, our_row(lp.mlp_up_w, 2 * j), "gate_proj");
    expect_row(up, j, our_row(lp.mlp_up_w, 2 * j + 1), "up_proj");
  }
  EXPECT_EQ(file.entry("model.layers.0.mlp.down_proj.weight").shape, (std::vector<int64_t>{C, F}));
  EXPECT_TRUE(same_bits(file.read("model.layers.0.mlp.down_proj.weight"),
                        std::vector<float>(s.params.begin() + lp.mlp_down_w, s.params.begin() + lp.mlp_down_w + C * F)));
  EXPECT_EQ(file.entry("lm_head.weight").shape, (std::vector<int64_t>{c.vocab_size, C}));
  EXPECT_TRUE(same_bits(file.read("lm_head.weight"),
                        std::vector<float>(s.params.begin() + s.layout.lm_head,
                                           s.params.begin() + s.layout.lm_head + c.vocab_size * C)));

  std::ifstream in(dir + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  EXPECT_EQ(config["model_type"], "llama");
  EXPECT_EQ(config["num_key_value_heads"], c.n_kv_head);
  EXPECT_EQ(config["head_dim"], hd);
  EXPECT_EQ(config["intermediate_size"], F);
  EXPECT_EQ(config["tie_word_embeddings"], false);
  EXPECT_EQ(config["rope_theta"].get<double>(), 500000.0);
  EXPECT_EQ(config["rms_norm_eps"].get<double>(), 1e-6);
  EXPECT_EQ(config["hidden_act"], "silu");

  TempDir tied_tmp("coda_ckpt");
  save_random(tied_tmp / "tied", llama_config(true), 23);
  EXPECT_FALSE(SafetensorsFile(tied_tmp / "tied/model.safetensors").contains("lm_head.weight"));
}

// A plain HF GPT-2 directory as the original conversion has it: bf16, no "transformer." prefix, the
// attention-mask buffers, n_inner null, no trainer files.
TEST(Checkpoint, LoadsPlainHfGpt2Bf16) {
  TempDir tmp("coda_ckpt");
  const Saved s = save_random(tmp / "ours", gpt2_config(), 31);
  const SafetensorsFile ours(tmp / "ours/model.safetensors");
  const std::string dir = tmp / "hf";
  fs::create_directories(dir);
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}}}};
  std::string data;
  std::vector<std::vector<float>> expected_values;
  auto add = [&](const std::string& name, const std::vector<int64_t>& shape, const std::vector<uint16_t>& bits) {
    header[name] = {{"dtype", "BF16"}, {"shape", shape}, {"data_offsets", {data.size(), data.size() + bits.size() * 2}}};
    data += raw(bits);
  };
  for (const auto& item : ours.tensors()) {
    std::vector<uint16_t> bits;
    for (float x : ours.read(item.first)) bits.push_back(to_bf16_bits(x));
    add(item.first.substr(std::string("transformer.").size()), item.second.shape, bits);
  }
  add("h.0.attn.bias", {1, 1, 4, 4}, std::vector<uint16_t>(16, 0x3F80));
  write_bytes(dir + "/model.safetensors", handmade_file(header.dump(), data));
  std::ifstream config_in(tmp / "ours/config.json");
  nlohmann::json config = nlohmann::json::parse(config_in);
  config.erase("tie_word_embeddings");
  config.erase("n_ctx");
  config["n_inner"] = nullptr;  // HF's default: 4 * n_embd, which gpt2_config() uses
  std::ofstream(dir + "/config.json") << config.dump();

  const Checkpoint loaded = coda::load_checkpoint(dir);
  EXPECT_FALSE(loaded.has_trainer_state);
  expect_same_config(loaded.model, s.config);
  ASSERT_EQ(loaded.params.size(), s.params.size());
  for (size_t i = 0; i < s.params.size(); ++i) {
    const uint32_t word = static_cast<uint32_t>(to_bf16_bits(s.params[i])) << 16;
    float expected;
    std::memcpy(&expected, &word, 4);
    ASSERT_EQ(loaded.params[i], expected) << i;
  }
}

// A sharded HF Llama directory (model.safetensors.index.json), F32, without trainer files.
TEST(Checkpoint, LoadsShardedHfLlama) {
  TempDir tmp("coda_ckpt");
  const Saved s = save_random(tmp / "ours", llama_config(false), 32);
  const SafetensorsFile ours(tmp / "ours/model.safetensors");
  const std::string dir = tmp / "hf";
  fs::create_directories(dir);
  fs::copy_file(tmp / "ours/config.json", dir + "/config.json");
  std::vector<coda::SafetensorsOutput> shards[2];
  nlohmann::json weight_map;
  int index = 0;
  for (const auto& item : ours.tensors()) {
    const std::string file = "model-0000" + std::to_string(index % 2 + 1) + "-of-00002.safetensors";
    weight_map[item.first] = file;
    const std::vector<float> values = ours.read(item.first);
    shards[index % 2].push_back({item.first, item.second.shape,
                                 [values](float* out) { std::memcpy(out, values.data(), values.size() * 4); }});
    ++index;
  }
  coda::write_safetensors(dir + "/model-00001-of-00002.safetensors", shards[0]);
  coda::write_safetensors(dir + "/model-00002-of-00002.safetensors", shards[1]);
  std::ofstream(dir + "/model.safetensors.index.json") << nlohmann::json{{"weight_map", weight_map}}.dump();
  const Checkpoint loaded = coda::load_checkpoint(dir);
  EXPECT_FALSE(loaded.has_trainer_state);
  expect_same_config(loaded.model, s.config);
  EXPECT_TRUE(same_bits(loaded.params, s.params));
}

// A Qwen2 directory as transformers writes it (Qwen2ForCausalLM: config.json with its own keys and no
// head_dim, BF16 tensors, q/k/v biases), loaded, then checked with HF's own math: q = x Wq^T + bq rotated
// by rotate-half RoPE over the HF tensors must be our qkv (bias, then our adjacent-pair RoPE) at the
// permuted rows, for the q and the k heads.
TEST(Checkpoint, LoadsHfQwen2AndMatchesHfRopeWithBias) {
  TempDir tmp("coda_ckpt");
  const ModelConfig c = qwen2_config(true);
  save_random(tmp / "ours", c, 33);
  const SafetensorsFile ours(tmp / "ours/model.safetensors");
  const std::string dir = tmp / "hf";
  fs::create_directories(dir);
  std::vector<coda::SafetensorsOutput> tensors;
  for (const auto& item : ours.tensors()) {
    std::vector<float> values = ours.read(item.first);
    for (float& x : values) {
      const uint32_t word = static_cast<uint32_t>(to_bf16_bits(x)) << 16;
      std::memcpy(&x, &word, 4);
    }
    tensors.push_back({item.first, item.second.shape,
                       [values](float* out) { std::memcpy(out, values.data(), values.size() * 4); }});
  }
  coda::write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  const nlohmann::json config = {{"architectures", {"Qwen2ForCausalLM"}},
                                 {"attention_dropout", 0.0},
                                 {"bos_token_id", 151643},
                                 {"eos_token_id", 151643},
                                 {"hidden_act", "silu"},
                                 {"hidden_size", c.d_model},
                                 {"initializer_range", 0.02},
                                 {"intermediate_size", c.d_ff},
                                 {"max_position_embeddings", c.max_seq_len},
                                 {"max_window_layers", 21},
                                 {"model_type", "qwen2"},
                                 {"num_attention_heads", c.n_head},
                                 {"num_hidden_layers", c.n_layer},
                                 {"num_key_value_heads", c.n_kv_head},
                                 {"rms_norm_eps", 1e-06},
                                 {"rope_scaling", nullptr},
                                 {"rope_theta", 1000000.0},
                                 {"sliding_window", 32768},
                                 {"tie_word_embeddings", true},
                                 {"torch_dtype", "bfloat16"},
                                 {"transformers_version", "4.43.1"},
                                 {"use_cache", true},
                                 {"use_sliding_window", false},
                                 {"vocab_size", c.vocab_size}};
  std::ofstream(dir + "/config.json") << config.dump(2);
  const Checkpoint loaded = coda::load_checkpoint(dir);
  expect_same_config(loaded.model, c);
  ASSERT_TRUE(loaded.model.qkv_bias);

  const coda::ParamLayout layout = coda::make_param_layout(c);
  const coda::LayerParams& lp = layout.layers[1];
  const SafetensorsFile hf(dir + "/model.safetensors");
  const int C = c.d_model, hd = c.head_dim(), Q = c.qkv_dim(), T = 6, p = T - 1;
  const std::vector<float> x = random_vector(static_cast<size_t>(T) * C, 34, false);
  std::vector<float> qkv(static_cast<size_t>(T) * Q);
  coda::ref::matmul_forward(qkv.data(), x.data(), loaded.params.data() + lp.qkv_w, loaded.params.data() + lp.qkv_b, T,
                            C, Q);
  coda::ref::rope_forward(qkv.data(), 1, T, c.n_head, c.n_kv_head, hd, c.rope_theta);
  struct Projection {
    const char* name;
    int heads, first_col;
  };
  for (const Projection& proj : {Projection{"q_proj", c.n_head, 0}, Projection{"k_proj", c.n_kv_head, c.n_head * hd}}) {
    const std::string prefix = std::string("model.layers.1.self_attn.") + proj.name;
    const std::vector<float> w = hf.read(prefix + ".weight"), b = hf.read(prefix + ".bias");
    const int rows = proj.heads * hd;
    std::vector<double> y(rows);
    for (int r = 0; r < rows; ++r) {
      y[r] = b[r];
      for (int k = 0; k < C; ++k) y[r] += static_cast<double>(w[static_cast<size_t>(r) * C + k]) * x[p * C + k];
    }
    for (int head = 0; head < proj.heads; ++head)
      for (int i = 0; i < hd / 2; ++i) {
        const double angle = p * std::pow(static_cast<double>(c.rope_theta), -2.0 * i / hd);
        const double a = y[head * hd + i], bb = y[head * hd + hd / 2 + i];
        const double hf_out[2] = {a * std::cos(angle) - bb * std::sin(angle), bb * std::cos(angle) + a * std::sin(angle)};
        for (int half = 0; half < 2; ++half) {
          const float our = qkv[static_cast<size_t>(p) * Q + proj.first_col + head * hd + 2 * i + half];
          EXPECT_NEAR(our, hf_out[half], 1e-4 * (1.0 + std::abs(hf_out[half])))
              << proj.name << " head " << head << " pair " << i << " half " << half;
        }
      }
  }

  nlohmann::json sliding = config;
  sliding["use_sliding_window"] = true;
  std::ofstream(dir + "/config.json") << sliding.dump();
  expect_error([&] { coda::load_checkpoint(dir); }, {dir + "/config.json", "use_sliding_window"});
}

TEST(Checkpoint, ErrorsNameTheFile) {
  TempDir tmp("coda_ckpt");
  const std::string dir = tmp / "ck";
  save_random(dir, llama_config(false), 41);
  const std::string model = dir + "/model.safetensors", config = dir + "/config.json",
                    state = dir + "/trainer_state.json", optimizer = dir + "/optimizer.safetensors";
  const std::string model_bytes = read_bytes(model), config_bytes = read_bytes(config),
                    state_bytes = read_bytes(state), optimizer_bytes = read_bytes(optimizer);
  auto restore = [&] {
    write_bytes(model, model_bytes);
    write_bytes(config, config_bytes);
    write_bytes(state, state_bytes);
    write_bytes(optimizer, optimizer_bytes);
  };
  auto load = [&] { coda::load_checkpoint(dir); };

  write_bytes(model, model_bytes.substr(0, model_bytes.size() - 100));
  expect_error(load, {model, "truncated"});
  restore();
  std::string flipped = model_bytes;
  flipped[8] = '#';  // the header's opening brace
  write_bytes(model, flipped);
  expect_error(load, {model});
  restore();
  fs::remove(config);
  expect_error(load, {config});
  restore();
  write_bytes(config, "{\"model_type\": \"llama\", \"hidden_size\": 64}");
  expect_error(load, {config, "intermediate_size"});
  restore();
  nlohmann::json edited = nlohmann::json::parse(config_bytes);
  edited["vocab_size"] = 251;
  write_bytes(config, edited.dump());
  expect_error(load, {model, "model.embed_tokens.weight", "[250, 64]"});
  restore();
  edited = nlohmann::json::parse(config_bytes);
  edited["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 32.0}};
  write_bytes(config, edited.dump());
  expect_error(load, {config, "rope_parameters", "llama3"});
  restore();
  edited = nlohmann::json::parse(state_bytes);
  edited["rng"][2] = "12x";
  write_bytes(state, edited.dump());
  expect_error(load, {state, "rng"});
  restore();
  write_bytes(state, state_bytes.substr(0, state_bytes.size() / 2));
  expect_error(load, {state});
  restore();
  edited = nlohmann::json::parse(state_bytes);
  edited["fp8"]["amax"][1] = -1.0;
  write_bytes(state, edited.dump());
  expect_error(load, {state, "fp8", "amax", "non-negative"});
  edited["fp8"]["amax"] = {1.0, 2.0, 3.0};  // not whole histories of 2
  write_bytes(state, edited.dump());
  expect_error(load, {state, "fp8", "amax"});
  edited["fp8"] = {{"amax", {1.0, 2.0}}};
  write_bytes(state, edited.dump());
  expect_error(load, {state, "fp8", "history"});
  restore();
  fs::remove(optimizer);
  expect_error(load, {optimizer, "missing"});
  restore();
  // A model.safetensors from another checkpoint no longer matches the optimizer's master copy.
  TempDir other("coda_ckpt");
  save_random(other / "ck", llama_config(false), 42);
  fs::copy_file(other / "ck/model.safetensors", model, fs::copy_options::overwrite_existing);
  expect_error(load, {optimizer, "master"});
  restore();
  EXPECT_NO_THROW(load());
  expect_error([&] { coda::load_checkpoint(tmp / "nowhere"); }, {"nowhere"});

  const std::string gpt2_dir = tmp / "gpt2";
  save_random(gpt2_dir, gpt2_config(), 43);
  const std::string gpt2_config_path = gpt2_dir + "/config.json";
  edited = nlohmann::json::parse(read_bytes(gpt2_config_path));
  edited["scale_attn_by_inverse_layer_idx"] = true;
  write_bytes(gpt2_config_path, edited.dump());
  expect_error([&] { coda::load_checkpoint(gpt2_dir); }, {gpt2_config_path, "scale_attn_by_inverse_layer_idx"});
  edited.erase("scale_attn_by_inverse_layer_idx");
  edited["activation_function"] = "relu";
  write_bytes(gpt2_config_path, edited.dump());
  expect_error([&] { coda::load_checkpoint(gpt2_dir); }, {gpt2_config_path, "activation_function", "relu"});
}

TEST(Checkpoint, AtomicReplace) {
  TempDir tmp("coda_ckpt");
  const std::string dir = tmp / "ck";
  save_random(dir, gpt2_config(), 51);
  // A stale half-written DIR.tmp from a crash is cleared, and the new checkpoint replaces the old.
  fs::create_directories(dir + ".tmp");
  write_bytes(dir + ".tmp/model.safetensors", "junk");
  write_bytes(dir + ".tmp/stray_file", "junk");
  const Saved second = save_random(dir + "/", llama_config(false), 52);  // trailing slash on purpose
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  EXPECT_FALSE(fs::exists(dir + ".old"));
  EXPECT_FALSE(fs::exists(dir + "/stray_file"));
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"config.json", "model.safetensors", "optimizer.safetensors",
                                             "trainer_state.json"}));
  expect_round_trip(dir, second);
}
