// posenc/detail/kv_storage.hpp — keys and values stored in half precision (a KV cache in f16 or bf16),
// widened to the kernel's scalar a few rows at a time, where the tiles read them.
//
// The storage type only changes how K and V are held: q, out and every accumulation stay in the
// call's T (float or double), and the widening is exact (every f16 and bf16 value is a float), so
// the result is the attention of the stored values; the only error against a float cache is the
// rounding of K and V to the storage type (docs/kv-cache.md).
//
// Widening runs at the speed the cache streams in: eight or sixteen values per instruction
// (vcvtph2ps) with F16C or AVX-512; bf16 is the top half of a float, a 16-bit shift the compiler
// vectorizes. Without F16C, f16 goes through Eigen's scalar conversion (the same values, slower).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "posenc/detail/platform.hpp"
#include "posenc/detail/prefetch.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

/// Scalar types a K/V cache may be stored in besides the call's own T.
template <class KV>
inline constexpr bool is_half_storage = std::is_same_v<KV, Eigen::half> || std::is_same_v<KV, Eigen::bfloat16>;

/// Storage types accepted for k and v in a call whose q and out are T: T itself, f16 or bf16.
template <class KV, class T>
concept kv_storage_for = std::is_same_v<KV, T> || is_half_storage<KV>;

namespace detail {

/// dst[i] = src[i] for n values, src in f16.
template <class T>
void widen(const Eigen::half* src, T* dst, index_t n) {
  index_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]));
}

/// dst[i] = src[i] for n values, src in bf16: the stored 16 bits are a float's upper half.
template <class T>
void widen(const Eigen::bfloat16* src, T* dst, index_t n) {
  static_assert(sizeof(Eigen::bfloat16) == sizeof(std::uint16_t));
  for (index_t i = 0; i < n; ++i) {
    const std::uint32_t bits = static_cast<std::uint32_t>(src[i].value) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    dst[i] = static_cast<T>(f);
  }
}

/// dst[i] = src[i] rounded to f16, to nearest even as PyTorch's `.to(torch.float16)` (infinities kept,
/// NaN stays NaN): how a float key or value is stored in a half-precision cache.
inline void narrow(const float* src, Eigen::half* dst, index_t n) {
  index_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = Eigen::half(src[i]);
}

/// dst[i] = src[i] rounded to bf16, to nearest even as PyTorch's `.to(torch.bfloat16)` (NaN stays NaN).
inline void narrow(const float* src, Eigen::bfloat16* dst, index_t n) {
  for (index_t i = 0; i < n; ++i) dst[i] = Eigen::bfloat16(src[i]);
}

/// dst (rows x cols, row stride dst_stride) = src widened (row stride src_stride).
template <class KV, class T>
void widen_rows(const KV* src, index_t src_stride, index_t rows, index_t cols, T* dst, index_t dst_stride) {
  for (index_t r = 0; r < rows; ++r) widen(src + r * src_stride, dst + r * dst_stride, cols);
}

/// dst (rows x cols, contiguous rows) = src rows (row stride src_stride) in T: copied or widened. With
/// `prefetch` != 0 each line read prefetches into L2 the line `prefetch` elements further (a cache's
/// tiles staged in turn: the rows read next, decode_prefetch_rows rows on or, in the column layout, a
/// later head's: decode_attention::column_prefetch).
template <class KV, class T>
void stage_rows(const KV* src, index_t src_stride, index_t rows, index_t cols, T* dst, index_t prefetch = 0) {
  for (index_t r = 0; r < rows; ++r) {
    if (prefetch != 0)
      for (index_t c = 0; c < cols; c += line_elements<KV>) prefetch_past(src + r * src_stride + c, prefetch);
    if constexpr (std::is_same_v<KV, T>) {
      // Eigen's inlined packet copy: memcpy's call costs as much as a 512-byte row's copy here
      Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(dst + r * cols, cols) =
          Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(src + r * src_stride, cols);
    } else {
      widen(src + r * src_stride, dst + r * cols, cols);
    }
  }
}

/// Rows first .. first+count-1 of one (batch, kv head) of a K or V view as a [count x dim] map of T: the
/// caller's rows when they are stored in T, else widened into `buffer` (grown as needed, never shrunk).
template <class T, class KV, class Buffer>
const_matrix_map<T> rows_as(const heads_view<const KV>& x, index_t b, index_t h, index_t first, index_t count,
                            Buffer& buffer) {
  if constexpr (std::is_same_v<KV, T>) {
    (void)buffer;
    return x.matrix(b, h, first, count);
  } else {
    const index_t d = x.dim();
    if (buffer.size() < count * d) buffer.resize(count * d);
    widen_rows(x.row(b, first, h), x.token_stride(), count, d, buffer.data(), d);
    return const_matrix_map<T>(buffer.data(), count, d, Eigen::OuterStride<>(d));
  }
}

}  // namespace detail
}  // namespace posenc
