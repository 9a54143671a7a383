// The fused attention kernel (posenc/attention.hpp) against the double reference attention
// (posenc/reference.hpp), which materializes every score and applies every term by its plainest
// per-element formula. Test encodings defined here exercise each hook kind; the reference gets the
// same formula as a per-element callable written independently of the hook's tiled code.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <posenc/attention.hpp>
#include <posenc/detail/relative.hpp>
#include <posenc/reference.hpp>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "attention_cases.hpp"
#include "golden.hpp"

using namespace attention_cases;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

}  // namespace

// ---- plain attention -------------------------------------------------------------------------------

TEST_CASE("attention: plain, small sizes, every option combination, double", "[kernel]") {
  for (const config& c : small_configs()) check_case<double>(c, posenc::no_position{});
}

TEST_CASE("attention: plain, small sizes, every option combination, float", "[kernel]") {
  for (const config& c : small_configs()) check_case<float>(c, posenc::no_position{});
}

TEST_CASE("attention: plain, large sizes (covering subset), double and float", "[kernel]") {
  for (const config& c : large_configs()) {
    check_both(c, posenc::no_position{});
  }
}

TEST_CASE("attention: default tiles with 129 x 700 (two key blocks, partial query block)", "[kernel]") {
  check_both(config{.B = 1, .Sq = 129, .Sk = 700, .D = 64, .Dv = 64, .causal = true, .off = offset::q_offset},
             posenc::no_position{});
}

// The packed tile products (detail/tile_gemm.hpp) reuse one packed K/V block for several query
// blocks and cut a causal block at a micro-panel boundary (multiples of 48 rows in float, 24 in
// double with AVX-512): these shapes put that cut strictly inside key blocks, give value widths
// that leave partial panels, and mix packed query blocks with a one-row block of a head without
// GQA, which takes the expression path (GEMV), in the same work item. Query blocks of 50 rows over
// blocks of 112 and 128 keys put cuts into the last, shorter panels.
TEST_CASE("attention: packed tile products, causal cuts inside key blocks, mixed short query blocks", "[kernel]") {
  for (config c : {config{.B = 1, .Sq = 300, .Sk = 300, .H = 2, .Hkv = 1, .D = 32, .Dv = 40, .causal = true,
                          .q_block = 64, .k_block = 160},
                   config{.B = 2, .Sq = 100, .Sk = 333, .H = 3, .Hkv = 3, .D = 16, .Dv = 24, .causal = true,
                          .off = offset::q_offset, .q_block = 40, .k_block = 200},
                   config{.B = 2, .Sq = 129, .Sk = 300, .H = 2, .Hkv = 2, .D = 16, .Dv = 24, .causal = true,
                          .off = offset::q_offset, .q_block = 64, .k_block = 200},
                   config{.B = 2, .Sq = 70, .Sk = 250, .H = 8, .Hkv = 2, .D = 24, .Dv = 8, .causal = true,
                          .pad = padding::lengths, .off = offset::q_offset, .q_block = 64, .k_block = 128},
                   config{.B = 1, .Sq = 90, .Sk = 90, .H = 4, .Hkv = 1, .D = 8, .Dv = 56, .causal = true,
                          .off = offset::explicit_positions, .q_block = 17, .k_block = 97},
                   config{.B = 1, .Sq = 200, .Sk = 200, .H = 2, .Hkv = 2, .D = 16, .Dv = 16, .causal = true,
                          .off = offset::shuffled_keys, .q_block = 50, .k_block = 120},
                   config{.B = 1, .Sq = 230, .Sk = 230, .H = 2, .Hkv = 1, .D = 64, .Dv = 64, .causal = true,
                          .q_block = 50, .k_block = 112},
                   config{.B = 1, .Sq = 260, .Sk = 260, .H = 2, .Hkv = 1, .D = 16, .Dv = 24, .causal = true,
                          .q_block = 50, .k_block = 128}}) {
    INFO(describe(c));
    check_both(c, posenc::no_position{});
  }
}

