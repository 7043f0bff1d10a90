// See Note [Recorded-order prefetch] in activation_schedule.hpp.
#include "tierflow/tiering/activation_schedule.hpp"

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

ActivationSchedule::ActivationSchedule(ActivationScheduleOptions options) : options_(options) {
  TIERFLOW_EXPECTS(options_.prefetch_bytes > 0, "ActivationSchedule: prefetch_bytes must be > 0");
}

void ActivationSchedule::set_prefetch_bytes(std::uint64_t bytes) {
  TIERFLOW_EXPECTS(bytes > 0, "ActivationSchedule: prefetch_bytes must be > 0");
  options_.prefetch_bytes = bytes;
}

void ActivationSchedule::begin_forward() {
  // The previous backward's reads become the order to expect next time.
  if (!read_order_.empty()) {
    recorded_ = std::move(read_order_);
    recorded_blocks_ = last_forward_blocks_;
  }
  read_order_.clear();
  if (registry_.all_released()) {
    registry_.clear();
  } else {
    // Blocks of an older graph are still alive (retain_graph, or a graph the
    // user kept): keep their entries and number the new ones after them.
  }
  // The previous forward's sizes tell where its tail began: see in_resident_tail().
  if (!packed_bytes_.empty()) previous_packed_bytes_ = std::move(packed_bytes_);
  packed_bytes_.clear();
  offloaded_.assign(registry_.size(), false);
  requested_.assign(registry_.size(), true);
  consumed_.assign(registry_.size(), true);
  expected_.clear();
  cursor_ = 0;
  window_bytes_ = 0;
  in_backward_ = false;
  first_block_ = static_cast<BlockId>(registry_.size());
  ++stats_.forwards;
}

PackDecision ActivationSchedule::on_pack(std::size_t bytes, bool eligible, PackDirective directive) {
  bool offload = false;
  // Tensors saved during backward (recomputation) are read right away: keep them.
  if (eligible && !in_backward_) {
    if (directive != PackDirective::kPolicy) {
      offload = directive == PackDirective::kOffload;
    } else {
      switch (options_.target) {
        case OffloadTarget::kHost:
        case OffloadTarget::kAuto:
        case OffloadTarget::kRecompute: offload = true; break;
        case OffloadTarget::kNvme: offload = !in_resident_tail(bytes); break;
        case OffloadTarget::kNone: offload = false; break;
      }
    }
  }
  packed_bytes_.push_back(bytes);
  BlockId id = registry_.add(bytes, offload ? Residence::kInFlightToHost : Residence::kResident);
  offloaded_.push_back(offload);
  requested_.push_back(false);
  consumed_.push_back(false);
  if (offload) ++stats_.offloaded_blocks;
  else ++stats_.kept_blocks;
  return {id, offload};
}

bool ActivationSchedule::in_resident_tail(std::size_t bytes) const {
  // SSDTrain: the last blocks saved are the first backward needs; writing them
  // to SSD and reading them straight back is wasted bandwidth. Keep blocks on
  // the device whose position, counted from the end of the previous forward
  // (the same graph), falls within keep_tail_bytes.
  if (options_.keep_tail_bytes == 0 || previous_packed_bytes_.empty()) return false;
  const std::size_t index = packed_bytes_.size();
  if (index >= previous_packed_bytes_.size() || previous_packed_bytes_[index] != bytes) return false;
  std::uint64_t from_end = 0;
  for (std::size_t i = previous_packed_bytes_.size(); i > index; --i) from_end += previous_packed_bytes_[i - 1];
  return from_end <= options_.keep_tail_bytes;
}

std::vector<BlockId> ActivationSchedule::begin_backward() {
  if (in_backward_) return {};
  in_backward_ = true;
  ++stats_.backwards;
  const std::size_t total = registry_.size();
  const std::size_t count = total - first_block_;
  last_forward_blocks_ = count;
  expected_.clear();
  if (!recorded_.empty() && recorded_blocks_ == count) {
    for (BlockId rel : recorded_) expected_.push_back(first_block_ + rel);
    ++stats_.recorded_orders_used;
  } else {
    for (std::size_t i = total; i > first_block_; --i) expected_.push_back(static_cast<BlockId>(i - 1));
  }
  cursor_ = 0;
  return fill_window();
}

std::vector<BlockId> ActivationSchedule::on_unpack(BlockId id) {
  TIERFLOW_EXPECTS(id < consumed_.size(), "ActivationSchedule::on_unpack: unknown block " +
                                              std::to_string(id));
  std::vector<BlockId> out;
  if (!in_backward_) out = begin_backward();
  if (consumed_[id]) return out;  // a second read of the same storage
  consumed_[id] = true;
  if (id >= first_block_) read_order_.push_back(id - first_block_);
  if (requested_[id] && offloaded_[id]) window_bytes_ -= registry_.bytes(id);
  // Advance past everything already read; a read elsewhere is an order miss.
  if (cursor_ < expected_.size() && expected_[cursor_] != id) ++stats_.order_misses;
  while (cursor_ < expected_.size() && consumed_[expected_[cursor_]]) ++cursor_;
  auto more = fill_window();
  out.insert(out.end(), more.begin(), more.end());
  return out;
}

std::vector<BlockId> ActivationSchedule::fill_window() {
  std::vector<BlockId> out;
  for (std::size_t i = cursor_; i < expected_.size(); ++i) {
    BlockId id = expected_[i];
    if (consumed_[id] || requested_[id] || !offloaded_[id]) continue;
    const std::size_t b = registry_.bytes(id);
    // Always let the next needed block in, even if it alone exceeds the window.
    if (window_bytes_ > 0 && window_bytes_ + b > options_.prefetch_bytes) break;
    requested_[id] = true;
    window_bytes_ += b;
    out.push_back(id);
  }
  return out;
}

}  // namespace tierflow::tiering
