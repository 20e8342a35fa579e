// Token shards and the rank-aware loader (see data.hpp for the format and the contract).
//
// Reading. A shard is validated before any token is used: the header's magic and version must be one
// of the two known pairs, and the file size must equal 1024 + count * token_bytes exactly (shorter
// means truncated, longer means the header lies). Token ids are checked against the vocabulary as
// they are read, so a bad id is reported with its file and position.
#include "data.hpp"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <utility>

#include "rng.hpp"

namespace coda {

namespace {

std::string shard_error(const std::string& path, const std::string& what) { return "shard " + path + ": " + what; }

// An open file read with pread; closes itself.
class ReadFile {
 public:
  ReadFile() = default;
  explicit ReadFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw std::runtime_error(shard_error(path, std::string("cannot open: ") + std::strerror(errno)));
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      const int err = errno;
      ::close(fd_);
      throw std::runtime_error(shard_error(path, std::string("cannot stat: ") + std::strerror(err)));
    }
    size_ = static_cast<size_t>(info.st_size);
  }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;
  ReadFile(ReadFile&& other) noexcept { *this = std::move(other); }
  ReadFile& operator=(ReadFile&& other) noexcept {
    std::swap(fd_, other.fd_);
    std::swap(size_, other.size_);
    std::swap(path_, other.path_);
    return *this;
  }
  ~ReadFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

  void read_at(size_t offset, size_t bytes, void* dst) const {
    auto* out = static_cast<char*>(dst);
    while (bytes > 0) {
      const ssize_t got = ::pread(fd_, out, bytes, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        throw std::runtime_error(shard_error(path_, got == 0 ? "unexpected end of file" : std::strerror(errno)));
      }
      out += got;
      offset += static_cast<size_t>(got);
      bytes -= static_cast<size_t>(got);
    }
  }

 private:
  int fd_ = -1;
  size_t size_ = 0;
  std::string path_;
};

struct ShardHeader {
  size_t tokens = 0;
  size_t token_bytes = 0;  // 2 or 4
};

ShardHeader read_header(const ReadFile& file) {
  const std::string& path = file.path();
  if (file.size() < kShardHeaderBytes) {
    throw std::runtime_error(shard_error(path, "file is " + std::to_string(file.size()) + " bytes, shorter than the " +
                                                   std::to_string(kShardHeaderBytes) + "-byte header (truncated)"));
  }
  int32_t header[kShardHeaderBytes / sizeof(int32_t)];
  file.read_at(0, kShardHeaderBytes, header);
  const int32_t magic = header[0], version = header[1], count = header[2];
  ShardHeader result;
  int32_t expected_version = 0;
  if (magic == kShardMagicU16) {
    result.token_bytes = 2;
    expected_version = kShardVersionU16;
  } else if (magic == kShardMagicU32) {
    result.token_bytes = 4;
    expected_version = kShardVersionU32;
  } else {
    throw std::runtime_error(shard_error(path, "bad magic number " + std::to_string(magic) + " (expected " +
                                                   std::to_string(kShardMagicU16) + " for uint16 tokens or " +
                                                   std::to_string(kShardMagicU32) + " for uint32 tokens)"));
  }
  if (version != expected_version) {
    throw std::runtime_error(shard_error(path, "unsupported version " + std::to_string(version) + " for magic " +
                                                   std::to_string(magic) + " (expected version " +
                                                   std::to_string(expected_version) + ")"));
  }
  if (count < 0) throw std::runtime_error(shard_error(path, "negative token count " + std::to_string(count)));
  result.tokens = static_cast<size_t>(count);
  const size_t expected_size = kShardHeaderBytes + result.tokens * result.token_bytes;
  if (file.size() != expected_size) {
    throw std::runtime_error(shard_error(
        path, "header says " + std::to_string(count) + " tokens of " + std::to_string(result.token_bytes) +
                  " bytes (" + std::to_string(expected_size) + " bytes with the header) but the file is " +
                  std::to_string(file.size()) + " bytes" +
                  (file.size() < expected_size ? " (truncated)" : " (trailing bytes)")));
  }
  return result;
}

