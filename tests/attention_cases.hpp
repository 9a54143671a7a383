// Set-up shared by the kernel's tests (test_attention.cpp: the tiled path, every hook kind, threads,
// errors, numerics; test_attention_decode.cpp: the decode strategy, K/V in half precision, strided
// cache views): problems in double with every mask and position option, the kernel and the double
// reference attention run on them, one test encoding per hook kind with its reference written per
// element, and the covering sets of configurations. Two translation units because the kernel's
// instantiations made one take the longest compile of the build (about 6 minutes under ASan).
#pragma once

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <posenc/attention.hpp>
#include <posenc/detail/relative.hpp>
#include <posenc/reference.hpp>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using Index = posenc::index_t;  // not `index`: POSIX declares ::index()
using posenc::layout;

namespace attention_cases {

// ---- problem set-up ---------------------------------------------------------------------------

enum class padding { none, mask, lengths };
enum class offset { none, q_offset, explicit_positions, shuffled_keys };

struct config {
  Index B = 2, Sq = 7, Sk = 7, H = 2, Hkv = 2, D = 8, Dv = 8;
  layout order = layout::bshd;
  bool causal = false;
  padding pad = padding::none;
  offset off = offset::none;
  Index window = 0;  ///< sliding window (causal only), 0 = none
  Index q_block = 0, k_block = 0;
  unsigned seed = 1;
  double scale_inputs = 1.0;
  posenc::attention_path path = posenc::attention_path::automatic;
  /// Slots of a preallocated cache after every query (q_offset only): the last `unfilled` keys of every
  /// row hold NaN, and the queries end before them. No query sees them, so nothing of them may reach
  /// the output.
  Index unfilled = 0;
};

inline std::string describe(const config& c) {
  return "B=" + std::to_string(c.B) + " Sq=" + std::to_string(c.Sq) + " Sk=" + std::to_string(c.Sk) +
         " H=" + std::to_string(c.H) + "/" + std::to_string(c.Hkv) + " D=" + std::to_string(c.D) +
         " Dv=" + std::to_string(c.Dv) + (c.order == layout::bshd ? " bshd" : " bhsd") +
         (c.causal ? " causal" : "") + " pad=" + std::to_string(static_cast<int>(c.pad)) +
         " off=" + std::to_string(static_cast<int>(c.off)) + " W=" + std::to_string(c.window) +
         " blocks=" + std::to_string(c.q_block) + "x" + std::to_string(c.k_block) +
         (c.unfilled > 0 ? " unfilled=" + std::to_string(c.unfilled) : "") +
         (c.path == posenc::attention_path::decode ? " decode" : c.path == posenc::attention_path::tiled ? " tiled" : "");
}

template <class T>
posenc::heads_view<T> view(T* data, Index B, Index S, Index H, Index D, layout order) {
  return order == layout::bshd ? posenc::bshd<T>(data, B, S, H, D) : posenc::bhsd<T>(data, B, H, S, D);
}

// Inputs in double plus the masks/positions the options point into (kept alive here).
struct problem {
  config c;
  std::vector<double> q, k, v;
  std::vector<std::int64_t> pad_mask, kv_len, q_pos, k_pos;

