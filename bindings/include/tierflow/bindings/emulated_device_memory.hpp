// The adversarial emulated device's memory: torch's CPU allocator, poisoned.
//
// On the emulated device the "device" tensors are CPU tensors that torch's CPU
// allocator serves. In adversarial mode (Note [Adversarial emulated device])
// tierflow replaces that allocator with a thin c10::Allocator whose memory
// comes from allocator/'s resources: EmulatedDeviceResource under a
// QuarantineAdaptor, which poisons every allocation, poisons and quarantines
// every freed block and counts late writes (Note [Quarantine adaptor]). What
// stays here is torch's side: the DataPtr and raw_deleter() bookkeeping, and
// handing blocks that torch allocated before installation back to torch.
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
