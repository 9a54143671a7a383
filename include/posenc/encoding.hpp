// posenc/encoding.hpp — the encoding contract: the hooks an encoding type may bring to the kernel.
//
// An encoding is a plain type with one or more of the hooks below, detected with `if constexpr`
// by the attention kernel (posenc/attention.hpp) and by tools. There is no base class and no
// if-chain per encoding in the kernel: a new family is a new type. docs/design.md gives the order
// in which the kernel applies the hooks and an example of each kind.
//
// Every tile-level hook sees one tile: a block of queries x a block of keys of one (batch, head),
// with their absolute positions, so the kernel can fuse it without an Lq x Lk buffer.
//
//  hook (member, const)                                         kind
//  -----------------------------------------------------------  --------------------------------
//  add_to(tensor_map<T,3> x, positions_view pos)                 input encoding: x[b,s,:] += PE(pos)
//  transform_qk(qk_role, index head, span<const int64> pos,      Q/K transform, once per token
//               matrix_map<T> x)                                 (x: [tokens x head_dim], in place)
//    optionally also (..., const_matrix_map<T> in,               the same, out of place (the kernel
//               matrix_map<T> out)                               then skips its copy of the input)
//  static constexpr bool transforms_keys = false                 (optional) the transform is for
//                                                                queries only: keys read as given
//  add_score_terms(const tile<T>&, T scale, matrix_map<T> s)     score term inside the scale:
//                                                                s += scale * term(q_i, k_j, i, j)
//  add_position_bias(const tile<T>&, matrix_map<T> s)            position-only bias after the scale
//  value_bucket_count(), value_buckets(const tile<T>&,           value term: out_i += sum_j p_ij *
//    matrix_map<int32> idx), value_table<T>(index head)          table[idx_ij] (accumulated per bucket)
//    uniform_value_bucket(const tile<T>&) -> int32               (optional) the one bucket of every
//                                                                pair of the tile, or -1
//  logit_scale(index head_dim) -> double                         the family's logit scale
//  bind(const call_info&) -> bound encoding                      per-call preparation (tables that
//                                                                depend on the call's positions)
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <span>
#include <type_traits>

#include "posenc/positions.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

/// Which operand a Q/K transform is applied to.
enum class qk_role { query, key };

/// Scalar type of an attention call (so that bind builds per-call tables in that type only).
enum class scalar_type { float32, float64 };

/// What `bind` sees, once per attention call, before any tile.
struct call_info {
  index_t batch = 0, heads = 0, kv_heads = 0, q_len = 0, k_len = 0, head_dim = 0, value_dim = 0;
  /// The call's keys are the caller's keys k_first .. k_first + k_len - 1: keys no query can see by
  /// index or padding, before every query's window or after every query, are left out (docs/masks.md).
  index_t k_first = 0;
  scalar_type scalar = scalar_type::float32;  ///< the kernel's T: float32 for float, float64 for double
  positions_view q_positions{nullptr, 0, 0};  ///< [batch, q_len]
  positions_view k_positions{nullptr, 0, 0};  ///< [batch, k_len], the keys from k_first on
  std::int64_t q_min = 0, q_max = -1, k_min = 0, k_max = -1;  ///< position ranges (max < min: empty)
};

/// One tile of one (batch, head): queries q_first..q_first+rows-1 x keys k_first..k_first+cols-1.
template <class T>
struct tile {
  index_t batch = 0, head = 0, kv_head = 0;
  index_t q_first = 0, k_first = 0;  ///< index of the first query / key of the tile in the caller's q / k
  index_t rows = 0, cols = 0;
  const std::int64_t* q_pos = nullptr;  ///< [rows] absolute positions of the tile's queries
  const std::int64_t* k_pos = nullptr;  ///< [cols] absolute positions of the tile's keys
  const_matrix_map<T> q{nullptr, 0, 0, Eigen::OuterStride<>(1)};  ///< [rows x d], after Q/K transforms, unscaled
  const_matrix_map<T> k{nullptr, 0, 0, Eigen::OuterStride<>(1)};  ///< [cols x d], after Q/K transforms
};

/// Integer tile (value-term bucket indices).
using index_tile = Eigen::Map<Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                              Eigen::Unaligned, Eigen::OuterStride<>>;

// ---- hook detection, per scalar type ------------------------------------------------------------