  explicit problem(const config& cfg) : c(cfg) {
    std::mt19937 rng(c.seed);
    std::normal_distribution<double> n(0.0, 1.0);
    q.resize(static_cast<std::size_t>(c.B * c.Sq * c.H * c.D));
    k.resize(static_cast<std::size_t>(c.B * c.Sk * c.Hkv * c.D));
    v.resize(static_cast<std::size_t>(c.B * c.Sk * c.Hkv * c.Dv));
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = c.scale_inputs * n(rng);
    std::uniform_int_distribution<int> coin(0, 3);
    for (const auto& [x, dim] : {std::pair{&k, c.D}, std::pair{&v, c.Dv}}) {
      const auto kv = view<double>(x->data(), c.B, c.Sk, c.Hkv, dim, c.order);
      for (Index b = 0; b < c.B; ++b)
        for (Index j = c.Sk - c.unfilled; j < c.Sk; ++j)
          for (Index h = 0; h < c.Hkv; ++h) std::fill_n(kv.row(b, j, h), dim, std::numeric_limits<double>::quiet_NaN());
    }
    if (c.pad == padding::mask) {
      pad_mask.assign(static_cast<std::size_t>(c.B * c.Sk), 0);
      for (auto& p : pad_mask) p = coin(rng) == 0 ? 1 : 0;  // ~25 % padding keys
      // a batch row whose keys are all padding when there is more than one row
      if (c.B > 1) std::fill(pad_mask.begin() + (c.B - 1) * c.Sk, pad_mask.end(), 1);
    }
    if (c.pad == padding::lengths) {
      kv_len.resize(static_cast<std::size_t>(c.B));
      for (Index b = 0; b < c.B; ++b) kv_len[b] = b == 0 ? c.Sk : (b == 1 ? (c.Sk + 1) / 2 : 0);
    }
    if (c.off == offset::explicit_positions || c.off == offset::shuffled_keys) {
      q_pos.resize(static_cast<std::size_t>(c.B * c.Sq));
      k_pos.resize(static_cast<std::size_t>(c.B * c.Sk));
      for (Index b = 0; b < c.B; ++b) {
        // left padding style: keys start at -b (positions may be negative), queries at the end
        for (Index j = 0; j < c.Sk; ++j) k_pos[b * c.Sk + j] = j - b;
        for (Index i = 0; i < c.Sq; ++i) q_pos[b * c.Sq + i] = std::max<Index>(c.Sk - c.Sq, 0) + i - b;
        if (c.off == offset::shuffled_keys) {
          std::shuffle(k_pos.begin() + b * c.Sk, k_pos.begin() + (b + 1) * c.Sk, rng);
          std::shuffle(q_pos.begin() + b * c.Sq, q_pos.begin() + (b + 1) * c.Sq, rng);
        }
      }
    }
  }

  [[nodiscard]] posenc::attention_options options() const {
    posenc::attention_options o;
    o.causal = c.causal;
    o.sliding_window = c.window;
    o.q_block = c.q_block;
    o.k_block = c.k_block;
    if (c.off == offset::q_offset) o.q_offset = std::max<Index>(c.Sk - c.unfilled - c.Sq, 0);  // KV cache
    if (!q_pos.empty()) {
      o.q_positions = posenc::positions_view(q_pos.data(), c.B, c.Sq);
      o.k_positions = posenc::positions_view(k_pos.data(), c.B, c.Sk);
    }
    if (!pad_mask.empty()) o.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad_mask.data(), c.B, c.Sk);
    if (!kv_len.empty()) o.kv_lengths = kv_len;
    o.path = c.path;
    return o;
  }
};

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

struct result {
  std::vector<double> out, lse;
};

