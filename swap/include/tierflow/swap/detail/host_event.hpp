// A completion event signalled by a host thread (the emulated copy engine's
// workers, the NVMe engine's I/O thread), with CUDA-event semantics.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

#include "tierflow/swap/transfer_handle.hpp"

namespace tierflow::swap::detail {

/// TransferState completed by finish() from any thread; wait() rethrows its error.
class HostEvent final : public TransferState {
 public:
  explicit HostEvent(std::size_t bytes) : bytes_(bytes) {}
  bool ready() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  void wait() const override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  std::size_t bytes() const noexcept override { return bytes_; }
  /// Marks the transfer complete, with `error` (null on success).
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

 private:
  std::size_t bytes_;
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace tierflow::swap::detail
