// posenc/alibi.hpp — ALiBi, attention with linear biases (Press, Smith & Lewis 2022, "Train Short,
// Test Long", sec. 3): a per-head slope times the query-key distance, added to the scaled logits
// (BLOOM adds it after the 1/sqrt(d) scale: modeling_bloom.py baddbmm(alibi, q, k, beta=1,
// alpha=inv_norm_factor)). The bias is formed per tile from the tile's absolute positions inside the
// kernel; no [heads, q_len, k_len] tensor exists.
//
// Slopes (Press et al.'s get_slopes, BLOOM build_alibi_tensor, ggml's max_bias form): n = the largest
// power of two <= heads,
//   head h <  n:  m_h = 2^(-max_bias (h+1) / n)
//   head h >= n:  m_h = 2^(-(max_bias/2) (2(h-n)+1) / n)   (every other slope of the 2n series)
// max_bias = 8 is the paper's; ggml exposes other values (m0 = 2^(-max_bias/n), m1 = 2^(-max_bias/2/n)).
// slope_scale multiplies every slope: Falcon adds the bias before the 1/sqrt(d) scale
// (modeling_falcon.py FalconAttention: (q k^T + alibi) * inv_norm_factor), so its slopes are m_h / sqrt(d).
//
// Forms (golden FORMAT.md 5.4), with q, k the absolute positions:
//   causal        -m (q - k)     the paper's form (equal to key_position under a causal softmax)
//   symmetric     -m |q - k|     bidirectional (llama.cpp's KQ mask for non-causal models)
//   key_position  +m k           BLOOM's form (softmax is shift-invariant per query row)
//
//   posenc::alibi enc({.heads = 8});
//   posenc::attention(q, k, v, out, enc, {.causal = true});
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

enum class alibi_form {
  causal,        ///< -m (q - k)
  symmetric,     ///< -m |q - k|
  key_position,  ///< +m k (BLOOM)
};

struct alibi_config {
  index_t heads = 0;
  double max_bias = 8.0;
  alibi_form form = alibi_form::causal;
  /// Multiplies every slope (1: the paper's and BLOOM's; Falcon: head_dim^-1/2).
  double slope_scale = 1.0;
};

/// The ALiBi slope of every head (Press et al. / BLOOM get_slopes; ggml's max_bias family).
[[nodiscard]] inline std::vector<double> alibi_slopes(index_t heads, double max_bias = 8.0) {
  require(heads > 0, "heads", "must be > 0", heads);
  require(std::isfinite(max_bias) && max_bias > 0.0, "max_bias", "must be finite and > 0", max_bias);
  index_t n = 1;
  while (2 * n <= heads) n *= 2;
  std::vector<double> m(static_cast<std::size_t>(heads));
  const double nd = static_cast<double>(n);
  for (index_t h = 0; h < heads; ++h) {
    // exp2 of a multiple of max_bias/n: exact powers of two whenever the exponent is an integer.
    const double e = h < n ? -max_bias * static_cast<double>(h + 1) / nd
                           : -(max_bias / 2.0) * static_cast<double>(2 * (h - n) + 1) / nd;
    m[static_cast<std::size_t>(h)] = std::exp2(e);
  }
  return m;
}

class alibi {
 public:
  explicit alibi(const alibi_config& config) : config_(config), slopes_(alibi_slopes(config.heads, config.max_bias)) {
    require(std::isfinite(config.slope_scale) && config.slope_scale > 0.0, "slope_scale", "must be finite and > 0",
            config.slope_scale);
    for (double& m : slopes_) m *= config.slope_scale;
  }

  [[nodiscard]] const alibi_config& config() const { return config_; }
  [[nodiscard]] index_t heads() const { return config_.heads; }
  [[nodiscard]] std::span<const double> slopes() const { return slopes_; }
  [[nodiscard]] double slope(index_t head) const { return slopes_.at(static_cast<std::size_t>(head)); }

  /// The bias of one (head, query position, key position) in double: the scalar formula.
  [[nodiscard]] double bias(index_t head, std::int64_t q_pos, std::int64_t k_pos) const {
    const double m = slope(head), r = static_cast<double>(k_pos - q_pos);
    switch (config_.form) {
      case alibi_form::causal:
        return m * r;
      case alibi_form::symmetric:
        return -m * std::abs(r);
      case alibi_form::key_position:
        return m * static_cast<double>(k_pos);
    }
    return 0.0;
  }

  /// Per-call check (the heads must match the slopes); the encoding itself serves the tiles.
  [[nodiscard]] const alibi& bind(const call_info& info) const {
    require(info.heads == config_.heads, "alibi", "heads must equal the query heads of the call", config_.heads, " vs ",
            info.heads);
    return *this;
  }

  /// Kernel hook: s(i, j) += bias(head, q_pos[i], k_pos[j]) for one tile, after the logit scale.
  /// Key positions are converted once per chunk so the row loop is a pure vector fma.
  template <class T>
  void add_position_bias(const tile<T>& t, matrix_map<T> s) const {
    const T m = static_cast<T>(slopes_[static_cast<std::size_t>(t.head)]);
    constexpr index_t chunk = 256;
    alignas(64) T kp[chunk];
    for (index_t c0 = 0; c0 < t.cols; c0 += chunk) {
      const index_t nc = std::min(chunk, t.cols - c0);
      for (index_t j = 0; j < nc; ++j) kp[j] = static_cast<T>(t.k_pos[c0 + j]);
      for (index_t i = 0; i < t.rows; ++i) {
        T* row = s.data() + i * s.outerStride() + c0;
        const T qp = static_cast<T>(t.q_pos[i]);
        switch (config_.form) {
          case alibi_form::causal:
            for (index_t j = 0; j < nc; ++j) row[j] += m * (kp[j] - qp);
            break;
          case alibi_form::symmetric:
            for (index_t j = 0; j < nc; ++j) row[j] -= m * std::abs(kp[j] - qp);
            break;
          case alibi_form::key_position:
            for (index_t j = 0; j < nc; ++j) row[j] += m * kp[j];
            break;
        }
      }
    }
  }

 private:
  alibi_config config_;
  std::vector<double> slopes_;
};

}  // namespace posenc
