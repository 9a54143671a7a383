// posenc/detail/relative.hpp — relative-position score terms over one tile without an L x L x d
// tensor: "relative range + gather".
//
// Shaw et al. 2018 (section 3, eq. 4: e_ij = x_i W^Q (x_j W^K + a^K_ij)^T) and DeBERTa (He et al.
// 2021, section 3.1, eq. 4: the c2p term Q_i . K^r_{delta(i,j)} and the p2c term K_j . Q^r_{delta(j,i)})
// add q_i . R[bucket(i, j)] to the score, where R is a small [buckets x d] table. Materializing
// R[bucket(i, j)] for every pair would cost L x L x d. Over one tile the buckets that occur lie in a
// short range [lo, hi] (positions of a tile are close together), so the tile needs only
//   P = X * R[lo..hi]^T        (rows x (hi-lo+1), one small GEMM per tile)
// and then a gather s(i, j) += scale * P(i, bucket(i, j) - lo). The same helper serves the key side
// (p2c): X = the key tile and the gather reads P(j, bucket(i, j) - lo). For Shaw's clipped buckets
// over consecutive key positions each query row of the gather is two constant runs (distances
// clipped to -k and +k) and one contiguous slice of P (gather_add_clipped, clipped_buckets), and a
// tile whose range is one bucket needs no gather at all.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <Eigen/Core>

#include "posenc/detail/platform.hpp"
#include "posenc/detail/position_scan.hpp"
#include "posenc/encoding.hpp"

