// The copy engine: device->host and host->device copies, each direction on
// its own in-order stream, overlapped with compute.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "tierflow/allocator/device.hpp"
#include "tierflow/core/stats.hpp"
#include "tierflow/swap/transfer_handle.hpp"

namespace tierflow::swap {

/// Direction of a copy; each has its own stream.
enum class Direction : std::uint8_t { kDeviceToHost = 0, kHostToDevice = 1 };

/// Bytes and operations per direction since the engine was created.
struct CopyEngineStats {
  std::uint64_t d2h_bytes = 0;  ///< bytes copied device -> host
  std::uint64_t h2d_bytes = 0;  ///< bytes copied host -> device
  std::uint64_t d2h_ops = 0;    ///< copies device -> host
  std::uint64_t h2d_ops = 0;    ///< copies host -> device
};

/// Test hook for the emulated engine: slows its copies so tests can hold
/// transfers in flight at a chosen moment.
struct CopyFaults {
  std::atomic<int> d2h_delay_us{0};  ///< each device -> host copy first sleeps this long
};

/// Asynchronous copies between the GPU tier and host memory.
///
/// Copies in one direction run in submission order (a stream). A copy starts
/// after every handle in `deps` has completed and, with CUDA, after the work
/// already queued on `producer_stream` (a cudaStream_t, e.g. torch's current
/// stream, so the copy sees the kernels that produced its source).
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  /// The backend of this engine.
  virtual allocator::DeviceKind device() const noexcept = 0;
  /// Enqueues a copy of `bytes` from `src` to `dst`; both stay valid until the handle completes.
  virtual TransferHandle copy(Direction dir, void* dst, const void* src, std::size_t bytes,
                              const std::vector<TransferHandle>& deps = {},
                              void* producer_stream = nullptr) = 0;
  /// Makes `consumer_stream` wait for `h` without blocking the host (CUDA);
  /// on the emulated device, blocks the caller until `h` completes.
  virtual void make_stream_wait(void* consumer_stream, const TransferHandle& h) = 0;
  /// The native stream of a direction (cudaStream_t), or nullptr when emulated.
  virtual void* native_stream(Direction dir) const noexcept = 0;
  /// Blocks until every queued copy has completed.
  virtual void synchronize() = 0;
  /// Totals since creation.
  CopyEngineStats stats() const noexcept {
    return {d2h_bytes_.value(), h2d_bytes_.value(), d2h_ops_.value(), h2d_ops_.value()};
  }

 protected:
  /// Counts one submitted copy.
  void count(Direction dir, std::size_t bytes) noexcept {
    if (dir == Direction::kDeviceToHost) {
      d2h_bytes_.add(bytes);
      d2h_ops_.add();
    } else {
      h2d_bytes_.add(bytes);
      h2d_ops_.add();
    }
  }

 private:
  Counter d2h_bytes_, h2d_bytes_, d2h_ops_, h2d_ops_;
};

/// Copies on two worker threads; see Note [Emulated device]. `faults`: tests only.
std::unique_ptr<CopyEngine> make_emulated_copy_engine(std::shared_ptr<const CopyFaults> faults = nullptr);

/// Copies on two non-blocking CUDA streams with events; throws logic_error
/// when tierflow was built without CUDA or no GPU is present.
std::unique_ptr<CopyEngine> make_cuda_copy_engine();

/// The engine for `kind`; `faults` applies to the emulated one only.
std::unique_ptr<CopyEngine> make_copy_engine(allocator::DeviceKind kind,
                                             std::shared_ptr<const CopyFaults> faults = nullptr);

}  // namespace tierflow::swap
