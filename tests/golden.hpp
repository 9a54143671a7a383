// tests/golden.hpp — test-side access to the vendored golden cases (tests/data/<case>.{json,safetensors},
// format: FORMAT.md of the shared reference vectors). Deliberately independent of posenc/io so the
// core tests do not test the reader with itself; payloads are copied with memcpy because offsets
// are not guaranteed to be aligned.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace golden {

struct tensor {
  std::string dtype;             // F64, F32 or I64
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;

  [[nodiscard]] std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  /// Values converted to double (F64, F32 and I64 all convert).
  [[nodiscard]] std::vector<double> f64() const {
    std::vector<double> v(static_cast<std::size_t>(numel()));
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (dtype == "F64") std::memcpy(&v[i], bytes.data() + 8 * i, 8);
      else if (dtype == "F32") { float f; std::memcpy(&f, bytes.data() + 4 * i, 4); v[i] = f; }
      else if (dtype == "I64") { std::int64_t x; std::memcpy(&x, bytes.data() + 8 * i, 8); v[i] = static_cast<double>(x); }
      else throw std::runtime_error("golden: unsupported dtype " + dtype);
    }
    return v;
  }
  [[nodiscard]] std::vector<float> f32() const {
    auto d = f64();
    return std::vector<float>(d.begin(), d.end());
  }
  [[nodiscard]] std::vector<std::int64_t> i64() const {
    if (dtype != "I64") throw std::runtime_error("golden: tensor is " + dtype + ", not I64");
    std::vector<std::int64_t> v(static_cast<std::size_t>(numel()));
    std::memcpy(v.data(), bytes.data(), v.size() * 8);
    return v;
  }
};

struct case_data {
  nlohmann::json meta;  // the case JSON
  std::map<std::string, tensor> tensors;
  [[nodiscard]] const tensor& at(const std::string& name) const {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw std::runtime_error("golden: no tensor " + name);
    return it->second;
  }
  [[nodiscard]] bool has(const std::string& name) const { return tensors.count(name) != 0; }
  [[nodiscard]] const nlohmann::json& params() const { return meta.at("params"); }
};

inline std::map<std::string, tensor> read_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("golden: cannot open " + path);
  std::vector<unsigned char> all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (all.size() < 8) throw std::runtime_error("golden: truncated " + path);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | all[static_cast<std::size_t>(i)];
  if (n > all.size() - 8) throw std::runtime_error("golden: header beyond file " + path);
  const auto header = nlohmann::json::parse(all.begin() + 8, all.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  const std::size_t data = 8 + n;
  std::map<std::string, tensor> out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    tensor t;
    t.dtype = info.at("dtype").get<std::string>();
    t.shape = info.at("shape").get<std::vector<std::int64_t>>();
    const auto off = info.at("data_offsets").get<std::vector<std::uint64_t>>();
    if (off.size() != 2 || off[0] > off[1] || data + off[1] > all.size())
      throw std::runtime_error("golden: bad offsets for " + name);
    t.bytes.assign(all.begin() + static_cast<std::ptrdiff_t>(data + off[0]),
                   all.begin() + static_cast<std::ptrdiff_t>(data + off[1]));
    out.emplace(name, std::move(t));
  }
  return out;
}

/// Load tests/data/<name>.json and its safetensors.
inline case_data load(const std::string& name) {
  const std::string dir = POSENC_TEST_DATA;
  std::ifstream j(dir + "/" + name + ".json");
  if (!j) throw std::runtime_error("golden: missing case " + dir + "/" + name + ".json");
  case_data c;
  c.meta = nlohmann::json::parse(j);
  c.tensors = read_safetensors(dir + "/" + c.meta.at("tensors_file").get<std::string>());
  return c;
}

/// The tolerance rule of FORMAT.md section 4 for an expected tensor: {atol, rtol}; exact -> {0, 0};
/// informational (atol null) -> atol = -1.
struct rule {
  double atol = 0, rtol = 0;
  bool exact = false, informational = false;
};
inline rule tolerance(const case_data& c, const std::string& name) {
  const auto& tol = c.meta.at("tolerance");
  const nlohmann::json r = tol.contains(name) ? tol.at(name) : tol.at("default");
  rule out;
  if (r.is_string()) {
    out.exact = true;
    return out;
  }
  if (r.at("atol").is_null()) {
    out.informational = true;
    return out;
  }
  out.atol = r.at("atol").get<double>();
  out.rtol = r.contains("rtol") && !r.at("rtol").is_null() ? r.at("rtol").get<double>() : 0.0;
  return out;
}

}  // namespace golden
