// Shaw et al. (2018) relative position representations (posenc/shaw.hpp, posenc/io/shaw.hpp): the
// fused kernel against the double reference attention with a^K and a^V materialized per pair
// (reference_terms score_term / value_term, written here from the paper's formula), over causal,
// padded, KV-cache, GQA, packed-position, shared / per-head, keys / values / both, small-tile shapes;
// thread-count invariance; argument errors; the vendored golden case; loading by the OpenNMT /
// CTranslate2 tensor names.
#include <catch2/catch.hpp>
#include <unsupported/Eigen/CXX11/ThreadPool>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "golden.hpp"
#include "posenc/attention.hpp"
#include "posenc/io/shaw.hpp"
#include "posenc/reference.hpp"
#include "posenc/shaw.hpp"
#include "random.hpp"

using idx = posenc::index_t;
using posenc::shaw_terms;

static_assert(posenc::attention_encoding<posenc::shaw_relative<float>>);
static_assert(posenc::has_bind<posenc::shaw_relative<double>>);
static_assert(posenc::has_score_terms<posenc::shaw_relative<float>::bound, float>);
static_assert(posenc::has_score_terms<posenc::shaw_relative<float>::bound, double>);
static_assert(posenc::has_value_terms<posenc::shaw_relative<double>::bound, float>);
static_assert(posenc::has_value_terms<posenc::shaw_relative<double>::bound, double>);
static_assert(posenc::has_score_terms<posenc::shaw_keys<float>::bound, float>);
static_assert(!posenc::has_value_terms<posenc::shaw_keys<float>::bound, float>);
static_assert(posenc::has_value_terms<posenc::shaw_values<float>::bound, float>);
static_assert(!posenc::has_score_terms<posenc::shaw_values<float>::bound, float>);

// The exact difference of two int64 positions (the oracle for the saturating one in the library).
__extension__ using wide = __int128;

namespace {

struct shaw_case {
  const char* what;
  idx B = 1, Sq = 40, Sk = 40, H = 2, Hkv = 2, D = 16, Dv = 16, K = 4;
  shaw_terms terms = shaw_terms::keys_values;
  bool per_head_keys = false, per_head_values = false;
  bool causal = false;
  std::int64_t q_offset = 0;
  enum class pad { none, mask, lengths } padding = pad::none;
  bool packed_keys = false;  // key positions restart mid-sequence (two documents)
  idx q_block = 16, k_block = 24;
};

/// Inputs of one case in double; tables [2K+1, (H,) dim] row-major.
struct shaw_problem {
  shaw_case c;
  std::vector<double> q, k, v, wk, wv;
  std::vector<std::int64_t> pad, lengths;
  posenc::positions kpos;

  explicit shaw_problem(const shaw_case& sc)
      : c(sc), kpos(posenc::contiguous_positions(sc.B, sc.Sk)) {
    const idx R = 2 * c.K + 1;
    q = test_util::randn(static_cast<std::size_t>(c.B * c.Sq * c.H * c.D), 31, 0.5);
    k = test_util::randn(static_cast<std::size_t>(c.B * c.Sk * c.Hkv * c.D), 32, 0.5);
    v = test_util::randn(static_cast<std::size_t>(c.B * c.Sk * c.Hkv * c.Dv), 33);
    wk = test_util::randn(static_cast<std::size_t>(R * (c.per_head_keys ? c.H : 1) * c.D), 34, 0.5);
    wv = test_util::randn(static_cast<std::size_t>(R * (c.per_head_values ? c.H : 1) * c.Dv), 35);
    pad.assign(static_cast<std::size_t>(c.B * c.Sk), 0);
    lengths.assign(static_cast<std::size_t>(c.B), c.Sk);
    for (idx b = 0; b < c.B; ++b) {
      const idx valid = std::max<idx>(1, c.Sk - 3 - 7 * b);
      lengths[static_cast<std::size_t>(b)] = valid;
      for (idx j = valid; j < c.Sk; ++j) pad[static_cast<std::size_t>(b * c.Sk + j)] = 1;
    }
    if (c.packed_keys)
      for (idx b = 0; b < c.B; ++b)
        for (idx j = c.Sk / 2; j < c.Sk; ++j) kpos(b, j) = j - c.Sk / 2 + 2 * b;
  }

