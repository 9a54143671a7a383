// ALiBi: slopes against Press et al.'s get_slopes and ggml's max_bias form (both written here), the
// golden cases (FORMAT.md 5.4), the per-tile hook against the scalar formula, and the fused kernel
// against the double reference attention with the bias materialized by an independent closed form.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "golden.hpp"
#include "posenc/alibi.hpp"
#include "posenc/attention.hpp"
#include "posenc/reference.hpp"
#include "random.hpp"

using idx = posenc::index_t;
using posenc::alibi_form;

static_assert(posenc::attention_encoding<posenc::alibi>);
static_assert(posenc::has_position_bias<posenc::alibi, float>);
static_assert(posenc::has_position_bias<posenc::alibi, double>);
static_assert(!posenc::input_encoding<posenc::alibi>);

namespace {

// Press et al. (ofirpress/attention_with_linear_biases, BLOOM build_alibi_tensor): a geometric
// series starting at 2^(-8/n) for a power of two n; otherwise the closest lower power of two plus
// every other element of the series for twice that.
std::vector<double> press_slopes_power_of_2(int n) {
  const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(double(n)) - 3.0)));
  std::vector<double> s;
  for (int i = 0; i < n; ++i) s.push_back(start * std::pow(start, i));
  return s;
}
std::vector<double> press_slopes(int n) {
  const double l = std::log2(double(n));
  if (l == std::floor(l)) return press_slopes_power_of_2(n);
  const int cp = 1 << static_cast<int>(std::floor(l));
  auto s = press_slopes_power_of_2(cp);
  const auto extra = press_slopes_power_of_2(2 * cp);
  for (int i = 0; static_cast<int>(s.size()) < n; i += 2) s.push_back(extra[static_cast<std::size_t>(i)]);
  return s;
}
// ggml (ggml_soft_max_ext / llama.cpp): m0 = 2^(-max_bias/n_log2), m1 = 2^(-max_bias/2/n_log2).
double ggml_slope(int h, int heads, double max_bias) {
  const int n_log2 = 1 << static_cast<int>(std::floor(std::log2(double(heads))));
  const double m0 = std::pow(2.0, -max_bias / n_log2), m1 = std::pow(2.0, -(max_bias / 2.0) / n_log2);
  return h < n_log2 ? std::pow(m0, h + 1) : std::pow(m1, 2 * (h - n_log2) + 1);
}

double closed_bias(alibi_form form, double m, std::int64_t qp, std::int64_t kp) {
  switch (form) {
    case alibi_form::causal:
      return -m * double(qp - kp);
    case alibi_form::symmetric:
      return -m * std::abs(double(qp - kp));
    case alibi_form::key_position:
      return m * double(kp);
  }
  return 0;
}

alibi_form form_of(const std::string& s) {
  if (s == "causal") return alibi_form::causal;
  if (s == "symmetric") return alibi_form::symmetric;
  return alibi_form::key_position;
}

}  // namespace

TEST_CASE("alibi: slopes for every head count 1..64 equal Press et al.'s get_slopes", "[alibi]") {
  for (int h = 1; h <= 64; ++h) {
    const auto want = press_slopes(h);
    const auto got = posenc::alibi_slopes(h);
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      INFO("heads " << h << " head " << i);
      REQUIRE(std::abs(got[i] - want[i]) <= 1e-14 * want[i]);  // pow of an inexact start: a few ulps
    }
  }
  // Spot values from the paper: 8 heads -> 1/2, 1/4, ..., 1/256.
  const auto s8 = posenc::alibi_slopes(8);
  for (int i = 0; i < 8; ++i) CHECK(s8[static_cast<std::size_t>(i)] == std::ldexp(1.0, -(i + 1)));
}

TEST_CASE("alibi: ggml max_bias family for every head count 1..64", "[alibi]") {
  for (double max_bias : {8.0, 4.0, 16.0, 0.5}) {
    for (int h = 1; h <= 64; ++h) {
      const auto got = posenc::alibi_slopes(h, max_bias);
      for (int i = 0; i < h; ++i) {
        INFO("max_bias " << max_bias << " heads " << h << " head " << i);
        const double want = ggml_slope(i, h, max_bias);
        REQUIRE(std::abs(got[static_cast<std::size_t>(i)] - want) <= 1e-14 * want);
      }
    }
  }
  CHECK_THROWS_AS(posenc::alibi_slopes(0), posenc::error);
  CHECK_THROWS_AS(posenc::alibi_slopes(8, -1.0), posenc::error);
  CHECK_THROWS_WITH(posenc::alibi({.heads = -2}), Catch::Contains("heads") && Catch::Contains("-2"));
}

