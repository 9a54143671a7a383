// posenc/attention.hpp — the fused multi-head attention kernel: tiled, online softmax, every hook of
// the encoding contract (posenc/encoding.hpp) applied inside the tile loop, threads over work items.
//
// The kernel is three parts, each in its own header (docs/design.md › The kernel):
//   scheduling      detail/attention_schedule.hpp  work items of up to 4 query blocks ("units") of one
//                                                  (batch, kv head), the key blocks each unit sees
//                                                  (the causal plan, padding-only blocks skipped)
//   operand supply  detail/attention_operands.hpp  queries, keys and values as the tiles need them:
//                                                  transformed once (Q/K transforms), packed for GEBP,
//                                                  prefetched a block ahead
//   tile math       detail/attention_tile.hpp      S = scale Q K^T + hooks, mask, online softmax step,
//                                                  O += P V and value-term buckets; out = O / l
// and this file: validation (nothing is written before it passes), the per-call driver and merge.
//
// Nothing proportional to q_len x k_len is ever allocated: per thread O(units x q_block x d) query
// copies and O(q_block x k_block) scores, kept for the thread's next call; per call O(batch x len)
// positions (and, for key transforms when a kv head's queries span several work items, the
// transformed keys, O(L d) per kv head).
//
// Threads: options.pool (an Eigen::ThreadPoolInterface, detail/thread.hpp) runs the work items;
// each item is computed by one thread with a fixed key-block order, and how units are grouped into
// items never changes a unit's arithmetic, so the result is bitwise identical for any thread count.
// An exception in any thread reaches the caller (for_each_item). The tile products are
// single-threaded: the kernel never calls Eigen::setNbThreads. (A program built with -fopenmp should
// call Eigen::setNbThreads(1) or define EIGEN_DONT_PARALLELIZE when it passes a pool, or Eigen would
// split every expression-path product over OpenMP threads on top of the pool's.)
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "posenc/detail/attention_decode.hpp"
#include "posenc/detail/attention_operands.hpp"
#include "posenc/detail/attention_schedule.hpp"
#include "posenc/detail/attention_tile.hpp"
#include "posenc/detail/mask.hpp"
#include "posenc/detail/prefetch.hpp"
#include "posenc/detail/thread.hpp"
#include "posenc/detail/tile_gemm.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/options.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

namespace detail {

template <class A, class B>
[[nodiscard]] bool memory_overlaps(const heads_view<A>& x, const heads_view<B>& y) {
  if (x.size() == 0 || y.size() == 0) return false;
  // the spans of memory the views reach: strided views that interleave (the q and k heads of one
  // fused buffer) count as overlapping, which only the inputs may do
  const auto* x0 = reinterpret_cast<const char*>(x.data());
  const auto* y0 = reinterpret_cast<const char*>(y.data());
  const auto* x1 = x0 + x.extent() * static_cast<index_t>(sizeof(*x.data()));
  const auto* y1 = y0 + y.extent() * static_cast<index_t>(sizeof(*y.data()));
  return std::less<const char*>{}(x0, y1) && std::less<const char*>{}(y0, x1);
}

/// One call of the kernel: scheduling (attention_schedule: items, units, the causal plan), operand
/// supply (operand_supply: queries, keys and values as the tiles need them) and tile math (tile_math:
/// one step per tile, then the unit's normalization), run over the work items.
template <class T, class KV, class Bound>
class fused_attention {
 public:
  using scratch = attention_scratch<T>;

  fused_attention(heads_view<const T> q, heads_view<const KV> k, heads_view<const KV> v, heads_view<T> out, T* lse,
                  const Bound& enc, const call_masks& masks, T scale, index_t q_block, index_t k_block,
                  index_t buckets, index_t threads, T softcap, std::vector<T> sinks)
      : out_(out), lse_(lse), heads_(q.heads()), q_len_(q.seq()),
        sched_(q.heads(), k.heads(), q_block, k_block, masks, threads, tile_gemm<T>::a_panel),
        operands_(q, k, v, enc, sched_, scale),
        math_(enc, sched_, scale, q.dim(), v.dim(), buckets, softcap, std::move(sinks)) {}

