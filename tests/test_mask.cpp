// The decoder options of posenc/options.hpp (sliding_window, logit_softcap, sinks, attention_mask),
// resolved in posenc/detail/mask.hpp and applied by the fused kernel's schedule, tile math and online
// softmax: the kernel against the double reference attention (posenc/reference.hpp), which applies
// each option by its plain per-element formula (FORMAT.md 5.11), in float and double, with 1 and 2
// threads, GQA, awkward sizes and tiles, with and without an encoding. Also the position scans
// (posenc/detail/position_scan.hpp) the masks and the relative encodings share.
#include <algorithm>
#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <posenc/alibi.hpp>
#include <posenc/attention.hpp>
#include <posenc/detail/attention_schedule.hpp>
#include <posenc/detail/online_softmax.hpp>
#include <posenc/detail/position_scan.hpp>
#include <posenc/reference.hpp>
#include <random>
#include <string>
#include <unsupported/Eigen/CXX11/ThreadPool>
#include <utility>
#include <vector>

using Index = posenc::index_t;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

/// Key positions: their indices (ascending), shuffled positions for queries and keys, or the keys by
/// index and the queries at explicit positions (queries_positioned: q_offset + i, in reverse order).
enum class keys { ascending, shuffled, queries_positioned };

struct dcase {
  Index B = 2, Sq = 37, Sk = 37, H = 4, Hkv = 2, D = 16, Dv = 12;
  std::int64_t q_offset = 0;
  std::int64_t k_offset = 0;  ///< first key position (shuffled keys only)
  bool causal = true;
  Index window = 0;
  double softcap = 0;
  std::vector<double> sinks{};
  bool attention_mask = false, key_padding_mask = false;
  std::vector<Index> kv_lengths{};
  /// Per batch row (empty: none): the keys from filled[b] on hold NaN and are padding in the masks
  /// given (slots of a preallocated cache no query may see; the case puts its queries and lengths
  /// before them).
  std::vector<Index> filled{};
  keys key_order = keys::ascending;
  Index q_block = 0, k_block = 0;
  double input_scale = 1.0;
  unsigned seed = 7;
  posenc::attention_path path = posenc::attention_path::automatic;
};

std::string describe(const dcase& c) {
  return "B=" + std::to_string(c.B) + " Sq=" + std::to_string(c.Sq) + " Sk=" + std::to_string(c.Sk) +
         " H=" + std::to_string(c.H) + "/" + std::to_string(c.Hkv) + " q_offset=" + std::to_string(c.q_offset) +
         " W=" + std::to_string(c.window) + " softcap=" + std::to_string(c.softcap) +
         " sinks=" + std::to_string(c.sinks.size()) + " attention_mask=" + std::to_string(c.attention_mask) +
         " key_padding_mask=" + std::to_string(c.key_padding_mask) +
         (c.key_order == keys::shuffled ? " shuffled keys" : "") +
         (c.key_order == keys::queries_positioned ? " query positions" : "") +
         " kv_lengths=" + std::to_string(c.kv_lengths.size()) + " filled=" + std::to_string(c.filled.size()) +
         " blocks=" + std::to_string(c.q_block) + "x" + std::to_string(c.k_block);
}

struct problem {
  dcase c;
  std::vector<double> q, k, v;
  std::vector<std::int64_t> am, kpm, q_pos, k_pos;

  explicit problem(dcase cfg) : c(std::move(cfg)) {
    std::mt19937 rng(c.seed);
    std::normal_distribution<double> n(0.0, c.input_scale);
    q.resize(static_cast<std::size_t>(c.B * c.Sq * c.H * c.D));
    k.resize(static_cast<std::size_t>(c.B * c.Sk * c.Hkv * c.D));
    v.resize(static_cast<std::size_t>(c.B * c.Sk * c.Hkv * c.Dv));
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = n(rng);
    std::uniform_int_distribution<int> coin(0, 3);
    if (c.attention_mask) {  // HF: 1 = token; left padding in row 1, holes elsewhere
      am.assign(static_cast<std::size_t>(c.B * c.Sk), 1);
      for (auto& a : am) a = coin(rng) == 0 ? 0 : 1;
      if (c.B > 1) std::fill(am.begin() + c.Sk, am.begin() + c.Sk + std::min<Index>(c.Sk, 5), 0);
    }
    if (c.key_padding_mask) {  // nonzero = padding
      kpm.assign(static_cast<std::size_t>(c.B * c.Sk), 0);
      for (auto& a : kpm) a = coin(rng) == 0 ? 3 : 0;
    }
    for (Index b = 0; b < static_cast<Index>(c.filled.size()); ++b)
      for (Index j = c.filled[static_cast<std::size_t>(b)]; j < c.Sk; ++j) {
        const auto at = static_cast<std::size_t>(b * c.Sk + j);
        if (!am.empty()) am[at] = 0;
        if (!kpm.empty()) kpm[at] = 3;
        std::fill_n(k.begin() + static_cast<std::ptrdiff_t>(at * c.Hkv * c.D), c.Hkv * c.D, std::nan(""));
        std::fill_n(v.begin() + static_cast<std::ptrdiff_t>(at * c.Hkv * c.Dv), c.Hkv * c.Dv, std::nan(""));
      }
    if (c.key_order == keys::shuffled) {
      q_pos.resize(static_cast<std::size_t>(c.B * c.Sq));
      k_pos.resize(static_cast<std::size_t>(c.B * c.Sk));
      for (Index b = 0; b < c.B; ++b) {
        for (Index j = 0; j < c.Sk; ++j) k_pos[static_cast<std::size_t>(b * c.Sk + j)] = c.k_offset + j;
        for (Index i = 0; i < c.Sq; ++i) q_pos[static_cast<std::size_t>(b * c.Sq + i)] = c.q_offset + i;
        std::shuffle(k_pos.begin() + b * c.Sk, k_pos.begin() + (b + 1) * c.Sk, rng);
      }
    }
    if (c.key_order == keys::queries_positioned) {
      q_pos.resize(static_cast<std::size_t>(c.B * c.Sq));
      for (Index b = 0; b < c.B; ++b)
        for (Index i = 0; i < c.Sq; ++i) q_pos[static_cast<std::size_t>(b * c.Sq + i)] = c.q_offset + c.Sq - 1 - i;
    }
  }

  [[nodiscard]] posenc::attention_options options() const {
    posenc::attention_options o;
    o.causal = c.causal;
    o.q_offset = c.q_offset;
    o.sliding_window = c.window;
    o.logit_softcap = c.softcap;
    o.sinks = c.sinks;
    o.q_block = c.q_block;
    o.k_block = c.k_block;
    o.path = c.path;
    if (!am.empty()) o.attention_mask = posenc::tensor_map<const std::int64_t, 2>(am.data(), c.B, c.Sk);
    if (!kpm.empty()) o.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(kpm.data(), c.B, c.Sk);
    if (!q_pos.empty()) o.q_positions = posenc::positions_view(q_pos.data(), c.B, c.Sq);
    if (!k_pos.empty()) o.k_positions = posenc::positions_view(k_pos.data(), c.B, c.Sk);
    o.kv_lengths = c.kv_lengths;
    return o;
  }
};

struct result {
  std::vector<double> out, lse;
};

// The kernel in T, K and V stored in KV (T, or Eigen::half / Eigen::bfloat16 with T = float).
template <class T, class KV = T, class E>
result run_kernel(const problem& p, const E& enc, Eigen::ThreadPoolInterface* pool) {
  const dcase& c = p.c;
  const std::vector<T> q(p.q.begin(), p.q.end());
  const auto stored = [](const std::vector<double>& x) {
    std::vector<KV> r(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) r[i] = KV(static_cast<T>(x[i]));
    return r;
  };
  const std::vector<KV> k = stored(p.k), v = stored(p.v);
  std::vector<T> out(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv), T(123));
  std::vector<T> lse(static_cast<std::size_t>(c.B * c.H * c.Sq), T(123));
  auto opt = p.options();
  opt.pool = pool;
  posenc::attention(posenc::bshd<const T>(q.data(), c.B, c.Sq, c.H, c.D),
                    posenc::bshd<const KV>(k.data(), c.B, c.Sk, c.Hkv, c.D),
                    posenc::bshd<const KV>(v.data(), c.B, c.Sk, c.Hkv, c.Dv),
                    posenc::bshd<T>(out.data(), c.B, c.Sq, c.H, c.Dv),
                    posenc::tensor_map<T, 3>(lse.data(), c.B, c.H, c.Sq), enc, opt);
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

