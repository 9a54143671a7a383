// Tests of posenc/io/safetensors.hpp: files assembled byte by byte here (independently of the writer),
// the writer's canonical layout, a round trip of every dtype, a vendored golden file read by both this
// reader and the independent tests/golden.hpp reader, and the malformed-file set, each with the rule it
// breaks named in the error.
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "golden.hpp"
#include "posenc/io/safetensors.hpp"

namespace {

using bytes_t = std::vector<unsigned char>;
using posenc::io::dtype;
using posenc::io::safetensors_file;
using posenc::io::safetensors_writer;

/// u64 LE length + header text + data, assembled by hand.
bytes_t make_file(const std::string& header, const bytes_t& data, std::uint64_t declared_len = UINT64_MAX) {
  const std::uint64_t n = declared_len == UINT64_MAX ? header.size() : declared_len;
  bytes_t out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<unsigned char>(n >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

template <class T>
void append(bytes_t& b, T x) {
  unsigned char raw[sizeof(T)];
  std::memcpy(raw, &x, sizeof(T));
  b.insert(b.end(), raw, raw + sizeof(T));
}

/// A file in the temporary directory, removed when the test leaves its scope.
struct temp_file {
  explicit temp_file(const std::string& name, const bytes_t& bytes)
      : path(std::filesystem::temp_directory_path() /
             (name + "." + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()))) {
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;
  ~temp_file() { std::filesystem::remove(path); }
  std::filesystem::path path;
};

/// The message of the posenc::error that f throws (a failed check when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const posenc::error& e) {
    return e.what();
  }
  FAIL("no error thrown");
  return {};
}

/// Parse and expect a posenc::error whose message contains every fragment; the same file written to
/// disk and read mapped and into memory gives the same message (but the source's name).
void expect_error(const bytes_t& file, std::initializer_list<std::string> fragments) {
  const std::string msg = error_of([&] { (void)safetensors_file::parse(file, "case.safetensors"); });
  INFO(msg);
  CHECK(msg.find("case.safetensors") != std::string::npos);
  for (const auto& f : fragments) CHECK(msg.find(f) != std::string::npos);
  const temp_file disk("posenc_test_malformed.safetensors", file);
  std::string on_disk = msg;
  if (const auto at = on_disk.find("case.safetensors"); at != std::string::npos)
    on_disk.replace(at, std::string("case.safetensors").size(), disk.path.string());
  CHECK(error_of([&] { (void)posenc::io::read_safetensors(disk.path); }) == on_disk);
  CHECK(error_of([&] { (void)posenc::io::read_safetensors(disk.path, {.memory_map = false}); }) == on_disk);
}

}  // namespace

