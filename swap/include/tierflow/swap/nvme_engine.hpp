// The NVMe tier's engine: libaio + O_DIRECT over swap files that grow on demand.
//
// Note [NVMe engine]
// ~~~~~~~~~~~~~~~~~~
// DeepSpeed's async I/O opens a file per tensor per operation and asserts on
// io_submit; its users see NVMe offload at a fraction of the disk's speed and
// "ran out of swap buffers". tierflow instead keeps one file per path, opened
// once with O_DIRECT, and manages the space inside as extents with a
// best-fit, coalescing free list, reused step after step. A block (one
// tensor's bytes) is striped RAID-0 style over every path in requests of
// `block_bytes`; one I/O thread keeps up to `queue_depth` requests in flight
// with io_submit/io_getevents. Each block write carries an XXH3 checksum of
// its bytes, verified when it is read back; a block whose last write failed
// is never valid to read. Every failure (ENOSPC, EIO, a short transfer, a
// checksum mismatch) becomes an io_error naming the path and the operation,
// delivered through the operation's handle.
//
// Note [NVMe space]
// ~~~~~~~~~~~~~~~~~
// A file is not preallocated to its budget. It grows on demand, with
// fallocate, in steps of `grow_bytes`, when allocate() places a block past
// its end, so that a write never meets ENOSPC: a grow
// that fails is an error of allocate(), before anything is written, naming
// the file, the need, the free space and TIERFLOW_NVME_MEMORY. reserve()
// grows the files up front for blocks a caller knows it will need (the NVMe
// optimizer's states, at wrap), so too little space is an error there.
// `bytes_per_path` caps each file; kNvmeAutoBytes (TIERFLOW_NVME_MEMORY=auto)
// caps it where the file system would keep less than kNvmeAutoKeepFree of
// its size free, judged at each grow, so the run takes what it needs and the
// disk stays usable for checkpoints and other work.
//
// Note [Stale swap files]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Files are named tierflow-swap-<tag><pid>-<n>-<random>.bin (the tag names
// the rank of a multi-process run: "rank3-") and each is held with
// an exclusive flock() on its descriptor for as long as the engine lives
// (flock locks belong to the open file description, so another descriptor,
// even in the same process, cannot take it). A process that dies, by kill -9
// included, lets go of the lock with its descriptors. remove_stale_files() removes a file
// only when it can take that lock, so a live file is never removed, whatever
// pid its name carries and from whatever PID namespace (container) it is
// looked at, and a dead process's file is removed even when its pid now
// belongs to another process. The destructor removes the engine's own files.
// A creator locks its file right after creating it and then checks that the
// name still leads to that file, so a cleaner that judged the new file in
// between (lock free) only makes the creator pick another name.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/swap/transfer_handle.hpp"

