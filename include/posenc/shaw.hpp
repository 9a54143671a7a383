// posenc/shaw.hpp — Shaw, Uszkoreit & Vaswani (2018), "Self-Attention with Relative Position
// Representations": learned vectors a^K and a^V per clipped relative distance, added to the keys
// and to the values of self-attention (section 3.1, eqs. 3-4):
//   e_ij  = (q_i . k_j + q_i . a^K_ij) / sqrt(d)
//   out_i = sum_j softmax_j(e_ij) (v_j + a^V_ij)
//   a^K_ij = w^K[clip(j - i, -k, k) + k],  a^V_ij = w^V[clip(j - i, -k, k) + k]
// with k = max_relative_position and tables of 2k + 1 rows (section 3.2). This is the formulation of
// tensor2tensor (common_attention.py, dot_product_attention_relative), OpenNMT-py
// (MultiHeadedAttention with max_relative_positions > 0) and CTranslate2 (layers/attention.cc,
// variables relative_position_keys / relative_position_values): the logit scale multiplies the
// relative term too (the queries are scaled before both products), and the tables are shared by all
// heads ([2k+1, head_dim]). A per-head table [2k+1, heads, head_dim] is accepted as well.
//
// Relative distances come from the absolute positions of the call (tile.q_pos, tile.k_pos), so a
// KV-cache decode step (queries at q_offset + i) and packed or padded sequences need nothing else;
// CTranslate2's cached step (the last row of the same matrix) is the special case Sq = 1.
//
// In the kernel (docs/design.md), per tile:
//   keys:   one product P = scale * Q_tile W^K[lo..hi]^T over the buckets [lo, hi] the tile's positions
//           can reach (detail::clipped_relative_range; at most rows + cols - 1 of them, at most 2k + 1),
//           then a gather S(i, j) += P(i, bucket(i, j) - lo) (detail::gather_add_clipped). A tile that
//           lies entirely beyond +-k has one bucket: one dot product per query row, added to the row.
//   values: the kernel accumulates each row's probability mass per bucket (value_buckets) and adds
//           mass x W^V once at the end (value_table); uniform_value_bucket names the single bucket of a
//           tile that lies beyond +-k.
// Nothing of size L x L (x d) is formed. Scratch (P) lives in a per-thread buffer.
//
// The tables are viewed, never copied, when their scalar type is the call's; a call in the other
// precision converts them once per call in bind() ((2k+1) x heads x d values).
//
//   posenc::shaw_relative<float> enc(posenc::tensor_map<const float, 2>(wk, 2 * 16 + 1, 64),
//                                    posenc::tensor_map<const float, 2>(wv, 2 * 16 + 1, 64),
//                                    {.max_relative_position = 16});
//   posenc::attention<float>(q, k, v, out, enc, {.causal = true});
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "posenc/detail/relative.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

/// Which of Shaw's two terms an encoding applies (the paper's ablation, table 3: keys, values or both).
enum class shaw_terms { keys, values, keys_values };

struct shaw_config {
  /// k: relative distances are clipped to [-k, k] (tensor2tensor max_relative_position, OpenNMT-py
  /// max_relative_positions, CTranslate2 maximum_relative_position). -1: from the tables, (rows - 1) / 2
  /// as CTranslate2 derives it.
  index_t max_relative_position = -1;
};

/// A view of one relative table: [2k+1, head_dim] shared by the heads, or [2k+1, heads, head_dim] per
/// head (rows of a head `heads x head_dim` apart). Never owns.
template <class W>
class shaw_table {
 public:
  shaw_table() = default;  ///< no table
  /// Shared by all heads: [2k+1, head_dim].
  shaw_table(tensor_map<const W, 2> t)  // NOLINT(google-explicit-constructor)
      : data_(t.data()), rows_(t.dimension(0)), dim_(t.dimension(1)) {
    require(data_ != nullptr, "shaw_table", "data must not be null");
  }
  /// One per head: [2k+1, heads, head_dim].
  shaw_table(tensor_map<const W, 3> t)  // NOLINT(google-explicit-constructor)
      : data_(t.data()), rows_(t.dimension(0)), heads_(t.dimension(1)), dim_(t.dimension(2)) {
    require(data_ != nullptr, "shaw_table", "data must not be null");
    require(heads_ > 0, "shaw_table", "a per-head table needs at least one head", heads_);
  }
  /// Raw form: heads = 0 for a shared table.
  shaw_table(const W* data, index_t rows, index_t heads, index_t dim)
      : data_(data), rows_(rows), heads_(heads), dim_(dim) {
    require(data_ != nullptr, "shaw_table", "data must not be null");
    require(rows >= 0 && heads >= 0 && dim >= 0, "shaw_table", "dimensions must be >= 0", rows, ", ", heads, ", ", dim);
  }

