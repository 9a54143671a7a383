// posenc/detail/position_scan.hpp — one pass over a run of int64 positions: their range, whether
// they ascend, whether they are consecutive. The masks scan every key of a call with these before
// any thread starts, and the relative encodings scan each tile's rows and keys, so each is a
// branch-free loop the compiler vectorizes (std::minmax_element compares one element at a time:
// clang 14 and g++ 12 at -O3 -march=native emit no vector min / max for it, 20-22 for position_range).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "posenc/tensor.hpp"

namespace posenc::detail {

/// The least and greatest of the n positions p into lo and hi (left as they are when n = 0).
inline void position_range(const std::int64_t* p, index_t n, std::int64_t& lo, std::int64_t& hi) {
  if (n == 0) return;
  std::int64_t a = std::numeric_limits<std::int64_t>::max(), z = std::numeric_limits<std::int64_t>::min();
  for (index_t j = 0; j < n; ++j) {
    a = std::min(a, p[j]);
    z = std::max(z, p[j]);
  }
  lo = a;
  hi = z;
}

/// Whether the n positions p never decrease.
[[nodiscard]] inline bool ascending_positions(const std::int64_t* p, index_t n) {
  bool up = true;
  for (index_t j = 1; j < n; ++j) up &= p[j - 1] <= p[j];
  return up;
}

/// Whether the n positions are p[0], p[0] + 1, ... (the usual key block: no packing, no padding
/// holes); never across the int64 maximum.
[[nodiscard]] inline bool consecutive_positions(const std::int64_t* p, index_t n) {
  bool ok = true;
  for (index_t j = 1; j < n; ++j) ok &= p[j - 1] != std::numeric_limits<std::int64_t>::max() && p[j] == p[j - 1] + 1;
  return ok;
}

}  // namespace posenc::detail
