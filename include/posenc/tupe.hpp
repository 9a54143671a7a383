// posenc/tupe.hpp — TUPE, Transformer with Untied Positional Encoding (Ke, He, Liu 2021, "Rethinking
// Positional Encoding in Language Pre-training", sec. 3; official code guolinke/TUPE,
// fairseq/modules/transformer_sentence_encoder.py and multihead_attention.py).
//
// TUPE keeps word and position apart: the position enters the logits through its own projections
// of the absolute position embeddings, never added to the token embeddings (eq. 3-4, per head h):
//   e_ij = (x_i W_q^T + b_q)_h . (x_j W_k^T + b_k)_h / sqrt(2d)                content, scaled 1/sqrt(2d)
//        + (p_i U_q^T + b_Uq)_h . (p_j U_k^T + b_Uk)_h / sqrt(2d)              untied position term
//        + b_{bucket(j - i)}[h]                                                TUPE-R relative term
// with d the head dimension (the official pos_scaling = (d * 2)^-0.5 and the layers' attention scale
// factor 2). With the [CLS] reset (sec. 3.2) the position term of the [CLS] token — the token at
// position 0 — is replaced by learned per-head scalars: first column 0 (others -> [CLS]) takes
// theta_others_to_cls[h], then row 0, including (0, 0), takes theta_cls_to_others[h]; the relative
// buckets are reset the same way (column 0 -> bucket rel_pos_bins, then row 0 -> rel_pos_bins / 2,
// a bucket the bidirectional T5 function never produces), so the relative table has rel_pos_bins + 1
// rows. The relative buckets are T5's bidirectional ones of r = key - query (detail/buckets.hpp).
//
// In the kernel: the position embeddings are projected once, at construction, to per-head tables
// Pq = (p U_q^T + b_Uq) / sqrt(2d) and Pk = p U_k^T + b_Uk, [heads, positions, d] (the official code
// also scales the query side). A tile adds, after the scale, the product Pq[q_pos] Pk[k_pos]^T of its
// positions' rows (a second q.k-sized GEMM: contiguous positions are a block of the table, others are
// gathered), then the [CLS] constants and the relative bias (a slice of a per-call vector per query
// row, detail/bucket_bias.hpp, shared with T5). The logit scale is 1/sqrt(2d). Nothing is [H, L, L].
// Positions index the table rows directly: bind() checks that every query and key position of the
// call lies in [0, rows of pos_emb); the [CLS] reset applies to position 0.
//
//   posenc::tupe enc(posenc::tupe_weights<float>{.pos_emb = p, .pos_q_weight = uq, .pos_q_bias = buq,
//                                                 .pos_k_weight = uk, .pos_k_bias = buk,
//                                                 .theta_cls_to_others = t_c2o, .theta_others_to_cls = t_o2c,
//                                                 .relative_attention_bias = rel},
//                    {.num_attention_heads = 12});
//   posenc::attention(q, k, v, out, enc, opt);
#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "posenc/detail/bucket_bias.hpp"
#include "posenc/detail/buckets.hpp"
#include "posenc/detail/position_scan.hpp"
#include "posenc/detail/relative.hpp"
#include "posenc/detail/table.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

struct tupe_config {
  index_t num_attention_heads = 0;  ///< H (head dim d = rows of pos_q_weight / H)
  bool cls_reset = true;            ///< position 0 is [CLS]: its row and column take the theta scalars
  index_t rel_pos_bins = 32;        ///< T5 bidirectional num_buckets of the relative term
  index_t max_rel_pos = 128;        ///< its max_distance
};

/// The weights, as the official code holds them (host memory, viewed during construction only).
/// Build it with designated initializers (optional members with emplace): assigning a TensorMap
/// member copies values into the viewed memory instead of re-pointing the view (Eigen semantics).
template <class W>
struct tupe_weights {
  tensor_map<const W, 2> pos_emb;       ///< [S, Dm] absolute embeddings p_0 .. p_{S-1}, after pos_ln
  tensor_map<const W, 2> pos_q_weight;  ///< U_q [H*d, Dm] (pos_q_linear.weight)
  tensor_map<const W, 1> pos_q_bias;    ///< [H*d] (pos_q_linear.bias)
  tensor_map<const W, 2> pos_k_weight;  ///< U_k [H*d, Dm] (pos_k_linear.weight)
  tensor_map<const W, 1> pos_k_bias;    ///< [H*d] (pos_k_linear.bias)
  std::optional<tensor_map<const W, 1>> theta_cls_to_others{};  ///< [H], with cls_reset
  std::optional<tensor_map<const W, 1>> theta_others_to_cls{};  ///< [H], with cls_reset
  /// [rel_pos_bins (+1 with cls_reset), H] (relative_attention_bias.weight); absent: no relative term.
  std::optional<tensor_map<const W, 2>> relative_attention_bias{};
};

