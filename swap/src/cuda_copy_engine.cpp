// The CUDA copy engine: one non-blocking stream per direction; each copy
// records an event that its handle waits on or that later copies chain on.
#include "tierflow/core/error.hpp"
#include "tierflow/swap/copy_engine.hpp"

#ifdef TIERFLOW_WITH_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "tierflow/allocator/detail/cuda_check.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/core/stall.hpp"
#endif

namespace tierflow::swap {

#ifdef TIERFLOW_WITH_CUDA
namespace {

class CudaState final : public detail::TransferState {
 public:
  CudaState(cudaEvent_t ev, std::size_t bytes, const char* kind) : event_(ev), bytes_(bytes), work_(kind, bytes) {
    work_.seen_only_when_polled();  // its end is seen when queried: no false stall of a copy done long ago
  }
  ~CudaState() override { TIERFLOW_CUDA_ASSERT_OK(cudaEventDestroy(event_)); }
  bool ready() const override {
    cudaError_t st = cudaEventQuery(event_);
    if (st == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    TIERFLOW_CUDA_TRY(st);
    work_.done();  // no longer in flight (Note [Stall timeout])
    return true;
  }
  // Note [Stall timeout]: an event cannot be waited on with a limit, so past a first stretch of spinning (as
  // cudaEventSynchronize spins) it is polled, with naps growing to 200 us, until the copy's deadline (counted
  // from when it was queued). Not measured on a GPU.
  void wait() const override {
    if (!(stall_timeout() > 0)) {
      TIERFLOW_CUDA_TRY(cudaEventSynchronize(event_));
      work_.done();
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = work_.deadline();
    auto oldest = oldest_deadline();  // a stall raises at the oldest work's limit (Note [Stall timeout])
    auto nap = std::chrono::microseconds(0);
    for (;;) {
      if (ready()) return;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) work_.stalled(std::chrono::duration<double>(now - start).count());
      if (now >= oldest) {
        raise_if_stalled();
        oldest = oldest_deadline();
      }
      if (now - start < std::chrono::milliseconds(2)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(std::chrono::microseconds(200), nap * 2 + std::chrono::microseconds(10));
      }
    }
  }
  std::size_t bytes() const noexcept override { return bytes_; }
  cudaEvent_t event() const noexcept { return event_; }

 private:
  cudaEvent_t event_;
  std::size_t bytes_;
  // Listed while in flight (Note [Stall timeout]): from the copy's queueing until it is seen complete. The
  // kind's text says "on a CUDA stream" through the engine's kinds below.
  mutable PendingWork work_;
};

class CudaCopyEngine final : public CopyEngine {
 public:
  CudaCopyEngine() {
    TIERFLOW_CUDA_TRY(cudaGetDevice(&device_));
    TIERFLOW_CUDA_TRY(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
    TIERFLOW_CUDA_TRY(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
  }
  ~CudaCopyEngine() override {
    TIERFLOW_CUDA_ASSERT_OK(cudaStreamSynchronize(d2h_));
    TIERFLOW_CUDA_ASSERT_OK(cudaStreamSynchronize(h2d_));
    TIERFLOW_CUDA_ASSERT_OK(cudaStreamDestroy(d2h_));
    TIERFLOW_CUDA_ASSERT_OK(cudaStreamDestroy(h2d_));
  }

  allocator::DeviceKind device() const noexcept override { return allocator::DeviceKind::kCuda; }

  TransferHandle copy(Direction dir, void* dst, const void* src, std::size_t bytes,
                      const std::vector<TransferHandle>& deps, StreamRef after) override {
    TIERFLOW_EXPECTS(bytes == 0 || (dst && src), "CopyEngine::copy: null pointer with nonzero size");
    TIERFLOW_EXPECTS(!after.named() || after.is_cuda(),
                     "CudaCopyEngine::copy: `after` names an emulated stream; pass compute_stream(torch's stream)");
    cudaStream_t s = dir == Direction::kDeviceToHost ? d2h_ : h2d_;
    if (after.named()) {
      // Rule 1 of Note [Copy ordering]. The handle nullptr is PyTorch's
      // default stream: an event recorded on it orders this copy after every
      // kernel queued there so far, exactly like any other stream.
      cudaEvent_t produced;
      TIERFLOW_CUDA_TRY(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming));
      TIERFLOW_CUDA_TRY(cudaEventRecord(produced, static_cast<cudaStream_t>(after.native())));
      TIERFLOW_CUDA_TRY(cudaStreamWaitEvent(s, produced, 0));
      TIERFLOW_CUDA_TRY(cudaEventDestroy(produced));  // destruction is deferred by the driver
    }
    for (const auto& d : deps) wait_on(s, d);
    if (bytes) TIERFLOW_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    cudaEvent_t done;
    TIERFLOW_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    TIERFLOW_CUDA_TRY(cudaEventRecord(done, s));
    count(dir, bytes);
    return TransferHandle(std::make_shared<CudaState>(
        done, bytes, dir == Direction::kDeviceToHost ? "device -> host copy on a CUDA stream" : "host -> device copy on a CUDA stream"));
  }

  void make_stream_wait(StreamRef consumer, const TransferHandle& h) override {
    if (!consumer.is_cuda()) {
      h.wait();  // no CUDA stream to order: the caller itself waits
      return;
    }
    wait_on(static_cast<cudaStream_t>(consumer.native()), h);
  }

  StreamRef compute_stream(void* cuda_native) const noexcept override { return StreamRef::cuda(cuda_native); }

  void* native_stream(Direction dir) const noexcept override {
    return dir == Direction::kDeviceToHost ? d2h_ : h2d_;
  }

  void synchronize() override {
    TIERFLOW_CUDA_TRY(cudaStreamSynchronize(d2h_));
    TIERFLOW_CUDA_TRY(cudaStreamSynchronize(h2d_));
  }

 private:
  static void wait_on(cudaStream_t s, const TransferHandle& h) {
    if (!h.valid()) return;
    auto* cs = dynamic_cast<const CudaState*>(h.state().get());
    if (cs) {
      TIERFLOW_CUDA_TRY(cudaStreamWaitEvent(s, cs->event(), 0));
    } else {
      h.wait();  // a handle of another backend: wait on the host
    }
  }

  int device_ = 0;
  cudaStream_t d2h_ = nullptr;
  cudaStream_t h2d_ = nullptr;
};

}  // namespace

std::unique_ptr<CopyEngine> make_cuda_copy_engine() {
  TIERFLOW_EXPECTS(allocator::cuda_available(),
                   "CUDA copy engine requested but no CUDA GPU is available");
  return std::make_unique<CudaCopyEngine>();
}

#else

std::unique_ptr<CopyEngine> make_cuda_copy_engine() {
  throw logic_error("CUDA copy engine requested but tierflow was built without CUDA "
                    "(rebuild with the CUDA toolkit and TIERFLOW_WITH_CUDA=ON or AUTO)");
}

#endif

}  // namespace tierflow::swap
