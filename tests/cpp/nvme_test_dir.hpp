// Set-up shared by the tests that put blocks on NVMe (test_stall.cpp under injected faults; the NVMe engine's, the
// staged pipeline's and the window-peak tests): a directory per test on a file system with O_DIRECT, and an
// engine's options over it.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "tierflow/swap/nvme_engine.hpp"

namespace tierflow::testing_nvme {

/// A fresh directory under NVME_TEST_DIR (else ./nvme-test; not tmpfs, which has no O_DIRECT) named `prefix` and
/// this process's id, removed with its files when the test ends.
class NvmeTestDir {
 public:
  explicit NvmeTestDir(const std::string& prefix) {
    const char* base = std::getenv("NVME_TEST_DIR");
    path_ = std::string(base ? base : (std::filesystem::current_path() / "nvme-test").string()) + "/" + prefix +
            std::to_string(getpid());
    std::filesystem::create_directories(path_);
  }
  ~NvmeTestDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  NvmeTestDir(const NvmeTestDir&) = delete;
  NvmeTestDir& operator=(const NvmeTestDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// An engine's options: one 16 MiB path in `dir`, blocks of `block_bytes`, requests delayed or failed by `faults`.
inline swap::NvmeEngineOptions faulty_nvme_options(const std::string& dir, swap::NvmeFaults& faults,
                                                   std::size_t block_bytes) {
  swap::NvmeEngineOptions o;
  o.paths = {dir};
  o.bytes_per_path = 16ULL << 20;
  o.block_bytes = block_bytes;
  o.faults = &faults;
  return o;
}

}  // namespace tierflow::testing_nvme
