// posenc/attention.hpp — the fused multi-head attention kernel: tiled, online softmax, every hook of
// the encoding contract (posenc/encoding.hpp) applied inside the tile loop, threads over work items
// of (batch, kv head, up to 4 query blocks).
//
// For one (batch, head) and one block of queries the kernel walks the key blocks in a fixed order:
//   S  = scale Q_blk K_blk^T                               one GEBP product on packed operands
//                                                          (detail/tile_gemm.hpp), the scale as the
//                                                          product's alpha
//   S += scale * score_terms ; S += position_bias          encoding hooks, per tile
//   S  = -inf where not visible                            causal by positions, key padding
//   online softmax (detail/online_softmax.hpp)             running max m, running sum l per row
//   O  = alpha O + P V_blk ; A = alpha A + bucket mass(P)  value terms per bucket (A: rows x buckets)
// and finally out = (O + A * table) / l, lse = m + log l.
//
// A work item holds up to default_units_per_item query blocks ("units") of one kv head (several
// query heads under GQA): each K/V block is packed once for all of them and each query block once
// for all key blocks, instead of both operands once per tile as `Q * K.transpose()` would do. Query
// blocks of one row without GQA (MHA decode steps) multiply through Eigen expressions (GEMV).
// Q/K transforms run once per token: queries into the unit's copy; keys into the worker's copy of
// the block when one item holds all of a kv head's queries, else, per block on first use, into a
// copy shared by the kv head's items (key_mode). When no hook reads the transformed rows, they go
// straight into the packed operands, a few rows at a time through L1 (transform_packed).
// transform_qk receives the query head for queries and the kv head for keys (a kv head is
// transformed once for its GQA group).
// Nothing proportional to q_len x k_len is ever allocated: per thread O(units x q_block x d) query
// copies and O(q_block x k_block) scores, kept for the thread's next call; per call O(batch x len)
// positions (and the shared transformed keys, O(L d) per kv head, only for Q/K transforms when a
// kv head's queries span several work items).
//
// Threads: options.pool (an Eigen::ThreadPoolInterface, detail/thread.hpp) runs the work items;
// each item is computed by one thread with a fixed key-block order, and how units are grouped into
// items never changes a unit's arithmetic, so the result is bitwise identical for any thread count.
// The tile products are single-threaded: the kernel never calls Eigen::setNbThreads. (A program
// built with -fopenmp should call Eigen::setNbThreads(1) or define EIGEN_DONT_PARALLELIZE when it
// passes a pool, or Eigen would split every expression-path product over OpenMP threads on top of
// the pool's.)
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "posenc/detail/mask.hpp"
#include "posenc/detail/online_softmax.hpp"
#include "posenc/detail/prefetch.hpp"
#include "posenc/detail/thread.hpp"
#include "posenc/detail/tile_gemm.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/options.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

