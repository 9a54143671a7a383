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

#include <unsupported/Eigen/CXX11/ThreadPool>

#include "posenc/tensor.hpp"

namespace posenc::detail {

/// Calls body(item, scratch) for item = 0 .. items-1. Each worker makes its own scratch once with
/// make_scratch() and pulls items from a shared counter (dynamic scheduling: items of unequal cost,
/// e.g. the causal triangle, balance without a static partition). Without a pool, with a
/// one-thread pool, or when called from one of the pool's own threads (a nested call would wait
/// on workers that can never run), everything runs on the calling thread. `body` must not throw.
template <class MakeScratch, class Body>
void for_each_item(Eigen::ThreadPoolInterface* pool, index items, MakeScratch make_scratch, Body body) {
  if (items <= 0) return;
  const index threads = pool != nullptr ? static_cast<index>(pool->NumThreads()) : 1;
  if (pool == nullptr || threads <= 1 || items == 1 || pool->CurrentThreadId() != -1) {
    auto scratch = make_scratch();
    for (index i = 0; i < items; ++i) body(i, scratch);
    return;
  }
  const index workers = std::min(threads, items);
  std::atomic<index> next{0};
  Eigen::Barrier done(static_cast<unsigned int>(workers));
  for (index w = 0; w < workers; ++w) {
    pool->Schedule([&] {
      auto scratch = make_scratch();
      for (index i = next.fetch_add(1, std::memory_order_relaxed); i < items;
           i = next.fetch_add(1, std::memory_order_relaxed))
        body(i, scratch);
      done.Notify();
    });
  }
  done.Wait();
}

}  // namespace posenc::detail
