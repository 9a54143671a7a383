// posenc/io/shaw.hpp — Shaw et al. (2018) relative tables from a safetensors file, by the names the
// public implementations give them:
//   CTranslate2  <scope>/relative_position_keys     [2k+1, head_dim]  (layers/attention.cc; the
//                <scope>/relative_position_values   [2k+1, head_dim]   OpenNMT-py converter fills both)
//                k = maximum_relative_position, derived from the rows: (rows - 1) / 2
//   OpenNMT-py   <scope>.relative_positions_embeddings.weight [2k+1, dim_per_head], one nn.Embedding
//                used for both keys and values (onmt/modules/multi_headed_attn.py), k =
//                opt.max_relative_positions
// A per-head table [2k+1, heads, head_dim] is accepted under the same names. An optional integer
// scalar tensor `<prefix>maximum_relative_position` (or the caller's value) fixes k; the rows must
// then be 2k + 1. Any tensor whose shape does not fit is a posenc::error naming the tensor.
//
//   auto file = posenc::io::read_safetensors("model.safetensors");
//   auto w = posenc::io::load_shaw<float>(file, "encoder/layer_0/self_attention/");
//   posenc::attention<float>(q, k, v, out, w.encoding(), opt);   // w must outlive the call
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/io/hf_config.hpp"
#include "posenc/io/safetensors.hpp"
#include "posenc/shaw.hpp"

namespace posenc::io {

/// Shaw tables loaded into memory (row-major, as stored). An absent table is empty. The encodings
/// made from it view these vectors: keep the struct alive (and unmoved) while they are used.
template <class W>
struct shaw_weights {
  index_t max_relative_position = 0;
  std::vector<W> keys, values;                          ///< a^K, a^V
  std::vector<std::int64_t> keys_shape, values_shape;  ///< [2k+1, dim] or [2k+1, heads, dim]
  std::string keys_name, values_name;                   ///< the tensors they came from

  [[nodiscard]] shaw_table<W> key_table() const { return table(keys, keys_shape); }
  [[nodiscard]] shaw_table<W> value_table() const { return table(values, values_shape); }
  [[nodiscard]] shaw_config config() const { return {.max_relative_position = max_relative_position}; }
  /// Keys and values (both tables required).
  [[nodiscard]] shaw_relative<W> encoding() const { return shaw_relative<W>(key_table(), value_table(), config()); }

 private:
  static shaw_table<W> table(const std::vector<W>& v, const std::vector<std::int64_t>& s) {
    if (s.empty()) return {};
    return s.size() == 2 ? shaw_table<W>(v.data(), s[0], 0, s[1]) : shaw_table<W>(v.data(), s[0], s[1], s[2]);
  }
};

/// The key term only / the value term only, from loaded weights.
template <class W>
[[nodiscard]] shaw_keys<W> shaw_keys_of(const shaw_weights<W>& w) {
  return shaw_keys<W>(w.key_table(), w.config());
}
template <class W>
[[nodiscard]] shaw_values<W> shaw_values_of(const shaw_weights<W>& w) {
  return shaw_values<W>(w.value_table(), w.config());
}

namespace detail {

/// Reads one table and checks its shape: rank 2 or 3, an odd number of rows, 2k + 1 rows when k is
/// known, at least one feature.
template <class W>
void read_shaw_table(const safetensors_file& f, const std::string& name, std::optional<index_t>& k, std::vector<W>& out,
                     std::vector<std::int64_t>& shape) {
  shape = f.shape(name);
  require(shape.size() == 2 || shape.size() == 3, name,
          "must have rank 2 [2k+1, head_dim] or rank 3 [2k+1, heads, head_dim]", "rank ", shape.size());
  require(shape[0] % 2 == 1, name, "must have an odd number of rows 2k+1", shape[0], " rows");
  if (k) {
    require(shape[0] == 2 * *k + 1, name, "must have 2 * maximum_relative_position + 1 rows", shape[0],
            " rows for k = ", *k);
  } else {
    k = (shape[0] - 1) / 2;
  }
  for (std::size_t a = 1; a < shape.size(); ++a)
    require(shape[a] > 0, name, "must have non-empty head and feature dimensions", "dim ", a, " = ", shape[a]);
  out = f.values<W>(name);
}

}  // namespace detail

/// Loads the tables under `prefix` (prepended to the tensor names, e.g. "encoder/layer_0/self_attention/"
/// or "encoder.transformer.0.self_attn."). max_relative_position: k when known (e.g. from OpenNMT-py's
/// opt); otherwise the file's maximum_relative_position scalar, otherwise (rows - 1) / 2.
template <class W>
[[nodiscard]] shaw_weights<W> load_shaw(const safetensors_file& f, const std::string& prefix = "",
                                        std::optional<index_t> max_relative_position = std::nullopt) {
  std::optional<index_t> k = max_relative_position;
  if (k) require(*k >= 0, "max_relative_position", "must be >= 0", *k);
  const std::string k_name = prefix + "maximum_relative_position";
  if (f.contains(k_name)) {
    const auto v = f.values<std::int64_t>(k_name);
    require(v.size() == 1, k_name, "must be one integer", v.size(), " elements");
    require(v[0] >= 0, k_name, "must be >= 0", v[0]);
    if (k) require(*k == v[0], k_name, "disagrees with the max_relative_position given", v[0], " vs ", *k);
    k = static_cast<index_t>(v[0]);
  }
  shaw_weights<W> w;
  const std::string keys = prefix + "relative_position_keys", values = prefix + "relative_position_values";
  const std::string shared = prefix + "relative_positions_embeddings.weight";
  if (f.contains(keys) || f.contains(values)) {
    if (f.contains(keys)) {
      detail::read_shaw_table(f, keys, k, w.keys, w.keys_shape);
      w.keys_name = keys;
    }
    if (f.contains(values)) {
      detail::read_shaw_table(f, values, k, w.values, w.values_shape);
      w.values_name = values;
    }
  } else {
    require(f.contains(shared), keys, "not found (nor " + values + " or " + shared + ")", f.source());
    detail::read_shaw_table(f, shared, k, w.keys, w.keys_shape);
    w.values = w.keys;
    w.values_shape = w.keys_shape;
    w.keys_name = w.values_name = shared;
  }
  w.max_relative_position = *k;
  return w;
}

template <class W>
[[nodiscard]] shaw_weights<W> load_shaw(const std::filesystem::path& path, const std::string& prefix = "",
                                        std::optional<index_t> max_relative_position = std::nullopt) {
  return load_shaw<W>(read_safetensors(path), prefix, max_relative_position);
}

/// k from an OpenNMT-py option set / config (max_relative_positions > 0 selects Shaw's encoding;
/// 0 is none, -1 RoPE and -2 ALiBi there, which are not this family; use_neg_dist must not be false).
[[nodiscard]] inline shaw_config shaw_config_from_opennmt(const nlohmann::json& opt) {
  const auto k = detail::need<index_t>(opt, {"max_relative_positions", "max_relative_position",
                                             "maximum_relative_position"},
                                       "Shaw relative positions");
  require(k > 0, "max_relative_positions", "must be > 0 for Shaw relative positions", k);
  // use_neg_dist = false folds distances to |j - i| over k + 1 rows: another encoding.
  const auto neg = detail::get<bool>(opt, {"use_neg_dist"});
  require(neg.value_or(true), "use_neg_dist", "false (distances folded to |j - i|) is not Shaw's signed form");
  return {.max_relative_position = k};
}

}  // namespace posenc::io
