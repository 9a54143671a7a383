// posenc/attention.hpp — the fused multi-head attention kernel: tiled, online softmax, every hook of
// the encoding contract (posenc/encoding.hpp) applied inside the tile loop, threads over
// (batch, head, query block).
//
// For one (batch, head) and one block of queries the kernel walks the key blocks in a fixed order:
//   S  = (scale * Q_blk) K_blk^T                           one GEMM (the scale folded into a copy of
//                                                          Q_blk: Eigen evaluates `(Q K^T) * scale`
//                                                          coefficient-wise, 2-5x slower)
//   S += scale * score_terms ; S += position_bias          encoding hooks, per tile
//   S  = -inf where not visible                            causal by positions, key padding
//   online softmax (detail/online_softmax.hpp)             running max m, running sum l per row
//   O  = alpha O + P V_blk ; A = alpha A + bucket mass(P)  value terms per bucket (A: rows x buckets)
// and finally out = (O + A * table) / l, lse = m + log l. Q/K transforms run once per token before
// the loop (keys: into a working copy per (batch, kv head); queries: into the query block's copy).
// Nothing proportional to q_len x k_len is ever allocated: per worker O(q_block x k_block) scores
// plus O(q_block x d) copies; per call O(batch x len) positions (and the transformed keys, O(L d)
// per kv head, only for encodings with a Q/K transform). transform_qk receives the query head for
// queries and the kv head for keys (each kv head is transformed once, not once per query head).
//
// Threads: options.pool (an Eigen::ThreadPoolInterface, detail/thread.hpp) runs the work items
// (batch, head, query block); each item is computed by one thread with a fixed key-block order, so
// the result is bitwise identical for any thread count. The tile products are single-threaded: the
// kernel never calls Eigen::setNbThreads. (A program built with -fopenmp should call
// Eigen::setNbThreads(1) or define EIGEN_DONT_PARALLELIZE when it passes a pool, or Eigen would split
// every tile product over OpenMP threads on top of the pool's.)
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "posenc/detail/mask.hpp"
#include "posenc/detail/online_softmax.hpp"
#include "posenc/detail/thread.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/options.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

