// posenc/detail/bucket_bias.hpp — a learned scalar per (relative bucket, head) added to the logits,
// prepared once per call: one bucket per relative distance r = key - query over the call's range and
// the bias of each r for each head, so a tile adds a contiguous slice per query row.
//
// T5's relative bias (t5.hpp; Raffel et al. 2020, sec. 2.1) and TUPE's relative term (tupe.hpp; Ke et
// al. 2021, sec. 3.2, which reuses T5's buckets) are the same computation over the same bucket
// function (detail/buckets.hpp). TUPE replaces the [CLS] row and column by other terms, so the tile
// hook can leave the rows and columns of one position untouched (`skip_position`).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "posenc/detail/buckets.hpp"
#include "posenc/detail/relative.hpp"
#include "posenc/detail/table.hpp"
#include "posenc/encoding.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

/// The per-call table of a bucketed relative bias. `buckets` and `table` ([num_buckets, heads]) belong
/// to the encoding whose bind() made this object and must outlive it (they are only read).
template <class W>
class bucket_bias_table {
 public:
  bucket_bias_table() = default;

  bucket_bias_table(const t5_bucketizer* buckets, const tensor_map<const W, 2>* table, const call_info& info)
      : buckets_(buckets), table_(table) {
    if (info.q_max < info.q_min || info.k_max < info.k_min) return;  // nothing to attend
    // One bucket per key - query distance of the call; a pathological range is served per element.
    const auto range = call_distance_range(info.k_min, info.k_max, info.q_min, info.q_max);
    if (!range) return;
    const std::int64_t r_min = range->lo;
    table_mode_ = true;
    r_min_ = r_min;
    span_ = range->count();
    const auto span = static_cast<std::size_t>(span_);
    const index_t H = table->dimension(1);
    buckets_of_r_.resize(span);
    bias_.d.resize(span * static_cast<std::size_t>(H));
    for (std::size_t r = 0; r < span; ++r) {
      const std::int32_t k = (*buckets)(r_min + static_cast<std::int64_t>(r));
      buckets_of_r_[r] = k;
      const W* w = row(k);
      for (index_t h = 0; h < H; ++h) bias_.d[static_cast<std::size_t>(h) * span + r] = static_cast<double>(w[h]);
    }
    bias_.round();
  }

  /// Bucket of relative distance r (the precomputed one when r is in the call's range).
  [[nodiscard]] std::int32_t bucket(std::int64_t r) const {
    return table_mode_ && r >= r_min_ && r - r_min_ < span_ ? buckets_of_r_[static_cast<std::size_t>(r - r_min_)]
                                                            : (*buckets_)(r);
  }
  [[nodiscard]] std::int64_t min_relative() const { return r_min_; }
  [[nodiscard]] std::int64_t max_relative() const { return r_min_ + span_ - 1; }

  /// s(i, j) += table[bucket(k_pos[j] - q_pos[i]), head] for every pair of the tile, except the rows
  /// whose query and the columns whose key is at `skip_position` (when given).
  template <class T>
  void add(const tile<T>& t, matrix_map<T> s, std::optional<std::int64_t> skip_position = std::nullopt) const {
    if (t.rows == 0 || t.cols == 0) return;
    const bool skip = skip_position.has_value();
    const std::int64_t sp = skip ? *skip_position : 0;
    if (!table_mode_) {  // pathological position ranges: bucket per element
      for (index_t i = 0; i < t.rows; ++i) {
        if (skip && t.q_pos[i] == sp) continue;
        for (index_t j = 0; j < t.cols; ++j) {
          if (skip && t.k_pos[j] == sp) continue;
          s(i, j) += static_cast<T>(row((*buckets_)(t.k_pos[j] - t.q_pos[i]))[t.head]);
        }
      }
      return;
    }
    const T* hb = bias_.template data<T>() + t.head * span_;
    bool contiguous = true;  // keys k_pos[0], k_pos[0]+1, ...: each row adds one contiguous slice
    for (index_t j = 1; j < t.cols && contiguous; ++j) contiguous = t.k_pos[j] == t.k_pos[0] + j;
    // Contiguous keys hold the skipped position at most once, in column j0 (cols: nowhere).
    index_t j0 = t.cols;
    if (skip && contiguous && t.k_pos[0] <= sp && sp - t.k_pos[0] < t.cols) j0 = static_cast<index_t>(sp - t.k_pos[0]);
    for (index_t i = 0; i < t.rows; ++i) {
      if (skip && t.q_pos[i] == sp) continue;
      T* out = s.data() + i * s.outerStride();
      if (contiguous) {
        const T* src = hb + (t.k_pos[0] - t.q_pos[i] - r_min_);
        for (index_t j = 0; j < j0; ++j) out[j] += src[j];
        for (index_t j = j0 + 1; j < t.cols; ++j) out[j] += src[j];
      } else {
        const std::int64_t base = t.q_pos[i] + r_min_;
        if (skip) {
          for (index_t j = 0; j < t.cols; ++j) out[j] += t.k_pos[j] == sp ? T(0) : hb[t.k_pos[j] - base];
        } else {
          for (index_t j = 0; j < t.cols; ++j) out[j] += hb[t.k_pos[j] - base];
        }
      }
    }
  }

 private:
  [[nodiscard]] const W* row(std::int32_t bucket) const {
    return table_->data() + static_cast<index_t>(bucket) * table_->dimension(1);
  }

  const t5_bucketizer* buckets_ = nullptr;
  const tensor_map<const W, 2>* table_ = nullptr;
  bool table_mode_ = false;
  std::int64_t r_min_ = 0, span_ = 0;
  std::vector<std::int32_t> buckets_of_r_;  ///< [span]
  dual_values bias_;                        ///< [heads, span]
};

}  // namespace posenc::detail
