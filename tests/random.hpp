// tests/random.hpp — standard-normal test inputs, shared by the test files.
#pragma once

#include <cstddef>
#include <random>
#include <vector>

namespace test_util {

/// n draws of scale * N(0, 1) from mt19937(seed): the same values on every platform's libstdc++.
inline std::vector<double> randn(std::size_t n, unsigned seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd;
  std::vector<double> v(n);
  for (auto& e : v) e = scale * nd(rng);
  return v;
}

}  // namespace test_util
