// tests/test_rope.cpp — RoPE (label rope): golden vectors (FORMAT.md 5.2, 5.3) and closed-form
// properties. Every expectation is an independent oracle: the float64 golden outputs, the formulas of
// the papers written out here, or the double reference attention.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "golden.hpp"
#include "posenc/attention.hpp"
#include "posenc/reference.hpp"
#include "posenc/rope.hpp"
#include "random.hpp"

namespace {

using posenc::index_t;

// ---- helpers -------------------------------------------------------------------------------------

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

/// Number of elements violating a FORMAT.md section 4 rule (informational rules never fail).
std::size_t violations(const std::vector<double>& actual, const std::vector<double>& expected, const golden::rule& r) {
  REQUIRE(actual.size() == expected.size());
  if (r.informational) return 0;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double tol = r.exact ? 0.0 : r.atol + r.rtol * std::abs(expected[i]);
    if (!(std::abs(actual[i] - expected[i]) <= tol)) ++bad;
  }
  return bad;
}

template <class T>
std::vector<double> to_double(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

/// rope_config from a golden case's params (keys as HF's config.json, FORMAT.md 5.2).
posenc::rope_config config_from(const nlohmann::json& p) {
  posenc::rope_config c;
  c.head_dim = p.at("head_dim").get<index_t>();
  c.rope_theta = p.at("rope_theta").get<double>();
  if (p.contains("partial_rotary_factor") && !p.at("partial_rotary_factor").is_null())
    c.partial_rotary_factor = p.at("partial_rotary_factor").get<double>();
  if (p.contains("max_position_embeddings") && !p.at("max_position_embeddings").is_null())
    c.max_position_embeddings = p.at("max_position_embeddings").get<std::int64_t>();
  c.layout = p.at("layout").get<std::string>() == "half" ? posenc::rope_layout::half : posenc::rope_layout::interleaved;
  if (p.contains("seq_len") && !p.at("seq_len").is_null()) c.seq_len = p.at("seq_len").get<std::int64_t>();
  if (p.contains("rope_scaling") && !p.at("rope_scaling").is_null()) {
    const auto& s = p.at("rope_scaling");
    auto num = [&](const char* k) -> std::optional<double> {
      if (s.contains(k) && !s.at(k).is_null()) return s.at(k).get<double>();
      return std::nullopt;
    };
    const std::string type = s.contains("rope_type") ? s.at("rope_type").get<std::string>() : s.at("type").get<std::string>();
    c.scaling.rope_type = posenc::rope_type_from_string(type);
    c.scaling.factor = num("factor");
    if (auto o = num("original_max_position_embeddings")) c.scaling.original_max_position_embeddings = static_cast<std::int64_t>(*o);
    c.scaling.attention_factor = num("attention_factor");
    c.scaling.beta_fast = num("beta_fast");
    c.scaling.beta_slow = num("beta_slow");
    c.scaling.mscale = num("mscale");
    c.scaling.mscale_all_dim = num("mscale_all_dim");
    if (s.contains("truncate") && !s.at("truncate").is_null()) c.scaling.truncate = s.at("truncate").get<bool>();
    c.scaling.low_freq_factor = num("low_freq_factor");
    c.scaling.high_freq_factor = num("high_freq_factor");
    if (s.contains("short_factor")) c.scaling.short_factor = s.at("short_factor").get<std::vector<double>>();
    if (s.contains("long_factor")) c.scaling.long_factor = s.at("long_factor").get<std::vector<double>>();
    if (auto t = num("rope_theta")) c.rope_theta = *t;  // inside rope_scaling overrides (FORMAT.md 5.2)
    if (auto f = num("partial_rotary_factor")) c.partial_rotary_factor = *f;
  }
  return c;
}

/// [B, S, H, D] row-major buffer -> [B, H, S, D].
template <class T>
std::vector<T> bshd_to_bhsd(const std::vector<T>& x, index_t B, index_t S, index_t H, index_t D) {
  std::vector<T> y(x.size());
  for (index_t b = 0; b < B; ++b)
    for (index_t s = 0; s < S; ++s)
      for (index_t h = 0; h < H; ++h)
        for (index_t d = 0; d < D; ++d) y[((b * H + h) * S + s) * D + d] = x[((b * S + s) * H + h) * D + d];
  return y;
}

const std::vector<std::string> rope_cases = {
    "rope_llama2_default_half_d128",      "rope_interleaved_d128_theta1e6",
    "rope_partial_0.4_half_d80_phi2",     "rope_partial_gptj_d256_rot64_interleaved",
    "rope_linear_f8_longchat16k",         "rope_dynamic_ntk_f4_beyond_4096",
    "rope_dynamic_ntk_f4_within_4096",    "rope_yarn_f4_orig4096_truncate",
    "rope_llama31_f8_interleaved_gguf",   "rope_longrope_phi3_medium_short",
    "rope_longrope_phi3_medium_long",     "rope_default_theta1e6_near_2p18"};

posenc::rope_config base_config(index_t d = 128, double theta = 10000.0,
                                posenc::rope_layout layout = posenc::rope_layout::half) {
  return posenc::rope_config{.head_dim = d, .rope_theta = theta, .layout = layout};
}

/// theta_i = base^(-2i/d), the RoFormer frequencies, written out independently of the library.
double theta(double base, index_t i, index_t d) { return std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d)); }

/// Rotate one [d]-vector by positions * inv_freq in double: the textbook formula of FORMAT.md 5.2.
std::vector<double> rotate_formula(const std::vector<double>& x, double pos, const std::vector<double>& inv, bool interleaved,
                                   index_t rot, double scale = 1.0) {
  std::vector<double> y = x;
  const index_t h = rot / 2;
  for (index_t k = 0; k < h; ++k) {
    const index_t i1 = interleaved ? 2 * k : k, i2 = interleaved ? 2 * k + 1 : k + h;
    const double a = pos * inv[static_cast<std::size_t>(k)];
    const double c = std::cos(a) * scale, s = std::sin(a) * scale;
    y[i1] = x[i1] * c - x[i2] * s;
    y[i2] = x[i2] * c + x[i1] * s;
  }
  return y;
}

/// y = RoPE(x) for S tokens x H heads x D features (BSHD, batch 1) at positions first, first+1, ..:
/// every head against rotate_formula with the RoFormer frequencies over rotary_dim `rot`, the
/// pass-through tail bit-identical.
void check_rotated(const std::vector<double>& x, const std::vector<double>& y, index_t S, index_t H, index_t D, index_t rot,
                   double first, posenc::rope_layout layout, double tol) {
  std::vector<double> inv;
  for (index_t i = 0; i < rot / 2; ++i) inv.push_back(theta(10000.0, i, rot));  // theta over rotary_dim
  for (index_t s = 0; s < S; ++s)
    for (index_t h = 0; h < H; ++h) {
      const index_t o = (s * H + h) * D;
      std::vector<double> xt(x.begin() + o, x.begin() + o + D), yt(y.begin() + o, y.begin() + o + D);
      const auto want = rotate_formula(xt, first + static_cast<double>(s), inv,
                                       layout == posenc::rope_layout::interleaved, rot);
      CHECK(max_abs_diff(yt, want) <= tol);
      for (index_t j = rot; j < D; ++j) CHECK(yt[j] == xt[j]);  // bit-identical tail
    }
}

// ---- golden vectors --------------------------------------------------------------------------------

