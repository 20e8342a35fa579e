// `coda sample`: autoregressive generation from a checkpoint.
// Each new token comes from the logits at the last position of the context (its last max_seq_len
// tokens; the whole window is recomputed every time, which is plain and fast enough for a reference).
// Temperature 0 takes the most likely token; otherwise the top_k most likely tokens (all when top_k is
// 0) are weighted by exp((logit - max) / temperature) and one is drawn with the seeded Rng, so a seed
// reproduces a sample.
// Output: a byte model's tokens are bytes, but a raw control byte (ESC, a carriage return, a bell)
// would drive the terminal rather than show; printable ASCII, newline and tab are written as they are
// and every other byte as \xNN. The same generation serves training's sample_every, on the training
// backend.

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "checkpoint.hpp"
#include "prepare.hpp"
#include "rng.hpp"
#include "train.hpp"

namespace coda {

namespace {

int32_t pick_token(const std::vector<float>& logits, float temperature, int top_k, Rng& rng) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t k = top_k > 0 ? std::min<size_t>(top_k, order.size()) : order.size();
  const auto higher = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + static_cast<long>(k), order.end(), higher);
  if (temperature == 0.0f) return order[0];
  std::vector<double> weights(k);
  for (size_t i = 0; i < k; ++i) weights[i] = std::exp((logits[order[i]] - logits[order[0]]) / temperature);
  double u = rng.uniform() * std::accumulate(weights.begin(), weights.end(), 0.0);
  for (size_t i = 0; i < k; ++i) {
    if (u < weights[i]) return order[i];
    u -= weights[i];
  }
  return order[k - 1];
}

std::vector<int32_t> prompt_tokens(const std::string& prompt, int vocab_size) {
  std::vector<int32_t> tokens;
  if (vocab_size == kByteVocabSize) {
    for (uint32_t token : byte_encode(prompt)) tokens.push_back(static_cast<int32_t>(token));
  } else {
    std::istringstream ids(prompt);
    for (std::string id; ids >> id;) {
      size_t used = 0;
      long value = -1;
      try {
        value = std::stol(id, &used);
      } catch (const std::exception&) {
      }
      if (used != id.size() || value < 0 || value >= vocab_size)
        throw std::invalid_argument("prompt: \"" + id + "\" is not a token id below vocab_size " +
                                    std::to_string(vocab_size) + " (the model has no byte tokenizer)");
      tokens.push_back(static_cast<int32_t>(value));
    }
  }
  if (tokens.empty()) throw std::invalid_argument("prompt: empty; sampling needs at least one token");
  return tokens;
}

}  // namespace

std::string token_text(int32_t token, bool bytes, bool first) {
  if (!bytes) return (first ? "" : " ") + std::to_string(token);
  if (token == '\n' || token == '\t' || (token >= 0x20 && token < 0x7f))
    return std::string(1, static_cast<char>(token));
  char escaped[8];
  std::snprintf(escaped, sizeof escaped, "\\x%02x", static_cast<unsigned>(token) & 0xffu);
  return escaped;
}

std::vector<int32_t> generate(Backend& backend, int vocab_size, std::vector<int32_t> context, int tokens,
                              float temperature, int top_k, int max_window, Rng& rng,
                              const std::function<void(int32_t)>& emit) {
  std::vector<float> logits(vocab_size);
  std::vector<int32_t> generated;
  for (int i = 0; i < tokens; ++i) {
    const size_t window = std::min<size_t>(context.size(), max_window);
    backend.last_logits(context.data() + context.size() - window, 1, static_cast<int>(window), logits.data());
    const int32_t next = pick_token(logits, temperature, top_k, rng);
    context.push_back(next);
    generated.push_back(next);
    emit(next);
  }
  return generated;
}

std::vector<int32_t> sample(const SampleOptions& options, std::FILE* out) {
  if (options.tokens < 0) throw std::invalid_argument("tokens must be >= 0");
  if (!(options.temperature >= 0.0f)) throw std::invalid_argument("temperature must be >= 0");
  if (options.top_k < 0) throw std::invalid_argument("top_k must be >= 0 (0: the whole vocabulary)");
  const std::string dir = find_checkpoint(options.checkpoint);
  const Checkpoint checkpoint = load_checkpoint(dir);
  const ModelConfig& model = checkpoint.model;
  const bool bytes = model.vocab_size == kByteVocabSize;
  std::vector<int32_t> context = prompt_tokens(options.prompt, model.vocab_size);

  RunConfig run;
  run.model = model;
  run.device = options.device;
  run.batch_size = 1;
  run.seq_len = model.max_seq_len;
  std::unique_ptr<Backend> backend = make_backend(run);
  backend->load_params(checkpoint.params.data());
  spdlog::info("sampling {} tokens from {} (backend {})", options.tokens, dir, backend->name());

  if (bytes) std::fwrite(options.prompt.data(), 1, options.prompt.size(), out);
  Rng rng(options.seed);
  bool first = true;
  const std::vector<int32_t> generated =
      generate(*backend, model.vocab_size, context, options.tokens, options.temperature, options.top_k,
               model.max_seq_len, rng, [&](int32_t token) {
                 std::fputs(token_text(token, bytes, first).c_str(), out);
                 std::fflush(out);
                 first = false;
               });
  std::fputc('\n', out);
  return generated;
}

}  // namespace coda
