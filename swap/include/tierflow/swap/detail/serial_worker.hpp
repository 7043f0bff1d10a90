// One thread running queued jobs in order: the emulated device's streams and
// the runtime's optimizer worker.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace tierflow::swap::detail {

/// A FIFO drained by its own thread. A job that throws does not stop the
/// worker; its exception is kept for drain() to rethrow (the first one only).
class SerialWorker {
 public:
  SerialWorker() : thread_([this] { run(); }) {}
  /// Runs every queued job, then joins.
  ~SerialWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  /// Queues `job`.
  void push(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(job));
      ++pending_;
    }
    cv_.notify_all();
  }
  /// Blocks until the queue is empty; rethrows (and clears) the first job failure.
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_cv_.wait(lock, [&] { return pending_ == 0; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        job();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      // Destroy the job (and what it captured) before reporting it done: a
      // waiter may hold a lock, such as Python's GIL, that the destruction needs.
      job = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --pending_;
      }
      idle_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;
  std::size_t pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace tierflow::swap::detail
