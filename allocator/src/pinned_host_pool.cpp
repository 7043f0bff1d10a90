// See Note [Pinned host pool] in pinned_host_pool.hpp.
#include "tierflow/allocator/pinned_host_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>

#include <string>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/allocator/device.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow::allocator {

PinnedHostPool::PinnedHostPool(PinnedHostPoolOptions options)
    : options_(options),
      pinned_(options.cuda_pinned),
      budget_(&pinned_, static_cast<std::size_t>(options.budget_bytes)),
      reserved_(&budget_) {
  TIERFLOW_EXPECTS(options_.slab_bytes >= kBlockAlignment,
                   "PinnedHostPool: slab_bytes must be at least 4096, got " +
                       std::to_string(options_.slab_bytes));
  options_.slab_bytes = round_up(options_.slab_bytes, kBlockAlignment);
  TIERFLOW_EXPECTS(!options_.cuda_pinned || cuda_available(),
                   "PinnedHostPool: cuda_pinned requested but no CUDA GPU is available");
}

PinnedHostPool::~PinnedHostPool() {
  // Note [Stall timeout]: a slab a copy still writes is not freed. Each fence is waited for within the limit,
  // counted from its copy's start (so a copy that stalled already is given up at once, and a hung device does
  // not hang the exit); after a stall, slabs that still hold blocks are kept for good instead.
  std::lock_guard<std::mutex> lock(mutex_);
  bool stalled = false;
  for (auto& f : fenced_) {  // a copy may still write into a slab: let it finish first
    try {
      f.fence->wait();
    } catch (const stall_error&) {
      stalled = true;
    } catch (...) {  // a failed copy has stopped using the block
    }
  }
  reap_fenced_locked();
  const bool keep = !blocks_.empty() && (stalled || stall_seen());
  if (!blocks_.empty() && !keep) {
    log(LogLevel::kWarn, "PinnedHostPool destroyed with " + std::to_string(blocks_.size()) +
                             " blocks still in use; their memory is released now");
  }
  std::uint64_t kept = 0;
  std::size_t kept_slabs = 0;
  for (auto& s : slabs_) {
    if (keep && s.base && s.used != 0) {
      kept += s.bytes;
      ++kept_slabs;
      continue;  // deliberately never freed
    }
    free_slab_memory(s);
  }
  if (kept_slabs)
    note_kept_forever(kept, std::to_string(kept_slabs) + " pinned pool slab(s) of " + format_bytes(kept) +
                                " holding " + std::to_string(blocks_.size()) + " block(s) still in use after a stall");
}

void PinnedHostPool::free_slab_memory(Slab& s) noexcept {
  if (!s.base) return;
  reserved_.deallocate(s.base, s.bytes, kBlockAlignment);
  s.base = nullptr;
}

void PinnedHostPool::insert_free_locked(std::size_t slab, std::size_t offset, std::size_t bytes) {
  auto& free = slabs_[slab].free;
  // Coalesce with the following and the preceding free ranges.
  auto next = free.lower_bound(offset);
  if (next != free.end() && offset + bytes == next->first) {
    free_by_size_.erase({next->second, slab, next->first});
    bytes += next->second;
    next = free.erase(next);
  }
  if (next != free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      free_by_size_.erase({prev->second, slab, prev->first});
      offset = prev->first;
      bytes += prev->second;
      free.erase(prev);
    }
  }
  free.emplace(offset, bytes);
  free_by_size_.insert({bytes, slab, offset});
}

void PinnedHostPool::erase_free_locked(std::size_t slab, std::size_t offset, std::size_t bytes) {
  slabs_[slab].free.erase(offset);
  free_by_size_.erase({bytes, slab, offset});
}