class tupe {
  struct tables;

 public:
  /// Projects the position embeddings once (in double) and copies what it needs: the weights need not
  /// outlive the constructor. Throws posenc::error naming the first tensor whose shape does not fit.
  template <class W>
  tupe(const tupe_weights<W>& w, const tupe_config& config) : config_(config) {
    const index_t H = config.num_attention_heads;
    require(H > 0, "num_attention_heads", "must be > 0", H);
    auto check_data = [](const auto& m, const char* name) {
      require(m.data() != nullptr || m.size() == 0, name, "data must not be null");
    };
    const index_t S = w.pos_emb.dimension(0), Dm = w.pos_emb.dimension(1), HD = w.pos_q_weight.dimension(0);
    require(S > 0 && Dm > 0, "pos_emb", "must be [positions, hidden_size] with both > 0", "[", S, ", ", Dm, "]");
    check_data(w.pos_emb, "pos_emb");
    require(HD > 0 && HD % H == 0, "pos_q_weight", "rows must be num_attention_heads * head_dim", HD, " rows for ",
            H, " heads");
    for (const auto* m : {&w.pos_q_weight, &w.pos_k_weight}) {
      const char* name = m == &w.pos_q_weight ? "pos_q_weight" : "pos_k_weight";
      require(m->dimension(0) == HD && m->dimension(1) == Dm, name, "must be [num_attention_heads * head_dim, hidden_size]",
              "[", m->dimension(0), ", ", m->dimension(1), "] vs [", HD, ", ", Dm, "]");
      check_data(*m, name);
    }
    for (const auto* b : {&w.pos_q_bias, &w.pos_k_bias}) {
      const char* name = b == &w.pos_q_bias ? "pos_q_bias" : "pos_k_bias";
      require(b->dimension(0) == HD, name, "must be [num_attention_heads * head_dim]", b->dimension(0), " vs ", HD);
      check_data(*b, name);
    }
    for (const auto* t : {&w.theta_cls_to_others, &w.theta_others_to_cls}) {
      const char* name = t == &w.theta_cls_to_others ? "theta_cls_to_others" : "theta_others_to_cls";
      require(t->has_value() || !config.cls_reset, name, "is required with cls_reset");
      if (!t->has_value()) continue;
      require((*t)->dimension(0) == H, name, "must be [num_attention_heads]", (*t)->dimension(0), " vs ", H);
      check_data(**t, name);
    }
    auto data = std::make_shared<tables>();
    tables& tb = *data;
    tb.heads = H;
    tb.dim = HD / H;
    tb.positions = S;
    if (w.relative_attention_bias) {
      const auto& rel = *w.relative_attention_bias;
      tb.buckets.emplace(config.rel_pos_bins, config.max_rel_pos, true);  // checks bins and max_rel_pos
      require(config.rel_pos_bins % 2 == 0, "rel_pos_bins", "must be even (bidirectional buckets)",
              config.rel_pos_bins);
      const index_t need = config.rel_pos_bins + (config.cls_reset ? 1 : 0);
      require(rel.dimension(1) == H && (rel.dimension(0) == need || rel.dimension(0) == config.rel_pos_bins + 1),
              "relative_attention_bias",
              config.cls_reset ? "must be [rel_pos_bins + 1, num_attention_heads] (the last row is [CLS]'s)"
                               : "must be [rel_pos_bins (+1), num_attention_heads]",
              "[", rel.dimension(0), ", ", rel.dimension(1), "] for rel_pos_bins ", config.rel_pos_bins, ", ", H,
              " heads");
      check_data(rel, "relative_attention_bias");
      tb.rel = Eigen::Tensor<double, 2, Eigen::RowMajor>(rel.dimension(0), H);
      for (index_t e = 0; e < rel.size(); ++e) tb.rel.data()[e] = static_cast<double>(rel.data()[e]);
      tb.rel_view.emplace(tb.rel.data(), tb.rel.dimension(0), H);
    }
    project(w, tb);
    if (config.cls_reset) {
      tb.cls_row.d.resize(static_cast<std::size_t>(H));
      tb.cls_col.d.resize(static_cast<std::size_t>(H));
      for (index_t h = 0; h < H; ++h) {
        // The [CLS] pairs' whole position bias: theta plus the reserved relative bucket (FORMAT 5.10).
        double row = static_cast<double>((*w.theta_cls_to_others)(h));
        double col = static_cast<double>((*w.theta_others_to_cls)(h));
        if (tb.rel_view) {
          row += tb.rel(config.rel_pos_bins / 2, h);
          col += tb.rel(config.rel_pos_bins, h);
        }
        tb.cls_row.d[static_cast<std::size_t>(h)] = row;
        tb.cls_col.d[static_cast<std::size_t>(h)] = col;
      }
      tb.cls_row.round();
      tb.cls_col.round();
    }
    tables_ = std::move(data);
  }

