// The block registry: one entry per managed tensor storage, with its
// residence and the legal transitions between residences.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "tierflow/core/stats.hpp"

namespace tierflow::tiering {

/// Index of a block within one forward pass (the order it was saved in).
using BlockId = std::uint32_t;

/// Where a block's bytes are. Legal moves (anything else is a logic_error):
///   kResident         -> kInFlightToHost | kReleased
///   kInFlightToHost   -> kOnHost | kResident (forwarded: the device copy is kept) | kReleased
///   kOnHost           -> kInFlightToDevice | kReleased
///   kInFlightToDevice -> kResident | kReleased
///   kReleased         -> (none)
enum class Residence : std::uint8_t {
  kResident,
  kInFlightToHost,
  kOnHost,
  kInFlightToDevice,
  kReleased,
};

/// Name of a residence, for messages.
std::string_view to_string(Residence r) noexcept;

/// Registry of the blocks of one step, with device/host byte accounting.
class BlockRegistry {
 public:
  /// Registers a block of `bytes` in `initial` (kResident or kInFlightToHost).
  BlockId add(std::size_t bytes, Residence initial);
  /// Moves a block; throws logic_error naming both states if the move is illegal.
  void transition(BlockId id, Residence to);
  /// Current residence.
  Residence residence(BlockId id) const;
  /// Size of a block.
  std::size_t bytes(BlockId id) const;
  /// Number of blocks registered since the last clear().
  std::size_t size() const noexcept { return blocks_.size(); }
  /// True when every block is released.
  bool all_released() const noexcept { return live_ == 0; }
  /// Forgets all blocks (they must all be released).
  void clear();

  /// Bytes that hold device memory (resident or with a copy in flight).
  const Stat& device_bytes() const noexcept { return device_; }
  /// Bytes that hold host memory (offloaded or with a copy in flight).
  const Stat& host_bytes() const noexcept { return host_; }
  /// Resets the peaks of both statistics to their current values.
  void reset_peaks() noexcept {
    device_.reset_peak();
    host_.reset_peak();
  }

 private:
  struct Entry {
    std::size_t bytes;
    Residence where;
  };
  static bool on_device(Residence r) noexcept;
  static bool on_host(Residence r) noexcept;
  const Entry& at(BlockId id) const;

  std::vector<Entry> blocks_;
  std::size_t live_ = 0;
  Stat device_;
  Stat host_;
};

}  // namespace tierflow::tiering