TEST_CASE("rope golden cases: inv_freq, scalars and outputs in every mode", "[rope][golden]") {
  const std::string name = GENERATE(from_range(rope_cases));
  INFO("case " << name);
  const golden::case_data gc = golden::load(name);
  const posenc::rope_config cfg = config_from(gc.params());
  const posenc::rope r(cfg);

  const auto& xt = gc.at("x");
  const index_t B = xt.shape[0], S = xt.shape[1], H = xt.shape[2], D = xt.shape[3];
  const std::vector<std::int64_t> pos_data = gc.at("positions").i64();
  const posenc::positions_view pos(pos_data.data(), B, S);
  const std::vector<double> x = xt.f64();

  // scalars
  const auto& sc = gc.meta.at("expected_scalars");
  CHECK(r.rotary_dim() == sc.at("rotary_dim").get<index_t>());
  const double att = sc.at("attention_scaling").get<double>();
  CHECK(std::abs(r.attention_factor() - att) <= 1e-12 * std::abs(att));
  if (!sc.at("seq_len_used").is_null()) CHECK(r.seq_len_for(pos) == sc.at("seq_len_used").get<std::int64_t>());
  const std::int64_t L = r.seq_len_for(pos);
  const posenc::rope_frequencies f = r.at(L);

  // inv_freq (double and HF float32)
  CHECK(violations(f.inv_freq(), gc.at("inv_freq").f64(), golden::tolerance(gc, "inv_freq")) == 0);
  if (gc.has("inv_freq_hf_float32")) {
    const auto exp32 = gc.at("inv_freq_hf_float32").f64();
    const auto got32 = to_double(f.inv_freq_hf_float32());
    CHECK(violations(got32, exp32, golden::tolerance(gc, "inv_freq_hf_float32")) == 0);
    // Stronger than the case's rtol 4e-6: the float32 operation sequence is reproduced bit for bit.
    CHECK(got32 == exp32);
  }

  const std::vector<double> expected = gc.at("out").f64();
  const golden::rule out_rule = golden::tolerance(gc, "out");

  SECTION("double, in place, BSHD, derived sequence length") {
    std::vector<double> y = x;
    r.apply(posenc::bshd(y.data(), B, S, H, D), pos);
    CHECK(violations(y, expected, out_rule) == 0);
  }
  SECTION("double, out of place BSHD -> BHSD, and BHSD in place") {
    std::vector<double> y(x.size(), -7.0);
    r.apply(posenc::bshd(x.data(), B, S, H, D), posenc::bhsd(y.data(), B, H, S, D), pos);
    CHECK(violations(y, bshd_to_bhsd(expected, B, S, H, D), out_rule) == 0);
    std::vector<double> z = bshd_to_bhsd(x, B, S, H, D);
    r.apply(posenc::bhsd(z.data(), B, H, S, D), pos);
    CHECK(violations(z, bshd_to_bhsd(expected, B, S, H, D), out_rule) == 0);
  }
  SECTION("double with a table (anchored angle-addition steps) within the case tolerance") {
    std::int64_t lo = pos_data[0], hi = pos_data[0];
    for (auto p : pos_data) lo = std::min(lo, p), hi = std::max(hi, p);
    const auto table = r.table<double>(lo, static_cast<index_t>(hi - lo + 1), L);
    std::vector<double> y = x, z = x;
    r.apply(posenc::bshd(y.data(), B, S, H, D), pos, table);
    r.apply(posenc::bshd(z.data(), B, S, H, D), pos);
    CHECK(violations(y, expected, out_rule) == 0);
    // differs from the table-free path only by the rounding of position * inv_freq (~1e-16 x position)
    CHECK(max_abs_diff(y, z) <= 1e-15 * static_cast<double>(std::max<std::int64_t>(hi, 1000)) * 8);
  }
  SECTION("float, exact angles: <= 1e-6 absolute against the float64 output") {
    std::vector<float> y(x.begin(), x.end());
    r.apply(posenc::bshd(y.data(), B, S, H, D), pos);
    const double dev = max_abs_diff(to_double(y), expected);
    INFO("max |float exact - float64| = " << dev);
    CHECK(dev <= 1e-6);
  }
  SECTION("float, hf_float32 angles against out_hf_float32") {
    if (!gc.has("out_hf_float32")) return;
    posenc::rope_config c32 = cfg;
    c32.angles = posenc::rope_angles::hf_float32;
    const posenc::rope r32(c32);
    std::vector<float> y(x.begin(), x.end());
    r32.apply(posenc::bshd(y.data(), B, S, H, D), pos);
    const auto exp32 = gc.at("out_hf_float32").f64();
    const double dev = max_abs_diff(to_double(y), exp32);
    const golden::rule rule32 = golden::tolerance(gc, "out_hf_float32");
    std::printf("%-44s out_hf_float32 max dev %.3g%s\n", name.c_str(), dev, rule32.informational ? " (informational)" : "");
    // Asserted for every case, also where the case marks it informational: inv_freq is bit-exact
    // (checked above), so only cos/sin rounding and the multiply-adds differ.
    CHECK(dev <= 2e-6);
  }
}

TEST_CASE("rope_attention golden: RoPE on q and k then causal GQA attention", "[rope][golden][attention]") {
  const golden::case_data gc = golden::load("rope_attention_gqa16x4_kvcache");
  const posenc::rope r(config_from(gc.params()));
  const auto& qt = gc.at("q");
  const auto& kt = gc.at("k");
  const auto& vt = gc.at("v");
  const index_t B = qt.shape[0], Sq = qt.shape[1], H = qt.shape[2], D = qt.shape[3];
  const index_t Sk = kt.shape[1], Hkv = kt.shape[2], Dv = vt.shape[3];
  const auto qp = gc.at("q_positions").i64();
  const auto kp = gc.at("k_positions").i64();
  const posenc::positions_view qpos(qp.data(), B, Sq), kpos(kp.data(), B, Sk);
  CHECK(r.rotary_dim() == gc.meta.at("expected_scalars").at("rotary_dim").get<index_t>());

  std::vector<double> q = qt.f64(), k = kt.f64();
  const std::vector<double> v = vt.f64();
  r.apply(posenc::bshd(q.data(), B, Sq, H, D), qpos);
  r.apply(posenc::bshd(k.data(), B, Sk, Hkv, D), kpos);
  CHECK(violations(q, gc.at("q_rot").f64(), golden::tolerance(gc, "q_rot")) == 0);
  CHECK(violations(k, gc.at("k_rot").f64(), golden::tolerance(gc, "k_rot")) == 0);
  CHECK(violations(r.inv_freq(), gc.at("inv_freq").f64(), golden::tolerance(gc, "inv_freq")) == 0);

  posenc::attention_options opt;
  opt.causal = gc.params().at("causal").get<bool>();
  opt.q_positions = qpos;
  opt.k_positions = kpos;
  std::vector<double> out(static_cast<std::size_t>(B * Sq * H * Dv));
  std::vector<double> probs(static_cast<std::size_t>(B * H * Sq * Sk));
  posenc::reference_attention<double>(posenc::bshd<const double>(q.data(), B, Sq, H, D),
                                      posenc::bshd<const double>(k.data(), B, Sk, Hkv, D),
                                      posenc::bshd<const double>(v.data(), B, Sk, Hkv, Dv),
                                      posenc::bshd(out.data(), B, Sq, H, Dv), opt, {},
                                      posenc::tensor_map<double, 4>(probs.data(), B, H, Sq, Sk));
  CHECK(violations(out, gc.at("out").f64(), golden::tolerance(gc, "out")) == 0);
  CHECK(violations(probs, gc.at("probs").f64(), golden::tolerance(gc, "probs")) == 0);

  SECTION("fused kernel with the rope encoding on the raw q, k") {
    const std::vector<double> q0 = qt.f64(), k0 = kt.f64();
    std::vector<double> fused(out.size(), -1.0);
    posenc::attention(posenc::bshd<const double>(q0.data(), B, Sq, H, D),
                      posenc::bshd<const double>(k0.data(), B, Sk, Hkv, D),
                      posenc::bshd<const double>(v.data(), B, Sk, Hkv, Dv), posenc::bshd(fused.data(), B, Sq, H, Dv),
                      r, opt);
    CHECK(violations(fused, gc.at("out").f64(), golden::tolerance(gc, "out")) == 0);
  }
}

// The interleaved rotation runs 8 lanes (4 pairs) at a time with a scalar loop for the rest:
// rotary dims around and below the vector width, in place, out of place and from a table.
TEST_CASE("rope: rotary dims off the vector width, both layouts, float and double", "[rope][partial]") {
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved})
    for (const index_t rot : {2, 6, 8, 10, 14, 18, 34}) {
      INFO("rotary_dim " << rot);
      const index_t D = rot + 4, S = 3, H = 2;
      posenc::rope_config c = base_config(D, 10000.0, layout);
      c.rotary_dim = rot;
      const posenc::rope r(c);
      const auto x = test_util::randn(S * H * D, static_cast<unsigned>(rot));
      const auto pos = posenc::contiguous_positions(1, S, 1000);
      std::vector<double> y = x;
      r.apply(posenc::bshd(y.data(), 1, S, H, D), posenc::view(pos));
      check_rotated(x, y, S, H, D, rot, 1000.0, layout, 1e-12);
      const auto t = r.table<float>(1000, S);
      std::vector<float> fx(x.begin(), x.end()), fi = fx, fo(fx.size()), ft = fx;
      r.apply(posenc::bshd(fi.data(), 1, S, H, D), posenc::view(pos));
      r.apply(posenc::bshd<const float>(fx.data(), 1, S, H, D), posenc::bshd(fo.data(), 1, S, H, D), posenc::view(pos));
      r.apply(posenc::bshd(ft.data(), 1, S, H, D), posenc::view(pos), t);
      CHECK(max_abs_diff(to_double(fi), y) <= 1e-5);
      CHECK(fo == fi);
      CHECK(max_abs_diff(to_double(ft), y) <= 1e-5);
    }
}

