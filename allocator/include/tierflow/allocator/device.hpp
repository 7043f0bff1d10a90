// Which device backs the GPU tier: a CUDA GPU, or the emulated device.
//
// Note [Emulated device]
// ~~~~~~~~~~~~~~~~~~~~~~
// With no GPU (CI, laptops) the GPU tier is ordinary host memory accounted
// against the GPU budget, and copies run on worker threads with the same
// handle semantics as CUDA streams and events. Everything above swap/ is the
// same code in both modes, so scheduling, budgets and the optimizer are tested
// without a GPU. The CUDA backend is compiled whenever the toolkit is found
// (TIERFLOW_WITH_CUDA) and chosen at run time when a GPU is present
// (TIERFLOW_DEVICE=emulated forces the emulated device even then).
//
// Note [Adversarial emulated device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The polite emulation cannot show a missing stream ordering: its "compute"
// (torch's CPU kernels on the calling thread) has finished before any hook
// runs, its copies finish in order and at once, and freed memory keeps its
// bytes. On an H100 the same code trained wrong (issue 8): copies named
// PyTorch's default stream by its handle, nullptr, which the engine read as
// "no stream", so nothing ordered them after the kernels that wrote their
// sources or still used their destinations. TIERFLOW_EMULATED_DEVICE=
// adversarial makes every rule of Note [Copy ordering] observable on a CPU:
//  - the emulated compute has a real stream token (StreamRef::emulated_compute);
//    a copy that names no stream stands for a copy racing the compute and
//    delivers poison (0xFF bytes: NaN in every float type) into its
//    destination, both directions;
//  - every copy is held back by a seeded random delay (most short, one in 16
//    long, TIERFLOW_EMULATED_SEED), so copies complete late, the two
//    directions complete out of order with each other and with the host, and
//    a reader that does not wait for a copy reads poison;
//  - torch's CPU allocator (the emulated device's memory) is replaced by one
//    over EmulatedDeviceResource and a QuarantineAdaptor (Note [Quarantine
//    adaptor]; the torch side in bindings/emulated_device_memory.hpp): fresh
//    blocks hold poison, freed blocks are poisoned and quarantined before
//    reuse and checked on the way out, so a copy that reads freed device
//    memory delivers poison and one that writes into it is counted as a late
//    write;
//  - the pinned host pool does the same with its blocks, and a block returned
//    with a fence waits for it before reuse;
//  - the CPU optimizer's gradients, masters and updated parameters move
//    through the copy engine exactly as on CUDA (Note [Optimizer copies]).
// What it cannot show: a race inside one CUDA stream, or between torch's own
// side streams, since the emulated compute is one thread; and timing.
// CopyFaults::ignore_stream_order brings issue 8's bug back on demand:
// tests/python/test_adversarial.py shows the polite device trains through it
// and the adversarial one does not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tierflow::allocator {

/// Byte that poisoned memory holds: 0xFF reads as NaN in float32, bfloat16
/// and float16 (and as -1 in integers), so poisoned data cannot go unnoticed.
inline constexpr unsigned char kPoisonByte = 0xFF;

/// Offset of the first byte of [p, p + bytes) that is not poison, or `bytes`
/// when all of it still is (a freed block that nobody wrote after its free).
inline std::size_t first_unpoisoned(const void* p, std::size_t bytes) noexcept {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < bytes; ++i)
    if (b[i] != kPoisonByte) return i;
  return bytes;
}

/// The backend of the GPU tier.
enum class DeviceKind : std::uint8_t { kEmulated, kCuda };

/// "emulated" or "cuda".
std::string_view to_string(DeviceKind k) noexcept;

/// True when tierflow was compiled with the CUDA backend.
bool cuda_compiled() noexcept;

/// True when the CUDA backend is compiled and at least one GPU is usable.
bool cuda_available() noexcept;

/// Total memory of the GPU tier: the current GPU's, or physical RAM when emulated.
std::uint64_t device_capacity_bytes(DeviceKind kind);

/// Physical RAM of this machine.
std::uint64_t host_capacity_bytes();

}  // namespace tierflow::allocator
