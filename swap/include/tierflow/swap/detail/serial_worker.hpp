// One thread running queued jobs in order: the emulated device's streams and
// the runtime's optimizer worker.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <memory>
#include <thread>

#include "tierflow/core/stall.hpp"

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
  void push(std::function<void()> job) { push(std::move(job), nullptr, 0); }
  /// Queues `job`, in flight as `kind` (a string literal, e.g. "CPU optimizer step") of `bytes` from now until
  /// it has run: drain() waits for it at most TIERFLOW_STALL_TIMEOUT from now (Note [Stall timeout]).
  void push(std::function<void()> job, const char* kind, std::uint64_t bytes, std::int64_t id = -1) {
    auto work = kind ? std::make_shared<PendingWork>(kind, bytes, id) : nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back({std::move(job), std::move(work)});
      ++pending_;
    }
    cv_.notify_all();
  }
  /// Blocks until the queue is empty; rethrows (and clears) the first job failure. A job pushed with a kind
  /// that has not run by TIERFLOW_STALL_TIMEOUT after it was queued raises stall_error naming it (the job goes
  /// on; Note [Stall timeout]).
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto start = std::chrono::steady_clock::now();
    while (pending_ != 0) {
      // The oldest job with a limit: the one running, else the first queued with a kind.
      std::shared_ptr<const PendingWork> oldest = running_;
      for (auto it = queue_.begin(); !oldest && it != queue_.end(); ++it) oldest = it->work;
      const auto deadline = oldest && stall_timeout() > 0 ? oldest->deadline()
                                                          : std::chrono::steady_clock::time_point::max();
      if (deadline == std::chrono::steady_clock::time_point::max()) {
        idle_cv_.wait(lock, [&] { return pending_ == 0 || changed_; });
      } else if (!idle_cv_.wait_until(lock, deadline, [&] { return pending_ == 0 || changed_; })) {
        lock.unlock();
        oldest->stalled(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      changed_ = false;
    }
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
        job = std::move(queue_.front().fn);
        running_ = std::move(queue_.front().work);
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
      std::shared_ptr<PendingWork> ran;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ran = std::move(running_);
        --pending_;
        changed_ = true;  // a waiter looks at the next oldest job's deadline
      }
      ran = nullptr;
      idle_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_, idle_cv_;
  struct Job {
    std::function<void()> fn;
    std::shared_ptr<PendingWork> work;  // listed while queued or running (null: no limit)
  };
  std::deque<Job> queue_;
  std::shared_ptr<PendingWork> running_;
  std::size_t pending_ = 0;
  bool changed_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace tierflow::swap::detail