  [[nodiscard]] posenc::attention_options options() const {
    posenc::attention_options opt{.causal = c.causal, .q_offset = c.q_offset};
    if (c.padding == shaw_case::pad::mask)
      opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), c.B, c.Sk);
    if (c.padding == shaw_case::pad::lengths) opt.kv_lengths = lengths;
    if (c.packed_keys) opt.k_positions = posenc::view(kpos);
    opt.q_block = c.q_block;
    opt.k_block = c.k_block;
    return opt;
  }

  [[nodiscard]] bool uses_keys() const { return c.terms != shaw_terms::values; }
  [[nodiscard]] bool uses_values() const { return c.terms != shaw_terms::keys; }

  /// Shaw's bucket of one pair from the paper: clip(j_pos - i_pos, -K, K) + K.
  [[nodiscard]] idx bucket(idx b, idx i, idx j) const {
    const std::int64_t r = kpos(b, j) - (c.q_offset + i);
    return static_cast<idx>(std::min<std::int64_t>(std::max<std::int64_t>(r, -c.K), c.K) + c.K);
  }
};

template <class T>
std::vector<double> rounded(const std::vector<double>& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(static_cast<T>(x[i]));
  return r;
}

/// The double reference on the inputs rounded to T (the tables to TT), with a^K and a^V materialized
/// per pair.
template <class T, class TT = T>
std::vector<double> reference(const shaw_problem& p) {
  const shaw_case& c = p.c;
  const auto q = rounded<T>(p.q), k = rounded<T>(p.k), v = rounded<T>(p.v);
  const auto wk = rounded<TT>(p.wk), wv = rounded<TT>(p.wv);
  const auto Q = posenc::bshd<const double>(q.data(), c.B, c.Sq, c.H, c.D);
  posenc::reference_terms<double> terms;
  if (p.uses_keys())
    terms.score_term = [&](idx b, idx h, idx i, idx j) {
      const idx r = p.bucket(b, i, j), hs = c.per_head_keys ? c.H : 1, hh = c.per_head_keys ? h : 0;
      double dot = 0;
      for (idx d = 0; d < c.D; ++d) dot += Q(b, i, h, d) * wk[static_cast<std::size_t>((r * hs + hh) * c.D + d)];
      return dot;
    };
  if (p.uses_values())
    terms.value_term = [&](idx b, idx h, idx i, idx j, double* add) {
      const idx r = p.bucket(b, i, j), hs = c.per_head_values ? c.H : 1, hh = c.per_head_values ? h : 0;
      for (idx d = 0; d < c.Dv; ++d) add[d] = wv[static_cast<std::size_t>((r * hs + hh) * c.Dv + d)];
    };
  std::vector<double> out(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv));
  auto opt = p.options();
  opt.q_block = opt.k_block = 0;
  posenc::reference_attention<double>(Q, posenc::bshd<const double>(k.data(), c.B, c.Sk, c.Hkv, c.D),
                                      posenc::bshd<const double>(v.data(), c.B, c.Sk, c.Hkv, c.Dv),
                                      posenc::bshd(out.data(), c.B, c.Sq, c.H, c.Dv), opt, terms);
  return out;
}

template <class W>
posenc::shaw_table<W> table_of(const std::vector<W>& w, idx R, idx heads, idx dim, bool per_head) {
  return per_head ? posenc::shaw_table<W>(posenc::tensor_map<const W, 3>(w.data(), R, heads, dim))
                  : posenc::shaw_table<W>(posenc::tensor_map<const W, 2>(w.data(), R, dim));
}

