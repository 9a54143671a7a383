// posenc/detail/platform.hpp — the compiler builtins posenc uses, each behind one name with a portable
// fallback, so the rest of the library is standard C++20.
//
// Supported and tested: g++ >= 12 and clang++ >= 14 (with and without -march=native). Other
// compilers (MSVC among them) get the portable fallbacks below: the same results, possibly slower.
//
//   POSENC_HAS_BUILTIN(x)          __has_builtin(x), 0 where the preprocessor lacks __has_builtin
//   POSENC_VECTOR_EXTENSIONS       defined when GCC/Clang vector types and __builtin_shufflevector exist
//                                  (detail/rope_kernels.hpp's interleaved rotation)
//   POSENC_ALWAYS_INLINE           inline, and inlined at every call (where the compiler has the attribute)
//   detail::prefetch<W, L>(p)      a software prefetch hint (no-op where there is none)
//   detail::add_overflow(a, b, r)  r = a + b for signed integers; true (and r unspecified) on overflow
//   detail::sub_overflow(a, b, r)  r = a - b, likewise
//   detail::cpu_relax()            a spin-wait hint: pause on x86, yield on AArch64, nothing elsewhere
//
// POSENC_PORTABLE_BUILTINS forces every fallback (for testing them on a compiler that has the builtins).
#pragma once

#include <limits>
#include <type_traits>

#if defined(_MSC_VER) && !defined(__clang__) && (defined(_M_X64) || defined(_M_IX86))
#include <emmintrin.h>  // _mm_pause
#include <xmmintrin.h>  // _mm_prefetch
#endif

#ifdef __has_builtin
#define POSENC_HAS_BUILTIN(x) __has_builtin(x)
#else
#define POSENC_HAS_BUILTIN(x) 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define POSENC_ALWAYS_INLINE __attribute__((always_inline)) inline
#elif defined(_MSC_VER)
#define POSENC_ALWAYS_INLINE __forceinline
#else
#define POSENC_ALWAYS_INLINE inline
#endif

#if !defined(POSENC_PORTABLE_BUILTINS) && POSENC_HAS_BUILTIN(__builtin_shufflevector)
#define POSENC_VECTOR_EXTENSIONS 1
#endif

namespace posenc::detail {

/// Prefetch hint for the cache line holding p. Write (0 read, 1 write) and Locality (0 none .. 3 keep
/// in every level) as __builtin_prefetch takes them; compile-time constants because the builtin
/// requires them. Always inlined, and so must be every function that only wraps it: g++ 12 marks a
/// function whose body is only the builtin as const (the builtin touches no memory as its optimizer
/// sees it; -fdump-tree-local-pure-const1 says so) and drops calls to it that were not inlined. A g++
/// -O3 build of the tiled kernel had none of its block, query and output prefetches left, and the
/// decode products lost theirs wherever a register block was inlined (f16 decode 1.2-1.3x slower).
template <int Write, int Locality>
POSENC_ALWAYS_INLINE void prefetch(const void* p) noexcept {
  static_assert((Write == 0 || Write == 1) && Locality >= 0 && Locality <= 3);
#if !defined(POSENC_PORTABLE_BUILTINS) && POSENC_HAS_BUILTIN(__builtin_prefetch)
  __builtin_prefetch(p, Write, Locality);
#elif !defined(POSENC_PORTABLE_BUILTINS) && defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
  constexpr int hint = Locality == 3 ? _MM_HINT_T0 : Locality == 2 ? _MM_HINT_T1 : Locality == 1 ? _MM_HINT_T2 : _MM_HINT_NTA;
  _mm_prefetch(static_cast<const char*>(p), hint);
#else
  (void)p;  // a hint only: nothing to do without one
#endif
}

namespace portable {

/// r = a + b unless that overflows T (then true, r untouched): the range test before the addition, so
/// no signed overflow ever happens.
template <class T>
constexpr bool add_overflow(T a, T b, T& r) noexcept {
  static_assert(std::is_integral_v<T> && std::is_signed_v<T>);
  if ((b > 0 && a > std::numeric_limits<T>::max() - b) || (b < 0 && a < std::numeric_limits<T>::min() - b)) return true;
  r = static_cast<T>(a + b);
  return false;
}

/// r = a - b unless that overflows T (then true, r untouched).
template <class T>
constexpr bool sub_overflow(T a, T b, T& r) noexcept {
  static_assert(std::is_integral_v<T> && std::is_signed_v<T>);
  if ((b < 0 && a > std::numeric_limits<T>::max() + b) || (b > 0 && a < std::numeric_limits<T>::min() + b)) return true;
  r = static_cast<T>(a - b);
  return false;
}

}  // namespace portable

/// r = a + b for a signed integer type; true when the sum does not fit T (r is then unspecified).
template <class T>
constexpr bool add_overflow(T a, T b, T& r) noexcept {
  static_assert(std::is_integral_v<T> && std::is_signed_v<T>);
#if !defined(POSENC_PORTABLE_BUILTINS) && POSENC_HAS_BUILTIN(__builtin_add_overflow)
  return __builtin_add_overflow(a, b, &r);
#else
  return portable::add_overflow(a, b, r);
#endif
}

/// r = a - b for a signed integer type; true when the difference does not fit T (r is then unspecified).
template <class T>
constexpr bool sub_overflow(T a, T b, T& r) noexcept {
  static_assert(std::is_integral_v<T> && std::is_signed_v<T>);
#if !defined(POSENC_PORTABLE_BUILTINS) && POSENC_HAS_BUILTIN(__builtin_sub_overflow)
  return __builtin_sub_overflow(a, b, &r);
#else
  return portable::sub_overflow(a, b, r);
#endif
}

/// A hint inside a spin-wait loop that the thread is waiting: it lets the core give its resources to a
/// sibling hardware thread and saves power (pause on x86, yield on AArch64; nothing elsewhere).
POSENC_ALWAYS_INLINE void cpu_relax() noexcept {
#if defined(POSENC_PORTABLE_BUILTINS)
#elif (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_ia32_pause();
#elif (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#elif defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
  _mm_pause();
#endif
}

}  // namespace posenc::detail