  void run(Eigen::ThreadPoolInterface* pool) {
    operands_.prepare(pool);
    for_each_item<scratch>(
        pool, sched_.items(), [&](scratch& sc) { sc.units.resize(static_cast<std::size_t>(sched_.units_per_item())); },
        [&](index_t item, scratch& sc) { run_item(sched_.item_at(item), sc); });
    require(!math_.bad_bucket(), "encoding", "value_buckets must return indices in [0, value_bucket_count())");
  }

 private:
  /// The item's units over the key blocks they see, in a fixed order: each block's K and V are
  /// packed once for all units, each unit's queries are prepared before its first tile.
  void run_item(const work_item& w, scratch& sc) {
    std::array<std::optional<const_matrix_map<T>>, default_units_per_item> queries;
    for (index_t i = 0; i < w.count; ++i) math_.start(unit(w, i), state(sc, i));
    sched_.plan(w, sc.plan);
    const std::vector<block_plan>& plan = sc.plan;
    for (std::size_t pi = 0; pi < plan.size(); ++pi) {
      const block_plan& p = plan[pi];
      const block_operands<T> ops = operands_.block(w.b, w.hk, p, sc);
      // While the units compute on this block, the next block's rows (or, after the last block, the
      // output rows) and the next unit's queries are fetched in slices, one per unit.
      const block_plan* next = pi + 1 < plan.size() ? &plan[pi + 1] : nullptr;
      index_t visible = 0;
      for (index_t i = 0; i < w.count; ++i) visible += p.cols[static_cast<std::size_t>(i)] > 0 ? 1 : 0;
      index_t slice = 0;
      for (index_t i = 0; i < w.count; ++i) {
        const index_t cols = p.cols[static_cast<std::size_t>(i)];
        if (cols == 0) continue;
        const query_unit& u = unit(w, i);
        if (next != nullptr) {
          const index_t n = next->kcols;
          operands_.prefetch_block(w.b, w.hk, *next, n * slice / visible, n * (slice + 1) / visible);
        } else {
          prefetch_rows(out_.matrix(w.b, u.head, u.q0, u.rows), true);
        }
        ++slice;
        auto& q = queries[static_cast<std::size_t>(i)];
        if (!q) {
          q.emplace(operands_.queries(w.b, u, sc, state(sc, i)));
          if (i + 1 < w.count && !queries[static_cast<std::size_t>(i + 1)]) operands_.prefetch_queries(w.b, unit(w, i + 1));
        }
        math_.step(tile_inputs<T>{.b = w.b, .hk = w.hk, .u = u, .q = *q, .blk = sched_.block(w.b, p.kb), .cols = cols,
                                  .kcols = p.kcols, .ops = ops},
                   state(sc, i), sc);
      }
    }
    for (index_t i = 0; i < w.count; ++i) {
      const query_unit& u = unit(w, i);
      math_.finish(u, state(sc, i), out_.matrix(w.b, u.head, u.q0, u.rows),
                   lse_ != nullptr ? lse_ + (w.b * heads_ + u.head) * q_len_ + u.q0 : nullptr);
    }
  }

  static const query_unit& unit(const work_item& w, index_t i) { return w.units[static_cast<std::size_t>(i)]; }
  static typename scratch::unit_state& state(scratch& sc, index_t i) { return sc.units[static_cast<std::size_t>(i)]; }

