// The adversarial emulated device's memory: torch's CPU allocator, poisoned.
//
// On the emulated device the "device" tensors are CPU tensors that torch's CPU
// allocator serves. A real GPU's caching allocator hands a freed block to the
// next request at once, while a copy on a side stream may still read or write
// it; the polite emulation hides that, because freed host memory keeps its old
// bytes. In adversarial mode (Note [Adversarial emulated device]) tierflow
// puts a poisoning allocator in front of torch's: every allocation starts as
// poison (what a reused block would hold, at worst), every freed block is
// filled with poison and kept in a quarantine before it goes back, and on its
// way out of the quarantine every byte is checked. A copy that reads a freed
// block delivers poison; one that writes into a freed block is counted as a
// late write. Only bindings/ can do this: the allocator is torch's.
#pragma once

#include <cstdint>

namespace tierflow::bindings {

/// Counters of the poisoning allocator since it was installed.
struct EmulatedDeviceMemoryStats {
  bool installed = false;            ///< whether the poisoning allocator serves torch's CPU tensors
  std::uint64_t allocations = 0;     ///< allocations it served
  std::uint64_t quarantined = 0;     ///< frees that went through the quarantine
  std::uint64_t late_writes = 0;     ///< freed blocks found written while in quarantine
};

/// Puts the poisoning allocator in front of torch's CPU allocator (once per
/// process; later calls do nothing). It stays for the rest of the process:
/// tensors it allocated must come back to it.
void install_poisoning_device_memory();

/// Checks every block still in quarantine now (so late writes show up in the
/// counters without waiting for eviction).
void check_device_memory_quarantine();

/// Counters snapshot.
EmulatedDeviceMemoryStats emulated_device_memory_stats();

}  // namespace tierflow::bindings
