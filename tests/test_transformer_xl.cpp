// Transformer-XL relative attention: the fused kernel against the double reference attention with
// ((q+u).k + (q+v).r) materialized per pair from a sinusoid and W_R written here; the official
// rel_shift on a small materialized matrix; the golden case (FORMAT.md 5.7); thread determinism;
// errors; loading a transfo-xl config.json + safetensors.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <unsupported/Eigen/CXX11/ThreadPool>

#include "golden.hpp"
#include "posenc/attention.hpp"
#include "posenc/io/transformer_xl.hpp"
#include "posenc/reference.hpp"
#include "posenc/transformer_xl.hpp"
#include "random.hpp"

using idx = posenc::index_t;
using txl = posenc::transformer_xl<double>;

static_assert(posenc::attention_encoding<txl>);
static_assert(posenc::has_bind<txl>);
static_assert(posenc::has_score_terms<txl::bound, float>);
static_assert(posenc::has_score_terms<txl::bound, double>);
static_assert(!posenc::has_qk_transform<txl::bound, float>);

namespace {

constexpr double neg_inf = -std::numeric_limits<double>::infinity();

/// The weights of one attention layer and r_h(dist) computed the plain way: R_dist = [sin | cos]
/// with w_f = 1 / 10000^(2f / d_model) (Transformer-XL PositionalEmbedding), r = W_R R.
struct layer {
  idx H, D, M;
  std::vector<double> w, u, v;  // [H*D, M], [H, D], [H, D]
  layer(idx heads, idx dim, idx d_model, unsigned seed) : H(heads), D(dim), M(d_model) {
    w = test_util::randn(static_cast<std::size_t>(H * D * M), seed, 0.1);
    u = test_util::randn(static_cast<std::size_t>(H * D), seed + 1, 0.3);
    v = test_util::randn(static_cast<std::size_t>(H * D), seed + 2, 0.3);
  }
  [[nodiscard]] std::vector<double> r(idx h, std::int64_t dist) const {
    std::vector<double> e(static_cast<std::size_t>(M));
    for (idx f = 0; f < M / 2; ++f) {
      const double inv_freq = 1.0 / std::pow(10000.0, static_cast<double>(2 * f) / static_cast<double>(M));
      e[static_cast<std::size_t>(f)] = std::sin(static_cast<double>(dist) * inv_freq);
      e[static_cast<std::size_t>(M / 2 + f)] = std::cos(static_cast<double>(dist) * inv_freq);
    }
    std::vector<double> out(static_cast<std::size_t>(D), 0.0);
    for (idx d = 0; d < D; ++d)
      for (idx c = 0; c < M; ++c)
        out[static_cast<std::size_t>(d)] += w[static_cast<std::size_t>((h * D + d) * M + c)] * e[static_cast<std::size_t>(c)];
    return out;
  }
  template <class T>
  [[nodiscard]] posenc::transformer_xl<T> encoding(const posenc::transformer_xl_config& cfg, std::vector<T>& wt,
                                                   std::vector<T>& ut, std::vector<T>& vt) const {
    wt.assign(w.begin(), w.end());
    ut.assign(u.begin(), u.end());
    vt.assign(v.begin(), v.end());
    return posenc::transformer_xl<T>(posenc::tensor_map<const T, 2>(wt.data(), H * D, M),
                                     posenc::tensor_map<const T, 2>(ut.data(), H, D),
                                     posenc::tensor_map<const T, 2>(vt.data(), H, D), cfg);
  }
};

struct xl_case {
  const char* what;
  idx B, Sq, mlen, H, D, M;
  std::int64_t clamp_len;
  bool same_length;
  idx mem_len;
  bool padded, shuffled_keys;
  idx q_block, k_block;
};

struct problem {
  xl_case c;
  idx Sk;
  std::vector<double> q, k, v;
  std::vector<std::int64_t> pad;
  posenc::positions kpos;
  posenc::attention_options opt;
  explicit problem(const xl_case& fc)
      : c(fc), Sk(fc.mlen + fc.Sq), kpos(posenc::contiguous_positions(fc.B, fc.mlen + fc.Sq)) {
    q = test_util::randn(static_cast<std::size_t>(c.B * c.Sq * c.H * c.D), 31, 0.5);
    k = test_util::randn(static_cast<std::size_t>(c.B * Sk * c.H * c.D), 32, 0.5);
    v = test_util::randn(static_cast<std::size_t>(c.B * Sk * c.H * c.D), 33);
    opt = posenc::transformer_xl_options(c.Sq, Sk);
    pad.assign(static_cast<std::size_t>(c.B * Sk), 0);
    if (c.padded)  // the oldest memory slots of batch row b are padding (b + 3 of them)
      for (idx b = 0; b < c.B; ++b)
        for (idx j = 0; j < std::min<idx>(b + 3, Sk); ++j) pad[static_cast<std::size_t>(b * Sk + j)] = 1;
    if (c.padded) opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), c.B, Sk);
    if (c.shuffled_keys) {  // keys stored in another order (positions travel with them): non-contiguous tiles
      for (idx b = 0; b < c.B; ++b)
        for (idx j = 0; j < Sk; ++j) kpos(b, j) = (j * 7 + b) % Sk;
      opt.k_positions = posenc::view(kpos);
    }
  }
  [[nodiscard]] std::int64_t distance(idx b, idx i, idx j) const { return c.mlen + i - kpos(b, j); }
};

