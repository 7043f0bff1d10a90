#include "tierflow/tiering/block_registry.hpp"

#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

std::string_view to_string(Residence r) noexcept {
  switch (r) {
    case Residence::kResident: return "resident";
    case Residence::kInFlightToHost: return "in-flight-to-host";
    case Residence::kOnHost: return "on-host";
    case Residence::kOnNvme: return "on-nvme";
    case Residence::kInFlightToDevice: return "in-flight-to-device";
    case Residence::kReleased: return "released";
  }
  return "?";
}

Residence residence_of(swap::StagedState s) noexcept {
  switch (s) {
    case swap::StagedState::kOnDevice: return Residence::kResident;
    case swap::StagedState::kToHost: return Residence::kInFlightToHost;
    case swap::StagedState::kOnHost: return Residence::kOnHost;
    case swap::StagedState::kOnNvme: return Residence::kOnNvme;
    case swap::StagedState::kToDevice: return Residence::kInFlightToDevice;
    case swap::StagedState::kReleased: return Residence::kReleased;
  }
  return Residence::kReleased;
}

bool BlockRegistry::on_device(Residence r) noexcept {
  return r == Residence::kResident || r == Residence::kInFlightToHost ||
         r == Residence::kInFlightToDevice;
}

bool BlockRegistry::on_host(Residence r) noexcept {
  return r == Residence::kInFlightToHost || r == Residence::kOnHost ||
         r == Residence::kInFlightToDevice;
}

const BlockRegistry::Entry& BlockRegistry::at(BlockId id) const {
  TIERFLOW_EXPECTS(id < blocks_.size(), "BlockRegistry: unknown block " + std::to_string(id));
  return blocks_[id];
}

BlockId BlockRegistry::add(std::size_t bytes, Residence initial) {
  TIERFLOW_EXPECTS(initial == Residence::kResident || initial == Residence::kInFlightToHost,
                   "BlockRegistry::add: a block starts resident or in flight to host, not " +
                       std::string(to_string(initial)));
  blocks_.push_back({bytes, initial});
  ++live_;
  const auto b = static_cast<std::int64_t>(bytes);
  if (on_device(initial)) device_.increase(b);
  if (on_host(initial)) host_.increase(b);
  return static_cast<BlockId>(blocks_.size() - 1);
}

bool BlockRegistry::legal(Residence from, Residence to) noexcept {
  switch (from) {
    case Residence::kResident:
      return to == Residence::kInFlightToHost || to == Residence::kReleased;
    case Residence::kInFlightToHost:
      return to == Residence::kOnHost || to == Residence::kResident || to == Residence::kReleased;
    case Residence::kOnHost:
      return to == Residence::kOnNvme || to == Residence::kInFlightToDevice || to == Residence::kReleased;
    case Residence::kOnNvme:
      return to == Residence::kInFlightToDevice || to == Residence::kReleased;
    case Residence::kInFlightToDevice:
      return to == Residence::kResident || to == Residence::kReleased;
    case Residence::kReleased:
      return false;
  }
  return false;
}

void BlockRegistry::count(Stat& stat, bool before, bool after, std::int64_t bytes) {
  if (before && !after) stat.decrease(bytes);
  if (!before && after) stat.increase(bytes);
}

void BlockRegistry::transition(BlockId id, Residence to) {
  const Entry& e = at(id);
  const Residence from = e.where;
  TIERFLOW_EXPECTS(legal(from, to), "BlockRegistry: block " + std::to_string(id) + " cannot move from " +
                                        std::string(to_string(from)) + " to " + std::string(to_string(to)));
  const auto b = static_cast<std::int64_t>(e.bytes);
  count(device_, on_device(from), on_device(to), b);
  count(host_, on_host(from), on_host(to), b);
  count(nvme_, from == Residence::kOnNvme, to == Residence::kOnNvme, b);
  if (to == Residence::kReleased) --live_;
  blocks_[id].where = to;
}

Residence BlockRegistry::residence(BlockId id) const { return at(id).where; }

std::size_t BlockRegistry::bytes(BlockId id) const { return at(id).bytes; }

void BlockRegistry::clear() {
  TIERFLOW_EXPECTS(live_ == 0, "BlockRegistry::clear: " + std::to_string(live_) +
                                   " blocks are still live");
  blocks_.clear();
}

}  // namespace tierflow::tiering
