// Fused attention kernel vs the practical peak (a plain Eigen GEMM of the Q K^T shape) and a naive
// materialized attention, H = 8 heads, batch 1, BSHD, float.
//
// Counters (per second, in GFLOP/s):
//   GFLOPs        dense count 4 * Lq * Lk * d per head (Q K^T and P V), also for causal runs, so a
//                 causal run that skips the upper triangle shows about twice the dense rate;
//   useful_GFLOPs the causal-useful count 4 * d * L (L + 1) / 2 per head (= GFLOPs when not causal);
//   GEMM runs count 2 * L * L * d per head (the one product they do).
// Arguments: L, d, causal (0/1), threads (1 = the calling thread, no pool; 2 = Eigen::ThreadPool(2)).
// BM_fused_vs_naive times the two back to back (counter naive_over_fused, the median ratio of pairs).
// BM_sliding_window/L/W/d/threads times a causal call with sliding window W against the same call
// fully causal, back to back (counter window_over_causal; target <= 0.5 at L = 16384, W = 4096).
// Speed targets live here and in docs/performance.md, never in unit tests.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <posenc/attention.hpp>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fma_peak.hpp"
#include "pairs.hpp"
#include "polling_pool.hpp"
#include "random.hpp"

namespace {

using Index = posenc::index_t;
constexpr Index kHeads = 8;

using bench_util::median_over;
using bench_util::random_vector;
using bench_util::run_turns;

struct inputs {
  Index L, d;
  std::vector<float> q, k, v, out;
  inputs(Index len, Index dim) : L(len), d(dim) {
    const auto n = static_cast<std::size_t>(L * kHeads * d);
    q = random_vector(n, 1);
    k = random_vector(n, 2);
    v = random_vector(n, 3);
    out.assign(n, 0.f);
  }
  [[nodiscard]] posenc::heads_view<const float> Q() const { return posenc::bshd<const float>(q.data(), 1, L, kHeads, d); }
  [[nodiscard]] posenc::heads_view<const float> K() const { return posenc::bshd<const float>(k.data(), 1, L, kHeads, d); }
  [[nodiscard]] posenc::heads_view<const float> V() const { return posenc::bshd<const float>(v.data(), 1, L, kHeads, d); }
};

void set_counters(benchmark::State& state, Index L, Index d, bool causal, double flops_per_head_dense) {
  const double iters = static_cast<double>(state.iterations());
  const double dense = flops_per_head_dense * kHeads * iters;
  const double useful = causal ? dense * (static_cast<double>(L) + 1) / (2.0 * static_cast<double>(L)) : dense;
  state.counters["GFLOPs"] = benchmark::Counter(dense * 1e-9, benchmark::Counter::kIsRate);
  state.counters["useful_GFLOPs"] = benchmark::Counter(useful * 1e-9, benchmark::Counter::kIsRate);
  (void)d;
}

std::unique_ptr<Eigen::ThreadPool> make_pool(Index threads) {
  return threads > 1 ? std::make_unique<Eigen::ThreadPool>(static_cast<int>(threads)) : nullptr;
}

/// A row's arguments (L, d, causal, threads), its inputs and its pool.
struct bench_case {
  explicit bench_case(const benchmark::State& state)
      : L(state.range(0)), d(state.range(1)), threads(state.range(3)), causal(state.range(2) != 0), x(L, d),
        pool(make_pool(threads)) {}
  Index L, d, threads;
  bool causal;
  inputs x;
  std::unique_ptr<Eigen::ThreadPool> pool;
};

void BM_fused(benchmark::State& state) {
  bench_case c(state);
  const Index L = c.L, d = c.d;
  const bool causal = c.causal;
  inputs& x = c.x;
  const auto& pool = c.pool;
  posenc::attention_options opt;
  opt.causal = causal;
  opt.pool = pool.get();
  // Tile sizes for tuning runs (POSENC_Q_BLOCK / POSENC_K_BLOCK); unset = the kernel's defaults.
  if (const char* e = std::getenv("POSENC_Q_BLOCK")) opt.q_block = std::atol(e);
  if (const char* e = std::getenv("POSENC_K_BLOCK")) opt.k_block = std::atol(e);
  for (auto _ : state) {
    posenc::attention<float>(x.Q(), x.K(), x.V(), posenc::bshd(x.out.data(), 1, L, kHeads, d), posenc::no_position{},
                             opt);
    benchmark::DoNotOptimize(x.out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, L, d, causal, 4.0 * static_cast<double>(L) * static_cast<double>(L) * static_cast<double>(d));
}

// Decode against a KV cache: `rows` new queries per head (positions Lk - rows .. Lk - 1, causal) over
// Lk cached keys, GQA 32 query heads / 8 kv heads, d = 128, K/V stored as f32, f16 or bf16 (BSHD, as
// a runtime appends them). Rows 1 and 4 take the decode strategy (4 and 16 rows per kv head), 16
// the tiled one (64 rows per kv head).
// Counters: KV_GBps, the K/V bytes one call reads over its time; triad_GBps, a STREAM triad
// (a = b + s c) moving the same number of bytes on the same threads, measured in the same row right
// before and after the timed loop (the better of the two); of_triad = KV_GBps / triad_GBps (1 = the
// call runs at the memory speed of this machine); read_GBps, a plain read of the cache itself
// (cache_reader, split over the same threads, measured like the triad) and of_read = KV_GBps /
// read_GBps: what a reader of those bytes gets without arithmetic (from DRAM on a Zen 5 VM: 0.95-1.0x
// the triad on one core); GFLOPs as 4 rows Lk d per query head. BM_decode_floor measures the two
// ratios in turns with the step instead (below).
/// Seconds of one run of part(t, parts) on each of the pool's threads (t < parts), the caller waiting.
template <class Part>
double run_parts(Eigen::ThreadPool* pool, Part&& part) {
  const int parts = pool != nullptr ? pool->NumThreads() : 1;
  const auto t0 = std::chrono::steady_clock::now();
  if (pool == nullptr) {
    part(0, 1);
  } else {
    Eigen::Barrier done(static_cast<unsigned>(parts));
    for (int t = 0; t < parts; ++t)
      pool->Schedule([&, t] {
        part(t, parts);
        done.Notify();
      });
    done.Wait();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The best of 5 runs of part(t, parts) on each of the pool's threads, as `bytes` per second.
template <class Part>
double best_rate(std::size_t bytes, Eigen::ThreadPool* pool, Part part) {
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) best = std::max(best, static_cast<double>(bytes) / run_parts(pool, part));
  return best;
}

/// [lo, hi) of part t of n items split in `parts`.
std::pair<std::size_t, std::size_t> part_range(std::size_t n, int t, int parts) {
  return {n * static_cast<std::size_t>(t) / static_cast<std::size_t>(parts),
          n * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(parts)};
}

/// A STREAM triad a = b + s c over three arrays of `bytes` / 3 together, split over the pool's threads.
struct triad_arrays {
  std::vector<float> a, b, c;
  explicit triad_arrays(std::size_t bytes)
      : a(bytes / (3 * sizeof(float)), 0.f), b(random_vector(a.size(), 7)), c(random_vector(a.size(), 8)) {}
  [[nodiscard]] std::size_t bytes() const { return 3 * a.size() * sizeof(float); }
  /// A run's seconds `s` scaled to `n` bytes moved (the arrays hold about as many as they are made for).
  [[nodiscard]] double seconds_for(double n, double s) const { return s * n / static_cast<double>(bytes()); }
  void operator()(int t, int parts) {
    const auto [lo, hi] = part_range(a.size(), t, parts);
    float* __restrict pa = a.data();
    const float* __restrict pb = b.data();
    const float* __restrict pc = c.data();
    for (std::size_t i = lo; i < hi; ++i) pa[i] = pb[i] + 1.0001f * pc[i];
    benchmark::DoNotOptimize(pa);
  }
};

/// Bytes per second of a triad over `bytes` (three arrays), split over the pool's threads.
double triad_rate(std::size_t bytes, Eigen::ThreadPool* pool) {
  triad_arrays x(bytes);
  return best_rate(x.bytes(), pool, std::ref(x));
}

/// A plain read of the arrays x, split over the pool's threads: a wrapping sum of their 64-bit words
/// (integer adds: no bit pattern costs more than another), each thread's part read as 4 interleaved
/// streams, each 64-byte line prefetching into L1 the line 4 KiB further. The fastest of the readers
/// tried on a Zen 5 VM (268 MB from DRAM, one core, fraction of the triad's rate in the same run):
/// 1 stream without prefetch 0.66-0.68, with it 0.75-0.80 (0.71-0.74 into L2), 2 / 8 streams
/// 0.65-0.81, 4 streams 0.82-0.85.
template <class E>
struct cache_reader {
  std::vector<const std::vector<E>*> x;
  std::vector<std::uint64_t> sums;  // one slot per part: no two threads write the same
  cache_reader(std::vector<const std::vector<E>*> arrays, Eigen::ThreadPool* pool)
      : x(std::move(arrays)), sums(static_cast<std::size_t>(pool != nullptr ? pool->NumThreads() : 1), 0) {}
  [[nodiscard]] std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto* a : x) n += a->size() * sizeof(E);
    return n;
  }
  void operator()(int t, int parts) {
    constexpr std::size_t words = 64 / sizeof(std::uint64_t), ahead = 4096, streams = 4;
    std::uint64_t sum = 0;
    auto line = [&](const unsigned char* p) {
      __builtin_prefetch(p + ahead, 0, 3);
      std::uint64_t w[words];
      std::memcpy(w, p, sizeof(w));
      for (std::size_t j = 0; j < words; ++j) sum += w[j];
    };
    for (const auto* a : x) {
      const auto* base = reinterpret_cast<const unsigned char*>(a->data());
      const auto [lo, hi] = part_range(a->size() * sizeof(E) / 64, t, parts);
      const std::size_t each = (hi - lo) / streams;
      for (std::size_t i = 0; i < each; ++i)
        for (std::size_t s = 0; s < streams; ++s) line(base + (lo + s * each + i) * 64);
      for (std::size_t i = lo + streams * each; i < hi; ++i) line(base + i * 64);
    }
    sums[static_cast<std::size_t>(t)] = sum;
    benchmark::DoNotOptimize(sums.data());
  }
};

/// Bytes per second of cache_reader over the arrays x.
template <class E>
double read_rate(const std::vector<const std::vector<E>*>& x, Eigen::ThreadPool* pool) {
  cache_reader<E> r(x, pool);
  return best_rate(r.bytes(), pool, std::ref(r));
}

template <class KV>
std::vector<KV> stored_as(const std::vector<float>& x) {
  std::vector<KV> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<KV>(x[i]);
  return out;
}

template <class KV>
void decode_rows(benchmark::State& state) {
  const Index rows = state.range(0), Lk = state.range(1), threads = state.range(2);
  constexpr Index H = 32, Hkv = 8, d = 128;
  const auto q = random_vector(static_cast<std::size_t>(rows * H * d), 1);
  const auto k = stored_as<KV>(random_vector(static_cast<std::size_t>(Lk * Hkv * d), 2));
  const auto v = stored_as<KV>(random_vector(static_cast<std::size_t>(Lk * Hkv * d), 3));
  std::vector<float> out(q.size());
  const auto pool = make_pool(threads);
  posenc::attention_options opt;
  opt.causal = true;
  opt.q_offset = Lk - rows;
  opt.pool = pool.get();
  // Strategy for A/B runs (POSENC_PATH=tiled|decode); unset = automatic.
  if (const char* e = std::getenv("POSENC_PATH"))
    opt.path = std::string(e) == "tiled" ? posenc::attention_path::tiled : posenc::attention_path::decode;
  const std::size_t kv_bytes = 2 * k.size() * sizeof(KV);
  auto step = [&] {
    posenc::attention<float>(posenc::bshd<const float>(q.data(), 1, rows, H, d),
                             posenc::bshd<const KV>(k.data(), 1, Lk, Hkv, d),
                             posenc::bshd<const KV>(v.data(), 1, Lk, Hkv, d), posenc::bshd(out.data(), 1, rows, H, d),
                             posenc::no_position{}, opt);
  };
  double triad = triad_rate(kv_bytes, pool.get());
  double read = read_rate<KV>({&k, &v}, pool.get());
  // One untimed call: on the VMs measured, the first read of the cache after the triad's arrays were
  // freed cost up to 10x a steady call (300 ms against 25 ms at Lk = 32768, f32; a plain read of the
  // cache pays it too), and a decode step is what a runtime repeats.
  step();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    step();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  triad = std::max(triad, triad_rate(kv_bytes, pool.get()));
  read = std::max(read, read_rate<KV>({&k, &v}, pool.get()));
  const double iters = static_cast<double>(state.iterations());
  state.counters["GFLOPs"] =
      benchmark::Counter(4.0 * static_cast<double>(rows * Lk * d * H) * 1e-9 * iters, benchmark::Counter::kIsRate);
  state.counters["KV_GBps"] = benchmark::Counter(static_cast<double>(kv_bytes) * 1e-9 * iters, benchmark::Counter::kIsRate);
  state.counters["triad_GBps"] = triad * 1e-9;
  state.counters["of_triad"] = static_cast<double>(kv_bytes) * iters / sec / triad;
  state.counters["read_GBps"] = read * 1e-9;
  state.counters["of_read"] = static_cast<double>(kv_bytes) * iters / sec / read;
}

/// A [tokens, kv_heads x d] cache copied into rows `pad_bytes` longer (the padding zero), and the
/// view of it: rows exactly 4 KiB apart (f32, 8 kv heads of 128) put the same column of every row in
/// one L1 set, which costs the value products (docs/decode-measurements.md, Zen 5). With `order` BHSD the
/// same values as [kv_heads, tokens, d] (a Hugging Face cache's layout; pad_bytes unused).
template <class KV>
struct decode_cache {
  std::vector<KV> data;
  Index tokens, heads, dim, stride;
  posenc::layout order;
  decode_cache(const std::vector<KV>& dense, Index tokens_, Index heads_, Index dim_, Index pad_bytes,
               posenc::layout order_ = posenc::layout::bshd)
      : tokens(tokens_), heads(heads_), dim(dim_),
        stride(heads_ * dim_ + pad_bytes / static_cast<Index>(sizeof(KV))), order(order_) {
    if (order == posenc::layout::bhsd) {
      data.resize(dense.size());
      for (Index t = 0; t < tokens; ++t)
        for (Index h = 0; h < heads; ++h)
          std::copy_n(dense.begin() + (t * heads + h) * dim, dim, data.begin() + (h * tokens + t) * dim);
      return;
    }
    data.assign(static_cast<std::size_t>(tokens * stride), KV(0));
    for (Index t = 0; t < tokens; ++t)
      std::copy_n(dense.begin() + t * heads * dim, heads * dim, data.begin() + t * stride);
  }
  [[nodiscard]] posenc::heads_view<const KV> view() const {
    if (order == posenc::layout::bhsd) return posenc::bhsd<const KV>(data.data(), 1, heads, tokens, dim);
    return posenc::strided(data.data(), 1, tokens, heads, dim, {.batch = tokens * stride, .token = stride, .head = dim});
  }
};

/// A causal call of `rows` new query rows for each of `heads` query heads against k and v, the queries
/// after the first `q_end` - `rows` keys; `opt` gives the options besides causal and q_offset.
template <class KV>
void causal_step(const std::vector<float>& q, Index rows, Index heads, posenc::heads_view<const KV> k,
                 posenc::heads_view<const KV> v, std::vector<float>& out, Index q_end, posenc::attention_options opt) {
  const Index d = k.dim();
  opt.causal = true;
  opt.q_offset = q_end - rows;
  posenc::attention<float>(posenc::bshd<const float>(q.data(), 1, rows, heads, d), k, v,
                           posenc::bshd(out.data(), 1, rows, heads, d), posenc::no_position{}, opt);
  benchmark::DoNotOptimize(out.data());
  benchmark::ClobberMemory();
}

/// One decode step of `rows` new query rows (GQA 32/8, causal, at the end of the cache, or after its
/// first `filled` keys when > 0), with a sliding window of `window` keys (0 = none).
template <class KV>
void decode_step(const std::vector<float>& q, Index rows, const decode_cache<KV>& k, const decode_cache<KV>& v,
                 std::vector<float>& out, Eigen::ThreadPoolInterface* pool, Index window = 0, Index filled = 0) {
  posenc::attention_options opt;
  opt.sliding_window = window;
  opt.pool = pool;
  causal_step(q, rows, 32, k.view(), v.view(), out, filled > 0 ? filled : k.tokens, opt);
}

/// Seconds of one decode step of `rows` rows (decode_step).
template <class KV>
std::function<double()> timed_step(const std::vector<float>& q, Index rows, const decode_cache<KV>& k,
                                   const decode_cache<KV>& v, std::vector<float>& out, Eigen::ThreadPool* pool) {
  return [&q, rows, &k, &v, &out, pool] {
    const auto t0 = std::chrono::steady_clock::now();
    decode_step(q, rows, k, v, out, pool);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
}

/// The K and V caches of the decode benchmarks (GQA 32/8, d = 128, Lk tokens, rows dense) and q for
/// up to `rows` new rows per head.
template <class KV>
struct decode_operands {
  static constexpr Index H = 32, Hkv = 8, d = 128;
  decode_operands(Index rows, Index Lk, Index pad_bytes = 0, posenc::layout order = posenc::layout::bshd)
      : q(random_vector(static_cast<std::size_t>(rows * H * d), 1)),
        k(stored_as<KV>(random_vector(static_cast<std::size_t>(Lk * Hkv * d), 2)), Lk, Hkv, d, pad_bytes, order),
        v(stored_as<KV>(random_vector(static_cast<std::size_t>(Lk * Hkv * d), 3)), Lk, Hkv, d, pad_bytes, order),
        out(q.size()) {}
  [[nodiscard]] double kv_bytes() const { return static_cast<double>(k.data.size() + v.data.size()) * sizeof(KV); }
  std::vector<float> q;
  decode_cache<KV> k, v;
  std::vector<float> out;
};

// 4 new query rows against 1, on the same cache (GQA 32/8, d = 128, causal), in back-to-back pairs:
// counter four_over_one, the median of time(4 rows) / time(1 row). The decode step's bytes do not
// grow with the rows, its arithmetic grows 4x (docs/performance.md › Decode). pad_bytes: the cache's
// token rows padded by that many bytes (decode_cache).
template <class KV>
void decode_rows_ratio(benchmark::State& state) {
  const Index Lk = state.range(0), threads = state.range(1), pad = state.range(2);
  decode_operands<KV> x(4, Lk, pad);
  const auto pool = make_pool(threads);
  state.counters["four_over_one"] = bench_util::median_pair_ratio(
      state, [&] { decode_step(x.q, 1, x.k, x.v, x.out, pool.get()); },
      [&] { decode_step(x.q, 4, x.k, x.v, x.out, pool.get()); });
}

// The same decode step on a cache whose token rows are padded by pad_bytes, against the dense cache
// of the same values, in back-to-back pairs: counter padded_over_dense, the median of
// time(padded) / time(dense).
template <class KV>
void decode_padding(benchmark::State& state) {
  const Index rows = state.range(0), Lk = state.range(1), threads = state.range(2), pad = state.range(3);
  decode_operands<KV> dense(rows, Lk), padded(rows, Lk, pad);  // the same values
  const auto pool = make_pool(threads);
  state.counters["padded_over_dense"] = bench_util::median_pair_ratio(
      state, [&] { decode_step(dense.q, rows, dense.k, dense.v, dense.out, pool.get()); },
      [&] { decode_step(padded.q, rows, padded.k, padded.v, padded.out, pool.get()); });
}

// The decode step against its memory floor, measured in turns (run_turns): each iteration runs the
// step, a triad moving the same bytes and cache_reader over the same cache, so that the three see
// the same machine state. Counters: of_triad and of_read, the medians of the per-iteration ratios
// (K/V bytes / step time) / (bytes / reference time); KV_GBps from the step's total time. The
// reported time is the step's. At Lk = 4096 the triad's and the reader's arrays evict part of the
// cache from the last-level cache between steps, so the step reads more of it from DRAM than in
// BM_decode.
template <class KV>
void decode_floor(benchmark::State& state) {
  const Index rows = state.range(0), Lk = state.range(1), threads = state.range(2);
  decode_operands<KV> x(rows, Lk);
  const auto pool = make_pool(threads);
  triad_arrays triad(static_cast<std::size_t>(x.kv_bytes()));
  cache_reader<KV> reader({&x.k.data, &x.v.data}, pool.get());
  const auto sec = run_turns(state, {timed_step(x.q, rows, x.k, x.v, x.out, pool.get()),
                                     [&] { return run_parts(pool.get(), std::ref(triad)); },
                                     [&] { return run_parts(pool.get(), std::ref(reader)); }});
  const double kv = x.kv_bytes(), rb = static_cast<double>(reader.bytes());
  double step_seconds = 0;
  for (const auto& s : sec) step_seconds += s[0];
  state.counters["KV_GBps"] = kv * static_cast<double>(sec.size()) / step_seconds * 1e-9;
  state.counters["of_triad"] = median_over(sec, [&](const auto& s) { return triad.seconds_for(kv, s[1]) / s[0]; });
  state.counters["of_read"] = median_over(sec, [&](const auto& s) { return kv / s[0] / (rb / s[2]); });
}

/// The median of time(1-row step on a cache of `slots` keys, with `window` and the row after the first
/// `filled` keys) / time(1-row step on a cache of only the `seen` keys it reads), in back-to-back pairs
/// on one thread: what the per-call work that grows with the cache adds to a step.
template <class KV>
double over_seen_keys(benchmark::State& state, Index seen, Index slots, Index window, Index filled) {
  decode_operands<KV> cache(1, slots), seen_only(1, seen);
  return bench_util::median_pair_ratio(
      state, [&] { decode_step(seen_only.q, 1, seen_only.k, seen_only.v, seen_only.out, nullptr); },
      [&] { decode_step(cache.q, 1, cache.k, cache.v, cache.out, nullptr, window, filled); });
}

// A sliding-window decode step (the local layers of gpt-oss, Gemma 2/3, Mistral: 1 row, GQA 32/8,
// d = 128, window W) on a cache of Lk keys, against the same step on a cache of only the window's W
// keys (fully causal): counter window_over_W (over_seen_keys). Both read W keys and values; what the
// long cache adds is the per-call work that grows with Lk (positions, key validity, key-block
// summaries, a softmax state per key segment).
template <class KV>
void decode_window(benchmark::State& state) {
  state.counters["window_over_W"] = over_seen_keys<KV>(state, state.range(0), state.range(1), state.range(0), 0);
}

// A decode step (1 row, GQA 32/8, d = 128) at position P of a preallocated cache of Lk slots
// (Hugging Face's StaticCache, a runtime's slab: the keys after P are not filled yet), against the
// same step on a cache of only the P filled keys: counter filled_over_P (over_seen_keys). Both read P
// keys and values; what the slots add is the per-call work that grows with Lk.
template <class KV>
void decode_filled(benchmark::State& state) {
  state.counters["filled_over_P"] = over_seen_keys<KV>(state, state.range(0), state.range(1), 0, state.range(0));
}

/// Seconds of `macs` float multiply-adds at the FMA peak (bench_util::fma_peak), split over the
/// pool's threads; `keep` receives their sums.
double fma_seconds(double macs, Eigen::ThreadPool* pool, std::vector<float>& keep) {
  return run_parts(pool, [&](int t, int parts) {
    keep[static_cast<std::size_t>(t)] =
        bench_util::fma_peak(static_cast<std::int64_t>(macs / bench_util::fma_lanes) / parts);
    benchmark::DoNotOptimize(keep.data());
  });
}

/// A step's multiply-adds fed by the cache itself, with nothing else: K and V read once in address
/// order, split over the pool's threads, each packet multiplied into F of C register-only chains (F
/// packet FMAs per packet is F multiply-adds per element: 16 for 16 query rows per kv head, 4 for 4),
/// each 64-byte line prefetching into L1 the line 4 KiB further (as cache_reader). With F < 16 the
/// packets take the chains in turn (C / F packets a round), so that no chain's latency sets the pace.
/// C = bench_util::fma_chains: 16 chains on 16 registers spilled.
template <int F>
struct streamed_fmas {
  static constexpr int chains = bench_util::fma_chains, round = F >= chains ? 1 : chains / F;
  static_assert(F % chains == 0 || chains % F == 0, "the rounds cover the chains evenly");
  std::vector<const std::vector<float>*> x;
  std::vector<float> sums;  // one slot per part
  streamed_fmas(std::vector<const std::vector<float>*> arrays, Eigen::ThreadPool* pool)
      : x(std::move(arrays)), sums(static_cast<std::size_t>(pool != nullptr ? pool->NumThreads() : 1), 0.f) {}
  void operator()(int t, int parts) {
    namespace in = Eigen::internal;
    using P = bench_util::fma_packet;
    constexpr std::size_t W = bench_util::fma_lanes, line = 64 / sizeof(float), ahead = 4096 / sizeof(float);
    P c[chains];
    for (P& a : c) a = in::pset1<P>(0.f);
    const P m = in::pset1<P>(0.9999f);
    // packet i + g of a round feeds chains g F .. g F + F - 1 (modulo C); g is a compile-time
    // constant, so that the chains stay in registers
    const auto packet = [&](const float* p, std::size_t i, auto g) {
      if (i * W % line == 0) __builtin_prefetch(p + i * W + ahead, 0, 3);
      const P v = in::ploadu<P>(p + i * W);
      for (int f = 0; f < F; ++f) c[(g() * F + f) % chains] = in::pmadd(v, m, c[(g() * F + f) % chains]);
    };
    const auto one_round = [&]<int... G>(const float* p, std::size_t i, std::integer_sequence<int, G...>) {
      (packet(p, i + G, std::integral_constant<int, G>{}), ...);
    };
    for (const auto* a : x) {
      const float* p = a->data();
      const auto [lo, hi] = part_range(a->size() / W, t, parts);
      std::size_t i = lo;
      for (; i + round <= hi; i += round) one_round(p, i, std::make_integer_sequence<int, round>{});
      for (; i < hi; ++i) packet(p, i, std::integral_constant<int, 0>{});
    }
    for (int i = 1; i < chains; ++i) c[0] = in::padd(c[0], c[i]);
    sums[static_cast<std::size_t>(t)] = in::predux(c[0]);
    benchmark::DoNotOptimize(sums.data());
  }
};

// Four rows against one and against the machine's limits, in turns (run_turns): each iteration runs
// the 1-row step, the 4-row step, a triad moving the step's K/V bytes, register-only FMAs as many as
// the 4-row step's multiply-adds (2 x 4 rows x 32 heads x Lk x d), and those multiply-adds fed by the
// cache read in address order (streamed_fmas), all on the same threads. Counters, medians of the
// per-iteration ratios:
//   four_over_one   time(4 rows) / time(1 row), as BM_decode_rows_ratio
//   at_limits       time(FMAs) / time(triad): four_over_one with the 4-row step at the FMA peak and the
//                   1-row step at the triad's rate, each step's bound on this machine, as if the core
//                   overlapped the two perfectly
//   stream_over_one time(streamed) / time(1 row): four_over_one with the 4-row step doing its
//                   multiply-adds on the bytes it reads and nothing else, as this core overlaps them
//   least           time(FMAs) / time(1 row): the least four_over_one the 1-row step's time leaves
//   one_of_triad    the 1-row step's rate against the triad's; four_of_peak the 4-row step's against
//                   the FMAs'; four_of_stream against the streamed multiply-adds
template <class KV>
void decode_limits(benchmark::State& state) {
  using X = decode_operands<KV>;
  const Index Lk = state.range(0), threads = state.range(1);
  X x(4, Lk);
  const auto pool = make_pool(threads);
  triad_arrays triad(static_cast<std::size_t>(x.kv_bytes()));
  const double macs = 2.0 * 4 * static_cast<double>(X::H * Lk * X::d);
  std::vector<float> keep(static_cast<std::size_t>(threads), 0.f);
  static_assert(std::is_same_v<KV, float>, "streamed_fmas reads f32 caches");
  streamed_fmas<4 * X::H / X::Hkv> streamed({&x.k.data, &x.v.data}, pool.get());
  const auto sec = run_turns(
      state,
      {timed_step(x.q, 1, x.k, x.v, x.out, pool.get()), timed_step(x.q, 4, x.k, x.v, x.out, pool.get()),
       [&] { return run_parts(pool.get(), std::ref(triad)); }, [&] { return fma_seconds(macs, pool.get(), keep); },
       [&] { return run_parts(pool.get(), std::ref(streamed)); }});
  const double kv = x.kv_bytes();
  state.counters["four_over_one"] = median_over(sec, [](const auto& s) { return s[1] / s[0]; });
  state.counters["at_limits"] = median_over(sec, [&](const auto& s) { return s[3] / triad.seconds_for(kv, s[2]); });
  state.counters["stream_over_one"] = median_over(sec, [](const auto& s) { return s[4] / s[0]; });
  state.counters["least"] = median_over(sec, [](const auto& s) { return s[3] / s[0]; });
  state.counters["one_of_triad"] = median_over(sec, [&](const auto& s) { return triad.seconds_for(kv, s[2]) / s[0]; });
  state.counters["four_of_peak"] = median_over(sec, [](const auto& s) { return s[3] / s[1]; });
  state.counters["four_of_stream"] = median_over(sec, [](const auto& s) { return s[4] / s[1]; });
}

// Split-KV against the memory's own scaling, in turns (run_turns): each iteration runs the 1-row step
// on 1 and on 2 threads, a triad moving the step's bytes on 1 and on 2 threads, and cache_reader over
// the cache itself on 1 and on 2 threads. Counters, medians of the per-iteration ratios:
//   two_over_one        time(1 thread) / time(2 threads) of the step
//   triad_two_over_one  the same for the triad: what a second core adds to this machine's memory rate
//   read_two_over_one   the same for the reader (reads only, as the step does)
//   one_of_triad, two_of_triad  each step's rate against the triad's on as many threads
//   at_triad            triad_two_over_one / one_of_triad: two_over_one with the 2-thread step at the
//                       2-thread triad's rate and the 1-thread step as fast as it ran
//   at_read             time(step, 1 thread) / time(reader, 2 threads): the same with the 2-thread step
//                       reading the cache as fast as the reader does on 2 threads; a 2-thread step
//                       cannot beat it by much without reading faster than a plain read
// With an f32 cache and 1 row, each iteration also runs on 1 and on 2 threads the step's own
// multiply-adds (4 per element of K and V: a group of 4 query rows per kv head) fed by the cache read
// once in address order (streamed_fmas), the least a step must do with what it reads:
//   stream_of_triad, stream_two_of_triad  their rate against the triad's on as many threads: the
//                       share of the triad's rate the step's reads and arithmetic reach on this core
//                       when they have nothing else to do
//   one_of_stream, two_of_stream  the step's rate against theirs on as many threads
template <class KV>
void decode_threads(benchmark::State& state) {
  using X = decode_operands<KV>;
  const Index rows = state.range(0), Lk = state.range(1);
  X x(rows, Lk);
  const auto pool = make_pool(2);
  triad_arrays triad(static_cast<std::size_t>(x.kv_bytes()));
  cache_reader<KV> reader({&x.k.data, &x.v.data}, pool.get());
  std::vector<std::function<double()>> runs{
      timed_step(x.q, rows, x.k, x.v, x.out, nullptr), timed_step(x.q, rows, x.k, x.v, x.out, pool.get()),
      [&] { return run_parts(nullptr, std::ref(triad)); }, [&] { return run_parts(pool.get(), std::ref(triad)); },
      [&] { return run_parts(nullptr, std::ref(reader)); }, [&] { return run_parts(pool.get(), std::ref(reader)); }};
  using streamed = streamed_fmas<X::H / X::Hkv>;
  std::unique_ptr<streamed> one, two;  // for one thread and for the pool's parts; f32, 1 row only
  if constexpr (std::is_same_v<KV, float>) {
    if (rows == 1) {
      const std::vector<const std::vector<float>*> kv_arrays{&x.k.data, &x.v.data};
      one = std::make_unique<streamed>(kv_arrays, nullptr);
      two = std::make_unique<streamed>(kv_arrays, pool.get());
      runs.emplace_back([&] { return run_parts(nullptr, std::ref(*one)); });
      runs.emplace_back([&] { return run_parts(pool.get(), std::ref(*two)); });
    }
  }
  const auto sec = run_turns(state, runs);
  const double kv = x.kv_bytes(), rb = static_cast<double>(reader.bytes());
  if (one != nullptr) {
    state.counters["stream_of_triad"] =
        median_over(sec, [&](const auto& s) { return triad.seconds_for(kv, s[2]) / s[6]; });
    state.counters["stream_two_of_triad"] =
        median_over(sec, [&](const auto& s) { return triad.seconds_for(kv, s[3]) / s[7]; });
    state.counters["one_of_stream"] = median_over(sec, [](const auto& s) { return s[6] / s[0]; });
    state.counters["two_of_stream"] = median_over(sec, [](const auto& s) { return s[7] / s[1]; });
  }
  state.counters["two_over_one"] = median_over(sec, [](const auto& s) { return s[0] / s[1]; });
  state.counters["triad_two_over_one"] = median_over(sec, [](const auto& s) { return s[2] / s[3]; });
  state.counters["read_two_over_one"] = median_over(sec, [](const auto& s) { return s[4] / s[5]; });
  state.counters["one_of_triad"] = median_over(sec, [&](const auto& s) { return triad.seconds_for(kv, s[2]) / s[0]; });
  state.counters["two_of_triad"] = median_over(sec, [&](const auto& s) { return triad.seconds_for(kv, s[3]) / s[1]; });
  state.counters["at_triad"] = median_over(sec, [&](const auto& s) { return s[0] / triad.seconds_for(kv, s[3]); });
  state.counters["at_read"] = median_over(sec, [&](const auto& s) { return s[0] / (s[5] * kv / rb); });
}

/// Bytes of K/V a decode loop spreads over its layers' caches (BM_decode_layers): far beyond a
/// last-level cache (32 MiB on the Zen 5 VM), so that no call finds its cache there.
constexpr double decode_loop_bytes = 256.0 * (1 << 20);

/// Seconds of one token of a decode loop: a `rows`-row step (decode_step) against each layer's cache in
/// turn, as a host runs its layers.
template <class KV>
std::function<double()> timed_loop(std::vector<decode_operands<KV>>& layers, Index rows,
                                   Eigen::ThreadPoolInterface* pool) {
  return [&layers, rows, pool] {
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& x : layers) decode_step(x.q, rows, x.k, x.v, x.out, pool);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
}

/// Seconds of one token of a decode loop run as two independent 1-thread loops at once: the calling
/// thread's over the first half of the layers, a pool thread's over the rest, every call without a pool
/// (timed_loop's calls, the same bytes). What two cores give the 1-thread step's own work on this
/// machine, with no call split between them and one hand-off per token instead of one per call: the
/// bound of a split-KV step's two_over_one (BM_decode_layers).
template <class KV>
std::function<double()> timed_loop_pair(std::vector<decode_operands<KV>>& layers, Index rows,
                                        Eigen::ThreadPoolInterface& pool) {
  return [&layers, rows, &pool] {
    const auto half = static_cast<std::ptrdiff_t>(layers.size() / 2);
    const auto run = [rows](auto first, auto last) {
      for (auto x = first; x != last; ++x) decode_step(x->q, rows, x->k, x->v, x->out, nullptr);
    };
    const auto t0 = std::chrono::steady_clock::now();
    Eigen::Barrier done(1);
    pool.Schedule([&] {
      run(layers.begin() + half, layers.end());
      done.Notify();
    });
    run(layers.begin(), layers.begin() + half);
    done.Wait();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
}

// A BHSD cache ([kv heads, tokens, d], Hugging Face's layout) against a BSHD copy of the same values, in
// a host's loop (timed_loop: one cache per layer, as many layers as make decode_loop_bytes for each
// layout), the two loops in turns (run_turns): counter bhsd_over_bshd, the median of the per-token
// ratios time(BHSD) / time(BSHD). The reported time is a token's with BSHD.
template <class KV>
void decode_layout(benchmark::State& state) {
  const Index rows = state.range(0), Lk = state.range(1), threads = state.range(2);
  std::vector<decode_operands<KV>> bshd_layers, bhsd_layers;
  bshd_layers.emplace_back(rows, Lk);
  const auto n = static_cast<std::size_t>(std::max(2.0, std::ceil(decode_loop_bytes / bshd_layers.front().kv_bytes())));
  while (bshd_layers.size() < n) bshd_layers.emplace_back(rows, Lk);
  while (bhsd_layers.size() < n) bhsd_layers.emplace_back(rows, Lk, 0, posenc::layout::bhsd);
  const auto pool = make_pool(threads);
  const auto sec = run_turns(state, {timed_loop(bshd_layers, rows, pool.get()), timed_loop(bhsd_layers, rows, pool.get())});
  state.counters["layers"] = static_cast<double>(n);
  state.counters["bhsd_over_bshd"] = median_over(sec, [](const auto& s) { return s[1] / s[0]; });
}

// Which strategy a shape wants: the same call on the tiled path and on the decode path, in back-to-back
// pairs, for groups wider than the 4-row step's (H query heads over Hkv kv heads, `rows` new queries
// per head: group x rows query rows per kv head). Counters: tiled_over_decode, the median of
// time(tiled) / time(decode); rows_per_kv_head; auto_decode, 1 where the automatic choice
// (detail::choose_decode) takes the decode path.
template <class KV>
void decode_groups(benchmark::State& state) {
  const Index H = state.range(0), Hkv = state.range(1), d = state.range(2), rows = state.range(3),
              Lk = state.range(4), threads = state.range(5);
  const auto q = random_vector(static_cast<std::size_t>(rows * H * d), 1);
  const auto k = stored_as<KV>(random_vector(static_cast<std::size_t>(Lk * Hkv * d), 2));
  const auto v = stored_as<KV>(random_vector(static_cast<std::size_t>(Lk * Hkv * d), 3));
  std::vector<float> out(q.size());
  const auto pool = make_pool(threads);
  const auto step = [&](posenc::attention_path path) {
    posenc::attention_options opt;
    opt.pool = pool.get();
    opt.path = path;
    causal_step(q, rows, H, posenc::bshd<const KV>(k.data(), 1, Lk, Hkv, d),
                posenc::bshd<const KV>(v.data(), 1, Lk, Hkv, d), out, Lk, opt);
  };
  state.counters["tiled_over_decode"] = bench_util::median_pair_ratio(
      state, [&] { step(posenc::attention_path::decode); }, [&] { step(posenc::attention_path::tiled); });
  state.counters["rows_per_kv_head"] = static_cast<double>(H / Hkv * rows);
  state.counters["auto_decode"] =
      posenc::detail::choose_decode<posenc::no_position, float>(posenc::attention_path::automatic, H / Hkv, rows);
}

// The decode step as a host's decode loop runs it: every layer has its own cache (Lk tokens, GQA 32/8,
// d = 128), and a token calls the step against each layer in turn, so each call reads a cache that the
// other layers' calls pushed out of the last-level cache, and the pool's threads come from the previous
// call rather than from a benchmark's idle spell (BM_decode calls one cache again and again, half of
// it still in L3 at Lk = 4096; BM_decode_threads and BM_decode_limits evict it with a triad's writes,
// single-thread runs in between). As many layers as make decode_loop_bytes (at least 2). Each
// iteration runs, in turns (run_turns), the loop with 1 row on 1 and on 2 threads, with 4 rows on 1
// and on 2 threads, a triad moving the loop's bytes on 1 and on 2 threads, and the 1-row loop as two
// independent 1-thread halves at once (timed_loop_pair). The reported time is a token's (all layers)
// with 1 row on 1 thread. `polling`: the 2-thread steps' pool, 0 Eigen's ThreadPool (as every other
// benchmark here), 1 a polling_pool (polling_pool.hpp), whose worker polls for 500 us after a task
// instead of sleeping (the triads and the two halves run on the Eigen pool either way). Counters,
// medians of the per-iteration ratios:
//   two_over_one      time(1 row, 1 thread) / time(1 row, 2 threads)
//   pair_two_over_one time(1 row, 1 thread) / time(the two halves at once): what the machine gives
//                     a second thread doing the same work, the bound of two_over_one
//   two_of_pair       time(the two halves) / time(1 row, 2 threads): the split step against that bound
//   four_over_one     time(4 rows) / time(1 row), on 1 thread; four_over_one_2t the same on 2
//   one_of_triad, two_of_triad  the 1-row loop's rate against the triad's on as many threads
//   triad_two_over_one  what the second core adds to the triad
template <class KV>
void decode_layers(benchmark::State& state) {
  const Index Lk = state.range(0);
  const bool polling = state.range(1) != 0;
  std::vector<decode_operands<KV>> layers;
  layers.emplace_back(4, Lk);
  const double layer_bytes = layers.front().kv_bytes();
  const auto n = static_cast<std::size_t>(std::max(2.0, std::ceil(decode_loop_bytes / layer_bytes)));
  while (layers.size() < n) layers.emplace_back(4, Lk);
  const auto pool = make_pool(2);
  std::optional<bench_util::polling_pool> polling_threads;
  if (polling) polling_threads.emplace(2);
  Eigen::ThreadPoolInterface* const steps = polling ? static_cast<Eigen::ThreadPoolInterface*>(&*polling_threads)
                                                    : pool.get();
  const double kv = layer_bytes * static_cast<double>(n);
  triad_arrays triad(static_cast<std::size_t>(kv));
  const auto sec = run_turns(
      state, {timed_loop(layers, 1, nullptr), timed_loop(layers, 1, steps), timed_loop(layers, 4, nullptr),
              timed_loop(layers, 4, steps), [&] { return run_parts(nullptr, std::ref(triad)); },
              [&] { return run_parts(pool.get(), std::ref(triad)); }, timed_loop_pair(layers, 1, *pool)});
  state.counters["layers"] = static_cast<double>(n);
  state.counters["two_over_one"] = median_over(sec, [](const auto& s) { return s[0] / s[1]; });
  state.counters["pair_two_over_one"] = median_over(sec, [](const auto& s) { return s[0] / s[6]; });
  state.counters["two_of_pair"] = median_over(sec, [](const auto& s) { return s[6] / s[1]; });
  state.counters["four_over_one"] = median_over(sec, [](const auto& s) { return s[2] / s[0]; });
  state.counters["four_over_one_2t"] = median_over(sec, [](const auto& s) { return s[3] / s[1]; });
  state.counters["one_of_triad"] = median_over(sec, [&](const auto& s) { return triad.seconds_for(kv, s[4]) / s[0]; });
  state.counters["two_of_triad"] = median_over(sec, [&](const auto& s) { return triad.seconds_for(kv, s[5]) / s[1]; });
  state.counters["triad_two_over_one"] = median_over(sec, [](const auto& s) { return s[4] / s[5]; });
}

// Runs f(head) for the 8 heads, on `threads` threads (heads split evenly, no pool overhead inside).
template <class F>
void for_heads(Eigen::ThreadPool* pool, F&& f) {
  if (pool == nullptr) {
    for (Index h = 0; h < kHeads; ++h) f(h);
    return;
  }
  const int n = pool->NumThreads();
  Eigen::Barrier done(static_cast<unsigned>(n));
  for (int t = 0; t < n; ++t)
    pool->Schedule([&, t] {
      for (Index h = t; h < kHeads; h += n) f(h);
      done.Notify();
    });
  done.Wait();
}

using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The practical peak: S = Q K^T per head (one [L x L] product), the kernel's dominant shape.
void BM_gemm_qkT(benchmark::State& state) {
  bench_case c(state);
  const Index L = c.L, d = c.d;
  inputs& x = c.x;
  const auto& pool = c.pool;
  std::vector<row_matrix> s(static_cast<std::size_t>(c.threads), row_matrix(L, L));
  for (auto _ : state) {
    for_heads(pool.get(), [&](Index h) {
      const Index t = pool ? pool->CurrentThreadId() : 0;
      s[static_cast<std::size_t>(t)].noalias() = x.Q().matrix(0, h) * x.K().matrix(0, h).transpose();
    });
    benchmark::ClobberMemory();
  }
  set_counters(state, L, d, false, 2.0 * static_cast<double>(L) * static_cast<double>(L) * static_cast<double>(d));
}

// Naive materialized attention per head: S = (scale Q) K^T, mask, softmax by rows, O = P V.
struct naive_attention {
  naive_attention(Index L, Index d, Index threads)
      : s(static_cast<std::size_t>(threads), row_matrix(L, L)), qs(static_cast<std::size_t>(threads), row_matrix(L, d)) {}
  void run(inputs& x, Eigen::ThreadPool* pool, bool causal) {
    const Index L = x.L, d = x.d;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for_heads(pool, [&](Index h) {
      const auto t = static_cast<std::size_t>(pool ? pool->CurrentThreadId() : 0);
      qs[t] = x.Q().matrix(0, h) * scale;
      row_matrix& S = s[t];
      S.noalias() = qs[t] * x.K().matrix(0, h).transpose();
      for (Index i = 0; i < L; ++i) {
        auto row = S.row(i).array();
        if (causal) row.tail(L - i - 1).setConstant(-std::numeric_limits<float>::infinity());
        row = (row - row.maxCoeff()).exp();
        row /= row.sum();
      }
      posenc::bshd(x.out.data(), 1, L, kHeads, d).matrix(0, h).noalias() = S * x.V().matrix(0, h);
    });
    benchmark::ClobberMemory();
  }
  std::vector<row_matrix> s, qs;
};

void BM_naive(benchmark::State& state) {
  bench_case c(state);
  naive_attention naive(c.L, c.d, c.threads);
  for (auto _ : state) naive.run(c.x, c.pool.get(), c.causal);
  set_counters(state, c.L, c.d, c.causal,
               4.0 * static_cast<double>(c.L) * static_cast<double>(c.L) * static_cast<double>(c.d));
}

// The fused kernel against the naive attention in back-to-back call pairs (bench/pairs.hpp): counter
// naive_over_fused, the median of time(naive) / time(fused).
void BM_fused_vs_naive(benchmark::State& state) {
  bench_case c(state);
  naive_attention naive(c.L, c.d, c.threads);
  posenc::attention_options opt;
  opt.causal = c.causal;
  opt.pool = c.pool.get();
  state.counters["naive_over_fused"] = bench_util::median_pair_ratio(
      state,
      [&] {
        posenc::attention<float>(c.x.Q(), c.x.K(), c.x.V(), posenc::bshd(c.x.out.data(), 1, c.L, kHeads, c.d),
                                 posenc::no_position{}, opt);
        benchmark::ClobberMemory();
      },
      [&] { naive.run(c.x, c.pool.get(), c.causal); });
}

// Sliding-window attention (Mistral / Gemma / gpt-oss layers) against full causal attention in
// back-to-back pairs: counter window_over_causal, the median of time(window) / time(causal). The
// schedule skips the key blocks before every query's window, so the ratio follows the visited tiles:
// for L = 16384, W = 4096 and 256 x 256 tiles, 952 of the causal plan's 2080 tile rows (0.46).
void BM_sliding_window(benchmark::State& state) {
  const Index L = state.range(0), W = state.range(1), d = state.range(2), threads = state.range(3);
  inputs x(L, d);
  const auto pool = make_pool(threads);
  posenc::attention_options causal;
  causal.causal = true;
  causal.pool = pool.get();
  posenc::attention_options window = causal;
  window.sliding_window = W;
  auto run = [&](const posenc::attention_options& opt) {
    posenc::attention<float>(x.Q(), x.K(), x.V(), posenc::bshd(x.out.data(), 1, L, kHeads, d), posenc::no_position{},
                             opt);
    benchmark::ClobberMemory();
  };
  state.counters["window_over_causal"] =
      bench_util::median_pair_ratio(state, [&] { run(causal); }, [&] { run(window); });
}

void fused_args(benchmark::internal::Benchmark* b) {
  for (Index L : {128, 512, 2048, 4096, 8192})
    for (Index d : {64, 128})
      for (Index causal : {0, 1})
        for (Index threads : {1, 2}) b->Args({L, d, causal, threads});
  b->Args({16384, 128, 1, 1});
  b->Args({16384, 128, 1, 2});
}
void reference_args(benchmark::internal::Benchmark* b) {  // materialized [L x L]: L <= 4096
  for (Index L : {128, 512, 2048, 4096})
    for (Index d : {64, 128})
      for (Index causal : {0, 1})
        for (Index threads : {1, 2}) b->Args({L, d, causal, threads});
}
void gemm_args(benchmark::internal::Benchmark* b) {
  for (Index L : {128, 512, 2048, 4096})
    for (Index d : {64, 128})
      for (Index threads : {1, 2}) b->Args({L, d, 0, threads});
}

BENCHMARK(BM_fused)->Apply(fused_args)->ArgNames({"L", "d", "causal", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
/// BM_decode/kv:<f32|f16|bf16>/rows:<r>/Lk:<Lk>/threads:<t> (stable names: scripts select rows by them).
template <class KV>
void register_decode(const char* kv) {
  benchmark::RegisterBenchmark((std::string("BM_decode/kv:") + kv).c_str(), decode_rows<KV>)
      ->ArgsProduct({{1, 4, 16}, {4096, 32768}, {1, 2}})
      ->ArgNames({"rows", "Lk", "threads"})
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
}
[[maybe_unused]] const bool decode_registered = [] {
  register_decode<float>("f32");
  register_decode<Eigen::half>("f16");
  register_decode<Eigen::bfloat16>("bf16");
  using bench_fn = void (*)(benchmark::State&);
  // the pairs time themselves (manual time), over at least a second
  const auto paired = [](const char* name, bench_fn fn, const std::vector<std::vector<std::int64_t>>& args,
                         const std::vector<std::string>& names) {
    benchmark::RegisterBenchmark(name, fn)
        ->ArgsProduct(args)
        ->ArgNames(names)
        ->Unit(benchmark::kMicrosecond)
        ->UseManualTime()
        ->MinTime(1.0);
  };
  paired("BM_decode_rows_ratio/kv:f32", decode_rows_ratio<float>, {{4096}, {1, 2}, {0, 64}},
         {"Lk", "threads", "pad_bytes"});
  paired("BM_decode_rows_ratio/kv:f16", decode_rows_ratio<Eigen::half>, {{4096}, {1, 2}, {0, 64}},
         {"Lk", "threads", "pad_bytes"});
  paired("BM_decode_floor/kv:f32", decode_floor<float>, {{1}, {4096, 32768}, {1, 2}}, {"rows", "Lk", "threads"});
  paired("BM_decode_floor/kv:f16", decode_floor<Eigen::half>, {{1}, {4096, 32768}, {1, 2}}, {"rows", "Lk", "threads"});
  paired("BM_decode_limits/kv:f32", decode_limits<float>, {{4096, 32768}, {1, 2}}, {"Lk", "threads"});
  paired("BM_decode_threads/kv:f32", decode_threads<float>, {{1}, {4096, 32768}}, {"rows", "Lk"});
  paired("BM_decode_threads/kv:f16", decode_threads<Eigen::half>, {{1}, {4096, 32768}}, {"rows", "Lk"});
  paired("BM_decode_layers/kv:f32", decode_layers<float>, {{4096, 32768}, {0, 1}}, {"Lk", "polling"});
  paired("BM_decode_layers/kv:f16", decode_layers<Eigen::half>, {{4096, 32768}, {0, 1}}, {"Lk", "polling"});
  // Falcon-7B (71/1, d = 64) and StarCoder (48/1, d = 128) decoding a token, Llama-3-70B (64/8) 4 tokens,
  // Llama-3-8B (32/8) 8 and 16, an MQA group of 128 2 tokens, Falcon-7B 4 tokens
  for (const char* kv : {"f32", "f16"}) {
    auto* b = benchmark::RegisterBenchmark((std::string("BM_decode_groups/kv:") + kv).c_str(),
                                           std::string(kv) == "f32" ? decode_groups<float> : decode_groups<Eigen::half>);
    for (const auto& s : std::vector<std::vector<std::int64_t>>{{71, 1, 64, 1}, {48, 1, 128, 1}, {64, 8, 128, 4},
                                                                {32, 8, 128, 8}, {128, 1, 128, 2}, {32, 8, 128, 16},
                                                                {71, 1, 64, 4}})
      for (const std::int64_t threads : {1, 2}) b->Args({s[0], s[1], s[2], s[3], 4096, threads});
    b->ArgNames({"H", "Hkv", "d", "rows", "Lk", "threads"})->Unit(benchmark::kMicrosecond)->UseManualTime()->MinTime(1.0);
  }
  paired("BM_decode_window/kv:f32", decode_window<float>, {{128, 1024}, {4096, 32768}}, {"W", "Lk"});
  paired("BM_decode_window/kv:f16", decode_window<Eigen::half>, {{128, 1024}, {4096, 32768}}, {"W", "Lk"});
  paired("BM_decode_filled/kv:f32", decode_filled<float>, {{128, 1024}, {4096, 32768}}, {"P", "Lk"});
  paired("BM_decode_filled/kv:f16", decode_filled<Eigen::half>, {{128, 1024}, {4096, 32768}}, {"P", "Lk"});
  paired("BM_decode_layout/kv:f32", decode_layout<float>, {{1, 4}, {4096, 32768}, {1, 2}}, {"rows", "Lk", "threads"});
  paired("BM_decode_layout/kv:f16", decode_layout<Eigen::half>, {{1, 4}, {4096, 32768}, {1, 2}},
         {"rows", "Lk", "threads"});
  paired("BM_decode_padding/kv:f32", decode_padding<float>, {{1, 4}, {4096, 32768}, {1}, {64}},
         {"rows", "Lk", "threads", "pad_bytes"});
  paired("BM_decode_padding/kv:f16", decode_padding<Eigen::half>, {{1, 4}, {4096, 32768}, {1}, {64}},
         {"rows", "Lk", "threads", "pad_bytes"});
  return true;
}();
BENCHMARK(BM_gemm_qkT)->Apply(gemm_args)->ArgNames({"L", "d", "causal", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_naive)->Apply(reference_args)->ArgNames({"L", "d", "causal", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_fused_vs_naive)->ArgsProduct({{512}, {64, 128}, {0, 1}, {1, 2}})->ArgNames({"L", "d", "causal", "threads"})
    ->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(3.0);
BENCHMARK(BM_sliding_window)->Args({4096, 1024, 128, 1})->Args({16384, 4096, 128, 1})->Args({16384, 4096, 128, 2})
    ->ArgNames({"L", "W", "d", "threads"})->Unit(benchmark::kMillisecond)->UseManualTime()->Iterations(5);

}  // namespace

BENCHMARK_MAIN();