  heads_view<T> out_;
  T* lse_;
  index_t heads_, q_len_;
  attention_schedule sched_;
  operand_supply<T, KV, Bound> operands_;
  tile_math<T, Bound> math_;
};

/// The strategy of a call (ggml's flash attention likewise picks one flat function per shape): decode
/// (K/V streamed, split-KV) for at most decode_max_rows query rows per kv head or at most
/// decode_max_queries_any_group queries per head, tiled otherwise. Depends on the shape and the
/// encoding only, never on the thread count.
template <class Bound, class T>
[[nodiscard]] bool choose_decode(attention_path path, index_t group, index_t q_len) {
  switch (path) {
    case attention_path::tiled:
      return false;
    case attention_path::decode:
      require(decode_supports<Bound, T>, "path",
              "decode cannot run an encoding with value terms (use attention_path::tiled or automatic)");
      return true;
    case attention_path::automatic:
      break;
  }
  return decode_supports<Bound, T> && (group * q_len <= decode_max_rows || q_len <= decode_max_queries_any_group);
}

/// Everything the public overloads share: validation first (nothing written on error), then the
/// kernel.
template <class T, class KV, class E>
void attention_impl(heads_view<const T> q, heads_view<const KV> k, heads_view<const KV> v, heads_view<T> out,
                    std::optional<tensor_map<T, 3>> lse, const E& enc, const attention_options& opt) {
  static_assert(has_attention_hook<E, T>, "posenc::attention: the encoding has no hook for this scalar type");
  check_attention_shapes<T, KV>(q, k, v, out);
  const index_t B = q.batch(), H = q.heads(), Hkv = k.heads(), Sq = q.seq(), Sk = k.seq(), D = q.dim(), Dv = v.dim();
  // A zero-length dot product has no meaning for an encoding, and GEBP divides by the depth.
  require(D > 0, "q", "head_dim must be > 0", D);
  if (lse)
    require(lse->dimension(0) == B && lse->dimension(1) == H && lse->dimension(2) == Sq, "lse",
            "must be [batch, heads, q_len]", "[", lse->dimension(0), ", ", lse->dimension(1), ", ",
            lse->dimension(2), "] for [", B, ", ", H, ", ", Sq, "]");
  require(opt.q_block >= 0, "q_block", "must be >= 0 (0 = default)", opt.q_block);
  require(opt.k_block >= 0, "k_block", "must be >= 0 (0 = default)", opt.k_block);
  const double scale = opt.scale ? *opt.scale : default_logit_scale(enc, D);
  require(std::isfinite(scale), "scale", "must be finite", scale);
  require(!memory_overlaps(out, q), "out", "must not overlap q");
  require(!memory_overlaps(out, k), "out", "must not overlap k");
  require(!memory_overlaps(out, v), "out", "must not overlap v");
  if (lse && lse->size() > 0) {
    const heads_view<const T> lv(lse->data(), 1, 1, 1, lse->size(), layout::bshd);
    require(!memory_overlaps(out, lv) && !memory_overlaps(lv, q) && !memory_overlaps(lv, k) &&
                !memory_overlaps(lv, v),
            "lse", "must not overlap q, k, v or out");
  }
  check_logit_options(opt, H);
  // Keys no query can see by index or padding are left out of the call: before every query's window
  // (leading_keys_unseen), after every query or past every row's padding (keys_seen_end). Both paths
  // then see only the caller's keys masks.k_first .. masks.k_first + masks.k_len - 1.
  thread_scratch<call_masks> held_masks;  // positions and validity, 9 bytes a key, kept between calls
  resolve_masks_into(held_masks.get(), opt, B, Sq, Sk, true);
  const call_masks& masks = held_masks.get();
  if (masks.k_first > 0 || masks.k_len < Sk) {
    k = k.slice_tokens(masks.k_first, masks.k_len);
    v = v.slice_tokens(masks.k_first, masks.k_len);
  }
  call_info info = masks.info(H, Hkv, D, Dv);
  info.scalar = std::is_same_v<T, double> ? scalar_type::float64 : scalar_type::float32;
  auto&& bound = bind_encoding(enc, info);
  using bound_type = std::remove_cvref_t<decltype(bound)>;

  index_t buckets = 0;
  if constexpr (has_value_terms<bound_type, T>) {
    buckets = static_cast<index_t>(bound.value_bucket_count());
    require(buckets >= 0, "encoding", "value_bucket_count must be >= 0", buckets);
    for (index_t h = 0; h < H; ++h) {
      const const_matrix_map<T> table = bound.template value_table<T>(h);
      require(table.rows() == buckets && table.cols() == Dv, "encoding",
              "value_table(head) must be [value_bucket_count, value_dim]", "[", table.rows(), ", ", table.cols(),
              "] for [", buckets, ", ", Dv, "] at head ", h);
    }
  }
  const bool decode = choose_decode<bound_type, T>(opt.path, H / std::max<index_t>(Hkv, 1), Sq);
  if (B * H * Sq == 0) return;

  if (decode) {
    decode_attention<T, KV, bound_type> kernel(q, k, v, out, lse ? lse->data() : nullptr, bound, masks,
                                               static_cast<T>(scale), static_cast<T>(opt.logit_softcap),
                                               std::vector<T>(opt.sinks.begin(), opt.sinks.end()));
    kernel.run(opt.pool);
    return;
  }
  const index_t q_block = opt.q_block > 0 ? opt.q_block : default_q_block;
  const index_t k_block = opt.k_block > 0 ? opt.k_block : default_k_block;
  fused_attention<T, KV, bound_type> kernel(q, k, v, out, lse ? lse->data() : nullptr, bound, masks,
                                            static_cast<T>(scale), q_block, k_block, buckets,
                                            opt.pool != nullptr ? std::max<index_t>(opt.pool->NumThreads(), 1) : 1,
                                            static_cast<T>(opt.logit_softcap),
                                            std::vector<T>(opt.sinks.begin(), opt.sinks.end()));
  kernel.run(opt.pool);
}


}  // namespace detail