// ---- properties and closed forms -----------------------------------------------------------------

TEST_CASE("rope: q.k after rotation depends only on the position difference", "[rope]") {
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    const index_t D = 64;
    const posenc::rope r(base_config(D, 10000.0, layout));
    const auto q0 = test_util::randn(D, 1), k0 = test_util::randn(D, 2);
    auto dot_at = [&](std::int64_t pq, std::int64_t pk) {
      std::vector<double> q = q0, k = k0;
      const std::int64_t a[1] = {pq}, b[1] = {pk};
      r.apply(posenc::bshd(q.data(), 1, 1, 1, D), posenc::positions_view(a, 1, 1));
      r.apply(posenc::bshd(k.data(), 1, 1, 1, D), posenc::positions_view(b, 1, 1));
      double s = 0;
      for (index_t i = 0; i < D; ++i) s += q[i] * k[i];
      return s;
    };
    for (std::int64_t delta : {0, 1, 7, 100, -5}) {
      const double ref = dot_at(delta + 1000, 1000);
      for (std::int64_t base : {0, 13, 4096, 50000}) {
        if (base + delta < 0) continue;
        CHECK(std::abs(dot_at(base + delta, base) - ref) <= 1e-10);
      }
    }
    // and it is not trivially constant: a different difference gives a different score
    CHECK(std::abs(dot_at(10, 0) - dot_at(11, 0)) > 1e-6);
  }
}

TEST_CASE("rope: YaRN correction range with truncate true and false", "[rope][yarn]") {
  const index_t d = 128;
  const double base = 10000.0, factor = 4.0, orig = 4096.0;
  // corr(n) = d ln(orig / (2 pi n)) / (2 ln base), YaRN sec. 3.2 / HF find_correction_dim.
  auto corr = [&](double n) { return d * std::log(orig / (2 * std::numbers::pi * n)) / (2 * std::log(base)); };
  const double low_raw = corr(32), high_raw = corr(1);
  REQUIRE(low_raw == Approx(20.94).margin(0.01));
  REQUIRE(high_raw == Approx(45.03).margin(0.01));
  for (bool truncate : {true, false}) {
    INFO("truncate " << truncate);
    posenc::rope_config c = base_config(d, base);
    c.max_position_embeddings = 16384;
    c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = factor, .original_max_position_embeddings = 4096,
                 .truncate = truncate};
    const posenc::rope r(c);
    const double low = truncate ? std::floor(low_raw) : low_raw, high = truncate ? std::ceil(high_raw) : high_raw;
    const auto inv = r.inv_freq();
    for (index_t i = 0; i < d / 2; ++i) {
      const double t = theta(base, i, d);
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      const double want = t * (1 - ramp) + (t / factor) * ramp;
      CHECK(inv[i] == Approx(want).epsilon(1e-14));
      if (i <= 20) CHECK(inv[i] == Approx(t).epsilon(1e-15));                 // high frequencies kept
      if (i >= 46) CHECK(inv[i] == Approx(t / factor).epsilon(1e-15));        // low ones interpolated
    }
    // pair 21 sits inside the ramp either way, but at a different weight
    const double ramp21 = (21 - low) / (high - low);
    CHECK(inv[21] == Approx(theta(base, 21, d) * (1 - ramp21 + ramp21 / factor)).epsilon(1e-14));
    CHECK(r.attention_factor() == Approx(0.1 * std::log(factor) + 1).epsilon(1e-15));
  }
  // the two settings really differ
  posenc::rope_config a = base_config(d, base), b = base_config(d, base);
  a.scaling = {.rope_type = posenc::rope_type::yarn, .factor = factor, .original_max_position_embeddings = 4096};
  b.scaling = a.scaling;
  b.scaling.truncate = false;
  CHECK(posenc::rope(a).inv_freq()[21] != Approx(posenc::rope(b).inv_freq()[21]).epsilon(1e-6));
  // explicit attention_factor and DeepSeek's mscale ratio
  a.scaling.attention_factor = 0.75;
  CHECK(posenc::rope(a).attention_factor() == 0.75);
  a.scaling.attention_factor.reset();
  a.scaling.mscale = 0.707;
  a.scaling.mscale_all_dim = 0.707;
  CHECK(posenc::rope(a).attention_factor() == Approx(1.0).epsilon(1e-15));
}

TEST_CASE("rope: Llama-3.1 scaling boundaries (d=128, theta=5e5, factor 8)", "[rope][llama3]") {
  posenc::rope_config c = base_config(128, 5e5, posenc::rope_layout::half);
  c.max_position_embeddings = 131072;
  c.scaling = {.rope_type = posenc::rope_type::llama3, .factor = 8, .original_max_position_embeddings = 8192,
               .low_freq_factor = 1, .high_freq_factor = 4};
  const posenc::rope r(c);
  const auto inv = r.inv_freq();
  REQUIRE(inv.size() == 64);
  for (index_t i = 0; i < 64; ++i) {
    const double t = theta(5e5, i, 128);
    INFO("pair " << i);
    if (i <= 28) {
      CHECK(inv[i] == Approx(t).epsilon(1e-15));
    } else if (i <= 34) {
      CHECK(inv[i] < t * (1 - 1e-9));
      CHECK(inv[i] > t / 8 * (1 + 1e-9));
      const double s = (8192.0 * t / (2 * std::numbers::pi) - 1.0) / 3.0;  // Llama 3.1 smooth factor
      CHECK(inv[i] == Approx((1 - s) * t / 8 + s * t).epsilon(1e-14));
    } else {
      CHECK(inv[i] == Approx(t / 8).epsilon(1e-15));
    }
  }
  CHECK(r.attention_factor() == 1.0);
}

TEST_CASE("rope: LongRoPE switches factors strictly beyond the original length", "[rope][longrope]") {
  const index_t d = 16;
  posenc::rope_config c = base_config(d, 10000.0);
  c.max_position_embeddings = 131072;
  c.scaling.rope_type = posenc::rope_type::longrope;
  c.scaling.original_max_position_embeddings = 4096;
  for (index_t i = 0; i < d / 2; ++i) {
    c.scaling.short_factor.push_back(1.0 + 0.01 * static_cast<double>(i));
    c.scaling.long_factor.push_back(2.0 + 3.0 * static_cast<double>(i));
  }
  const posenc::rope r(c);
  auto expect = [&](const std::vector<double>& ext) {
    std::vector<double> v;
    for (index_t i = 0; i < d / 2; ++i) v.push_back(theta(10000.0, i, d) / ext[i]);
    return v;
  };
  CHECK(max_abs_diff(r.inv_freq(4096), expect(c.scaling.short_factor)) <= 1e-15);
  CHECK(max_abs_diff(r.inv_freq(4097), expect(c.scaling.long_factor)) <= 1e-15);
  CHECK(r.at(4096).seq_len() == 4096);
  // f = max_pos / orig = 32: sqrt(1 + ln 32 / ln 4096)
  CHECK(r.attention_factor() == Approx(std::sqrt(1 + std::log(32.0) / std::log(4096.0))).epsilon(1e-15));

  // apply derives L = max(positions) + 1 over the whole tensor (all batch rows)
  const auto x = test_util::randn(2 * 2 * d, 3);
  for (std::int64_t last : {4095, 4096}) {
    const std::int64_t p[4] = {0, 5, 1, last};  // batch 2, seq 2: the max is in the second row
    std::vector<double> y = x;
    r.apply(posenc::bshd(y.data(), 2, 2, 1, d), posenc::positions_view(p, 2, 2));
    const auto& ext = last + 1 > 4096 ? c.scaling.long_factor : c.scaling.short_factor;
    const auto inv = expect(ext);
    for (int t = 0; t < 4; ++t) {
      std::vector<double> xt(x.begin() + t * d, x.begin() + (t + 1) * d);
      const auto want = rotate_formula(xt, static_cast<double>(p[t]), inv, false, d, r.attention_factor());
      std::vector<double> got(y.begin() + t * d, y.begin() + (t + 1) * d);
      CHECK(max_abs_diff(got, want) <= 1e-12);
    }
  }
}

