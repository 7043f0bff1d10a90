// A completion event signalled by a host thread (the emulated copy engine's
// workers, the NVMe engine's I/O thread), with CUDA-event semantics.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>

#include "tierflow/core/stall.hpp"
#include "tierflow/swap/transfer_handle.hpp"

namespace tierflow::swap::detail {

/// TransferState completed by finish() from any thread; wait() rethrows its error, and throws stall_error
/// past TIERFLOW_STALL_TIMEOUT (Note [Stall timeout]), naming `kind` (a string literal) and `id`.
class HostEvent final : public TransferState {
 public:
  explicit HostEvent(std::size_t bytes, const char* kind = "transfer", std::int64_t id = -1)
      : bytes_(bytes), work_(kind, bytes, id) {}
  bool ready() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  void wait() const override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_) {
      const auto start = std::chrono::steady_clock::now();
      if (stall_timeout() > 0) {  // counted from the work's start, not the wait's (Note [Stall timeout])
        // Ends by the oldest work's deadline too: a stall raises at the limit of the oldest work in flight.
        for (;;) {
          const auto own = work_.deadline();
          const auto until = std::min(own, oldest_deadline());
          if (cv_.wait_until(lock, until, [&] { return done_; })) break;
          lock.unlock();
          if (std::chrono::steady_clock::now() >= own)
            work_.stalled(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
          raise_if_stalled();  // the oldest work, past its deadline; or it completed meanwhile: wait on
          lock.lock();
        }
      } else {
        cv_.wait(lock, [&] { return done_; });
      }
    }
    if (error_) std::rethrow_exception(error_);
  }
  std::size_t bytes() const noexcept override { return bytes_; }
  /// Marks the transfer complete, with `error` (null on success).
  void finish(std::exception_ptr error) {
    work_.done();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

 private:
  std::size_t bytes_;
  PendingWork work_;
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace tierflow::swap::detail
