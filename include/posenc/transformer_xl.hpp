// posenc/transformer_xl.hpp — Transformer-XL relative attention (Dai et al. 2019, sec. 3.3, the
// score decomposition (a)-(d) with the global biases u and v): the official
// RelPartialLearnableMultiHeadAttn of kimiyoung/transformer-xl (pytorch/mem_transformer.py) and
// Hugging Face's deprecated transfo-xl port (modeling_transfo_xl.py), fused into the kernel.
//
// Queries are the current segment, keys and values the memory of mlen earlier positions followed
// by the segment (klen = mlen + qlen); query i sits at position mlen + i, key j at j. With the
// distance dist = q_pos - k_pos (clamped to clamp_len when clamp_len > 0, HF pos_seq.clamp_(max=)),
//   R_dist  = [sin(dist w) | cos(dist w)], w_f = 10000^(-2f/d_model)   (PositionalEmbedding, concat)
//   r_h     = (W_R R_dist)[h*D .. h*D+D)                           (r_net: [H*D, d_model], no bias)
//   s_ij    = ((q_i + u_h) . k_j + (q_i + v_h) . r_h(dist)) * scale,   scale = 1/sqrt(d_head)
// with u = r_w_bias and v = r_r_bias ([H, D]). Keys in the future of a query (dist < 0) are never
// visible: the official model is causal (dec_attn_mask = triu(ones, 1 + mlen)) and its R is only
// defined for dist >= 0 (pos_seq = klen-1 .. 0), so the encoding masks them itself; pass
// attention_options::causal too, so the kernel skips the tiles above the diagonal
// (transformer_xl_options below). With same_length, a query also ignores keys at dist >= mem_len:
// HF/official build that mask as triu(ones, 1 + mlen) + tril(ones, -mask_shift_len) with
// mask_shift_len = qlen - (klen - mem_len) when klen > mem_len, which is exactly "dist >= mem_len"
// (and nothing when klen <= mem_len, where no key is that far).
//
// How the terms are fused (never the official rel_shift of a [qlen, klen] matrix, which the tests
// reproduce on small inputs):
//  * bind computes, once per call, r_h(dist) for exactly the distances the call can see
//    ([max(0, q_min - k_max), q_max - k_min], clamped; O(klen x H x D), the size of K), in the
//    call's scalar type, stored per head with the largest distance first and packed as the A operand
//    of Eigen's GEBP micro-kernel (detail/tile_gemm.hpp), and c_h(dist) = v_h . r_h(dist).
//  * per tile, the (q+v).r term is, for each group of 8 query rows, one small product
//    P = scale (c_h + Q_rows R_h[the rows' distances]^T) (cols + 7 distances for contiguous
//    positions, fewer when clamp_len caps them; the range arithmetic of detail/relative.hpp) on the
//    packed table, then a gather by distance: for contiguous key positions each query row reads a
//    contiguous slice of P, so the gather is a plain vectorizable add. A product over all rows of a
//    tile would cover rows + cols - 1 distances for cols keys: twice the q.k product at 256 x 256.
//  * the u.k term is one number per key and head, u_h . k_j, a GEMV over the tile's keys (1/rows
//    of the q.k product) added in the same pass as the gather. Chosen over a Q transform
//    q' = q + u: a transform makes the kernel copy the queries, and, until it can be told that
//    keys need no transform, the keys as well (an O(klen d) copy per kv head and a pass over K), and
//    hooks would then see q' where the (q+v).r product needs q (it would need q' + (v - u)).
//
//   posenc::transformer_xl<float> enc(r_net_weight, r_w_bias, r_r_bias,
//                                     {.d_model = 512, .n_head = 8, .d_head = 64, .clamp_len = 1000});
//   posenc::attention(q, k, v, out, enc, posenc::transformer_xl_options(q_len, k_len));
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "posenc/detail/position_scan.hpp"
#include "posenc/detail/relative.hpp"
#include "posenc/detail/sinusoid.hpp"
#include "posenc/detail/table.hpp"
#include "posenc/detail/thread.hpp"
#include "posenc/detail/tile_gemm.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/options.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

