// Learned absolute position embeddings: lookups against the table read directly, the offset
// convention (OPT/BART/RoBERTa), viewed vs owned storage, and out-of-range positions (an error naming
// the position and the table size, thrown before anything is written).
#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <vector>

#include "posenc/learned.hpp"
#include "random.hpp"

using idx = posenc::index_t;

static_assert(posenc::input_encoding<posenc::learned_absolute<float>>);
static_assert(posenc::input_encoding<posenc::learned_absolute<double>>);
static_assert(!posenc::attention_encoding<posenc::learned_absolute<double>>);

namespace {

}  // namespace

TEMPLATE_TEST_CASE("learned: add_to adds table[pos + offset] per token", "[learned]", float, double) {
  using T = TestType;
  const idx P = 10, D = 6, B = 2, S = 4;
  const auto w = test_util::randn(P * D, 1);
  const auto x0d = test_util::randn(B * S * D, 2);
  const std::vector<T> x0(x0d.begin(), x0d.end());
  posenc::positions pos(B, S);
  const std::int64_t p[B][S] = {{0, 1, 2, 3}, {5, 6, 7, 0}};
  for (idx b = 0; b < B; ++b)
    for (idx s = 0; s < S; ++s) pos(b, s) = p[b][s];

  for (std::int64_t offset : {0, 2}) {
    posenc::learned_absolute<double> pe(posenc::tensor_map<const double, 2>(w.data(), P, D), {.offset = offset});
    REQUIRE(pe.table().data() == w.data());  // a view, no copy
    REQUIRE(pe.max_positions() == P);
    std::vector<T> x = x0;
    pe.add_to(posenc::tensor_map<T, 3>(x.data(), B, S, D), posenc::view(pos));
    for (idx b = 0; b < B; ++b)
      for (idx s = 0; s < S; ++s)
        for (idx d = 0; d < D; ++d) {
          const std::size_t e = static_cast<std::size_t>((b * S + s) * D + d);
          const T want =
              static_cast<T>(x0[e] + static_cast<T>(w[static_cast<std::size_t>((p[b][s] + offset) * D + d)]));
          REQUIRE(x[e] == want);
        }
  }
}

TEST_CASE("learned: owned table, [1, seq] positions shared by the batch", "[learned]") {
  const idx P = 4, D = 3;
  Eigen::Tensor<float, 2, Eigen::RowMajor> table(P, D);
  for (idx r = 0; r < P; ++r)
    for (idx d = 0; d < D; ++d) table(r, d) = static_cast<float>(10 * r + d);
  posenc::learned_absolute<float> pe(std::move(table), {.offset = 1});
  REQUIRE(pe.min_position() == -1);
  REQUIRE(pe.max_position() == 2);
  const auto copy = pe;  // copies share the owned table
  REQUIRE(copy.table().data() == pe.table().data());
  std::vector<float> x(2 * 3 * D, 0.0f);
  const auto pos = posenc::contiguous_positions(1, 3, -1);  // -1, 0, 1 -> rows 0, 1, 2
  copy.add_to(posenc::tensor_map<float, 3>(x.data(), 2, 3, D), posenc::view(pos));
  for (idx b = 0; b < 2; ++b)
    for (idx s = 0; s < 3; ++s)
      for (idx d = 0; d < D; ++d) REQUIRE(x[static_cast<std::size_t>((b * 3 + s) * D + d)] == float(10 * s + d));
}

TEST_CASE("learned: out-of-range positions throw naming the position and table size, nothing written",
          "[learned][errors]") {
  const idx P = 8, D = 4, B = 2, S = 3;
  const auto w = test_util::randn(P * D, 3);
  posenc::learned_absolute<double> opt(posenc::tensor_map<const double, 2>(w.data(), P, D), {.offset = 2});
  std::vector<double> x(B * S * D, 0.5);
  posenc::positions pos(B, S);
  // Valid: positions -2 .. 5. The bad one is the very last token, so a check-as-you-go
  // implementation would already have written every other row.
  const std::int64_t good[B][S] = {{-2, 0, 5}, {1, 2, 3}};
  for (idx b = 0; b < B; ++b)
    for (idx s = 0; s < S; ++s) pos(b, s) = good[b][s];
  pos(1, 2) = 6;  // row 8 of an 8-row table
  CHECK_THROWS_AS(opt.add_to(posenc::tensor_map<double, 3>(x.data(), B, S, D), posenc::view(pos)), posenc::error);
  CHECK_THROWS_WITH(opt.add_to(posenc::tensor_map<double, 3>(x.data(), B, S, D), posenc::view(pos)),
                    Catch::Contains("got 6") && Catch::Contains("[1, 2]") && Catch::Contains("row 8") &&
                        Catch::Contains("table size 8"));
  for (double e : x) REQUIRE(e == 0.5);

  pos(1, 2) = -3;  // row -1
  CHECK_THROWS_WITH(opt.add_to(posenc::tensor_map<double, 3>(x.data(), B, S, D), posenc::view(pos)),
                    Catch::Contains("got -3") && Catch::Contains("row -1") && Catch::Contains("table size 8"));
  pos(1, 2) = INT64_MAX;  // row would overflow int64: still an error, no UB
  CHECK_THROWS_WITH(opt.add_to(posenc::tensor_map<double, 3>(x.data(), B, S, D), posenc::view(pos)),
                    Catch::Contains("out of int64"));
  for (double e : x) REQUIRE(e == 0.5);

  pos(1, 2) = 5;  // all valid now
  opt.add_to(posenc::tensor_map<double, 3>(x.data(), B, S, D), posenc::view(pos));
  REQUIRE(x[static_cast<std::size_t>(((1 * S) + 2) * D)] == 0.5 + w[static_cast<std::size_t>(7 * D)]);
}

TEST_CASE("learned: shape errors", "[learned][errors]") {
  const std::vector<double> w(12, 0.0);
  posenc::learned_absolute<double> pe(posenc::tensor_map<const double, 2>(w.data(), 4, 3));
  std::vector<double> x(2 * 2 * 5, 0.0);
  const auto pos = posenc::contiguous_positions(2, 2);
  CHECK_THROWS_WITH(pe.add_to(posenc::tensor_map<double, 3>(x.data(), 2, 2, 5), posenc::view(pos)),
                    Catch::Contains("d_model") && Catch::Contains("5 vs 3"));
  std::vector<double> y(2 * 2 * 3, 0.0);
  const auto pos3 = posenc::contiguous_positions(3, 2);
  CHECK_THROWS_WITH(pe.add_to(posenc::tensor_map<double, 3>(y.data(), 2, 2, 3), posenc::view(pos3)),
                    Catch::Contains("pos"));
  CHECK_THROWS_AS(posenc::learned_absolute<double>(posenc::tensor_map<const double, 2>(w.data(), 0, 3)), posenc::error);
}