TEST_CASE("attention: explicit scale, and the overload without lse writes the same output", "[kernel]") {
  config c;
  c.Sq = 37;
  c.Sk = 65;
  const problem p(c);
  auto opt = p.options();
  opt.scale = 0.3;
  const auto qv = view<const double>(p.q.data(), c.B, c.Sq, c.H, c.D, c.order);
  const auto kv = view<const double>(p.k.data(), c.B, c.Sk, c.Hkv, c.D, c.order);
  const auto vv = view<const double>(p.v.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order);
  std::vector<double> a(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv)), b(a.size()), r(a.size());
  std::vector<double> lse(static_cast<std::size_t>(c.B * c.H * c.Sq));
  posenc::attention<double>(qv, kv, vv, view<double>(a.data(), c.B, c.Sq, c.H, c.Dv, c.order), posenc::no_position{},
                            opt);
  posenc::attention<double>(qv, kv, vv, view<double>(b.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                            posenc::tensor_map<double, 3>(lse.data(), c.B, c.H, c.Sq), posenc::no_position{}, opt);
  posenc::reference_attention<double>(qv, kv, vv, view<double>(r.data(), c.B, c.Sq, c.H, c.Dv, c.order), opt);
  CHECK(a == b);
  expect_close<double>(a, r, "out");

  // q, k and v as mutable views of the host's buffers (what posenc::bshd(double*, ...) gives): the
  // same call, with and without lse, options given as a braced list.
  std::vector<double> q(p.q), k(p.k), v(p.v), m(a.size()), ml(a.size()), lse2(lse.size());
  const auto qm = view<double>(q.data(), c.B, c.Sq, c.H, c.D, c.order);
  const auto km = view<double>(k.data(), c.B, c.Sk, c.Hkv, c.D, c.order);
  const auto vm = view<double>(v.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order);
  posenc::attention(qm, km, vm, view<double>(m.data(), c.B, c.Sq, c.H, c.Dv, c.order), posenc::no_position{},
                    {.scale = 0.3,
                     .causal = opt.causal,
                     .q_offset = opt.q_offset,
                     .q_positions = opt.q_positions,
                     .k_positions = opt.k_positions,
                     .key_padding_mask = opt.key_padding_mask,
                     .kv_lengths = opt.kv_lengths});
  posenc::attention(qm, kv, vm, view<double>(ml.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                    posenc::tensor_map<double, 3>(lse2.data(), c.B, c.H, c.Sq), posenc::no_position{}, opt);
  expect_close<double>(m, r, "out, mutable q, k, v");
  expect_close<double>(ml, r, "out, mutable q, v, with lse");
  CHECK(lse2 == lse);
}

// ---- packing in pieces ----------------------------------------------------------------------------

// The kernel transforms Q/K rows piece by piece and packs each piece at its offset
// (fused_attention::transform_packed); that is only the whole operand's layout when the pieces end
// at multiples of tile_gemm::pack_step. Checked bitwise against packing all rows at once.
template <class T>
void check_piecewise_packing() {
  using gemm = posenc::detail::tile_gemm<T>;
  for (const Index depth : {1, 8, 64, 129})
    for (const Index rows : {Index{1}, Index{3}, gemm::pack_step - 1, gemm::pack_step, gemm::pack_step + 5,
                             3 * gemm::pack_step + 17}) {
      INFO("rows " << rows << " depth " << depth);
      std::mt19937 rng(static_cast<unsigned>(rows * 1000 + depth));
      std::normal_distribution<double> n;
      std::vector<T> m(static_cast<std::size_t>(rows * depth));
      for (auto& e : m) e = static_cast<T>(n(rng));
      for (const bool as_a : {true, false}) {
        typename gemm::buffer whole(rows * depth), pieces(rows * depth);
        auto pack = [&](T* dst, const T* from, Index n) {
          if (as_a) gemm::pack_a(dst, from, depth, n, depth);
          else gemm::pack_b(dst, from, depth, n, depth);
        };
        pack(whole.data(), m.data(), rows);
        for (Index r = 0; r < rows; r += gemm::pack_step)
          pack(pieces.data() + r * depth, m.data() + r * depth, std::min(gemm::pack_step, rows - r));
        CHECK(whole == pieces);
      }
    }
}

TEST_CASE("tile_gemm: packing in pack_step pieces gives the whole operand's layout", "[kernel]") {
  check_piecewise_packing<float>();
  check_piecewise_packing<double>();
}

// ---- each hook kind ------------------------------------------------------------------------------

// A token transformed twice would be rotated twice (the reference comparison fails) or counted
// twice (the bounds below fail); a key block no query sees, and a query block that sees no key, may
// be skipped, so under masks the counts are bounds, and exact when every block is seen.
TEST_CASE("attention: Q/K transform once per token (each kv head once under GQA)", "[kernel]") {
  Eigen::ThreadPool two(2);
  for (const config& base : {config{.B = 2, .Sq = 37, .Sk = 65, .H = 4, .Hkv = 2, .causal = true,
                                    .off = offset::q_offset, .q_block = 16, .k_block = 24},
                             config{.B = 1, .Sq = 257, .Sk = 257, .H = 3, .Hkv = 1, .order = layout::bhsd,
                                    .pad = padding::mask, .off = offset::shuffled_keys},
                             config{.B = 3, .Sq = 7, .Sk = 65, .H = 2, .Hkv = 2, .causal = true,
                                    .pad = padding::lengths, .off = offset::explicit_positions, .q_block = 4,
                                    .k_block = 16},
                             config{.B = 2, .Sq = 300, .Sk = 290, .H = 4, .Hkv = 2, .q_block = 16, .k_block = 32},
                             config{.B = 1, .Sq = 65, .Sk = 65, .H = 2, .Hkv = 2, .q_block = 16, .k_block = 24},
                             // blocks of several transform_packed pieces (48 rows at D = 64) with a
                             // short last piece: one item per kv head (keys transformed per item, packed only), causal
                             // cuts inside a key block; then items sharing the packed keys
                             config{.B = 2, .Sq = 200, .Sk = 200, .H = 2, .Hkv = 2, .D = 64, .causal = true,
                                    .q_block = 100, .k_block = 150},
                             config{.B = 1, .Sq = 200, .Sk = 230, .H = 4, .Hkv = 2, .D = 64, .q_block = 50,
                                    .k_block = 150}}) {
    INFO(describe(base));
    const problem p(base);
    const bool every_block_seen = !base.causal && base.pad == padding::none;
    for (Eigen::ThreadPoolInterface* pool : {static_cast<Eigen::ThreadPoolInterface*>(nullptr),
                                             static_cast<Eigen::ThreadPoolInterface*>(&two)}) {
      rotate_qk enc;
      const result got = run_kernel<double>(p, enc, pool);
      const result want = run_reference<double>(p, {}, rotate_reference(p));
      expect_close<double>(got.out, want.out, "out");
      const long queries = base.B * base.Sq * base.H, keys = base.B * base.Sk * base.Hkv;
      CHECK(enc.queries->load() <= queries);
      CHECK(enc.keys->load() <= keys);
      if (every_block_seen) {
        CHECK(enc.queries->load() == queries);
        CHECK(enc.keys->load() == keys);
      }
    }
    check_case<float>(base, rotate_qk{}, {}, rotate_reference(p));
  }
}

namespace {
// The same rotation for the queries only (transforms_keys = false): the keys are read as given.
struct rotate_queries_only : rotate_qk {
  static constexpr bool transforms_keys = false;
};
static_assert(posenc::has_qk_transform<rotate_queries_only, float> &&
              !posenc::has_key_transform<rotate_queries_only, float> && posenc::has_key_transform<rotate_qk, float>);
}  // namespace

TEST_CASE("attention: a query-only transform (transforms_keys = false) never touches the keys", "[kernel]") {
  Eigen::ThreadPool two(2);
  // one item per kv head, items sharing a kv head (GQA, several query blocks), and a hook-free
  // packed path
  for (const config& c : {config{.B = 2, .Sq = 37, .Sk = 65, .H = 4, .Hkv = 2, .causal = true,
                                 .off = offset::q_offset, .q_block = 16, .k_block = 24},
                          config{.B = 1, .Sq = 200, .Sk = 230, .H = 4, .Hkv = 2, .D = 64, .pad = padding::mask,
                                 .q_block = 50, .k_block = 150}}) {
    INFO(describe(c));
    const problem p(c);
    for (Eigen::ThreadPoolInterface* pool : {static_cast<Eigen::ThreadPoolInterface*>(nullptr),
                                             static_cast<Eigen::ThreadPoolInterface*>(&two)}) {
      rotate_queries_only enc;
      expect_close<double>(run_kernel<double>(p, enc, pool).out,
                           run_reference<double>(p, {}, rotate_reference(p, false)).out, "out");
      CHECK(enc.keys->load() == 0);
      CHECK(enc.queries->load() == c.B * c.Sq * c.H);
    }
    check_case<float>(c, rotate_queries_only{}, {}, rotate_reference(p, false));
  }
}

TEST_CASE("attention: position-only bias per tile, and masked tiles are skipped", "[kernel]") {
  for (config c : {config{.B = 2, .Sq = 65, .Sk = 257, .H = 2, .Hkv = 1, .causal = true, .off = offset::q_offset,
                          .q_block = 16, .k_block = 32},
                   config{.B = 2, .Sq = 257, .Sk = 257, .causal = true, .q_block = 32, .k_block = 32},
                   config{.B = 3, .Sq = 64, .Sk = 200, .order = layout::bhsd, .pad = padding::lengths,
                          .q_block = 16, .k_block = 32},
                   config{.B = 1, .Sq = 1000, .Sk = 1000, .H = 1, .Hkv = 1, .causal = true}}) {
    const problem p(c);
    const auto m = masks_of(p);
    std::vector<unsigned char> valid(m.k_valid);
    distance_bias enc{.k_valid = &valid, .k_len = c.Sk, .causal = c.causal};
    check_both(c, enc, distance_bias_terms(p));
    CHECK_FALSE(enc.saw_dead_tile->load());
  }
}

TEST_CASE("attention: relative score terms with clipped tables (query and key side gathers)", "[kernel]") {
  for (config c : {config{.B = 2, .Sq = 37, .Sk = 65, .H = 2, .Hkv = 1, .causal = true, .q_block = 16, .k_block = 24},
                   config{.B = 1, .Sq = 257, .Sk = 257, .order = layout::bhsd, .pad = padding::mask,
                          .off = offset::shuffled_keys},
                   config{.B = 3, .Sq = 65, .Sk = 64, .H = 4, .Hkv = 2, .pad = padding::lengths,
                          .off = offset::explicit_positions, .q_block = 8, .k_block = 16}}) {
    const problem p(c);
    const relative_terms enc(3, c.D, 7);
    check_both(c, enc, relative_reference(p, enc));
  }
}

TEST_CASE("attention: value terms accumulated per relative bucket", "[kernel]") {
  for (config c : {config{.B = 2, .Sq = 37, .Sk = 65, .H = 2, .Hkv = 1, .causal = true, .q_block = 16, .k_block = 24},
                   config{.B = 1, .Sq = 257, .Sk = 1000, .order = layout::bhsd, .pad = padding::mask,
                          .off = offset::q_offset},
                   config{.B = 3, .Sq = 65, .Sk = 64, .H = 4, .Hkv = 2, .causal = true, .pad = padding::lengths,
                          .off = offset::shuffled_keys, .q_block = 8, .k_block = 16}}) {
    const problem p(c);
    const relative_values enc(2, c.H, c.Dv, 11);
    check_both(c, enc, value_reference(p, enc));
  }
}

namespace {
// relative_values that also names the one bucket of a tile beyond +-K (uniform_value_bucket), and
// counts the tiles it named.
struct relative_values_uniform : relative_values {
  using relative_values::relative_values;
  std::shared_ptr<std::atomic<long>> uniform_tiles = std::make_shared<std::atomic<long>>(0);
  template <class T>
  [[nodiscard]] std::int32_t uniform_value_bucket(const posenc::tile<T>& t) const {
    const auto r = posenc::detail::clipped_relative_range(t.q_pos, t.rows, t.k_pos, t.cols, K);
    if (r.count() != 1) return -1;
    ++*uniform_tiles;
    return static_cast<std::int32_t>(r.lo);
  }
};
}  // namespace

TEST_CASE("attention: value terms of tiles in one bucket (uniform_value_bucket) add row sums", "[kernel]") {
  // Small tiles and K = 2: most tiles lie entirely beyond +-2 (one bucket), the diagonal ones do not.
  for (config c : {config{.B = 2, .Sq = 65, .Sk = 65, .H = 2, .Hkv = 1, .causal = true, .q_block = 8, .k_block = 8},
                   config{.B = 1, .Sq = 40, .Sk = 90, .H = 2, .Hkv = 2, .pad = padding::mask, .off = offset::q_offset,
                          .q_block = 8, .k_block = 16}}) {
    const problem p(c);
    const relative_values_uniform enc(2, c.H, c.Dv, 5);
    check_both(c, enc, value_reference(p, enc));
    CHECK(enc.uniform_tiles->load() > 0);
  }
}

// The last four: a sliding window at the end of a long cache, where the call leaves out the keys
// before every query's window (detail::leading_keys_unseen) and the hooks must still see the
// caller's key indices (distance_bias reads per-key data by tile.k_first) and positions (rotate_qk,
// the position bias); kv_lengths cut row 1 to 150 keys, which W = 20 puts out of its queries' reach.
TEST_CASE("attention: every hook at once, with the encoding's own logit scale", "[kernel]") {
  for (config c : {config{.B = 2, .Sq = 65, .Sk = 257, .H = 4, .Hkv = 2, .causal = true, .pad = padding::mask,
                          .off = offset::q_offset, .q_block = 16, .k_block = 32},
                   config{.B = 3, .Sq = 37, .Sk = 37, .H = 2, .Hkv = 2, .order = layout::bhsd,
                          .pad = padding::lengths, .off = offset::shuffled_keys},
                   config{.B = 3, .Sq = 3, .Sk = 300, .H = 4, .Hkv = 2, .causal = true, .pad = padding::lengths,
                          .off = offset::q_offset, .window = 20},
                   config{.B = 3, .Sq = 3, .Sk = 300, .H = 4, .Hkv = 2, .causal = true, .pad = padding::lengths,
                          .off = offset::q_offset, .window = 200, .k_block = 32,
                          .path = posenc::attention_path::tiled},
                   config{.B = 3, .Sq = 40, .Sk = 300, .H = 2, .Hkv = 1, .order = layout::bhsd, .causal = true,
                          .pad = padding::lengths, .off = offset::q_offset, .window = 50, .q_block = 16,
                          .k_block = 32},
                   config{.B = 2, .Sq = 1, .Sk = 3000, .H = 4, .Hkv = 1, .causal = true, .off = offset::q_offset,
                          .window = 7},
                   // steps and a prefill chunk inside a preallocated cache, its unfilled slots NaN
                   config{.B = 3, .Sq = 3, .Sk = 300, .H = 4, .Hkv = 2, .causal = true, .pad = padding::lengths,
                          .off = offset::q_offset, .unfilled = 170},
                   config{.B = 2, .Sq = 1, .Sk = 300, .H = 4, .Hkv = 1, .causal = true, .pad = padding::mask,
                          .off = offset::q_offset, .window = 20, .unfilled = 33},
                   config{.B = 2, .Sq = 40, .Sk = 300, .H = 2, .Hkv = 1, .order = layout::bhsd, .causal = true,
                          .off = offset::q_offset, .window = 50, .q_block = 16, .k_block = 32,
                          .path = posenc::attention_path::tiled, .unfilled = 100}}) {
    const problem p(c);
    all_hooks enc{{.rot = {}, .bias = {}, .rel = relative_terms(2, c.D, 3)}, relative_values(3, c.H, c.Dv, 5)};
    posenc::reference_terms<double> terms;
    terms.bias = distance_bias_terms(p).bias;
    terms.score_term = relative_reference(p, enc.rel).score_term;
    terms.value_term = value_reference(p, enc.val).value_term;
    // The reference needs the encoding's scale explicitly, and the relative score term must read
    // the rotated q/k: run the reference on rotated copies with a score term over those copies.
    auto run = [&](auto tag) {
      using T = decltype(tag);
      INFO(describe(c) << (std::is_same_v<T, float> ? " float" : " double"));
      const result got = run_kernel<T>(p, enc);
      problem rotated = p;
      {  // rotate the (rounded) inputs the way the reference will see them
        for (auto* x : {&rotated.q, &rotated.k})
          for (auto& e : *x) e = static_cast<double>(static_cast<T>(e));
        auto qv = view<double>(rotated.q.data(), c.B, c.Sq, c.H, c.D, c.order);
        auto kv = view<double>(rotated.k.data(), c.B, c.Sk, c.Hkv, c.D, c.order);
        rotate_reference(p)(qv, kv);
      }
      posenc::reference_terms<double> t = terms;
      t.score_term = relative_reference(rotated, enc.rel).score_term;
      auto opt = rotated.options();
      opt.scale = all_hooks::logit_scale(c.D);
      std::vector<double> v = rotated.v;
      for (auto& e : v) e = static_cast<double>(static_cast<T>(e));
      result want;
      want.out.assign(got.out.size(), 0.0);
      want.lse.assign(got.lse.size(), 0.0);
      posenc::reference_attention<double>(
          view<const double>(rotated.q.data(), c.B, c.Sq, c.H, c.D, c.order),
          view<const double>(rotated.k.data(), c.B, c.Sk, c.Hkv, c.D, c.order),
          view<const double>(v.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order),
          view<double>(want.out.data(), c.B, c.Sq, c.H, c.Dv, c.order), opt, t, std::nullopt,
          posenc::tensor_map<double, 3>(want.lse.data(), c.B, c.H, c.Sq));
      expect_close<T>(got.out, want.out, "out", 5e-5);
      expect_close<T>(got.lse, want.lse, "lse", 5e-5);
    };
    run(double{});
    run(float{});
  }
}

namespace {
// bind: once per call, sees the call's shapes and positions; the hooks then run on what it returns.
// The bound bias is -|i - j| / (k_max - k_min + 1) by positions (a bias normalized by the call's
// key-position range, which only bind can know).
struct normalized_distance {
  std::shared_ptr<std::atomic<int>> binds = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<posenc::call_info> seen = std::make_shared<posenc::call_info>();
  struct bound {
    double inv_range = 1.0;
    template <class T>
    void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T> s) const {
      for (Index i = 0; i < t.rows; ++i)
        for (Index j = 0; j < t.cols; ++j)
          s(i, j) -= static_cast<T>(inv_range * static_cast<double>(std::abs(t.q_pos[i] - t.k_pos[j])));
    }
  };
  [[nodiscard]] bound bind(const posenc::call_info& info) const {
    ++*binds;
    *seen = info;
    return bound{1.0 / static_cast<double>(info.k_max - info.k_min + 1)};
  }
};
}  // namespace

