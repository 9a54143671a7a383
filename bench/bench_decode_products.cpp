// bench/bench_decode_products.cpp — the decode step's products against the core's FMA peak.
//
// Each product of detail/decode_kernels.hpp on one 32-key tile of the 8 kv heads (d = 128, f32), as
// the decode step calls it, timed back to back with a loop of as many register-only FMAs in
// independent chains (the peak, fma_peak.hpp): counter of_peak = time(FMA loop) / time(product), the fraction of
// the FMA peak the product runs at, paired so that the VM's drift cancels (pairs.hpp).
//   BM_decode_products/<product>/layout:<l>
//     product  row_dots           S = Q K^T, 4 query rows per kv head (the 1-row GQA 32/8 step),
//                                 keys 4 at a time across the heads (row_dots_across_heads)
//              add_weighted       O += P V, 4 rows, head by head
//              column_dots        S^T = K Q^T, 16 rows per kv head (the 4-row step; with AVX-512
//                                 two dimensions per broadcast, whatever layout q holds)
//              add_weighted_rows  O += P V from P^T, 16 rows, 8 rows x 2 packets at a time (other ISAs,
//                                 f16 / bf16 values, 8 or fewer rows)
//              add_weighted_pairs O += P V from P^T, 16 rows, value pairs broadcast against the weights
//                                 duplicated (AVX-512, f32 values; the pair layout of O)
//     layout   l1    each head's 32 rows adjacent and the same 16 KiB tile for every head: in L1
//              l2    each head's 32 rows adjacent, the heads' tiles one after the other: 128 KiB, in L2
//              bshd  rows 4 KiB apart (8 kv heads x 128 floats a token), the heads' tiles in turn,
//                    as the step reads a cache: 128 KiB, in L2
//              pad   as bshd with every token row 64 bytes longer (a padded cache, docs/kv-cache.md):
//                    the same column of the 32 rows in 32 L1 sets instead of one
// Without the products' prefetch (it is for the next tile from DRAM: bench_read_order). Counters
// MACs_per_ns (the product) and peak_MACs_per_ns (the FMA loop), a packet FMA counting its lanes.
// What the decode step takes beyond these rates is its reads from DRAM and its softmax step
// (docs/decode-measurements.md, Zen 5).
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <cstddef>
#include <string>
#include <vector>

#include "fma_peak.hpp"
#include "pairs.hpp"
#include "posenc/detail/decode_kernels.hpp"

namespace {

using posenc::index_t;
namespace dk = posenc::detail;
constexpr index_t heads = 8, dim = 128, token = heads * dim, padded_token = token + 16, keys = 32;

/// x, opaque to the optimizer: the products get their sizes at run time, as the decode step passes
/// them (constant sizes let g++ 12 unroll and warn about loops the step never compiles).
index_t at_run_time(index_t x) {
  benchmark::DoNotOptimize(x);
  return x;
}

enum class product { row_dots, add_weighted, column_dots, add_weighted_rows, add_weighted_pairs };
enum class layout { l1, l2, bshd, pad };

/// The operands of one tile of the 8 kv heads, and the product run over them.
struct tile {
  product what;
  layout where;
  index_t rows = what == product::row_dots || what == product::add_weighted ? 4 : 16;
  std::vector<float> cache = std::vector<float>(static_cast<std::size_t>(keys * padded_token), 1e-3f);
  std::vector<float> q = std::vector<float>(static_cast<std::size_t>(heads * rows * dim), 1e-2f);
  std::vector<float> scores = std::vector<float>(static_cast<std::size_t>(heads * rows * keys), 1e-2f);
  std::vector<float> out = std::vector<float>(static_cast<std::size_t>(heads * rows * dim), 0.f);

  /// Head h's first row and the row stride: in place in (padded) BSHD, head h's contiguous tile (l2), or
  /// the one contiguous tile (l1).
  [[nodiscard]] bool in_place() const { return where == layout::bshd || where == layout::pad; }
  [[nodiscard]] const float* rows_of(index_t h) const {
    return cache.data() + (in_place() ? h * dim : where == layout::l2 ? h * keys * dim : 0);
  }
  [[nodiscard]] index_t stride() const {
    return where == layout::pad ? padded_token : where == layout::bshd ? token : dim;
  }

