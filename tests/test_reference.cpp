// The reference attention (the tests' oracle) against hand-computed cases and an independent
// brute-force loop written here with different structure (BHSD copies, log-sum-exp form).
#include <catch2/catch.hpp>

#include <posenc/reference.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

using Index = posenc::index_t;  // not `index`: POSIX declares ::index()

namespace {

struct qkv {
  Index B, Sq, Sk, H, Hkv, D, Dv;
  std::vector<double> q, k, v;
  qkv(Index b, Index sq, Index sk, Index h, Index hkv, Index d, Index dv, unsigned seed)
      : B(b), Sq(sq), Sk(sk), H(h), Hkv(hkv), D(d), Dv(dv), q(b * sq * h * d), k(b * sk * hkv * d), v(b * sk * hkv * dv) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> n(0.0, 1.0);
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = n(rng);
  }
  posenc::heads_view<const double> Q() const { return posenc::bshd<const double>(q.data(), B, Sq, H, D); }
  posenc::heads_view<const double> K() const { return posenc::bshd<const double>(k.data(), B, Sk, Hkv, D); }
  posenc::heads_view<const double> V() const { return posenc::bshd<const double>(v.data(), B, Sk, Hkv, Dv); }
};

// Brute force in log-sum-exp form: out_i = sum_j exp(s_ij - lse_i) v_j with lse from all visible s_ij.
std::vector<double> brute(const qkv& x, double scale, bool causal, std::int64_t q_offset,
                          const std::vector<std::int64_t>& kv_len, const std::vector<double>& bias /*[H,Sq,Sk] or empty*/) {
  std::vector<double> out(x.B * x.Sq * x.H * x.Dv, 0.0);
  const Index group = x.H / x.Hkv;
  for (Index b = 0; b < x.B; ++b)
    for (Index h = 0; h < x.H; ++h)
      for (Index i = 0; i < x.Sq; ++i) {
        std::vector<double> s;
        std::vector<Index> js;
        for (Index j = 0; j < x.Sk; ++j) {
          if (j >= kv_len[b]) continue;
          if (causal && j > q_offset + i) continue;
          double dot = 0;
          for (Index d = 0; d < x.D; ++d)
            dot += x.q[((b * x.Sq + i) * x.H + h) * x.D + d] * x.k[((b * x.Sk + j) * x.Hkv + h / group) * x.D + d];
          s.push_back(scale * dot + (bias.empty() ? 0.0 : bias[(h * x.Sq + i) * x.Sk + j]));
          js.push_back(j);
        }
        if (s.empty()) continue;
        double mx = -std::numeric_limits<double>::infinity();
        for (double e : s) mx = std::max(mx, e);
        double sum = 0;
        for (double e : s) sum += std::exp(e - mx);
        const double lse = mx + std::log(sum);
        for (std::size_t t = 0; t < s.size(); ++t)
          for (Index d = 0; d < x.Dv; ++d)
            out[((b * x.Sq + i) * x.H + h) * x.Dv + d] +=
                std::exp(s[t] - lse) * x.v[((b * x.Sk + js[t]) * x.Hkv + h / group) * x.Dv + d];
      }
  return out;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace

TEST_CASE("reference: one query, two keys, computed by hand", "[core][reference]") {
  // q = [1, 0], k0 = [1, 0], k1 = [0, 1], scale 1: s = [1, 0]; p0 = e/(e+1).
  const std::vector<double> q{1, 0}, k{1, 0, 0, 1}, v{10, 0, 0, 20};
  std::vector<double> out(2), probs(2), lse(1);
  posenc::attention_options opt;
  opt.scale = 1.0;
  posenc::reference_attention<double>(posenc::bshd(q.data(), 1, 1, 1, 2), posenc::bshd(k.data(), 1, 2, 1, 2),
                                      posenc::bshd(v.data(), 1, 2, 1, 2), posenc::bshd(out.data(), 1, 1, 1, 2), opt, {},
                                      posenc::tensor_map<double, 4>(probs.data(), 1, 1, 1, 2),
                                      posenc::tensor_map<double, 3>(lse.data(), 1, 1, 1));
  const double e = std::exp(1.0), p0 = e / (e + 1.0);
  CHECK(probs[0] == Approx(p0).epsilon(1e-15));
  CHECK(probs[1] == Approx(1 - p0).epsilon(1e-14));
  CHECK(out[0] == Approx(10 * p0).epsilon(1e-15));
  CHECK(out[1] == Approx(20 * (1 - p0)).epsilon(1e-14));
  CHECK(lse[0] == Approx(std::log(e + 1.0)).epsilon(1e-15));
}

TEST_CASE("reference: causal by positions, with a KV offset, computed by hand", "[core][reference]") {
  // Two cached keys + one new: the query at position 1 sees keys 0 and 1 only (equal scores).
  const std::vector<double> q{0, 0}, k(6, 0.0), v{1, 1, 3, 3, 100, 100};
  std::vector<double> out(2);
  posenc::attention_options opt;
  opt.causal = true;
  opt.q_offset = 1;
  posenc::reference_attention<double>(posenc::bshd(q.data(), 1, 1, 1, 2), posenc::bshd(k.data(), 1, 3, 1, 2),
                                      posenc::bshd(v.data(), 1, 3, 1, 2), posenc::bshd(out.data(), 1, 1, 1, 2), opt);
  CHECK(out[0] == Approx(2.0).epsilon(1e-15));
  CHECK(out[1] == Approx(2.0).epsilon(1e-15));
}

TEST_CASE("reference: a fully masked row gives zeros and lse -inf, never NaN", "[core][reference]") {
  const std::vector<double> q{1, 2}, k{3, 4}, v{5, 6};
  std::vector<double> out{7, 7}, lse{0};
  const std::vector<std::int64_t> pad{1};
  posenc::attention_options opt;
  opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), 1, 1);
  posenc::reference_attention<double>(posenc::bshd(q.data(), 1, 1, 1, 2), posenc::bshd(k.data(), 1, 1, 1, 2),
                                      posenc::bshd(v.data(), 1, 1, 1, 2), posenc::bshd(out.data(), 1, 1, 1, 2), opt, {},
                                      std::nullopt, posenc::tensor_map<double, 3>(lse.data(), 1, 1, 1));
  CHECK(out[0] == 0.0);
  CHECK(out[1] == 0.0);
  CHECK(std::isinf(lse[0]));
  CHECK(lse[0] < 0);
}

