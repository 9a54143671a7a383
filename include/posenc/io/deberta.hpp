// posenc/io/deberta.hpp — DeBERTa-v2/v3 from a Hugging Face checkpoint: the `deberta-v2` config.json
// and one layer's relative-attention tensors from its .safetensors.
//
// Config keys and defaults follow transformers' DebertaV2Config and the getattr defaults of
// modeling_deberta_v2.py: relative_attention (false), position_buckets (-1), max_relative_positions
// (-1 -> max_position_embeddings), max_position_embeddings (512), pos_att_type (a list, or the
// string "p2c|c2p"; "p2p", which v2 ignores, is ignored), share_att_key (false), hidden_size,
// num_attention_heads, attention_head_size (hidden_size / num_attention_heads), norm_rel_ebd
// ("none"; "layer_norm" normalizes rel_embeddings), layer_norm_eps (1e-7).
//
// Tensor names (DebertaV2Encoder, DisentangledSelfAttention), after a prefix "deberta." (the task
// models) or none (DebertaV2Model): encoder.rel_embeddings.weight, encoder.LayerNorm.{weight,bias},
// encoder.layer.{i}.attention.self.{query_proj,key_proj,value_proj,pos_key_proj,pos_query_proj}.
// {weight,bias}. A tensor whose shape does not fit the config is a posenc::error naming it.
//
//   auto hf = posenc::io::deberta_config_from_hf(posenc::io::read_json("deberta-v3-base/config.json"));
//   auto file = posenc::io::read_safetensors("deberta-v3-base/model.safetensors");
//   auto layer = posenc::io::load_deberta_layer(file, hf, 0);
//   posenc::deberta_disentangled enc(hf.attention, layer.weights());
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/deberta.hpp"
#include "posenc/error.hpp"
#include "posenc/io/hf_config.hpp"
#include "posenc/io/safetensors.hpp"

namespace posenc::io {

/// What a deberta-v2 config.json says about the attention layers.
struct deberta_hf_config {
  deberta_config attention;     ///< heads, head_dim, buckets, pos_att_type, share_att_key
  index_t hidden_size = 0;      ///< hidden_size
  bool layer_norm_rel = false;  ///< norm_rel_ebd contains "layer_norm"
  double layer_norm_eps = 1e-7; ///< layer_norm_eps
};

/// pos_att_type as a list or a "|"-separated string -> (c2p, p2c); HF lower-cases and strips entries.
inline void deberta_pos_att_type_from_hf(const nlohmann::json& v, deberta_config& c) {
  std::vector<std::string> items;
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    std::size_t at = 0;
    while (at <= s.size()) {
      const std::size_t bar = std::min(s.find('|', at), s.size());
      items.push_back(s.substr(at, bar - at));
      at = bar + 1;
    }
  } else {
    require(v.is_array() || v.is_null(), "pos_att_type", "must be a list of strings or a \"p2c|c2p\" string", v.dump());
    if (v.is_array())
      for (const auto& e : v) items.push_back(detail::as<std::string>(e, "pos_att_type"));
  }
  c.c2p = c.p2c = false;
  for (std::string s : items) {
    s.erase(0, s.find_first_not_of(" \t"));
    s.erase(s.find_last_not_of(" \t") + 1);
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    if (s == "c2p") c.c2p = true;
    else if (s == "p2c") c.p2c = true;
    else require(s == "p2p" || s.empty() || s == "none", "pos_att_type", "entries must be c2p or p2c", s);
  }
}

/// A deberta-v2 config.json -> the attention configuration. Needs relative_attention: true.
[[nodiscard]] inline deberta_hf_config deberta_config_from_hf(const nlohmann::json& cfg) {
  using detail::get;
  require(cfg.is_object(), "config", "must be a JSON object");
  require(get<bool>(cfg, {"relative_attention"}).value_or(false), "relative_attention",
          "must be true for DeBERTa's relative terms (without it the layer is plain attention)");
  deberta_hf_config out;
  deberta_config& a = out.attention;
  out.hidden_size = detail::need<index_t>(cfg, {"hidden_size"}, "deberta");
  a.heads = detail::need<index_t>(cfg, {"num_attention_heads"}, "deberta");
  require(a.heads > 0 && out.hidden_size % a.heads == 0, "hidden_size", "must be a multiple of num_attention_heads",
          out.hidden_size, " / ", a.heads);
  a.head_dim = get<index_t>(cfg, {"attention_head_size"}).value_or(out.hidden_size / a.heads);
  a.position_buckets = get<index_t>(cfg, {"position_buckets"}).value_or(-1);
  a.max_relative_positions = get<index_t>(cfg, {"max_relative_positions"}).value_or(-1);
  a.max_position_embeddings = get<index_t>(cfg, {"max_position_embeddings"}).value_or(512);
  a.share_att_key = get<bool>(cfg, {"share_att_key"}).value_or(false);
  if (const detail::json* p = detail::find_key(cfg, {"pos_att_type"}); p) deberta_pos_att_type_from_hf(*p, a);
  else a.c2p = a.p2c = false;  // HF: pos_att_type None -> []
  const std::string norm = get<std::string>(cfg, {"norm_rel_ebd"}).value_or("none");
  std::string lower(norm);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  out.layer_norm_rel = lower.find("layer_norm") != std::string::npos;
  out.layer_norm_eps = get<double>(cfg, {"layer_norm_eps"}).value_or(1e-7);
  return out;
}

