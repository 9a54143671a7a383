// posenc/detail/attention_decode.hpp — the decode strategy: a few query rows per kv head (a new token,
// or a short chunk, against a long KV cache), keys and values streamed from the cache rows once.
//
// The tiled strategy (attention.hpp) packs every K/V block for GEBP, which pays for itself only when
// many query rows reuse it; a decode step has one row per query head, so packing would double the
// bytes the step moves. Here:
//   scheduling     the queries of one (batch, kv head) — its group of query heads, all their rows — form
//                  one small matrix of G = group x q_len rows; the keys are cut into segments
//                  (decode_segments), and each (batch, segment) is a work item for every kv head
//                  (split-KV, Flash-Decoding), cut into parts of the kv heads when there are fewer
//                  items than threads or they split unevenly (head_chunks). Segments depend only on
//                  k_len, never on the thread count, and the partial results are merged in segment
//                  order: bitwise the same for any pool. An item runs its tiles for all its kv heads
//                  together, or, where each head's rows are adjacent (BHSD), each head over all the
//                  tiles in turn (heads_outer): either way it reads the cache in address order.
//   operand supply the caller's key and value rows in place, f16 / bf16 widened inside the products'
//                  loads (decode_kernels.hpp kv_packets); staged a tile at a time only for an encoding
//                  that rotates keys, half keys in the column layout, or an ISA without in-register
//                  widening (the staging prefetches as the products do). The products prefetch
//                  the cache rows one tile (32 keys) ahead of the ones they read, once per line, at
//                  the pace they read (decode_prefetch_rows), the keys swept across the heads 4 rows
//                  ahead (decode_sweep_prefetch_rows, into L1 where it holds 48 KiB or more, else
//                  into L2: with_sweep_locality), one head's rows in turn 8 KiB ahead
//                  (decode_stream_prefetch_bytes), and the values swept across the heads a chunk
//                  ahead, the first chunk before the softmax (prefetch_first_values); prefetching
//                  the next tile in a burst measured slower (f32, 1 row: 1.65 -> 2.0 ms).
//   tile math      per tile of 32 keys (64 where both its keys and values are read across the kv
//                  heads: decode_swept_tile_keys) S = scale Q K^T, the encoding's score terms and bias
//                  per query head, masks, online softmax, O += P V; per segment (O, m, l) are kept
//                  and merged exactly at the end (the log-sum-exp merge of attention.hpp's merge).
//                  Up to 4 rows per kv head (half keys read in place: 8 with AVX-512, 16 with AVX2,
//                  column_min_rows) the scores are rows (row_dots, add_weighted); for more, columns
//                  (column_dots, the softmax down the columns, add_weighted_rows), where each K and
//                  V value comes from memory once for all the rows (decode_kernels.hpp); past two
//                  packets of rows (a token of a wide MQA group) rows again, in 4-row blocks
//                  (stage_stored_rows).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "posenc/detail/attention_schedule.hpp"
#include "posenc/detail/attention_tile.hpp"
#include "posenc/detail/decode_kernels.hpp"
#include "posenc/detail/kv_storage.hpp"
#include "posenc/detail/mask.hpp"
#include "posenc/detail/online_softmax.hpp"
#include "posenc/detail/thread.hpp"
#include "posenc/encoding.hpp"