TEMPLATE_TEST_CASE("alibi: tile hook equals the closed form, any positions, wide tiles", "[alibi]", float, double) {
  using T = TestType;
  const idx rows = 5, cols = 600;  // wider than the hook's 256-key chunk
  std::vector<std::int64_t> qp = {0, 7, 300, 599, 1000};
  std::vector<std::int64_t> kp(cols);
  for (idx j = 0; j < cols; ++j) kp[static_cast<std::size_t>(j)] = (j * 37) % 701;  // not contiguous
  const idx stride = cols + 3;
  for (auto form : {alibi_form::causal, alibi_form::symmetric, alibi_form::key_position}) {
    posenc::alibi enc({.heads = 12, .form = form});
    const auto m = press_slopes(12);
    for (idx h : {0, 7, 11}) {
      std::vector<T> s(static_cast<std::size_t>(rows * stride), T(1));
      posenc::tile<T> t;
      t.head = h;
      t.rows = rows;
      t.cols = cols;
      t.q_pos = qp.data();
      t.k_pos = kp.data();
      enc.add_position_bias(t, posenc::matrix_map<T>(s.data(), rows, cols, Eigen::OuterStride<>(stride)));
      for (idx i = 0; i < rows; ++i)
        for (idx j = 0; j < stride; ++j) {
          const double got = double(s[static_cast<std::size_t>(i * stride + j)]);
          if (j >= cols) {
            REQUIRE(got == 1.0);  // outside the tile: untouched
            continue;
          }
          const double want = 1.0 + closed_bias(form, m[static_cast<std::size_t>(h)], qp[static_cast<std::size_t>(i)],
                                                kp[static_cast<std::size_t>(j)]);
          REQUIRE(std::abs(got - want) <= (std::is_same_v<T, float> ? 1e-6 * (1 + std::abs(want)) : 1e-13));
          REQUIRE(std::abs(enc.bias(h, qp[static_cast<std::size_t>(i)], kp[static_cast<std::size_t>(j)]) -
                           (want - 1.0)) <= 1e-12);
        }
    }
  }
}

