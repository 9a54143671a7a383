// TUPE: the fused kernel against the double reference attention with the position bias materialized
// by a direct per-pair formula written here from the raw weights (projection, 1/sqrt(2d), the [CLS]
// reset of FORMAT.md 5.10, the relative table), with and without the reset and the relative term,
// padding, packed (non-contiguous) positions, small tiles, float and double; thread determinism;
// the golden cases; argument errors; the official-checkpoint loader (posenc/io/tupe.hpp).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <unsupported/Eigen/CXX11/ThreadPool>
#include <vector>

#include "golden.hpp"
#include "posenc/attention.hpp"
#include "posenc/io/tupe.hpp"
#include "posenc/reference.hpp"
#include "posenc/tupe.hpp"
#include "random.hpp"

using idx = posenc::index_t;

static_assert(posenc::attention_encoding<posenc::tupe>);
static_assert(posenc::has_bind<posenc::tupe>);
static_assert(posenc::has_logit_scale<posenc::tupe>);
static_assert(posenc::has_position_bias<posenc::tupe::bound, float>);
static_assert(posenc::has_position_bias<posenc::tupe::bound, double>);
static_assert(!posenc::has_score_terms<posenc::tupe::bound, float>);

namespace {

/// Raw TUPE weights (double) and the direct formula of the position bias.
struct tupe_params {
  idx S, Dm, H, d, bins = 32, max_rel = 128;
  bool cls = true, rel = true;
  std::vector<double> pos, uq, buq, uk, buk, c2o, o2c, table;

  tupe_params(idx S_, idx H_, idx d_, bool cls_, bool rel_, unsigned seed, idx Dm_ = 0)
      : S(S_), Dm(Dm_ > 0 ? Dm_ : H_ * d_), H(H_), d(d_), cls(cls_), rel(rel_) {
    pos = test_util::randn(static_cast<std::size_t>(S * Dm), seed);
    uq = test_util::randn(static_cast<std::size_t>(H * d * Dm), seed + 1, 0.3);
    buq = test_util::randn(static_cast<std::size_t>(H * d), seed + 2, 0.3);
    uk = test_util::randn(static_cast<std::size_t>(H * d * Dm), seed + 3, 0.3);
    buk = test_util::randn(static_cast<std::size_t>(H * d), seed + 4, 0.3);
    c2o = test_util::randn(static_cast<std::size_t>(H), seed + 5);
    o2c = test_util::randn(static_cast<std::size_t>(H), seed + 6);
    table = test_util::randn(static_cast<std::size_t>((bins + 1) * H), seed + 7);
  }

  /// The weights as W (copied to `store`, which the views point into).
  template <class W>
  posenc::tupe_weights<W> weights(std::vector<std::vector<W>>& store) const {
    store.clear();
    for (const auto* v : {&pos, &uq, &buq, &uk, &buk, &c2o, &o2c, &table}) store.emplace_back(v->begin(), v->end());
    posenc::tupe_weights<W> w{.pos_emb = {store[0].data(), S, Dm},
                              .pos_q_weight = {store[1].data(), H * d, Dm},
                              .pos_q_bias = {store[2].data(), H * d},
                              .pos_k_weight = {store[3].data(), H * d, Dm},
                              .pos_k_bias = {store[4].data(), H * d}};
    if (cls) {
      w.theta_cls_to_others.emplace(store[5].data(), H);
      w.theta_others_to_cls.emplace(store[6].data(), H);
    }
    if (rel) w.relative_attention_bias.emplace(store[7].data(), bins + (cls ? 1 : 0), H);
    return w;
  }
  [[nodiscard]] posenc::tupe_config config() const {
    return {.num_attention_heads = H, .cls_reset = cls, .rel_pos_bins = bins, .max_rel_pos = max_rel};
  }
  [[nodiscard]] posenc::tupe make() const {
    std::vector<std::vector<double>> store;
    return posenc::tupe(weights<double>(store), config());
  }

