// What a stretch of code leaves allocated on the device: the C++ `auto` plan's
// measure of the bytes a kept block saves (Note [C++ auto activations] in
// block_offload.hpp).
//
// Note [Device memory meter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// On CUDA the caching allocator counts its allocated bytes: a meter reads the
// device's allocated_bytes (c10::CachingDeviceAllocator::DeviceStats) when it
// starts and when asked. torch's CPU allocator, which serves the emulated
// device, counts nothing, so install_counting_cpu_allocator puts a counting
// c10::Allocator in front of whichever CPU allocator is in force (torch's,
// or the adversarial device's poisoning one: installed by the Runtime first,
// it stays under the counter and keeps poisoning; one installed after the
// counter, by a later runtime in the same process, gets a counter of its own
// in front of it at the next install). The counter counts only
// the allocations made on a thread while a meter is open on it (a copy
// engine's or an optimizer's thread allocating meanwhile is not the block's),
// and their frees, from any thread; every other block passes through to the
// allocator below untouched. Torch's CPU kernels free through raw_deleter(),
// so a counted block's data pointer is its own context, and a block the
// counter did not serve goes back to the allocator below.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace tierflow::bindings {

/// Puts the counting allocator in front of torch's CPU allocator (once per process; later calls do nothing).
/// Returns false when torch refused the replacement (a meter on the emulated device then reads 0).
bool install_counting_cpu_allocator();

/// The device bytes allocated since construction and still live, net of frees, on `device`'s allocator:
/// CUDA's caching allocator, or (CPU, the emulated device) the counting allocator's, for this thread's
/// allocations only. Not copyable; one thread.
class DeviceMemoryMeter {
 public:
  explicit DeviceMemoryMeter(const c10::Device& device);
  ~DeviceMemoryMeter();
  DeviceMemoryMeter(const DeviceMemoryMeter&) = delete;
  DeviceMemoryMeter& operator=(const DeviceMemoryMeter&) = delete;
  /// Allocated since construction and live now (0 when frees outweigh them).
  std::uint64_t live_bytes() const;

 private:
  c10::Device device_;
  std::int64_t start_ = 0;
};

}  // namespace tierflow::bindings
