// Every encoding side by side per sequence length: one attention layer call (batch 1, H = 8, d = 128,
// BSHD, float) with the encoding configured and masked as its canonical model uses it
// (examples/encoding_zoo.hpp lists them: decoders causal, encoders bidirectional); the input
// encodings include their add_to on q and k.
//
// Rows: encodings/<encoding>/L:<L>/threads:<t>, L = 128 .. 16384, t = 1 (calling thread) or 2
// (Eigen::ThreadPool(2)). The row's time is the encoding's call alone; each iteration also runs the
// same call with no encoding (same mask, same logit scale) right before or after it (bench/pairs.hpp),
// and the counters are:
//   tokens_per_s  L / time of the call
//   GFLOPs        dense attention FLOPs (4 d H per visible pair: q.k and p.v) / time; the same
//                 count for every encoding, so it compares speed, not work
//   over_none     median over the pairs of time(encoding) / time(none): the overhead, measured on
//                 the same machine state (the `none` row gives the noise: a null A/B)
//   weight_bytes  the parameter tensors the caller passes (viewed by the encoding, model weights)
//   held_bytes    heap the encoding object allocates at construction (tables it keeps)
//   bind_bytes    heap the encoding's per-call preparation (bind) holds during a call
//   extra_bytes   held_bytes + bind_bytes
// The heap counts are glibc's mallinfo2 (in use, all arenas, mmapped blocks included) before and after.
// The input encodings write into a copy of q and k each call (add_to works in place); the copy is
// in their time.
//
// Unless --benchmark_min_time is given, rows run for 0.1 s (at least one pair): at L = 16384 a
// bidirectional pair takes about a minute on one core.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "encoding_zoo.hpp"
#include "pairs.hpp"

