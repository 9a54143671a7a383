// posenc/detail/attention_tile.hpp — the fused kernel's tile math: one step of one unit over one key
// block, and the unit's final normalization.
//
// For a unit's queries Q (rows) and a key block's first `cols` keys:
//   S  = scale Q K^T                                       GEBP on packed operands (S^T = scale K Q^T,
//                                                          the scale as the product's alpha), or an
//                                                          Eigen expression for few rows
//   S += scale * score_terms                               the encoding's terms inside the scale
//   S  = c tanh(S / c)                                     logit softcap c, when set (softcap_tile)
//   S += position_bias                                     the encoding's bias after the scale
//   S  = -inf where not visible                            padding keys, causal by positions, sliding
//                                                          window (mask_tile)
//   online softmax step (detail/online_softmax.hpp)        S becomes the weights P
//   O  = alpha O + P V ; A = alpha A + bucket mass of P    value terms per bucket (A: rows x buckets)
// and at the end O = O + A * value_table, the head's sink folded into (m, l) (online_softmax::
// fold_sink), out = O / l, lse = m + log l.
// mask_tile, softcap_tile and fold_sink are free of the schedule so that other paths building score
// tiles (a decode step) apply the same rules.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "posenc/detail/attention_operands.hpp"
#include "posenc/encoding.hpp"

namespace posenc::detail {

/// Sets the invisible scores of a tile to -inf (call_masks::visible, per tile): padding keys by
/// column, causal by comparing positions, and with a sliding window (`window` > 0, causal only) the
/// keys at or before q - window; when the key positions ascend, each row keeps one contiguous range.
/// `s`: a writable Eigen expression, row i the scores of query i (a matrix_map of the row layout, or
/// the transpose of the decode column layout's S^T, masked in place).
template <class T, class S>
void mask_tile(S&& s, const std::int64_t* q_pos, const std::int64_t* k_pos, const unsigned char* k_valid,
               bool has_padding, bool causal, bool ascending, std::int64_t window = 0) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const index_t rows = s.rows(), cols = s.cols();
  if (has_padding)
    for (index_t j = 0; j < cols; ++j)
      if (k_valid[j] == 0) s.col(j).setConstant(neg_inf);
  if (!causal) return;
  if (ascending) {
    for (index_t i = 0; i < rows; ++i) {
      const index_t seen = std::upper_bound(k_pos, k_pos + cols, q_pos[i]) - k_pos;
      s.row(i).tail(cols - seen).setConstant(neg_inf);
      if (window > 0) {  // keys before q - window + 1 are outside the window
        const index_t first = std::lower_bound(k_pos, k_pos + seen, window_start(q_pos[i], window)) - k_pos;
        s.row(i).head(first).setConstant(neg_inf);
      }
    }
  } else {
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < cols; ++j)
        if (!causal_visible(q_pos[i], k_pos[j], window)) s(i, j) = neg_inf;
  }
}

/// Logit softcap (Gemma 2's attn_logit_softcapping; ggml's logit_softcap): s = cap tanh(s / cap),
/// element-wise over a tile (Eigen's packet tanh where it has one). cap > 0.
template <class T>
void softcap_tile(matrix_map<T> s, T cap) {
  const T inv = T(1) / cap;
  for (index_t i = 0; i < s.rows(); ++i) s.row(i).array() = (s.row(i).array() * inv).tanh() * cap;
}

/// Everything one tile step reads: the unit (its prepared queries), the key block and its operands.
template <class T>
struct tile_inputs {
  index_t b = 0, hk = 0;
  const query_unit& u;
  const_matrix_map<T> q;  ///< the unit's (transformed) queries for the hooks (may have no rows)
  const key_block& blk;
  index_t cols = 0;   ///< keys this unit computes (a prefix of the block under a causal cut)
  index_t kcols = 0;  ///< keys packed for the item (the largest cols of its units)
  const block_operands<T>& ops;
};

