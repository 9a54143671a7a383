// bench/random.hpp — standard-normal float inputs for the attention benchmarks.
#pragma once

#include <cstddef>
#include <random>
#include <vector>

namespace bench_util {

/// n draws of N(0, 1) as float from mt19937(seed).
inline std::vector<float> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& e : v) e = nd(rng);
  return v;
}

}  // namespace bench_util
