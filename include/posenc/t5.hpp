// posenc/t5.hpp — T5's bucketed relative position bias (Raffel et al. 2020, sec. 2.1; Hugging Face
// modeling_t5.py T5Attention.compute_bias): a learned scalar per (bucket, head) added to the logits,
// where the bucket of r = key_position - query_position is exact for small |r| and log-spaced up to
// max_distance (detail/buckets.hpp holds the float32-exact bucket function).
//
// T5 does not scale the logits by 1/sqrt(d) (its initialization absorbs it), so logit_scale() is 1.
// The weight is HF's nn.Embedding `relative_attention_bias.weight`, [num_buckets, heads], viewed
// from host memory or owned. An encoder uses bidirectional buckets; a decoder (is_decoder) uses
// unidirectional ones, where every future key shares bucket 0 — the causal mask itself is the
// caller's attention_options::causal, as in HF where it comes with the decoder's attention mask.
// A KV-cache decode step passes the queries' absolute positions (attention_options::q_offset or
// q_positions), as HF's compute_bias(query_length, key_length, cache_position) does.
//
// In the kernel, bind() computes one bucket per relative distance over the call's range
// [k_min - q_max, k_max - q_min] (O(q_len + k_len) logf calls, once per call) and the per-head bias
// of each distance; a tile then adds a contiguous slice of that vector per query row.
//
//   posenc::t5_relative_bias<float> enc(weight_map, {.num_buckets = 32, .max_distance = 128});
//   posenc::attention(q, k, v, out, enc, {});                       // encoder self-attention
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "posenc/detail/buckets.hpp"
#include "posenc/detail/platform.hpp"
#include "posenc/detail/table.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

struct t5_config {
  index_t num_buckets = 32;    ///< HF relative_attention_num_buckets
  index_t max_distance = 128;  ///< HF relative_attention_max_distance
  bool is_decoder = false;   ///< true: unidirectional buckets (pair it with attention_options::causal)
};

/// T5's bucket of r = key_position - query_position (HF _relative_position_bucket).
[[nodiscard]] inline std::int32_t t5_relative_bucket(std::int64_t relative, index_t num_buckets = 32,
                                                     index_t max_distance = 128, bool bidirectional = true) {
  return detail::t5_bucketizer(num_buckets, max_distance, bidirectional)(relative);
}

template <class W>
class t5_relative_bias {
 public:
  using table_type = Eigen::Tensor<W, 2, Eigen::RowMajor>;

  /// View HF's relative_attention_bias weight [num_buckets, heads] (no copy; keep it alive).
  explicit t5_relative_bias(tensor_map<const W, 2> table, const t5_config& config = {})
      : config_(config), buckets_(config.num_buckets, config.max_distance, !config.is_decoder), table_(table) {
    check();
  }
  /// Own the weight [num_buckets, heads] (moved in).
  explicit t5_relative_bias(table_type table, const t5_config& config = {})
      : config_(config),
        buckets_(config.num_buckets, config.max_distance, !config.is_decoder),
        table_(std::move(table)) {
    check();
  }

  [[nodiscard]] const t5_config& config() const { return config_; }
  [[nodiscard]] index_t num_buckets() const { return config_.num_buckets; }
  [[nodiscard]] index_t heads() const { return table_.cols(); }
  [[nodiscard]] const tensor_map<const W, 2>& table() const { return table_.view(); }

  /// Bucket of r = key_position - query_position.
  [[nodiscard]] std::int32_t bucket(std::int64_t relative) const { return buckets_(relative); }
  /// The bias of one (head, query position, key position).
  [[nodiscard]] W bias(index_t head, std::int64_t q_pos, std::int64_t k_pos) const {
    require(head >= 0 && head < heads(), "head", "must be in [0, heads)", head, " for ", heads(), " heads");
    return table_.row(bucket(k_pos - q_pos))[head];
  }

  /// T5 applies no 1/sqrt(d) to its logits.
  [[nodiscard]] static double logit_scale(index_t /*head_dim*/) { return 1.0; }

  /// What the kernel's tiles see: the bias of every relative distance of one call, per head.
  class bound {
   public:
    [[nodiscard]] static double logit_scale(index_t /*head_dim*/) { return 1.0; }
    /// Bucket of relative distance r (the precomputed one when r is in the call's range).
    [[nodiscard]] std::int32_t bucket(std::int64_t r) const {
      return table_mode_ && r >= r_min_ && r - r_min_ < span_ ? buckets_[static_cast<std::size_t>(r - r_min_)]
                                                              : parent_->bucket(r);
    }
    [[nodiscard]] std::int64_t min_relative() const { return r_min_; }
    [[nodiscard]] std::int64_t max_relative() const { return r_min_ + span_ - 1; }