/// The double reference with the terms of every pair written out (u.k + (q+v).r inside the scale,
/// the same_length window as a -inf bias).
std::vector<double> reference_out(const problem& p, const layer& L) {
  const xl_case& c = p.c;
  // r_h(dist) for every distance that occurs, by the plain formula above.
  const std::int64_t max_d = c.mlen + c.Sq - 1;
  std::vector<std::vector<double>> r(static_cast<std::size_t>(c.H * (max_d + 1)));
  auto clamp = [&](std::int64_t d) { return c.clamp_len > 0 ? std::min(d, c.clamp_len) : d; };
  for (idx h = 0; h < c.H; ++h)
    for (std::int64_t d = 0; d <= max_d; ++d) r[static_cast<std::size_t>(h * (max_d + 1) + d)] = L.r(h, clamp(d));
  posenc::reference_terms<double> terms;
  terms.score_term = [&](idx b, idx h, idx i, idx j) {
    const std::int64_t d = p.distance(b, i, j);
    if (d < 0) return 0.0;  // future: masked by causality
    const auto& rh = r[static_cast<std::size_t>(h * (max_d + 1) + d)];
    double s = 0;
    for (idx e = 0; e < c.D; ++e) {
      const double qe = p.q[static_cast<std::size_t>(((b * c.Sq + i) * c.H + h) * c.D + e)];
      const double ke = p.k[static_cast<std::size_t>(((b * p.Sk + j) * c.H + h) * c.D + e)];
      s += L.u[static_cast<std::size_t>(h * c.D + e)] * ke + (qe + L.v[static_cast<std::size_t>(h * c.D + e)]) * rh[static_cast<std::size_t>(e)];
    }
    return s;
  };
  if (c.same_length)
    terms.bias = [&](idx b, idx, idx i, idx j) { return p.distance(b, i, j) >= c.mem_len ? neg_inf : 0.0; };
  std::vector<double> want(p.q.size());
  posenc::attention_options ro = p.opt;
  ro.scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  posenc::reference_attention<double>(posenc::bshd(p.q.data(), c.B, c.Sq, c.H, c.D),
                                      posenc::bshd(p.k.data(), c.B, p.Sk, c.H, c.D),
                                      posenc::bshd(p.v.data(), c.B, p.Sk, c.H, c.D),
                                      posenc::bshd(want.data(), c.B, c.Sq, c.H, c.D), ro, terms);
  return want;
}

template <class T>
std::vector<T> fused_out(const problem& p, const layer& L, Eigen::ThreadPoolInterface* pool = nullptr) {
  const xl_case& c = p.c;
  std::vector<T> wt, ut, vt;
  const auto enc = L.encoding<T>({.d_model = c.M, .n_head = c.H, .d_head = c.D, .mem_len = c.mem_len,
                                  .clamp_len = c.clamp_len, .same_length = c.same_length},
                                 wt, ut, vt);
  const std::vector<T> q(p.q.begin(), p.q.end()), k(p.k.begin(), p.k.end()), v(p.v.begin(), p.v.end());
  std::vector<T> out(q.size(), T(-7));
  posenc::attention_options opt = p.opt;
  opt.q_block = c.q_block;
  opt.k_block = c.k_block;
  opt.pool = pool;
  posenc::attention<T>(posenc::bshd(q.data(), c.B, c.Sq, c.H, c.D), posenc::bshd(k.data(), c.B, p.Sk, c.H, c.D),
                       posenc::bshd(v.data(), c.B, p.Sk, c.H, c.D), posenc::bshd(out.data(), c.B, c.Sq, c.H, c.D), enc,
                       opt);
  return out;
}