// The double reference on the inputs rounded to T, and K and V then to KV where they are stored in a
// half type (only the kernel's arithmetic differs).
template <class T, class KV = T>
result run_reference(const problem& p, const posenc::reference_terms<double>& terms) {
  const dcase& c = p.c;
  auto round = [](const std::vector<double>& x, auto stored) {
    using S = decltype(stored);
    std::vector<double> r(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(static_cast<S>(static_cast<T>(x[i])));
    return r;
  };
  const auto q = round(p.q, T{}), k = round(p.k, KV{}), v = round(p.v, KV{});
  result r;
  r.out.assign(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv), 0.0);
  r.lse.assign(static_cast<std::size_t>(c.B * c.H * c.Sq), 0.0);
  posenc::reference_attention<double>(posenc::bshd<const double>(q.data(), c.B, c.Sq, c.H, c.D),
                                      posenc::bshd<const double>(k.data(), c.B, c.Sk, c.Hkv, c.D),
                                      posenc::bshd<const double>(v.data(), c.B, c.Sk, c.Hkv, c.Dv),
                                      posenc::bshd<double>(r.out.data(), c.B, c.Sq, c.H, c.Dv), p.options(), terms,
                                      std::nullopt, posenc::tensor_map<double, 3>(r.lse.data(), c.B, c.H, c.Sq));
  return r;
}

template <class T>
void expect_close(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  double mag = 1.0;
  for (double w : want)
    if (std::isfinite(w)) mag = std::max(mag, std::abs(w));
  const double tol = (std::is_same_v<T, float> ? 3e-5 : 1e-12) * mag;
  double worst = 0;
  std::size_t bad_special = got.size();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool ok = std::isinf(want[i]) ? got[i] == want[i] : std::isfinite(got[i]);
    if (!ok && bad_special == got.size()) bad_special = i;
    if (std::isfinite(want[i]) && std::isfinite(got[i])) worst = std::max(worst, std::abs(got[i] - want[i]));
  }
  INFO(what << ": first mismatched infinity or NaN at " << bad_special << "; worst |error| " << worst
            << " (tolerance " << tol << ")");
  CHECK(bad_special == got.size());
  CHECK(worst <= tol);
}

// The kernel in T with K and V stored in KV (run_kernel) against `want`: out and lse.
template <class T, class KV = T, class E>
void expect_kernel(const char* what, const problem& p, const E& enc, Eigen::ThreadPoolInterface* pool,
                   const result& want) {
  INFO(what);
  const result got = run_kernel<T, KV>(p, enc, pool);
  expect_close<T>(got.out, want.out, "out");
  expect_close<T>(got.lse, want.lse, "lse");
}

// f(the problem on one path, pool) for both strategies, the tiled kernel and the decode one
// (detail/attention_decode.hpp), each on 1 and 2 threads.
template <class F>
void on_paths_and_threads(const problem& p, F&& f) {
  Eigen::ThreadPool two(2);
  for (const auto path : {posenc::attention_path::tiled, posenc::attention_path::decode})
  for (Eigen::ThreadPoolInterface* pool : {static_cast<Eigen::ThreadPoolInterface*>(nullptr),
                                           static_cast<Eigen::ThreadPoolInterface*>(&two)}) {
    INFO((pool != nullptr ? "2 threads" : "1 thread") << (path == posenc::attention_path::decode ? " decode" : " tiled"));
    problem pp = p;
    pp.c.path = path;
    f(pp, pool);
  }
}

// Kernel (float and double, 1 and 2 threads) against the reference.
template <class E = posenc::no_position>
void check(const dcase& c, const E& enc = {}, const posenc::reference_terms<double>& terms = {}) {
  INFO(describe(c));
  const problem p(c);
  const result want_d = run_reference<double>(p, terms), want_f = run_reference<float>(p, terms);
  on_paths_and_threads(p, [&](const problem& pp, Eigen::ThreadPoolInterface* pool) {
    expect_kernel<double>("double", pp, enc, pool, want_d);
    expect_kernel<float>("float", pp, enc, pool, want_f);
  });
}

// K and V stored in f16 and bf16 (q, out and lse in float), against the reference on the stored values:
// the half-precision operand paths (keys widened in the loads or staged, the row layout taking up to
// 8 or 16 rows per kv head) under the same options.
void check_half_kv(const dcase& c) {
  INFO(describe(c));
  const problem p(c);
  const result want_h = run_reference<float, Eigen::half>(p, {}), want_b = run_reference<float, Eigen::bfloat16>(p, {});
  on_paths_and_threads(p, [&](const problem& pp, Eigen::ThreadPoolInterface* pool) {
    expect_kernel<float, Eigen::half>("f16 K/V", pp, posenc::no_position{}, pool, want_h);
    expect_kernel<float, Eigen::bfloat16>("bf16 K/V", pp, posenc::no_position{}, pool, want_b);
  });
}

// A score term inside the scale (the softcap must see it): scale * 0.75 sin(0.3 i + 0.7 j + h).
double term_formula(Index h, Index i, Index j) {
  return 0.75 * std::sin(0.3 * static_cast<double>(i) + 0.7 * static_cast<double>(j) + static_cast<double>(h));
}
struct wavy_terms {
  template <class T>
  void add_score_terms(const posenc::tile<T>& t, T scale, posenc::matrix_map<T> s) const {
    for (Index i = 0; i < t.rows; ++i)
      for (Index j = 0; j < t.cols; ++j)
        s(i, j) += scale * static_cast<T>(term_formula(t.head, t.q_first + i, t.k_first + j));
  }
};

// ALiBi's causal form written out for the reference: -m_h (q - k), m_h = 2^(-8 (h + 1) / H) (H = 4).
posenc::reference_terms<double> alibi_reference(const problem& p) {
  posenc::reference_terms<double> t;
  t.bias = [&p](Index b, Index h, Index i, Index j) {
    const double m = std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(p.c.H));
    const double qp = p.q_pos.empty() ? static_cast<double>(p.c.q_offset + i)
                                      : static_cast<double>(p.q_pos[static_cast<std::size_t>(b * p.c.Sq + i)]);
    const double kp = p.k_pos.empty() ? static_cast<double>(j)
                                      : static_cast<double>(p.k_pos[static_cast<std::size_t>(b * p.c.Sk + j)]);
    return -m * (qp - kp);
  };
  return t;
}

// Counts the tiles the kernel computes and those wholly before the window of their queries.
struct tile_probe {
  std::shared_ptr<std::atomic<long>> tiles = std::make_shared<std::atomic<long>>(0);
  std::shared_ptr<std::atomic<long>> outside = std::make_shared<std::atomic<long>>(0);
  std::int64_t window = 0;
  template <class T>
  void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T>) const {
    ++*tiles;
    const std::int64_t q_min = *std::min_element(t.q_pos, t.q_pos + t.rows);
    const std::int64_t k_max = *std::max_element(t.k_pos, t.k_pos + t.cols);
    if (q_min - k_max >= window) ++*outside;
  }
};

}  // namespace

TEST_CASE("sliding window: prefill, decode chunks, tiles and GQA against the reference", "[kernel]") {
  for (Index W : {1, 3, 8, 17, 100}) {
    dcase c;
    c.window = W;
    check(c);  // default tiles: one block
    c.q_block = 5;
    c.k_block = 7;  // many blocks, windows across block edges
    check(c);
    c.Sq = 9;
    c.Sk = 61;
    c.q_offset = 52;  // a chunk after 52 cached tokens
    check(c);
    c.Sq = 1;
    c.q_offset = 60;  // a decode step
    c.k_block = 4;
    check(c);
  }
}

