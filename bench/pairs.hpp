// bench/pairs.hpp — the ratio of two calls measured in back-to-back pairs.
//
// This VM's speed drifts by 20-40 % within minutes (it is shared), so two benchmark rows run a
// minute apart can differ by more than the effect being measured. Timing the two calls back to back,
// in alternating order, and taking the median of the per-pair ratios compares them on the same
// machine state: a null A/B (the same call on both sides) gave 0.999 and 0.998 (docs/rope.md).
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

namespace bench_util {

/// What a paired run measured.
struct pair_result {
  double ratio = 0;      ///< median of the per-pair ratios time(b) / time(a)
  double seconds_a = 0;  ///< total time of the a() calls
  double seconds_b = 0;  ///< total time of the b() calls
  std::int64_t pairs = 0;
};

/// Which time a paired run reports as the iteration's (the benchmark is registered with UseManualTime).
enum class pair_time { sum, b_only };

/// Runs a() and b() once per iteration of `state`, alternating which goes first; reports their summed
/// time (or b's alone) as the iteration's and returns the median ratio and the totals.
template <class A, class B>
pair_result run_pairs(benchmark::State& state, A&& a, B&& b, pair_time report = pair_time::sum) {
  std::vector<double> ratios;
  pair_result r;
  bool a_first = true;
  for (auto _ : state) {
    double t_a = 0, t_b = 0;
    for (const bool run_a : {a_first, !a_first}) {
      const auto t0 = std::chrono::steady_clock::now();
      if (run_a) a();
      else b();
      (run_a ? t_a : t_b) = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    state.SetIterationTime(report == pair_time::sum ? t_a + t_b : t_b);
    ratios.push_back(t_b / t_a);
    r.seconds_a += t_a;
    r.seconds_b += t_b;
    a_first = !a_first;
  }
  r.pairs = static_cast<std::int64_t>(ratios.size());
  if (ratios.empty()) return r;
  std::nth_element(ratios.begin(), ratios.begin() + static_cast<std::ptrdiff_t>(ratios.size() / 2), ratios.end());
  r.ratio = ratios[ratios.size() / 2];
  return r;
}

/// run_pairs reporting the summed time; returns the median of time(b) / time(a).
template <class A, class B>
double median_pair_ratio(benchmark::State& state, A&& a, B&& b) {
  return run_pairs(state, std::forward<A>(a), std::forward<B>(b)).ratio;
}

}  // namespace bench_util