  [[nodiscard]] const tupe_config& config() const { return config_; }
  [[nodiscard]] index_t heads() const { return tables_->heads; }
  [[nodiscard]] index_t head_dim() const { return tables_->dim; }
  /// Rows of pos_emb: positions 0 .. max_positions() - 1 are valid.
  [[nodiscard]] index_t max_positions() const { return tables_->positions; }
  [[nodiscard]] bool has_relative() const { return tables_->rel_view.has_value(); }

  /// Both the content and the position term are scaled by 1/sqrt(2d) (official attn_scale_factor 2).
  [[nodiscard]] static double logit_scale(index_t head_dim) {
    return head_dim > 0 ? 1.0 / std::sqrt(2.0 * static_cast<double>(head_dim)) : 1.0;
  }

  /// The relative bucket of a (query position, key position) pair: T5's bidirectional bucket of
  /// k - q, with the [CLS] reset rel_pos_bins for key 0, then rel_pos_bins / 2 for query 0.
  [[nodiscard]] std::int32_t relative_bucket(std::int64_t q_pos, std::int64_t k_pos) const {
    require(has_relative(), "tupe", "has no relative term (no relative_attention_bias)");
    if (config_.cls_reset && q_pos == 0) return static_cast<std::int32_t>(config_.rel_pos_bins / 2);
    if (config_.cls_reset && k_pos == 0) return static_cast<std::int32_t>(config_.rel_pos_bins);
    return (*tables_->buckets)(k_pos - q_pos);
  }

  /// The whole position bias of one (head, query position, key position), in double (after the scale).
  [[nodiscard]] double position_bias(index_t head, std::int64_t q_pos, std::int64_t k_pos) const {
    const tables& tb = *tables_;
    require(head >= 0 && head < tb.heads, "head", "must be in [0, heads)", head);
    require(q_pos >= 0 && q_pos < tb.positions && k_pos >= 0 && k_pos < tb.positions, "position",
            "must be in [0, max_positions)", q_pos, ", ", k_pos, " for ", tb.positions);
    const auto h = static_cast<std::size_t>(head);
    if (config_.cls_reset && q_pos == 0) return tb.cls_row.d[h];
    if (config_.cls_reset && k_pos == 0) return tb.cls_col.d[h];
    const double* pq = tb.pq.d.data() + (head * tb.positions + q_pos) * tb.dim;
    const double* pk = tb.pk.d.data() + (head * tb.positions + k_pos) * tb.dim;
    double dot = 0;
    for (index_t c = 0; c < tb.dim; ++c) dot += pq[c] * pk[c];
    if (tb.rel_view) dot += tb.rel(relative_bucket(q_pos, k_pos), head);
    return dot;
  }

  /// What the kernel's tiles see: the encoding's tables and the call's relative-bias vector.
  class bound {
   public:
    [[nodiscard]] static double logit_scale(index_t head_dim) { return tupe::logit_scale(head_dim); }

    /// Kernel hook, after the scale: s += Pq[q_pos] Pk[k_pos]^T, the [CLS] constants, the relative
    /// bias. Never throws (bind validated the positions); allocates only for non-contiguous positions.
    template <class T>
    void add_position_bias(const tile<T>& t, matrix_map<T> s) const {
      if (t.rows == 0 || t.cols == 0) return;
      const tables& tb = *tables_;
      const index_t d = tb.dim;
      const T* pq = tb.pq.template data<T>() + t.head * tb.positions * d;
      const T* pk = tb.pk.template data<T>() + t.head * tb.positions * d;
      // The positions' rows of the tables: a block of them for consecutive positions (the usual
      // case), else gathered into the thread's buffer (permuted or packed positions).
      auto rows_of = [&](const T* table, const std::int64_t* pos, index_t n, index_t slot) {
        if (detail::consecutive_positions(pos, n))
          return const_matrix_map<T>(table + pos[0] * d, n, d, Eigen::OuterStride<>(d));
        T* g = detail::thread_buffer<T>(2 * std::max(t.rows, t.cols) * d) + slot * std::max(t.rows, t.cols) * d;
        for (index_t r = 0; r < n; ++r) std::copy_n(table + pos[r] * d, d, g + r * d);
        return const_matrix_map<T>(g, n, d, Eigen::OuterStride<>(d));
      };
      s.noalias() += rows_of(pq, t.q_pos, t.rows, 0) * rows_of(pk, t.k_pos, t.cols, 1).transpose();
      if (cls_reset_) {  // Pq and Pk are zero at position 0: the product added nothing there
        const T row_c = tb.cls_row.template data<T>()[t.head], col_c = tb.cls_col.template data<T>()[t.head];
        for (index_t j = 0; j < t.cols; ++j) {
          if (t.k_pos[j] != 0) continue;
          for (index_t i = 0; i < t.rows; ++i)
            if (t.q_pos[i] != 0) s(i, j) += col_c;
        }
        for (index_t i = 0; i < t.rows; ++i)
          if (t.q_pos[i] == 0) s.row(i).array() += row_c;
      }
      if (has_relative_)
        relative_.add(t, s, cls_reset_ ? std::optional<std::int64_t>(0) : std::nullopt);
    }

