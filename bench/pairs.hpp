// bench/pairs.hpp — the ratio of two calls measured in back-to-back pairs, and several calls in turns.
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
#include <functional>
#include <utility>
#include <vector>

namespace bench_util {

/// The median of x (0 when empty).
inline double median(std::vector<double> x) {
  if (x.empty()) return 0;
  std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2), x.end());
  return x[x.size() / 2];
}

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
  r.ratio = median(std::move(ratios));
  return r;
}

/// run_pairs reporting the summed time; returns the median of time(b) / time(a).
template <class A, class B>
double median_pair_ratio(benchmark::State& state, A&& a, B&& b) {
  return run_pairs(state, std::forward<A>(a), std::forward<B>(b)).ratio;
}

/// Runs each of `runs` (each returning its seconds) once per iteration of `state`, in turns, the
/// first to go rotating, so that they see the same machine state; the first run's time is reported as
/// the iteration's. Returns each iteration's seconds, run by run. The runs are called once each before
/// (untimed: the first touch of their arrays).
inline std::vector<std::vector<double>> run_turns(benchmark::State& state,
                                                  const std::vector<std::function<double()>>& runs) {
  for (const auto& run : runs) run();
  const std::size_t n = runs.size();
  std::vector<std::vector<double>> seconds;
  std::size_t first = 0;
  for (auto _ : state) {
    std::vector<double> sec(n);
    for (std::size_t i = 0; i < n; ++i) sec[(first + i) % n] = runs[(first + i) % n]();
    first = (first + 1) % n;
    state.SetIterationTime(sec[0]);
    seconds.push_back(std::move(sec));
  }
  return seconds;
}

/// The median over the iterations of f(seconds of that iteration's runs) (run_turns).
template <class F>
double median_over(const std::vector<std::vector<double>>& seconds, F&& f) {
  std::vector<double> x;
  for (const auto& sec : seconds) x.push_back(f(sec));
  return median(std::move(x));
}

}  // namespace bench_util
