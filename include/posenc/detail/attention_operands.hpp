// posenc/detail/attention_operands.hpp — the fused kernel's operand supply: where a tile's queries,
// keys and values come from (the caller's rows, transformed copies, packed copies) and their prefetch.
//
// Queries are prepared once per unit: transformed (Q/K transform hook), then packed as GEBP's B
// operand, or scaled for the expression path. Keys come from one of three stores (key_store):
//   caller  no key transform: the caller's rows, packed per item and block;
//   item    one item holds all of a kv head's queries: it transforms each block it uses itself;
//   shared  a kv head's queries span several items: every key block some query sees is transformed
//           once per call, before the items run (prepare), into a copy all items read.
// and, independently, a store may hold only the packed form (no hook reads the transformed keys and
// every query block multiplies on packed operands): the transform then writes straight into the
// packed layout, a few rows at a time through L1 (transform_packed).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include <Eigen/Core>

#include "posenc/detail/attention_schedule.hpp"
#include "posenc/detail/kv_storage.hpp"
#include "posenc/detail/online_softmax.hpp"
#include "posenc/detail/prefetch.hpp"
#include "posenc/detail/thread.hpp"
#include "posenc/detail/tile_gemm.hpp"
#include "posenc/encoding.hpp"

namespace posenc::detail {

/// Per-thread buffers (thread_scratch: kept from call to call), grown to the largest tile the thread
/// meets and reused by its items (maps give them each tile's shape: an Eigen resize would reallocate
/// at every shape change).
template <class T>
struct attention_scratch {
  using buffer = typename tile_gemm<T>::buffer;
  /// Per query unit of an item.
  struct unit_state {
    buffer q_work;    ///< transformed queries (when a hook reads them or Q is not packed)
    buffer q_scaled;  ///< scale * queries: left operand of the expression path
    buffer q_packed;  ///< queries packed as the B operand of S^T = K Q^T (packed path)
    buffer acc_out, acc_buckets;
    online_softmax<T> softmax;
  };
  std::vector<unit_state> units;
  buffer k_work;    ///< a transformed key block (key_store::item, unpacked)
  buffer qk_piece;  ///< a few transformed rows on their way to a packed operand (transform_packed)
  buffer k_wide, v_wide;  ///< a block of a half-precision cache, widened to T (detail/kv_storage.hpp)
  buffer k_packed, v_packed, p_packed, scores;
  Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> buckets;
  std::vector<block_plan> plan;  ///< the current item's key blocks

  /// Grows b to at least n elements (never shrinks, so no reallocation once the largest tile is seen).
  template <class B>
  static auto* at_least(B& b, index_t n) {
    if (b.size() < n) b.resize(n);
    return b.data();
  }
};

enum class key_store { caller, item, shared };

/// A key block's operands for the tiles of one item.
template <class T>
struct block_operands {
  const_matrix_map<T> k;  ///< the keys as rows (no rows when only the packed form exists)
  const T* k_packed;      ///< GEBP's A operand (null when no unit of the item is packed)
  const_matrix_map<T> v;  ///< the caller's value rows
  const T* v_packed;      ///< V^T packed as GEBP's A operand (null when no unit is packed)
};

template <class T, class KV, class Bound>
class operand_supply {
 public:
  using gemm = tile_gemm<T>;
  using scratch = attention_scratch<T>;
  static constexpr bool transforms_queries = has_qk_transform<Bound, T>;
  static constexpr bool transforms_keys = has_key_transform<Bound, T>;
  /// Whether a hook receives the tile's (transformed) queries and keys.
  static constexpr bool hooks_read_qk =
      has_score_terms<Bound, T> || has_position_bias<Bound, T> || has_value_terms<Bound, T>;