TEST_CASE("safetensors: hand-assembled file with every dtype and unaligned offsets", "[io][safetensors]") {
  // Payload order: an odd F32 tensor first shifts the F64 one to offset 12 (not 8-aligned).
  bytes_t data;
  append<float>(data, 1.5f);
  append<float>(data, -2.25f);
  append<float>(data, 3.0f);  // a [3] F32: bytes [0, 12)
  append<double>(data, 0.1);
  append<double>(data, -1e300);         // b [2] F64: [12, 28)
  append<std::uint16_t>(data, 0x3C00);  // F16 1.0
  append<std::uint16_t>(data, 0xC000);  // F16 -2.0
  append<std::uint16_t>(data, 0x7BFF);  // F16 65504 (largest finite)
  append<std::uint16_t>(data, 0x0001);  // F16 smallest subnormal 2^-24   c [2,2] F16: [28, 36)
  append<std::uint16_t>(data, 0x3F80);  // BF16 1.0
  append<std::uint16_t>(data, 0x4049);  // BF16 3.140625  d [2] BF16: [36, 40)
  append<std::int64_t>(data, -7);
  append<std::int64_t>(data, INT64_C(1) << 40);  // e [2] I64: [40, 56)
  append<std::int32_t>(data, 2147483647);        // f [] I32 scalar: [56, 60)
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"b":{"dtype":"F64","shape":[2],"data_offsets":[12,28]},)"
      R"("c":{"dtype":"F16","shape":[2,2],"data_offsets":[28,36]},"d":{"dtype":"BF16","shape":[2],"data_offsets":[36,40]},)"
      R"("e":{"dtype":"I64","shape":[2],"data_offsets":[40,56]},"f":{"dtype":"I32","shape":[],"data_offsets":[56,60]},)"
      R"("__metadata__":{"format":"pt"}})";
  const auto f = safetensors_file::parse(make_file(header, data));

  CHECK(f.size() == 6);
  CHECK(f.names() == std::vector<std::string>{"a", "b", "c", "d", "e", "f"});
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.info("b").begin == 12);
  CHECK(f.info("f").numel() == 1);
  CHECK(f.info("f").rank() == 0);

  CHECK(f.values<float>("a") == std::vector<float>{1.5f, -2.25f, 3.0f});
  CHECK(f.values<double>("a") == std::vector<double>{1.5, -2.25, 3.0});
  CHECK(f.values<double>("b") == std::vector<double>{0.1, -1e300});
  CHECK(f.values<float>("b")[0] == 0.1f);
  CHECK(f.values<double>("c") == std::vector<double>{1.0, -2.0, 65504.0, 0x1p-24});
  CHECK(f.values<float>("d") == std::vector<float>{1.0f, 3.140625f});
  CHECK(f.values<std::int64_t>("e") == std::vector<std::int64_t>{-7, INT64_C(1) << 40});
  CHECK(f.values<std::int64_t>("f") == std::vector<std::int64_t>{2147483647});
  CHECK(f.values<std::int32_t>("f") == std::vector<std::int32_t>{2147483647});

  // Raw half types come back bit for bit.
  const auto halves = f.values<Eigen::half>("c");
  CHECK(Eigen::numext::bit_cast<std::uint16_t>(halves[2]) == 0x7BFF);
  CHECK(static_cast<float>(f.values<Eigen::bfloat16>("d")[1]) == 3.140625f);
  CHECK_THROWS_WITH(f.values<Eigen::half>("d"), Catch::Contains("BF16"));

  const auto c = f.tensor<double, 2>("c");
  CHECK(c.dimension(0) == 2);
  CHECK(c(1, 0) == 65504.0);
  CHECK(c(0, 1) == -2.0);

  // Refused conversions and lookups name the tensor.
  CHECK_THROWS_WITH(f.values<double>("e"), Catch::Contains("'e'") && Catch::Contains("I64"));
  CHECK_THROWS_WITH(f.values<std::int64_t>("a"), Catch::Contains("'a'") && Catch::Contains("F32"));
  CHECK_THROWS_WITH(f.values<std::int32_t>("e"), Catch::Contains("'e'") && Catch::Contains("int32"));
  CHECK_THROWS_WITH((f.tensor<double, 3>("c")), Catch::Contains("'c'") && Catch::Contains("rank is 2"));
  CHECK_THROWS_WITH(f.info("zz"), Catch::Contains("no tensor 'zz'"));
}