TEST_CASE("attention: bind runs once per call with the call's shapes and positions", "[kernel]") {
  config c{.B = 2, .Sq = 37, .Sk = 65, .H = 4, .Hkv = 2, .D = 8, .Dv = 6, .causal = true,
           .off = offset::explicit_positions, .q_block = 16, .k_block = 16};
  const problem p(c);
  normalized_distance enc;
  const auto m = masks_of(p);
  const double inv_range = 1.0 / static_cast<double>(m.k_max - m.k_min + 1);
  posenc::reference_terms<double> terms;
  terms.bias = [&](Index b, Index, Index i, Index j) {
    return -inv_range * static_cast<double>(std::abs(m.qp(b)[i] - m.kp(b)[j]));
  };
  check_case<double>(c, enc, terms);
  CHECK(enc.binds->load() == 1);
  const posenc::call_info& info = *enc.seen;
  CHECK(info.batch == c.B);
  CHECK(info.heads == c.H);
  CHECK(info.kv_heads == c.Hkv);
  CHECK(info.q_len == c.Sq);
  CHECK(info.k_len == c.Sk);
  CHECK(info.head_dim == c.D);
  CHECK(info.value_dim == c.Dv);
  CHECK(info.k_min == m.k_min);
  CHECK(info.k_max == m.k_max);
  CHECK(info.q_min == m.q_min);
  CHECK(info.q_max == m.q_max);
  check_case<float>(c, enc, terms);
  CHECK(enc.binds->load() == 2);
}

