// posenc/deberta.hpp — DeBERTa-v2/v3 disentangled attention (He et al. 2021, "DeBERTa: Decoding-enhanced
// BERT with Disentangled Attention", sec. 3.1, eq. 4), with the semantics the released v2/v3
// checkpoints were trained with: Hugging Face modeling_deberta_v2.py (DisentangledSelfAttention,
// make_log_bucket_position, build_relative_position).
//
//   s_ij = ( Q_i.K_j  +  Q_i.Kr[c(i, j)]  +  K_j.Qr[c(i, j)] ) / sqrt(d * (1 + #terms))
//                         c2p               p2c
//   c(i, j) = clip(bucket(p_i - p_j) + span, 0, 2 span - 1)
//
// with p the absolute positions (query minus key), bucket the log buckets of detail/buckets.hpp
// (identity when position_buckets <= 0), span = position_buckets (or max_relative_positions without
// buckets), Kr = rel_embeddings Wk^T + bk and Qr = rel_embeddings Wq^T + bq split into heads
// ([2 span, H, d]; share_att_key: the content projections, else pos_key_proj / pos_query_proj).
// p2c uses the same row c(i, j) as c2p: HF gathers p2c at clip(-bucket(p_j - p_i) + span) on the
// key side and transposes, and buckets are odd in r (the paper writes delta(j, i) there; the
// checkpoints were trained with HF's index).
//
// In the kernel (posenc/attention.hpp) the terms are score terms inside the scale. Kr and Qr depend
// on no position, so the constructor projects them once (per head, float and double); bind()
// tabulates c(r) over the call's relative range (O(q_len + k_len) logf). A tile then computes
// Q_blk . Kr[lo..hi]^T and K_blk . Qr[lo..hi]^T over the rows [lo, hi] its relative range touches,
// in chunks of rows (c2p) or keys (p2c) so that each chunk's range stays short, and gathers by row
// (detail/relative.hpp). A chunk whose pairs all map to one row (far beyond the table: saturated)
// adds one value per query (c2p) or per key (p2c), without a gather. Nothing [H, L, L] or
// [L, L, d] exists.
//
// Padding, HF's way: a pair is allowed iff both tokens are real, and a padded query's row is zero.
// deberta_attention() takes HF's attention_mask [batch, seq] (1 = token): it masks keys through
// attention_options::key_padding_mask and the padded query rows through the encoding (their scores
// become -inf, which the kernel turns into an all-zero row).
//
//   posenc::deberta_disentangled enc(cfg, weights);            // once per layer
//   posenc::deberta_attention<float>(q, k, v, out, enc, mask);  // per forward
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "posenc/attention.hpp"
#include "posenc/detail/buckets.hpp"
#include "posenc/detail/position_scan.hpp"
#include "posenc/detail/relative.hpp"
#include "posenc/detail/tile_gemm.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/options.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

/// DeBERTa-v2/v3 attention configuration (HF DebertaV2Config names).
struct deberta_config {
  index_t heads = 12;                    ///< num_attention_heads
  index_t head_dim = 64;                 ///< attention_head_size (hidden_size / num_attention_heads)
  index_t position_buckets = 256;        ///< position_buckets; <= 0: no log buckets
  index_t max_relative_positions = -1;   ///< max_relative_positions; < 1: max_position_embeddings
  index_t max_position_embeddings = 512; ///< used only through the fallback above
  bool c2p = true;                       ///< "c2p" in pos_att_type
  bool p2c = true;                       ///< "p2c" in pos_att_type
  bool share_att_key = true;             ///< relative keys/queries from key_proj/query_proj

  /// max_relative_positions after HF's fallback.
  [[nodiscard]] index_t relative_positions() const {
    return max_relative_positions < 1 ? max_position_embeddings : max_relative_positions;
  }
  /// att_span (HF pos_ebd_size): position_buckets, or max_relative_positions without buckets.
  [[nodiscard]] index_t att_span() const { return position_buckets > 0 ? position_buckets : relative_positions(); }
  /// 1 + the number of relative terms (HF scale_factor).
  [[nodiscard]] index_t scale_factor() const { return 1 + (c2p ? 1 : 0) + (p2c ? 1 : 0); }
};