namespace posenc::detail {

/// Query rows per kv head (group x q_len) up to which the automatic choice streams K/V (decode)
/// instead of packing it (tiled), and new queries per head up to which it does so for any group
/// (docs/performance.md › Decode or tiled). The tiled path's query blocks hold one head's q_len rows,
/// so with a few new tokens its products are matrices of q_len rows however wide the group; the
/// decode path takes the group's rows as one matrix. Measured (Zen 5 VM, one core, Lk = 4096, f32 /
/// f16 cache, time tiled / decode): 17 to 32 rows, GQA 64/8 at d = 128 with 4 tokens 2.14 / 2.55,
/// 32/8 with 8 tokens 1.43 / 2.06, 8/1 at d = 256 with 4 tokens 2.22 / 1.53, MHA 32/32 with 32 tokens
/// 1.72 / 1.21; a token or two of MQA: 71/1 at d = 64 (Falcon-7B) 3.76 / 2.61 and 2.69 / 2.47,
/// 128/1 at d = 128 3.32 / 3.43 and 2.22 / 2.65. Beyond both the products of the decode path's row
/// layout lose: 64 rows 0.79-1.41 (32/8 with 16 tokens 0.97 / 1.19, 64/8 with 8 0.79 / 1.41), 71/1
/// with 4 tokens 0.72 / 0.95.
inline constexpr index_t decode_max_rows = 32;
inline constexpr index_t decode_max_queries_any_group = 2;
/// The longest cache that is one split-KV segment; decode_segments cuts a longer one.
inline constexpr index_t decode_segment_keys = 1024;
/// Keys per segment, about, when decode_segments cuts a longer cache.
inline constexpr index_t decode_segment_target_keys = 2048;
/// Keys per tile. Measured (f32 cache, 1 row, GQA 32/8, d = 128, Lk = 4096, one core): 16 keys 1.64 ms,
/// 32 keys 1.54 ms, 64 keys 6.3 ms: a tile's key rows of one kv head are 2-4 KiB apart (BSHD) and
/// share L1 sets, and 64 of them evict the queries and scores the tile keeps rereading.
inline constexpr index_t decode_tile_keys = 32;
/// Keys per tile when the row layout reads both a tile's keys and its values across the kv heads, a few
/// keys at a time in address order (values_swept: f32, at most 4 rows per kv head): a head's rows are
/// then read a few at a time, never a whole tile's in turn, so a longer tile does not crowd L1 sets,
/// and each softmax step (the row maxima and sums reduced, the checks, alpha) and each tile's dispatch
/// serve twice the keys. Paired calls against 32 keys (1 row, GQA 32/8, d = 128, Zen 5 VM, calls
/// rotating over 384 MiB of caches, medians of per-call ratios): one thread Lk = 1024 0.96, 4096
/// 0.97-0.98, 32768 0.95-0.97; two threads 0.98-0.99; AVX2 build 0.99-1.00; 128 keys against 64
/// 0.99-1.00. Where a tile is read head by head it stays at 32: f16 1 row with 64 keys took 1.05-1.27x
/// the time, f32 4 rows (column layout) 1.02-1.05x.
inline constexpr index_t decode_swept_tile_keys = 64;

/// Split-KV segments of a cache of k_len keys: one up to decode_segment_keys, else an even number of
/// equal segments (segment_tiles) of about decode_segment_target_keys, at least 2. They depend on k_len alone,
/// never on the number of threads, so the result does not either. Every segment restarts the running
/// max (its first tiles rescale the accumulators) and costs its queries, accumulators and merge; an
/// even count of equal segments splits evenly over 2 threads without cutting the kv heads (the
/// halves of every token's row, head_chunks). Paired calls against fixed segments of 1024 keys (1
/// row, GQA 32/8, d = 128, Zen 5 VM, calls rotating over 384 MiB of caches, medians of per-call
/// ratios): one thread f32 Lk = 1536 to 32768 0.96-0.99, f16 Lk = 4096 / 32768 0.96 / 0.97, 4 rows
/// 0.98-0.99; two threads Lk = 1536 0.91, 3072 0.89-0.90, 4096 to 32768 0.96-1.00 (4 rows at 4096
/// 1.00, f16 0.96). Segments of 2048 keys and a last shorter one left a thread idle at Lk = 3072 (1.18),
/// and 3 equal segments at Lk = 6144, shared by cutting the kv heads in 2, 1.17.
constexpr index_t decode_segments(index_t k_len) {
  if (k_len <= decode_segment_keys) return 1;
  constexpr index_t pair = 2 * decode_segment_target_keys;
  return std::max<index_t>(2, 2 * ((k_len + pair / 2) / pair));
}

/// The tiles [first, end) of segment `seg` of `segments` over `tiles` tiles: equal to a tile.
struct segment_tiles {
  index_t first, end;
  segment_tiles(index_t seg, index_t segments, index_t tiles)
      : first(seg * tiles / segments), end((seg + 1) * tiles / segments) {}
};

/// K/V bytes below which the kv heads of a (batch, segment) work item are not cut into parts for more
/// threads (decode_attention::head_chunks). GQA 32/8, d = 128, 2 threads, calls rotating over 6-16
/// layers' caches (Zen 5 VM, paired, time against whole items): f32 (8 MiB items, two parts) 1 row
/// Lk = 1024 0.79-0.89, Lk = 3072 0.89-0.94, 4 rows Lk = 3072 0.88-0.90 (one cache called again and
/// again, in L3: Lk = 1024 0.95-1.07, Lk = 3072 0.87-0.91). Smaller parts did not pay: f32 Lk = 256 / 512
/// 1.04 / 1.01, f16 (4 MiB items) Lk = 1024 1.07-1.17, Lk = 3072 1.18-1.22: waking a pool thread,
/// and reading half of every token's row, cost more than the second thread saves.
inline constexpr index_t decode_split_min_bytes = index_t{4} << 20;

/// Whether the decode strategy can run the encoding (value terms need the tiled path's buckets).
template <class Bound, class T>
inline constexpr bool decode_supports = !has_value_terms<Bound, T>;

template <class T>
struct decode_scratch {
  using buffer = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  /// What one kv head's group keeps over a segment.
  struct group_state {
    buffer q_work;    ///< the group's queries after the Q transform, unscaled (what hooks read)
    buffer q_scaled;  ///< scale * queries: the left operand of row_dots
    buffer q_cols;    ///< the same as column_dots reads them (column_queries), zero padded
    buffer acc;       ///< O, [rows x value_dim], or in the pair layout when value_pairs() (add_weighted_pairs)
    online_softmax<T> softmax;
    bool rescale = false;  ///< the last softmax step left some alpha != 1 (column layout)
  };
  std::vector<group_state> groups;  ///< per kv head
  std::vector<const T*> q_heads;     ///< per kv head, its group's q_scaled (scores_across_heads)
  index_t head_first = 0, head_end = 0;  ///< the kv heads of the current work item
  buffer k_work, v_work, scores, score_rows;
  /// Rows ahead the products prefetch in the cache during the current tile: decode_prefetch_rows when
  /// the item reads the adjacent tile next, else 0 (no lines past its keys or the cache's end).
  index_t ahead = 0;
  std::vector<std::int64_t> q_pos;  ///< query positions, repeated for each head of the group
};

/// The partial results of a call's segments (decode_attention::partials_): per part (batch row, kv
/// head, segment, row) the output row O, the running max m and the sum l.
template <class T>
struct decode_partials {
  Eigen::VectorX<T> acc, m, l;
};

template <class T, class KV, class Bound>
class decode_attention {
 public:
  static constexpr bool transforms_queries = has_qk_transform<Bound, T>;
  static constexpr bool transforms_keys = has_key_transform<Bound, T>;

  /// `softcap`: 0 = none; `sinks`: one logit per query head, or empty.
  decode_attention(heads_view<const T> q, heads_view<const KV> k, heads_view<const KV> v, heads_view<T> out, T* lse,
                   const Bound& enc, const call_masks& masks, T scale, T softcap, std::vector<T> sinks)
      : q_(q), k_(k), v_(v), out_(out), lse_(lse), enc_(enc), masks_(masks), scale_(scale), softcap_(softcap),
        sinks_(std::move(sinks)), heads_(q.heads()),
        kv_heads_(k.heads()), group_(q.heads() / k.heads()), q_len_(q.seq()), rows_(group_ * q.seq()),
        dim_(q.dim()), vdim_(v.dim()),
        segments_(decode_segments(masks.k_len)),
        tile_keys_(values_swept() ? decode_swept_tile_keys : decode_tile_keys),
        tiles_(summarize_key_blocks(masks, tile_keys_)),
        tiles_per_row_(masks.k_len == 0 ? 0 : (masks.k_len + tile_keys_ - 1) / tile_keys_),
        part_acc_(part_buffer(partials_.get().acc, vdim_)),
        part_m_(part_buffer(partials_.get().m, 1)),
        part_l_(part_buffer(partials_.get().l, 1)) {
    for (index_t b = 0; b < masks.batch; ++b) {
      std::int64_t lo = 0, hi = 0;  // 0, 0 for no queries
      position_range(masks.qp(b), q_len_, lo, hi);
      q_min_.push_back(lo);
      q_max_.push_back(hi);
    }
  }

  void run(Eigen::ThreadPoolInterface* pool) {
    const index_t chunks = head_chunks(pool != nullptr ? static_cast<index_t>(pool->NumThreads()) : 1);
    for_each_item<decode_scratch<T>>(
        pool, masks_.batch * segments_ * chunks,
        [&](decode_scratch<T>& sc) {
          sc.groups.resize(static_cast<std::size_t>(kv_heads_));
          sc.q_heads.resize(static_cast<std::size_t>(kv_heads_));
        },
        [&](index_t item, decode_scratch<T>& sc) {
          // the parts outer, so that two threads read different segments, not the two halves of the
          // same tokens at once (in L3, f16 Lk = 3072 cut in 2, 2 threads: 0.86x the time of whole
          // items this way, 1.02x with the segments outer)
          const index_t n = masks_.batch * segments_, c = item / n, bs = item % n;
          sc.head_first = c * kv_heads_ / chunks;
          sc.head_end = (c + 1) * kv_heads_ / chunks;
          run_segment(bs / segments_, bs % segments_, sc);
        },
        workers::pool_and_caller);  // short calls: the caller starts while a pool thread wakes (thread.hpp)
    online_softmax<T> st;
    Eigen::Matrix<T, 1, Eigen::Dynamic> o(vdim_);
    for (index_t bh = 0; bh < masks_.batch * kv_heads_; ++bh) merge_segments(bh / kv_heads_, bh % kv_heads_, st, o);
  }

