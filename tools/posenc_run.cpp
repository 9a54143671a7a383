// posenc-run — run one reference case (the golden format, docs/parity.md) through posenc's public API,
// write what it computes to a safetensors file and optionally compare with the case's expectations.
//
//   posenc-run [--dtype f64|f32] [--rope-angles exact|hf_float32] [--threads N] [--check] [--out FILE] CASE.json
//   posenc-run --list-kinds
//
// A case is `<name>.json` (kind, params, tensor names, tolerances) plus the safetensors file it names
// (inputs and expected outputs). Each kind is one runner function (`run_<kind>`) and one row of the
// `kinds` table at the bottom; a new encoding family joins with one of each (docs/adding-an-encoding.md).
//
// --list-kinds prints that table, one kind per line: `<kind> <attention|-> <variants|->`. The second
// column says whether the runner calls the fused kernel (the parity tests then also run it with
// --threads 2); the third lists the extra parity variants (`hf_float32`: --rope-angles hf_float32).
// It is the registry of kinds: tests/parity.cmake builds the parity tests from it when ctest runs.
//
// Precision: --dtype f64 (default) computes in double and is checked against the case tolerances
// (formula-level parity, ~1e-11). --dtype f32 casts the F64 inputs to float, runs the float path and is
// checked against the float tolerances documented in docs/parity.md (float_rule below).
//
// probs: the fused kernel does not materialize probabilities; posenc-run asks it for the per-row
// log-sum-exp and forms p_ij = exp(s_ij - lse_i) from the scores s_ij = scale q_i.k_j + bias_ij
// recomputed from the encoding's public per-element functions (alibi::bias, t5 bias table, RoPE'd q/k).
// So `probs` checks the kernel's normalizer and the encoding's bias formula; `out` always comes from the
// fused kernel itself.
//
// Exit status: 0 = every checked output within tolerance (or no --check), 1 = a check failed,
// 2 = bad command line, unreadable or malformed case, or a kind this tool does not know.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <unsupported/Eigen/CXX11/ThreadPool>
#include <utility>
#include <vector>

#include "posenc/alibi.hpp"
#include "posenc/attention.hpp"
#include "posenc/deberta.hpp"
#include "posenc/io/deberta.hpp"
#include "posenc/io/hf_config.hpp"
#include "posenc/io/safetensors.hpp"
#include "posenc/rope.hpp"
#include "posenc/shaw.hpp"
#include "posenc/sinusoidal.hpp"
#include "posenc/t5.hpp"
#include "posenc/tupe.hpp"
#include "posenc/transformer_xl.hpp"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using posenc::index_t;

// ---- command line ------------------------------------------------------------------------------

struct settings {
  bool f32 = false;
  bool hf_float32_angles = false;
  int threads = 1;
  bool check = false;
  bool list_kinds = false;
  std::string out;
  std::string case_path;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::cerr << "posenc-run: " << what << "\n"
            << "usage: posenc-run [--dtype f64|f32] [--rope-angles exact|hf_float32] [--threads N] [--check] "
               "[--out FILE] CASE.json\n"
               "       posenc-run --list-kinds\n";
  std::exit(2);
}

settings parse_args(int argc, char** argv) {
  settings s;
  auto value = [&](int& i, std::string_view flag) -> std::string {
    if (i + 1 >= argc) usage_error(std::string(flag) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--dtype") {
      const auto v = value(i, a);
      if (v != "f64" && v != "f32") usage_error("--dtype must be f64 or f32 (got " + v + ")");
      s.f32 = v == "f32";
    } else if (a == "--rope-angles") {
      const auto v = value(i, a);
      if (v != "exact" && v != "hf_float32") usage_error("--rope-angles must be exact or hf_float32 (got " + v + ")");
      s.hf_float32_angles = v == "hf_float32";
    } else if (a == "--threads") {
      const auto v = value(i, a);
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || n < 1 || n > 1024)
        usage_error("--threads must be an integer in [1, 1024] (got " + v + ")");
      s.threads = static_cast<int>(n);
    } else if (a == "--check") {
      s.check = true;
    } else if (a == "--list-kinds") {
      s.list_kinds = true;
    } else if (a == "--out") {
      s.out = value(i, a);
    } else if (a == "-h" || a == "--help") {
      usage_error("help");
    } else if (!a.empty() && a[0] == '-') {
      usage_error("unknown option " + std::string(a));
    } else {
      if (!s.case_path.empty()) usage_error("only one CASE.json may be given");
      s.case_path = a;
    }
  }
  if (s.list_kinds) {
    if (!s.case_path.empty()) usage_error("--list-kinds takes no CASE.json");
    return s;
  }
  if (s.case_path.empty()) usage_error("missing CASE.json");
  return s;
}

// ---- the case ----------------------------------------------------------------------------------

/// The case JSON and its tensors, with typed access that names the case in errors.
class case_data {
 public:
  explicit case_data(const fs::path& path) {
    std::ifstream f(path);
    posenc::require(static_cast<bool>(f), "case", "cannot open", path.string());
    try {
      meta_ = json::parse(f);
    } catch (const json::exception& e) {
      throw posenc::error("posenc: case " + path.string() + ": not valid JSON: " + e.what());
    }
    posenc::require(meta_.is_object() && meta_.contains("kind") && meta_.at("kind").is_string(), "case",
                    "must be a JSON object with a string 'kind'", path.string());
    name_ = meta_.value("name", path.stem().string());
    posenc::require(meta_.contains("tensors_file") && meta_.at("tensors_file").is_string(), "case",
                    "needs a string 'tensors_file'", name_);
    st_ = std::make_unique<posenc::io::safetensors_file>(
        posenc::io::read_safetensors(path.parent_path() / meta_.at("tensors_file").get<std::string>()));
    // FORMAT.md sec. 1: the dtype/shape listed in the JSON equal the safetensors header.
    for (const char* section : {"inputs", "expected"}) {
      if (!meta_.contains(section)) continue;
      for (const auto& [tname, info] : meta_.at(section).items()) {
        posenc::require(st_->contains(tname), "case", "tensor listed in the JSON is missing from the safetensors file",
                        name_, ": ", section, ".", tname);
        const auto& t = st_->info(tname);
        posenc::require(info.value("dtype", "") == posenc::io::dtype_name(t.dtype) &&
                            info.value("shape", std::vector<std::int64_t>{}) == t.shape,
                        "case", "JSON dtype/shape differ from the safetensors header", name_, ": ", tname);
      }
    }
  }

  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] std::string kind() const { return meta_.at("kind").get<std::string>(); }
  [[nodiscard]] const json& meta() const { return meta_; }
  [[nodiscard]] const json& params() const {
    static const json empty = json::object();
    return meta_.contains("params") ? meta_.at("params") : empty;
  }
  [[nodiscard]] bool has_input(const std::string& n) const {
    return meta_.contains("inputs") && meta_.at("inputs").contains(n);
  }
  [[nodiscard]] bool has_tensor(const std::string& n) const { return st_->contains(n); }
  [[nodiscard]] std::vector<std::int64_t> shape(const std::string& n) const { return st_->shape(n); }
  [[nodiscard]] index_t dim(const std::string& n, std::size_t axis) const {
    const auto s = shape(n);
    posenc::require(axis < s.size(), n, "has too few dimensions", s.size());
    return static_cast<index_t>(s[axis]);
  }
  /// Float tensor converted to T (inputs are F64; f32 mode casts them).
  template <class T>
  [[nodiscard]] std::vector<T> real(const std::string& n) const {
    return st_->values<T>(n);
  }
  [[nodiscard]] std::vector<std::int64_t> ints(const std::string& n) const { return st_->values<std::int64_t>(n); }
  [[nodiscard]] const posenc::io::safetensors_file& tensors() const { return *st_; }

  /// Optional parameter: absent or null -> fallback.
  template <class V>
  [[nodiscard]] V param(const std::string& key, V fallback) const {
    const json& p = params();
    if (!p.contains(key) || p.at(key).is_null()) return fallback;
    try {
      return p.at(key).get<V>();
    } catch (const json::exception& e) {
      throw posenc::error("posenc: case " + name_ + ": params." + key + " has the wrong type: " + e.what());
    }
  }
  /// Refuses (posenc::error, exit status 2) a parameter or input the runner does not implement, so a
  /// case is never checked with one of its settings silently ignored. `unsupported` names parameters
  /// the format defines but this runner cannot run yet, each with the reason.
  void only(std::initializer_list<std::string_view> known_params, std::initializer_list<std::string_view> known_inputs,
            std::initializer_list<std::pair<std::string_view, std::string_view>> unsupported = {}) const {
    auto listed = [](std::initializer_list<std::string_view> l, const std::string& k) {
      return std::find(l.begin(), l.end(), std::string_view(k)) != l.end();
    };
    for (const auto& [key, value] : params().items()) {
      for (const auto& [name, why] : unsupported)
        if (key == name)
          throw posenc::error("posenc: case " + name_ + ": params." + key + ": not supported by posenc-run's " +
                              kind() + " kind (" + std::string(why) + ")");
      posenc::require(listed(known_params, key), "params." + key, "is not a parameter of kind " + kind(), name_);
    }
    if (meta_.contains("inputs"))
      for (const auto& [key, value] : meta_.at("inputs").items())
        posenc::require(listed(known_inputs, key), "inputs." + key, "is not an input of kind " + kind(), name_);
  }

  /// Required parameter.
  template <class V>
  [[nodiscard]] V need(const std::string& key) const {
    const json& p = params();
    posenc::require(p.contains(key) && !p.at(key).is_null(), "params." + key, "is required for kind " + kind(), name_);
    return param<V>(key, V{});
  }

 private:
  json meta_;
  std::string name_;
  std::unique_ptr<posenc::io::safetensors_file> st_;
};