  operand_supply(heads_view<const T> q, heads_view<const KV> k, heads_view<const KV> v, const Bound& enc,
                 const attention_schedule& sched, T scale)
      : q_(q), k_(k), v_(v), enc_(enc), sched_(sched), scale_(scale), dim_(q.dim()), vdim_(v.dim()),
        kv_heads_(k.heads()) {
    if (!transforms_keys) store_ = key_store::caller;
    else store_ = sched.one_item_per_kv_head() ? key_store::item : key_store::shared;
    packed_only_ = transforms_keys && !hooks_read_qk && sched.all_packed();
    // Rows per piece of transform_packed: whole packing steps, about 16 KiB, so the piece stays in L1
    // (docs/performance.md › Transformed operands).
    const index_t rows_in_16k = 16384 / static_cast<index_t>(sizeof(T)) / std::max<index_t>(dim_, 1);
    piece_rows_ = std::max<index_t>(1, rows_in_16k / gemm::pack_step) * gemm::pack_step;
  }

  /// Before the items: the shared transformed keys (key_store::shared), every block some query sees,
  /// one work item per (batch, kv head, block). Blocks nobody sees are neither transformed nor read.
  void prepare(Eigen::ThreadPoolInterface* pool) {
    if constexpr (transforms_keys) prepare_shared_keys(pool);
    else (void)pool;
  }

  /// The unit's queries, transformed once (Q/K transforms), packed or scaled for the score products
  /// (into st). Returns the (transformed) queries for the hooks: no rows when no hook reads them and
  /// they were transformed straight into the packed operand.
  const_matrix_map<T> queries(index_t b, const query_unit& u, scratch& sc, typename scratch::unit_state& st) const {
    const std::span<const std::int64_t> pos(u.q_pos, static_cast<std::size_t>(u.rows));
    if constexpr (transforms_queries && !hooks_read_qk) {
      if (u.packed) {
        transform_packed(qk_role::query, u.head, pos, q_.matrix(b, u.head, u.q0, u.rows),
                         scratch::at_least(st.q_packed, u.rows * dim_), false, sc);
        return no_rows();
      }
    }
    const const_matrix_map<T> q = [&] {
      if constexpr (transforms_queries) {
        matrix_map<T> qt(scratch::at_least(st.q_work, u.rows * dim_), u.rows, dim_, Eigen::OuterStride<>(dim_));
        transform_into(qk_role::query, u.head, pos, q_.matrix(b, u.head, u.q0, u.rows), qt);
        return const_matrix_map<T>(qt.data(), u.rows, dim_, Eigen::OuterStride<>(dim_));
      } else {
        return q_.matrix(b, u.head, u.q0, u.rows);
      }
    }();
    if (u.packed) {  // the logit scale is the product's alpha
      gemm::pack_b(scratch::at_least(st.q_packed, u.rows * dim_), q.data(), q.outerStride(), u.rows, dim_);
    } else {  // the scale on Q: `(Q K^T) * scale` would be evaluated coefficient-wise
      matrix_map<T>(scratch::at_least(st.q_scaled, u.rows * dim_), u.rows, dim_, Eigen::OuterStride<>(dim_)) =
          q * scale_;
    }
    return q;
  }

