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
// (p2c): X = the key tile and the gather reads P(j, bucket(i, j) - lo).
#pragma once

#include <algorithm>
#include <cstdint>

#include <Eigen/Core>

#include "posenc/encoding.hpp"

namespace posenc::detail {

/// Inclusive range of bucket indices a tile can produce.
struct bucket_range {
  index_t lo = 0, hi = -1;
  [[nodiscard]] index_t count() const { return hi >= lo ? hi - lo + 1 : 0; }
};

/// The buckets clip(k_pos - q_pos, -max_distance, max_distance) + max_distance that a tile with
/// these positions can produce (Shaw's clipped relative distance, offset to a 0-based row).
[[nodiscard]] inline bucket_range clipped_relative_range(const std::int64_t* q_pos, index_t rows,
                                                         const std::int64_t* k_pos, index_t cols,
                                                         std::int64_t max_distance) {
  if (rows == 0 || cols == 0) return {};
  const auto [qmin, qmax] = std::minmax_element(q_pos, q_pos + rows);
  const auto [kmin, kmax] = std::minmax_element(k_pos, k_pos + cols);
  auto clip = [&](std::int64_t r) { return std::clamp(r, -max_distance, max_distance) + max_distance; };
  return {static_cast<index_t>(clip(*kmin - *qmax)), static_cast<index_t>(clip(*kmax - *qmin))};
}

/// Clipped relative bucket of one pair (same formula as clipped_relative_range).
[[nodiscard]] inline index_t clipped_relative_bucket(std::int64_t q_pos, std::int64_t k_pos, std::int64_t max_distance) {
  return static_cast<index_t>(std::clamp(k_pos - q_pos, -max_distance, max_distance) + max_distance);
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

/// prod = x * table.middleRows(range)^T into caller storage (at least x.rows() * range.count()
/// elements, e.g. a per-thread buffer kept across tiles); returns the row-major [x.rows(), count] map.
template <class T, class X, class Table>
matrix_map<T> relative_products_into(const X& x, const Table& table, bucket_range range, T* storage) {
  matrix_map<T> prod(storage, x.rows(), range.count(), Eigen::OuterStride<>(std::max<index_t>(range.count(), 1)));
  if (range.count() > 0 && x.rows() > 0) prod.noalias() = x * table.middleRows(range.lo, range.count()).transpose();
  return prod;
}

/// Query-side gather: s(i, j) += scale * prod(i, row_buckets(i)[j] - range.lo).
template <class T, class RowBuckets>
void gather_add_by_row_buckets(const matrix_map<T>& prod, bucket_range range, RowBuckets&& row_buckets, T scale,
                               matrix_map<T> s) {
  const index_t cols = s.cols();
  const auto lo = static_cast<std::int32_t>(range.lo);
  for (index_t i = 0; i < s.rows(); ++i) {
    const std::int32_t* idx = row_buckets(i);
    const T* p = prod.data() + i * prod.outerStride();
    T* out = s.data() + i * s.outerStride();
    for (index_t j = 0; j < cols; ++j) out[j] += scale * p[idx[j] - lo];
  }
}

/// Key-side gather: s(i, j) += scale * prod(j, row_buckets(i)[j] - range.lo) (prod: one row per key).
template <class T, class RowBuckets>
void gather_add_by_col_buckets(const matrix_map<T>& prod, bucket_range range, RowBuckets&& row_buckets, T scale,
                               matrix_map<T> s) {
  const index_t cols = s.cols();
  const auto stride = static_cast<std::int32_t>(prod.outerStride());
  const auto lo = static_cast<std::int32_t>(range.lo);
  const T* p = prod.data();
  for (index_t i = 0; i < s.rows(); ++i) {
    const std::int32_t* idx = row_buckets(i);
    T* out = s.data() + i * s.outerStride();
    for (index_t j = 0; j < cols; ++j) out[j] += scale * p[static_cast<std::int32_t>(j) * stride + idx[j] - lo];
  }
}

}  // namespace posenc::detail