// The decode strategy cuts these 3000 keys into two segments (detail::decode_segments); a window
// shorter than the second (W up to 1100 here) leaves the first unseen, which the step passes over.
TEST_CASE("sliding window: decode steps on 3000 keys, segments before the window unseen", "[kernel]") {
  dcase c;
  c.Sk = 3000;
  c.attention_mask = true;  // the second batch row's first keys are padding
  for (const Index Sq : {1, 3})
    for (const Index W : {1, 100, 1100, 2100}) {
      c.Sq = Sq;
      c.q_offset = c.Sk - Sq;
      c.window = W;
      c.sinks.clear();
      check(c);
      c.sinks = {0.5, -1.0, 2.0, -inf};
      check(c);
    }
}

TEST_CASE("sliding window: packed products with panels cut by the window, 300 tokens", "[kernel]") {
  dcase c;
  c.B = 1;
  c.Sq = c.Sk = 300;
  c.H = 8;
  c.Hkv = 2;
  c.D = 32;
  c.Dv = 32;
  c.q_block = 48;
  c.k_block = 40;
  for (Index W : {1, 33, 64, 129}) {
    c.window = W;
    check(c);
  }
  c.q_block = c.k_block = 0;
  c.window = 77;
  check(c);
}

TEST_CASE("sliding window: with padding (attention_mask and key_padding_mask) and unordered keys", "[kernel]") {
  dcase c;
  c.Sq = c.Sk = 45;
  c.q_block = 8;
  c.k_block = 6;
  c.window = 9;
  c.attention_mask = true;
  check(c);
  c.key_padding_mask = true;
  check(c);
  c.attention_mask = c.key_padding_mask = false;
  c.key_order = keys::shuffled;  // not ascending: the per-element mask path
  check(c);
}

TEST_CASE("sliding window: with ALiBi, and the window at the int64 extremes of positions", "[kernel]") {
  dcase c;
  c.Sq = c.Sk = 40;
  c.q_block = 16;
  c.k_block = 8;
  c.window = 6;
  {
    const problem p(c);
    check(c, posenc::alibi(posenc::alibi_config{.heads = 4}), alibi_reference(p));
  }
  // A window larger than any distance sees what causal sees; positions near INT64_MAX and a huge
  // window do not overflow.
  c.window = std::numeric_limits<Index>::max();
  check(c);
  c.q_offset = std::numeric_limits<std::int64_t>::max() - 40;
  c.k_offset = c.q_offset - 3;
  c.window = 3;
  c.key_order = keys::shuffled;
  check(c);
  c.k_offset = std::numeric_limits<std::int64_t>::min();  // q - k beyond int64: never inside a window
  check(c);
}

TEST_CASE("sliding window: key blocks before every query's window are never computed", "[kernel]") {
  // The position bias hook (tile_probe) sees every computed tile: none may lie wholly before its
  // queries' windows.
  const Index L = 512, W = 64, block = 32;
  dcase c;
  c.B = 1;
  c.H = c.Hkv = 1;
  c.Sq = c.Sk = L;
  c.window = W;
  c.q_block = c.k_block = block;
  const problem p(c);
  tile_probe probe{.window = W};
  const result got = run_kernel<double>(p, probe, nullptr);
  CHECK(*probe.outside == 0);
  // Query block r sees key blocks r - W / block .. r: at most W / block + 1 tiles, not r + 1.
  const long blocks = L / block;
  long bound = 0;
  for (long r = 0; r < blocks; ++r) bound += std::min(r + 1, W / block + 1);
  CHECK(*probe.tiles == bound);
  const result want = run_reference<double>(p, {});
  expect_close<double>(got.out, want.out, "out");
}

// A window at the end of a long cache: the call holds only the keys from the first one some query's
// window reaches (detail::leading_keys_unseen), and must give what the reference gives over all of
// them: positions by index (ALiBi), the caller's key indices in the tiles (wavy_terms reads
// tile.k_first), kv_lengths that end before or inside the window, padding masks, queries at explicit
// positions, and queries past every key's window (rows of zeros, lse -inf).
TEST_CASE("sliding window: the keys before every query's window are left out of the call", "[kernel]") {
  posenc::reference_terms<double> wavy;
  wavy.score_term = [](Index, Index h, Index i, Index j) { return term_formula(h, i, j); };
  for (const Index Sq : {1, 3})
    for (const Index W : {1, 9, 40}) {
      dcase c;
      c.Sk = 300;
      c.Sq = Sq;
      c.q_offset = c.Sk - Sq;
      c.window = W;
      c.k_block = 32;
      c.kv_lengths = {300, 280};  // row 1 ends 20 keys before its queries: W = 1 and 9 leave it nothing
      check(c);
      c.kv_lengths.clear();
      check(c, wavy_terms{}, wavy);
      c.attention_mask = c.key_padding_mask = true;  // padding read at the caller's key indices
      check(c);
      c.attention_mask = c.key_padding_mask = false;
      const problem p(c);
      check(c, posenc::alibi(posenc::alibi_config{.heads = 4}), alibi_reference(p));
      c.key_order = keys::queries_positioned;
      c.sinks = {0.5, -1.0, 2.0, -inf};
      check(c);
    }
  dcase c;
  c.Sk = 200;
  c.Sq = 2;
  c.q_offset = 260;  // 61 and more past the last key
  c.window = 50;
  check(c);
  c.window = 62;  // the query at 260 reaches key 199, the one at 261 none
  check(c);
}

// A step or a prefill chunk inside a preallocated cache whose unfilled slots hold NaN: the call holds
// only the keys up to the last one some query may see by index or padding (detail::keys_seen_end), and
// a shorter row's tiles end at its last token (summarize_key_blocks), so no unfilled slot is read:
// causal by index, with a window, queries at explicit positions, kv_lengths, trailing padding in
// attention_mask and key_padding_mask, without causal too, ragged rows; every result against the
// reference over the whole cache, which skips unseen keys.
TEST_CASE("a cache with unfilled slots: the keys after every query and past all padding are left out", "[kernel]") {
  posenc::reference_terms<double> wavy;
  wavy.score_term = [](Index, Index h, Index i, Index j) { return term_formula(h, i, j); };
  for (const Index Sq : {1, 3})
    for (const Index last : {0, 40, 161}) {  // the last query's position
      dcase c;
      c.Sk = 300;
      c.Sq = Sq;
      c.q_offset = last - (Sq - 1);
      c.filled = {last + 1, last + 1};
      c.k_block = 32;
      check(c);
      check(c, wavy_terms{}, wavy);  // the caller's key indices in the tiles
      const problem p(c);
      check(c, posenc::alibi(posenc::alibi_config{.heads = 4}), alibi_reference(p));
      c.window = 9;
      check(c);
      c.key_order = keys::queries_positioned;
      c.sinks = {0.5, -1.0, 2.0, -inf};
      check(c);
      c.key_order = keys::ascending;
      c.sinks.clear();
      c.window = 0;
      c.causal = false;  // what the lengths and the masks cut
      for (const bool ragged : {false, true}) {  // row 1 filled to half of row 0
        if (ragged) c.filled = {last + 1, (last + 1) / 2};
        c.kv_lengths = {last + 1, ragged ? (last + 1) / 2 : last + 1};
        check(c);
        c.kv_lengths = {0, 0};
        check(c);
        c.kv_lengths.clear();
        c.attention_mask = true;
        check(c);
        c.key_padding_mask = true;
        check(c);
        c.attention_mask = false;
        check(c);
        c.key_padding_mask = false;
        c.causal = true;  // and causal, queries at explicit positions
        c.kv_lengths = {last + 1, ragged ? (last + 1) / 2 : last + 1};
        c.key_order = keys::queries_positioned;
        check(c);
        c.key_order = keys::ascending;
        c.kv_lengths.clear();
        c.causal = false;
      }
    }
}

