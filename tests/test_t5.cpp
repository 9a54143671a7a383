// T5 relative bias: buckets against a float32 replica of HF's _relative_position_bucket written here
// (every r in [-5000, 5000], several configurations, both directions), the golden cases (FORMAT.md
// 5.5 and the fragile rule of sec. 4), the bound per-call table, and the fused kernel against the
// double reference attention with the bias materialized from the replica.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "golden.hpp"
#include "posenc/attention.hpp"
#include "posenc/reference.hpp"
#include "posenc/t5.hpp"
#include "random.hpp"

using idx = posenc::index_t;
using t5d = posenc::t5_relative_bias<double>;

static_assert(posenc::attention_encoding<t5d>);
static_assert(posenc::has_bind<t5d>);
static_assert(posenc::has_logit_scale<t5d>);
static_assert(posenc::has_position_bias<t5d::bound, float>);
static_assert(posenc::has_position_bias<t5d::bound, double>);

namespace {

// Hugging Face T5Attention._relative_position_bucket transliterated with the dtypes PyTorch uses:
// the position tensor is int64, `.float() / max_exact` and torch.log are float32, the division by
// the Python float math.log(max_distance / max_exact) and the product with (num_buckets - max_exact)
// are float32 ops, `.to(torch.long)` truncates.
std::int64_t hf_bucket_replica(std::int64_t relative_position, std::int64_t num_buckets, std::int64_t max_distance,
                               bool bidirectional) {
  std::int64_t relative_buckets = 0;
  if (bidirectional) {
    num_buckets /= 2;
    relative_buckets += (relative_position > 0 ? 1 : 0) * num_buckets;
    relative_position = relative_position < 0 ? -relative_position : relative_position;
  } else {
    relative_position = -std::min<std::int64_t>(relative_position, 0);
  }
  const std::int64_t max_exact = num_buckets / 2;
  const bool is_small = relative_position < max_exact;
  if (is_small) return relative_buckets + relative_position;  // torch.where picks this branch
  const float scaled = static_cast<float>(relative_position) / static_cast<float>(max_exact);
  const float logged = std::log(scaled);
  const float divided = logged / static_cast<float>(std::log(double(max_distance) / double(max_exact)));
  const float multiplied = divided * static_cast<float>(num_buckets - max_exact);
  std::int64_t large = max_exact + static_cast<std::int64_t>(multiplied);
  large = std::min<std::int64_t>(large, num_buckets - 1);
  return relative_buckets + large;
}

}  // namespace

TEST_CASE("t5: every r in [-5000, 5000] buckets like the float32 replica of HF", "[t5]") {
  struct cfg {
    idx nb, md;
  };
  const cfg cfgs[] = {{32, 128}, {32, 64}, {64, 128}, {128, 4096}, {16, 32}, {8, 20}, {4, 8}, {320, 1000}, {6, 7}};
  for (const auto& c : cfgs) {
    for (bool bidirectional : {true, false}) {
      posenc::t5_relative_bias<float> enc(Eigen::Tensor<float, 2, Eigen::RowMajor>(c.nb, 1),
                                          {.num_buckets = c.nb, .max_distance = c.md, .is_decoder = !bidirectional});
      std::int64_t hi = 0;
      for (std::int64_t r = -5000; r <= 5000; ++r) {
        const std::int64_t want = hf_bucket_replica(r, c.nb, c.md, bidirectional);
        const std::int32_t got = enc.bucket(r);
        if (got != want) {
          INFO("num_buckets " << c.nb << " max_distance " << c.md << " bidirectional " << bidirectional << " r " << r);
          REQUIRE(got == want);
        }
        REQUIRE(got == posenc::t5_relative_bucket(r, c.nb, c.md, bidirectional));
        hi = std::max<std::int64_t>(hi, got);
      }
      CHECK(hi == c.nb - 1);  // the range reaches the last bucket
      // Far beyond: saturates without UB.
      for (std::int64_t r : {std::int64_t{1} << 40, -(std::int64_t{1} << 40), std::int64_t{123456789}})
        REQUIRE(enc.bucket(r) == hf_bucket_replica(r, c.nb, c.md, bidirectional));
      const std::int64_t extremes[] = {INT64_MAX, INT64_MIN};
      for (std::int64_t r : extremes) {
        const std::int32_t b = enc.bucket(r);
        REQUIRE(b >= 0);
        REQUIRE(b < c.nb);
      }
    }
  }
}

