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

/// A compute stream as the copy engine sees it: the stream whose queued work
/// produced a copy's source or last used its destination, or that will read
/// what a copy brings. On CUDA the handle is a cudaStream_t, and PyTorch's
/// default stream has the handle nullptr, so whether a stream is named at all
/// is kept apart from the handle (see Note [Copy ordering]).
class StreamRef {
 public:
  /// Names no stream: the copy is ordered after nothing but its dependencies.
  StreamRef() = default;
  /// A CUDA stream; nullptr is the legacy default stream, a real stream.
  static StreamRef cuda(void* native) noexcept { return StreamRef(Kind::kCuda, native); }
  /// The emulated device's compute: the host thread that runs the model.
  static StreamRef emulated_compute() noexcept { return StreamRef(Kind::kEmulated, nullptr); }
  /// True unless default-constructed.
  bool named() const noexcept { return kind_ != Kind::kNone; }
  /// True for a CUDA stream.
  bool is_cuda() const noexcept { return kind_ == Kind::kCuda; }
  /// The cudaStream_t (nullptr for the default stream and for emulated compute).
  void* native() const noexcept { return native_; }

 private:
  enum class Kind : std::uint8_t { kNone, kCuda, kEmulated };
  StreamRef(Kind k, void* n) : kind_(k), native_(n) {}
  Kind kind_ = Kind::kNone;
  void* native_ = nullptr;
};

/// Copies on the emulated device and NVMe requests queued in this process
/// since it started: the work whose buffers the adversarial emulated device
/// delays, reorders or poisons (CUDA copies are not counted: no emulated mode
/// reaches them).
/// The Python suite reads it to hold its rule of where a test runs (Note
/// [Test tiers] in tests/README.md): a test that queued none cannot depend on
/// their completion order, so it runs in one emulated mode only.
std::uint64_t queued_transfers_in_process() noexcept;

namespace detail {
/// Counts one queued copy or NVMe request in queued_transfers_in_process().
void count_queued_transfer() noexcept;
}  // namespace detail

/// Bytes and operations per direction since the engine was created.
struct CopyEngineStats {
  std::uint64_t d2h_bytes = 0;  ///< bytes copied device -> host
  std::uint64_t h2d_bytes = 0;  ///< bytes copied host -> device
  std::uint64_t d2h_ops = 0;    ///< copies device -> host
  std::uint64_t h2d_ops = 0;    ///< copies host -> device
};

/// CopyEngineStats' exported fields (Note [Stat fields]): the report's "links".
const std::vector<StatField<CopyEngineStats>>& copy_engine_stat_fields();

/// Test hook for the emulated engine: slows its copies so tests can hold
/// transfers in flight at a chosen moment.
struct CopyFaults {
  std::atomic<int> d2h_delay_us{0};  ///< each device -> host copy first sleeps this long
  /// Every copy behaves as if it named no stream (the ordering bug of issue 8),
  /// so tests can show that the adversarial mode catches it.
  std::atomic<bool> ignore_stream_order{false};
  /// The next this-many device -> host copies fail (their handles rethrow an
  /// io_error; the destination is not written), so tests can show a failed
  /// copy loses nothing. Counted down as copies are queued.
  mutable std::atomic<int> fail_d2h_copies{0};
  /// While set, device -> host copies do not start (a hung device, Note [Stall timeout]); cleared, they go on.
  std::atomic<bool> hold_d2h{false};
};

/// Behaviour of the emulated engine; see Note [Adversarial emulated device].
struct EmulatedCopyOptions {
  bool adversarial = false;          ///< late, randomly delayed copies; poison for unordered ones
  std::uint64_t seed = 1;            ///< seed of the delays
  int max_delay_us = 400;            ///< most of a copy's random delay (adversarial)
  int long_delay_us = 3000;          ///< one copy in 16 waits this long instead (adversarial)
};

/// Counters of the adversarial emulated engine.
struct EmulatedCopyStats {
  std::uint64_t unordered_copies = 0;  ///< copies that named no stream: their destination was poisoned
  std::uint64_t delayed_copies = 0;    ///< copies that were held back by a random delay
};

/// EmulatedCopyStats' exported fields (Note [Stat fields]).
const std::vector<StatField<EmulatedCopyStats>>& emulated_copy_stat_fields();

/// Asynchronous copies between the GPU tier and host memory.
///
/// Note [Copy ordering]
/// ~~~~~~~~~~~~~~~~~~~~
/// Copies in one direction run in submission order (a stream); the two
/// directions run independently of each other and of compute. Three rules
/// keep every buffer that a copy touches safe, on CUDA and on the emulated
/// device alike (its adversarial mode breaks any copy that skips one, see
/// Note [Adversarial emulated device]):
///  1. Before the copy: a copy names `after`, the compute stream whose queued
///     work produced its source (device -> host) or last used its destination
///     (host -> device: memory the caching allocator handed out may still be
///     read by kernels queued before it was freed). The engine orders the copy
///     after everything queued on that stream so far (an event recorded there
///     and waited on by the copy stream). PyTorch's default CUDA stream is a
///     named stream with the handle nullptr. Only copies between memory that
///     no compute stream touches may name none.
///  2. After the copy: compute that reads a copy's destination first waits for
///     it, with make_stream_wait(compute, handle) (no host block on CUDA) or
///     handle.wait() on the host; so does compute that writes a copy's source
///     in place while the copy may still read it (a user's clip of gradients
///     on their way to the host).
///  3. Lifetime: the source and destination of a copy stay allocated until its
///     handle is ready. The caller keeps device storage referenced (or waits
///     on the host before dropping it), and returns a pinned block to the pool
///     with the handle of the last copy that touched it
///     (PinnedHostPool::deallocate(p, fence)), which reuses it only after that.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  /// The backend of this engine.
  virtual allocator::DeviceKind device() const noexcept = 0;
  /// Enqueues a copy of `bytes` from `src` to `dst`, after every handle in
  /// `deps` and after the work queued so far on `after` (rule 1 of Note
  /// [Copy ordering]); both buffers stay valid until the handle completes.
  virtual TransferHandle copy(Direction dir, void* dst, const void* src, std::size_t bytes,
                              const std::vector<TransferHandle>& deps = {}, StreamRef after = {}) = 0;
  /// Makes `consumer` wait for `h` (rule 2): on CUDA without blocking the
  /// host; on the emulated device (whose compute is the calling thread) by
  /// blocking the caller until `h` completes.
  virtual void make_stream_wait(StreamRef consumer, const TransferHandle& h) = 0;
  /// The compute stream a caller on this thread names: emulated compute, or
  /// for CUDA the stream given by the caller (the engine cannot see torch's).
  virtual StreamRef compute_stream(void* cuda_native) const noexcept = 0;
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
std::unique_ptr<CopyEngine> make_emulated_copy_engine(std::shared_ptr<const CopyFaults> faults = nullptr,
                                                      EmulatedCopyOptions options = {});

/// The adversarial counters of an emulated engine (zeros for any other engine).
EmulatedCopyStats emulated_copy_stats(const CopyEngine& engine) noexcept;

/// Copies on two non-blocking CUDA streams with events; throws logic_error
/// when tierflow was built without CUDA or no GPU is present.
std::unique_ptr<CopyEngine> make_cuda_copy_engine();

/// The engine for `kind`; `faults` and `options` apply to the emulated one only.
std::unique_ptr<CopyEngine> make_copy_engine(allocator::DeviceKind kind,
                                             std::shared_ptr<const CopyFaults> faults = nullptr,
                                             EmulatedCopyOptions options = {});

}  // namespace tierflow::swap