// ---- what a runner produces --------------------------------------------------------------------

/// One computed output. Reals are kept in double for the comparison; `stored` is the dtype written.
struct output {
  std::string name;
  posenc::io::dtype stored = posenc::io::dtype::f64;
  std::vector<std::int64_t> shape;
  std::vector<double> real;
  std::vector<std::int64_t> ints;
  /// Per-element absolute tolerance in f32 mode, when the generic float rule does not fit (RoPE).
  std::vector<double> f32_atol;
  [[nodiscard]] bool is_int() const { return stored == posenc::io::dtype::i64; }
};

struct results {
  std::vector<output> outputs;
  json scalars = json::object();
  /// Expected names deliberately not computed, with the reason (companion flags such as range_fragile).
  std::map<std::string, std::string> not_computed;
  /// Relative positions (key - query) of the [Sq, Sk] bucket matrix, for the fragile rule (T5).
  std::vector<std::int64_t> bucket_relative;
  std::set<std::int64_t> fragile_relative;  ///< fragile r values from the case's range tensors

  template <class T>
  output& add_real(std::string name, std::vector<std::int64_t> shape, const std::vector<T>& v) {
    output o;
    o.name = std::move(name);
    o.stored = posenc::io::dtype_of<T>();
    o.shape = std::move(shape);
    o.real.assign(v.begin(), v.end());
    outputs.push_back(std::move(o));
    return outputs.back();
  }
  output& add_ints(std::string name, std::vector<std::int64_t> shape, std::vector<std::int64_t> v) {
    output o;
    o.name = std::move(name);
    o.stored = posenc::io::dtype::i64;
    o.shape = std::move(shape);
    o.ints = std::move(v);
    outputs.push_back(std::move(o));
    return outputs.back();
  }
};

/// Everything a runner gets.
struct run_env {
  const case_data& c;
  const settings& s;
  Eigen::ThreadPoolInterface* pool;
};

// ---- shared pieces of the attention kinds ------------------------------------------------------

template <class T>
posenc::heads_view<const T> view_bshd(const std::vector<T>& v, const std::vector<std::int64_t>& s) {
  return posenc::bshd(v.data(), s[0], s[1], s[2], s[3]);
}

/// An additive bias tensor broadcastable to [B, H, Sq, Sk] (NumPy rules: right-aligned, each dim 1 or
/// equal), as an encoding of the kernel contract: the `attention` kind's explicit `bias` input.
template <class T>
class tensor_bias {
 public:
  tensor_bias(std::vector<T> values, const std::vector<std::int64_t>& shape, index_t B, index_t H, index_t Sq, index_t Sk)
      : v_(std::move(values)) {
    posenc::require(shape.size() <= 4, "bias", "must have rank <= 4", shape.size());
    const index_t full[4] = {B, H, Sq, Sk};
    index_t dims[4] = {1, 1, 1, 1};
    for (std::size_t r = 0; r < shape.size(); ++r) dims[4 - shape.size() + r] = static_cast<index_t>(shape[r]);
    index_t stride = 1;
    for (int a = 3; a >= 0; --a) {
      posenc::require(dims[a] == 1 || dims[a] == full[a], "bias", "must broadcast to [batch, heads, q_len, k_len]",
                      "dim ", a, " = ", dims[a], " vs ", full[a]);
      stride_[a] = dims[a] == 1 ? 0 : stride;
      stride *= dims[a];
    }
  }
  [[nodiscard]] T at(index_t b, index_t h, index_t i, index_t j) const {
    return v_[static_cast<std::size_t>(b * stride_[0] + h * stride_[1] + i * stride_[2] + j * stride_[3])];
  }
  template <class U>
  void add_position_bias(const posenc::tile<U>& t, posenc::matrix_map<U> s) const {
    for (index_t i = 0; i < t.rows; ++i)
      for (index_t j = 0; j < t.cols; ++j) s(i, j) += static_cast<U>(at(t.batch, t.head, t.q_first + i, t.k_first + j));
  }

 private:
  std::vector<T> v_;
  index_t stride_[4] = {0, 0, 0, 0};
};

/// Visibility and positions of one attention case, mirroring FORMAT.md sec. 3 (for probs).
struct visibility {
  index_t B = 0, Sq = 0, Sk = 0;
  bool causal = false;
  std::vector<std::int64_t> q_pos, k_pos;  // [B, Sq], [B, Sk]
  std::vector<std::int64_t> padding;       // [B, Sk], nonzero = padding (empty = none)
  std::int64_t window = 0;                 // sliding window (causal only), 0 = none
  [[nodiscard]] bool visible(index_t b, index_t i, index_t j) const {
    if (!padding.empty() && padding[static_cast<std::size_t>(b * Sk + j)] != 0) return false;
    if (!causal) return true;
    const std::int64_t q = q_pos[static_cast<std::size_t>(b * Sq + i)], k = k_pos[static_cast<std::size_t>(b * Sk + j)];
    return k <= q && (window == 0 || q - k < window);
  }
};

/// How k and v reach the kernel: in the run's dtype, or (the kinds that read FORMAT.md 5.11 kv_dtype)
/// stored as that dtype names. Only the second instantiates the kernel for f16 and bf16 storage too:
/// with every kind doing so, posenc-run's one translation unit took 214 s to compile (g++ 12 -O2).
struct kv_in_run_dtype {};
struct kv_stored_as {
  std::string_view dtype;  // "" (the run's dtype), "f16" or "bf16"
};

/// Run the fused kernel with lse and derive probs p_ij = exp(s_ij - lse_i) (see the file comment;
/// with sinks lse includes the sink, so these are the probabilities without a sink column).
/// `bias(b, h, i, j)` is the additive term after the scale and opt.logit_softcap. The scores use q and k, or q_scores /
/// k_scores when the encoding transforms them inside the kernel (RoPE: the rotated operands).
template <class T, class E, class Bias, class KVStorage = kv_in_run_dtype>
void attention_outputs(const run_env& env, results& r, const std::vector<T>& q, const std::vector<std::int64_t>& qs,
                       const std::vector<T>& k, const std::vector<std::int64_t>& ks, const std::vector<T>& v,
                       const std::vector<std::int64_t>& vs, const E& enc, posenc::attention_options opt,
                       const visibility& vis, double scale, Bias&& bias, const std::vector<T>* q_scores = nullptr,
                       const std::vector<T>* k_scores = nullptr, [[maybe_unused]] KVStorage kv = {}) {
  const index_t B = qs[0], Sq = qs[1], H = qs[2], D = qs[3], Sk = ks[1], Hkv = ks[2], Dv = vs[3];
  std::vector<T> out(static_cast<std::size_t>(B * Sq * H * Dv));
  std::vector<T> lse(static_cast<std::size_t>(B * H * Sq));
  opt.pool = env.pool;
  opt.scale = scale;
  // FORMAT.md 5.11 kv_dtype: k and v stored in that type (q, out and the accumulation stay in T)
  auto run_stored = [&](auto tag) {
    using KV = decltype(tag);
    const std::vector<KV> k_stored(k.begin(), k.end()), v_stored(v.begin(), v.end());
    posenc::attention<T, KV>(view_bshd(q, qs), view_bshd(k_stored, ks), view_bshd(v_stored, vs),
                             posenc::bshd(out.data(), B, Sq, H, Dv), posenc::tensor_map<T, 3>(lse.data(), B, H, Sq), enc,
                             opt);
  };
  std::string_view kv_dtype;
  if constexpr (std::is_same_v<KVStorage, kv_stored_as>) {
    kv_dtype = kv.dtype;
    if (kv_dtype == "f16") run_stored(Eigen::half{});
    else if (kv_dtype == "bf16") run_stored(Eigen::bfloat16{});
  }
  if (kv_dtype.empty())
    posenc::attention<T>(view_bshd(q, qs), view_bshd(k, ks), view_bshd(v, vs), posenc::bshd(out.data(), B, Sq, H, Dv),
                         posenc::tensor_map<T, 3>(lse.data(), B, H, Sq), enc, opt);
  r.add_real<T>("out", {B, Sq, H, Dv}, out);

  std::vector<T> probs(static_cast<std::size_t>(B * H * Sq * Sk), T(0));
  const index_t group = H / Hkv;
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < Sq; ++i) {
        const double l = static_cast<double>(lse[static_cast<std::size_t>((b * H + h) * Sq + i)]);
        if (!std::isfinite(l)) continue;  // a row that sees nothing: all-zero probabilities
        const T* qi = (q_scores ? *q_scores : q).data() + ((b * Sq + i) * H + h) * D;
        for (index_t j = 0; j < Sk; ++j) {
          if (!vis.visible(b, i, j)) continue;
          const T* kj = (k_scores ? *k_scores : k).data() + ((b * Sk + j) * Hkv + h / group) * D;
          double dot = 0;
          for (index_t d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * static_cast<double>(kj[d]);
          double s = scale * dot;
          if (opt.logit_softcap > 0) s = opt.logit_softcap * std::tanh(s / opt.logit_softcap);  // FORMAT.md 5.11
          s += static_cast<double>(bias(b, h, i, j));
          probs[static_cast<std::size_t>(((b * H + h) * Sq + i) * Sk + j)] = static_cast<T>(std::exp(s - l));
        }
      }
  r.add_real<T>("probs", {B, H, Sq, Sk}, probs);
}