TEST_CASE("t5: known buckets of the 32/128 configuration", "[t5]") {
  // Bidirectional: 16 per direction, 8 exact; future keys (r > 0) take the upper half.
  CHECK(posenc::t5_relative_bucket(0) == 0);
  CHECK(posenc::t5_relative_bucket(-7) == 7);
  CHECK(posenc::t5_relative_bucket(7) == 23);
  CHECK(posenc::t5_relative_bucket(-8) == 8);
  CHECK(posenc::t5_relative_bucket(-200) == 15);
  CHECK(posenc::t5_relative_bucket(200) == 31);
  // Unidirectional: future keys -> 0; 16 exact buckets.
  CHECK(posenc::t5_relative_bucket(5, 32, 128, false) == 0);
  CHECK(posenc::t5_relative_bucket(-15, 32, 128, false) == 15);
  CHECK(posenc::t5_relative_bucket(-1000, 32, 128, false) == 31);
}

TEST_CASE("t5: configuration and table errors", "[t5][errors]") {
  using table = Eigen::Tensor<double, 2, Eigen::RowMajor>;
  CHECK_THROWS_WITH(t5d(table(32, 4), {.num_buckets = 2}), Catch::Contains("num_buckets") && Catch::Contains("2"));
  CHECK_THROWS_AS(t5d(table(1, 4), {.num_buckets = 1, .is_decoder = true}), posenc::error);
  CHECK_THROWS_WITH(t5d(table(32, 4), {.num_buckets = 32, .max_distance = 8}), Catch::Contains("max_distance"));
  CHECK_THROWS_WITH(t5d(table(16, 4), {.num_buckets = 32}),
                    Catch::Contains("relative_attention_bias") && Catch::Contains("16 rows vs 32"));
  CHECK_NOTHROW(t5d(table(32, 4), {.num_buckets = 32, .max_distance = 9}));
  t5d enc(table(32, 4));
  CHECK(enc.logit_scale(64) == 1.0);
  posenc::call_info info;
  info.heads = 8;
  CHECK_THROWS_WITH(enc.bind(info), Catch::Contains("heads") && Catch::Contains("4 vs 8"));
}

TEMPLATE_TEST_CASE("t5: bound table per relative distance; tile hook equals the lookup", "[t5]", float, double) {
  using T = TestType;
  const idx NB = 32, H = 3;
  const auto w = test_util::randn(static_cast<std::size_t>(NB * H), 5);
  t5d enc(posenc::tensor_map<const double, 2>(w.data(), NB, H));
  REQUIRE(enc.table().data() == w.data());  // viewed, not copied
  // A decode-like call: queries at 500..503, keys at 0..599 (as positions_view would give).
  posenc::call_info info;
  info.heads = H;
  info.q_min = 500;
  info.q_max = 503;
  info.k_min = 0;
  info.k_max = 599;
  const auto b = enc.bind(info);
  REQUIRE(b.min_relative() == 0 - 503);
  REQUIRE(b.max_relative() == 599 - 500);
  for (std::int64_t r = -503; r <= 99; ++r) REQUIRE(b.bucket(r) == hf_bucket_replica(r, NB, 128, true));
  REQUIRE(b.logit_scale(64) == 1.0);

  std::vector<std::int64_t> qp = {500, 503, 501};
  std::vector<std::int64_t> contiguous(70), scattered(70);
  for (idx j = 0; j < 70; ++j) {
    contiguous[static_cast<std::size_t>(j)] = 530 + j;
    scattered[static_cast<std::size_t>(j)] = (j * 131) % 600;
  }
  for (const auto* kp : {&contiguous, &scattered}) {
    const idx rows = 3, cols = 70, stride = 75;
    std::vector<T> s(static_cast<std::size_t>(rows * stride), T(0.5));
    posenc::tile<T> t;
    t.head = 2;
    t.rows = rows;
    t.cols = cols;
    t.q_pos = qp.data();
    t.k_pos = kp->data();
    b.add_position_bias(t, posenc::matrix_map<T>(s.data(), rows, cols, Eigen::OuterStride<>(stride)));
    for (idx i = 0; i < rows; ++i)
      for (idx j = 0; j < stride; ++j) {
        const T got = s[static_cast<std::size_t>(i * stride + j)];
        if (j >= cols) {
          REQUIRE(got == T(0.5));
          continue;
        }
        const auto bucket =
            hf_bucket_replica((*kp)[static_cast<std::size_t>(j)] - qp[static_cast<std::size_t>(i)], NB, 128, true);
        REQUIRE(got == T(0.5) + static_cast<T>(w[static_cast<std::size_t>(bucket * H + 2)]));
      }
  }
}