namespace detail {

template <class T>
using row_matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Default tile sizes, chosen by measurement (docs/performance.md; clang 14 -O3 -march=native,
// float, H = 8, 1 thread). Every product re-packs its operands (Eigen's GEMM cannot keep a packed
// K or V block across calls) and a profile puts packing at ~1/4 of the kernel's time, so a taller
// query block (K and V packed once per 256 query rows instead of 128) pays off; the key block then
// stays at 256 so the 256 x 256 score tile is as small as 128 x 512 (256 KiB in float, in L2 with
// the K/V blocks). Measured ms per call, 128 x 512 -> 256 x 256, same process order, twice:
//   L = 2048, d = 128 dense 203/179 -> 176/169, causal 108/104 -> 111/105;
//   L = 512,  d = 128 dense 13.3/12.0 -> 11.2/9.84, causal 8.6/7.5 -> 8.6/8.0;
//   L = 2048, d = 64  dense 115/106 -> 101/96,  causal 61.5/58.2 -> 58.3/57.1.
// Blocks of 64 rows were 20-60 % slower, key blocks of 1024 15-25 % slower (the score tile leaves
// L2), and 256 x 384 / 256 x 288 / 128 x 384 did not beat these.
inline constexpr index default_q_block = 256;
inline constexpr index default_k_block = 256;

/// Summary of one key block of one batch row: lets the kernel skip blocks nothing can see and
/// avoid masking blocks everything sees.
struct key_block {
  index first = 0, cols = 0;
  index valid = 0;                           ///< keys that are not padding
  std::int64_t pos_min = 0, pos_max = 0;     ///< over all keys of the block
  bool ascending = true;                     ///< positions non-decreasing (the usual case)
};

inline std::vector<key_block> summarize_key_blocks(const call_masks& m, index block) {
  const index nkb = m.k_len == 0 ? 0 : (m.k_len + block - 1) / block;
  std::vector<key_block> out(static_cast<std::size_t>(m.batch * nkb));
  for (index b = 0; b < m.batch; ++b) {
    const std::int64_t* pos = m.kp(b);
    const unsigned char* valid = m.kv(b);
    for (index kb = 0; kb < nkb; ++kb) {
      key_block& s = out[static_cast<std::size_t>(b * nkb + kb)];
      s.first = kb * block;
      s.cols = std::min(block, m.k_len - s.first);
      s.pos_min = std::numeric_limits<std::int64_t>::max();
      s.pos_max = std::numeric_limits<std::int64_t>::min();
      for (index j = s.first; j < s.first + s.cols; ++j) {
        s.valid += valid[j] != 0 ? 1 : 0;
        s.pos_min = std::min(s.pos_min, pos[j]);
        s.pos_max = std::max(s.pos_max, pos[j]);
        if (j > s.first && pos[j] < pos[j - 1]) s.ascending = false;
      }
    }
  }
  return out;
}

/// Sets the invisible scores of a tile to -inf (call_masks::visible, per tile): padding keys by
/// column, causal by comparing positions (a prefix per row when the key positions ascend).
template <class T>
void mask_tile(matrix_map<T> s, const std::int64_t* q_pos, const std::int64_t* k_pos, const unsigned char* k_valid,
               bool has_padding, bool causal, bool ascending) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const index rows = s.rows(), cols = s.cols();
  if (has_padding)
    for (index j = 0; j < cols; ++j)
      if (k_valid[j] == 0) s.col(j).setConstant(neg_inf);
  if (!causal) return;
  if (ascending) {
    for (index i = 0; i < rows; ++i) {
      const index seen = std::upper_bound(k_pos, k_pos + cols, q_pos[i]) - k_pos;
      s.row(i).tail(cols - seen).setConstant(neg_inf);
    }
  } else {
    for (index i = 0; i < rows; ++i)
      for (index j = 0; j < cols; ++j)
        if (k_pos[j] > q_pos[i]) s(i, j) = neg_inf;
  }
}

template <class A, class B>
[[nodiscard]] bool memory_overlaps(const heads_view<A>& x, const heads_view<B>& y) {
  if (x.size() == 0 || y.size() == 0) return false;
  const auto* x0 = reinterpret_cast<const char*>(x.data());
  const auto* y0 = reinterpret_cast<const char*>(y.data());
  const auto* x1 = x0 + x.size() * static_cast<index>(sizeof(*x.data()));
  const auto* y1 = y0 + y.size() * static_cast<index>(sizeof(*y.data()));
  return std::less<const char*>{}(x0, y1) && std::less<const char*>{}(y0, x1);
}

/// Per-worker buffers, allocated once per worker at the maximum tile size.
template <class T>
struct attention_scratch {
  row_matrix<T> q_scaled, q_transformed, scores, acc_out, acc_buckets;
  Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> buckets;
  online_softmax<T> softmax;
};

template <class T, class Bound>
class fused_attention {
 public:
  static constexpr bool transforms = has_qk_transform<Bound, T>;
  static constexpr bool score_terms = has_score_terms<Bound, T>;
  static constexpr bool position_bias = has_position_bias<Bound, T>;
  static constexpr bool value_terms = has_value_terms<Bound, T>;

  fused_attention(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
                  T* lse, const Bound& enc, const call_masks& masks, T scale, index q_block, index k_block,
                  index buckets)
      : q_(q), k_(k), v_(v), out_(out), lse_(lse), enc_(enc), masks_(masks), scale_(scale), q_block_(q_block),
        k_block_(k_block), buckets_(buckets), heads_(q.heads()), kv_heads_(k.heads()), dim_(q.dim()),
        vdim_(v.dim()), q_len_(q.seq()), k_len_(k.seq()),
        q_blocks_(q_len_ == 0 ? 0 : (q_len_ + q_block - 1) / q_block),
        k_blocks_(k_len_ == 0 ? 0 : (k_len_ + k_block - 1) / k_block),
        key_blocks_(summarize_key_blocks(masks, k_block)) {}