  [[nodiscard]] bool empty() const { return data_ == nullptr; }
  [[nodiscard]] const W* data() const { return data_; }
  [[nodiscard]] index_t rows() const { return rows_; }
  [[nodiscard]] index_t heads() const { return heads_; }  ///< 0: shared by all heads
  [[nodiscard]] index_t dim() const { return dim_; }
  [[nodiscard]] bool per_head() const { return heads_ > 0; }
  [[nodiscard]] index_t size() const { return rows_ * (per_head() ? heads_ : 1) * dim_; }
  /// Elements between row r and r + 1 of one head.
  [[nodiscard]] index_t row_stride() const { return per_head() ? heads_ * dim_ : dim_; }
  /// Row 0 of head h.
  [[nodiscard]] const W* head(index_t h) const { return per_head() ? data_ + h * dim_ : data_; }
  /// Element (bucket, head, feature).
  [[nodiscard]] W at(index_t bucket, index_t h, index_t d) const { return head(h)[bucket * row_stride() + d]; }
  /// Head h's [rows x dim] table as a strided matrix.
  [[nodiscard]] const_matrix_map<W> matrix(index_t h) const {
    return const_matrix_map<W>(head(h), rows_, dim_, Eigen::OuterStride<>(std::max<index_t>(row_stride(), 1)));
  }

 private:
  const W* data_ = nullptr;
  index_t rows_ = 0, heads_ = 0, dim_ = 0;
};

template <class W, shaw_terms Terms = shaw_terms::keys_values>
class shaw_relative {
 public:
  static constexpr bool uses_keys = Terms != shaw_terms::values;
  static constexpr bool uses_values = Terms != shaw_terms::keys;

  /// Both tables (a^K for the scores, a^V for the values); the one a keys-only / values-only
  /// encoding does not use must be empty.
  shaw_relative(shaw_table<W> keys, shaw_table<W> values, const shaw_config& config = {})
      : keys_(keys), values_(values) {
    init(config);
  }
  /// The single table of a keys-only or values-only encoding.
  explicit shaw_relative(shaw_table<W> table, const shaw_config& config = {})
    requires(Terms != shaw_terms::keys_values)
      : keys_(uses_keys ? table : shaw_table<W>{}), values_(uses_values ? table : shaw_table<W>{}) {
    init(config);
  }

  [[nodiscard]] index_t max_relative_position() const { return k_; }
  [[nodiscard]] index_t buckets() const { return 2 * k_ + 1; }
  [[nodiscard]] const shaw_table<W>& keys() const { return keys_; }
  [[nodiscard]] const shaw_table<W>& values() const { return values_; }

  /// Table row of the pair (query position, key position): clip(k_pos - q_pos, -k, k) + k.
  [[nodiscard]] index_t bucket(std::int64_t q_pos, std::int64_t k_pos) const {
    return detail::clipped_relative_bucket(q_pos, k_pos, k_);
  }

  /// What the kernel's tiles see: the tables in the call's scalar type, validated against its shapes.
  class bound {
   public:
    [[nodiscard]] index_t max_relative_position() const { return k_; }

    /// Score term inside the scale: s(i, j) += scale * q_i . a^K[bucket(i, j)] (Shaw eq. 4).
    template <class T>
      requires uses_keys
    void add_score_terms(const tile<T>& t, T scale, matrix_map<T> s) const {
      if (t.rows == 0 || t.cols == 0) return;
      const detail::bucket_range range = detail::clipped_relative_range(t.q_pos, t.rows, t.k_pos, t.cols, k_);
      const const_matrix_map<T> table = view<T>(true).matrix(t.head);
      if (range.count() == 1) {  // every pair clipped to one row: one dot per query row
        const auto row = table.row(range.lo);
        for (index_t i = 0; i < t.rows; ++i) s.row(i).array() += scale * t.q.row(i).dot(row);
        return;
      }
      const index_t span = range.count();
      T* buf = detail::thread_buffer<T>(t.rows * span);
      detail::relative_products<T>(t.q, table, range, scale, matrix_map<T>(buf, t.rows, span, Eigen::OuterStride<>(span)));
      detail::gather_add_clipped<T>(const_matrix_map<T>(buf, t.rows, span, Eigen::OuterStride<>(span)), range, t.q_pos,
                                    t.k_pos, k_, s);
    }

    /// Value term: out_i += sum_j p_ij a^V[bucket(i, j)] (Shaw eq. 3), accumulated per bucket.
    [[nodiscard]] index_t value_bucket_count() const
      requires uses_values
    {
      return 2 * k_ + 1;
    }
    template <class T>
      requires uses_values
    void value_buckets(const tile<T>& t, index_tile idx) const {
      detail::clipped_buckets(t.q_pos, t.k_pos, k_, idx);
    }
    /// The single bucket of a tile whose pairs all clip to one row (a tile beyond +-k), else -1.
    template <class T>
      requires uses_values
    [[nodiscard]] std::int32_t uniform_value_bucket(const tile<T>& t) const {
      const detail::bucket_range range = detail::clipped_relative_range(t.q_pos, t.rows, t.k_pos, t.cols, k_);
      return range.count() == 1 ? static_cast<std::int32_t>(range.lo) : -1;
    }
    template <class T>
      requires uses_values
    [[nodiscard]] const_matrix_map<T> value_table(index_t head) const {
      return view<T>(false).matrix(head);
    }

