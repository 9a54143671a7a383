// Long context: causal attention at L = 131072 (H = 1, d = 64, float) with RoPE (exact angles, and
// YaRN) and with ALiBi completes without anything proportional to L² (peak RSS), and query rows
// sampled across the sequence match a per-row computation in double built from the papers' and
// Hugging Face's formulas, independent of posenc. Label `long`: run in the optimized builds only
// (a sanitizer build would take tens of minutes for the same arithmetic).
#include <catch2/catch.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <numbers>
#include <random>
#include <vector>

#include <unsupported/Eigen/CXX11/ThreadPool>

#include "posenc/posenc.hpp"

namespace {

using idx = posenc::index_t;
constexpr idx L = 131072, D = 64;

/// Peak resident set size of the process so far, in bytes (Linux reports KiB).
std::int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<std::int64_t>(u.ru_maxrss) * 1024;
}

std::vector<float> normal(std::size_t n, unsigned seed, float scale) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& e : v) e = nd(g);
  return v;
}

/// HF modeling_rope_utils._compute_yarn_parameters (beta_fast 32, beta_slow 1, truncate) in double:
/// the inv_freq blend between interpolation and extrapolation and the attention factor
/// 0.1 ln(factor) + 1 (Peng et al. 2023, eq. 22).
struct yarn_reference {
  std::vector<double> inv_freq;
  double attention_factor = 1;
  yarn_reference(double base, double factor, double original, bool yarn) {
    const int half = D / 2;
    inv_freq.resize(half);
    if (!yarn) {
      for (int k = 0; k < half; ++k) inv_freq[k] = 1.0 / std::pow(base, 2.0 * k / D);
      return;
    }
    auto correction_dim = [&](double rotations) {
      return D * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
    };
    const double low = std::max(std::floor(correction_dim(32.0)), 0.0);
    double high = std::min(std::ceil(correction_dim(1.0)), static_cast<double>(D - 1));
    if (low == high) high += 0.001;
    for (int k = 0; k < half; ++k) {
      const double pos_freq = std::pow(base, 2.0 * k / D);
      const double ramp = std::clamp((k - low) / (high - low), 0.0, 1.0);
      const double extrapolation = 1.0 - ramp;
      inv_freq[k] = (1.0 / (factor * pos_freq)) * (1.0 - extrapolation) + (1.0 / pos_freq) * extrapolation;
    }
    attention_factor = 0.1 * std::log(factor) + 1.0;
  }
  /// rotate_half at position p (HF apply_rotary_pos_emb), cos and sin scaled by the attention factor.
  [[nodiscard]] std::vector<double> rotate(const float* x, std::int64_t p) const {
    std::vector<double> y(D);
    for (int k = 0; k < D / 2; ++k) {
      const double a = static_cast<double>(p) * inv_freq[k];
      const double c = std::cos(a) * attention_factor, s = std::sin(a) * attention_factor;
      y[k] = x[k] * c - x[k + D / 2] * s;
      y[k + D / 2] = x[k + D / 2] * c + x[k] * s;
    }
    return y;
  }
};

struct long_problem {
  std::vector<float> q = normal(static_cast<std::size_t>(L * D), 1, 1.0f);
  std::vector<float> k = normal(static_cast<std::size_t>(L * D), 2, 1.0f);
  std::vector<float> v = normal(static_cast<std::size_t>(L * D), 3, 1.0f);
  std::vector<float> out = std::vector<float>(static_cast<std::size_t>(L * D), 0.0f);

  /// Runs the kernel; returns the growth of the peak RSS during the call.
  template <class E>
  std::int64_t run(const E& enc) {
    std::fill(out.begin(), out.end(), 0.0f);  // touched before the baseline
    Eigen::ThreadPool pool(2);
    posenc::attention_options opt;
    opt.causal = true;
    opt.pool = &pool;
    const std::int64_t before = peak_rss_bytes();
    posenc::attention<float>(posenc::bshd<const float>(q.data(), 1, L, 1, D), posenc::bshd<const float>(k.data(), 1, L, 1, D),
                             posenc::bshd<const float>(v.data(), 1, L, 1, D), posenc::bshd(out.data(), 1, L, 1, D), enc, opt);
    return peak_rss_bytes() - before;
  }

