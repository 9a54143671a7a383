// posenc demo: a tour of every encoding through the one fused attention kernel.
//
// For each encoding (configured and masked as its canonical model uses it, examples/encoding_zoo.hpp),
// one attention layer (batch 1, H = 8, d = 128) on random inputs:
//  * max error of the float kernel against the double reference attention (posenc/reference.hpp),
//    relative to max |reference|, at L = 256. The reference materializes the scores; the encoding's
//    terms enter it pair by pair, evaluated in double on 1 x 1 tiles (q and k transformed in double
//    beforehand, the input encodings added in double), so the comparison checks the kernel's tiling,
//    fusion and online softmax; the formulas themselves are checked against reference vectors by
//    the unit tests;
//  * ms per call and the overhead against no encoding (same mask and logit scale, best of 3 to 11) at
//    several lengths, on 2 threads, and the extra memory (heap the encoding allocates, held and per call);
//  * the relative-position property of its position-only scores S(i, j) (the score with the same
//    content at every position minus the score without positions; visible pairs only): max |S(i,j) - S(i+t,j+t)| is 0
//    for a relative encoding and not for an absolute one. The input encodings go through random
//    per-head projections here (as in a model), since PE(i).PE(j) of a sinusoid alone is relative.
// Then RoPE's angle precision at position 2^24.
//
// It writes CSV files for the pictures (tools/plot_demo.py draws them) into the folder given as the
// first argument (default: demo-output in the working directory); a second argument --quick times
// L = 256 only. Exits non-zero if an error exceeds
// its tolerance or a relative-position property is not the expected one.
#include <posenc/posenc.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "encoding_zoo.hpp"

namespace {

using zoo::Index;
constexpr Index kHeads = 8, kDim = 128, kModel = kHeads * kDim;
constexpr Index kCheckLen = 256;                          // length of the reference comparison
constexpr Index kPosLen = 64, kMaxShift = 32;              // position-only scores: i, j < kPosLen + kMaxShift
constexpr std::array<Index, 3> kShifts = {1, 7, kMaxShift};
constexpr std::array<Index, 3> kMapHeads = {0, 3, 7};     // heads drawn in the score heatmaps
constexpr Index kMaxLen = 2048;                           // rows of the absolute tables
constexpr double kTolerance = 2e-5;                       // float kernel vs double reference, relative

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The encoding's per-pair terms in double, from its (bound) hooks on 1 x 1 tiles.
template <class B>
struct pair_terms {
  const B& b;
  const std::vector<double>& q;  // [L, H, D] after the Q/K transforms
  const std::vector<double>& k;
  const std::vector<std::int64_t>& q_pos;
  const std::vector<std::int64_t>& k_pos;