  /// The first p.kcols keys and values of block p.kb of (batch b, kv head hk), packed once for all
  /// units of the item when one of them multiplies on packed operands.
  block_operands<T> block(index_t b, index_t hk, const block_plan& p, scratch& sc) const {
    const key_block& blk = sched_.block(b, p.kb);
    const index_t kcols = p.kcols;
    const T* k_packed = nullptr;
    const const_matrix_map<T> k = [&]() -> const_matrix_map<T> {
      if constexpr (transforms_keys) {
        switch (store_) {
          case key_store::item:
            if (packed_only_) {
              T* packed = scratch::at_least(sc.k_packed, blk.cols * dim_);
              transform_packed(qk_role::key, hk, sched_.key_positions(b, blk), caller_keys(b, hk, blk, sc), packed,
                               true, sc);
              k_packed = packed;
              return no_rows();
            } else {
              matrix_map<T> kt(scratch::at_least(sc.k_work, blk.cols * dim_), blk.cols, dim_,
                               Eigen::OuterStride<>(dim_));
              transform_into(qk_role::key, hk, sched_.key_positions(b, blk), caller_keys(b, hk, blk, sc), kt);
              return const_matrix_map<T>(kt.data(), kcols, dim_, Eigen::OuterStride<>(dim_));
            }
          case key_store::shared:
            if (packed_only_) {
              k_packed = shared_block(b, hk, p.kb);
              return no_rows();
            }
            return const_matrix_map<T>(shared_block(b, hk, p.kb), kcols, dim_, Eigen::OuterStride<>(dim_));
          case key_store::caller:
            break;
        }
      }
      return rows_as<T>(k_, b, hk, blk.first, kcols, sc.k_wide);
    }();
    const const_matrix_map<T> v = rows_as<T>(v_, b, hk, blk.first, kcols, sc.v_wide);
    const T* v_packed = nullptr;
    if (p.any_packed) {
      if (k_packed == nullptr) {
        gemm::pack_a(scratch::at_least(sc.k_packed, kcols * dim_), k.data(), k.outerStride(), kcols, dim_);
        k_packed = sc.k_packed.data();
      }
      gemm::pack_a_transposed(scratch::at_least(sc.v_packed, kcols * vdim_), v.data(), v.outerStride(), vdim_, kcols);
      v_packed = sc.v_packed.data();
    }
    return {k, k_packed, v, v_packed};
  }

  /// Prefetches rows r0 .. r1-1 of block p for its first use: the keys the block's supply reads (the
  /// caller's rows, or the shared transformed block) and the values. Host rows are 2-4 KiB apart in
  /// BSHD, a new page each, so unprefetched reads run at the memory latency (docs/performance.md ›
  /// Prefetch).
  POSENC_ALWAYS_INLINE void prefetch_block(index_t b, index_t hk, const block_plan& p, index_t r0, index_t r1) const {
    const index_t first = sched_.block(b, p.kb).first + r0;
    if (store_ == key_store::shared) {
      const T* block = shared_block(b, hk, p.kb);
      prefetch_bytes(block + r0 * dim_, (r1 - r0) * dim_ * static_cast<index_t>(sizeof(T)), false);
    } else {
      prefetch_rows(k_.matrix(b, hk, first, r1 - r0), false);
    }
    prefetch_rows(v_.matrix(b, hk, first, r1 - r0), false);
  }

  POSENC_ALWAYS_INLINE void prefetch_queries(index_t b, const query_unit& u) const {
    prefetch_rows(q_.matrix(b, u.head, u.q0, u.rows), false);
  }

 private:
  void prepare_shared_keys(Eigen::ThreadPoolInterface* pool) {
    if (store_ != key_store::shared) return;
    const index_t blocks = sched_.masks().batch * kv_heads_ * sched_.k_blocks();
    // Uninitialized: every block a query reads is written here first (a zero fill would be one more
    // pass over O(batch x kv_heads x L x d) memory). Eigen aligns it for the packed layout's loads.
    scratch::at_least(shared_keys_, blocks * shared_block_size());
    for_each_item<scratch>(pool, blocks, [](scratch&) {}, [&](index_t i, scratch& sc) {
      const index_t kb = i % sched_.k_blocks(), bh = i / sched_.k_blocks();
      const index_t b = bh / kv_heads_, hk = bh % kv_heads_;
      const key_block& blk = sched_.block(b, kb);
      if (!sched_.block_seen(b, blk)) return;
      T* dst = shared_keys_.data() + shared_offset(b, hk, kb);
      if (packed_only_)
        transform_packed(qk_role::key, hk, sched_.key_positions(b, blk), caller_keys(b, hk, blk, sc), dst, true, sc);
      else transform_into(qk_role::key, hk, sched_.key_positions(b, blk), caller_keys(b, hk, blk, sc),
                          matrix_map<T>(dst, blk.cols, dim_, Eigen::OuterStride<>(dim_)));
    });
  }

