// posenc/detail/mask.hpp — positions and masks of one attention call, resolved once and shared by
// the reference attention and the fused kernel, so both apply exactly the same visibility rule.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "posenc/detail/platform.hpp"
#include "posenc/detail/position_scan.hpp"
#include "posenc/encoding.hpp"
#include "posenc/options.hpp"

namespace posenc::detail {

/// Causal visibility by positions with an optional sliding window (0 = none): k <= q, and
/// q - k < window (Hugging Face Mistral's sliding-window mask, FORMAT.md 5.11). The difference is
/// taken in uint64, exact for any k <= q even when q - k does not fit int64.
[[nodiscard]] inline bool causal_visible(std::int64_t q, std::int64_t k, std::int64_t window) {
  return k <= q && (window == 0 || static_cast<std::uint64_t>(q) - static_cast<std::uint64_t>(k) <
                                       static_cast<std::uint64_t>(window));
}

/// Whether a key at position k is before the window of a query at q (k <= q - window): it is then
/// before the window of every query at a position >= q too.
[[nodiscard]] inline bool before_window(std::int64_t q, std::int64_t k, std::int64_t window) {
  return window > 0 && k <= q && !causal_visible(q, k, window);
}

/// The smallest key position inside the window of a query at q: q - window + 1 (the int64 minimum
/// when that is below it; any key is then inside).
[[nodiscard]] inline std::int64_t window_start(std::int64_t q, std::int64_t window) {
  std::int64_t r = 0;
  if (sub_overflow(q, window - 1, r)) return std::numeric_limits<std::int64_t>::min();
  return r;
}

/// Positions and key validity of a call, [batch, len] each, owned (O(L) per batch row).
struct call_masks {
  index_t batch = 0, q_len = 0, k_len = 0;
  /// The first of the caller's keys the call holds (leading_keys_unseen): its keys are the caller's
  /// k_first .. k_first + k_len - 1 (keys_seen_end), key j at the caller's index k_first + j.
  index_t k_first = 0;
  bool causal = false;
  std::int64_t window = 0;             ///< sliding window (with causal), 0 = none
  std::vector<std::int64_t> q_pos;     ///< [batch * q_len]
  std::vector<std::int64_t> k_pos;     ///< [batch * k_len]
  std::vector<unsigned char> k_valid;  ///< [batch * k_len], 1 = may be attended
  std::int64_t q_min = 0, q_max = -1, k_min = 0, k_max = -1;

  [[nodiscard]] const std::int64_t* qp(index_t b) const { return q_pos.data() + b * q_len; }
  [[nodiscard]] const std::int64_t* kp(index_t b) const { return k_pos.data() + b * k_len; }
  [[nodiscard]] const unsigned char* kv(index_t b) const { return k_valid.data() + b * k_len; }
  /// The single visibility rule (FORMAT.md sections 3 and 5.11): valid key, and when causal key
  /// position <= query position, within the sliding window when there is one.
  [[nodiscard]] bool visible(index_t b, index_t i, index_t j) const {
    return kv(b)[j] != 0 && (!causal || causal_visible(qp(b)[i], kp(b)[j], window));
  }