// Kernel in T on the problem's inputs rounded to T.
template <class T, class E>
result run_kernel(const problem& p, const E& enc, Eigen::ThreadPoolInterface* pool = nullptr) {
  const config& c = p.c;
  const auto q = cast<T>(p.q), k = cast<T>(p.k), v = cast<T>(p.v);
  std::vector<T> out(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv), T(123));
  std::vector<T> lse(static_cast<std::size_t>(c.B * c.H * c.Sq), T(123));
  auto opt = p.options();
  opt.pool = pool;
  posenc::attention<T>(view<const T>(q.data(), c.B, c.Sq, c.H, c.D, c.order),
                       view<const T>(k.data(), c.B, c.Sk, c.Hkv, c.D, c.order),
                       view<const T>(v.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order),
                       view<T>(out.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                       posenc::tensor_map<T, 3>(lse.data(), c.B, c.H, c.Sq), enc, opt);
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

// The kernel in T on 1, 2 and 8 threads: output and lse bitwise the same (the work is cut at fixed
// points and merged in a fixed order, whatever the pool). Returns the 8-thread result.
template <class T, class E>
result expect_same_for_pools(const problem& p, const E& enc, Eigen::ThreadPoolInterface& two,
                             Eigen::ThreadPoolInterface& eight) {
  INFO((std::is_same_v<T, float> ? "float" : "double"));
  const result one = run_kernel<T>(p, enc), r2 = run_kernel<T>(p, enc, &two), r8 = run_kernel<T>(p, enc, &eight);
  CHECK(one.out == r2.out);
  CHECK(one.out == r8.out);
  CHECK(one.lse == r2.lse);
  CHECK(one.lse == r8.lse);
  return r8;
}

// Reference in double on the same inputs rounded to T (so only the kernel's arithmetic differs).
// `qk` optionally rewrites the (rounded) q and k first (the materialized Q/K transform).
template <class T, class QK = std::nullptr_t>
result run_reference(const problem& p, const posenc::reference_terms<double>& terms, QK qk = nullptr,
                     std::vector<double>* probs = nullptr) {
  const config& c = p.c;
  auto round = [](const std::vector<double>& x) {
    std::vector<double> r(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(static_cast<T>(x[i]));
    return r;
  };
  auto q = round(p.q), k = round(p.k), v = round(p.v);
  const auto vq = view<double>(q.data(), c.B, c.Sq, c.H, c.D, c.order);
  const auto vk = view<double>(k.data(), c.B, c.Sk, c.Hkv, c.D, c.order);
  if constexpr (!std::is_same_v<QK, std::nullptr_t>) qk(vq, vk);
  result r;
  r.out.assign(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv), 0.0);
  r.lse.assign(static_cast<std::size_t>(c.B * c.H * c.Sq), 0.0);
  std::optional<posenc::tensor_map<double, 4>> pr;
  if (probs != nullptr) {
    probs->assign(static_cast<std::size_t>(c.B * c.H * c.Sq * c.Sk), 0.0);
    pr = posenc::tensor_map<double, 4>(probs->data(), c.B, c.H, c.Sq, c.Sk);
  }
  posenc::reference_attention<double>(vq, vk, view<const double>(v.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order),
                                      view<double>(r.out.data(), c.B, c.Sq, c.H, c.Dv, c.order), p.options(),
                                      terms, pr, posenc::tensor_map<double, 3>(r.lse.data(), c.B, c.H, c.Sq));
  return r;
}

// Float: tolerance scaled to the magnitude of the values; double: ~1e-12 relative.
template <class T>
void expect_close(const std::vector<double>& got, const std::vector<double>& want, const std::string& what,
                  double float_tol = 2e-5, double double_tol = 1e-12) {
  REQUIRE(got.size() == want.size());
  double mag = 1.0;
  for (double w : want)
    if (std::isfinite(w)) mag = std::max(mag, std::abs(w));
  const double tol = (std::is_same_v<T, float> ? float_tol : double_tol) * mag;
  double worst = 0;
  std::size_t at = 0, mismatched_special = got.size();
  for (std::size_t i = 0; i < got.size(); ++i) {
    // -inf (an lse of a row that sees nothing) must match exactly; NaN is never acceptable
    const bool special_ok = std::isinf(want[i]) ? got[i] == want[i] : std::isfinite(got[i]);
    if (!special_ok && mismatched_special == got.size()) mismatched_special = i;
    if (!std::isfinite(want[i]) || !std::isfinite(got[i])) continue;
    const double e = std::abs(got[i] - want[i]);
    if (e > worst) worst = e, at = i;
  }
  {
    INFO(what << ": first non-finite or mismatched infinity at " << mismatched_special);
    CHECK(mismatched_special == got.size());
  }
  INFO(what << ": worst |error| " << worst << " at " << at << " (tolerance " << tol << ")");
  CHECK(worst <= tol);
}

template <class T, class E, class QK = std::nullptr_t>
void check_case(const config& c, const E& enc = {}, const posenc::reference_terms<double>& terms = {}, QK qk = nullptr) {
  INFO(describe(c) << (std::is_same_v<T, float> ? " float" : " double"));
  const problem p(c);
  const result got = run_kernel<T>(p, enc);
  const result want = run_reference<T>(p, terms, qk);
  expect_close<T>(got.out, want.out, "out");
  expect_close<T>(got.lse, want.lse, "lse");
}

// check_case in double and in float.
template <class E, class QK = std::nullptr_t>
void check_both(const config& c, const E& enc = {}, const posenc::reference_terms<double>& terms = {},
                QK qk = nullptr) {
  check_case<double>(c, enc, terms, qk);
  check_case<float>(c, enc, terms, qk);
}

// The resolved positions of a problem (the test encodings' reference callables read them).
inline posenc::detail::call_masks masks_of(const problem& p) {
  return posenc::detail::resolve_masks(p.options(), p.c.B, p.c.Sq, p.c.Sk);
}

// ---- test encodings: one per hook kind ----------------------------------------------------------

// Q/K transform: rotate feature pairs (2t, 2t+1) by pos * theta_t * (1 + head/4), a RoPE-like
// per-position rotation whose angle also depends on the head index the kernel passes (the kv head
// for keys), and that counts how many tokens it transformed.
inline double rotation_angle(std::int64_t pos, Index pair, Index head) {
  return static_cast<double>(pos) * std::pow(100.0, -static_cast<double>(pair) / 4.0) * (1.0 + 0.25 * head);
}
struct rotate_qk {
  std::shared_ptr<std::atomic<long>> queries = std::make_shared<std::atomic<long>>(0);
  std::shared_ptr<std::atomic<long>> keys = std::make_shared<std::atomic<long>>(0);
  template <class T>
  void transform_qk(posenc::qk_role role, Index head, std::span<const std::int64_t> pos,
                    posenc::matrix_map<T> x) const {
    // (no Catch assertion here: hooks run on pool threads, and Catch is not thread-safe)
    *(role == posenc::qk_role::query ? queries : keys) +=
        static_cast<long>(pos.size() == static_cast<std::size_t>(x.rows()) ? x.rows() : -1000000);
    for (Index r = 0; r < x.rows(); ++r)
      for (Index t = 0; t + 1 < x.cols(); t += 2) {
        const double a = rotation_angle(pos[r], t / 2, head);
        const T c = static_cast<T>(std::cos(a)), s = static_cast<T>(std::sin(a));
        const T x0 = x(r, t), x1 = x(r, t + 1);
        x(r, t) = c * x0 - s * x1;
        x(r, t + 1) = s * x0 + c * x1;
      }
  }
};
// The same rotation materialized over whole tensors for the reference.
inline auto rotate_reference(const problem& p, bool keys = true) {
  return [&p, keys](posenc::heads_view<double> q, posenc::heads_view<double> k) {
    const auto m = masks_of(p);
    auto rot = [](posenc::heads_view<double> x, const posenc::detail::call_masks& m, bool is_q, Index heads) {
      for (Index b = 0; b < x.batch(); ++b)
        for (Index s = 0; s < x.seq(); ++s)
          for (Index h = 0; h < heads; ++h) {
            const std::int64_t pos = is_q ? m.qp(b)[s] : m.kp(b)[s];
            for (Index t = 0; t + 1 < x.dim(); t += 2) {
              const double a = rotation_angle(pos, t / 2, h);
              const double x0 = x(b, s, h, t), x1 = x(b, s, h, t + 1);
              x(b, s, h, t) = std::cos(a) * x0 - std::sin(a) * x1;
              x(b, s, h, t + 1) = std::sin(a) * x0 + std::cos(a) * x1;
            }
          }
    };
    rot(q, m, true, q.heads());
    if (keys) rot(k, m, false, k.heads());
  };
}

// Position-only bias after the scale: -0.1 (h + 1) |i - j| by positions (ALiBi-like, symmetric).
// It also records whether the kernel ever handed it a tile that nothing in it can see (such
// tiles must be skipped).
struct distance_bias {
  const std::vector<unsigned char>* k_valid = nullptr;  // optional [batch * k_len] validity
  Index k_len = 0;
  bool causal = false;
  std::shared_ptr<std::atomic<bool>> saw_dead_tile = std::make_shared<std::atomic<bool>>(false);
  template <class T>
  void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T> s) const {
    bool any = false;
    for (Index i = 0; i < t.rows; ++i)
      for (Index j = 0; j < t.cols; ++j) {
        s(i, j) += static_cast<T>(-0.1 * static_cast<double>(t.head + 1) *
                                  static_cast<double>(std::abs(t.q_pos[i] - t.k_pos[j])));
        const bool valid = k_valid == nullptr || (*k_valid)[t.batch * k_len + t.k_first + j] != 0;
        any = any || (valid && (!causal || t.k_pos[j] <= t.q_pos[i]));
      }
    if (!any) *saw_dead_tile = true;
  }
};
inline posenc::reference_terms<double> distance_bias_terms(const problem& p) {
  auto m = std::make_shared<posenc::detail::call_masks>(masks_of(p));
  posenc::reference_terms<double> r;
  r.bias = [m](Index b, Index h, Index i, Index j) {
    return -0.1 * static_cast<double>(h + 1) * static_cast<double>(std::abs(m->qp(b)[i] - m->kp(b)[j]));
  };
  return r;
}