TEST_CASE("alibi: golden cases (slopes, bias, reference probs/out, fused out)", "[alibi][golden]") {
  for (const std::string name : {"alibi_8_heads_causal_prefill", "alibi_16_heads_symmetric_right_padded"}) {
    INFO(name);
    const auto c = golden::load(name);
    const auto& prm = c.params();
    const idx H = prm.at("num_heads").get<idx>();
    const double max_bias = prm.contains("max_bias") ? prm.at("max_bias").get<double>() : 8.0;
    const auto form = form_of(prm.at("form").get<std::string>());
    const bool causal = prm.at("causal").get<bool>();
    const std::int64_t q_offset = prm.contains("q_offset") ? prm.at("q_offset").get<std::int64_t>() : 0;
    posenc::alibi enc({.heads = H, .max_bias = max_bias, .form = form});

    const auto slopes = c.at("slopes").f64();
    REQUIRE(static_cast<idx>(slopes.size()) == H);
    for (idx h = 0; h < H; ++h) REQUIRE(std::abs(enc.slope(h) - slopes[static_cast<std::size_t>(h)]) <= 1e-11);

    const auto& qt = c.at("q");
    const idx B = qt.shape[0], S = qt.shape[1], D = qt.shape[3];
    const idx Sk = c.at("k").shape[1];
    const auto bias = c.at("bias").f64();
    for (idx h = 0; h < H; ++h)
      for (idx i = 0; i < S; ++i)
        for (idx j = 0; j < Sk; ++j)
          REQUIRE(std::abs(enc.bias(h, q_offset + i, j) - bias[static_cast<std::size_t>((h * S + i) * Sk + j)]) <=
                  1e-11);

    const auto q = qt.f64(), k = c.at("k").f64(), v = c.at("v").f64();
    std::vector<std::int64_t> pad;
    posenc::attention_options opt{.causal = causal, .q_offset = q_offset};
    if (c.has("key_padding_mask")) {
      pad = c.at("key_padding_mask").i64();
      opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), B, Sk);
    }
    posenc::reference_terms<double> terms;
    terms.bias = [&](idx, idx h, idx i, idx j) { return enc.bias(h, q_offset + i, j); };
    std::vector<double> out(q.size()), probs(static_cast<std::size_t>(B * H * S * Sk));
    posenc::reference_attention<double>(posenc::bshd(q.data(), B, S, H, D), posenc::bshd(k.data(), B, Sk, H, D),
                                        posenc::bshd(v.data(), B, Sk, H, D), posenc::bshd(out.data(), B, S, H, D), opt,
                                        terms, posenc::tensor_map<double, 4>(probs.data(), B, H, S, Sk));
    const auto want_out = c.at("out").f64(), want_probs = c.at("probs").f64();
    const auto tol_out = golden::tolerance(c, "out"), tol_p = golden::tolerance(c, "probs");
    for (std::size_t e = 0; e < out.size(); ++e)
      REQUIRE(std::abs(out[e] - want_out[e]) <= tol_out.atol + tol_out.rtol * std::abs(want_out[e]));
    for (std::size_t e = 0; e < probs.size(); ++e)
      REQUIRE(std::abs(probs[e] - want_probs[e]) <= tol_p.atol + tol_p.rtol * std::abs(want_probs[e]));

    // The fused kernel (small tiles, so several tiles per row).
    std::vector<double> fused(q.size(), -7.0);
    opt.q_block = 8;
    opt.k_block = 8;
    posenc::attention<double>(posenc::bshd(q.data(), B, S, H, D), posenc::bshd(k.data(), B, Sk, H, D),
                              posenc::bshd(v.data(), B, Sk, H, D), posenc::bshd(fused.data(), B, S, H, D), enc, opt);
    for (std::size_t e = 0; e < fused.size(); ++e)
      REQUIRE(std::abs(fused[e] - want_out[e]) <= tol_out.atol + tol_out.rtol * std::abs(want_out[e]));
  }
}

namespace {

struct fused_case {
  const char* what;
  idx B, Sq, Sk, H, Hkv, D;
  alibi_form form;
  bool causal;
  std::int64_t q_offset;
  bool padded;
};

template <class T>
void run_fused(const fused_case& fc, double slope_scale = 1.0) {
  INFO(fc.what);
  const auto qd = test_util::randn(static_cast<std::size_t>(fc.B * fc.Sq * fc.H * fc.D), 11);
  const auto kd = test_util::randn(static_cast<std::size_t>(fc.B * fc.Sk * fc.Hkv * fc.D), 12);
  const auto vd = test_util::randn(static_cast<std::size_t>(fc.B * fc.Sk * fc.Hkv * fc.D), 13);
  std::vector<std::int64_t> pad(static_cast<std::size_t>(fc.B * fc.Sk), 0);
  if (fc.padded)  // right padding of a different length per batch row
    for (idx b = 0; b < fc.B; ++b)
      for (idx j = fc.Sk - 1 - 3 * b; j < fc.Sk; ++j) pad[static_cast<std::size_t>(b * fc.Sk + j)] = 1;
  posenc::attention_options opt{.causal = fc.causal, .q_offset = fc.q_offset};
  if (fc.padded) opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), fc.B, fc.Sk);

  const auto slopes = press_slopes(static_cast<int>(fc.H));
  posenc::reference_terms<double> terms;
  terms.bias = [&](idx, idx h, idx i, idx j) {
    return closed_bias(fc.form, slope_scale * slopes[static_cast<std::size_t>(h)], fc.q_offset + i, j);
  };
  std::vector<double> want(static_cast<std::size_t>(fc.B * fc.Sq * fc.H * fc.D));
  posenc::reference_attention<double>(posenc::bshd(qd.data(), fc.B, fc.Sq, fc.H, fc.D),
                                      posenc::bshd(kd.data(), fc.B, fc.Sk, fc.Hkv, fc.D),
                                      posenc::bshd(vd.data(), fc.B, fc.Sk, fc.Hkv, fc.D),
                                      posenc::bshd(want.data(), fc.B, fc.Sq, fc.H, fc.D), opt, terms);

  const std::vector<T> q(qd.begin(), qd.end()), k(kd.begin(), kd.end()), v(vd.begin(), vd.end());
  std::vector<T> got(want.size(), T(-7));
  posenc::alibi enc({.heads = fc.H, .form = fc.form, .slope_scale = slope_scale});
  opt.q_block = 16;
  opt.k_block = 32;
  posenc::attention<T>(
      posenc::bshd(q.data(), fc.B, fc.Sq, fc.H, fc.D), posenc::bshd(k.data(), fc.B, fc.Sk, fc.Hkv, fc.D),
      posenc::bshd(v.data(), fc.B, fc.Sk, fc.Hkv, fc.D), posenc::bshd(got.data(), fc.B, fc.Sq, fc.H, fc.D), enc, opt);
  const double tol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
  for (std::size_t e = 0; e < want.size(); ++e) REQUIRE(std::abs(double(got[e]) - want[e]) <= tol);
}

}  // namespace