TEST_CASE("rope: dynamic NTK within and beyond max_position_embeddings", "[rope][dynamic]") {
  const index_t d = 64;
  posenc::rope_config c = base_config(d, 10000.0);
  c.max_position_embeddings = 2048;
  c.scaling = {.rope_type = posenc::rope_type::dynamic, .factor = 2};
  const posenc::rope r(c);
  std::vector<double> plain;
  for (index_t i = 0; i < d / 2; ++i) plain.push_back(theta(10000.0, i, d));
  CHECK(max_abs_diff(r.inv_freq(1), plain) <= 1e-16);
  CHECK(max_abs_diff(r.inv_freq(2048), plain) <= 1e-16);  // equal to the limit: unscaled
  for (std::int64_t L : {2049, 5000, 100000}) {
    const double base2 = 10000.0 * std::pow(2.0 * L / 2048.0 - 1.0, double(d) / (d - 2));
    std::vector<double> want;
    for (index_t i = 0; i < d / 2; ++i) want.push_back(theta(base2, i, d));
    const auto got = r.inv_freq(L);
    for (index_t i = 0; i < d / 2; ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-14));
    CHECK(got[d / 2 - 1] < plain[d / 2 - 1]);
  }
  // stateless: asking for a long length does not change a later short one
  (void)r.inv_freq(100000);
  CHECK(max_abs_diff(r.inv_freq(100), plain) <= 1e-16);
  // an explicit seq_len in the config replaces max(positions) + 1
  posenc::rope_config c2 = c;
  c2.seq_len = 5000;
  const std::int64_t p[1] = {3};
  CHECK(posenc::rope(c2).seq_len_for(posenc::positions_view(p, 1, 1)) == 5000);
  CHECK(r.seq_len_for(posenc::positions_view(p, 1, 1)) == 4);
}

TEST_CASE("rope: partial rotary in both layouts passes the tail through", "[rope][partial]") {
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    const index_t D = 80, rot = 32, S = 5, H = 3;
    posenc::rope_config c = base_config(D, 10000.0, layout);
    c.partial_rotary_factor = 0.4;
    const posenc::rope r(c);
    REQUIRE(r.rotary_dim() == rot);
    posenc::rope_config c_explicit = base_config(D, 10000.0, layout);
    c_explicit.rotary_dim = rot;
    const posenc::rope r_explicit(c_explicit);
    const auto x = test_util::randn(S * H * D, 4);
    const auto pos = posenc::contiguous_positions(1, S, 17);
    std::vector<double> y = x, z(x.size(), 0.0), w = x;
    r.apply(posenc::bshd(y.data(), 1, S, H, D), posenc::view(pos));
    r.apply(posenc::bshd<const double>(x.data(), 1, S, H, D), posenc::bshd(z.data(), 1, S, H, D), posenc::view(pos));
    r_explicit.apply(posenc::bshd(w.data(), 1, S, H, D), posenc::view(pos));
    CHECK(y == z);
    CHECK(y == w);
    check_rotated(x, y, S, H, D, rot, 17.0, layout, 1e-13);
  }
}

TEST_CASE("rope: proportional keeps the first p d / 2 frequencies of the whole head, the rest pass through",
          "[rope][proportional]") {
  // HF _compute_proportional_rope_parameters (Gemma 4's full layers: d = 512, p = 0.25, theta 1e6):
  // R = int(p * d // 2) pairs rotate with base^(-2i/d) / factor (the exponent over the whole head), the
  // other d/2 - R frequencies are 0; rotate_half pairs dim j with j + d/2 over the whole head.
  for (double factor : {1.0, 4.0}) {
    posenc::rope_config c = base_config(512, 1e6);
    c.partial_rotary_factor = 0.25;
    c.scaling = {.rope_type = posenc::rope_type::proportional};
    if (factor != 1.0) c.scaling.factor = factor;
    const posenc::rope r(c);
    CHECK(r.rotary_dim() == 512);
    const auto inv = r.inv_freq();
    REQUIRE(inv.size() == 256);
    for (index_t i = 0; i < 256; ++i) {
      const double want = i < 64 ? std::pow(1e6, -2.0 * static_cast<double>(i) / 512.0) / factor : 0.0;
      CHECK(inv[static_cast<std::size_t>(i)] == Approx(want).epsilon(1e-14).margin(0.0));
    }
    const auto x = test_util::randn(512, 31);
    for (std::int64_t p : {0, 7, 99999}) {
      INFO("position " << p << " factor " << factor);
      std::vector<double> y = x;
      r.apply(posenc::bshd(y.data(), 1, 1, 1, 512), posenc::positions_view(&p, 1, 1));
      const auto want = rotate_formula(x, static_cast<double>(p), inv, false, 512);
      CHECK(max_abs_diff(y, want) <= 1e-15 * static_cast<double>(p + 1) + 1e-15);
      for (index_t j = 64; j < 256; ++j) {  // frequency 0: cos 1, sin 0, both dims of the pair unchanged
        CHECK(y[static_cast<std::size_t>(j)] == x[static_cast<std::size_t>(j)]);
        CHECK(y[static_cast<std::size_t>(j + 256)] == x[static_cast<std::size_t>(j + 256)]);
      }
    }
  }
  // hf_float32: the same steps in float32 (arange(0, 2R, 2) / d, base ** that, reciprocal).
  posenc::rope_config c = base_config(512, 1e6);
  c.partial_rotary_factor = 0.25;
  c.scaling = {.rope_type = posenc::rope_type::proportional};
  const auto f32 = posenc::rope(c).at(0).inv_freq_hf_float32();
  for (index_t i = 0; i < 256; ++i)
    CHECK(f32[static_cast<std::size_t>(i)] ==
          (i < 64 ? 1.0f / std::pow(1e6f, static_cast<float>(2 * i) / 512.0f) : 0.0f));
  // R = int(0.3 * 10 // 2) = 1 of 5 pairs; an explicit rotary_dim other than head_dim is refused.
  posenc::rope_config small = base_config(10);
  small.partial_rotary_factor = 0.3;
  small.scaling = {.rope_type = posenc::rope_type::proportional};
  const auto si = posenc::rope(small).inv_freq();
  CHECK(si[0] == 1.0);
  for (std::size_t i = 1; i < 5; ++i) CHECK(si[i] == 0.0);
  small.rotary_dim = 4;
  CHECK_THROWS_WITH(posenc::rope(small),
                    Catch::Contains("rotary_dim: must be unset or head_dim for rope_type proportional"));
  CHECK(posenc::rope_type_from_string("proportional") == posenc::rope_type::proportional);
}

TEST_CASE("rope: invalid configurations throw posenc::error", "[rope][errors]") {
  auto bad = [](posenc::rope_config c) { CHECK_THROWS_AS(posenc::rope(c), posenc::error); };
  {
    posenc::rope_config c = base_config(64);
    c.rotary_dim = 63;  // odd
    CHECK_THROWS_WITH(posenc::rope(c), Catch::Contains("rotary_dim") && Catch::Contains("even"));
  }
  {
    posenc::rope_config c = base_config(10);
    c.partial_rotary_factor = 0.5;  // int(10 * 0.5) = 5: odd
    bad(c);
  }
  bad(base_config(0));
  {
    posenc::rope_config c = base_config(64);
    c.partial_rotary_factor = 1.5;
    bad(c);
    c.partial_rotary_factor = 1;
    c.rotary_dim = 66;
    bad(c);
    c.rotary_dim.reset();
    c.rope_theta = -1;
    bad(c);
  }
  {
    posenc::rope_config c = base_config(64);
    c.scaling = {.rope_type = posenc::rope_type::linear, .factor = 0.0};
    CHECK_THROWS_WITH(posenc::rope(c), Catch::Contains("factor"));
    c.scaling.factor.reset();
    bad(c);
    c.scaling = {.rope_type = posenc::rope_type::dynamic, .factor = 2};  // no max_position_embeddings
    bad(c);
    c.scaling = {.rope_type = posenc::rope_type::llama3, .factor = 8, .original_max_position_embeddings = 8192,
                 .low_freq_factor = 4, .high_freq_factor = 1};
    bad(c);
    c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = 4};  // no original / max_position_embeddings
    bad(c);
    c.scaling = {.rope_type = posenc::rope_type::longrope, .original_max_position_embeddings = 4096,
                 .short_factor = std::vector<double>(31, 1.0), .long_factor = std::vector<double>(32, 1.0)};
    c.max_position_embeddings = 8192;
    CHECK_THROWS_WITH(posenc::rope(c), Catch::Contains("short_factor") && Catch::Contains("31"));
    c.scaling.short_factor.push_back(1.0);
    CHECK_NOTHROW(posenc::rope(c));
    c.scaling.long_factor[3] = -1;
    bad(c);
  }
  CHECK_THROWS_AS(posenc::rope_type_from_string("ntk"), posenc::error);
}

