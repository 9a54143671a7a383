// DeBERTa-v2/v3 disentangled attention: log buckets against a float32 replica of HF's
// make_log_bucket_position written here (every r in [-5000, 5000], several configurations) and the
// golden bucket case; the fused kernel against the double reference attention with c2p / p2c
// materialized per pair from projections computed here (padding, S = 1, S = span +- 1, one term
// only, shared and separate projections, no buckets, small tiles, scattered positions; float and
// double; 1/2/8 threads bitwise identical); the golden deberta cases; errors; the HF loaders.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <unsupported/Eigen/CXX11/ThreadPool>
#include <vector>

#include "golden.hpp"
#include "posenc/attention.hpp"
#include "posenc/deberta.hpp"
#include "posenc/io/deberta.hpp"
#include "posenc/reference.hpp"
#include "random.hpp"

using idx = posenc::index_t;

static_assert(posenc::attention_encoding<posenc::deberta_disentangled>);
static_assert(posenc::has_bind<posenc::deberta_disentangled>);
static_assert(posenc::has_score_terms<posenc::deberta_disentangled::bound, float>);
static_assert(posenc::has_score_terms<posenc::deberta_disentangled::bound, double>);
static_assert(posenc::has_position_bias<posenc::deberta_disentangled::bound, float>);

namespace {

// Hugging Face make_log_bucket_position transliterated with PyTorch's dtypes: relative_pos is int64,
// `abs_pos / mid` is a float32 true division, torch.log float32, the denominator is
// torch.log(torch.tensor(python float)) (the ratio in double, rounded to float32, then logf), the
// product with (mid - 1) and ceil are float32, `+ mid` and `* sign` stay in float32, `.to(long)`.
std::int64_t hf_log_bucket(std::int64_t relative_pos, std::int64_t bucket_size, std::int64_t max_position) {
  const std::int64_t sign = relative_pos > 0 ? 1 : (relative_pos < 0 ? -1 : 0);
  const std::int64_t mid = bucket_size / 2;
  const std::int64_t abs_pos =
      (relative_pos < mid && relative_pos > -mid) ? mid - 1 : (relative_pos < 0 ? -relative_pos : relative_pos);
  if (abs_pos <= mid) return relative_pos;  // torch.where picks relative_pos
  const float ratio = static_cast<float>(abs_pos) / static_cast<float>(mid);
  const float num = std::log(ratio);
  const float den = std::log(static_cast<float>(static_cast<double>(max_position - 1) / static_cast<double>(mid)));
  const float scaled = (num / den) * static_cast<float>(mid - 1);
  const float log_pos = std::ceil(scaled) + static_cast<float>(mid);
  return static_cast<std::int64_t>(log_pos * static_cast<float>(sign));
}

/// The test's own description of a layer: config, weights, projections computed here in double.
struct layer {
  posenc::deberta_config cfg;
  idx hidden = 0, span = 0;
  std::vector<double> rel, wq, bq, wk, bk, wpk, bpk, wpq, bpq;
  std::vector<double> kr, qr;  // [2 span, H, d] as HF's projection output

  layer(const posenc::deberta_config& c, idx hidden_size, unsigned seed, idx extra_rows = 0) : cfg(c), hidden(hidden_size) {
    span = c.position_buckets > 0 ? c.position_buckets
                                  : (c.max_relative_positions < 1 ? c.max_position_embeddings : c.max_relative_positions);
    const idx hd = c.heads * c.head_dim;
    rel = test_util::randn(static_cast<std::size_t>((2 * span + extra_rows) * hidden), seed, 0.5);
    auto w = [&](unsigned s) { return test_util::randn(static_cast<std::size_t>(hd * hidden), s, 0.2); };
    auto b = [&](unsigned s) { return test_util::randn(static_cast<std::size_t>(hd), s, 0.1); };
    wq = w(seed + 1), bq = b(seed + 2), wk = w(seed + 3), bk = b(seed + 4);
    wpk = w(seed + 5), bpk = b(seed + 6), wpq = w(seed + 7), bpq = b(seed + 8);
    auto project = [&](const std::vector<double>& W, const std::vector<double>& B) {
      std::vector<double> y(static_cast<std::size_t>(2 * span * hd));
      for (idx t = 0; t < 2 * span; ++t)
        for (idx o = 0; o < hd; ++o) {
          double acc = B[static_cast<std::size_t>(o)];
          for (idx m = 0; m < hidden; ++m)
            acc += rel[static_cast<std::size_t>(t * hidden + m)] * W[static_cast<std::size_t>(o * hidden + m)];
          y[static_cast<std::size_t>(t * hd + o)] = acc;
        }
      return y;
    };
    kr = c.share_att_key ? project(wk, bk) : project(wpk, bpk);
    qr = c.share_att_key ? project(wq, bq) : project(wpq, bpq);
  }