template <class T, class Bound>
class tile_math {
 public:
  using gemm = tile_gemm<T>;
  using scratch = attention_scratch<T>;
  using unit_state = typename scratch::unit_state;
  static constexpr bool value_terms = has_value_terms<Bound, T>;

  /// `softcap`: 0 = none; `sinks`: one logit per query head, or empty.
  tile_math(const Bound& enc, const attention_schedule& sched, T scale, index_t dim, index_t vdim, index_t buckets,
            T softcap, std::vector<T> sinks)
      : enc_(enc), sched_(sched), scale_(scale), softcap_(softcap), sinks_(std::move(sinks)), dim_(dim), vdim_(vdim),
        buckets_(buckets),
        chunk_s_(gemm::column_chunk(sched.max_k_cols(), dim, sched.max_q_rows())),
        chunk_pv_(gemm::column_chunk(vdim, sched.max_k_cols(), sched.max_q_rows())) {}

  /// Zero accumulators and a fresh softmax for the unit.
  void start(const query_unit& u, unit_state& st) const {
    scratch::at_least(st.acc_out, u.rows * vdim_);
    st.acc_out.head(u.rows * vdim_).setZero();
    if constexpr (value_terms) {
      scratch::at_least(st.acc_buckets, u.rows * buckets_);
      st.acc_buckets.head(u.rows * buckets_).setZero();
    }
    st.softmax.reset(u.rows);
  }

  /// One tile: the unit's queries x the first `cols` keys of the block.
  void step(const tile_inputs<T>& in, unit_state& st, scratch& sc) {
    const query_unit& u = in.u;
    const index_t rows = u.rows, cols = in.cols;
    const std::int64_t* k_pos = sched_.masks().kp(in.b) + in.blk.first;
    matrix_map<T> s(scratch::at_least(sc.scores, rows * cols), rows, cols, Eigen::OuterStride<>(cols));
    if (u.packed) {  // S^T (keys x queries, column-major) = scale K Q^T
      s.setZero();
      gemm::multiply(s.data(), cols, in.ops.k_packed, st.q_packed.data(), cols, dim_, rows, scale_, dim_, chunk_s_);
    } else {
      const const_matrix_map<T> q_scaled(st.q_scaled.data(), rows, dim_, Eigen::OuterStride<>(dim_));
      s.noalias() = q_scaled * in.ops.k.topRows(cols).transpose();
    }

    const index_t k_first = sched_.masks().k_first + in.blk.first;  // the caller's index (leading_keys_unseen)
    const tile<T> t{.batch = in.b, .head = u.head, .kv_head = in.hk, .q_first = u.q0, .k_first = k_first,
                    .rows = rows, .cols = cols, .q_pos = u.q_pos, .k_pos = k_pos, .q = in.q,
                    .k = const_matrix_map<T>(in.ops.k.data(), std::min(cols, in.ops.k.rows()), dim_,
                                             Eigen::OuterStride<>(in.ops.k.outerStride()))};
    if constexpr (has_score_terms<Bound, T>) enc_.add_score_terms(t, scale_, s);
    if (softcap_ > T(0)) softcap_tile<T>(s, softcap_);
    if constexpr (has_position_bias<Bound, T>) enc_.add_position_bias(t, s);
    if (!sched_.all_visible(in.blk, u))
      mask_tile<T>(s, u.q_pos, k_pos, sched_.masks().kv(in.b) + in.blk.first, in.blk.valid != in.blk.cols,
                   sched_.masks().causal, in.blk.ascending, sched_.masks().window);

    online_softmax<T>& sm = st.softmax;
    matrix_map<T> acc(st.acc_out.data(), rows, vdim_, Eigen::OuterStride<>(vdim_));
    if (sm.step(s)) {
      acc = sm.alpha.asDiagonal() * acc;
      if constexpr (value_terms) bucket_sums(rows, st) = sm.alpha.asDiagonal() * bucket_sums(rows, st);
    }
    if (u.packed) {  // out^T (dv x queries) += V^T P^T
      gemm::pack_b(scratch::at_least(sc.p_packed, rows * cols), s.data(), cols, rows, cols);
      gemm::multiply(acc.data(), vdim_, in.ops.v_packed, sc.p_packed.data(), vdim_, cols, rows, T(1), in.kcols,
                     chunk_pv_);
    } else {
      acc.noalias() += s * in.ops.v.topRows(cols);
    }
    if constexpr (value_terms) add_bucket_mass(t, s, st, sc);
  }