TEST_CASE("leading_keys_unseen and keys_seen_end: no query sees a key left out, and they leave out all they can",
          "[kernel]") {
  std::mt19937 rng(5);
  for (int n = 0; n < 4000; ++n) {
    const Index B = 1 + n % 3, Sq = 1 + n % 5, Sk = std::uniform_int_distribution<Index>(0, 120)(rng);
    const Index W = std::uniform_int_distribution<Index>(0, 60)(rng);
    std::vector<std::int64_t> qp(static_cast<std::size_t>(B * Sq)), kp(static_cast<std::size_t>(B * Sk), 0),
        mask(static_cast<std::size_t>(B * Sk), 1);
    for (auto& x : qp) x = std::uniform_int_distribution<std::int64_t>(-10, 200)(rng);
    for (Index j = 0; j < B * Sk; ++j) kp[static_cast<std::size_t>(j)] = j % std::max<Index>(Sk, 1);
    posenc::attention_options opt;
    opt.causal = n % 11 != 0;
    opt.sliding_window = opt.causal ? W : 0;
    opt.q_offset = std::uniform_int_distribution<std::int64_t>(-20, 200)(rng);
    const int kind = n % 7;  // 0-2 plain, 3 query positions, 4 kv_lengths, 5 k_positions, 6 masks
    if (kind == 3) opt.q_positions = posenc::positions_view(qp.data(), B, Sq);
    std::vector<Index> lengths(static_cast<std::size_t>(B));
    for (auto& x : lengths) x = std::uniform_int_distribution<Index>(0, Sk)(rng);
    if (kind == 4) opt.kv_lengths = lengths;
    if (kind == 5) opt.k_positions = posenc::positions_view(kp.data(), B, Sk);
    std::vector<std::int64_t> padding(mask.size());
    for (auto& x : mask) x = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 0 : 1;
    for (auto& x : padding) x = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 5 : 0;
    if (kind == 6) {
      opt.attention_mask = posenc::tensor_map<const std::int64_t, 2>(mask.data(), B, Sk);       // 1 = token
      opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(padding.data(), B, Sk);  // nonzero = padding
    }
    INFO("n = " << n << ", B = " << B << ", Sq = " << Sq << ", Sk = " << Sk << ", W = " << opt.sliding_window
                << ", causal " << opt.causal << ", kind " << kind << ", q_offset " << opt.q_offset);
    const auto full = posenc::detail::resolve_masks(opt, B, Sq, Sk);
    const auto cut = posenc::detail::resolve_masks(opt, B, Sq, Sk, true);
    const Index first = cut.k_first;
    REQUIRE(first >= 0);
    REQUIRE(first <= std::max<Index>(Sk - 1, 0));
    const Index end = first + cut.k_len;  // one past the last key it holds
    REQUIRE(end <= Sk);
    CHECK(cut.k_len >= std::min<Index>(Sk, 1));
    if (kind == 5 || !opt.causal || opt.sliding_window == 0) CHECK(first == 0);
    // no query sees a key before `first` or from `end` on
    bool seen = false;
    for (Index b = 0; b < B; ++b)
      for (Index i = 0; i < Sq; ++i)
        for (Index j = 0; j < Sk; ++j) seen = seen || ((j < first || j >= end) && full.visible(b, i, j));
    CHECK_FALSE(seen);
    // maximal: the last key it holds is a token in some row, by index not after every query (or one
    // key is kept)
    if (end > first + 1) {
      bool token = false;
      for (Index b = 0; b < B; ++b) token = token || full.kv(b)[end - 1] != 0;
      CHECK(token);
      if (opt.causal && kind != 5) CHECK(end - 1 <= full.q_max);
    }
    if (end < Sk && end > first + 1 && opt.causal && kind != 5) {  // key `end` is padding or after every query
      bool token = false;
      for (Index b = 0; b < B; ++b) token = token || full.kv(b)[end] != 0;
      CHECK((!token || end > full.q_max));
    }
    if (end < Sk && !opt.causal)
      for (Index b = 0; b < B; ++b) CHECK(full.kv(b)[end] == 0);
    // maximal: key `first` is inside the window of the lowest query position (or one key is kept)
    if (first > 0 && first < Sk - 1) CHECK(posenc::detail::causal_visible(full.q_min, first, opt.sliding_window));
    if (first == 0 && kind != 5 && opt.causal && opt.sliding_window > 0 && Sk > 1)
      CHECK(posenc::detail::window_start(full.q_min, opt.sliding_window) <= 0);
    // the keys it holds: positions and validity of the caller's keys from `first` on
    for (Index b = 0; b < B; ++b)
      for (Index j = 0; j < cut.k_len; ++j) {
        CHECK(cut.kp(b)[j] == full.kp(b)[first + j]);
        CHECK(cut.kv(b)[j] == full.kv(b)[first + j]);
      }
    CHECK(cut.info(4, 2, 8, 8).k_first == first);
  }
}

TEST_CASE("logit softcap: on q.k and score terms, before ALiBi's bias, large logits", "[kernel]") {
  for (double cap : {5.0, 30.0}) {
    dcase c;
    c.softcap = cap;
    c.input_scale = 2.5;  // q.k / sqrt(d) of ~25: the cap bends them
    c.q_block = 8;
    c.k_block = 16;
    check(c);
    c.causal = false;
    check(c);
    c.causal = true;
    posenc::reference_terms<double> terms;
    terms.score_term = [](Index, Index h, Index i, Index j) { return term_formula(h, i, j); };
    check(c, wavy_terms{}, terms);
    const problem p(c);
    check(c, posenc::alibi(posenc::alibi_config{.heads = 4}), alibi_reference(p));
  }
}

TEST_CASE("sinks: per-head logits in the denominator, lse includes them, rows without keys stay zero", "[kernel]") {
  dcase c;
  c.sinks = {-1.5, 0.0, 2.0, 40.0};  // the last one dominates every row
  c.q_block = 8;
  c.k_block = 8;
  check(c);
  c.causal = false;
  check(c);
  c.causal = true;
  c.sinks = {-inf, 0.5, -inf, 3.0};  // -inf: a head without a sink
  c.attention_mask = true;           // row 1 starts with padding: its first queries see no key
  check(c);
  c.window = 5;
  c.softcap = 10.0;
  c.input_scale = 2.0;
  check(c);
  const problem p(c);
  check(c, posenc::alibi(posenc::alibi_config{.heads = 4}), alibi_reference(p));
  // decode step, MQA
  c.Sq = 1;
  c.q_offset = 36;
  c.Hkv = 1;
  check(c);
}

TEST_CASE("sinks: a query that sees no key has zero output and lse -inf", "[kernel]") {
  dcase c;
  c.B = 1;
  c.Sq = c.Sk = 6;
  c.H = c.Hkv = 2;
  c.sinks = {1.0, -2.0};
  c.attention_mask = true;
  problem p(c);
  std::fill(p.am.begin(), p.am.end(), 0);
  p.am[4] = 1;  // queries 0..3 see nothing, 4 and 5 see key 4
  const result got = run_kernel<double>(p, posenc::no_position{}, nullptr);
  for (Index h = 0; h < 2; ++h)
    for (Index i = 0; i < 6; ++i) {
      INFO("head " << h << " query " << i);
      const double l = got.lse[static_cast<std::size_t>(h * 6 + i)];
      if (i < 4) {
        CHECK(l == -inf);
        for (Index d = 0; d < c.Dv; ++d) CHECK(got.out[static_cast<std::size_t>((i * 2 + h) * c.Dv + d)] == 0.0);
      } else {
        // one key: lse = log(exp(s) + exp(sink)) and out = v_4 exp(s) / (exp(s) + exp(sink))
        double s = 0;
        for (Index d = 0; d < c.D; ++d)
          s += p.q[static_cast<std::size_t>((i * 2 + h) * c.D + d)] * p.k[static_cast<std::size_t>((4 * 2 + h) * c.D + d)];
        s /= std::sqrt(static_cast<double>(c.D));
        const double sink = c.sinks[static_cast<std::size_t>(h)];
        CHECK(l == Approx(std::log(std::exp(s) + std::exp(sink))).epsilon(1e-13));
        const double w = std::exp(s) / (std::exp(s) + std::exp(sink));
        for (Index d = 0; d < c.Dv; ++d)
          CHECK(got.out[static_cast<std::size_t>((i * 2 + h) * c.Dv + d)] ==
                Approx(w * p.v[static_cast<std::size_t>((4 * 2 + h) * c.Dv + d)]).margin(1e-14));
      }
    }
}