const xl_case kCases[] = {
    // what                                   B  Sq mlen H  D   M  clamp same  mem  pad  shuf  qb  kb
    {"memory longer than the segment",        2, 40, 70, 3, 16, 48, -1, false, 70, false, false, 16, 24},
    {"clamp_len 9 (far pairs share R_9)",     2, 50, 30, 2, 8, 32, 9, false, 30, false, false, 16, 24},
    {"same_length, mem_len 25",               2, 45, 25, 2, 8, 32, -1, true, 25, false, false, 16, 24},
    {"same_length + clamp_len 6",             1, 60, 20, 2, 8, 16, 6, true, 20, false, false, 16, 24},
    {"KV-cache decode: 1 query at 4000",      2, 1, 4000, 4, 16, 64, -1, false, 4000, false, false, 16, 24},
    {"padding of the oldest memory",          3, 37, 29, 2, 8, 32, -1, false, 29, true, false, 16, 24},
    {"odd head dim 7, odd lengths",           2, 33, 21, 3, 7, 22, -1, false, 21, false, false, 16, 24},
    {"keys out of position order",           2, 30, 26, 2, 8, 24, 12, false, 26, false, true, 16, 24},
    {"default tiles",                         1, 300, 200, 2, 16, 32, -1, false, 200, true, false, 0, 0},
};

}  // namespace

TEMPLATE_TEST_CASE("transformer_xl: fused kernel equals the reference with the terms materialized", "[xl][kernel]",
                   float, double) {
  using T = TestType;
  for (const auto& fc : kCases) {
    INFO(fc.what);
    const problem p(fc);
    const layer L(fc.H, fc.D, fc.M, 50);
    const auto want = reference_out(p, L);
    const auto got = fused_out<T>(p, L);
    const double tol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
    double worst = 0;
    for (std::size_t e = 0; e < want.size(); ++e) worst = std::max(worst, std::abs(double(got[e]) - want[e]));
    INFO("max |fused - reference| = " << worst);
    REQUIRE(worst <= tol);
  }
}

TEST_CASE("transformer_xl: 1, 2 and 8 threads give bitwise identical outputs", "[xl][threads]") {
  const xl_case fc{"threads", 2, 70, 50, 4, 16, 64, 40, false, 50, true, false, 16, 24};
  const problem p(fc);
  const layer L(fc.H, fc.D, fc.M, 60);
  const auto base_f = fused_out<float>(p, L);
  const auto base_d = fused_out<double>(p, L);
  for (int n : {1, 2, 8}) {
    Eigen::ThreadPool pool(n);
    const auto f = fused_out<float>(p, L, &pool);
    const auto d = fused_out<double>(p, L, &pool);
    REQUIRE(std::memcmp(f.data(), base_f.data(), f.size() * sizeof(float)) == 0);
    REQUIRE(std::memcmp(d.data(), base_d.data(), d.size() * sizeof(double)) == 0);
  }
}