  /// out rows of the unit = (O + A * value_table) / l, after the head's sink joined l (zeros for
  /// rows that see no key, NaN for poisoned rows), and their lse when asked for.
  void finish(const query_unit& u, unit_state& st, matrix_map<T> dst, T* lse) const {
    matrix_map<T> acc(st.acc_out.data(), u.rows, vdim_, Eigen::OuterStride<>(vdim_));
    if constexpr (value_terms)
      if (buckets_ > 0) acc.noalias() += bucket_sums(u.rows, st) * enc_.template value_table<T>(u.head);
    online_softmax<T>& sm = st.softmax;
    if (!sinks_.empty())
      for (index_t r = 0; r < u.rows; ++r) {
        const T a = sm.fold_sink(r, sinks_[static_cast<std::size_t>(u.head)]);
        if (a != T(1)) acc.row(r) *= a;
      }
    for (index_t r = 0; r < u.rows; ++r) sm.finish_row(r, dst.row(r), acc.row(r));
    if (lse != nullptr)
      for (index_t r = 0; r < u.rows; ++r) lse[r] = sm.lse(r);
  }

  /// Whether some visible pair got a bucket outside the value table (an encoding bug).
  [[nodiscard]] bool bad_bucket() const { return bad_bucket_.load(); }

 private:
  matrix_map<T> bucket_sums(index_t rows, unit_state& st) const {
    return matrix_map<T>(st.acc_buckets.data(), rows, buckets_, Eigen::OuterStride<>(std::max<index_t>(buckets_, 1)));
  }

  /// A += the weights of the tile summed per value bucket: per row when the encoding says the whole
  /// tile falls in one bucket (uniform_value_bucket), else pair by pair.
  void add_bucket_mass(const tile<T>& t, const matrix_map<T>& p, unit_state& st, scratch& sc) {
    matrix_map<T> sums = bucket_sums(t.rows, st);
    if constexpr (has_uniform_value_bucket<Bound, T>) {
      const std::int32_t c = enc_.uniform_value_bucket(t);
      if (c >= 0) {
        if (c < buckets_) sums.col(c) += p.rowwise().sum();
        else if ((p.array() > T(0)).any()) bad_bucket_.store(true);
        return;
      }
    }
    index_tile idx(scratch::at_least(sc.buckets, t.rows * t.cols), t.rows, t.cols, Eigen::OuterStride<>(t.cols));
    enc_.value_buckets(t, idx);
    for (index_t i = 0; i < t.rows; ++i)
      for (index_t j = 0; j < t.cols; ++j) {
        const std::int32_t c = idx(i, j);
        // Masked pairs (weight 0) may carry any index; a visible pair with an index outside the table
        // is an encoding bug, reported after the call (docs/design.md › Errors).
        if (c < 0 || c >= buckets_) {
          if (p(i, j) > T(0)) bad_bucket_.store(true);
          continue;
        }
        sums(i, c) += p(i, j);
      }
  }

  const Bound& enc_;
  const attention_schedule& sched_;
  T scale_, softcap_;
  std::vector<T> sinks_;
  index_t dim_, vdim_, buckets_, chunk_s_, chunk_pv_;
  std::atomic<bool> bad_bucket_{false};
};

}  // namespace posenc::detail