/// key_padding_mask (optional) as attention_options + visibility.
inline void read_padding(const case_data& c, posenc::attention_options& opt, visibility& vis,
                         std::vector<std::int64_t>& storage, index_t B, index_t Sk) {
  if (!c.has_input("key_padding_mask")) return;
  storage = c.ints("key_padding_mask");
  posenc::require(c.shape("key_padding_mask") == std::vector<std::int64_t>{B, Sk}, "key_padding_mask",
                  "must be [batch, k_len]");
  opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(storage.data(), B, Sk);
  vis.padding = storage;
}

inline std::vector<std::int64_t> offset_positions(index_t B, index_t S, std::int64_t offset) {
  std::vector<std::int64_t> p(static_cast<std::size_t>(B * S));
  for (index_t b = 0; b < B; ++b)
    for (index_t i = 0; i < S; ++i) p[static_cast<std::size_t>(b * S + i)] = offset + i;
  return p;
}

// ---- kinds --------------------------------------------------------------------------------------

/// 5.1 sinusoidal: the table of real positions (the angle is formed in double by the library).
template <class T>
results run_sinusoidal(const run_env& env) {
  const case_data& c = env.c;
  c.only({"d_model", "base", "layout", "schedule"}, {"positions"});
  posenc::sinusoidal_config cfg{.d_model = c.need<index_t>("d_model"), .base = c.param<double>("base", 10000.0)};
  const auto layout = c.need<std::string>("layout");
  posenc::require(layout == "interleaved" || layout == "concat", "params.layout", "must be interleaved or concat",
                  layout);
  cfg.layout = layout == "concat" ? posenc::sinusoid_layout::concat : posenc::sinusoid_layout::interleaved;
  const auto schedule = c.param<std::string>("schedule", "vaswani");
  posenc::require(schedule == "vaswani" || schedule == "t2t", "params.schedule", "must be vaswani or t2t", schedule);
  cfg.schedule = schedule == "t2t" ? posenc::frequency_schedule::t2t : posenc::frequency_schedule::vaswani;
  const auto pos = c.real<double>("positions");
  const posenc::sinusoidal pe(cfg);
  const auto table = pe.table<T>(pos);
  results r;
  r.add_real<T>("table", {static_cast<std::int64_t>(pos.size()), cfg.d_model},
                std::vector<T>(table.data(), table.data() + table.size()));
  return r;
}

/// 5.4 alibi: slopes, the [H, Sq, Sk] bias, and attention with the fused bias.
template <class T>
results run_alibi(const run_env& env) {
  const case_data& c = env.c;
  c.only({"num_heads", "max_bias", "form", "causal", "q_offset"}, {"q", "k", "v", "key_padding_mask"});
  const auto form = c.need<std::string>("form");
  posenc::alibi_config cfg{.heads = c.need<index_t>("num_heads"), .max_bias = c.param<double>("max_bias", 8.0)};
  if (form == "causal")
    cfg.form = posenc::alibi_form::causal;
  else if (form == "symmetric")
    cfg.form = posenc::alibi_form::symmetric;
  else if (form == "key_position")
    cfg.form = posenc::alibi_form::key_position;
  else
    throw posenc::error("posenc: params.form: must be causal, symmetric or key_position (got " + form + ")");
  const posenc::alibi enc(cfg);

  const auto qs = c.shape("q"), ks = c.shape("k"), vs = c.shape("v");
  const index_t B = qs[0], Sq = qs[1], H = qs[2], Sk = ks[1];
  const std::int64_t q_offset = c.param<std::int64_t>("q_offset", 0);
  results r;
  r.add_real<double>("slopes", {H}, std::vector<double>(enc.slopes().begin(), enc.slopes().end()));
  std::vector<double> bias(static_cast<std::size_t>(H * Sq * Sk));
  for (index_t h = 0; h < H; ++h)
    for (index_t i = 0; i < Sq; ++i)
      for (index_t j = 0; j < Sk; ++j)
        bias[static_cast<std::size_t>((h * Sq + i) * Sk + j)] = enc.bias(h, q_offset + i, j);
  r.add_real<T>("bias", {H, Sq, Sk}, std::vector<T>(bias.begin(), bias.end()));

  posenc::attention_options opt{.causal = c.need<bool>("causal"), .q_offset = q_offset};
  visibility vis{B, Sq, Sk, opt.causal, offset_positions(B, Sq, q_offset), offset_positions(B, Sk, 0), {}};
  std::vector<std::int64_t> pad;
  read_padding(c, opt, vis, pad, B, Sk);
  const double scale = 1.0 / std::sqrt(static_cast<double>(qs[3]));
  attention_outputs<T>(
      env, r, c.real<T>("q"), qs, c.real<T>("k"), ks, c.real<T>("v"), vs, enc, opt, vis, scale,
      [&](index_t, index_t h, index_t i, index_t j) { return bias[static_cast<std::size_t>((h * Sq + i) * Sk + j)]; });
  return r;
}

/// 5.5 t5: buckets, the [H, Sq, Sk] bias, attention with scale 1, and the bucket of every value of
/// the optional range tensor.
template <class T>
results run_t5(const run_env& env) {
  const case_data& c = env.c;
  c.only({"relative_attention_num_buckets", "relative_attention_max_distance", "is_decoder", "num_heads"},
         {"q", "k", "v", "relative_attention_bias", "key_padding_mask", "query_positions", "relative_position_range"});
  const posenc::t5_config cfg{.num_buckets = c.need<index_t>("relative_attention_num_buckets"),
                              .max_distance = c.need<index_t>("relative_attention_max_distance"),
                              .is_decoder = c.param<bool>("is_decoder", false)};
  const auto table_shape = c.shape("relative_attention_bias");
  typename posenc::t5_relative_bias<T>::table_type table(table_shape[0], table_shape[1]);
  {
    const auto w = c.real<T>("relative_attention_bias");
    std::copy(w.begin(), w.end(), table.data());
  }
  const posenc::t5_relative_bias<T> enc(std::move(table), cfg);

  const auto qs = c.shape("q"), ks = c.shape("k"), vs = c.shape("v");
  const index_t B = qs[0], Sq = qs[1], H = qs[2], Sk = ks[1];
  std::vector<std::int64_t> qpos1(static_cast<std::size_t>(Sq));
  for (index_t i = 0; i < Sq; ++i) qpos1[static_cast<std::size_t>(i)] = i;
  if (c.has_input("query_positions")) qpos1 = c.ints("query_positions");
  posenc::require(static_cast<index_t>(qpos1.size()) == Sq, "query_positions", "must be [q_len]", qpos1.size());

  results r;
  std::vector<std::int64_t> buckets(static_cast<std::size_t>(Sq * Sk));
  std::vector<T> bias(static_cast<std::size_t>(H * Sq * Sk));
  for (index_t i = 0; i < Sq; ++i)
    for (index_t j = 0; j < Sk; ++j) {
      const std::int64_t rel = j - qpos1[static_cast<std::size_t>(i)];
      buckets[static_cast<std::size_t>(i * Sk + j)] = enc.bucket(rel);
      r.bucket_relative.push_back(rel);
      for (index_t h = 0; h < H; ++h) bias[static_cast<std::size_t>((h * Sq + i) * Sk + j)] = enc.bias(h, qpos1[i], j);
    }
  r.add_ints("buckets", {Sq, Sk}, buckets);
  r.add_real<T>("bias", {H, Sq, Sk}, bias);

  if (c.has_input("relative_position_range")) {
    const auto range = c.ints("relative_position_range");
    std::vector<std::int64_t> rb(range.size());
    for (std::size_t n = 0; n < range.size(); ++n) rb[n] = enc.bucket(range[n]);
    r.add_ints("range_buckets", {static_cast<std::int64_t>(range.size())}, rb);
    r.not_computed["range_fragile"] = "companion flag of the case (used to relax bucket comparisons)";
    if (c.has_tensor("range_fragile")) {
      const auto fr = c.ints("range_fragile");
      for (std::size_t n = 0; n < range.size() && n < fr.size(); ++n)
        if (fr[n] != 0) r.fragile_relative.insert(range[n]);
    }
  }

  // The decoder's causal mask starts at query_positions[0] (FORMAT.md 5.5); all batch rows share it.
  std::vector<std::int64_t> qpos(static_cast<std::size_t>(B * Sq));
  for (index_t b = 0; b < B; ++b) std::copy(qpos1.begin(), qpos1.end(), qpos.begin() + b * Sq);
  posenc::attention_options opt{.causal = cfg.is_decoder};
  opt.q_positions = posenc::positions_view(qpos.data(), B, Sq);
  visibility vis{B, Sq, Sk, opt.causal, qpos, offset_positions(B, Sk, 0), {}};
  std::vector<std::int64_t> pad;
  read_padding(c, opt, vis, pad, B, Sk);
  attention_outputs<T>(
      env, r, c.real<T>("q"), qs, c.real<T>("k"), ks, c.real<T>("v"), vs, enc, opt, vis, 1.0,
      [&](index_t, index_t h, index_t i, index_t j) { return bias[static_cast<std::size_t>((h * Sq + i) * Sk + j)]; });
  return r;
}