// Relative score terms inside the scale with clipped relative tables (Shaw-style query side and
// DeBERTa-p2c-style key side): term = q_i . Rq[clip(j-i)+K] + k_j . Rk[clip(i-j)+K], computed per
// tile through detail/relative.hpp (products with just the needed table rows, then a gather).
struct relative_terms {
  Index K = 3;
  std::vector<double> rq, rk;  // [2K+1, d]
  std::vector<float> rq32, rk32;
  relative_terms(Index max_distance, Index d, unsigned seed) : K(max_distance) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> n(0.0, 0.5);
    rq.resize(static_cast<std::size_t>((2 * K + 1) * d));
    rk.resize(rq.size());
    for (auto& e : rq) e = n(rng);
    for (auto& e : rk) e = n(rng);
    rq32.assign(rq.begin(), rq.end());
    rk32.assign(rk.begin(), rk.end());
  }
  template <class T>
  [[nodiscard]] posenc::const_matrix_map<T> table(bool query_side, Index d) const {
    const T* data;
    if constexpr (std::is_same_v<T, float>) data = query_side ? rq32.data() : rk32.data();
    else data = query_side ? rq.data() : rk.data();
    return posenc::const_matrix_map<T>(data, 2 * K + 1, d, Eigen::OuterStride<>(d));
  }
  template <class T>
  void add_score_terms(const posenc::tile<T>& t, T scale, posenc::matrix_map<T> s) const {
    namespace pd = posenc::detail;
    const Index d = t.q.cols();
    Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> prod;
    // query side: buckets clip(k - q) + K
    const pd::bucket_range rq_range = pd::clipped_relative_range(t.q_pos, t.rows, t.k_pos, t.cols, K);
    pd::relative_products<T>(t.q, table<T>(true, d), rq_range, prod);
    pd::gather_add_by_row<T>(prod, rq_range, [&](Index i, Index j) {
      return pd::clipped_relative_bucket(t.q_pos[i], t.k_pos[j], K);
    }, scale, s);
    // key side: buckets clip(q - k) + K (positions swapped)
    const pd::bucket_range rk_range = pd::clipped_relative_range(t.k_pos, t.cols, t.q_pos, t.rows, K);
    pd::relative_products<T>(t.k, table<T>(false, d), rk_range, prod);
    pd::gather_add_by_col<T>(prod, rk_range, [&](Index i, Index j) {
      return pd::clipped_relative_bucket(t.k_pos[j], t.q_pos[i], K);
    }, scale, s);
  }
};
inline posenc::reference_terms<double> relative_reference(const problem& p, const relative_terms& e) {
  auto m = std::make_shared<posenc::detail::call_masks>(masks_of(p));
  // the reference sees the inputs rounded to the kernel's type; relative terms use the same rounding
  // through the float tables, so a double table is exact for double and rq32 widened for float.
  const config c = p.c;
  auto q = std::make_shared<std::vector<double>>(p.q);
  auto k = std::make_shared<std::vector<double>>(p.k);
  posenc::reference_terms<double> r;
  r.score_term = [m, q, k, c, &e](Index b, Index h, Index i, Index j) {
    const auto vq = view<const double>(q->data(), c.B, c.Sq, c.H, c.D, c.order);
    const auto vk = view<const double>(k->data(), c.B, c.Sk, c.Hkv, c.D, c.order);
    const Index hk = h / (c.H / c.Hkv);
    const std::int64_t pi = m->qp(b)[i], pj = m->kp(b)[j];
    const Index bq = std::clamp<std::int64_t>(pj - pi, -e.K, e.K) + e.K;
    const Index bk = std::clamp<std::int64_t>(pi - pj, -e.K, e.K) + e.K;
    double sum = 0;
    for (Index d = 0; d < c.D; ++d)
      sum += vq(b, i, h, d) * e.rq[bq * c.D + d] + vk(b, j, hk, d) * e.rk[bk * c.D + d];
    return sum;
  };
  return r;
}

