// The emulated device's copy engine: one worker thread per direction, each a
// FIFO, with the completion and chaining semantics of CUDA streams and events.
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <thread>

#include "tierflow/allocator/small_alloc.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/detail/host_event.hpp"
#include "tierflow/swap/detail/serial_worker.hpp"

namespace tierflow::swap {
namespace {

using EmulatedState = detail::HostEvent;

class EmulatedCopyEngine final : public CopyEngine {
 public:
  EmulatedCopyEngine(std::shared_ptr<const CopyFaults> faults, EmulatedCopyOptions options)
      : faults_(std::move(faults)), options_(options), rng_(options.seed) {}

  allocator::DeviceKind device() const noexcept override { return allocator::DeviceKind::kEmulated; }

  TransferHandle copy(Direction dir, void* dst, const void* src, std::size_t bytes,
                      const std::vector<TransferHandle>& deps, StreamRef after) override {
    TIERFLOW_EXPECTS(bytes == 0 || (dst && src), "CopyEngine::copy: null pointer with nonzero size");
    TIERFLOW_EXPECTS(!after.is_cuda(), "emulated copy engine: `after` names a CUDA stream");
    // Handles are small and frequent: see Note [mimalloc shim].
    auto state = std::allocate_shared<EmulatedState>(
        allocator::SmallAllocator<EmulatedState>(), bytes,
        dir == Direction::kDeviceToHost ? "device -> host copy" : "host -> device copy");
    count(dir, bytes);
    detail::count_queued_transfer();
    int delay_us = faults_ && dir == Direction::kDeviceToHost ? faults_->d2h_delay_us.load() : 0;
    const bool fail = faults_ && dir == Direction::kDeviceToHost && faults_->fail_d2h_copies.load() > 0 &&
                      faults_->fail_d2h_copies.fetch_sub(1) > 0;
    bool poison = false;
    if (options_.adversarial) {
      // Note [Adversarial emulated device]: the emulated compute has finished
      // when the copy is queued, so only a copy that names it is ordered
      // after it. One that does not stands for a CUDA copy racing the kernels
      // that write its source or still use its destination: it delivers poison.
      poison = !after.named() || (faults_ && faults_->ignore_stream_order.load());
      delay_us += next_delay_us();
      if (poison) unordered_.add();
      if (delay_us > 0) delayed_.add();
    }
    const CopyFaults* held = faults_ && dir == Direction::kDeviceToHost ? faults_.get() : nullptr;
    stream(dir).push([dst, src, bytes, deps, state, delay_us, poison, fail, held, keep = faults_] {
      std::exception_ptr error;
      try {
        while (held && held->hold_d2h.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        for (const auto& d : deps) d.wait();
        if (fail) throw io_error(EIO, "emulated copy engine: device -> host copy of " + std::to_string(bytes) +
                                 " bytes failed (CopyFaults::fail_d2h_copies)");
        if (bytes && poison) std::memset(dst, allocator::kPoisonByte, bytes);
        else if (bytes) std::memcpy(dst, src, bytes);
      } catch (...) {
        error = std::current_exception();
      }
      state->finish(error);  // failures travel through the handle, not the worker
    });
    return TransferHandle(state);
  }

  void make_stream_wait(StreamRef, const TransferHandle& h) override { h.wait(); }
  StreamRef compute_stream(void*) const noexcept override { return StreamRef::emulated_compute(); }
  void* native_stream(Direction) const noexcept override { return nullptr; }
  void synchronize() override {
    d2h_.drain();
    h2d_.drain();
  }
  EmulatedCopyStats adversarial_stats() const noexcept { return {unordered_.value(), delayed_.value()}; }

 private:
  // Seeded: the same sequence of copies gets the same delays. Most copies
  // wait a little (late), one in 16 waits long (so the two directions and
  // the host see completions in a different order from run to run of seeds).
  int next_delay_us() {
    std::lock_guard<std::mutex> lock(rng_mutex_);
    const std::uint64_t r = rng_();
    if ((r & 15) == 0) return options_.long_delay_us;
    return static_cast<int>((r >> 8) % static_cast<std::uint64_t>(options_.max_delay_us + 1));
  }

  detail::SerialWorker& stream(Direction dir) { return dir == Direction::kDeviceToHost ? d2h_ : h2d_; }
  std::shared_ptr<const CopyFaults> faults_;
  EmulatedCopyOptions options_;
  std::mutex rng_mutex_;
  std::mt19937_64 rng_;
  Counter unordered_, delayed_;
  detail::SerialWorker d2h_, h2d_;  // one in-order "stream" per direction
};

}  // namespace

std::unique_ptr<CopyEngine> make_emulated_copy_engine(std::shared_ptr<const CopyFaults> faults,
                                                      EmulatedCopyOptions options) {
  return std::make_unique<EmulatedCopyEngine>(std::move(faults), options);
}

namespace {
Counter& queued_transfers() noexcept {
  static Counter c;
  return c;
}
}  // namespace

void detail::count_queued_transfer() noexcept { queued_transfers().add(); }

std::uint64_t queued_transfers_in_process() noexcept { return queued_transfers().value(); }

EmulatedCopyStats emulated_copy_stats(const CopyEngine& engine) noexcept {
  const auto* e = dynamic_cast<const EmulatedCopyEngine*>(&engine);
  return e ? e->adversarial_stats() : EmulatedCopyStats{};
}

std::unique_ptr<CopyEngine> make_copy_engine(allocator::DeviceKind kind, std::shared_ptr<const CopyFaults> faults,
                                             EmulatedCopyOptions options) {
  return kind == allocator::DeviceKind::kCuda ? make_cuda_copy_engine()
                                              : make_emulated_copy_engine(std::move(faults), options);
}

const std::vector<StatField<CopyEngineStats>>& copy_engine_stat_fields() {
  using S = CopyEngineStats;
  static const std::vector<StatField<S>> fields = {
      {"gpu_to_host_bytes", &S::d2h_bytes}, {"host_to_gpu_bytes", &S::h2d_bytes},
      {"gpu_to_host_ops", &S::d2h_ops},     {"host_to_gpu_ops", &S::h2d_ops},
  };
  return fields;
}

const std::vector<StatField<EmulatedCopyStats>>& emulated_copy_stat_fields() {
  using S = EmulatedCopyStats;
  static const std::vector<StatField<S>> fields = {
      {"unordered_copies", &S::unordered_copies},
      {"delayed_copies", &S::delayed_copies},
  };
  return fields;
}

}  // namespace tierflow::swap
