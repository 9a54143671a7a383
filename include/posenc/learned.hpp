// posenc/learned.hpp — learned absolute position embeddings (BERT, GPT-2, OPT, BART, RoBERTa):
// x[b, s, :] += table[pos[b, s] + offset, :].
//
// The table [max_positions, d_model] is a host weight (nn.Embedding), viewed without a copy, or
// owned. `offset` is the row shift some models bake into their embedding lookup: OPT and BART
// (OPTLearnedPositionalEmbedding, BartLearnedPositionalEmbedding) look up position + 2; RoBERTa's
// create_position_ids_from_input_ids starts real tokens at padding_idx + 1 (= 2). A row outside the
// table is an error naming the position and the table size — never a clamp or an out-of-bounds
// read — and every token is checked before anything is written.
//
//   posenc::learned_absolute<float> pe(weight_map, {.offset = 2});   // OPT
//   pe.add_to(x, posenc::view(pos));
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "posenc/detail/platform.hpp"
#include "posenc/detail/table.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/positions.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

struct learned_options {
  /// Row of position p is p + offset (OPT/BART: 2; RoBERTa: padding_idx + 1 = 2).
  std::int64_t offset = 0;
};

template <class W>
class learned_absolute {
 public:
  using table_type = Eigen::Tensor<W, 2, Eigen::RowMajor>;

  /// View a host table [max_positions, d_model] (no copy; keep it alive).
  explicit learned_absolute(tensor_map<const W, 2> table, const learned_options& options = {})
      : table_(table), options_(options) {
    check();
  }
  /// Own a table [max_positions, d_model] (moved in).
  explicit learned_absolute(table_type table, const learned_options& options = {})
      : table_(std::move(table)), options_(options) {
    check();
  }

  [[nodiscard]] index_t max_positions() const { return table_.rows(); }
  [[nodiscard]] index_t d_model() const { return table_.cols(); }
  [[nodiscard]] std::int64_t offset() const { return options_.offset; }
  [[nodiscard]] const tensor_map<const W, 2>& table() const { return table_.view(); }
  /// The first and last position that have a row: [-offset, max_positions - 1 - offset].
  [[nodiscard]] std::int64_t min_position() const { return -options_.offset; }
  [[nodiscard]] std::int64_t max_position() const { return table_.rows() - 1 - options_.offset; }

  /// Input encoding: x[b, s, :] += table[pos[b, s] + offset, :]. x is [batch, seq, d_model]; pos is
  /// [batch, seq] or [1, seq] (shared by the batch). Throws before writing if any row is missing.
  template <class T>
  requires std::is_floating_point_v<T>
  void add_to(tensor_map<T, 3> x, positions_view pos) const {
    const index_t B = x.dimension(0), S = x.dimension(1), D = x.dimension(2);
    require(D == d_model(), "x", "last dimension must equal the table's d_model", D, " vs ", d_model());
    require((pos.dimension(0) == B || pos.dimension(0) == 1) && pos.dimension(1) == S, "pos",
            "must be [batch, seq] or [1, seq]", "[", pos.dimension(0), ", ", pos.dimension(1), "] for x [", B, ", ", S,
            ", ", D, "]");
    const index_t P = pos.dimension(0);
    for (index_t b = 0; b < P; ++b)
      for (index_t s = 0; s < S; ++s) check_position(pos(b, s), b, s);
    for (index_t b = 0; b < B; ++b) {
      for (index_t s = 0; s < S; ++s) {
        const W* src = table_.row(pos(P == 1 ? 0 : b, s) + options_.offset);
        T* dst = x.data() + (b * S + s) * D;
        for (index_t d = 0; d < D; ++d) dst[d] += static_cast<T>(src[d]);
      }
    }
  }

 private:
  void check() const {
    require(table_.rows() > 0, "table", "must have at least one row (max_positions > 0)", table_.rows());
    require(table_.view().data() != nullptr || table_.cols() == 0, "table", "data must not be null");
  }
  void check_position(std::int64_t p, index_t b, index_t s) const {
    // Compare p against the valid position range rather than forming p + offset, which could overflow.
    if (p >= min_position() && p <= max_position()) return;
    std::int64_t row = 0;
    const bool overflow = detail::add_overflow(p, options_.offset, row);
    require(false, "pos",
            "position has no row in the learned table (row = position + offset must be in [0, max_positions))", p,
            " at [", b, ", ", s, "]: row ", overflow ? std::string("out of int64") : std::to_string(row),
            " with offset ", options_.offset, ", table size ", table_.rows());
  }

  detail::table_storage<W> table_;
  learned_options options_;
};

}  // namespace posenc