TEST_CASE("transformer_xl: the direct gather equals the official rel_shift wherever rel_shift is valid", "[xl]") {
  // HF/official: BD[i][c] = (q_i + v) . r(klen - 1 - c) (pos_seq = klen-1 .. 0), then _rel_shift: pad
  // a zero column, view [qlen, klen+1] as [klen+1, qlen], drop the first row, view as [qlen, klen].
  const idx Sq = 6, mlen = 4, Sk = Sq + mlen, H = 2, D = 4, M = 10;
  const layer L(H, D, M, 70);
  std::vector<double> wt, ut, vt;
  layer Lz = L;
  std::fill(Lz.u.begin(), Lz.u.end(), 0.0);  // u = 0: the hook then adds exactly (q + v) . r
  const auto enc = Lz.encoding<double>({.d_model = M, .n_head = H, .d_head = D}, wt, ut, vt);
  const auto q = test_util::randn(static_cast<std::size_t>(Sq * D), 71);
  const auto k = test_util::randn(static_cast<std::size_t>(Sk * D), 72);
  posenc::call_info info;
  info.heads = H;
  info.kv_heads = H;
  info.head_dim = D;
  info.q_len = Sq;
  info.k_len = Sk;
  info.scalar = posenc::scalar_type::float64;
  info.q_min = mlen;
  info.q_max = mlen + Sq - 1;
  info.k_min = 0;
  info.k_max = Sk - 1;
  const auto b = enc.bind(info);
  std::vector<std::int64_t> qp(Sq), kp(Sk);
  for (idx i = 0; i < Sq; ++i) qp[static_cast<std::size_t>(i)] = mlen + i;
  for (idx j = 0; j < Sk; ++j) kp[static_cast<std::size_t>(j)] = j;
  for (idx h = 0; h < H; ++h) {
    std::vector<double> bd(static_cast<std::size_t>(Sq * Sk));
    for (idx i = 0; i < Sq; ++i)
      for (idx c = 0; c < Sk; ++c) {
        const auto r = L.r(h, Sk - 1 - c);
        double s = 0;
        for (idx e = 0; e < D; ++e)
          s += (q[static_cast<std::size_t>(i * D + e)] + L.v[static_cast<std::size_t>(h * D + e)]) * r[static_cast<std::size_t>(e)];
        bd[static_cast<std::size_t>(i * Sk + c)] = s;
      }
    std::vector<double> padded;  // [Sq, Sk + 1] row-major, zero column first
    for (idx i = 0; i < Sq; ++i) {
      padded.push_back(0.0);
      for (idx c = 0; c < Sk; ++c) padded.push_back(bd[static_cast<std::size_t>(i * Sk + c)]);
    }
    // viewed as [Sk + 1, Sq], rows 1.. viewed as [Sq, Sk]: element (i, j) is flat index Sq + i * Sk + j
    std::vector<double> shifted(static_cast<std::size_t>(Sq * Sk));
    for (idx e = 0; e < Sq * Sk; ++e) shifted[static_cast<std::size_t>(e)] = padded[static_cast<std::size_t>(Sq + e)];

    std::vector<double> s(static_cast<std::size_t>(Sq * Sk), 0.0);
    const posenc::tile<double> t{.head = h, .rows = Sq, .cols = Sk, .q_pos = qp.data(), .k_pos = kp.data(),
                                 .q = posenc::const_matrix_map<double>(q.data(), Sq, D, Eigen::OuterStride<>(D)),
                                 .k = posenc::const_matrix_map<double>(k.data(), Sk, D, Eigen::OuterStride<>(D))};
    b.add_score_terms<double>(t, 1.0, posenc::matrix_map<double>(s.data(), Sq, Sk, Eigen::OuterStride<>(Sk)));
    int compared = 0, differs_outside = 0;
    for (idx i = 0; i < Sq; ++i)
      for (idx j = 0; j < Sk; ++j) {
        const double got = s[static_cast<std::size_t>(i * Sk + j)], rs = shifted[static_cast<std::size_t>(i * Sk + j)];
        if (j <= mlen + i) {  // where rel_shift is valid
          REQUIRE(std::abs(got - rs) <= 1e-12);
          ++compared;
        } else {
          REQUIRE(got == neg_inf);  // the future: rel_shift leaves other rows' values there
          differs_outside += rs != 0.0 ? 1 : 0;
        }
      }
    CHECK(compared == Sq * mlen + Sq * (Sq + 1) / 2);
    CHECK(differs_outside > 0);
  }
}