TEST_CASE("rope: permuting a checkpoint's q/k rows turns half into interleaved", "[rope][layout]") {
  // Meta's checkpoints (interleaved) become HF's (half) by permuting the rows of Wq/Wk inside each head:
  // half index k <-> interleaved index 2k, half index k + d/2 <-> interleaved 2k + 1. So for any x,
  // interleaved(P x) = P half(x), and scores are unchanged.
  const index_t D = 64, S = 6, H = 2;
  const posenc::rope half(base_config(D, 5e5, posenc::rope_layout::half));
  const posenc::rope inter(base_config(D, 5e5, posenc::rope_layout::interleaved));
  auto permute = [&](const std::vector<double>& x) {
    std::vector<double> y(x.size());
    for (std::size_t o = 0; o < x.size(); o += D)
      for (index_t k = 0; k < D / 2; ++k) {
        y[o + 2 * k] = x[o + k];
        y[o + 2 * k + 1] = x[o + k + D / 2];
      }
    return y;
  };
  const auto x = test_util::randn(S * H * D, 5);
  const auto pos = posenc::contiguous_positions(1, S, 1000);
  std::vector<double> a = x, b = permute(x);
  half.apply(posenc::bshd(a.data(), 1, S, H, D), posenc::view(pos));
  inter.apply(posenc::bshd(b.data(), 1, S, H, D), posenc::view(pos));
  CHECK(max_abs_diff(permute(a), b) <= 1e-15);
}

TEST_CASE("rope: exact angles stay within 1e-6 in float up to position 2^24", "[rope][precision]") {
  const index_t D = 128;
  const posenc::rope r(base_config(D, 10000.0));
  posenc::rope_config c32 = base_config(D, 10000.0);
  c32.angles = posenc::rope_angles::hf_float32;
  const posenc::rope r32(c32);
  std::vector<std::int64_t> p = {0, 1, 4095, 65536, 1000000, 8388607, (1 << 24) - 1, 1 << 24};
  std::mt19937_64 g(6);
  for (int i = 0; i < 56; ++i) p.push_back(static_cast<std::int64_t>(g() % ((1u << 24) + 1)));
  const index_t S = static_cast<index_t>(p.size());
  // unit inputs: every pair (1, 0) rotated gives (cos, sin) of the angle
  std::vector<double> x(static_cast<std::size_t>(S * D));
  for (index_t s = 0; s < S; ++s)
    for (index_t j = 0; j < D; ++j) x[s * D + j] = j < D / 2 ? 1.0 : 0.0;
  std::vector<float> xf(x.begin(), x.end()), xh = xf;
  const posenc::positions_view pv(p.data(), 1, S);
  r.apply(posenc::bshd(xf.data(), 1, S, 1, D), pv);
  r32.apply(posenc::bshd(xh.data(), 1, S, 1, D), pv);
  double worst = 0, worst_hf = 0;
  for (index_t s = 0; s < S; ++s)
    for (index_t k = 0; k < D / 2; ++k) {
      const double a = static_cast<double>(p[s]) * theta(10000.0, k, D);  // float64 angle
      worst = std::max({worst, std::abs(xf[s * D + k] - std::cos(a)), std::abs(xf[s * D + k + D / 2] - std::sin(a))});
      worst_hf = std::max(worst_hf, std::abs(xh[s * D + k] - std::cos(a)));
    }
  INFO("exact " << worst << ", hf_float32 " << worst_hf);
  CHECK(worst <= 1e-6);
  CHECK(worst_hf > 1e-2);  // what the float32 angle costs at large positions (documented contrast)
}

TEST_CASE("rope: table equals no table, both layouts, float and double", "[rope][table]") {
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    posenc::rope_config c = base_config(96, 1e6, layout);
    c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = 8, .original_max_position_embeddings = 4096};
    const posenc::rope r(c);
    const index_t B = 2, S = 7, H = 3, D = 96;
    const auto x = test_util::randn(B * S * H * D, 7);
    posenc::positions pos(B, S);
    for (index_t b = 0; b < B; ++b)
      for (index_t s = 0; s < S; ++s) pos(b, s) = 100 + 37 * s + 5 * b;
    const auto td = r.table<double>(100, 300);
    std::vector<double> a = x, bb = x;
    r.apply(posenc::bshd(a.data(), B, S, H, D), posenc::view(pos), td);
    r.apply(posenc::bshd(bb.data(), B, S, H, D), posenc::view(pos));
    CHECK(max_abs_diff(a, bb) <= 1e-13);
    const auto tf = r.table<float>(100, 300);
    std::vector<float> fa(x.begin(), x.end()), fb = fa, fo(x.size());
    r.apply(posenc::bshd(fa.data(), B, S, H, D), posenc::view(pos), tf);
    r.apply(posenc::bshd(fb.data(), B, S, H, D), posenc::view(pos));
    r.apply(posenc::bshd<const float>(fb.data(), B, S, H, D), posenc::bshd(fo.data(), B, S, H, D), posenc::view(pos), tf);
    CHECK(max_abs_diff(to_double(fa), to_double(fb)) <= 1e-6);
    CHECK(max_abs_diff(to_double(fa), a) <= 2e-6);
    CHECK(tf.bytes() == 300 * 96 * sizeof(float));  // rotary_dim values per position in both layouts
  }
}

TEST_CASE("rope: strided views (the k heads of a fused QKV buffer) rotate as dense copies do", "[rope][view]") {
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    const posenc::rope r(base_config(64, 10000.0, layout));
    const index_t B = 2, S = 6, H = 4, Hkv = 2, D = 64, W = H + 2 * Hkv;
    const auto x = test_util::randn(B * S * W * D, 10);
    posenc::positions pos(B, S);
    for (index_t b = 0; b < B; ++b)
      for (index_t s = 0; s < S; ++s) pos(b, s) = 30 + 3 * s - b;
    // dense copy of the k heads, rotated
    std::vector<double> dense(static_cast<std::size_t>(B * S * Hkv * D));
    const auto fused0 = posenc::bshd<const double>(x.data(), B, S, W, D).slice_heads(H, Hkv);
    const auto dk = posenc::bshd(dense.data(), B, S, Hkv, D);
    for (index_t b = 0; b < B; ++b)
      for (index_t s = 0; s < S; ++s)
        for (index_t h = 0; h < Hkv; ++h)
          for (index_t d = 0; d < D; ++d) dk(b, s, h, d) = fused0(b, s, h, d);
    r.apply(dk, posenc::view(pos));
    // in place on the fused buffer's k heads: q and v untouched
    std::vector<double> y = x;
    const auto fused = posenc::bshd(y.data(), B, S, W, D);
    r.apply(fused.slice_heads(H, Hkv), posenc::view(pos));
    // out of place from the fused buffer into a padded cache
    std::vector<double> cache(static_cast<std::size_t>(B * (S + 2) * (Hkv * D + 5)), -7.0);
    const auto kc = posenc::strided(cache.data(), B, S, Hkv, D,
                                    {.batch = (S + 2) * (Hkv * D + 5), .token = Hkv * D + 5, .head = D});
    r.apply(fused0, kc, posenc::view(pos));
    double worst = 0;
    index_t changed_outside = 0;
    for (index_t b = 0; b < B; ++b)
      for (index_t s = 0; s < S; ++s)
        for (index_t h = 0; h < W; ++h)
          for (index_t d = 0; d < D; ++d) {
            if (h >= H && h < H + Hkv) {
              worst = std::max(worst, std::abs(fused(b, s, h, d) - dk(b, s, h - H, d)));
              worst = std::max(worst, std::abs(kc(b, s, h - H, d) - dk(b, s, h - H, d)));
            } else {
              changed_outside +=
                  fused(b, s, h, d) != x[static_cast<std::size_t>(&fused(b, s, h, d) - y.data())] ? 1 : 0;
            }
          }
    CHECK(worst == 0.0);
    CHECK(changed_outside == 0);
    CHECK(std::count(cache.begin(), cache.end(), -7.0) == static_cast<long>(cache.size()) - B * S * Hkv * D);
    // in and out the same buffer with other strides overlap: refused
    CHECK_THROWS_WITH(r.apply(posenc::heads_view<const double>(fused.slice_heads(H, Hkv)),
                              fused.slice_heads(H + 1, Hkv), posenc::view(pos)),
                      Catch::Contains("must not overlap in"));
  }
}

