// bench/bench_rope.cpp — RoPE apply throughput against a STREAM-style triad in the same binary, and
// the cost of RoPE inside the fused attention kernel.
//
// Bytes counted (counter `bytes_per_second`): apply reads and writes x once (2 x S*H*D*4 bytes, in
// place or out of place alike: out of place reads in and writes out), plus one pass over the cos/sin
// table when one is used; the triad a = b + s c moves 3 arrays of the same element count as x.
// Counter `s_per_elem` is seconds per element of x (printed with SI prefixes: 180p = 0.18 ns).
// Compare ratios from one run: apply bytes/s over triad bytes/s at the same S, and apply against
// BM_rope_ggml_style (ggml's CPU rope algorithm) at the same S (docs/rope.md).
// RoPE's cost inside attention: BM_attention (separate rows with and without RoPE) and
// BM_attention_rope_overhead (counter rope_over_none: median ratio of back-to-back call pairs).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/rope.hpp"
#include "pairs.hpp"

namespace {

constexpr posenc::index_t H = 32, D = 128;

/// Uniform values in [-1, 1) from a xorshift generator (setup of 512 MB tensors must stay cheap).
std::vector<float> random_floats(std::size_t n, unsigned seed) {
  std::uint64_t s = 0x9E3779B97F4A7C15ull * (seed + 1);
  std::vector<float> v(n);
  for (auto& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = static_cast<float>(static_cast<double>(s >> 11) * 0x1.0p-52 - 1.0);
  }
  return v;
}

void set_counters(benchmark::State& state, double elements, double bytes_per_iter) {
  state.counters["bytes_per_second"] =
      benchmark::Counter(bytes_per_iter, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  state.counters["s_per_elem"] =
      benchmark::Counter(elements, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

/// STREAM triad a[i] = b[i] + s * c[i] over S*H*D floats per array.
void BM_triad(benchmark::State& state) {
  const auto S = state.range(0);
  const std::size_t n = static_cast<std::size_t>(S * H * D);
  std::vector<float> a(n, 0.f), b = random_floats(n, 1), c = random_floats(n, 2);
  const float s = 1.0001f;
  for (auto _ : state) {
    float* __restrict pa = a.data();
    const float* __restrict pb = b.data();
    const float* __restrict pc = c.data();
    for (std::size_t i = 0; i < n; ++i) pa[i] = pb[i] + s * pc[i];
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, static_cast<double>(n), 3.0 * static_cast<double>(n) * sizeof(float));
}

/// args: S, layout (0 half, 1 interleaved), in place (1) / out of place (0), table (1) / none (0).
void BM_rope_apply(benchmark::State& state) {
  const auto S = state.range(0);
  const auto layout = state.range(1) ? posenc::rope_layout::interleaved : posenc::rope_layout::half;
  const bool inplace = state.range(2) != 0, with_table = state.range(3) != 0;
  const posenc::rope r(posenc::rope_config{.head_dim = D, .rope_theta = 5e5, .layout = layout});
  const posenc::rope_frequencies f = r.at(0);
  const std::size_t n = static_cast<std::size_t>(S * H * D);
  std::vector<float> x = random_floats(n, 3), out(inplace ? 0 : n);
  const posenc::positions pos = posenc::contiguous_positions(1, S);
  std::optional<posenc::rope_table<float>> table;
  if (with_table) table.emplace(f.table<float>(0, S));
  const auto xv = posenc::bshd(x.data(), 1, S, H, D);
  for (auto _ : state) {
    if (inplace) {
      if (with_table) f.apply(xv, posenc::view(pos), *table);
      else f.apply(xv, posenc::view(pos));
    } else {
      const auto ov = posenc::bshd(out.data(), 1, S, H, D);
      if (with_table) f.apply(posenc::heads_view<const float>(xv), ov, posenc::view(pos), *table);
      else f.apply(posenc::heads_view<const float>(xv), ov, posenc::view(pos));
    }
    benchmark::DoNotOptimize(x.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double table_bytes = with_table ? static_cast<double>(table->bytes()) : 0.0;
  set_counters(state, static_cast<double>(n), 2.0 * static_cast<double>(n) * sizeof(float) + table_bytes);
}

/// Baseline in the same binary: ggml's CPU rope algorithm (ggml-cpu `ggml_compute_forward_rope`,
/// re-implemented from its description, default scaling, one thread). Per token it fills a cache of
/// cos/sin for every pair from theta = p, multiplied by theta_scale = base^(-2/d) after each pair, in
/// float with cosf/sinf, then rotates every head out of place into dst: normal mode pairs (2i, 2i+1)
/// (our `interleaved`), NeoX mode pairs (i, i + d/2) (our `half`). It recomputes the trig on every
/// call; ours reads a table built once. args: S, layout (0 NeoX / half, 1 normal / interleaved).
void BM_rope_ggml_style(benchmark::State& state) {
  const auto S = state.range(0);
  const bool normal = state.range(1) != 0;
  const std::size_t n = static_cast<std::size_t>(S * H * D);
  const std::vector<float> x = random_floats(n, 3);
  std::vector<float> dst(n), cache(static_cast<std::size_t>(D));
  const float theta_scale = std::pow(5e5f, -2.0f / static_cast<float>(D));
  for (auto _ : state) {
    for (posenc::index_t s = 0; s < S; ++s) {
      float theta = static_cast<float>(s);
      for (posenc::index_t i = 0; i < D; i += 2) {
        cache[static_cast<std::size_t>(i)] = std::cos(theta);
        cache[static_cast<std::size_t>(i + 1)] = std::sin(theta);
        theta *= theta_scale;
      }
      for (posenc::index_t h = 0; h < H; ++h) {
        const float* src = x.data() + (s * H + h) * D;
        float* out = dst.data() + (s * H + h) * D;
        for (posenc::index_t i = 0; i < D; i += 2) {
          const float c = cache[static_cast<std::size_t>(i)], sn = cache[static_cast<std::size_t>(i + 1)];
          const posenc::index_t a = normal ? i : i / 2, b = normal ? i + 1 : i / 2 + D / 2;
          const float x0 = src[a], x1 = src[b];
          out[a] = x0 * c - x1 * sn;
          out[b] = x0 * sn + x1 * c;
        }
      }
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, static_cast<double>(n), 2.0 * static_cast<double>(n) * sizeof(float));
}

/// Building a table: cos/sin pairs per second (counter pairs_per_second).
void BM_rope_table_build(benchmark::State& state) {
  const auto S = state.range(0);
  const posenc::rope r(posenc::rope_config{.head_dim = D, .rope_theta = 5e5});
  for (auto _ : state) {
    auto t = r.table<float>(0, S);
    benchmark::DoNotOptimize(t);
  }
  state.counters["pairs_per_second"] =
      benchmark::Counter(static_cast<double>(S * D / 2), benchmark::Counter::kIsIterationInvariantRate);
}

/// Attention (float, one thread, causal, H = 8, d = 128) with RoPE fused (either layout) vs without an
/// encoding.
struct attention_inputs {
  static constexpr posenc::index_t heads = 8;
  explicit attention_inputs(posenc::index_t L, bool interleaved = false)
      : r(posenc::rope_config{.head_dim = D, .rope_theta = 5e5,
                              .layout = interleaved ? posenc::rope_layout::interleaved : posenc::rope_layout::half}),
        n(static_cast<std::size_t>(L * heads * D)), q(random_floats(n, 4)), k(random_floats(n, 5)),
        v(random_floats(n, 6)), out(n), qv(posenc::bshd<const float>(q.data(), 1, L, heads, D)),
        kv(posenc::bshd<const float>(k.data(), 1, L, heads, D)), vv(posenc::bshd<const float>(v.data(), 1, L, heads, D)),
        ov(posenc::bshd(out.data(), 1, L, heads, D)) {
    opt.causal = true;
  }
  void run(bool with_rope) {
    if (with_rope) posenc::attention(qv, kv, vv, ov, r, opt);
    else posenc::attention(qv, kv, vv, ov, posenc::no_position{}, opt);
    benchmark::DoNotOptimize(out.data());
  }
  posenc::rope r;
  std::size_t n;
  std::vector<float> q, k, v, out;
  posenc::heads_view<const float> qv, kv, vv;
  posenc::heads_view<float> ov;
  posenc::attention_options opt;
};

void BM_attention(benchmark::State& state) {
  attention_inputs x(state.range(0));
  const bool with_rope = state.range(1) != 0;
  for (auto _ : state) x.run(with_rope);
}

/// RoPE's overhead in attention from back-to-back call pairs (bench/pairs.hpp): counter
/// rope_over_none, the median of time(with RoPE) / time(without).
void BM_attention_rope_overhead(benchmark::State& state) {
  attention_inputs x(state.range(0), state.range(1) != 0);
  state.counters["rope_over_none"] = bench_util::median_pair_ratio(state, [&] { x.run(false); }, [&] { x.run(true); });
}

void apply_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t S : {128, 1024, 8192, 32768})
    for (int layout : {0, 1})
      for (int inplace : {1, 0})
        for (int table : {1, 0}) b->Args({S, layout, inplace, table});
  b->ArgNames({"S", "interleaved", "inplace", "table"});
}

}  // namespace

BENCHMARK(BM_triad)->Arg(128)->Arg(1024)->Arg(8192)->Arg(32768)->ArgName("S");
BENCHMARK(BM_rope_apply)->Apply(apply_args);
BENCHMARK(BM_rope_ggml_style)->ArgsProduct({{128, 1024, 8192, 32768}, {0, 1}})->ArgNames({"S", "interleaved"});
BENCHMARK(BM_rope_table_build)->Arg(8192)->ArgName("S");
BENCHMARK(BM_attention)->ArgsProduct({{1024, 2048, 4096}, {0, 1}})->ArgNames({"L", "rope"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_attention_rope_overhead)->ArgsProduct({{1024, 2048, 4096}, {0, 1}})->ArgNames({"L", "interleaved"})
    ->UseManualTime()->MinTime(10.0)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
