// Tests of the shard format, the loader and dataset preparation (src/data.*, src/prepare.*).
//
// Loader tests write shards whose token at position p of shard s is the value s * kTag + p (vocab 2^20,
// so uint32 shards), which makes every window identify itself: its first token says which shard and
// which window it is. Everything else uses random tokens.
#include <CLI/CLI.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <unordered_map>

#include "data.hpp"
#include "prepare.hpp"
#include "rng.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using coda::DataLoader;

namespace {

constexpr uint32_t kTag = 100000;
constexpr int kTagVocab = 1 << 20;

class DataTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return dir_ / name; }

  static std::vector<uint32_t> random_tokens(size_t n, uint32_t vocab, uint64_t seed) {
    coda::Rng rng(seed);
    std::vector<uint32_t> tokens(n);
    for (auto& token : tokens) token = static_cast<uint32_t>(rng.below(vocab));
    return tokens;
  }

  // Shards "tag_000.bin"... holding s * kTag + p at position p; returns the glob.
  std::string write_tagged_shards(const std::vector<size_t>& sizes) {
    for (size_t s = 0; s < sizes.size(); ++s) {
      std::vector<uint32_t> tokens(sizes[s]);
      for (size_t p = 0; p < sizes[s]; ++p) tokens[p] = static_cast<uint32_t>(s * kTag + p);
      char name[32];
      std::snprintf(name, sizeof(name), "tag_%03zu.bin", s);
      coda::write_shard(path(name), tokens, kTagVocab);
    }
    return path("tag_*.bin");
  }

  // Runs one batch; checks inputs/targets are consecutive tokens of one window starting at a multiple of
  // T; returns each row's first token (its window's identity).
  static std::vector<uint32_t> next_windows(DataLoader& loader, int B, int T) {
    std::vector<int32_t> tokens(static_cast<size_t>(B) * T, -1), targets(static_cast<size_t>(B) * T, -1);
    loader.next_batch(tokens.data(), targets.data());
    std::vector<uint32_t> starts;
    for (int b = 0; b < B; ++b) {
      const int32_t first = tokens[static_cast<size_t>(b) * T];
      EXPECT_EQ((first % kTag) % T, 0u) << "window does not start at a multiple of T";
      for (int t = 0; t < T; ++t) {
        EXPECT_EQ(tokens[static_cast<size_t>(b) * T + t], first + t);
        EXPECT_EQ(targets[static_cast<size_t>(b) * T + t], first + t + 1);
      }
      starts.push_back(static_cast<uint32_t>(first));
    }
    return starts;
  }

  static void overwrite_header_word(const std::string& file, int index, int32_t value) {
    std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
    stream.seekp(index * 4);
    stream.write(reinterpret_cast<const char*>(&value), 4);
  }

  template <typename F>
  static void expect_error_naming(F&& action, const std::string& file, const std::string& phrase) {
    try {
      action();
      ADD_FAILURE() << "no error; expected one naming " << file << " with \"" << phrase << "\"";
    } catch (const std::exception& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find(file), std::string::npos) << message;
      EXPECT_NE(message.find(phrase), std::string::npos) << message;
    }
  }

  coda::test::TempDir dir_{"coda_data"};
};

TEST_F(DataTest, ShardRoundTripUint16) {
  for (int vocab : {256, 50257}) {
    const auto tokens = random_tokens(12345, static_cast<uint32_t>(vocab), 7 + vocab);
    const std::string file = path("u16.bin");
    coda::write_shard(file, tokens, vocab);
    EXPECT_EQ(fs::file_size(file), coda::kShardHeaderBytes + 2 * tokens.size());
    EXPECT_FALSE(fs::exists(file + ".tmp"));
    std::ifstream in(file, std::ios::binary);
    int32_t header[3];
    in.read(reinterpret_cast<char*>(header), sizeof(header));
    EXPECT_EQ(header[0], coda::kShardMagicU16);
    EXPECT_EQ(header[1], coda::kShardVersionU16);
    EXPECT_EQ(header[2], static_cast<int32_t>(tokens.size()));
    EXPECT_EQ(coda::read_shard(file, vocab), tokens);
  }
}