/// The fused kernel in T with tables of type W (W != T: converted per call in bind).
template <class T, class W = T>
std::vector<T> fused(const shaw_problem& p, Eigen::ThreadPoolInterface* pool = nullptr) {
  const shaw_case& c = p.c;
  const std::vector<T> q(p.q.begin(), p.q.end()), k(p.k.begin(), p.k.end()), v(p.v.begin(), p.v.end());
  // Tables rounded to T first, so a W = double table carries the same values as the reference's.
  const auto wk_r = rounded<T>(p.wk), wv_r = rounded<T>(p.wv);
  const std::vector<W> wk(wk_r.begin(), wk_r.end()), wv(wv_r.begin(), wv_r.end());
  const idx R = 2 * c.K + 1;
  const auto tk = table_of(wk, R, c.H, c.D, c.per_head_keys);
  const auto tv = table_of(wv, R, c.H, c.Dv, c.per_head_values);
  std::vector<T> out(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv), T(-7));
  auto opt = p.options();
  opt.pool = pool;
  const auto run = [&](const auto& enc) {
    posenc::attention<T>(posenc::bshd<const T>(q.data(), c.B, c.Sq, c.H, c.D),
                         posenc::bshd<const T>(k.data(), c.B, c.Sk, c.Hkv, c.D),
                         posenc::bshd<const T>(v.data(), c.B, c.Sk, c.Hkv, c.Dv),
                         posenc::bshd(out.data(), c.B, c.Sq, c.H, c.Dv), enc, opt);
  };
  const posenc::shaw_config cfg{.max_relative_position = c.K};
  switch (c.terms) {
    case shaw_terms::keys_values:
      run(posenc::shaw_relative<W>(tk, tv, cfg));
      break;
    case shaw_terms::keys:
      run(posenc::shaw_keys<W>(tk, cfg));
      break;
    case shaw_terms::values:
      run(posenc::shaw_values<W>(tv, cfg));
      break;
  }
  return out;
}

template <class T>
void check_close(const std::vector<T>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t e = 0; e < want.size(); ++e) worst = std::max(worst, std::abs(double(got[e]) - want[e]));
  INFO("max |fused - reference| = " << worst);
  REQUIRE(worst <= tol);
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

using pad = shaw_case::pad;

// Every shape of the kernel's tiling with every kind of table; small tiles (16 x 24 by default) so
// most tiles lie beyond +-k (one bucket) and the rest straddle the band.
const shaw_case kCases[] = {
    {.what = "both, shared, bidirectional"},
    {.what = "both, causal", .causal = true},
    {.what = "both, key_padding_mask", .B = 2, .padding = pad::mask},
    {.what = "both, kv_lengths, causal", .B = 2, .causal = true, .padding = pad::lengths},
    {.what = "keys only", .terms = shaw_terms::keys},
    {.what = "values only", .terms = shaw_terms::values, .causal = true},
    {.what = "per-head keys and values", .H = 3, .Hkv = 3, .per_head_keys = true, .per_head_values = true},
    {.what = "per-head keys, shared values", .H = 3, .Hkv = 3, .per_head_keys = true},
    {.what = "per-head values only", .H = 3, .Hkv = 3, .terms = shaw_terms::values, .per_head_values = true},
    {.what = "GQA 8 query heads over 2 kv heads", .H = 8, .Hkv = 2, .per_head_keys = true, .causal = true},
    {.what = "MQA 4 over 1, keys only", .H = 4, .Hkv = 1, .terms = shaw_terms::keys},
    {.what = "k = 1", .K = 1},
    {.what = "k = 0 (one table row)", .K = 0},
    {.what = "k >= L (no clipping)", .Sq = 30, .Sk = 30, .K = 64},
    {.what = "odd head dims 33 / 7", .D = 33, .Dv = 7},
    {.what = "head dim 7, value dim 33, per head", .D = 7, .Dv = 33, .per_head_keys = true, .per_head_values = true},
    {.what = "q_len != k_len, chunk of 9 after 50 cached", .B = 2, .Sq = 9, .Sk = 59, .causal = true, .q_offset = 50,
     .padding = pad::mask},
    {.what = "packed key positions (non-consecutive in a tile)", .B = 2, .packed_keys = true},
    {.what = "larger tiles, long sequence", .Sq = 300, .Sk = 300, .D = 32, .Dv = 32, .K = 16, .q_block = 64,
     .k_block = 96},
    {.what = "default tiles", .Sq = 300, .Sk = 300, .H = 2, .K = 8, .q_block = 0, .k_block = 0},
};

}  // namespace

TEMPLATE_TEST_CASE("shaw: fused kernel equals the reference with a^K and a^V materialized", "[shaw][kernel]", float,
                   double) {
  using T = TestType;
  for (const auto& c : kCases) {
    INFO(c.what);
    const shaw_problem p(c);
    check_close(fused<T>(p), reference<T>(p), tolerance<T>());
  }
}