/// 5.7 transformer_xl: pos_emb (R of pos_seq = klen-1 .. 0), attention over memory + segment (queries
/// at mlen + i, causal), probs from the encoding's per-pair score_term, and the scalar mlen.
template <class T>
results run_transformer_xl(const run_env& env) {
  const case_data& c = env.c;
  c.only({"d_model", "n_head", "d_head", "mem_len", "clamp_len", "same_length"},
         {"q", "k", "v", "r_net_weight", "r_w_bias", "r_r_bias", "key_padding_mask"});
  const posenc::transformer_xl_config cfg{.d_model = c.need<index_t>("d_model"),
                                          .n_head = c.need<index_t>("n_head"),
                                          .d_head = c.need<index_t>("d_head"),
                                          .mem_len = c.param<index_t>("mem_len", 0),
                                          .clamp_len = c.param<std::int64_t>("clamp_len", -1),
                                          .same_length = c.param<bool>("same_length", false)};
  auto table = [&](const std::string& name) {
    const auto shape = c.shape(name);
    posenc::require(shape.size() == 2, name, "must be a matrix", shape.size(), " dims");
    typename posenc::transformer_xl<T>::table_type t(shape[0], shape[1]);
    const auto w = c.real<T>(name);
    std::copy(w.begin(), w.end(), t.data());
    return t;
  };
  const posenc::transformer_xl<T> enc(table("r_net_weight"), table("r_w_bias"), table("r_r_bias"), cfg);

  const auto qs = c.shape("q"), ks = c.shape("k"), vs = c.shape("v");
  const index_t B = qs[0], Sq = qs[1], H = qs[2], D = qs[3], Sk = ks[1];
  const index_t mlen = Sk - Sq;
  results r;
  r.scalars["mlen"] = mlen;
  std::vector<T> pos_emb(static_cast<std::size_t>(Sk * cfg.d_model));
  for (index_t t = 0; t < Sk; ++t) {
    const auto row = enc.pos_emb(Sk - 1 - t);
    std::copy(row.begin(), row.end(), pos_emb.begin() + t * cfg.d_model);
  }
  r.add_real<T>("pos_emb", {Sk, cfg.d_model}, pos_emb);

  const posenc::attention_options opt = posenc::transformer_xl_options(Sq, Sk);
  visibility vis{B, Sq, Sk, true, offset_positions(B, Sq, mlen), offset_positions(B, Sk, 0), {}};
  std::vector<std::int64_t> pad;
  posenc::attention_options opt_pad = opt;
  read_padding(c, opt_pad, vis, pad, B, Sk);
  const auto q = c.real<T>("q"), k = c.real<T>("k"), v = c.real<T>("v");
  const double scale = enc.logit_scale(D);
  attention_outputs<T>(env, r, q, qs, k, ks, v, vs, enc, opt_pad, vis, scale,
                       [&](index_t b, index_t h, index_t i, index_t j) {
                         if (!enc.visible(mlen + i, j)) return -std::numeric_limits<double>::infinity();
                         return scale * enc.score_term(h, q.data() + ((b * Sq + i) * H + h) * D,
                                                       k.data() + ((b * Sk + j) * ks[2] + h / (H / ks[2])) * D, mlen + i - j);
                       });
  return r;
}

/// 5.11 attention: the plain kernel, with an optional broadcast additive bias and the decoder
/// features (sliding_window, logit_softcap, per-head sinks). Any other parameter or input is refused.
template <class T>
results run_attention(const run_env& env) {
  const case_data& c = env.c;
  c.only({"num_attention_heads", "num_key_value_heads", "causal", "q_offset", "scale", "sliding_window", "logit_softcap",
          "kv_dtype"},
         {"q", "k", "v", "bias", "key_padding_mask", "sinks"});
  const std::string kv_dtype = c.param<std::string>("kv_dtype", "");
  posenc::require(kv_dtype.empty() || kv_dtype == "f16" || kv_dtype == "bf16", "params.kv_dtype", "must be f16 or bf16",
                  kv_dtype);
  const auto qs = c.shape("q"), ks = c.shape("k"), vs = c.shape("v");
  const index_t B = qs[0], Sq = qs[1], H = qs[2], D = qs[3], Sk = ks[1];
  const double scale = c.param<double>("scale", 1.0 / std::sqrt(static_cast<double>(D)));
  const std::int64_t q_offset = c.param<std::int64_t>("q_offset", 0);
  posenc::attention_options opt{.causal = c.need<bool>("causal"),
                                .sliding_window = c.param<index_t>("sliding_window", 0),
                                .logit_softcap = c.param<double>("logit_softcap", 0.0),
                                .q_offset = q_offset};
  visibility vis{B, Sq, Sk, opt.causal, offset_positions(B, Sq, q_offset), offset_positions(B, Sk, 0), {}};
  vis.window = opt.sliding_window;
  std::vector<std::int64_t> pad;
  read_padding(c, opt, vis, pad, B, Sk);
  std::vector<double> sinks;  // the kernel takes sinks in double in both dtypes
  if (c.has_input("sinks")) {
    posenc::require(c.shape("sinks") == std::vector<std::int64_t>{H}, "sinks", "must be [num_attention_heads]");
    sinks = c.real<double>("sinks");
    opt.sinks = sinks;
  }
  results r;
  const auto q = c.real<T>("q"), k = c.real<T>("k"), v = c.real<T>("v");
  if (c.has_input("bias")) {
    const tensor_bias<T> enc(c.real<T>("bias"), c.shape("bias"), B, H, Sq, Sk);
    attention_outputs<T>(env, r, q, qs, k, ks, v, vs, enc, opt, vis, scale,
                         [&](index_t b, index_t h, index_t i, index_t j) { return enc.at(b, h, i, j); }, nullptr,
                         nullptr, kv_stored_as{kv_dtype});
  } else {
    attention_outputs<T>(env, r, q, qs, k, ks, v, vs, posenc::no_position{}, opt, vis, scale,
                         [](index_t, index_t, index_t, index_t) { return 0.0; }, nullptr, nullptr,
                         kv_stored_as{kv_dtype});
  }
  return r;
}

/// RoPE parameters of a case: the HF keys go through posenc/io/hf_config.hpp (the same reader as a
/// config.json), then the case-only keys `layout` and `seq_len`.
inline posenc::rope_config rope_config_of(const case_data& c, bool hf_float32) {
  posenc::rope_config cfg = posenc::io::rope_config_from_hf(c.params());
  const auto layout = c.need<std::string>("layout");
  posenc::require(layout == "half" || layout == "interleaved", "params.layout", "must be half or interleaved", layout);
  cfg.layout = layout == "half" ? posenc::rope_layout::half : posenc::rope_layout::interleaved;
  if (c.params().contains("seq_len") && !c.params().at("seq_len").is_null())
    cfg.seq_len = c.need<std::int64_t>("seq_len");
  cfg.angles = hf_float32 ? posenc::rope_angles::hf_float32 : posenc::rope_angles::exact;
  return cfg;
}