  void run(Eigen::ThreadPoolInterface* pool) {
    if constexpr (transforms) transform_keys(pool);
    // Items of one (batch, head) are consecutive, so the threads walk the same K/V blocks one after
    // the other (they stay in cache when a head's K/V fit; at L = 2048, d = 128 the order made no
    // measurable difference here). Within a head the last query blocks come first: under a causal
    // mask they see the most keys, so the dynamic schedule ends with short items and the threads
    // finish together.
    const index per_head = q_blocks_;
    for_each_item(
        pool, q_blocks_ * q_.batch() * heads_, [&] { return make_scratch(); },
        [&](index item, attention_scratch<T>& sc) {
          const index bh = item / per_head, qb = q_blocks_ - 1 - item % per_head;
          run_item(bh / heads_, bh % heads_, qb, sc);
        });
    require(!bad_bucket_.load(), "encoding", "value_buckets must return indices in [0, value_bucket_count())");
  }

 private:
  attention_scratch<T> make_scratch() const {
    attention_scratch<T> sc;
    const index qb = std::min(q_block_, q_len_), kb = std::min(k_block_, k_len_);
    sc.q_scaled.resize(qb, dim_);
    if constexpr (transforms) sc.q_transformed.resize(qb, dim_);
    sc.scores.resize(qb, kb);
    sc.acc_out.resize(qb, vdim_);
    if constexpr (value_terms) {
      sc.buckets.resize(qb, kb);
      sc.acc_buckets.resize(qb, buckets_);
    }
    return sc;
  }

  // Q/K transforms once per key token, each kv head once (not once per query head of a GQA group).
  void transform_keys(Eigen::ThreadPoolInterface* pool) {
    // Uninitialized: every element is written by the copy below (a zero fill would be one more pass
    // over O(batch x kv_heads x L x d) memory per call).
    keys_ = std::make_unique_for_overwrite<T[]>(static_cast<std::size_t>(q_.batch() * kv_heads_ * k_len_ * dim_));
    for_each_item(
        pool, q_.batch() * kv_heads_, [] { return 0; },
        [&](index item, int&) {
          const index b = item / kv_heads_, hk = item % kv_heads_;
          matrix_map<T> x(keys_.get() + item * k_len_ * dim_, k_len_, dim_, Eigen::OuterStride<>(dim_));
          x = k_.matrix(b, hk);
          enc_.transform_qk(qk_role::key, hk, std::span<const std::int64_t>(masks_.kp(b), k_len_), x);
        });
  }

  [[nodiscard]] const_matrix_map<T> keys(index b, index hk, index first, index count) const {
    if constexpr (transforms)
      return const_matrix_map<T>(keys_.get() + ((b * kv_heads_ + hk) * k_len_ + first) * dim_, count, dim_,
                                 Eigen::OuterStride<>(dim_));
    else
      return k_.matrix(b, hk, first, count);
  }