namespace posenc::detail {

/// key - query, saturated to the int64 range (positions are caller data; a difference that overflows
/// is beyond any clipping distance anyway).
[[nodiscard]] inline std::int64_t relative_distance(std::int64_t q_pos, std::int64_t k_pos) {
  std::int64_t r = 0;
  if (sub_overflow(k_pos, q_pos, r)) return k_pos > q_pos ? INT64_MAX : INT64_MIN;
  return r;
}

/// Inclusive range of bucket indices a tile can produce.
struct bucket_range {
  index_t lo = 0, hi = -1;
  [[nodiscard]] index_t count() const { return hi >= lo ? hi - lo + 1 : 0; }
};

/// The differences a - b of one call (a in [a_min, a_max], b in [b_min, b_max]: key minus query
/// positions for T5, query minus key for DeBERTa), as the inclusive range an encoding tabulates once
/// per call in bind(). Contiguous positions give q_len + k_len - 1 differences; nullopt when the range
/// is wider than 2^24 (sparse, pathological positions) or its ends overflow int64: the encoding then
/// serves each pair directly.
struct distance_range {
  std::int64_t lo = 0, hi = -1;
  [[nodiscard]] std::int64_t count() const { return hi - lo + 1; }
};
[[nodiscard]] inline std::optional<distance_range> call_distance_range(std::int64_t a_min, std::int64_t a_max,
                                                                       std::int64_t b_min, std::int64_t b_max) {
  constexpr std::int64_t max_width = std::int64_t{1} << 24;
  std::int64_t lo = 0, hi = 0, width = 0;
  if (sub_overflow(a_min, b_max, lo) || sub_overflow(a_max, b_min, hi) || sub_overflow(hi, lo, width) ||
      width >= max_width)
    return std::nullopt;
  return distance_range{lo, hi};
}

/// The buckets clip(k_pos - q_pos, -max_distance, max_distance) + max_distance that a tile with
/// these positions can produce (Shaw's clipped relative distance, offset to a 0-based row).
[[nodiscard]] inline bucket_range clipped_relative_range(const std::int64_t* q_pos, index_t rows,
                                                         const std::int64_t* k_pos, index_t cols,
                                                         std::int64_t max_distance) {
  if (rows == 0 || cols == 0) return {};
  std::int64_t qmin = 0, qmax = 0, kmin = 0, kmax = 0;
  position_range(q_pos, rows, qmin, qmax);
  position_range(k_pos, cols, kmin, kmax);
  auto clip = [&](std::int64_t r) { return std::clamp(r, -max_distance, max_distance) + max_distance; };
  return {static_cast<index_t>(clip(relative_distance(qmax, kmin))),
          static_cast<index_t>(clip(relative_distance(qmin, kmax)))};
}

/// Clipped relative bucket of one pair (same formula as clipped_relative_range).
[[nodiscard]] inline index_t clipped_relative_bucket(std::int64_t q_pos, std::int64_t k_pos, std::int64_t max_distance) {
  return static_cast<index_t>(std::clamp(relative_distance(q_pos, k_pos), -max_distance, max_distance) + max_distance);
}

/// prod = x * table.middleRows(range)^T: the products of every tile row with just the table rows
/// the tile needs. `prod` is resized (a per-call scratch the caller may keep across tiles).
template <class T, class X, class Table>
void relative_products(const X& x, const Table& table, bucket_range range,
                       Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>& prod) {
  prod.resize(x.rows(), range.count());
  if (range.count() == 0) return;
  prod.noalias() = x * table.middleRows(range.lo, range.count()).transpose();
}

/// prod = alpha * x * table.middleRows(range)^T into caller memory ([x.rows() x range.count()]): the
/// form for hooks that must not allocate per tile. alpha rides on the product (GEMM's alpha), so a
/// logit scale costs nothing here and nothing in the gather.
template <class T, class X, class Table>
void relative_products(const X& x, const Table& table, bucket_range range, T alpha, matrix_map<T> prod) {
  if (range.count() == 0 || x.rows() == 0) return;
  prod.noalias() = (alpha * x) * table.middleRows(range.lo, range.count()).transpose();
}

/// A growable buffer of the calling thread, for per-tile scratch of hooks that run on pool threads
/// (const, called concurrently: no shared mutable state, and no allocation once it is large enough).
template <class T>
[[nodiscard]] T* thread_buffer(index_t n) {
  thread_local std::vector<T> buffer;
  if (static_cast<index_t>(buffer.size()) < n) buffer.resize(static_cast<std::size_t>(n));
  return buffer.data();
}

/// One query row against consecutive keys k_first, k_first + 1, ..., k_first + cols - 1 under
/// clip(k - q, -max_distance, max_distance): columns [0, below) are clipped to bucket 0, columns
/// [below, inside_end) take bucket first + j, columns [inside_end, cols) are clipped to bucket
/// 2 max_distance. Lets a gather run as two constant fills and one contiguous copy, branch-free.
struct clipped_segments {
  index_t below = 0, inside_end = 0;
  std::int64_t first = 0;  ///< bucket of column 0 before clipping (r + max_distance)
};
[[nodiscard]] inline clipped_segments clipped_row_segments(std::int64_t q_pos, std::int64_t k_first, index_t cols,
                                                           std::int64_t max_distance) {
  // r0 clamped to a range where the arithmetic below cannot overflow and the segments are unchanged
  // (cols and max_distance are far below 2^60).
  constexpr std::int64_t lim = std::int64_t{1} << 60;
  const std::int64_t r0 = std::clamp(relative_distance(q_pos, k_first), -lim, lim);
  clipped_segments c;
  c.below = static_cast<index_t>(std::clamp<std::int64_t>(-max_distance - r0, 0, cols));
  c.inside_end = static_cast<index_t>(std::clamp<std::int64_t>(max_distance - r0 + 1, 0, cols));
  c.first = r0 + max_distance;
  return c;
}

/// Shaw's query-side gather: s(i, j) += prod(i, clip(k_pos[j] - q_pos[i], -K, K) + K - range.lo),
/// prod from relative_products over `range` (clipped_relative_range of the same positions).
/// Consecutive key positions: per row two constant segments and one contiguous slice.
template <class T>
void gather_add_clipped(const const_matrix_map<T>& prod, bucket_range range, const std::int64_t* q_pos,
                        const std::int64_t* k_pos, std::int64_t max_distance, matrix_map<T> s) {
  const index_t rows = s.rows(), cols = s.cols();
  if (consecutive_positions(k_pos, cols)) {
    for (index_t i = 0; i < rows; ++i) {
      const T* p = prod.data() + i * prod.outerStride();  // p[bucket - range.lo]
      T* row = s.data() + i * s.outerStride();
      const clipped_segments c = clipped_row_segments(q_pos[i], k_pos[0], cols, max_distance);
      if (c.below > 0) {
        const T v = p[0 - range.lo];
        for (index_t j = 0; j < c.below; ++j) row[j] += v;
      }
      const std::int64_t mid = c.first - range.lo;  // p[mid + j] for the unclipped columns
      for (index_t j = c.below; j < c.inside_end; ++j) row[j] += p[mid + j];
      if (c.inside_end < cols) {
        const T v = p[2 * max_distance - range.lo];
        for (index_t j = c.inside_end; j < cols; ++j) row[j] += v;
      }
    }
    return;
  }
  for (index_t i = 0; i < rows; ++i) {
    const T* p = prod.data() + i * prod.outerStride();
    T* row = s.data() + i * s.outerStride();
    for (index_t j = 0; j < cols; ++j)
      row[j] += p[clipped_relative_bucket(q_pos[i], k_pos[j], max_distance) - range.lo];
  }
}

/// idx(i, j) = clip(k_pos[j] - q_pos[i], -K, K) + K for every pair of a tile (Shaw's value buckets).
inline void clipped_buckets(const std::int64_t* q_pos, const std::int64_t* k_pos, std::int64_t max_distance,
                            index_tile idx) {
  const index_t rows = idx.rows(), cols = idx.cols();
  const auto top = static_cast<std::int32_t>(2 * max_distance);
  if (consecutive_positions(k_pos, cols)) {
    for (index_t i = 0; i < rows; ++i) {
      std::int32_t* row = idx.data() + i * idx.outerStride();
      const clipped_segments c = clipped_row_segments(q_pos[i], k_pos[0], cols, max_distance);
      for (index_t j = 0; j < c.below; ++j) row[j] = 0;
      const auto first = static_cast<std::int32_t>(c.first);
      for (index_t j = c.below; j < c.inside_end; ++j) row[j] = first + static_cast<std::int32_t>(j);
      for (index_t j = c.inside_end; j < cols; ++j) row[j] = top;
    }
    return;
  }
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < cols; ++j)
      idx(i, j) = static_cast<std::int32_t>(clipped_relative_bucket(q_pos[i], k_pos[j], max_distance));
}

