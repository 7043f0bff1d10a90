#include "tierflow/tiering/block_registry.hpp"

#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

std::string_view to_string(Residence r) noexcept {
  switch (r) {
    case Residence::kResident: return "resident";
    case Residence::kInFlightToHost: return "in-flight-to-host";
    case Residence::kOnHost: return "on-host";
    case Residence::kInFlightToDevice: return "in-flight-to-device";
    case Residence::kReleased: return "released";
  }
  return "?";
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

void BlockRegistry::transition(BlockId id, Residence to) {
  const Entry& e = at(id);
  const Residence from = e.where;
  bool legal = false;
  switch (from) {
    case Residence::kResident:
      legal = to == Residence::kInFlightToHost || to == Residence::kReleased;
      break;
    case Residence::kInFlightToHost:
      legal = to == Residence::kOnHost || to == Residence::kResident || to == Residence::kReleased;
      break;
    case Residence::kOnHost:
      legal = to == Residence::kInFlightToDevice || to == Residence::kReleased;
      break;
    case Residence::kInFlightToDevice:
      legal = to == Residence::kResident || to == Residence::kReleased;
      break;
    case Residence::kReleased:
      legal = false;
      break;
  }
  TIERFLOW_EXPECTS(legal, "BlockRegistry: block " + std::to_string(id) + " cannot move from " +
                              std::string(to_string(from)) + " to " + std::string(to_string(to)));
  const auto b = static_cast<std::int64_t>(e.bytes);
  if (on_device(from) && !on_device(to)) device_.decrease(b);
  if (!on_device(from) && on_device(to)) device_.increase(b);
  if (on_host(from) && !on_host(to)) host_.decrease(b);
  if (!on_host(from) && on_host(to)) host_.increase(b);
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