TEST_F(DataTest, ShardRoundTripUint32) {
  const int vocab = 128256;
  const auto tokens = random_tokens(20000, vocab, 11);
  ASSERT_GT(*std::max_element(tokens.begin(), tokens.end()), 65535u);
  const std::string file = path("u32.bin");
  coda::write_shard(file, tokens, vocab);
  EXPECT_EQ(fs::file_size(file), coda::kShardHeaderBytes + 4 * tokens.size());
  std::ifstream in(file, std::ios::binary);
  int32_t header[2];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], coda::kShardMagicU32);
  EXPECT_EQ(header[1], coda::kShardVersionU32);
  EXPECT_EQ(coda::read_shard(file, vocab), tokens);
  EXPECT_EQ(coda::read_shard(file), tokens);
}

TEST_F(DataTest, WriteRejectsTokenOutsideVocab) {
  auto tokens = random_tokens(100, 256, 3);
  tokens[57] = 256;
  const std::string file = path("bad.bin");
  expect_error_naming([&] { coda::write_shard(file, tokens, 256); }, file, "vocab_size 256");
  EXPECT_FALSE(fs::exists(file));
}

TEST_F(DataTest, ReadErrorsNameTheFile) {
  const auto tokens = random_tokens(1000, 50257, 5);
  const std::string magic = path("magic.bin"), version = path("version.bin"), truncated = path("truncated.bin"),
                    headerless = path("headerless.bin"), vocab = path("vocab.bin");
  for (const auto& file : {magic, version, truncated, headerless, vocab}) coda::write_shard(file, tokens, 50257);
  overwrite_header_word(magic, 0, 12345);
  overwrite_header_word(version, 1, 3);
  fs::resize_file(truncated, fs::file_size(truncated) - 3);
  fs::resize_file(headerless, 1000);
  expect_error_naming([&] { coda::read_shard(magic); }, magic, "magic");
  expect_error_naming([&] { coda::read_shard(version); }, version, "version 3");
  expect_error_naming([&] { coda::read_shard(truncated); }, truncated, "truncated");
  expect_error_naming([&] { coda::read_shard(headerless); }, headerless, "truncated");
  expect_error_naming([&] { coda::read_shard(vocab, 256); }, vocab, ">= vocab_size 256");
  expect_error_naming([&] { coda::read_shard(path("missing.bin")); }, path("missing.bin"), "cannot open");
  // The loader validates headers and every token id when it starts.
  expect_error_naming([&] { DataLoader(truncated, 2, 8, 0, 1, true, 1, 50257); }, truncated, "truncated");
  expect_error_naming([&] { DataLoader(vocab, 4, 32, 0, 1, false, 1, 256); }, vocab, ">= vocab_size 256");
}

// One bad id near the end of the last shard: the first batches never read it, the loader still refuses
// the data when it starts, naming the shard, the id, its position and vocab_size.
TEST_F(DataTest, LoaderFindsABadIdAnywhereBeforeTheFirstBatch) {
  coda::write_shard(path("v_000.bin"), random_tokens(5000, 256, 1), 65536);
  std::vector<uint32_t> tokens = random_tokens(5000, 256, 2);
  tokens[4321] = 300;
  coda::write_shard(path("v_001.bin"), tokens, 65536);
  try {
    DataLoader loader(path("v_*.bin"), 2, 8, 0, 1, false, 1, 256);
    ADD_FAILURE() << "the loader accepted a shard holding token id 300 for vocab_size 256";
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    for (const std::string& part : {path("v_001.bin"), std::string("token id 300"), std::string("position 4321"),
                                    std::string("vocab_size 256")})
      EXPECT_NE(message.find(part), std::string::npos) << "message should name " << part << ": " << message;
  }
  EXPECT_NO_THROW(DataLoader(path("v_*.bin"), 2, 8, 0, 1, false, 1, 301));
}

