// Dataset preparation (see prepare.hpp for the tokenizer and the synthetic source).
//
// Both preparations stream: tokens go into a ShardWriter that writes a shard whenever shard_tokens
// have accumulated, so memory stays at one shard whatever the dataset size. dataset.json is written
// last, so its presence means the preparation finished. Stale train_/val_ shards of an earlier run in
// the same directory are removed first; otherwise the loader's glob would mix the two datasets.
#include "prepare.hpp"

#include <glob.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <spdlog/spdlog.h>
#include <stdexcept>

#include "data.hpp"

namespace coda {

std::vector<uint32_t> byte_encode(const std::string& text) {
  std::vector<uint32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string byte_decode(const std::vector<uint32_t>& tokens) {
  std::string text(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= static_cast<uint32_t>(kByteVocabSize)) {
      throw std::invalid_argument("byte_decode: token id " + std::to_string(tokens[i]) + " at position " +
                                  std::to_string(i) + " is not a byte (>= 256)");
    }
    text[i] = static_cast<char>(tokens[i]);
  }
  return text;
}

double synthetic_entropy_rate(int successors) { return std::log(static_cast<double>(successors)); }

SyntheticCorpus::SyntheticCorpus(uint64_t seed, uint64_t stream, int successors) : successors_(successors) {
  if (successors < 1 || 2 * successors > kByteVocabSize) {
    throw std::invalid_argument("synthetic corpus: successors = " + std::to_string(successors) +
                                " must be in [1, " + std::to_string(kByteVocabSize / 2) + "]");
  }
  Rng rng(seed);
  permutation_.resize(kByteVocabSize);
  for (int i = 0; i < kByteVocabSize; ++i) permutation_[i] = static_cast<uint32_t>(i);
  for (size_t i = permutation_.size(); i > 1; --i) std::swap(permutation_[i - 1], permutation_[rng.below(i)]);
  base_.resize(kByteVocabSize);
  bit_.resize(kByteVocabSize);
  for (auto& base : base_) base = static_cast<uint32_t>(rng.below(kByteVocabSize));
  for (auto& bit : bit_) bit = static_cast<uint32_t>(rng.below(2));
  sampler_.reseed(rng.next_u64() + stream);
}

std::vector<uint32_t> SyntheticCorpus::successors(uint32_t prev2, uint32_t prev) const {
  std::vector<uint32_t> next(static_cast<size_t>(successors_));
  const uint32_t start = base_.at(prev) + static_cast<uint32_t>(successors_) * bit_.at(prev2);
  for (size_t j = 0; j < next.size(); ++j) next[j] = permutation_[(start + j) % kByteVocabSize];
  return next;
}

void SyntheticCorpus::generate(size_t n, std::vector<uint32_t>& out) {
  out.reserve(out.size() + n);
  for (size_t i = 0; i < n; ++i, ++emitted_) {
    uint32_t token;
    if (emitted_ < 2) {
      token = static_cast<uint32_t>(sampler_.below(kByteVocabSize));
    } else {
      const uint32_t start = base_[prev_] + static_cast<uint32_t>(successors_) * bit_[prev2_];
      token = permutation_[(start + sampler_.below(static_cast<uint64_t>(successors_))) % kByteVocabSize];
    }
    prev2_ = prev_;
    prev_ = token;
    out.push_back(token);
  }
}

namespace {

// Accumulates tokens of one split and writes DIR/SPLIT_000000.bin, ... every shard_tokens tokens.
class ShardWriter {
 public:
  ShardWriter(std::string dir, std::string split, size_t shard_tokens)
      : dir_(std::move(dir)), split_(std::move(split)), shard_tokens_(shard_tokens) {}

  void add(const uint32_t* tokens, size_t n) {
    while (n > 0) {
      const size_t take = std::min(n, shard_tokens_ - buffer_.size());
      buffer_.insert(buffer_.end(), tokens, tokens + take);
      tokens += take;
      n -= take;
      if (buffer_.size() == shard_tokens_) flush();
    }
  }
  void finish() {
    if (!buffer_.empty()) flush();
  }
  size_t tokens() const { return tokens_; }
  size_t shards() const { return shards_; }

 private:
  void flush() {
    char name[64];
    std::snprintf(name, sizeof(name), "%s_%06zu.bin", split_.c_str(), shards_);
    write_shard((std::filesystem::path(dir_) / name).string(), buffer_, kByteVocabSize);
    tokens_ += buffer_.size();
    ++shards_;
    buffer_.clear();
  }

  std::string dir_, split_;
  size_t shard_tokens_;
  std::vector<uint32_t> buffer_;
  size_t tokens_ = 0, shards_ = 0;
};

// Logs "what: P%" each time the done fraction passes another 10%, for jobs of at least 16M tokens.
class Progress {
 public:
  Progress(std::string what, size_t total) : what_(std::move(what)), total_(total) {}
  void update(size_t done) {
    if (total_ < (size_t{1} << 24)) return;
    const int tenths = static_cast<int>(10.0 * static_cast<double>(done) / static_cast<double>(total_));
    if (tenths > logged_tenths_) {
      logged_tenths_ = tenths;
      spdlog::info("{}: {}% ({} of {} tokens)", what_, 10 * tenths, done, total_);
    }
  }