  /// dst = transform(src): in one pass when the encoding has the out-of-place form, else a copy and
  /// the in-place form.
  void transform_into(qk_role role, index_t head, std::span<const std::int64_t> pos, const const_matrix_map<T>& src,
                      matrix_map<T> dst) const {
    if constexpr (has_qk_transform_copy<Bound, T>) {
      enc_.transform_qk(role, head, pos, src, dst);
    } else {
      dst = src;
      enc_.transform_qk(role, head, pos, dst);
    }
  }

  /// Q/K transform of `src` straight into its packed layout (`as_a`: GEBP's A operand, keys; else its
  /// B operand, queries), piece_rows_ rows at a time through an L1-resident buffer, so the transformed
  /// rows never make a round trip through L2 (packing piecewise gives the whole's layout:
  /// tile_gemm::pack_step).
  void transform_packed(qk_role role, index_t head, std::span<const std::int64_t> pos, const const_matrix_map<T>& src,
                        T* packed, bool as_a, scratch& sc) const {
    T* piece = scratch::at_least(sc.qk_piece, piece_rows_ * dim_);
    const index_t rows = src.rows();
    for (index_t r = 0; r < rows; r += piece_rows_) {
      const index_t n = std::min(piece_rows_, rows - r);
      transform_into(role, head, pos.subspan(static_cast<std::size_t>(r), static_cast<std::size_t>(n)),
                     const_matrix_map<T>(src.data() + r * src.outerStride(), n, dim_,
                                         Eigen::OuterStride<>(src.outerStride())),
                     matrix_map<T>(piece, n, dim_, Eigen::OuterStride<>(dim_)));
      if (as_a) gemm::pack_a(packed + r * dim_, piece, dim_, n, dim_);
      else gemm::pack_b(packed + r * dim_, piece, dim_, n, dim_);
    }
  }

  /// The block's keys as the caller stored them, widened to T for a half-precision cache.
  [[nodiscard]] const_matrix_map<T> caller_keys(index_t b, index_t hk, const key_block& blk, scratch& sc) const {
    return rows_as<T>(k_, b, hk, blk.first, blk.cols, sc.k_wide);
  }

  /// Queries or keys that went straight into a packed operand: nothing unpacked for the hooks to read.
  [[nodiscard]] const_matrix_map<T> no_rows() const {
    return const_matrix_map<T>(nullptr, 0, dim_, Eigen::OuterStride<>(dim_));
  }

  /// Elements per block of the shared keys: a whole number of the alignment the packed layout's
  /// packet loads need.
  [[nodiscard]] index_t shared_block_size() const {
    constexpr index_t align = EIGEN_MAX_ALIGN_BYTES / static_cast<index_t>(sizeof(T));
    return (sched_.max_k_cols() * dim_ + align - 1) / align * align;
  }

  /// Where key block kb of (batch b, kv head hk) starts in the shared keys.
  [[nodiscard]] index_t shared_offset(index_t b, index_t hk, index_t kb) const {
    return ((b * kv_heads_ + hk) * sched_.k_blocks() + kb) * shared_block_size();
  }
  [[nodiscard]] const T* shared_block(index_t b, index_t hk, index_t kb) const {
    return shared_keys_.data() + shared_offset(b, hk, kb);
  }

  heads_view<const T> q_;
  heads_view<const KV> k_, v_;
  const Bound& enc_;
  const attention_schedule& sched_;
  T scale_;
  index_t dim_, vdim_, kv_heads_;
  key_store store_ = key_store::caller;
  bool packed_only_ = false;
  index_t piece_rows_ = 1;  ///< rows per piece of transform_packed
  typename gemm::buffer shared_keys_;  ///< key_store::shared: per (batch, kv head, key block)
};

}  // namespace posenc::detail
