// The fused attention kernel's decode strategy (detail/attention_decode.hpp: a few query rows per kv
// head streamed against a cache, split-KV threads), K/V stored in f16 and bf16 on both paths, and
// strided views of caches (padded rows, a preallocated cache's first tokens, a fused QKV buffer),
// against the double reference attention (posenc/reference.hpp) with the test encodings of
// attention_cases.hpp.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <posenc/attention.hpp>
#include <posenc/reference.hpp>
#include <span>
#include <vector>

#include "attention_cases.hpp"

using namespace attention_cases;

// ---- the decode strategy (detail/attention_decode.hpp) -----------------------------------------------

namespace {

std::vector<config> with_path(std::vector<config> cs, posenc::attention_path path) {
  for (config& c : cs) c.path = path;
  return cs;
}

// Decode shapes: a few query rows per kv head against caches that span several split-KV segments
// (beyond 1024 keys: detail::decode_segments) and tiles (32 keys), with every mask and position
// option, head dims that are not a whole number of packets, value dims unlike the key dims, and
// groups of 1 to 32 rows per kv head (whole 4-row blocks and every remainder).
std::vector<config> decode_configs() {
  std::vector<config> out;
  auto add = [&](Index sq, Index sk, Index h, Index hkv, Index d, Index dv, layout order, bool causal, padding pad,
                 offset off) {
    out.push_back(config{.B = pad == padding::lengths ? 3 : 2, .Sq = sq, .Sk = sk, .H = h, .Hkv = hkv, .D = d,
                         .Dv = dv, .order = order, .causal = causal, .pad = pad, .off = off,
                         .seed = static_cast<unsigned>(300 + out.size())});
  };
  add(1, 2500, 8, 2, 72, 40, layout::bshd, true, padding::none, offset::q_offset);
  add(1, 1025, 4, 1, 128, 128, layout::bshd, true, padding::mask, offset::q_offset);
  add(3, 2049, 8, 2, 16, 24, layout::bhsd, true, padding::lengths, offset::q_offset);
  add(2, 1100, 2, 2, 33, 7, layout::bshd, false, padding::mask, offset::none);
  add(5, 1500, 6, 3, 64, 64, layout::bhsd, true, padding::none, offset::explicit_positions);
  add(4, 1300, 4, 4, 20, 20, layout::bshd, true, padding::mask, offset::shuffled_keys);
  add(16, 700, 1, 1, 128, 64, layout::bshd, true, padding::none, offset::q_offset);
  add(1, 63, 32, 8, 128, 128, layout::bshd, true, padding::none, offset::q_offset);
  add(1, 0, 4, 2, 8, 8, layout::bshd, false, padding::none, offset::none);
  add(1, 1700, 3, 1, 48, 48, layout::bshd, true, padding::none, offset::q_offset);
  add(7, 1200, 2, 2, 24, 40, layout::bhsd, true, padding::mask, offset::q_offset);
  add(1, 900, 2, 2, 128, 128, layout::bshd, true, padding::none, offset::q_offset);
  add(5, 800, 8, 2, 40, 40, layout::bshd, true, padding::mask, offset::q_offset);  // 20 rows: two packets (AVX-512)
  // head dims the keys' register blocks are compiled for (with_head_dim), 4 and 2 rows per kv head
  add(2, 1300, 4, 2, 64, 64, layout::bshd, true, padding::lengths, offset::q_offset);
  add(1, 600, 4, 2, 256, 256, layout::bshd, true, padding::none, offset::q_offset);
  // the column layout's key products: an odd head dim (one dimension at a time), a head dim of 4 k + 2
  // (AVX-512: pairs of dimensions, the last pair alone) with keys ending mid-block, 6 and 16 rows
  add(3, 1100, 4, 2, 33, 33, layout::bshd, true, padding::none, offset::q_offset);
  add(8, 1190, 2, 1, 66, 66, layout::bshd, true, padding::mask, offset::q_offset);
  // the column layout's value sums: in pairs (AVX-512: more than 8 rows, f32 values, dv even; above:
  // 10, 12 and 16 rows, dv 24, 64 and 66), and row by row for an odd dv
  add(5, 900, 4, 2, 32, 17, layout::bshd, true, padding::none, offset::q_offset);
  // a BHSD cache read a kv head at a time (heads_outer) with the row layout: 1 and 2 rows per query head,
  // the keys' register blocks compiled for d = 128
  add(1, 2100, 8, 2, 128, 128, layout::bhsd, true, padding::mask, offset::q_offset);
  add(2, 1100, 4, 2, 128, 64, layout::bhsd, true, padding::lengths, offset::q_offset);
  // wide groups the automatic choice sends to the decode path: 17 to 32 rows (two packets of columns
  // with AVX-512, rows elsewhere), and 1 or 2 queries of a wide MQA group (the row layout: 71 rows, a
  // Falcon-7B token; 80)
  add(8, 1050, 8, 2, 24, 24, layout::bshd, true, padding::lengths, offset::q_offset);
  add(6, 1300, 10, 2, 40, 40, layout::bshd, true, padding::mask, offset::q_offset);
  add(1, 1500, 71, 1, 64, 64, layout::bshd, true, padding::none, offset::q_offset);
  add(2, 1100, 40, 1, 32, 24, layout::bhsd, true, padding::mask, offset::explicit_positions);
  // 8 rows at the head dims with register blocks: the row layout for a half-precision cache (AVX-512
  // and AVX2, which also takes its 9 to 16 rows, above, in rows), the column layout for one stored as T
  add(2, 1300, 8, 2, 128, 128, layout::bshd, true, padding::mask, offset::q_offset);
  add(1, 1100, 8, 1, 256, 256, layout::bshd, true, padding::none, offset::q_offset);
  return out;
}

}  // namespace