TEMPLATE_TEST_CASE("shaw: KV-cache decode, one query at position 4000 against 4001 keys", "[shaw][kernel]", float,
                   double) {
  using T = TestType;
  for (const auto terms : {shaw_terms::keys_values, shaw_terms::keys, shaw_terms::values}) {
    for (const idx Hkv : {4, 1}) {
      shaw_case c{.what = "decode", .B = 2, .Sq = 1, .Sk = 4001, .H = 4, .Hkv = Hkv, .D = 24, .Dv = 24, .K = 16,
                  .terms = terms, .causal = true, .q_offset = 4000, .padding = pad::lengths, .q_block = 0,
                  .k_block = 0};
      INFO("terms " << int(terms) << " kv heads " << Hkv);
      const shaw_problem p(c);
      check_close(fused<T>(p), reference<T>(p), tolerance<T>());
    }
  }
}

TEST_CASE("shaw: tables in the other precision are converted per call", "[shaw][kernel]") {
  const shaw_problem p({.what = "mixed", .B = 2, .H = 3, .Hkv = 3, .per_head_values = true, .causal = true});
  check_close(fused<float, double>(p), reference<float>(p), tolerance<float>());
  check_close(fused<double, float>(p), reference<double, float>(p), 1e-12);  // float tables, double arithmetic
}

TEMPLATE_TEST_CASE("shaw: 1, 2 and 8 threads give bitwise identical outputs", "[shaw][kernel][threads]", float,
                   double) {
  using T = TestType;
  Eigen::ThreadPool two(2), eight(8);
  const shaw_case cases[] = {
      {.what = "both, causal, padded", .B = 2, .Sq = 120, .Sk = 120, .H = 4, .Hkv = 2, .causal = true,
       .padding = pad::mask},
      {.what = "keys only, per head", .B = 1, .Sq = 97, .Sk = 130, .H = 3, .Hkv = 3, .terms = shaw_terms::keys,
       .per_head_keys = true, .q_offset = 33},
      {.what = "values only, default tiles", .Sq = 400, .Sk = 400, .terms = shaw_terms::values, .q_block = 0,
       .k_block = 0},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    const shaw_problem p(c);
    const auto one = fused<T>(p);
    REQUIRE(fused<T>(p, &two) == one);
    REQUIRE(fused<T>(p, &eight) == one);
    check_close(one, reference<T>(p), tolerance<T>());
  }
}