/// Transformer-XL attention parameters, with Hugging Face TransfoXLConfig names.
struct transformer_xl_config {
  index_t d_model = 0;           ///< width of the sinusoid R and input width of r_net (even)
  index_t n_head = 0;            ///< H
  index_t d_head = 0;            ///< D
  index_t mem_len = 0;           ///< memory length; only same_length reads it
  std::int64_t clamp_len = -1;   ///< > 0: distances above it use R_clamp_len; <= 0: no clamping
  bool same_length = false;      ///< every query sees at most mem_len keys (dist < mem_len)
};

/// The options of a Transformer-XL call over q_len queries and k_len = mlen + q_len keys: causal,
/// queries at positions mlen + i (FORMAT.md 3: q_offset is the memory length).
[[nodiscard]] inline attention_options transformer_xl_options(index_t q_len, index_t k_len,
                                                              attention_options base = {}) {
  require(q_len >= 0 && k_len >= q_len, "k_len", "must be >= q_len (memory first, then the segment)", k_len,
          " keys for ", q_len, " queries");
  base.causal = true;
  base.q_offset = k_len - q_len;
  return base;
}

namespace detail {

/// Per-thread scratch of the Transformer-XL tile hook (thread_scratch keeps it between tiles).
template <class T>
struct transformer_xl_scratch {
  std::vector<T> products;                    ///< P: rows x distances of the tile
  std::vector<T> key_bias;                    ///< scale * u_h . k_j per key of the tile
  typename tile_gemm<T>::buffer packed_rows;  ///< the rows' queries packed for the product
};

}  // namespace detail

template <class W>
class transformer_xl {
 public:
  using table_type = Eigen::Tensor<W, 2, Eigen::RowMajor>;
  /// Most distinct distances one call may need (positions far apart without clamp_len).
  static constexpr std::int64_t max_distances = std::int64_t{1} << 24;

  /// View the checkpoint's r_net.weight [H*D, d_model], r_w_bias (u) and r_r_bias (v) [H, D] (no
  /// copy; keep them alive).
  transformer_xl(tensor_map<const W, 2> r_net_weight, tensor_map<const W, 2> r_w_bias,
                 tensor_map<const W, 2> r_r_bias, const transformer_xl_config& config)
      : config_(config), r_net_(r_net_weight), u_(r_w_bias), v_(r_r_bias) {
    init();
  }
  /// Own them (moved in).
  transformer_xl(table_type r_net_weight, table_type r_w_bias, table_type r_r_bias, const transformer_xl_config& config)
      : config_(config), r_net_(std::move(r_net_weight)), u_(std::move(r_w_bias)), v_(std::move(r_r_bias)) {
    init();
  }

  [[nodiscard]] const transformer_xl_config& config() const { return config_; }
  [[nodiscard]] index_t heads() const { return config_.n_head; }
  [[nodiscard]] index_t head_dim() const { return config_.d_head; }
  [[nodiscard]] const tensor_map<const W, 2>& r_net_weight() const { return r_net_.view(); }
  [[nodiscard]] const tensor_map<const W, 2>& r_w_bias() const { return u_.view(); }
  [[nodiscard]] const tensor_map<const W, 2>& r_r_bias() const { return v_.view(); }

  /// HF: self.scale = 1 / d_head ** 0.5.
  [[nodiscard]] static double logit_scale(index_t head_dim) { return no_position::logit_scale(head_dim); }

