// Something that finishes later, seen from below the layer that started it:
// a transfer's event, as the allocator sees it when it defers reuse.
#pragma once

namespace tierflow {

/// The completion of asynchronous work (a CUDA event, an emulated copy, an
/// NVMe request). Implemented by swap's transfer states.
class Completion {
 public:
  virtual ~Completion() = default;
  /// True once the work has finished (successfully or not).
  virtual bool ready() const = 0;
  /// Blocks until finished; rethrows the work's error.
  virtual void wait() const = 0;
};

}  // namespace tierflow