TEST_CASE("online_softmax::fold_sink after merging partial states equals the softmax with the sink", "[kernel]") {
  // Two key halves stepped separately (a split-KV decode), merged, then the sink folded once.
  const std::vector<double> s = {0.3, -1.2, 2.5, 0.7, -0.4, 1.9};
  const double sink = 1.1;
  Eigen::Matrix<double, 1, Eigen::Dynamic, Eigen::RowMajor> row(1, 6);
  for (Index j = 0; j < 6; ++j) row(0, j) = s[static_cast<std::size_t>(j)];
  posenc::detail::online_softmax<double> sm;
  sm.reset(1);
  posenc::matrix_map<double> a(row.data(), 1, 3, Eigen::OuterStride<>(6)), b(row.data() + 3, 1, 3, Eigen::OuterStride<>(6));
  sm.step(a);
  const double w_a = row(0, 0) + row(0, 1) + row(0, 2);  // weights relative to the first max
  sm.step(b);
  CHECK(sm.alpha(0) == 1.0);  // 2.5 stays the max
  const double factor = sm.fold_sink(0, sink);
  double z = std::exp(sink);
  for (double x : s) z += std::exp(x);
  CHECK(factor == 1.0);
  CHECK(sm.lse(0) == Approx(std::log(z)).epsilon(1e-14));
  CHECK(w_a / sm.l(0) == Approx((std::exp(0.3) + std::exp(-1.2) + std::exp(2.5)) / z).epsilon(1e-14));
  // A sink above every score moves the max: the accumulators are rescaled by the returned factor.
  posenc::detail::online_softmax<double> big;
  big.reset(1);
  for (Index j = 0; j < 6; ++j) row(0, j) = s[static_cast<std::size_t>(j)];
  posenc::matrix_map<double> all(row.data(), 1, 6, Eigen::OuterStride<>(6));
  big.step(all);
  const double f = big.fold_sink(0, 10.0);
  CHECK(f == Approx(std::exp(2.5 - 10.0)).epsilon(1e-14));
  z += std::exp(10.0) - std::exp(sink);
  CHECK(big.lse(0) == Approx(std::log(z)).epsilon(1e-14));
  // A row without keys stays empty; a poisoned row stays NaN.
  posenc::detail::online_softmax<double> empty;
  empty.reset(2);
  empty.l(1) = empty.m(1) = std::numeric_limits<double>::quiet_NaN();
  CHECK(empty.fold_sink(0, 3.0) == 1.0);
  CHECK(empty.lse(0) == -inf);
  empty.fold_sink(1, 3.0);
  CHECK(std::isnan(empty.lse(1)));
}

TEST_CASE("online_softmax::step: weights in whole packets and tails; a NaN poisons its row in any lane", "[kernel]") {
  using posenc::detail::online_softmax;
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  for (Index n = 1; n <= 40; ++n) {
    INFO("n = " << n);
    Eigen::Matrix<float, 3, Eigen::Dynamic, Eigen::RowMajor> s(3, n);
    for (Index j = 0; j < n; ++j) {
      s(0, j) = std::sin(0.7f * static_cast<float>(j)) * 3.0f;  // finite
      s(1, j) = j % 3 == 1 ? -std::numeric_limits<float>::infinity() : 0.25f * static_cast<float>(j);
      s(2, j) = -std::numeric_limits<float>::infinity();  // nothing visible
    }
    const Eigen::MatrixXf before = s;
    online_softmax<float> sm;
    sm.reset(3);
    sm.step(posenc::matrix_map<float>(s.data(), 3, n, Eigen::OuterStride<>(n)));
    for (Index r = 0; r < 2; ++r) {
      const float m = before.row(r).maxCoeff();
      double l = 0;
      for (Index j = 0; j < n; ++j) {
        const double w = std::exp(static_cast<double>(before(r, j)) - m);
        CHECK(s(r, j) == Approx(w).margin(1e-7));
        l += w;
      }
      CHECK(sm.m(r) == m);
      CHECK(sm.l(r) == Approx(l).epsilon(1e-6));
    }
    CHECK(s.row(2).isZero());
    CHECK(sm.l(2) == 0.0f);
    // one NaN among masked scores (the reported max may come out -inf), or among finite ones
    for (Index at = 0; at < n; ++at)
      for (const float other : {-std::numeric_limits<float>::infinity(), 1.5f}) {
        Eigen::Matrix<float, 1, Eigen::Dynamic> row = Eigen::Matrix<float, 1, Eigen::Dynamic>::Constant(n, other);
        row(at) = nan;
        online_softmax<float> one;
        one.reset(1);
        one.step(posenc::matrix_map<float>(row.data(), 1, n, Eigen::OuterStride<>(n)));
        CHECK(std::isnan(one.l(0)));
        CHECK(std::isnan(one.m(0)));
        CHECK(row.array().isNaN().all());
      }
  }
}

TEST_CASE("online_softmax::exp_of_weight: pexp_float's floats, within 2 ulp of exp, NaN stays NaN", "[kernel]") {
  using sm = posenc::detail::online_softmax<float>;
  namespace in = Eigen::internal;
  constexpr Index W = sm::width;
  // every 97th float of [flush_below, 0] (11 million of them), both ends, +0 and a few in between
  std::vector<float> xs{sm::flush_below, -0.0f, 0.0f, -1e-45f, -0.5f * std::log(2.0f)};
  std::uint32_t first = 0, last = 0;  // the bits of -0 and flush_below: a negative float's grow with |x|
  const float negative_zero = -0.0f;
  std::memcpy(&first, &negative_zero, sizeof first);
  std::memcpy(&last, &sm::flush_below, sizeof last);
  for (std::uint32_t u = first; u <= last; u += 97) {
    float x = 0;
    std::memcpy(&x, &u, sizeof x);
    xs.push_back(x);
  }
  while (xs.size() % W != 0) xs.push_back(0.0f);
  // 1.24 ulp at worst with the two-part ln 2 (Eigen 3.4's AVX-512 pexp, one part: 3.4 near flush_below)
  double worst_ulp = 0;
  Index differ = 0;  // from Eigen's generic pexp_float, whose arithmetic it keeps
  std::vector<float> got(W), eigen(W);
  for (std::size_t i = 0; i < xs.size(); i += W) {
    const auto x = in::ploadu<sm::packet>(xs.data() + i);
    in::pstoreu(got.data(), sm::exp_of_weight(x));
    in::pstoreu(eigen.data(), in::pexp_float(x));
    for (Index k = 0; k < W; ++k) {
      const double e = std::exp(static_cast<double>(xs[i + k]));
      const double ulp = std::ldexp(1.0, std::ilogb(e) - 23);  // of the float nearest e
      worst_ulp = std::max(worst_ulp, std::abs(got[k] - e) / ulp);
      differ += got[k] != eigen[k];
    }
  }
  CHECK(worst_ulp <= 2.0);
  CHECK(differ == 0);
  const auto nan = in::pset1<sm::packet>(std::numeric_limits<float>::quiet_NaN());
  in::pstoreu(got.data(), sm::exp_of_weight(nan));
  for (const float g : got) CHECK(std::isnan(g));
}

// flush_below is a constant expression (the static_assert), the float and double 4 log(eps) rounds to,
// so that flush_weight, initialized at run time from it, never reads it unset
TEST_CASE("online_softmax: flush_below is 4 log(eps), flush_weight 2 exp(flush_below)", "[kernel]") {
  using f = posenc::detail::online_softmax<float>;
  using d = posenc::detail::online_softmax<double>;
  static_assert(f::flush_below < -63.0f && d::flush_below < -144.0);
  CHECK(f::flush_below == 4.0f * std::log(std::numeric_limits<float>::epsilon()));
  CHECK(d::flush_below == 4.0 * std::log(std::numeric_limits<double>::epsilon()));
  CHECK(f::flush_weight == 2.0f * std::exp(f::flush_below));
  CHECK(d::flush_weight == 2.0 * std::exp(d::flush_below));
}

