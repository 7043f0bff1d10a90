// The block registry: one entry per managed tensor storage, with its
// residence and the legal transitions between residences.
//
// Note [Block residences]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A block is where its bytes are, one tier at a time: on the device, on the
// way to the host, in pinned host memory, on NVMe only, on the way back, or
// released. The staged pipeline (Note [Staged pipeline]) moves the bytes and
// reports each of its states; residence_of() says which residence that is,
// and the registry refuses any move the pipeline should never make (a block
// that jumps from the device to NVMe, or comes back from NVMe without a read
// in flight). Each residence counts its bytes on the tiers that hold them:
//   device: kResident, kInFlightToHost (its device copy is kept until the copy
//           lands), kInFlightToDevice (the destination is allocated);
//   host:   kInFlightToHost, kOnHost, kInFlightToDevice (staging, or the host
//           copy read from);
//   NVMe:   kOnNvme (the only copy; its staging went back to the pool).
// A block coming back from NVMe holds host staging and device memory while
// in flight, as one from the host does; its NVMe space is freed when it is
// released (NvmeEngine::release).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "tierflow/core/stats.hpp"
#include "tierflow/swap/staged_pipeline.hpp"

namespace tierflow::tiering {

/// Index of a block within one forward pass (the order it was saved in).
using BlockId = std::uint32_t;

/// Where a block's bytes are (Note [Block residences]). Legal moves (anything
/// else is a logic_error):
///   kResident         -> kInFlightToHost | kReleased
///   kInFlightToHost   -> kOnHost | kResident (forwarded: the device copy is kept) | kReleased
///   kOnHost           -> kOnNvme (written behind) | kInFlightToDevice | kReleased
///   kOnNvme           -> kInFlightToDevice (read ahead) | kReleased
///   kInFlightToDevice -> kResident | kReleased
///   kReleased         -> (none)
enum class Residence : std::uint8_t {
  kResident,
  kInFlightToHost,
  kOnHost,
  kOnNvme,
  kInFlightToDevice,
  kReleased,
};

/// Name of a residence, for messages.
std::string_view to_string(Residence r) noexcept;

/// True for a block whose bytes are only on the host or NVMe (a read must fetch it).
constexpr bool off_device(Residence r) noexcept { return r == Residence::kOnHost || r == Residence::kOnNvme; }

/// The residence of a block in the staged pipeline's state `s`.
Residence residence_of(swap::StagedState s) noexcept;

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
  /// Bytes whose only copy is on NVMe.
  const Stat& nvme_bytes() const noexcept { return nvme_; }
  /// Resets the peaks of the statistics to their current values.
  void reset_peaks() noexcept {
    device_.reset_peak();
    host_.reset_peak();
    nvme_.reset_peak();
  }
  /// The most bytes each tier held since the previous call (the first: since construction), what it holds now
  /// included (Note [Window peak]; one reader: the step recorder, Note [Step stats]).
  struct WindowPeaks {
    std::int64_t device = 0, host = 0, nvme = 0;
  };
  WindowPeaks take_window_peaks() noexcept {
    return {device_.take_window_peak(), host_.take_window_peak(), nvme_.take_window_peak()};
  }

 private:
  struct Entry {
    std::size_t bytes;
    Residence where;
  };
  static bool on_device(Residence r) noexcept;
  static bool on_host(Residence r) noexcept;
  static bool legal(Residence from, Residence to) noexcept;
  static void count(Stat& stat, bool before, bool after, std::int64_t bytes);
  const Entry& at(BlockId id) const;

  std::vector<Entry> blocks_;
  std::size_t live_ = 0;
  Stat device_;
  Stat host_;
  Stat nvme_;
};

}  // namespace tierflow::tiering
