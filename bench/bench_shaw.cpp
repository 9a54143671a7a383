// Shaw et al. (2018) relative keys and values inside the fused kernel (posenc/shaw.hpp).
//
// BM_shaw_overhead: time(attention with Shaw) / time(attention with no encoding), same shapes, from
// back-to-back call pairs (bench/pairs.hpp; counter shaw_over_none). Float, batch 1, H = 8, BSHD,
// shared tables [2k+1, d]. Targets at L = 4096: keys only <= 1.15, keys + values <= 1.35.
// Arguments: L, d, k, values (0: keys only, 1: keys + values), threads (1 = calling thread, 2 =
// Eigen::ThreadPool(2)), causal.
//
// BM_shaw_vs_materialized: the same computation done the way CTranslate2 does it
// (layers/attention.cc, add_relative_representations): gather the table into an [Lq, Lk, d] tensor,
// multiply the queries of each time step by it (a batched product over time), add to the
// materialized [H, Lq, Lk] scores, softmax, P V, then gather the value table into [Lq, Lk, d] and add
// the probabilities of each time step times it. Plain Eigen, one thread. Counter
// materialized_over_fused = time(materialized) / time(fused). Target at L = 4096: >= 5. The relative
// tensor is Lq * Lk * d floats (4 GiB at L = 4096, d = 64); as in CTranslate2 the key tensor is gone
// before the value tensor is made, so one buffer serves both, and only d = 64 is registered at 4096
// (d = 128 would need 8 GiB).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <posenc/attention.hpp>
#include <posenc/shaw.hpp>
#include <string>
#include <vector>

#include "pairs.hpp"
#include "random.hpp"

namespace {

using Index = posenc::index_t;
constexpr Index kHeads = 8;
using bench_util::random_vector;

struct inputs {
  Index L, d, k;
  std::vector<float> q, kk, v, out, wk, wv;
  inputs(Index len, Index dim, Index max_rel) : L(len), d(dim), k(max_rel) {
    const auto n = static_cast<std::size_t>(L * kHeads * d);
    q = random_vector(n, 1);
    kk = random_vector(n, 2);
    v = random_vector(n, 3);
    out.assign(n, 0.f);
    wk = random_vector(static_cast<std::size_t>((2 * k + 1) * d), 4);
    wv = random_vector(static_cast<std::size_t>((2 * k + 1) * d), 5);
  }
  [[nodiscard]] posenc::heads_view<const float> Q() const { return posenc::bshd<const float>(q.data(), 1, L, kHeads, d); }
  [[nodiscard]] posenc::heads_view<const float> K() const { return posenc::bshd<const float>(kk.data(), 1, L, kHeads, d); }
  [[nodiscard]] posenc::heads_view<const float> V() const { return posenc::bshd<const float>(v.data(), 1, L, kHeads, d); }
  [[nodiscard]] posenc::heads_view<float> O() { return posenc::bshd(out.data(), 1, L, kHeads, d); }
  [[nodiscard]] posenc::tensor_map<const float, 2> table(bool keys) const {
    return {(keys ? wk : wv).data(), 2 * k + 1, d};
  }
};

void BM_shaw_overhead(benchmark::State& state) {
  const Index L = state.range(0), d = state.range(1), k = state.range(2), threads = state.range(4);
  const bool values = state.range(3) != 0, causal = state.range(5) != 0;
  inputs x(L, d, k);
  const auto pool = threads > 1 ? std::make_unique<Eigen::ThreadPool>(static_cast<int>(threads)) : nullptr;
  posenc::attention_options opt{.causal = causal};
  opt.pool = pool.get();
  const posenc::shaw_keys<float> keys_only(x.table(true), {.max_relative_position = k});
  const posenc::shaw_relative<float> both(x.table(true), x.table(false), {.max_relative_position = k});
  const auto none = [&] { posenc::attention<float>(x.Q(), x.K(), x.V(), x.O(), posenc::no_position{}, opt); };
  const auto shaw = [&] {
    if (values) posenc::attention<float>(x.Q(), x.K(), x.V(), x.O(), both, opt);
    else posenc::attention<float>(x.Q(), x.K(), x.V(), x.O(), keys_only, opt);
  };
  state.counters["shaw_over_none"] = bench_util::median_pair_ratio(state, none, shaw);
}

/// Shaw attention the CTranslate2 way, with everything materialized (see the file comment).
class materialized {
 public:
  explicit materialized(const inputs& x)
      : x_(x), rel_(static_cast<std::size_t>(x.L * x.L * x.d)), scores_(static_cast<std::size_t>(kHeads * x.L * x.L)) {}

