// posenc/detail/prefetch.hpp — software prefetch of strided rows.
//
// The caller's q/k/v/out rows are 2-4 KiB apart in BSHD (a new page every row), where the hardware
// prefetchers do not follow: the kernel and RoPE's transform fetch the rows they will read next
// (docs/performance.md, docs/rope.md for the measurements).
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>  // sysconf
#endif

#include <Eigen/Core>

#include "posenc/detail/platform.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

/// The cache line the prefetches count in, in bytes, and in elements of E.
inline constexpr index_t cache_line_bytes = 64;
template <class E>
inline constexpr index_t line_elements = cache_line_bytes / static_cast<index_t>(sizeof(E));

/// One prefetch instruction per 64-byte line of [p, p + bytes); Write and Locality as
/// detail::prefetch takes them (compile-time constants).
template <int Write, int Locality>
POSENC_ALWAYS_INLINE void prefetch_lines(const void* p, index_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (index_t o = 0; o < bytes; o += cache_line_bytes) prefetch<Write, Locality>(c + o);
}

/// Prefetches [p, p + bytes) into L2 (for_write: with intent to write, so that the later stores do
/// not wait for the line).
POSENC_ALWAYS_INLINE void prefetch_bytes(const void* p, index_t bytes, bool for_write) {
  if (for_write) prefetch_lines<1, 2>(p, bytes);
  else prefetch_lines<0, 2>(p, bytes);
}

/// Prefetches [p, p + bytes) into L1 for reading, for data consumed within a few rows of work (RoPE's
/// transform, 4 rows ahead): into L2 only, the lines still had to come to L1 at the load
/// (docs/performance.md › Prefetch).
POSENC_ALWAYS_INLINE void prefetch_bytes_l1(const void* p, index_t bytes) {
  prefetch_lines<0, 3>(p, bytes);
}

/// The Locality values of prefetch for the cache level the lines go to.
inline constexpr int to_l2 = 2, to_l1 = 3;

/// Prefetches the element `elements` past p (negative: before it; rows x stride for a strided run read
/// ahead of time), into L2 (Locality to_l2) or L1 (to_l1), by address arithmetic (modulo 2^64): where
/// it names no element (a prefetch never faults) it forms no out-of-range pointer.
template <int Locality = to_l2, class E>
POSENC_ALWAYS_INLINE void prefetch_past(const E* p, index_t elements) {
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(elements * sizeof(E));
  prefetch<0, Locality>(reinterpret_cast<const void*>(at));
}

/// The L1 data cache of the core, in bytes, as the C library reports it (glibc reads it from CPUID);
/// 0 where it does not.
inline index_t l1_data_bytes() noexcept {
#if defined(_SC_LEVEL1_DCACHE_SIZE)
  static const index_t bytes = std::max<index_t>(0, static_cast<index_t>(sysconf(_SC_LEVEL1_DCACHE_SIZE)));
  return bytes;
#else
  return 0;
#endif
}

/// Prefetches every row of a strided row-major matrix map.
template <class M>
POSENC_ALWAYS_INLINE void prefetch_rows(const M& m, bool for_write) {
  const index_t bytes = m.cols() * static_cast<index_t>(sizeof(typename M::Scalar));
  for (index_t r = 0; r < m.rows(); ++r) prefetch_bytes(m.data() + r * m.outerStride(), bytes, for_write);
}

}  // namespace posenc::detail
