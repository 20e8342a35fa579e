// Shared helper of the CPU tests: a temporary directory that lives as long as the object holding it.
//
// The directory is made by mkdtemp under std::filesystem::temp_directory_path() as PREFIX_XXXXXX, so
// its name is unique across tests and concurrent runs of the suite, and the prefix says which area
// left it behind if a crashed run ever does. The destructor removes it with everything inside.
// `dir / "name"` is the std::string path of a child, the form the code under test takes paths in.
#pragma once
#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace coda::test {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
    if (mkdtemp(pattern.data()) == nullptr)
      throw std::runtime_error("cannot create temporary directory " + pattern + ": " + std::strerror(errno));
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace coda::test
