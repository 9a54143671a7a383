// posenc demo: three model families through the one fused kernel, each checked against the plain
// double-precision reference attention, then RoPE's angle precision at a large position.
//
//   Llama-3.1  RoPE (llama3 scaling) + causal GQA 32/8   float kernel vs double reference
//   BLOOM      ALiBi after the 1/sqrt(d) scale, causal    float kernel vs double reference
//   T5         bucketed relative bias, no 1/sqrt(d)        float kernel vs double reference
//
// Exits non-zero if any comparison is off, so `cmake --workflow --preset demo` doubles as a smoke test.
#include <posenc/posenc.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

using Index = posenc::index_t;  // not `index`: POSIX declares ::index()

struct problem {
  Index L, H, Hkv, D;
  std::vector<double> q, k, v;  // BSHD, batch 1
  problem(Index l, Index h, Index hkv, Index d, unsigned seed) : L(l), H(h), Hkv(hkv), D(d) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> n;
    q.resize(L * H * D);
    k.resize(L * Hkv * D);
    v.resize(L * Hkv * D);
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = n(rng);
  }
};

std::vector<float> to_float(const std::vector<double>& x) { return {x.begin(), x.end()}; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Runs the float kernel with `enc`, the double reference with the given terms, prints one line and
/// returns the max abs difference relative to max |reference|.
template <class E>
double compare(const char* name, const problem& p, const E& enc, const std::vector<double>& q_ref,
               const std::vector<double>& k_ref, const posenc::attention_options& opt,
               const posenc::reference_terms<double>& terms) {
  const auto qf = to_float(p.q), kf = to_float(p.k), vf = to_float(p.v);
  std::vector<float> out(p.L * p.H * p.D);
  auto t0 = std::chrono::steady_clock::now();
  posenc::attention(posenc::bshd<const float>(qf.data(), 1, p.L, p.H, p.D),
                    posenc::bshd<const float>(kf.data(), 1, p.L, p.Hkv, p.D),
                    posenc::bshd<const float>(vf.data(), 1, p.L, p.Hkv, p.D), posenc::bshd(out.data(), 1, p.L, p.H, p.D),
                    enc, opt);
  const double t_fused = seconds_since(t0);

  std::vector<double> ref(out.size());
  t0 = std::chrono::steady_clock::now();
  posenc::reference_attention<double>(posenc::bshd<const double>(q_ref.data(), 1, p.L, p.H, p.D),
                                      posenc::bshd<const double>(k_ref.data(), 1, p.L, p.Hkv, p.D),
                                      posenc::bshd<const double>(p.v.data(), 1, p.L, p.Hkv, p.D),
                                      posenc::bshd(ref.data(), 1, p.L, p.H, p.D), opt, terms);
  const double t_ref = seconds_since(t0);
  double err = 0, mag = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(out[i]) - ref[i]));
    mag = std::max(mag, std::abs(ref[i]));
  }
  std::printf("%-34s L=%-5td H=%td/%td d=%td  max|fused-ref|/max|ref| = %.2e   fused float %6.2f ms, naive double reference %7.1f ms\n",
              name, p.L, p.H, p.Hkv, p.D, err / mag, 1e3 * t_fused, 1e3 * t_ref);
  return err / mag;
}

}  // namespace