// The largest id is cached beside the shard for the file's size and mtime: a matching cache is believed
// (here one that lies, to show it is read), a changed shard is scanned again, and shard globs never
// match the cache files.
TEST_F(DataTest, ScanCacheIsReusedUntilTheShardChanges) {
  const std::string shard = path("c_000.bin");
  std::vector<uint32_t> tokens = random_tokens(3000, 200, 3);
  tokens[17] = 250;
  coda::write_shard(shard, tokens, 256);
  EXPECT_EQ(coda::shard_max_token(shard), 250);
  const std::string cache = coda::shard_scan_cache_path(shard);
  ASSERT_TRUE(fs::exists(cache));
  nlohmann::json saved;
  std::ifstream(cache) >> saved;
  saved["max_token"] = 7;
  std::ofstream(cache, std::ios::trunc) << saved.dump();
  EXPECT_EQ(coda::shard_max_token(shard), 7) << "a cache that matches the file is used";

  tokens.push_back(255);
  coda::write_shard(shard, tokens, 256);
  EXPECT_EQ(coda::shard_max_token(shard), 255) << "a changed shard is scanned again";
  EXPECT_EQ(coda::match_shards(path("*")), std::vector<std::string>{shard});
  coda::write_shard(path("empty.bin"), {}, 256);
  EXPECT_EQ(coda::shard_max_token(path("empty.bin")), -1);
}

TEST_F(DataTest, MatchShardsSortsAndFailsOnNoMatch) {
  for (const char* name : {"x_002.bin", "x_000.bin", "x_001.bin", "y_000.bin"}) {
    coda::write_shard(path(name), random_tokens(10, 256, 1), 256);
  }
  const auto matched = coda::match_shards(path("x_*.bin"));
  ASSERT_EQ(matched.size(), 3u);
  EXPECT_EQ(matched[0], path("x_000.bin"));
  EXPECT_EQ(matched[2], path("x_002.bin"));
  expect_error_naming([&] { coda::match_shards(path("z_*.bin")); }, path("z_*.bin"), "no shard files match");
  expect_error_naming([&] { DataLoader(path("z_*.bin"), 1, 4, 0, 1, false, 0, 256); }, path("z_*.bin"),
                      "no shard files match");
  // A directory that does not exist is named, with the way to make the data.
  expect_error_naming([&] { coda::match_shards(path("absent/x_*.bin")); }, path("absent"), "cannot read directory");
  expect_error_naming([&] { coda::match_shards(path("absent/x_*.bin")); }, path("absent"), "coda prepare");
}

TEST_F(DataTest, TooFewWindowsForOneGlobalBatch) {
  // 3 windows of 17 tokens in each of the two shards; world 2 x B 4 needs 8.
  const std::string pattern = write_tagged_shards({49, 50});
  expect_error_naming([&] { DataLoader(pattern, 4, 16, 1, 2, true, 1, kTagVocab); }, path("tag_001.bin"),
                      "6 windows");
  DataLoader fits(pattern, 3, 16, 1, 2, true, 1, kTagVocab);
  EXPECT_EQ(fits.batches_per_epoch(), 1u);
  EXPECT_EQ(fits.total_tokens(), 99u);
}

TEST_F(DataTest, TargetsAreInputsShiftedByOne) {
  const int B = 3, T = 17;
  std::vector<std::vector<uint32_t>> shards;
  for (size_t s = 0; s < 2; ++s) {
    shards.push_back(random_tokens(300 + 50 * s, 50257, 20 + s));
    coda::write_shard(path("r_00" + std::to_string(s) + ".bin"), shards.back(), 50257);
  }
  DataLoader loader(path("r_*.bin"), B, T, 0, 1, true, 9, 50257);
  std::vector<int32_t> inputs(B * T), targets(B * T);
  for (int step = 0; step < 12; ++step) {
    loader.next_batch(inputs.data(), targets.data());
    for (int b = 0; b < B; ++b) {
      const int32_t* row = inputs.data() + b * T;
      // The row must be the window at some offset w*T of one shard.
      bool found = false;
      for (const auto& shard : shards) {
        for (size_t w = 0; (w + 1) * T < shard.size() && !found; ++w) {
          found = std::equal(row, row + T, shard.begin() + w * T,
                             [](int32_t x, uint32_t y) { return static_cast<uint32_t>(x) == y; }) &&
                  static_cast<uint32_t>(targets[b * T + T - 1]) == shard[w * T + T];
        }
      }
      EXPECT_TRUE(found) << "step " << step << " row " << b;
      for (int t = 0; t + 1 < T; ++t) EXPECT_EQ(targets[b * T + t], inputs[b * T + t + 1]);
    }
  }
}

