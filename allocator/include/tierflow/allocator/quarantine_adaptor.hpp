// A memory resource adaptor that poisons memory and delays its reuse, so that
// a read of freed memory sees poison and a write into it is caught.
//
// Note [Quarantine adaptor]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A real GPU's caching allocator hands a freed block to the next request at
// once, while a copy on a side stream may still read or write it; freed host
// memory keeps its old bytes, so on the emulated device such a copy goes
// unseen. In adversarial mode (Note [Adversarial emulated device]) the
// emulated device's memory comes through this adaptor:
//  - every allocation starts as poison (kPoisonByte: what a reused block
//    would hold, at worst);
//  - every freed block is filled with poison and held in a FIFO quarantine
//    instead of going upstream, until the quarantine holds more than
//    `max_bytes` or more than `max_blocks` blocks; then the oldest blocks go
//    upstream;
//  - a block leaving the quarantine is checked first: a byte that is no
//    longer poison was written after the free, by a copy that still used the
//    block. That is a late write, counted and logged once per block.
//    check_all() checks every block still held, without evicting it, so a
//    late write shows up before the quarantine turns over.
// A copy that reads freed memory therefore delivers poison (NaN in every
// float type), and one that writes into it is counted. The adaptor is
// thread-safe; upstream calls happen outside its lock. The pinned host pool
// quarantines its own blocks inside its slabs (Note [Pinned host pool]).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>

#include "tierflow/allocator/memory_resource.hpp"

namespace tierflow::allocator {

/// How much freed memory the quarantine holds before the oldest goes upstream.
struct QuarantineLimits {
  std::size_t max_bytes = std::size_t{64} << 20;  ///< freed bytes held back from reuse
  std::size_t max_blocks = 4096;                  ///< freed blocks held back from reuse
};

/// Counters since construction.
struct QuarantineStats {
  std::uint64_t allocations = 0;  ///< allocations served (each poisoned)
  std::uint64_t quarantined = 0;  ///< deallocations that went into the quarantine
  std::uint64_t late_writes = 0;  ///< freed blocks found written while quarantined
  std::size_t held_bytes = 0;     ///< bytes in the quarantine now
  std::size_t held_blocks = 0;    ///< blocks in the quarantine now
};

/// Poisons allocations, quarantines and checks freed blocks (Note [Quarantine adaptor]).
class QuarantineAdaptor final : public MemoryResource {
 public:
  /// `upstream` must outlive the adaptor; `label` starts its late-write log lines.
  explicit QuarantineAdaptor(MemoryResource* upstream, QuarantineLimits limits = {},
                             std::string label = "emulated device");
  /// Checks every held block and returns it upstream.
  ~QuarantineAdaptor() override;
  QuarantineAdaptor(const QuarantineAdaptor&) = delete;
  QuarantineAdaptor& operator=(const QuarantineAdaptor&) = delete;

  Tier tier() const noexcept override { return upstream_->tier(); }
  /// Checks every block still in quarantine now, without evicting any.
  void check_all() noexcept;
  /// Checks every held block and returns it upstream.
  void release() noexcept;
  /// Counters snapshot.
  QuarantineStats stats() const noexcept;
  /// The limits it was built with.
  const QuarantineLimits& limits() const noexcept { return limits_; }

 private:
  struct Held {
    void* p;
    std::size_t bytes;
    std::size_t alignment;
    bool reported;  // a late write in it was already counted
  };

  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  void check_locked(Held& h) noexcept;
  void give_back(std::deque<Held>& out) noexcept;

  MemoryResource* upstream_;
  QuarantineLimits limits_;
  std::string label_;
  mutable std::mutex mutex_;
  std::deque<Held> held_;
  std::size_t held_bytes_ = 0;
  std::atomic<std::uint64_t> allocations_{0}, quarantined_{0}, late_writes_{0};
};

}  // namespace tierflow::allocator