  posenc::deberta_weights<double> weights() const {
    const idx hd = cfg.heads * cfg.head_dim;
    posenc::deberta_weights<double> w(
        posenc::tensor_map<const double, 2>(rel.data(), static_cast<idx>(rel.size()) / hidden, hidden));
    auto lin = [&](const std::vector<double>& W, const std::vector<double>& B) {
      return posenc::deberta_linear<double>(posenc::tensor_map<const double, 2>(W.data(), hd, hidden),
                                            posenc::tensor_map<const double, 1>(B.data(), hd));
    };
    w.query_proj = lin(wq, bq);
    w.key_proj = lin(wk, bk);
    w.pos_key_proj = lin(wpk, bpk);
    w.pos_query_proj = lin(wpq, bpq);
    return w;
  }

  /// clip(bucket(q - k) + span, 0, 2 span - 1), buckets from the replica.
  [[nodiscard]] idx row(std::int64_t r) const {
    const std::int64_t b = cfg.position_buckets > 0 ? hf_log_bucket(r, cfg.position_buckets, span_limit()) : r;
    return static_cast<idx>(std::clamp<std::int64_t>(b + span, 0, 2 * span - 1));
  }
  [[nodiscard]] idx span_limit() const {
    return cfg.max_relative_positions < 1 ? cfg.max_position_embeddings : cfg.max_relative_positions;
  }
  [[nodiscard]] double scale() const {
    return 1.0 / std::sqrt(double(cfg.head_dim) * double(1 + (cfg.c2p ? 1 : 0) + (cfg.p2c ? 1 : 0)));
  }
};

struct problem {
  idx B, S, H, D;
  std::vector<double> q, k, v;
  std::vector<std::int64_t> mask;  // HF attention_mask [B, S], empty = all tokens
};

/// Reference: c2p + p2c per pair, padded keys masked, padded query rows -inf (zero output).
std::vector<double> reference(const problem& p, const layer& L, const std::vector<std::int64_t>& qpos,
                              const std::vector<std::int64_t>& kpos) {
  const idx H = p.H, D = p.D;
  auto q = posenc::bshd(p.q.data(), p.B, p.S, H, D);
  auto k = posenc::bshd(p.k.data(), p.B, p.S, H, D);
  posenc::reference_terms<double> terms;
  terms.score_term = [&](idx b, idx h, idx i, idx j) {
    const idx c = L.row(qpos[static_cast<std::size_t>(b * p.S + i)] - kpos[static_cast<std::size_t>(b * p.S + j)]);
    double sum = 0;
    for (idx e = 0; e < D; ++e) {
      if (L.cfg.c2p) sum += q(b, i, h, e) * L.kr[static_cast<std::size_t>((c * H + h) * D + e)];
      if (L.cfg.p2c) sum += k(b, j, h, e) * L.qr[static_cast<std::size_t>((c * H + h) * D + e)];
    }
    return sum;
  };
  if (!p.mask.empty())
    terms.bias = [&](idx b, idx, idx i, idx) {
      return p.mask[static_cast<std::size_t>(b * p.S + i)] != 0 ? 0.0 : -std::numeric_limits<double>::infinity();
    };
  std::vector<std::int64_t> pad;
  posenc::attention_options opt;
  opt.scale = L.scale();
  opt.q_positions = posenc::positions_view(qpos.data(), p.B, p.S);
  opt.k_positions = posenc::positions_view(kpos.data(), p.B, p.S);
  if (!p.mask.empty()) {
    for (auto m : p.mask) pad.push_back(m == 0 ? 1 : 0);
    opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), p.B, p.S);
  }
  std::vector<double> out(p.q.size());
  posenc::reference_attention<double>(q, k, posenc::bshd(p.v.data(), p.B, p.S, H, D), posenc::bshd(out.data(), p.B, p.S, H, D),
                                      opt, terms);
  return out;
}

problem make_problem(idx B, idx S, idx H, idx D, unsigned seed, bool padded) {
  problem p{B, S, H, D, test_util::randn(static_cast<std::size_t>(B * S * H * D), seed, 0.5),
            test_util::randn(static_cast<std::size_t>(B * S * H * D), seed + 1, 0.5),
            test_util::randn(static_cast<std::size_t>(B * S * H * D), seed + 2), {}};
  if (padded) {
    p.mask.assign(static_cast<std::size_t>(B * S), 1);
    for (idx b = 1; b < B; ++b)  // batch row b has 3b padded tokens at the end (at most S - 1)
      for (idx j = std::max<idx>(1, S - 3 * b); j < S; ++j) p.mask[static_cast<std::size_t>(b * S + j)] = 0;
  }
  return p;
}

std::vector<std::int64_t> arange_positions(idx B, idx S) {
  std::vector<std::int64_t> p(static_cast<std::size_t>(B * S));
  for (idx b = 0; b < B; ++b)
    for (idx i = 0; i < S; ++i) p[static_cast<std::size_t>(b * S + i)] = i;
  return p;
}