// Value term per relative bucket (Shaw's a^V_ij): out_i += sum_j p_ij W_h[clip(j - i) + K], with a
// per-head table W_h [2K+1, dv].
struct relative_values {
  Index K = 2, heads = 1, dv = 1;
  std::vector<double> w;  // [heads, 2K+1, dv]
  std::vector<float> w32;
  relative_values(Index max_distance, Index h, Index value_dim, unsigned seed) : K(max_distance), heads(h), dv(value_dim) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> n(0.0, 1.0);
    w.resize(static_cast<std::size_t>(heads * (2 * K + 1) * dv));
    for (auto& e : w) e = n(rng);
    w32.assign(w.begin(), w.end());
  }
  [[nodiscard]] Index value_bucket_count() const { return 2 * K + 1; }
  template <class T>
  void value_buckets(const posenc::tile<T>& t, posenc::index_tile idx) const {
    for (Index i = 0; i < t.rows; ++i)
      for (Index j = 0; j < t.cols; ++j)
        idx(i, j) = static_cast<std::int32_t>(posenc::detail::clipped_relative_bucket(t.q_pos[i], t.k_pos[j], K));
  }
  template <class T>
  [[nodiscard]] posenc::const_matrix_map<T> value_table(Index head) const {
    const T* base;
    if constexpr (std::is_same_v<T, float>) base = w32.data();
    else base = w.data();
    return posenc::const_matrix_map<T>(base + head * (2 * K + 1) * dv, 2 * K + 1, dv, Eigen::OuterStride<>(dv));
  }
};
inline posenc::reference_terms<double> value_reference(const problem& p, const relative_values& e) {
  auto m = std::make_shared<posenc::detail::call_masks>(masks_of(p));
  posenc::reference_terms<double> r;
  r.value_term = [m, &e](Index b, Index h, Index i, Index j, double* add) {
    const Index bucket = std::clamp<std::int64_t>(m->kp(b)[j] - m->qp(b)[i], -e.K, e.K) + e.K;
    for (Index d = 0; d < e.dv; ++d) add[d] = e.w[(h * (2 * e.K + 1) + bucket) * e.dv + d];
  };
  return r;
}

