// posenc/detail/decode_kernels.hpp — the decode path's tile products, for a few query rows against keys
// and values read straight from the cache rows (no packed copies):
//   row_dots      S = Q K^T   each score a dot product of two contiguous rows
//   add_weighted  O += P V    each output row a sum of value rows weighted by its scores
// Both are written on Eigen's packet primitives (Packet16f with AVX-512, Packet8f with AVX, Packet4f
// with SSE, and the double forms), so they vectorize on every target the library builds for, with no
// horizontal reduction inside the loops: row_dots keeps a register block of 2 rows x 4 keys of packet
// accumulators and reduces each one once; add_weighted keeps 4 packets of an output row in registers
// across the keys of a tile. Keys and values are read once per pair of rows (row_dots) or per row
// (add_weighted) from L1: the tile is at most decode_tile_keys rows, sized to stay there.
#pragma once

#include <algorithm>

#include <Eigen/Core>

#include "posenc/tensor.hpp"

namespace posenc::detail {

template <class T>
struct packet_of {
  using type = typename Eigen::internal::packet_traits<T>::type;
  static constexpr index_t width = Eigen::internal::unpacket_traits<type>::size;
};

/// s[r * s_stride + j] = dot(q row r, k row j) for R rows x J keys, the dimension d in whole packets
/// (dv = d rounded down to them) and a scalar tail.
template <int R, int J, class T>
inline void row_dots_block(const T* q, index_t q_stride, const T* k, index_t k_stride, index_t d, T* s,
                           index_t s_stride) {
  using P = typename packet_of<T>::type;
  constexpr index_t W = packet_of<T>::width;
  namespace in = Eigen::internal;
  P acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = in::pset1<P>(T(0));
  const index_t dv = d / W * W;
  for (index_t t = 0; t < dv; t += W) {
    P kp[J];
    for (int j = 0; j < J; ++j) kp[j] = in::ploadu<P>(k + j * k_stride + t);
    for (int r = 0; r < R; ++r) {
      const P qp = in::ploadu<P>(q + r * q_stride + t);
      for (int j = 0; j < J; ++j) acc[r][j] = in::pmadd(qp, kp[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      T sum = in::predux(acc[r][j]);
      for (index_t t = dv; t < d; ++t) sum += q[r * q_stride + t] * k[j * k_stride + t];
      s[r * s_stride + j] = sum;
    }
}

/// S (rows x cols, row-major, row stride s_stride) = Q (rows x d) K^T (K: cols x d); rows of Q and K
/// contiguous, any row strides.
template <class T>
void row_dots(const T* q, index_t q_stride, index_t rows, const T* k, index_t k_stride, index_t cols, index_t d, T* s,
              index_t s_stride) {
  index_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    index_t j = 0;
    for (; j + 4 <= cols; j += 4)
      row_dots_block<2, 4>(q + r * q_stride, q_stride, k + j * k_stride, k_stride, d, s + r * s_stride + j, s_stride);
    for (; j < cols; ++j)
      row_dots_block<2, 1>(q + r * q_stride, q_stride, k + j * k_stride, k_stride, d, s + r * s_stride + j, s_stride);
  }
  for (; r < rows; ++r) {
    index_t j = 0;
    for (; j + 4 <= cols; j += 4)
      row_dots_block<1, 4>(q + r * q_stride, q_stride, k + j * k_stride, k_stride, d, s + r * s_stride + j, s_stride);
    for (; j < cols; ++j)
      row_dots_block<1, 1>(q + r * q_stride, q_stride, k + j * k_stride, k_stride, d, s + r * s_stride + j, s_stride);
  }
}

/// o[0 .. N*W) += sum_j p[j] v_j[0 .. N*W) over `cols` value rows, N packets kept in registers.
template <int N, class T>
inline void add_weighted_packets(const T* p, const T* v, index_t v_stride, index_t cols, T* o) {
  using P = typename packet_of<T>::type;
  constexpr index_t W = packet_of<T>::width;
  namespace in = Eigen::internal;
  P acc[N];
  for (int i = 0; i < N; ++i) acc[i] = in::ploadu<P>(o + i * W);
  for (index_t j = 0; j < cols; ++j) {
    const P w = in::pset1<P>(p[j]);
    for (int i = 0; i < N; ++i) acc[i] = in::pmadd(w, in::ploadu<P>(v + j * v_stride + i * W), acc[i]);
  }
  for (int i = 0; i < N; ++i) in::pstoreu(o + i * W, acc[i]);
}

/// O (rows x dv, row stride o_stride) += P (rows x cols, row stride p_stride) V (cols x dv).
template <class T>
void add_weighted(const T* p, index_t p_stride, index_t rows, const T* v, index_t v_stride, index_t cols, index_t dv,
                  T* o, index_t o_stride) {
  constexpr index_t W = packet_of<T>::width;
  for (index_t r = 0; r < rows; ++r) {
    const T* pr = p + r * p_stride;
    T* orow = o + r * o_stride;
    index_t t = 0;
    for (; t + 4 * W <= dv; t += 4 * W) add_weighted_packets<4>(pr, v + t, v_stride, cols, orow + t);
    for (; t + W <= dv; t += W) add_weighted_packets<1>(pr, v + t, v_stride, cols, orow + t);
    for (; t < dv; ++t) {
      T sum = orow[t];
      for (index_t j = 0; j < cols; ++j) sum += pr[j] * v[j * v_stride + t];
      orow[t] = sum;
    }
  }
}

}  // namespace posenc::detail
