// posenc/reference.hpp — the reference attention: deliberately plain, the oracle of the tests.
//
// It materializes the [q_len x k_len] scores of each (batch, head), applies every term by its
// plainest per-element formula, and takes a two-pass softmax. It is slow on purpose and shares no
// code with the fused kernel except the resolution of positions and masks (detail/mask.hpp), so a
// test that compares the two checks the kernel's tiling, fusion and online softmax.
//
// Encoding terms enter as per-element callables, so a test writes each formula independently of
// the encoding type under test:
//   s_ij = cap(scale * (q_i . k_j + score_term(b,h,i,j))) + bias(b,h,i,j)
//          cap(x) = c tanh(x / c) with options.logit_softcap = c, else x
//   p_ij = exp(s_ij - m) / (sum_j' exp(s_ij' - m) [+ exp(sinks[h] - m)]) over the visible keys
//          (m the maximum of the visible scores and the sink)
//   out_i = sum_j p_ij * (v_j + value_term(b,h,i,j))
// Q/K transforms (RoPE) are applied to q and k before the call.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "posenc/detail/mask.hpp"
#include "posenc/options.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

template <class T>
struct reference_terms {
  /// Added to q_i . k_j inside the scale (Shaw keys, Transformer-XL, DeBERTa, TUPE's untied term).
  std::function<T(index_t b, index_t h, index_t i, index_t j)> score_term{};
  /// Added after the scale (ALiBi, T5, TUPE's relative bias, an explicit additive mask).
  std::function<T(index_t b, index_t h, index_t i, index_t j)> bias{};
  /// Writes value_dim numbers added to v_j for the pair (i, j) (Shaw values).
  std::function<void(index_t b, index_t h, index_t i, index_t j, T* add)> value_term{};
};

/// Plain materialized attention. `probs` (optional) is [batch, heads, q_len, k_len]; `lse` (optional)
/// is [batch, heads, q_len], natural log of sum_j exp(s_ij) over visible keys, plus exp(sinks[h])
/// when there are sinks (-inf when the row sees no key).
template <class T>
void reference_attention(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
                         const attention_options& opt = {}, const reference_terms<T>& terms = {},
                         std::optional<tensor_map<T, 4>> probs = std::nullopt,
                         std::optional<tensor_map<T, 3>> lse = std::nullopt) {
  detail::check_attention_shapes<T, T>(q, k, v, out);
  const index_t B = q.batch(), H = q.heads(), Hkv = k.heads(), Sq = q.seq(), Sk = k.seq(), D = q.dim(), Dv = v.dim();
  if (probs)
    require(probs->dimension(0) == B && probs->dimension(1) == H && probs->dimension(2) == Sq &&
                probs->dimension(3) == Sk,
            "probs", "must be [batch, heads, q_len, k_len]");
  if (lse)
    require(lse->dimension(0) == B && lse->dimension(1) == H && lse->dimension(2) == Sq, "lse",
            "must be [batch, heads, q_len]");
  detail::check_logit_options(opt, H);
  const detail::call_masks m = detail::resolve_masks(opt, B, Sq, Sk);
  const double scale = opt.scale ? *opt.scale : 1.0 / std::sqrt(static_cast<double>(D));
  require(std::isfinite(scale), "scale", "must be finite", scale);

  const T neg_inf = -std::numeric_limits<T>::infinity();
  std::vector<T> s(static_cast<std::size_t>(Sk)), add(static_cast<std::size_t>(Dv));
  std::vector<unsigned char> vis(static_cast<std::size_t>(Sk));
  for (index_t b = 0; b < B; ++b) {
    for (index_t h = 0; h < H; ++h) {
      const index_t hk = detail::kv_head_of(h, H, Hkv);
      for (index_t i = 0; i < Sq; ++i) {
        T mx = neg_inf;
        bool poisoned = false;  // a visible NaN or +inf score makes the row NaN, as in PyTorch's softmax
        for (index_t j = 0; j < Sk; ++j) {
          vis[j] = m.visible(b, i, j) ? 1 : 0;
          T dot = 0;
          for (index_t d = 0; d < D; ++d) dot += q(b, i, h, d) * k(b, j, hk, d);
          if (terms.score_term) dot += terms.score_term(b, h, i, j);
          s[j] = static_cast<T>(scale) * dot;
          if (opt.logit_softcap > 0) {
            const T c = static_cast<T>(opt.logit_softcap);
            s[j] = c * std::tanh(s[j] / c);
          }
          if (terms.bias) s[j] += terms.bias(b, h, i, j);
          if (vis[j] && s[j] > mx) mx = s[j];
          if (vis[j] && (std::isnan(s[j]) || s[j] == -neg_inf)) poisoned = true;
        }
        if (poisoned) {
          for (index_t d = 0; d < Dv; ++d) out(b, i, h, d) = std::numeric_limits<T>::quiet_NaN();
          if (probs)
            for (index_t j = 0; j < Sk; ++j) (*probs)(b, h, i, j) = std::numeric_limits<T>::quiet_NaN();
          if (lse) (*lse)(b, h, i) = std::numeric_limits<T>::quiet_NaN();
          continue;
        }
        // A row whose visible scores are all -inf (or that sees nothing) gets zero weights and no sink.
        const bool sink = !opt.sinks.empty() && mx != neg_inf;
        const T sink_logit = sink ? static_cast<T>(opt.sinks[static_cast<std::size_t>(h)]) : neg_inf;
        if (sink && sink_logit > mx) mx = sink_logit;
        T sum = sink ? std::exp(sink_logit - mx) : T(0);
        for (index_t j = 0; j < Sk; ++j) {
          s[j] = (vis[j] && mx != neg_inf) ? std::exp(s[j] - mx) : T(0);
          sum += s[j];
        }
        for (index_t d = 0; d < Dv; ++d) out(b, i, h, d) = 0;
        for (index_t j = 0; j < Sk; ++j) {
          const T p = sum > 0 ? s[j] / sum : T(0);
          if (probs) (*probs)(b, h, i, j) = p;
          if (p == 0) continue;
          for (index_t d = 0; d < Dv; ++d) add[d] = 0;
          if (terms.value_term) terms.value_term(b, h, i, j, add.data());
          for (index_t d = 0; d < Dv; ++d) out(b, i, h, d) += p * (v(b, j, hk, d) + add[d]);
        }
        if (lse) (*lse)(b, h, i) = sum > 0 ? mx + std::log(sum) : neg_inf;
      }
    }
  }
}

}  // namespace posenc