TEST_CASE("reference: -inf bias on every visible key also gives a zero row", "[core][reference]") {
  const std::vector<double> q{1}, k{1, 2}, v{5, 6};
  std::vector<double> out{9};
  posenc::reference_terms<double> terms;
  terms.bias = [](Index, Index, Index, Index) { return -std::numeric_limits<double>::infinity(); };
  posenc::reference_attention<double>(posenc::bshd(q.data(), 1, 1, 1, 1), posenc::bshd(k.data(), 1, 2, 1, 1),
                                      posenc::bshd(v.data(), 1, 2, 1, 1), posenc::bshd(out.data(), 1, 1, 1, 1), {}, terms);
  CHECK(out[0] == 0.0);
}

TEST_CASE("reference: NaN or +inf among the visible scores gives a NaN row, as PyTorch's softmax", "[core][reference]") {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  // one query, three keys with q.k = 1, NaN or +inf at key 1, and key 2 masked by causality
  for (const double bad : {nan, inf}) {
    const std::vector<double> q{1}, k{1, bad, 1}, v{5, 6, 7};
    std::vector<double> out{0}, lse{0}, probs(3, 0.0);
    posenc::attention_options opt;
    opt.causal = true;
    opt.q_offset = 1;  // sees keys 0 and 1
    posenc::reference_attention<double>(posenc::bshd(q.data(), 1, 1, 1, 1), posenc::bshd(k.data(), 1, 3, 1, 1),
                                        posenc::bshd(v.data(), 1, 3, 1, 1), posenc::bshd(out.data(), 1, 1, 1, 1), opt,
                                        {}, posenc::tensor_map<double, 4>(probs.data(), 1, 1, 1, 3),
                                        posenc::tensor_map<double, 3>(lse.data(), 1, 1, 1));
    CHECK(std::isnan(out[0]));
    CHECK(std::isnan(lse[0]));
    for (double p : probs) CHECK(std::isnan(p));
    // the same key masked: the row is finite (only key 0 is seen)
    opt.q_offset = 0;
    posenc::reference_attention<double>(posenc::bshd(q.data(), 1, 1, 1, 1), posenc::bshd(k.data(), 1, 3, 1, 1),
                                        posenc::bshd(v.data(), 1, 3, 1, 1), posenc::bshd(out.data(), 1, 1, 1, 1), opt);
    CHECK(out[0] == 5.0);
  }
}