TEST_CASE("t5: golden cases (range and matrix buckets, bias, reference probs/out, fused out)", "[t5][golden]") {
  // The range tensors also fix which relative positions are fragile for the matrices (FORMAT.md sec. 4).
  for (const std::string name :
       {"t5_encoder_32_128_h8", "t5_decoder_32_128_h8", "t5_decoder_32_128_decode_step_pos199"}) {
    INFO(name);
    const auto c = golden::load(name);
    const auto& prm = c.params();
    const idx NB = prm.at("relative_attention_num_buckets").get<idx>();
    const idx MD = prm.at("relative_attention_max_distance").get<idx>();
    const bool decoder = prm.at("is_decoder").get<bool>();
    const auto& wt = c.at("relative_attention_bias");
    const idx H = wt.shape[1];
    const auto w = wt.f64();
    t5d enc(posenc::tensor_map<const double, 2>(w.data(), NB, H),
            {.num_buckets = NB, .max_distance = MD, .is_decoder = decoder});

    std::vector<std::int64_t> fragile_r;
    if (c.has("relative_position_range")) {
      const auto range = c.at("relative_position_range").i64();
      const auto want = c.at("range_buckets").i64();
      const auto fragile = c.at("range_fragile").i64();
      int fragile_differ = 0;
      for (std::size_t e = 0; e < range.size(); ++e) {
        const std::int64_t got = enc.bucket(range[e]);
        INFO("r " << range[e]);
        if (fragile[e] != 0) {
          fragile_r.push_back(range[e]);
          REQUIRE(std::abs(got - want[e]) <= 1);
          fragile_differ += got != want[e] ? 1 : 0;
        } else {
          REQUIRE(got == want[e]);
        }
      }
      INFO("fragile entries differing by one: " << fragile_differ);
      SUCCEED();
    }
    const auto is_fragile = [&](std::int64_t r) {
      return std::find(fragile_r.begin(), fragile_r.end(), r) != fragile_r.end();
    };

    const auto& qt = c.at("q");
    const idx B = qt.shape[0], Sq = qt.shape[1], D = qt.shape[3], Sk = c.at("k").shape[1];
    std::vector<std::int64_t> qpos(static_cast<std::size_t>(Sq));
    for (idx i = 0; i < Sq; ++i) qpos[static_cast<std::size_t>(i)] = i;
    if (c.has("query_positions")) qpos = c.at("query_positions").i64();
    const auto buckets = c.at("buckets").i64();
    const auto bias = c.at("bias").f64();
    bool any_fragile_diff = false;
    for (idx i = 0; i < Sq; ++i)
      for (idx j = 0; j < Sk; ++j) {
        const std::int64_t r = j - qpos[static_cast<std::size_t>(i)];
        const std::int64_t want = buckets[static_cast<std::size_t>(i * Sk + j)];
        const std::int64_t got = enc.bucket(r);
        if (is_fragile(r)) {
          REQUIRE(std::abs(got - want) <= 1);
          any_fragile_diff = any_fragile_diff || got != want;
          continue;
        }
        REQUIRE(got == want);
        for (idx h = 0; h < H; ++h)
          REQUIRE(std::abs(enc.bias(h, qpos[static_cast<std::size_t>(i)], j) -
                           bias[static_cast<std::size_t>((h * Sq + i) * Sk + j)]) <= 1e-11);
      }
    if (any_fragile_diff) {
      WARN("a fragile bucket differs by one (logf not correctly rounded here): out/probs not compared");
      continue;
    }

    const auto q = qt.f64(), k = c.at("k").f64(), v = c.at("v").f64();
    posenc::attention_options opt{.causal = decoder};
    posenc::positions qp_t(B, Sq);
    for (idx b = 0; b < B; ++b)
      for (idx i = 0; i < Sq; ++i) qp_t(b, i) = qpos[static_cast<std::size_t>(i)];
    opt.q_positions = posenc::view(qp_t);
    std::vector<std::int64_t> pad;
    if (c.has("key_padding_mask")) {
      pad = c.at("key_padding_mask").i64();
      opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), B, Sk);
    }
    opt.scale = 1.0;  // FORMAT 5.5: no 1/sqrt(D)
    posenc::reference_terms<double> terms;
    terms.bias = [&](idx, idx h, idx i, idx j) { return enc.bias(h, qpos[static_cast<std::size_t>(i)], j); };
    std::vector<double> out(q.size()), probs(static_cast<std::size_t>(B * H * Sq * Sk));
    posenc::reference_attention<double>(posenc::bshd(q.data(), B, Sq, H, D), posenc::bshd(k.data(), B, Sk, H, D),
                                        posenc::bshd(v.data(), B, Sk, H, D), posenc::bshd(out.data(), B, Sq, H, D), opt,
                                        terms, posenc::tensor_map<double, 4>(probs.data(), B, H, Sq, Sk));
    const auto want_out = c.at("out").f64(), want_probs = c.at("probs").f64();
    const auto to = golden::tolerance(c, "out"), tp = golden::tolerance(c, "probs");
    for (std::size_t e = 0; e < out.size(); ++e)
      REQUIRE(std::abs(out[e] - want_out[e]) <= to.atol + to.rtol * std::abs(want_out[e]));
    for (std::size_t e = 0; e < probs.size(); ++e)
      REQUIRE(std::abs(probs[e] - want_probs[e]) <= tp.atol + tp.rtol * std::abs(want_probs[e]));

    // Fused: the scale comes from the encoding (1.0), positions from opt, small tiles.
    opt.scale.reset();
    opt.q_block = 8;
    opt.k_block = 16;
    std::vector<double> fused(q.size(), -7.0);
    posenc::attention<double>(posenc::bshd(q.data(), B, Sq, H, D), posenc::bshd(k.data(), B, Sk, H, D),
                              posenc::bshd(v.data(), B, Sk, H, D), posenc::bshd(fused.data(), B, Sq, H, D), enc, opt);
    for (std::size_t e = 0; e < fused.size(); ++e)
      REQUIRE(std::abs(fused[e] - want_out[e]) <= to.atol + to.rtol * std::abs(want_out[e]));
    // A decode step can also say where it is with q_offset alone.
    if (Sq == 1) {
      posenc::attention_options o2{.causal = decoder, .q_offset = qpos[0]};
      std::vector<double> f2(q.size(), -7.0);
      posenc::attention<double>(posenc::bshd(q.data(), B, Sq, H, D), posenc::bshd(k.data(), B, Sk, H, D),
                                posenc::bshd(v.data(), B, Sk, H, D), posenc::bshd(f2.data(), B, Sq, H, D), enc, o2);
      for (std::size_t e = 0; e < f2.size(); ++e) REQUIRE(std::abs(f2[e] - want_out[e]) <= to.atol);
    }
  }
}