TEST_CASE("rope: shift(k, delta) equals applying at position + delta", "[rope][shift]") {
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    posenc::rope_config c = base_config(64, 10000.0, layout);
    c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = 4, .original_max_position_embeddings = 2048};
    const posenc::rope r(c);  // attention factor 1.1386: must not be applied twice
    const index_t S = 9, H = 2, D = 64;
    const auto x = test_util::randn(S * H * D, 8);
    for (std::int64_t delta : {-300, 0, 5, 4000}) {
      const auto p0 = posenc::contiguous_positions(1, S, 500);
      const auto p1 = posenc::contiguous_positions(1, S, 500 + delta);
      std::vector<double> a = x, b = x;
      r.apply(posenc::bshd(a.data(), 1, S, H, D), posenc::view(p0));
      r.shift(posenc::bshd(a.data(), 1, S, H, D), delta);
      r.apply(posenc::bshd(b.data(), 1, S, H, D), posenc::view(p1));
      CHECK(max_abs_diff(a, b) <= 1e-12);
      std::vector<float> fa(x.begin(), x.end()), fb = fa;
      r.apply(posenc::bshd(fa.data(), 1, S, H, D), posenc::view(p0));
      r.shift(posenc::bshd(fa.data(), 1, S, H, D), delta);
      r.apply(posenc::bshd(fb.data(), 1, S, H, D), posenc::view(p1));
      CHECK(max_abs_diff(to_double(fa), to_double(fb)) <= 3e-6);
    }
  }
}

/// Half a unit in the last place of S (f16 or bf16) at the magnitude of e: the largest distance from e
/// to e rounded to nearest in S, normal or subnormal.
template <class S>
double half_ulp(double e) {
  constexpr int mantissa = std::is_same_v<S, Eigen::half> ? 10 : 7;
  constexpr int min_exp = std::is_same_v<S, Eigen::half> ? -14 : -126;  // the smallest normal's exponent
  int ex = 0;
  (void)std::frexp(e, &ex);  // |e| in [2^(ex-1), 2^ex)
  return std::ldexp(1.0, std::max(ex - 1, min_exp) - mantissa - 1);
}

/// Every element of `got` (stored in S) is the double `want` rounded to nearest in S, within `slack` of
/// a rounding midpoint (the float rotation's own error); returns the elements that are not exactly the
/// nearest S of the double value (ties of the two roundings), for a count.
template <class S>
std::size_t check_rounded(const std::vector<S>& got, const std::vector<double>& want, double slack) {
  REQUIRE(got.size() == want.size());
  std::size_t off = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(static_cast<float>(got[i]));
    CHECK(std::abs(g - want[i]) <= half_ulp<S>(want[i]) + slack);
    if (g != static_cast<double>(static_cast<float>(S(static_cast<float>(want[i]))))) ++off;
  }
  return off;
}

TEMPLATE_TEST_CASE(
    "rope: keys rotated into a half-precision cache and shifted there are the double rotation rounded once",
    "[rope][half][shift]", Eigen::half, Eigen::bfloat16) {
  using S = TestType;
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    for (index_t rot : {64, 48}) {  // full and partial rotary (a pass-through tail of 16)
      posenc::rope_config c = base_config(64, 10000.0, layout);
      c.rotary_dim = rot;
      const posenc::rope r(c);
      std::vector<double> inv;
      for (index_t i = 0; i < rot / 2; ++i) inv.push_back(theta(10000.0, i, rot));
      const bool il = layout == posenc::rope_layout::interleaved;
      // A preallocated cache [1, Hkv, capacity, D] (BHSD, as a Hugging Face static cache) holding n tokens;
      // the new tokens are rotated at positions first.. and stored in the slots after them.
      const index_t Hkv = 3, D = 64, capacity = 40, n = 11, fresh = 5;
      const std::int64_t first = 70000;
      const auto x = test_util::randn(static_cast<std::size_t>(fresh * Hkv * D), 21, 3.0);
      const std::vector<float> xf(x.begin(), x.end());
      const S sentinel = S(30000.0f);  // far above any rotated value
      std::vector<S> cache(static_cast<std::size_t>(Hkv * capacity * D), sentinel);
      const auto slots = posenc::bhsd(cache.data(), 1, Hkv, capacity, D).slice_tokens(n, fresh);
      const auto pos = posenc::contiguous_positions(1, fresh, first);
      r.apply(posenc::bshd<const float>(xf.data(), 1, fresh, Hkv, D), slots, posenc::view(pos));

      std::vector<S> got;
      std::vector<double> want;
      for (index_t t = 0; t < fresh; ++t)
        for (index_t h = 0; h < Hkv; ++h) {
          const std::vector<double> row(xf.begin() + (t * Hkv + h) * D, xf.begin() + (t * Hkv + h + 1) * D);
          const auto w = rotate_formula(row, static_cast<double>(first + t), inv, il, rot);
          for (index_t d = 0; d < D; ++d) {
            got.push_back(slots(0, t, h, d));
            want.push_back(w[static_cast<std::size_t>(d)]);
          }
          for (index_t d = rot; d < D; ++d)
            CHECK(slots(0, t, h, d) == S(xf[static_cast<std::size_t>((t * Hkv + h) * D + d)]));
        }
      // The float rotation of values up to ~12 at positions near 7e4 is within 2e-5 of the double one.
      CHECK(check_rounded(got, want, 2e-5) <= got.size() / 100);
      // Slots outside the new tokens' are not written.
      std::size_t written = 0;
      for (const S& e : cache) written += !(e == sentinel);
      CHECK(written == static_cast<std::size_t>(fresh * Hkv * D));

      // Context shifting in place on the half-precision slots: the stored keys rotated by delta in
      // double, rounded once.
      for (std::int64_t delta : {-65000, 3}) {
        std::vector<S> before(cache);
        r.shift(slots, delta);
        std::vector<S> shifted;
        std::vector<double> expect;
        const auto old = posenc::bhsd<const S>(before.data(), 1, Hkv, capacity, D).slice_tokens(n, fresh);
        for (index_t t = 0; t < fresh; ++t)
          for (index_t h = 0; h < Hkv; ++h) {
            std::vector<double> row(static_cast<std::size_t>(D));
            for (index_t d = 0; d < D; ++d) row[static_cast<std::size_t>(d)] = static_cast<float>(old(0, t, h, d));
            const auto w = rotate_formula(row, static_cast<double>(delta), inv, il, rot);
            for (index_t d = 0; d < D; ++d) {
              shifted.push_back(slots(0, t, h, d));
              expect.push_back(w[static_cast<std::size_t>(d)]);
            }
            for (index_t d = rot; d < D; ++d) CHECK(slots(0, t, h, d) == old(0, t, h, d));  // tail untouched
          }
        CHECK(check_rounded(shifted, expect, 2e-5) <= shifted.size() / 100);
        written = 0;
        for (const S& e : cache) written += !(e == sentinel);
        CHECK(written == static_cast<std::size_t>(fresh * Hkv * D));
      }
    }
  }
}