// Reads `count` tokens starting at token index `first` into dst, checking ids against vocab_size (> 0).
void read_tokens(const ReadFile& file, const ShardHeader& header, size_t first, size_t count, int vocab_size,
                 std::vector<uint8_t>& scratch, uint32_t* dst) {
  scratch.resize(count * header.token_bytes);
  file.read_at(kShardHeaderBytes + first * header.token_bytes, scratch.size(), scratch.data());
  for (size_t i = 0; i < count; ++i) {
    if (header.token_bytes == 2) {
      uint16_t value;
      std::memcpy(&value, scratch.data() + 2 * i, 2);
      dst[i] = value;
    } else {
      std::memcpy(&dst[i], scratch.data() + 4 * i, 4);
    }
    if (vocab_size > 0 && dst[i] >= static_cast<uint32_t>(vocab_size)) {
      throw std::runtime_error(shard_error(file.path(), "token id " + std::to_string(dst[i]) + " at position " +
                                                            std::to_string(first + i) + " is >= vocab_size " +
                                                            std::to_string(vocab_size)));
    }
  }
}

// The identity of a shard's contents that its scan cache is keyed by.
struct FileStamp {
  int64_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp& other) const { return size == other.size && mtime_ns == other.mtime_ns; }
};

FileStamp file_stamp(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0)
    throw std::runtime_error(shard_error(path, std::string("cannot stat: ") + std::strerror(errno)));
  return {static_cast<int64_t>(info.st_size),
          static_cast<int64_t>(info.st_mtim.tv_sec) * 1000000000 + static_cast<int64_t>(info.st_mtim.tv_nsec)};
}

constexpr size_t kScanChunkTokens = size_t{1} << 20;

// Visits the tokens of a shard in chunks: visit(first token index, pointer, count); stops when it
// returns false.
template <typename Token, typename Visit>
void for_each_chunk(const ReadFile& file, const ShardHeader& header, Visit visit) {
  std::vector<Token> chunk(std::min(kScanChunkTokens, header.tokens));
  for (size_t first = 0; first < header.tokens; first += chunk.size()) {
    const size_t count = std::min(chunk.size(), header.tokens - first);
    file.read_at(kShardHeaderBytes + first * sizeof(Token), count * sizeof(Token), chunk.data());
    if (!visit(first, chunk.data(), count)) return;
  }
}

template <typename Token>
int64_t scan_max_token(const ReadFile& file, const ShardHeader& header) {
  int64_t largest = -1;
  for_each_chunk<Token>(file, header, [&](size_t, const Token* tokens, size_t count) {
    Token m = 0;
    for (size_t i = 0; i < count; ++i) m = tokens[i] > m ? tokens[i] : m;
    largest = std::max(largest, static_cast<int64_t>(m));
    return true;
  });
  return largest;
}

// (position, id) of the first token id >= vocab_size.
template <typename Token>
std::pair<size_t, uint32_t> first_bad_token(const ReadFile& file, const ShardHeader& header, int vocab_size) {
  std::pair<size_t, uint32_t> bad{header.tokens, 0};
  for_each_chunk<Token>(file, header, [&](size_t first, const Token* tokens, size_t count) {
    for (size_t i = 0; i < count; ++i)
      if (tokens[i] >= static_cast<uint32_t>(vocab_size)) {
        bad = {first + i, tokens[i]};
        return false;
      }
    return true;
  });
  return bad;
}

// The cached largest id when the cache matches stamp.
std::optional<int64_t> read_scan_cache(const std::string& cache, const FileStamp& stamp) {
  std::ifstream in(cache);
  if (!in) return std::nullopt;
  const nlohmann::json json = nlohmann::json::parse(in, nullptr, false);
  if (!json.is_object() || !json.contains("size") || !json.contains("mtime_ns") || !json.contains("max_token") ||
      !json.at("max_token").is_number_integer())
    return std::nullopt;
  if (!(FileStamp{json.value("size", int64_t{-1}), json.value("mtime_ns", int64_t{-1})} == stamp)) return std::nullopt;
  return json.at("max_token").get<int64_t>();
}

void write_scan_cache(const std::string& cache, const FileStamp& stamp, int64_t max_token) {
  const std::string tmp = cache + "." + std::to_string(::getpid()) + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << nlohmann::json{{"size", stamp.size}, {"mtime_ns", stamp.mtime_ns}, {"max_token", max_token}}.dump() << "\n";
    if (!out.flush()) {
      std::remove(tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), cache.c_str()) != 0) std::remove(tmp.c_str());
}

// splitmix64 finaliser folded over the words: a seed for Rng that differs for every (seed, epoch, shard).
uint64_t mix_seed(std::initializer_list<uint64_t> words) {
  uint64_t h = 0x243F6A8885A308D3ull;
  for (uint64_t word : words) {
    h ^= word + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
  }
  return h;
}

template <typename Index>
void shuffle_in_place(std::vector<Index>& items, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = items.size(); i > 1; --i) std::swap(items[i - 1], items[rng.below(i)]);
}

}  // namespace