TEST_F(DataTest, RanksTakeDisjointSlicesOfTheGlobalBatch) {
  const int B = 2, T = 8, world = 3;
  // Windows per shard: 12, 0 (too short), 7, 20 -> 39 windows, 6 global batches of 6.
  const std::string pattern = write_tagged_shards({100, 5, 60, 161});
  for (bool shuffle : {false, true}) {
    std::vector<DataLoader> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(pattern, B, T, r, world, shuffle, 42, kTagVocab);
    DataLoader whole(pattern, B * world, T, 0, 1, shuffle, 42, kTagVocab);
    ASSERT_EQ(whole.batches_per_epoch(), 6u);
    ASSERT_EQ(ranks[0].batches_per_epoch(), 6u);
    std::set<uint32_t> epoch_windows;
    for (int step = 0; step < 6; ++step) {
      std::vector<uint32_t> joined;
      for (int r = 0; r < world; ++r) {
        const auto starts = next_windows(ranks[r], B, T);
        joined.insert(joined.end(), starts.begin(), starts.end());
      }
      EXPECT_EQ(joined, next_windows(whole, B * world, T)) << "step " << step << " shuffle " << shuffle;
      epoch_windows.insert(joined.begin(), joined.end());
    }
    EXPECT_EQ(epoch_windows.size(), 36u) << "a window was used twice in one epoch";
    for (uint32_t start : epoch_windows) EXPECT_NE(start / kTag, 1u) << "window from a shard too short for one";
  }
}

TEST_F(DataTest, ShuffleIsDeterministicAndVariesWithSeedAndEpoch) {
  const int B = 4, T = 8;
  const std::string pattern = write_tagged_shards({257, 129, 400, 90});  // 32 + 16 + 49 + 11 = 108 windows
  auto epochs = [&](uint64_t seed) {
    DataLoader loader(pattern, B, T, 0, 1, true, seed, kTagVocab);
    std::vector<std::vector<uint32_t>> result(2);
    for (auto& epoch : result) {
      for (size_t step = 0; step < loader.batches_per_epoch(); ++step) {
        const auto starts = next_windows(loader, B, T);
        epoch.insert(epoch.end(), starts.begin(), starts.end());
      }
    }
    return result;
  };
  const auto a = epochs(1), again = epochs(1), b = epochs(2);
  EXPECT_EQ(a, again);
  EXPECT_NE(a[0], b[0]);
  EXPECT_NE(a[0], a[1]);
  ASSERT_EQ(a[0].size(), 108u);
  EXPECT_EQ(std::set<uint32_t>(a[0].begin(), a[0].end()).size(), 108u);
  EXPECT_EQ(std::set<uint32_t>(a[0].begin(), a[0].end()), std::set<uint32_t>(a[1].begin(), a[1].end()));
  // Shuffled for real: consecutive windows are rarely neighbours in a shard.
  int neighbours = 0;
  for (size_t i = 1; i < a[0].size(); ++i) neighbours += a[0][i] == a[0][i - 1] + T;
  EXPECT_LT(neighbours, 20);
}

TEST_F(DataTest, SequentialOrderWrapsToTheStart) {
  const int B = 2, T = 10;
  const std::string pattern = write_tagged_shards({45, 31});  // 4 + 3 windows: 3 batches, 1 left over
  DataLoader loader(pattern, B, T, 0, 1, false, 5, kTagVocab);
  ASSERT_EQ(loader.batches_per_epoch(), 3u);
  std::vector<uint32_t> order;
  for (int step = 0; step < 4; ++step) {
    const auto starts = next_windows(loader, B, T);
    order.insert(order.end(), starts.begin(), starts.end());
  }
  const std::vector<uint32_t> expected = {0, 10, 20, 30, kTag, kTag + 10, 0, 10};
  EXPECT_EQ(order, expected);
  loader.reset();
  EXPECT_EQ(next_windows(loader, B, T), (std::vector<uint32_t>{0, 10}));
}