TEMPLATE_TEST_CASE("alibi: fused kernel equals the reference with the bias materialized", "[alibi][kernel]", float,
                   double) {
  const fused_case cases[] = {
      {"causal prefill", 2, 70, 70, 4, 4, 16, alibi_form::causal, true, 0, false},
      {"causal, key_position form (BLOOM)", 1, 50, 50, 6, 6, 8, alibi_form::key_position, true, 0, false},
      {"symmetric, right padded", 3, 45, 45, 8, 8, 8, alibi_form::symmetric, false, 0, true},
      {"KV-cache decode step (q_offset 90)", 2, 1, 91, 5, 5, 16, alibi_form::causal, true, 90, false},
      {"KV-cache chunk of 7 after 60 cached", 1, 7, 67, 4, 4, 8, alibi_form::causal, true, 60, true},
      {"GQA 8/2 causal", 2, 40, 40, 8, 2, 8, alibi_form::causal, true, 0, false},
      {"MQA 12/1 symmetric, non-power-of-two heads", 1, 33, 33, 12, 1, 8, alibi_form::symmetric, false, 0, true},
  };
  for (const auto& fc : cases) run_fused<TestType>(fc);
}

// Falcon adds the bias before its logit scale, (q k^T + m (k - q)) d^-1/2 (FalconAttention): the slopes
// times d^-1/2, added after the scale.
TEMPLATE_TEST_CASE("alibi: slope_scale multiplies every slope (Falcon's bias before the scale)", "[alibi][kernel]",
                   float, double) {
  run_fused<TestType>({"Falcon-style, d = 64", 2, 37, 37, 8, 8, 64, alibi_form::causal, true, 0, true}, 1.0 / 8.0);
  run_fused<TestType>({"decode step, 12 heads, d = 16", 1, 1, 50, 12, 4, 16, alibi_form::causal, true, 49, false},
                      0.25);
  const posenc::alibi a({.heads = 8, .slope_scale = 0.125});
  const auto want = press_slopes(8);
  for (idx h = 0; h < 8; ++h) CHECK(a.slope(h) == want[static_cast<std::size_t>(h)] * 0.125);
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()})
    CHECK_THROWS_WITH(posenc::alibi({.heads = 4, .slope_scale = bad}),
                      Catch::Contains("slope_scale: must be finite and > 0"));
}

TEST_CASE("alibi: a head count that differs from the call's is an error before any write", "[alibi][errors]") {
  const idx B = 1, S = 4, H = 4, D = 8;
  const auto q = test_util::randn(static_cast<std::size_t>(B * S * H * D), 1);
  std::vector<double> out(q.size(), 3.0);
  posenc::alibi enc({.heads = 8});
  CHECK_THROWS_WITH(
      posenc::attention<double>(posenc::bshd(q.data(), B, S, H, D), posenc::bshd(q.data(), B, S, H, D),
                                posenc::bshd(q.data(), B, S, H, D), posenc::bshd(out.data(), B, S, H, D), enc, {}),
      Catch::Contains("heads") && Catch::Contains("8 vs 4"));
  for (double e : out) REQUIRE(e == 3.0);
}