  [[nodiscard]] call_info info(index_t heads, index_t kv_heads, index_t head_dim, index_t value_dim) const {
    call_info c;
    c.batch = batch;
    c.heads = heads;
    c.kv_heads = kv_heads;
    c.q_len = q_len;
    c.k_len = k_len;
    c.k_first = k_first;
    c.head_dim = head_dim;
    c.value_dim = value_dim;
    c.q_positions = positions_view(q_pos.data(), batch, q_len);
    c.k_positions = positions_view(k_pos.data(), batch, k_len);
    c.q_min = q_min;
    c.q_max = q_max;
    c.k_min = k_min;
    c.k_max = k_max;
    return c;
  }
};

/// How many leading keys of a call no query can see, with nothing but their index to tell: with a
/// sliding window and keys positioned by their index (no k_positions), the keys before the window of
/// the lowest query position q_min, k < q_min - W + 1, are before every query's window (padding only
/// hides more keys). A decode step with W = 128 on a 32768-key cache would otherwise resolve,
/// summarize and keep a softmax state for all of them (docs/decode-measurements.md › Per-call work that
/// grows with the cache). At least one key is kept, so the call's shapes stay those of a call with keys.
[[nodiscard]] inline index_t leading_keys_unseen(const attention_options& opt, std::int64_t q_min, index_t k_len) {
  if (!opt.causal || opt.sliding_window == 0 || opt.k_positions || k_len <= 1) return 0;
  const std::int64_t first = window_start(q_min, opt.sliding_window);
  return first <= 0 ? 0 : static_cast<index_t>(std::min<std::int64_t>(first, k_len - 1));
}

/// One past the last key of a call some query may see, told by index and padding alone: causal with
/// keys positioned by their index, the keys after the highest query position q_max; in every batch
/// row, the keys from its kv_length on and the trailing keys key_padding_mask or attention_mask call
/// padding. A step at position p of a preallocated cache (Hugging Face's StaticCache, a runtime's
/// slab) would otherwise resolve and summarize every slot, and the tile that holds p would read the
/// value rows of the unfilled slots after it (a NaN there, 0 * NaN, would reach the output). The
/// masks are scanned from the end, so only the trailing padding is read. Not below `k_first` + 1.
[[nodiscard]] inline index_t keys_seen_end(const attention_options& opt, std::int64_t q_max, index_t k_first,
                                           index_t k_len, index_t batch) {
  index_t bound = k_len;
  if (opt.causal && !opt.k_positions) bound = static_cast<index_t>(std::clamp<std::int64_t>(q_max, -1, k_len - 1) + 1);
  index_t end = k_first;  // keys before k_first are left out already: no scan goes below it
  for (index_t b = 0; b < batch && end < bound; ++b) {
    index_t e = bound;
    if (!opt.kv_lengths.empty()) e = std::min(e, static_cast<index_t>(opt.kv_lengths[static_cast<std::size_t>(b)]));
    const auto padding = [&](index_t j) {
      return (opt.key_padding_mask && (*opt.key_padding_mask)(b, j) != 0) ||
             (opt.attention_mask && (*opt.attention_mask)(b, j) == 0);
    };
    while (e > end && padding(e - 1)) --e;
    end = std::max(end, e);
  }
  return std::max(end, k_first + 1);
}

/// Validate the mask/position options against the shapes and resolve them into m (throws posenc::error
/// before m is touched). m's arrays keep their storage: attention passes a call_masks its thread keeps
/// between calls (thread_scratch), so a decode step does not fault fresh pages in for its 9 bytes a key
/// every call (resolve_masks gives a new one). `leave_unseen`: the call holds only the keys from
/// leading_keys_unseen up to keys_seen_end (call_masks::k_first, k_len); the caller views k and v as that
/// range.
inline void resolve_masks_into(call_masks& m, const attention_options& opt, index_t batch, index_t q_len,
                               index_t k_len, bool leave_unseen = false) {
  if (opt.q_positions) {
    require(opt.q_positions->dimension(0) == batch && opt.q_positions->dimension(1) == q_len, "q_positions",
            "must be [batch, q_len]", "[", opt.q_positions->dimension(0), ", ", opt.q_positions->dimension(1),
            "] for batch ", batch, ", q_len ", q_len);
  }
  if (opt.k_positions) {
    require(opt.k_positions->dimension(0) == batch && opt.k_positions->dimension(1) == k_len, "k_positions",
            "must be [batch, k_len]", "[", opt.k_positions->dimension(0), ", ", opt.k_positions->dimension(1),
            "] for batch ", batch, ", k_len ", k_len);
  }
  if (opt.key_padding_mask) {
    require(opt.key_padding_mask->dimension(0) == batch && opt.key_padding_mask->dimension(1) == k_len,
            "key_padding_mask", "must be [batch, k_len]", "[", opt.key_padding_mask->dimension(0), ", ",
            opt.key_padding_mask->dimension(1), "] for batch ", batch, ", k_len ", k_len);
  }
  if (opt.attention_mask) {
    const auto& am = *opt.attention_mask;
    require(am.dimension(0) == batch && am.dimension(1) == k_len, "attention_mask", "must be [batch, k_len]", "[",
            am.dimension(0), ", ", am.dimension(1), "] for batch ", batch, ", k_len ", k_len);
    check_attention_mask(am);
  }
  require(opt.sliding_window >= 0, "sliding_window", "must be >= 0 (0 = off)", opt.sliding_window);
  require(opt.sliding_window == 0 || opt.causal, "sliding_window", "requires causal = true", opt.sliding_window);
  // the default query positions q_offset + i must be int64s (the sum would overflow, undefined, past INT64_MAX)
  if (!opt.q_positions && q_len > 0)
    require(opt.q_offset <= std::numeric_limits<std::int64_t>::max() - (q_len - 1), "q_offset",
            "must keep the last query's position q_offset + q_len - 1 within int64", opt.q_offset, " with q_len ",
            q_len);
  if (!opt.kv_lengths.empty()) {
    require(static_cast<index_t>(opt.kv_lengths.size()) == batch, "kv_lengths", "must have one entry per batch row",
            opt.kv_lengths.size(), " entries for batch ", batch);
    for (std::size_t b = 0; b < opt.kv_lengths.size(); ++b)
      require(opt.kv_lengths[b] >= 0 && opt.kv_lengths[b] <= k_len, "kv_lengths", "entries must be in [0, k_len]",
              opt.kv_lengths[b], " at batch ", b, ", k_len ", k_len);
  }

  // a fresh call_masks but for the arrays' storage
  m = call_masks{.q_pos = std::move(m.q_pos), .k_pos = std::move(m.k_pos), .k_valid = std::move(m.k_valid)};
  m.batch = batch;
  m.q_len = q_len;
  m.causal = opt.causal;
  m.window = opt.sliding_window;
  // A decode step resolves its whole cache's keys every call: each array is filled by its own
  // branch-free loop, only for the options given (one loop testing every option per key took 46 us
  // at k_len = 32768, 0.4 % of a 1-thread f32 step, 0.8 % of a 2-thread one, before any thread starts).
  // The queries first: their lowest position tells which leading keys no query sees.
  m.q_pos.resize(static_cast<std::size_t>(batch * q_len));
  // the lengths as locals the stores below cannot alias (batch, q_len and k_len had their addresses
  // taken by the checks above, so the loops reloaded them after every store and stayed scalar)
  const index_t nq = q_len;
  for (index_t b = 0; b < batch; ++b) {
    std::int64_t* qp = m.q_pos.data() + b * nq;
    if (opt.q_positions)
      for (index_t i = 0; i < nq; ++i) qp[i] = (*opt.q_positions)(b, i);
    else
      for (index_t i = 0; i < nq; ++i) qp[i] = opt.q_offset + i;
  }
  position_range(m.q_pos.data(), batch * q_len, m.q_min, m.q_max);
  const bool cut = leave_unseen && batch * q_len > 0 && k_len > 0;
  const index_t k_first = cut ? leading_keys_unseen(opt, m.q_min, k_len) : 0;
  m.k_first = k_first;
  m.k_len = (cut ? keys_seen_end(opt, m.q_max, k_first, k_len, batch) : k_len) - k_first;
  const index_t nk = m.k_len;
  m.k_pos.resize(static_cast<std::size_t>(batch * nk));
  m.k_valid.assign(static_cast<std::size_t>(batch * nk), 1);
  for (index_t b = 0; b < batch; ++b) {
    std::int64_t* kp = m.k_pos.data() + b * nk;
    unsigned char* kv = m.k_valid.data() + b * nk;
    if (opt.k_positions)  // k_first is 0 with k_positions
      for (index_t j = 0; j < nk; ++j) kp[j] = (*opt.k_positions)(b, j);
    else
      for (index_t j = 0; j < nk; ++j) kp[j] = k_first + j;
    if (opt.key_padding_mask)
      for (index_t j = 0; j < nk; ++j)
        kv[j] &= static_cast<unsigned char>((*opt.key_padding_mask)(b, k_first + j) == 0);
    if (opt.attention_mask)
      for (index_t j = 0; j < nk; ++j) kv[j] &= static_cast<unsigned char>((*opt.attention_mask)(b, k_first + j) != 0);
    if (!opt.kv_lengths.empty())
      std::fill(kv + std::clamp<index_t>(opt.kv_lengths[static_cast<std::size_t>(b)] - k_first, 0, nk), kv + nk,
                static_cast<unsigned char>(0));
  }
  position_range(m.k_pos.data(), batch * nk, m.k_min, m.k_max);
}

/// resolve_masks_into a new call_masks.
inline call_masks resolve_masks(const attention_options& opt, index_t batch, index_t q_len, index_t k_len,
                                bool leave_unseen = false) {
  call_masks m;
  resolve_masks_into(m, opt, batch, q_len, k_len, leave_unseen);
  return m;
}

/// The logit options every entry point shares (throws posenc::error before anything is written):
/// logit_softcap 0 or finite > 0; sinks empty or one per query head, each finite or -inf (a head
/// without a sink).
inline void check_logit_options(const attention_options& opt, index_t heads) {
  require(opt.logit_softcap == 0.0 || (std::isfinite(opt.logit_softcap) && opt.logit_softcap > 0.0), "logit_softcap",
          "must be 0 (off) or finite and > 0", opt.logit_softcap);
  if (opt.sinks.empty()) return;
  require(static_cast<index_t>(opt.sinks.size()) == heads, "sinks", "must have one entry per query head",
          opt.sinks.size(), " entries for ", heads, " heads");
  for (std::size_t h = 0; h < opt.sinks.size(); ++h)
    require(std::isfinite(opt.sinks[h]) || opt.sinks[h] == -std::numeric_limits<double>::infinity(), "sinks",
            "entries must be finite or -inf", opt.sinks[h], " at head ", h);
}

/// Shape checks common to every attention entry point (throws posenc::error naming the argument).
template <class T, class KV>
void check_attention_shapes(const heads_view<const T>& q, const heads_view<const KV>& k,
                            const heads_view<const KV>& v, const heads_view<T>& out) {
  require(k.batch() == q.batch(), "k", "batch must equal q's batch", k.batch(), " vs ", q.batch());
  require(v.batch() == q.batch(), "v", "batch must equal q's batch", v.batch(), " vs ", q.batch());
  require(out.batch() == q.batch(), "out", "batch must equal q's batch", out.batch(), " vs ", q.batch());
  require(k.dim() == q.dim(), "k", "head_dim must equal q's head_dim", k.dim(), " vs ", q.dim());
  require(v.seq() == k.seq(), "v", "seq must equal k's seq", v.seq(), " vs ", k.seq());
  require(v.heads() == k.heads(), "v", "heads must equal k's heads", v.heads(), " vs ", k.heads());
  require(out.seq() == q.seq(), "out", "seq must equal q's seq", out.seq(), " vs ", q.seq());
  require(out.heads() == q.heads(), "out", "heads must equal q's heads", out.heads(), " vs ", q.heads());
  require(out.dim() == v.dim(), "out", "head_dim must equal v's head_dim", out.dim(), " vs ", v.dim());
  require(k.heads() > 0 || q.heads() == 0, "k", "heads must be > 0", k.heads());
  require(k.heads() == 0 || q.heads() % k.heads() == 0, "k",
          "heads (kv_heads) must divide q's heads (GQA/MQA)", k.heads(), " for ", q.heads(), " query heads");
}

/// GQA/MQA (HF repeat_kv): query head h reads kv head h / (heads / kv_heads).
[[nodiscard]] inline index_t kv_head_of(index_t head, index_t heads, index_t kv_heads) { return head / (heads / kv_heads); }

}  // namespace posenc::detail