  /// The distance whose R a pair at distance `dist` uses (clamp_len applied).
  [[nodiscard]] std::int64_t clamped(std::int64_t dist) const {
    return config_.clamp_len > 0 ? std::min(dist, config_.clamp_len) : dist;
  }
  /// Whether a query at q_pos may see the key at k_pos (causal; same_length window).
  [[nodiscard]] bool visible(std::int64_t q_pos, std::int64_t k_pos) const {
    const std::int64_t d = q_pos - k_pos;
    return d >= 0 && (!config_.same_length || d < config_.mem_len);
  }
  /// R of a distance (clamped): the [sin | cos] row of width d_model, in double.
  [[nodiscard]] std::vector<double> pos_emb(std::int64_t dist) const {
    std::vector<double> row(static_cast<std::size_t>(config_.d_model));
    detail::sinusoid_row<false>(static_cast<double>(clamped(dist)), freq_, sinusoid_layout::concat, config_.d_model,
                                row.data());
    return row;
  }
  /// r_h of a distance (clamped): head h's D values of W_R R_dist, in double.
  [[nodiscard]] std::vector<double> relative_key(index_t head, std::int64_t dist) const {
    require(head >= 0 && head < heads(), "head", "must be in [0, heads)", head, " for ", heads(), " heads");
    const std::vector<double> e = pos_emb(dist);
    std::vector<double> r(static_cast<std::size_t>(config_.d_head), 0.0);
    for (index_t d = 0; d < config_.d_head; ++d) {
      const W* w = r_net_.row(head * config_.d_head + d);
      double acc = 0;
      for (index_t c = 0; c < config_.d_model; ++c) acc += static_cast<double>(w[c]) * e[static_cast<std::size_t>(c)];
      r[static_cast<std::size_t>(d)] = acc;
    }
    return r;
  }
  /// The term inside the scale besides q.k, of one pair: u_h . k + (q + v_h) . r_h(dist), in double
  /// (q, k: D values each). Per pair and slow: for tools and checks, not the kernel.
  template <class T>
  [[nodiscard]] double score_term(index_t head, const T* q, const T* k, std::int64_t dist) const {
    const std::vector<double> r = relative_key(head, dist);
    const W* u = u_.row(head);
    const W* v = v_.row(head);
    double acc = 0;
    for (index_t d = 0; d < config_.d_head; ++d)
      acc += static_cast<double>(u[d]) * static_cast<double>(k[d]) +
             (static_cast<double>(q[d]) + static_cast<double>(v[d])) * r[static_cast<std::size_t>(d)];
    return acc;
  }

  /// What the kernel's tiles see: r_h and c_h of every distance the call can see.
  class bound {
   public:
    [[nodiscard]] static double logit_scale(index_t head_dim) { return no_position::logit_scale(head_dim); }
    /// A bound encoding serves further calls of the same shape (e.g. every segment of a stream with
    /// the same q_len and memory length) without recomputing W_R R: passed to posenc::attention, it
    /// checks that the call's heads, head_dim, scalar type and distances fit its table, and is used as is.
    [[nodiscard]] const bound& bind(const call_info& info) const {
      parent_->check_call(info);
      const auto [lo, hi] = parent_->distance_range(info);
      require(hi < lo || (n_ > 0 && lo >= min_distance() && hi <= max_distance()), "transformer_xl",
              "a bound encoding serves only calls whose distances lie in its table", "distances [", lo, ", ", hi,
              "] vs table [", min_distance(), ", ", max_distance(), "]");
      require(hi < lo || info.scalar == scalar_, "transformer_xl",
              "a bound encoding serves only calls of the scalar type it was bound for");
      return *this;
    }

    /// Distances of the per-call table: [min_distance, max_distance] (empty when max < min).
    [[nodiscard]] std::int64_t min_distance() const { return d_hi_ - n_ + 1; }
    [[nodiscard]] std::int64_t max_distance() const { return d_hi_; }
    /// Kernel hook: s(i, j) += scale * (u_h . k_j + (q_i + v_h) . r_h(dist_ij)), -inf where the
    /// pair is not visible (future key; same_length window).
    template <class T>
    void add_score_terms(const tile<T>& t, T scale, matrix_map<T> s) const {
      if (t.rows == 0 || t.cols == 0) return;
      detail::thread_scratch<detail::transformer_xl_scratch<T>> held;
      auto& sc = held.get();
      // scale * u_h . k_j, once per key of the tile
      if (static_cast<index_t>(sc.key_bias.size()) < t.cols) sc.key_bias.resize(static_cast<std::size_t>(t.cols));
      Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>> uk(sc.key_bias.data(), t.cols);
      const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> u(u_vec<T>().data() + t.head * d_, d_);
      uk.noalias() = t.k * (scale * u);
      const bool contiguous = detail::consecutive_positions(t.k_pos, t.cols);
      std::int64_t kmin = 0, kmax = 0;
      detail::position_range(t.k_pos, t.cols, kmin, kmax);
      // Rows in chunks: a chunk of r rows needs cols + r - 1 distances (contiguous positions), so the
      // (q+v).r product costs about (1 + (r - 1 + 2 a_panel) / cols) of the chunk's q.k product
      // whatever the tile's shape (one product over all rows would cost (rows + cols - 1) / cols).
      for (index_t i0 = 0; i0 < t.rows; i0 += rows_per_product)
        add_rows(t, i0, std::min(rows_per_product, t.rows - i0), kmin, kmax, contiguous, scale, s, sc);
    }