TEST_CASE("alibi: numerics as PyTorch — masked rows zero, huge biases and logits finite, NaN rows NaN",
          "[alibi][kernel][numerics]") {
  // Batch row 0 sees no key (kv_lengths 0): zeros and lse -inf. Batch row 1: queries at 10^6 + i see
  // keys at 0..S-1 (bias down to -0.5 * 10^6 on head 0) with logits scaled to about ±1e4, a padded key
  // holding NaN (never seen), and one query row holding NaN (that row of that head only is NaN, as
  // softmax(NaN) in PyTorch).
  const idx B = 2, S = 40, H = 4, D = 16;
  auto q = test_util::randn(static_cast<std::size_t>(B * S * H * D), 41);
  auto k = test_util::randn(q.size(), 42);
  const auto v = test_util::randn(q.size(), 43);
  const std::int64_t offset = 1000000;
  const idx nan_row = 7, nan_head = 2, nan_key = 35;
  q[static_cast<std::size_t>(((1 * S + nan_row) * H + nan_head) * D + 3)] = std::numeric_limits<double>::quiet_NaN();
  for (idx h = 0; h < H; ++h) k[static_cast<std::size_t>(((1 * S + nan_key) * H + h) * D)] = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::int64_t> lengths = {0, nan_key};
  posenc::attention_options opt;
  opt.causal = true;
  opt.q_offset = offset;
  opt.kv_lengths = lengths;
  opt.scale = 1e4 / double(D);
  opt.q_block = 16;
  opt.k_block = 16;
  const posenc::alibi enc({.heads = H});
  const auto slopes = press_slopes(H);
  posenc::reference_terms<double> terms;
  terms.bias = [&](idx, idx h, idx i, idx j) { return closed_bias(alibi_form::causal, slopes[static_cast<std::size_t>(h)], offset + i, j); };
  std::vector<double> want(q.size()), want_lse(static_cast<std::size_t>(B * H * S));
  posenc::reference_attention<double>(posenc::bshd<const double>(q.data(), B, S, H, D), posenc::bshd<const double>(k.data(), B, S, H, D),
                                      posenc::bshd<const double>(v.data(), B, S, H, D), posenc::bshd(want.data(), B, S, H, D), opt, terms,
                                      std::nullopt, posenc::tensor_map<double, 3>(want_lse.data(), B, H, S));
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const std::vector<T> qt(q.begin(), q.end()), kt(k.begin(), k.end()), vt(v.begin(), v.end());
    std::vector<T> out(q.size(), T(5)), lse(want_lse.size(), T(5));
    double worst = 0;
    posenc::attention<T>(posenc::bshd<const T>(qt.data(), B, S, H, D), posenc::bshd<const T>(kt.data(), B, S, H, D),
                         posenc::bshd<const T>(vt.data(), B, S, H, D), posenc::bshd(out.data(), B, S, H, D),
                         posenc::tensor_map<T, 3>(lse.data(), B, H, S), enc, opt);
    for (idx b = 0; b < B; ++b)
      for (idx i = 0; i < S; ++i)
        for (idx h = 0; h < H; ++h) {
          INFO("b " << b << " i " << i << " h " << h);
          const T l = lse[static_cast<std::size_t>((b * H + h) * S + i)];
          const bool poisoned = b == 1 && i == nan_row && h == nan_head;
          if (b == 0) CHECK(l == -std::numeric_limits<T>::infinity());
          else if (poisoned) CHECK(std::isnan(l));
          else CHECK(std::isfinite(l));
          for (idx d = 0; d < D; ++d) {
            const std::size_t at = static_cast<std::size_t>(((b * S + i) * H + h) * D + d);
            if (b == 0) {
              REQUIRE(out[at] == T(0));
            } else if (poisoned) {
              REQUIRE(std::isnan(out[at]));
            } else {
              REQUIRE(std::isfinite(out[at]));
              worst = std::max(worst, std::abs(double(out[at]) - want[at]));
            }
          }
        }
    return worst;
  };
  // The kernel's bias is exact in the distance and the running max takes out the common -m * 10^6,
  // so the error is that of a softmax over logits ~1e4 (measured: double 2e-16, float 1.2e-7).
  const double worst_double = run(0.0), worst_float = run(0.0f);
  INFO("worst |out - reference|: double " << worst_double << ", float " << worst_float);
  CHECK(worst_double <= 1e-12);
  CHECK(worst_float <= 1e-5);
}