  /// (p_a U^T + b)_h component c.
  [[nodiscard]] double proj(const std::vector<double>& u, const std::vector<double>& b, std::int64_t a, idx h,
                            idx c) const {
    double acc = b[static_cast<std::size_t>(h * d + c)];
    for (idx m = 0; m < Dm; ++m)
      acc += pos[static_cast<std::size_t>(a * Dm + m)] * u[static_cast<std::size_t>((h * d + c) * Dm + m)];
    return acc;
  }
  /// FORMAT.md 5.10: untied term / sqrt(2d); [CLS] column then row; relative table with reset buckets.
  [[nodiscard]] double bias(idx h, std::int64_t i, std::int64_t j) const {
    double absolute = 0;
    for (idx c = 0; c < d; ++c) absolute += proj(uq, buq, i, h, c) * proj(uk, buk, j, h, c);
    absolute /= std::sqrt(2.0 * static_cast<double>(d));
    std::int64_t bucket = posenc::t5_relative_bucket(j - i, bins, max_rel, true);
    if (cls && j == 0) {
      absolute = o2c[static_cast<std::size_t>(h)];
      bucket = bins;
    }
    if (cls && i == 0) {
      absolute = c2o[static_cast<std::size_t>(h)];
      bucket = bins / 2;
    }
    return absolute + (rel ? table[static_cast<std::size_t>(bucket * H + h)] : 0.0);
  }
};

struct fused_case {
  const char* what;
  idx B, S, H, d;
  bool cls, rel, padded, packed;
  idx q_block, k_block;  // 0: the kernel's defaults
};

template <class T>
void run_fused(const fused_case& fc) {
  INFO(fc.what);
  const idx B = fc.B, S = fc.S, H = fc.H, D = fc.d;
  const tupe_params prm(S + 3, H, D, fc.cls, fc.rel, 40);
  const auto qd = test_util::randn(static_cast<std::size_t>(B * S * H * D), 31);
  const auto kd = test_util::randn(static_cast<std::size_t>(B * S * H * D), 32);
  const auto vd = test_util::randn(static_cast<std::size_t>(B * S * H * D), 33);
  std::vector<std::int64_t> pad(static_cast<std::size_t>(B * S), 0);
  if (fc.padded)
    for (idx b = 0; b < B; ++b)
      for (idx j = S - 2 - 5 * b; j < S; ++j) pad[static_cast<std::size_t>(b * S + j)] = 1;
  posenc::attention_options opt;
  if (fc.padded) opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), B, S);
  // Packed: two documents per row, each starting with its own [CLS] at position 0.
  posenc::positions pos = posenc::contiguous_positions(B, S);
  if (fc.packed) {
    for (idx b = 0; b < B; ++b)
      for (idx j = S / 3 + b; j < S; ++j) pos(b, j) = j - (S / 3 + b);
    opt.q_positions = posenc::view(pos);
    opt.k_positions = posenc::view(pos);
  }
  posenc::reference_terms<double> terms;
  terms.bias = [&](idx b, idx h, idx i, idx j) { return prm.bias(h, pos(b, i), pos(b, j)); };
  std::vector<double> want(qd.size());
  posenc::attention_options ref_opt = opt;
  ref_opt.scale = 1.0 / std::sqrt(2.0 * static_cast<double>(D));
  posenc::reference_attention<double>(posenc::bshd(qd.data(), B, S, H, D), posenc::bshd(kd.data(), B, S, H, D),
                                      posenc::bshd(vd.data(), B, S, H, D), posenc::bshd(want.data(), B, S, H, D),
                                      ref_opt, terms);

  const std::vector<T> q(qd.begin(), qd.end()), k(kd.begin(), kd.end()), v(vd.begin(), vd.end());
  std::vector<std::vector<T>> store;
  const posenc::tupe enc(prm.weights<T>(store), prm.config());
  std::vector<T> got(want.size(), T(-7));
  opt.q_block = fc.q_block;
  opt.k_block = fc.k_block;
  posenc::attention<T>(posenc::bshd(q.data(), B, S, H, D), posenc::bshd(k.data(), B, S, H, D),
                       posenc::bshd(v.data(), B, S, H, D), posenc::bshd(got.data(), B, S, H, D), enc, opt);
  const double tol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
  double worst = 0;
  for (std::size_t e = 0; e < want.size(); ++e) worst = std::max(worst, std::abs(double(got[e]) - want[e]));
  INFO("max |fused - reference| = " << worst);
  REQUIRE(worst <= tol);
}

}  // namespace