/// The f32 bound of a RoPE output (FORMAT.md sec. 4): posenc reduces the angle in double, so the
/// error does not grow with the position and is about 1e-7 |x|; with a margin of 4 and the attention
/// factor (which scales the rotated dims): 4e-7 * attention_scaling * (1 + max |x| of the token's head
/// vector), per element.
template <class T>
std::vector<double> rope_f32_bound(const std::vector<T>& x, const std::vector<std::int64_t>& shape, double scaling) {
  const std::size_t d = static_cast<std::size_t>(shape[3]);
  std::vector<double> bound(x.size());
  for (std::size_t row = 0; row < x.size(); row += d) {
    double m = 0;
    for (std::size_t i = 0; i < d; ++i) m = std::max(m, std::abs(static_cast<double>(x[row + i])));
    std::fill(bound.begin() + static_cast<std::ptrdiff_t>(row), bound.begin() + static_cast<std::ptrdiff_t>(row + d),
              4e-7 * std::max(scaling, 1.0) * (1.0 + m));
  }
  return bound;
}

/// 5.2 rope: inv_freq, the rotated tensor and the scalars; with --rope-angles hf_float32 also the
/// float32 emulation of HF's path (always computed in float, as HF does).
template <class T>
results run_rope(const run_env& env) {
  const case_data& c = env.c;
  c.only({"head_dim", "rope_theta", "partial_rotary_factor", "max_position_embeddings", "rope_scaling", "layout",
          "seq_len", "with_hf_float32"},
         {"x", "positions"});
  const posenc::rope r(rope_config_of(c, false));
  const auto xs = c.shape("x");
  const auto pos = c.ints("positions");
  const posenc::positions_view pv(pos.data(), c.dim("positions", 0), c.dim("positions", 1));
  const std::int64_t L = r.seq_len_for(pv);

  results res;
  const auto x = c.real<T>("x");
  std::vector<T> out(x.size());
  r.apply(view_bshd(x, xs), posenc::bshd(out.data(), xs[0], xs[1], xs[2], xs[3]), pv);
  const auto inv = r.inv_freq(L);
  res.add_real<double>("inv_freq", {static_cast<std::int64_t>(inv.size())}, inv);
  res.add_real<T>("out", xs, out).f32_atol = rope_f32_bound(x, xs, r.attention_factor());
  res.scalars["attention_scaling"] = r.attention_factor();
  res.scalars["rotary_dim"] = r.rotary_dim();
  const bool has_seq_len = c.params().contains("seq_len") && !c.params().at("seq_len").is_null();
  res.scalars["seq_len_used"] = r.uses_seq_len() || has_seq_len ? json(L) : json(nullptr);

  if (env.s.hf_float32_angles) {
    const posenc::rope hf(rope_config_of(c, true));
    const auto xf = c.real<float>("x");
    std::vector<float> of(xf.size());
    hf.apply(view_bshd(xf, xs), posenc::bshd(of.data(), xs[0], xs[1], xs[2], xs[3]), pv);
    const auto invf = hf.inv_freq_hf_float32(L);
    res.add_real<float>("inv_freq_hf_float32", {static_cast<std::int64_t>(invf.size())}, invf);
    res.add_real<float>("out_hf_float32", xs, of);
  }
  return res;
}

/// 5.3 rope_attention: q and k rotated at their positions, then the kernel with RoPE fused as its
/// Q/K transform. The sequence length is params.seq_len, never derived from the positions (0 = the
/// unscaled frequencies for dynamic, the short factors for longrope).
template <class T>
results run_rope_attention(const run_env& env) {
  const case_data& c = env.c;
  c.only({"head_dim", "rope_theta", "partial_rotary_factor", "max_position_embeddings", "rope_scaling", "layout",
          "seq_len", "num_attention_heads", "num_key_value_heads", "causal", "q_offset"},
         {"q", "k", "v", "q_positions", "k_positions", "key_padding_mask"});
  // No *_hf_float32 expectations exist for this kind: always the exact angles.
  posenc::rope_config cfg = rope_config_of(c, false);
  if (!cfg.seq_len) cfg.seq_len = 0;
  const posenc::rope r(cfg);
  const auto qs = c.shape("q"), ks = c.shape("k"), vs = c.shape("v");
  const index_t B = qs[0], Sq = qs[1], H = qs[2], D = qs[3], Sk = ks[1];
  auto qpos = c.ints("q_positions"), kpos = c.ints("k_positions");
  const posenc::positions_view qpv(qpos.data(), B, Sq), kpv(kpos.data(), B, Sk);

  results res;
  const auto q = c.real<T>("q"), k = c.real<T>("k"), v = c.real<T>("v");
  std::vector<T> qr(q.size()), kr(k.size());
  r.apply(view_bshd(q, qs), posenc::bshd(qr.data(), B, Sq, H, D), qpv);
  r.apply(view_bshd(k, ks), posenc::bshd(kr.data(), B, Sk, ks[2], D), kpv);
  const auto inv = r.inv_freq();
  res.add_real<double>("inv_freq", {static_cast<std::int64_t>(inv.size())}, inv);
  res.add_real<T>("q_rot", qs, qr).f32_atol = rope_f32_bound(q, qs, r.attention_factor());
  res.add_real<T>("k_rot", ks, kr).f32_atol = rope_f32_bound(k, ks, r.attention_factor());
  res.scalars["attention_scaling"] = r.attention_factor();
  res.scalars["rotary_dim"] = r.rotary_dim();

  posenc::attention_options opt{.causal = c.need<bool>("causal")};
  opt.q_positions = qpv;
  opt.k_positions = kpv;
  visibility vis{B, Sq, Sk, opt.causal, qpos, kpos, {}};
  std::vector<std::int64_t> pad;
  read_padding(c, opt, vis, pad, B, Sk);
  // `out` from the kernel with RoPE fused (it rotates its own copies of q and k); probs from the
  // rotated operands q_rot, k_rot and the kernel's lse.
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  attention_outputs<T>(
      env, res, q, qs, k, ks, v, vs, r, opt, vis, scale, [](index_t, index_t, index_t, index_t) { return 0.0; }, &qr, &kr);
  return res;
}

/// 5.10 tupe: the runner projects q, k, v from x (plain Eigen, y = x W^T + b, in the run's dtype),
/// the encoding projects the position embeddings; outputs position_bias [H, S, S], rel_buckets,
/// out and probs (scale 1/sqrt(2d), the position bias after it).
template <class T>
results run_tupe(const run_env& env) {
  const case_data& c = env.c;
  c.only({"num_attention_heads", "hidden_size", "rel_pos_bins", "max_rel_pos", "cls_reset"},
         {"x", "pos_emb", "Uq", "bUq", "Uk", "bUk", "Wq", "bq", "Wk", "bk", "Wv", "bv", "relative_attention_bias",
          "theta_cls_to_others", "theta_others_to_cls", "key_padding_mask"});
  const index_t H = c.need<index_t>("num_attention_heads");
  const bool cls = c.need<bool>("cls_reset");
  const auto xs = c.shape("x");
  posenc::require(xs.size() == 3 && H > 0 && xs[2] % H == 0, "x", "must be [batch, seq, hidden] with hidden % heads == 0");
  const index_t B = xs[0], S = xs[1], Dm = xs[2], D = Dm / H;
  using mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const auto x = c.real<T>("x");
  auto project = [&](const std::string& w, const std::string& b) {
    const auto W = c.real<T>(w), bias = c.real<T>(b);
    posenc::require(c.shape(w) == std::vector<std::int64_t>{Dm, Dm} && c.shape(b) == std::vector<std::int64_t>{Dm},
                    w, "must be [hidden, hidden] with a [hidden] bias");
    std::vector<T> y(static_cast<std::size_t>(B * S * Dm));
    Eigen::Map<mat> ym(y.data(), B * S, Dm);
    ym.noalias() = Eigen::Map<const mat>(x.data(), B * S, Dm) * Eigen::Map<const mat>(W.data(), Dm, Dm).transpose();
    ym.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias.data(), Dm);
    return y;
  };
  const auto q = project("Wq", "bq"), k = project("Wk", "bk"), v = project("Wv", "bv");

  std::map<std::string, std::vector<T>> w;
  for (const char* n : {"pos_emb", "Uq", "bUq", "Uk", "bUk", "theta_cls_to_others", "theta_others_to_cls",
                        "relative_attention_bias"})
    if (c.has_input(n)) w[n] = c.real<T>(n);
  auto m2 = [&](const char* n) { return posenc::tensor_map<const T, 2>(w.at(n).data(), c.dim(n, 0), c.dim(n, 1)); };
  auto m1 = [&](const char* n) { return posenc::tensor_map<const T, 1>(w.at(n).data(), c.dim(n, 0)); };
  posenc::tupe_weights<T> tw{.pos_emb = m2("pos_emb"), .pos_q_weight = m2("Uq"), .pos_q_bias = m1("bUq"),
                             .pos_k_weight = m2("Uk"), .pos_k_bias = m1("bUk")};
  if (w.count("theta_cls_to_others")) tw.theta_cls_to_others.emplace(m1("theta_cls_to_others"));
  if (w.count("theta_others_to_cls")) tw.theta_others_to_cls.emplace(m1("theta_others_to_cls"));
  if (w.count("relative_attention_bias")) tw.relative_attention_bias.emplace(m2("relative_attention_bias"));
  const posenc::tupe enc(tw, {.num_attention_heads = H,
                              .cls_reset = cls,
                              .rel_pos_bins = c.param<index_t>("rel_pos_bins", 32),
                              .max_rel_pos = c.param<index_t>("max_rel_pos", 128)});

  results r;
  std::vector<T> bias(static_cast<std::size_t>(H * S * S));
  for (index_t h = 0; h < H; ++h)
    for (index_t i = 0; i < S; ++i)
      for (index_t j = 0; j < S; ++j)
        bias[static_cast<std::size_t>((h * S + i) * S + j)] = static_cast<T>(enc.position_bias(h, i, j));
  r.add_real<T>("position_bias", {H, S, S}, bias);
  if (enc.has_relative()) {
    std::vector<std::int64_t> buckets(static_cast<std::size_t>(S * S));
    for (index_t i = 0; i < S; ++i)
      for (index_t j = 0; j < S; ++j) buckets[static_cast<std::size_t>(i * S + j)] = enc.relative_bucket(i, j);
    r.add_ints("rel_buckets", {S, S}, buckets);
  }
  posenc::attention_options opt;
  visibility vis{B, S, S, false, offset_positions(B, S, 0), offset_positions(B, S, 0), {}};
  std::vector<std::int64_t> pad;
  read_padding(c, opt, vis, pad, B, S);
  const std::vector<std::int64_t> shape{B, S, H, D};
  attention_outputs<T>(env, r, q, shape, k, shape, v, shape, enc, opt, vis, posenc::tupe::logit_scale(D),
                       [&](index_t, index_t h, index_t i, index_t j) {
                         return bias[static_cast<std::size_t>((h * S + i) * S + j)];
                       });
  return r;
}