// ---- threads -------------------------------------------------------------------------------------

TEST_CASE("attention: bitwise identical results for 1, 2 and 8 threads", "[kernel]") {
  Eigen::ThreadPool two(2), eight(8);
  for (config c : {config{.B = 2, .Sq = 257, .Sk = 300, .H = 4, .Hkv = 2, .D = 16, .Dv = 16, .causal = true,
                          .pad = padding::mask, .off = offset::q_offset, .q_block = 32, .k_block = 64},
                   config{.B = 1, .Sq = 1000, .Sk = 257, .H = 2, .Hkv = 1, .D = 16, .Dv = 16,
                          .order = layout::bhsd}}) {
    INFO(describe(c));
    const problem p(c);
    expect_same_for_pools<double>(
        p, all_hooks{{.rot = {}, .bias = {}, .rel = relative_terms(2, c.D, 3)}, relative_values(3, c.H, c.Dv, 5)}, two,
        eight);
    expect_same_for_pools<float>(p, posenc::no_position{}, two, eight);
  }
}

namespace {
// distance_bias whose hook runs a small attention of its own on the same thread, as an encoding that
// calls a kernel inside a hook would: the outer call's per-thread scratch (detail::thread_scratch)
// must not be the inner call's, or the inner call would overwrite the outer units' accumulators.
struct nested_bias : distance_bias {
  template <class T>
  void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T> s) const {
    distance_bias::add_position_bias(t, s);
    const Index L = 40, H = 2, D = 8;
    std::vector<T> x(static_cast<std::size_t>(L * H * D), T(0.5)), out(x.size());
    const auto view_x = posenc::bshd<const T>(x.data(), 1, L, H, D);
    posenc::attention<T>(view_x, view_x, view_x, posenc::bshd(out.data(), 1, L, H, D));
  }
};
}  // namespace

TEST_CASE("attention: a hook may run attention itself (per-thread scratch is not shared)", "[kernel]") {
  Eigen::ThreadPool two(2);
  const config c{.B = 1, .Sq = 300, .Sk = 300, .H = 2, .Hkv = 1, .D = 16, .Dv = 16, .causal = true,
                 .q_block = 64, .k_block = 64};
  INFO(describe(c));
  const problem p(c);
  const auto m = masks_of(p);
  std::vector<unsigned char> valid(m.k_valid);
  nested_bias enc;
  enc.k_valid = &valid;
  enc.k_len = c.Sk;
  enc.causal = c.causal;
  check_both(c, enc, distance_bias_terms(p));
  CHECK(run_kernel<double>(p, enc, &two).out == run_kernel<double>(p, enc).out);  // nested on pool threads
}

// ---- merge ---------------------------------------------------------------------------------------

