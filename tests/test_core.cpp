// Core types: views in both layouts, position helpers, errors, the encoding concept.
#include <catch2/catch.hpp>

#include <posenc/detail/platform.hpp>
#include <posenc/encoding.hpp>
#include <posenc/positions.hpp>
#include <posenc/tensor.hpp>
#include <posenc/version.hpp>

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <numeric>
#include <string>
#include <vector>

using Index = posenc::index_t;  // not `index`: POSIX declares ::index()

namespace {

// Row-major offset of [a, b, c, d] in a tensor of dimensions dims: an independent oracle for the views.
Index offset4(const std::array<Index, 4>& dims, Index a, Index b, Index c, Index d) {
  return ((a * dims[1] + b) * dims[2] + c) * dims[3] + d;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const posenc::error& e) {
    return e.what();
  }
  return "<no posenc::error thrown>";
}

}  // namespace

TEST_CASE("heads_view over a BSHD buffer addresses [b, s, h, d] row-major", "[core][view]") {
  const Index B = 2, S = 3, H = 4, D = 5;
  std::vector<float> buf(B * S * H * D);
  std::iota(buf.begin(), buf.end(), 0.f);
  auto v = posenc::bshd(buf.data(), B, S, H, D);
  CHECK(v.batch() == B);
  CHECK(v.seq() == S);
  CHECK(v.heads() == H);
  CHECK(v.dim() == D);
  CHECK(v.order() == posenc::layout::bshd);
  for (Index b = 0; b < B; ++b)
    for (Index s = 0; s < S; ++s)
      for (Index h = 0; h < H; ++h)
        for (Index d = 0; d < D; ++d) CHECK(v(b, s, h, d) == buf[offset4({B, S, H, D}, b, s, h, d)]);
}

TEST_CASE("heads_view over a BHSD buffer addresses [b, h, s, d] row-major", "[core][view]") {
  const Index B = 2, S = 3, H = 4, D = 5;
  std::vector<double> buf(B * S * H * D);
  std::iota(buf.begin(), buf.end(), 0.0);
  auto v = posenc::bhsd(buf.data(), B, H, S, D);
  CHECK(v.seq() == S);
  CHECK(v.heads() == H);
  for (Index b = 0; b < B; ++b)
    for (Index s = 0; s < S; ++s)
      for (Index h = 0; h < H; ++h)
        for (Index d = 0; d < D; ++d) CHECK(v(b, s, h, d) == buf[offset4({B, H, S, D}, b, h, s, d)]);
}

TEST_CASE("heads_view::matrix is a strided view of one (batch, head), never a copy", "[core][view]") {
  const Index B = 2, S = 6, H = 3, D = 4;
  std::vector<float> a(B * S * H * D), c(B * S * H * D);
  std::iota(a.begin(), a.end(), 0.f);
  std::iota(c.begin(), c.end(), 0.f);
  for (auto order : {posenc::layout::bshd, posenc::layout::bhsd}) {
    auto& buf = order == posenc::layout::bshd ? a : c;
    posenc::heads_view<float> v(buf.data(), B, S, H, D, order);
    auto m = v.matrix(1, 2, 2, 3);
    REQUIRE(m.rows() == 3);
    REQUIRE(m.cols() == D);
    for (Index r = 0; r < 3; ++r)
      for (Index d = 0; d < D; ++d) CHECK(&m(r, d) == &v(1, 2 + r, 2, d));
    m(0, 0) = -1.f;  // writes through to the host buffer
    CHECK(v(1, 2, 2, 0) == -1.f);
  }
}

TEST_CASE("heads_view from a TensorMap keeps the memory order and converts to const", "[core][view]") {
  std::vector<double> buf(2 * 3 * 4 * 5);
  std::iota(buf.begin(), buf.end(), 0.0);
  posenc::tensor_map<double, 4> t(buf.data(), 2, 4, 3, 5);  // BHSD dims in memory order
  auto v = posenc::bhsd(t);
  CHECK(v.seq() == 3);
  CHECK(v.heads() == 4);
  posenc::heads_view<const double> cv = v;
  CHECK(cv(1, 2, 3, 4) == t(1, 3, 2, 4));
  auto back = cv.tensor();
  CHECK(back.dimension(1) == 4);
  CHECK(back.data() == buf.data());
}