namespace {

/// Scores for the online_softmax steps over two blocks, by row kind: 0 finite, max rising in block 1;
/// 1 some -inf, max falling; 2 nothing visible in block 0, finite in block 1; 3 nothing visible; 4 a
/// NaN among -inf in block 1; 5 a NaN among finite ones in block 0; 6 a +inf in block 1; 7 a NaN
/// first among finite ones (a packet max loses it). With `unusual` false only kinds 0, 1 and 7 (the
/// packet paths), else 0-6 (row by row).
struct softmax_scores {
  bool unusual = false;
  [[nodiscard]] Index kind(Index r) const { return unusual ? r % 7 : (r % 3 == 2 ? 7 : r % 3); }
  [[nodiscard]] float operator()(Index blk, Index r, Index j, Index n) const {
    constexpr float finf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    const auto x = static_cast<float>(j), b = static_cast<float>(blk), rf = static_cast<float>(r);
    switch (kind(r)) {
      case 0: return std::sin(0.7f * x + rf) * 3.0f + 2.0f * b;
      case 1:
        return j % 3 == 1 ? -finf : 0.25f * x - 3.0f * b;
      case 2:
        return blk == 0 ? -finf : 0.1f * x;
      case 3:
        return -finf;
      case 4:
        return blk == 1 && j == r % n ? nan : -finf;
      case 5: return blk == 0 && j == (7 * r) % n ? nan : 0.5f * x;
      case 6:
        return blk == 1 && j == n / 2 ? finf : -0.5f * x;
      default: return blk == 0 && j == 0 ? nan : 0.3f * x;
    }
  }
};

/// The double-precision running softmax of `rows` rows of softmax_scores, block by block: check(blk,
/// step) runs one block's step (step(blk) fills and steps it) and then compares the state and the
/// weights (weight(r, j)) with the running reference.
struct softmax_oracle {
  softmax_scores score;
  Index rows, n;
  std::vector<double> m_ref, l_ref;
  std::vector<bool> poisoned;
  softmax_oracle(softmax_scores s, Index rows_, Index n_)
      : score(s),
        rows(rows_),
        n(n_),
        m_ref(static_cast<std::size_t>(rows_), -inf),
        l_ref(static_cast<std::size_t>(rows_), 0.0),
        poisoned(static_cast<std::size_t>(rows_), false) {}

  template <class Weight>
  void check_block(Index blk, const posenc::detail::online_softmax<float>& sm, Weight&& weight) {
    for (Index r = 0; r < rows; ++r) {
      INFO("block " << blk << ", row " << r);
      const auto i = static_cast<std::size_t>(r);
      double block_max = -inf;
      bool bad = false;
      for (Index j = 0; j < n; ++j) {
        const float x = score(blk, r, j, n);
        bad = bad || std::isnan(x) || x == std::numeric_limits<float>::infinity();
        block_max = std::max(block_max, static_cast<double>(x));
      }
      poisoned[i] = poisoned[i] || bad;
      if (poisoned[i]) {
        CHECK(std::isnan(sm.m(r)));
        CHECK(std::isnan(sm.l(r)));
        for (Index j = 0; j < n; ++j) CHECK(std::isnan(weight(r, j)));
        continue;
      }
      const double m_new = std::max(m_ref[i], block_max);
      const double alpha = m_new == -inf ? 1.0 : std::exp(m_ref[i] - m_new);
      double sum = 0;
      for (Index j = 0; j < n; ++j) {
        const double w = m_new == -inf ? 0.0 : std::exp(static_cast<double>(score(blk, r, j, n)) - m_new);
        CHECK(weight(r, j) == Approx(w).margin(1e-7));
        sum += w;
      }
      CHECK(sm.alpha(r) == Approx(alpha).margin(1e-7));
      l_ref[i] = alpha * l_ref[i] + sum;
      m_ref[i] = m_new;
      CHECK(static_cast<double>(sm.m(r)) == m_ref[i]);
      CHECK(sm.l(r) == Approx(l_ref[i]).epsilon(1e-6));
    }
  }
};

}  // namespace

TEST_CASE("online_softmax::step over two blocks: every row kind, 1-5 rows, whole packets and tails", "[kernel]") {
  using posenc::detail::online_softmax;
  // up to 4 rows of whole packets take the reductions side by side (AVX-512, step_rows4), the others
  // and any row that is not finite row by row; a row stride past n as the decode tiles have none
  for (const bool unusual : {false, true})
    for (const Index rows : {1, 2, 3, 4, 5})
      for (const Index n : {1, 5, 16, 32, 33, 48}) {
        INFO("rows = " << rows << ", n = " << n << (unusual ? ", unusual rows" : ""));
        const Index ld = n + 3;
        softmax_oracle oracle(softmax_scores{unusual}, rows, n);
        online_softmax<float> sm;
        sm.reset(rows);
        for (Index blk = 0; blk < 2; ++blk) {
          std::vector<float> s(static_cast<std::size_t>(rows * ld), 7.0f);  // the gaps must stay as they are
          for (Index r = 0; r < rows; ++r)
            for (Index j = 0; j < n; ++j) s[static_cast<std::size_t>(r * ld + j)] = oracle.score(blk, r, j, n);
          sm.step(posenc::matrix_map<float>(s.data(), rows, n, Eigen::OuterStride<>(ld)));
          oracle.check_block(blk, sm, [&](Index r, Index j) { return s[static_cast<std::size_t>(r * ld + j)]; });
          for (Index r = 0; r < rows; ++r)
            for (Index j = n; j < ld; ++j) CHECK(s[static_cast<std::size_t>(r * ld + j)] == 7.0f);
        }
      }
}

TEST_CASE(
    "online_softmax::step_columns: each row (lane) gets the step's weights, max, sum and alpha; NaN rules per lane",
    "[kernel]") {
  using posenc::detail::online_softmax;
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr Index W = online_softmax<float>::width;
  for (int pass = 0; pass < 2 * 6 * 4; ++pass) {
    const bool u = pass >= 6 * 4;
    const Index rows = std::array<Index, 6>{1, 3, W - 1, W, W + 1, 2 * W}[static_cast<std::size_t>(pass / 4 % 6)];
    const Index n = std::array<Index, 4>{1, 5, 32, 33}[static_cast<std::size_t>(pass % 4)];
    INFO("rows = " << rows << ", n = " << n << (u ? ", unusual rows" : ""));
    const Index ld = (rows + W - 1) / W * W;
    softmax_oracle oracle(softmax_scores{u}, rows, n);
    online_softmax<float> sm;
    sm.reset(ld);  // a row per lane; the padding rows are ignored
    for (Index blk = 0; blk < 2; ++blk) {
      // padding rows 0 (as the kernel's zero queries give), or NaN: it must not leak into the rows
      std::vector<float> st(static_cast<std::size_t>(n * ld), u ? nan : 0.0f);
      for (Index j = 0; j < n; ++j)
        for (Index r = 0; r < rows; ++r) st[static_cast<std::size_t>(j * ld + r)] = oracle.score(blk, r, j, n);
      sm.step_columns(st.data(), n, ld);
      oracle.check_block(blk, sm, [&](Index r, Index j) { return st[static_cast<std::size_t>(j * ld + r)]; });
    }
  }
}

TEST_CASE("attention_mask: HF 1 = token, 0 = padding, alone or with key_padding_mask (union)", "[kernel]") {
  dcase c;
  c.causal = false;
  c.q_block = 7;
  c.k_block = 5;
  c.attention_mask = true;
  check(c);
  c.key_padding_mask = true;
  check(c);
  c.causal = true;
  check(c);
  // The same masks as one key_padding_mask give the same result (bitwise: the same visible set).
  const problem p(c);
  problem q(c);
  for (std::size_t j = 0; j < q.kpm.size(); ++j) q.kpm[j] = (p.kpm[j] != 0 || p.am[j] == 0) ? 1 : 0;
  q.am.clear();
  const result a = run_kernel<float>(p, posenc::no_position{}, nullptr);
  const result b = run_kernel<float>(q, posenc::no_position{}, nullptr);
  CHECK(a.out == b.out);
  // And an all-ones attention_mask changes nothing.
  dcase plain;
  plain.attention_mask = true;
  problem ones(plain), none(plain);
  std::fill(ones.am.begin(), ones.am.end(), 1);
  none.am.clear();
  CHECK(run_kernel<double>(ones, posenc::no_position{}, nullptr).out ==
        run_kernel<double>(none, posenc::no_position{}, nullptr).out);
}