namespace {
// The keys [first, first+count) of a problem as a problem of their own (positions kept explicit).
problem key_range(const problem& p, Index first, Index count) {
  config c = p.c;
  c.Sk = count;
  problem r(c);
  const auto m = masks_of(p);
  r.k.assign(static_cast<std::size_t>(c.B * count * c.Hkv * c.D), 0.0);
  r.v.assign(static_cast<std::size_t>(c.B * count * c.Hkv * c.Dv), 0.0);
  r.q = p.q;
  const auto src_k = view<const double>(p.k.data(), c.B, p.c.Sk, c.Hkv, c.D, c.order);
  const auto src_v = view<const double>(p.v.data(), c.B, p.c.Sk, c.Hkv, c.Dv, c.order);
  const auto dst_k = view<double>(r.k.data(), c.B, count, c.Hkv, c.D, c.order);
  const auto dst_v = view<double>(r.v.data(), c.B, count, c.Hkv, c.Dv, c.order);
  for (Index b = 0; b < c.B; ++b)
    for (Index j = 0; j < count; ++j)
      for (Index h = 0; h < c.Hkv; ++h) {
        for (Index d = 0; d < c.D; ++d) dst_k(b, j, h, d) = src_k(b, first + j, h, d);
        for (Index d = 0; d < c.Dv; ++d) dst_v(b, j, h, d) = src_v(b, first + j, h, d);
      }
  // explicit positions and a padding mask reproduce the original call's visibility exactly
  r.c.off = offset::explicit_positions;
  r.c.pad = padding::mask;
  r.kv_len.clear();
  r.q_pos.assign(m.q_pos.begin(), m.q_pos.end());
  r.k_pos.resize(static_cast<std::size_t>(c.B * count));
  r.pad_mask.resize(static_cast<std::size_t>(c.B * count));
  for (Index b = 0; b < c.B; ++b)
    for (Index j = 0; j < count; ++j) {
      r.k_pos[b * count + j] = m.kp(b)[first + j];
      r.pad_mask[b * count + j] = m.kv(b)[first + j] != 0 ? 0 : 1;
    }
  return r;
}

template <class T>
void check_merge(const config& c) {
  INFO(describe(c) << (std::is_same_v<T, float> ? " float" : " double"));
  const problem p(c);
  const Index split = c.Sk / 3;
  const problem a = key_range(p, 0, split), b = key_range(p, split, c.Sk - split);
  const result ra = run_kernel<T>(a, posenc::no_position{}), rb = run_kernel<T>(b, posenc::no_position{});
  const auto oa = cast<T>(ra.out), ob = cast<T>(rb.out), la = cast<T>(ra.lse), lb = cast<T>(rb.lse);
  std::vector<T> out(oa.size(), T(9)), lse(la.size(), T(9));
  posenc::merge<T>(view<const T>(oa.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                   posenc::tensor_map<const T, 3>(la.data(), c.B, c.H, c.Sq),
                   view<const T>(ob.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                   posenc::tensor_map<const T, 3>(lb.data(), c.B, c.H, c.Sq),
                   view<T>(out.data(), c.B, c.Sq, c.H, c.Dv, c.order), posenc::tensor_map<T, 3>(lse.data(), c.B, c.H, c.Sq));
  const result want = run_reference<T>(p, {});
  expect_close<T>(std::vector<double>(out.begin(), out.end()), want.out, "merged out");
  expect_close<T>(std::vector<double>(lse.begin(), lse.end()), want.lse, "merged lse");

  // in place: out = out_a
  auto oa2 = oa;
  auto la2 = la;
  posenc::merge<T>(view<const T>(oa2.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                   posenc::tensor_map<const T, 3>(la2.data(), c.B, c.H, c.Sq),
                   view<const T>(ob.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                   posenc::tensor_map<const T, 3>(lb.data(), c.B, c.H, c.Sq),
                   view<T>(oa2.data(), c.B, c.Sq, c.H, c.Dv, c.order), posenc::tensor_map<T, 3>(la2.data(), c.B, c.H, c.Sq));
  CHECK(oa2 == out);
  CHECK(la2 == lse);
}
}  // namespace

TEST_CASE("merge: two key ranges combine to the full attention", "[kernel]") {
  for (config c : {config{.B = 2, .Sq = 37, .Sk = 65, .H = 4, .Hkv = 2, .causal = true, .off = offset::q_offset},
                   config{.B = 3, .Sq = 64, .Sk = 257, .order = layout::bhsd, .causal = true,
                          .pad = padding::lengths},
                   config{.B = 2, .Sq = 7, .Sk = 1000, .H = 2, .Hkv = 1, .pad = padding::mask,
                          .off = offset::shuffled_keys},
                   config{.B = 1, .Sq = 65, .Sk = 2, .causal = true}}) {
    check_merge<double>(c);
    check_merge<float>(c);
  }
}

TEST_CASE("merge: rejects mismatched shapes", "[kernel]") {
  std::vector<double> a(2 * 3 * 2 * 4, 1.0), lse(2 * 2 * 3, 0.0), bad_lse(2 * 2 * 4, 0.0), out(a.size(), 5.0),
      out_lse(lse.size(), 5.0);
  const auto va = posenc::bshd<const double>(a.data(), 2, 3, 2, 4);
  const auto vbad = posenc::bshd<const double>(a.data(), 2, 4, 2, 3);
  posenc::tensor_map<const double, 3> l(lse.data(), 2, 2, 3), lb(bad_lse.data(), 2, 2, 4);
  CHECK_THROWS_AS(posenc::merge<double>(va, l, vbad, l, posenc::bshd(out.data(), 2, 3, 2, 4),
                                        posenc::tensor_map<double, 3>(out_lse.data(), 2, 2, 3)),
                  posenc::error);
  CHECK_THROWS_WITH(posenc::merge<double>(va, l, va, lb, posenc::bshd(out.data(), 2, 3, 2, 4),
                                          posenc::tensor_map<double, 3>(out_lse.data(), 2, 2, 3)),
                    Catch::Contains("lse_b"));
  CHECK(std::all_of(out.begin(), out.end(), [](double x) { return x == 5.0; }));
  CHECK(std::all_of(out_lse.begin(), out_lse.end(), [](double x) { return x == 5.0; }));
  // out in the memory of a part under other strides (it would overwrite rows not read yet); the part
  // itself is fine
  std::vector<double> c(a.size(), 2.0);
  const auto vc = posenc::bshd<const double>(c.data(), 2, 3, 2, 4);
  CHECK_THROWS_WITH(posenc::merge<double>(va, l, vc, l, posenc::bhsd(c.data(), 2, 2, 3, 4),
                                          posenc::tensor_map<double, 3>(out_lse.data(), 2, 2, 3)),
                    Catch::Contains("out") && Catch::Contains("out_b itself"));
  CHECK(std::all_of(c.begin(), c.end(), [](double x) { return x == 2.0; }));
  CHECK_NOTHROW(posenc::merge<double>(va, l, vc, l, posenc::bshd(c.data(), 2, 3, 2, 4),
                                      posenc::tensor_map<double, 3>(out_lse.data(), 2, 2, 3)));
  CHECK(std::all_of(c.begin(), c.end(), [](double x) { return std::abs(x - 1.5) < 1e-15; }));
}

// ---- golden vectors ------------------------------------------------------------------------------

namespace {
// The golden case's additive bias [1, H, Sq, Sk] as a position-only bias hook (read per tile).
struct table_bias {
  const std::vector<double>* bias = nullptr;
  Index H = 0, Sq = 0, Sk = 0;
  template <class T>
  void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T> s) const {
    for (Index i = 0; i < t.rows; ++i)
      for (Index j = 0; j < t.cols; ++j)
        s(i, j) += static_cast<T>((*bias)[((t.head * Sq) + t.q_first + i) * Sk + t.k_first + j]);
  }
};
}  // namespace

TEST_CASE("attention: golden GQA 8x2, left padded, causal, with an additive bias", "[kernel]") {
  const auto g = golden::load("attention_gqa8x2_left_padded_causal");
  const auto& qt = g.at("q");
  const Index B = qt.shape[0], S = qt.shape[1], H = qt.shape[2], D = qt.shape[3];
  const Index Hkv = g.at("k").shape[2], Sk = g.at("k").shape[1];
  REQUIRE(g.params().at("num_key_value_heads").get<Index>() == Hkv);
  const auto q = qt.f64(), k = g.at("k").f64(), v = g.at("v").f64(), bias = g.at("bias").f64();
  const auto mask = g.at("key_padding_mask").i64();
  const auto want_out = g.at("out").f64(), want_probs = g.at("probs").f64();
  const double atol = golden::tolerance(g, "out").atol;

  posenc::attention_options opt;
  opt.causal = g.params().at("causal").get<bool>();
  opt.q_offset = g.params().at("q_offset").get<std::int64_t>();
  opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(mask.data(), B, Sk);
  opt.q_block = 8;  // several tiles even at S = 20
  opt.k_block = 8;
  const auto vq = posenc::bshd<const double>(q.data(), B, S, H, D);
  const auto vk = posenc::bshd<const double>(k.data(), B, Sk, Hkv, D);
  const auto vv = posenc::bshd<const double>(v.data(), B, Sk, Hkv, D);
  std::vector<double> out(want_out.size(), -1.0);
  posenc::attention<double>(vq, vk, vv, posenc::bshd(out.data(), B, S, H, D),
                            table_bias{.bias = &bias, .H = H, .Sq = S, .Sk = Sk}, opt);
  for (std::size_t i = 0; i < out.size(); ++i) {
    INFO("out[" << i << "]");
    REQUIRE(std::abs(out[i] - want_out[i]) <= atol);
  }
  // probabilities through the reference (the kernel never materializes them)
  std::vector<double> ref_out(out.size()), probs(want_probs.size());
  posenc::reference_terms<double> terms;
  terms.bias = [&](Index, Index h, Index i, Index j) { return bias[(h * S + i) * Sk + j]; };
  posenc::reference_attention<double>(vq, vk, vv, posenc::bshd(ref_out.data(), B, S, H, D), opt, terms,
                                      posenc::tensor_map<double, 4>(probs.data(), B, H, S, Sk));
  for (std::size_t i = 0; i < probs.size(); ++i) {
    INFO("probs[" << i << "]");
    REQUIRE(std::abs(probs[i] - want_probs[i]) <= atol);
  }
  // its first rows see no key: all-zero output
  for (Index d = 0; d < D; ++d) CHECK(out[d] == 0.0);
}

// ---- numerics ------------------------------------------------------------------------------------

TEST_CASE("attention: fully masked rows give zeros and lse -inf", "[kernel]") {
  // kv_lengths 0 for batch row 2, and causal queries positioned before every key.
  for (config c : {config{.B = 3, .Sq = 37, .Sk = 65, .causal = true, .pad = padding::lengths, .q_block = 16,
                          .k_block = 16},
                   config{.B = 2, .Sq = 20, .Sk = 64, .causal = true, .off = offset::explicit_positions}}) {
    problem p(c);
    if (!p.q_pos.empty())
      for (Index i = 0; i < 5; ++i) p.q_pos[i] = -100;  // see nothing
    const result got = run_kernel<double>(p, posenc::no_position{});
    const result want = run_reference<double>(p, {});
    expect_close<double>(got.out, want.out, "out");
    expect_close<double>(got.lse, want.lse, "lse");
    const result gotf = run_kernel<float>(p, posenc::no_position{});
    expect_close<float>(gotf.out, want.out, "out");
    CHECK(std::count(got.lse.begin(), got.lse.end(), -inf) > 0);
    CHECK(std::count(gotf.lse.begin(), gotf.lse.end(), -inf) == std::count(got.lse.begin(), got.lse.end(), -inf));
  }
}

namespace {
// -inf on every key of the even query rows of head 0, and on every other key elsewhere.
struct neg_inf_bias {
  template <class T>
  void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T> s) const {
    for (Index i = 0; i < t.rows; ++i)
      for (Index j = 0; j < t.cols; ++j)
        if ((t.head == 0 && (t.q_first + i) % 2 == 0) || (t.k_first + j) % 2 == 1)
          s(i, j) = -std::numeric_limits<T>::infinity();
  }
};
}  // namespace

TEST_CASE("attention: -inf biases stay finite (rows of -inf give zeros)", "[kernel]") {
  config c{.B = 2, .Sq = 37, .Sk = 65, .causal = true, .pad = padding::mask, .q_block = 16, .k_block = 16};
  const problem p(c);
  posenc::reference_terms<double> terms;
  terms.bias = [](Index, Index h, Index i, Index j) { return (h == 0 && i % 2 == 0) || j % 2 == 1 ? -inf : 0.0; };
  const result want = run_reference<double>(p, terms);
  expect_close<double>(run_kernel<double>(p, neg_inf_bias{}).out, want.out, "out");
  expect_close<double>(run_kernel<double>(p, neg_inf_bias{}).lse, want.lse, "lse");
  expect_close<float>(run_kernel<float>(p, neg_inf_bias{}).out, want.out, "out");
}

TEST_CASE("attention: logits of +-1e4 and denormal inputs stay finite", "[kernel]") {
  SECTION("huge logits") {
    config c{.B = 1, .Sq = 65, .Sk = 300, .causal = true, .q_block = 16, .k_block = 64};
    const problem p(c);
    auto opt = p.options();
    // scale chosen so the largest |logit| is about 1e4
    double mx = 0;
    std::vector<double> ref(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv)), got(ref.size()), lse(c.B * c.H * c.Sq);
    for (std::size_t i = 0; i < p.q.size(); ++i) mx = std::max(mx, std::abs(p.q[i]));
    opt.scale = 1e4 / (mx * mx * static_cast<double>(c.D));
    const auto qv = view<const double>(p.q.data(), c.B, c.Sq, c.H, c.D, c.order);
    const auto kv = view<const double>(p.k.data(), c.B, c.Sk, c.Hkv, c.D, c.order);
    const auto vv = view<const double>(p.v.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order);
    posenc::attention<double>(qv, kv, vv, view<double>(got.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                              posenc::tensor_map<double, 3>(lse.data(), c.B, c.H, c.Sq), posenc::no_position{}, opt);
    posenc::reference_attention<double>(qv, kv, vv, view<double>(ref.data(), c.B, c.Sq, c.H, c.Dv, c.order), opt);
    // logits ~1e4: a rounding of 1e4 * 2^-52 per score moves the weights by ~1e-12 relative
    expect_close<double>(got, ref, "out", 0, 1e-9);
    for (double x : lse) CHECK(std::isfinite(x));
    // float: the same inputs in float; outputs finite and within the value range
    const auto q32 = cast<float>(p.q), k32 = cast<float>(p.k), v32 = cast<float>(p.v);
    std::vector<float> out32(ref.size());
    posenc::attention<float>(view<const float>(q32.data(), c.B, c.Sq, c.H, c.D, c.order),
                             view<const float>(k32.data(), c.B, c.Sk, c.Hkv, c.D, c.order),
                             view<const float>(v32.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order),
                             view<float>(out32.data(), c.B, c.Sq, c.H, c.Dv, c.order), posenc::no_position{}, opt);
    double vmax = 0;
    for (double x : p.v) vmax = std::max(vmax, std::abs(x));
    for (float x : out32) {
      REQUIRE(std::isfinite(x));
      REQUIRE(std::abs(x) <= vmax * 1.0001);
    }
  }
  SECTION("denormals") {
    for (double tiny : {1e-310, 1e-40}) {
      config c{.B = 1, .Sq = 37, .Sk = 65, .causal = true, .q_block = 16, .k_block = 16, .scale_inputs = tiny};
      const problem p(c);
      if (tiny < 1e-300) {
        const result got = run_kernel<double>(p, posenc::no_position{});
        const result want = run_reference<double>(p, {});
        expect_close<double>(got.out, want.out, "out");
        for (double x : got.out) REQUIRE(std::isfinite(x));
      } else {
        const result got = run_kernel<float>(p, posenc::no_position{});
        const result want = run_reference<float>(p, {});
        for (double x : got.out) REQUIRE(std::isfinite(x));
        // scores underflow to ~0: uniform weights over the visible keys, values are denormal
        for (std::size_t i = 0; i < got.out.size(); ++i) REQUIRE(std::abs(got.out[i] - want.out[i]) <= 1e-42);
      }
    }
  }
}

// ---- errors: thrown before anything is written ----------------------------------------------------

TEST_CASE("attention: invalid arguments throw and leave the outputs untouched", "[kernel]") {
  const Index B = 2, S = 5, H = 4, Hkv = 2, D = 8;
  std::vector<double> q(B * S * H * D, 0.5), k(B * S * Hkv * D, 0.25), v(B * S * Hkv * D, 1.0);
  std::vector<double> out(B * S * H * D, 7.0), lse(B * H * S, 7.0);
  const auto vq = posenc::bshd<const double>(q.data(), B, S, H, D);
  const auto vk = posenc::bshd<const double>(k.data(), B, S, Hkv, D);
  const auto vv = posenc::bshd<const double>(v.data(), B, S, Hkv, D);
  const auto vo = posenc::bshd(out.data(), B, S, H, D);
  const posenc::tensor_map<double, 3> vl(lse.data(), B, H, S);
  auto untouched = [&] {
    CHECK(std::all_of(out.begin(), out.end(), [](double x) { return x == 7.0; }));
    CHECK(std::all_of(lse.begin(), lse.end(), [](double x) { return x == 7.0; }));
  };
  auto call = [&](auto q_, auto k_, auto v_, auto o_, posenc::attention_options opt) {
    posenc::attention<double>(q_, k_, v_, o_, vl, posenc::no_position{}, opt);
  };

  SECTION("head_dim mismatch") {
    const auto bad_k = posenc::bshd<const double>(k.data(), B, S, Hkv * 2, D / 2);
    CHECK_THROWS_WITH(call(vq, bad_k, posenc::bshd<const double>(v.data(), B, S, Hkv * 2, D / 2), vo, {}),
                      Catch::Contains("head_dim"));
  }
  SECTION("heads not divisible by kv_heads") {
    const auto k3 = posenc::bshd<const double>(k.data(), B, 1, 3, 8);
    const auto v3 = posenc::bshd<const double>(v.data(), B, 1, 3, 8);
    CHECK_THROWS_WITH(call(vq, k3, v3, vo, {}), Catch::Contains("divide"));
  }
  SECTION("v seq differs from k seq") {
    const auto v4 = posenc::bshd<const double>(v.data(), B, S - 1, Hkv, D);
    CHECK_THROWS_WITH(call(vq, vk, v4, vo, {}), Catch::Contains("seq"));
  }
  SECTION("out shape") {
    const auto o2 = posenc::bshd(out.data(), B, S - 1, H, D);
    CHECK_THROWS_WITH(call(vq, vk, vv, o2, {}), Catch::Contains("out"));
  }
  SECTION("bad kv_lengths") {
    const std::vector<std::int64_t> too_long{S, S + 1}, negative{-1, 2}, wrong_size{S};
    for (const auto* kl : {&too_long, &negative, &wrong_size}) {
      posenc::attention_options opt;
      opt.kv_lengths = *kl;
      CHECK_THROWS_WITH(call(vq, vk, vv, vo, opt), Catch::Contains("kv_lengths"));
    }
  }
  SECTION("bad positions shapes") {
    const std::vector<std::int64_t> pos(B * (S + 1), 0);
    posenc::attention_options opt;
    opt.q_positions = posenc::positions_view(pos.data(), B, S + 1);
    CHECK_THROWS_WITH(call(vq, vk, vv, vo, opt), Catch::Contains("q_positions"));
    posenc::attention_options opt2;
    opt2.k_positions = posenc::positions_view(pos.data(), B + 1, S - 1);
    CHECK_THROWS_WITH(call(vq, vk, vv, vo, opt2), Catch::Contains("k_positions"));
  }
  SECTION("bad padding mask shape") {
    const std::vector<std::int64_t> m(B * S, 0);
    posenc::attention_options opt;
    opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(m.data(), S, B);
    CHECK_THROWS_WITH(call(vq, vk, vv, vo, opt), Catch::Contains("key_padding_mask"));
  }
  SECTION("lse shape") {
    std::vector<double> l2(B * H * (S + 1), 7.0);
    CHECK_THROWS_WITH(posenc::attention<double>(vq, vk, vv, vo, posenc::tensor_map<double, 3>(l2.data(), B, H, S + 1)),
                      Catch::Contains("lse"));
    CHECK(std::all_of(l2.begin(), l2.end(), [](double x) { return x == 7.0; }));
  }
  SECTION("non-finite scale") {
    posenc::attention_options opt;
    opt.scale = std::numeric_limits<double>::quiet_NaN();
    CHECK_THROWS_WITH(call(vq, vk, vv, vo, opt), Catch::Contains("scale"));
    opt.scale = inf;
    CHECK_THROWS_WITH(call(vq, vk, vv, vo, opt), Catch::Contains("scale"));
  }
  SECTION("negative tile size") {
    posenc::attention_options opt;
    opt.k_block = -1;
    CHECK_THROWS_WITH(call(vq, vk, vv, vo, opt), Catch::Contains("k_block"));
  }
  SECTION("out overlapping an input") {
    std::vector<double> qq(B * S * H * D, 0.5);
    const auto q_as_out = posenc::bshd(qq.data(), B, S, H, D);
    CHECK_THROWS_WITH(posenc::attention<double>(posenc::heads_view<const double>(q_as_out), vk, vv, q_as_out),
                      Catch::Contains("overlap"));
    CHECK(std::all_of(qq.begin(), qq.end(), [](double x) { return x == 0.5; }));
  }
  SECTION("value table of the wrong shape") {
    const relative_values enc(2, H, D + 1, 1);  // dv = D+1 but v has D
    CHECK_THROWS_WITH(posenc::attention<double>(vq, vk, vv, vo, vl, enc), Catch::Contains("value_table"));
  }
  untouched();
}

TEST_CASE("attention: empty shapes", "[kernel]") {
  // no keys: every row sees nothing
  std::vector<double> q(1 * 3 * 2 * 4, 1.0), out(q.size(), 5.0), lse(1 * 2 * 3, 5.0);
  const auto vq = posenc::bshd<const double>(q.data(), 1, 3, 2, 4);
  const auto vk = posenc::bshd<const double>(nullptr, 1, 0, 2, 4);
  posenc::attention<double>(vq, vk, vk, posenc::bshd(out.data(), 1, 3, 2, 4),
                            posenc::tensor_map<double, 3>(lse.data(), 1, 2, 3));
  CHECK(std::all_of(out.begin(), out.end(), [](double x) { return x == 0.0; }));
  CHECK(std::all_of(lse.begin(), lse.end(), [](double x) { return x == -inf; }));
  // no queries: nothing to do
  const auto vq0 = posenc::bshd<const double>(nullptr, 1, 0, 2, 4);
  posenc::attention<double>(vq0, vq, vq, posenc::bshd<double>(nullptr, 1, 0, 2, 4));
}

// ---- errors from hooks reach the caller ----------------------------------------------------------

namespace {
// A test exception type, so the tests can check that the caller gets the very exception a hook threw.
struct hook_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
enum class failing_hook { bind, transform_qk, transform_keys, score_terms, position_bias, value_buckets };
// Throws from one hook kind, for head 1 only (so other work items run, and may finish, first).
template <failing_hook Hook>
struct throwing_encoding {
  std::shared_ptr<std::atomic<long>> calls = std::make_shared<std::atomic<long>>(0);
  void fail(Index head) const {
    ++*calls;
    if (head == 1) throw hook_failure("hook failed on head 1");
  }
  const throwing_encoding& bind(const posenc::call_info&) const
    requires(Hook == failing_hook::bind)
  {
    throw hook_failure("bind failed");
  }
  template <class T>
  void transform_qk(posenc::qk_role role, Index head, std::span<const std::int64_t>, posenc::matrix_map<T>) const
    requires(Hook == failing_hook::transform_qk || Hook == failing_hook::transform_keys)
  {
    // keys: also from the transform of the keys shared by a kv head's items, made before the items
    if ((role == posenc::qk_role::query) == (Hook == failing_hook::transform_qk)) fail(head);
  }
  template <class T>
  void add_score_terms(const posenc::tile<T>& t, T, posenc::matrix_map<T>) const
    requires(Hook == failing_hook::score_terms)
  {
    fail(t.head);
  }
  template <class T>
  void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T>) const
    requires(Hook == failing_hook::position_bias)
  {
    fail(t.head);
  }
  [[nodiscard]] Index value_bucket_count() const
    requires(Hook == failing_hook::value_buckets)
  {
    return 1;
  }
  template <class T>
  void value_buckets(const posenc::tile<T>& t, posenc::index_tile idx) const
    requires(Hook == failing_hook::value_buckets)
  {
    idx.setZero();
    fail(t.head);
  }
  template <class T>
  [[nodiscard]] posenc::const_matrix_map<T> value_table(Index) const
    requires(Hook == failing_hook::value_buckets)
  {
    static const std::vector<T> zeros(64, T(0));
    return posenc::const_matrix_map<T>(zeros.data(), 1, 8, Eigen::OuterStride<>(8));
  }
};

template <failing_hook Hook>
void check_hook_failure_reaches_caller(Index threads, bool decode) {
  INFO("hook " << static_cast<int>(Hook) << ", threads " << threads << (decode ? ", decode" : ", tiled"));
  // Many small work items, so that a pool runs several of them before and after the failing one; the
  // decode strategy's items (batch, segment of 1024 keys) also run on the calling thread.
  config c{.B = 2, .Sq = 96, .Sk = 96, .H = 4, .Hkv = 2, .D = 8, .Dv = 8, .causal = true, .q_block = 16, .k_block = 16};
  if (decode) {  // one new row per head against 3000 keys: 3 segments per batch row
    c.Sq = 1;
    c.Sk = 3000;
    c.off = offset::q_offset;
  }
  const problem p(c);
  const auto q = cast<float>(p.q), k = cast<float>(p.k), v = cast<float>(p.v);
  std::vector<float> out(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv), 7.f);
  Eigen::ThreadPool pool(static_cast<int>(threads));
  auto opt = p.options();
  opt.pool = threads > 1 ? &pool : nullptr;
  const throwing_encoding<Hook> enc;
  auto call = [&] {
    posenc::attention<float>(view<const float>(q.data(), c.B, c.Sq, c.H, c.D, c.order),
                             view<const float>(k.data(), c.B, c.Sk, c.Hkv, c.D, c.order),
                             view<const float>(v.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order),
                             view<float>(out.data(), c.B, c.Sq, c.H, c.Dv, c.order), enc, opt);
  };
  CHECK_THROWS_AS(call(), hook_failure);  // the hook's own type, on this thread, not std::terminate
  CHECK_THROWS_WITH(call(), Catch::Contains("failed"));
  // The kernel still works afterwards on every thread (per-thread scratch released, no stuck worker).
  const result got = run_kernel<float>(p, posenc::no_position{}, opt.pool);
  expect_close<float>(got.out, run_reference<float>(p, {}).out, "out after a failed call");
}

template <failing_hook Hook>
void check_hook_failure_all_threads() {
  for (Index threads : {1, 2, 8})
    for (bool decode : {false, true}) check_hook_failure_reaches_caller<Hook>(threads, decode);
}
}  // namespace