TEST_CASE("attention, decode path: small sizes, every option combination, double and float", "[kernel][decode]") {
  for (const config& c : with_path(small_configs(), posenc::attention_path::decode)) {
    check_case<double>(c, posenc::no_position{});
    check_case<float>(c, posenc::no_position{});
  }
}

TEST_CASE("decode kernels: queries into the column layout and the pair layout back to rows, every row count",
          "[kernel][decode]") {
  namespace dk = posenc::detail;
  for (Index d = 2; d <= 130; d += 2)
    for (Index rows = 5; rows <= 16; ++rows) {
      const Index lanes = 16, stride = d + 3;  // rows padded: the products read q with a row stride
      std::vector<float> q(static_cast<std::size_t>(rows * stride));
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 1000) + 0.25f;
      std::vector<float> qc(static_cast<std::size_t>(d * lanes), -1.f);
      dk::column_queries(q.data(), stride, rows, d, lanes, qc.data());
      const bool pairs = dk::column_pairs<float>(lanes, d);
      INFO("d " << d << ", rows " << rows << (pairs ? ", pair layout" : ", columns"));
      Index wrong = 0;
      for (Index r = 0; r < lanes; ++r)
        for (Index t = 0; t < d; ++t) {
          const float want = r < rows ? q[static_cast<std::size_t>(r * stride + t)] : 0.f;
          const Index at = pairs ? dk::pair_offset(r, t) : t * lanes + r;
          wrong += qc[static_cast<std::size_t>(at)] != want;
        }
      CHECK(wrong == 0);
      if (!pairs) continue;
      std::vector<float> back(static_cast<std::size_t>(rows * d + 5), -7.f);  // 5 past the end: untouched
      dk::unpair_rows(qc.data(), rows, d, back.data());
      for (Index r = 0; r < rows; ++r)
        for (Index t = 0; t < d; ++t)
          wrong += back[static_cast<std::size_t>(r * d + t)] != q[static_cast<std::size_t>(r * stride + t)];
      for (Index i = rows * d; i < rows * d + 5; ++i) wrong += back[static_cast<std::size_t>(i)] != -7.f;
      CHECK(wrong == 0);
    }
}

TEST_CASE("decode kernels: column_dots against a double sum, every column row count, awkward widths and key counts",
          "[kernel][decode]") {
  namespace dk = posenc::detail;
  for (Index d : {2, 6, 24, 33, 66, 128, 130, 256, 512})
    for (Index rows = 5; rows <= 32; rows += rows < 16 ? 1 : 16)
      for (Index cols : {1, 7, 8, 9, 15, 33}) {
        const Index lanes = dk::column_packets<float>(rows) * dk::packet_of<float>::width, k_stride = d + 3,
                    q_stride = d + 1, ld = lanes + 1;
        if (lanes == 0) continue;
        std::vector<float> q(static_cast<std::size_t>(rows * q_stride)), k(static_cast<std::size_t>(cols * k_stride)),
            qc(static_cast<std::size_t>(d * lanes)), st(static_cast<std::size_t>(cols * ld), -9.f);
        for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(static_cast<int>(i * 29 % 97) - 48) / 32.f;
        for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(static_cast<int>(i * 41 % 89) - 44) / 32.f;
        dk::column_queries(q.data(), q_stride, rows, d, lanes, qc.data());
        dk::column_dots(qc.data(), rows, lanes, d, k.data(), k_stride, cols, st.data(), ld);
        INFO("d " << d << ", rows " << rows << ", keys " << cols);
        Index wrong = 0;
        for (Index j = 0; j < cols; ++j)
          for (Index r = 0; r < lanes; ++r) {
            double want = 0, mag = 0;
            for (Index t = 0; r < rows && t < d; ++t) {
              const double x = double(q[static_cast<std::size_t>(r * q_stride + t)]) * k[static_cast<std::size_t>(j * k_stride + t)];
              want += x;
              mag += std::abs(x);
            }
            const double got = st[static_cast<std::size_t>(j * ld + r)];
            // the lanes past the rows hold 0; the others a float sum of d products, within d ulps of their magnitude
            wrong += r < rows ? !(std::abs(got - want) <= 1e-7 * static_cast<double>(d) * mag + 1e-30) : got != 0.0;
          }
        CHECK(wrong == 0);
        for (Index j = 0; j < cols; ++j) CHECK(st[static_cast<std::size_t>(j * ld + lanes)] == -9.f);  // ld padding
      }
}