TEST_CASE("decoder options together: random shapes, windows, sinks, softcap, masks, positions, f16 / bf16 K/V",
          "[kernel]") {
  // The cases above set one option at a time on a few shapes; here every option is drawn at random,
  // so that they meet in combinations and shapes no case lists: head dims that are not whole packets
  // or pairs, value dims unlike the key dims, groups of 1 to 8 query heads, caches over several
  // split-KV segments (beyond 1024 keys), windows shorter and longer than a tile, rows that see no key;
  // K and V in float and double, and stored in f16 and bf16.
  std::mt19937 rng(2026);
  const auto pick = [&](std::initializer_list<Index> from) {
    return *(from.begin() +
             std::uniform_int_distribution<std::ptrdiff_t>(0, static_cast<std::ptrdiff_t>(from.size()) - 1)(rng));
  };
  const auto one_in = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng) == 0; };
  std::normal_distribution<double> normal;
  for (int i = 0; i < 24; ++i) {
    dcase c;
    c.seed = static_cast<unsigned>(100 + i);
    c.B = pick({1, 2});
    c.Hkv = pick({1, 2, 4});
    c.H = c.Hkv * pick({1, 2, 3, 4, 8});
    c.D = pick({8, 16, 33, 64, 66, 128});
    c.Dv = one_in(3) ? pick({12, 40}) : c.D;
    c.Sq = pick({1, 1, 2, 3, 5, 17});
    c.Sk = std::max(c.Sq, pick({1, 31, 64, 100, 700, 1100, 2100}));
    c.q_offset = one_in(4) ? std::uniform_int_distribution<Index>(0, c.Sk)(rng) : c.Sk - c.Sq;
    c.causal = !one_in(4);
    if (c.causal && one_in(3)) c.window = pick({1, 7, 64, 300, 1000});
    if (one_in(3)) c.softcap = static_cast<double>(pick({5, 30}));
    if (one_in(3))
      for (Index h = 0; h < c.H; ++h) c.sinks.push_back(one_in(5) ? -inf : normal(rng));
    c.attention_mask = one_in(4);
    c.key_padding_mask = one_in(4);
    if (one_in(4))
      for (Index b = 0; b < c.B; ++b) c.kv_lengths.push_back(std::uniform_int_distribution<Index>(0, c.Sk)(rng));
    c.key_order = one_in(6) ? keys::shuffled : one_in(5) ? keys::queries_positioned : keys::ascending;
    c.input_scale = one_in(3) ? 2.5 : 1.0;
    if (one_in(2)) {
      c.q_block = 8;
      c.k_block = pick({16, 32});
    }
    check(c);
    check_half_kv(c);
  }
}

TEST_CASE("decoder options: invalid values throw posenc::error before anything is written", "[kernel]") {
  const Index B = 2, S = 5, H = 4, Hkv = 2, D = 8;
  std::vector<double> q(B * S * H * D, 0.5), k(B * S * Hkv * D, 0.25), v(B * S * Hkv * D, 1.0);
  std::vector<double> out(B * S * H * D, 7.0), lse(B * H * S, 7.0);
  std::vector<std::int64_t> am(B * S, 1);
  const std::vector<double> sinks3 = {0, 0, 0}, sinks_nan = {0, std::nan(""), 0, 0}, sinks_inf = {0, 0, inf, 0};
  auto untouched = [&] {
    CHECK(std::all_of(out.begin(), out.end(), [](double x) { return x == 7.0; }));
    CHECK(std::all_of(lse.begin(), lse.end(), [](double x) { return x == 7.0; }));
  };
  auto both = [&](posenc::attention_options opt, const char* needle) {
    CHECK_THROWS_WITH(posenc::attention<double>(posenc::bshd<const double>(q.data(), B, S, H, D),
                                                posenc::bshd<const double>(k.data(), B, S, Hkv, D),
                                                posenc::bshd<const double>(v.data(), B, S, Hkv, D),
                                                posenc::bshd(out.data(), B, S, H, D),
                                                posenc::tensor_map<double, 3>(lse.data(), B, H, S),
                                                posenc::no_position{}, opt),
                      Catch::Contains(needle));
    untouched();
    CHECK_THROWS_AS(posenc::reference_attention<double>(posenc::bshd<const double>(q.data(), B, S, H, D),
                                                        posenc::bshd<const double>(k.data(), B, S, Hkv, D),
                                                        posenc::bshd<const double>(v.data(), B, S, Hkv, D),
                                                        posenc::bshd(out.data(), B, S, H, D), opt),
                    posenc::error);
    untouched();
  };
  SECTION("sliding_window < 0") { both({.causal = true, .sliding_window = -1}, "sliding_window: must be >= 0"); }
  SECTION("sliding_window without causal") { both({.sliding_window = 4}, "sliding_window: requires causal"); }
  SECTION("logit_softcap NaN") { both({.logit_softcap = std::nan("")}, "logit_softcap: must be 0 (off) or finite"); }
  SECTION("logit_softcap < 0") { both({.logit_softcap = -30.0}, "logit_softcap"); }
  SECTION("logit_softcap inf") { both({.logit_softcap = inf}, "logit_softcap"); }
  SECTION("sinks of the wrong size") { both({.sinks = sinks3}, "sinks: must have one entry per query head"); }
  SECTION("sinks NaN or +inf") {
    both({.sinks = sinks_nan}, "sinks: entries must be finite or -inf");
    both({.sinks = sinks_inf}, "sinks: entries must be finite or -inf");
  }
  SECTION("attention_mask values other than 0 and 1") {
    am[7] = 2;
    both({.attention_mask = posenc::tensor_map<const std::int64_t, 2>(am.data(), B, S)},
         "attention_mask: entries must be 0 or 1");
    am[7] = -1;
    both({.attention_mask = posenc::tensor_map<const std::int64_t, 2>(am.data(), B, S)}, "attention_mask");
  }
  SECTION("attention_mask shape") {
    both({.attention_mask = posenc::tensor_map<const std::int64_t, 2>(am.data(), B, S - 1)},
         "attention_mask: must be [batch, k_len]");
  }
}