TEMPLATE_TEST_CASE("rope: NaN reaches a half-precision cache; a wrong out shape writes nothing", "[rope][half][errors]",
                   Eigen::half, Eigen::bfloat16) {
  using S = TestType;
  const posenc::rope r(base_config(32));
  const index_t T = 3, H = 2, D = 32;
  const auto x = test_util::randn(static_cast<std::size_t>(T * H * D), 22);
  std::vector<float> xf(x.begin(), x.end());
  // token 1, head 1, dimension 5
  xf[static_cast<std::size_t>((1 * H + 1) * D + 5)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<S> out(xf.size(), S(0.0f));
  const auto pos = posenc::contiguous_positions(1, T, 9);
  r.apply(posenc::bshd<const float>(xf.data(), 1, T, H, D), posenc::bshd(out.data(), 1, T, H, D), posenc::view(pos));
  const auto o = posenc::bshd<const S>(out.data(), 1, T, H, D);
  // dims 5 and 5 + 16 form the pair (half layout): both NaN; every other value finite
  for (index_t t = 0; t < T; ++t)
    for (index_t h = 0; h < H; ++h)
      for (index_t d = 0; d < D; ++d) {
        const bool nan_pair = t == 1 && h == 1 && (d == 5 || d == 21);
        CHECK(std::isnan(static_cast<float>(o(0, t, h, d))) == nan_pair);
      }
  r.shift(posenc::bshd(out.data(), 1, T, H, D), 4);
  CHECK(std::isnan(static_cast<float>(o(0, 1, 1, 5))));
  CHECK(std::isnan(static_cast<float>(o(0, 1, 1, 21))));
  // out of another shape: refused before anything is written
  std::vector<S> small(static_cast<std::size_t>(T * D), S(2.0f));
  CHECK_THROWS_WITH(r.apply(posenc::bshd<const float>(xf.data(), 1, T, H, D), posenc::bshd(small.data(), 1, T, 1, D),
                            posenc::view(pos)),
                    Catch::Contains("out") && Catch::Contains("must have the shape of in"));
  CHECK(std::all_of(small.begin(), small.end(), [](S v) { return static_cast<float>(v) == 2.0f; }));
  // a head_dim other than the rope's
  std::vector<S> k16(static_cast<std::size_t>(T * H * 16), S(2.0f));
  CHECK_THROWS_WITH(r.shift(posenc::bshd(k16.data(), 1, T, H, 16), 1), Catch::Contains("k: head_dim"));
  CHECK(std::all_of(k16.begin(), k16.end(), [](S v) { return static_cast<float>(v) == 2.0f; }));
}

TEST_CASE("rope: errors leave the outputs untouched", "[rope][errors]") {
  const posenc::rope r(base_config(32));
  const index_t S = 4, H = 2, D = 32;
  const auto x = test_util::randn(S * H * D, 9);
  const auto pos = posenc::contiguous_positions(1, S);
  std::vector<double> y = x;
  // wrong head_dim
  CHECK_THROWS_WITH(r.apply(posenc::bshd(y.data(), 1, S * 2, H, D / 2), posenc::view(pos)), Catch::Contains("head_dim"));
  CHECK(y == x);
  // positions of the wrong shape
  const auto pos_bad = posenc::contiguous_positions(1, S + 1);
  CHECK_THROWS_WITH(r.apply(posenc::bshd(y.data(), 1, S, H, D), posenc::view(pos_bad)), Catch::Contains("positions"));
  CHECK(y == x);
  // a table that misses a position
  const auto t = r.table<double>(0, S - 1);
  CHECK_THROWS_WITH(r.apply(posenc::bshd(y.data(), 1, S, H, D), posenc::view(pos), t), Catch::Contains("cover"));
  CHECK(y == x);
  // a table of other frequencies
  const posenc::rope other(base_config(32, 500.0));
  const auto t_other = other.table<double>(0, S);
  CHECK_THROWS_WITH(r.apply(posenc::bshd(y.data(), 1, S, H, D), posenc::view(pos), t_other), Catch::Contains("table"));
  CHECK(y == x);
  // out of place: out of another shape, or overlapping in
  std::vector<double> out(x.size(), 3.0);
  CHECK_THROWS_AS(r.apply(posenc::bshd<const double>(x.data(), 1, S, H, D), posenc::bshd(out.data(), 1, S, 1, D),
                          posenc::view(pos)),
                  posenc::error);
  CHECK(std::all_of(out.begin(), out.end(), [](double v) { return v == 3.0; }));
  CHECK_THROWS_AS(r.apply(posenc::bshd<const double>(y.data(), 1, S, H, D), posenc::bshd(y.data() + 1, 1, S, H, D),
                          posenc::view(pos)),
                  posenc::error);
  CHECK(y == x);
  // apply_qk checks both before rotating either
  std::vector<double> q = x, k = x;
  CHECK_THROWS_AS(r.apply_qk(posenc::bshd(q.data(), 1, S, H, D), posenc::bshd(k.data(), 1, S / 2, H, D), posenc::view(pos)),
                  posenc::error);
  CHECK(q == x);
}

TEST_CASE("rope: a head_dim that differs from the call's throws before attention writes, with and without a pool",
          "[rope][errors]") {
  // The rope is for head_dim 64, the call's q and k have 32. The check lives in bind, on the calling
  // thread: with a pool it used to fail inside a worker's transform and end in std::terminate.
  const posenc::rope r(base_config(64));
  const posenc::rope_frequencies f = r.at(0);
  const index_t S = 40, H = 4, D = 32;
  const auto q = test_util::randn(S * H * D, 3), k = test_util::randn(S * H * D, 4), v = test_util::randn(S * H * D, 5);
  for (int threads : {1, 2, 8}) {
    Eigen::ThreadPool pool(threads);
    posenc::attention_options opt;
    opt.causal = true;
    opt.q_block = 8;
    opt.pool = &pool;
    std::vector<double> out(q.size(), 7.0);
    auto call = [&](const auto& enc) {
      posenc::attention<double>(posenc::bshd<const double>(q.data(), 1, S, H, D), posenc::bshd<const double>(k.data(), 1, S, H, D),
                                posenc::bshd<const double>(v.data(), 1, S, H, D), posenc::bshd(out.data(), 1, S, H, D), enc,
                                opt);
    };
    CHECK_THROWS_WITH(call(r), Catch::Contains("rope") && Catch::Contains("head_dim"));
    CHECK_THROWS_AS(call(f), posenc::error);  // the frequencies used as an encoding directly
    CHECK(std::all_of(out.begin(), out.end(), [](double x) { return x == 7.0; }));
  }
}

TEST_CASE("rope: kernel hooks — transform_qk and bind agree with apply", "[rope][hooks]") {
  static_assert(posenc::has_qk_transform<posenc::rope, float> && posenc::has_qk_transform<posenc::rope, double>);
  static_assert(posenc::has_bind<posenc::rope> && posenc::attention_encoding<posenc::rope>);
  static_assert(posenc::has_qk_transform<posenc::rope_frequencies, float>);
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    posenc::rope_config c = base_config(64, 10000.0, layout);
    c.max_position_embeddings = 64;
    c.scaling = {.rope_type = posenc::rope_type::dynamic, .factor = 2};
    const posenc::rope r(c);
    const index_t B = 1, S = 100, H = 3, D = 64;
    const auto x = test_util::randn(B * S * H * D, 10);
    const auto pos = posenc::contiguous_positions(B, S);  // L = 100 > 64: scaled
    std::vector<double> want = x;
    r.apply(posenc::bshd(want.data(), B, S, H, D), posenc::view(pos));

    posenc::call_info info;
    info.batch = B;
    info.heads = info.kv_heads = H;
    info.q_len = info.k_len = S;
    info.head_dim = info.value_dim = D;
    info.q_positions = info.k_positions = posenc::view(pos);
    info.q_min = info.k_min = 0;
    info.q_max = info.k_max = S - 1;
    const posenc::rope_frequencies bound = r.bind(info);
    CHECK(bound.seq_len() == S);
    std::vector<double> got = x;
    std::vector<float> gotf(x.begin(), x.end());
    const auto view = posenc::bshd(got.data(), B, S, H, D);
    const auto viewf = posenc::bshd(gotf.data(), B, S, H, D);
    for (index_t h = 0; h < H; ++h) {
      const std::span<const std::int64_t> p(pos.data(), static_cast<std::size_t>(S));
      bound.transform_qk(posenc::qk_role::query, h, p, view.matrix(0, h));
      bound.transform_qk(posenc::qk_role::key, h, p, viewf.matrix(0, h));
    }
    CHECK(max_abs_diff(got, want) <= 1e-13);  // the call table steps angles by addition (~1e-16 each)
    CHECK(max_abs_diff(to_double(gotf), want) <= 1e-6);

    // without bind: config seq_len, else unscaled
    std::vector<double> plain = x;
    const posenc::rope r_plain(base_config(64, 10000.0, layout));
    r_plain.apply(posenc::bshd(plain.data(), B, S, H, D), posenc::view(pos));
    std::vector<double> hooked = x;
    const auto hv = posenc::bshd(hooked.data(), B, S, H, D);
    for (index_t h = 0; h < H; ++h)
      r.transform_qk(posenc::qk_role::key, h, std::span<const std::int64_t>(pos.data(), S), hv.matrix(0, h));
    CHECK(hooked == plain);
  }
}