 private:
  /// Parts the kv heads of each (batch, segment) are cut into, one work item each: the fewest that bring
  /// the rounds of items within 10 % of an even split over the threads (a single segment, Lk <= 1024,
  /// on 2 threads: 2 items; 2 segments on 8 threads: 4 or 8), with no part under decode_split_min_bytes.
  /// A head's arithmetic does not depend on the item that runs it, so this may follow the thread count:
  /// results stay bitwise the same.
  [[nodiscard]] index_t head_chunks(index_t threads) const {
    if (threads <= 1) return 1;
    const index_t n = masks_.batch * segments_;
    const index_t item_bytes =
        (masks_.k_len + segments_ - 1) / segments_ * kv_heads_ * (dim_ + vdim_) * static_cast<index_t>(sizeof(KV));
    const index_t most = std::clamp<index_t>(item_bytes / decode_split_min_bytes, 1, kv_heads_);
    for (index_t c = 1; c < most; ++c) {
      const index_t items = n * c, rounds = (items + threads - 1) / threads;
      if (rounds * threads * 10 <= items * 11) return c;
    }
    return most;
  }

  /// One (batch, segment) for the item's kv heads: tile by tile, each tile's rows for those kv heads in turn.
  /// In BSHD a token's keys of all kv heads are one contiguous row (kv_heads x d), so the item reads
  /// the cache in address order: measured at Lk = 4096, 8 kv heads, d = 128, reading K and V head by
  /// head (rows 4 KiB apart) ran at 16.7 GB/s, in address order at 27 GB/s.
  void run_segment(index_t b, index_t seg, decode_scratch<T>& sc) {
    const index_t G = rows_;
    const segment_tiles tiles(seg, segments_, tiles_per_row_);
    const index_t t0 = tiles.first, t1 = tiles.end;
    const index_t first = first_seen_tile(b, t0, t1);
    if (first == t1) return leave_unseen(b, seg, sc);
    // the group's query positions (row g * q_len + i: query i), the same for every kv head
    sc.q_pos.resize(static_cast<std::size_t>(G));
    for (index_t g = 0; g < group_; ++g) std::copy(masks_.qp(b), masks_.qp(b) + q_len_, sc.q_pos.begin() + g * q_len_);
    for (index_t hk = sc.head_first; hk < sc.head_end; ++hk) {
      auto& gs = sc.groups[static_cast<std::size_t>(hk)];
      prepare_queries(b, hk, gs);
      sc.q_heads[static_cast<std::size_t>(hk)] = gs.q_scaled.data();
      const index_t acc_size = (value_pairs() ? column_lanes() : G) * vdim_;
      T* acc = grow(gs.acc, acc_size);
      std::fill(acc, acc + acc_size, T(0));
      gs.softmax.reset(column_scores() ? column_lanes() : G);  // step_columns: a row per lane
    }
    // the item's kv heads all together tile by tile, or one after the other over all their tiles
    // (heads_outer); run_tile takes the heads of sc.head_first .. head_end
    const index_t head_first = sc.head_first, head_end = sc.head_end;
    const index_t heads_step = heads_outer() ? 1 : std::max<index_t>(1, head_end - head_first);
    for (index_t h = head_first; h < head_end; h += heads_step) {
      sc.head_first = h;
      sc.head_end = h + heads_step;
      run_tiles(b, first, t1, sc);
    }
    sc.head_first = head_first;
    sc.head_end = head_end;
    for (index_t hk = sc.head_first; hk < sc.head_end; ++hk) {
      const auto& gs = sc.groups[static_cast<std::size_t>(hk)];
      const index_t part = ((b * kv_heads_ + hk) * segments_ + seg) * G;
      if (value_pairs())
        unpair_rows(gs.acc.data(), G, vdim_, part_acc_.data() + part * vdim_);
      else
        std::copy(gs.acc.data(), gs.acc.data() + G * vdim_, part_acc_.data() + part * vdim_);
      for (index_t r = 0; r < G; ++r) {
        part_m_(part + r) = gs.softmax.m(r);
        part_l_(part + r) = gs.softmax.l(r);
      }
    }
  }

  /// The seen tiles of [first, t1) in order, first being seen, for the heads of sc.head_first .. head_end.
  void run_tiles(index_t b, index_t first, index_t t1, decode_scratch<T>& sc) const {
    for (index_t ti = first; ti < t1;) {
      const index_t next = first_seen_tile(b, ti + 1, t1);
      sc.ahead = next == ti + 1 ? decode_prefetch_rows : 0;
      run_tile(b, key_tile(b, ti), sc);
      ti = next;
    }
  }

  /// Whether an item takes its kv heads one after the other, each over all the item's tiles, rather
  /// than every head tile by tile: when each head's rows of K and of V are adjacent (BHSD, the layout
  /// of a Hugging Face cache, [batch, kv heads, tokens, d]) and the products read the keys there, so
  /// that the item reads the cache as two runs in address order, as it does in BSHD with the heads
  /// inner. A head's arithmetic does not depend on the order: the results are bitwise the same.
  /// Measured against the same step on a BSHD copy of the cache (GQA 32/8, d = 128, a Zen 5 VM, calls
  /// rotating over 384-512 MiB of caches, the variants in turn, medians of per-call ratios, two runs,
  /// Lk = 4096 and 32768): 1 row with the heads inner f32 1.34-1.47x, f16 1.25-1.55x (2 threads
  /// 1.16-1.40, 1.16-1.41); outer f32 1.11-1.17x, f16 0.97-1.03x (2 threads 1.02-1.14, 0.95-1.03),
  /// outer / inner 0.64-0.90. f32 4 rows (column layout) outer / inner 0.90-0.96. Staged keys (half
  /// keys in the column layout) keep the heads inner: outer / inner 1.00-1.03 there.
  [[nodiscard]] bool heads_outer() const {
    return keys_in_cache() && k_.token_stride() < k_.head_stride() && v_.token_stride() < v_.head_stride();
  }
  /// Whether the products read the key rows in the cache, not a staged copy (keys_swept,
  /// column_key_rows).
  [[nodiscard]] bool keys_in_cache() const {
    return column_scores() ? std::is_same_v<KV, T> && !transforms_keys : keys_swept();
  }

  /// Rows ahead that the products reading a run of rows in address order prefetch, into L1 or L2
  /// (with_sweep_locality): the keys swept across the heads (decode_sweep_prefetch_rows), or, with the
  /// heads outer, one head's rows of `dim` elements (decode_stream_prefetch_bytes), at most a tile, so
  /// that no line past the next tile is asked for (decode_scratch::ahead).
  [[nodiscard]] index_t near_rows(index_t dim) const {
    if (!heads_outer()) return decode_sweep_prefetch_rows;
    return std::clamp<index_t>(decode_stream_prefetch_bytes / (dim * static_cast<index_t>(sizeof(KV))), 1,
                               tile_keys_);
  }