  void run_item(index b, index h, index qb, attention_scratch<T>& sc) {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    const index hk = kv_head_of(h, heads_, kv_heads_);
    const index q0 = qb * q_block_, rows = std::min(q_block_, q_len_ - q0);
    const std::int64_t* q_pos = masks_.qp(b) + q0;
    const std::int64_t* k_pos = masks_.kp(b);
    const unsigned char* k_valid = masks_.kv(b);
    const auto [qmin_it, qmax_it] = std::minmax_element(q_pos, q_pos + rows);
    const std::int64_t q_min = *qmin_it, q_max = *qmax_it;
    const bool causal = masks_.causal;

    // The query block: transformed once per token (this item is the only one that owns these rows),
    // then a copy scaled by the logit scale, the left operand of every score product.
    const const_matrix_map<T> q_tile = [&] {
      if constexpr (transforms) {
        matrix_map<T> qt(sc.q_transformed.data(), rows, dim_, Eigen::OuterStride<>(dim_));
        qt = q_.matrix(b, h, q0, rows);
        enc_.transform_qk(qk_role::query, h, std::span<const std::int64_t>(q_pos, rows), qt);
        return const_matrix_map<T>(qt.data(), rows, dim_, Eigen::OuterStride<>(dim_));
      } else {
        return q_.matrix(b, h, q0, rows);
      }
    }();
    matrix_map<T> q_scaled(sc.q_scaled.data(), rows, dim_, Eigen::OuterStride<>(dim_));
    q_scaled = q_tile * scale_;

    matrix_map<T> acc(sc.acc_out.data(), rows, vdim_, Eigen::OuterStride<>(vdim_));
    acc.setZero();
    matrix_map<T> acc_buckets(sc.acc_buckets.data(), rows, buckets_, Eigen::OuterStride<>(buckets_));
    if constexpr (value_terms) acc_buckets.setZero();
    online_softmax<T>& sm = sc.softmax;
    sm.reset(rows);

    for (index kb = 0; kb < k_blocks_; ++kb) {
      const key_block& blk = key_blocks_[static_cast<std::size_t>(b * k_blocks_ + kb)];
      if (blk.valid == 0) continue;                    // every key is padding
      if (causal && blk.pos_min > q_max) continue;     // above the causal diagonal: nothing visible
      index cols = blk.cols;
      if (causal && blk.ascending)                     // drop the keys past the last query's position
        cols = std::upper_bound(k_pos + blk.first, k_pos + blk.first + blk.cols, q_max) - (k_pos + blk.first);
      const bool all_visible = blk.valid == blk.cols && (!causal || blk.pos_max <= q_min);

      const const_matrix_map<T> k_tile = keys(b, hk, blk.first, cols);
      matrix_map<T> s(sc.scores.data(), rows, cols, Eigen::OuterStride<>(cols));
      s.noalias() = q_scaled * k_tile.transpose();

      const tile<T> t{.batch = b, .head = h, .kv_head = hk, .q_first = q0, .k_first = blk.first, .rows = rows,
                      .cols = cols, .q_pos = q_pos, .k_pos = k_pos + blk.first, .q = q_tile, .k = k_tile};
      if constexpr (score_terms) enc_.add_score_terms(t, scale_, s);
      if constexpr (position_bias) enc_.add_position_bias(t, s);
      if (!all_visible)
        mask_tile<T>(s, q_pos, k_pos + blk.first, k_valid + blk.first, blk.valid != blk.cols, causal,
                     blk.ascending);

      if (sm.step(s)) {
        acc = sm.alpha.asDiagonal() * acc;
        if constexpr (value_terms) acc_buckets = sm.alpha.asDiagonal() * acc_buckets;
      }
      acc.noalias() += s * v_.matrix(b, hk, blk.first, cols);

      if constexpr (value_terms) {
        index_tile idx(sc.buckets.data(), rows, cols, Eigen::OuterStride<>(cols));
        enc_.value_buckets(t, idx);
        for (index i = 0; i < rows; ++i)
          for (index j = 0; j < cols; ++j) {
            const std::int32_t c = idx(i, j);
            // Masked pairs (weight 0) may carry any index; a visible pair with an index outside the
            // table is an encoding bug, reported after the call (a worker thread cannot throw). It is
            // the one error detected after writing: `out` is then unspecified.
            if (c < 0 || c >= buckets_) {
              if (s(i, j) != T(0)) bad_bucket_.store(true);
              continue;
            }
            acc_buckets(i, c) += s(i, j);
          }
      }
    }

    if constexpr (value_terms) {
      if (buckets_ > 0) acc.noalias() += acc_buckets * enc_.template value_table<T>(h);
    }
    auto dst = out_.matrix(b, h, q0, rows);
    for (index i = 0; i < rows; ++i) {
      if (sm.l(i) > T(0)) dst.row(i) = acc.row(i) * (T(1) / sm.l(i));
      else dst.row(i).setZero();  // the row sees no key
    }
    if (lse_ != nullptr) {
      T* row_lse = lse_ + (b * heads_ + h) * q_len_ + q0;
      for (index i = 0; i < rows; ++i) row_lse[i] = sm.l(i) > T(0) ? sm.lse(i) : neg_inf;
    }
  }