TEMPLATE_TEST_CASE("tupe: fused kernel equals the reference with the position bias materialized", "[tupe][kernel]",
                   float, double) {
  const fused_case cases[] = {
      {"[CLS] reset + relative, padded, tiles 16/24", 2, 70, 3, 8, true, true, true, false, 16, 24},
      {"[CLS] reset, no relative term, tiles 16/24", 1, 50, 2, 16, true, false, false, false, 16, 24},
      {"relative term, no reset, padded, default tiles", 2, 45, 4, 8, false, true, true, false, 0, 0},
      {"untied term only", 1, 40, 2, 8, false, false, false, false, 16, 24},
      {"packed documents (non-contiguous positions, two [CLS]), tiles 16/24", 2, 60, 2, 8, true, true, true, true,
       16, 24},
      {"one tile per head (L < the tile)", 1, 9, 2, 4, true, true, false, false, 0, 0},
  };
  for (const auto& fc : cases) run_fused<TestType>(fc);
}

TEST_CASE("tupe: the tile hook adds exactly the materialized bias", "[tupe]") {
  // Independent of the kernel: one tile with [CLS] inside it, contiguous and scattered keys.
  const tupe_params prm(40, 2, 4, true, true, 7);
  const posenc::tupe enc = prm.make();
  posenc::call_info info;
  info.heads = 2;
  info.head_dim = 4;
  info.q_min = 0;
  info.q_max = 39;
  info.k_min = 0;
  info.k_max = 39;
  const auto b = enc.bind(info);
  std::vector<std::int64_t> qp = {0, 1, 2, 3, 4};
  std::vector<std::int64_t> contiguous(20), scattered(20);
  for (idx j = 0; j < 20; ++j) {
    contiguous[static_cast<std::size_t>(j)] = j;
    scattered[static_cast<std::size_t>(j)] = (j * 7) % 40;
  }
  for (const auto* kp : {&contiguous, &scattered}) {
    const idx rows = 5, cols = 20, stride = 23;
    std::vector<double> s(static_cast<std::size_t>(rows * stride), 0.25);
    posenc::tile<double> t;
    t.head = 1;
    t.rows = rows;
    t.cols = cols;
    t.q_pos = qp.data();
    t.k_pos = kp->data();
    b.add_position_bias(t, posenc::matrix_map<double>(s.data(), rows, cols, Eigen::OuterStride<>(stride)));
    for (idx i = 0; i < rows; ++i)
      for (idx j = 0; j < stride; ++j) {
        const double got = s[static_cast<std::size_t>(i * stride + j)];
        if (j >= cols) {
          REQUIRE(got == 0.25);
          continue;
        }
        const double want = 0.25 + prm.bias(1, qp[static_cast<std::size_t>(i)], (*kp)[static_cast<std::size_t>(j)]);
        REQUIRE(std::abs(got - want) <= 1e-13);
        REQUIRE(std::abs(enc.position_bias(1, qp[static_cast<std::size_t>(i)], (*kp)[static_cast<std::size_t>(j)]) -
                         (want - 0.25)) <= 1e-13);
      }
  }
  // The [CLS] buckets: row 0 takes bins / 2 (also at (0, 0)), column 0 takes bins.
  CHECK(enc.relative_bucket(0, 0) == 16);
  CHECK(enc.relative_bucket(0, 9) == 16);
  CHECK(enc.relative_bucket(9, 0) == 32);
  CHECK(enc.relative_bucket(3, 10) == posenc::t5_relative_bucket(7));
  CHECK(enc.logit_scale(64) == 1.0 / std::sqrt(128.0));
}