void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, int vocab_size) {
  if (vocab_size <= 0) throw std::invalid_argument(shard_error(path, "vocab_size must be positive"));
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw std::invalid_argument(shard_error(path, std::to_string(tokens.size()) +
                                                      " tokens do not fit the header's int32 count"));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= static_cast<uint32_t>(vocab_size)) {
      throw std::invalid_argument(shard_error(path, "token id " + std::to_string(tokens[i]) + " at position " +
                                                        std::to_string(i) + " is >= vocab_size " +
                                                        std::to_string(vocab_size)));
    }
  }
  const bool narrow = vocab_size <= 65536;
  int32_t header[kShardHeaderBytes / sizeof(int32_t)] = {};
  header[0] = narrow ? kShardMagicU16 : kShardMagicU32;
  header[1] = narrow ? kShardVersionU16 : kShardVersionU32;
  header[2] = static_cast<int32_t>(tokens.size());

  const std::string tmp = path + ".tmp";
  std::FILE* file = std::fopen(tmp.c_str(), "wb");
  if (!file) throw std::runtime_error(shard_error(tmp, std::string("cannot create: ") + std::strerror(errno)));
  bool ok = std::fwrite(header, 1, sizeof(header), file) == sizeof(header);
  if (narrow) {
    const std::vector<uint16_t> narrowed(tokens.begin(), tokens.end());
    ok = ok && std::fwrite(narrowed.data(), sizeof(uint16_t), narrowed.size(), file) == narrowed.size();
  } else {
    ok = ok && std::fwrite(tokens.data(), sizeof(uint32_t), tokens.size(), file) == tokens.size();
  }
  ok = (std::fclose(file) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error(shard_error(path, "write failed: " + reason));
  }
}

std::vector<uint32_t> read_shard(const std::string& path, int vocab_size) {
  const ReadFile file(path);
  const ShardHeader header = read_header(file);
  std::vector<uint32_t> tokens(header.tokens);
  std::vector<uint8_t> scratch;
  read_tokens(file, header, 0, header.tokens, vocab_size, scratch, tokens.data());
  return tokens;
}

std::vector<std::string> match_shards(const std::string& pattern) {
  glob_t matches{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &matches);
  std::vector<std::string> paths(matches.gl_pathv, matches.gl_pathv + (rc == 0 ? matches.gl_pathc : 0));
  ::globfree(&matches);
  if (rc == GLOB_NOMATCH || (rc == 0 && paths.empty())) {
    throw std::runtime_error("no shard files match \"" + pattern + "\"");
  }
  if (rc == GLOB_ABORTED) {
    std::string dir = std::filesystem::path(pattern).parent_path().string();
    if (dir.empty()) dir = ".";
    throw std::runtime_error("no shard files match \"" + pattern + "\": cannot read directory \"" + dir +
                             "\" (missing? `coda prepare` writes shards)");
  }
  if (rc != 0) throw std::runtime_error("cannot expand shard pattern \"" + pattern + "\"");
  std::sort(paths.begin(), paths.end());
  return paths;
}

// Loading. The loader never holds a whole dataset, nor even a whole shard: at construction it reads
// only the headers (token counts), and each window of T+1 tokens is read with one pread from the one
// shard file it keeps open. Shard s holds floor((n_s - 1) / T) windows; window w covers tokens
// [w T, w T + T]. One epoch is the sequence of all windows: shards in epoch order, and within a shard
// its windows in epoch order. Global batch k is the windows [k G, (k+1) G) of that sequence with
// G = world_size * B, and rank r reads the slice [k G + r B, k G + (r+1) B). The leftover windows
// (fewer than G) at the end of an epoch are skipped. With shuffling, the shard order of epoch e is a
// permutation drawn from hash(seed, e), and the window order of shard s in epoch e one drawn from
// hash(seed, e, s); without it both are the identity. Because every order is a pure function of
// (seed, epoch, shard), the position is just (epoch, batch): restore() rebuilds everything else, and
// every rank computes the same orders without communicating.

// Vocabulary check. A bad id deep inside a shard would otherwise surface only when its window is read,
// possibly hours into a run, so the loader checks every shard whole at construction: one sequential
// pass computes the largest id (a branch-free max over chunks, which the compiler vectorizes), and only
// when it is >= vocab_size a second pass finds the first bad id for the message. The largest id does not
// depend on vocab_size, so it is cached beside the shard in a hidden ".NAME.max_token" file (JSON: the
// shard's size and mtime in nanoseconds, and the id); a cache that does not match the file's current size
// and mtime is ignored and rewritten. The cache is written through a temporary file of this process and a
// rename, so concurrent ranks scanning the same shard never read a partial one; a directory that cannot
// be written just goes without a cache.
std::string shard_scan_cache_path(const std::string& path) {
  const std::filesystem::path shard(path);
  return (shard.parent_path() / ("." + shard.filename().string() + ".max_token")).string();
}