TEST_CASE("shaw: the tile hooks directly (one bucket, straddling, non-consecutive keys)", "[shaw]") {
  const idx K = 3, D = 5, R = 2 * K + 1;
  const auto wk = test_util::randn(static_cast<std::size_t>(R * D), 41);
  const auto wv = test_util::randn(static_cast<std::size_t>(R * D), 42);
  const posenc::shaw_relative<double> enc(posenc::tensor_map<const double, 2>(wk.data(), R, D),
                                          posenc::tensor_map<const double, 2>(wv.data(), R, D));
  REQUIRE(enc.max_relative_position() == K);  // from the table rows, as CTranslate2 derives it
  posenc::call_info info;
  info.heads = 1;
  info.head_dim = D;
  info.value_dim = D;
  info.scalar = posenc::scalar_type::float64;
  const auto b = enc.bind(info);
  REQUIRE(b.value_bucket_count() == R);
  REQUIRE(b.value_table<double>(0).data() == wv.data());  // viewed, not copied

  const std::vector<std::int64_t> near = {10, 11, 12}, extreme = {INT64_MAX, INT64_MIN, 0};
  const std::vector<std::int64_t> far_right = {20, 21, 22, 23}, far_left = {0, 1, 2, 3, 4, 5, 6},
                                  band = {6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, scattered = {12, 3, 30, 10, 9, 11},
                                  top = {INT64_MAX - 2, INT64_MAX - 1, INT64_MAX},
                                  bottom = {INT64_MIN, INT64_MIN + 1, INT64_MIN + 2};
  const auto q = test_util::randn(static_cast<std::size_t>(3 * D), 43);
  struct pair_set {
    const std::vector<std::int64_t>* q;
    const std::vector<std::int64_t>* k;
  };
  // Positions at the ends of int64 (caller data): distances saturate instead of overflowing.
  for (const auto [qpp, kp] : {pair_set{&near, &far_right}, pair_set{&near, &far_left}, pair_set{&near, &band},
                               pair_set{&near, &scattered}, pair_set{&extreme, &band}, pair_set{&extreme, &top},
                               pair_set{&extreme, &bottom}, pair_set{&near, &top}}) {
    const std::vector<std::int64_t>& qp = *qpp;
    const idx rows = 3, cols = static_cast<idx>(kp->size()), stride = cols + 2;
    const posenc::tile<double> t{.rows = rows, .cols = cols, .q_pos = qp.data(), .k_pos = kp->data(),
                                 .q = posenc::const_matrix_map<double>(q.data(), rows, D, Eigen::OuterStride<>(D))};
    std::vector<double> s(static_cast<std::size_t>(rows * stride), 0.25);
    const double scale = 0.5;
    b.add_score_terms<double>(t, scale, posenc::matrix_map<double>(s.data(), rows, cols, Eigen::OuterStride<>(stride)));
    std::vector<std::int32_t> idx_buf(static_cast<std::size_t>(rows * cols), -5);
    b.value_buckets<double>(t, posenc::index_tile(idx_buf.data(), rows, cols, Eigen::OuterStride<>(cols)));
    std::int32_t first = -2;
    bool uniform = true;
    for (idx i = 0; i < rows; ++i)
      for (idx j = 0; j < stride; ++j) {
        const double got = s[static_cast<std::size_t>(i * stride + j)];
        if (j >= cols) {
          REQUIRE(got == 0.25);  // beyond the tile: untouched
          continue;
        }
        const wide r = static_cast<wide>((*kp)[static_cast<std::size_t>(j)]) - qp[static_cast<std::size_t>(i)];
        const idx bucket = static_cast<idx>(std::clamp<wide>(r, -K, K) + K);
        double dot = 0;
        for (idx d = 0; d < D; ++d) dot += q[static_cast<std::size_t>(i * D + d)] * wk[static_cast<std::size_t>(bucket * D + d)];
        REQUIRE(std::abs(got - (0.25 + scale * dot)) <= 1e-14);
        REQUIRE(idx_buf[static_cast<std::size_t>(i * cols + j)] == bucket);
        REQUIRE(enc.bucket(qp[static_cast<std::size_t>(i)], (*kp)[static_cast<std::size_t>(j)]) == bucket);
        if (first == -2) first = static_cast<std::int32_t>(bucket);
        uniform = uniform && first == bucket;
      }
    REQUIRE(b.uniform_value_bucket<double>(t) == (uniform ? first : -1));
  }
  CHECK(b.uniform_value_bucket<double>(posenc::tile<double>{}) == -1);  // an empty tile
}

TEST_CASE("shaw: argument errors name the table and leave out untouched", "[shaw][errors]") {
  using t2 = posenc::tensor_map<const double, 2>;
  using t3 = posenc::tensor_map<const double, 3>;
  const std::vector<double> w(static_cast<std::size_t>(9 * 4 * 8), 0.1);
  // Construction.
  CHECK_THROWS_WITH(posenc::shaw_relative<double>(t2(w.data(), 9, 8), t2(w.data(), 7, 8), {.max_relative_position = 4}),
                    Catch::Contains("relative_position_values") && Catch::Contains("7 rows for k = 4"));
  CHECK_THROWS_WITH(posenc::shaw_keys<double>(t2(w.data(), 9, 8), {.max_relative_position = 3}),
                    Catch::Contains("relative_position_keys") && Catch::Contains("9 rows for k = 3"));
  CHECK_THROWS_WITH(posenc::shaw_keys<double>(t2(w.data(), 8, 8)),
                    Catch::Contains("relative_position_keys") && Catch::Contains("odd"));
  CHECK_THROWS_WITH(posenc::shaw_keys<double>(t2(w.data(), 9, 8), {.max_relative_position = -2}),
                    Catch::Contains("max_relative_position"));
  CHECK_THROWS_WITH(posenc::shaw_keys<double>(t2(w.data(), 9, 8), t2(w.data(), 9, 8)),
                    Catch::Contains("relative_position_values") && Catch::Contains("keys-only"));
  CHECK_THROWS_WITH(posenc::shaw_relative<double>(t2(w.data(), 9, 8), posenc::shaw_table<double>{}),
                    Catch::Contains("relative_position_values") && Catch::Contains("required"));
  CHECK_THROWS_WITH(posenc::shaw_keys<double>(t2(w.data(), 9, 0)), Catch::Contains("feature column"));
  CHECK_THROWS_AS(posenc::shaw_table<double>(t2(nullptr, 9, 8)), posenc::error);
  CHECK_NOTHROW(posenc::shaw_values<double>(t3(w.data(), 9, 4, 8)));

  // Against the call: head_dim, value_dim, heads of a per-head table.
  const idx B = 1, S = 12, H = 4, D = 8;
  const auto x = test_util::randn(static_cast<std::size_t>(B * S * H * D), 44);
  const auto xv = test_util::randn(static_cast<std::size_t>(B * S * H * 6), 45);
  std::vector<double> out(static_cast<std::size_t>(B * S * H * 6), 42.0);
  const auto Q = posenc::bshd<const double>(x.data(), B, S, H, D);
  const auto V = posenc::bshd<const double>(xv.data(), B, S, H, 6);
  const auto O = posenc::bshd(out.data(), B, S, H, 6);
  const auto call = [&](const auto& enc) { posenc::attention<double>(Q, Q, V, O, enc, {}); };
  CHECK_THROWS_WITH(call(posenc::shaw_keys<double>(t2(w.data(), 9, 7))),
                    Catch::Contains("relative_position_keys") && Catch::Contains("head_dim") && Catch::Contains("7 vs 8"));
  CHECK_THROWS_WITH(call(posenc::shaw_values<double>(t2(w.data(), 9, 8))),
                    Catch::Contains("relative_position_values") && Catch::Contains("value_dim") &&
                        Catch::Contains("8 vs 6"));
  CHECK_THROWS_WITH(call(posenc::shaw_keys<double>(t3(w.data(), 9, 3, 8))),
                    Catch::Contains("relative_position_keys") && Catch::Contains("heads") && Catch::Contains("3 vs 4"));
  CHECK_THROWS_WITH(call(posenc::shaw_relative<double>(t2(w.data(), 9, 8), t3(w.data(), 9, 2, 6))),
                    Catch::Contains("relative_position_values") && Catch::Contains("2 vs 4"));
  for (double e : out) REQUIRE(e == 42.0);
  // The same tables fit a matching call.
  CHECK_NOTHROW(call(posenc::shaw_relative<double>(t2(w.data(), 9, 8), t3(w.data(), 9, 4, 6))));
}

TEST_CASE("shaw: golden case, rel_index and out, fused in double (small tiles) and in float", "[shaw][golden]") {
  const auto c = golden::load("shaw_k8_bidirectional_right_padded");
  const idx K = c.params().at("max_relative_position").get<idx>();
  const bool causal = c.params().at("causal").get<bool>();
  const std::int64_t q_offset = c.params().value("q_offset", std::int64_t{0});
  const auto& qt = c.at("q");
  const idx B = qt.shape[0], Sq = qt.shape[1], H = qt.shape[2], D = qt.shape[3], Sk = c.at("k").shape[1];
  const auto q = qt.f64(), k = c.at("k").f64(), v = c.at("v").f64(), wk = c.at("rel_k").f64(), wv = c.at("rel_v").f64();
  REQUIRE(c.at("rel_k").shape == std::vector<std::int64_t>{2 * K + 1, D});
  const posenc::shaw_relative<double> enc(posenc::tensor_map<const double, 2>(wk.data(), 2 * K + 1, D),
                                          posenc::tensor_map<const double, 2>(wv.data(), 2 * K + 1, D),
                                          {.max_relative_position = K});
  const auto rel_index = c.at("rel_index").i64();
  for (idx i = 0; i < Sq; ++i)
    for (idx j = 0; j < Sk; ++j) REQUIRE(enc.bucket(q_offset + i, j) == rel_index[static_cast<std::size_t>(i * Sk + j)]);

  const auto pad = c.at("key_padding_mask").i64();
  posenc::attention_options opt{.causal = causal, .q_offset = q_offset};
  opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), B, Sk);
  const auto want = c.at("out").f64();
  const auto tol = golden::tolerance(c, "out");
  for (const idx blocks : {0, 5}) {
    opt.q_block = opt.k_block = blocks;
    std::vector<double> out(want.size(), -7.0);
    posenc::attention<double>(posenc::bshd(q.data(), B, Sq, H, D), posenc::bshd(k.data(), B, Sk, H, D),
                              posenc::bshd(v.data(), B, Sk, H, D), posenc::bshd(out.data(), B, Sq, H, D), enc, opt);
    for (std::size_t e = 0; e < want.size(); ++e)
      REQUIRE(std::abs(out[e] - want[e]) <= tol.atol + tol.rtol * std::abs(want[e]));
  }
  // float: inputs and tables rounded once; ~1e-6 relative for O(1) outputs.
  const std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end());
  std::vector<float> outf(want.size(), -7.f);
  opt.q_block = opt.k_block = 0;
  posenc::attention<float>(posenc::bshd<const float>(qf.data(), B, Sq, H, D),
                           posenc::bshd<const float>(kf.data(), B, Sk, H, D),
                           posenc::bshd<const float>(vf.data(), B, Sk, H, D), posenc::bshd(outf.data(), B, Sq, H, D),
                           enc, opt);
  for (std::size_t e = 0; e < want.size(); ++e) REQUIRE(std::abs(outf[e] - want[e]) <= 4e-6 * (1 + std::abs(want[e])));
}