    /// Rows per (q+v).r product. Measured (clang -O3, AVX-512, float, hook time / Eigen's Q K^T of
    /// the tile): 256 x 256, d = 64: 8 rows 1.27, 12: 1.32, 16: 1.29, 32: 1.37, 48: 1.44, 64: 1.52;
    /// d = 128: 8: 1.20, 16: 1.23, 32: 1.29, 64: 1.43; 64 x 512, d = 64: 8: 1.10, 16: 1.15, 32: 1.17.
    static constexpr index_t rows_per_product = 8;

   private:
    friend class transformer_xl;
    bound() = default;

    /// Rows i0 .. i0+rows-1 of the tile: P = scale (Q R_h[distances]^T + c_h), then the gather.
    template <class T>
    void add_rows(const tile<T>& t, index_t i0, index_t rows, std::int64_t kmin, std::int64_t kmax, bool contiguous,
                  T scale, matrix_map<T> s, detail::transformer_xl_scratch<T>& sc) const {
      constexpr T neg_inf = -std::numeric_limits<T>::infinity();
      const std::int64_t* q_pos = t.q_pos + i0;
      std::int64_t qmin = 0, qmax = 0;
      detail::position_range(q_pos, rows, qmin, qmax);
      // The distances a visible pair of these rows can have, clamped (bind checked these differences fit).
      const std::int64_t lo = std::max<std::int64_t>(qmin - kmax, 0);
      std::int64_t hi = qmax - kmin;
      if (same_length_) hi = std::min(hi, mem_len_ - 1);
      if (n_ == 0 || hi < lo) {  // no pair of these rows is visible
        for (index_t i = 0; i < rows; ++i) s.row(i0 + i).setConstant(neg_inf);
        return;
      }
      // Table rows (d_hi_ - distance) of these rows' distances, widened to whole micro-panels of the
      // packed table (a packed A's row range is itself a packed A from a multiple of a_panel to a
      // multiple of it or its end): at most a_panel - 1 extra distances at each end.
      using gemm = detail::tile_gemm<T>;
      const std::int64_t first = d_hi_ - std::min(hi, clamp_), last = d_hi_ - std::min(lo, clamp_);
      const index_t r0 = static_cast<index_t>(first / gemm::a_panel * gemm::a_panel);
      const index_t r1 = static_cast<index_t>(std::min<std::int64_t>(n_, (last / gemm::a_panel + 1) * gemm::a_panel));
      const index_t m = r1 - r0;
      const std::int64_t top = d_hi_ - r0;  // distance of product column 0
      if (static_cast<index_t>(sc.products.size()) < rows * m) sc.products.resize(static_cast<std::size_t>(rows * m));
      // P(i, c) = scale * (c_h(top - c) + q_i . r_h(top - c)): (q + v) . r with the v part per
      // distance. Computed as P^T = R Q^T on the table packed in bind and the rows packed here
      // (column-major P^T is row-major P), starting from scale * c_h.
      const T* ch = bias<T>().data() + t.head * n_ + r0;
      for (index_t i = 0; i < rows; ++i) {
        T* pi = sc.products.data() + i * m;
        for (index_t c = 0; c < m; ++c) pi[c] = scale * ch[c];
      }
      T* qp = sc.packed_rows.size() < rows * d_ ? (sc.packed_rows.resize(rows * d_), sc.packed_rows.data())
                                                : sc.packed_rows.data();
      gemm::pack_b(qp, t.q.data() + i0 * t.q.outerStride(), t.q.outerStride(), rows, d_);
      gemm::multiply(sc.products.data(), m, packed<T>().data() + t.head * head_stride_ + r0 * d_, qp, m, d_, rows, scale,
                     d_, gemm::column_chunk(m, d_, rows));

      const T* ukp = sc.key_bias.data();
      for (index_t i = 0; i < rows; ++i) {
        T* row = s.data() + (i0 + i) * s.outerStride();
        const T* pi = sc.products.data() + i * m;
        if (!contiguous) {
          for (index_t j = 0; j < t.cols; ++j) {
            const std::int64_t d = q_pos[i] - t.k_pos[j];
            if (d < 0 || (same_length_ && d >= mem_len_)) row[j] = neg_inf;
            else row[j] += pi[top - std::min(d, clamp_)] + ukp[j];
          }
          continue;
        }
        // Key j is at distance e - j: [0, a) beyond the same_length window, [a, b) clamped to
        // clamp_len (one product column), [b, f) one column per distance, [f, cols) future.
        const std::int64_t e = q_pos[i] - t.k_pos[0];
        if (e < 0) {  // every key of the row is in the future
          for (index_t j = 0; j < t.cols; ++j) row[j] = neg_inf;
          continue;
        }
        const auto at = [&](std::int64_t j) { return static_cast<index_t>(std::clamp<std::int64_t>(j, 0, t.cols)); };
        const index_t f = at(e + 1);
        const index_t a = same_length_ ? std::min(at(e - mem_len_ + 1), f) : index_t{0};
        const index_t b = clamped_ ? std::clamp(at(e - clamp_), a, f) : a;
        for (index_t j = 0; j < a; ++j) row[j] = neg_inf;
        if (b > a) {
          const T pc = pi[top - clamp_];
          for (index_t j = a; j < b; ++j) row[j] += pc + ukp[j];
        }
        const index_t off = static_cast<index_t>(top - e);  // column of key j: top - (e - j) = off + j
        for (index_t j = b; j < f; ++j) row[j] += pi[off + j] + ukp[j];
        for (index_t j = f; j < t.cols; ++j) row[j] = neg_inf;
      }
    }