template <class T>
std::vector<T> fused(const problem& p, const posenc::deberta_disentangled& enc, posenc::attention_options opt) {
  const std::vector<T> q(p.q.begin(), p.q.end()), k(p.k.begin(), p.k.end()), v(p.v.begin(), p.v.end());
  std::vector<T> out(q.size(), T(-7));
  std::optional<posenc::tensor_map<const std::int64_t, 2>> mask;
  if (!p.mask.empty()) mask = posenc::tensor_map<const std::int64_t, 2>(p.mask.data(), p.B, p.S);
  posenc::deberta_attention<T>(posenc::bshd(q.data(), p.B, p.S, p.H, p.D), posenc::bshd(k.data(), p.B, p.S, p.H, p.D),
                               posenc::bshd(v.data(), p.B, p.S, p.H, p.D), posenc::bshd(out.data(), p.B, p.S, p.H, p.D),
                               enc, mask, opt);
  return out;
}

struct fused_case {
  const char* what;
  idx B, S, H, D;
  idx buckets, mrp;
  bool c2p, p2c, share, padded;
  idx q_block, k_block;
  bool scattered = false;  // explicit non-contiguous key positions (per-pair fallback)
};

template <class T>
void run_case(const fused_case& fc) {
  INFO(fc.what);
  const posenc::deberta_config cfg{.heads = fc.H, .head_dim = fc.D, .position_buckets = fc.buckets,
                                   .max_relative_positions = fc.mrp, .max_position_embeddings = 64,
                                   .c2p = fc.c2p, .p2c = fc.p2c, .share_att_key = fc.share};
  const idx hidden = fc.H * fc.D + 3;  // hidden_size need not equal heads * head_dim for the relative rows
  const layer L(cfg, hidden, 100 + static_cast<unsigned>(fc.S), 5);
  const posenc::deberta_disentangled enc(cfg, L.weights());
  const problem p = make_problem(fc.B, fc.S, fc.H, fc.D, 7, fc.padded);
  std::vector<std::int64_t> qpos = arange_positions(fc.B, fc.S), kpos = qpos;
  posenc::attention_options opt{.q_block = fc.q_block, .k_block = fc.k_block};
  if (fc.scattered) {
    for (idx b = 0; b < fc.B; ++b)
      for (idx j = 0; j < fc.S; ++j) kpos[static_cast<std::size_t>(b * fc.S + j)] = (j * 37 + 11 * b) % (3 * fc.S);
    opt.k_positions = posenc::positions_view(kpos.data(), fc.B, fc.S);
  }
  const auto want = reference(p, L, qpos, kpos);
  const auto got = fused<T>(p, enc, opt);
  const double tol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
  double worst = 0;
  for (std::size_t e = 0; e < want.size(); ++e) worst = std::max(worst, std::abs(double(got[e]) - want[e]));
  INFO("max |fused - reference| = " << worst);
  REQUIRE(worst <= tol);
  if (fc.padded)  // padded query rows are exactly zero
    for (idx b = 0; b < fc.B; ++b)
      for (idx i = 0; i < fc.S; ++i)
        if (p.mask[static_cast<std::size_t>(b * fc.S + i)] == 0)
          for (idx e = 0; e < fc.H * fc.D; ++e) REQUIRE(got[static_cast<std::size_t>((b * fc.S + i) * fc.H * fc.D + e)] == T(0));
}

}  // namespace

