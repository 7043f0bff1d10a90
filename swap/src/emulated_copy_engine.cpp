// The emulated device's copy engine: one worker thread per direction, each a
// FIFO, with the completion and chaining semantics of CUDA streams and events.
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
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
  explicit EmulatedCopyEngine(std::shared_ptr<const CopyFaults> faults) : faults_(std::move(faults)) {}

  allocator::DeviceKind device() const noexcept override { return allocator::DeviceKind::kEmulated; }

  TransferHandle copy(Direction dir, void* dst, const void* src, std::size_t bytes,
                      const std::vector<TransferHandle>& deps, void*) override {
    TIERFLOW_EXPECTS(bytes == 0 || (dst && src), "CopyEngine::copy: null pointer with nonzero size");
    // Handles are small and frequent: see Note [mimalloc shim].
    auto state = std::allocate_shared<EmulatedState>(allocator::SmallAllocator<EmulatedState>(), bytes);
    count(dir, bytes);
    const int delay_us = faults_ && dir == Direction::kDeviceToHost ? faults_->d2h_delay_us.load() : 0;
    stream(dir).push([dst, src, bytes, deps, state, delay_us] {
      std::exception_ptr error;
      try {
        if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        for (const auto& d : deps) d.wait();
        if (bytes) std::memcpy(dst, src, bytes);
      } catch (...) {
        error = std::current_exception();
      }
      state->finish(error);  // failures travel through the handle, not the worker
    });
    return TransferHandle(state);
  }

  void make_stream_wait(void*, const TransferHandle& h) override { h.wait(); }
  void* native_stream(Direction) const noexcept override { return nullptr; }
  void synchronize() override {
    d2h_.drain();
    h2d_.drain();
  }

 private:
  detail::SerialWorker& stream(Direction dir) { return dir == Direction::kDeviceToHost ? d2h_ : h2d_; }
  std::shared_ptr<const CopyFaults> faults_;
  detail::SerialWorker d2h_, h2d_;  // one in-order "stream" per direction
};

}  // namespace

std::unique_ptr<CopyEngine> make_emulated_copy_engine(std::shared_ptr<const CopyFaults> faults) {
  return std::make_unique<EmulatedCopyEngine>(std::move(faults));
}

std::unique_ptr<CopyEngine> make_copy_engine(allocator::DeviceKind kind, std::shared_ptr<const CopyFaults> faults) {
  return kind == allocator::DeviceKind::kCuda ? make_cuda_copy_engine()
                                              : make_emulated_copy_engine(std::move(faults));
}

}  // namespace tierflow::swap
