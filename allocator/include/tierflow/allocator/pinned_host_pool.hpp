// The pinned host pool: large page-locked slabs carved up and reused.
//
// Note [Pinned host pool]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Pinning costs milliseconds per call (cudaHostAlloc ~3 ms a tensor in a
// PyTorch PR that moved to a pool), and per-tensor pinning is why torchtune's
// activation offload failed to overlap. So the pool pins whole slabs
// (TIERFLOW_PINNED_SLAB_BYTES) once and serves blocks from them best-fit,
// coalescing on free; a steady training loop stops allocating slabs after its
// first step. Blocks are 4 KiB-aligned in address and size, so any block can
// be an O_DIRECT buffer. The pool never holds more than its budget
// (TIERFLOW_HOST_MEMORY): past it, try_allocate() returns nullptr and
// allocate() throws out_of_memory, after releasing empty slabs and retrying.
// Slabs come from allocator/'s resources, composed as RMM composes them:
// PinnedHostResource (cudaHostAlloc with the CUDA backend and a GPU present,
// otherwise resident huge-page mmap, see Note [Emulated device]) under a
// LimitingAdaptor that holds the budget, under a StatisticsAdaptor that
// counts the reserved bytes.
//
// A block that a copy may still read or write is returned with that copy's
// completion (deallocate(p, fence)); the pool reuses it only once the fence
// is ready, and an allocation that finds no room waits for the oldest fence
// before it gives up (rule 3 of Note [Copy ordering]). With
// `poison_freed` (the adversarial emulated device) a freed block is filled
// with poison and held in a quarantine before reuse; when it leaves the
// quarantine its bytes are checked, and any byte that is no longer poison
// was written after the block was freed: a late write, counted and logged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "tierflow/allocator/memory_resource.hpp"
#include "tierflow/core/completion.hpp"
#include "tierflow/core/stats.hpp"

namespace tierflow::allocator {

/// Construction options of a PinnedHostPool.
struct PinnedHostPoolOptions {
  std::uint64_t budget_bytes = 0;             ///< most bytes of slabs held at once
  std::uint64_t slab_bytes = 64ULL << 20;     ///< size of a regular slab
  bool cuda_pinned = false;                   ///< cudaHostAlloc slabs (needs a GPU)
  bool poison_freed = false;                  ///< poison and quarantine freed blocks, check for late writes
  std::uint64_t quarantine_bytes = 32ULL << 20;  ///< most bytes held in quarantine (with poison_freed)
};

/// Snapshot of the pool's statistics.
struct PinnedHostPoolStats {
  StatValues in_use;             ///< bytes handed out in blocks (rounded sizes)
  StatValues reserved;           ///< bytes of slabs held
  std::uint64_t slab_allocations = 0;  ///< slabs ever created (pinning calls)
  std::uint64_t block_allocations = 0; ///< blocks ever handed out
  std::uint64_t failed_allocations = 0;///< requests refused for the budget
  std::uint64_t fenced_frees = 0;      ///< blocks returned while a copy still used them (reuse deferred)
  std::uint64_t fence_waits = 0;       ///< allocations that waited for a fenced block to come free
  std::uint64_t late_writes = 0;       ///< quarantined blocks found written after they were freed
};

/// PinnedHostPoolStats' exported counters (Note [Stat fields]); in_use and reserved are StatValues.
const std::vector<StatField<PinnedHostPoolStats>>& pinned_pool_stat_fields();

/// Thread-safe pool of page-locked host memory with a budget.
class PinnedHostPool {
 public:
  /// Alignment of every block's address and size.
  static constexpr std::size_t kBlockAlignment = 4096;

  explicit PinnedHostPool(PinnedHostPoolOptions options);
  ~PinnedHostPool();
  PinnedHostPool(const PinnedHostPool&) = delete;
  PinnedHostPool& operator=(const PinnedHostPool&) = delete;

