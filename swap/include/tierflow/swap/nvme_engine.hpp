// The NVMe tier's engine: libaio + O_DIRECT over preallocated swap files.
//
// Note [NVMe engine]
// ~~~~~~~~~~~~~~~~~~
// DeepSpeed's async I/O opens a file per tensor per operation and asserts on
// io_submit; its users see NVMe offload at a fraction of the disk's speed and
// "ran out of swap buffers". tierflow instead keeps one file per path, opened
// once with O_DIRECT and preallocated with fallocate, and manages the space
// inside as extents with a best-fit, coalescing free list, reused step after
// step. A block (one tensor's bytes) is striped RAID-0 style over every path
// in requests of `block_bytes`; one I/O thread keeps up to `queue_depth`
// requests in flight with io_submit/io_getevents. Each block write carries an
// XXH3 checksum of its bytes, verified when it is read back; a block whose
// last write failed is never valid to read. Every failure (ENOSPC, EIO, a
// short transfer, a checksum mismatch) becomes an io_error naming the path and
// the operation, delivered through the operation's handle. Files are named
// tierflow-swap-<pid>-<n>.bin: removed by the destructor, and any left by a
// process that no longer exists are removed when an engine starts.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tierflow/swap/transfer_handle.hpp"

namespace tierflow::swap {

/// Test hook: makes the next I/O requests of a kind fail or come back short.
struct NvmeFaults {
  std::atomic<int> fail_writes{0};   ///< next N write requests fail with `error`
  std::atomic<int> fail_reads{0};    ///< next N read requests fail with `error`
  std::atomic<int> short_writes{0};  ///< next N write requests transfer half their bytes
  std::atomic<int> short_reads{0};   ///< next N read requests transfer half their bytes
  std::atomic<int> corrupt_reads{0}; ///< next N read requests flip a byte in what they read
  int error = 5;                     ///< errno to inject (EIO)
};

/// Settings of an NvmeEngine.
struct NvmeEngineOptions {
  std::vector<std::string> paths;          ///< directories, one swap file each
  std::uint64_t bytes_per_path = 1ULL << 30;  ///< preallocated size of each file
  std::size_t block_bytes = 1 << 20;       ///< request size (TIERFLOW_AIO_BLOCK_SIZE)
  unsigned queue_depth = 32;               ///< requests in flight (TIERFLOW_AIO_QUEUE_DEPTH)
  bool checksums = true;                   ///< XXH3 per block, verified on read
  NvmeFaults* faults = nullptr;            ///< fault injection for tests
};

/// Counters of an NvmeEngine.
struct NvmeEngineStats {
  std::uint64_t bytes_written = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t write_ops = 0;       ///< block writes completed
  std::uint64_t read_ops = 0;        ///< block reads completed
  std::uint64_t requests = 0;        ///< aio requests completed
  std::uint64_t failures = 0;        ///< operations that ended in an error
  std::uint64_t bytes_in_use = 0;    ///< allocated (rounded) bytes over all paths
  std::uint64_t bytes_capacity = 0;  ///< preallocated bytes over all paths
};

/// Identifies an allocated block.
using NvmeBlock = std::uint64_t;

/// Asynchronous block storage over swap files on one or more paths. Thread-safe.
class NvmeEngine {
 public:
  /// Creates and preallocates the swap files; throws io_error naming the path
  /// and the operation (open, fallocate) that failed, e.g. ENOSPC.
  explicit NvmeEngine(NvmeEngineOptions options);
  /// Waits for in-flight I/O, closes and removes the swap files.
  ~NvmeEngine();
  NvmeEngine(const NvmeEngine&) = delete;
  NvmeEngine& operator=(const NvmeEngine&) = delete;

  /// Space for `bytes`, striped over the paths; throws out_of_memory when the
  /// files are full (naming TIERFLOW_NVME_MEMORY).
  NvmeBlock allocate(std::uint64_t bytes);
  /// Returns a block's space; waits for I/O still using it.
  void release(NvmeBlock block) noexcept;
  /// Writes `bytes` (at most the block's size) from `src`. `src` must stay
  /// valid until the handle completes; it needs no alignment.
  TransferHandle write(NvmeBlock block, const void* src, std::uint64_t bytes);
  /// Reads the block's last written bytes into `dst` (capacity `bytes`).
  TransferHandle read(NvmeBlock block, void* dst, std::uint64_t bytes);
  /// True when the block's last write completed without error.
  bool valid(NvmeBlock block) const;
  /// Counters.
  NvmeEngineStats stats() const;
  /// The swap files, one per path.
  std::vector<std::string> files() const;
  /// Removes the files' names now (at process exit, while blocks may still be
  /// referenced); open descriptors keep working until the engine is destroyed.
  void unlink_files() noexcept;
  /// Removes tierflow swap files in `paths` whose process no longer runs; returns how many.
  static std::size_t remove_stale_files(const std::vector<std::string>& paths);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierflow::swap
