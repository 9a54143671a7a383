// posenc/detail/attention_schedule.hpp — the fused kernel's scheduling: which work items exist, which
// query blocks ("units") each holds, and which key blocks each unit sees (the causal plan).
//
// Units of work (docs/design.md › Units of work):
//   tile   one query block x one key block of one (batch, head): the unit of the tile math;
//   unit   one query block of one (batch, head) over all its key blocks (q_block rows);
//   item   up to default_units_per_item units of one (batch, kv head), run by one thread: each K/V
//          block is packed once for all of them;
//   block  a key block (k_block keys of one batch row), summarized once per call (key_block).
// With a sliding window (causal only) a key block that lies before the window of every query of a
// unit is skipped like a block above the causal diagonal: for L = 16384 and W = 4096 a query block
// visits at most W / k_block + 2 key blocks instead of up to L / k_block.
// Nothing here reads q, k or v: the schedule depends only on shapes, positions and masks, so the
// arithmetic of a unit never depends on the thread count.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "posenc/detail/mask.hpp"
#include "posenc/detail/position_scan.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

// Default tile sizes, chosen by measurement (docs/performance.md › Tile sizes).
inline constexpr index_t default_q_block = 256;
inline constexpr index_t default_k_block = 256;
/// Query blocks (of one kv head) per work item: they share each K/V block's packing; 4 keeps the
/// item's state (4 x (packed Q + output) = 512 KiB in float at d = 128) inside a 2 MiB L2
/// (docs/performance.md › Tile sizes).
inline constexpr index_t default_units_per_item = 4;

/// Whether a query block multiplies on packed operands (tile_gemm) or through Eigen expressions.
/// Packing K/V for a single query row pays only when other query heads share the packed block (GQA)
/// (docs/performance.md › Packed or expression products). Depends only on the problem's shape, never
/// on the grouping of work items, so results stay thread-count invariant.
[[nodiscard]] inline bool packed_products(index_t rows, index_t group) { return rows >= 2 || group >= 2; }

/// Summary of one key block of one batch row: lets the kernel skip blocks nothing can see and
/// avoid masking blocks everything sees.
struct key_block {
  index_t first = 0, cols = 0;
  index_t valid = 0;                        ///< keys that are not padding
  std::int64_t pos_min = 0, pos_max = 0;    ///< over all keys of the block
  bool ascending = true;                    ///< positions non-decreasing (the usual case)
};

/// The blocks of `block` keys of every batch row, summarized. A decode step summarizes its whole cache
/// every call, before any thread starts: so each summary is a branch-free loop the compiler
/// vectorizes, a row of ascending positions (the usual case) gives every block's range from its ends,
/// and a row without padding every block's count of valid keys (one loop testing every key of each
/// block took 36 us at k_len = 32768, this 4.4 us).
/// The block that holds a row's last valid key ends with it: a shorter row of a ragged batch
/// (kv_lengths, trailing padding) never has the values of the slots after its last token read, where
/// a preallocated cache may hold anything (0 * NaN would reach the row's output). The blocks after it
/// keep their size and have no valid key.
inline std::vector<key_block> summarize_key_blocks(const call_masks& m, index_t block) {
  const index_t nkb = m.k_len == 0 ? 0 : (m.k_len + block - 1) / block;
  std::vector<key_block> out(static_cast<std::size_t>(m.batch * nkb));
  for (index_t b = 0; b < m.batch; ++b) {
    const std::int64_t* pos = m.kp(b);
    const unsigned char* valid = m.kv(b);
    const bool row_ascending = ascending_positions(pos, m.k_len);
    const bool row_valid = m.k_len == 0 || std::memchr(valid, 0, static_cast<std::size_t>(m.k_len)) == nullptr;
    index_t row_end = m.k_len;  // one past the row's last valid key (0: none)
    if (!row_valid)
      while (row_end > 0 && valid[row_end - 1] == 0) --row_end;
    for (index_t kb = 0; kb < nkb; ++kb) {
      key_block& s = out[static_cast<std::size_t>(b * nkb + kb)];
      s.first = kb * block;
      s.cols = std::min(block, (s.first < row_end ? row_end : m.k_len) - s.first);
      const std::int64_t* p = pos + s.first;
      const unsigned char* v = valid + s.first;
      index_t n_valid = s.cols;
      if (!row_valid) {
        n_valid = 0;
        for (index_t j = 0; j < s.cols; ++j) n_valid += v[j] != 0 ? 1 : 0;
      }
      s.valid = n_valid;
      if (row_ascending) {
        s.pos_min = p[0];
        s.pos_max = p[s.cols - 1];
        s.ascending = true;
      } else {
        position_range(p, s.cols, s.pos_min, s.pos_max);
        s.ascending = ascending_positions(p, s.cols);
      }
    }
  }
  return out;
}