  heads_view<const T> q_, k_, v_;
  heads_view<T> out_;
  T* lse_;
  const Bound& enc_;
  const call_masks& masks_;
  T scale_;
  index q_block_, k_block_, buckets_;
  index heads_, kv_heads_, dim_, vdim_, q_len_, k_len_, q_blocks_, k_blocks_;
  std::vector<key_block> key_blocks_;
  std::unique_ptr<T[]> keys_;  // transformed keys [batch, kv_heads, k_len, dim] (Q/K transforms only)
  std::atomic<bool> bad_bucket_{false};
};

/// Everything the public overloads share: validation first (nothing written on error), then the
/// kernel.
template <class T, class E>
void attention_impl(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
                    std::optional<tensor_map<T, 3>> lse, const E& enc, const attention_options& opt) {
  static_assert(has_attention_hook<E, T>, "posenc::attention: the encoding has no hook for this scalar type");
  check_attention_shapes<T>(q, k, v, out);
  const index B = q.batch(), H = q.heads(), Hkv = k.heads(), Sq = q.seq(), Sk = k.seq(), D = q.dim(), Dv = v.dim();
  if (lse)
    require(lse->dimension(0) == B && lse->dimension(1) == H && lse->dimension(2) == Sq, "lse",
            "must be [batch, heads, q_len]", "[", lse->dimension(0), ", ", lse->dimension(1), ", ",
            lse->dimension(2), "] for [", B, ", ", H, ", ", Sq, "]");
  require(opt.q_block >= 0, "q_block", "must be >= 0 (0 = default)", opt.q_block);
  require(opt.k_block >= 0, "k_block", "must be >= 0 (0 = default)", opt.k_block);
  const double scale = opt.scale ? *opt.scale : default_logit_scale(enc, D);
  require(std::isfinite(scale), "scale", "must be finite", scale);
  require(!memory_overlaps(out, q), "out", "must not overlap q");
  require(!memory_overlaps(out, k), "out", "must not overlap k");
  require(!memory_overlaps(out, v), "out", "must not overlap v");
  if (lse && lse->size() > 0) {
    const heads_view<const T> lv(lse->data(), 1, 1, 1, lse->size(), layout::bshd);
    require(!memory_overlaps(out, lv) && !memory_overlaps(lv, q) && !memory_overlaps(lv, k) &&
                !memory_overlaps(lv, v),
            "lse", "must not overlap q, k, v or out");
  }
  const call_masks masks = resolve_masks(opt, B, Sq, Sk);
  auto&& bound = bind_encoding(enc, masks.info(H, Hkv, D, Dv));
  using bound_type = std::remove_cvref_t<decltype(bound)>;

  index buckets = 0;
  if constexpr (has_value_terms<bound_type, T>) {
    buckets = static_cast<index>(bound.value_bucket_count());
    require(buckets >= 0, "encoding", "value_bucket_count must be >= 0", buckets);
    for (index h = 0; h < H; ++h) {
      const const_matrix_map<T> table = bound.template value_table<T>(h);
      require(table.rows() == buckets && table.cols() == Dv, "encoding",
              "value_table(head) must be [value_bucket_count, value_dim]", "[", table.rows(), ", ", table.cols(),
              "] for [", buckets, ", ", Dv, "] at head ", h);
    }
  }
  if (B * H * Sq == 0) return;

  const index q_block = opt.q_block > 0 ? opt.q_block : default_q_block;
  const index k_block = opt.k_block > 0 ? opt.k_block : default_k_block;
  fused_attention<T, bound_type> kernel(q, k, v, out, lse ? lse->data() : nullptr, bound, masks,
                                        static_cast<T>(scale), q_block, k_block, buckets);
  kernel.run(opt.pool);
}

}  // namespace detail