/// One nn.Linear of the layer, viewed: weight [out, in] (PyTorch layout, y = x W^T + b), bias [out].
/// Holds pointers, so copying or assigning it rebinds the view (assigning an Eigen map would copy
/// values into the viewed memory instead).
template <class W>
class deberta_linear {
 public:
  deberta_linear(tensor_map<const W, 2> weight, tensor_map<const W, 1> bias)
      : w_(weight.data()), b_(bias.data()), out_(weight.dimension(0)), in_(weight.dimension(1)),
        bias_len_(bias.dimension(0)) {}
  [[nodiscard]] tensor_map<const W, 2> weight() const { return tensor_map<const W, 2>(w_, out_, in_); }
  [[nodiscard]] tensor_map<const W, 1> bias() const { return tensor_map<const W, 1>(b_, bias_len_); }

 private:
  const W *w_, *b_;
  index_t out_, in_, bias_len_;
};

/// The tensors the relative terms need, viewed from host memory (read once, in the constructor of
/// deberta_disentangled). rel_embeddings: the encoder's rel_embeddings.weight after its LayerNorm
/// when norm_rel_ebd has layer_norm, [>= 2 att_span, hidden] (the first 2 att_span rows are used, as
/// HF slices them). share_att_key: key_proj (c2p) and query_proj (p2c); otherwise pos_key_proj (c2p)
/// and pos_query_proj (p2c). Projections a configuration does not use may be absent.
template <class W>
class deberta_weights {
 public:
  explicit deberta_weights(tensor_map<const W, 2> rel_embeddings)
      : rel_(rel_embeddings.data()), rows_(rel_embeddings.dimension(0)), hidden_(rel_embeddings.dimension(1)) {}
  [[nodiscard]] tensor_map<const W, 2> rel_embeddings() const { return tensor_map<const W, 2>(rel_, rows_, hidden_); }

  std::optional<deberta_linear<W>> query_proj{}, key_proj{}, pos_key_proj{}, pos_query_proj{};

 private:
  const W* rel_;
  index_t rows_, hidden_;
};

class deberta_disentangled;

/// The DeBERTa encoding: c2p / p2c score terms for posenc::attention (see the file comment).
class deberta_disentangled {
  /// Kr or Qr: per head [2 span][d], float and double, plain and packed.
  struct tables {
    std::shared_ptr<std::vector<double>> d;  ///< [H][2 span][d]
    std::shared_ptr<std::vector<float>> f;
    /// Per head, the same rows packed as the B operand of detail::tile_gemm (its GEBP micro-kernel),
    /// so a tile's product over rows [lo, hi] packs only its own queries or keys.
    std::shared_ptr<std::vector<typename detail::tile_gemm<double>::buffer>> packed_d;
    std::shared_ptr<std::vector<typename detail::tile_gemm<float>::buffer>> packed_f;
  };