int main() {
  bool ok = true;
  const double tol = 2e-5;  // float kernel vs double oracle, relative to the output magnitude

  {  // Llama-3.1: the reference gets q and k rotated by RoPE in double (the transform, applied up front).
    problem p(512, 32, 8, 128, 1);
    posenc::rope rope(posenc::rope_config{
        .head_dim = 128, .rope_theta = 5e5,
        .scaling = {.rope_type = posenc::rope_type::llama3, .factor = 8.0, .original_max_position_embeddings = 8192,
                    .low_freq_factor = 1.0, .high_freq_factor = 4.0},
        .max_position_embeddings = 131072});
    const auto pos = posenc::contiguous_positions(1, p.L);
    std::vector<double> qr(p.q.size()), kr(p.k.size());
    rope.apply(posenc::bshd<const double>(p.q.data(), 1, p.L, p.H, p.D), posenc::bshd(qr.data(), 1, p.L, p.H, p.D),
               posenc::view(pos));
    rope.apply(posenc::bshd<const double>(p.k.data(), 1, p.L, p.Hkv, p.D), posenc::bshd(kr.data(), 1, p.L, p.Hkv, p.D),
               posenc::view(pos));
    ok &= compare("Llama-3.1 RoPE + causal GQA", p, rope, qr, kr, {.causal = true}, {}) < tol;
  }
  {  // BLOOM: ALiBi, bias m_h * (j - i) after the scale.
    problem p(512, 16, 16, 64, 2);
    posenc::alibi alibi(posenc::alibi_config{.heads = 16});
    posenc::reference_terms<double> terms;
    const auto slopes = posenc::alibi_slopes(16);
    terms.bias = [&](Index, Index h, Index i, Index j) { return slopes[h] * static_cast<double>(j - i); };
    ok &= compare("BLOOM ALiBi, causal", p, alibi, p.q, p.k, {.causal = true}, terms) < tol;
  }
  {  // T5 encoder: bidirectional buckets, logits unscaled.
    problem p(512, 8, 8, 64, 3);
    std::vector<double> table(32 * 8);
    std::mt19937 rng(4);
    std::normal_distribution<double> n;
    for (auto& e : table) e = n(rng);
    const auto table_f = to_float(table);
    posenc::t5_relative_bias<float> t5(posenc::tensor_map<const float, 2>(table_f.data(), 32, 8),
                                       posenc::t5_config{.num_buckets = 32, .max_distance = 128});
    posenc::reference_terms<double> terms;
    terms.bias = [&](Index, Index h, Index i, Index j) { return table[posenc::t5_relative_bucket(j - i) * 8 + h]; };
    // The kernel takes the scale from T5's logit_scale (1); the reference is told explicitly.
    ok &= compare("T5 relative bias (encoder)", p, t5, p.q, p.k, {.scale = 1.0}, terms) < tol;
  }
  {  // Angle precision: one unit vector rotated at position 2^24 in float, exact vs HF's float32 path.
    const std::int64_t p = std::int64_t{1} << 24;
    const std::vector<std::int64_t> pos{p};
    double worst_exact = 0, worst_hf = 0;
    for (auto angles : {posenc::rope_angles::exact, posenc::rope_angles::hf_float32}) {
      posenc::rope r(posenc::rope_config{.head_dim = 128, .rope_theta = 1e4, .angles = angles});
      std::vector<float> x(128, 0.f);
      std::vector<double> xd(128, 0.0);
      for (int i = 0; i < 128; ++i) x[i] = static_cast<float>(xd[i] = (i % 2 == 0 ? 1.0 : -1.0) / std::sqrt(128.0));
      r.apply(posenc::bshd(x.data(), 1, 1, 1, 128), posenc::positions_view(pos.data(), 1, 1));
      posenc::rope rd(posenc::rope_config{.head_dim = 128, .rope_theta = 1e4});
      rd.apply(posenc::bshd(xd.data(), 1, 1, 1, 128), posenc::positions_view(pos.data(), 1, 1));
      double worst = 0;
      for (int i = 0; i < 128; ++i) worst = std::max(worst, std::abs(x[i] - xd[i]));
      (angles == posenc::rope_angles::exact ? worst_exact : worst_hf) = worst;
    }
    std::printf("RoPE in float at position 2^24: max error vs double  exact %.1e   hf_float32 %.1e\n", worst_exact,
                worst_hf);
    ok &= worst_exact < 1e-6;
  }
  std::printf(ok ? "demo: all comparisons within tolerance\n" : "demo: a comparison FAILED\n");
  return ok ? 0 : 1;
}
