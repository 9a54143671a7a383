// posenc/detail/thread.hpp — run independent work items on the caller's thread pool.
//
// Threads come from an Eigen::ThreadPoolInterface the caller owns (options.pool), not from OpenMP:
// a header-only library cannot impose -fopenmp on its users, and Eigen's pool is already a
// dependency (unsupported/Eigen/CXX11/ThreadPool). Each item is computed entirely by one thread,
// so the result of an item does not depend on how many threads there are or which one ran it:
// outputs are bitwise identical for 1, 2 or 8 threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include <unsupported/Eigen/CXX11/ThreadPool>

#include "posenc/detail/platform.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

/// The first exception of several threads, kept for the calling thread to rethrow.
class first_error {
 public:
  void record(std::exception_ptr e) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::move(e);
  }
  /// Call after every recording thread has finished (the barrier orders the accesses).
  void rethrow_if_any() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mutex_;
  std::exception_ptr error_;
};

/// The calling thread's scratch of type S, kept from one call to the next. Per-call scratch came
/// from fresh pages every call (glibc returns large blocks to the kernel on free), and their first
/// touch faulted: measured 2.4 % of an attention call at L = 2048 (perf, clear_page_erms under
/// memset of the score tile). A thread keeps its buffers, sized by the largest tile it met, until it
/// exits. A nested use on the same thread (a hook that runs a kernel itself) gets a scratch of its own.
template <class S>
class thread_scratch {
 public:
  thread_scratch() {
    cell& c = slot();
    if (c.in_use) {
      own_ = std::make_unique<S>();
      use_ = own_.get();
    } else {
      c.in_use = true;
      use_ = &c.scratch;
    }
  }
  ~thread_scratch() {
    if (!own_) slot().in_use = false;
  }
  thread_scratch(const thread_scratch&) = delete;
  thread_scratch& operator=(const thread_scratch&) = delete;
  [[nodiscard]] S& get() { return *use_; }

 private:
  struct cell {
    S scratch;
    bool in_use = false;
  };
  static cell& slot() {
    thread_local cell c;
    return c;
  }
  std::unique_ptr<S> own_;
  S* use_ = nullptr;
};

/// Who runs the items of a call given a pool: the pool's threads while the calling thread waits, or the
/// calling thread as one of them (with up to n - 1 of the pool's n). The caller starts at once instead
/// of waiting for a pool thread to wake, which pays for short calls; for long ones the pool thread
/// left idle costs more. Measured on a 2-vCPU Zen 5 VM, 2-thread pool, time with the caller / without:
/// 4 items of 10 us 26 / 51-57 us back to back, 46 / 83 us 20 us apart, 86 / 126-130 us 200 us apart
/// (items of 100 us: 233 / 215, 226 / 271, 288 / 289 us); decode steps 0.89-1.02x (paired calls, GQA
/// 32/8, Lk = 1024 to 32768); prefill 1.02x (L = 1024) and 1.05x (L = 2048), so only decode uses it.
enum class workers { pool, pool_and_caller };

/// How long a calling thread that ran items itself (workers::pool_and_caller) polls for the pool's
/// threads to finish theirs before it sleeps in the barrier. A pool thread that ends last wakes a
/// sleeping caller only when the OS runs it again, tens of microseconds later on a VM, on every call:
/// a host's decode loop of 2-thread steps (BM_decode_layers, f32, 1 row, GQA 32/8, d = 128, Lk = 4096,
/// 2-vCPU Zen 5 VM; two_of_pair, the loop's time against two independent 1-thread loops making the
/// same calls at once) ran at 0.89-0.94 of that bound with the caller sleeping (12 runs), 0.93-0.97
/// with it polling (six runs); in three alternating pairs of runs two_over_one went from 1.49-1.63
/// to 1.65-1.75. Not yielding measured 0.96-0.99 (five runs; in turns with this 0.97 / 0.97, 0.98 /
/// 0.94), within the spread, so the yield that keeps an oversubscribed pool going stays. The wait it
/// covers is the pool thread's later start and the items' unequal times (0.2 ms apart at most at
/// Lk = 32768); past it the caller sleeps, so that it holds its core for at most this long.
inline constexpr std::chrono::microseconds caller_poll_time{500};

/// Returns once finished reaches count or caller_poll_time has passed, whichever is first. Between
/// clock reads the thread yields, so that a pool with more threads than cores still runs its workers.
inline void poll_until(const std::atomic<index_t>& finished, index_t count) {
  const auto until = std::chrono::steady_clock::now() + caller_poll_time;
  for (unsigned spin = 1; finished.load(std::memory_order_acquire) < count; ++spin) {
    if (spin % 64 == 0) {
      if (std::chrono::steady_clock::now() > until) return;
      std::this_thread::yield();
    }
    cpu_relax();
  }
}

/// Calls body(item, scratch) for item = 0 .. items-1. Each worker takes its thread's scratch
/// (thread_scratch<S>), lets prepare(scratch) size it for this call, and pulls items from a shared
/// counter (dynamic scheduling: items of unequal cost, e.g. the causal triangle, balance without a
/// static partition). Without a pool, with a one-thread pool, or when called from one of the pool's
/// own threads (a nested call would wait on workers that can never run), everything runs on the
/// calling thread; otherwise `who` says which threads work (at most as many as the pool has). Results
/// must not depend on what an earlier call left in the scratch.
///
/// An exception thrown by prepare or body reaches the caller, on the caller's thread, with its type
/// and message intact: a worker that catches one records it (the first one wins), stops the others
/// from taking new items, and the exception is rethrown after every worker has finished (a pool
/// thread that let it escape would end the program in std::terminate).
template <class S, class Prepare, class Body>
void for_each_item(Eigen::ThreadPoolInterface* pool, index_t items, Prepare prepare, Body body,
                   workers who = workers::pool) {
  if (items <= 0) return;
  const index_t threads = pool != nullptr ? static_cast<index_t>(pool->NumThreads()) : 1;
  if (pool == nullptr || threads <= 1 || items == 1 || pool->CurrentThreadId() != -1) {
    thread_scratch<S> held;
    prepare(held.get());
    for (index_t i = 0; i < items; ++i) body(i, held.get());
    return;
  }
  const index_t count = std::min(threads, items);
  std::atomic<index_t> next{0};
  std::atomic<index_t> finished{0};  // workers done, for a caller that polls (poll_until)
  first_error error;
  Eigen::Barrier done(static_cast<unsigned int>(count));
  const auto work = [&] {
    try {
      thread_scratch<S> held;
      prepare(held.get());
      for (index_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
           i = next.fetch_add(1, std::memory_order_relaxed))
        body(i, held.get());
    } catch (...) {
      error.record(std::current_exception());
      next.store(items, std::memory_order_relaxed);  // no new items for anyone
    }
    finished.fetch_add(1, std::memory_order_release);
    done.Notify();
  };
  const bool caller = who == workers::pool_and_caller;
  for (index_t w = caller ? 1 : 0; w < count; ++w) pool->Schedule(work);
  if (caller) {
    work();
    poll_until(finished, count);
  }
  done.Wait();
  error.rethrow_if_any();
}

}  // namespace posenc::detail
