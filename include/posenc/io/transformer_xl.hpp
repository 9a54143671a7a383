// posenc/io/transformer_xl.hpp — Transformer-XL attention from a Hugging Face `transfo-xl` checkpoint:
// the config.json keys of TransfoXLConfig and one layer's position tensors from .safetensors.
//
// Keys (defaults: TransfoXLConfig): d_model, n_head, d_head (required), mem_len (1600), clamp_len
// (1000), same_length (true), untie_r (true), n_layer (checked against the layer asked for when present).
// Tensors (modeling_transfo_xl.py; TransfoXLLMHeadModel prefixes them with "transformer.",
// TransfoXLModel does not; both are recognised):
//   layers.<i>.dec_attn.r_net.weight          [n_head * d_head, d_model]   W_R
//   layers.<i>.dec_attn.r_w_bias / r_r_bias   [n_head, d_head]             u / v, with untie_r = true
//   r_w_bias / r_r_bias                       [n_head, d_head]             shared by all layers, untie_r = false
// A missing tensor or one whose shape does not fit the config is a posenc::error naming the tensor.
//
//   const auto cfg = posenc::io::read_json("transfo-xl-wt103/config.json");
//   const auto st = posenc::io::read_safetensors("transfo-xl-wt103/model.safetensors");
//   auto enc = posenc::io::transformer_xl_from_hf<float>(cfg, st, /*layer=*/0);
#pragma once

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "posenc/error.hpp"
#include "posenc/io/hf_config.hpp"
#include "posenc/io/safetensors.hpp"
#include "posenc/transformer_xl.hpp"

namespace posenc::io {

/// The Transformer-XL attention keys of a transfo-xl config.json.
[[nodiscard]] inline transformer_xl_config transformer_xl_config_from_hf(const nlohmann::json& cfg) {
  using detail::get;
  using detail::need;
  transformer_xl_config c;
  c.d_model = need<index_t>(cfg, {"d_model", "hidden_size"}, "transformer_xl");
  c.n_head = need<index_t>(cfg, {"n_head", "num_attention_heads"}, "transformer_xl");
  c.d_head = need<index_t>(cfg, {"d_head"}, "transformer_xl");
  c.mem_len = get<index_t>(cfg, {"mem_len"}).value_or(1600);
  c.clamp_len = get<std::int64_t>(cfg, {"clamp_len"}).value_or(1000);
  c.same_length = get<bool>(cfg, {"same_length"}).value_or(true);
  return c;
}

/// untie_r of a transfo-xl config.json (true: u and v per layer; false: shared by the layers).
[[nodiscard]] inline bool transformer_xl_untie_r(const nlohmann::json& cfg) {
  return detail::get<bool>(cfg, {"untie_r"}).value_or(true);
}

namespace detail {

/// "transformer." for a TransfoXLLMHeadModel checkpoint (or any that has it), else "".
[[nodiscard]] inline std::string transformer_xl_prefix(const safetensors_file& st) {
  for (const auto& n : st.names())
    if (n.rfind("transformer.", 0) == 0) return "transformer.";
  return "";
}

/// Tensor `name` as an owned [rows, cols] table of W; a missing tensor or another shape names it.
template <class W>
[[nodiscard]] Eigen::Tensor<W, 2, Eigen::RowMajor> transformer_xl_tensor(const safetensors_file& st,
                                                                         const std::string& name, index_t rows,
                                                                         index_t cols) {
  require(st.contains(name), name, "missing from the checkpoint", st.source());
  const auto shape = st.shape(name);
  const bool ok = shape.size() == 2 && shape[0] == rows && shape[1] == cols;
  if (!ok) {
    std::string got = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) got += (i ? ", " : "") + std::to_string(shape[i]);
    require(false, name, "has the wrong shape for the config", got, "] for [", rows, ", ", cols, "]");
  }
  return st.tensor<W, 2>(name);
}

}  // namespace detail

/// Layer `layer`'s attention encoding: r_net.weight, r_w_bias and r_r_bias copied out of `st`
/// (owned, so the file may be released), shapes checked against the config.
template <class W>
[[nodiscard]] transformer_xl<W> transformer_xl_from_hf(const nlohmann::json& cfg, const safetensors_file& st,
                                                       index_t layer) {
  const transformer_xl_config c = transformer_xl_config_from_hf(cfg);
  require(layer >= 0, "layer", "must be >= 0", layer);
  if (const auto n_layer = detail::get<index_t>(cfg, {"n_layer", "num_hidden_layers"}))
    require(layer < *n_layer, "layer", "must be < n_layer", layer, " for ", *n_layer, " layers");
  require(c.n_head > 0 && c.d_head > 0 && c.d_model > 0, "config", "n_head, d_head and d_model must be > 0", c.n_head,
          ", ", c.d_head, ", ", c.d_model);
  const std::string p = detail::transformer_xl_prefix(st);
  const std::string attn = p + "layers." + std::to_string(layer) + ".dec_attn.";
  const std::string bias = transformer_xl_untie_r(cfg) ? attn : p;
  // One statement each: the first bad tensor in this order is the one reported.
  auto r_net = detail::transformer_xl_tensor<W>(st, attn + "r_net.weight", c.n_head * c.d_head, c.d_model);
  auto u = detail::transformer_xl_tensor<W>(st, bias + "r_w_bias", c.n_head, c.d_head);
  auto v = detail::transformer_xl_tensor<W>(st, bias + "r_r_bias", c.n_head, c.d_head);
  return transformer_xl<W>(std::move(r_net), std::move(u), std::move(v), c);
}

}  // namespace posenc::io
