// posenc/detail/prefetch.hpp — software prefetch of strided rows, and a copy that bypasses the cache.
//
// The caller's q/k/v/out rows are 2-4 KiB apart in BSHD (a new page every row), where the hardware
// prefetchers do not follow: the kernel and RoPE's transform fetch the rows they will read next
// (docs/performance.md, docs/rope.md for the measurements).
#pragma once

#include <cstdint>
#include <cstring>

#include <Eigen/Core>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "posenc/detail/platform.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

/// One prefetch instruction per 64-byte line of [p, p + bytes); Write and Locality as
/// detail::prefetch takes them (compile-time constants).
template <int Write, int Locality>
inline void prefetch_lines(const void* p, index_t bytes) {
  constexpr index_t line = 64;
  const char* c = static_cast<const char*>(p);
  for (index_t o = 0; o < bytes; o += line) prefetch<Write, Locality>(c + o);
}

/// Prefetches [p, p + bytes) into L2 (for_write: with intent to write, so that the later stores do
/// not wait for the line).
inline void prefetch_bytes(const void* p, index_t bytes, bool for_write) {
  if (for_write) prefetch_lines<1, 2>(p, bytes);
  else prefetch_lines<0, 2>(p, bytes);
}

/// Prefetches [p, p + bytes) into L1 for reading, for data consumed within a few rows of work (RoPE's
/// transform, 4 rows ahead): into L2 only, the lines still had to come to L1 at the load. Measured
/// with the pair driver (RoPE over no encoding in attention, L = 1024, causal, 1 thread, three runs
/// each, alternating): input and table rows into L2 3.5 / 3.6 / 2.9 %, table rows into L1 3.1 / 2.6 /
/// 3.2 %, both into L1 3.3 / 2.2 / 2.3 %.
inline void prefetch_bytes_l1(const void* p, index_t bytes) { prefetch_lines<0, 3>(p, bytes); }

/// Prefetches every row of a strided row-major matrix map.
template <class M>
void prefetch_rows(const M& m, bool for_write) {
  const index_t bytes = m.cols() * static_cast<index_t>(sizeof(typename M::Scalar));
  for (index_t r = 0; r < m.rows(); ++r) prefetch_bytes(m.data() + r * m.outerStride(), bytes, for_write);
}

/// Copies `bytes` from src to dst with non-temporal stores where the target has them (and both are
/// aligned to the vector width, else a plain copy): the copy goes to memory without displacing the
/// writer's cache.
inline void stream_copy(void* dst, const void* src, index_t bytes) {
  index_t done = 0;
  [[maybe_unused]] const auto aligned = [&](std::uintptr_t a) {
    return ((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src)) % a) == 0;
  };
#if defined(__AVX512F__)
  if (aligned(64)) {
    for (; done + 64 <= bytes; done += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(static_cast<char*>(dst) + done),
                          _mm512_load_si512(static_cast<const char*>(src) + done));
    _mm_sfence();
  }
#elif defined(__SSE2__)
  if (aligned(16)) {
    for (; done + 16 <= bytes; done += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<char*>(dst) + done),
                       _mm_load_si128(reinterpret_cast<const __m128i*>(static_cast<const char*>(src) + done)));
    _mm_sfence();
  }
#endif
  std::memcpy(static_cast<char*>(dst) + done, static_cast<const char*>(src) + done, static_cast<std::size_t>(bytes - done));
}

}  // namespace posenc::detail