// A test encoding with every hook but the value terms (those need the tiled path).
struct hooks_without_values {
  rotate_qk rot;
  distance_bias bias;
  relative_terms rel;
  static double logit_scale(Index d) { return 0.5 / std::sqrt(static_cast<double>(d)); }
  template <class T>
  void transform_qk(posenc::qk_role r, Index h, std::span<const std::int64_t> pos, posenc::matrix_map<T> x) const {
    rot.transform_qk<T>(r, h, pos, x);
  }
  template <class T>
  void add_score_terms(const posenc::tile<T>& t, T scale, posenc::matrix_map<T> s) const {
    rel.add_score_terms<T>(t, scale, s);
  }
  template <class T>
  void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T> s) const {
    bias.add_position_bias<T>(t, s);
  }
};

// Every hook at once (and a logit scale of its own).
struct all_hooks : hooks_without_values {
  relative_values val;
  [[nodiscard]] Index value_bucket_count() const { return val.value_bucket_count(); }
  template <class T>
  void value_buckets(const posenc::tile<T>& t, posenc::index_tile idx) const {
    val.value_buckets<T>(t, idx);
  }
  template <class T>
  [[nodiscard]] posenc::const_matrix_map<T> value_table(Index head) const {
    return val.value_table<T>(head);
  }
};