int64_t shard_max_token(const std::string& path) {
  const FileStamp stamp = file_stamp(path);
  const std::string cache = shard_scan_cache_path(path);
  if (const std::optional<int64_t> cached = read_scan_cache(cache, stamp)) return *cached;
  const ReadFile file(path);
  const ShardHeader header = read_header(file);
  const int64_t largest =
      header.token_bytes == 2 ? scan_max_token<uint16_t>(file, header) : scan_max_token<uint32_t>(file, header);
  write_scan_cache(cache, stamp, largest);
  return largest;
}

void check_shard_vocab(const std::string& path, int vocab_size) {
  const int64_t largest = shard_max_token(path);
  if (largest < vocab_size) return;
  const ReadFile file(path);
  const ShardHeader header = read_header(file);
  const auto [position, id] = header.token_bytes == 2 ? first_bad_token<uint16_t>(file, header, vocab_size)
                                                      : first_bad_token<uint32_t>(file, header, vocab_size);
  throw std::runtime_error(shard_error(path, "token id " + std::to_string(id) + " at position " +
                                                 std::to_string(position) + " is >= vocab_size " +
                                                 std::to_string(vocab_size) + " (the largest id in the shard is " +
                                                 std::to_string(largest) + "; was it tokenized for another model?)"));
}

struct DataLoader::Impl {
  struct Shard {
    std::string path;
    ShardHeader header;
    size_t windows = 0;
  };

  std::string pattern;
  int B = 0, T = 0, rank = 0, world_size = 1;
  bool shuffle = false;
  uint64_t seed = 0;
  int vocab_size = 0;
  std::vector<Shard> shards;  // sorted by path
  size_t total_windows = 0, total_tokens = 0, batches_per_epoch = 0;

  size_t epoch = 0, batch = 0;  // the position: the next batch to hand out

  // Orders of the epoch `layout_epoch`: shard_order[p] is the shard at place p, window_start[p] the
  // index in the epoch's window sequence of its first window (window_start.back() = total_windows).
  size_t layout_epoch = std::numeric_limits<size_t>::max();
  std::vector<size_t> shard_order, window_start;

  // The open shard (place `open_place` of layout_epoch) and its window order.
  size_t open_place = std::numeric_limits<size_t>::max();
  ReadFile open_file;
  std::vector<uint32_t> window_order;
  std::vector<uint8_t> scratch;
  std::vector<uint32_t> window;

  size_t global_batch() const { return static_cast<size_t>(world_size) * static_cast<size_t>(B); }

  void lay_out_epoch() {
    if (layout_epoch == epoch) return;
    shard_order.resize(shards.size());
    for (size_t s = 0; s < shards.size(); ++s) shard_order[s] = s;
    if (shuffle) shuffle_in_place(shard_order, mix_seed({seed, epoch}));
    window_start.assign(1, 0);
    for (size_t s : shard_order) window_start.push_back(window_start.back() + shards[s].windows);
    layout_epoch = epoch;
    open_place = std::numeric_limits<size_t>::max();
  }

  void open_place_of(size_t place) {
    if (open_place == place) return;
    const size_t s = shard_order[place];
    open_file = ReadFile(shards[s].path);
    window_order.resize(shards[s].windows);
    for (size_t w = 0; w < window_order.size(); ++w) window_order[w] = static_cast<uint32_t>(w);
    if (shuffle) shuffle_in_place(window_order, mix_seed({seed, epoch, s + 1}));
    open_place = place;
  }

  // Reads window number `index` of the current epoch's sequence into `window` (T+1 tokens).
  void read_window(size_t index) {
    lay_out_epoch();
    const size_t place =
        static_cast<size_t>(std::upper_bound(window_start.begin(), window_start.end(), index) - window_start.begin()) - 1;
    open_place_of(place);
    const Shard& shard = shards[shard_order[place]];
    const size_t w = window_order[index - window_start[place]];
    window.resize(static_cast<size_t>(T) + 1);
    read_tokens(open_file, shard.header, w * static_cast<size_t>(T), window.size(), vocab_size, scratch, window.data());
  }
};

