// bench/polling_pool.hpp — a thread pool whose workers poll for a task for a while after their last
// one instead of going to sleep, as a runtime's own pool may keep its threads between decode steps
// (ggml's threadpool polls between graph computations).
//
// Why: a 2-thread decode step hands a pool thread its items at the start of every call, and Eigen's
// ThreadPool lets an idle worker spin only briefly (2500 steal attempts on 2 threads) before it sleeps;
// on the 2-vCPU VMs a sleeping worker starts a task 12-77 us after Schedule (docs/decode-measurements.md,
// Zen 5). BM_decode_layers runs the same loop with both pools, so that what the split-KV step
// costs and what the pool's wake costs are told apart.
//
// The calling thread counts as one of the pool's threads: `threads - 1` workers, NumThreads() =
// `threads`. The decode strategy runs its items on the caller and on NumThreads() - 1 pool threads
// (workers::pool_and_caller), so every worker has a core and none spins beside the caller.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <unsupported/Eigen/CXX11/ThreadPool>

#include "posenc/detail/platform.hpp"

namespace bench_util {

class polling_pool final : public Eigen::ThreadPoolInterface {
 public:
  /// `poll`: how long a worker keeps polling after its last task before it sleeps.
  explicit polling_pool(int threads, std::chrono::microseconds poll = std::chrono::microseconds(500))
      : poll_(poll) {
    for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  polling_pool(const polling_pool&) = delete;
  polling_pool& operator=(const polling_pool&) = delete;
  ~polling_pool() override {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void Schedule(std::function<void()> fn) override {
    bool sleeping = false;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(fn));
      queued_.store(tasks_.size(), std::memory_order_release);
      sleeping = sleepers_ > 0;
    }
    if (sleeping) wake_.notify_one();
  }
  [[nodiscard]] int NumThreads() const override { return static_cast<int>(workers_.size()) + 1; }
  [[nodiscard]] int CurrentThreadId() const override { return owner() == this ? index() : -1; }

 private:
  static const polling_pool*& owner() {
    thread_local const polling_pool* p = nullptr;
    return p;
  }
  static int& index() {
    thread_local int i = -1;
    return i;
  }

  /// The next task, or an empty function when none is queued.
  std::function<void()> take() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return pop_locked();
  }
  /// The same with mutex_ held by the caller.
  std::function<void()> pop_locked() {
    if (tasks_.empty()) return {};
    std::function<void()> fn = std::move(tasks_.front());
    tasks_.pop_front();
    queued_.store(tasks_.size(), std::memory_order_release);
    return fn;
  }

  void work(int i) {
    owner() = this;
    index() = i;
    for (;;) {
      // poll: the queue's size is read without the lock until a task shows or the time is up
      const auto until = std::chrono::steady_clock::now() + poll_;
      std::function<void()> fn;
      for (unsigned spin = 0; !fn; ++spin) {
        if (queued_.load(std::memory_order_acquire) > 0) fn = take();
        if (fn) break;
        if (spin % 64 == 0 && std::chrono::steady_clock::now() > until) break;
        posenc::detail::cpu_relax();
      }
      if (!fn) {
        std::unique_lock<std::mutex> lock(mutex_);
        ++sleepers_;
        wake_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        --sleepers_;
        if (stop_ && tasks_.empty()) return;
        fn = pop_locked();
      }
      fn();
    }
  }

  std::chrono::microseconds poll_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<std::size_t> queued_{0};
  int sleepers_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace bench_util