  /// The parts of a segment no query sees a key of (outside a sliding window, or all padding), as a
  /// segment's softmax state starts: m = -inf and l = 0, which merge_segments passes over without
  /// reading the accumulator. A decode step with a window of W keys against a long cache runs every
  /// other segment this way (preparing each segment's queries and accumulators all the same, a
  /// step with W = 1 at Lk = 32768 took 51 us instead of 22, f32, GQA 32/8, d = 128, one core).
  void leave_unseen(index_t b, index_t seg, const decode_scratch<T>& sc) {
    const index_t G = rows_;
    for (index_t hk = sc.head_first; hk < sc.head_end; ++hk) {
      const index_t part = ((b * kv_heads_ + hk) * segments_ + seg) * G;
      part_m_.segment(part, G).setConstant(-std::numeric_limits<T>::infinity());
      part_l_.segment(part, G).setZero();
    }
  }

  /// The group's query rows (row g * q_len + i: head hk * group + g, query i), transformed once, and
  /// scaled for row_dots.
  void prepare_queries(index_t b, index_t hk, typename decode_scratch<T>::group_state& gs) const {
    const index_t G = rows_;
    T* qw = grow(gs.q_work, G * dim_);
    const std::span<const std::int64_t> pos(masks_.qp(b), static_cast<std::size_t>(q_len_));
    for (index_t g = 0; g < group_; ++g) {
      matrix_map<T> dst(qw + g * q_len_ * dim_, q_len_, dim_, Eigen::OuterStride<>(dim_));
      const const_matrix_map<T> src = q_.matrix(b, hk * group_ + g);
      if constexpr (transforms_queries) {
        if constexpr (has_qk_transform_copy<Bound, T>) {
          enc_.transform_qk(qk_role::query, hk * group_ + g, pos, src, dst);
        } else {
          dst = src;
          enc_.transform_qk(qk_role::query, hk * group_ + g, pos, dst);
        }
      } else {
        dst = src;
      }
    }
    T* qs = grow(gs.q_scaled, G * dim_);
    for (index_t i = 0; i < G * dim_; ++i) qs[i] = qw[i] * scale_;
    if (column_scores()) {
      const index_t lanes = column_lanes();
      column_queries(qs, dim_, G, dim_, lanes, grow(gs.q_cols, dim_ * lanes));
    }
  }

  /// Whether the tiles run in the column layout (decode_kernels.hpp): for more than column_min_rows,
  /// up to two packets of rows. Measured (GQA 32/8, d = 128, 4 query rows = 16 per kv head, Lk = 4096,
  /// one core, best of 30 calls): f32 cache, row layout 4.42-4.47 ms, columns 2.76-2.78 ms; f16 cache
  /// 4.00-4.03 ms against 3.11-3.13 ms.
  [[nodiscard]] bool column_scores() const { return rows_ > column_min_rows && column_packets<T>(rows_) > 0; }
  /// Lanes of a column of scores: the rows rounded up to whole packets.
  [[nodiscard]] index_t column_lanes() const { return column_packets<T>(rows_) * packet_of<T>::width; }
  /// Whether the column layout sums the values with add_weighted_pairs (AVX-512, f32 values, 9 to 16
  /// rows, dv even): each value line read once for all the rows, a broadcast value pair feeding two
  /// FMAs, as column_dots' pairs do for the keys. Measured (GQA 32/8, d = 128, 4 rows per query head,
  /// one core of a Zen 5 VM, paired steps against add_weighted_rows): 0.96-0.97 of the time at Lk = 1024
  /// to 32768; with 8 rows per kv head (2 rows per query head), where half the lanes are idle, 1.20.
  [[nodiscard]] bool value_pairs() const {
#if defined(EIGEN_VECTORIZE_AVX512)
    return std::is_same_v<T, float> && std::is_same_v<KV, float> && rows_ > 8 && column_lanes() == 16 &&
           vdim_ % 2 == 0;
#else
    return false;
#endif
  }

  /// Whether the products read a tile's rows of K or V in the cache (kv_packets: stored in T, or in
  /// f16 / bf16 widened in the loads) rather than from a staged copy in T. Keys are staged when the
  /// encoding rotates them (in the staging buffer, never in the caller's cache), and when they are
  /// stored in half precision and a score-term hook reads them as rows of T.
  static constexpr bool values_direct = kv_packets<KV, T>::direct;
  static constexpr bool keys_direct =
      values_direct && !transforms_keys && (std::is_same_v<KV, T> || !has_score_terms<Bound, T>);
  /// Rows per kv head up to which the row layout runs: one 4-row block of row_dots, and further with
  /// keys stored in half precision that the row layout reads in place (keys_direct): half a packet
  /// with AVX-512 (8 rows), both packets the column layout could take with AVX2 (16 rows, all of it).
  /// The column layout widens such keys into a staged copy, where the row layout widens them in its
  /// loads. Keys staged anyway (rotated, or read by score terms) keep the column layout, as T rows do.
  /// Paired steps, rows / columns, f16, one core of a Zen 5 VM (Lk = 4096 / 32768 / 1024 in L3):
  ///   AVX-512: 8 rows per kv head 0.74-0.92 (64/8 at d = 128 0.82 / 0.79 / 0.79, 8/1 at d = 256
  ///   0.74 / 0.78 / 0.77, 64/8 at d = 64 0.87 / 0.92 / 0.86, two tokens of 32/8 0.77 / 0.83 / 0.79;
  ///   2 threads, 64/8: 0.83 / 0.82 / 0.81; bf16 0.75-0.83), 7 rows (28/4) 0.78 / 0.83 / 0.81, 6 rows
  ///   (12/2) 0.99 / 1.01 / 0.72; with 12 rows 0.96-0.99, with 16 rows 1.16-1.23 (so not past 8).
  ///   AVX2 (-march=native -mno-avx512f), against the column layout with 8-key blocks
  ///   (column_block_keys), GQA 32/8 at d = 128: 8 rows 0.90-0.92, 12 rows 0.80-0.81, 16 rows
  ///   0.94-0.98; against its 4-key blocks, in six shapes of 6 to 8 rows 0.66-0.91, two of 12 rows
  ///   0.65-0.79 and three of 16 rows 0.79-0.93.
  static constexpr index_t half_row_layout_rows =
      packet_of<T>::width >= 16 ? packet_of<T>::width / 2 : 2 * packet_of<T>::width;
  static constexpr index_t column_min_rows = std::is_same_v<KV, T> || !keys_direct ? 4 : half_row_layout_rows;
  /// In the row layout, rows stored in T are staged all the same for more than 4 rows per kv head
  /// (groups too wide for the column layout): then every row is read by several 4-row blocks, and f32
  /// rows 4 KiB apart (BSHD, 8 kv heads x 128) alias in L1 sets and against the stores of the scores
  /// and accumulators. Measured at 16 rows, Lk = 4096: in place 7.0-7.9 ms, staged 5.1-5.4 ms; f16
  /// rows widened in place 3.3-3.7 ms either way.
  [[nodiscard]] bool stage_stored_rows() const { return std::is_same_v<KV, T> && rows_ > 4; }

