// The bad-input catalogue: one test case per class of bad input over every public entry point
// (docs/design.md › Errors). Each case checks that the call throws posenc::error, that the message
// names the argument and the constraint, and that every output buffer is bitwise unchanged.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/posenc.hpp"
#include "posenc/io/hf_config.hpp"
#include "posenc/io/safetensors.hpp"
#include "random.hpp"

namespace {

using idx = posenc::index_t;
constexpr double nan_v = std::numeric_limits<double>::quiet_NaN();
constexpr double inf_v = std::numeric_limits<double>::infinity();

/// Runs `call`, requires a posenc::error whose message contains every one of `parts` (the argument
/// and the constraint).
void expect_error(const std::function<void()>& call, std::initializer_list<const char*> parts) {
  std::string what;
  try {
    call();
  } catch (const posenc::error& e) {
    what = e.what();
  }
  INFO("message: " << what);
  REQUIRE(!what.empty());
  for (const char* p : parts) CHECK_THAT(what, Catch::Contains(p));
}

/// A buffer with a recognisable pattern (NaN-free) and a copy of its bytes to compare against.
struct guarded {
  std::vector<double> data;
  std::vector<double> before;
  explicit guarded(std::size_t n, double fill = 7.25) : data(n, fill) {
    for (std::size_t i = 0; i < n; ++i) data[i] = fill + static_cast<double>(i % 13);
    before = data;
  }
  [[nodiscard]] bool unchanged() const {
    return data.size() == before.size() && std::memcmp(data.data(), before.data(), data.size() * sizeof(double)) == 0;
  }
};

/// q, k, v [B, S, H|Hkv, D] BSHD and a guarded out: the operands of the kernel cases.
struct attention_call {
  idx B = 2, S = 8, H = 4, Hkv = 2, D = 16;
  std::vector<double> q = test_util::randn(static_cast<std::size_t>(B * S * H * D), 1);
  std::vector<double> k = test_util::randn(static_cast<std::size_t>(B * S * Hkv * D), 2);
  std::vector<double> v = test_util::randn(static_cast<std::size_t>(B * S * Hkv * D), 3);
  guarded out{static_cast<std::size_t>(B * S * H * D)};
  guarded lse{static_cast<std::size_t>(B * H * S)};

  [[nodiscard]] posenc::heads_view<const double> qv() const { return posenc::bshd<const double>(q.data(), B, S, H, D); }
  [[nodiscard]] posenc::heads_view<const double> kv() const { return posenc::bshd<const double>(k.data(), B, S, Hkv, D); }
  [[nodiscard]] posenc::heads_view<const double> vv() const { return posenc::bshd<const double>(v.data(), B, S, Hkv, D); }
  [[nodiscard]] posenc::heads_view<double> ov() { return posenc::bshd(out.data.data(), B, S, H, D); }

  template <class E = posenc::no_position>
  void run(const posenc::attention_options& opt, const E& enc = {}) {
    posenc::attention<double>(qv(), kv(), vv(), ov(), enc, opt);
  }
};

/// The rope of the kernel cases and a valid config to break one field of.
posenc::rope_config rope_cfg(idx head_dim = 64) {
  posenc::rope_config c;
  c.head_dim = head_dim;
  return c;
}

posenc::rope_config yarn_cfg(double factor) {
  posenc::rope_config c = rope_cfg();
  c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = factor, .original_max_position_embeddings = 4096};
  c.max_position_embeddings = 16384;
  return c;
}

posenc::rope_config longrope_cfg(std::size_t short_n, std::size_t long_n) {
  posenc::rope_config c = rope_cfg();
  c.scaling = {.rope_type = posenc::rope_type::longrope, .original_max_position_embeddings = 4096,
               .short_factor = std::vector<double>(short_n, 1.0), .long_factor = std::vector<double>(long_n, 1.0)};
  c.max_position_embeddings = 8192;
  return c;
}

// ---- safetensors images --------------------------------------------------------------------------

