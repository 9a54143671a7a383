// posenc/detail/prefetch.hpp — software prefetch of strided rows.
//
// The caller's q/k/v/out rows are 2-4 KiB apart in BSHD (a new page every row), where the hardware
// prefetchers do not follow: the kernel and RoPE's transform fetch the rows they will read next
// (docs/performance.md, docs/rope.md for the measurements).
#pragma once

#include <Eigen/Core>

#include "posenc/tensor.hpp"

namespace posenc::detail {

/// Prefetches [p, p + bytes) into L2, one instruction per 64-byte line (for_write: with intent to
/// write, so that the later stores do not wait for the line).
inline void prefetch_bytes(const void* p, index bytes, bool for_write) {
  constexpr index line = 64;
  const char* c = static_cast<const char*>(p);
  if (for_write)
    for (index o = 0; o < bytes; o += line) __builtin_prefetch(c + o, 1, 2);
  else
    for (index o = 0; o < bytes; o += line) __builtin_prefetch(c + o, 0, 2);
}

/// Prefetches every row of a strided row-major matrix map.
template <class M>
void prefetch_rows(const M& m, bool for_write) {
  const index bytes = m.cols() * static_cast<index>(sizeof(typename M::Scalar));
  for (index r = 0; r < m.rows(); ++r) prefetch_bytes(m.data() + r * m.outerStride(), bytes, for_write);
}

}  // namespace posenc::detail