  /// Row i in double: s_j = q_i·k_j / sqrt(d) + bias(i, j) over j <= i, softmax, Σ p_j v_j; max |diff|.
  template <class Score>
  double row_error(idx i, const Score& score) const {
    std::vector<double> s(static_cast<std::size_t>(i + 1));
    double m = -INFINITY;
    for (idx j = 0; j <= i; ++j) m = std::max(m, s[static_cast<std::size_t>(j)] = score(i, j));
    std::vector<double> o(D, 0.0);
    double sum = 0;
    for (idx j = 0; j <= i; ++j) {
      const double p = std::exp(s[static_cast<std::size_t>(j)] - m);
      sum += p;
      for (idx d = 0; d < D; ++d) o[d] += p * v[static_cast<std::size_t>(j * D + d)];
    }
    double err = 0;
    for (idx d = 0; d < D; ++d) err = std::max(err, std::abs(o[d] / sum - out[static_cast<std::size_t>(i * D + d)]));
    return err;
  }
};

const std::vector<idx> sampled_rows = {0, 1, 255, 256, 4097, 32768, 65535, 99999, 131000, L - 1};
constexpr std::int64_t l2_bytes = std::int64_t{L} * L * 4;
// Inputs are 128 MiB; the kernel's own memory is O(L d) (positions, transformed keys) plus tiles.
constexpr std::int64_t rss_budget = std::int64_t{256} << 20;

template <class E>
void check_rope(long_problem& p, const E& enc, const yarn_reference& ref, const char* name) {
  const std::int64_t grew = p.run(enc);
  std::cout << name << ": peak RSS grew by " << grew / (1 << 20) << " MiB (L^2 * 4 bytes = " << (l2_bytes >> 30)
            << " GiB)\n";
  CHECK(grew < rss_budget);
  std::vector<std::vector<double>> kr(static_cast<std::size_t>(L));
  for (idx j = 0; j < L; ++j) kr[static_cast<std::size_t>(j)] = ref.rotate(p.k.data() + j * D, j);
  double worst = 0;
  for (idx i : sampled_rows) {
    const std::vector<double> qr = ref.rotate(p.q.data() + i * D, i);
    const double e = p.row_error(i, [&](idx, idx j) {
      double dot = 0;
      for (idx d = 0; d < D; ++d) dot += qr[d] * kr[static_cast<std::size_t>(j)][d];
      return dot / std::sqrt(double(D));
    });
    INFO(name << " row " << i);
    CHECK(e < 1e-5);
    worst = std::max(worst, e);
  }
  std::cout << name << ": worst |out - double| over sampled rows " << worst << "\n";
}

}  // namespace

TEST_CASE("long context: RoPE exact angles at L = 131072, causal, O(L) memory, rows match double", "[long]") {
  long_problem p;
  posenc::rope_config c;
  c.head_dim = D;
  check_rope(p, posenc::rope(c), yarn_reference(10000.0, 1.0, 0.0, false), "rope exact");
}

TEST_CASE("long context: RoPE YaRN at L = 131072, causal, O(L) memory, rows match double", "[long]") {
  long_problem p;
  posenc::rope_config c;
  c.head_dim = D;
  c.rope_theta = 1e6;
  c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = 4, .original_max_position_embeddings = 32768};
  c.max_position_embeddings = L;
  check_rope(p, posenc::rope(c), yarn_reference(1e6, 4.0, 32768.0, true), "rope yarn");
}

TEST_CASE("long context: ALiBi at L = 131072, causal, O(L) memory, rows match double", "[long]") {
  long_problem p;
  const std::int64_t grew = p.run(posenc::alibi({.heads = 1}));
  std::cout << "alibi: peak RSS grew by " << grew / (1 << 20) << " MiB\n";
  CHECK(grew < rss_budget);
  // One head, max_bias 8: slope 2^-8 (Press et al. 2022, BLOOM get_slopes); causal form -m (i - j).
  const double slope = std::pow(2.0, -8.0);
  double worst = 0;
  for (idx i : sampled_rows) {
    const double e = p.row_error(i, [&](idx qi, idx j) {
      double dot = 0;
      for (idx d = 0; d < D; ++d) dot += double(p.q[static_cast<std::size_t>(qi * D + d)]) * p.k[static_cast<std::size_t>(j * D + d)];
      return dot / std::sqrt(double(D)) - slope * double(qi - j);
    });
    INFO("alibi row " << i);
    CHECK(e < 1e-5);
    worst = std::max(worst, e);
  }
  std::cout << "alibi: worst |out - double| over sampled rows " << worst << "\n";
}