TEST_CASE("deberta: every r in [-5000, 5000] buckets like the float32 replica of HF", "[deberta][buckets]") {
  struct cfg {
    idx pb, mrp;
  };
  // Power-of-two mids (the released checkpoints) make (max - 1) / mid exact in float32; the others
  // make the double division, its float32 rounding and logf each matter.
  const cfg cfgs[] = {{256, 512}, {128, 512}, {256, 1024}, {64, 128}, {32, 100}, {512, 4096}, {4, 10},  {2, 5},
                      {3, 9},     {10, 100},  {24, 512},   {200, 1000}, {100, 333}, {14, 77},   {300, 4097}, {96, 250}};
  for (const auto& c : cfgs) {
    const posenc::deberta_config dc{.heads = 1, .head_dim = 1, .position_buckets = c.pb, .max_relative_positions = c.mrp,
                                    .c2p = false, .p2c = false};
    const std::vector<double> rel(static_cast<std::size_t>(2 * c.pb), 0.0);
    const posenc::deberta_disentangled enc(dc, posenc::deberta_weights<double>(
                                                   posenc::tensor_map<const double, 2>(rel.data(), 2 * c.pb, 1)));
    std::int64_t hi = 0;
    for (std::int64_t r = -5000; r <= 5000; ++r) {
      const std::int64_t want = hf_log_bucket(r, c.pb, c.mrp);
      const std::int64_t got = enc.bucket(r);
      if (got != want) {
        INFO("position_buckets " << c.pb << " max_relative_positions " << c.mrp << " r " << r);
        REQUIRE(got == want);
      }
      const auto row = enc.relative_row(r, 0);
      REQUIRE(row == std::clamp<std::int64_t>(want + c.pb, 0, 2 * c.pb - 1));
      REQUIRE(enc.relative_row(1000 + r, 1000) == row);  // only q - k matters
      hi = std::max(hi, got);
    }
    CHECK(hi >= c.pb / 2);
    for (std::int64_t r : {std::int64_t{1} << 40, -(std::int64_t{1} << 40), std::int64_t{123456789}})
      REQUIRE(enc.bucket(r) == hf_log_bucket(r, c.pb, c.mrp));
    for (std::int64_t r : {std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::min()}) {
      // As far as +-2^40 (with mid - 1 = 0 every log bucket is +-1, so no saturation there).
      const std::int64_t far = hf_log_bucket(r > 0 ? std::int64_t{1} << 40 : -(std::int64_t{1} << 40), c.pb, c.mrp);
      REQUIRE(enc.relative_row(r, 0) == std::clamp<std::int64_t>(far + c.pb, 0, 2 * c.pb - 1));
    }
    REQUIRE(enc.relative_row(std::numeric_limits<std::int64_t>::min(), 5) ==
            enc.relative_row(std::numeric_limits<std::int64_t>::min(), 0));  // q - k overflows: saturates
  }
  // Known values of DeBERTa-v3 (256 buckets, 512 positions): exact within +-128, then log-spaced up to
  // +-255 at |r| = 511, beyond the table from 512 on.
  const posenc::deberta_config v3{.heads = 1, .head_dim = 1, .c2p = false, .p2c = false};
  const std::vector<double> rel(512, 0.0);
  const posenc::deberta_disentangled e3(v3, posenc::deberta_weights<double>(
                                               posenc::tensor_map<const double, 2>(rel.data(), 512, 1)));
  CHECK(e3.att_span() == 256);
  CHECK(e3.bucket(128) == 128);
  CHECK(e3.bucket(-128) == -128);
  CHECK(e3.bucket(129) == 129);
  CHECK(e3.bucket(511) == 255);
  CHECK(e3.bucket(-511) == -255);
  CHECK(e3.bucket(512) == 256);
  CHECK(e3.relative_row(511, 0) == 511);
  CHECK(e3.relative_row(0, 512) == 0);
}

TEST_CASE("deberta: golden log buckets (pb 128, mp 512, r in [-2500, 2500])", "[deberta][buckets][golden]") {
  const auto c = golden::load("deberta_log_buckets_pb128_mp512_range");
  const idx pb = c.params().at("position_buckets").get<idx>(), mp = c.params().at("max_relative_positions").get<idx>();
  const std::vector<double> rel(static_cast<std::size_t>(2 * pb), 0.0);
  const posenc::deberta_disentangled enc(
      {.heads = 1, .head_dim = 1, .position_buckets = pb, .max_relative_positions = mp, .c2p = false, .p2c = false},
      posenc::deberta_weights<double>(posenc::tensor_map<const double, 2>(rel.data(), 2 * pb, 1)));
  const auto range = c.at("relative_position_range").i64(), want = c.at("buckets").i64(),
             fragile = c.at("fragile").i64();
  int differ = 0;
  for (std::size_t e = 0; e < range.size(); ++e) {
    INFO("r " << range[e]);
    const std::int64_t got = enc.bucket(range[e]);
    REQUIRE(hf_log_bucket(range[e], pb, mp) == got);
    if (fragile[e] != 0) {
      REQUIRE(std::abs(got - want[e]) <= 1);
      differ += got != want[e] ? 1 : 0;
    } else {
      REQUIRE(got == want[e]);
    }
  }
  INFO("fragile entries differing by one: " << differ);
  SUCCEED();
}

TEMPLATE_TEST_CASE("deberta: fused kernel equals the reference with c2p/p2c materialized", "[deberta][kernel]", float,
                   double) {
  const fused_case cases[] = {
      {"v3-like, 32 buckets / 64 positions, padded batch, default tiles", 3, 150, 2, 8, 32, 64, true, true, true, true, 0, 0},
      {"small tiles 16/24, padded", 2, 90, 2, 8, 16, 40, true, true, true, true, 16, 24},
      {"S = 1", 2, 1, 3, 8, 16, 40, true, true, true, false, 0, 0},
      {"S = span - 1", 1, 15, 2, 8, 16, 40, true, true, true, false, 16, 24},
      {"S = span + 1", 1, 17, 2, 8, 16, 40, true, true, true, false, 16, 24},
      {"no buckets, span 8, S = span - 1", 1, 7, 2, 8, -1, 8, true, true, false, false, 0, 0},
      {"no buckets, span 8, S = span + 1, separate projections, padded", 2, 9, 2, 8, -1, 8, true, true, false, true, 16, 24},
      {"no buckets, mrp < 1 -> max_position_embeddings 64, S = 100", 1, 100, 2, 4, 0, -1, true, true, true, false, 16, 24},
      {"c2p only", 2, 70, 2, 8, 16, 40, true, false, true, true, 16, 24},
      {"p2c only", 2, 70, 2, 8, 16, 40, false, true, true, true, 16, 24},
      {"c2p only, separate projection", 1, 70, 2, 8, 16, 40, true, false, false, false, 0, 0},
      {"p2c only, separate projection", 1, 70, 2, 8, 16, 40, false, true, false, false, 0, 0},
      {"separate projections, long: saturated chunks and multi-chunk tiles", 1, 400, 2, 8, 16, 30, true, true, false, true, 0, 0},
      {"scattered key positions (per-pair rows)", 2, 60, 2, 8, 16, 40, true, true, true, false, 16, 24, true},
  };
  for (const auto& fc : cases) run_case<TestType>(fc);
}