 public:
  template <class W>
  deberta_disentangled(const deberta_config& config, const deberta_weights<W>& w) : config_(config) {
    require(config.heads > 0, "heads", "must be > 0", config.heads);
    require(config.head_dim > 0, "head_dim", "must be > 0", config.head_dim);
    require(config.relative_positions() >= 1, "max_position_embeddings",
            "must be >= 1 when max_relative_positions < 1", config.max_position_embeddings);
    span_ = config.att_span();
    require(span_ <= (index_t{1} << 28), "att_span", "must be <= 2^28", span_);
    if (config.position_buckets > 0)
      buckets_ = std::make_shared<const detail::deberta_bucketizer>(config.position_buckets,
                                                                    config.relative_positions());
    const tensor_map<const W, 2> rel_map = w.rel_embeddings();
    const index_t rows = 2 * span_, hidden = rel_map.dimension(1), hd = config.heads * config.head_dim;
    require(rel_map.data() != nullptr, "rel_embeddings", "must not be null");
    require(rel_map.dimension(0) >= rows, "rel_embeddings", "must have at least 2 * att_span rows",
            rel_map.dimension(0), " rows for att_span ", span_);
    require(hidden > 0, "rel_embeddings", "must have hidden_size > 0 columns", hidden);
    const Eigen::MatrixXd rel = Eigen::Map<const Eigen::Matrix<W, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
                                    rel_map.data(), rows, hidden)
                                    .template cast<double>();
    auto project = [&](const std::optional<deberta_linear<W>>& lin, const char* name, tables& out) {
      require(lin.has_value(), name, "must be given for this configuration (pos_att_type, share_att_key)");
      const tensor_map<const W, 2> weight = lin->weight();
      const tensor_map<const W, 1> bias = lin->bias();
      require(weight.data() != nullptr && bias.data() != nullptr, name, "weight and bias must not be null");
      require(weight.dimension(0) == hd && weight.dimension(1) == hidden, name,
              "weight must be [heads * head_dim, hidden_size]", "[", weight.dimension(0), ", ", weight.dimension(1),
              "] for [", hd, ", ", hidden, "]");
      require(bias.dimension(0) == hd, name, "bias must be [heads * head_dim]", bias.dimension(0), " for ", hd);
      const Eigen::MatrixXd wt =
          Eigen::Map<const Eigen::Matrix<W, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(weight.data(), hd, hidden)
              .template cast<double>();
      const Eigen::RowVectorXd b =
          Eigen::Map<const Eigen::Matrix<W, 1, Eigen::Dynamic>>(bias.data(), hd).template cast<double>();
      // y = rel W^T + b, [2 span, H * d]; stored per head as [H][2 span][d] so a head's rows are contiguous.
      Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> y = rel * wt.transpose();
      y.rowwise() += b;
      out.d = std::make_shared<std::vector<double>>(static_cast<std::size_t>(hd * rows));
      out.f = std::make_shared<std::vector<float>>(out.d->size());
      const index_t d = config.head_dim;
      for (index_t h = 0; h < config.heads; ++h)
        for (index_t t = 0; t < rows; ++t)
          for (index_t e = 0; e < d; ++e) {
            const double x = y(t, h * d + e);
            const auto at = static_cast<std::size_t>((h * rows + t) * d + e);
            (*out.d)[at] = x;
            (*out.f)[at] = static_cast<float>(x);
          }
      out.packed_d = std::make_shared<std::vector<typename detail::tile_gemm<double>::buffer>>(
          static_cast<std::size_t>(config.heads));
      out.packed_f = std::make_shared<std::vector<typename detail::tile_gemm<float>::buffer>>(
          static_cast<std::size_t>(config.heads));
      for (index_t h = 0; h < config.heads; ++h) {
        auto& pd = (*out.packed_d)[static_cast<std::size_t>(h)];
        auto& pf = (*out.packed_f)[static_cast<std::size_t>(h)];
        pd.resize(rows * d);
        pf.resize(rows * d);
        detail::tile_gemm<double>::pack_b(pd.data(), out.d->data() + h * rows * d, d, rows, d);
        detail::tile_gemm<float>::pack_b(pf.data(), out.f->data() + h * rows * d, d, rows, d);
      }
    };
    if (config.c2p)
      project(config.share_att_key ? w.key_proj : w.pos_key_proj, config.share_att_key ? "key_proj" : "pos_key_proj",
              kr_);
    if (config.p2c)
      project(config.share_att_key ? w.query_proj : w.pos_query_proj,
              config.share_att_key ? "query_proj" : "pos_query_proj", qr_);
  }

  [[nodiscard]] const deberta_config& config() const { return config_; }
  [[nodiscard]] index_t att_span() const { return span_; }

  /// HF's relative_pos entry of r = query_position - key_position: the log bucket, or r without buckets.
  [[nodiscard]] std::int64_t bucket(std::int64_t r) const { return buckets_ ? (*buckets_)(r) : r; }
  /// The row of Kr / Qr a pair uses: clip(bucket(q - k) + span, 0, 2 span - 1).
  [[nodiscard]] std::int32_t relative_row(std::int64_t q_pos, std::int64_t k_pos) const {
    const std::int64_t r = detail::relative_distance(k_pos, q_pos);  // q - k, saturated
    const std::int64_t b = bucket(r);
    // b + span without overflow: anything beyond +-span is clipped anyway.
    const std::int64_t c = std::clamp<std::int64_t>(b, -span_, span_) + span_;
    return static_cast<std::int32_t>(std::min<std::int64_t>(c, 2 * span_ - 1));
  }

  /// Kr of head h, [2 span, d] (c2p's relative keys); empty without c2p.
  template <class T>
  [[nodiscard]] const_matrix_map<T> position_keys(index_t h) const {
    return head_table<T>(kr_, h);
  }
  /// Qr of head h, [2 span, d] (p2c's relative queries); empty without p2c.
  template <class T>
  [[nodiscard]] const_matrix_map<T> position_queries(index_t h) const {
    return head_table<T>(qr_, h);
  }

  /// 1 / sqrt(d * (1 + #relative terms)) (HF: scores / sqrt(d * scale_factor)).
  [[nodiscard]] double logit_scale(index_t head_dim) const {
    return 1.0 / std::sqrt(static_cast<double>(head_dim) * static_cast<double>(config_.scale_factor()));
  }

  /// What the kernel's tiles see: the parent's tables, the call's per-distance rows and, through
  /// with_attention_mask, HF's attention_mask for the padded query rows.
  class bound {
   public:
    [[nodiscard]] double logit_scale(index_t head_dim) const { return parent_->logit_scale(head_dim); }

    /// Kernel hook: s += scale * (c2p + p2c) over the tile.
    template <class T>
    void add_score_terms(const tile<T>& t, T scale, matrix_map<T> s) const {
      if (t.rows == 0 || t.cols == 0) return;
      const bool contiguous = contiguous_keys(t);
      std::int64_t kmin = 0, kmax = 0;
      detail::position_range(t.k_pos, t.cols, kmin, kmax);
      if (parent_->config_.c2p) {
        for (index_t i0 = 0; i0 < t.rows; i0 += chunk<T>()) {
          const index_t n = std::min(chunk<T>(), t.rows - i0);
          std::int64_t qmin = 0, qmax = 0;
          detail::position_range(t.q_pos + i0, n, qmin, qmax);
          const detail::bucket_range range{row_of(qmin, kmax), row_of(qmax, kmin)};
          matrix_map<T> sc(s.data() + i0 * s.outerStride(), n, t.cols, Eigen::OuterStride<>(s.outerStride()));
          const auto q = t.q.middleRows(i0, n);
          const const_matrix_map<T> kr = parent_->position_keys<T>(t.head);
          if (range.count() == 1) {  // one row of Kr for every pair of the chunk: one value per query
            sc.colwise() += ((q * kr.row(range.lo).transpose()) * scale).eval();
            continue;
          }
          add_gathered<T>(packed_products<T>(q, parent_->kr_, t.head, range), t, i0, n, 0, t.cols, contiguous, scale,
                          sc, false);
        }
      }
      if (parent_->config_.p2c) {
        std::int64_t qmin = 0, qmax = 0;
        detail::position_range(t.q_pos, t.rows, qmin, qmax);
        for (index_t j0 = 0; j0 < t.cols; j0 += chunk<T>()) {
          const index_t n = std::min(chunk<T>(), t.cols - j0);
          std::int64_t cmin = 0, cmax = 0;
          detail::position_range(t.k_pos + j0, n, cmin, cmax);
          const detail::bucket_range range{row_of(qmin, cmax), row_of(qmax, cmin)};
          matrix_map<T> sc(s.data() + j0, t.rows, n, Eigen::OuterStride<>(s.outerStride()));
          const auto k = t.k.middleRows(j0, n);
          const const_matrix_map<T> qr = parent_->position_queries<T>(t.head);
          if (range.count() == 1) {  // one value per key
            sc.rowwise() += ((k * qr.row(range.lo).transpose()) * scale).transpose().eval();
            continue;
          }
          add_gathered<T>(packed_products<T>(k, parent_->qr_, t.head, range), t, 0, t.rows, j0, n, contiguous, scale,
                          sc, true);
        }
      }
    }

    /// Kernel hook: the rows of padded queries (HF attention_mask 0) become -inf, so the kernel gives
    /// them an all-zero output, as HF's XSoftmax does.
    template <class T>
    void add_position_bias(const tile<T>& t, matrix_map<T> s) const {
      if (query_mask_ == nullptr) return;
      const std::int64_t* m = query_mask_ + t.batch * mask_len_ + t.q_first;
      for (index_t i = 0; i < t.rows; ++i)
        if (m[i] == 0) s.row(i).setConstant(-std::numeric_limits<T>::infinity());
    }

   private:
    friend class deberta_disentangled;

    [[nodiscard]] std::int32_t row_of(std::int64_t q, std::int64_t k) const {
      if (table_mode_) return rows_[static_cast<std::size_t>(r_max_ - (q - k))];
      return parent_->relative_row(q, k);
    }

    template <class T>
    static bool contiguous_keys(const tile<T>& t) {
      for (index_t j = 1; j < t.cols; ++j)
        if (t.k_pos[j] != t.k_pos[0] + j) return false;
      return true;
    }

    /// Per-thread buffers (never shared between threads; kept across tiles and calls): the packed
    /// rows of a chunk and the chunk's products.
    template <class T>
    struct thread_buffers {
      typename detail::tile_gemm<T>::buffer packed, prod;
    };
    template <class T>
    static thread_buffers<T>& scratch() {
      thread_local thread_buffers<T> b;
      return b;
    }

    /// Rows of c2p (keys of p2c) per relative product: one micro-panel of GEBP's A operand, so the
    /// chunk packs without a remainder panel; each chunk's relative range is at most chunk + tile
    /// width - 1 distances (not twice the tile's for a whole diagonal tile), and chunks far from the
    /// diagonal saturate on their own.
    template <class T>
    static constexpr index_t chunk() {
      return detail::tile_gemm<T>::a_panel;
    }

    /// The products of a chunk's rows x (queries or keys) with the table rows [lo, hi]: stored one
    /// table row per line, prod(t, x) at data[(t - lo) * ld + x].
    template <class T>
    struct chunk_products {
      const T* data;
      index_t ld;
      detail::bucket_range rows;
    };

    /// x . table[lo'..hi']^T over the table rows [lo', hi'] that cover `range` in whole packed
    /// micro-panels of B (a packed B's column prefix is a packed B only at panel multiples, or up
    /// to the end).
    template <class T, class X>
    chunk_products<T> packed_products(const X& x, const tables& tb, index_t head, detail::bucket_range range) const {
      using gemm = detail::tile_gemm<T>;
      constexpr index_t nr = gemm::b_panel;
      const index_t rows = 2 * parent_->span_, d = parent_->config_.head_dim, n = x.rows();
      const index_t lo = range.lo / nr * nr;
      const index_t hi = std::min(rows, (range.hi + nr) / nr * nr);
      const index_t m = hi - lo;
      thread_buffers<T>& b = scratch<T>();
      if (b.packed.size() < n * d) b.packed.resize(n * d);
      if (b.prod.size() < n * m) b.prod.resize(n * m);
      gemm::pack_a(b.packed.data(), x.data(), x.outerStride(), n, d);
      std::fill_n(b.prod.data(), n * m, T(0));
      // Column-major C (n x m) = A (x) B (table rows^T): column t - lo holds table row t's products.
      gemm::multiply(b.prod.data(), n, b.packed.data(), parent_->packed_table<T>(tb, head) + lo * d, n, d, m, T(1), d,
                     gemm::column_chunk(n, d, m));
      return {b.prod.data(), n, detail::bucket_range{lo, hi - 1}};
    }

    /// The gather of one chunk: rows [i0, i0 + rows) x keys [j0, j0 + cols) of the tile into sc.
    template <class T>
    void add_gathered(const chunk_products<T>& p, const tile<T>& t, index_t i0, index_t rows, index_t j0,
                      index_t cols, bool contiguous, T scale, matrix_map<T> sc, bool key_side) const {
      const auto lo = static_cast<std::int32_t>(p.rows.lo), ld = static_cast<std::int32_t>(p.ld);
      if (table_mode_ && contiguous) {
        // Keys at k0, k0 + 1, ...: row i reads rows_[r_max - q_i + k0 + j], a forward run of the table.
        const std::int64_t k0 = t.k_pos[j0];
        for (index_t i = 0; i < rows; ++i) {
          const std::int32_t* idx = rows_.data() + static_cast<std::size_t>(r_max_ - t.q_pos[i0 + i] + k0);
          T* out = sc.data() + i * sc.outerStride();
          if (key_side) detail::gather_add_row<T>(out, p.data, idx, lo, 1, ld, cols, scale);
          else detail::gather_add_row<T>(out, p.data + i, idx, lo, 0, ld, cols, scale);
        }
        return;
      }
      // Scattered key positions or a pathological position range: a row per pair.
      for (index_t i = 0; i < rows; ++i)
        for (index_t j = 0; j < cols; ++j) {
          const std::int32_t c = row_of(t.q_pos[i0 + i], t.k_pos[j0 + j]) - lo;
          sc(i, j) += scale * p.data[c * ld + (key_side ? j : i)];
        }
    }

    const deberta_disentangled* parent_ = nullptr;
    const std::int64_t* query_mask_ = nullptr;  ///< HF attention_mask [batch, mask_len_], or null
    index_t mask_len_ = 0;
    bool table_mode_ = false;
    std::int64_t r_max_ = 0;          ///< largest q - k of the call
    std::vector<std::int32_t> rows_;  ///< rows_[t] = relative_row of r = r_max_ - t
  };

  /// Per-call preparation: the Kr/Qr row of every relative distance r = q - k of the call.
  [[nodiscard]] bound bind(const call_info& info) const { return bind_masked(info, nullptr); }

  /// The same encoding with HF's attention_mask [batch, seq] (1 = token): padded query rows are
  /// zero. Keys still need attention_options::key_padding_mask (deberta_key_padding_mask), which
  /// deberta_attention sets. The mask is viewed: keep it alive during the call.
  class masked {
   public:
    [[nodiscard]] double logit_scale(index_t head_dim) const { return parent_->logit_scale(head_dim); }
    [[nodiscard]] bound bind(const call_info& info) const {
      require(mask_.dimension(0) == info.batch && mask_.dimension(1) == info.q_len, "attention_mask",
              "must be [batch, q_len]", "[", mask_.dimension(0), ", ", mask_.dimension(1), "] for [", info.batch, ", ",
              info.q_len, "]");
      return parent_->bind_masked(info, &mask_);
    }

   private:
    friend class deberta_disentangled;
    masked(const deberta_disentangled* parent, tensor_map<const std::int64_t, 2> mask)
        : parent_(parent), mask_(mask) {}
    const deberta_disentangled* parent_;
    tensor_map<const std::int64_t, 2> mask_;
  };

  [[nodiscard]] masked with_attention_mask(tensor_map<const std::int64_t, 2> attention_mask) const {
    check_attention_mask(attention_mask);
    return masked(this, attention_mask);
  }

  /// HF attention_mask entries must be 0 (padding) or 1 (token).
  static void check_attention_mask(tensor_map<const std::int64_t, 2> m) {
    require(m.data() != nullptr || m.size() == 0, "attention_mask", "data must not be null");
    for (index_t e = 0; e < m.size(); ++e)
      require(m.data()[e] == 0 || m.data()[e] == 1, "attention_mask", "entries must be 0 (padding) or 1 (token)",
              m.data()[e], " at flat index ", e);
  }

 private:
  template <class T>
  [[nodiscard]] const T* packed_table(const tables& tb, index_t h) const {
    if constexpr (std::is_same_v<T, float>) return (*tb.packed_f)[static_cast<std::size_t>(h)].data();
    else return (*tb.packed_d)[static_cast<std::size_t>(h)].data();
  }

  template <class T>
  [[nodiscard]] const_matrix_map<T> head_table(const tables& tb, index_t h) const {
    const index_t rows = 2 * span_, d = config_.head_dim;
    const T* base = nullptr;
    if constexpr (std::is_same_v<T, float>) base = tb.f ? tb.f->data() : nullptr;
    else base = tb.d ? tb.d->data() : nullptr;
    if (base == nullptr) return const_matrix_map<T>(nullptr, 0, d, Eigen::OuterStride<>(d));
    return const_matrix_map<T>(base + h * rows * d, rows, d, Eigen::OuterStride<>(d));
  }

  [[nodiscard]] bound bind_masked(const call_info& info, const tensor_map<const std::int64_t, 2>* mask) const {
    require(info.heads == config_.heads, "deberta_disentangled", "heads must equal the call's query heads",
            config_.heads, " vs ", info.heads);
    require(info.head_dim == config_.head_dim, "deberta_disentangled", "head_dim must equal the call's head_dim",
            config_.head_dim, " vs ", info.head_dim);
    bound b;
    b.parent_ = this;
    if (mask != nullptr) {
      b.query_mask_ = mask->data();
      b.mask_len_ = mask->dimension(1);
    }
    if (info.q_max < info.q_min || info.k_max < info.k_min) return b;  // nothing to attend
    const auto range = detail::call_distance_range(info.q_min, info.q_max, info.k_min, info.k_max);
    if (!range) return b;  // served per pair
    b.table_mode_ = true;
    b.r_max_ = range->hi;
    b.rows_.resize(static_cast<std::size_t>(range->count()));
    for (std::int64_t t = 0; t < range->count(); ++t)
      b.rows_[static_cast<std::size_t>(t)] = relative_row(range->hi - t, 0);
    return b;
  }

  deberta_config config_;
  index_t span_ = 0;
  std::shared_ptr<const detail::deberta_bucketizer> buckets_;  ///< null: no log buckets
  tables kr_, qr_;
};

