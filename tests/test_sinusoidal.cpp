// Sinusoidal absolute encoding: golden tables (FORMAT.md 5.1), closed forms written here
// independently (both layouts, both schedules, odd d_model, negative and fractional positions), and
// add_to on [batch, seq, d_model] with per-token positions.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "golden.hpp"
#include "posenc/sinusoidal.hpp"

using posenc::frequency_schedule;
using idx = posenc::index_t;
using posenc::sinusoid_layout;

static_assert(posenc::input_encoding<posenc::sinusoidal>);
static_assert(posenc::encoding<posenc::sinusoidal>);
static_assert(!posenc::attention_encoding<posenc::sinusoidal>);

namespace {

// Independent closed form of one table entry (channel c of position p).
double closed_form(double p, idx c, idx d, double base, sinusoid_layout layout, frequency_schedule schedule) {
  const idx n = d / 2;
  if (c >= 2 * n) return 0.0;  // odd d_model: zero channel last
  idx i = 0;
  bool is_sin = true;
  if (layout == sinusoid_layout::interleaved) {
    i = c / 2;
    is_sin = c % 2 == 0;
  } else {  // two halves: sin first (concat) or cos first (concat_cos_sin, MusicGen's torch.cat([cos, sin]))
    i = c < n ? c : c - n;
    is_sin = (c < n) == (layout == sinusoid_layout::concat);
  }
  double w = 0;
  if (schedule == frequency_schedule::vaswani) {
    w = 1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(d));
  } else {
    w = std::exp(-static_cast<double>(i) * std::log(base) / std::max<double>(static_cast<double>(n - 1), 1.0));
  }
  return is_sin ? std::sin(p * w) : std::cos(p * w);
}

void check_golden(const std::string& name) {
  const auto c = golden::load(name);
  const auto& prm = c.params();
  const idx d = prm.at("d_model").get<idx>();
  const double base = prm.contains("base") && !prm.at("base").is_null() ? prm.at("base").get<double>() : 10000.0;
  const auto layout =
      prm.at("layout").get<std::string>() == "concat" ? sinusoid_layout::concat : sinusoid_layout::interleaved;
  const auto schedule = prm.contains("schedule") && prm.at("schedule").get<std::string>() == "t2t"
                            ? frequency_schedule::t2t
                            : frequency_schedule::vaswani;
  posenc::sinusoidal pe({.d_model = d, .base = base, .layout = layout, .schedule = schedule});
  const auto pos = c.at("positions").f64();
  const auto expected = c.at("table").f64();
  const auto rule = golden::tolerance(c, "table");
  REQUIRE_FALSE(rule.exact);
  const auto table = pe.table<double>(pos);
  REQUIRE(table.dimension(0) == static_cast<idx>(pos.size()));
  REQUIRE(table.dimension(1) == d);
  double worst = 0;
  for (std::size_t e = 0; e < expected.size(); ++e) {
    const double err = std::abs(table.data()[e] - expected[e]);
    worst = std::max(worst, err);
    if (!rule.informational) REQUIRE(err <= rule.atol + rule.rtol * std::abs(expected[e]));
  }
  INFO(name << " worst abs error " << worst);
  SUCCEED();
}

}  // namespace

TEST_CASE("sinusoidal: golden interleaved Transformer-big table (positions up to 2^19)", "[sinusoidal][golden]") {
  check_golden("sinusoidal_interleaved_d1024_transformer_big");
}

TEST_CASE("sinusoidal: golden concat Transformer-XL table (d_model 410, pos_seq 47..0)", "[sinusoidal][golden]") {
  check_golden("sinusoidal_concat_d410_txl_wt103");
}