 private:
  std::string what_;
  size_t total_;
  int logged_tenths_ = 0;
};

void check_shard_tokens(size_t shard_tokens) {
  if (shard_tokens < 1 || shard_tokens > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw std::invalid_argument("shard_tokens = " + std::to_string(shard_tokens) + " must be in [1, 2^31 - 1]");
  }
}

// Creates the directory and removes the train_/val_ shards an earlier preparation left in it.
void prepare_out_dir(const std::string& out_dir) {
  if (out_dir.empty()) throw std::invalid_argument("prepare: --out must name a directory");
  std::error_code error;
  std::filesystem::create_directories(out_dir, error);
  if (error || !std::filesystem::is_directory(out_dir)) {
    throw std::runtime_error("prepare: cannot create output directory " + out_dir + ": " + error.message());
  }
  size_t removed = 0;
  for (const char* split : {"train", "val"}) {
    const std::string pattern = (std::filesystem::path(out_dir) / split).string() + "_[0-9][0-9][0-9][0-9][0-9][0-9].bin";
    glob_t matches{};
    if (::glob(pattern.c_str(), 0, nullptr, &matches) == 0) {
      for (size_t i = 0; i < matches.gl_pathc; ++i) removed += std::filesystem::remove(matches.gl_pathv[i]) ? 1 : 0;
    }
    ::globfree(&matches);
  }
  if (removed > 0) spdlog::info("prepare: removed {} shards of an earlier preparation in {}", removed, out_dir);
}

void write_dataset_json(const std::string& out_dir, const nlohmann::json& info) {
  const std::string path = (std::filesystem::path(out_dir) / "dataset.json").string();
  std::ofstream file(path);
  file << info.dump(2) << "\n";
  file.close();
  if (!file) throw std::runtime_error("prepare: cannot write " + path);
}

nlohmann::json describe(const ShardWriter& train, const ShardWriter& val, size_t shard_tokens) {
  return {{"tokenizer", "byte"},           {"vocab_size", kByteVocabSize}, {"train_tokens", train.tokens()},
          {"train_shards", train.shards()}, {"val_tokens", val.tokens()},   {"val_shards", val.shards()},
          {"shard_tokens", shard_tokens},   {"shard_format", "llm.c uint16 (magic 20240520, version 1)"}};
}

}  // namespace

nlohmann::json prepare_synthetic(const std::string& out_dir, size_t train_tokens, size_t val_tokens, uint64_t seed,
                                 size_t shard_tokens) {
  check_shard_tokens(shard_tokens);
  if (train_tokens < 2) throw std::invalid_argument("prepare synthetic: train_tokens must be >= 2");
  prepare_out_dir(out_dir);
  ShardWriter train(out_dir, "train", shard_tokens), val(out_dir, "val", shard_tokens);
  Progress progress("prepare synthetic", train_tokens + val_tokens);
  size_t done = 0;
  for (auto [writer, count, stream] : {std::make_tuple(&train, train_tokens, 0), std::make_tuple(&val, val_tokens, 1)}) {
    SyntheticCorpus corpus(seed, static_cast<uint64_t>(stream));
    std::vector<uint32_t> chunk;
    for (size_t left = count; left > 0;) {
      const size_t n = std::min(left, shard_tokens);
      chunk.clear();
      corpus.generate(n, chunk);
      writer->add(chunk.data(), n);
      left -= n;
      progress.update(done += n);
    }
    writer->finish();
  }
  nlohmann::json info = describe(train, val, shard_tokens);
  info["source"] = "synthetic order-2 Markov";
  info["seed"] = seed;
  info["successors"] = kSyntheticSuccessors;
  info["entropy_rate_nats"] = synthetic_entropy_rate(kSyntheticSuccessors);
  write_dataset_json(out_dir, info);
  spdlog::info("prepare synthetic: {} train tokens in {} shards, {} val tokens in {} shards in {}; entropy rate "
               "{:.4f} nats/token",
               train.tokens(), train.shards(), val.tokens(), val.shards(), out_dir, info["entropy_rate_nats"].get<double>());
  return info;
}

nlohmann::json prepare_text(const std::vector<std::string>& files, const std::string& out_dir, double val_fraction,
                            size_t shard_tokens) {
  check_shard_tokens(shard_tokens);
  if (!(val_fraction >= 0.0 && val_fraction < 1.0)) {
    throw std::invalid_argument("prepare text: val_fraction = " + std::to_string(val_fraction) + " must be in [0, 1)");
  }
  if (files.empty()) throw std::invalid_argument("prepare text: no input files");
  std::vector<size_t> sizes;
  size_t total = 0, total_val = 0;
  for (const std::string& file : files) {
    std::error_code error;
    if (!std::filesystem::is_regular_file(file, error)) {
      throw std::runtime_error("prepare text: input file " + file + " does not exist or is not a regular file");
    }
    sizes.push_back(static_cast<size_t>(std::filesystem::file_size(file)));
    if (sizes.back() == 0) spdlog::warn("prepare text: input file {} is empty", file);
    total += sizes.back();
    total_val += static_cast<size_t>(std::llround(val_fraction * static_cast<double>(sizes.back())));
  }
  if (total == 0) {
    std::string names;
    for (const std::string& file : files) names += (names.empty() ? "" : ", ") + file;
    throw std::runtime_error("prepare text: the input files (" + names + ") hold no bytes, nothing to write");
  }
  if (val_fraction > 0.0 && total_val == 0) {
    throw std::runtime_error("prepare text: val_fraction " + std::to_string(val_fraction) + " of " +
                             std::to_string(total) + " bytes leaves no validation tokens");
  }
  if (total_val == total) throw std::runtime_error("prepare text: val_fraction leaves no training tokens");
  prepare_out_dir(out_dir);
  ShardWriter train(out_dir, "train", shard_tokens), val(out_dir, "val", shard_tokens);
  Progress progress("prepare text", total);
  size_t done = 0;
  std::vector<char> bytes(size_t{1} << 24);
  std::vector<uint32_t> tokens;
  for (size_t f = 0; f < files.size(); ++f) {
    std::ifstream in(files[f], std::ios::binary);
    if (!in) throw std::runtime_error("prepare text: cannot open input file " + files[f]);
    const size_t train_bytes =
        sizes[f] - static_cast<size_t>(std::llround(val_fraction * static_cast<double>(sizes[f])));
    for (size_t offset = 0; offset < sizes[f];) {
      in.read(bytes.data(), static_cast<std::streamsize>(std::min(bytes.size(), sizes[f] - offset)));
      const size_t got = static_cast<size_t>(in.gcount());
      if (got == 0) throw std::runtime_error("prepare text: read error in input file " + files[f]);
      tokens = byte_encode(std::string(bytes.data(), got));
      const size_t to_train = offset < train_bytes ? std::min(got, train_bytes - offset) : 0;
      train.add(tokens.data(), to_train);
      val.add(tokens.data() + to_train, got - to_train);
      offset += got;
      progress.update(done += got);
    }
  }
  train.finish();
  val.finish();
  nlohmann::json info = describe(train, val, shard_tokens);
  info["source"] = "text";
  info["files"] = files;
  info["val_fraction"] = val_fraction;
  write_dataset_json(out_dir, info);
  spdlog::info("prepare text: {} train tokens in {} shards, {} val tokens in {} shards in {}", train.tokens(),
               train.shards(), val.tokens(), val.shards(), out_dir);
  return info;
}

void add_prepare_command(CLI::App& app) {
  CLI::App* prepare = app.add_subcommand("prepare", "Write token shards (llm.c format) for training");
  prepare->require_subcommand(1);

  struct SyntheticOptions {
    std::string out = "data/synthetic";
    size_t train_tokens = 5000000, val_tokens = 250000, shard_tokens = 100000000;
    uint64_t seed = 1337;
  };
  auto synthetic = std::make_shared<SyntheticOptions>();
  CLI::App* synthetic_cmd = prepare->add_subcommand(
      "synthetic", "Order-2 Markov byte corpus with a known entropy rate (ln " +
                       std::to_string(kSyntheticSuccessors) + " nats/token)");
  synthetic_cmd->add_option("--out", synthetic->out, "output directory")->capture_default_str();
  synthetic_cmd->add_option("--train_tokens", synthetic->train_tokens, "training tokens")->capture_default_str();
  synthetic_cmd->add_option("--val_tokens", synthetic->val_tokens, "validation tokens (0: none)")->capture_default_str();
  synthetic_cmd->add_option("--shard_tokens", synthetic->shard_tokens, "tokens per shard")->capture_default_str();
  synthetic_cmd->add_option("--seed", synthetic->seed, "seed of the source and the samples")->capture_default_str();
  synthetic_cmd->callback([synthetic] {
    prepare_synthetic(synthetic->out, synthetic->train_tokens, synthetic->val_tokens, synthetic->seed,
                      synthetic->shard_tokens);
  });

  struct TextOptions {
    std::vector<std::string> files;
    std::string out;
    double val_fraction = 0.1;
    size_t shard_tokens = 100000000;
  };
  auto text = std::make_shared<TextOptions>();
  CLI::App* text_cmd = prepare->add_subcommand("text", "Byte-tokenize text files (vocabulary 256)");
  text_cmd->add_option("files", text->files, "input text files")->required();
  text_cmd->add_option("--out", text->out, "output directory")->required();
  text_cmd->add_option("--val_fraction", text->val_fraction, "fraction of each file (its end) for validation")
      ->capture_default_str();
  text_cmd->add_option("--shard_tokens", text->shard_tokens, "tokens per shard")->capture_default_str();
  text_cmd->callback([text] { prepare_text(text->files, text->out, text->val_fraction, text->shard_tokens); });
}

}  // namespace coda