TEST_CASE("attention: an exception from any hook reaches the caller with 1, 2 and 8 threads", "[kernel][errors]") {
  check_hook_failure_all_threads<failing_hook::bind>();
  check_hook_failure_all_threads<failing_hook::transform_qk>();
  check_hook_failure_all_threads<failing_hook::transform_keys>();
  check_hook_failure_all_threads<failing_hook::score_terms>();
  check_hook_failure_all_threads<failing_hook::position_bias>();
  check_hook_failure_all_threads<failing_hook::value_buckets>();
}

TEST_CASE("for_each_item: the first exception of a worker is rethrown on the calling thread", "[kernel][errors]") {
  struct scratch {};
  using posenc::detail::workers;
  for (int threads : {2, 8})
    for (workers who : {workers::pool, workers::pool_and_caller}) {
      INFO("threads " << threads << (who == workers::pool ? ", pool" : ", pool and caller"));
      Eigen::ThreadPool pool(threads);
      std::atomic<long> ran{0};
      // Every item after the failing one would take 1 ms: without the stop the call would take ~1 s.
      CHECK_THROWS_AS(posenc::detail::for_each_item<scratch>(
                          &pool, 1000, [](scratch&) {},
                          [&](Index i, scratch&) {
                            ++ran;
                            if (i == 3) throw std::out_of_range("item 3");
                            std::this_thread::sleep_for(std::chrono::milliseconds(1));
                          },
                          who),
                      std::out_of_range);
      CHECK(ran.load() < 100);  // the others stopped taking items
      CHECK_THROWS_AS(posenc::detail::for_each_item<scratch>(
                          &pool, 4, [](scratch&) { throw std::length_error("prepare"); }, [](Index, scratch&) {}, who),
                      std::length_error);
      // every item runs exactly once, on at most `threads` threads, the caller among them or not
      std::vector<std::atomic<int>> seen(100);
      std::mutex m;
      std::set<std::thread::id> ids;
      posenc::detail::for_each_item<scratch>(
          &pool, 100, [](scratch&) {},
          [&](Index i, scratch&) {
            ++seen[static_cast<std::size_t>(i)];
            const std::lock_guard<std::mutex> lock(m);
            ids.insert(std::this_thread::get_id());
          },
          who);
      CHECK(std::all_of(seen.begin(), seen.end(), [](const std::atomic<int>& x) { return x.load() == 1; }));
      CHECK(ids.size() <= static_cast<std::size_t>(threads));
      if (who == workers::pool) CHECK(ids.count(std::this_thread::get_id()) == 0);
      // an item that ends long after the others, past the time a working caller polls for them
      // (caller_poll_time): the caller then waits in the barrier, and the call still returns complete
      std::atomic<int> done{0};
      posenc::detail::for_each_item<scratch>(
          &pool, 2, [](scratch&) {},
          [&](Index i, scratch&) {
            if (i == 1) std::this_thread::sleep_for(4 * posenc::detail::caller_poll_time);
            ++done;
          },
          who);
      CHECK(done.load() == 2);
    }
}