TEMPLATE_TEST_CASE("tupe: 1, 2 and 8 threads give bitwise identical outputs", "[tupe][threads]", float, double) {
  using T = TestType;
  const idx B = 2, S = 130, H = 3, D = 8;
  const tupe_params prm(S, H, D, true, true, 50);
  std::vector<std::vector<T>> store;
  const posenc::tupe enc(prm.weights<T>(store), prm.config());
  const auto qd = test_util::randn(static_cast<std::size_t>(B * S * H * D), 1);
  const auto kd = test_util::randn(static_cast<std::size_t>(B * S * H * D), 2);
  const auto vd = test_util::randn(static_cast<std::size_t>(B * S * H * D), 3);
  const std::vector<T> q(qd.begin(), qd.end()), k(kd.begin(), kd.end()), v(vd.begin(), vd.end());
  std::vector<std::int64_t> pad(static_cast<std::size_t>(B * S), 0);
  for (idx j = S - 11; j < S; ++j) pad[static_cast<std::size_t>(S + j)] = 1;
  std::vector<std::vector<T>> outs;
  for (int threads : {1, 2, 8}) {
    Eigen::ThreadPool pool(threads);
    posenc::attention_options opt{.q_block = 16, .k_block = 24};
    opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), B, S);
    opt.pool = &pool;
    std::vector<T> out(q.size());
    posenc::attention<T>(posenc::bshd(q.data(), B, S, H, D), posenc::bshd(k.data(), B, S, H, D),
                         posenc::bshd(v.data(), B, S, H, D), posenc::bshd(out.data(), B, S, H, D), enc, opt);
    outs.push_back(std::move(out));
  }
  REQUIRE(outs[0] == outs[1]);
  REQUIRE(outs[0] == outs[2]);
}

TEST_CASE("tupe: golden cases (position_bias, rel_buckets, out)", "[tupe][golden]") {
  for (const std::string name : {"tupe_r_cls_reset_rel32_h2", "tupe_r_no_reset_rel32_h3"}) {
    INFO(name);
    const auto c = golden::load(name);
    const auto& p = c.params();
    const idx H = p.at("num_attention_heads").get<idx>();
    const bool cls = p.at("cls_reset").get<bool>();
    const auto xs = c.at("x").shape;
    const idx B = xs[0], S = xs[1], Dm = xs[2], D = Dm / H;
    auto f = [&](const char* n) { return c.at(n).f64(); };
    const auto pos = f("pos_emb"), uq = f("Uq"), buq = f("bUq"), uk = f("Uk"), buk = f("bUk");
    const auto rel = f("relative_attention_bias");
    std::vector<double> c2o, o2c;
    posenc::tupe_weights<double> w{.pos_emb = {pos.data(), S, Dm},
                                   .pos_q_weight = {uq.data(), Dm, Dm},
                                   .pos_q_bias = {buq.data(), Dm},
                                   .pos_k_weight = {uk.data(), Dm, Dm},
                                   .pos_k_bias = {buk.data(), Dm}};
    w.relative_attention_bias.emplace(rel.data(), c.at("relative_attention_bias").shape[0], H);
    if (cls) {
      c2o = f("theta_cls_to_others");
      o2c = f("theta_others_to_cls");
      w.theta_cls_to_others.emplace(c2o.data(), H);
      w.theta_others_to_cls.emplace(o2c.data(), H);
    }
    const posenc::tupe enc(w, {.num_attention_heads = H,
                               .cls_reset = cls,
                               .rel_pos_bins = p.at("rel_pos_bins").get<idx>(),
                               .max_rel_pos = p.at("max_rel_pos").get<idx>()});
    const auto want_bias = f("position_bias");
    const auto want_buckets = c.at("rel_buckets").i64();
    for (idx h = 0; h < H; ++h)
      for (idx i = 0; i < S; ++i)
        for (idx j = 0; j < S; ++j) {
          REQUIRE(std::abs(enc.position_bias(h, i, j) - want_bias[static_cast<std::size_t>((h * S + i) * S + j)]) <=
                  1e-11);
          if (h == 0) REQUIRE(enc.relative_bucket(i, j) == want_buckets[static_cast<std::size_t>(i * S + j)]);
        }

    // q, k, v = x W^T + b, split into heads; the fused kernel with the encoding's own scale.
    const auto x = f("x");
    auto project = [&](const char* wn, const char* bn) {
      const auto W = f(wn), bb = f(bn);
      std::vector<double> y(static_cast<std::size_t>(B * S * Dm));
      for (idx t = 0; t < B * S; ++t)
        for (idx o = 0; o < Dm; ++o) {
          double acc = bb[static_cast<std::size_t>(o)];
          for (idx m = 0; m < Dm; ++m)
            acc += x[static_cast<std::size_t>(t * Dm + m)] * W[static_cast<std::size_t>(o * Dm + m)];
          y[static_cast<std::size_t>(t * Dm + o)] = acc;
        }
      return y;
    };
    const auto q = project("Wq", "bq"), k = project("Wk", "bk"), v = project("Wv", "bv");
    std::vector<std::int64_t> pad(static_cast<std::size_t>(B * S), 0);
    if (c.has("key_padding_mask")) pad = c.at("key_padding_mask").i64();
    posenc::attention_options opt;
    opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), B, S);
    std::vector<double> out(q.size());
    posenc::attention<double>(posenc::bshd(q.data(), B, S, H, D), posenc::bshd(k.data(), B, S, H, D),
                              posenc::bshd(v.data(), B, S, H, D), posenc::bshd(out.data(), B, S, H, D), enc, opt);
    const auto want = f("out");
    for (std::size_t e = 0; e < out.size(); ++e) REQUIRE(std::abs(out[e] - want[e]) <= 1e-11);
  }
}