  [[nodiscard]] posenc::tile<double> tile(Index h, Index i, Index j) const {
    return {.batch = 0, .head = h, .kv_head = h, .q_first = i, .k_first = j, .rows = 1, .cols = 1,
            .q_pos = &q_pos[static_cast<std::size_t>(i)], .k_pos = &k_pos[static_cast<std::size_t>(j)],
            .q = posenc::const_matrix_map<double>(&q[static_cast<std::size_t>((i * kHeads + h) * kDim)], 1, kDim,
                                                  Eigen::OuterStride<>(kDim)),
            .k = posenc::const_matrix_map<double>(&k[static_cast<std::size_t>((j * kHeads + h) * kDim)], 1, kDim,
                                                  Eigen::OuterStride<>(kDim))};
  }
  /// Inside the scale: s_ij = scale (q.k + score) + bias.
  // The 1 x 1 score tile lives in a vector's worth of doubles: g++ 12 cannot see that the hooks'
  // vectorized paths never run on one element and warns (-Warray-bounds) on a lone double.
  using cell = std::array<double, 8>;
  [[nodiscard]] double score(Index h, Index i, Index j) const {
    alignas(64) cell s{};
    if constexpr (posenc::has_score_terms<B, double>) {
      b.add_score_terms(tile(h, i, j), 1.0, posenc::matrix_map<double>(s.data(), 1, 1, Eigen::OuterStride<>(1)));
    }
    return s[0];
  }
  [[nodiscard]] double bias(Index h, Index i, Index j) const {
    alignas(64) cell s{};
    if constexpr (posenc::has_position_bias<B, double>) {
      b.add_position_bias(tile(h, i, j), posenc::matrix_map<double>(s.data(), 1, 1, Eigen::OuterStride<>(1)));
    }
    return s[0];
  }
  void value(Index h, Index i, Index j, double* add) const {
    if constexpr (posenc::has_value_terms<B, double>) {
      alignas(64) std::array<std::int32_t, 16> idx{};  // as cell above
      b.value_buckets(tile(h, i, j), posenc::index_tile(idx.data(), 1, 1, Eigen::OuterStride<>(1)));
      const auto table = b.template value_table<double>(h);
      for (Index d = 0; d < kDim; ++d) add[d] += table(idx[0], d);
    }
  }
};

/// Applies the bound encoding's Q/K transform (if any) to x [L, H, D] in place, in double.
template <class B>
void transform(const B& b, posenc::qk_role role, std::vector<double>& x, const std::vector<std::int64_t>& pos) {
  if constexpr (posenc::has_qk_transform<B, double>) {
    if (role == posenc::qk_role::key && !posenc::has_key_transform<B, double>) return;
    const auto L = static_cast<Index>(pos.size());
    for (Index h = 0; h < kHeads; ++h)
      b.transform_qk(role, h, std::span<const std::int64_t>(pos),
                     posenc::matrix_map<double>(x.data() + h * kDim, L, kDim, Eigen::OuterStride<>(kModel)));
  } else {
    (void)b, (void)role, (void)x, (void)pos;
  }
}

std::vector<float> to_float(const std::vector<double>& x) { return {x.begin(), x.end()}; }

/// The bound encoding of a call of L tokens in double, and what the kernel would see.
template <class E>
decltype(auto) bind_double(const E& enc, const posenc::call_info& info) {
  if constexpr (posenc::has_bind<E>) return enc.bind(info);
  else return (enc);
}

struct check_result {
  double error = 0;
  double relative_gap = 0, scores_max = 0;  // max |S(i,j) - S(i+t,j+t)|, max |S|
};

/// Reference comparison and position-only scores of one encoding (W = double weights and float
/// weights built from the same numbers). Appends the heatmap rows to `map`.
check_result check(zoo::kind kind, std::ofstream& map) {
  check_result r;
  const auto wd = zoo::make_weights<double>(kind, kHeads, kDim, kMaxLen);
  const auto wf = zoo::make_weights<float>(kind, kHeads, kDim, kMaxLen);
  const Index L = kCheckLen;
  const auto n = static_cast<std::size_t>(L * kModel);
  const auto q = zoo::normal<double>(n, 1), k = zoo::normal<double>(n, 2), v = zoo::normal<double>(n, 3);
  const auto pos = posenc::contiguous_positions(1, L);

  // The float kernel.
  std::vector<float> out(n);
  zoo::with_encoding(wf, [&](const auto& enc) {
    using E = std::decay_t<decltype(enc)>;
    const auto opt = zoo::options(kind, enc, L, kDim);
    auto qf = to_float(q), kf = to_float(k);
    const auto vf = to_float(v);
    const auto call = [&](const auto& e) {
      posenc::attention<float>(posenc::bshd<const float>(qf.data(), 1, L, kHeads, kDim),
                               posenc::bshd<const float>(kf.data(), 1, L, kHeads, kDim),
                               posenc::bshd<const float>(vf.data(), 1, L, kHeads, kDim),
                               posenc::bshd(out.data(), 1, L, kHeads, kDim), e, opt);
    };
    if constexpr (posenc::input_encoding<E>) {  // x + PE, then attention without an encoding
      enc.add_to(posenc::tensor_map<float, 3>(qf.data(), 1, L, kModel), posenc::view(pos));
      enc.add_to(posenc::tensor_map<float, 3>(kf.data(), 1, L, kModel), posenc::view(pos));
      call(posenc::no_position{});
    } else {
      call(enc);
    }
  });

  zoo::with_encoding(wd, [&](const auto& enc) {
    using E = std::decay_t<decltype(enc)>;
    // The double reference.
    {
      const auto opt = zoo::options(kind, enc, L, kDim);
      std::vector<std::int64_t> qp(static_cast<std::size_t>(L)), kp(qp.size());
      for (Index i = 0; i < L; ++i) qp[static_cast<std::size_t>(i)] = opt.q_offset + i, kp[static_cast<std::size_t>(i)] = i;
      auto qd = q, kd = k;
      std::vector<double> ref(n);
      posenc::reference_terms<double> terms;
      const auto qpos = posenc::contiguous_positions(1, L, opt.q_offset);
      if constexpr (posenc::input_encoding<E>) {
        enc.add_to(posenc::tensor_map<double, 3>(qd.data(), 1, L, kModel), posenc::view(pos));
        enc.add_to(posenc::tensor_map<double, 3>(kd.data(), 1, L, kModel), posenc::view(pos));
        posenc::reference_attention<double>(posenc::bshd<const double>(qd.data(), 1, L, kHeads, kDim),
                                            posenc::bshd<const double>(kd.data(), 1, L, kHeads, kDim),
                                            posenc::bshd<const double>(v.data(), 1, L, kHeads, kDim),
                                            posenc::bshd(ref.data(), 1, L, kHeads, kDim), opt, terms);
      } else {
        decltype(auto) b = bind_double(enc, zoo::call_info_of(L, kHeads, kDim, opt, qpos, pos, posenc::scalar_type::float64));
        transform(b, posenc::qk_role::query, qd, qp);
        transform(b, posenc::qk_role::key, kd, kp);
        const pair_terms<std::decay_t<decltype(b)>> t{b, qd, kd, qp, kp};
        terms.score_term = [&](Index, Index h, Index i, Index j) { return t.score(h, i, j); };
        terms.bias = [&](Index, Index h, Index i, Index j) { return t.bias(h, i, j); };
        terms.value_term = [&](Index, Index h, Index i, Index j, double* add) { t.value(h, i, j, add); };
        posenc::reference_attention<double>(posenc::bshd<const double>(qd.data(), 1, L, kHeads, kDim),
                                            posenc::bshd<const double>(kd.data(), 1, L, kHeads, kDim),
                                            posenc::bshd<const double>(v.data(), 1, L, kHeads, kDim),
                                            posenc::bshd(ref.data(), 1, L, kHeads, kDim), opt, terms);
      }
      double err = 0, mag = 0;
      for (std::size_t i = 0; i < n; ++i) {
        err = std::max(err, std::abs(static_cast<double>(out[i]) - ref[i]));
        mag = std::max(mag, std::abs(ref[i]));
      }
      r.error = err / mag;
    }

    // Position-only scores over N = kPosLen + kMaxShift positions: the same content at every position.
    const Index N = kPosLen + kMaxShift;
    const auto opt = zoo::options(kind, enc, N, kDim);
    const double scale = *opt.scale;
    const auto qbar = zoo::normal<double>(static_cast<std::size_t>(kModel), 40);
    const auto kbar = zoo::normal<double>(static_cast<std::size_t>(kModel), 41);
    std::vector<double> S(static_cast<std::size_t>(kHeads * N * N));  // [H, N, N]
    const auto at = [&](Index h, Index i, Index j) -> double& { return S[static_cast<std::size_t>((h * N + i) * N + j)]; };
    const auto dot = [&](const double* a, const double* b) {
      double s = 0;
      for (Index d = 0; d < kDim; ++d) s += a[d] * b[d];
      return s;
    };
    std::vector<std::int64_t> qp(static_cast<std::size_t>(N)), kp(qp.size());
    for (Index i = 0; i < N; ++i) qp[static_cast<std::size_t>(i)] = opt.q_offset + i, kp[static_cast<std::size_t>(i)] = i;
    const auto spos = posenc::contiguous_positions(1, N), sqpos = posenc::contiguous_positions(1, N, opt.q_offset);
    if constexpr (posenc::input_encoding<E>) {
      // x_i = content + PE(i), then per-head projections W_q, W_k [D, d_model] (random, 1/sqrt(d_model)).
      std::vector<double> pe(static_cast<std::size_t>(N * kModel), 0.0);
      enc.add_to(posenc::tensor_map<double, 3>(pe.data(), 1, N, kModel), posenc::view(spos));
      const auto wq = zoo::normal<double>(static_cast<std::size_t>(kModel * kModel), 42, 1.f / 32.f);
      const auto wk = zoo::normal<double>(static_cast<std::size_t>(kModel * kModel), 43, 1.f / 32.f);
      const auto project = [&](const std::vector<double>& w, const double* x, double* y) {
        for (Index r2 = 0; r2 < kModel; ++r2) {
          double s = 0;
          for (Index c = 0; c < kModel; ++c) s += w[static_cast<std::size_t>(r2 * kModel + c)] * x[c];
          y[r2] = s;
        }
      };
      std::vector<double> pq(static_cast<std::size_t>(N * kModel)), pk(pq.size()), cq(static_cast<std::size_t>(kModel)),
          ck(cq.size()), x(cq.size());
      project(wq, qbar.data(), cq.data());
      project(wk, kbar.data(), ck.data());
      for (Index i = 0; i < N; ++i) {
        for (Index c = 0; c < kModel; ++c) x[static_cast<std::size_t>(c)] = qbar[static_cast<std::size_t>(c)] + pe[static_cast<std::size_t>(i * kModel + c)];
        project(wq, x.data(), pq.data() + i * kModel);
        for (Index c = 0; c < kModel; ++c) x[static_cast<std::size_t>(c)] = kbar[static_cast<std::size_t>(c)] + pe[static_cast<std::size_t>(i * kModel + c)];
        project(wk, x.data(), pk.data() + i * kModel);
      }
      for (Index h = 0; h < kHeads; ++h)
        for (Index i = 0; i < N; ++i)
          for (Index j = 0; j < N; ++j)
            at(h, i, j) = scale * (dot(pq.data() + i * kModel + h * kDim, pk.data() + j * kModel + h * kDim) -
                                   dot(cq.data() + h * kDim, ck.data() + h * kDim));
    } else {
      decltype(auto) b = bind_double(enc, zoo::call_info_of(N, kHeads, kDim, opt, sqpos, spos, posenc::scalar_type::float64));
      std::vector<double> qs(static_cast<std::size_t>(N * kModel)), ks(qs.size());
      for (Index i = 0; i < N; ++i)
        for (Index c = 0; c < kModel; ++c) {
          qs[static_cast<std::size_t>(i * kModel + c)] = qbar[static_cast<std::size_t>(c)];
          ks[static_cast<std::size_t>(i * kModel + c)] = kbar[static_cast<std::size_t>(c)];
        }
      transform(b, posenc::qk_role::query, qs, qp);
      transform(b, posenc::qk_role::key, ks, kp);
      const pair_terms<std::decay_t<decltype(b)>> t{b, qs, ks, qp, kp};
      for (Index h = 0; h < kHeads; ++h)
        for (Index i = 0; i < N; ++i)
          for (Index j = 0; j < N; ++j)
            at(h, i, j) = scale * (dot(&qs[static_cast<std::size_t>(i * kModel + h * kDim)],
                                       &ks[static_cast<std::size_t>(j * kModel + h * kDim)]) -
                                   dot(&qbar[static_cast<std::size_t>(h * kDim)], &kbar[static_cast<std::size_t>(h * kDim)]) +
                                   t.score(h, i, j)) +
                          t.bias(h, i, j);
    }
    // Only the pairs a query sees (a causal family's hooks may leave anything, e.g. -inf, in the others).
    const auto visible = [&](Index i, Index j) { return !opt.causal || j <= i; };
    for (Index h = 0; h < kHeads; ++h)
      for (Index i = 0; i < kPosLen; ++i)
        for (Index j = 0; j < kPosLen; ++j) {
          if (!visible(i, j)) continue;
          r.scores_max = std::max(r.scores_max, std::abs(at(h, i, j)));
          for (Index s : kShifts) r.relative_gap = std::max(r.relative_gap, std::abs(at(h, i, j) - at(h, i + s, j + s)));
        }
    for (Index h : kMapHeads)
      for (Index i = 0; i < kPosLen; ++i)
        for (Index j = 0; j < kPosLen; ++j) {
          map << zoo::describe(kind).name << ',' << h << ',' << i << ',' << j << ',';
          if (visible(i, j)) map << at(h, i, j) << '\n';
          else map << "nan\n";
        }
  });
  return r;
}

struct timing {
  double ms = 0, ms_none = 0;
  std::size_t extra_bytes = 0;
};

/// Best of 3 to 11 calls with the encoding and of the same call with none (interleaved), 2 threads.
timing time_call(zoo::kind kind, Index L, Eigen::ThreadPool& pool) {
  timing r;
  const auto n = static_cast<std::size_t>(L * kModel);
  const auto q = zoo::normal<float>(n, 1), k = zoo::normal<float>(n, 2), v = zoo::normal<float>(n, 3);
  std::vector<float> out(n), qw(n), kw(n);
  const auto pos = posenc::contiguous_positions(1, L);
  const auto w = zoo::make_weights<float>(kind, kHeads, kDim, L);
  const std::size_t heap0 = zoo::heap_in_use();
  zoo::with_encoding(w, [&](const auto& enc) {
    using E = std::decay_t<decltype(enc)>;
    const std::size_t held = zoo::heap_in_use() - std::min(heap0, zoo::heap_in_use());
    auto opt = zoo::options(kind, enc, L, kDim);
    opt.pool = &pool;
    r.extra_bytes = held + zoo::bind_bytes(enc, zoo::call_info_of(L, kHeads, kDim, opt, pos, pos, posenc::scalar_type::float32));
    const auto Q = posenc::bshd<const float>(q.data(), 1, L, kHeads, kDim);
    const auto K = posenc::bshd<const float>(k.data(), 1, L, kHeads, kDim);
    const auto V = posenc::bshd<const float>(v.data(), 1, L, kHeads, kDim);
    const auto O = posenc::bshd(out.data(), 1, L, kHeads, kDim);
    r.ms = r.ms_none = 1e300;
    const int reps = L <= 256 ? 12 : L <= 512 ? 6 : 4;  // short calls are noisier: more of them
    for (int rep = 0; rep < reps; ++rep) {  // the first pair warms up (thread scratch, page faults)
      auto t0 = std::chrono::steady_clock::now();
      posenc::attention<float>(Q, K, V, O, posenc::no_position{}, opt);
      const double t_none = seconds_since(t0);
      t0 = std::chrono::steady_clock::now();
      if constexpr (posenc::input_encoding<E>) {
        std::copy(q.begin(), q.end(), qw.begin());
        std::copy(k.begin(), k.end(), kw.begin());
        enc.add_to(posenc::tensor_map<float, 3>(qw.data(), 1, L, kModel), posenc::view(pos));
        enc.add_to(posenc::tensor_map<float, 3>(kw.data(), 1, L, kModel), posenc::view(pos));
        posenc::attention<float>(posenc::bshd<const float>(qw.data(), 1, L, kHeads, kDim),
                                 posenc::bshd<const float>(kw.data(), 1, L, kHeads, kDim), V, O, posenc::no_position{}, opt);
      } else {
        posenc::attention<float>(Q, K, V, O, enc, opt);
      }
      const double t_enc = seconds_since(t0);
      if (rep > 0) r.ms_none = std::min(r.ms_none, 1e3 * t_none), r.ms = std::min(r.ms, 1e3 * t_enc);
    }
  });
  return r;
}

std::string human_bytes(std::size_t b) {
  char s[32];
  if (b < 1024) std::snprintf(s, sizeof s, "%zu B", b);
  else if (b < (1u << 20)) std::snprintf(s, sizeof s, "%.1f KiB", static_cast<double>(b) / 1024.0);
  else std::snprintf(s, sizeof s, "%.1f MiB", static_cast<double>(b) / 1048576.0);
  return s;
}

/// The data of the pictures that are not per-encoding scores.
void write_curves(const std::filesystem::path& dir) {
  {  // RoPE long-range decay: R(t) 1 . R(0) 1 / D for all-ones q and k, per scaling.
    std::ofstream f(dir / "rope_decay.csv");
    f << "scaling,distance,score\n";
    std::vector<std::int64_t> dist;
    for (int e = 0; e <= 170; ++e) {
      const auto t = static_cast<std::int64_t>(std::llround(std::pow(10.0, e / 34.0)));  // 1 .. 1e5
      if (dist.empty() || t != dist.back()) dist.push_back(t);
    }
    const auto n = static_cast<Index>(dist.size());
    for (zoo::kind k : {zoo::kind::rope, zoo::kind::rope_dynamic, zoo::kind::rope_yarn, zoo::kind::rope_llama3}) {
      posenc::rope_config cfg = zoo::rope_config_of(k, kDim);
      cfg.seq_len = 131072;  // the scaled frequencies of a 128k context (dynamic NTK depends on it)
      const posenc::rope r(cfg);
      std::vector<double> x(static_cast<std::size_t>(n * kDim), 1.0), x0(static_cast<std::size_t>(kDim), 1.0);
      const std::vector<std::int64_t> zero{0};
      r.apply(posenc::bshd(x.data(), 1, n, 1, kDim), posenc::positions_view(dist.data(), 1, n));
      r.apply(posenc::bshd(x0.data(), 1, 1, 1, kDim), posenc::positions_view(zero.data(), 1, 1));
      for (Index i = 0; i < n; ++i) {
        double s = 0;
        for (Index d = 0; d < kDim; ++d) s += x[static_cast<std::size_t>(i * kDim + d)] * x0[static_cast<std::size_t>(d)];
        f << zoo::describe(k).name << ',' << dist[static_cast<std::size_t>(i)] << ',' << s / kDim << '\n';
      }
    }
  }
  {  // ALiBi slopes for a few head counts.
    std::ofstream f(dir / "alibi_slopes.csv");
    f << "heads,head,slope\n";
    for (Index H : {8, 12, 16, 32}) {
      const auto m = posenc::alibi_slopes(H);
      for (Index h = 0; h < H; ++h) f << H << ',' << h << ',' << m[static_cast<std::size_t>(h)] << '\n';
    }
  }
  {  // T5 buckets (bidirectional encoder, unidirectional decoder) and DeBERTa's log buckets.
    std::ofstream f(dir / "buckets.csv");
    f << "relative,t5_encoder,t5_decoder,deberta\n";
    const auto w = zoo::make_weights<float>(zoo::kind::deberta, kHeads, kDim, 1);
    zoo::with_encoding(w, [&](const auto& enc) {
      if constexpr (std::is_same_v<std::decay_t<decltype(enc)>, posenc::deberta_disentangled>) {
        for (std::int64_t r = -1024; r <= 1024; ++r)
          f << r << ',' << posenc::t5_relative_bucket(r, 32, 128, true) << ','
            << posenc::t5_relative_bucket(r, 32, 128, false) << ',' << enc.bucket(r) << '\n';
      }
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path dir = std::filesystem::absolute(argc > 1 ? argv[1] : "demo-output");
  // --quick: time one length only (sanitizer and debug builds, where the kernel runs ~50x slower).
  const bool quick = argc > 2 && std::string(argv[2]) == "--quick";
  const std::vector<Index> lengths = quick ? std::vector<Index>{256} : std::vector<Index>{256, 512, 1024};
  std::filesystem::create_directories(dir);
  bool ok = true;
  Eigen::ThreadPool pool(2);

  std::printf("posenc tour: one attention layer per encoding, batch 1, H = %td, d = %td, float, 2 threads.\n"
              "error: max |fused float - double reference| / max |reference| at L = %td (tolerance %.0e);\n"
              "relative: max |S(i,j) - S(i+t,j+t)| of the position-only scores (t = 1, 7, 32), relative to max |S|.\n\n",
              kHeads, kDim, kCheckLen, kTolerance);
  std::printf("%-15s %-6s %-36s %10s %9s %10s", "encoding", "mask", "parameters", "extra mem", "error", "relative");
  for (Index L : lengths) std::printf("   L=%-5td ms  x none", L);
  std::printf("\n");
  std::fflush(stdout);

  std::ofstream map(dir / "position_scores.csv");
  map << "encoding,head,i,j,score\n";
  std::ofstream table(dir / "table.csv");
  table << "encoding,L,ms,ms_none,over_none,extra_bytes,error,relative_gap\n";
  for (zoo::kind kind : zoo::all) {
    const auto d = zoo::describe(kind);
    std::printf("%-15s %-6s %-36s ", d.name, d.causal ? "causal" : "bidir", d.params);
    std::fflush(stdout);
    const check_result c = check(kind, map);
    const double rel = c.scores_max > 0 ? c.relative_gap / c.scores_max : 0.0;
    const bool absolute = kind == zoo::kind::sinusoidal || kind == zoo::kind::learned || kind == zoo::kind::tupe;
    const bool err_ok = c.error < kTolerance, rel_ok = absolute ? rel > 1e-3 : rel < 1e-9;
    ok &= err_ok && rel_ok;
    std::vector<timing> times;
    for (Index L : lengths) times.push_back(time_call(kind, L, pool));
    std::printf("%10s %9.1e%s %9.1e%s", human_bytes(times.back().extra_bytes).c_str(), c.error, err_ok ? " " : "!", rel,
                rel_ok ? " " : "!");
    for (std::size_t i = 0; i < times.size(); ++i) {
      std::printf("   %9.2f  %5.2f", times[i].ms, times[i].ms / times[i].ms_none);
      table << d.name << ',' << lengths[i] << ',' << times[i].ms << ',' << times[i].ms_none << ','
            << times[i].ms / times[i].ms_none << ',' << times[i].extra_bytes << ',' << c.error << ',' << rel << '\n';
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  std::printf("(extra mem: heap the encoding allocates, held + per call, at L = %td; '!' marks a failed check:"
              " the relative column should be 0 except for sinusoidal, learned and tupe)\n\n",
              lengths.back());

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
  write_curves(dir);
  std::printf(ok ? "demo: all checks passed\n" : "demo: a check FAILED\n");
  std::printf("data for the pictures (tools/plot_demo.py %s): %s\n", dir.c_str(), dir.c_str());
  return ok ? 0 : 1;
}