// resolve_masks and summarize_key_blocks fill each array and each block summary by their own
// vectorizable loops; here against the per-key formulas (FORMAT.md 3: a key is padding when
// key_padding_mask != 0, attention_mask == 0 or j >= kv_lengths[b]), over lengths around the vector
// widths and blocks, every option alone and together, and positions ascending with gaps and repeats,
// shuffled, or descending. Each set is also resolved into one call_masks kept across the loop, as
// attention reuses its thread's (resolve_masks_into): nothing of the set before may remain.
TEST_CASE("resolve_masks and summarize_key_blocks: every key and block against the per-key formulas", "[kernel]") {
  std::mt19937 rng(11);
  enum class order { offset, gaps, shuffled, descending };
  posenc::detail::call_masks reused;
  for (const Index B : {1, 3})
    for (const Index Sk : {0, 1, 7, 31, 32, 33, 64, 100, 1000})
      for (const order ord : {order::offset, order::gaps, order::shuffled, order::descending})
        for (int opts = 0; opts < 8; ++opts) {
          const Index Sq = Sk % 5 + 1;
          INFO("B = " << B << ", Sk = " << Sk << ", order " << static_cast<int>(ord) << ", options " << opts);
          std::vector<std::int64_t> qp(static_cast<std::size_t>(B * Sq)), kp(static_cast<std::size_t>(B * Sk));
          std::vector<std::int64_t> kpm(kp.size()), am(kp.size()), lengths(static_cast<std::size_t>(B));
          std::uniform_int_distribution<int> coin(0, 3);
          for (Index b = 0; b < B; ++b) {
            std::int64_t p = -5 + 1000 * b;
            for (Index j = 0; j < Sk; ++j) {
              p += ord == order::gaps ? coin(rng) : 1;  // gaps of 0 (repeated positions) to 3
              kp[static_cast<std::size_t>(b * Sk + j)] = ord == order::descending ? -p : p;
            }
            if (ord == order::shuffled) std::shuffle(kp.begin() + b * Sk, kp.begin() + (b + 1) * Sk, rng);
            for (Index i = 0; i < Sq; ++i) qp[static_cast<std::size_t>(b * Sq + i)] = 7 * i - 3 * b;
            lengths[static_cast<std::size_t>(b)] = Sk == 0 ? 0 : std::uniform_int_distribution<Index>(0, Sk)(rng);
          }
          for (auto& x : kpm) x = coin(rng) == 0 ? 2 : 0;
          for (auto& x : am) x = coin(rng) == 0 ? 0 : 1;
          posenc::attention_options opt;
          opt.q_offset = 40;
          if (ord != order::offset) {
            opt.q_positions = posenc::positions_view(qp.data(), B, Sq);
            opt.k_positions = posenc::positions_view(kp.data(), B, Sk);
          }
          if ((opts & 1) != 0) opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(kpm.data(), B, Sk);
          if ((opts & 2) != 0) opt.attention_mask = posenc::tensor_map<const std::int64_t, 2>(am.data(), B, Sk);
          if ((opts & 4) != 0) opt.kv_lengths = lengths;
          const auto m = posenc::detail::resolve_masks(opt, B, Sq, Sk);
          REQUIRE(m.q_pos.size() == qp.size());
          REQUIRE(m.k_pos.size() == kp.size());
          REQUIRE(m.k_valid.size() == kp.size());
          std::int64_t q_lo = 0, q_hi = -1, k_lo = 0, k_hi = -1;
          for (Index b = 0; b < B; ++b) {
            for (Index i = 0; i < Sq; ++i) {
              const auto at = static_cast<std::size_t>(b * Sq + i);
              const std::int64_t want = ord != order::offset ? qp[at] : 40 + i;
              CHECK(m.q_pos[at] == want);
              q_lo = b + i == 0 ? want : std::min(q_lo, want);
              q_hi = b + i == 0 ? want : std::max(q_hi, want);
            }
            for (Index j = 0; j < Sk; ++j) {
              const auto at = static_cast<std::size_t>(b * Sk + j);
              const std::int64_t want = ord != order::offset ? kp[at] : j;
              CHECK(m.k_pos[at] == want);
              k_lo = b + j == 0 ? want : std::min(k_lo, want);
              k_hi = b + j == 0 ? want : std::max(k_hi, want);
              const bool padding = ((opts & 1) != 0 && kpm[at] != 0) || ((opts & 2) != 0 && am[at] == 0) ||
                                   ((opts & 4) != 0 && j >= lengths[static_cast<std::size_t>(b)]);
              CHECK(m.k_valid[at] == (padding ? 0 : 1));
            }
          }
          CHECK(m.q_min == q_lo);
          CHECK(m.q_max == q_hi);
          CHECK(m.k_min == k_lo);
          CHECK(m.k_max == k_hi);
          posenc::detail::resolve_masks_into(reused, opt, B, Sq, Sk);
          CHECK((reused.batch == B && reused.q_len == Sq && reused.k_len == Sk && reused.k_first == 0));
          CHECK((reused.causal == m.causal && reused.window == m.window));
          CHECK((reused.q_pos == m.q_pos && reused.k_pos == m.k_pos && reused.k_valid == m.k_valid));
          CHECK((reused.q_min == q_lo && reused.q_max == q_hi && reused.k_min == k_lo && reused.k_max == k_hi));
          for (const Index block : {1, 7, 32, 64}) {
            const auto blocks = posenc::detail::summarize_key_blocks(m, block);
            const Index nkb = (Sk + block - 1) / block;
            REQUIRE(static_cast<Index>(blocks.size()) == B * nkb);
            for (Index b = 0; b < B; ++b) {
              // the block holding the row's last valid key ends with it; the blocks after it keep their size
              Index row_end = 0;
              for (Index j = 0; j < Sk; ++j)
                if (m.k_valid[static_cast<std::size_t>(b * Sk + j)] != 0) row_end = j + 1;
              for (Index kb = 0; kb < nkb; ++kb) {
                const auto& s = blocks[static_cast<std::size_t>(b * nkb + kb)];
                const Index first = kb * block, cols = std::min(block, (first < row_end ? row_end : Sk) - first);
                const auto* p = kp.data() + b * Sk + first;
                std::vector<std::int64_t> pos(static_cast<std::size_t>(cols));
                for (Index j = 0; j < cols; ++j)
                  pos[static_cast<std::size_t>(j)] = ord != order::offset ? p[j] : first + j;
                Index valid = 0;
                for (Index j = 0; j < cols; ++j) valid += m.k_valid[static_cast<std::size_t>(b * Sk + first + j)];
                CHECK(s.first == first);
                CHECK(s.cols == cols);
                CHECK(s.valid == valid);
                CHECK(s.pos_min == *std::min_element(pos.begin(), pos.end()));
                CHECK(s.pos_max == *std::max_element(pos.begin(), pos.end()));
                CHECK(s.ascending == std::is_sorted(pos.begin(), pos.end()));
              }
            }
          }
        }
}

TEST_CASE("position scans: range, ascending and consecutive against per-element definitions", "[kernel]") {
  constexpr std::int64_t lo64 = std::numeric_limits<std::int64_t>::min(),
                         hi64 = std::numeric_limits<std::int64_t>::max();
  std::mt19937 rng(5);
  for (const Index n : {0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 257})
    for (int kind = 0; kind < 6; ++kind) {
      INFO("n = " << n << ", kind " << kind);
      // 0 consecutive from a start near the int64 maximum (the last step would wrap), 1 consecutive
      // from the minimum, 2 ascending with repeats, 3 random over the whole int64 range, 4 consecutive
      // with one step of 2, 5 consecutive with one step back
      std::vector<std::int64_t> p(static_cast<std::size_t>(n));
      std::uniform_int_distribution<std::int64_t> any(lo64, hi64);
      std::uniform_int_distribution<int> step(0, 2);
      const auto at = [&](Index j) -> std::int64_t& { return p[static_cast<std::size_t>(j)]; };
      for (Index j = 0; j < n; ++j) {
        switch (kind) {
          case 0:
            at(j) = hi64 - n + 1 + j;
            break;
          case 1:
            at(j) = lo64 + j;
            break;
          case 2:
            at(j) = j == 0 ? -3 : at(j - 1) + step(rng);
            break;
          case 3:
            at(j) = any(rng);
            break;
          default:
            at(j) = 1000 + j;
            break;
        }
      }
      if (kind == 4 && n > 2) at(n / 2) += 1;
      if (kind == 5 && n > 2) at(n - 1) = at(n - 2) - 1;
      std::int64_t lo = 42, hi = -42;
      posenc::detail::position_range(p.data(), n, lo, hi);
      if (n == 0) {
        CHECK(lo == 42);  // left as they were
        CHECK(hi == -42);
      } else {
        std::int64_t want_lo = hi64, want_hi = lo64;
        for (const std::int64_t x : p) {
          if (x < want_lo) want_lo = x;
          if (x > want_hi) want_hi = x;
        }
        CHECK(lo == want_lo);
        CHECK(hi == want_hi);
      }
      bool up = true, next = true;
      for (Index j = 1; j < n; ++j) {
        up = up && at(j - 1) <= at(j);
        next = next && at(j - 1) < hi64 && at(j) == at(j - 1) + 1;
      }
      CHECK(posenc::detail::ascending_positions(p.data(), n) == up);
      CHECK(posenc::detail::consecutive_positions(p.data(), n) == next);
    }
  // a run ending at the int64 maximum is consecutive; one that would step past it is not
  const std::array<std::int64_t, 3> top{hi64 - 2, hi64 - 1, hi64}, wrap{hi64 - 1, hi64, lo64};
  CHECK(posenc::detail::consecutive_positions(top.data(), 3));
  CHECK_FALSE(posenc::detail::consecutive_positions(wrap.data(), 3));
}