bool PinnedHostPool::add_slab_locked(std::size_t min_bytes) {
  const std::uint64_t held = budget_.allocated_bytes(), budget = budget_.limit_bytes();
  std::size_t want = std::max<std::size_t>(options_.slab_bytes, min_bytes);
  if (held + want > budget) {
    // A smaller slab that still fits the request is better than failing.
    if (held + min_bytes > budget) return false;
    want = round_up(budget - held, kBlockAlignment);
    if (held + want > budget) want -= kBlockAlignment;
    if (want < min_bytes) return false;
  }
  void* base = nullptr;
  try {
    base = reserved_.allocate(want, kBlockAlignment);
  } catch (const out_of_memory&) {
    return false;  // (logged by the resource where the system refused)
  }
  Slab s;
  s.base = static_cast<std::byte*>(base);
  s.bytes = want;
  // Reuse the index of a released slab so indices stay small.
  std::size_t idx = slabs_.size();
  for (std::size_t i = 0; i < slabs_.size(); ++i) {
    if (!slabs_[i].base) {
      idx = i;
      break;
    }
  }
  if (idx == slabs_.size()) slabs_.emplace_back();
  slabs_[idx] = std::move(s);
  insert_free_locked(idx, 0, want);
  ++slab_allocations_;
  return true;
}

void* PinnedHostPool::allocate_locked(std::size_t rounded) {
  auto it = free_by_size_.lower_bound({rounded, 0, 0});
  if (it == free_by_size_.end()) return nullptr;
  auto [size, slab, offset] = *it;
  erase_free_locked(slab, offset, size);
  if (size > rounded) insert_free_locked(slab, offset + rounded, size - rounded);
  Slab& s = slabs_[slab];
  s.used += rounded;
  void* p = s.base + offset;
  // Adversarial: a block holds what its last user left, at worst poison.
  if (options_.poison_freed) std::memset(p, kPoisonByte, rounded);
  blocks_.emplace(p, BlockInfo{slab, offset, rounded});
  in_use_.increase(static_cast<std::int64_t>(rounded));
  ++block_allocations_;
  return p;
}

void* PinnedHostPool::try_allocate_once_locked(std::size_t rounded) noexcept {
  reap_fenced_locked();
  if (void* p = allocate_locked(rounded)) return p;
  if (!quarantine_.empty()) {  // quarantine delays reuse; it never refuses memory
    drain_quarantine_locked(0);
    if (void* p = allocate_locked(rounded)) return p;
  }
  if (add_slab_locked(rounded)) {
    if (void* p = allocate_locked(rounded)) return p;
  }
  // Free empty slabs (they may be the wrong size) and retry once.
  if (release_unused_locked() > 0 && add_slab_locked(rounded)) {
    if (void* p = allocate_locked(rounded)) return p;
  }
  return nullptr;
}

void* PinnedHostPool::try_allocate(std::size_t bytes) {
  std::size_t rounded = round_up(bytes == 0 ? 1 : bytes, kBlockAlignment);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (void* p = try_allocate_once_locked(rounded)) return p;
    if (fenced_.empty()) break;
    // A block is still held by a copy in flight: it comes free when that
    // copy completes. Wait for the oldest (without the lock), then retry.
    auto fence = fenced_.front().fence;
    ++fence_waits_;
    lock.unlock();
    try {
      fence->wait();
    } catch (const stall_error&) {
      // Note [Stall timeout]: the copy still holds the block; waiting again would loop, and taking it for a
      // lack of memory would hide the hang. Raised to the caller.
      throw;
    } catch (...) {
      // a failed copy has stopped using the block all the same
    }
    lock.lock();
  }
  ++failed_allocations_;
  return nullptr;
}

void* PinnedHostPool::allocate(std::size_t bytes) {
  if (void* p = try_allocate(bytes)) return p;
  auto st = stats();
  throw out_of_memory("pinned host pool: cannot allocate " + format_bytes(bytes) + " within " +
                      "TIERFLOW_HOST_MEMORY budget of " + format_bytes(options_.budget_bytes) +
                      " (" + format_bytes(st.in_use.current) + " in use, " +
                      format_bytes(st.reserved.current) + " reserved); raise TIERFLOW_HOST_MEMORY");
}

void PinnedHostPool::deallocate(void* p) noexcept {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!release_block_locked(p))
    log(LogLevel::kError, "PinnedHostPool::deallocate: pointer not from this pool (ignored)");
}