TEST_CASE("sinusoidal: closed form for every layout, schedule, odd width and real positions", "[sinusoidal]") {
  const std::vector<double> positions = {0.0, 1.0, 2.5, -1.0, -47.0, 1e-3, 12345.0, -0.75, 65535.0};
  for (idx d : {1, 2, 3, 7, 8, 64, 65, 410}) {
    for (double base : {10000.0, 500000.0, 2.0}) {
      for (auto layout : {sinusoid_layout::interleaved, sinusoid_layout::concat, sinusoid_layout::concat_cos_sin}) {
        for (auto schedule : {frequency_schedule::vaswani, frequency_schedule::t2t}) {
          posenc::sinusoidal pe({.d_model = d, .base = base, .layout = layout, .schedule = schedule});
          const auto t = pe.table<double>(positions);
          const auto tf = pe.table<float>(positions);
          for (std::size_t p = 0; p < positions.size(); ++p) {
            for (idx c = 0; c < d; ++c) {
              const double want = closed_form(positions[p], c, d, base, layout, schedule);
              INFO("d " << d << " base " << base << " pos " << positions[p] << " channel " << c);
              // A 1-ulp difference in w_i (pow vs 1/pow) moves the angle by up to |p| * 2.2e-16.
              const double angle_ulp = 4.5e-16 * std::abs(positions[p]);
              REQUIRE(std::abs(t(static_cast<idx>(p), c) - want) <= 1e-14 + angle_ulp);
              REQUIRE(std::abs(double(tf(static_cast<idx>(p), c)) - want) <= 1e-7 + angle_ulp);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("sinusoidal: t2t frequencies follow tensor2tensor's log-timescale increment", "[sinusoidal]") {
  posenc::sinusoidal pe({.d_model = 8, .base = 10000.0, .schedule = frequency_schedule::t2t});
  const auto w = pe.frequencies();
  REQUIRE(w.size() == 4);
  // n = 4: increment ln(1e4)/3, so w = 1, 10^(-4/3), 10^(-8/3), 1e-4.
  CHECK(w[0] == Approx(1.0).epsilon(1e-15));
  CHECK(w[1] == Approx(std::pow(10.0, -4.0 / 3.0)).epsilon(1e-14));
  CHECK(w[3] == Approx(1e-4).epsilon(1e-14));
  posenc::sinusoidal v({.d_model = 8});
  CHECK(v.frequencies()[3] == Approx(std::pow(10000.0, -6.0 / 8.0)).epsilon(1e-14));
}

TEMPLATE_TEST_CASE("sinusoidal: add_to adds the row of each token's own position", "[sinusoidal]", float, double) {
  using T = TestType;
  const idx B = 3, S = 5, D = 12;
  std::mt19937 rng(7);
  std::normal_distribution<double> nd;
  std::vector<T> x(B * S * D), x0;
  for (auto& e : x) e = static_cast<T>(nd(rng));
  x0 = x;
  // Row 0 contiguous, row 1 a decode offset, row 2 left padded / packed restarts (negative too).
  posenc::positions pos(B, S);
  const std::int64_t p[B][S] = {{0, 1, 2, 3, 4}, {100, 101, 102, 103, 104}, {1, 0, 1, 0, -3}};
  for (idx b = 0; b < B; ++b)
    for (idx s = 0; s < S; ++s) pos(b, s) = p[b][s];
  for (auto layout : {sinusoid_layout::interleaved, sinusoid_layout::concat, sinusoid_layout::concat_cos_sin}) {
    x = x0;
    posenc::sinusoidal pe({.d_model = D, .layout = layout});
    pe.add_to(posenc::tensor_map<T, 3>(x.data(), B, S, D), posenc::view(pos));
    const double tol = std::is_same_v<T, float> ? 2e-6 : 1e-14;
    for (idx b = 0; b < B; ++b)
      for (idx s = 0; s < S; ++s)
        for (idx c = 0; c < D; ++c) {
          const std::size_t e = static_cast<std::size_t>((b * S + s) * D + c);
          const double want =
              double(x0[e]) + closed_form(double(p[b][s]), c, D, 10000.0, layout, frequency_schedule::vaswani);
          REQUIRE(std::abs(double(x[e]) - want) <= tol);
        }
  }
  // [1, seq] positions are shared by every batch row.
  x = x0;
  posenc::sinusoidal pe({.d_model = D});
  const auto shared = posenc::contiguous_positions(1, S, 10);
  pe.add_to(posenc::tensor_map<T, 3>(x.data(), B, S, D), posenc::view(shared));
  for (idx b = 0; b < B; ++b)
    for (idx s = 0; s < S; ++s)
      for (idx c = 0; c < D; ++c) {
        const std::size_t e = static_cast<std::size_t>((b * S + s) * D + c);
        const double want = double(x0[e]) + closed_form(double(10 + s), c, D, 10000.0, sinusoid_layout::interleaved,
                                                        frequency_schedule::vaswani);
        REQUIRE(std::abs(double(x[e]) - want) <= (std::is_same_v<T, float> ? 2e-6 : 1e-14));
      }
}

TEST_CASE("sinusoidal: bad arguments throw posenc::error and leave x untouched", "[sinusoidal][errors]") {
  CHECK_THROWS_AS(posenc::sinusoidal({.d_model = 0}), posenc::error);
  CHECK_THROWS_AS(posenc::sinusoidal({.d_model = 8, .base = 0.0}), posenc::error);
  CHECK_THROWS_AS(posenc::sinusoidal({.d_model = 8, .base = std::nan("")}), posenc::error);
  CHECK_THROWS_WITH(posenc::sinusoidal({.d_model = -4}), Catch::Contains("d_model") && Catch::Contains("-4"));
  posenc::sinusoidal pe({.d_model = 8});
  std::vector<double> x(2 * 3 * 8, 1.0);
  const auto pos = posenc::contiguous_positions(2, 4);  // seq mismatch
  CHECK_THROWS_WITH(pe.add_to(posenc::tensor_map<double, 3>(x.data(), 2, 3, 8), posenc::view(pos)),
                    Catch::Contains("pos") && Catch::Contains("[2, 4]"));
  std::vector<double> y(2 * 3 * 6, 1.0);
  const auto pos3 = posenc::contiguous_positions(2, 3);
  CHECK_THROWS_WITH(pe.add_to(posenc::tensor_map<double, 3>(y.data(), 2, 3, 6), posenc::view(pos3)),
                    Catch::Contains("d_model"));
  for (double e : x) REQUIRE(e == 1.0);
  for (double e : y) REQUIRE(e == 1.0);
  const std::vector<double> bad = {0.0, INFINITY};
  CHECK_THROWS_AS(pe.table<double>(bad), posenc::error);
}

TEST_CASE("sinusoidal: float add_to over long runs stays within one float rounding of the exact row", "[sinusoidal]") {
  // float outputs walk consecutive positions by rotation between exact anchors; the result must
  // still be the exact double row rounded to float (|error| <= 1 ulp of values in [-1, 1]).
  const idx B = 2, S = 300, D = 66;
  for (std::int64_t start : {std::int64_t{0}, std::int64_t{-150}, std::int64_t{123456}, std::int64_t{1} << 20}) {
    for (auto layout : {sinusoid_layout::interleaved, sinusoid_layout::concat, sinusoid_layout::concat_cos_sin}) {
      posenc::sinusoidal pe({.d_model = D, .layout = layout, .schedule = frequency_schedule::t2t});
      posenc::positions pos = posenc::contiguous_positions(B, S, start);
      pos(1, 77) = 5;  // one token of row 1 elsewhere (e.g. a packed restart)
      std::vector<float> x(static_cast<std::size_t>(B * S * D), 0.0f);
      pe.add_to(posenc::tensor_map<float, 3>(x.data(), B, S, D), posenc::view(pos));
      for (idx b = 0; b < B; ++b)
        for (idx s = 0; s < S; ++s)
          for (idx c = 0; c < D; ++c) {
            const double want = closed_form(double(pos(b, s)), c, D, 10000.0, layout, frequency_schedule::t2t);
            INFO("start " << start << " b " << b << " s " << s << " c " << c);
            REQUIRE(std::abs(double(x[static_cast<std::size_t>((b * S + s) * D + c)]) - want) <=
                    6e-8 + 4.5e-16 * std::abs(double(pos(b, s))));
          }
    }
  }
}

namespace {

/// One entry of fairseq's get_embedding table (M2M100SinusoidalPositionalEmbedding and its copies), row r
/// of a d-wide table, every step in float as PyTorch runs it: emb = ln(10000) / (half - 1) as a Python
/// float; w = exp(arange(half).float() * -emb) (the scalar rounded to float, the product and exp in
/// float); angle = arange(rows).float()[r] * w in float; [sin | cos] in float, a zero column when d is odd.
float fairseq_entry(std::int64_t r, idx c, idx d) {
  const idx half = d / 2;
  if (c >= 2 * half) return 0.0f;
  const idx i = c < half ? c : c - half;
  const float scalar = static_cast<float>(-(std::log(10000.0) / static_cast<double>(half - 1)));
  const float w = std::exp(static_cast<float>(i) * scalar);
  const float angle = static_cast<float>(r) * w;
  return c < half ? std::sin(angle) : std::cos(angle);
}

}  // namespace

TEMPLATE_TEST_CASE("sinusoidal: float32 angles reproduce fairseq's float32 table; offset shifts the row",
                   "[sinusoidal]", float, double) {
  // M2M100 / NLLB-200 (d_model 1024, pad 1): position p is row p + 2 of the float32 table.
  const idx D = 1024, B = 2, S = 40;
  const posenc::sinusoidal pe({.d_model = D,
                               .layout = sinusoid_layout::concat,
                               .schedule = frequency_schedule::t2t,
                               .angles = posenc::sinusoid_angles::float32,
                               .offset = 2});
  // add_to, rows of positions 0 .. 19 and 2000 .. 2019 (beyond 1024: the table grows there in transformers)
  posenc::positions pos = posenc::contiguous_positions(B, S, 0);
  for (idx s = 0; s < S; ++s) pos(1, s) = s < 20 ? s : 1980 + s;
  std::vector<TestType> x(static_cast<std::size_t>(B * S * D), TestType(0));
  pe.add_to(posenc::tensor_map<TestType, 3>(x.data(), B, S, D), posenc::view(pos));
  double exact_gap = 0;  // how far the float32 rows lie from the double-angle ones
  const posenc::sinusoidal exact(
      {.d_model = D, .layout = sinusoid_layout::concat, .schedule = frequency_schedule::t2t});
  std::vector<double> ex(static_cast<std::size_t>(D));
  for (idx b = 0; b < B; ++b)
    for (idx s = 0; s < S; ++s) {
      exact.row(static_cast<double>(pos(b, s) + 2), std::span<double>(ex));
      for (idx c = 0; c < D; ++c) {
        const double got = static_cast<double>(x[static_cast<std::size_t>((b * S + s) * D + c)]);
        INFO("b " << b << " s " << s << " c " << c);
        REQUIRE(got == static_cast<double>(fairseq_entry(pos(b, s) + 2, c, D)));
        exact_gap = std::max(exact_gap, std::abs(got - ex[static_cast<std::size_t>(c)]));
      }
    }
  // The float angles matter: at rows near 2000 the float32 table is off the double one by 1.4e-4.
  CHECK(exact_gap > 2e-5);
  CHECK(exact_gap < 3e-4);
  // row and table take the same path and the same offset.
  std::vector<TestType> r(static_cast<std::size_t>(D));
  pe.row(1500.0, std::span<TestType>(r));
  const auto t = pe.table<TestType>(3, 1499.0);
  for (idx c = 0; c < D; ++c) {
    CHECK(static_cast<double>(r[static_cast<std::size_t>(c)]) == static_cast<double>(fairseq_entry(1502, c, D)));
    CHECK(t(1, c) == r[static_cast<std::size_t>(c)]);
  }
  // odd width: the zero column last, as get_embedding appends it
  const posenc::sinusoidal odd({.d_model = 7,
                                .layout = sinusoid_layout::concat,
                                .schedule = frequency_schedule::t2t,
                                .angles = posenc::sinusoid_angles::float32});
  std::vector<TestType> o(7);
  odd.row(33.0, std::span<TestType>(o));
  for (idx c = 0; c < 7; ++c) CHECK(static_cast<double>(o[static_cast<std::size_t>(c)]) == fairseq_entry(33, c, 7));
}

TEST_CASE("sinusoidal: the offset moves every path by the same rows; bad offsets are errors", "[sinusoidal]") {
  // Exact angles with an offset: position p gives the closed form at p + offset, for add_to (the float walk
  // included), row and table.
  const idx D = 10;
  for (auto layout : {sinusoid_layout::interleaved, sinusoid_layout::concat, sinusoid_layout::concat_cos_sin}) {
    const posenc::sinusoidal pe({.d_model = D, .layout = layout, .offset = 5});
    const auto pos = posenc::contiguous_positions(1, 70, 3);
    std::vector<float> x(static_cast<std::size_t>(70 * D), 0.0f);
    pe.add_to(posenc::tensor_map<float, 3>(x.data(), 1, 70, D), posenc::view(pos));
    const auto t = pe.table<double>(70, 3.0);
    for (idx s = 0; s < 70; ++s)
      for (idx c = 0; c < D; ++c) {
        const double want = closed_form(double(s + 3 + 5), c, D, 10000.0, layout, frequency_schedule::vaswani);
        CHECK(std::abs(double(x[static_cast<std::size_t>(s * D + c)]) - want) <= 6e-8);
        CHECK(std::abs(t(s, c) - want) <= 1e-14);
      }
  }
  CHECK_THROWS_WITH(posenc::sinusoidal({.d_model = 8, .offset = -1}),
                    Catch::Contains("offset: must be in [0, 2^31)") && Catch::Contains("-1"));
  CHECK_THROWS_WITH(posenc::sinusoidal({.d_model = 8, .layout = static_cast<sinusoid_layout>(7)}),
                    Catch::Contains("layout: must be interleaved, concat or concat_cos_sin"));
}
