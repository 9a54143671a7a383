// Overhead of Transformer-XL relative attention inside the fused kernel: time(Transformer-XL) /
// time(no encoding) of the same shape, measured in back-to-back pairs (bench/pairs.hpp). H = 8,
// d = 64 or 128 (d_model = H d), batch 1, BSHD, float; a segment of L queries over a memory of L / 2
// (k_len = 1.5 L, queries at mlen + i, causal), no clamp_len. Target: <= 1.8x.
//
// Beyond q.k, each tile pays P = Q R_h[distances]^T over its rows + cols - 1 distances, i.e.
// (rows + cols - 1) / cols of its q.k product, plus the gather and u.k; the call pays W_R R for its
// k_len distances in bind. So the tile shape decides most of the overhead: `tiles` 0 runs the
// kernel's default tiles, 1 runs wide tiles (q_block 64, k_block 512). The baseline always runs the
// default tiles.
//
// BM_xl_materialized: the classic implementation (Dai et al.'s official code, HF transfo-xl): per
// head the [q_len, k_len] AC = (q+u) K^T and BD = (q+v) R^T matrices, BD shifted by distance (the
// gather rel_shift amounts to), masked, softmax, P V; counter materialized_over_fused.
// BM_xl_bind: the per-call preparation alone (W_R R and v.r for every distance); `prebound` 1 in
// BM_xl_overhead leaves it out of the timing (an encoding bound once for a stream of equal segments).
#include <benchmark/benchmark.h>

#include <cmath>
#include <limits>
#include <memory>
#include <posenc/attention.hpp>
#include <posenc/transformer_xl.hpp>
#include <string>
#include <vector>

#include "pairs.hpp"
#include "random.hpp"

namespace {

using Index = posenc::index_t;
using row_major = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
constexpr Index kHeads = 8;

struct xl_inputs {
  Index L, mlen, Sk, D, M;
  std::vector<float> q, k, v, out, w, u, rv;
  std::unique_ptr<Eigen::ThreadPool> pool;
  posenc::transformer_xl<float> enc;
  xl_inputs(Index len, Index dim, Index threads)
      : L(len), mlen(len / 2), Sk(len + len / 2), D(dim), M(kHeads * dim),
        q(bench_util::random_vector(static_cast<std::size_t>(L * M), 1)),
        k(bench_util::random_vector(static_cast<std::size_t>(Sk * M), 2)),
        v(bench_util::random_vector(static_cast<std::size_t>(Sk * M), 3)),
        out(static_cast<std::size_t>(L * M)),
        w(scaled(bench_util::random_vector(static_cast<std::size_t>(M * M), 4), 0.05f)),
        u(scaled(bench_util::random_vector(static_cast<std::size_t>(M), 5), 0.3f)),
        rv(scaled(bench_util::random_vector(static_cast<std::size_t>(M), 6), 0.3f)),
        pool(threads > 1 ? std::make_unique<Eigen::ThreadPool>(static_cast<int>(threads)) : nullptr),
        enc(posenc::tensor_map<const float, 2>(w.data(), M, M), posenc::tensor_map<const float, 2>(u.data(), kHeads, D),
            posenc::tensor_map<const float, 2>(rv.data(), kHeads, D),
            {.d_model = M, .n_head = kHeads, .d_head = D, .mem_len = mlen}) {}
  static std::vector<float> scaled(std::vector<float> x, float s) {
    for (auto& e : x) e *= s;
    return x;
  }
  [[nodiscard]] posenc::attention_options options(bool wide) const {
    posenc::attention_options opt = posenc::transformer_xl_options(L, Sk);
    opt.pool = pool.get();
    if (wide) {
      opt.q_block = 64;
      opt.k_block = 512;
    }
    return opt;
  }
  template <class E>
  void run(const E& e, bool wide) {
    posenc::attention<float>(posenc::bshd<const float>(q.data(), 1, L, kHeads, D),
                             posenc::bshd<const float>(k.data(), 1, Sk, kHeads, D),
                             posenc::bshd<const float>(v.data(), 1, Sk, kHeads, D),
                             posenc::bshd(out.data(), 1, L, kHeads, D), e, options(wide));
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }

