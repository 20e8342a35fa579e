// Token data: the llm.c shard format and the rank-aware loader.
// Shard format (llm.c / nanoGPT-style scripts): a 1024-byte header of 256 int32 values
//   header[0] = magic, header[1] = version, header[2] = number of tokens,
// followed by the tokens: magic 20240520 / version 1 stores uint16 tokens, magic 20240801 / version 7
// stores uint32 tokens (for vocabularies over 65535).
// The loader cuts every shard into non-overlapping windows of T+1 tokens at stride T (inputs are the
// first T, targets the last T). A global batch is world_size * B windows; rank r takes its B windows
// from the global batch's slice r, so ranks never share a window. Training order is shuffled from the
// seed (shard order and window order, re-drawn every epoch); validation is sequential.

#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace coda {

constexpr int32_t kShardMagicU16 = 20240520;
constexpr int32_t kShardVersionU16 = 1;
constexpr int32_t kShardMagicU32 = 20240801;
constexpr int32_t kShardVersionU32 = 7;
constexpr size_t kShardHeaderBytes = 1024;

// Writes tokens as a shard, uint16 when vocab_size <= 65536, else uint32. Atomic (temp + rename).
void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, int vocab_size);
// Reads and validates a whole shard; throws std::runtime_error naming the file on a bad magic or
// version, a truncated file, or (when vocab_size > 0) a token id >= vocab_size.
std::vector<uint32_t> read_shard(const std::string& path, int vocab_size = 0);
// Sorted list of files matching a glob pattern; throws if none match.
std::vector<std::string> match_shards(const std::string& pattern);

// The largest token id of a shard (-1 when it holds no tokens), found by one pass over the tokens, or
// from the shard's scan cache when that was written for a file of the same size and mtime. The pass
// writes the cache (when the directory is writable), so a large dataset is scanned once.
int64_t shard_max_token(const std::string& path);
// Where the scan cache of a shard lives: ".NAME.max_token" beside it (hidden from shard globs).
std::string shard_scan_cache_path(const std::string& path);
// Throws std::runtime_error naming the shard, the first id >= vocab_size, its position and vocab_size
// when the shard holds one.
void check_shard_vocab(const std::string& path, int vocab_size);

class DataLoader {
 public:
  // Throws std::runtime_error (naming the files) when the shards hold fewer windows than one global
  // batch, or on any shard error above. With vocab_size > 0 every shard is checked whole
  // (check_shard_vocab) here, so a bad id stops the run before its first step, not when it is read.
  DataLoader(const std::string& pattern, int B, int T, int rank, int world_size, bool shuffle, uint64_t seed,
             int vocab_size);
  // Fills B*T inputs and B*T targets for this rank and advances; wraps to a new epoch at the end.
  void next_batch(int32_t* tokens, int32_t* targets);
  // Back to the first batch of epoch 0.
  void reset();
  // Exact position (epoch, batch within the epoch, and what the shuffle needs), for checkpoints.
  nlohmann::json position() const;
  void restore(const nlohmann::json& position);
  // Global batches in one pass over the data.
  size_t batches_per_epoch() const;
  size_t total_tokens() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace coda