TEST_CASE("transformer_xl: golden case txl_mem8_q12_d64 (pos_emb, probs, out)", "[xl][golden]") {
  const auto c = golden::load("txl_mem8_q12_d64");
  const auto& prm = c.params();
  const posenc::transformer_xl_config cfg{.d_model = prm.at("d_model").get<idx>(),
                                          .n_head = prm.at("n_head").get<idx>(),
                                          .d_head = prm.at("d_head").get<idx>(),
                                          .mem_len = prm.at("mem_len").get<idx>(),
                                          .clamp_len = prm.at("clamp_len").get<std::int64_t>()};
  const auto w = c.at("r_net_weight").f64(), u = c.at("r_w_bias").f64(), v = c.at("r_r_bias").f64();
  const idx H = cfg.n_head, D = cfg.d_head;
  const txl enc(posenc::tensor_map<const double, 2>(w.data(), H * D, cfg.d_model),
                posenc::tensor_map<const double, 2>(u.data(), H, D), posenc::tensor_map<const double, 2>(v.data(), H, D),
                cfg);
  const auto& qt = c.at("q");
  const idx B = qt.shape[0], Sq = qt.shape[1], Sk = c.at("k").shape[1], mlen = Sk - Sq;
  REQUIRE(mlen == c.meta.at("expected_scalars").at("mlen").get<idx>());
  const auto tol = golden::tolerance(c, "out");
  // pos_emb row t = distance klen - 1 - t
  const auto pe = c.at("pos_emb").f64();
  for (idx t = 0; t < Sk; ++t) {
    const auto row = enc.pos_emb(Sk - 1 - t);
    for (idx e = 0; e < cfg.d_model; ++e)
      REQUIRE(std::abs(row[static_cast<std::size_t>(e)] - pe[static_cast<std::size_t>(t * cfg.d_model + e)]) <= 1e-12);
  }
  const auto q = qt.f64(), k = c.at("k").f64(), vv = c.at("v").f64();
  const auto want = c.at("out").f64(), want_probs = c.at("probs").f64();
  // probs from the per-pair score_term and the kernel's lse
  std::vector<double> out(want.size(), -7.0), lse(static_cast<std::size_t>(B * H * Sq));
  posenc::attention<double>(posenc::bshd(q.data(), B, Sq, H, D), posenc::bshd(k.data(), B, Sk, H, D),
                            posenc::bshd(vv.data(), B, Sk, H, D), posenc::bshd(out.data(), B, Sq, H, D),
                            posenc::tensor_map<double, 3>(lse.data(), B, H, Sq), enc,
                            posenc::transformer_xl_options(Sq, Sk, {.q_block = 5, .k_block = 7}));
  for (std::size_t e = 0; e < want.size(); ++e) REQUIRE(std::abs(out[e] - want[e]) <= tol.atol);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (idx b = 0; b < B; ++b)
    for (idx h = 0; h < H; ++h)
      for (idx i = 0; i < Sq; ++i)
        for (idx j = 0; j < Sk; ++j) {
          double p = 0;
          if (enc.visible(mlen + i, j)) {
            const double* qi = q.data() + ((b * Sq + i) * H + h) * D;
            const double* kj = k.data() + ((b * Sk + j) * H + h) * D;
            double dot = 0;
            for (idx e = 0; e < D; ++e) dot += qi[e] * kj[e];
            p = std::exp(scale * (dot + enc.score_term(h, qi, kj, mlen + i - j)) -
                         lse[static_cast<std::size_t>((b * H + h) * Sq + i)]);
          }
          REQUIRE(std::abs(p - want_probs[static_cast<std::size_t>(((b * H + h) * Sq + i) * Sk + j)]) <= 1e-11);
        }
  // float: the same case within the float tolerance
  const std::vector<float> wf(w.begin(), w.end()), uf(u.begin(), u.end()), vf(v.begin(), v.end());
  const std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vvf(vv.begin(), vv.end());
  const posenc::transformer_xl<float> encf(posenc::tensor_map<const float, 2>(wf.data(), H * D, cfg.d_model),
                                           posenc::tensor_map<const float, 2>(uf.data(), H, D),
                                           posenc::tensor_map<const float, 2>(vf.data(), H, D), cfg);
  std::vector<float> outf(want.size(), -7.f);
  posenc::attention<float>(posenc::bshd(qf.data(), B, Sq, H, D), posenc::bshd(kf.data(), B, Sk, H, D),
                           posenc::bshd(vvf.data(), B, Sk, H, D), posenc::bshd(outf.data(), B, Sq, H, D), encf,
                           posenc::transformer_xl_options(Sq, Sk));
  for (std::size_t e = 0; e < want.size(); ++e) REQUIRE(std::abs(outf[e] - want[e]) <= 4e-6 * (1 + std::abs(want[e])));
}