/// 5.8 deberta / 5.9 deberta_buckets: DeBERTa-v2/v3 disentangled attention. The case's params go
/// through posenc/io/deberta.hpp (the config.json reader); the host's part (hidden -> Q, K, V, split
/// into heads) is done here in double; `context` comes from the fused kernel with HF's
/// attention_mask (padded keys masked, padded query rows zero), probs from its lse and the scores
/// rebuilt from the encoding's public per-pair pieces (relative_row, position_keys/queries).
/// deberta_buckets: make_log_bucket_position of each value of the range, with the fragile rule.
template <class T>
results run_deberta(const run_env& env) {
  const case_data& c = env.c;
  if (c.kind() == "deberta_buckets")
    c.only({"position_buckets", "max_relative_positions"}, {"relative_position_range"});
  else
    c.only(
        {"num_attention_heads", "hidden_size", "position_buckets", "max_relative_positions", "max_position_embeddings",
         "pos_att_type", "share_att_key", "store_score_terms"},
        {"hidden", "Wq", "bq", "Wk", "bk", "Wv", "bv", "rel_embeddings", "Wpk", "bpk", "Wpq", "bpq", "attention_mask"});
  json prm = c.params();
  prm["relative_attention"] = true;  // the kind is relative attention by definition
  if (c.kind() == "deberta_buckets") {
    prm["hidden_size"] = 1;
    prm["num_attention_heads"] = 1;
    prm["pos_att_type"] = json::array();
  }
  const posenc::io::deberta_hf_config hf = posenc::io::deberta_config_from_hf(prm);
  const posenc::deberta_config& cfg = hf.attention;
  results r;
  if (c.kind() == "deberta_buckets") {
    const std::vector<double> rel(static_cast<std::size_t>(2 * cfg.att_span()), 0.0);
    const posenc::deberta_disentangled enc(
        cfg, posenc::deberta_weights<double>(posenc::tensor_map<const double, 2>(rel.data(), 2 * cfg.att_span(), 1)));
    const auto range = c.ints("relative_position_range");
    std::vector<std::int64_t> b(range.size());
    for (std::size_t n = 0; n < range.size(); ++n) b[n] = enc.bucket(range[n]);
    r.add_ints("buckets", {static_cast<std::int64_t>(range.size())}, b);
    r.bucket_relative = range;
    r.not_computed["fragile"] = "companion flag of the case (used to relax bucket comparisons)";
    if (c.has_tensor("fragile")) {
      const auto fr = c.ints("fragile");
      for (std::size_t n = 0; n < range.size() && n < fr.size(); ++n)
        if (fr[n] != 0) r.fragile_relative.insert(range[n]);
    }
    return r;
  }

  const auto hs = c.shape("hidden");
  const index_t B = hs[0], S = hs[1], Dm = hs[2], H = cfg.heads, D = cfg.head_dim;
  posenc::require(H * D == Dm, "params", "num_attention_heads * head_dim must equal hidden's width", H * D, " vs ", Dm);
  std::map<std::string, std::vector<double>> w;
  for (const char* n : {"Wq", "bq", "Wk", "bk", "Wv", "bv", "Wpk", "bpk", "Wpq", "bpq"})
    if (c.has_input(n)) w[n] = c.real<double>(n);
  const auto rel = c.real<double>("rel_embeddings");
  posenc::deberta_weights<double> weights(
      posenc::tensor_map<const double, 2>(rel.data(), c.dim("rel_embeddings", 0), c.dim("rel_embeddings", 1)));
  auto lin = [&](const char* W, const char* b) -> std::optional<posenc::deberta_linear<double>> {
    if (!w.count(W) || !w.count(b)) return std::nullopt;
    return posenc::deberta_linear<double>(posenc::tensor_map<const double, 2>(w[W].data(), c.dim(W, 0), c.dim(W, 1)),
                                          posenc::tensor_map<const double, 1>(w[b].data(), c.dim(b, 0)));
  };
  weights.query_proj = lin("Wq", "bq");
  weights.key_proj = lin("Wk", "bk");
  weights.pos_key_proj = lin("Wpk", "bpk");
  weights.pos_query_proj = lin("Wpq", "bpq");
  const posenc::deberta_disentangled enc(cfg, weights);
  r.scalars["att_span"] = enc.att_span();
  r.scalars["scale_factor"] = cfg.scale_factor();

  std::vector<std::int64_t> relative_pos(static_cast<std::size_t>(S * S));
  for (index_t i = 0; i < S; ++i)
    for (index_t j = 0; j < S; ++j) relative_pos[static_cast<std::size_t>(i * S + j)] = enc.bucket(i - j);
  r.add_ints("relative_pos", {S, S}, relative_pos);

  // The host's projections x W^T + b in double, [B, S, H, d] (= [B, S, Dm]), then cast to T.
  const auto hidden = c.real<double>("hidden");
  auto project = [&](const char* W, const char* b) {
    posenc::require(w.count(W) && w.count(b), W, "is a required input");
    std::vector<T> y(static_cast<std::size_t>(B * S * Dm));
    for (index_t t = 0; t < B * S; ++t)
      for (index_t o = 0; o < Dm; ++o) {
        double acc = w[b][static_cast<std::size_t>(o)];
        for (index_t m = 0; m < Dm; ++m)
          acc += hidden[static_cast<std::size_t>(t * Dm + m)] * w[W][static_cast<std::size_t>(o * Dm + m)];
        y[static_cast<std::size_t>(t * Dm + o)] = static_cast<T>(acc);
      }
    return y;
  };
  const auto q = project("Wq", "bq"), k = project("Wk", "bk"), v = project("Wv", "bv");
  const std::vector<std::int64_t> shape{B, S, H, D};

  // Per-pair terms (each divided by the scale sqrt(d * scale_factor), as HF adds them).
  const double scale = enc.logit_scale(D);
  const auto n4 = static_cast<std::size_t>(B * H * S * S);
  std::vector<T> c2c(n4), c2p(n4, T(0)), p2c(n4, T(0));
  std::vector<double> rel_terms(n4, 0.0);
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < S; ++i)
        for (index_t j = 0; j < S; ++j) {
          const T* qi = q.data() + ((b * S + i) * H + h) * D;
          const T* kj = k.data() + ((b * S + j) * H + h) * D;
          const index_t row = enc.relative_row(i, j);
          double cc = 0, cp = 0, pc = 0;
          for (index_t e = 0; e < D; ++e) {
            cc += double(qi[e]) * double(kj[e]);
            if (cfg.c2p) cp += double(qi[e]) * double(enc.position_keys<T>(h)(row, e));
            if (cfg.p2c) pc += double(kj[e]) * double(enc.position_queries<T>(h)(row, e));
          }
          const auto at = static_cast<std::size_t>(((b * H + h) * S + i) * S + j);
          c2c[at] = static_cast<T>(cc * scale);
          c2p[at] = static_cast<T>(cp * scale);
          p2c[at] = static_cast<T>(pc * scale);
          rel_terms[at] = (cp + pc) * scale;
        }
  if (c.param<bool>("store_score_terms", true)) {
    r.add_real<T>("score_c2c", {B, H, S, S}, c2c);
    if (cfg.c2p) r.add_real<T>("score_c2p", {B, H, S, S}, c2p);
    if (cfg.p2c) r.add_real<T>("score_p2c", {B, H, S, S}, p2c);
  }

  // HF's attention_mask: keys through key_padding_mask, padded query rows through the encoding.
  std::vector<std::int64_t> mask(static_cast<std::size_t>(B * S), 1);
  if (c.has_input("attention_mask")) mask = c.ints("attention_mask");
  const posenc::tensor_map<const std::int64_t, 2> mask_view(mask.data(), B, S);
  const std::vector<std::int64_t> pad = posenc::deberta_key_padding_mask(mask_view);
  posenc::attention_options opt;
  opt.key_padding_mask = posenc::tensor_map<const std::int64_t, 2>(pad.data(), B, S);
  visibility vis{B, S, S, false, offset_positions(B, S, 0), offset_positions(B, S, 0), pad};
  attention_outputs<T>(env, r, q, shape, k, shape, v, shape, enc.with_attention_mask(mask_view), opt, vis, scale,
                       [&](index_t b, index_t h, index_t i, index_t j) {
                         return rel_terms[static_cast<std::size_t>(((b * H + h) * S + i) * S + j)];
                       });
  for (auto& o : r.outputs)
    if (o.name == "out") {  // the context per head is HF's context_layer [B, S, H * d]
      o.name = "context";
      o.shape = {B, S, Dm};
    }
  return r;
}

