// See stream_slots.hpp.
#include "tierflow/optimizer/stream_slots.hpp"

#include <algorithm>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/optimizer/step_ledger.hpp"

namespace tierflow::optimizer {

bool ReducedSlots::add(const void* key, std::size_t slot) {
  if (!by_key_.emplace(key, slot).second) return false;
  slots_.push_back(slot);
  return true;
}

std::vector<ReducedSlots::Slice> ReducedSlots::slices(const std::vector<Member>& members, const Flat& flat) const {
  std::int64_t total = 0;
  for (const Member& m : members) total += static_cast<std::int64_t>(m.numel);
  TIERFLOW_EXPECTS(flat.dim == 1 && flat.contiguous && flat.numel == total,
                   "GradStream::on_reduced: the reduced bucket must be one contiguous 1-D tensor of " +
                       std::to_string(total) + " elements (its parameters' sizes, one after the other); got " +
                       std::to_string(flat.numel) + " elements in " + std::to_string(flat.dim) + " dimensions");
  std::vector<Slice> out;
  std::size_t offset = 0;
  for (const Member& m : members) {
    const auto it = by_key_.find(m.key);
    if (it != by_key_.end() && m.same_type) out.push_back({it->second, offset, m.numel});
    offset += m.numel;
  }
  return out;
}

bool BackwardEnds::queue(bool may_queue) noexcept {
  const bool now = may_queue && !queued_;
  queued_ = queued_ || now;
  return now;
}

bool BackwardEnds::requeue(bool reduced) noexcept {
  if (!reduced || requeued_) {
    requeued_ = false;
    return false;
  }
  requeued_ = true;
  return true;
}

std::vector<std::size_t> WrittenWeights::judge(const std::vector<bool>& differs, StepLedger& ledger) {
  std::vector<std::size_t> changed;
  for (std::size_t i = 0; i < stale_.size(); ++i) {
    if (i < differs.size() && differs[i]) stale_[i] = true;  // until a step re-reads it (reread)
    if (!stale_[i]) continue;
    changed.push_back(i);
    if (ledger.is_streamed(i)) ledger.state_set(i);  // an early step read the old master: stepped again
  }
  return changed;
}

void ReleasedGrads::add(StepEngine& engine, std::size_t slot) {
  slots_.push_back(slot);
  engine.counters().grads_released += 1;
}

std::vector<std::size_t> ReleasedGrads::take_landed(const StepEngine& engine,
                                                    const std::function<bool(std::size_t)>& holds) {
  std::vector<std::size_t> landed;
  std::size_t kept = 0;
  for (std::size_t i : slots_) {
    if (!engine.ledger().released(i) || !holds(i)) continue;
    bool done = false;
    const swap::TransferHandle& copy = engine.copy_of(i);
    if (copy.ready()) {
      try {
        copy.wait();  // does not block: rethrows a failed copy, whose gradient the worker puts back
        done = true;
      } catch (const std::exception&) {
      }
    }
    if (done) landed.push_back(i);
    else slots_[kept++] = i;
  }
  slots_.resize(kept);
  return landed;
}

ReleasedGrads::Waited ReleasedGrads::wait_all(const StepEngine& engine) {
  Waited out;
  for (std::size_t i : slots_) {
    try {
      engine.copy_of(i).wait();
    } catch (const stall_error&) {
      if (!out.stall) out.stall = std::current_exception();
      out.stalled.push_back(i);
    } catch (const std::exception& e) {
      log(LogLevel::kWarn, std::string("a gradient copy of a discarded window failed: ") + e.what());
    }
  }
  slots_.clear();
  return out;
}

std::vector<std::pair<DeviceId, std::size_t>> last_copied(
    const StepEngine& engine, const std::vector<std::pair<std::size_t, DeviceId>>& candidates) {
  std::vector<std::pair<DeviceId, std::size_t>> last;
  for (const auto& [slot, device] : candidates) {
    auto it = std::find_if(last.begin(), last.end(), [&](const auto& l) { return l.first == device; });
    if (it == last.end()) last.emplace_back(device, slot);
    else if (engine.copy_seq_of(slot) > engine.copy_seq_of(it->second)) it->second = slot;
  }
  return last;
}

}  // namespace tierflow::optimizer