TEST_CASE("transformer_xl: argument errors name the argument, nothing is written", "[xl][errors]") {
  const idx H = 2, D = 4, M = 8;
  const layer L(H, D, M, 80);
  std::vector<double> wt, ut, vt;
  const posenc::transformer_xl_config ok{.d_model = M, .n_head = H, .d_head = D, .mem_len = 4};
  REQUIRE_NOTHROW(L.encoding<double>(ok, wt, ut, vt));
  auto with = [&](auto change) {
    posenc::transformer_xl_config c = ok;
    change(c);
    return c;
  };
  using Catch::Contains;
  CHECK_THROWS_WITH(L.encoding<double>(with([](auto& c) { c.d_model = 9; }), wt, ut, vt), Contains("d_model"));
  CHECK_THROWS_WITH(L.encoding<double>(with([](auto& c) { c.d_model = 6; }), wt, ut, vt),
                    Contains("r_net.weight") && Contains("[8, 8] for [8, 6]"));
  CHECK_THROWS_WITH(L.encoding<double>(with([](auto& c) { c.d_head = 2; }), wt, ut, vt), Contains("r_net.weight"));
  CHECK_THROWS_WITH(L.encoding<double>(with([](auto& c) { c.clamp_len = -2; }), wt, ut, vt), Contains("clamp_len"));
  CHECK_THROWS_WITH(L.encoding<double>(with([](auto& c) {
                      c.same_length = true;
                      c.mem_len = 0;
                    }), wt, ut, vt),
                    Contains("mem_len"));
  {
    const std::vector<double> w(static_cast<std::size_t>(H * D * M)), u(static_cast<std::size_t>(H * (D + 1)));
    CHECK_THROWS_WITH(txl(posenc::tensor_map<const double, 2>(w.data(), H * D, M),
                          posenc::tensor_map<const double, 2>(u.data(), H, D + 1),
                          posenc::tensor_map<const double, 2>(u.data(), H, D), ok),
                      Contains("r_w_bias") && Contains("[2, 5] for [2, 4]"));
    CHECK_THROWS_WITH(txl(posenc::tensor_map<const double, 2>(w.data(), H * D, M),
                          posenc::tensor_map<const double, 2>(u.data(), H, D),
                          posenc::tensor_map<const double, 2>(u.data(), H + 1, D), ok),
                      Contains("r_r_bias"));
  }
  CHECK_THROWS_WITH(posenc::transformer_xl_options(5, 3), Contains("k_len"));

  // Through the kernel: heads / head_dim mismatches and a position range too wide for the table.
  const auto enc = L.encoding<double>(ok, wt, ut, vt);
  const idx B = 1, Sq = 3, Sk = 5;
  auto run = [&](idx heads, idx dim, posenc::attention_options opt, const txl* e = nullptr) {
    const std::vector<double> q(static_cast<std::size_t>(B * Sq * heads * dim), 0.5),
        k(static_cast<std::size_t>(B * Sk * heads * dim), 0.5);
    std::vector<double> out(q.size(), -7.0);
    try {
      posenc::attention<double>(posenc::bshd(q.data(), B, Sq, heads, dim), posenc::bshd(k.data(), B, Sk, heads, dim),
                                posenc::bshd(k.data(), B, Sk, heads, dim), posenc::bshd(out.data(), B, Sq, heads, dim),
                                e ? *e : enc, opt);
    } catch (...) {
      for (double x : out) REQUIRE(x == -7.0);  // untouched
      throw;
    }
  };
  CHECK_THROWS_WITH(run(3, D, posenc::transformer_xl_options(Sq, Sk)), Contains("n_head") && Contains("2 vs 3"));
  CHECK_THROWS_WITH(run(H, 6, posenc::transformer_xl_options(Sq, Sk)), Contains("d_head") && Contains("4 vs 6"));
  // One key far in the past: distances 0 .. 2^40 without clamp_len are too many for a table.
  posenc::positions far_keys = posenc::contiguous_positions(B, Sk);
  far_keys(0, 0) = -(std::int64_t{1} << 40);
  posenc::attention_options far = posenc::transformer_xl_options(Sq, Sk);
  far.k_positions = posenc::view(far_keys);
  CHECK_THROWS_WITH(run(H, D, far), Contains("positions") && Contains("clamp_len"));
  const auto clamped = L.encoding<double>(with([](auto& c) { c.clamp_len = 16; }), wt, ut, vt);
  REQUIRE_NOTHROW(run(H, D, far, &clamped));
  REQUIRE_NOTHROW(run(H, D, posenc::transformer_xl_options(Sq, Sk)));
}