DataLoader::DataLoader(const std::string& pattern, int B, int T, int rank, int world_size, bool shuffle,
                       uint64_t seed, int vocab_size)
    : impl_(std::make_shared<Impl>()) {
  if (B < 1 || T < 1) {
    throw std::invalid_argument("data loader for \"" + pattern + "\": batch size " + std::to_string(B) +
                                " and sequence length " + std::to_string(T) + " must be >= 1");
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("data loader for \"" + pattern + "\": rank " + std::to_string(rank) +
                                " is not in [0, world_size = " + std::to_string(world_size) + ")");
  }
  Impl& d = *impl_;
  d.pattern = pattern;
  d.B = B;
  d.T = T;
  d.rank = rank;
  d.world_size = world_size;
  d.shuffle = shuffle;
  d.seed = seed;
  d.vocab_size = vocab_size;
  for (const std::string& path : match_shards(pattern)) {
    Impl::Shard shard;
    shard.path = path;
    shard.header = read_header(ReadFile(path));
    if (vocab_size > 0) check_shard_vocab(path, vocab_size);
    shard.windows = shard.header.tokens > 0 ? (shard.header.tokens - 1) / static_cast<size_t>(T) : 0;
    if (shard.windows > std::numeric_limits<uint32_t>::max()) {
      throw std::runtime_error(shard_error(path, "too many windows for the loader"));
    }
    d.total_windows += shard.windows;
    d.total_tokens += shard.header.tokens;
    d.shards.push_back(shard);
  }
  d.batches_per_epoch = d.total_windows / d.global_batch();
  if (d.batches_per_epoch == 0) {
    std::string files;
    const size_t listed = std::min<size_t>(d.shards.size(), 8);
    for (size_t i = 0; i < listed; ++i) files += (i ? ", " : "") + d.shards[i].path;
    if (listed < d.shards.size()) files += " and " + std::to_string(d.shards.size() - listed) + " more";
    throw std::runtime_error("data \"" + pattern + "\" (" + files + ") holds " + std::to_string(d.total_tokens) +
                             " tokens = " + std::to_string(d.total_windows) + " windows of seq_len+1 = " +
                             std::to_string(T + 1) + " tokens, fewer than one global batch of world_size * batch_size = " +
                             std::to_string(world_size) + " * " + std::to_string(B) + " = " +
                             std::to_string(d.global_batch()) + " windows");
  }
}

void DataLoader::next_batch(int32_t* tokens, int32_t* targets) {
  Impl& d = *impl_;
  const size_t T = static_cast<size_t>(d.T);
  const size_t first = d.batch * d.global_batch() + static_cast<size_t>(d.rank) * static_cast<size_t>(d.B);
  for (size_t b = 0; b < static_cast<size_t>(d.B); ++b) {
    d.read_window(first + b);
    for (size_t t = 0; t < T; ++t) {
      tokens[b * T + t] = static_cast<int32_t>(d.window[t]);
      targets[b * T + t] = static_cast<int32_t>(d.window[t + 1]);
    }
  }
  if (++d.batch == d.batches_per_epoch) {
    d.batch = 0;
    ++d.epoch;
  }
}

void DataLoader::reset() {
  impl_->epoch = 0;
  impl_->batch = 0;
}

nlohmann::json DataLoader::position() const {
  const Impl& d = *impl_;
  return {{"epoch", d.epoch},          {"batch", d.batch},   {"shuffle", d.shuffle},
          {"seed", d.seed},            {"seq_len", d.T},     {"global_batch", d.global_batch()},
          {"windows", d.total_windows}};
}

void DataLoader::restore(const nlohmann::json& position) {
  Impl& d = *impl_;
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!position.is_object() || !position.contains(key)) {
      throw std::invalid_argument("data position for \"" + d.pattern + "\": missing key \"" + key + "\"");
    }
    return position.at(key);
  };
  auto require_same = [&](const char* key, const nlohmann::json& ours) {
    if (field(key) != ours) {
      throw std::invalid_argument("data position for \"" + d.pattern + "\": saved " + key + " = " +
                                  field(key).dump() + " but this loader has " + ours.dump() +
                                  " (the saved stream cannot be resumed exactly)");
    }
  };
  require_same("shuffle", d.shuffle);
  require_same("seed", d.seed);
  require_same("seq_len", d.T);
  require_same("global_batch", d.global_batch());
  require_same("windows", d.total_windows);
  const size_t batch = field("batch").get<size_t>();
  if (batch >= d.batches_per_epoch) {
    throw std::invalid_argument("data position for \"" + d.pattern + "\": batch " + std::to_string(batch) +
                                " is not below batches_per_epoch " + std::to_string(d.batches_per_epoch));
  }
  d.epoch = field("epoch").get<size_t>();
  d.batch = batch;
}

size_t DataLoader::batches_per_epoch() const { return impl_->batches_per_epoch; }

size_t DataLoader::total_tokens() const { return impl_->total_tokens; }

}  // namespace coda