TEMPLATE_TEST_CASE("deberta: 1, 2 and 8 threads give bitwise identical outputs", "[deberta][threads]", float, double) {
  using T = TestType;
  const posenc::deberta_config cfg{.heads = 3, .head_dim = 8, .position_buckets = 16, .max_relative_positions = 40};
  const layer L(cfg, 24, 3);
  const posenc::deberta_disentangled enc(cfg, L.weights());
  const problem p = make_problem(2, 200, 3, 8, 11, true);
  std::vector<std::vector<T>> outs;
  for (int threads : {1, 2, 8}) {
    std::unique_ptr<Eigen::ThreadPool> pool = threads > 1 ? std::make_unique<Eigen::ThreadPool>(threads) : nullptr;
    posenc::attention_options opt{.q_block = 32, .k_block = 48};
    opt.pool = pool.get();
    outs.push_back(fused<T>(p, enc, opt));
  }
  REQUIRE(outs[0] == outs[1]);
  REQUIRE(outs[0] == outs[2]);
}

TEST_CASE("deberta: golden deberta cases (relative_pos, score terms, context through the fused kernel)",
          "[deberta][golden]") {
  for (const std::string name : {"deberta_v3_pb256_share_S150_h3", "deberta_nobuckets_mrp16_noshare_padded"}) {
    INFO(name);
    const auto c = golden::load(name);
    const auto& prm = c.params();
    const idx H = prm.at("num_attention_heads").get<idx>(), Dm = prm.at("hidden_size").get<idx>(), D = Dm / H;
    posenc::deberta_config cfg{.heads = H, .head_dim = D,
                               .position_buckets = prm.at("position_buckets").get<idx>(),
                               .max_relative_positions = prm.at("max_relative_positions").get<idx>(),
                               .max_position_embeddings = prm.at("max_position_embeddings").get<idx>(),
                               .c2p = false, .p2c = false,
                               .share_att_key = prm.at("share_att_key").get<bool>()};
    for (const auto& t : prm.at("pos_att_type")) {
      cfg.c2p = cfg.c2p || t.get<std::string>() == "c2p";
      cfg.p2c = cfg.p2c || t.get<std::string>() == "p2c";
    }
    const auto hidden = c.at("hidden").f64(), rel = c.at("rel_embeddings").f64();
    const idx B = c.at("hidden").shape[0], S = c.at("hidden").shape[1];
    std::map<std::string, std::vector<double>> w;
    for (const char* n : {"Wq", "bq", "Wk", "bk", "Wv", "bv", "Wpk", "bpk", "Wpq", "bpq"})
      if (c.has(n)) w[n] = c.at(n).f64();
    posenc::deberta_weights<double> weights(
        posenc::tensor_map<const double, 2>(rel.data(), c.at("rel_embeddings").shape[0], Dm));
    auto lin = [&](const char* W, const char* b) -> std::optional<posenc::deberta_linear<double>> {
      if (!w.count(W)) return std::nullopt;
      return posenc::deberta_linear<double>(posenc::tensor_map<const double, 2>(w[W].data(), Dm, Dm),
                                            posenc::tensor_map<const double, 1>(w[b].data(), Dm));
    };
    weights.query_proj = lin("Wq", "bq");
    weights.key_proj = lin("Wk", "bk");
    weights.pos_key_proj = lin("Wpk", "bpk");
    weights.pos_query_proj = lin("Wpq", "bpq");
    const posenc::deberta_disentangled enc(cfg, weights);
    CHECK(enc.att_span() == c.meta.at("expected_scalars").at("att_span").get<idx>());
    CHECK(cfg.scale_factor() == c.meta.at("expected_scalars").at("scale_factor").get<idx>());

    const auto relative_pos = c.at("relative_pos").i64();
    for (idx i = 0; i < S; ++i)
      for (idx j = 0; j < S; ++j) REQUIRE(enc.bucket(i - j) == relative_pos[static_cast<std::size_t>(i * S + j)]);

    // Projections (the host's part): x W^T + b, split into heads.
    auto project = [&](const std::vector<double>& W, const std::vector<double>& b) {
      std::vector<double> y(static_cast<std::size_t>(B * S * Dm));
      for (idx t = 0; t < B * S; ++t)
        for (idx o = 0; o < Dm; ++o) {
          double acc = b[static_cast<std::size_t>(o)];
          for (idx m = 0; m < Dm; ++m)
            acc += hidden[static_cast<std::size_t>(t * Dm + m)] * W[static_cast<std::size_t>(o * Dm + m)];
          y[static_cast<std::size_t>(t * Dm + o)] = acc;
        }
      return y;
    };
    const auto q = project(w["Wq"], w["bq"]), k = project(w["Wk"], w["bk"]), v = project(w["Wv"], w["bv"]);
    const double scale = enc.logit_scale(D);
    if (c.has("score_c2p")) {  // the projected tables, through the per-pair score terms
      const auto c2p = c.at("score_c2p").f64(), p2c = c.at("score_p2c").f64();
      for (idx b = 0; b < B; ++b)
        for (idx h = 0; h < H; ++h)
          for (idx i = 0; i < S; ++i)
            for (idx j = 0; j < S; ++j) {
              const idx row = enc.relative_row(i, j);
              const auto kr = enc.position_keys<double>(h).row(row), qr = enc.position_queries<double>(h).row(row);
              double a = 0, bb = 0;
              for (idx e = 0; e < D; ++e) {
                a += q[static_cast<std::size_t>((b * S + i) * Dm + h * D + e)] * kr(e);
                bb += k[static_cast<std::size_t>((b * S + j) * Dm + h * D + e)] * qr(e);
              }
              const auto at = static_cast<std::size_t>(((b * H + h) * S + i) * S + j);
              REQUIRE(std::abs(a * scale - c2p[at]) <= 1e-11);
              REQUIRE(std::abs(bb * scale - p2c[at]) <= 1e-11);
            }
    }
    std::vector<std::int64_t> mask;
    std::optional<posenc::tensor_map<const std::int64_t, 2>> mask_view;
    if (c.has("attention_mask")) {
      mask = c.at("attention_mask").i64();
      mask_view = posenc::tensor_map<const std::int64_t, 2>(mask.data(), B, S);
    }
    const auto want = c.at("context").f64();
    const auto tol = golden::tolerance(c, "context");
    for (idx qb : {idx(0), idx(16)}) {
      std::vector<double> out(want.size(), -7.0);
      posenc::deberta_attention<double>(posenc::bshd(q.data(), B, S, H, D), posenc::bshd(k.data(), B, S, H, D),
                                        posenc::bshd(v.data(), B, S, H, D), posenc::bshd(out.data(), B, S, H, D), enc,
                                        mask_view, {.q_block = qb, .k_block = qb == 0 ? 0 : 24});
      for (std::size_t e = 0; e < want.size(); ++e) REQUIRE(std::abs(out[e] - want[e]) <= tol.atol);
      // float within the f32 rule of docs/parity.md
      const std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end());
      std::vector<float> of(want.size(), -7.f);
      posenc::deberta_attention<float>(posenc::bshd(qf.data(), B, S, H, D), posenc::bshd(kf.data(), B, S, H, D),
                                       posenc::bshd(vf.data(), B, S, H, D), posenc::bshd(of.data(), B, S, H, D), enc,
                                       mask_view, {.q_block = qb, .k_block = qb == 0 ? 0 : 24});
      for (std::size_t e = 0; e < want.size(); ++e) REQUIRE(std::abs(of[e] - want[e]) <= 4e-6 * (1 + std::abs(want[e])));
    }
  }
}