  /// MACs of the product over the tile's 8 heads.
  [[nodiscard]] index_t macs() const { return heads * rows * keys * dim; }

  void run() {
    const index_t n = at_run_time(keys), d = at_run_time(dim), hs = at_run_time(heads);
    switch (what) {
      case product::row_dots:
        if (in_place()) {
          dk::row_dots_across_heads<4, dim, dk::to_l2>([&](index_t h) { return q.data() + h * rows * d; }, hs,
                                                       rows_of(0), stride(), d, n, d, scores.data(), rows * n, 0);
        } else {
          for (index_t h = 0; h < hs; ++h)
            dk::row_dots_across_heads<4, dim, dk::to_l2>([&](index_t) { return q.data() + h * rows * d; }, 1,
                                                         rows_of(h), d, d, n, d, scores.data() + h * rows * n, rows * n,
                                                         0);
        }
        break;
      case product::add_weighted:
        for (index_t h = 0; h < hs; ++h)
          dk::add_weighted(scores.data() + h * rows * n, n, rows, rows_of(h), stride(), n, d, out.data() + h * rows * d,
                           d);
        break;
      case product::column_dots:  // Q^T [d x 16] per head in q, S^T [keys x 16] per head
        for (index_t h = 0; h < hs; ++h)
          dk::column_dots(q.data() + h * rows * d, rows, rows, d, rows_of(h), stride(), n, scores.data() + h * rows * n,
                          rows);
        break;
      case product::add_weighted_rows:  // P^T [keys x 16] per head
        for (index_t h = 0; h < hs; ++h)
          dk::add_weighted_rows(scores.data() + h * rows * n, rows, rows, rows_of(h), stride(), n, d,
                                out.data() + h * rows * d, d, static_cast<const float*>(nullptr));
        break;
      case product::add_weighted_pairs:
#if defined(EIGEN_VECTORIZE_AVX512)
        for (index_t h = 0; h < hs; ++h)
          dk::add_weighted_pairs(scores.data() + h * rows * n, rows, rows_of(h), stride(), n, d,
                                 out.data() + h * rows * d, nullptr, 0);
#endif
        break;
    }
    benchmark::DoNotOptimize(scores.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
};

void products(benchmark::State& state, product what, layout where) {
  tile t{what, where};
  constexpr int tiles = 8;  // per timed call: a few microseconds, far above the clock's resolution
  float keep = 0;
  auto kernel = [&] {
    for (int i = 0; i < tiles; ++i) t.run();
  };
  auto peak = [&] {
    keep += bench_util::fma_peak(tiles * t.macs() / bench_util::fma_lanes);
    benchmark::DoNotOptimize(keep);
  };
  kernel();  // first touch outside the timing
  const auto p = bench_util::run_pairs(state, peak, kernel, bench_util::pair_time::b_only);
  const double macs = static_cast<double>(tiles * t.macs() * p.pairs);
  state.counters["of_peak"] = 1.0 / p.ratio;
  state.counters["MACs_per_ns"] = macs / (p.seconds_b * 1e9);
  state.counters["peak_MACs_per_ns"] = macs / (p.seconds_a * 1e9);
}

[[maybe_unused]] const bool registered = [] {
  const std::pair<const char*, product> names[] = {{"row_dots", product::row_dots},
                                                   {"add_weighted", product::add_weighted},
                                                   {"column_dots", product::column_dots},
                                                   {"add_weighted_rows", product::add_weighted_rows},
                                                   {"add_weighted_pairs", product::add_weighted_pairs}};
  for (const auto& [name, what] : names) {
#if !defined(EIGEN_VECTORIZE_AVX512)
    if (what == product::add_weighted_pairs) continue;
#endif
    for (const auto& [lname, where] :
         {std::pair<const char*, layout>{"l1", layout::l1}, {"l2", layout::l2}, {"bshd", layout::bshd},
          {"pad", layout::pad}})
      benchmark::RegisterBenchmark((std::string("BM_decode_products/") + name + "/layout:" + lname).c_str(),
                                   [what = what, where = where](benchmark::State& s) { products(s, what, where); })
          ->Unit(benchmark::kMicrosecond)
          ->UseManualTime()
          ->MinTime(1.0);
  }
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