/// One (head, query block) of a work item.
struct query_unit {
  index_t head = 0, q0 = 0, rows = 0;
  const std::int64_t* q_pos = nullptr;
  std::int64_t q_min = 0, q_max = 0;
  bool packed = false;  ///< products on packed operands (tile_gemm); else Eigen expressions (few rows)
};

/// A key block some unit of a work item sees: the keys it provides (kcols) and each unit's share.
struct block_plan {
  index_t kb = 0;  ///< its index in the batch row's key blocks
  index_t kcols = 0;
  bool any_packed = false;
  std::array<index_t, default_units_per_item> cols{};  ///< per unit (0: the unit does not see the block)
};

/// One work item: up to default_units_per_item units of one (batch, kv head).
struct work_item {
  index_t b = 0, hk = 0, count = 0;
  std::array<query_unit, default_units_per_item> units{};
};

class attention_schedule {
 public:
  /// `a_panel`: rows of a packed K panel (tile_gemm::a_panel); a packed unit's causal cut is rounded
  /// up to it. `threads` only sets how many units an item holds, which never changes a unit's result.
  attention_schedule(index_t heads, index_t kv_heads, index_t q_block, index_t k_block, const call_masks& masks,
                     index_t threads, index_t a_panel)
      : masks_(masks), heads_(heads), kv_heads_(kv_heads), group_(heads / kv_heads), q_block_(q_block),
        k_block_(k_block), a_panel_(a_panel),
        q_blocks_(masks.q_len == 0 ? 0 : (masks.q_len + q_block - 1) / q_block),
        k_blocks_(masks.k_len == 0 ? 0 : (masks.k_len + k_block - 1) / k_block),
        key_blocks_(summarize_key_blocks(masks, k_block)) {
    for (index_t b = 0; b < masks.batch; ++b) {
      std::int64_t lo = 0, hi = std::numeric_limits<std::int64_t>::min();  // no queries: below every key
      position_range(masks.qp(b), masks.q_len, lo, hi);
      q_max_.push_back(hi);
    }
    if (masks.window > 0) {  // block_seen asks whether some query's window reaches a block
      q_sorted_.assign(masks.q_pos.begin(), masks.q_pos.end());
      for (index_t b = 0; b < masks.batch; ++b)
        std::sort(q_sorted_.begin() + b * masks.q_len, q_sorted_.begin() + (b + 1) * masks.q_len);
    }
    // Up to default_units_per_item units per item, fewer when that would leave under two items per
    // thread.
    const index_t units = masks.batch * heads_ * q_blocks_;
    units_per_item_ = std::clamp<index_t>(units / (2 * threads), 1, default_units_per_item);
    units_per_group_ = group_ * q_blocks_;
    items_per_group_ = (units_per_group_ + units_per_item_ - 1) / units_per_item_;
  }

  [[nodiscard]] index_t items() const { return masks_.batch * kv_heads_ * items_per_group_; }
  [[nodiscard]] index_t units_per_item() const { return units_per_item_; }
  /// Whether one item holds all of a kv head's queries (then nothing else reads its keys).
  [[nodiscard]] bool one_item_per_kv_head() const { return items_per_group_ == 1; }
  [[nodiscard]] index_t k_blocks() const { return k_blocks_; }
  [[nodiscard]] index_t max_q_rows() const { return std::min(q_block_, masks_.q_len); }
  [[nodiscard]] index_t max_k_cols() const { return std::min(k_block_, masks_.k_len); }
  [[nodiscard]] const call_masks& masks() const { return masks_; }

  /// Whether every query block multiplies on packed operands (only the last one can be shorter).
  [[nodiscard]] bool all_packed() const {
    const index_t last_rows = masks_.q_len - (q_blocks_ - 1) * q_block_;
    return packed_products(max_q_rows(), group_) && packed_products(last_rows, group_);
  }

  [[nodiscard]] const key_block& block(index_t b, index_t kb) const {
    return key_blocks_[static_cast<std::size_t>(b * k_blocks_ + kb)];
  }
  [[nodiscard]] std::span<const std::int64_t> key_positions(index_t b, const key_block& blk) const {
    return {masks_.kp(b) + blk.first, static_cast<std::size_t>(blk.cols)};
  }