  void run(float* out) {
    using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using cmap = Eigen::Map<const mat, Eigen::Unaligned, Eigen::OuterStride<>>;
    using map = Eigen::Map<mat, Eigen::Unaligned, Eigen::OuterStride<>>;
    const Index L = x_.L, d = x_.d, hd = kHeads * d;
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    // scores[h] = scale Q_h K_h^T
    for (Index h = 0; h < kHeads; ++h) {
      const cmap Qh(x_.q.data() + h * d, L, d, Eigen::OuterStride<>(hd));
      const cmap Kh(x_.kk.data() + h * d, L, d, Eigen::OuterStride<>(hd));
      map(scores_.data() + h * L * L, L, L, Eigen::OuterStride<>(L)).noalias() = (scale * Qh) * Kh.transpose();
    }
    // keys: rel[i, j, :] = a^K[clip(j - i)], then per time step i: scores[:, i, :] += scale Q_i rel_i^T
    gather(x_.wk.data());
    mat step(kHeads, L);
    for (Index i = 0; i < L; ++i) {
      const cmap Qi(x_.q.data() + i * hd, kHeads, d, Eigen::OuterStride<>(d));
      const cmap Ri(rel_.data() + i * L * d, L, d, Eigen::OuterStride<>(d));
      step.noalias() = (scale * Qi) * Ri.transpose();
      map(scores_.data() + i * L, kHeads, L, Eigen::OuterStride<>(L * L)) += step;
    }
    // softmax over each row
    for (Index r = 0; r < kHeads * L; ++r) {
      float* s = scores_.data() + r * L;
      const float m = *std::max_element(s, s + L);
      float sum = 0;
      for (Index j = 0; j < L; ++j) sum += (s[j] = std::exp(s[j] - m));
      const float inv = 1.f / sum;
      for (Index j = 0; j < L; ++j) s[j] *= inv;
    }
    // out_h = P_h V_h
    for (Index h = 0; h < kHeads; ++h) {
      const cmap Vh(x_.v.data() + h * d, L, d, Eigen::OuterStride<>(hd));
      map(out + h * d, L, d, Eigen::OuterStride<>(hd)).noalias() =
          cmap(scores_.data() + h * L * L, L, L, Eigen::OuterStride<>(L)) * Vh;
    }
    // values: rel[i, j, :] = a^V[clip(j - i)], then out[i] += P[:, i, :] rel_i
    gather(x_.wv.data());
    for (Index i = 0; i < L; ++i) {
      const cmap Pi(scores_.data() + i * L, kHeads, L, Eigen::OuterStride<>(L * L));
      const cmap Ri(rel_.data() + i * L * d, L, d, Eigen::OuterStride<>(d));
      map(out + i * hd, kHeads, d, Eigen::OuterStride<>(d)).noalias() += Pi * Ri;
    }
  }

 private:
  void gather(const float* table) {
    const Index L = x_.L, d = x_.d, k = x_.k;
    for (Index i = 0; i < L; ++i)
      for (Index j = 0; j < L; ++j) {
        const Index r = std::clamp<Index>(j - i, -k, k) + k;
        std::copy(table + r * d, table + (r + 1) * d, rel_.data() + (i * L + j) * d);
      }
  }

  const inputs& x_;
  std::vector<float> rel_;     // [Lq, Lk, d]
  std::vector<float> scores_;  // [H, Lq, Lk]
};

void BM_shaw_vs_materialized(benchmark::State& state) {
  const Index L = state.range(0), d = state.range(1), k = state.range(2);
  inputs x(L, d, k);
  materialized m(x);
  std::vector<float> out_m(x.out.size());
  const posenc::shaw_relative<float> both(x.table(true), x.table(false), {.max_relative_position = k});
  const auto fused = [&] { posenc::attention<float>(x.Q(), x.K(), x.V(), x.O(), both, {}); };
  state.counters["materialized_over_fused"] =
      bench_util::median_pair_ratio(state, fused, [&] { m.run(out_m.data()); });
  // The two agree (a wrong materialized baseline would make the ratio meaningless).
  double worst = 0;
  for (std::size_t e = 0; e < out_m.size(); ++e) worst = std::max(worst, double(std::abs(out_m[e] - x.out[e])));
  state.counters["max_abs_diff"] = worst;
}

}  // namespace

int main(int argc, char** argv) {
  // L-major so the rows of one length run close together.
  for (Index L : {512, 1024, 2048, 4096, 8192})
    for (Index d : {64, 128})
      for (Index k : {16, 64})
        for (Index values : {0, 1})
          for (Index threads : {1, 2}) {
            benchmark::RegisterBenchmark("BM_shaw_overhead", BM_shaw_overhead)
                ->Args({L, d, k, values, threads, 0})
                ->ArgNames({"L", "d", "k", "values", "threads", "causal"})
                ->UseManualTime()
                ->Unit(benchmark::kMillisecond);
            if (L == 4096)
              benchmark::RegisterBenchmark("BM_shaw_overhead", BM_shaw_overhead)
                  ->Args({L, d, k, values, threads, 1})
                  ->ArgNames({"L", "d", "k", "values", "threads", "causal"})
                  ->UseManualTime()
                  ->Unit(benchmark::kMillisecond);
          }
  for (Index L : {1024, 2048, 4096})
    for (Index d : {64, 128}) {
      if (L == 4096 && d == 128) continue;  // 8 GiB relative tensor
      benchmark::RegisterBenchmark("BM_shaw_vs_materialized", BM_shaw_vs_materialized)
          ->Args({L, d, 16})
          ->ArgNames({"L", "d", "k"})
          ->UseManualTime()
          ->Iterations(L >= 4096 ? 3 : 5)
          ->Unit(benchmark::kMillisecond);
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