   private:
    friend class tupe;
    std::shared_ptr<const tables> tables_;
    bool cls_reset_ = false, has_relative_ = false;
    detail::bucket_bias_table<double> relative_;
  };

  /// Per-call preparation: validates the call against the tables; the relative bias of every
  /// relative distance in [k_min - q_max, k_max - q_min], per head.
  [[nodiscard]] bound bind(const call_info& info) const {
    const tables& tb = *tables_;
    require(info.heads == tb.heads, "tupe", "num_attention_heads must equal the query heads of the call", tb.heads,
            " vs ", info.heads);
    require(info.head_dim == tb.dim, "tupe", "head_dim of the position projections must equal the call's head_dim",
            tb.dim, " vs ", info.head_dim);
    if (info.q_max >= info.q_min)
      require(info.q_min >= 0 && info.q_max < tb.positions, "q_positions",
              "must lie in [0, rows of pos_emb) (absolute positions index the position table)", "[", info.q_min,
              ", ", info.q_max, "] for ", tb.positions, " rows");
    if (info.k_max >= info.k_min)
      require(info.k_min >= 0 && info.k_max < tb.positions, "k_positions",
              "must lie in [0, rows of pos_emb) (absolute positions index the position table)", "[", info.k_min,
              ", ", info.k_max, "] for ", tb.positions, " rows");
    bound b;
    b.tables_ = tables_;
    b.cls_reset_ = config_.cls_reset;
    b.has_relative_ = tb.rel_view.has_value();
    if (b.has_relative_) b.relative_ = detail::bucket_bias_table<double>(&*tb.buckets, &*tb.rel_view, info);
    return b;
  }

 private:
  /// Everything derived from the weights, shared (immutable) by copies of the encoding and bounds.
  struct tables {
    index_t heads = 0, dim = 0, positions = 0;
    detail::dual_values pq, pk;          ///< [heads, positions, dim]; pq already scaled by 1/sqrt(2d)
    detail::dual_values cls_row, cls_col;  ///< [heads]: theta (+ the reserved relative bucket)
    Eigen::Tensor<double, 2, Eigen::RowMajor> rel;  ///< relative_attention_bias [rows, heads]
    std::optional<tensor_map<const double, 2>> rel_view;
    std::optional<detail::t5_bucketizer> buckets;
  };

  /// Pq = (p U_q^T + b_Uq) / sqrt(2d), Pk = p U_k^T + b_Uk, split into heads [H, S, d], in double; with
  /// the [CLS] reset position 0's rows are zero (its pairs take the theta constants instead).
  template <class W>
  void project(const tupe_weights<W>& w, tables& tb) const {
    using mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using in_map = Eigen::Map<const Eigen::Matrix<W, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    using vec_map = Eigen::Map<const Eigen::Matrix<W, 1, Eigen::Dynamic>>;
    const index_t S = tb.positions, H = tb.heads, d = tb.dim, Dm = w.pos_emb.dimension(1), HD = H * d;
    const mat p = in_map(w.pos_emb.data(), S, Dm).template cast<double>();
    const double scale = logit_scale(d);
    auto one = [&](const tensor_map<const W, 2>& u, const tensor_map<const W, 1>& b, double factor,
                   detail::dual_values& out) {
      mat proj = p * in_map(u.data(), HD, Dm).template cast<double>().transpose();
      proj.rowwise() += vec_map(b.data(), HD).template cast<double>();
      proj *= factor;
      if (config_.cls_reset) proj.row(0).setZero();
      out.d.resize(static_cast<std::size_t>(H * S * d));
      for (index_t h = 0; h < H; ++h)
        for (index_t s = 0; s < S; ++s)
          for (index_t c = 0; c < d; ++c) out.d[static_cast<std::size_t>((h * S + s) * d + c)] = proj(s, h * d + c);
      out.round();
    };
    one(w.pos_q_weight, w.pos_q_bias, scale, tb.pq);
    one(w.pos_k_weight, w.pos_k_bias, 1.0, tb.pk);
  }

  tupe_config config_;
  std::shared_ptr<const tables> tables_;
};

}  // namespace posenc