TEST_CASE("tupe: argument errors name the argument, the output stays untouched", "[tupe][errors]") {
  const tupe_params prm(20, 2, 4, true, true, 3);
  std::vector<std::vector<double>> store;
  const auto good = prm.weights<double>(store);
  const auto cfg = prm.config();
  CHECK_NOTHROW(posenc::tupe(good, cfg));
  // (a TensorMap assignment would copy values, not rebind: each case builds its own weights)
  auto reshaped = [&](idx q_rows, idx q_cols, idx k_rows, idx k_cols, idx kb_len) {
    return posenc::tupe_weights<double>{.pos_emb = good.pos_emb,
                                        .pos_q_weight = {store[1].data(), q_rows, q_cols},
                                        .pos_q_bias = good.pos_q_bias,
                                        .pos_k_weight = {store[3].data(), k_rows, k_cols},
                                        .pos_k_bias = {store[4].data(), kb_len},
                                        .theta_cls_to_others = good.theta_cls_to_others,
                                        .theta_others_to_cls = good.theta_others_to_cls,
                                        .relative_attention_bias = good.relative_attention_bias};
  };
  CHECK_NOTHROW(posenc::tupe(reshaped(8, 8, 8, 8, 8), cfg));
  CHECK_THROWS_WITH(posenc::tupe(reshaped(8, 7, 8, 8, 8), cfg),
                    Catch::Contains("pos_q_weight") && Catch::Contains("[8, 7]"));
  CHECK_THROWS_WITH(posenc::tupe(reshaped(8, 8, 4, 8, 8), cfg), Catch::Contains("pos_k_weight"));
  CHECK_THROWS_WITH(posenc::tupe(reshaped(8, 8, 8, 8, 7), cfg),
                    Catch::Contains("pos_k_bias") && Catch::Contains("7 vs 8"));
  {
    auto w = good;
    w.theta_others_to_cls.reset();
    CHECK_THROWS_WITH(posenc::tupe(w, cfg), Catch::Contains("theta_others_to_cls") && Catch::Contains("cls_reset"));
    w.theta_cls_to_others.emplace(store[5].data(), 3);
    CHECK_THROWS_WITH(posenc::tupe(w, cfg), Catch::Contains("theta_cls_to_others"));
  }
  {
    auto w = good;
    w.relative_attention_bias.emplace(store[7].data(), 32, 2);  // the [CLS] row is missing
    CHECK_THROWS_WITH(posenc::tupe(w, cfg), Catch::Contains("relative_attention_bias") && Catch::Contains("[32, 2]"));
  }
  CHECK_THROWS_WITH(posenc::tupe(good, {.num_attention_heads = 3}), Catch::Contains("pos_q_weight"));
  CHECK_THROWS_WITH(posenc::tupe(good, {.num_attention_heads = 0}), Catch::Contains("num_attention_heads"));
  {
    auto c2 = cfg;
    c2.max_rel_pos = 8;  // not beyond the 8 exact buckets
    CHECK_THROWS_WITH(posenc::tupe(good, c2), Catch::Contains("max_distance"));
  }

  // Call errors, raised by bind before anything is written.
  const posenc::tupe enc(good, cfg);
  auto call = [&](idx S, idx H, idx D, const posenc::attention_options& opt) {
    const std::vector<double> q(static_cast<std::size_t>(S * H * D), 0.5);
    std::vector<double> out(q.size(), -3.0);
    std::string message;
    try {
      posenc::attention<double>(posenc::bshd(q.data(), 1, S, H, D), posenc::bshd(q.data(), 1, S, H, D),
                                posenc::bshd(q.data(), 1, S, H, D), posenc::bshd(out.data(), 1, S, H, D), enc, opt);
    } catch (const posenc::error& e) {
      message = e.what();
      CHECK(std::all_of(out.begin(), out.end(), [](double x) { return x == -3.0; }));
    }
    return message;
  };
  CHECK_THAT(call(10, 3, 4, {}), Catch::Contains("heads") && Catch::Contains("2 vs 3"));
  CHECK_THAT(call(10, 2, 8, {}), Catch::Contains("head_dim") && Catch::Contains("4 vs 8"));
  CHECK_THAT(call(21, 2, 4, {}), Catch::Contains("q_positions") && Catch::Contains("[0, 20] for 20 rows"));
  posenc::positions far = posenc::contiguous_positions(1, 10);
  far(0, 9) = 20;
  posenc::attention_options far_keys;
  far_keys.k_positions = posenc::view(far);
  CHECK_THAT(call(10, 2, 4, far_keys), Catch::Contains("k_positions") && Catch::Contains("[0, 20] for 20 rows"));
  posenc::attention_options late;
  late.q_offset = 15;  // queries at 15..24 overrun the 20-row table
  CHECK_THAT(call(10, 2, 4, late), Catch::Contains("q_positions"));
  CHECK(call(20, 2, 4, {}).empty());
}