/// Multi-head attention with the encoding's hooks fused in the tile loop.
/// q [batch, q_len, heads, d], k [batch, k_len, kv_heads, d], v [batch, k_len, kv_heads, dv] and
/// out [batch, q_len, heads, dv], each in BSHD or BHSD (heads_view); kv_heads divides heads.
/// Throws posenc::error before writing anything when an argument is invalid.
template <class T, attention_encoding E = no_position>
void attention(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
               const E& enc = {}, const attention_options& opt = {}) {
  detail::attention_impl<T, T>(q, k, v, out, std::nullopt, enc, opt);
}

/// Same, with k and v stored in half precision (a KV cache in Eigen::half or Eigen::bfloat16): q, out
/// and every accumulation stay in T; K and V are widened (exactly) as the tiles read them.
template <class T, class KV, attention_encoding E = no_position>
  requires is_half_storage<KV>
void attention(heads_view<const T> q, heads_view<const KV> k, heads_view<const KV> v, heads_view<T> out,
               const E& enc = {}, const attention_options& opt = {}) {
  detail::attention_impl<T, KV>(q, k, v, out, std::nullopt, enc, opt);
}

/// Same, and writes lse [batch, heads, q_len]: the natural-log log-sum-exp of each row's scaled
/// scores over the visible keys (-inf for a row that sees nothing), including the head's sink when
/// options.sinks is set: log(sum_j exp(s_ij) + exp(sink_h)). With it, two calls over disjoint key
/// ranges combine exactly (merge) — without sinks: a sink must join the denominator once, so merged
/// partial calls pass no sinks (docs/masks.md).
template <class T, attention_encoding E = no_position>
void attention(heads_view<const T> q, heads_view<const T> k, heads_view<const T> v, heads_view<T> out,
               tensor_map<T, 3> lse, const E& enc = {}, const attention_options& opt = {}) {
  detail::attention_impl<T, T>(q, k, v, out, std::optional<tensor_map<T, 3>>(lse), enc, opt);
}

/// Same with lse, k and v in half precision.
template <class T, class KV, attention_encoding E = no_position>
  requires is_half_storage<KV>
void attention(heads_view<const T> q, heads_view<const KV> k, heads_view<const KV> v, heads_view<T> out,
               tensor_map<T, 3> lse, const E& enc = {}, const attention_options& opt = {}) {
  detail::attention_impl<T, KV>(q, k, v, out, std::optional<tensor_map<T, 3>>(lse), enc, opt);
}

/// Whether q, k or v of a call is a mutable view (the host's own buffer, posenc::bshd(float*, ...)).
template <class Q, class K, class V>
concept mutable_inputs = !std::is_const_v<Q> || !std::is_const_v<K> || !std::is_const_v<V>;

/// Any of the above with q, k or v given as mutable views: the same call with const views of them, so
/// that a host's own buffers need no `bshd<const float>`.
template <class Q, class K, class V, class T, attention_encoding E = no_position>
  requires mutable_inputs<Q, K, V>