// ---- loading (posenc/io/shaw.hpp) ----------------------------------------------------------------

namespace {

std::filesystem::path temp_file(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("posenc_test_shaw_" + name + ".safetensors");
}

}  // namespace

TEST_CASE("shaw io: CTranslate2 names, OpenNMT-py's shared table, and shape errors naming the tensor",
          "[shaw][io]") {
  const idx K = 3, R = 2 * K + 1, D = 4;
  const auto wk = test_util::randn(static_cast<std::size_t>(R * D), 51);
  const auto wv = test_util::randn(static_cast<std::size_t>(R * D), 52);
  const auto wh = test_util::randn(static_cast<std::size_t>(R * 2 * D), 53);

  SECTION("CTranslate2: <scope>/relative_position_keys and _values, k from the rows") {
    posenc::io::safetensors_writer w;
    w.add<float>("encoder/layer_0/self_attention/relative_position_keys", {R, D},
                 std::vector<float>(wk.begin(), wk.end()));
    w.add<float>("encoder/layer_0/self_attention/relative_position_values", {R, 2, D},
                 std::vector<float>(wh.begin(), wh.end()));
    const auto file = posenc::io::safetensors_file::parse(w.bytes());
    const auto wts = posenc::io::load_shaw<double>(file, "encoder/layer_0/self_attention/");
    REQUIRE(wts.max_relative_position == K);
    REQUIRE(wts.keys_shape == std::vector<std::int64_t>{R, D});
    REQUIRE(wts.values_shape == std::vector<std::int64_t>{R, 2, D});
    const auto enc = wts.encoding();
    REQUIRE(enc.max_relative_position() == K);
    REQUIRE(enc.keys().data() == wts.keys.data());  // the encoding views the loaded tables
    REQUIRE(enc.values().per_head());
    REQUIRE(enc.keys().at(5, 0, 3) == static_cast<double>(static_cast<float>(wk[5 * D + 3])));
    REQUIRE(enc.values().at(2, 1, 0) == static_cast<double>(static_cast<float>(wh[(2 * 2 + 1) * D])));
  }
  SECTION("maximum_relative_position stored in the file must agree with the tables") {
    posenc::io::safetensors_writer w;
    w.add<double>("relative_position_keys", {R, D}, wk);
    w.add<std::int64_t>("maximum_relative_position", {}, std::vector<std::int64_t>{K});
    auto wts = posenc::io::load_shaw<float>(posenc::io::safetensors_file::parse(w.bytes()));
    REQUIRE(wts.max_relative_position == K);
    REQUIRE(wts.values.empty());
    REQUIRE(posenc::io::shaw_keys_of(wts).keys().rows() == R);
    CHECK_THROWS_WITH(wts.encoding(), Catch::Contains("relative_position_values"));

    posenc::io::safetensors_writer bad;
    bad.add<double>("relative_position_keys", {R, D}, wk);
    bad.add<std::int64_t>("maximum_relative_position", {}, std::vector<std::int64_t>{K + 1});
    CHECK_THROWS_WITH(posenc::io::load_shaw<float>(posenc::io::safetensors_file::parse(bad.bytes())),
                      Catch::Contains("relative_position_keys") && Catch::Contains("rows"));
  }
  SECTION("OpenNMT-py: one relative_positions_embeddings.weight for keys and values") {
    posenc::io::safetensors_writer w;
    w.add<double>("encoder.transformer.0.self_attn.relative_positions_embeddings.weight", {R, D}, wk);
    const auto path = temp_file("onmt");
    w.write(path);
    const auto wts = posenc::io::load_shaw<double>(path, "encoder.transformer.0.self_attn.");
    std::filesystem::remove(path);
    REQUIRE(wts.max_relative_position == K);
    REQUIRE(wts.keys == wk);
    REQUIRE(wts.values == wk);
    const auto enc = wts.encoding();
    REQUIRE(enc.values().at(6, 0, 1) == wk[6 * D + 1]);
  }
  SECTION("shape errors name the tensor") {
    posenc::io::safetensors_writer even;
    even.add<double>("relative_position_keys", {R + 1, D}, std::vector<double>(static_cast<std::size_t>((R + 1) * D)));
    CHECK_THROWS_WITH(posenc::io::load_shaw<double>(posenc::io::safetensors_file::parse(even.bytes())),
                      Catch::Contains("relative_position_keys") && Catch::Contains("odd"));
    posenc::io::safetensors_writer mismatch;
    mismatch.add<double>("relative_position_keys", {R, D}, wk);
    mismatch.add<double>("relative_position_values", {R + 2, D}, std::vector<double>(static_cast<std::size_t>((R + 2) * D)));
    CHECK_THROWS_WITH(posenc::io::load_shaw<double>(posenc::io::safetensors_file::parse(mismatch.bytes())),
                      Catch::Contains("relative_position_values") && Catch::Contains("rows"));
    posenc::io::safetensors_writer rank;
    rank.add<double>("relative_position_keys", {R}, std::vector<double>(static_cast<std::size_t>(R)));
    CHECK_THROWS_WITH(posenc::io::load_shaw<double>(posenc::io::safetensors_file::parse(rank.bytes())),
                      Catch::Contains("relative_position_keys") && Catch::Contains("rank"));
    posenc::io::safetensors_writer none;
    none.add<double>("something_else", {R, D}, wk);
    CHECK_THROWS_WITH(posenc::io::load_shaw<double>(posenc::io::safetensors_file::parse(none.bytes())),
                      Catch::Contains("relative_position_keys"));
    posenc::io::safetensors_writer ints;
    ints.add<std::int64_t>("relative_position_keys", {R, D}, std::vector<std::int64_t>(static_cast<std::size_t>(R * D)));
    CHECK_THROWS_WITH(posenc::io::load_shaw<double>(posenc::io::safetensors_file::parse(ints.bytes())),
                      Catch::Contains("relative_position_keys"));
  }
  SECTION("OpenNMT-py option max_relative_positions") {
    CHECK(posenc::io::shaw_config_from_opennmt({{"max_relative_positions", 20}}).max_relative_position == 20);
    CHECK_THROWS_WITH(posenc::io::shaw_config_from_opennmt({{"max_relative_positions", -1}}),
                      Catch::Contains("max_relative_positions"));
    CHECK_THROWS_WITH(posenc::io::shaw_config_from_opennmt(nlohmann::json::object()),
                      Catch::Contains("max_relative_positions"));
    CHECK_THROWS_WITH(posenc::io::shaw_config_from_opennmt({{"max_relative_positions", 8}, {"use_neg_dist", false}}),
                      Catch::Contains("use_neg_dist"));
    CHECK(posenc::io::shaw_config_from_opennmt({{"max_relative_positions", 8}, {"use_neg_dist", true}})
              .max_relative_position == 8);
  }
  SECTION("the loaded tables against a call that does not fit") {
    posenc::io::safetensors_writer w;
    w.add<double>("relative_position_keys", {R, D}, wk);
    w.add<double>("relative_position_values", {R, D}, wv);
    const auto wts = posenc::io::load_shaw<double>(posenc::io::safetensors_file::parse(w.bytes()));
    const auto enc = wts.encoding();
    const auto x = test_util::randn(static_cast<std::size_t>(5 * 2 * (D + 1)), 54);
    std::vector<double> out(x.size(), 1.0);
    const auto X = posenc::bshd<const double>(x.data(), 1, 5, 2, D + 1);
    CHECK_THROWS_WITH(posenc::attention<double>(X, X, X, posenc::bshd(out.data(), 1, 5, 2, D + 1), enc),
                      Catch::Contains("relative_position_keys") && Catch::Contains("head_dim"));
  }
}
