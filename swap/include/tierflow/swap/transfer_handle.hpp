// Completion handles for asynchronous transfers.
//
// A handle is the event of one transfer: it can be polled, waited on (which
// rethrows the transfer's error), and passed as a dependency of a later
// transfer on another stream, which then starts only after it (the same
// chaining as cudaStreamWaitEvent). Copies of a handle share its state.
#pragma once

#include <cstddef>
#include <memory>

#include "tierflow/core/completion.hpp"

namespace tierflow::swap {

namespace detail {
/// Backend state of one transfer (an emulated completion flag or a CUDA event).
class TransferState : public Completion {
 public:
  /// Bytes moved by the transfer.
  virtual std::size_t bytes() const noexcept = 0;
};
}  // namespace detail

/// Shared handle to an asynchronous transfer. A default handle is complete.
class TransferHandle {
 public:
  TransferHandle() = default;
  /// Wraps backend state; used by engines.
  explicit TransferHandle(std::shared_ptr<detail::TransferState> s) : state_(std::move(s)) {}

  /// True unless default-constructed.
  bool valid() const noexcept { return state_ != nullptr; }
  /// Non-blocking completion test; true for an empty handle.
  bool ready() const { return !state_ || state_->ready(); }
  /// Blocks until the transfer completes; rethrows its error.
  void wait() const {
    if (state_) state_->wait();
  }
  /// Bytes moved by the transfer (0 for an empty handle).
  std::size_t bytes() const noexcept { return state_ ? state_->bytes() : 0; }
  /// Backend state, for engines that chain on it.
  const std::shared_ptr<detail::TransferState>& state() const noexcept { return state_; }

 private:
  std::shared_ptr<detail::TransferState> state_;
};

}  // namespace tierflow::swap
