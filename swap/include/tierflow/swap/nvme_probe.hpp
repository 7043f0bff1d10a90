// The NVMe tier's speed as the engine itself moves data.
//
// Note [NVMe probe]
// ~~~~~~~~~~~~~~~~~
// The activation planner prices a swap to NVMe with the tier's write and read
// bandwidth. It measures them through the NvmeEngine the run uses: one block
// striped over every TIERFLOW_NVME_PATHS path, in TIERFLOW_AIO_BLOCK_SIZE
// requests with TIERFLOW_AIO_QUEUE_DEPTH in flight, O_DIRECT (no page cache
// on either side), checksums as configured; the best of `repeats` rounds of a
// write and a read back. benchmarks/bench_nvme_engine times the same function
// beside fio, so the figure the planner uses is the one the benchmark reports.
#pragma once

#include <cstdint>

#include "tierflow/swap/nvme_engine.hpp"

namespace tierflow::swap {

/// Bandwidths measured through an NvmeEngine, in bytes per second.
struct NvmeBandwidth {
  double write_bytes_per_second = 0.0;
  double read_bytes_per_second = 0.0;
  std::uint64_t bytes = 0;  ///< bytes moved each way per round
};

/// Writes `bytes` from `buffer` into one block of `engine` and reads them back
/// into it, `repeats` times; the best time each way. The block is released
/// before it returns. Throws out_of_memory when the tier has no room for
/// `bytes` (NvmeEngine::available_bytes says how much it has) and io_error
/// when an operation fails; the buffer's first `bytes` are overwritten.
NvmeBandwidth measure_bandwidth(NvmeEngine& engine, void* buffer, std::uint64_t bytes, int repeats = 1);

}  // namespace tierflow::swap