  /// Rows of K or V as the products read them: in the cache (stored as KV, or as T when that is the
  /// cache's type) or staged in T. For the cache's rows the products prefetch the line `prefetch`
  /// elements past each line they read (0: none): the same head's rows a tile on in the row layout
  /// (rows_ahead), a later head's in the column layout (column_prefetch); none for a staged copy (the
  /// staging prefetches the cache's rows instead: kv_storage.hpp stage_rows).
  template <class E>
  struct rows_ref {
    const E* data;
    index_t stride;
    index_t prefetch = 0;
  };
  /// The cache's rows of one kv head from key `first` of a tile, the products prefetching `prefetch`
  /// elements past them.
  template <class E>
  static rows_ref<E> in_cache(const heads_view<const KV>& x, index_t b, index_t first, index_t hk, index_t prefetch) {
    return rows_ref<E>{x.row(b, first, hk), x.token_stride(), prefetch};
  }
  /// Elements from a row of x to the same element `rows` tokens further (the same head's row), the
  /// products' prefetch offset in the row layout; 0 (none) when the item reads no further tile
  /// (decode_scratch::ahead).
  [[nodiscard]] static index_t rows_ahead(const heads_view<const KV>& x, index_t rows, const decode_scratch<T>& sc) {
    return sc.ahead > 0 ? rows * x.token_stride() : 0;
  }

  /// Whether a tile's scores are computed across the kv heads a few keys at a time, reading the key
  /// rows in place: in BSHD the rows of all kv heads of a key are one contiguous run, so the tile's
  /// keys are read in address order, which the hardware prefetchers follow (measured, GQA 32/8,
  /// d = 128, 1 row, Lk = 4096, one core, against head by head: f32 cache 1.63-1.69 -> 1.53-1.59 ms,
  /// f16 1.35-1.37 -> 1.15-1.17 ms). Staged keys are scored head by head.
  [[nodiscard]] bool keys_swept() const { return keys_direct && !stage_stored_rows(); }

  /// One tile of keys for every kv head: the scores (row_dots) and the softmax step (finish_scores),
  /// then the weighted values (add_weighted); run_tile_columns in the column layout.
  void run_tile(index_t b, const key_block& blk, decode_scratch<T>& sc) const {
    if (column_scores()) return run_tile_columns(b, blk, sc);
    const index_t G = rows_, n = blk.cols;
    T* scores = grow(sc.scores, kv_heads_ * G * n);  // [G x n] per kv head
    if (keys_swept())
      score_across_heads(b, blk, scores, sc);
    else
      for (index_t hk = sc.head_first; hk < sc.head_end; ++hk) {
        const auto k = key_rows(b, hk, blk, sc);
        row_dots(group(sc, hk).q_scaled.data(), dim_, G, k.data, k.stride, n, dim_, scores + hk * G * n, n, k.prefetch);
        finish_scores(b, hk, blk, k, scores + hk * G * n, group(sc, hk), sc);
      }
    if (values_swept()) return add_values_across_heads(b, blk, scores, sc);
    for (index_t hk = sc.head_first; hk < sc.head_end; ++hk) {
      const auto v = value_rows(b, hk, blk, sc);
      const auto add = [&](auto L, index_t prefetch) {
        add_weighted<L()>(scores + hk * G * n, n, G, v.data, v.stride, n, vdim_, group(sc, hk).acc.data(), vdim_,
                          prefetch);
      };
      if (heads_outer())  // one head's value rows, read as a run: prefetched as the keys are
        with_sweep_locality([&](auto L) { add(L, v.prefetch != 0 ? near_rows(vdim_) * v.stride : 0); });
      else
        add(std::integral_constant<int, to_l2>{}, v.prefetch);
    }
  }

  /// Whether run_tile sums the values a few keys at a time across the kv heads (in address order, as
  /// the scores read the keys) instead of head by head: f32, f16 or bf16 values read in place, the
  /// heads of a token adjacent, a chunk of tokens' values at most decode_value_chunk_keys f32 rows of
  /// decode_value_chunk_row_bytes (decode_kernels.hpp value_chunk_keys), and the tokens adjacent
  /// too. On token rows padded past their heads (64 bytes, a strided view) the sweep cost: head by
  /// head took 0.87-0.92x its time (1 row, GQA 32/8, d = 128, Lk = 4096 and 32768, 1 and 2 threads,
  /// Zen 5 VM, both in turns in one process), where on the dense cache the two measured 0.96-1.04 of
  /// each other that day. The column layout sums its values its own way (run_tile_columns).
  static constexpr bool values_sweepable = values_direct && sizeof(KV) <= sizeof(float);
  [[nodiscard]] bool values_swept() const {
    if constexpr (values_sweepable)
      return keys_swept() && !column_scores() && v_.head_stride() == vdim_ && v_.token_stride() == kv_heads_ * vdim_ &&
             value_chunk_keys<KV> * kv_heads_ * vdim_ * static_cast<index_t>(sizeof(KV)) <=
                 decode_value_chunk_keys * decode_value_chunk_row_bytes;
    return false;
  }

  /// O += P V for every kv head of the item, value_chunk_keys keys at a time across the heads,
  /// each chunk prefetching the next one's rows (into L1 or L2: with_sweep_locality; none past the
  /// item's last tile).
  void add_values_across_heads(index_t b, const key_block& blk, const T* scores, decode_scratch<T>& sc) const {
    if constexpr (values_sweepable) {
      const index_t G = rows_, n = blk.cols, chunk = value_chunk_keys<KV>, ahead = rows_ahead(v_, chunk, sc);
      with_sweep_locality([&](auto L) {
        for (index_t j0 = 0; j0 < n; j0 += chunk)
          for (index_t hk = sc.head_first; hk < sc.head_end; ++hk)
            add_weighted<L()>(scores + hk * G * n + j0, n, G, v_.row(b, blk.first + j0, hk), v_.token_stride(),
                              std::min(chunk, n - j0), vdim_, group(sc, hk).acc.data(), vdim_, ahead);
      });
    }
  }