TEST_CASE("reference matches a brute-force loop on random inputs (GQA, causal, padding, offset, bias)",
          "[core][reference]") {
  struct cfg {
    Index B, Sq, Sk, H, Hkv, D, Dv;
    bool causal;
    std::int64_t q_offset;
  };
  const cfg cases[] = {{1, 5, 5, 2, 2, 4, 4, false, 0}, {2, 7, 9, 4, 2, 8, 3, true, 2},
                       {2, 1, 13, 8, 1, 16, 16, true, 12}, {1, 6, 6, 3, 3, 5, 7, true, 0}};
  unsigned seed = 1;
  for (const auto& c : cases) {
    qkv x(c.B, c.Sq, c.Sk, c.H, c.Hkv, c.D, c.Dv, seed++);
    std::vector<std::int64_t> kv_len(c.B, c.Sk);
    if (c.B > 1) kv_len[1] = c.Sk - 3;
    std::vector<double> bias(c.H * c.Sq * c.Sk);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(-2, 2);
    for (auto& e : bias) e = u(rng);
    posenc::attention_options opt;
    opt.causal = c.causal;
    opt.q_offset = c.q_offset;
    opt.kv_lengths = kv_len;
    posenc::reference_terms<double> terms;
    terms.bias = [&](Index, Index h, Index i, Index j) { return bias[(h * c.Sq + i) * c.Sk + j]; };
    std::vector<double> out(c.B * c.Sq * c.H * c.Dv, -1.0);
    posenc::reference_attention<double>(x.Q(), x.K(), x.V(), posenc::bshd(out.data(), c.B, c.Sq, c.H, c.Dv), opt, terms);
    const auto expected = brute(x, 1.0 / std::sqrt(static_cast<double>(c.D)), c.causal, c.q_offset, kv_len, bias);
    CHECK(max_abs_diff(out, expected) < 1e-13);
  }
}

TEST_CASE("reference: BHSD and BSHD layouts give the same result", "[core][reference]") {
  qkv x(2, 5, 6, 4, 2, 8, 8, 42);
  std::vector<double> out1(2 * 5 * 4 * 8), out2(out1.size());
  posenc::reference_attention<double>(x.Q(), x.K(), x.V(), posenc::bshd(out1.data(), 2, 5, 4, 8));
  // Transpose inputs to BHSD.
  auto to_bhsd = [](const std::vector<double>& src, Index B, Index S, Index H, Index D) {
    std::vector<double> dst(src.size());
    for (Index b = 0; b < B; ++b)
      for (Index s = 0; s < S; ++s)
        for (Index h = 0; h < H; ++h)
          for (Index d = 0; d < D; ++d) dst[((b * H + h) * S + s) * D + d] = src[((b * S + s) * H + h) * D + d];
    return dst;
  };
  const auto q = to_bhsd(x.q, 2, 5, 4, 8), k = to_bhsd(x.k, 2, 6, 2, 8), v = to_bhsd(x.v, 2, 6, 2, 8);
  posenc::reference_attention<double>(posenc::bhsd(q.data(), 2, 4, 5, 8), posenc::bhsd(k.data(), 2, 2, 6, 8),
                                      posenc::bhsd(v.data(), 2, 2, 6, 8), posenc::bhsd(out2.data(), 2, 4, 5, 8));
  const auto back = to_bhsd(out1, 2, 5, 4, 8);
  CHECK(max_abs_diff(back, out2) < 1e-15);
}