/// One layer's tensors, owned (double), with rel_embeddings already layer-normed when the config says so.
struct deberta_layer {
  index_t hidden = 0, out = 0, rel_rows = 0;
  std::vector<double> rel_embeddings;  ///< [rel_rows, hidden]
  struct linear {
    std::vector<double> weight, bias;  ///< [out, hidden], [out]
  };
  std::optional<linear> query_proj, key_proj, value_proj, pos_key_proj, pos_query_proj;

  /// Views of the tensors for deberta_disentangled (this object must outlive the views' use).
  [[nodiscard]] deberta_weights<double> weights() const {
    deberta_weights<double> w(tensor_map<const double, 2>(rel_embeddings.data(), rel_rows, hidden));
    auto view = [&](const std::optional<linear>& l) -> std::optional<deberta_linear<double>> {
      if (!l) return std::nullopt;
      return deberta_linear<double>(tensor_map<const double, 2>(l->weight.data(), out, hidden),
                                    tensor_map<const double, 1>(l->bias.data(), out));
    };
    w.query_proj = view(query_proj);
    w.key_proj = view(key_proj);
    w.pos_key_proj = view(pos_key_proj);
    w.pos_query_proj = view(pos_query_proj);
    return w;
  }
};

/// Layer `layer` of a DeBERTa-v2/v3 checkpoint. prefix: "deberta." or "" (unset: whichever the file
/// has). Loads rel_embeddings (the first 2 att_span rows, normalized with encoder.LayerNorm when
/// norm_rel_ebd has layer_norm), query/key/value_proj and, without share_att_key, the pos_*_proj the
/// pos_att_type needs.
[[nodiscard]] inline deberta_layer load_deberta_layer(const safetensors_file& f, const deberta_hf_config& hf,
                                                      index_t layer, std::optional<std::string> prefix = std::nullopt) {
  const deberta_config& c = hf.attention;
  require(layer >= 0, "layer", "must be >= 0", layer);
  const std::string pre =
      prefix ? *prefix : (f.contains("deberta.encoder.rel_embeddings.weight") ? std::string("deberta.") : std::string());
  deberta_layer out;
  out.hidden = hf.hidden_size;
  out.out = c.heads * c.head_dim;
  const index_t span = c.att_span();
  out.rel_rows = 2 * span;

  auto shaped = [&](const std::string& name, std::vector<std::int64_t> want) {
    require(f.contains(name), name, "missing from the checkpoint", f.source());
    const auto got = f.shape(name);
    std::string g, w;
    for (auto s : got) g += (g.empty() ? "" : ", ") + std::to_string(s);
    for (auto s : want) w += (w.empty() ? "" : ", ") + std::to_string(s);
    require(got == want, name, "has the wrong shape for the config", "[", g, "] vs [", w, "]");
    return f.values<double>(name);
  };

  const std::string rel_name = pre + "encoder.rel_embeddings.weight";
  require(f.contains(rel_name), rel_name, "missing from the checkpoint", f.source());
  const auto rel_shape = f.shape(rel_name);
  require(rel_shape.size() == 2 && rel_shape[0] >= out.rel_rows && rel_shape[1] == out.hidden, rel_name,
          "must be [>= 2 * att_span, hidden_size]", rel_shape.size() == 2 ? rel_shape[0] : -1, " x ",
          rel_shape.size() == 2 ? rel_shape[1] : -1, " for 2 * att_span = ", out.rel_rows, ", hidden_size ",
          out.hidden);
  const auto rel_all = f.values<double>(rel_name);
  out.rel_embeddings.assign(rel_all.begin(), rel_all.begin() + out.rel_rows * out.hidden);
  if (hf.layer_norm_rel) {
    // nn.LayerNorm over hidden: (x - mean) / sqrt(var + eps) * weight + bias, biased variance.
    const auto g = shaped(pre + "encoder.LayerNorm.weight", {out.hidden});
    const auto b = shaped(pre + "encoder.LayerNorm.bias", {out.hidden});
    for (index_t r = 0; r < out.rel_rows; ++r) {
      double* x = out.rel_embeddings.data() + r * out.hidden;
      double mean = 0, var = 0;
      for (index_t e = 0; e < out.hidden; ++e) mean += x[e];
      mean /= static_cast<double>(out.hidden);
      for (index_t e = 0; e < out.hidden; ++e) var += (x[e] - mean) * (x[e] - mean);
      var /= static_cast<double>(out.hidden);
      const double inv = 1.0 / std::sqrt(var + hf.layer_norm_eps);
      for (index_t e = 0; e < out.hidden; ++e)
        x[e] = (x[e] - mean) * inv * g[static_cast<std::size_t>(e)] + b[static_cast<std::size_t>(e)];
    }
  }
  const std::string base = pre + "encoder.layer." + std::to_string(layer) + ".attention.self.";
  auto linear = [&](const std::string& name) {
    deberta_layer::linear l;
    l.weight = shaped(base + name + ".weight", {out.out, out.hidden});
    l.bias = shaped(base + name + ".bias", {out.out});
    return l;
  };
  out.query_proj = linear("query_proj");
  out.key_proj = linear("key_proj");
  out.value_proj = linear("value_proj");
  if (!c.share_att_key) {
    if (c.c2p) out.pos_key_proj = linear("pos_key_proj");
    if (c.p2c) out.pos_query_proj = linear("pos_query_proj");
  }
  return out;
}

}  // namespace posenc::io