#if defined(EIGEN_VECTORIZE_AVX512)
TEST_CASE("decode kernels: add_weighted_pairs against a double sum, awkward key counts and widths", "[kernel][decode]") {
  namespace dk = posenc::detail;
  const Index lanes = 16, ld = 17;  // P^T rows padded: the products read it with a row stride
  for (Index dv : {2, 6, 8, 10, 16, 30, 100, 128, 130})
    for (Index cols : {1, 7, 8, 9, 15, 29, 32})
      for (bool with_alpha : {false, true}) {
        const Index v_stride = dv + 3;
        std::vector<float> pt(static_cast<std::size_t>(cols * ld)), v(static_cast<std::size_t>(cols * v_stride)),
            oc(static_cast<std::size_t>(dv / 2 * 32)), alpha(static_cast<std::size_t>(lanes));
        const auto fill = [](std::vector<float>& x, int salt) {
          for (std::size_t i = 0; i < x.size(); ++i)
            x[i] = static_cast<float>((static_cast<int>(i) * 37 + salt * 11) % 101 - 50) / 64.f;
        };
        fill(pt, 1);
        fill(v, 2);
        fill(oc, 3);
        fill(alpha, 4);
        const std::vector<float> before = oc;
        dk::add_weighted_pairs(pt.data(), ld, v.data(), v_stride, cols, dv, oc.data(), with_alpha ? alpha.data() : nullptr,
                               0);
        INFO("dv " << dv << ", keys " << cols << (with_alpha ? ", alpha" : ""));
        double worst = 0;
        for (Index r = 0; r < lanes; ++r)
          for (Index t = 0; t < dv; ++t) {
            const auto at = static_cast<std::size_t>(dk::pair_offset(r, t));
            double want = before[at] * (with_alpha ? double{alpha[static_cast<std::size_t>(r)]} : 1.0);
            for (Index j = 0; j < cols; ++j)
              want += double{pt[static_cast<std::size_t>(j * ld + r)]} * v[static_cast<std::size_t>(j * v_stride + t)];
            worst = std::max(worst, std::abs(oc[at] - want));
          }
        CHECK(worst < 1e-5);
      }
}
#endif

TEST_CASE("attention, tiled path forced: small sizes, every option combination, float", "[kernel]") {
  for (const config& c : with_path(small_configs(), posenc::attention_path::tiled)) check_case<float>(c, posenc::no_position{});
}

TEST_CASE("attention, decode path: caches over several segments and tiles", "[kernel][decode]") {
  for (const auto path : {posenc::attention_path::automatic, posenc::attention_path::decode})
    for (const config& c : with_path(decode_configs(), path)) check_both(c, posenc::no_position{});
}

TEST_CASE("attention, decode path: Q/K transform, score terms and bias per query head", "[kernel][decode]") {
  for (const config& c : with_path(decode_configs(), posenc::attention_path::decode)) {
    if (c.D % 2 != 0 || c.Sk == 0) continue;
    INFO(describe(c));
    const problem p(c);
    const rotate_qk rot;
    check_case<double>(c, rot, {}, rotate_reference(p));
    check_case<float>(c, rot, {}, rotate_reference(p));
    check_both(c, distance_bias{}, distance_bias_terms(p));
    const relative_terms rel(3, c.D, 7);
    check_both(c, rel, relative_reference(p, rel));
  }
}