   private:
    friend class shaw_relative;

    /// The keys (or values) table in scalar T: the caller's memory, or the per-call conversion.
    template <class T>
    [[nodiscard]] shaw_table<T> view(bool keys) const {
      const shaw_table<W>& src = keys ? parent_->keys_ : parent_->values_;
      if constexpr (std::is_same_v<T, W>) {
        return src;
      } else {
        const std::vector<T>& copy = keys ? converted<T>().first : converted<T>().second;
        return shaw_table<T>(copy.data(), src.rows(), src.heads(), src.dim());
      }
    }
    template <class T>
    [[nodiscard]] const std::pair<std::vector<T>, std::vector<T>>& converted() const {
      if constexpr (std::is_same_v<T, float>) return as_float_;
      else return as_double_;
    }

    const shaw_relative* parent_ = nullptr;
    index_t k_ = 0;
    std::pair<std::vector<float>, std::vector<float>> as_float_;     ///< keys, values (when W is not float)
    std::pair<std::vector<double>, std::vector<double>> as_double_;  ///< keys, values (when W is not double)
  };

  /// Per-call preparation: the tables must fit the call's head_dim / value_dim / heads.
  [[nodiscard]] bound bind(const call_info& info) const {
    if constexpr (uses_keys) check_fits(keys_, "relative_position_keys", info.head_dim, "head_dim", info.heads);
    if constexpr (uses_values) check_fits(values_, "relative_position_values", info.value_dim, "value_dim", info.heads);
    bound b;
    b.parent_ = this;
    b.k_ = k_;
    if (info.scalar == scalar_type::float32) convert(b.as_float_);
    else convert(b.as_double_);
    return b;
  }

 private:
  void init(const shaw_config& config) {
    require(config.max_relative_position >= -1, "max_relative_position", "must be >= 0 (or -1: from the tables)",
            config.max_relative_position);
    if constexpr (!uses_keys)
      require(keys_.empty(), "relative_position_keys", "must be empty for a values-only encoding");
    if constexpr (!uses_values)
      require(values_.empty(), "relative_position_values", "must be empty for a keys-only encoding");
    const shaw_table<W>& first = uses_keys ? keys_ : values_;
    const char* first_name = uses_keys ? "relative_position_keys" : "relative_position_values";
    require(!first.empty(), first_name, "is required by this encoding (a table was not given)");
    k_ = config.max_relative_position;
    if (k_ < 0) {
      require(first.rows() % 2 == 1, first_name, "must have an odd number of rows 2k+1 (k from the table)",
              first.rows(), " rows");
      k_ = (first.rows() - 1) / 2;
    }
    // Buckets are int32 in the kernel (value_buckets) and 2k+1 table rows must exist.
    require(k_ < (index_t{1} << 30), "max_relative_position", "must be < 2^30", k_);
    if constexpr (uses_keys) check_rows(keys_, "relative_position_keys");
    if constexpr (uses_values) check_rows(values_, "relative_position_values");
  }

  void check_rows(const shaw_table<W>& t, const char* name) const {
    require(!t.empty(), name, "is required by this encoding (a table was not given)");
    require(t.rows() == 2 * k_ + 1, name, "must have 2 * max_relative_position + 1 rows", t.rows(), " rows for k = ",
            k_);
    require(t.dim() > 0, name, "must have at least one feature column", t.dim());
  }

  static void check_fits(const shaw_table<W>& t, const char* name, index_t dim, const char* dim_name, index_t heads) {
    require(t.dim() == dim, name, std::string("must have ") + dim_name + " columns", t.dim(), " vs ", dim);
    if (t.per_head())
      require(t.heads() == heads, name, "per-head table must have the query heads of the call ([2k+1, heads, dim])",
              t.heads(), " vs ", heads);
  }

  template <class T>
  void convert(std::pair<std::vector<T>, std::vector<T>>& out) const {
    if constexpr (!std::is_same_v<T, W>) {
      if constexpr (uses_keys) out.first.assign(keys_.data(), keys_.data() + keys_.size());
      if constexpr (uses_values) out.second.assign(values_.data(), values_.data() + values_.size());
    } else {
      (void)out;
    }
  }

  shaw_table<W> keys_, values_;
  index_t k_ = 0;
};

/// Shaw with the key term only (a^K) / the value term only (a^V).
template <class W>
using shaw_keys = shaw_relative<W, shaw_terms::keys>;
template <class W>
using shaw_values = shaw_relative<W, shaw_terms::values>;

}  // namespace posenc