/// Multi-head attention with the encoding's hooks fused in the tile loop.
/// q [batch, q_len, heads, d], k [batch, k_len, kv_heads, d], v [batch, k_len, kv_heads, dv] and
/// out [batch, q_len, heads, dv], each in BSHD or BHSD (heads_view); kv_heads divides heads.
/// Throws posenc::error before writing anything when an argument is invalid.
template <class T, attention_encoding E = no_position>
void attention(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
               const E& enc = {}, const attention_options& opt = {}) {
  detail::attention_impl<T>(q, k, v, out, std::nullopt, enc, opt);
}

/// Same, and writes lse [batch, heads, q_len]: the natural-log log-sum-exp of each row's scaled
/// scores over the visible keys (-inf for a row that sees nothing). With it, two calls over
/// disjoint key ranges combine exactly (merge).
template <class T, attention_encoding E = no_position>
void attention(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
               tensor_map<T, 3> lse, const E& enc = {}, const attention_options& opt = {}) {
  detail::attention_impl<T>(q, k, v, out, std::optional<tensor_map<T, 3>>(lse), enc, opt);
}

/// Exact combination of two partial attentions over disjoint key ranges (split-KV decoding, ring /
/// sequence-parallel attention; FlashAttention-2 section 3.1.1 / Flash-Decoding): with
/// m = max(lse_a, lse_b), w_x = exp(lse_x - m),
///   out = (w_a out_a + w_b out_b) / (w_a + w_b),  lse = m + log(w_a + w_b).
/// A row that neither part sees stays zero with lse -inf. out may be out_a or out_b (same layout).
template <class T>
void merge(heads_view<const T> out_a, tensor_map<const T, 3> lse_a, heads_view<const T> out_b,
           tensor_map<const T, 3> lse_b, heads_view<T> out, tensor_map<T, 3> lse) {
  const index B = out.batch(), S = out.seq(), H = out.heads(), D = out.dim();
  auto same_shape = [&](const heads_view<const T>& x, const char* name) {
    require(x.batch() == B && x.seq() == S && x.heads() == H && x.dim() == D, name,
            "must have out's shape [batch, seq, heads, dim]", "[", x.batch(), ", ", x.seq(), ", ", x.heads(), ", ",
            x.dim(), "] vs [", B, ", ", S, ", ", H, ", ", D, "]");
  };
  same_shape(out_a, "out_a");
  same_shape(out_b, "out_b");
  auto lse_shape = [&](const auto& x, const char* name) {
    require(x.dimension(0) == B && x.dimension(1) == H && x.dimension(2) == S, name,
            "must be [batch, heads, seq]", "[", x.dimension(0), ", ", x.dimension(1), ", ", x.dimension(2),
            "] for [", B, ", ", H, ", ", S, "]");
  };
  lse_shape(lse_a, "lse_a");
  lse_shape(lse_b, "lse_b");
  lse_shape(lse, "lse");
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  for (index b = 0; b < B; ++b)
    for (index h = 0; h < H; ++h)
      for (index s = 0; s < S; ++s) {
        const T la = lse_a(b, h, s), lb = lse_b(b, h, s);
        const T m = std::max(la, lb);
        const T* a = out_a.row(b, s, h);
        const T* c = out_b.row(b, s, h);
        T* o = out.row(b, s, h);
        if (m == neg_inf) {  // neither part sees a key
          for (index d = 0; d < D; ++d) o[d] = T(0);
          lse(b, h, s) = neg_inf;
          continue;
        }
        const T wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
        for (index d = 0; d < D; ++d) o[d] = (wa * a[d] + wb * c[d]) / sum;
        lse(b, h, s) = m + std::log(sum);
      }
}

}  // namespace posenc