TEST_CASE("attention: the automatic strategy by shape (detail::choose_decode)", "[kernel][decode]") {
  namespace dt = posenc::detail;
  // up to 32 query rows per kv head (group x new queries), and 1 or 2 new queries with any group (MQA:
  // Falcon-7B's 71 query heads on one kv head)
  const struct {
    Index group, q_len;
    bool decode;
  } cases[] = {{4, 1, true},   {4, 8, true},   {1, 32, true},   {8, 4, true},   {4, 9, false},  {1, 33, false},
               {8, 5, false},  {71, 1, true},  {71, 2, true},   {128, 2, true}, {71, 3, false}, {17, 3, false}};
  for (const auto& c : cases) {
    INFO("group " << c.group << ", " << c.q_len << " queries");
    CHECK(dt::choose_decode<posenc::no_position, float>(posenc::attention_path::automatic, c.group, c.q_len) ==
          c.decode);
  }
  // forced either way
  CHECK(dt::choose_decode<posenc::no_position, float>(posenc::attention_path::decode, 4, 1000));
  CHECK_FALSE(dt::choose_decode<posenc::no_position, float>(posenc::attention_path::tiled, 4, 1));
}

TEST_CASE("attention, decode path: an encoding with value terms cannot be forced onto it", "[kernel][decode][errors]") {
  config c{.Sq = 1, .Sk = 40, .H = 2, .Hkv = 1, .path = posenc::attention_path::decode};
  const problem p(c);
  const relative_values enc(2, c.H, c.Dv, 11);
  try {
    (void)run_kernel<float>(p, enc);
    FAIL("no error");
  } catch (const posenc::error& e) {
    CHECK_THAT(e.what(), Catch::Contains("path") && Catch::Contains("value terms"));
  }
  // automatic picks the tiled path for it, and matches the reference
  c.path = posenc::attention_path::automatic;
  check_both(c, enc, value_reference(problem(c), enc));
}

// The split-KV segments: one up to 1024 keys, then an even number of segments of whole tiles, equal to
// a tile, about 2048 keys each (the count a function of the cache length alone).
TEST_CASE("attention, decode path: split-KV segments of a cache length", "[kernel][decode]") {
  using posenc::detail::decode_segments;
  using posenc::detail::decode_tile_keys;
  using posenc::detail::segment_tiles;
  CHECK(decode_segments(0) == 1);
  CHECK(decode_segments(1024) == 1);
  CHECK(decode_segments(1025) == 2);
  CHECK(decode_segments(6143) == 2);
  CHECK(decode_segments(6144) == 4);
  CHECK(decode_segments(32768) == 16);
  for (Index k_len = 1025; k_len <= 70000; k_len += 97) {
    const Index segments = decode_segments(k_len), tiles = (k_len + decode_tile_keys - 1) / decode_tile_keys;
    INFO("k_len " << k_len << ", " << segments << " segments");
    CHECK(segments % 2 == 0);
    Index next = 0, least = tiles, most = 0;
    for (Index s = 0; s < segments; ++s) {
      const segment_tiles t(s, segments, tiles);
      CHECK(t.first == next);
      least = std::min(least, t.end - t.first);
      most = std::max(most, t.end - t.first);
      next = t.end;
    }
    CHECK(next == tiles);
    CHECK(most - least <= 1);
    CHECK(least * decode_tile_keys >= 512);
    if (k_len >= 6144) CHECK(most * decode_tile_keys <= 3072 + decode_tile_keys);
  }
}

// In the cases split, columns and uneven the kv heads of a (batch, segment) item are cut into parts
// (decode_attention::head_chunks), 8 kv heads of 8-10 MiB per segment in float and twice that in
// double: one segment (2 parts on 2 threads, 2 / 4 on 8), and two segments (whole on 2 threads, 2 or 4
// parts each on 8), in the column layout (16 rows per kv head) and the row layout.
TEST_CASE("attention, decode path: bitwise identical for 1, 2 and 8 threads (fixed split-KV segments)",
          "[kernel][decode]") {
  Eigen::ThreadPool two(2), eight(8);
  const config one_kv_head = {
      .B = 1, .Sq = 1, .Sk = 5000, .H = 4, .Hkv = 1, .D = 64, .Dv = 64, .causal = true, .off = offset::q_offset};
  const config padded = {.B = 2,
                         .Sq = 2,
                         .Sk = 3000,
                         .H = 8,
                         .Hkv = 2,
                         .D = 40,
                         .Dv = 24,
                         .causal = true,
                         .pad = padding::mask,
                         .off = offset::q_offset};
  const config split = {
      .B = 1, .Sq = 1, .Sk = 1024, .H = 32, .Hkv = 8, .D = 128, .Dv = 128, .causal = true, .off = offset::q_offset};
  config columns = split, uneven = split;
  columns.Sq = 4;
  columns.Sk = 2500;
  uneven.Sk = 2600;
  uneven.pad = padding::mask;
  // BHSD: without an encoding (the double runs) each item takes its kv heads one after the other; the
  // rotating encoding stages its keys, which keeps them tile by tile
  config heads_apart = uneven, columns_apart = columns;
  heads_apart.order = columns_apart.order = layout::bhsd;
  for (const config& c : {one_kv_head, padded, split, columns, uneven, heads_apart, columns_apart}) {
    INFO(describe(c));
    const problem p(c);
    expect_same_for_pools<float>(p, hooks_without_values{.rot = {}, .bias = {}, .rel = relative_terms(3, c.D, 7)},
                                 two, eight);
    const result d8 = expect_same_for_pools<double>(p, posenc::no_position{}, two, eight);
    const result want = run_reference<double>(p, {});
    expect_close<double>(d8.out, want.out, "out, 8 threads");
    expect_close<double>(d8.lse, want.lse, "lse, 8 threads");
  }
}