TEST_CASE("safetensors: writer produces the canonical layout", "[io][safetensors]") {
  safetensors_writer w;
  w.add<double>("zeta", {2}, std::vector<double>{1.0, 2.0});
  w.add<float>("alpha", {1, 3}, std::vector<float>{1, 2, 3});
  w.add<std::int64_t>("mid", {}, std::vector<std::int64_t>{42});
  w.metadata("case", "x");
  const auto b = w.bytes();

  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[static_cast<std::size_t>(i)];
  CHECK(n % 8 == 0);
  const std::string header(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  CHECK(header.substr(header.find_last_not_of(' ') + 1).find_first_not_of(' ') == std::string::npos);
  const auto j = nlohmann::json::parse(header);
  // Sorted names packed back to back: alpha [0,12), mid [12,20), zeta [20,36).
  CHECK(j.at("alpha").at("data_offsets") == nlohmann::json::array({0, 12}));
  CHECK(j.at("mid").at("data_offsets") == nlohmann::json::array({12, 20}));
  CHECK(j.at("zeta").at("data_offsets") == nlohmann::json::array({20, 36}));
  CHECK(j.at("mid").at("shape") == nlohmann::json::array());
  CHECK(j.at("__metadata__").at("case") == "x");
  CHECK(b.size() == 8 + n + 36);
  double z1;
  std::memcpy(&z1, b.data() + 8 + n + 28, 8);
  CHECK(z1 == 2.0);

  CHECK_THROWS_WITH(w.add<double>("zeta", {1}, std::vector<double>{0}), Catch::Contains("duplicate"));
  CHECK_THROWS_WITH(w.add<double>("bad", {2, 2}, std::vector<double>{0}), Catch::Contains("product of the shape"));
  CHECK_THROWS_WITH(w.add_as<double>("bad", dtype::i64, {1}, std::vector<double>{0}), Catch::Contains("integer"));
  CHECK_THROWS_WITH(w.add_as<std::int64_t>("bad", dtype::i32, {1}, std::vector<std::int64_t>{INT64_C(1) << 33}),
                    Catch::Contains("I32"));
}

TEST_CASE("safetensors: round trip of every dtype through a file", "[io][safetensors]") {
  const std::vector<double> x{0.0, -1.0, 0.5, 3.0, -65504.0, 1e-3};
  const std::vector<std::int64_t> ix{0, -1, INT64_C(1) << 50, 7, -9, 3};
  safetensors_writer w;
  w.add<double>("f64", {2, 3}, x);
  w.add_as<double>("f32", dtype::f32, {3, 2}, x);
  w.add_as<double>("f16", dtype::f16, {6}, x);
  w.add_as<double>("bf16", dtype::bf16, {1, 6}, x);
  w.add<std::int64_t>("i64", {6}, ix);
  w.add_as<std::int64_t>("i32", dtype::i32, {6}, std::vector<std::int64_t>{0, -1, 2147483647, -2147483648LL, 5, 6});
  Eigen::Tensor<float, 3, Eigen::RowMajor> t(2, 1, 3);
  for (int i = 0; i < 6; ++i) t.data()[i] = 0.25f * static_cast<float>(i);
  w.add("eigen", t);

  const auto f = [&] {
    const temp_file disk("posenc_test_roundtrip.safetensors", {});
    w.write(disk.path);
    return posenc::io::read_safetensors(disk.path);
  }();

  CHECK(f.values<double>("f64") == x);
  CHECK(f.info("f64").shape == std::vector<std::int64_t>{2, 3});
  const auto f32 = f.values<double>("f32");
  const auto f16 = f.values<double>("f16");
  const auto bf16 = f.values<double>("bf16");
  for (std::size_t i = 0; i < x.size(); ++i) {
    CHECK(f32[i] == static_cast<double>(static_cast<float>(x[i])));
    // Round to nearest: relative error <= 2^-11 (F16) and 2^-8 (BF16) of the value.
    CHECK(std::abs(f16[i] - x[i]) <= 0x1p-11 * std::abs(x[i]));
    CHECK(std::abs(bf16[i] - x[i]) <= 0x1p-8 * std::abs(x[i]));
  }
  CHECK(f16[2] == 0.5);
  CHECK(f16[4] == -65504.0);
  CHECK(f.info("f16").dtype == dtype::f16);
  CHECK(f.info("bf16").dtype == dtype::bf16);
  CHECK(f.values<std::int64_t>("i64") == ix);
  CHECK(f.values<std::int64_t>("i32") == std::vector<std::int64_t>{0, -1, 2147483647, -2147483648LL, 5, 6});
  const auto e = f.tensor<float, 3>("eigen");
  CHECK(e.dimension(2) == 3);
  CHECK(e(1, 0, 2) == 1.25f);
}

TEST_CASE("safetensors: a mapped file reads as the same file held in memory, and outlives its name",
          "[io][safetensors]") {
  // Unaligned payloads (an F16 of 3 elements shifts every later offset by 6 bytes) of every dtype.
  safetensors_writer w;
  const std::vector<double> x{0.5, -2.0, 3.25, 1e-3, -7.0, 65504.0, 0.0};
  w.add_as<double>("a_f16", dtype::f16, {3}, {x.begin(), x.begin() + 3});
  w.add<double>("b_f64", {7}, x);
  w.add_as<double>("c_bf16", dtype::bf16, {7}, x);
  w.add_as<double>("d_f32", dtype::f32, {7, 1}, x);
  w.add<std::int64_t>("e_i64", {2}, std::vector<std::int64_t>{-3, INT64_C(1) << 40});
  w.add_as<std::int64_t>("f_i32", dtype::i32, {1}, std::vector<std::int64_t>{12});
  w.metadata("format", "pt");
  const auto image = w.bytes();
  std::optional<temp_file> disk(std::in_place, "posenc_test_mapped.safetensors", image);

  const auto in_memory = safetensors_file::parse(image);
  const auto read = posenc::io::read_safetensors(disk->path, {.memory_map = false});
  auto mapped = std::make_optional(posenc::io::read_safetensors(disk->path));
  CHECK_FALSE(in_memory.mapped());
  CHECK_FALSE(read.mapped());
  CHECK(mapped->mapped() == (POSENC_SAFETENSORS_MMAP == 1));
  const auto copy = *mapped;  // shares the mapping
  mapped.reset();
  disk.reset();  // the name goes; a mapping keeps the file's pages
  REQUIRE(copy.names() == in_memory.names());
  CHECK(copy.metadata() == in_memory.metadata());
  for (const auto& name : in_memory.names()) {
    INFO(name);
    const auto a = in_memory.bytes(name), b = copy.bytes(name), c = read.bytes(name);
    CHECK(std::vector<unsigned char>(b.begin(), b.end()) == std::vector<unsigned char>(a.begin(), a.end()));
    CHECK(std::vector<unsigned char>(c.begin(), c.end()) == std::vector<unsigned char>(a.begin(), a.end()));
    if (in_memory.info(name).dtype == dtype::i64 || in_memory.info(name).dtype == dtype::i32)
      CHECK(copy.values<std::int64_t>(name) == in_memory.values<std::int64_t>(name));
    else
      CHECK(copy.values<double>(name) == in_memory.values<double>(name));
  }
  CHECK(copy.values<double>("b_f64") == x);
}

TEST_CASE("safetensors: a golden file reads the same as with the independent test reader", "[io][safetensors]") {
  const std::string path = std::string(POSENC_TEST_DATA) + "/t5_decoder_32_128_decode_step_pos199.safetensors";
  const auto f = posenc::io::read_safetensors(path);
  const auto g = golden::read_safetensors(path);
  REQUIRE(f.size() == g.size());
  for (const auto& [name, t] : g) {
    INFO(name);
    CHECK(std::string(posenc::io::dtype_name(f.info(name).dtype)) == t.dtype);
    CHECK(f.info(name).shape == t.shape);
    if (t.dtype == "I64")
      CHECK(f.values<std::int64_t>(name) == t.i64());
    else
      CHECK(f.values<double>(name) == t.f64());
  }
  CHECK(f.metadata().at("kind") == "t5");
}

TEST_CASE("safetensors: malformed files give errors naming the violation", "[io][safetensors]") {
  bytes_t eight;  // one F64
  append<double>(eight, 1.0);
  const std::string ok = R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})";
  REQUIRE_NOTHROW(safetensors_file::parse(make_file(ok, eight)));

  SECTION("truncated before the length") {
    expect_error(bytes_t{1, 0, 0}, {"truncated"});
  }
  SECTION("empty") {
    expect_error(bytes_t{}, {"truncated: 0 bytes"});
  }
  SECTION("truncated payload") {
    expect_error(make_file(ok, bytes_t(eight.begin(), eight.begin() + 5)), {"'x'", "beyond the data buffer"});
  }
  SECTION("header length beyond the file") {
    expect_error(make_file(ok, eight, ok.size() + 100), {"header length", "beyond the file"});
  }
  SECTION("header length over 100 MB") {
    expect_error(make_file(ok, eight, 200'000'000), {"100 MB"});
  }
  SECTION("header not JSON") {
    expect_error(make_file("{\"x\": [", eight), {"not valid JSON"});
  }
  SECTION("non-object JSON") {
    expect_error(make_file("[1, 2, 3]", eight), {"must be a JSON object", "array"});
  }
  SECTION("entry not an object") {
    expect_error(make_file(R"({"x": 3})", eight), {"'x'", "object"});
  }
  SECTION("unknown dtype") {
    expect_error(make_file(R"({"x":{"dtype":"F12","shape":[8],"data_offsets":[0,8]}})", eight),
                 {"'x'", "unknown dtype 'F12'", "F8_E4M3"});
  }
  SECTION("a dtype of the format that posenc does not convert: its size checked like the others") {
    expect_error(make_file(R"({"x":{"dtype":"U16","shape":[3],"data_offsets":[0,8]}})", eight),
                 {"'x'", "span 8 bytes", "U16 needs 6"});
  }
  SECTION("a name twice (the reference keeps one of them silently)") {
    bytes_t sixteen = eight;
    append<double>(sixteen, 2.0);
    expect_error(make_file(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},)"
                           R"("a":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}})",
                           sixteen),
                 {"'a'", "appears twice"});
  }
  SECTION("bytes between two payloads") {
    bytes_t twentyfour = eight;
    append<double>(twentyfour, 2.0);
    append<double>(twentyfour, 3.0);
    expect_error(make_file(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F64","shape":[1],"data_offsets":[16,24]}})",
                           twentyfour),
                 {"'b'", "leave bytes [8, 16)", "to no tensor"});
  }
  SECTION("bytes after the last payload") {
    bytes_t sixteen = eight;
    append<double>(sixteen, 2.0);
    expect_error(make_file(ok, sixteen), {"8 bytes after the last tensor", "belong to no tensor"});
    expect_error(make_file("{}", eight), {"8 bytes after the last tensor"});
  }
  SECTION("missing dtype") {
    expect_error(make_file(R"({"x":{"shape":[1],"data_offsets":[0,8]}})", eight), {"'x'", "dtype"});
  }
  SECTION("wrong dtype size") {  // 8 bytes cannot hold one I64 as F32 x 1
    expect_error(make_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", eight),
                 {"'x'", "span 8 bytes", "needs 4"});
  }
  SECTION("negative shape") {
    expect_error(make_file(R"({"x":{"dtype":"F64","shape":[-1],"data_offsets":[0,8]}})", eight),
                 {"'x'", "non-negative"});
  }
  SECTION("offsets out of range") {
    expect_error(make_file(R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}})", eight),
                 {"'x'", "[8, 16]", "beyond the data buffer of 8 bytes"});
  }
  SECTION("offsets reversed") {
    expect_error(make_file(R"({"x":{"dtype":"F64","shape":[0],"data_offsets":[8,0]}})", eight), {"'x'", "begin > end"});
  }
  SECTION("offsets not a pair") {
    expect_error(make_file(R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0]}})", eight), {"'x'", "data_offsets"});
  }
  SECTION("overlapping offsets") {
    bytes_t sixteen = eight;
    append<double>(sixteen, 2.0);
    expect_error(make_file(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                           R"("b":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}})",
                           sixteen),
                 {"'b'", "overlap", "'a'"});
  }
  SECTION("bad metadata") {
    expect_error(make_file(R"({"__metadata__":{"n":1}})", {}), {"__metadata__", "string"});
  }
}