void attention(heads_view<Q> q, heads_view<K> k, heads_view<V> v, heads_view<T> out, const E& enc = {},
               const attention_options& opt = {}) {
  attention(heads_view<const Q>(q), heads_view<const K>(k), heads_view<const V>(v), out, enc, opt);
}

/// Same, with lse.
template <class Q, class K, class V, class T, attention_encoding E = no_position>
  requires mutable_inputs<Q, K, V>
void attention(heads_view<Q> q, heads_view<K> k, heads_view<V> v, heads_view<T> out, tensor_map<T, 3> lse,
               const E& enc = {}, const attention_options& opt = {}) {
  attention(heads_view<const Q>(q), heads_view<const K>(k), heads_view<const V>(v), out, lse, enc, opt);
}

/// Exact combination of two partial attentions over disjoint key ranges (split-KV decoding, ring /
/// sequence-parallel attention; FlashAttention-2 section 3.1.1 / Flash-Decoding): with
/// m = max(lse_a, lse_b), w_x = exp(lse_x - m),
///   out = (w_a out_a + w_b out_b) / (w_a + w_b),  lse = m + log(w_a + w_b).
/// A row that neither part sees stays zero with lse -inf. out may be out_a or out_b (the same view:
/// same buffer and strides), and must not overlap them otherwise.
template <class T>
void merge(heads_view<const T> out_a, tensor_map<const T, 3> lse_a, heads_view<const T> out_b,
           tensor_map<const T, 3> lse_b, heads_view<T> out, tensor_map<T, 3> lse) {
  const index_t B = out.batch(), S = out.seq(), H = out.heads(), D = out.dim();
  auto same_shape = [&](const heads_view<const T>& x, const char* name) {
    require(x.batch() == B && x.seq() == S && x.heads() == H && x.dim() == D, name,
            "must have out's shape [batch, seq, heads, dim]", "[", x.batch(), ", ", x.seq(), ", ", x.heads(), ", ",
            x.dim(), "] vs [", B, ", ", S, ", ", H, ", ", D, "]");
  };
  same_shape(out_a, "out_a");
  same_shape(out_b, "out_b");
  auto lse_shape = [&](const auto& x, const char* name) {
    require(x.dimension(0) == B && x.dimension(1) == H && x.dimension(2) == S, name,
            "must be [batch, heads, seq]", "[", x.dimension(0), ", ", x.dimension(1), ", ", x.dimension(2),
            "] for [", B, ", ", H, ", ", S, "]");
  };
  lse_shape(lse_a, "lse_a");
  lse_shape(lse_b, "lse_b");
  lse_shape(lse, "lse");
  // each row is read before it is written, so out may be a part itself, but not another view of its memory
  const auto is_view_of = [&](const heads_view<const T>& x) {
    return x.data() == out.data() && x.strides() == out.strides();
  };
  require(is_view_of(out_a) || !detail::memory_overlaps(out, out_a), "out",
          "must be out_a itself (same buffer and strides) or not overlap it");
  require(is_view_of(out_b) || !detail::memory_overlaps(out, out_b), "out",
          "must be out_b itself (same buffer and strides) or not overlap it");
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h)
      for (index_t s = 0; s < S; ++s) {
        const T la = lse_a(b, h, s), lb = lse_b(b, h, s);
        const T* a = out_a.row(b, s, h);
        const T* c = out_b.row(b, s, h);
        T* o = out.row(b, s, h);
        if (std::isnan(la) || std::isnan(lb)) {  // a poisoned part (NaN or +inf score) poisons the row
          for (index_t d = 0; d < D; ++d) o[d] = std::numeric_limits<T>::quiet_NaN();
          lse(b, h, s) = std::numeric_limits<T>::quiet_NaN();
          continue;
        }
        const T m = std::max(la, lb);
        if (m == neg_inf) {  // neither part sees a key
          for (index_t d = 0; d < D; ++d) o[d] = T(0);
          lse(b, h, s) = neg_inf;
          continue;
        }
        const T wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
        for (index_t d = 0; d < D; ++d) o[d] = (wa * a[d] + wb * c[d]) / sum;
        lse(b, h, s) = m + std::log(sum);
      }
}

}  // namespace posenc