  /// Prefetches the tile's first chunk of values (value_chunk_keys rows of the item's kv heads)
  /// into L1 or L2 (with_sweep_locality), between the scores and the softmax steps. Each chunk of the
  /// sweep prefetches the next, so the first was prefetched by the previous tile's last chunk, and the
  /// tile's keys (256 KiB with f32, 8 kv heads of 128) pushed it out of L1 before it was read; fetched
  /// again here, it arrives while the softmax runs. 1 row, GQA 32/8, d = 128, Zen 5 VM, paired calls
  /// (both orders, calls rotating over 384 MiB of caches): 0.97-1.00 of the time without it, median
  /// 0.99, at Lk = 4096 and 32768 on 1 and 2 threads; the first two chunks 1.00, and two more into L2
  /// besides 1.015-1.017.
  void prefetch_first_values(index_t b, const key_block& blk, const decode_scratch<T>& sc) const {
    const index_t rows = std::min(value_chunk_keys<KV>, blk.cols);
    const index_t elements = (rows - 1) * v_.token_stride() + (sc.head_end - sc.head_first) * vdim_;
    with_sweep_locality([&](auto L) {
      prefetch_lines<0, L()>(v_.row(b, blk.first, sc.head_first), elements * static_cast<index_t>(sizeof(KV)));
    });
  }

  /// Head passes ahead that the column layout prefetches for rows of `dim` elements of E: those that
  /// make decode_column_prefetch_bytes, 1 to decode_column_prefetch_heads (decode_kernels.hpp).
  template <class E>
  [[nodiscard]] static constexpr index_t column_prefetch_passes(index_t dim) {
    const index_t pass = decode_tile_keys * dim * static_cast<index_t>(sizeof(E));
    return std::clamp<index_t>(decode_column_prefetch_bytes / pass, 1, decode_column_prefetch_heads);
  }

  /// Elements from a row of kv head hk in the current tile to the same element of the rows the column
  /// layout reads column_prefetch_passes head passes later (as many as the item has, at most): those of
  /// a later head of the item in this tile, or, past its last head, in the next tile; 0 (no prefetch)
  /// when the item does not read the next tile (decode_scratch::ahead). In BHSD the offset may be
  /// negative; prefetch_past takes it modulo 2^64.
  template <class X>
  [[nodiscard]] static index_t column_prefetch(const X& x, index_t hk, const decode_scratch<T>& sc) {
    if (sc.ahead == 0) return 0;
    const index_t heads = sc.head_end - sc.head_first;
    const index_t later = std::min(column_prefetch_passes<typename X::scalar>(x.dim()), heads);
    if (hk + later < sc.head_end) return later * x.head_stride();
    return decode_tile_keys * x.token_stride() + (later - heads) * x.head_stride();
  }

  /// run_tile in the column layout: per kv head S^T = K Q^T (column_dots), the masks applied to it in
  /// place (masks_only) or, with hooks or a softcap, the scores turned into rows and back, the softmax
  /// down the columns; then O += P V (add_weighted_rows), each head's values read once, in place when
  /// kv_packets can.
  void run_tile_columns(index_t b, const key_block& blk, decode_scratch<T>& sc) const {
    const index_t G = rows_, n = blk.cols, lanes = column_lanes();
    T* scores = grow(sc.scores, kv_heads_ * n * lanes);  // S^T [n x lanes] per kv head
    for (index_t hk = sc.head_first; hk < sc.head_end; ++hk) {
      auto& gs = group(sc, hk);
      T* st = scores + hk * n * lanes;
      const auto k = column_key_rows(b, hk, blk, sc);
      column_dots(gs.q_cols.data(), G, lanes, dim_, k.data, k.stride, n, st, lanes, k.prefetch);
      if (masks_only()) {
        if (!all_visible(b, blk))  // masked in place, down the columns
          mask_scores(b, blk, matrix_map<T>(st, n, lanes, Eigen::OuterStride<>(lanes)).leftCols(G).transpose(), sc);
      } else {  // the hooks and the softcap take rows
        T* s = grow(sc.score_rows, G * n);
        transpose_into(st, lanes, G, n, s, n);
        score_hooks(b, hk, blk, k, s, gs, sc);
        transpose_into(s, n, n, G, st, lanes);
      }
      gs.rescale = gs.softmax.step_columns(st, n, lanes);
    }
    for (index_t hk = sc.head_first; hk < sc.head_end; ++hk) {
      auto& gs = group(sc, hk);
      // the accumulators' rescale by alpha is folded into the product's loads of them
      const T* alpha = gs.rescale ? gs.softmax.alpha.data() : nullptr;
#if defined(EIGEN_VECTORIZE_AVX512)
      if constexpr (std::is_same_v<T, float> && std::is_same_v<KV, float>) {
        if (value_pairs()) {
          add_weighted_pairs(scores + hk * n * lanes, lanes, v_.row(b, blk.first, hk), v_.token_stride(), n, vdim_,
                             gs.acc.data(), alpha, column_prefetch(v_, hk, sc));
          continue;
        }
      }
#endif
      if constexpr (values_direct) {
        add_weighted_rows(scores + hk * n * lanes, lanes, G, v_.row(b, blk.first, hk), v_.token_stride(), n, vdim_,
                          gs.acc.data(), vdim_, alpha, column_prefetch(v_, hk, sc));
      } else {  // staged (value_rows prefetches the cache's rows a tile ahead)
        const auto v = value_rows(b, hk, blk, sc);
        add_weighted_rows(scores + hk * n * lanes, lanes, G, v.data, v.stride, n, vdim_, gs.acc.data(), vdim_, alpha);
      }
    }
  }

  /// Whether the masks are all that score_hooks would apply (no hooks, no softcap): the column layout
  /// then masks S^T in place instead of turning a tile's scores into rows and back, element by
  /// element. A 4-row GQA 32/8 step, whose last tile the causal mask cuts, took with the two
  /// transposes 1.11x the time at Lk = 32, 1.05x at 128, 1.01x at 512 (one core of a Zen 5 VM, both
  /// ways in turns in one process).
  [[nodiscard]] bool masks_only() const {
    return !has_score_terms<Bound, T> && !has_position_bias<Bound, T> && !(softcap_ > T(0));
  }

  /// The masks of call_masks on a tile's scores `s` (row i: query row i of the group; mask_tile).
  template <class S>
  void mask_scores(index_t b, const key_block& blk, S&& s, const decode_scratch<T>& sc) const {
    mask_tile<T>(std::forward<S>(s), sc.q_pos.data(), masks_.kp(b) + blk.first, masks_.kv(b) + blk.first,
                 blk.valid != blk.cols, masks_.causal, blk.ascending, masks_.window);
  }