std::vector<unsigned char> image(const std::string& header, std::size_t data_bytes, std::uint64_t declared_length) {
  std::vector<unsigned char> b(8);
  for (int i = 0; i < 8; ++i) b[static_cast<std::size_t>(i)] = static_cast<unsigned char>(declared_length >> (8 * i));
  b.insert(b.end(), header.begin(), header.end());
  b.insert(b.end(), data_bytes, 0);
  return b;
}
std::vector<unsigned char> image(const std::string& header, std::size_t data_bytes) {
  return image(header, data_bytes, header.size());
}
void expect_safetensors_error(const std::vector<unsigned char>& bytes, std::initializer_list<const char*> parts) {
  expect_error([&] { (void)posenc::io::safetensors_file::parse(bytes); }, parts);
}

}  // namespace

// ---- attention: shapes, layouts, overlaps, options -----------------------------------------------

TEST_CASE("errors: attention k head_dim differs from q's", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), posenc::bshd<const double>(c.k.data(), c.B, c.S * 2, c.Hkv, c.D / 2),
                                               posenc::bshd<const double>(c.v.data(), c.B, c.S * 2, c.Hkv, c.D / 2), c.ov()); },
               {"k:", "head_dim must equal q's head_dim", "8 vs 16"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention k batch differs from q's", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), posenc::bshd<const double>(c.k.data(), 1, c.S * 2, c.Hkv, c.D),
                                               posenc::bshd<const double>(c.v.data(), 1, c.S * 2, c.Hkv, c.D), c.ov()); },
               {"k:", "batch must equal q's batch", "1 vs 2"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention v seq differs from k's", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), c.kv(), posenc::bshd<const double>(c.v.data(), c.B, c.S / 2, c.Hkv, c.D),
                                               c.ov()); },
               {"v:", "seq must equal k's seq", "4 vs 8"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention v heads differ from k's", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), c.kv(), posenc::bshd<const double>(c.v.data(), c.B, c.S, 1, c.D),
                                               c.ov()); },
               {"v:", "heads must equal k's heads", "1 vs 2"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention out seq differs from q's", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), c.kv(), c.vv(), posenc::bshd(c.out.data.data(), c.B, c.S - 1, c.H, c.D)); },
               {"out:", "seq must equal q's seq", "7 vs 8"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention out heads differ from q's", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), c.kv(), c.vv(), posenc::bshd(c.out.data.data(), c.B, c.S, 2, c.D)); },
               {"out:", "heads must equal q's heads", "2 vs 4"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention out head_dim differs from v's", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), c.kv(), c.vv(), posenc::bshd(c.out.data.data(), c.B, c.S, c.H, c.D / 2)); },
               {"out:", "head_dim must equal v's head_dim", "8 vs 16"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention with head_dim 0", "[errors]") {
  // With an explicit scale this used to reach GEBP with depth 0 and die of SIGFPE (division by zero).
  attention_call c;
  posenc::attention_options opt;
  opt.scale = 1.0;
  expect_error([&] { posenc::attention<double>(posenc::bshd<const double>(c.q.data(), c.B, c.S, c.H, 0),
                                               posenc::bshd<const double>(c.k.data(), c.B, c.S, c.Hkv, 0), c.vv(), c.ov(),
                                               posenc::no_position{}, opt); },
               {"q:", "head_dim must be > 0", "0"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention heads not a multiple of kv_heads", "[errors]") {
  attention_call c;
  c.Hkv = 3;
  c.k.resize(static_cast<std::size_t>(c.B * c.S * 3 * c.D));
  c.v.resize(c.k.size());
  expect_error([&] { c.run({}); }, {"k:", "must divide q's heads", "3 for 4 query heads"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention out in a layout that overlaps q", "[errors]") {
  // The same buffer seen as BHSD out and BSHD q: it cannot be both.
  attention_call c;
  std::vector<double> qbuf = c.q;
  const std::vector<double> q_before = qbuf;
  expect_error([&] { posenc::attention<double>(posenc::bshd<const double>(qbuf.data(), c.B, c.S, c.H, c.D), c.kv(), c.vv(),
                                               posenc::bhsd(qbuf.data(), c.B, c.H, c.S, c.D)); },
               {"out:", "must not overlap q"});
  CHECK(qbuf == q_before);
}

TEST_CASE("errors: attention out overlaps v", "[errors]") {
  attention_call c;
  c.Hkv = c.H;  // v as large as out, shifted by one element into it
  std::vector<double> buf(static_cast<std::size_t>(c.B * c.S * c.H * c.D) + 1, 0.5);
  c.k = test_util::randn(buf.size() - 1, 4);
  const std::vector<double> before = buf;
  expect_error([&] { posenc::attention<double>(c.qv(), c.kv(), posenc::bshd<const double>(buf.data() + 1, c.B, c.S, c.H, c.D),
                                               posenc::bshd(buf.data(), c.B, c.S, c.H, c.D)); },
               {"out:", "must not overlap v"});
  CHECK(buf == before);
}

TEST_CASE("errors: attention lse of the wrong shape", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), c.kv(), c.vv(), c.ov(),
                                               posenc::tensor_map<double, 3>(c.lse.data.data(), c.B, c.S, c.H)); },
               {"lse:", "must be [batch, heads, q_len]", "[2, 8, 4] for [2, 4, 8]"});
  CHECK(c.out.unchanged());
  CHECK(c.lse.unchanged());
}

TEST_CASE("errors: attention lse overlaps out", "[errors]") {
  attention_call c;
  expect_error([&] { posenc::attention<double>(c.qv(), c.kv(), c.vv(), c.ov(),
                                               posenc::tensor_map<double, 3>(c.out.data.data(), c.B, c.H, c.S)); },
               {"lse:", "must not overlap"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention negative q_block", "[errors]") {
  attention_call c;
  posenc::attention_options opt;
  opt.q_block = -1;
  expect_error([&] { c.run(opt); }, {"q_block:", "must be >= 0", "-1"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention NaN scale", "[errors]") {
  attention_call c;
  posenc::attention_options opt;
  opt.scale = nan_v;
  expect_error([&] { c.run(opt); }, {"scale:", "must be finite", "nan"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention infinite scale", "[errors]") {
  attention_call c;
  posenc::attention_options opt;
  opt.scale = inf_v;
  expect_error([&] { c.run(opt); }, {"scale:", "must be finite", "inf"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention q_positions of the wrong shape", "[errors]") {
  attention_call c;
  const auto pos = posenc::contiguous_positions(c.B, c.S + 1);
  posenc::attention_options opt;
  opt.q_positions = posenc::view(pos);
  expect_error([&] { c.run(opt); }, {"q_positions:", "[batch, q_len]"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention k_positions of the wrong shape", "[errors]") {
  attention_call c;
  const auto pos = posenc::contiguous_positions(1, c.S);
  posenc::attention_options opt;
  opt.k_positions = posenc::view(pos);
  expect_error([&] { c.run(opt); }, {"k_positions:", "[batch, k_len]"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention key_padding_mask of the wrong shape", "[errors]") {
  attention_call c;
  const std::vector<std::int64_t> mask(static_cast<std::size_t>(c.B * (c.S - 2)), 0);
  posenc::attention_options opt;
  opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(mask.data(), c.B, c.S - 2);
  expect_error([&] { c.run(opt); }, {"key_padding_mask:", "[batch, k_len]"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention kv_lengths with the wrong count", "[errors]") {
  attention_call c;
  const std::vector<std::int64_t> lengths = {8};
  posenc::attention_options opt;
  opt.kv_lengths = lengths;
  expect_error([&] { c.run(opt); }, {"kv_lengths:", "one entry per batch row"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention kv_lengths entry above k_len", "[errors]") {
  attention_call c;
  const std::vector<std::int64_t> lengths = {8, 9};
  posenc::attention_options opt;
  opt.kv_lengths = lengths;
  expect_error([&] { c.run(opt); }, {"kv_lengths:", "entries must be in [0, k_len]", "9 at batch 1"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention negative kv_lengths entry", "[errors]") {
  attention_call c;
  const std::vector<std::int64_t> lengths = {-1, 8};
  posenc::attention_options opt;
  opt.kv_lengths = lengths;
  expect_error([&] { c.run(opt); }, {"kv_lengths:", "entries must be in [0, k_len]", "-1 at batch 0"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: attention q_offset whose last query position would overflow int64", "[errors]") {
  attention_call c;  // q_len 8: positions q_offset .. q_offset + 7
  Eigen::ThreadPool pool(2);
  posenc::attention_options opt;
  opt.causal = true;
  opt.q_offset = std::numeric_limits<std::int64_t>::max() - 6;
  expect_error([&] { c.run(opt); }, {"q_offset:", "within int64", "with q_len 8"});
  opt.pool = &pool;
  expect_error([&] { c.run(opt); }, {"q_offset:", "within int64"});
  CHECK(c.out.unchanged());
  opt.q_offset = std::numeric_limits<std::int64_t>::max() - 7;  // the last position is INT64_MAX itself
  c.run(opt);
  CHECK_FALSE(c.out.unchanged());
}

TEST_CASE("errors: attention with a thread pool rejects before any worker writes", "[errors]") {
  attention_call c;
  Eigen::ThreadPool pool(4);
  const std::vector<std::int64_t> lengths = {8, 100};
  posenc::attention_options opt;
  opt.kv_lengths = lengths;
  opt.pool = &pool;
  expect_error([&] { c.run(opt); }, {"kv_lengths:", "entries must be in [0, k_len]", "100 at batch 1"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: a view with a negative length", "[errors]") {
  std::vector<double> x(16, 1.0);
  expect_error([&] { (void)posenc::bshd(x.data(), 1, -4, 1, 4); }, {"heads_view:", "must be >= 0", "-4"});
}

TEST_CASE("errors: an empty buffer viewed with a non-zero size", "[errors]") {
  expect_error([&] { (void)posenc::bshd<double>(nullptr, 1, 4, 2, 8); }, {"heads_view:", "data must not be null"});
}

TEST_CASE("errors: merge with parts of different shapes", "[errors]") {
  const idx B = 1, S = 4, H = 2, D = 8;
  const auto a = test_util::randn(static_cast<std::size_t>(B * S * H * D), 5);
  const std::vector<double> la(static_cast<std::size_t>(B * H * S), 0.0);
  guarded out(a.size()), lse(la.size());
  expect_error([&] { posenc::merge<double>(posenc::bshd<const double>(a.data(), B, S, H, D),
                                           posenc::tensor_map<const double, 3>(la.data(), B, H, S),
                                           posenc::bshd<const double>(a.data(), B, S / 2, H, D),
                                           posenc::tensor_map<const double, 3>(la.data(), B, H, S),
                                           posenc::bshd(out.data.data(), B, S, H, D),
                                           posenc::tensor_map<double, 3>(lse.data.data(), B, H, S)); },
               {"out_b:", "must have out's shape"});
  CHECK(out.unchanged());
  CHECK(lse.unchanged());
}

TEST_CASE("errors: merge with an lse of the wrong shape", "[errors]") {
  const idx B = 1, S = 4, H = 2, D = 8;
  const auto a = test_util::randn(static_cast<std::size_t>(B * S * H * D), 6);
  const std::vector<double> la(static_cast<std::size_t>(B * H * S), 0.0);
  guarded out(a.size()), lse(la.size());
  expect_error([&] { posenc::merge<double>(posenc::bshd<const double>(a.data(), B, S, H, D),
                                           posenc::tensor_map<const double, 3>(la.data(), B, S, H),
                                           posenc::bshd<const double>(a.data(), B, S, H, D),
                                           posenc::tensor_map<const double, 3>(la.data(), B, H, S),
                                           posenc::bshd(out.data.data(), B, S, H, D),
                                           posenc::tensor_map<double, 3>(lse.data.data(), B, H, S)); },
               {"lse_a:", "must be [batch, heads, seq]"});
  CHECK(out.unchanged());
  CHECK(lse.unchanged());
}

// ---- positions -----------------------------------------------------------------------------------

TEST_CASE("errors: contiguous_positions with a negative length", "[errors]") {
  expect_error([] { (void)posenc::contiguous_positions(1, -3); }, {"seq:", "must be >= 0", "-3"});
}

TEST_CASE("errors: cu_seqlens that decrease", "[errors]") {
  const std::vector<std::int64_t> cu = {0, 5, 3};
  expect_error([&] { (void)posenc::positions_from_cu_seqlens(cu); }, {"cu_seqlens:", "non-decreasing", "5 then 3"});
}

TEST_CASE("errors: an attention_mask entry other than 0 or 1", "[errors]") {
  const std::vector<std::int64_t> m = {1, 1, 2};
  expect_error([&] { (void)posenc::positions_from_attention_mask(posenc::tensor_map<const std::int64_t, 2>(m.data(), 1, 3)); },
               {"attention_mask:", "entries must be 0 or 1", "2 at [0, 2]"});
}

// ---- RoPE ----------------------------------------------------------------------------------------

TEST_CASE("errors: rope with an odd rotary_dim", "[errors]") {
  posenc::rope_config c = rope_cfg();
  c.rotary_dim = 31;
  expect_error([&] { posenc::rope r(c); }, {"rotary_dim:", "must be even", "31"});
}

TEST_CASE("errors: rope with rotary_dim above head_dim", "[errors]") {
  posenc::rope_config c = rope_cfg();
  c.rotary_dim = 66;
  expect_error([&] { posenc::rope r(c); }, {"rotary_dim:", "must be in [1, head_dim]", "66, head_dim 64"});
}

TEST_CASE("errors: rope with head_dim 0", "[errors]") {
  expect_error([] { posenc::rope r(rope_cfg(0)); }, {"head_dim:", "must be > 0", "0"});
}

TEST_CASE("errors: rope with a NaN rope_theta", "[errors]") {
  posenc::rope_config c = rope_cfg();
  c.rope_theta = nan_v;
  expect_error([&] { posenc::rope r(c); }, {"rope_theta:", "must be finite and > 0", "nan"});
}

TEST_CASE("errors: rope with an infinite rope_theta", "[errors]") {
  posenc::rope_config c = rope_cfg();
  c.rope_theta = inf_v;
  expect_error([&] { posenc::rope r(c); }, {"rope_theta:", "must be finite and > 0", "inf"});
}

TEST_CASE("errors: rope with a NaN partial_rotary_factor", "[errors]") {
  posenc::rope_config c = rope_cfg();
  c.partial_rotary_factor = nan_v;
  expect_error([&] { posenc::rope r(c); }, {"partial_rotary_factor:", "nan"});
}

TEST_CASE("errors: rope YaRN factor 0", "[errors]") {
  expect_error([] { posenc::rope r(yarn_cfg(0.0)); }, {"rope_scaling.factor:", "must be finite and > 0", "0"});
}

TEST_CASE("errors: rope YaRN negative factor", "[errors]") {
  expect_error([] { posenc::rope r(yarn_cfg(-2.0)); }, {"rope_scaling.factor:", "must be finite and > 0", "-2"});
}

TEST_CASE("errors: rope YaRN NaN factor", "[errors]") {
  expect_error([] { posenc::rope r(yarn_cfg(nan_v)); }, {"rope_scaling.factor:", "must be finite and > 0", "nan"});
}

TEST_CASE("errors: rope YaRN NaN beta_fast", "[errors]") {
  posenc::rope_config c = yarn_cfg(4.0);
  c.scaling.beta_fast = nan_v;
  expect_error([&] { posenc::rope r(c); }, {"beta_fast", "must be finite", "nan"});
}

TEST_CASE("errors: rope LongRoPE short_factor of the wrong length", "[errors]") {
  expect_error([] { posenc::rope r(longrope_cfg(31, 32)); },
               {"rope_scaling.short_factor:", "must have rotary_dim/2 entries", "31"});
}

TEST_CASE("errors: rope LongRoPE long_factor of the wrong length", "[errors]") {
  expect_error([] { posenc::rope r(longrope_cfg(32, 33)); },
               {"rope_scaling.long_factor:", "must have rotary_dim/2 entries", "33"});
}

TEST_CASE("errors: rope LongRoPE infinite factor entry", "[errors]") {
  posenc::rope_config c = longrope_cfg(32, 32);
  c.scaling.long_factor[5] = inf_v;
  expect_error([&] { posenc::rope r(c); }, {"rope_scaling.long_factor:", "inf"});
}

TEST_CASE("errors: unknown rope_type name", "[errors]") {
  expect_error([] { (void)posenc::rope_type_from_string("ntk"); }, {"rope_type:", "must be one of", "ntk"});
}

TEST_CASE("errors: rope head_dim differs from the call's, with a pool", "[errors]") {
  attention_call c;
  Eigen::ThreadPool pool(2);
  posenc::attention_options opt;
  opt.pool = &pool;
  opt.causal = true;
  const posenc::rope r(rope_cfg(64));
  expect_error([&] { c.run(opt, r); }, {"rope:", "head_dim must equal the call's q/k head_dim", "64 vs 16"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: rope apply out-of-place into a buffer that overlaps in under another layout", "[errors]") {
  const idx S = 4, H = 2, D = 16;
  const posenc::rope r(rope_cfg(D));
  guarded buf(static_cast<std::size_t>(S * H * D));
  const auto pos = posenc::contiguous_positions(1, S);
  expect_error([&] { r.apply(posenc::bshd<const double>(buf.data.data(), 1, S, H, D),
                             posenc::bhsd(buf.data.data(), 1, H, S, D), posenc::view(pos)); },
               {"out:", "must not overlap in"});
  CHECK(buf.unchanged());
}

TEST_CASE("errors: rope apply with positions of the wrong shape", "[errors]") {
  const idx S = 4, H = 2, D = 16;
  const posenc::rope r(rope_cfg(D));
  guarded x(static_cast<std::size_t>(S * H * D));
  const auto pos = posenc::contiguous_positions(1, S + 1);
  expect_error([&] { r.apply(posenc::bshd(x.data.data(), 1, S, H, D), posenc::view(pos)); }, {"positions", "must be [batch, seq]"});
  CHECK(x.unchanged());
}

TEST_CASE("errors: rope apply with a table that misses a position", "[errors]") {
  const idx S = 4, H = 2, D = 16;
  const posenc::rope r(rope_cfg(D));
  guarded x(static_cast<std::size_t>(S * H * D));
  const auto pos = posenc::contiguous_positions(1, S);
  const auto t = r.table<double>(0, S - 1);
  expect_error([&] { r.apply(posenc::bshd(x.data.data(), 1, S, H, D), posenc::view(pos), t); },
               {"table:", "must cover every position", "position 3"});
  CHECK(x.unchanged());
}

// ---- ALiBi, T5 -----------------------------------------------------------------------------------

TEST_CASE("errors: alibi heads differ from the call's", "[errors]") {
  attention_call c;
  expect_error([&] { c.run({}, posenc::alibi({.heads = 8})); }, {"alibi:", "heads must equal the query heads", "8 vs 4"});
  CHECK(c.out.unchanged());
}

TEST_CASE("errors: alibi with a NaN max_bias", "[errors]") {
  expect_error([] { posenc::alibi a({.heads = 4, .max_bias = nan_v}); }, {"max_bias:", "must be finite and > 0", "nan"});
}

TEST_CASE("errors: alibi with zero heads", "[errors]") {
  expect_error([] { posenc::alibi a({.heads = 0}); }, {"heads:", "must be > 0", "0"});
}

TEST_CASE("errors: t5 decoder num_buckets below 2", "[errors]") {
  Eigen::Tensor<double, 2, Eigen::RowMajor> table(1, 4);
  table.setZero();
  expect_error([&] { posenc::t5_relative_bias<double> t(table, {.num_buckets = 1, .is_decoder = true}); },
               {"num_buckets:", "must be >= 2", "1"});
}

TEST_CASE("errors: t5 max_distance not above the exact buckets", "[errors]") {
  Eigen::Tensor<double, 2, Eigen::RowMajor> table(32, 4);
  table.setZero();
  expect_error([&] { posenc::t5_relative_bias<double> t(table, {.num_buckets = 32, .max_distance = 8}); },
               {"max_distance:", "must exceed the exact-bucket count", "8 <= 8"});
}

TEST_CASE("errors: t5 table heads differ from the call's", "[errors]") {
  attention_call c;
  Eigen::Tensor<double, 2, Eigen::RowMajor> table(32, 3);
  table.setZero();
  const posenc::t5_relative_bias<double> t5(table);
  expect_error([&] { c.run({}, t5); }, {"t5_relative_bias:", "must equal the query heads", "3 vs 4"});
  CHECK(c.out.unchanged());
}

// ---- absolute encodings --------------------------------------------------------------------------

TEST_CASE("errors: learned position outside the table", "[errors]") {
  const idx P = 8, D = 4;
  const auto w = test_util::randn(P * D, 7);
  const posenc::learned_absolute<double> pe(posenc::tensor_map<const double, 2>(w.data(), P, D));
  guarded x(static_cast<std::size_t>(2 * D));
  const std::vector<std::int64_t> p = {3, 8};
  expect_error([&] { pe.add_to(posenc::tensor_map<double, 3>(x.data.data(), 1, 2, D),
                               posenc::positions_view(p.data(), 1, 2)); },
               {"pos:", "got 8", "table size 8"});
  CHECK(x.unchanged());
}

TEST_CASE("errors: learned d_model differs from x", "[errors]") {
  const auto w = test_util::randn(8 * 4, 8);
  const posenc::learned_absolute<double> pe(posenc::tensor_map<const double, 2>(w.data(), 8, 4));
  guarded x(static_cast<std::size_t>(2 * 5));
  const auto pos = posenc::contiguous_positions(1, 2);
  expect_error([&] { pe.add_to(posenc::tensor_map<double, 3>(x.data.data(), 1, 2, 5), posenc::view(pos)); },
               {"x:", "must equal the table's d_model", "5 vs 4"});
  CHECK(x.unchanged());
}

TEST_CASE("errors: sinusoidal with an infinite base", "[errors]") {
  expect_error([] { posenc::sinusoidal s({.d_model = 8, .base = inf_v}); }, {"base:", "must be finite and > 0", "inf"});
}

TEST_CASE("errors: sinusoidal with d_model 0", "[errors]") {
  expect_error([] { posenc::sinusoidal s({.d_model = 0}); }, {"d_model:", "must be > 0", "0"});
}

TEST_CASE("errors: sinusoidal add_to with the wrong d_model", "[errors]") {
  const posenc::sinusoidal s({.d_model = 8});
  guarded x(static_cast<std::size_t>(3 * 6));
  const auto pos = posenc::contiguous_positions(1, 3);
  expect_error([&] { s.add_to(posenc::tensor_map<double, 3>(x.data.data(), 1, 3, 6), posenc::view(pos)); },
               {"x:", "must equal d_model", "6 vs 8"});
  CHECK(x.unchanged());
}

// ---- safetensors ---------------------------------------------------------------------------------

TEST_CASE("errors: safetensors truncated before the header length", "[errors]") {
  expect_safetensors_error({1, 2, 3}, {"safetensors", "truncated", "3 bytes"});
}

TEST_CASE("errors: safetensors header length beyond the file", "[errors]") {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  expect_safetensors_error(image(h, 4, h.size() + 100), {"safetensors", "header length", "extends beyond the file"});
}

TEST_CASE("errors: safetensors huge header length", "[errors]") {
  expect_safetensors_error(image("{}", 0, std::uint64_t{1} << 62), {"safetensors", "header length", "exceeds the 100 MB limit"});
}

TEST_CASE("errors: safetensors header that is not JSON", "[errors]") {
  expect_safetensors_error(image("{\"a\": [", 0), {"safetensors", "header is not valid JSON"});
}

TEST_CASE("errors: safetensors header that is not a JSON object", "[errors]") {
  expect_safetensors_error(image("[1, 2, 3]", 0), {"safetensors", "header must be a JSON object", "array"});
}

TEST_CASE("errors: safetensors unknown dtype", "[errors]") {
  expect_safetensors_error(image(R"({"a":{"dtype":"F12","shape":[4],"data_offsets":[0,4]}})", 4),
                           {"tensor 'a'", "unknown dtype 'F12'"});
}

TEST_CASE("errors: safetensors tensor of a dtype posenc lists but does not convert", "[errors]") {
  const auto f =
      posenc::io::safetensors_file::parse(image(R"({"a":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4));
  expect_error([&] { (void)f.values<float>("a"); }, {"tensor 'a'", "stored as F8_E4M3", "does not convert"});
}

TEST_CASE("errors: safetensors size differs from shape times dtype", "[errors]") {
  expect_safetensors_error(image(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20),
                           {"tensor 'a'", "data_offsets span 20 bytes", "needs 24"});
}

TEST_CASE("errors: safetensors offsets beyond the data buffer", "[errors]") {
  expect_safetensors_error(image(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})", 16),
                           {"tensor 'a'", "reach beyond the data buffer of 16 bytes"});
}

TEST_CASE("errors: safetensors offsets with begin after end", "[errors]") {
  expect_safetensors_error(image(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 16),
                           {"tensor 'a'", "begin > end"});
}

TEST_CASE("errors: safetensors overlapping tensors", "[errors]") {
  expect_safetensors_error(image(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                 16),
                           {"tensor 'b'", "overlap tensor 'a'"});
}

TEST_CASE("errors: safetensors negative shape entry", "[errors]") {
  expect_safetensors_error(image(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", 0),
                           {"tensor 'a'", "shape entries must be non-negative integers", "-1"});
}

TEST_CASE("errors: safetensors shape whose element count overflows", "[errors]") {
  expect_safetensors_error(
      image(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0),
      {"tensor 'a'", "is too large"});
}

TEST_CASE("errors: safetensors reading a float tensor as integers", "[errors]") {
  const auto f = posenc::io::safetensors_file::parse(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4));
  expect_error([&] { (void)f.values<std::int64_t>("a"); }, {"tensor 'a'", "stored as F32", "cannot be read as I64"});
}

// ---- config.json ---------------------------------------------------------------------------------

TEST_CASE("errors: config that is not a JSON object", "[errors]") {
  expect_error([] { (void)posenc::io::encoding_from_hf(nlohmann::json::array({1, 2})); }, {"config:", "must be a JSON object"});
}

TEST_CASE("errors: config with an unknown rope_type", "[errors]") {
  const auto cfg = nlohmann::json::parse(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
                                             "rope_scaling":{"rope_type":"ntk-by-parts","factor":2}})");
  expect_error([&] { (void)posenc::io::encoding_from_hf(cfg); }, {"rope_scaling.rope_type:", "unsupported type 'ntk-by-parts'"});
}

TEST_CASE("errors: config rope_scaling that is not an object", "[errors]") {
  const auto cfg = nlohmann::json::parse(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
                                             "rope_scaling":[1,2]})");
  expect_error([&] { (void)posenc::io::rope_config_from_hf(cfg); }, {"rope_scaling:", "must be an object or null"});
}

TEST_CASE("errors: config hidden_size not a multiple of num_attention_heads", "[errors]") {
  const auto cfg = nlohmann::json::parse(R"({"model_type":"llama","hidden_size":65,"num_attention_heads":4})");
  expect_error([&] { (void)posenc::io::rope_config_from_hf(cfg); },
               {"hidden_size:", "must be a multiple of num_attention_heads", "65 / 4"});
}

TEST_CASE("errors: config rope_theta of the wrong JSON type", "[errors]") {
  const auto cfg = nlohmann::json::parse(R"({"model_type":"llama","head_dim":64,"rope_theta":"10000"})");
  expect_error([&] { (void)posenc::io::rope_config_from_hf(cfg); }, {"rope_theta", "has the wrong JSON type"});
}

TEST_CASE("errors: config LongRoPE short_factor that is not a list", "[errors]") {
  const auto cfg = nlohmann::json::parse(R"({"model_type":"phi3","head_dim":64,
                                             "rope_scaling":{"type":"longrope","short_factor":3,"long_factor":[]}})");
  expect_error([&] { (void)posenc::io::rope_config_from_hf(cfg); }, {"rope_scaling.short_factor:", "must be a list of numbers"});
}

TEST_CASE("errors: config of no known family", "[errors]") {
  const auto cfg = nlohmann::json::parse(R"({"model_type":"mamba","hidden_size":64})");
  expect_error([&] { (void)posenc::io::encoding_from_hf(cfg); }, {"config:", "cannot tell the positional encoding", "mamba"});
}

TEST_CASE("errors: config whose YaRN factor is 0 fails when the rope is built", "[errors]") {
  const auto cfg = nlohmann::json::parse(R"({"model_type":"qwen2","head_dim":64,"max_position_embeddings":32768,
                                             "rope_scaling":{"type":"yarn","factor":0,
                                                             "original_max_position_embeddings":4096}})");
  const posenc::rope_config c = posenc::io::rope_config_from_hf(cfg);
  expect_error([&] { posenc::rope r(c); }, {"rope_scaling.factor:", "must be finite and > 0"});
}

TEST_CASE("errors: config file that does not exist", "[errors]") {
  expect_error([] { (void)posenc::io::read_json("/nonexistent/posenc/config.json"); }, {"config:", "cannot open file"});
}

TEST_CASE("errors: safetensors path that is a directory", "[errors]") {
  // A directory opens as a stream; its size used to be read as ~2^63 bytes (std::bad_alloc).
  const auto dir = std::filesystem::temp_directory_path();
  expect_error([&] { (void)posenc::io::read_safetensors(dir); }, {"safetensors:", "must be a file, not a directory"});
}

TEST_CASE("errors: config path that is a directory", "[errors]") {
  // Reading it used to escape as std::ios_base::failure.
  const auto dir = std::filesystem::temp_directory_path();
  expect_error([&] { (void)posenc::io::read_json(dir); }, {"config:", "must be a file, not a directory"});
}