    template <class T>
    [[nodiscard]] const typename detail::tile_gemm<T>::buffer& packed() const {
      if constexpr (std::is_same_v<T, float>) return packed_f_;
      else return packed_d_;
    }
    template <class T>
    [[nodiscard]] const std::vector<T>& bias() const {
      if constexpr (std::is_same_v<T, float>) return c_f_;
      else return c_d_;
    }
    template <class T>
    [[nodiscard]] const std::vector<T>& u_vec() const {
      if constexpr (std::is_same_v<T, float>) return parent_->u_f_;
      else return parent_->u_d_;
    }

    const transformer_xl* parent_ = nullptr;
    index_t d_ = 0;
    std::int64_t d_hi_ = -1, n_ = 0;  ///< table rows: distances d_hi_, d_hi_ - 1, ..., d_hi_ - n_ + 1
    std::int64_t clamp_ = std::numeric_limits<std::int64_t>::max(), mem_len_ = 0;
    bool same_length_ = false, clamped_ = false;
    scalar_type scalar_ = scalar_type::float32;
    std::vector<double> c_d_;  ///< [H, n] v_h . r_h per distance
    std::vector<float> c_f_;
    index_t head_stride_ = 0;  ///< elements between heads of the packed table (aligned)
    detail::tile_gemm<double>::buffer packed_d_;  ///< per head: r_h of every distance packed as GEBP's A
    detail::tile_gemm<float>::buffer packed_f_;
  };

  /// Per-call preparation: r_h and v_h . r_h for the distances the call can see, in its scalar type.
  [[nodiscard]] bound bind(const call_info& info) const {
    check_call(info);
    bound b;
    b.parent_ = this;
    b.d_ = head_dim();
    b.same_length_ = config_.same_length;
    b.mem_len_ = config_.mem_len;
    b.scalar_ = info.scalar;
    if (config_.clamp_len > 0) {
      b.clamp_ = config_.clamp_len;
      b.clamped_ = true;
    }
    const auto [lo, hi] = distance_range(info);
    if (hi < lo) return b;  // every pair is in the future (or outside the window), or no query/key
    b.d_hi_ = hi;
    b.n_ = hi - lo + 1;
    if (info.scalar == scalar_type::float32) fill<float>(b, b.c_f_, b.packed_f_);
    else fill<double>(b, b.c_d_, b.packed_d_);
    return b;
  }