TEST_CASE("safetensors: a file with dtypes posenc does not convert is read for its other tensors",
          "[io][safetensors]") {
  // gpt-oss checkpoints keep their MXFP4 experts as U8 next to the BF16 sinks; DeepSeek-V3's are F8_E4M3.
  bytes_t data;
  for (unsigned char b : {1, 2, 3, 4, 5, 6}) data.push_back(b);  // blocks: U8 [2, 3]
  const Eigen::bfloat16 sinks[2] = {Eigen::bfloat16(0.5f), Eigen::bfloat16(-1.25f)};
  for (const auto& x : sinks) {
    const auto bits = Eigen::numext::bit_cast<std::uint16_t>(x);
    data.push_back(static_cast<unsigned char>(bits & 0xff));
    data.push_back(static_cast<unsigned char>(bits >> 8));
  }
  data.push_back(1);  // a BOOL
  const auto f = safetensors_file::parse(make_file(R"({"blocks":{"dtype":"U8","shape":[2,3],"data_offsets":[0,6]},)"
                                                   R"("sinks":{"dtype":"BF16","shape":[2],"data_offsets":[6,10]},)"
                                                   R"("flag":{"dtype":"BOOL","shape":[],"data_offsets":[10,11]}})",
                                                   data));
  CHECK(f.values<float>("sinks") == std::vector<float>{0.5f, -1.25f});
  CHECK(f.info("blocks").dtype == dtype::other);
  CHECK(f.info("blocks").format_dtype == "U8");
  CHECK(f.info("blocks").shape == std::vector<std::int64_t>{2, 3});
  CHECK(f.bytes("blocks").size() == 6);
  CHECK(f.bytes("blocks")[5] == 6);
  CHECK(f.bytes("flag").size() == 1);
  CHECK_THROWS_WITH(f.values<std::int64_t>("blocks"),
                    Catch::Contains("'blocks': stored as U8, which posenc does not convert"));
  CHECK_THROWS_WITH((f.tensor<float, 2>("blocks")), Catch::Contains("stored as U8"));
  CHECK_THROWS_WITH(f.values<double>("flag"), Catch::Contains("stored as BOOL"));
  posenc::io::safetensors_writer w;
  CHECK_THROWS_WITH(w.add_as<std::int64_t>("u8", dtype::other, {1}, std::vector<std::int64_t>{1}),
                    Catch::Contains("not dtype::other"));
}

TEST_CASE("safetensors: edge cases that are valid", "[io][safetensors]") {
  // Empty header object, zero-element tensors sharing an offset, header padded with spaces.
  CHECK(safetensors_file::parse(make_file("{}", {})).size() == 0);
  const auto f = safetensors_file::parse(make_file(
      R"({"e1":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},"e2":{"dtype":"I64","shape":[0],"data_offsets":[0,0]}}    )",
      {}));
  CHECK(f.values<float>("e1").empty());
  CHECK(f.tensor<float, 2>("e1").dimension(1) == 4);
  CHECK_THROWS_WITH(posenc::io::read_safetensors("/nonexistent/x.safetensors"), Catch::Contains("cannot open"));
}