TEST_CASE("deberta: argument errors name the argument; out stays untouched", "[deberta][errors]") {
  const posenc::deberta_config ok{.heads = 2, .head_dim = 4, .position_buckets = 8, .max_relative_positions = 20};
  const layer L(ok, 8, 5);
  using dd = posenc::deberta_disentangled;
  CHECK_THROWS_WITH(dd({.heads = 2, .head_dim = 4, .position_buckets = 1, .max_relative_positions = 20}, L.weights()),
                    Catch::Contains("position_buckets"));
  CHECK_THROWS_WITH(dd({.heads = 2, .head_dim = 4, .position_buckets = 8, .max_relative_positions = 5}, L.weights()),
                    Catch::Contains("max_relative_positions"));
  CHECK_THROWS_WITH(dd({.heads = 0, .head_dim = 4}, L.weights()), Catch::Contains("heads"));
  CHECK_THROWS_WITH(dd({.heads = 2, .head_dim = 4, .position_buckets = 16, .max_relative_positions = 40}, L.weights()),
                    Catch::Contains("rel_embeddings") && Catch::Contains("att_span 16"));
  CHECK_THROWS_WITH(dd({.heads = 2, .head_dim = 3, .position_buckets = 8, .max_relative_positions = 20}, L.weights()),
                    Catch::Contains("key_proj") && Catch::Contains("[8, 8] for [6, 8]"));
  {
    posenc::deberta_weights<double> w(posenc::tensor_map<const double, 2>(L.rel.data(), 16, 8));
    CHECK_THROWS_WITH(dd(ok, w), Catch::Contains("key_proj") && Catch::Contains("must be given"));
    w.key_proj = L.weights().key_proj;
    CHECK_THROWS_WITH(dd(ok, w), Catch::Contains("query_proj"));
    w.query_proj = L.weights().query_proj;
    CHECK_NOTHROW(dd(ok, w));
    posenc::deberta_config sep = ok;
    sep.share_att_key = false;
    CHECK_THROWS_WITH(dd(sep, w), Catch::Contains("pos_key_proj"));
    sep.c2p = false;
    CHECK_THROWS_WITH(dd(sep, w), Catch::Contains("pos_query_proj"));
    sep.p2c = false;
    CHECK_NOTHROW(dd(sep, w));
    const std::vector<double> short_bias(5, 0.0);
    w.key_proj = posenc::deberta_linear<double>(posenc::tensor_map<const double, 2>(L.wk.data(), 8, 8),
                                                posenc::tensor_map<const double, 1>(short_bias.data(), 5));
    CHECK_THROWS_WITH(dd(ok, w), Catch::Contains("key_proj") && Catch::Contains("bias"));
  }
  const dd enc(ok, L.weights());
  const problem p = make_problem(2, 10, 2, 4, 1, true);
  std::vector<double> out(p.q.size(), -7.0);
  auto call = [&](idx heads, idx dim, std::optional<posenc::tensor_map<const std::int64_t, 2>> mask,
                  posenc::attention_options opt = {}) {
    posenc::deberta_attention<double>(posenc::bshd(p.q.data(), 2, 10 * 2 * 4 / (heads * dim), heads, dim),
                                      posenc::bshd(p.k.data(), 2, 10 * 2 * 4 / (heads * dim), heads, dim),
                                      posenc::bshd(p.v.data(), 2, 10 * 2 * 4 / (heads * dim), heads, dim),
                                      posenc::bshd(out.data(), 2, 10 * 2 * 4 / (heads * dim), heads, dim), enc, mask,
                                      opt);
  };
  const auto mask = posenc::tensor_map<const std::int64_t, 2>(p.mask.data(), 2, 10);
  CHECK_THROWS_WITH(call(1, 4, std::nullopt), Catch::Contains("heads") && Catch::Contains("2 vs 1"));
  CHECK_THROWS_WITH(call(2, 2, std::nullopt), Catch::Contains("head_dim") && Catch::Contains("4 vs 2"));
  CHECK_THROWS_WITH(call(2, 4, posenc::tensor_map<const std::int64_t, 2>(p.mask.data(), 1, 10)),
                    Catch::Contains("attention_mask") && Catch::Contains("[1, 10] for [2, 10]"));
  std::vector<std::int64_t> bad = p.mask;
  bad[3] = 2;
  CHECK_THROWS_WITH(call(2, 4, posenc::tensor_map<const std::int64_t, 2>(bad.data(), 2, 10)),
                    Catch::Contains("attention_mask") && Catch::Contains("0 (padding) or 1"));
  const std::vector<std::int64_t> kpm(20, 0);
  posenc::attention_options with_pad;
  with_pad.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(kpm.data(), 2, 10);
  CHECK_THROWS_WITH(call(2, 4, mask, with_pad), Catch::Contains("key_padding_mask"));
  for (double x : out) REQUIRE(x == -7.0);
  CHECK_NOTHROW(call(2, 4, mask));
  CHECK(out[0] != -7.0);
}

