// Sinusoidal input encoding: bytes/s of x += PE(pos) on [batch, seq, d_model] float, against a
// STREAM-like triad over the same x (x = x + 1.0 * y, y a precomputed [batch, seq, d_model] array:
// the memory-bound ceiling of any "add a row per token" pass), and against the table lookup
// (learned_absolute viewing a precomputed sinusoid table), which is what to use when positions recur.
// Bytes counted: x read + x written (+ y / table rows read for the triad / lookup).
#include <benchmark/benchmark.h>

#include <posenc/learned.hpp>
#include <posenc/sinusoidal.hpp>
#include <vector>

namespace {

using Index = posenc::index_t;
constexpr Index kBatch = 4;

void set_bytes(benchmark::State& state, double bytes_per_iter) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes_per_iter * static_cast<double>(state.iterations())));
}

void BM_sinusoidal_add(benchmark::State& state) {
  const Index S = state.range(0), D = state.range(1);
  std::vector<float> x(static_cast<std::size_t>(kBatch * S * D), 0.f);
  const auto pos = posenc::contiguous_positions(kBatch, S);
  const posenc::sinusoidal pe({.d_model = D});
  for (auto _ : state) {
    pe.add_to(posenc::tensor_map<float, 3>(x.data(), kBatch, S, D), posenc::view(pos));
    benchmark::ClobberMemory();
  }
  set_bytes(state, 2.0 * sizeof(float) * double(x.size()));
}

void BM_table_lookup_add(benchmark::State& state) {
  const Index S = state.range(0), D = state.range(1);
  std::vector<float> x(static_cast<std::size_t>(kBatch * S * D), 0.f);
  const auto pos = posenc::contiguous_positions(kBatch, S);
  const posenc::sinusoidal pe({.d_model = D});
  const posenc::learned_absolute<float> lookup(pe.table<float>(S));  // built once, outside the loop
  for (auto _ : state) {
    lookup.add_to(posenc::tensor_map<float, 3>(x.data(), kBatch, S, D), posenc::view(pos));
    benchmark::ClobberMemory();
  }
  set_bytes(state, 3.0 * sizeof(float) * double(x.size()));
}

void BM_triad(benchmark::State& state) {
  const Index S = state.range(0), D = state.range(1);
  const auto n = static_cast<std::size_t>(kBatch * S * D);
  std::vector<float> x(n, 0.f), y(n, 1.f);
  const float a = 1.0f;
  for (auto _ : state) {
    float* xp = x.data();
    const float* yp = y.data();
    for (std::size_t i = 0; i < n; ++i) xp[i] = xp[i] + a * yp[i];
    benchmark::ClobberMemory();
  }
  set_bytes(state, 3.0 * sizeof(float) * double(n));
}

void shapes(benchmark::internal::Benchmark* b) {
  for (Index S : {512, 2048})
    for (Index D : {512, 1024}) b->Args({S, D});
}

BENCHMARK(BM_sinusoidal_add)->Apply(shapes)->ArgNames({"seq", "d_model"})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_table_lookup_add)->Apply(shapes)->ArgNames({"seq", "d_model"})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_triad)->Apply(shapes)->ArgNames({"seq", "d_model"})->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