  /// bind for one Transformer-XL segment: q_len queries at positions mlen .. k_len-1 over k_len keys
  /// at 0 .. k_len-1 (transformer_xl_options), to reuse across calls of that shape.
  [[nodiscard]] bound bind_segment(index_t q_len, index_t k_len, scalar_type scalar) const {
    require(q_len >= 0 && k_len >= q_len, "k_len", "must be >= q_len (memory first, then the segment)", k_len,
            " keys for ", q_len, " queries");
    call_info info;
    info.heads = info.kv_heads = heads();
    info.head_dim = info.value_dim = head_dim();
    info.q_len = q_len;
    info.k_len = k_len;
    info.scalar = scalar;
    info.q_min = k_len - q_len;
    info.q_max = k_len - 1;
    info.k_min = 0;
    info.k_max = k_len - 1;
    return bind(info);
  }

 private:
  void check_call(const call_info& info) const {
    require(info.heads == heads(), "transformer_xl", "n_head must equal the query heads of the call", heads(), " vs ",
            info.heads);
    require(info.head_dim == head_dim(), "transformer_xl", "d_head must equal the head_dim of q and k", head_dim(),
            " vs ", info.head_dim);
  }

  /// The clamped distances [lo, hi] a visible pair of the call can have (hi < lo: none).
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> distance_range(const call_info& info) const {
    if (info.q_max < info.q_min || info.k_max < info.k_min) return {0, -1};
    std::int64_t hi = 0, lo = 0;
    // Distances are formed per pair in int64 (plus one): keep them well inside its range.
    constexpr std::int64_t limit = std::int64_t{1} << 62;
    require(!detail::sub_overflow(info.q_max, info.k_min, hi) && !detail::sub_overflow(info.q_min, info.k_max, lo) &&
                hi < limit && lo > -limit,
            "positions", "query minus key positions must lie in (-2^62, 2^62)", "queries [", info.q_min, ", ",
            info.q_max, "], keys [", info.k_min, ", ", info.k_max, "]");
    lo = std::max<std::int64_t>(lo, 0);
    if (config_.same_length) hi = std::min<std::int64_t>(hi, config_.mem_len - 1);
    if (hi < lo) return {0, -1};
    const std::int64_t clamp = config_.clamp_len > 0 ? config_.clamp_len : std::numeric_limits<std::int64_t>::max();
    lo = std::min(lo, clamp);
    hi = std::min(hi, clamp);
    require(hi - lo + 1 <= max_distances, "positions",
            "the call spans too many query-key distances for the per-call table (set clamp_len)", hi - lo + 1,
            " distances, at most ", max_distances);
    return {lo, hi};
  }

  void init() {
    const transformer_xl_config& c = config_;
    require(c.n_head > 0, "n_head", "must be > 0", c.n_head);
    require(c.d_head > 0, "d_head", "must be > 0", c.d_head);
    require(c.d_model > 0 && c.d_model % 2 == 0, "d_model",
            "must be even and > 0 (R is [sin | cos] of d_model / 2 frequencies)", c.d_model);
    require(c.clamp_len >= -1, "clamp_len", "must be >= -1 (<= 0: no clamping)", c.clamp_len);
    require(c.mem_len >= 0, "mem_len", "must be >= 0", c.mem_len);
    require(!c.same_length || c.mem_len > 0, "mem_len", "must be > 0 with same_length (a query sees mem_len keys)",
            c.mem_len);
    require(r_net_.view().data() != nullptr && r_net_.rows() == c.n_head * c.d_head && r_net_.cols() == c.d_model,
            "r_net.weight", "must be [n_head * d_head, d_model]", "[", r_net_.rows(), ", ", r_net_.cols(), "] for [",
            c.n_head * c.d_head, ", ", c.d_model, "]");
    require(u_.view().data() != nullptr && u_.rows() == c.n_head && u_.cols() == c.d_head, "r_w_bias",
            "must be [n_head, d_head]", "[", u_.rows(), ", ", u_.cols(), "] for [", c.n_head, ", ", c.d_head, "]");
    require(v_.view().data() != nullptr && v_.rows() == c.n_head && v_.cols() == c.d_head, "r_r_bias",
            "must be [n_head, d_head]", "[", v_.rows(), ", ", v_.cols(), "] for [", c.n_head, ", ", c.d_head, "]");
    freq_ = detail::sinusoid_frequencies(c.d_model, 10000.0, frequency_schedule::vaswani);
    const auto hd = static_cast<std::size_t>(c.n_head * c.d_head);
    u_d_.resize(hd);
    u_f_.resize(hd);
    for (std::size_t e = 0; e < hd; ++e) {
      u_d_[e] = static_cast<double>(u_.view().data()[e]);
      u_f_[e] = static_cast<float>(u_.view().data()[e]);
    }
  }

