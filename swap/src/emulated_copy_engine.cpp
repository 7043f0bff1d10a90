// The emulated device's copy engine: one worker thread per direction, each a
// FIFO, with the completion and chaining semantics of CUDA streams and events.
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "tierflow/allocator/small_alloc.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/detail/host_event.hpp"

namespace tierflow::swap {
namespace {

using EmulatedState = detail::HostEvent;

struct Task {
  void* dst;
  const void* src;
  std::size_t bytes;
  std::vector<TransferHandle> deps;
  std::shared_ptr<EmulatedState> state;
};

// One in-order "stream": a worker thread draining a FIFO.
class WorkerStream {
 public:
  WorkerStream() : thread_([this] { run(); }) {}
  ~WorkerStream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(Task t) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(t));
      ++pending_;
    }
    cv_.notify_all();
  }
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_cv_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  void run() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        for (const auto& d : t.deps) d.wait();
        if (t.bytes) std::memcpy(t.dst, t.src, t.bytes);
      } catch (...) {
        error = std::current_exception();
      }
      t.state->finish(error);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --pending_;
      }
      idle_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Task> queue_;
  std::size_t pending_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

class EmulatedCopyEngine final : public CopyEngine {
 public:
  allocator::DeviceKind device() const noexcept override { return allocator::DeviceKind::kEmulated; }

  TransferHandle copy(Direction dir, void* dst, const void* src, std::size_t bytes,
                      const std::vector<TransferHandle>& deps, void*) override {
    TIERFLOW_EXPECTS(bytes == 0 || (dst && src), "CopyEngine::copy: null pointer with nonzero size");
    // Handles are small and frequent: see Note [mimalloc shim].
    auto state = std::allocate_shared<EmulatedState>(allocator::SmallAllocator<EmulatedState>(), bytes);
    count(dir, bytes);
    stream(dir).push(Task{dst, src, bytes, deps, state});
    return TransferHandle(state);
  }

  void make_stream_wait(void*, const TransferHandle& h) override { h.wait(); }
  void* native_stream(Direction) const noexcept override { return nullptr; }
  void synchronize() override {
    d2h_.drain();
    h2d_.drain();
  }

 private:
  WorkerStream& stream(Direction dir) { return dir == Direction::kDeviceToHost ? d2h_ : h2d_; }
  WorkerStream d2h_, h2d_;
};

}  // namespace

std::unique_ptr<CopyEngine> make_emulated_copy_engine() {
  return std::make_unique<EmulatedCopyEngine>();
}

std::unique_ptr<CopyEngine> make_copy_engine(allocator::DeviceKind kind) {
  return kind == allocator::DeviceKind::kCuda ? make_cuda_copy_engine()
                                              : make_emulated_copy_engine();
}

}  // namespace tierflow::swap