namespace detail {

// Default tile sizes, chosen by measurement (docs/performance.md; clang 14 -O3 -march=native,
// float, H = 8, 1 thread). With the expression-based products (every operand re-packed per tile)
// 256 x 256 beat 128 x 512, 64-row blocks (20-60 % slower), 1024-key blocks (15-25 % slower: the
// score tile leaves L2) and 256 x 384 / 256 x 288 / 128 x 384. With the packed products, key blocks
// of 192, 240, 288 and 384 were within the VM's noise (+-6 %) of 256 at L = 512 and 2048, d = 128.
inline constexpr index_t default_q_block = 256;
inline constexpr index_t default_k_block = 256;
/// Query blocks (of one kv head) per work item: they share each K/V block's packing. Measured ms at
/// L = 2048, d = 128, 1 thread (two runs, same process order), units 1 -> 2 -> 4 -> 8: dense
/// 179/189 -> 174/182 -> 159/166 -> 171/161, causal 98/113 -> 101/97 -> 94/93 -> 97/91; 4 keeps
/// the item's state (4 x (packed Q + output) = 512 KiB in float) well inside the 2 MiB L2.
inline constexpr index_t default_units_per_item = 4;
/// Where an encoding's Q/K transform puts the transformed keys (each key is transformed once per call).
enum class key_mode {
  caller,         ///< no transform: K is read from the caller's buffer
  worker,         ///< one work item holds all of the kv head's queries: the worker's cache-resident copy
  worker_packed,  ///< the same, transformed straight into the packed block (transform_packed), when no
                  ///< hook reads the tile's keys and every query block is packed
  shared,         ///< items share a copy of K, transformed block by block on first use (ensure_keys)
  shared_packed,  ///< the same, stored packed as GEBP's A operand, so that the items neither re-read
                  ///< the caller's rows nor re-pack the block: when no hook reads the tile's keys and
                  ///< every query block is packed (measurements at ensure_keys)
};
/// Whether a query block multiplies on packed operands. Packing K/V for a single query row pays
/// only when other query heads share the packed block (GQA): measured on BM_decode (Lk = 4096,
/// d = 128, float, 1 thread, ms per step, expression path -> packed), 32 heads over 8 kv heads:
/// 1 row 9.5 -> 7.7, 4 rows 18.8 -> 8.7, 15 rows 28.4 -> 20.5; 32 heads over 32 kv heads: 1 row
/// 23.1/23.7/23.0/20.5 -> 33.8/31.9/29.1/28.0 (so 1-row blocks without GQA keep the GEMV), 4 rows
/// 61/46 -> 53/34, 15 rows 88/45 -> 52/36. The rule depends only on the problem's shape, never on the
/// grouping of work items (which follows the thread count), so results stay thread-count invariant.
[[nodiscard]] inline bool packed_products(index_t rows, index_t group) { return rows >= 2 || group >= 2; }

/// Summary of one key block of one batch row: lets the kernel skip blocks nothing can see and
/// avoid masking blocks everything sees.
struct key_block {
  index_t first = 0, cols = 0;
  index_t valid = 0;                           ///< keys that are not padding
  std::int64_t pos_min = 0, pos_max = 0;     ///< over all keys of the block
  bool ascending = true;                     ///< positions non-decreasing (the usual case)
};

inline std::vector<key_block> summarize_key_blocks(const call_masks& m, index_t block) {
  const index_t nkb = m.k_len == 0 ? 0 : (m.k_len + block - 1) / block;
  std::vector<key_block> out(static_cast<std::size_t>(m.batch * nkb));
  for (index_t b = 0; b < m.batch; ++b) {
    const std::int64_t* pos = m.kp(b);
    const unsigned char* valid = m.kv(b);
    for (index_t kb = 0; kb < nkb; ++kb) {
      key_block& s = out[static_cast<std::size_t>(b * nkb + kb)];
      s.first = kb * block;
      s.cols = std::min(block, m.k_len - s.first);
      s.pos_min = std::numeric_limits<std::int64_t>::max();
      s.pos_max = std::numeric_limits<std::int64_t>::min();
      for (index_t j = s.first; j < s.first + s.cols; ++j) {
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
  const index_t rows = s.rows(), cols = s.cols();
  if (has_padding)
    for (index_t j = 0; j < cols; ++j)
      if (k_valid[j] == 0) s.col(j).setConstant(neg_inf);
  if (!causal) return;
  if (ascending) {
    for (index_t i = 0; i < rows; ++i) {
      const index_t seen = std::upper_bound(k_pos, k_pos + cols, q_pos[i]) - k_pos;
      s.row(i).tail(cols - seen).setConstant(neg_inf);
    }
  } else {
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < cols; ++j)
        if (k_pos[j] > q_pos[i]) s(i, j) = neg_inf;
  }
}

template <class A, class B>
[[nodiscard]] bool memory_overlaps(const heads_view<A>& x, const heads_view<B>& y) {
  if (x.size() == 0 || y.size() == 0) return false;
  const auto* x0 = reinterpret_cast<const char*>(x.data());
  const auto* y0 = reinterpret_cast<const char*>(y.data());
  const auto* x1 = x0 + x.size() * static_cast<index_t>(sizeof(*x.data()));
  const auto* y1 = y0 + y.size() * static_cast<index_t>(sizeof(*y.data()));
  return std::less<const char*>{}(x0, y1) && std::less<const char*>{}(y0, x1);
}

/// A key block some unit of a work item sees: the keys it provides (kcols) and each unit's share.
struct block_plan {
  index_t kb = 0;  ///< its index in the batch row's key blocks
  index_t kcols = 0;
  bool any_packed = false;
  std::array<index_t, default_units_per_item> cols{};  ///< per unit (0: the unit does not see the block)
};

/// Per-thread buffers (detail::thread_scratch: kept from call to call), grown to the largest tile the
/// thread meets and reused by its items (maps give them each tile's shape: an Eigen resize would
/// reallocate at every shape change).
template <class T>
struct attention_scratch {
  using buffer = typename tile_gemm<T>::buffer;
  /// Per query unit of an item.
  struct unit_state {
    buffer q_work;    ///< transformed queries (Q/K transforms, when a hook reads them or Q is not packed)
    buffer q_scaled;  ///< scale * queries: left operand of the expression path
    buffer q_packed;  ///< queries packed as the B operand of S^T = K Q^T (packed path)
    buffer acc_out, acc_buckets;
    online_softmax<T> softmax;
  };
  std::vector<unit_state> units;
  buffer k_work;  ///< a transformed key block (Q/K transforms: key_mode worker, shared)
  buffer qk_piece;  ///< a few transformed rows on their way to a packed operand (transform_packed)
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

/// One (head, query block) of a work item.
struct query_unit {
  index_t head = 0, q0 = 0, rows = 0;
  const std::int64_t* q_pos = nullptr;
  std::int64_t q_min = 0, q_max = 0;
  bool packed = false;  ///< products on packed operands (tile_gemm); else Eigen expressions (few rows)
};

template <class T, class Bound>
class fused_attention {
 public:
  static constexpr bool transforms = has_qk_transform<Bound, T>;
  static constexpr bool score_terms = has_score_terms<Bound, T>;
  static constexpr bool position_bias = has_position_bias<Bound, T>;
  static constexpr bool value_terms = has_value_terms<Bound, T>;
  /// Whether a hook receives the tile's (transformed) queries and keys.
  static constexpr bool hooks_read_qk = score_terms || position_bias || value_terms;
  using gemm = tile_gemm<T>;

  fused_attention(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
                  T* lse, const Bound& enc, const call_masks& masks, T scale, index_t q_block, index_t k_block,
                  index_t buckets, index_t threads)
      : q_(q), k_(k), v_(v), out_(out), lse_(lse), enc_(enc), masks_(masks), scale_(scale), q_block_(q_block),
        k_block_(k_block), buckets_(buckets), heads_(q.heads()), kv_heads_(k.heads()), group_(heads_ / kv_heads_),
        dim_(q.dim()), vdim_(v.dim()), q_len_(q.seq()), k_len_(k.seq()),
        q_blocks_(q_len_ == 0 ? 0 : (q_len_ + q_block - 1) / q_block),
        k_blocks_(k_len_ == 0 ? 0 : (k_len_ + k_block - 1) / k_block),
        key_blocks_(summarize_key_blocks(masks, k_block)) {
    const index_t qb = std::min(q_block_, q_len_), kb = std::min(k_block_, k_len_);
    chunk_s_ = gemm::column_chunk(kb, dim_, qb);
    chunk_pv_ = gemm::column_chunk(vdim_, kb, qb);
    // Units per item: up to default_units_per_item, fewer when that would leave under two items per
    // thread. The grouping never changes a unit's arithmetic (same packed operands, same order), so
    // the result does not depend on it, nor on the thread count it is derived from.
    const index_t units = q_.batch() * heads_ * q_blocks_;
    units_per_item_ = std::clamp<index_t>(units / (2 * threads), 1, default_units_per_item);
    units_per_group_ = group_ * q_blocks_;
    items_per_group_ = (units_per_group_ + units_per_item_ - 1) / units_per_item_;
    // Blocks that multiply through expressions (packed_products) need the keys unpacked; only the
    // last query block can be shorter than the others.
    const index_t last_rows = q_len_ - (q_blocks_ - 1) * q_block_;
    const bool all_packed = packed_products(std::min(q_block_, q_len_), group_) && packed_products(last_rows, group_);
    const bool keys_packed_only = !hooks_read_qk && all_packed;  // nothing reads the unpacked keys
    if (!transforms) keys_ = key_mode::caller;
    else if (items_per_group_ == 1) keys_ = keys_packed_only ? key_mode::worker_packed : key_mode::worker;
    else keys_ = keys_packed_only ? key_mode::shared_packed : key_mode::shared;
    // Rows per piece of transform_packed: whole packing steps, about 16 KiB, so the piece stays in L1
    // (48 rows at d = 128 in float; 96 and 192 rows measured the same within the pair benchmark's
    // noise, RoPE at L = 1024).
    const index_t rows_in_16k = 16384 / static_cast<index_t>(sizeof(T)) / std::max<index_t>(dim_, 1);
    piece_rows_ = std::max<index_t>(1, rows_in_16k / gemm::pack_step) * gemm::pack_step;
  }

  void run(Eigen::ThreadPoolInterface* pool) {
    if (keys_shared()) {
      // Shared by the items of a kv head. Uninitialized: each key block is written by its transform
      // before any read (a zero fill would be one more pass over O(batch x kv_heads x L x d) memory).
      // (Eigen's resize leaves the storage uninitialized and aligns it for the packed layout's
      // aligned packet loads and stores.)
      attention_scratch<T>::at_least(shared_keys_, q_.batch() * kv_heads_ * k_blocks_ * shared_block_size());
      key_state_ = std::make_unique<std::atomic<std::uint8_t>[]>(static_cast<std::size_t>(q_.batch() * kv_heads_ * k_blocks_));
    }
    // Items of one (batch, kv head) are consecutive and, within it, the last query blocks come first:
    // under a causal mask they see the most keys, so the dynamic schedule ends with short items and
    // the threads finish together.
    for_each_item<attention_scratch<T>>(
        pool, q_.batch() * kv_heads_ * items_per_group_,
        [&](attention_scratch<T>& sc) { sc.units.resize(static_cast<std::size_t>(units_per_item_)); },
        [&](index_t item, attention_scratch<T>& sc) { run_item(item, sc); });
    require(!bad_bucket_.load(), "encoding", "value_buckets must return indices in [0, value_bucket_count())");
  }

 private:
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

  /// Q/K transform of `src` (rows of `role`, positions `pos`) straight into its packed layout (`as_a`:
  /// GEBP's A operand, keys; else its B operand, queries), for when nothing reads the transformed rows
  /// unpacked. It runs piece by piece: piece_rows_ rows are transformed into an L1-resident buffer and
  /// packed from there, so the transformed rows never make a round trip through L2 (packing piecewise
  /// gives the whole's layout: tile_gemm::pack_step).
  void transform_packed(qk_role role, index_t head, std::span<const std::int64_t> pos, const const_matrix_map<T>& src,
                        T* packed, bool as_a, attention_scratch<T>& sc) const {
    T* piece = attention_scratch<T>::at_least(sc.qk_piece, piece_rows_ * dim_);
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

  /// Key block `blk` of (batch b, kv head hk) transformed and packed into the worker's buffer.
  const T* transformed_packed_block(index_t b, index_t hk, const key_block& blk, attention_scratch<T>& sc) const {
    T* packed = attention_scratch<T>::at_least(sc.k_packed, blk.cols * dim_);
    transform_packed(qk_role::key, hk, key_positions(b, blk), k_.matrix(b, hk, blk.first, blk.cols), packed, true, sc);
    return packed;
  }

  /// Q/K transform of key block kb of (batch b, kv head hk) into the shared copy of K, exactly once
  /// per call: the first work item that needs the block transforms it (just before use, after its
  /// rows were prefetched during the previous block), items that need it meanwhile wait for it.
  /// Blocks no query sees are never transformed. Each kv head is transformed once, not once per
  /// query head of its GQA group. Returns the block: the shared copy, or, to the item that made it,
  /// its own copy, still in its cache.
  ///
  /// The block is made in the worker's buffers (packed there in key_mode::shared_packed) and copied
  /// to the shared one with non-temporal stores. Written through the cache, the shared copy (1 MiB
  /// per kv head at L = 2048, d = 128) displaced the item's packed queries and accumulators from L2:
  /// RoPE's overhead over no encoding (L = 2048, causal, 1 thread, medians of 16 paired calls, three
  /// runs) was +5.7 / +6.8 / +4.2 % with memcpy, +4.0 / +2.1 / +3.2 % with the streamed copy, and
  /// +4.4 / +4.1 / +2.3 % when every work item transformed its own keys (a token rotated once per item).
  const T* ensure_keys(index_t b, index_t hk, index_t kb, attention_scratch<T>& sc) {
    std::atomic<std::uint8_t>& state = key_state_[static_cast<std::size_t>(key_block_index(b, hk, kb))];
    T* shared = shared_block(b, hk, kb);
    if (state.load(std::memory_order_acquire) == key_done) return shared;
    std::uint8_t expected = key_todo;
    if (state.compare_exchange_strong(expected, key_busy, std::memory_order_acq_rel)) {
      const key_block& blk = block_of(b, kb);
      const T* mine = keys_ == key_mode::shared_packed ? transformed_packed_block(b, hk, blk, sc)
                                                       : transformed_block(b, hk, blk, sc).data();
      stream_copy(shared, mine, blk.cols * dim_ * static_cast<index_t>(sizeof(T)));
      state.store(key_done, std::memory_order_release);
      return mine;
    }
    while (state.load(std::memory_order_acquire) != key_done) std::this_thread::yield();  // one block's transform
    return shared;
  }

  /// Prefetches keys r0 .. r1-1 of block kb for its first use: the caller's rows, which the packing
  /// or the transform reads, or the shared transformed block once another item has made it (its
  /// caller rows are then not read again).
  void prefetch_keys(index_t b, index_t hk, index_t kb, index_t r0, index_t r1) {
    if (keys_shared() &&
        key_state_[static_cast<std::size_t>(key_block_index(b, hk, kb))].load(std::memory_order_relaxed) == key_done) {
      prefetch_bytes(shared_block(b, hk, kb) + r0 * dim_, (r1 - r0) * dim_ * static_cast<index_t>(sizeof(T)), false);
      return;
    }
    prefetch_rows(k_.matrix(b, hk, block_of(b, kb).first + r0, r1 - r0), false);
  }

  /// Queries or keys that went straight into a packed operand: nothing unpacked for the hooks to read.
  [[nodiscard]] const_matrix_map<T> no_rows() const {
    return const_matrix_map<T>(nullptr, 0, dim_, Eigen::OuterStride<>(dim_));
  }

  [[nodiscard]] bool keys_shared() const { return keys_ == key_mode::shared || keys_ == key_mode::shared_packed; }

  /// Index of key block kb of (batch b, kv head hk) among all of the call's (key_state_, shared_keys_).
  [[nodiscard]] index_t key_block_index(index_t b, index_t hk, index_t kb) const {
    return (b * kv_heads_ + hk) * k_blocks_ + kb;
  }

  /// Elements per block of the shared keys: a whole number of the alignment that the packed layout's
  /// packet loads and the streamed copy need.
  [[nodiscard]] index_t shared_block_size() const {
    constexpr index_t align = EIGEN_MAX_ALIGN_BYTES / static_cast<index_t>(sizeof(T));
    return (std::min(k_block_, k_len_) * dim_ + align - 1) / align * align;
  }

  /// Start of key block kb of (batch b, kv head hk) in the shared keys.
  [[nodiscard]] T* shared_block(index_t b, index_t hk, index_t kb) {
    return shared_keys_.data() + key_block_index(b, hk, kb) * shared_block_size();
  }

  /// The keys of block `blk` transformed into the worker's buffer.
  matrix_map<T> transformed_block(index_t b, index_t hk, const key_block& blk, attention_scratch<T>& sc) const {
    matrix_map<T> kt(attention_scratch<T>::at_least(sc.k_work, blk.cols * dim_), blk.cols, dim_,
                     Eigen::OuterStride<>(dim_));
    transform_into(qk_role::key, hk, key_positions(b, blk), k_.matrix(b, hk, blk.first, blk.cols), kt);
    return kt;
  }

  [[nodiscard]] std::span<const std::int64_t> key_positions(index_t b, const key_block& blk) const {
    return {masks_.kp(b) + blk.first, static_cast<std::size_t>(blk.cols)};
  }

  [[nodiscard]] const key_block& block_of(index_t b, index_t kb) const {
    return key_blocks_[static_cast<std::size_t>(b * k_blocks_ + kb)];
  }

  /// Keys of block `blk` a unit must compute: all of them, or under a causal mask with ascending
  /// positions the prefix up to the unit's last query position (packed: rounded up to whole panels
  /// of the packed K, whose row prefixes are only packed K's themselves at panel boundaries).
  [[nodiscard]] index_t needed_keys(const key_block& blk, const std::int64_t* k_pos, const query_unit& u) const {
    if (!masks_.causal || !blk.ascending) return blk.cols;
    const std::int64_t* first = k_pos + blk.first;
    const index_t seen = std::upper_bound(first, first + blk.cols, u.q_max) - first;
    if (!u.packed) return seen;
    return std::min(blk.cols, (seen + gemm::a_panel - 1) / gemm::a_panel * gemm::a_panel);
  }

  /// The unit's queries, transformed once (Q/K transforms), packed or scaled for the score products.
  /// Returns the (transformed) queries for the hooks: none (no rows) when no hook reads them and they
  /// were transformed straight into the packed operand.
  const_matrix_map<T> prepare_queries(index_t b, const query_unit& u, attention_scratch<T>& sc,
                                      typename attention_scratch<T>::unit_state& st) {
    using scratch = attention_scratch<T>;
    if constexpr (transforms && !hooks_read_qk) {
      if (u.packed) {
        transform_packed(qk_role::query, u.head, std::span<const std::int64_t>(u.q_pos, u.rows),
                         q_.matrix(b, u.head, u.q0, u.rows), scratch::at_least(st.q_packed, u.rows * dim_), false, sc);
        return no_rows();
      }
    }
    const const_matrix_map<T> q = [&] {
      if constexpr (transforms) {
        matrix_map<T> qt(scratch::at_least(st.q_work, u.rows * dim_), u.rows, dim_, Eigen::OuterStride<>(dim_));
        transform_into(qk_role::query, u.head, std::span<const std::int64_t>(u.q_pos, u.rows),
                       q_.matrix(b, u.head, u.q0, u.rows), qt);
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

  void run_item(index_t item, attention_scratch<T>& sc) {
    const index_t grp = item / items_per_group_;
    const index_t chunk = items_per_group_ - 1 - item % items_per_group_;
    const index_t b = grp / kv_heads_, hk = grp % kv_heads_;
    const index_t first_unit = chunk * units_per_item_;
    const index_t n_units = std::min(units_per_item_, units_per_group_ - first_unit);
    const std::int64_t* k_pos = masks_.kp(b);
    const unsigned char* k_valid = masks_.kv(b);
    const bool causal = masks_.causal;
    using scratch = attention_scratch<T>;

    std::array<query_unit, default_units_per_item> units;
    std::array<std::optional<const_matrix_map<T>>, default_units_per_item> q_tiles;
    for (index_t i = 0; i < n_units; ++i) {
      query_unit& u = units[static_cast<std::size_t>(i)];
      const index_t unit = first_unit + i;
      u.head = hk * group_ + unit / q_blocks_;
      u.q0 = unit % q_blocks_ * q_block_;
      u.rows = std::min(q_block_, q_len_ - u.q0);
      u.q_pos = masks_.qp(b) + u.q0;
      const auto [lo, hi] = std::minmax_element(u.q_pos, u.q_pos + u.rows);
      u.q_min = *lo;
      u.q_max = *hi;
      u.packed = packed_products(u.rows, group_);
      auto& st = sc.units[static_cast<std::size_t>(i)];
      q_tiles[static_cast<std::size_t>(i)].reset();  // prepared before the unit's first tile
      scratch::at_least(st.acc_out, u.rows * vdim_);
      st.acc_out.head(u.rows * vdim_).setZero();
      if constexpr (value_terms) {
        scratch::at_least(st.acc_buckets, u.rows * buckets_);
        st.acc_buckets.head(u.rows * buckets_).setZero();
      }
      st.softmax.reset(u.rows);
    }

    // The key blocks some unit sees, and how many keys each unit needs from them.
    std::vector<block_plan>& plan = sc.plan;
    plan.clear();
    for (index_t kb = 0; kb < k_blocks_; ++kb) {
      const key_block& blk = block_of(b, kb);
      if (blk.valid == 0) continue;  // every key is padding
      block_plan p{.kb = kb};
      for (index_t i = 0; i < n_units; ++i) {
        const query_unit& u = units[static_cast<std::size_t>(i)];
        if (causal && blk.pos_min > u.q_max) continue;  // above the causal diagonal: nothing visible
        p.cols[static_cast<std::size_t>(i)] = needed_keys(blk, k_pos, u);
        p.kcols = std::max(p.kcols, p.cols[static_cast<std::size_t>(i)]);
        p.any_packed = p.any_packed || u.packed;
      }
      if (p.kcols > 0) plan.push_back(p);
    }

    for (std::size_t pi = 0; pi < plan.size(); ++pi) {
      const block_plan& p = plan[pi];
      const key_block& blk = block_of(b, p.kb);
      const index_t kcols = p.kcols;
      // The block's keys and values, packed once for all units (keys once per call in
      // key_mode::shared_packed).
      const T* k_packed = nullptr;
      const const_matrix_map<T> k_tile = [&] {
        if constexpr (transforms) {
          if (keys_ == key_mode::worker) {
            const matrix_map<T> kt = transformed_block(b, hk, blk, sc);
            return const_matrix_map<T>(kt.data(), kcols, dim_, Eigen::OuterStride<>(dim_));
          }
          if (keys_ == key_mode::worker_packed) {
            k_packed = transformed_packed_block(b, hk, blk, sc);
            return no_rows();  // no hook reads it
          }
          const T* first = ensure_keys(b, hk, p.kb, sc);
          if (keys_ == key_mode::shared_packed) {
            k_packed = first;
            return no_rows();  // no hook reads it
          }
          return const_matrix_map<T>(first, kcols, dim_, Eigen::OuterStride<>(dim_));
        } else {
          return k_.matrix(b, hk, blk.first, kcols);
        }
      }();
      const const_matrix_map<T> v_tile = v_.matrix(b, hk, blk.first, kcols);
      if (p.any_packed) {
        if (k_packed == nullptr) {  // unless the transform packed it (key_mode worker_packed, shared_packed)
          gemm::pack_a(scratch::at_least(sc.k_packed, kcols * dim_), k_tile.data(), k_tile.outerStride(), kcols, dim_);
          k_packed = sc.k_packed.data();
        }
        gemm::pack_a_transposed(scratch::at_least(sc.v_packed, kcols * vdim_), v_tile.data(), v_tile.outerStride(),
                                vdim_, kcols);
      }

      // While the units compute on this block, the next block's K and V rows (or, after the last
      // block, the output rows) and the next unit's queries are fetched in slices, one per unit:
      // host rows are 2-4 KiB apart in BSHD, a new page each, so unprefetched reads run at the
      // memory latency (measured: a Q/K transform reading unprefetched rows took 2.2 ms of a 29 ms
      // RoPE attention call at L = 1024, 1 thread, 8 heads).
      const block_plan* next = pi + 1 < plan.size() ? &plan[pi + 1] : nullptr;
      index_t visible = 0;
      for (index_t i = 0; i < n_units; ++i) visible += p.cols[static_cast<std::size_t>(i)] > 0 ? 1 : 0;
      index_t slice = 0;
      for (index_t i = 0; i < n_units; ++i) {
        const index_t c = p.cols[static_cast<std::size_t>(i)];
        if (c == 0) continue;
        if (next != nullptr) {
          const index_t n = next->kcols, r0 = n * slice / visible, r1 = n * (slice + 1) / visible;
          const index_t first = block_of(b, next->kb).first + r0;
          prefetch_keys(b, hk, next->kb, r0, r1);
          prefetch_rows(v_.matrix(b, hk, first, r1 - r0), false);
        } else {
          const query_unit& u = units[static_cast<std::size_t>(i)];
          prefetch_rows(out_.matrix(b, u.head, u.q0, u.rows), true);
        }
        ++slice;
        auto& q_tile = q_tiles[static_cast<std::size_t>(i)];
        if (!q_tile) {
          q_tile.emplace(
              prepare_queries(b, units[static_cast<std::size_t>(i)], sc, sc.units[static_cast<std::size_t>(i)]));
          if (i + 1 < n_units && !q_tiles[static_cast<std::size_t>(i + 1)]) {
            const query_unit& w = units[static_cast<std::size_t>(i + 1)];
            prefetch_rows(q_.matrix(b, w.head, w.q0, w.rows), false);
          }
        }
        tile_step(b, hk, blk, c, kcols, units[static_cast<std::size_t>(i)], *q_tiles[static_cast<std::size_t>(i)],
                  k_tile, k_packed, v_tile, k_pos, k_valid, sc.units[static_cast<std::size_t>(i)], sc);
      }
    }

    for (index_t i = 0; i < n_units; ++i) {
      const query_unit& u = units[static_cast<std::size_t>(i)];
      auto& st = sc.units[static_cast<std::size_t>(i)];
      matrix_map<T> acc(st.acc_out.data(), u.rows, vdim_, Eigen::OuterStride<>(vdim_));
      if constexpr (value_terms) {
        const const_matrix_map<T> acc_buckets(st.acc_buckets.data(), u.rows, buckets_,
                                              Eigen::OuterStride<>(buckets_));
        if (buckets_ > 0) acc.noalias() += acc_buckets * enc_.template value_table<T>(u.head);
      }
      const online_softmax<T>& sm = st.softmax;
      auto dst = out_.matrix(b, u.head, u.q0, u.rows);
      for (index_t r = 0; r < u.rows; ++r) sm.finish_row(r, dst.row(r), acc.row(r));
      if (lse_ != nullptr) {
        T* row_lse = lse_ + (b * heads_ + u.head) * q_len_ + u.q0;
        for (index_t r = 0; r < u.rows; ++r) row_lse[r] = sm.lse(r);
      }
    }
  }

  /// One tile: the unit's queries x the first `cols` keys of block `blk` (kcols: keys packed).
  void tile_step(index_t b, index_t hk, const key_block& blk, index_t cols, index_t kcols, const query_unit& u,
                 const const_matrix_map<T>& q_tile, const const_matrix_map<T>& k_block, const T* k_packed,
                 const const_matrix_map<T>& v_block,
                 const std::int64_t* k_pos, const unsigned char* k_valid,
                 typename attention_scratch<T>::unit_state& st, attention_scratch<T>& sc) {
    using scratch = attention_scratch<T>;
    const index_t rows = u.rows;
    const bool all_visible = blk.valid == blk.cols && (!masks_.causal || blk.pos_max <= u.q_min);
    matrix_map<T> s(scratch::at_least(sc.scores, rows * cols), rows, cols, Eigen::OuterStride<>(cols));
    if (u.packed) {  // S^T (keys x queries, column-major) = scale K Q^T
      s.setZero();
      gemm::multiply(s.data(), cols, k_packed, st.q_packed.data(), cols, dim_, rows, scale_, dim_,
                     chunk_s_);
    } else {
      const const_matrix_map<T> q_scaled(st.q_scaled.data(), rows, dim_, Eigen::OuterStride<>(dim_));
      s.noalias() = q_scaled * k_block.topRows(cols).transpose();
    }

    // (key_mode::shared_packed: no hook reads the keys, k_block has no rows)
    const const_matrix_map<T> k_tile(k_block.data(), std::min(cols, k_block.rows()), dim_,
                                     Eigen::OuterStride<>(k_block.outerStride()));
    const tile<T> t{.batch = b, .head = u.head, .kv_head = hk, .q_first = u.q0, .k_first = blk.first,
                    .rows = rows, .cols = cols, .q_pos = u.q_pos, .k_pos = k_pos + blk.first, .q = q_tile,
                    .k = k_tile};
    if constexpr (score_terms) enc_.add_score_terms(t, scale_, s);
    if constexpr (position_bias) enc_.add_position_bias(t, s);
    if (!all_visible)
      mask_tile<T>(s, u.q_pos, k_pos + blk.first, k_valid + blk.first, blk.valid != blk.cols, masks_.causal,
                   blk.ascending);

    online_softmax<T>& sm = st.softmax;
    matrix_map<T> acc(st.acc_out.data(), rows, vdim_, Eigen::OuterStride<>(vdim_));
    matrix_map<T> acc_buckets(value_terms ? st.acc_buckets.data() : nullptr, rows, buckets_,
                              Eigen::OuterStride<>(std::max<index_t>(buckets_, 1)));
    if (sm.step(s)) {
      acc = sm.alpha.asDiagonal() * acc;
      if constexpr (value_terms) acc_buckets = sm.alpha.asDiagonal() * acc_buckets;
    }
    if (u.packed) {  // out^T (dv x queries) += V^T P^T
      gemm::pack_b(scratch::at_least(sc.p_packed, rows * cols), s.data(), cols, rows, cols);
      gemm::multiply(acc.data(), vdim_, sc.v_packed.data(), sc.p_packed.data(), vdim_, cols, rows, T(1), kcols,
                     chunk_pv_);
    } else {
      acc.noalias() += s * v_block.topRows(cols);
    }

    if constexpr (value_terms) {
      index_tile idx(scratch::at_least(sc.buckets, rows * cols), rows, cols, Eigen::OuterStride<>(cols));
      enc_.value_buckets(t, idx);
      for (index_t i = 0; i < rows; ++i)
        for (index_t j = 0; j < cols; ++j) {
          const std::int32_t c = idx(i, j);
          // Masked pairs (weight 0) may carry any index; a visible pair with an index outside the
          // table is an encoding bug, reported after the call (a worker thread cannot throw). It is
          // the one error detected after writing: `out` is then unspecified.
          if (c < 0 || c >= buckets_) {
            if (s(i, j) > T(0)) bad_bucket_.store(true);
            continue;
          }
          acc_buckets(i, c) += s(i, j);
        }
    }
  }

  heads_view<const T> q_, k_, v_;
  heads_view<T> out_;
  T* lse_;
  const Bound& enc_;
  const call_masks& masks_;
  T scale_;
  index_t q_block_, k_block_, buckets_;
  index_t heads_, kv_heads_, group_, dim_, vdim_, q_len_, k_len_, q_blocks_, k_blocks_;
  index_t chunk_s_ = 0, chunk_pv_ = 0, units_per_item_ = 1, units_per_group_ = 0, items_per_group_ = 0;
  key_mode keys_ = key_mode::caller;
  index_t piece_rows_ = 1;  ///< rows per piece of transform_packed
  std::vector<key_block> key_blocks_;
  // Transformed keys (key_mode shared*): per (batch, kv head, key block), shared_block_size() apart,
  // the block's rows (shared) or the block packed (shared_packed).
  typename gemm::buffer shared_keys_;
  std::unique_ptr<std::atomic<std::uint8_t>[]> key_state_;  // per (batch, kv head, key block): ensure_keys
  static constexpr std::uint8_t key_todo = 0, key_busy = 1, key_done = 2;
  std::atomic<bool> bad_bucket_{false};
};

/// Everything the public overloads share: validation first (nothing written on error), then the
/// kernel.
template <class T, class E>
void attention_impl(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
                    std::optional<tensor_map<T, 3>> lse, const E& enc, const attention_options& opt) {
  static_assert(has_attention_hook<E, T>, "posenc::attention: the encoding has no hook for this scalar type");
  check_attention_shapes<T>(q, k, v, out);
  const index_t B = q.batch(), H = q.heads(), Hkv = k.heads(), Sq = q.seq(), Sk = k.seq(), D = q.dim(), Dv = v.dim();
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
  call_info info = masks.info(H, Hkv, D, Dv);
  info.scalar = std::is_same_v<T, double> ? scalar_type::float64 : scalar_type::float32;
  auto&& bound = bind_encoding(enc, info);
  using bound_type = std::remove_cvref_t<decltype(bound)>;

  index_t buckets = 0;
  if constexpr (has_value_terms<bound_type, T>) {
    buckets = static_cast<index_t>(bound.value_bucket_count());
    require(buckets >= 0, "encoding", "value_bucket_count must be >= 0", buckets);
    for (index_t h = 0; h < H; ++h) {
      const const_matrix_map<T> table = bound.template value_table<T>(h);
      require(table.rows() == buckets && table.cols() == Dv, "encoding",
              "value_table(head) must be [value_bucket_count, value_dim]", "[", table.rows(), ", ", table.cols(),
              "] for [", buckets, ", ", Dv, "] at head ", h);
    }
  }
  if (B * H * Sq == 0) return;

  const index_t q_block = opt.q_block > 0 ? opt.q_block : default_q_block;
  const index_t k_block = opt.k_block > 0 ? opt.k_block : default_k_block;
  fused_attention<T, bound_type> kernel(q, k, v, out, lse ? lse->data() : nullptr, bound, masks,
                                        static_cast<T>(scale), q_block, k_block, buckets,
                                        opt.pool != nullptr ? std::max<index_t>(opt.pool->NumThreads(), 1) : 1);
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
  const index_t B = out.batch(), S = out.seq(), H = out.heads(), D = out.dim();
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
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h)
      for (index_t s = 0; s < S; ++s) {
        const T la = lse_a(b, h, s), lb = lse_b(b, h, s);
        const T* a = out_a.row(b, s, h);
        const T* c = out_b.row(b, s, h);
        T* o = out.row(b, s, h);
        if (std::isnan(la) || std::isnan(lb)) {  // a poisoned part (NaN or +inf score) poisons the row
          for (index_t d = 0; d < D; ++d) o[d] = std::numeric_limits<T>::quiet_NaN();
          lse(b, h, s) = std::numeric_limits<T>::quiet_NaN();
          continue;
        }
        const T m = std::max(la, lb);
        if (m == neg_inf) {  // neither part sees a key
          for (index_t d = 0; d < D; ++d) o[d] = T(0);
          lse(b, h, s) = neg_inf;
          continue;
        }
        const T wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
        for (index_t d = 0; d < D; ++d) o[d] = (wa * a[d] + wb * c[d]) / sum;
        lse(b, h, s) = m + std::log(sum);
      }
}

}  // namespace posenc