/// HF attention_mask [batch, seq] (1 = token) -> attention_options::key_padding_mask (1 = padding).
[[nodiscard]] inline std::vector<std::int64_t> deberta_key_padding_mask(
    tensor_map<const std::int64_t, 2> attention_mask) {
  deberta_disentangled::check_attention_mask(attention_mask);
  std::vector<std::int64_t> pad(static_cast<std::size_t>(attention_mask.size()));
  for (index_t e = 0; e < attention_mask.size(); ++e)
    pad[static_cast<std::size_t>(e)] = attention_mask.data()[e] == 0 ? 1 : 0;
  return pad;
}

/// DeBERTa self-attention of one layer with HF's padding semantics: q, k, v [batch, seq, heads, d]
/// (the host's query_proj / key_proj / value_proj outputs split into heads), out the context per
/// head. attention_mask [batch, seq] (1 = token, HF's), optional: a pair is allowed iff both tokens
/// are real and a padded query's output is zero. opt may set positions, tiles and the pool; with an
/// attention_mask it must not carry its own key padding. Throws posenc::error before writing.
template <class T>
void deberta_attention(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
                       const deberta_disentangled& enc,
                       std::optional<tensor_map<const std::int64_t, 2>> attention_mask = std::nullopt,
                       attention_options opt = {}) {
  if (!attention_mask) {
    attention<T>(q, k, v, out, enc, opt);
    return;
  }
  require(!opt.key_padding_mask && opt.kv_lengths.empty(), "attention_options",
          "key_padding_mask / kv_lengths must be unset when attention_mask is given (it masks the keys)");
  require(q.seq() == k.seq(), "attention_mask", "needs self-attention (q_len == k_len)", q.seq(), " vs ", k.seq());
  require(attention_mask->dimension(0) == q.batch() && attention_mask->dimension(1) == q.seq(), "attention_mask",
          "must be [batch, seq]", "[", attention_mask->dimension(0), ", ", attention_mask->dimension(1), "] for [",
          q.batch(), ", ", q.seq(), "]");
  const std::vector<std::int64_t> pad = deberta_key_padding_mask(*attention_mask);
  opt.key_padding_mask = tensor_map<const std::int64_t, 2>(pad.data(), q.batch(), k.seq());
  attention<T>(q, k, v, out, enc.with_attention_mask(*attention_mask), opt);
}

}  // namespace posenc