  /// The classic materialized computation, one head at a time ([q_len, k_len] AC, BD, P per head).
  void run_materialized() {
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    // r_net(pos_emb) for pos_seq = k_len-1 .. 0: [k_len, H*D]
    row_major pos(Sk, M);
    for (Index t = 0; t < Sk; ++t) {
      const auto row = enc.pos_emb(Sk - 1 - t);
      for (Index c = 0; c < M; ++c) pos(t, c) = static_cast<float>(row[static_cast<std::size_t>(c)]);
    }
    const Eigen::Map<const row_major> W(w.data(), M, M);
    const row_major rk = pos * W.transpose();
    row_major ac(L, Sk), bd(L, Sk), qb(L, D);
    const Eigen::OuterStride<> stride(M);
    for (Index h = 0; h < kHeads; ++h) {
      const posenc::const_matrix_map<float> Q(q.data() + h * D, L, D, stride), K(k.data() + h * D, Sk, D, stride),
          V(v.data() + h * D, Sk, D, stride);
      const Eigen::Map<const Eigen::RowVectorXf> uh(u.data() + h * D, D), vh(rv.data() + h * D, D);
      qb = Q.rowwise() + uh;
      ac.noalias() = qb * K.transpose();
      qb = Q.rowwise() + vh;
      bd.noalias() = qb * rk.middleCols(h * D, D).transpose();
      for (Index i = 0; i < L; ++i) {
        float* a = ac.row(i).data();
        const float* b = bd.row(i).data() + (L - 1 - i);  // rel_shift: column j reads j + q_len - 1 - i
        const Index last = mlen + i;
        float mx = -std::numeric_limits<float>::infinity();
        for (Index j = 0; j <= last; ++j) {
          a[j] = (a[j] + b[j]) * scale;
          mx = std::max(mx, a[j]);
        }
        float sum = 0;
        for (Index j = 0; j <= last; ++j) sum += (a[j] = std::exp(a[j] - mx));
        for (Index j = 0; j <= last; ++j) a[j] /= sum;
        for (Index j = last + 1; j < Sk; ++j) a[j] = 0;
      }
      posenc::matrix_map<float>(out.data() + h * D, L, D, stride).noalias() = ac * V;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
};

/// Counter xl_over_none: median of time(Transformer-XL, tiles) / time(no encoding, default tiles).
/// prebound 1: the encoding bound once before the loop (bind_segment), so W_R R is not in the timing.
void BM_xl_overhead(benchmark::State& state) {
  xl_inputs x(state.range(0), state.range(1), state.range(2));
  const bool wide = state.range(3) != 0;
  if (state.range(4) != 0) {
    const auto bound = x.enc.bind_segment(x.L, x.Sk, posenc::scalar_type::float32);
    state.counters["xl_over_none"] = bench_util::median_pair_ratio(
        state, [&] { x.run(posenc::no_position{}, false); }, [&] { x.run(bound, wide); });
    return;
  }
  state.counters["xl_over_none"] = bench_util::median_pair_ratio(
      state, [&] { x.run(posenc::no_position{}, false); }, [&] { x.run(x.enc, wide); });
}

/// Counter materialized_over_fused: median of time(classic materialized) / time(fused, default tiles).
void BM_xl_materialized(benchmark::State& state) {
  xl_inputs x(state.range(0), state.range(1), 1);
  state.counters["materialized_over_fused"] =
      bench_util::median_pair_ratio(state, [&] { x.run(x.enc, false); }, [&] { x.run_materialized(); });
}

/// The per-call preparation alone.
void BM_xl_bind(benchmark::State& state) {
  xl_inputs x(state.range(0), state.range(1), 1);
  posenc::call_info info;
  info.heads = info.kv_heads = kHeads;
  info.head_dim = x.D;
  info.q_min = x.mlen;
  info.q_max = x.mlen + x.L - 1;
  info.k_min = 0;
  info.k_max = x.Sk - 1;
  for (auto _ : state) {
    auto b = x.enc.bind(info);
    benchmark::DoNotOptimize(&b);
  }
}

}  // namespace

BENCHMARK(BM_xl_overhead)
    ->ArgsProduct({{512, 1024, 2048, 4096, 8192}, {64, 128}, {1, 2}, {0, 1}, {0, 1}})
    ->ArgNames({"L", "d", "threads", "wide", "prebound"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_xl_materialized)->Args({4096, 64})->ArgNames({"L", "d"})->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_xl_bind)->ArgsProduct({{512, 2048, 8192}, {64, 128}})->ArgNames({"L", "d"})->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