  /// Whether some query of batch row b can see block blk (it has a valid key, and under a causal
  /// mask a key at or before the row's last query position; with a sliding window, some query at a
  /// position in [pos_min, pos_max + window - 1]).
  [[nodiscard]] bool block_seen(index_t b, const key_block& blk) const {
    if (blk.valid == 0 || masks_.q_len == 0) return false;
    if (!masks_.causal) return true;
    if (blk.pos_min > q_max_[static_cast<std::size_t>(b)]) return false;
    if (masks_.window == 0) return true;
    // The first query at or after pos_min: the block is seen iff its window still reaches pos_max.
    const auto first = q_sorted_.begin() + b * masks_.q_len, last = first + masks_.q_len;
    const auto q = std::lower_bound(first, last, blk.pos_min);
    return q != last && !before_window(*q, blk.pos_max, masks_.window);
  }

  /// Item `item`. Items of one (batch, kv head) are consecutive and, within it, the last query blocks
  /// come first: under a causal mask they see the most keys, so the dynamic schedule ends with short
  /// items and the threads finish together.
  [[nodiscard]] work_item item_at(index_t item) const {
    work_item w;
    const index_t grp = item / items_per_group_;
    const index_t chunk = items_per_group_ - 1 - item % items_per_group_;
    w.b = grp / kv_heads_;
    w.hk = grp % kv_heads_;
    const index_t first_unit = chunk * units_per_item_;
    w.count = std::min(units_per_item_, units_per_group_ - first_unit);
    for (index_t i = 0; i < w.count; ++i) {
      query_unit& u = w.units[static_cast<std::size_t>(i)];
      const index_t unit = first_unit + i;
      u.head = w.hk * group_ + unit / q_blocks_;
      u.q0 = unit % q_blocks_ * q_block_;
      u.rows = std::min(q_block_, masks_.q_len - u.q0);
      u.q_pos = masks_.qp(w.b) + u.q0;
      position_range(u.q_pos, u.rows, u.q_min, u.q_max);
      u.packed = packed_products(u.rows, group_);
    }
    return w;
  }

  /// The key blocks some unit of `w` sees, and how many keys each unit needs from them.
  void plan(const work_item& w, std::vector<block_plan>& out) const {
    out.clear();
    for (index_t kb = 0; kb < k_blocks_; ++kb) {
      const key_block& blk = block(w.b, kb);
      if (blk.valid == 0) continue;  // every key is padding
      block_plan p{.kb = kb};
      for (index_t i = 0; i < w.count; ++i) {
        const query_unit& u = w.units[static_cast<std::size_t>(i)];
        if (masks_.causal && blk.pos_min > u.q_max) continue;  // above the causal diagonal: nothing visible
        if (before_window(u.q_min, blk.pos_max, masks_.window)) continue;  // before every query's window
        p.cols[static_cast<std::size_t>(i)] = needed_keys(w.b, blk, u);
        p.kcols = std::max(p.kcols, p.cols[static_cast<std::size_t>(i)]);
        p.any_packed = p.any_packed || u.packed;
      }
      if (p.kcols > 0) out.push_back(p);
    }
  }

  /// Whether unit u sees every key of blk (no mask to apply on the tile).
  [[nodiscard]] bool all_visible(const key_block& blk, const query_unit& u) const {
    return blk.valid == blk.cols &&
           (!masks_.causal || (blk.pos_max <= u.q_min && causal_visible(u.q_max, blk.pos_min, masks_.window)));
  }

 private:
  /// Keys of block `blk` a unit must compute: all of them, or under a causal mask with ascending
  /// positions the prefix up to the unit's last query position (packed: rounded up to whole panels
  /// of the packed K, whose row prefixes are only packed K's themselves at panel boundaries).
  [[nodiscard]] index_t needed_keys(index_t b, const key_block& blk, const query_unit& u) const {
    if (!masks_.causal || !blk.ascending) return blk.cols;
    const std::int64_t* first = masks_.kp(b) + blk.first;
    const index_t seen = std::upper_bound(first, first + blk.cols, u.q_max) - first;
    if (!u.packed) return seen;
    return std::min(blk.cols, (seen + a_panel_ - 1) / a_panel_ * a_panel_);
  }

  const call_masks& masks_;
  index_t heads_, kv_heads_, group_, q_block_, k_block_, a_panel_, q_blocks_, k_blocks_;
  index_t units_per_item_ = 1, units_per_group_ = 0, items_per_group_ = 0;
  std::vector<key_block> key_blocks_;
  std::vector<std::int64_t> q_max_;  ///< per batch row: the last query position
  std::vector<std::int64_t> q_sorted_;  ///< [batch, q_len] query positions sorted per row (sliding window only)
};

}  // namespace posenc::detail