  /// A tile's key rows as T for column_dots: the cache rows when stored in T and not rotated (each
  /// is read once, as a run of broadcasts), else widened (and rotated) into the staging buffer.
  rows_ref<T> column_key_rows(index_t b, index_t hk, const key_block& blk, decode_scratch<T>& sc) const {
    if constexpr (std::is_same_v<KV, T> && !transforms_keys) {
      return in_cache<T>(k_, b, blk.first, hk, column_prefetch(k_, hk, sc));
    } else {
      T* dst = grow(sc.k_work, blk.cols * dim_);
      stage_rows(k_.row(b, blk.first, hk), k_.token_stride(), blk.cols, dim_, dst, column_prefetch(k_, hk, sc));
      if constexpr (transforms_keys)
        enc_.transform_qk(qk_role::key, hk,
                          std::span<const std::int64_t>(masks_.kp(b) + blk.first, static_cast<std::size_t>(blk.cols)),
                          matrix_map<T>(dst, blk.cols, dim_, Eigen::OuterStride<>(dim_)));
      return rows_ref<T>{dst, dim_};
    }
  }

  /// The tile's scores read from the cache rows in place, a few keys at a time across the kv heads
  /// (keys_swept), then finished per kv head.
  void score_across_heads(index_t b, const key_block& blk, T* scores, decode_scratch<T>& sc) const {
    if constexpr (keys_direct) {  // keys_swept() is false otherwise
      const index_t G = rows_, n = blk.cols, h0 = sc.head_first;
      // one sweep per register block of rows (one for the usual <= 4 rows per kv head)
      scores_across_heads<T, KV>(sc.q_heads.data() + h0, G, sc.head_end - h0, k_.row(b, blk.first, h0), k_.token_stride(),
                                 k_.head_stride(), n, dim_, scores + h0 * G * n, G * n,
                                 rows_ahead(k_, near_rows(dim_), sc));
      if (values_swept()) prefetch_first_values(b, blk, sc);
      for (index_t hk = sc.head_first; hk < sc.head_end; ++hk)
        finish_scores(b, hk, blk, in_cache<KV>(k_, b, blk.first, hk, 0), scores + hk * G * n, group(sc, hk), sc);
    }
  }

  static typename decode_scratch<T>::group_state& group(decode_scratch<T>& sc, index_t hk) {
    return sc.groups[static_cast<std::size_t>(hk)];
  }

  /// A tile's scores for one kv head's group, past the products: hooks, masks, softmax step (the
  /// scores become the weights), the accumulators rescaled.
  template <class E>
  void finish_scores(index_t b, index_t hk, const key_block& blk, const rows_ref<E>& k, T* scores,
                     typename decode_scratch<T>::group_state& gs, decode_scratch<T>& sc) const {
    score_hooks(b, hk, blk, k, scores, gs, sc);
    if (gs.softmax.step(matrix_map<T>(scores, rows_, blk.cols, Eigen::OuterStride<>(blk.cols)))) rescale(gs);
  }

  /// The accumulators of a group multiplied by the softmax step's alpha.
  void rescale(typename decode_scratch<T>::group_state& gs) const {
    matrix_map<T> acc(gs.acc.data(), rows_, vdim_, Eigen::OuterStride<>(vdim_));
    acc = gs.softmax.alpha.asDiagonal() * acc;
  }

  /// A tile's scores (G x n rows) before the softmax step: score terms, softcap, position bias, masks.
  template <class E>
  void score_hooks(index_t b, index_t hk, const key_block& blk, const rows_ref<E>& k, T* scores,
                   const typename decode_scratch<T>::group_state& gs, decode_scratch<T>& sc) const {
    const index_t G = rows_, n = blk.cols;
    matrix_map<T> s(scores, G, n, Eigen::OuterStride<>(n));

    // the order of attention_tile.hpp: score terms, softcap, position bias, masks
    const const_matrix_map<T> k_rows = hook_keys(k, n);
    if constexpr (has_score_terms<Bound, T>)
      for_each_head(b, hk, blk, k_rows, s, gs, [&](const posenc::tile<T>& t, matrix_map<T> sg) { enc_.add_score_terms(t, scale_, sg); });
    if (softcap_ > T(0)) softcap_tile<T>(s, softcap_);
    if constexpr (has_position_bias<Bound, T>)
      for_each_head(b, hk, blk, k_rows, s, gs, [&](const posenc::tile<T>& t, matrix_map<T> sg) { enc_.add_position_bias(t, sg); });
    if (!all_visible(b, blk)) mask_scores(b, blk, s, sc);
  }

  /// f(tile, scores) for each query head of the group: the hooks see one head's rows of the scores.
  template <class F>
  void for_each_head(index_t b, index_t hk, const key_block& blk, const const_matrix_map<T>& k, matrix_map<T> s,
                     const typename decode_scratch<T>::group_state& gs, F&& f) const {
    const index_t n = blk.cols;
    const index_t k_first = masks_.k_first + blk.first;  // the caller's index (leading_keys_unseen)
    for (index_t g = 0; g < group_; ++g) {
      const posenc::tile<T> t{.batch = b, .head = hk * group_ + g, .kv_head = hk, .q_first = 0, .k_first = k_first,
                              .rows = q_len_, .cols = n, .q_pos = masks_.qp(b), .k_pos = masks_.kp(b) + blk.first,
                              .q = const_matrix_map<T>(gs.q_work.data() + g * q_len_ * dim_, q_len_, dim_,
                                                       Eigen::OuterStride<>(dim_)),
                              .k = k};
      f(t, matrix_map<T>(s.data() + g * q_len_ * n, q_len_, n, Eigen::OuterStride<>(n)));
    }
  }

  /// The tile's keys as T rows for the hooks. Keys read from a half-precision cache in place give none:
  /// only a position bias (which reads positions, never keys) runs on them (keys_in_place).
  template <class E>
  const_matrix_map<T> hook_keys(const rows_ref<E>& k, index_t n) const {
    if constexpr (std::is_same_v<E, T>) {
      return const_matrix_map<T>(k.data, n, dim_, Eigen::OuterStride<>(k.stride));
    } else {
      return const_matrix_map<T>(nullptr, 0, 0, Eigen::OuterStride<>(1));
    }
  }

  /// A tile's rows of K or V (`x`, `dim` wide): in the cache when `direct` allows it (and, stored in T,
  /// for at most 4 rows per kv head), else staged in T into `buffer`; the cache's rows are prefetched
  /// a tile on (decode_prefetch_rows: rows_ahead), by the products or the staging.
  template <bool direct, class Buffer>
  auto cache_rows(const heads_view<const KV>& x, index_t dim, index_t b, index_t hk, const key_block& blk,
                  Buffer& buffer, const decode_scratch<T>& sc) const {
    const index_t prefetch = rows_ahead(x, decode_prefetch_rows, sc);
    if constexpr (direct && !std::is_same_v<KV, T>) {
      return in_cache<KV>(x, b, blk.first, hk, prefetch);
    } else {
      if constexpr (direct)
        if (!stage_stored_rows()) return in_cache<T>(x, b, blk.first, hk, prefetch);
      T* dst = grow(buffer, blk.cols * dim);
      stage_rows(x.row(b, blk.first, hk), x.token_stride(), blk.cols, dim, dst, prefetch);
      return rows_ref<T>{dst, dim};
    }
  }