  /// A block of at least `bytes`; throws out_of_memory naming the budget when it cannot fit.
  void* allocate(std::size_t bytes);
  /// Like allocate() but returns nullptr instead of throwing when over budget. Throws only stall_error: a
  /// block it waits for stays held by a copy past TIERFLOW_STALL_TIMEOUT (Note [Stall timeout]).
  void* try_allocate(std::size_t bytes);
  /// Returns a block to the pool; p must come from this pool.
  void deallocate(void* p) noexcept;
  /// Returns a block that a copy may still use: it is reused only once `fence` is ready.
  void deallocate(void* p, std::shared_ptr<const Completion> fence) noexcept;
  /// Takes back every fenced block whose fence is ready (allocations do this too).
  void reap() noexcept;
  /// Frees slabs with no block in use; returns the bytes given back.
  std::size_t release_unused() noexcept;

  /// Statistics snapshot.
  PinnedHostPoolStats stats() const;
  /// The most bytes in use since the previous call (the first: since construction), in use now included
  /// (Note [Window peak]; one reader: the step recorder, Note [Step stats]).
  std::int64_t take_in_use_window_peak() noexcept { return in_use_.take_window_peak(); }
  /// The budget in bytes.
  std::uint64_t budget_bytes() const noexcept { return options_.budget_bytes; }
  /// True when slabs are page-locked by CUDA (false on the emulated device).
  bool cuda_pinned() const noexcept { return options_.cuda_pinned; }

 private:
  struct Slab {
    std::byte* base = nullptr;
    std::size_t bytes = 0;
    std::size_t used = 0;
    std::map<std::size_t, std::size_t> free;  // offset -> size, coalesced
  };
  struct BlockInfo {
    std::size_t slab;
    std::size_t offset;
    std::size_t bytes;
  };
  using FreeKey = std::tuple<std::size_t, std::size_t, std::size_t>;  // size, slab, offset

  void* allocate_locked(std::size_t rounded);
  bool add_slab_locked(std::size_t min_bytes);
  std::size_t release_unused_locked() noexcept;
  void insert_free_locked(std::size_t slab, std::size_t offset, std::size_t bytes);
  void erase_free_locked(std::size_t slab, std::size_t offset, std::size_t bytes);
  void free_slab_memory(Slab& s) noexcept;
  // The one release routine of both free paths (plain and fenced): false when p
  // is not a live block of this pool.
  bool release_block_locked(void* p) noexcept;
  void reap_fenced_locked() noexcept;
  void drain_quarantine_locked(std::size_t keep_bytes) noexcept;
  void* try_allocate_once_locked(std::size_t rounded) noexcept;

  PinnedHostPoolOptions options_;
  // Where slabs come from (Note [Pinned host pool]): upstream first, so it is destroyed last.
  PinnedHostResource pinned_;
  LimitingAdaptor budget_;      // TIERFLOW_HOST_MEMORY over the slabs held
  StatisticsAdaptor reserved_;  // the bytes of slabs held
  mutable std::mutex mutex_;
  std::vector<Slab> slabs_;                       // a freed slab keeps its index, base == nullptr
  std::set<FreeKey> free_by_size_;                // best-fit index over all slabs
  std::unordered_map<void*, BlockInfo> blocks_;   // live blocks
  Stat in_use_;
  std::uint64_t slab_allocations_ = 0;
  std::uint64_t block_allocations_ = 0;
  std::uint64_t failed_allocations_ = 0;
  struct Fenced {
    void* p;
    std::shared_ptr<const Completion> fence;
  };
  struct Quarantined {
    void* p;
    BlockInfo info;
  };
  std::deque<Fenced> fenced_;            // returned, waiting for their last copy
  std::deque<Quarantined> quarantine_;   // freed and poisoned, oldest first
  std::uint64_t quarantined_bytes_ = 0;
  std::uint64_t fenced_frees_ = 0;
  std::uint64_t fence_waits_ = 0;
  std::uint64_t late_writes_ = 0;
};

}  // namespace tierflow::allocator