TEST_CASE("transformer_xl: clamp_len makes far positions cheap and exact", "[xl]") {
  // Queries at 2^40 over keys just before them and far away: with clamp_len the table has clamp_len + 1 rows.
  const idx H = 2, D = 4, M = 8;
  const layer L(H, D, M, 90);
  std::vector<double> wt, ut, vt;
  const auto enc = L.encoding<double>({.d_model = M, .n_head = H, .d_head = D, .clamp_len = 16}, wt, ut, vt);
  posenc::call_info info;
  info.heads = H;
  info.head_dim = D;
  info.scalar = posenc::scalar_type::float64;
  info.q_min = info.q_max = std::int64_t{1} << 40;
  info.k_min = 0;
  info.k_max = (std::int64_t{1} << 40) - 3;
  const auto b = enc.bind(info);
  REQUIRE(b.max_distance() == 16);
  REQUIRE(b.min_distance() == 3);
  // One query at 2^40 over keys at distances 3 .. 40 (u = v = 0: the hook adds q . r_h(min(d, 16))).
  layer Lz = L;
  std::fill(Lz.u.begin(), Lz.u.end(), 0.0);
  std::fill(Lz.v.begin(), Lz.v.end(), 0.0);
  const auto encz = Lz.encoding<double>({.d_model = M, .n_head = H, .d_head = D, .clamp_len = 16}, wt, ut, vt);
  const auto bz = encz.bind(info);
  const idx C = 38;
  const std::vector<std::int64_t> qp = {std::int64_t{1} << 40};
  std::vector<std::int64_t> kp(C);
  for (idx j = 0; j < C; ++j) kp[static_cast<std::size_t>(j)] = (std::int64_t{1} << 40) - 40 + j;
  const auto q = test_util::randn(static_cast<std::size_t>(D), 91);
  const std::vector<double> k(static_cast<std::size_t>(C * D), 1.0);
  for (idx h = 0; h < H; ++h) {
    std::vector<double> s(static_cast<std::size_t>(C), 0.0);
    const posenc::tile<double> t{.head = h, .rows = 1, .cols = C, .q_pos = qp.data(), .k_pos = kp.data(),
                                 .q = posenc::const_matrix_map<double>(q.data(), 1, D, Eigen::OuterStride<>(D)),
                                 .k = posenc::const_matrix_map<double>(k.data(), C, D, Eigen::OuterStride<>(D))};
    bz.add_score_terms<double>(t, 1.0, posenc::matrix_map<double>(s.data(), 1, C, Eigen::OuterStride<>(C)));
    for (idx j = 0; j < C; ++j) {
      const auto r = L.r(h, std::min<std::int64_t>(40 - j, 16));
      double want = 0;
      for (idx e = 0; e < D; ++e) want += q[static_cast<std::size_t>(e)] * r[static_cast<std::size_t>(e)];
      REQUIRE(std::abs(s[static_cast<std::size_t>(j)] - want) <= 1e-13);
    }
  }
}

TEST_CASE("transformer_xl: config.json and safetensors of a transfo-xl checkpoint", "[xl][io]") {
  namespace fs = std::filesystem;
  const idx H = 2, D = 3, M = 6, layers = 2;
  const fs::path dir = fs::temp_directory_path() / "posenc_test_transformer_xl";
  fs::create_directories(dir);
  nlohmann::json cfg = {{"model_type", "transfo-xl"}, {"d_model", M},          {"n_head", H},
                        {"d_head", D},                {"mem_len", 12},         {"clamp_len", 7},
                        {"same_length", false},       {"untie_r", true},       {"n_layer", layers}};
  {
    const auto c = posenc::io::transformer_xl_config_from_hf(cfg);
    CHECK(c.d_model == M);
    CHECK(c.n_head == H);
    CHECK(c.d_head == D);
    CHECK(c.mem_len == 12);
    CHECK(c.clamp_len == 7);
    CHECK_FALSE(c.same_length);
    // TransfoXLConfig defaults
    const auto d = posenc::io::transformer_xl_config_from_hf({{"d_model", 8}, {"n_head", 2}, {"d_head", 4}});
    CHECK(d.mem_len == 1600);
    CHECK(d.clamp_len == 1000);
    CHECK(d.same_length);
    CHECK(posenc::io::transformer_xl_untie_r({}));
    CHECK_THROWS_WITH(posenc::io::transformer_xl_config_from_hf({{"d_model", 8}, {"n_head", 2}}),
                      Catch::Contains("d_head"));
  }
  auto vals = [](idx n, unsigned seed) { return test_util::randn(static_cast<std::size_t>(n), seed); };
  // untie_r = true, TransfoXLLMHeadModel names ("transformer." prefix), per-layer biases.
  posenc::io::safetensors_writer untied;
  for (idx l = 0; l < layers; ++l) {
    const std::string p = "transformer.layers." + std::to_string(l) + ".dec_attn.";
    untied.add<double>(p + "r_net.weight", {H * D, M}, vals(H * D * M, 100 + l));
    untied.add<double>(p + "r_w_bias", {H, D}, vals(H * D, 110 + l));
    untied.add<double>(p + "r_r_bias", {H, D}, vals(H * D, 120 + l));
    untied.add<double>(p + "qkv_net.weight", {3 * H * D, M}, vals(3 * H * D * M, 130 + l));
  }
  untied.write(dir / "untied.safetensors");
  const auto st = posenc::io::read_safetensors(dir / "untied.safetensors");
  const auto enc = posenc::io::transformer_xl_from_hf<float>(cfg, st, 1);
  CHECK(enc.config().clamp_len == 7);
  {
    const auto w = vals(H * D * M, 101), u = vals(H * D, 111), v = vals(H * D, 121);
    for (idx e = 0; e < H * D * M; ++e) REQUIRE(enc.r_net_weight().data()[e] == static_cast<float>(w[static_cast<std::size_t>(e)]));
    for (idx e = 0; e < H * D; ++e) {
      REQUIRE(enc.r_w_bias().data()[e] == static_cast<float>(u[static_cast<std::size_t>(e)]));
      REQUIRE(enc.r_r_bias().data()[e] == static_cast<float>(v[static_cast<std::size_t>(e)]));
    }
  }
  CHECK_THROWS_WITH(posenc::io::transformer_xl_from_hf<float>(cfg, st, 2), Catch::Contains("n_layer"));
  // untie_r = false: TransfoXLModel names (no prefix), biases shared at model level.
  cfg["untie_r"] = false;
  CHECK_THROWS_WITH(posenc::io::transformer_xl_from_hf<float>(cfg, st, 0),
                    Catch::Contains("transformer.r_w_bias") && Catch::Contains("missing"));
  posenc::io::safetensors_writer tied;
  tied.add<double>("layers.0.dec_attn.r_net.weight", {H * D, M}, vals(H * D * M, 140));
  tied.add<double>("r_w_bias", {H, D}, vals(H * D, 141));
  tied.add<double>("r_r_bias", {H, D}, vals(H * D, 142));
  tied.add<double>("layers.1.dec_attn.r_net.weight", {H * D, M + 2}, vals(H * D * (M + 2), 143));
  tied.write(dir / "tied.safetensors");
  const auto st2 = posenc::io::read_safetensors(dir / "tied.safetensors");
  const auto enc2 = posenc::io::transformer_xl_from_hf<double>(cfg, st2, 0);
  CHECK(enc2.r_r_bias().data()[3] == vals(H * D, 142)[3]);
  CHECK_THROWS_WITH(posenc::io::transformer_xl_from_hf<double>(cfg, st2, 1),
                    Catch::Contains("layers.1.dec_attn.r_net.weight") && Catch::Contains("[6, 8] for [6, 6]"));
  cfg["d_head"] = 4;
  CHECK_THROWS_WITH(posenc::io::transformer_xl_from_hf<double>(cfg, st2, 0),
                    Catch::Contains("layers.0.dec_attn.r_net.weight") && Catch::Contains("[8, 6]"));
  fs::remove_all(dir);
}