    /// Kernel hook: s(i, j) += table[bucket(k_pos[j] - q_pos[i]), head], after the (unit) scale.
    template <class T>
    void add_position_bias(const tile<T>& t, matrix_map<T> s) const {
      if (t.rows == 0 || t.cols == 0) return;
      if (!table_mode_) {  // pathological position ranges: bucket per element
        for (index_t i = 0; i < t.rows; ++i)
          for (index_t j = 0; j < t.cols; ++j)
            s(i, j) += static_cast<T>(parent_->table_.row(parent_->bucket(t.k_pos[j] - t.q_pos[i]))[t.head]);
        return;
      }
      const T* hb = head_bias<T>(t.head);
      bool contiguous = true;  // keys k_pos[0], k_pos[0]+1, ...: each row adds one contiguous slice
      for (index_t j = 1; j < t.cols && contiguous; ++j) contiguous = t.k_pos[j] == t.k_pos[0] + j;
      for (index_t i = 0; i < t.rows; ++i) {
        T* row = s.data() + i * s.outerStride();
        if (contiguous) {
          const T* src = hb + (t.k_pos[0] - t.q_pos[i] - r_min_);
          for (index_t j = 0; j < t.cols; ++j) row[j] += src[j];
        } else {
          const std::int64_t base = t.q_pos[i] + r_min_;
          for (index_t j = 0; j < t.cols; ++j) row[j] += hb[t.k_pos[j] - base];
        }
      }
    }

   private:
    friend class t5_relative_bias;
    template <class T>
    [[nodiscard]] const T* head_bias(index_t h) const {
      if constexpr (std::is_same_v<T, float>)
        return bias_f_.data() + h * span_;
      else
        return bias_d_.data() + h * span_;
    }

    const t5_relative_bias* parent_ = nullptr;
    bool table_mode_ = false;
    std::int64_t r_min_ = 0, span_ = 0;
    std::vector<std::int32_t> buckets_;  ///< [span]
    std::vector<double> bias_d_;         ///< [heads, span]
    std::vector<float> bias_f_;          ///< [heads, span]
  };

  /// Per-call preparation: one bucket per relative distance in [k_min - q_max, k_max - q_min].
  [[nodiscard]] bound bind(const call_info& info) const {
    require(info.heads == heads(), "t5_relative_bias", "table heads (columns) must equal the query heads of the call",
            heads(), " vs ", info.heads);
    bound b;
    b.parent_ = this;
    if (info.q_max < info.q_min || info.k_max < info.k_min) return b;  // nothing to attend
    std::int64_t r_min = 0, r_max = 0, width = 0;
    // Contiguous positions give span = q_len + k_len - 1; a sparse range this large (or one whose
    // ends overflow int64) is served per element.
    constexpr std::int64_t max_span = std::int64_t{1} << 24;
    if (detail::sub_overflow(info.k_min, info.q_max, r_min) || detail::sub_overflow(info.k_max, info.q_min, r_max) ||
        detail::sub_overflow(r_max, r_min, width) || width >= max_span)
      return b;
    b.table_mode_ = true;
    b.r_min_ = r_min;
    b.span_ = r_max - r_min + 1;
    const auto span = static_cast<std::size_t>(b.span_);
    const index_t H = heads();
    b.buckets_.resize(span);
    b.bias_d_.resize(span * static_cast<std::size_t>(H));
    b.bias_f_.resize(span * static_cast<std::size_t>(H));
    for (std::size_t r = 0; r < span; ++r) {
      const std::int32_t k = buckets_(r_min + static_cast<std::int64_t>(r));
      b.buckets_[r] = k;
      const W* w = table_.row(k);
      for (index_t h = 0; h < H; ++h) {
        b.bias_d_[static_cast<std::size_t>(h) * span + r] = static_cast<double>(w[h]);
        b.bias_f_[static_cast<std::size_t>(h) * span + r] = static_cast<float>(w[h]);
      }
    }
    return b;
  }

 private:
  void check() const {
    require(table_.rows() == config_.num_buckets, "relative_attention_bias",
            "must have num_buckets rows ([num_buckets, heads], nn.Embedding layout)", table_.rows(), " rows vs ",
            config_.num_buckets, " buckets");
    require(table_.cols() > 0, "relative_attention_bias", "must have at least one head column", table_.cols());
    require(table_.view().data() != nullptr, "relative_attention_bias", "data must not be null");
  }

  t5_config config_;
  detail::t5_bucketizer buckets_;
  detail::table_storage<W> table_;
};

}  // namespace posenc
