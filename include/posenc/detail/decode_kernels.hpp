// posenc/detail/decode_kernels.hpp — the decode path's tile products, for a few query rows against keys
// and values read straight from the cache rows (no packed copies):
//   row_dots      S = Q K^T   each score a dot product of two contiguous rows
//   add_weighted  O += P V    each output row a sum of value rows weighted by its scores
// Both are written on Eigen's packet primitives (Packet16f with AVX-512, Packet8f with AVX, Packet4f
// with SSE, and the double forms), so they vectorize on every target the library builds for, with no
// horizontal reduction inside the loops: row_dots keeps a register block of 4 rows x 4 keys (2 keys
// with 16 registers) of packet accumulators and reduces each one once; add_weighted keeps 4 rows x 4
// packets of output in registers across the keys of a tile. Each key and value row is read once per 4
// query rows: a decode step of up to 4 rows per kv head reads the cache exactly once.
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

/// Register blocks: 4 rows x J keys of accumulators (J = 4 with 32 vector registers, AVX-512; 2 with
/// 16), so a group of up to 4 rows reads each key once.
#if defined(EIGEN_VECTORIZE_AVX512)
inline constexpr int dot_block_keys = 4;
inline constexpr int weighted_block_packets = 4;
#else
inline constexpr int dot_block_keys = 2;
inline constexpr int weighted_block_packets = 2;
#endif

template <int R, class T>
inline void row_dots_rows(const T* q, index_t q_stride, const T* k, index_t k_stride, index_t cols, index_t d, T* s,
                          index_t s_stride) {
  constexpr int J = dot_block_keys;
  index_t j = 0;
  for (; j + J <= cols; j += J) row_dots_block<R, J>(q, q_stride, k + j * k_stride, k_stride, d, s + j, s_stride);
  for (; j < cols; ++j) row_dots_block<R, 1>(q, q_stride, k + j * k_stride, k_stride, d, s + j, s_stride);
}

/// S (rows x cols, row-major, row stride s_stride) = Q (rows x d) K^T (K: cols x d); rows of Q and K
/// contiguous, any row strides. Each key row is read once per 4 query rows.
template <class T>
void row_dots(const T* q, index_t q_stride, index_t rows, const T* k, index_t k_stride, index_t cols, index_t d, T* s,
              index_t s_stride) {
  index_t r = 0;
  for (; r + 4 <= rows; r += 4) row_dots_rows<4>(q + r * q_stride, q_stride, k, k_stride, cols, d, s + r * s_stride, s_stride);
  switch (rows - r) {
    case 3: row_dots_rows<3>(q + r * q_stride, q_stride, k, k_stride, cols, d, s + r * s_stride, s_stride); break;
    case 2: row_dots_rows<2>(q + r * q_stride, q_stride, k, k_stride, cols, d, s + r * s_stride, s_stride); break;
    case 1: row_dots_rows<1>(q + r * q_stride, q_stride, k, k_stride, cols, d, s + r * s_stride, s_stride); break;
    default: break;
  }
}

/// R output rows, N packets each from column t: o_r[t .. t+N*W) += sum_j p_r[j] v_j[t .. t+N*W), the
/// R x N accumulators in registers, each value packet loaded once for the R rows.
template <int R, int N, class T>
inline void add_weighted_block(const T* p, index_t p_stride, const T* v, index_t v_stride, index_t cols, T* o,
                               index_t o_stride) {
  using P = typename packet_of<T>::type;
  constexpr index_t W = packet_of<T>::width;
  namespace in = Eigen::internal;
  P acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = in::ploadu<P>(o + r * o_stride + i * W);
  for (index_t j = 0; j < cols; ++j) {
    P vp[N];
    for (int i = 0; i < N; ++i) vp[i] = in::ploadu<P>(v + j * v_stride + i * W);
    for (int r = 0; r < R; ++r) {
      const P w = in::pset1<P>(p[r * p_stride + j]);
      for (int i = 0; i < N; ++i) acc[r][i] = in::pmadd(w, vp[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) in::pstoreu(o + r * o_stride + i * W, acc[r][i]);
}

template <int R, class T>
void add_weighted_rows(const T* p, index_t p_stride, const T* v, index_t v_stride, index_t cols, index_t dv, T* o,
                       index_t o_stride) {
  constexpr index_t W = packet_of<T>::width;
  constexpr int N = weighted_block_packets;
  index_t t = 0;
  for (; t + N * W <= dv; t += N * W) add_weighted_block<R, N>(p, p_stride, v + t, v_stride, cols, o + t, o_stride);
  for (; t + W <= dv; t += W) add_weighted_block<R, 1>(p, p_stride, v + t, v_stride, cols, o + t, o_stride);
  for (; t < dv; ++t)
    for (int r = 0; r < R; ++r) {
      T sum = o[r * o_stride + t];
      for (index_t j = 0; j < cols; ++j) sum += p[r * p_stride + j] * v[j * v_stride + t];
      o[r * o_stride + t] = sum;
    }
}

/// O (rows x dv, row stride o_stride) += P (rows x cols, row stride p_stride) V (cols x dv). Each value
/// row is read once per 4 output rows.
template <class T>
void add_weighted(const T* p, index_t p_stride, index_t rows, const T* v, index_t v_stride, index_t cols, index_t dv,
                  T* o, index_t o_stride) {
  index_t r = 0;
  for (; r + 4 <= rows; r += 4)
    add_weighted_rows<4>(p + r * p_stride, p_stride, v, v_stride, cols, dv, o + r * o_stride, o_stride);
  switch (rows - r) {
    case 3: add_weighted_rows<3>(p + r * p_stride, p_stride, v, v_stride, cols, dv, o + r * o_stride, o_stride); break;
    case 2: add_weighted_rows<2>(p + r * p_stride, p_stride, v, v_stride, cols, dv, o + r * o_stride, o_stride); break;
    case 1: add_weighted_rows<1>(p + r * p_stride, p_stride, v, v_stride, cols, dv, o + r * o_stride, o_stride); break;
    default: break;
  }
}

}  // namespace posenc::detail
