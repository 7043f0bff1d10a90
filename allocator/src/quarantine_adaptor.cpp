// See Note [Quarantine adaptor].
#include "tierflow/allocator/quarantine_adaptor.hpp"

#include <cstring>
#include <string>
#include <utility>

#include "tierflow/allocator/device.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow::allocator {

QuarantineAdaptor::QuarantineAdaptor(MemoryResource* upstream, QuarantineLimits limits, std::string label)
    : upstream_(upstream), limits_(limits), label_(std::move(label)) {
  TIERFLOW_EXPECTS(upstream != nullptr, "QuarantineAdaptor: upstream must not be null");
}

QuarantineAdaptor::~QuarantineAdaptor() { release(); }

void* QuarantineAdaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  void* p = upstream_->allocate(bytes, alignment);
  if (bytes) std::memset(p, kPoisonByte, bytes);  // reused memory, at worst
  allocations_.fetch_add(1, std::memory_order_relaxed);
  return p;
}

void QuarantineAdaptor::do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
  if (bytes) std::memset(p, kPoisonByte, bytes);
  std::deque<Held> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    quarantined_.fetch_add(1, std::memory_order_relaxed);
    held_bytes_ += bytes;
    held_.push_back(Held{p, bytes, alignment, false});
    while (!held_.empty() && (held_bytes_ > limits_.max_bytes || held_.size() > limits_.max_blocks)) {
      check_locked(held_.front());
      held_bytes_ -= held_.front().bytes;
      out.push_back(held_.front());
      held_.pop_front();
    }
  }
  give_back(out);  // upstream, outside the lock
}

void QuarantineAdaptor::check_locked(Held& h) noexcept {
  if (h.reported) return;
  const std::size_t i = first_unpoisoned(h.p, h.bytes);
  if (i == h.bytes) return;
  h.reported = true;
  late_writes_.fetch_add(1, std::memory_order_relaxed);
  try {
    const char* what = tier() == Tier::kGpu ? "device memory" : "memory";
    log(LogLevel::kError, label_ + ": a freed block of " + format_bytes(h.bytes) +
                              " was written after it was freed (byte " + std::to_string(i) + "): a copy still used " +
                              what + " that had been returned");
  } catch (...) {
    // The count is what tests and reports read; a lost log line is not worth a crash.
  }
}

void QuarantineAdaptor::give_back(std::deque<Held>& out) noexcept {
  for (const Held& h : out) upstream_->deallocate(h.p, h.bytes, h.alignment);
  out.clear();
}

void QuarantineAdaptor::check_all() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Held& h : held_) check_locked(h);
}

void QuarantineAdaptor::release() noexcept {
  std::deque<Held> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Held& h : held_) check_locked(h);
    out.swap(held_);
    held_bytes_ = 0;
  }
  give_back(out);
}

QuarantineStats QuarantineAdaptor::stats() const noexcept {
  QuarantineStats s;
  s.allocations = allocations_.load(std::memory_order_relaxed);
  s.quarantined = quarantined_.load(std::memory_order_relaxed);
  s.late_writes = late_writes_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mutex_);
  s.held_bytes = held_bytes_;
  s.held_blocks = held_.size();
  return s;
}

}  // namespace tierflow::allocator