/// Query-side gather: s(i, j) += scale * prod(i, bucket(i, j) - range.lo).
template <class T, class Bucket>
void gather_add_by_row(const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>& prod,
                       bucket_range range, Bucket&& bucket, T scale, matrix_map<T> s) {
  for (index_t i = 0; i < s.rows(); ++i)
    for (index_t j = 0; j < s.cols(); ++j) s(i, j) += scale * prod(i, bucket(i, j) - range.lo);
}

/// Key-side gather: s(i, j) += scale * prod(j, bucket(i, j) - range.lo).
template <class T, class Bucket>
void gather_add_by_col(const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>& prod,
                       bucket_range range, Bucket&& bucket, T scale, matrix_map<T> s) {
  for (index_t i = 0; i < s.rows(); ++i)
    for (index_t j = 0; j < s.cols(); ++j) s(i, j) += scale * prod(j, bucket(i, j) - range.lo);
}

// ---- gathers by precomputed bucket rows -------------------------------------------------------------
// The per-element `bucket(i, j)` callables above suit a bucket formula that is cheap per pair. When
// the bucket of a relative distance costs a logf (DeBERTa's log buckets), the encoding tabulates it
// once per call and each tile row reads a run of that table: `row_buckets(i)` returns a pointer to
// the cols bucket indices of row i (for contiguous key positions, a slice of the per-distance
// table). The loops below then have no call and no branch per element, so they vectorize (an
// indexed load per score on AVX2).

/// One row of an indexed gather: out[j] += scale * base[j * stride + (idx[j] - lo) * mult], j < cols.
/// With the products stored one table row per line (mult = the line length), stride 0 reads one
/// query's column of them (query side), stride 1 reads key j's (key side). Indices are 32-bit: with
/// AVX-512 / AVX2 the loads are one 32-bit-indexed gather per vector (the compiler's own
/// vectorization widens the indices to 64 bits and gathers half as many elements per instruction).
template <class T>
void gather_add_row(T* out, const T* base, const std::int32_t* idx, std::int32_t lo, std::int32_t stride,
                    std::int32_t mult, index_t cols, T scale) {
  index_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512i vm = _mm512_set1_epi32(mult), vlo = _mm512_set1_epi32(lo), step = _mm512_set1_epi32(16 * stride);
    __m512i off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(stride));
    for (; j + 16 <= cols; j += 16) {
      const __m512i c = _mm512_sub_epi32(_mm512_loadu_si512(idx + j), vlo);
      const __m512i id = _mm512_add_epi32(_mm512_mullo_epi32(c, vm), off);
      const __m512 g = _mm512_i32gather_ps(id, base, 4);
      _mm512_storeu_ps(out + j, _mm512_fmadd_ps(vs, g, _mm512_loadu_ps(out + j)));
      off = _mm512_add_epi32(off, step);
    }
  } else {
    const __m512d vs = _mm512_set1_pd(scale);
    const __m256i vm = _mm256_set1_epi32(mult), vlo = _mm256_set1_epi32(lo), step = _mm256_set1_epi32(8 * stride);
    __m256i off = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
    for (; j + 8 <= cols; j += 8) {
      const __m256i c = _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + j)), vlo);
      const __m256i id = _mm256_add_epi32(_mm256_mullo_epi32(c, vm), off);
      const __m512d g = _mm512_i32gather_pd(id, base, 8);
      _mm512_storeu_pd(out + j, _mm512_fmadd_pd(vs, g, _mm512_loadu_pd(out + j)));
      off = _mm256_add_epi32(off, step);
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 vs = _mm256_set1_ps(scale);
    const __m256i vm = _mm256_set1_epi32(mult), vlo = _mm256_set1_epi32(lo), step = _mm256_set1_epi32(8 * stride);
    __m256i off = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
    for (; j + 8 <= cols; j += 8) {
      const __m256i c = _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + j)), vlo);
      const __m256i id = _mm256_add_epi32(_mm256_mullo_epi32(c, vm), off);
      const __m256 g = _mm256_i32gather_ps(base, id, 4);
      _mm256_storeu_ps(out + j, _mm256_fmadd_ps(vs, g, _mm256_loadu_ps(out + j)));
      off = _mm256_add_epi32(off, step);
    }
  }
#endif
  for (; j < cols; ++j) out[j] += scale * base[static_cast<std::int32_t>(j) * stride + (idx[j] - lo) * mult];
}

}  // namespace posenc::detail
