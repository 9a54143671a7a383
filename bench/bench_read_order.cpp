// bench/bench_read_order.cpp — the order a decode step reads a BSHD KV cache in, without the kernel.
//
// A loop that reads K and V (Lk tokens x 8 kv heads x 128 floats each) with a fixed number of
// register-only FMAs per packet, so that it does about the decode step's arithmetic per byte
// (8 per 16 floats: 0.18 us per key with the cache in L2 on a Zen 5 VM, the 1-row step 0.19-0.20)
// and nothing else. It separates what the read order costs from what the kernel's own code costs:
//   BM_read_order/Lk:<n>           the decode order (per 32-key tile: keys 4 at a time across the
//                                  kv heads, then the values head by head; detail/attention_decode.hpp)
//                                  against address order (every token's row of all heads in turn),
//                                  back-to-back pairs: counter kernel_over_address
//   BM_read_order_prefetch/Lk:<n>  the decode order with and without the products' prefetch (the
//                                  same line of the row decode_prefetch_rows tokens further, once
//                                  per line): counter prefetch_over_none
// Lk = 64 (512 KiB) keeps the cache in L2; Lk = 32768 (268 MB) reads it from DRAM (docs/decode-measurements.md, Zen 5).
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <cstddef>
#include <vector>

#include "pairs.hpp"
#include "posenc/detail/decode_kernels.hpp"
#include "posenc/detail/prefetch.hpp"

namespace {

using posenc::index_t;
namespace in = Eigen::internal;
using packet = in::packet_traits<float>::type;
constexpr index_t width = in::packet_traits<float>::size;  // (unpacket_traits<packet>: g++ warns of ignored attributes)
constexpr index_t heads = 8, dim = 128, token = heads * dim, tile = 32, sweep = 4;
/// FMAs per packet: 8 per 16 floats, whatever the packet width.
constexpr int fmas = static_cast<int>(8 * width / 16 > 0 ? 8 * width / 16 : 1);

/// Register-only arithmetic on every packet read: 8 independent FMA chains and a running sum.
struct sink {
  packet sum = in::pset1<packet>(0.f), m = in::pset1<packet>(0.99999f);
  packet c[8] = {};

  template <bool prefetch>
  void row(const float* p, index_t tokens_left) {
    for (index_t t = 0; t < dim; t += width) {
      const packet a = in::ploadu<packet>(p + t);
      if constexpr (prefetch)
        if (tokens_left > posenc::detail::decode_prefetch_rows && posenc::detail::starts_line<float>(t))
          posenc::detail::prefetch_past(p + t, posenc::detail::decode_prefetch_rows * token);
      sum = in::padd(sum, a);
      for (int f = 0; f < fmas; ++f) c[f % 8] = in::pmadd(c[f % 8], m, a);
    }
  }
  float result() {
    for (const packet& x : c) sum = in::padd(sum, x);
    return in::predux(sum);
  }
};

template <bool prefetch>
float decode_order(const float* k, const float* v, index_t len) {
  sink s;
  for (index_t t0 = 0; t0 < len; t0 += tile) {
    for (index_t j = 0; j < tile; j += sweep)
      for (index_t h = 0; h < heads; ++h)
        for (index_t i = j; i < j + sweep; ++i) s.row<prefetch>(k + (t0 + i) * token + h * dim, len - t0 - i);
    for (index_t h = 0; h < heads; ++h)
      for (index_t i = 0; i < tile; ++i) s.row<prefetch>(v + (t0 + i) * token + h * dim, len - t0 - i);
  }
  return s.result();
}

float address_order(const float* k, const float* v, index_t len) {
  sink s;
  for (index_t t0 = 0; t0 < len; t0 += tile) {
    for (index_t r = 0; r < tile * heads; ++r) s.row<false>(k + t0 * token + r * dim, 0);
    for (index_t r = 0; r < tile * heads; ++r) s.row<false>(v + t0 * token + r * dim, 0);
  }
  return s.result();
}

using order_fn = float (*)(const float*, const float*, index_t);

/// Times `b` against `a` on one cache (repeated to 32768 keys' worth of work when it is small).
void paired(benchmark::State& state, const char* counter, order_fn a, order_fn b) {
  const index_t len = state.range(0), repeat = len >= 32768 ? 1 : 32768 / len;
  const std::vector<float> k(static_cast<std::size_t>(len * token), 1.f), v(k.size(), 1.f);
  float keep = 0;
  auto run = [&](order_fn f) {
    return [&, f] {
      for (index_t r = 0; r < repeat; ++r) keep += f(k.data(), v.data(), len);
      benchmark::DoNotOptimize(keep);
    };
  };
  run(a)();  // first touch outside the timing
  const auto p = bench_util::run_pairs(state, run(a), run(b));
  const double keys = static_cast<double>(len * repeat * p.pairs);
  state.counters[counter] = p.ratio;
  state.counters["a_us_per_key"] = p.seconds_a * 1e6 / keys;
  state.counters["b_us_per_key"] = p.seconds_b * 1e6 / keys;
}

void BM_read_order(benchmark::State& state) {
  paired(state, "kernel_over_address", address_order, decode_order<false>);
}
void BM_read_order_prefetch(benchmark::State& state) {
  paired(state, "prefetch_over_none", decode_order<false>, decode_order<true>);
}

/// Lk = 64 (in L2) and 32768 (DRAM), paired for at least 2 s.
void read_order_args(benchmark::internal::Benchmark* b) {
  b->Arg(64)->Arg(32768)->ArgName("Lk")->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(2.0);
}
BENCHMARK(BM_read_order)->Apply(read_order_args);
BENCHMARK(BM_read_order_prefetch)->Apply(read_order_args);

}  // namespace

BENCHMARK_MAIN();