template <class E, class T>
concept has_input_encoding = requires(const E& e, tensor_map<T, 3> x, positions_view p) { e.add_to(x, p); };

template <class E, class T>
concept has_qk_transform = requires(const E& e, qk_role r, index_t h, std::span<const std::int64_t> p,
                                    matrix_map<T> x) { e.transform_qk(r, h, p, x); };

/// Optional out-of-place form of a Q/K transform: out = transform(in), both [tokens x head_dim]
/// (in: the caller's strided rows). The kernel prefers it to a copy followed by the in-place form:
/// one pass over the caller's buffer instead of two.
template <class E, class T>
concept has_qk_transform_copy =
    has_qk_transform<E, T> && requires(const E& e, qk_role r, index_t h, std::span<const std::int64_t> p,
                                       const_matrix_map<T> in, matrix_map<T> out) { e.transform_qk(r, h, p, in, out); };

/// Whether the kernel applies the Q/K transform to the keys too: yes unless the encoding declares
/// `static constexpr bool transforms_keys = false` (a query-side transform, e.g. Transformer-XL's
/// q + u; the keys are then read from the caller's rows, never copied).
template <class E, class T>
concept has_key_transform = has_qk_transform<E, T> && !requires {
  requires !E::transforms_keys;
};

template <class E, class T>
concept has_score_terms = requires(const E& e, const tile<T>& t, T scale, matrix_map<T> s) {
  e.add_score_terms(t, scale, s);
};

template <class E, class T>
concept has_position_bias = requires(const E& e, const tile<T>& t, matrix_map<T> s) { e.add_position_bias(t, s); };

template <class E, class T>
concept has_value_terms = requires(const E& e, const tile<T>& t, index_tile idx, index_t h) {
  { e.value_bucket_count() } -> std::convertible_to<index_t>;
  e.value_buckets(t, idx);
  { e.template value_table<T>(h) } -> std::convertible_to<const_matrix_map<T>>;
};

/// Optional companion of the value terms: the bucket every pair of the tile maps to, or -1 when
/// the tile has several (a tile entirely beyond a clipped distance). The kernel then adds each row's
/// weight to that bucket instead of asking for a bucket per pair.
template <class E, class T>
concept has_uniform_value_bucket = has_value_terms<E, T> && requires(const E& e, const tile<T>& t) {
  { e.uniform_value_bucket(t) } -> std::convertible_to<std::int32_t>;
};

template <class E>
concept has_logit_scale = requires(const E& e, index_t d) {
  { e.logit_scale(d) } -> std::convertible_to<double>;
};

template <class E>
concept has_bind = requires(const E& e, const call_info& c) { e.bind(c); };

template <class E, class T>
concept has_attention_hook = has_qk_transform<E, T> || has_score_terms<E, T> || has_position_bias<E, T> ||
                             has_value_terms<E, T> || has_logit_scale<E> || has_bind<E>;

/// A type the attention kernel accepts: at least one attention hook for float or double.
template <class E>
concept attention_encoding = has_attention_hook<E, float> || has_attention_hook<E, double>;

/// A type that adds to embeddings (sinusoidal, learned absolute).
template <class E>
concept input_encoding = has_input_encoding<E, float> || has_input_encoding<E, double>;

/// Anything with at least one hook of the contract. A type with none is not an encoding.
template <class E>
concept encoding = attention_encoding<E> || input_encoding<E>;

/// No positional information: plain scaled dot-product attention (logit scale 1/sqrt(d)).
struct no_position {
  [[nodiscard]] static double logit_scale(index_t head_dim) {
    return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
  }
};

namespace detail {

/// The object whose hooks the kernel calls: enc.bind(info) when the encoding has it, else enc.
template <class E>
decltype(auto) bind_encoding(const E& enc, const call_info& info) {
  if constexpr (has_bind<E>) {
    return enc.bind(info);
  } else {
    (void)info;
    return (enc);  // a reference, no copy
  }
}

}  // namespace detail

/// The logit scale an encoding asks for, or 1/sqrt(head_dim) when it has no opinion.
template <class E>
[[nodiscard]] double default_logit_scale(const E& enc, index_t head_dim) {
  if constexpr (has_logit_scale<E>) return enc.logit_scale(head_dim);
  else return no_position::logit_scale(head_dim);
}

}  // namespace posenc