TEST_CASE("heads_view with strides: padded rows, slices of tokens and heads", "[core][view]") {
  const Index B = 2, cap = 5, H = 6, D = 4;
  std::vector<float> buf(B * cap * H * D);
  std::iota(buf.begin(), buf.end(), 0.f);
  const auto all = posenc::bshd(buf.data(), B, cap, H, D);
  CHECK(all.dense());
  CHECK(all.strides() == posenc::view_strides{.batch = cap * H * D, .token = H * D, .head = D});
  CHECK(all.extent() == all.size());

  // the first 3 tokens of a 5-token cache, every batch row
  const auto first3 = all.slice_tokens(0, 3);
  CHECK(first3.seq() == 3);
  CHECK(!first3.dense());
  CHECK(first3.batch_stride() == cap * H * D);
  CHECK(&first3(1, 2, 5, 3) == &all(1, 2, 5, 3));
  CHECK(first3.extent() == (B - 1) * cap * H * D + 2 * H * D + 5 * D + D);
  // heads 2..3 (a fused buffer's k part), then tokens 1..4 of those
  const auto k = all.slice_heads(2, 2).slice_tokens(1, 4);
  CHECK(k.heads() == 2);
  CHECK(&k(1, 0, 1, 2) == &all(1, 1, 3, 2));
  const auto m = k.matrix(1, 1);
  CHECK(&m(3, 0) == &all(1, 4, 3, 0));

  // a BHSD cache's first tokens: the head stride stays the capacity's
  const auto bh = posenc::bhsd(buf.data(), B, H, cap, D).slice_tokens(0, 2);
  CHECK(bh.head_stride() == cap * D);
  CHECK(&bh(1, 1, 4, 0) == &buf[((1 * H + 4) * cap + 1) * D]);
  CHECK(bh.order() == posenc::layout::bhsd);

  // token rows padded past their heads
  const auto padded = posenc::strided(buf.data(), 1, 3, 2, D, {.batch = 0, .token = 2 * D + 3, .head = D});
  CHECK(&padded(0, 2, 1, 1) == &buf[2 * (2 * D + 3) + D + 1]);
  CHECK(padded.order() == posenc::layout::bshd);
  const posenc::heads_view<const float> cp = padded;
  CHECK(cp.strides() == padded.strides());
  CHECK(&cp(0, 2, 1, 1) == &padded(0, 2, 1, 1));
}

TEST_CASE("heads_view with strides: bad strides and slices are refused", "[core][view][error]") {
  std::vector<float> buf(1000);
  CHECK_THROWS_WITH(posenc::strided(buf.data(), 1, 4, 2, 8, {.token = -16, .head = 8}),
                    Catch::Contains("heads_view") && Catch::Contains("strides must be >= 0"));
  // a written view whose rows overlap: tokens 4 apart with 8 values each
  CHECK_THROWS_WITH(posenc::strided(buf.data(), 1, 4, 1, 8, {.token = 4, .head = 8}),
                    Catch::Contains("must not reach an element twice"));
  // heads on top of each other (stride 0) in a written view; the same view of inputs reads fine
  CHECK_THROWS_AS(posenc::strided(buf.data(), 1, 4, 2, 8, {.token = 8, .head = 0}), posenc::error);
  CHECK_NOTHROW(posenc::strided<const float>(buf.data(), 1, 4, 2, 8, {.token = 8, .head = 0}));
  // one token or one head: its stride is never used
  CHECK_NOTHROW(posenc::strided(buf.data(), 1, 1, 3, 8, {.token = 0, .head = 8}));
  const auto v = posenc::bshd(buf.data(), 2, 5, 4, 8);
  CHECK_THROWS_WITH(v.slice_tokens(3, 3), Catch::Contains("slice_tokens") && Catch::Contains("[3, 6) of 5"));
  CHECK_THROWS_WITH(v.slice_heads(-1, 2), Catch::Contains("slice_heads"));
  CHECK(v.slice_tokens(5, 0).seq() == 0);
  CHECK_THROWS_WITH(v.slice_tokens(0, 2).tensor(), Catch::Contains("tensor") && Catch::Contains("dense"));
}

