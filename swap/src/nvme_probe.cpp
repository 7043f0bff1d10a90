#include "tierflow/swap/nvme_probe.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <limits>

#include "tierflow/core/error.hpp"

namespace tierflow::swap {

NvmeBandwidth measure_bandwidth(NvmeEngine& engine, void* buffer, std::uint64_t bytes, int repeats) {
  TIERFLOW_EXPECTS(buffer != nullptr && bytes > 0, "measure_bandwidth: an empty buffer");
  TIERFLOW_EXPECTS(repeats >= 1, "measure_bandwidth: repeats must be at least 1");
  const NvmeBlock block = engine.allocate(bytes);  // out_of_memory before anything is touched
  // Bytes that do not compress (some SSDs compress zeros): a xorshift stream.
  auto* p = static_cast<std::byte*>(buffer);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (std::uint64_t i = 0; i < bytes; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<std::byte>(x);
  }
  using Clock = std::chrono::steady_clock;
  double best_write = std::numeric_limits<double>::infinity(), best_read = best_write;
  try {
    for (int r = 0; r < repeats; ++r) {
      auto t0 = Clock::now();
      engine.write(block, buffer, bytes).wait();
      best_write = std::min(best_write, std::chrono::duration<double>(Clock::now() - t0).count());
      t0 = Clock::now();
      engine.read(block, buffer, bytes).wait();
      best_read = std::min(best_read, std::chrono::duration<double>(Clock::now() - t0).count());
    }
  } catch (...) {
    engine.release(block);
    throw;
  }
  engine.release(block);
  NvmeBandwidth out;
  out.bytes = bytes;
  out.write_bytes_per_second = static_cast<double>(bytes) / std::max(best_write, 1e-9);
  out.read_bytes_per_second = static_cast<double>(bytes) / std::max(best_read, 1e-9);
  return out;
}

}  // namespace tierflow::swap