namespace {

struct fused_case {
  const char* what;
  idx B, Sq, Sk, H, Hkv, D, NB, MD;
  bool decoder, causal;
  std::int64_t q_offset;
  bool padded, packed_keys;
};

template <class T>
void run_fused(const fused_case& fc) {
  INFO(fc.what);
  const auto qd = test_util::randn(static_cast<std::size_t>(fc.B * fc.Sq * fc.H * fc.D), 21, 0.3);
  const auto kd = test_util::randn(static_cast<std::size_t>(fc.B * fc.Sk * fc.Hkv * fc.D), 22, 0.3);
  const auto vd = test_util::randn(static_cast<std::size_t>(fc.B * fc.Sk * fc.Hkv * fc.D), 23);
  const auto wd = test_util::randn(static_cast<std::size_t>(fc.NB * fc.H), 24);
  std::vector<std::int64_t> pad(static_cast<std::size_t>(fc.B * fc.Sk), 0);
  if (fc.padded)
    for (idx b = 0; b < fc.B; ++b)
      for (idx j = fc.Sk - 1 - 4 * b; j < fc.Sk; ++j) pad[static_cast<std::size_t>(b * fc.Sk + j)] = 1;
  posenc::attention_options opt{.causal = fc.causal, .q_offset = fc.q_offset};
  if (fc.padded) opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), fc.B, fc.Sk);
  // Packed keys: positions restart in the middle (two documents), so tiles see non-contiguous keys.
  posenc::positions kpos = posenc::contiguous_positions(fc.B, fc.Sk);
  if (fc.packed_keys) {
    for (idx b = 0; b < fc.B; ++b)
      for (idx j = fc.Sk / 2; j < fc.Sk; ++j) kpos(b, j) = j - fc.Sk / 2 + 3 * b;
    opt.k_positions = posenc::view(kpos);
  }

  posenc::reference_terms<double> terms;
  terms.bias = [&](idx b, idx h, idx i, idx j) {
    const std::int64_t r = kpos(b, j) - (fc.q_offset + i);
    return wd[static_cast<std::size_t>(hf_bucket_replica(r, fc.NB, fc.MD, !fc.decoder) * fc.H + h)];
  };
  std::vector<double> want(static_cast<std::size_t>(fc.B * fc.Sq * fc.H * fc.D));
  posenc::attention_options ref_opt = opt;
  ref_opt.scale = 1.0;
  posenc::reference_attention<double>(posenc::bshd(qd.data(), fc.B, fc.Sq, fc.H, fc.D),
                                      posenc::bshd(kd.data(), fc.B, fc.Sk, fc.Hkv, fc.D),
                                      posenc::bshd(vd.data(), fc.B, fc.Sk, fc.Hkv, fc.D),
                                      posenc::bshd(want.data(), fc.B, fc.Sq, fc.H, fc.D), ref_opt, terms);

  const std::vector<T> q(qd.begin(), qd.end()), k(kd.begin(), kd.end()), v(vd.begin(), vd.end());
  const std::vector<T> w(wd.begin(), wd.end());
  posenc::t5_relative_bias<T> enc(posenc::tensor_map<const T, 2>(w.data(), fc.NB, fc.H),
                                  {.num_buckets = fc.NB, .max_distance = fc.MD, .is_decoder = fc.decoder});
  std::vector<T> got(want.size(), T(-7));
  opt.q_block = 16;
  opt.k_block = 32;
  posenc::attention<T>(
      posenc::bshd(q.data(), fc.B, fc.Sq, fc.H, fc.D), posenc::bshd(k.data(), fc.B, fc.Sk, fc.Hkv, fc.D),
      posenc::bshd(v.data(), fc.B, fc.Sk, fc.Hkv, fc.D), posenc::bshd(got.data(), fc.B, fc.Sq, fc.H, fc.D), enc, opt);
  const double tol = std::is_same_v<T, float> ? 3e-5 : 1e-12;
  for (std::size_t e = 0; e < want.size(); ++e) REQUIRE(std::abs(double(got[e]) - want[e]) <= tol);
}

}  // namespace