namespace tierflow::swap {

/// Test hook: makes the next I/O requests of a kind fail or come back short.
struct NvmeFaults {
  std::atomic<int> fail_writes{0};   ///< next N write requests fail with `error`
  std::atomic<int> fail_reads{0};    ///< next N read requests fail with `error`
  std::atomic<int> short_writes{0};  ///< next N write requests transfer half their bytes
  std::atomic<int> short_reads{0};   ///< next N read requests transfer half their bytes
  std::atomic<int> corrupt_reads{0}; ///< next N read requests flip a byte in what they read
  std::atomic<int> fail_grows{0};    ///< next N grows of a swap file fail with ENOSPC (a full disk)
  std::atomic<int> write_delay_us{0}; ///< each write request completes this much later (holds writes in flight)
  std::atomic<int> read_delay_us{0};  ///< each read request completes this much later (a stuck disk, Note [Stall timeout])
  int error = 5;                     ///< errno to inject (EIO)
};

// bytes_per_path of TIERFLOW_NVME_MEMORY=auto is tierflow::kNvmeAutoBytes
// (core/config.hpp): grow while the file system keeps kNvmeAutoKeepFree free.
/// The share of a file system's size that TIERFLOW_NVME_MEMORY=auto leaves free.
inline constexpr double kNvmeAutoKeepFree = 0.10;

/// Settings of an NvmeEngine.
struct NvmeEngineOptions {
  std::vector<std::string> paths;          ///< directories, one swap file each
  std::string name_tag;                    ///< goes into the files' names (a rank: "rank3-"); [A-Za-z0-9-] only
  std::uint64_t bytes_per_path = 1ULL << 30;  ///< most bytes each file may grow to, or kNvmeAutoBytes
  std::uint64_t grow_bytes = 64ULL << 20;  ///< a file grows (fallocate) in steps of at least this
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
  std::uint64_t bytes_capacity = 0;  ///< most bytes the files may grow to over all paths (0: auto)
  std::uint64_t bytes_on_disk = 0;   ///< bytes the files hold now (fallocated) over all paths
  std::uint64_t grows = 0;           ///< fallocate calls that grew a file
};

/// Where a block's bytes lie in one swap file (for tests and diagnostics).
struct NvmeExtent {
  std::string file;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

/// Identifies an allocated block.
using NvmeBlock = std::uint64_t;

/// Asynchronous block storage over swap files on one or more paths. Thread-safe.
class NvmeEngine {
 public:
  /// Creates the swap files, locks them and gives each its first
  /// `block_bytes`; throws io_error naming the path and the operation (open,
  /// fallocate) that failed, e.g. ENOSPC, EROFS, or EINVAL without O_DIRECT.
  explicit NvmeEngine(NvmeEngineOptions options);
  /// Waits for in-flight I/O, closes and removes the swap files.
  ~NvmeEngine();
  NvmeEngine(const NvmeEngine&) = delete;
  NvmeEngine& operator=(const NvmeEngine&) = delete;

  /// Space for `bytes`, striped over the paths, growing the files when needed;
  /// throws out_of_memory when the tier is full: a file at its cap, or a grow
  /// refused for want of disk space (naming the file, the need, the free space
  /// and TIERFLOW_NVME_MEMORY). Nothing changes when it throws.
  NvmeBlock allocate(std::uint64_t bytes);
  /// Grows the files now so that blocks of these sizes will fit beside what is
  /// in use without growing later; throws io_error (ENOSPC) naming each path's
  /// need, its free space and TIERFLOW_NVME_MEMORY, and then grows nothing.
  void reserve(const std::vector<std::uint64_t>& block_sizes);
  /// Returns a block's space; waits for I/O still using it.
  void release(NvmeBlock block) noexcept;
  /// Writes `bytes` (at most the block's size) from `src`. `src` must stay
  /// valid until the handle completes; it needs no alignment.
  TransferHandle write(NvmeBlock block, const void* src, std::uint64_t bytes);
  /// Reads the block's last written bytes into `dst` (capacity `bytes`).
  TransferHandle read(NvmeBlock block, void* dst, std::uint64_t bytes);
  /// True when the block's last write completed without error.
  bool valid(NvmeBlock block) const;
  /// Bytes that allocate() could still place now, striped over every path:
  /// per path what its cap and its file system's free space (less what
  /// TIERFLOW_NVME_MEMORY=auto keeps free) leave beside the blocks in use,
  /// times the number of paths for the path with least (a block takes an
  /// equal share of each). A snapshot: other writers change it.
  std::uint64_t available_bytes() const;
  /// Counters.
  NvmeEngineStats stats() const;
  /// The most bytes in use (NvmeEngineStats::bytes_in_use) since the previous call (the first: since the engine
  /// began), in use now included (Note [Window peak] in core/stats.hpp; one reader: the step recorder).
  std::uint64_t take_in_use_window_peak();
  /// The swap files, one per path.
  std::vector<std::string> files() const;
  /// Where a block lies: one extent per path it touches.
  std::vector<NvmeExtent> extents(NvmeBlock block) const;
  /// Removes the files' names now (at process exit, while blocks may still be
  /// referenced); open descriptors keep working until the engine is destroyed.
  void unlink_files() noexcept;
  /// Removes the tierflow swap files in `paths` that no engine holds locked
  /// (their process is gone); returns how many.
  static std::size_t remove_stale_files(const std::vector<std::string>& paths);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierflow::swap
