// posenc/detail/online_softmax.hpp — the running-max / running-sum softmax over key blocks.
//
// Milakov & Gimelshein 2018 ("Online normalizer calculation for softmax", algorithm 3) and
// FlashAttention (Dao et al. 2022, section 3.1): after key block t a row keeps
//   m_t = max(m_{t-1}, max_j s_j),  l_t = exp(m_{t-1} - m_t) l_{t-1} + sum_j exp(s_j - m_t),
// and every accumulator built from earlier blocks (the output, the value-term buckets) is rescaled
// by alpha = exp(m_{t-1} - m_t). At the end out = acc / l and lse = m + log l.
// A row that has seen only -inf scores (masked keys, -inf biases) keeps m = -inf and l = 0 and never
// evaluates exp(-inf - -inf) = NaN.
#pragma once

#include <cmath>
#include <limits>

#include <Eigen/Core>

#include "posenc/tensor.hpp"

namespace posenc::detail {

template <class T>
struct online_softmax {
  using vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  vector m, l, alpha;  ///< running max, running sum, rescale factor of the last step (per row)

  void reset(index rows) {
    m.setConstant(rows, -std::numeric_limits<T>::infinity());
    l.setZero(rows);
    alpha.setOnes(rows);
  }

  /// Replaces the scores s (rows x cols, masked entries -inf) by exp(s - m_new) in place and updates
  /// m, l and alpha. Returns whether some alpha differs from 1 (the accumulators need rescaling).
  bool step(matrix_map<T> s) {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    bool rescale = false;
    for (index i = 0; i < s.rows(); ++i) {
      auto row = s.row(i).array();
      const T m_new = std::max(m(i), row.maxCoeff());
      if (m_new == neg_inf) {  // nothing visible so far: weights 0, nothing to rescale
        row.setZero();
        alpha(i) = T(1);
        continue;
      }
      alpha(i) = std::exp(m(i) - m_new);  // m(i) = -inf gives 0: the accumulators are still zero
      rescale = rescale || alpha(i) != T(1);
      row = (row - m_new).exp();  // vectorized (Eigen's packet exp); exp(-inf) = 0 for masked keys
      l(i) = alpha(i) * l(i) + row.sum();
      m(i) = m_new;
    }
    return rescale;
  }

  /// Natural-log log-sum-exp of row i (-inf when the row saw no finite score).
  [[nodiscard]] T lse(index i) const {
    return l(i) > T(0) ? m(i) + std::log(l(i)) : -std::numeric_limits<T>::infinity();
  }
};

}  // namespace posenc::detail