  /// A tile's key rows (cache_rows); staged keys are rotated in the staging buffer when the encoding
  /// rotates keys (keys_direct is false then).
  auto key_rows(index_t b, index_t hk, const key_block& blk, decode_scratch<T>& sc) const {
    const auto k = cache_rows<keys_direct>(k_, dim_, b, hk, blk, sc.k_work, sc);
    if constexpr (transforms_keys)
      enc_.transform_qk(qk_role::key, hk,
                        std::span<const std::int64_t>(masks_.kp(b) + blk.first, static_cast<std::size_t>(blk.cols)),
                        matrix_map<T>(sc.k_work.data(), blk.cols, dim_, Eigen::OuterStride<>(dim_)));
    return k;
  }

  auto value_rows(index_t b, index_t hk, const key_block& blk, decode_scratch<T>& sc) const {
    return cache_rows<values_direct>(v_, vdim_, b, hk, blk, sc.v_work, sc);
  }

  [[nodiscard]] const key_block& key_tile(index_t b, index_t ti) const {
    return tiles_[static_cast<std::size_t>(b * tiles_per_row_ + ti)];
  }

  /// Whether some query of batch row b sees a key of the tile.
  [[nodiscard]] bool seen(index_t b, const key_block& blk) const {
    if (blk.valid == 0 || q_len_ == 0) return false;
    if (!masks_.causal) return true;
    return blk.pos_min <= q_max_[static_cast<std::size_t>(b)] &&
           !before_window(q_min_[static_cast<std::size_t>(b)], blk.pos_max, masks_.window);
  }
  [[nodiscard]] index_t first_seen_tile(index_t b, index_t from, index_t to) const {
    while (from < to && !seen(b, key_tile(b, from))) ++from;
    return from;
  }
  /// Whether every query of batch row b sees every key of the tile (no mask to apply).
  [[nodiscard]] bool all_visible(index_t b, const key_block& blk) const {
    const auto i = static_cast<std::size_t>(b);
    return blk.valid == blk.cols && (!masks_.causal || (blk.pos_max <= q_min_[i] &&
                                                        causal_visible(q_max_[i], blk.pos_min, masks_.window)));
  }

  /// out and lse of one (batch, kv head) from its segments, in segment order:
  ///   M = max_s m_s,  L = sum_s exp(m_s - M) l_s,  O = sum_s exp(m_s - M) O_s,
  /// then the head's sink folded into (M, L) once (online_softmax::fold_sink), out = O / L and
  /// lse = M + log L (online_softmax::finish_row and lse: zeros and -inf for a row that sees no key, NaN
  /// for a poisoned one).
  void merge_segments(index_t b, index_t hk, online_softmax<T>& st, Eigen::Matrix<T, 1, Eigen::Dynamic>& o) {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    const index_t G = rows_;
    const index_t first_part = (b * kv_heads_ + hk) * segments_ * G;
    // one segment and no sink: o would be the part's row times exp(0) = 1, so the row is finished
    // from the part itself, the same values (with o set and added to per row, GQA 32/8 steps took
    // 1.06x the time with 4 rows and 1.04x with 1 at Lk = 32, 1.02-1.03x and 1.01x at Lk = 64; one
    // core of a Zen 5 VM, both ways in turns in one process)
    const bool single = segments_ == 1 && sinks_.empty();
    st.reset(G);
    for (index_t r = 0; r < G; ++r) {
      const index_t g = r / q_len_, i = r % q_len_, head = hk * group_ + g;
      T M = neg_inf, L = 0;
      bool poisoned = false;
      for (index_t s = 0; s < segments_; ++s) {
        const T m = part_m_(first_part + s * G + r);
        poisoned = poisoned || std::isnan(m);
        M = std::max(M, m);
      }
      if (!single) o.setZero(vdim_);
      if (poisoned) {
        M = L = std::numeric_limits<T>::quiet_NaN();
      } else if (M != neg_inf) {
        for (index_t s = 0; s < segments_; ++s) {
          const index_t part = first_part + s * G + r;
          const T m = part_m_(part);
          if (m == neg_inf) continue;
          const T w = std::exp(m - M);
          L += w * part_l_(part);
          if (!single) o += w * part_row(part);
        }
      }
      st.m(r) = M;
      st.l(r) = L;
      if (!sinks_.empty()) o *= st.fold_sink(r, sinks_[static_cast<std::size_t>(head)]);
      Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> dst(out_.row(b, i, head), vdim_);
      if (single)
        st.finish_row(r, dst, part_row(first_part + r));
      else
        st.finish_row(r, dst, o);
      if (lse_ != nullptr) lse_[(b * heads_ + head) * q_len_ + i] = st.lse(r);
    }
  }

  /// The accumulated output row of a part (a segment's row of one group).
  [[nodiscard]] Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> part_row(index_t part) const {
    return {part_acc_.data() + part * vdim_, vdim_};
  }

  /// `buffer` grown to `width` elements per part of the call (batch row, kv head, segment, row).
  [[nodiscard]] Eigen::Map<Eigen::VectorX<T>> part_buffer(Eigen::VectorX<T>& buffer, index_t width) const {
    const index_t n = masks_.batch * kv_heads_ * segments_ * rows_ * width;
    return {grow(buffer, n), n};
  }

  template <class B>
  static T* grow(B& buffer, index_t n) {
    if (buffer.size() < n) buffer.resize(n);
    return buffer.data();
  }

  heads_view<const T> q_;
  heads_view<const KV> k_, v_;
  heads_view<T> out_;
  T* lse_;
  const Bound& enc_;
  const call_masks& masks_;
  T scale_, softcap_;
  std::vector<T> sinks_;
  index_t heads_, kv_heads_, group_, q_len_, rows_, dim_, vdim_, segments_;
  /// Keys per tile: decode_swept_tile_keys or decode_tile_keys (always the latter in the column layout,
  /// whose prefetch distances count tiles of decode_tile_keys: column_prefetch). Set from the members
  /// above it, which values_swept reads.
  index_t tile_keys_;
  std::vector<key_block> tiles_;
  index_t tiles_per_row_;
  std::vector<std::int64_t> q_min_, q_max_;
  /// The segments' partial results, in buffers the calling thread keeps between calls: O alone is
  /// 256 KiB for 1 row of GQA 32/8 at d = 128 and Lk = 32768 (16 segments), and as a new allocation
  /// glibc returned it to the kernel after each call, so every step faulted its pages in afresh on
  /// their first writes: 0.8-1.0 ms of an 11-14 ms 1-row f32 step (one core of a Zen 5 VM).
  thread_scratch<decode_partials<T>> partials_;
  Eigen::Map<Eigen::VectorX<T>> part_acc_, part_m_, part_l_;
};

}  // namespace posenc::detail