TEST_F(DataTest, RestoreResumesTheExactStream) {
  const int B = 3, T = 16, world = 2;
  const std::string pattern = write_tagged_shards({500, 333, 170});
  DataLoader first(pattern, B, T, 1, world, true, 77, kTagVocab);
  const size_t per_epoch = first.batches_per_epoch();
  for (size_t step = 0; step < per_epoch + 2; ++step) next_windows(first, B, T);  // into epoch 1
  const std::string saved = first.position().dump();
  std::vector<uint32_t> expected;
  for (size_t step = 0; step < per_epoch + 3; ++step) {
    const auto starts = next_windows(first, B, T);
    expected.insert(expected.end(), starts.begin(), starts.end());
  }
  DataLoader resumed(pattern, B, T, 1, world, true, 77, kTagVocab);
  next_windows(resumed, B, T);  // its own state must not leak into the restored one
  resumed.restore(nlohmann::json::parse(saved));
  std::vector<uint32_t> got;
  for (size_t step = 0; step < per_epoch + 3; ++step) {
    const auto starts = next_windows(resumed, B, T);
    got.insert(got.end(), starts.begin(), starts.end());
  }
  EXPECT_EQ(got, expected);
  DataLoader other_seed(pattern, B, T, 1, world, true, 78, kTagVocab);
  EXPECT_THROW(other_seed.restore(nlohmann::json::parse(saved)), std::invalid_argument);
}

TEST(SyntheticCorpus, DeterministicAndStreamsDiffer) {
  coda::SyntheticCorpus a(3, 0), b(3, 0), val(3, 1);
  std::vector<uint32_t> whole, pieces, other;
  a.generate(5000, whole);
  b.generate(1234, pieces);
  b.generate(5000 - 1234, pieces);
  val.generate(5000, other);
  EXPECT_EQ(whole, pieces);
  EXPECT_NE(whole, other);
  EXPECT_EQ(a.successors(17, 200), val.successors(17, 200));  // one source, two sample paths
  EXPECT_NE(coda::SyntheticCorpus(4, 0).successors(17, 200), a.successors(17, 200));
  std::vector<uint32_t> other_seed;
  coda::SyntheticCorpus(4, 0).generate(5000, other_seed);
  EXPECT_NE(whole, other_seed);
}

TEST(SyntheticCorpus, EmpiricalEntropyMatchesTheRate) {
  const int K = coda::kSyntheticSuccessors;
  coda::SyntheticCorpus corpus(1337, 0);
  std::vector<uint32_t> tokens;
  corpus.generate(1 << 20, tokens);
  std::unordered_map<uint32_t, std::map<uint32_t, double>> order2, order1;
  for (size_t t = 2; t < tokens.size(); ++t) {
    order2[tokens[t - 2] * 256 + tokens[t - 1]][tokens[t]] += 1;
    order1[tokens[t - 1]][tokens[t]] += 1;
  }
  auto conditional_entropy = [](const std::unordered_map<uint32_t, std::map<uint32_t, double>>& counts) {
    double total = 0, entropy = 0;
    for (const auto& [context, next] : counts) {
      double n = 0;
      for (const auto& [token, count] : next) n += count;
      for (const auto& [token, count] : next) entropy -= count * std::log(count / n);
      total += n;
    }
    return entropy / total;
  };
  for (const auto& [context, next] : order2) {
    const auto allowed = corpus.successors(context / 256, context % 256);
    ASSERT_EQ(std::set<uint32_t>(allowed.begin(), allowed.end()).size(), static_cast<size_t>(K));
    for (const auto& [token, count] : next) {
      EXPECT_NE(std::find(allowed.begin(), allowed.end(), token), allowed.end()) << "context " << context;
    }
  }
  const double h2 = conditional_entropy(order2), h1 = conditional_entropy(order1);
  EXPECT_NEAR(h2, coda::synthetic_entropy_rate(), 0.01);
  EXPECT_DOUBLE_EQ(coda::synthetic_entropy_rate(), std::log(static_cast<double>(K)));
  // The token before last matters (learnable second-order structure), within the 2K candidates of the last.
  EXPECT_GT(h1, h2 + 0.3);
  EXPECT_LT(h1, std::log(2.0 * K) + 0.01);
  EXPECT_GT(order1.size(), 250u) << "the chain should visit (nearly) every token";
}

TEST(ByteTokenizer, RoundTrip) {
  coda::Rng rng(8);
  std::string text = "héllo, wörld \xF0\x9F\x99\x82 \n";
  for (int i = 0; i < 4000; ++i) text.push_back(static_cast<char>(rng.below(256)));
  text.push_back('\0');
  text.push_back('\xFF');
  const auto tokens = coda::byte_encode(text);
  ASSERT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[1], 0xC3u);
  EXPECT_EQ(tokens.back(), 255u);
  EXPECT_EQ(coda::byte_decode(tokens), text);
  EXPECT_THROW(coda::byte_decode({65, 256}), std::invalid_argument);
}