TEST_CASE("deberta: config.json reader and safetensors layer loader", "[deberta][io]") {
  using nlohmann::json;
  const json v3 = json::parse(R"({"model_type": "deberta-v2", "hidden_size": 768, "num_attention_heads": 12,
    "relative_attention": true, "position_buckets": 256, "max_relative_positions": -1,
    "max_position_embeddings": 512, "pos_att_type": "p2c|c2p", "share_att_key": true,
    "norm_rel_ebd": "layer_norm", "layer_norm_eps": 1e-7})");
  const auto hf = posenc::io::deberta_config_from_hf(v3);
  CHECK(hf.attention.heads == 12);
  CHECK(hf.attention.head_dim == 64);
  CHECK(hf.attention.att_span() == 256);
  CHECK(hf.attention.relative_positions() == 512);
  CHECK(hf.attention.c2p);
  CHECK(hf.attention.p2c);
  CHECK(hf.attention.share_att_key);
  CHECK(hf.layer_norm_rel);
  json v2 = v3;
  v2["pos_att_type"] = json::array({"c2p"});
  v2.erase("position_buckets");
  v2["max_relative_positions"] = 300;
  v2.erase("share_att_key");
  v2["norm_rel_ebd"] = "none";
  const auto h2 = posenc::io::deberta_config_from_hf(v2);
  CHECK(h2.attention.c2p);
  CHECK_FALSE(h2.attention.p2c);
  CHECK(h2.attention.att_span() == 300);
  CHECK_FALSE(h2.attention.share_att_key);
  CHECK_FALSE(h2.layer_norm_rel);
  json bad = v3;
  bad["pos_att_type"] = "c2p|q2q";
  CHECK_THROWS_WITH(posenc::io::deberta_config_from_hf(bad), Catch::Contains("pos_att_type") && Catch::Contains("q2q"));
  bad = v3;
  bad["relative_attention"] = false;
  CHECK_THROWS_WITH(posenc::io::deberta_config_from_hf(bad), Catch::Contains("relative_attention"));
  bad = v3;
  bad.erase("num_attention_heads");
  CHECK_THROWS_WITH(posenc::io::deberta_config_from_hf(bad), Catch::Contains("num_attention_heads"));

  // A small checkpoint with HF's names: 2 heads x 4, hidden 8, 4 buckets (span 4 -> 8 rows).
  const json small = json::parse(R"({"hidden_size": 8, "num_attention_heads": 2, "relative_attention": true,
    "position_buckets": 4, "max_relative_positions": 16, "pos_att_type": ["c2p", "p2c"], "share_att_key": false,
    "norm_rel_ebd": "layer_norm", "layer_norm_eps": 1e-5})");
  const auto hs = posenc::io::deberta_config_from_hf(small);
  const idx Dm = 8;
  const auto rel = test_util::randn(8 * Dm, 41), g = test_util::randn(Dm, 42), be = test_util::randn(Dm, 43);
  posenc::io::safetensors_writer wr;
  wr.add<double>("deberta.encoder.rel_embeddings.weight", {8, Dm}, rel);
  wr.add<double>("deberta.encoder.LayerNorm.weight", {Dm}, g);
  wr.add<double>("deberta.encoder.LayerNorm.bias", {Dm}, be);
  std::map<std::string, std::vector<double>> lin;
  unsigned seed = 50;
  for (const char* n : {"query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj"}) {
    const std::string base = std::string("deberta.encoder.layer.1.attention.self.") + n;
    lin[std::string(n) + ".weight"] = test_util::randn(Dm * Dm, seed++);
    lin[std::string(n) + ".bias"] = test_util::randn(Dm, seed++);
    wr.add<double>(base + ".weight", {Dm, Dm}, lin[std::string(n) + ".weight"]);
    wr.add<double>(base + ".bias", {Dm}, lin[std::string(n) + ".bias"]);
  }
  const auto file = posenc::io::safetensors_file::parse(wr.bytes(), "small");
  const auto layer1 = posenc::io::load_deberta_layer(file, hs, 1);
  // LayerNorm of row 3, computed here.
  double mean = 0, var = 0;
  for (idx e = 0; e < Dm; ++e) mean += rel[static_cast<std::size_t>(3 * Dm + e)] / Dm;
  for (idx e = 0; e < Dm; ++e) var += std::pow(rel[static_cast<std::size_t>(3 * Dm + e)] - mean, 2) / Dm;
  for (idx e = 0; e < Dm; ++e)
    CHECK(std::abs(layer1.rel_embeddings[static_cast<std::size_t>(3 * Dm + e)] -
                   ((rel[static_cast<std::size_t>(3 * Dm + e)] - mean) / std::sqrt(var + 1e-5) * g[e] + be[e])) <= 1e-12);
  const posenc::deberta_disentangled enc(hs.attention, layer1.weights());
  // Kr row 5 of head 1 = LN(rel)[5] . Wpk[4 + e]^T + bpk[4 + e].
  const auto& Wpk = lin["pos_key_proj.weight"];
  for (idx e = 0; e < 4; ++e) {
    double want = lin["pos_key_proj.bias"][static_cast<std::size_t>(4 + e)];
    for (idx m = 0; m < Dm; ++m)
      want += layer1.rel_embeddings[static_cast<std::size_t>(5 * Dm + m)] * Wpk[static_cast<std::size_t>((4 + e) * Dm + m)];
    CHECK(std::abs(enc.position_keys<double>(1)(5, e) - want) <= 1e-12);
  }
  CHECK_THROWS_WITH(posenc::io::load_deberta_layer(file, hs, 0),
                    Catch::Contains("deberta.encoder.layer.0.attention.self.query_proj.weight"));
  // A wrong shape names the tensor.
  posenc::io::safetensors_writer wr2;
  wr2.add<double>("encoder.rel_embeddings.weight", {8, Dm}, rel);
  wr2.add<double>("encoder.LayerNorm.weight", {Dm}, g);
  wr2.add<double>("encoder.LayerNorm.bias", {Dm}, be);
  wr2.add<double>("encoder.layer.0.attention.self.query_proj.weight", {Dm, Dm - 1},
                  std::vector<double>(static_cast<std::size_t>(Dm * (Dm - 1)), 0.0));
  const auto file2 = posenc::io::safetensors_file::parse(wr2.bytes(), "bad");
  CHECK_THROWS_WITH(posenc::io::load_deberta_layer(file2, hs, 0),
                    Catch::Contains("encoder.layer.0.attention.self.query_proj.weight") &&
                        Catch::Contains("[8, 7] vs [8, 8]"));
  posenc::io::safetensors_writer wr3;
  wr3.add<double>("encoder.rel_embeddings.weight", {6, Dm}, std::vector<double>(6 * Dm, 0.0));
  CHECK_THROWS_WITH(posenc::io::load_deberta_layer(posenc::io::safetensors_file::parse(wr3.bytes(), "short"), hs, 0),
                    Catch::Contains("encoder.rel_embeddings.weight"));
}