// ---- NaN and Inf: what PyTorch's softmax does --------------------------------------------------------

namespace {
// +inf position bias on one (query, key) pair of head 0, by positions.
struct pos_inf_bias {
  std::int64_t q_at = 0, k_at = 0;
  template <class T>
  void add_position_bias(const posenc::tile<T>& t, posenc::matrix_map<T> s) const {
    if (t.head != 0) return;
    for (Index i = 0; i < t.rows; ++i)
      for (Index j = 0; j < t.cols; ++j)
        if (t.q_pos[i] == q_at && t.k_pos[j] == k_at) s(i, j) = std::numeric_limits<T>::infinity();
  }
};

// NaN where the reference has NaN (and only there), the values close elsewhere.
template <class T>
void expect_same_nan_pattern(const result& got, const result& want) {
  auto nan_pattern = [](const std::vector<double>& x) {
    std::vector<bool> n(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) n[i] = std::isnan(x[i]);
    return n;
  };
  const auto got_out = nan_pattern(got.out), want_out = nan_pattern(want.out);
  CHECK(std::count(want_out.begin(), want_out.end(), true) > 0);
  CHECK(got_out == want_out);
  CHECK(nan_pattern(got.lse) == nan_pattern(want.lse));
  auto finite_part = [](std::vector<double> x) {
    for (double& e : x)
      if (std::isnan(e)) e = 0;
    return x;
  };
  expect_close<T>(finite_part(got.out), finite_part(want.out), "out (non-NaN rows)");
  expect_close<T>(finite_part(got.lse), finite_part(want.lse), "lse (non-NaN rows)");
}

template <class T, class E>
void check_nan_case(const problem& p, const E& enc, const posenc::reference_terms<double>& terms) {
  const result want = run_reference<T>(p, terms);
  expect_same_nan_pattern<T>(run_kernel<T>(p, enc), want);
  Eigen::ThreadPool pool(2);
  expect_same_nan_pattern<T>(run_kernel<T>(p, enc, &pool), want);
}
}  // namespace