/// 5.6 shaw: rel_index and attention with a^K inside the scale and a^V added to the values; the
/// tables rel_k / rel_v are [2k+1, D] (shared) or [2k+1, H, D] (per head).
template <class T>
results run_shaw(const run_env& env) {
  const case_data& c = env.c;
  c.only({"max_relative_position", "causal", "q_offset"}, {"q", "k", "v", "rel_k", "rel_v", "key_padding_mask"});
  const auto K = c.need<index_t>("max_relative_position");
  const std::int64_t q_offset = c.param<std::int64_t>("q_offset", 0);
  const auto qs = c.shape("q"), ks = c.shape("k"), vs = c.shape("v");
  const index_t B = qs[0], Sq = qs[1], H = qs[2], D = qs[3], Sk = ks[1];
  const auto wk = c.real<T>("rel_k"), wv = c.real<T>("rel_v");
  const auto table = [&](const std::vector<T>& w, const std::string& name) {
    const auto s = c.shape(name);
    posenc::require(s.size() == 2 || s.size() == 3, name, "must be [2k+1, D] or [2k+1, H, D]", "rank ", s.size());
    return s.size() == 2 ? posenc::shaw_table<T>(w.data(), s[0], 0, s[1]) : posenc::shaw_table<T>(w.data(), s[0], s[1], s[2]);
  };
  const posenc::shaw_relative<T> enc(table(wk, "rel_k"), table(wv, "rel_v"), {.max_relative_position = K});

  results r;
  std::vector<std::int64_t> rel_index(static_cast<std::size_t>(Sq * Sk));
  for (index_t i = 0; i < Sq; ++i)
    for (index_t j = 0; j < Sk; ++j) rel_index[static_cast<std::size_t>(i * Sk + j)] = enc.bucket(q_offset + i, j);
  r.add_ints("rel_index", {Sq, Sk}, rel_index);

  posenc::attention_options opt{.causal = c.need<bool>("causal"), .q_offset = q_offset};
  visibility vis{B, Sq, Sk, opt.causal, offset_positions(B, Sq, q_offset), offset_positions(B, Sk, 0), {}};
  std::vector<std::int64_t> pad;
  read_padding(c, opt, vis, pad, B, Sk);
  const auto q = c.real<T>("q");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // probs: the key term lives inside the scale, so it enters the scores as scale * q_i . a^K_ij.
  const posenc::shaw_table<T> ak = enc.keys();
  attention_outputs<T>(env, r, q, qs, c.real<T>("k"), ks, c.real<T>("v"), vs, enc, opt, vis, scale,
                       [&](index_t b, index_t h, index_t i, index_t j) {
                         const T* qi = q.data() + ((b * Sq + i) * H + h) * D;
                         const index_t row = rel_index[static_cast<std::size_t>(i * Sk + j)];
                         double dot = 0;
                         for (index_t d = 0; d < D; ++d)
                           dot += static_cast<double>(qi[d]) * static_cast<double>(ak.at(row, h, d));
                         return scale * dot;
                       });
  return r;
}

// ---- the kinds table: one row per family ---------------------------------------------------------

/// Whether a kind's runner calls the fused kernel (posenc::attention): parity then also runs its
/// cases with --threads 2.
enum class kernel { no, yes };

/// One row: the kind, its runners and what parity runs for it. A constructor rather than an aggregate
/// so that a row cannot leave `kernel` out by accident.
struct kind_runner {
  using runner = results (*)(const run_env&);
  constexpr kind_runner(std::string_view kind_, runner f64_, runner f32_, kernel kernel_,
                        std::string_view variants_ = {})
      : kind(kind_), f64(f64_), f32(f32_), runs_kernel(kernel_ == kernel::yes), variants(variants_) {}
  std::string_view kind;
  runner f64, f32;
  bool runs_kernel;
  /// Extra parity variants, comma-separated: "hf_float32" = also --dtype f32 --rope-angles hf_float32.
  std::string_view variants;
};

constexpr kind_runner kinds[] = {
    {"sinusoidal", run_sinusoidal<double>, run_sinusoidal<float>, kernel::no},
    {"rope", run_rope<double>, run_rope<float>, kernel::no, "hf_float32"},
    {"rope_attention", run_rope_attention<double>, run_rope_attention<float>, kernel::yes},
    {"alibi", run_alibi<double>, run_alibi<float>, kernel::yes},
    {"t5", run_t5<double>, run_t5<float>, kernel::yes},
    {"shaw", run_shaw<double>, run_shaw<float>, kernel::yes},
    {"transformer_xl", run_transformer_xl<double>, run_transformer_xl<float>, kernel::yes},
    {"attention", run_attention<double>, run_attention<float>, kernel::yes},
    {"tupe", run_tupe<double>, run_tupe<float>, kernel::yes},
    {"deberta", run_deberta<double>, run_deberta<float>, kernel::yes},
    {"deberta_buckets", run_deberta<double>, run_deberta<float>, kernel::no},
};

/// --list-kinds: `<kind> <attention|-> <variants|->`, one line per kind (the format parity.cmake reads).
void list_kinds() {
  for (const auto& k : kinds)
    std::printf("%-16s %-9s %s\n", std::string(k.kind).c_str(), k.runs_kernel ? "attention" : "-",
                k.variants.empty() ? "-" : std::string(k.variants).c_str());
}

std::string supported_kinds() {
  std::string s;
  for (const auto& k : kinds) s += (s.empty() ? "" : ", ") + std::string(k.kind);
  return s;
}

// ---- comparison (FORMAT.md sec. 4) ---------------------------------------------------------------

struct rule {
  bool exact = false, informational = false;
  double atol = 0, rtol = 0;
  std::string note;
};

rule case_rule(const json& meta, const std::string& name, posenc::io::dtype expected_dtype) {
  rule out;
  const json tol = meta.value("tolerance", json::object());
  json r;
  if (tol.contains(name))
    r = tol.at(name);
  else if (tol.contains("default"))
    r = tol.at("default");
  else {  // FORMAT.md sec. 4 fallback
    if (expected_dtype == posenc::io::dtype::i64)
      out.exact = true;
    else if (expected_dtype == posenc::io::dtype::f64)
      out.atol = 1e-11;
    else
      out.informational = true;
    return out;
  }
  if (r.is_string()) {
    out.exact = r.get<std::string>() == "exact";
    posenc::require(out.exact, "tolerance." + name, "a string rule must be \"exact\"", r.dump());
    return out;
  }
  if (!r.contains("atol") || r.at("atol").is_null()) {
    out.informational = true;
    return out;
  }
  out.atol = r.at("atol").get<double>();
  out.rtol = r.contains("rtol") && !r.at("rtol").is_null() ? r.at("rtol").get<double>() : 0.0;
  return out;
}

