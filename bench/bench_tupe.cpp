// TUPE's overhead in the fused kernel: attention with TUPE (untied absolute term, [CLS] reset, with or
// without the T5-bucketed relative bias) vs attention with no encoding, same shapes and the same logit
// scale 1/sqrt(2d), timed in back-to-back call pairs (bench/pairs.hpp): counter tupe_over_none is the
// median of time(TUPE) / time(none). Encoder self-attention (not causal), H = 12, d = 64 (BERT-base,
// the paper's setting), batch 1, BSHD, float.
//
// The untied term is a second q.k-sized product per tile (Pq[q_pos] Pk[k_pos]^T over the tile's
// positions), so the floor is about 1 + (q.k product) / (whole attention) ~ 1.5x; the target is
// <= 1.6x at L = 4096 with the relative bias.
// Arguments: L, threads (1 = calling thread; 2 = Eigen::ThreadPool(2)), relative bias (0/1).
#include <benchmark/benchmark.h>

#include <cmath>
#include <memory>
#include <posenc/attention.hpp>
#include <posenc/tupe.hpp>
#include <unsupported/Eigen/CXX11/ThreadPool>
#include <vector>

#include "pairs.hpp"
#include "random.hpp"

namespace {

using Index = posenc::index_t;
constexpr Index kHeads = 12, kDim = 64, kModel = kHeads * kDim;

using bench_util::random_vector;

posenc::tupe make_tupe(Index L, bool relative) {
  auto scaled = [](std::vector<float> v, float s) {
    for (auto& e : v) e *= s;
    return v;
  };
  const auto pos = random_vector(static_cast<std::size_t>(L * kModel), 10);
  const auto uq = scaled(random_vector(static_cast<std::size_t>(kModel * kModel), 11), 0.03f);
  const auto uk = scaled(random_vector(static_cast<std::size_t>(kModel * kModel), 12), 0.03f);
  const auto bq = random_vector(static_cast<std::size_t>(kModel), 13);
  const auto bk = random_vector(static_cast<std::size_t>(kModel), 14);
  const auto theta = random_vector(static_cast<std::size_t>(2 * kHeads), 15);
  const auto rel = random_vector(static_cast<std::size_t>(33 * kHeads), 16);
  posenc::tupe_weights<float> w{.pos_emb = {pos.data(), L, kModel},
                                .pos_q_weight = {uq.data(), kModel, kModel},
                                .pos_q_bias = {bq.data(), kModel},
                                .pos_k_weight = {uk.data(), kModel, kModel},
                                .pos_k_bias = {bk.data(), kModel}};
  w.theta_cls_to_others.emplace(theta.data(), kHeads);
  w.theta_others_to_cls.emplace(theta.data() + kHeads, kHeads);
  if (relative) w.relative_attention_bias.emplace(rel.data(), 33, kHeads);
  return posenc::tupe(w, {.num_attention_heads = kHeads});
}

void BM_tupe_overhead(benchmark::State& state) {
  const Index L = state.range(0), threads = state.range(1);
  const bool relative = state.range(2) != 0;
  const auto n = static_cast<std::size_t>(L * kHeads * kDim);
  const auto q = random_vector(n, 1), k = random_vector(n, 2), v = random_vector(n, 3);
  std::vector<float> out(n);
  const auto pool = threads > 1 ? std::make_unique<Eigen::ThreadPool>(static_cast<int>(threads)) : nullptr;
  posenc::attention_options opt;
  opt.pool = pool.get();
  opt.scale = posenc::tupe::logit_scale(kDim);  // the same for both sides: only the encoding differs
  const posenc::tupe enc = make_tupe(L, relative);
  const auto Q = posenc::bshd(q.data(), 1, L, kHeads, kDim), K = posenc::bshd(k.data(), 1, L, kHeads, kDim),
             V = posenc::bshd(v.data(), 1, L, kHeads, kDim);
  const auto O = posenc::bshd(out.data(), 1, L, kHeads, kDim);
  auto none = [&] {
    posenc::attention<float>(Q, K, V, O, posenc::no_position{}, opt);
    benchmark::DoNotOptimize(out.data());
  };
  auto tupe = [&] {
    posenc::attention<float>(Q, K, V, O, enc, opt);
    benchmark::DoNotOptimize(out.data());
  };
  state.counters["tupe_over_none"] = bench_util::median_pair_ratio(state, none, tupe);
}

}  // namespace

BENCHMARK(BM_tupe_overhead)
    ->ArgsProduct({{512, 2048, 4096}, {1, 2}, {1, 0}})
    ->ArgNames({"L", "threads", "relative"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