TEST_CASE("heads_view rejects negative dimensions and null data", "[core][view][error]") {
  CHECK_THROWS_AS(posenc::bshd<float>(nullptr, 1, 2, 3, 4), posenc::error);
  std::vector<float> buf(4);
  CHECK_THROWS_AS(posenc::bshd(buf.data(), -1, 2, 3, 4), posenc::error);
  CHECK_NOTHROW(posenc::bshd<float>(nullptr, 0, 2, 3, 4));  // empty is fine
}

TEST_CASE("contiguous_positions: offset .. offset+seq-1 in every row", "[core][positions]") {
  auto p = posenc::contiguous_positions(2, 4, 40);
  REQUIRE(p.dimension(0) == 2);
  REQUIRE(p.dimension(1) == 4);
  for (Index b = 0; b < 2; ++b)
    for (Index s = 0; s < 4; ++s) CHECK(p(b, s) == 40 + s);
  CHECK_THROWS_AS(posenc::contiguous_positions(-1, 4), posenc::error);
}

TEST_CASE("positions_from_cu_seqlens restarts at every sequence boundary", "[core][positions]") {
  const std::vector<std::int64_t> cu{0, 3, 3, 7};
  auto p = posenc::positions_from_cu_seqlens(cu);
  REQUIRE(p.dimension(1) == 7);
  const std::vector<std::int64_t> expected{0, 1, 2, 0, 1, 2, 3};
  for (Index s = 0; s < 7; ++s) CHECK(p(0, s) == expected[s]);
}

TEST_CASE("positions_from_cu_seqlens validates its argument", "[core][positions][error]") {
  const std::vector<std::int64_t> bad_start{1, 3}, decreasing{0, 4, 2};
  CHECK_THROWS_WITH(posenc::positions_from_cu_seqlens(bad_start), Catch::Contains("cu_seqlens") &&
                                                                      Catch::Contains("start at 0"));
  CHECK_THROWS_WITH(posenc::positions_from_cu_seqlens(decreasing), Catch::Contains("non-decreasing"));
  CHECK_THROWS_AS(posenc::positions_from_cu_seqlens({}), posenc::error);
}