TEST_CASE("attention: NaN and +inf scores give NaN rows, -inf masks, fully masked rows stay zero", "[kernel]") {
  // Small tiles: the NaN arrives in a later key block than the row's first (the row is poisoned
  // mid-way and stays NaN), and both packed and expression products are used.
  const config base{.B = 2, .Sq = 40, .Sk = 40, .H = 4, .Hkv = 2, .D = 8, .Dv = 8, .causal = true,
                    .pad = padding::mask, .q_block = 8, .k_block = 12};
  auto at = [&](const problem& p, Index b, Index s, Index h, Index d, Index heads, Index dim) {
    return static_cast<std::size_t>(((b * p.c.Sq + s) * heads + h) * dim + d);
  };
  SECTION("NaN in one query row: that row of that head only") {
    problem p(base);
    p.q[at(p, 0, 17, 3, 2, p.c.H, p.c.D)] = std::numeric_limits<double>::quiet_NaN();
    check_nan_case<double>(p, posenc::no_position{}, {});
    check_nan_case<float>(p, posenc::no_position{}, {});
  }
  SECTION("NaN in one key: every row that sees it, in both query heads of its kv head") {
    problem p(base);
    const Index j = 13;
    p.pad_mask[static_cast<std::size_t>(j)] = 0;  // batch 0's key 13 is a real key
    p.k[static_cast<std::size_t>((j * p.c.Hkv + 1) * p.c.D + 5)] = std::numeric_limits<double>::quiet_NaN();
    check_nan_case<double>(p, posenc::no_position{}, {});
    check_nan_case<float>(p, posenc::no_position{}, {});
    // a padded key with NaN is never seen
    p.pad_mask[static_cast<std::size_t>(j)] = 1;
    const result got = run_kernel<double>(p, posenc::no_position{});
    for (double x : got.out) CHECK(!std::isnan(x));
  }
  SECTION("+inf score: NaN row") {
    problem p(base);
    std::fill(p.pad_mask.begin(), p.pad_mask.end(), 0);
    const pos_inf_bias enc{.q_at = 30, .k_at = 20};
    posenc::reference_terms<double> terms;
    terms.bias = [](Index, Index h, Index i, Index j) { return h == 0 && i == 30 && j == 20 ? inf : 0.0; };
    check_nan_case<double>(p, enc, terms);
    check_nan_case<float>(p, enc, terms);
  }
}

TEST_CASE("merge: a NaN part gives a NaN row", "[kernel]") {
  std::vector<double> a(4, 1.0), c(4, 2.0), o(4, 0.0);
  std::vector<double> la{std::numeric_limits<double>::quiet_NaN(), -inf}, lb{0.0, std::numeric_limits<double>::quiet_NaN()},
      lo(2, 0.0);
  posenc::merge<double>(posenc::bshd<const double>(a.data(), 1, 2, 1, 2), posenc::tensor_map<const double, 3>(la.data(), 1, 1, 2),
                        posenc::bshd<const double>(c.data(), 1, 2, 1, 2), posenc::tensor_map<const double, 3>(lb.data(), 1, 1, 2),
                        posenc::bshd(o.data(), 1, 2, 1, 2), posenc::tensor_map<double, 3>(lo.data(), 1, 1, 2));
  for (double x : o) CHECK(std::isnan(x));
  for (double x : lo) CHECK(std::isnan(x));
}
