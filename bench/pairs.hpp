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
#include <vector>

namespace bench_util {

/// Runs a() and b() once per iteration of `state`, alternating which goes first; reports their summed
/// time as the iteration's (register the benchmark with UseManualTime) and returns the median of the
/// per-pair ratios time(b) / time(a).
template <class A, class B>
double median_pair_ratio(benchmark::State& state, A&& a, B&& b) {
  std::vector<double> ratios;
  bool a_first = true;
  for (auto _ : state) {
    double t_a = 0, t_b = 0;
    for (const bool run_a : {a_first, !a_first}) {
      const auto t0 = std::chrono::steady_clock::now();
      if (run_a) a();
      else b();
      (run_a ? t_a : t_b) = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    state.SetIterationTime(t_a + t_b);
    ratios.push_back(t_b / t_a);
    a_first = !a_first;
  }
  if (ratios.empty()) return 0.0;
  std::nth_element(ratios.begin(), ratios.begin() + static_cast<std::ptrdiff_t>(ratios.size() / 2), ratios.end());
  return ratios[ratios.size() / 2];
}

}  // namespace bench_util
