// Token data: the llm.c shard format and the rank-aware loader.
//
// Shard format (llm.c / nanoGPT-style scripts): a 1024-byte header of 256 int32 values
//   header[0] = magic, header[1] = version, header[2] = number of tokens,
// followed by the tokens: magic 20240520 / version 1 stores uint16 tokens, magic 20240801 / version 7
// stores uint32 tokens (for vocabularies over 65535).
//
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

class DataLoader {
 public:
  // Throws std::runtime_error (naming the files) when the shards hold fewer windows than one global
  // batch, or on any shard error above.
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