TEST_F(DataTest, PrepareTextSplitsEachFileAndShards) {
  coda::Rng rng(4);
  std::vector<std::string> contents(2);
  std::vector<std::string> files;
  for (size_t f = 0; f < contents.size(); ++f) {
    for (int i = 0; i < 3000 + 1000 * static_cast<int>(f); ++i) contents[f].push_back(static_cast<char>(32 + rng.below(95)));
    files.push_back(path("in_" + std::to_string(f) + ".txt"));
    std::ofstream(files.back(), std::ios::binary) << contents[f];
  }
  const std::string out = path("out");
  fs::create_directories(out);
  coda::write_shard(out + "/train_000009.bin", {1, 2, 3}, 256);  // stale shard of an earlier run
  const auto info = coda::prepare_text(files, out, 0.25, 1000);
  EXPECT_FALSE(fs::exists(out + "/train_000009.bin"));
  std::string train, val;
  for (const auto& shard : coda::match_shards(out + "/train_*.bin")) train += coda::byte_decode(coda::read_shard(shard, 256));
  for (const auto& shard : coda::match_shards(out + "/val_*.bin")) val += coda::byte_decode(coda::read_shard(shard, 256));
  EXPECT_EQ(train, contents[0].substr(0, 2250) + contents[1].substr(0, 3000));
  EXPECT_EQ(val, contents[0].substr(2250) + contents[1].substr(3000));
  EXPECT_EQ(coda::match_shards(out + "/train_*.bin").size(), 6u);
  EXPECT_EQ(info["train_tokens"], 5250);
  EXPECT_EQ(info["val_tokens"], 1750);
  std::ifstream json_file(out + "/dataset.json");
  EXPECT_EQ(nlohmann::json::parse(json_file), info);
  EXPECT_EQ(info["vocab_size"], 256);
  EXPECT_EQ(info["tokenizer"], "byte");
  expect_error_naming([&] { coda::prepare_text({files[0], path("nope.txt")}, out, 0.1, 1000); }, path("nope.txt"),
                      "does not exist");
  std::ofstream(path("empty.txt")).close();
  expect_error_naming([&] { coda::prepare_text({path("empty.txt")}, out, 0.1, 1000); }, path("empty.txt"), "no bytes");
}

TEST_F(DataTest, PrepareCommandWritesSyntheticShardsTheLoaderReads) {
  CLI::App app("coda");
  coda::add_prepare_command(app);
  const std::string out = path("synthetic");
  const std::vector<std::string> args = {"coda",           "prepare", "synthetic", "--out",          out,
                                         "--train_tokens", "5000",    "--val_tokens", "700", "--shard_tokens",
                                         "2000",           "--seed",  "9"};
  std::vector<const char*> argv;
  for (const auto& arg : args) argv.push_back(arg.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
  EXPECT_EQ(coda::match_shards(out + "/train_*.bin").size(), 3u);
  EXPECT_EQ(coda::match_shards(out + "/val_*.bin").size(), 1u);
  std::ifstream json_file(out + "/dataset.json");
  const auto info = nlohmann::json::parse(json_file);
  EXPECT_EQ(info["train_tokens"], 5000);
  EXPECT_EQ(info["val_tokens"], 700);
  EXPECT_DOUBLE_EQ(info["entropy_rate_nats"].get<double>(), coda::synthetic_entropy_rate());
  // The shards are the corpus' streams 0 and 1 of seed 9.
  std::vector<uint32_t> expected, got;
  coda::SyntheticCorpus(9, 0).generate(5000, expected);
  for (const auto& shard : coda::match_shards(out + "/train_*.bin")) {
    const auto tokens = coda::read_shard(shard, 256);
    got.insert(got.end(), tokens.begin(), tokens.end());
  }
  EXPECT_EQ(got, expected);
  DataLoader loader(out + "/val_*.bin", 4, 64, 0, 1, false, 0, 256);
  EXPECT_EQ(loader.batches_per_epoch(), 2u);
}

}  // namespace