// ---- the covering set of configurations ---------------------------------------------------------

// Small sizes: the full product of layout x causal x padding x offset, GQA shapes cycling.
inline std::vector<config> small_configs() {
  std::vector<config> out;
  const Index sizes[][2] = {{1, 1}, {2, 7}, {7, 2}, {37, 65}, {64, 64}, {65, 37}};
  const Index heads[][2] = {{2, 2}, {4, 2}, {3, 1}};
  unsigned seed = 1;
  for (const auto& sz : sizes)
    for (layout order : {layout::bshd, layout::bhsd})
      for (bool causal : {false, true})
        for (padding pad : {padding::none, padding::mask, padding::lengths})
          for (offset off : {offset::none, offset::q_offset, offset::explicit_positions, offset::shuffled_keys}) {
            // GQA shape cycles with the other options (every pairing of it with each option
            // value occurs; the full product would only repeat them at 3x the run time)
            const auto& hh = heads[(seed + seed / 6) % 3];
            config c;
            c.Sq = sz[0];
            c.Sk = sz[1];
            c.H = hh[0];
            c.Hkv = hh[1];
            c.D = 8;
            c.Dv = 6;
            c.order = order;
            c.causal = causal;
            c.pad = pad;
            c.off = off;
            c.B = pad == padding::lengths ? 3 : 2;
            // small tiles so these sizes cross several tile boundaries (partial tiles)
            c.q_block = (seed % 3 == 0) ? 0 : 16;
            c.k_block = (seed % 3 == 0) ? 0 : (seed % 2 == 0 ? 24 : 32);
            c.seed = seed++;
            out.push_back(c);
          }
  return out;
}

// Large sizes: a covering subset (every option value appears), cheap enough for ASan at -O1.
inline std::vector<config> large_configs() {
  std::vector<config> out;
  auto add = [&](Index sq, Index sk, layout order, bool causal, padding pad, offset off, Index h, Index hkv) {
    config c;
    c.B = pad == padding::lengths ? 3 : (sq * sk > 100000 ? 1 : 2);
    c.Sq = sq;
    c.Sk = sk;
    c.H = h;
    c.Hkv = hkv;
    c.D = 16;
    c.Dv = 8;
    c.order = order;
    c.causal = causal;
    c.pad = pad;
    c.off = off;
    c.seed = static_cast<unsigned>(100 + out.size());
    out.push_back(c);
  };
  add(257, 257, layout::bshd, true, padding::none, offset::none, 2, 1);
  add(257, 1000, layout::bhsd, false, padding::mask, offset::none, 2, 2);
  add(1000, 257, layout::bshd, true, padding::lengths, offset::q_offset, 2, 1);
  add(1, 1000, layout::bshd, true, padding::none, offset::q_offset, 4, 2);  // one decode step
  add(65, 1000, layout::bhsd, true, padding::mask, offset::explicit_positions, 2, 1);
  add(1000, 1000, layout::bshd, true, padding::none, offset::none, 1, 1);
  add(1000, 257, layout::bhsd, false, padding::none, offset::shuffled_keys, 1, 1);
  add(37, 1000, layout::bshd, true, padding::lengths, offset::shuffled_keys, 2, 2);
  return out;
}

}  // namespace attention_cases
