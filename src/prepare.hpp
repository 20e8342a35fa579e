// Dataset preparation: the byte tokenizer, the built-in synthetic corpus, and `coda prepare`.
//
// Byte tokenizer: a token is one byte of the UTF-8 text, so the vocabulary is 256 and decoding is exact.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rng.hpp"

namespace CLI {
class App;
}

namespace coda {

constexpr int kByteVocabSize = 256;

std::vector<uint32_t> byte_encode(const std::string& text);
// Throws std::invalid_argument on a token id >= 256.
std::string byte_decode(const std::vector<uint32_t>& tokens);

// Synthetic corpus: an order-2 Markov source over 256 tokens whose entropy rate is known exactly, so a
// training run can be judged against the best loss possible. From the seed it draws a permutation P of
// the 256 tokens, a base[b] in [0, 256) for every token b and a bit[a] in {0, 1} for every token a.
// After the context (a, b) = (token before last, last token), the next token is uniform over the K
// distinct tokens P[(base[b] + K bit[a] + j) mod 256], j = 0..K-1. Every context has exactly K equally
// likely successors, so H(x_t | x_<t) = ln K nats for every t >= 2 and the entropy rate is ln K.
// The structure is learnable in stages: the last token alone narrows the next one to 2K candidates
// (a bigram table, loss at most ln 2K), and one bit of the token before picks the half (loss ln K), which
// needs a previous-token attention head. With K = 4 the stages measure about 5.45 (unigram), 2.0
// (bigram, <= ln 8 = 2.08) and ln 4 = 1.386.
// In a window of T tokens the first prediction sees no token before last, so the best mean loss of a
// window lies between ln K and ln K + (ln 2) / T.
constexpr int kSyntheticSuccessors = 4;

// ln K nats per token: the entropy rate of SyntheticCorpus with K successors per context.
double synthetic_entropy_rate(int successors = kSyntheticSuccessors);

class SyntheticCorpus {
 public:
  // The source (P, base, bit) comes from `seed` alone; `stream` picks an independent sample path from it
  // (train and validation are streams 0 and 1 of one source). 1 <= successors <= 128.
  SyntheticCorpus(uint64_t seed, uint64_t stream, int successors = kSyntheticSuccessors);
  // The K tokens that may follow the context (prev2, prev), each with probability 1/K.
  std::vector<uint32_t> successors(uint32_t prev2, uint32_t prev) const;
  // Appends the next n tokens of the stream to `out` (the stream opens with two uniform tokens).
  void generate(size_t n, std::vector<uint32_t>& out);

 private:
  int successors_;
  std::vector<uint32_t> permutation_, base_, bit_;
  Rng sampler_;
  size_t emitted_ = 0;
  uint32_t prev2_ = 0, prev_ = 0;
};

// Both write DIR/train_000000.bin ..., DIR/val_000000.bin ... (shards of at most shard_tokens tokens;
// older train_/val_ shards in DIR are removed first) and DIR/dataset.json, whose content they return.
nlohmann::json prepare_synthetic(const std::string& out_dir, size_t train_tokens, size_t val_tokens, uint64_t seed,
                                 size_t shard_tokens);
// Byte-tokenizes the files; the last val_fraction of each file goes to validation.
nlohmann::json prepare_text(const std::vector<std::string>& files, const std::string& out_dir, double val_fraction,
                            size_t shard_tokens);

// Registers `prepare synthetic` and `prepare text` (their callbacks run the preparation when parsed).
void add_prepare_command(CLI::App& app);

}  // namespace coda