namespace {

/// An official-code checkpoint (random weights) written as safetensors, and its forward pass's
/// position bias written out directly: LayerNorm of pos.weight, the (S+1) x (S+1) untied term,
/// cls_2_other = [0, 0], other_2_cls = [1, 1], the [1:, 1:] offset, column 0 then row 0 reset.
struct official_checkpoint {
  idx H = 2, Dm = 8, N = 12, bins = 32;  // N = max_positions
  std::vector<double> pos, ln_w, ln_b, uq, buq, uk, buk, rel;
  official_checkpoint() {
    pos = test_util::randn(static_cast<std::size_t>((N + 1) * Dm), 60);
    ln_w = test_util::randn(static_cast<std::size_t>(Dm), 61, 0.2);
    for (auto& g : ln_w) g += 1.0;
    ln_b = test_util::randn(static_cast<std::size_t>(Dm), 62, 0.1);
    uq = test_util::randn(static_cast<std::size_t>(Dm * Dm), 63, 0.3);
    buq = test_util::randn(static_cast<std::size_t>(Dm), 64, 0.3);
    uk = test_util::randn(static_cast<std::size_t>(Dm * Dm), 65, 0.3);
    buk = test_util::randn(static_cast<std::size_t>(Dm), 66, 0.3);
    rel = test_util::randn(static_cast<std::size_t>((bins + 1) * H), 67);
  }
  [[nodiscard]] std::vector<unsigned char> file(const std::string& prefix, idx rel_rows = 33) const {
    posenc::io::safetensors_writer w;
    w.add<double>(prefix + "pos.weight", {N + 1, Dm}, pos)
        .add<double>(prefix + "pos_ln.weight", {Dm}, ln_w)
        .add<double>(prefix + "pos_ln.bias", {Dm}, ln_b)
        .add<double>(prefix + "pos_q_linear.weight", {Dm, Dm}, uq)
        .add<double>(prefix + "pos_q_linear.bias", {Dm}, buq)
        .add<double>(prefix + "pos_k_linear.weight", {Dm, Dm}, uk)
        .add<double>(prefix + "pos_k_linear.bias", {Dm}, buk);
    std::vector<double> r(rel.begin(), rel.begin() + rel_rows * H);
    w.add<double>(prefix + "relative_attention_bias.weight", {rel_rows, H}, r);
    return w.bytes();
  }
  [[nodiscard]] double bias(idx h, idx i, idx j) const {
    auto ln = [&](idx row, idx c) {
      double mean = 0, var = 0;
      for (idx m = 0; m < Dm; ++m) mean += pos[static_cast<std::size_t>(row * Dm + m)] / double(Dm);
      for (idx m = 0; m < Dm; ++m) {
        const double z = pos[static_cast<std::size_t>(row * Dm + m)] - mean;
        var += z * z / double(Dm);
      }
      return (pos[static_cast<std::size_t>(row * Dm + c)] - mean) / std::sqrt(var + 1e-5) *
                 ln_w[static_cast<std::size_t>(c)] +
             ln_b[static_cast<std::size_t>(c)];
    };
    const idx d = Dm / H;
    auto term = [&](idx a, idx b) {
      double dot = 0;
      for (idx c = h * d; c < (h + 1) * d; ++c) {
        double x = buq[static_cast<std::size_t>(c)], y = buk[static_cast<std::size_t>(c)];
        for (idx m = 0; m < Dm; ++m) {
          x += ln(a, m) * uq[static_cast<std::size_t>(c * Dm + m)];
          y += ln(b, m) * uk[static_cast<std::size_t>(c * Dm + m)];
        }
        dot += x * y;
      }
      return dot / std::sqrt(2.0 * double(d));
    };
    double absolute = term(i + 1, j + 1);
    std::int64_t bucket = posenc::t5_relative_bucket(j - i, bins, 128, true);
    if (j == 0) {
      absolute = term(1, 1);
      bucket = bins;
    }
    if (i == 0) {
      absolute = term(0, 0);
      bucket = bins / 2;
    }
    return absolute + rel[static_cast<std::size_t>(bucket * H + h)];
  }
};

}  // namespace