void PinnedHostPool::deallocate(void* p, std::shared_ptr<const Completion> fence) noexcept {
  if (!p) return;
  bool ready = true;
  try {
    ready = !fence || fence->ready();
  } catch (...) {
    ready = false;  // settle it through the deferred path
  }
  if (ready) return deallocate(p);
  std::lock_guard<std::mutex> lock(mutex_);
  if (blocks_.find(p) == blocks_.end()) {
    log(LogLevel::kError, "PinnedHostPool::deallocate: pointer not from this pool (ignored)");
    return;
  }
  ++fenced_frees_;
  fenced_.push_back({p, std::move(fence)});
}

bool PinnedHostPool::release_block_locked(void* p) noexcept {
  auto it = blocks_.find(p);
  if (it == blocks_.end()) return false;
  // Copied before the erase: the entry is gone once the map forgets it.
  const BlockInfo info = it->second;
  blocks_.erase(it);
  in_use_.decrease(static_cast<std::int64_t>(info.bytes));
  if (options_.poison_freed) {
    // Note [Adversarial emulated device]: a read of a freed block sees poison;
    // a write to it is found when it leaves the quarantine.
    std::memset(p, kPoisonByte, info.bytes);
    quarantine_.push_back({p, info});
    quarantined_bytes_ += info.bytes;
    drain_quarantine_locked(options_.quarantine_bytes);
    return true;
  }
  slabs_[info.slab].used -= info.bytes;
  insert_free_locked(info.slab, info.offset, info.bytes);
  return true;
}

void PinnedHostPool::drain_quarantine_locked(std::size_t keep_bytes) noexcept {
  while (!quarantine_.empty() && quarantined_bytes_ > keep_bytes) {
    Quarantined q = quarantine_.front();
    quarantine_.pop_front();
    quarantined_bytes_ -= q.info.bytes;
    const std::size_t first_bad = first_unpoisoned(q.p, q.info.bytes);
    if (first_bad < q.info.bytes) {
      ++late_writes_;
      log(LogLevel::kError, "PinnedHostPool: a block of " + format_bytes(q.info.bytes) +
                                " was written after it was freed (byte " + std::to_string(first_bad) +
                                "): a copy still used it when it was returned without its fence");
    }
    slabs_[q.info.slab].used -= q.info.bytes;
    insert_free_locked(q.info.slab, q.info.offset, q.info.bytes);
  }
}

void PinnedHostPool::reap_fenced_locked() noexcept {
  if (fenced_.empty()) return;
  std::deque<Fenced> still;
  for (auto& f : fenced_) {
    bool ready = true;
    try {
      ready = f.fence->ready();
    } catch (...) {
      ready = true;  // a failed copy no longer uses the block
    }
    if (!ready) {
      still.push_back(std::move(f));
      continue;
    }
    release_block_locked(f.p);
  }
  fenced_.swap(still);
}

std::size_t PinnedHostPool::release_unused_locked() noexcept {
  std::size_t released = 0;
  for (std::size_t i = 0; i < slabs_.size(); ++i) {
    Slab& s = slabs_[i];
    if (!s.base || s.used != 0) continue;
    erase_free_locked(i, 0, s.bytes);
    released += s.bytes;
    free_slab_memory(s);
    s.free.clear();
    s.bytes = 0;
  }
  return released;
}

std::size_t PinnedHostPool::release_unused() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  reap_fenced_locked();
  drain_quarantine_locked(0);
  return release_unused_locked();
}

void PinnedHostPool::reap() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  reap_fenced_locked();
}

PinnedHostPoolStats PinnedHostPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PinnedHostPoolStats s;
  s.in_use = in_use_.values();
  s.reserved = reserved_.bytes();
  s.slab_allocations = slab_allocations_;
  s.block_allocations = block_allocations_;
  s.failed_allocations = failed_allocations_;
  s.fenced_frees = fenced_frees_;
  s.fence_waits = fence_waits_;
  s.late_writes = late_writes_;
  return s;
}

const std::vector<StatField<PinnedHostPoolStats>>& pinned_pool_stat_fields() {
  using S = PinnedHostPoolStats;
  static const std::vector<StatField<S>> fields = {
      {"slab_allocations", &S::slab_allocations},   {"block_allocations", &S::block_allocations},
      {"failed_allocations", &S::failed_allocations}, {"fenced_frees", &S::fenced_frees},
      {"fence_waits", &S::fence_waits},             {"late_writes", &S::late_writes},
  };
  return fields;
}

}  // namespace tierflow::allocator