namespace {

using zoo::Index;
constexpr Index kHeads = 8, kDim = 128, kModel = kHeads * kDim;

/// Dense attention FLOPs of one call: 4 d H per visible (query, key) pair.
double attention_flops(Index L, bool causal) {
  const double pairs = causal ? 0.5 * double(L) * double(L + 1) : double(L) * double(L);
  return 4.0 * double(kDim) * double(kHeads) * pairs;
}

void run(benchmark::State& state, zoo::kind k, Index L, Index threads) {
  const auto n = static_cast<std::size_t>(L * kModel);
  const auto q = zoo::normal<float>(n, 1), kk = zoo::normal<float>(n, 2), v = zoo::normal<float>(n, 3);
  std::vector<float> out(n), qw(n), kw(n);
  const auto pool = threads > 1 ? std::make_unique<Eigen::ThreadPool>(static_cast<int>(threads)) : nullptr;
  const auto w = zoo::make_weights<float>(k, kHeads, kDim, L);
  const auto pos = posenc::contiguous_positions(1, L);

  const std::size_t heap0 = zoo::heap_in_use();
  zoo::with_encoding(w, [&](const auto& enc) {
    using E = std::decay_t<decltype(enc)>;
    const std::size_t held = zoo::heap_in_use() - std::min(heap0, zoo::heap_in_use());
    posenc::attention_options opt = zoo::options(k, enc, L, kDim);
    opt.pool = pool.get();
    const auto Q = posenc::bshd<const float>(q.data(), 1, L, kHeads, kDim);
    const auto K = posenc::bshd<const float>(kk.data(), 1, L, kHeads, kDim);
    const auto V = posenc::bshd<const float>(v.data(), 1, L, kHeads, kDim);
    const auto O = posenc::bshd(out.data(), 1, L, kHeads, kDim);

    const std::size_t bind_bytes = zoo::bind_bytes(
        enc, zoo::call_info_of(L, kHeads, kDim, opt, pos, pos, posenc::scalar_type::float32));

    const auto none = [&] {
      posenc::attention<float>(Q, K, V, O, posenc::no_position{}, opt);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    };
    const auto with = [&] {
      if constexpr (posenc::input_encoding<E>) {
        std::memcpy(qw.data(), q.data(), n * sizeof(float));
        std::memcpy(kw.data(), kk.data(), n * sizeof(float));
        enc.add_to(posenc::tensor_map<float, 3>(qw.data(), 1, L, kModel), posenc::view(pos));
        enc.add_to(posenc::tensor_map<float, 3>(kw.data(), 1, L, kModel), posenc::view(pos));
        posenc::attention<float>(posenc::bshd<const float>(qw.data(), 1, L, kHeads, kDim),
                                 posenc::bshd<const float>(kw.data(), 1, L, kHeads, kDim), V, O,
                                 posenc::no_position{}, opt);
      } else {
        posenc::attention<float>(Q, K, V, O, enc, opt);
      }
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    };
    const auto r = bench_util::run_pairs(state, none, with, bench_util::pair_time::b_only);
    if (r.seconds_b > 0) {
      state.counters["tokens_per_s"] = double(L) * double(r.pairs) / r.seconds_b;
      state.counters["GFLOPs"] = 1e-9 * attention_flops(L, opt.causal) * double(r.pairs) / r.seconds_b;
    }
    state.counters["over_none"] = r.ratio;
    state.counters["weight_bytes"] = double(w.bytes());
    state.counters["held_bytes"] = double(held);
    state.counters["bind_bytes"] = double(bind_bytes);
    state.counters["extra_bytes"] = double(held + bind_bytes);
    state.counters["causal"] = opt.causal ? 1 : 0;
  });
}

/// Reports rows under their registered names: Google Benchmark appends "/manual_time" to the name
/// of a manual-time benchmark, and scripts select rows by `encodings/<encoding>/L:<L>/threads:<t>`.
template <class Base>
class plain_names : public Base {
 public:
  using Base::Base;
  void ReportRuns(const std::vector<benchmark::BenchmarkReporter::Run>& runs) override {
    auto copy = runs;
    for (auto& r : copy) r.run_name.time_type.clear();
    Base::ReportRuns(copy);
  }
};

/// The console and JSON reporters with plain names; null for another format (csv, deprecated in
/// Google Benchmark: its rows keep the "/manual_time" suffix).
std::unique_ptr<benchmark::BenchmarkReporter> make_reporter(const std::string& format) {
  if (format == "json") return std::make_unique<plain_names<benchmark::JSONReporter>>();
  if (format == "console") return std::make_unique<plain_names<benchmark::ConsoleReporter>>();
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  // Registered L-major so that the encodings of one (L, threads) run back to back.
  std::vector<std::string> names;
  for (Index L : {128, 256, 512, 1024, 2048, 4096, 8192, 16384})
    for (Index threads : {1, 2})
      for (zoo::kind k : zoo::all) {
        const std::string name = std::string("encodings/") + zoo::describe(k).name + "/L:" + std::to_string(L) +
                                 "/threads:" + std::to_string(threads);
        names.push_back(name);
        benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) { run(s, k, L, threads); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }

  std::vector<char*> args(argv, argv + argc);
  std::string format = "console", out_format = "json", filter;
  std::vector<std::string> kept;  // rewritten arguments (args points into it)
  kept.reserve(static_cast<std::size_t>(argc));
  bool has_min_time = false, has_out = false, list = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--benchmark_min_time", 0) == 0) has_min_time = true;
    if (a.rfind("--benchmark_format=", 0) == 0) format = a.substr(19);
    if (a.rfind("--benchmark_out_format=", 0) == 0) out_format = a.substr(23);
    if (a.rfind("--benchmark_out=", 0) == 0) has_out = true;
    if (a == "--benchmark_list_tests" || a == "--benchmark_list_tests=true") list = true;
    if (a.rfind("--benchmark_filter=", 0) == 0) {
      // The names Google Benchmark matches end in "/manual_time": a filter anchored at the end of
      // the plain name is anchored before it.
      filter = a.substr(19);
      if (!filter.empty() && filter.back() == '$') {
        kept.push_back("--benchmark_filter=" + filter.substr(0, filter.size() - 1) + "(/manual_time)?$");
        args[static_cast<std::size_t>(i)] = kept.back().data();
      }
    }
  }
  if (list) {  // the plain names (the library's listing would print the suffix)
    const std::regex re(filter.empty() || filter == "all" ? "." : filter);
    for (const auto& name : names)
      if (std::regex_search(name, re)) std::printf("%s\n", name.c_str());
    return 0;
  }
  char min_time[] = "--benchmark_min_time=0.1";
  if (!has_min_time) args.insert(args.begin() + 1, min_time);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  const auto display = make_reporter(format);
  const auto file = has_out ? make_reporter(out_format) : nullptr;
  if (display && (file || !has_out)) benchmark::RunSpecifiedBenchmarks(display.get(), file.get());
  else benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