  /// table [H, n, D]: r_h(d_hi - t) for row t; c [H, n]: v_h . r_h. R is made in chunks of rows
  /// (never the whole [n, d_model]) and multiplied by W_R in the call's type.
  template <class T>
  void fill(bound& b, std::vector<T>& c, typename detail::tile_gemm<T>::buffer& packed) const {
    using row_major = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using gemm = detail::tile_gemm<T>;
    const index_t H = heads(), D = head_dim(), M = config_.d_model, n = b.n_;
    c.resize(static_cast<std::size_t>(H * n));
    // Packed per head (heads 64-byte aligned apart), chunk by chunk: packing rows [t0, t0 + cn) at
    // offset t0 * D gives the layout of packing all n rows when t0 is a multiple of pack_step, so
    // the unpacked [H, n, D] table never exists (it would double the call's peak memory).
    b.head_stride_ = (n * D + 15) / 16 * 16;
    packed.resize(H * b.head_stride_);
    row_major w(H * D, M), vv(H, D);
    for (index_t r = 0; r < H * D; ++r)
      for (index_t k = 0; k < M; ++k) w(r, k) = static_cast<T>(r_net_.row(r)[k]);
    for (index_t h = 0; h < H; ++h)
      for (index_t d = 0; d < D; ++d) vv(h, d) = static_cast<T>(v_.row(h)[d]);
    const index_t chunk = std::max<index_t>(1, 256 / gemm::pack_step) * gemm::pack_step;
    row_major rows(std::min<index_t>(chunk, n), M), r(std::min<index_t>(chunk, n), H * D);
    // float: consecutive distances by rotation (detail::sinusoid_walker, ~1e-14 from exact); double: exact.
    detail::sinusoid_walker walker(freq_);
    for (index_t t0 = 0; t0 < n; t0 += chunk) {
      const index_t cn = std::min(chunk, n - t0);
      // Row t of the chunk is distance d_hi - t0 - t; walk the distances upward.
      for (index_t t = cn - 1; t >= 0; --t) {
        const std::int64_t dist = b.d_hi_ - t0 - t;
        if constexpr (std::is_same_v<T, float>) {
          walker.go(dist);
          walker.write(sinusoid_layout::concat, M, rows.row(t).data());
        } else {
          detail::sinusoid_row<false>(static_cast<double>(dist), freq_, sinusoid_layout::concat, M, rows.row(t).data());
        }
      }
      r.topRows(cn).noalias() = rows.topRows(cn) * w.transpose();  // R W_R^T: [cn, H*D]
      for (index_t h = 0; h < H; ++h) {
        gemm::pack_a(packed.data() + h * b.head_stride_ + t0 * D, r.data() + h * D, H * D, cn, D);
        Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>(c.data() + h * n + t0, cn).noalias() =
            r.topRows(cn).middleCols(h * D, D) * vv.row(h).transpose();
      }
    }
  }

  transformer_xl_config config_;
  detail::table_storage<W> r_net_, u_, v_;
  std::vector<double> freq_;
  std::vector<double> u_d_;
  std::vector<float> u_f_;
};

}  // namespace posenc