TEMPLATE_TEST_CASE("t5: fused kernel equals the reference with the bias materialized", "[t5][kernel]", float, double) {
  const fused_case cases[] = {
      {"encoder, padded, 32/128", 2, 150, 150, 4, 4, 16, 32, 128, false, false, 0, true, false},
      {"decoder causal prefill 32/128", 1, 140, 140, 4, 4, 8, 32, 128, true, true, 0, false, false},
      {"decoder KV-cache decode step at 300", 2, 1, 301, 4, 4, 8, 32, 128, true, true, 300, false, false},
      {"decoder chunk of 5 after 200 cached, padded", 2, 5, 205, 4, 4, 8, 32, 128, true, true, 200, true, false},
      {"GQA 8/2 encoder 64/256", 1, 90, 90, 8, 2, 8, 64, 256, false, false, 0, false, false},
      {"packed keys (non-contiguous positions in a tile)", 2, 60, 60, 4, 4, 8, 32, 128, false, false, 0, false, true},
  };
  for (const auto& fc : cases) run_fused<TestType>(fc);
}

TEST_CASE("t5: a position range too wide for a per-call table falls back to a bucket per score", "[t5]") {
  const idx NB = 32, H = 2;
  const auto w = test_util::randn(static_cast<std::size_t>(NB * H), 9);
  t5d enc(posenc::tensor_map<const double, 2>(w.data(), NB, H));
  posenc::call_info info;
  info.heads = H;
  info.q_min = 0;
  info.q_max = std::int64_t{1} << 30;  // e.g. packed documents with huge position ids
  info.k_min = 0;
  info.k_max = std::int64_t{1} << 30;
  const auto b = enc.bind(info);
  const std::vector<std::int64_t> qp = {0, std::int64_t{1} << 30};
  const std::vector<std::int64_t> kp = {5, (std::int64_t{1} << 30) - 3, 0};
  std::vector<double> s(6, 0.0);
  posenc::tile<double> t;
  t.head = 1;
  t.rows = 2;
  t.cols = 3;
  t.q_pos = qp.data();
  t.k_pos = kp.data();
  b.add_position_bias(t, posenc::matrix_map<double>(s.data(), 2, 3, Eigen::OuterStride<>(3)));
  for (idx i = 0; i < 2; ++i)
    for (idx j = 0; j < 3; ++j) {
      const auto bucket = hf_bucket_replica(kp[static_cast<std::size_t>(j)] - qp[static_cast<std::size_t>(i)], NB,
                                            128, true);
      REQUIRE(s[static_cast<std::size_t>(i * 3 + j)] == w[static_cast<std::size_t>(bucket * H + 1)]);
      REQUIRE(b.bucket(kp[static_cast<std::size_t>(j)] - qp[static_cast<std::size_t>(i)]) == bucket);
    }
}