// ---- K/V stored in half precision -----------------------------------------------------------------

namespace {

// Kernel in T with k and v stored as KV (q and out in T).
template <class T, class KV, class E>
result run_kernel_kv(const problem& p, const E& enc, Eigen::ThreadPoolInterface* pool = nullptr) {
  const config& c = p.c;
  const auto q = cast<T>(p.q);
  std::vector<KV> k(p.k.size()), v(p.v.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<KV>(static_cast<float>(p.k[i]));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<KV>(static_cast<float>(p.v[i]));
  std::vector<T> out(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv), T(123));
  std::vector<T> lse(static_cast<std::size_t>(c.B * c.H * c.Sq), T(123));
  auto opt = p.options();
  opt.pool = pool;
  posenc::attention<T, KV>(view<const T>(q.data(), c.B, c.Sq, c.H, c.D, c.order),
                           view<const KV>(k.data(), c.B, c.Sk, c.Hkv, c.D, c.order),
                           view<const KV>(v.data(), c.B, c.Sk, c.Hkv, c.Dv, c.order),
                           view<T>(out.data(), c.B, c.Sq, c.H, c.Dv, c.order),
                           posenc::tensor_map<T, 3>(lse.data(), c.B, c.H, c.Sq), enc, opt);
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

// The problem with k and v rounded to KV (q to T): the reference then sees exactly the stored values.
template <class T, class KV>
problem rounded_kv(const config& c) {
  problem p(c);
  for (auto& x : p.q) x = static_cast<double>(static_cast<T>(x));
  for (auto* x : {&p.k, &p.v})
    for (auto& e : *x) e = static_cast<double>(static_cast<float>(static_cast<KV>(static_cast<float>(e))));
  return p;
}

template <class T, class KV, class E>
void check_kv(const config& c, const E& enc, const posenc::reference_terms<double>& terms = {}) {
  INFO(describe(c) << (std::is_same_v<KV, Eigen::half> ? " f16" : " bf16")
                   << (std::is_same_v<T, float> ? " float" : " double"));
  const problem p = rounded_kv<T, KV>(c);
  const result got = run_kernel_kv<T, KV>(p, enc);
  const result want = run_reference<double>(p, terms);
  expect_close<T>(got.out, want.out, "out");
  expect_close<T>(got.lse, want.lse, "lse");
}

}  // namespace

TEST_CASE("attention: K/V in f16 and bf16, decode and tiled paths, against the reference on the stored values",
          "[kernel][decode]") {
  std::vector<config> cs = decode_configs();
  for (config c : {config{.B = 2, .Sq = 129, .Sk = 300, .H = 4, .Hkv = 2, .D = 40, .Dv = 24, .causal = true,
                          .pad = padding::mask, .off = offset::q_offset, .q_block = 64, .k_block = 128},
                   config{.B = 1, .Sq = 70, .Sk = 70, .H = 2, .Hkv = 1, .D = 17, .Dv = 9, .order = layout::bhsd,
                          .off = offset::shuffled_keys}})
    cs.push_back(c);
  for (config c : cs) {
    for (const auto path : {posenc::attention_path::automatic, posenc::attention_path::tiled}) {
      c.path = path;
      check_kv<float, Eigen::half>(c, posenc::no_position{});
      check_kv<float, Eigen::bfloat16>(c, posenc::no_position{});
      check_kv<double, Eigen::half>(c, posenc::no_position{});
    }
  }
}

// Groups wider than the column layout takes (more than 2 packets of rows: 40 float rows with AVX-512,
// 20 double rows; fewer elsewhere) stay in the row layout, where half-precision keys are read in place
// by several 4-row blocks, each sweeping the tile across the heads into its own rows of the scores.
TEST_CASE("attention, decode path: K/V in half precision, groups too wide for the column layout", "[kernel][decode]") {
  for (config c : {config{.B = 1, .Sq = 5, .Sk = 1100, .H = 8, .Hkv = 1, .D = 64, .Dv = 32, .causal = true,
                          .pad = padding::mask, .off = offset::q_offset, .path = posenc::attention_path::decode},
                   config{.B = 2, .Sq = 10, .Sk = 700, .H = 8, .Hkv = 2, .D = 40, .Dv = 40, .causal = true,
                          .off = offset::q_offset, .path = posenc::attention_path::decode}}) {
    check_kv<float, Eigen::half>(c, posenc::no_position{});
    check_kv<float, Eigen::bfloat16>(c, posenc::no_position{});
    check_kv<double, Eigen::half>(c, posenc::no_position{});
  }
}

TEST_CASE("attention: K/V in half precision with a Q/K transform and a bias (both paths)", "[kernel][decode]") {
  for (config c : {config{.B = 2, .Sq = 1, .Sk = 1500, .H = 8, .Hkv = 2, .D = 64, .Dv = 64, .causal = true,
                          .off = offset::q_offset},
                   config{.B = 2, .Sq = 2, .Sk = 1300, .H = 8, .Hkv = 2, .D = 64, .Dv = 64, .causal = true,
                          .off = offset::q_offset},  // 8 rows per kv head: with AVX-512 the row layout for
                                                     // the bias, columns for the staged keys of the others
                   config{.B = 1, .Sq = 100, .Sk = 300, .H = 4, .Hkv = 2, .D = 32, .Dv = 16, .causal = true,
                          .off = offset::q_offset, .q_block = 32, .k_block = 64}}) {
    const problem p = rounded_kv<float, Eigen::bfloat16>(c);
    distance_bias bias;
    check_kv<float, Eigen::bfloat16>(c, bias, distance_bias_terms(p));
    // the rotation: reference rotates the stored (rounded) keys
    const rotate_qk rot;
    const result got = run_kernel_kv<float, Eigen::half>(rounded_kv<float, Eigen::half>(c), rot);
    const problem ph = rounded_kv<float, Eigen::half>(c);
    const result want = run_reference<double>(ph, {}, rotate_reference(ph));
    expect_close<float>(got.out, want.out, "out");
    // score terms read the keys as float rows: a half cache is widened for them
    const relative_terms rel(3, c.D, 7);
    check_kv<float, Eigen::half>(c, rel, relative_reference(ph, rel));
  }
}

// ---- strided views: padded rows, the filled part of a preallocated cache, a fused QKV buffer -----

namespace {

// Elements added between the rows of a strided view: after each head's d values, after each
// token's heads (BSHD) or values (BHSD), after each batch row, and whole tokens past seq (a cache's
// unused capacity).
struct row_padding {
  Index head = 0, token = 0, batch = 0, tokens = 0;
};

// E from double and back (Eigen's half types convert through float).
template <class E>
E to(double x) {
  if constexpr (std::is_floating_point_v<E>)
    return static_cast<E>(x);
  else
    return static_cast<E>(static_cast<float>(x));
}
template <class E>
double from(E x) {
  if constexpr (std::is_floating_point_v<E>)
    return static_cast<double>(x);
  else
    return static_cast<double>(static_cast<float>(x));
}

// f(batch, token, head, element) for every element of a [B, S, H, D] tensor.
template <class F>
void for_each_element(Index B, Index S, Index H, Index D, F&& f) {
  for (Index i = 0; i < B; ++i)
    for (Index t = 0; t < S; ++t)
      for (Index k = 0; k < H; ++k)
        for (Index e = 0; e < D; ++e) f(i, t, k, e);
}

// A copy of a dense tensor (in c.order) into a larger buffer of E whose padding holds `fill`, and the
// strided view of it. The padding of an input is NaN: a kernel that read one element outside its view
// would turn rows NaN.
template <class E>
struct strided_copy {
  std::vector<E> buf;
  posenc::view_strides strides;
  Index B, S, H, D;
  strided_copy(const std::vector<double>& dense, Index b, Index s, Index h, Index d, layout order, row_padding pad,
               double fill)
      : B(b), S(s), H(h), D(d) {
    if (order == layout::bshd) {
      strides.head = D + pad.head;
      strides.token = H * strides.head + pad.token;
      strides.batch = (S + pad.tokens) * strides.token + pad.batch;
    } else {
      strides.token = D + pad.token;
      strides.head = (S + pad.tokens) * strides.token + pad.head;
      strides.batch = H * strides.head + pad.batch;
    }
    buf.assign(static_cast<std::size_t>(B * strides.batch), to<E>(fill));
    const auto src = view<const double>(dense.data(), B, S, H, D, order);
    const auto dst = strided_view();
    for_each_element(B, S, H, D, [&](Index i, Index t, Index k, Index e) { dst(i, t, k, e) = to<E>(src(i, t, k, e)); });
  }
  posenc::heads_view<E> strided_view() { return posenc::strided(buf.data(), B, S, H, D, strides); }
  // The viewed values in c.order, dense.
  std::vector<double> gather(layout order) {
    std::vector<double> out(static_cast<std::size_t>(B * S * H * D));
    const auto dst = view<double>(out.data(), B, S, H, D, order);
    const auto src = strided_view();
    for_each_element(B, S, H, D, [&](Index i, Index t, Index k, Index e) { dst(i, t, k, e) = from(src(i, t, k, e)); });
    return out;
  }
  // Elements outside the view that no longer hold `fill`.
  [[nodiscard]] Index touched_padding(double fill) const {
    std::vector<unsigned char> inside(buf.size(), 0);
    for_each_element(B, S, H, D, [&](Index i, Index t, Index k, Index e) {
      inside[static_cast<std::size_t>(i * strides.batch + t * strides.token + k * strides.head + e)] = 1;
    });
    Index n = 0;
    for (std::size_t i = 0; i < buf.size(); ++i)
      if (!inside[i] && from(buf[i]) != fill) ++n;
    return n;
  }
};

// Attention with q, k, v and out in strided buffers (k and v stored as KV) against the reference on
// the dense problem, rounded as stored.
template <class T, class KV>
void check_strided(const config& c, row_padding pad) {
  INFO(describe(c) << " padding " << pad.head << "/" << pad.token << "/" << pad.batch << "/" << pad.tokens
                   << (std::is_same_v<KV, Eigen::half> ? " f16"
                       : std::is_same_v<KV, T>         ? ""
                                                       : " bf16")
                   << (std::is_same_v<T, float> ? " float" : " double"));
  const problem p = rounded_kv<T, KV>(c);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  strided_copy<T> q(p.q, c.B, c.Sq, c.H, c.D, c.order, pad, nan);
  strided_copy<KV> k(p.k, c.B, c.Sk, c.Hkv, c.D, c.order, pad, nan), v(p.v, c.B, c.Sk, c.Hkv, c.Dv, c.order, pad, nan);
  strided_copy<T> out(std::vector<double>(static_cast<std::size_t>(c.B * c.Sq * c.H * c.Dv), 0.0), c.B, c.Sq, c.H, c.Dv,
                      c.order, pad, 123.0);
  std::vector<T> lse(static_cast<std::size_t>(c.B * c.H * c.Sq));
  Eigen::ThreadPool pool(2);
  auto opt = p.options();
  opt.pool = &pool;
  const posenc::tensor_map<T, 3> lv(lse.data(), c.B, c.H, c.Sq);
  if constexpr (std::is_same_v<KV, T>)
    posenc::attention<T>(q.strided_view(), k.strided_view(), v.strided_view(), out.strided_view(), lv,
                         posenc::no_position{}, opt);
  else
    posenc::attention<T, KV>(q.strided_view(), k.strided_view(), v.strided_view(), out.strided_view(), lv,
                             posenc::no_position{}, opt);
  CHECK(out.touched_padding(123.0) == 0);
  const result want = run_reference<double>(p, {});
  expect_close<T>(out.gather(c.order), want.out, "out");
  expect_close<T>(std::vector<double>(lse.begin(), lse.end()), want.lse, "lse");
}

}  // namespace

TEST_CASE("attention: strided views (padded rows, a preallocated cache's first tokens), both paths, f32 / f16 K/V",
          "[kernel][decode][view]") {
  // decode: 1 row per query head (keys swept across the kv heads, whose rows are now apart), 4 and
  // 16 rows per kv head (the column layout), a BHSD cache; tiled: a prefill
  std::vector<config> cs;
  auto add = [&](Index B, Index sq, Index sk, Index h, Index hkv, Index d, Index dv, layout order, padding pad,
                 offset off) {
    cs.push_back(config{.B = B, .Sq = sq, .Sk = sk, .H = h, .Hkv = hkv, .D = d, .Dv = dv, .order = order,
                        .causal = true, .pad = pad, .off = off, .seed = static_cast<unsigned>(41 + cs.size())});
  };
  add(2, 1, 1100, 8, 2, 64, 64, layout::bshd, padding::mask, offset::q_offset);
  add(2, 1, 700, 32, 8, 128, 128, layout::bshd, padding::none, offset::q_offset);
  add(1, 4, 1300, 8, 2, 40, 24, layout::bshd, padding::none, offset::q_offset);
  add(2, 3, 900, 4, 1, 32, 32, layout::bhsd, padding::lengths, offset::q_offset);
  add(2, 70, 90, 4, 2, 24, 16, layout::bshd, padding::mask, offset::q_offset);
  add(2, 50, 50, 2, 2, 16, 16, layout::bhsd, padding::none, offset::none);
  cs[4].q_block = 32;
  cs[4].k_block = 64;
  for (const config& c : cs)
    for (const row_padding pad :
         {row_padding{.token = 16}, row_padding{.head = 3, .token = 5, .batch = 7, .tokens = 33},
          row_padding{.tokens = 100}}) {
      check_strided<float, float>(c, pad);
      check_strided<float, Eigen::half>(c, pad);
      check_strided<double, double>(c, pad);
    }
}

TEST_CASE("attention: q, k and v as head slices of one fused QKV buffer, decoding its last tokens",
          "[kernel][decode][view]") {
  // [batch, tokens, H + 2 Hkv, D] as a fused projection writes it; the cache part is the first
  // `cached` tokens of a buffer of `capacity`
  const Index B = 2, H = 8, Hkv = 2, D = 32, capacity = 1200, cached = 1037, W = H + 2 * Hkv;
  std::mt19937 rng(5);
  std::normal_distribution<float> n;
  std::vector<float> qkv(static_cast<std::size_t>(B * capacity * W * D));
  for (auto& e : qkv) e = n(rng);
  const auto all = posenc::bshd<const float>(qkv.data(), B, capacity, W, D).slice_tokens(0, cached);
  for (const Index rows : {Index{1}, Index{3}, Index{cached}}) {
    INFO("query rows " << rows);
    const auto q = all.slice_tokens(cached - rows, rows).slice_heads(0, H);
    const auto k = all.slice_heads(H, Hkv), v = all.slice_heads(H + Hkv, Hkv);
    // dense copies for the reference, indexed in the fused buffer by hand
    std::vector<double> dq(static_cast<std::size_t>(B * rows * H * D)),
        dk(static_cast<std::size_t>(B * cached * Hkv * D)), dv(dk.size());
    auto copy = [&](Index t0, Index seq, Index h0, Index heads, std::vector<double>& dst) {
      for_each_element(B, seq, heads, D, [&](Index b, Index s, Index h, Index d) {
        dst[static_cast<std::size_t>(((b * seq + s) * heads + h) * D + d)] =
            qkv[static_cast<std::size_t>(((b * capacity + t0 + s) * W + h0 + h) * D + d)];
      });
    };
    copy(cached - rows, rows, 0, H, dq);
    copy(0, cached, H, Hkv, dk);
    copy(0, cached, H + Hkv, Hkv, dv);
    std::vector<float> out(static_cast<std::size_t>(B * rows * H * D));
    std::vector<double> want(out.size());
    const posenc::attention_options opt{.causal = true, .q_offset = cached - rows};
    posenc::attention<float>(q, k, v, posenc::bshd(out.data(), B, rows, H, D), posenc::no_position{}, opt);
    posenc::reference_attention<double>(
        posenc::bshd<const double>(dq.data(), B, rows, H, D), posenc::bshd<const double>(dk.data(), B, cached, Hkv, D),
        posenc::bshd<const double>(dv.data(), B, cached, Hkv, D), posenc::bshd(want.data(), B, rows, H, D), opt);
    double worst = 0;
    for (std::size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(out[i] - want[i]));
    CHECK(worst < 2e-5);
  }
}

TEST_CASE("attention: an output view reaching into an input's span is refused", "[kernel][view][errors]") {
  std::vector<float> buf(2 * 10 * 6 * 8, 1.f);
  const auto all = posenc::bshd(buf.data(), 2, 10, 6, 8);
  // q and k, v are head slices of one buffer (inputs may interleave); out is the buffer's q part
  CHECK_THROWS_WITH(posenc::attention<float>(all.slice_heads(0, 2), all.slice_heads(2, 2), all.slice_heads(4, 2),
                                             all.slice_heads(0, 2), posenc::no_position{}),
                    Catch::Contains("out") && Catch::Contains("must not overlap q"));
}