TEST_CASE("transformer_xl: a bound encoding serves later calls of the same shape", "[xl]") {
  const xl_case fc{"reuse", 2, 20, 30, 2, 8, 32, -1, false, 30, false, false, 16, 24};
  const problem p(fc);
  const layer L(fc.H, fc.D, fc.M, 95);
  std::vector<float> wt, ut, vt;
  const auto enc = L.encoding<float>({.d_model = fc.M, .n_head = fc.H, .d_head = fc.D}, wt, ut, vt);
  const auto bound = enc.bind_segment(fc.Sq, p.Sk, posenc::scalar_type::float32);
  REQUIRE(bound.min_distance() == 0);
  REQUIRE(bound.max_distance() == p.Sk - 1);
  const std::vector<float> q(p.q.begin(), p.q.end()), k(p.k.begin(), p.k.end()), v(p.v.begin(), p.v.end());
  auto run = [&](const auto& e, idx sq, posenc::attention_options opt) {
    std::vector<float> out(static_cast<std::size_t>(fc.B * sq * fc.H * fc.D), -7.f);
    posenc::attention<float>(posenc::bshd(q.data(), fc.B, sq, fc.H, fc.D), posenc::bshd(k.data(), fc.B, p.Sk, fc.H, fc.D),
                             posenc::bshd(v.data(), fc.B, p.Sk, fc.H, fc.D), posenc::bshd(out.data(), fc.B, sq, fc.H, fc.D),
                             e, opt);
    return out;
  };
  const auto opt = posenc::transformer_xl_options(fc.Sq, p.Sk);
  const auto fresh = run(enc, fc.Sq, opt);
  for (int call = 0; call < 2; ++call) {
    const auto again = run(bound, fc.Sq, opt);
    REQUIRE(std::memcmp(again.data(), fresh.data(), fresh.size() * sizeof(float)) == 0);
  }
  // A decode step inside the table's distances is served too; one beyond it is refused, untouched.
  REQUIRE_NOTHROW(run(bound, 1, posenc::transformer_xl_options(1, p.Sk)));
  posenc::attention_options beyond = opt;
  beyond.q_offset += 5;
  CHECK_THROWS_WITH(run(bound, fc.Sq, beyond), Catch::Contains("table"));
  const auto bound_d = enc.bind_segment(fc.Sq, p.Sk, posenc::scalar_type::float64);
  CHECK_THROWS_WITH(run(bound_d, fc.Sq, opt), Catch::Contains("scalar type"));
}
