// Overhead of the position-bias encodings inside the fused kernel: attention with ALiBi and with T5's
// relative bias vs attention with no encoding, same shapes, same run. H = 8 heads, d = 128, batch 1,
// BSHD, float. Goal: overhead <= 5 % at L >= 1024 (docs/t5.md).
//
// Both biases are formed per tile inside the kernel (ALiBi: slope x distance, one fma per score;
// T5: a contiguous slice of the per-call bias vector, one add per score); neither allocates
// [H, L, L]. The ratio to report is time(encoding) / time(none) of the same L, causal and threads.
// Arguments: L, causal (0/1), threads (1 = calling thread; 2 = Eigen::ThreadPool(2)).
#include <benchmark/benchmark.h>
#include <pmmintrin.h>
#include <xmmintrin.h>

#include <cstdlib>
#include <memory>
#include <posenc/alibi.hpp>
#include <posenc/attention.hpp>
#include <posenc/t5.hpp>
#include <random>
#include <string>
#include <vector>

#include "random.hpp"

namespace {

using Index = posenc::index_t;
constexpr Index kHeads = 8, kDim = 128;

using bench_util::random_vector;

struct inputs {
  Index L;
  std::vector<float> q, k, v, out, t5_table;
  explicit inputs(Index len) : L(len) {
    const auto n = static_cast<std::size_t>(L * kHeads * kDim);
    q = random_vector(n, 1);
    k = random_vector(n, 2);
    v = random_vector(n, 3);
    out.assign(n, 0.f);
    t5_table = random_vector(32 * kHeads, 4);
  }
};

enum class which { none, alibi, t5 };

void BM_attention(benchmark::State& state, which enc_kind) {
  const Index L = state.range(0), threads = state.range(2);
  const bool causal = state.range(1) != 0;
  inputs x(L);
  const auto pool = threads > 1 ? std::make_unique<Eigen::ThreadPool>(static_cast<int>(threads)) : nullptr;
  posenc::attention_options opt{.causal = causal};
  opt.pool = pool.get();
  const auto Q = posenc::bshd<const float>(x.q.data(), 1, L, kHeads, kDim);
  const auto K = posenc::bshd<const float>(x.k.data(), 1, L, kHeads, kDim);
  const auto V = posenc::bshd<const float>(x.v.data(), 1, L, kHeads, kDim);
  const auto O = posenc::bshd(x.out.data(), 1, L, kHeads, kDim);
  const posenc::alibi alibi(
      {.heads = kHeads, .form = causal ? posenc::alibi_form::causal : posenc::alibi_form::symmetric});
  const posenc::t5_relative_bias<float> t5(posenc::tensor_map<const float, 2>(x.t5_table.data(), 32, kHeads),
                                           {.num_buckets = 32, .max_distance = 128, .is_decoder = causal});
  // Same logit scale for all three (T5's own is 1), so only the bias differs.
  opt.scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  for (auto _ : state) {
    switch (enc_kind) {
      case which::none:
        posenc::attention<float>(Q, K, V, O, posenc::no_position{}, opt);
        break;
      case which::alibi:
        posenc::attention<float>(Q, K, V, O, alibi, opt);
        break;
      case which::t5:
        posenc::attention<float>(Q, K, V, O, t5, opt);
        break;
    }
    benchmark::DoNotOptimize(x.out.data());
    benchmark::ClobberMemory();
  }
  const double dense = 4.0 * double(L) * double(L) * double(kDim) * kHeads * double(state.iterations());
  state.counters["GFLOPs"] = benchmark::Counter(dense * 1e-9, benchmark::Counter::kIsRate);
}

}  // namespace

int main(int argc, char** argv) {
  // Registered L-major so the three encodings of one shape run back to back (same machine state).
  struct shape {
    Index L, causal, threads;
  };
  std::vector<shape> shapes;
  for (Index L : {512, 1024, 4096})
    for (Index causal : {1, 0})
      for (Index threads : {1, 2}) shapes.push_back({L, causal, threads});
  shapes.push_back({16384, 1, 1});
  for (const auto& s : shapes) {
    for (auto [name, kind] :
         {std::pair{"none", which::none}, std::pair{"alibi", which::alibi}, std::pair{"t5", which::t5}}) {
      benchmark::RegisterBenchmark((std::string("BM_attention/") + name).c_str(), BM_attention, kind)
          ->Args({s.L, s.causal, s.threads})
          ->ArgNames({"L", "causal", "threads"})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  // POSENC_BENCH_FTZ=1: flush denormals to zero on this thread (diagnostic for the softmax tail,
  // see docs/alibi.md; pool threads are not affected, so use it with threads = 1).
  if (const char* e = std::getenv("POSENC_BENCH_FTZ"); e != nullptr && *e == '1') {
    _MM_SET_FLUSH_ZERO_MODE(_MM_FLUSH_ZERO_ON);
    _MM_SET_DENORMALS_ZERO_MODE(_MM_DENORMALS_ZERO_ON);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