TEST_CASE("tupe io: official checkpoint names, fairseq arguments, shape errors name the tensor", "[tupe][io]") {
  const official_checkpoint ck;
  const auto args = nlohmann::json::parse(
      R"({"encoder_attention_heads": 2, "encoder_embed_dim": 8, "max_positions": 12, "rel_pos": true})");
  const posenc::io::tupe_spec spec = posenc::io::tupe_spec_from_args(args);
  CHECK(spec.heads == 2);
  CHECK(spec.max_positions == 12);
  CHECK(spec.rel_pos);
  CHECK(spec.rel_pos_bins == 32);
  CHECK(spec.max_rel_pos == 128);

  const auto st = posenc::io::safetensors_file::parse(ck.file("decoder.sentence_encoder."));
  const posenc::tupe enc = posenc::io::tupe_from_safetensors(st, spec);  // prefix found by itself
  REQUIRE(enc.max_positions() == 12);
  REQUIRE(enc.has_relative());
  REQUIRE(enc.config().cls_reset);
  for (idx h = 0; h < 2; ++h)
    for (idx i = 0; i < 12; ++i)
      for (idx j = 0; j < 12; ++j) REQUIRE(std::abs(enc.position_bias(h, i, j) - ck.bias(h, i, j)) <= 1e-12);

  // Without --rel-pos the table is not read.
  auto no_rel = spec;
  no_rel.rel_pos = false;
  CHECK_FALSE(posenc::io::tupe_from_safetensors(st, no_rel, "decoder.sentence_encoder.").has_relative());

  // A table whose shape does not fit the arguments: the error names the tensor.
  const auto bad = posenc::io::safetensors_file::parse(ck.file("", 32));
  CHECK_THROWS_WITH(posenc::io::tupe_from_safetensors(bad, spec),
                    Catch::Contains("relative_attention_bias.weight") && Catch::Contains("[32, 2]") &&
                        Catch::Contains("[33, 2]"));
  auto wider = spec;
  wider.max_positions = 20;
  CHECK_THROWS_WITH(posenc::io::tupe_from_safetensors(st, wider), Catch::Contains("decoder.sentence_encoder.pos.weight"));
  auto heads3 = spec;
  heads3.heads = 4;
  CHECK_THROWS_WITH(posenc::io::tupe_from_safetensors(st, heads3), Catch::Contains("relative_attention_bias.weight"));
  CHECK_THROWS_WITH(posenc::io::tupe_spec_from_args(nlohmann::json::parse(R"({"encoder_embed_dim": 8})")),
                    Catch::Contains("encoder_attention_heads"));
  CHECK_THROWS_WITH(posenc::io::tupe_spec_from_args(nlohmann::json::parse(
                        R"({"encoder_attention_heads": 3, "encoder_embed_dim": 8, "max_positions": 4})")),
                    Catch::Contains("encoder_embed_dim"));
}