TEST_CASE("rope: fused attention equals the reference on pre-rotated q and k", "[rope][attention]") {
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    posenc::rope_config c = base_config(32, 10000.0, layout);
    c.partial_rotary_factor = 0.5;
    c.max_position_embeddings = 64;
    c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = 4, .original_max_position_embeddings = 16};
    const posenc::rope r(c);
    const index_t B = 2, Sq = 9, Sk = 30, H = 4, Hkv = 2, D = 32;
    const auto q = test_util::randn(B * Sq * H * D, 11), k = test_util::randn(B * Sk * Hkv * D, 12),
               v = test_util::randn(B * Sk * Hkv * D, 13);
    const auto qpos = posenc::contiguous_positions(B, Sq, Sk - Sq), kpos = posenc::contiguous_positions(B, Sk);
    posenc::attention_options opt;
    opt.causal = true;
    opt.q_positions = posenc::view(qpos);
    opt.k_positions = posenc::view(kpos);
    std::vector<double> qr = q, kr = k, want(B * Sq * H * D), got(want.size(), -1.0);
    r.apply(posenc::bshd(qr.data(), B, Sq, H, D), posenc::view(qpos));
    r.apply(posenc::bshd(kr.data(), B, Sk, Hkv, D), posenc::view(kpos));
    posenc::reference_attention<double>(posenc::bshd<const double>(qr.data(), B, Sq, H, D),
                                        posenc::bshd<const double>(kr.data(), B, Sk, Hkv, D),
                                        posenc::bshd<const double>(v.data(), B, Sk, Hkv, D),
                                        posenc::bshd(want.data(), B, Sq, H, D), opt);
    posenc::attention(posenc::bshd<const double>(q.data(), B, Sq, H, D),
                      posenc::bshd<const double>(k.data(), B, Sk, Hkv, D),
                      posenc::bshd<const double>(v.data(), B, Sk, Hkv, D), posenc::bshd(got.data(), B, Sq, H, D), r,
                      opt);
    CHECK(max_abs_diff(got, want) <= 1e-12);
  }
}

// A KV cache of keys rotated once, when appended: queries_only() rotates the queries and reads the keys
// as they are; both strategies (decode rows, tiled prefill), a float and an f16 cache, and a cache
// shifted by delta (context shifting) used with queries shifted by the same delta.
TEST_CASE("rope: queries_only() over keys rotated when appended equals the reference", "[rope][attention][decode]") {
  for (auto layout : {posenc::rope_layout::half, posenc::rope_layout::interleaved}) {
    posenc::rope_config c = base_config(64, 10000.0, layout);
    c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = 4, .original_max_position_embeddings = 512};
    c.max_position_embeddings = 4096;
    const posenc::rope r(c);
    const index_t B = 1, Sk = 1500, H = 8, Hkv = 2, D = 64;
    for (const index_t Sq : {index_t{1}, index_t{3}, index_t{80}}) {
      INFO("Sq " << Sq << (layout == posenc::rope_layout::half ? " half" : " interleaved"));
      const auto q = test_util::randn(B * Sq * H * D, 21), k = test_util::randn(B * Sk * Hkv * D, 22),
                 v = test_util::randn(B * Sk * Hkv * D, 23);
      const auto qpos = posenc::contiguous_positions(B, Sq, Sk - Sq), kpos = posenc::contiguous_positions(B, Sk);
      posenc::attention_options opt{.causal = true, .q_offset = Sk - Sq};
      std::vector<double> qr = q, kr = k, want(B * Sq * H * D), got(want.size(), -1.0);
      r.apply(posenc::bshd(qr.data(), B, Sq, H, D), posenc::view(qpos));
      r.apply(posenc::bshd(kr.data(), B, Sk, Hkv, D), posenc::view(kpos));  // the cache, rotated once
      posenc::reference_attention<double>(posenc::bshd<const double>(qr.data(), B, Sq, H, D),
                                          posenc::bshd<const double>(kr.data(), B, Sk, Hkv, D),
                                          posenc::bshd<const double>(v.data(), B, Sk, Hkv, D),
                                          posenc::bshd(want.data(), B, Sq, H, D), opt);
      posenc::attention(posenc::bshd<const double>(q.data(), B, Sq, H, D), posenc::bshd<const double>(kr.data(), B, Sk, Hkv, D),
                        posenc::bshd<const double>(v.data(), B, Sk, Hkv, D), posenc::bshd(got.data(), B, Sq, H, D),
                        r.queries_only(), opt);
      CHECK(max_abs_diff(got, want) <= 1e-12);

      // float, with the cache in f16: the reference sees the stored (rounded) keys and values
      std::vector<Eigen::half> kh(kr.size()), vh(v.size());
      std::vector<double> kd(kr.size()), vd(v.size());
      for (std::size_t i = 0; i < kr.size(); ++i) {
        kh[i] = Eigen::half(static_cast<float>(kr[i]));
        kd[i] = static_cast<double>(static_cast<float>(kh[i]));
        vh[i] = Eigen::half(static_cast<float>(v[i]));
        vd[i] = static_cast<double>(static_cast<float>(vh[i]));
      }
      std::vector<float> qf(q.begin(), q.end()), gotf(want.size());
      std::vector<double> qfr(qf.begin(), qf.end());
      r.apply(posenc::bshd(qfr.data(), B, Sq, H, D), posenc::view(qpos));
      posenc::reference_attention<double>(posenc::bshd<const double>(qfr.data(), B, Sq, H, D),
                                          posenc::bshd<const double>(kd.data(), B, Sk, Hkv, D),
                                          posenc::bshd<const double>(vd.data(), B, Sk, Hkv, D),
                                          posenc::bshd(want.data(), B, Sq, H, D), opt);
      posenc::attention<float, Eigen::half>(posenc::bshd<const float>(qf.data(), B, Sq, H, D),
                                            posenc::bshd<const Eigen::half>(kh.data(), B, Sk, Hkv, D),
                                            posenc::bshd<const Eigen::half>(vh.data(), B, Sk, Hkv, D),
                                            posenc::bshd(gotf.data(), B, Sq, H, D), r.queries_only(), opt);
      CHECK(max_abs_diff(std::vector<double>(gotf.begin(), gotf.end()), want) <= 2e-5);

      // context shifting: the cache shifted by delta and the queries placed delta later give the same
      // attention (scores depend on the distance only)
      const std::int64_t delta = 700;
      std::vector<double> ks = kr, shifted(want.size());
      r.shift(posenc::bshd(ks.data(), B, Sk, Hkv, D), delta);
      posenc::attention_options later = opt;
      later.q_offset += delta;
      std::vector<std::int64_t> kpos_later(static_cast<std::size_t>(Sk));
      for (index_t j = 0; j < Sk; ++j) kpos_later[static_cast<std::size_t>(j)] = j + delta;
      later.k_positions = posenc::positions_view(kpos_later.data(), 1, Sk);
      posenc::attention(posenc::bshd<const double>(q.data(), B, Sq, H, D), posenc::bshd<const double>(ks.data(), B, Sk, Hkv, D),
                        posenc::bshd<const double>(v.data(), B, Sk, Hkv, D), posenc::bshd(shifted.data(), B, Sq, H, D),
                        r.queries_only(), later);
      CHECK(max_abs_diff(shifted, got) <= 1e-11);
    }
  }
}

}  // namespace