/// The float tolerances of --dtype f32 (docs/parity.md): ~1e-6 relative for O(1) outputs, i.e.
/// |a - e| <= kF32Tol * (1 + |e|) with kF32Tol = 4e-6, never tighter than the case's own rule; RoPE outputs carry a
/// per-element bound (output::f32_atol) instead.
constexpr double kF32Tol = 4e-6;

int compare(const case_data& c, const results& res, const settings& s) {
  const auto& expected = c.meta().value("expected", json::object());
  int failures = 0;
  bool fragile_mismatch = false;
  std::printf("%-22s %-6s %12s %12s  %s\n", "output", "dtype", "max_abs", "max_rel", "rule / result");
  // Bucket tensors first so a fragile mismatch is known before the tensors derived from them.
  std::vector<std::string> names;
  for (const auto& [n, _] : expected.items()) names.push_back(n);
  std::stable_partition(names.begin(), names.end(),
                        [](const std::string& n) { return n.find("bucket") != std::string::npos; });

  for (const auto& name : names) {
    const auto it =
        std::find_if(res.outputs.begin(), res.outputs.end(), [&](const output& o) { return o.name == name; });
    const auto& einfo = c.tensors().info(name);
    const bool hf32 = name.size() > 11 && name.compare(name.size() - 11, 11, "_hf_float32") == 0;
    if (it == res.outputs.end()) {
      if (res.not_computed.count(name)) {
        std::printf("%-22s %-6s %12s %12s  not computed: %s\n", name.c_str(), "", "-", "-",
                    res.not_computed.at(name).c_str());
      } else if (hf32 && !s.hf_float32_angles) {
        std::printf("%-22s %-6s %12s %12s  skipped (compared only with --rope-angles hf_float32)\n", name.c_str(), "",
                    "-", "-");
      } else {
        std::printf("%-22s %-6s %12s %12s  FAIL: not produced\n", name.c_str(), "", "-", "-");
        ++failures;
      }
      continue;
    }
    const output& o = *it;
    if (o.shape != einfo.shape) {
      std::printf("%-22s FAIL: shape differs from the expected one\n", name.c_str());
      ++failures;
      continue;
    }
    rule r = case_rule(c.meta(), name, einfo.dtype);
    const bool float_mode = s.f32 && !r.exact && !hf32;
    double max_abs = 0, max_rel = 0;
    std::size_t bad = 0, relaxed = 0, first_bad = 0;
    if (o.is_int() || r.exact) {
      const auto e = c.ints(name);
      for (std::size_t n = 0; n < e.size(); ++n) {
        const double a = o.is_int() ? static_cast<double>(o.ints[n]) : o.real[n];
        const double d = std::abs(a - static_cast<double>(e[n]));
        max_abs = std::max(max_abs, d);
        if (e[n] != 0) max_rel = std::max(max_rel, d / std::abs(static_cast<double>(e[n])));
        if (d == 0) continue;
        // Fragile buckets (FORMAT.md sec. 4): a flagged relative position may differ by one.
        bool fragile = false;
        if (name == "range_buckets" && c.has_tensor("range_fragile")) fragile = c.ints("range_fragile")[n] != 0;
        if (name == "buckets" && n < res.bucket_relative.size())
          fragile = res.fragile_relative.count(res.bucket_relative[n]) != 0;
        if (fragile && d <= 1) {
          ++relaxed;
          continue;
        }
        if (bad++ == 0) first_bad = n;
      }
      if (relaxed) fragile_mismatch = fragile_mismatch || name == "buckets";
    } else {
      const auto e = c.real<double>(name);
      for (std::size_t n = 0; n < e.size(); ++n) {
        const double d = std::abs(o.real[n] - e[n]);
        if (std::isnan(o.real[n]) != std::isnan(e[n])) {
          if (bad++ == 0) first_bad = n;
          max_abs = std::numeric_limits<double>::infinity();
          continue;
        }
        max_abs = std::max(max_abs, d);
        if (e[n] != 0) max_rel = std::max(max_rel, d / std::abs(e[n]));
        double lim = r.atol + r.rtol * std::abs(e[n]);
        if (float_mode) {
          lim = !o.f32_atol.empty() ? std::max(lim, o.f32_atol[n]) : std::max(lim, kF32Tol * (1.0 + std::abs(e[n])));
        }
        if (!(d <= lim) && bad++ == 0) first_bad = n;
      }
    }
    std::string verdict;
    char buf[160];
    if (r.exact)
      verdict = "exact";
    else if (r.informational)
      verdict = "informational";
    else if (float_mode)
      verdict = o.f32_atol.empty() ? "f32: 4e-6*(1+|e|)" : "f32: 4e-7*scaling*(1+|x|)";
    else {
      std::snprintf(buf, sizeof buf, "atol=%.0e rtol=%.0e", r.atol, r.rtol);
      verdict = buf;
    }
    const bool derived = fragile_mismatch && (name == "bias" || name == "probs" || name == "out");
    if (relaxed) {
      std::snprintf(buf, sizeof buf, ", %zu fragile entries differ by one (allowed)", relaxed);
      verdict += buf;
    }
    if (r.informational)
      verdict += "  (not asserted)";
    else if (bad == 0)
      verdict += "  ok";
    else if (derived) {
      std::snprintf(buf, sizeof buf, "  (%zu beyond; derived from a fragile bucket, not asserted)", bad);
      verdict += buf;
    } else {
      std::snprintf(buf, sizeof buf, "  FAIL: %zu elements beyond, first at flat index %zu", bad, first_bad);
      verdict += buf;
      ++failures;
    }
    std::printf("%-22s %-6s %12.3e %12.3e  %s\n", name.c_str(), std::string(posenc::io::dtype_name(o.stored)).c_str(),
                max_abs, max_rel, verdict.c_str());
  }

  // Scalars (FORMAT.md sec. 1): integers exactly, null = not applicable, floats to 1e-12 relative.
  const auto& es = c.meta().value("expected_scalars", json::object());
  for (const auto& [name, e] : es.items()) {
    if (!res.scalars.contains(name)) {
      std::printf("%-22s FAIL: scalar not produced\n", name.c_str());
      ++failures;
      continue;
    }
    const json& a = res.scalars.at(name);
    bool ok = false;
    if (e.is_null())
      ok = a.is_null();
    else if (e.is_number_integer())
      ok = a.is_number() && a.get<double>() == e.get<double>();
    else if (e.is_number())
      ok = a.is_number() && std::abs(a.get<double>() - e.get<double>()) <= 1e-12 * std::abs(e.get<double>());
    std::printf("%-22s %-6s %25s  expected %s  %s\n", name.c_str(), "scalar", a.dump().c_str(), e.dump().c_str(),
                ok ? "ok" : "FAIL");
    if (!ok) ++failures;
  }
  return failures;
}

void write_outputs(const results& res, const std::string& path, const case_data& c) {
  posenc::io::safetensors_writer w;
  for (const auto& o : res.outputs) {
    if (o.is_int())
      w.add<std::int64_t>(o.name, o.shape, o.ints);
    else
      w.add_as<double>(o.name, o.stored, o.shape, o.real);
  }
  w.metadata("case", c.name()).metadata("kind", c.kind()).metadata("producer", "posenc-run");
  if (!res.scalars.empty()) w.metadata("scalars", res.scalars.dump());
  w.write(path);
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse_args(argc, argv);
  if (s.list_kinds) {
    list_kinds();
    return 0;
  }
  try {
    const case_data c(s.case_path);
    const std::string kind = c.kind();
    const auto* runner =
        std::find_if(std::begin(kinds), std::end(kinds), [&](const kind_runner& k) { return k.kind == kind; });
    if (runner == std::end(kinds)) {
      std::cerr << "posenc-run: case " << c.name() << ": unknown kind '" << kind
                << "' (this posenc-run supports: " << supported_kinds() << ")\n";
      return 2;
    }
    std::unique_ptr<Eigen::ThreadPool> pool;
    if (s.threads > 1) pool = std::make_unique<Eigen::ThreadPool>(s.threads);
    const run_env env{c, s, pool.get()};
    const results res = s.f32 ? runner->f32(env) : runner->f64(env);
    std::printf("case %s (kind %s, dtype %s, rope angles %s, threads %d)\n", c.name().c_str(), kind.c_str(),
                s.f32 ? "f32" : "f64", s.hf_float32_angles ? "hf_float32" : "exact", s.threads);
    if (!s.out.empty()) write_outputs(res, s.out, c);
    if (!s.check) {
      for (const auto& o : res.outputs) std::printf("computed %s\n", o.name.c_str());
      return 0;
    }
    const int failures = compare(c, res, s);
    std::printf("%s: %s (%d failure%s)\n", c.name().c_str(), failures == 0 ? "PASS" : "FAIL", failures,
                failures == 1 ? "" : "s");
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "posenc-run: " << s.case_path << ": " << e.what() << "\n";
    return 2;
  }
}