TEST_CASE("reference: score_term lives inside the scale, bias after it, value_term adds to v", "[core][reference]") {
  // One query, one key: out = v + value_term whatever the scores; two keys to see the scale placement.
  const std::vector<double> q{1}, k{1, 1}, v{2, 4};
  std::vector<double> out(1), probs(2);
  posenc::attention_options opt;
  opt.scale = 0.5;
  posenc::reference_terms<double> terms;
  terms.score_term = [](Index, Index, Index, Index j) { return j == 0 ? 2.0 : 0.0; };  // s0 = 0.5*(1+2)
  terms.bias = [](Index, Index, Index, Index j) { return j == 1 ? 1.0 : 0.0; };        // s1 = 0.5*1 + 1
  terms.value_term = [](Index, Index, Index, Index j, double* add) { add[0] = j == 0 ? 10.0 : 0.0; };
  posenc::reference_attention<double>(posenc::bshd(q.data(), 1, 1, 1, 1), posenc::bshd(k.data(), 1, 2, 1, 1),
                                      posenc::bshd(v.data(), 1, 2, 1, 1), posenc::bshd(out.data(), 1, 1, 1, 1), opt, terms,
                                      posenc::tensor_map<double, 4>(probs.data(), 1, 1, 1, 2));
  // s0 = 1.5, s1 = 1.5: equal weights.
  CHECK(probs[0] == Approx(0.5).epsilon(1e-15));
  CHECK(out[0] == Approx(0.5 * 12 + 0.5 * 4).epsilon(1e-15));
}

TEST_CASE("reference: invalid shapes throw posenc::error and leave the output untouched", "[core][reference][error]") {
  qkv x(1, 3, 4, 4, 3, 8, 8, 7);  // 4 query heads, 3 kv heads: not divisible
  std::vector<double> out(1 * 3 * 4 * 8, 42.0);
  CHECK_THROWS_WITH(posenc::reference_attention<double>(x.Q(), x.K(), x.V(), posenc::bshd(out.data(), 1, 3, 4, 8)),
                    Catch::Contains("kv_heads") && Catch::Contains("divide"));
  for (double e : out) CHECK(e == 42.0);

  qkv y(2, 3, 4, 2, 2, 8, 8, 8);
  std::vector<double> out2(2 * 3 * 2 * 8, 42.0);
  const std::vector<std::int64_t> lens{4, 5};
  posenc::attention_options opt;
  opt.kv_lengths = lens;
  CHECK_THROWS_WITH(posenc::reference_attention<double>(y.Q(), y.K(), y.V(), posenc::bshd(out2.data(), 2, 3, 2, 8), opt),
                    Catch::Contains("kv_lengths") && Catch::Contains("got 5"));
  const std::vector<std::int64_t> pos(5, 0);
  posenc::attention_options opt2;
  opt2.q_positions = posenc::positions_view(pos.data(), 1, 5);
  CHECK_THROWS_WITH(posenc::reference_attention<double>(y.Q(), y.K(), y.V(), posenc::bshd(out2.data(), 2, 3, 2, 8), opt2),
                    Catch::Contains("q_positions"));
  std::vector<double> small(2 * 3 * 2 * 4);
  CHECK_THROWS_WITH(posenc::reference_attention<double>(y.Q(), y.K(), y.V(), posenc::bshd(small.data(), 2, 3, 2, 4)),
                    Catch::Contains("out") && Catch::Contains("head_dim"));
  for (double e : out2) CHECK(e == 42.0);
}

TEST_CASE("resolve_masks: positions default to q_offset + i and j, padding from mask and lengths", "[core][mask]") {
  const std::vector<std::int64_t> pad{0, 1, 0, 0, 0, 0};
  const std::vector<std::int64_t> lens{3, 2};
  posenc::attention_options opt;
  opt.causal = true;
  opt.q_offset = 1;
  opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), 2, 3);
  opt.kv_lengths = lens;
  auto m = posenc::detail::resolve_masks(opt, 2, 2, 3);
  CHECK(m.qp(1)[0] == 1);
  CHECK(m.qp(1)[1] == 2);
  CHECK(m.kp(0)[2] == 2);
  CHECK(m.visible(0, 0, 0));
  CHECK_FALSE(m.visible(0, 0, 1));  // padded by the mask
  CHECK_FALSE(m.visible(0, 0, 2));  // causal: key 2 > query 1
  CHECK(m.visible(0, 1, 2));
  CHECK_FALSE(m.visible(1, 1, 2));  // beyond kv_lengths[1]
  CHECK(m.q_min == 1);
  CHECK(m.q_max == 2);
  CHECK(m.k_max == 2);
}