TEST_CASE("positions_from_attention_mask is cumsum(mask) - 1 for left padding", "[core][positions]") {
  // HF generate with left padding: row 0 has two pads, row 1 none.
  const std::vector<std::int64_t> mask{0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  posenc::tensor_map<const std::int64_t, 2> m(mask.data(), 2, 5);
  auto p = posenc::positions_from_attention_mask(m);
  const std::vector<std::int64_t> expected{1, 1, 0, 1, 2, 0, 1, 2, 3, 4};
  for (Index i = 0; i < 10; ++i) CHECK(p.data()[i] == expected[i]);
  const std::vector<std::int64_t> bad{0, 2};
  CHECK_THROWS_WITH(posenc::positions_from_attention_mask(posenc::tensor_map<const std::int64_t, 2>(bad.data(), 1, 2)),
                    Catch::Contains("attention_mask") && Catch::Contains("0 or 1"));
}

TEST_CASE("sequence_length is max(position)+1 over every batch row", "[core][positions]") {
  const std::vector<std::int64_t> pos{0, 1, 9, 3, 4, 5};
  CHECK(posenc::sequence_length(posenc::positions_view(pos.data(), 2, 3)) == 10);
  CHECK(posenc::sequence_length(posenc::positions_view(pos.data(), 0, 3)) == 0);
}

TEST_CASE("posenc::error messages name the argument, the constraint and the value", "[core][error]") {
  const auto msg = message_of([] { posenc::require(false, "kv_lengths", "entries must be in [0, k_len]", 9, " at batch ", 1); });
  CHECK(msg == "posenc: kv_lengths: entries must be in [0, k_len] (got 9 at batch 1)");
  CHECK(message_of([] { posenc::require(false, "x", "must be set"); }) == "posenc: x: must be set");
  CHECK_NOTHROW(posenc::require(true, "x", "never thrown"));
  // Callers catching the standard type keep working.
  CHECK_THROWS_AS(posenc::require(false, "x", "c"), std::invalid_argument);
}

// ---- the encoding concept ------------------------------------------------------------------------

namespace {
struct hookless {
  int something = 0;
  void unrelated() const {}
};
struct only_scale {
  double logit_scale(Index) const { return 1.0; }
};
struct a_bias {
  template <class T>
  void add_position_bias(const posenc::tile<T>&, posenc::matrix_map<T>) const {}
};
struct a_transform {
  template <class T>
  void transform_qk(posenc::qk_role, Index, std::span<const std::int64_t>, posenc::matrix_map<T>) const {}
};
struct a_score_term {
  template <class T>
  void add_score_terms(const posenc::tile<T>&, T, posenc::matrix_map<T>) const {}
};
struct a_value_term {
  Index value_bucket_count() const { return 1; }
  template <class T>
  void value_buckets(const posenc::tile<T>&, posenc::index_tile) const {}
  template <class T>
  posenc::const_matrix_map<T> value_table(Index) const {
    return {nullptr, 0, 0, Eigen::OuterStride<>(1)};
  }
};
struct an_input {
  template <class T>
  void add_to(posenc::tensor_map<T, 3>, posenc::positions_view) const {}
};
struct float_only_bias {  // a hook for one scalar type is enough
  void add_position_bias(const posenc::tile<float>&, posenc::matrix_map<float>) const {}
};
struct wrong_signature {  // right name, wrong arguments: not a hook
  void add_position_bias(int) const {}
};
}  // namespace

TEST_CASE("the encoding concept accepts every hook kind and rejects a hookless type", "[core][concept]") {
  STATIC_REQUIRE_FALSE(posenc::encoding<hookless>);
  STATIC_REQUIRE_FALSE(posenc::encoding<int>);
  STATIC_REQUIRE_FALSE(posenc::encoding<wrong_signature>);
  STATIC_REQUIRE(posenc::attention_encoding<only_scale>);
  STATIC_REQUIRE(posenc::attention_encoding<a_bias>);
  STATIC_REQUIRE(posenc::attention_encoding<a_transform>);
  STATIC_REQUIRE(posenc::attention_encoding<a_score_term>);
  STATIC_REQUIRE(posenc::attention_encoding<a_value_term>);
  STATIC_REQUIRE(posenc::attention_encoding<float_only_bias>);
  STATIC_REQUIRE(posenc::attention_encoding<posenc::no_position>);
  STATIC_REQUIRE(posenc::input_encoding<an_input>);
  STATIC_REQUIRE_FALSE(posenc::attention_encoding<an_input>);
  STATIC_REQUIRE(posenc::encoding<an_input>);
}

TEST_CASE("hook detection is per scalar type", "[core][concept]") {
  STATIC_REQUIRE(posenc::has_position_bias<float_only_bias, float>);
  STATIC_REQUIRE_FALSE(posenc::has_position_bias<float_only_bias, double>);
  STATIC_REQUIRE(posenc::has_position_bias<a_bias, double>);
  STATIC_REQUIRE_FALSE(posenc::has_qk_transform<a_bias, double>);
  STATIC_REQUIRE(posenc::has_value_terms<a_value_term, float>);
  STATIC_REQUIRE(posenc::has_logit_scale<only_scale>);
  STATIC_REQUIRE_FALSE(posenc::has_bind<only_scale>);
}

TEST_CASE("default_logit_scale: the encoding's, else 1/sqrt(d)", "[core][concept]") {
  CHECK(posenc::default_logit_scale(only_scale{}, 64) == 1.0);
  CHECK(posenc::default_logit_scale(a_bias{}, 64) == Approx(0.125).epsilon(1e-15));
  CHECK(posenc::default_logit_scale(posenc::no_position{}, 128) == Approx(1.0 / std::sqrt(128.0)).epsilon(1e-15));
}

namespace {
struct counting_bind {
  struct bound {
    std::int64_t span;
    double logit_scale(Index) const { return static_cast<double>(span); }
  };
  bound bind(const posenc::call_info& c) const { return {c.k_max - c.q_min}; }
};
}  // namespace

TEST_CASE("bind_encoding returns the bound object when there is bind, the encoding itself otherwise", "[core][concept]") {
  posenc::call_info info;
  info.q_min = 3;
  info.k_max = 10;
  auto b = posenc::detail::bind_encoding(counting_bind{}, info);
  CHECK(b.logit_scale(1) == 7.0);
  const only_scale s;
  const auto& same = posenc::detail::bind_encoding(s, info);
  CHECK(&same == &s);
}

// ---- version.hpp --------------------------------------------------------------------------------

TEST_CASE("version macros: numbers, the string spelled from them, and the CMake project version", "[core][version]") {
  STATIC_REQUIRE(POSENC_VERSION_MAJOR >= 0);
  STATIC_REQUIRE(POSENC_VERSION_MINOR >= 0);
  STATIC_REQUIRE(POSENC_VERSION_PATCH >= 0);
  const std::string spelled = std::to_string(POSENC_VERSION_MAJOR) + "." + std::to_string(POSENC_VERSION_MINOR) + "." +
                              std::to_string(POSENC_VERSION_PATCH);
  CHECK(std::string(POSENC_VERSION) == spelled);
  // tests/CMakeLists.txt passes PROJECT_VERSION, which CMakeLists.txt read from version.hpp.
  CHECK(std::string(POSENC_TEST_PROJECT_VERSION) == spelled);
}

// ---- detail/platform.hpp ------------------------------------------------------------------------

namespace {
/// Both the dispatching function (a builtin on g++/clang) and the portable fallback, on one case:
/// `want` is the exact result, or std::nullopt when it does not fit T.
template <class T>
void check_add(T a, T b, std::optional<T> want) {
  T r1 = 0, r2 = 0;
  CHECK(posenc::detail::add_overflow(a, b, r1) == !want);
  CHECK(posenc::detail::portable::add_overflow(a, b, r2) == !want);
  if (want) {
    CHECK(r1 == *want);
    CHECK(r2 == *want);
  }
}
template <class T>
void check_sub(T a, T b, std::optional<T> want) {
  T r1 = 0, r2 = 0;
  CHECK(posenc::detail::sub_overflow(a, b, r1) == !want);
  CHECK(posenc::detail::portable::sub_overflow(a, b, r2) == !want);
  if (want) {
    CHECK(r1 == *want);
    CHECK(r2 == *want);
  }
}
}  // namespace

TEST_CASE("platform: overflow-checked add and sub at the int64 and int32 limits", "[core][platform]") {
  using I64 = std::int64_t;
  using L = std::numeric_limits<I64>;
  const std::optional<I64> over;
  check_add<I64>(1, 2, 3);
  check_add<I64>(L::max(), 0, L::max());
  check_add<I64>(L::max(), 1, over);
  check_add<I64>(L::max() - 5, 5, L::max());
  check_add<I64>(L::max() - 5, 6, over);
  check_add<I64>(L::min(), -1, over);
  check_add<I64>(L::min(), L::max(), -1);
  check_add<I64>(-7, L::min() + 7, L::min());
  check_add<I64>(-8, L::min() + 7, over);
  check_sub<I64>(5, 7, -2);
  check_sub<I64>(0, L::min(), over);
  check_sub<I64>(-1, L::min(), L::max());
  check_sub<I64>(L::max(), -1, over);
  check_sub<I64>(L::min(), 1, over);
  check_sub<I64>(L::min() + 1, 1, L::min());
  check_sub<I64>(L::max(), L::max(), 0);
  using I32 = std::int32_t;
  using M = std::numeric_limits<I32>;
  check_add<I32>(M::max(), 1, std::nullopt);
  check_add<I32>(M::max() - 1, 1, M::max());
  check_sub<I32>(M::min(), 1, std::nullopt);
  check_sub<I32>(M::min() + 1, 1, M::min());
  STATIC_REQUIRE([] {
    I64 r = 0;
    return !posenc::detail::portable::add_overflow<I64>(40, 2, r) && r == 42;
  }());
}

TEST_CASE("platform: prefetch is a hint and never faults on valid memory", "[core][platform]") {
  std::array<int, 64> a{};
  posenc::detail::prefetch<0, 3>(a.data());
  posenc::detail::prefetch<1, 2>(a.data() + 32);
  posenc::detail::prefetch<0, 0>(a.data() + 63);
  CHECK(a[0] == 0);
}
