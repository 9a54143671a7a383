// posenc/io/tupe.hpp — TUPE from a checkpoint of the official code (guolinke/TUPE,
// fairseq/modules/transformer_sentence_encoder.py) stored as .safetensors, and its fairseq arguments.
//
// The official TransformerSentenceEncoder holds, under its prefix (`decoder.sentence_encoder.` in
// the BERT model of that repository):
//   pos.weight                      [max_positions + 1, Dm]  nn.Embedding of the absolute positions
//   pos_ln.weight, pos_ln.bias      [Dm]                     LayerNorm (eps 1e-5) applied to it
//   pos_q_linear.weight / .bias     [Dm, Dm] / [Dm]          U_q (the query-side projection)
//   pos_k_linear.weight / .bias     [Dm, Dm] / [Dm]          U_k
//   relative_attention_bias.weight  [rel_pos_bins + 1, H]    only with --rel-pos
// Its forward pass uses the LayerNorm'ed rows e_0 .. e_S: token t takes row t + 1, and the [CLS]
// constants are the position terms of rows 0 and 1 themselves (cls_2_other = e_0 . e_0 and
// other_2_cls = e_1 . e_1 through the projections, / sqrt(2d)); the [CLS] reset is always on. This
// reader does exactly that and returns a posenc::tupe with pos_emb = e_1 .. e_S and those thetas.
//
// The fairseq arguments (a checkpoint's `args`, saved as JSON): encoder_attention_heads,
// encoder_embed_dim, max_positions (else tokens_per_sample), rel_pos (default false); rel_pos_bins
// and max_rel_pos are the encoder's constructor defaults 32 and 128 unless given.
//
//   const auto st = posenc::io::read_safetensors("tupe.safetensors");
//   const auto spec = posenc::io::tupe_spec_from_args(posenc::io::read_json("args.json"));
//   const posenc::tupe enc = posenc::io::tupe_from_safetensors(st, spec);  // prefix found by itself
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/io/hf_config.hpp"
#include "posenc/io/safetensors.hpp"
#include "posenc/tupe.hpp"

namespace posenc::io {

/// The encoder's hyper-parameters that shape the TUPE tensors.
struct tupe_spec {
  index_t heads = 0;          ///< encoder_attention_heads
  index_t embed_dim = 0;      ///< encoder_embed_dim (Dm)
  index_t max_positions = 0;  ///< max_positions: pos.weight has max_positions + 1 rows
  bool rel_pos = false;       ///< rel_pos: relative_attention_bias present
  index_t rel_pos_bins = 32;
  index_t max_rel_pos = 128;
  double layer_norm_eps = 1e-5;  ///< pos_ln (fairseq LayerNorm default)
};

/// The fairseq argument names of the official code's BERT model.
[[nodiscard]] inline tupe_spec tupe_spec_from_args(const nlohmann::json& args) {
  using detail::get;
  using detail::need;
  require(args.is_object(), "config", "must be a JSON object");
  tupe_spec s;
  s.heads = need<index_t>(args, {"encoder_attention_heads"}, "TUPE");
  s.embed_dim = need<index_t>(args, {"encoder_embed_dim"}, "TUPE");
  s.max_positions = need<index_t>(args, {"max_positions", "tokens_per_sample"}, "TUPE");
  s.rel_pos = get<bool>(args, {"rel_pos"}).value_or(false);
  s.rel_pos_bins = get<index_t>(args, {"rel_pos_bins"}).value_or(32);
  s.max_rel_pos = get<index_t>(args, {"max_rel_pos"}).value_or(128);
  require(s.heads > 0 && s.embed_dim > 0 && s.embed_dim % s.heads == 0, "encoder_embed_dim",
          "must be a positive multiple of encoder_attention_heads", s.embed_dim, " for ", s.heads, " heads");
  require(s.max_positions > 0, "max_positions", "must be > 0", s.max_positions);
  return s;
}

namespace detail {

/// The tensor `name` as double after checking its shape; the error names the tensor.
[[nodiscard]] inline std::vector<double> tupe_tensor(const safetensors_file& st, const std::string& name,
                                                     const std::vector<std::int64_t>& shape) {
  require(st.contains(name), name, "is missing from the checkpoint", st.source());
  const auto got = st.shape(name);
  if (got != shape) {
    std::string g, w;
    for (auto x : got) g += (g.empty() ? "" : ", ") + std::to_string(x);
    for (auto x : shape) w += (w.empty() ? "" : ", ") + std::to_string(x);
    throw error("posenc: " + name + ": shape does not fit the configuration (got [" + g + "], expected [" + w + "])");
  }
  return st.values<double>(name);
}

/// The encoder's prefix: the one of the only tensor named `*pos_q_linear.weight`.
[[nodiscard]] inline std::string tupe_prefix(const safetensors_file& st) {
  const std::string key = "pos_q_linear.weight";
  std::string prefix;
  int found = 0;
  for (const auto& n : st.names())
    if (n.size() >= key.size() && n.compare(n.size() - key.size(), key.size(), key) == 0 &&
        (n.size() == key.size() || n[n.size() - key.size() - 1] == '.')) {
      prefix = n.substr(0, n.size() - key.size());
      ++found;
    }
  require(found == 1, "checkpoint", "must hold exactly one TUPE encoder (a tensor named *pos_q_linear.weight)",
          found, " found in ", st.source());
  return prefix;
}

}  // namespace detail

/// A posenc::tupe from the official tensor names under `prefix` (found from *pos_q_linear.weight when
/// empty). Shapes are checked against `spec`; the error names the tensor.
[[nodiscard]] inline tupe tupe_from_safetensors(const safetensors_file& st, const tupe_spec& spec,
                                                std::string prefix = "") {
  if (prefix.empty()) prefix = detail::tupe_prefix(st);
  const index_t H = spec.heads, Dm = spec.embed_dim, N = spec.max_positions + 1, d = Dm / H;
  require(H > 0 && Dm > 0 && Dm % H == 0 && spec.max_positions > 0, "spec",
          "needs heads > 0, embed_dim a multiple of heads, max_positions > 0");
  const auto pos = detail::tupe_tensor(st, prefix + "pos.weight", {N, Dm});
  const auto ln_w = detail::tupe_tensor(st, prefix + "pos_ln.weight", {Dm});
  const auto ln_b = detail::tupe_tensor(st, prefix + "pos_ln.bias", {Dm});
  const auto uq = detail::tupe_tensor(st, prefix + "pos_q_linear.weight", {Dm, Dm});
  const auto buq = detail::tupe_tensor(st, prefix + "pos_q_linear.bias", {Dm});
  const auto uk = detail::tupe_tensor(st, prefix + "pos_k_linear.weight", {Dm, Dm});
  const auto buk = detail::tupe_tensor(st, prefix + "pos_k_linear.bias", {Dm});
  std::vector<double> rel;
  if (spec.rel_pos)
    rel = detail::tupe_tensor(st, prefix + "relative_attention_bias.weight", {spec.rel_pos_bins + 1, H});

  // pos_ln over each row of pos.weight (biased variance, as torch.nn.LayerNorm).
  std::vector<double> e(pos.size());
  for (index_t r = 0; r < N; ++r) {
    const double* x = pos.data() + r * Dm;
    double mean = 0, var = 0;
    for (index_t c = 0; c < Dm; ++c) mean += x[c];
    mean /= static_cast<double>(Dm);
    for (index_t c = 0; c < Dm; ++c) var += (x[c] - mean) * (x[c] - mean);
    var /= static_cast<double>(Dm);
    const double inv = 1.0 / std::sqrt(var + spec.layer_norm_eps);
    for (index_t c = 0; c < Dm; ++c)
      e[static_cast<std::size_t>(r * Dm + c)] = (x[c] - mean) * inv * ln_w[static_cast<std::size_t>(c)] +
                                                ln_b[static_cast<std::size_t>(c)];
  }
  // The [CLS] constants: the position term of row 0 with itself, and of row 1 with itself.
  auto self_term = [&](index_t row, index_t h) {
    const double* x = e.data() + row * Dm;
    double dot = 0;
    for (index_t c = h * d; c < (h + 1) * d; ++c) {
      double a = buq[static_cast<std::size_t>(c)], b = buk[static_cast<std::size_t>(c)];
      for (index_t m = 0; m < Dm; ++m) {
        a += x[m] * uq[static_cast<std::size_t>(c * Dm + m)];
        b += x[m] * uk[static_cast<std::size_t>(c * Dm + m)];
      }
      dot += a * b;
    }
    return dot * tupe::logit_scale(d);
  };
  std::vector<double> c2o(static_cast<std::size_t>(H)), o2c(static_cast<std::size_t>(H));
  for (index_t h = 0; h < H; ++h) {
    c2o[static_cast<std::size_t>(h)] = self_term(0, h);
    o2c[static_cast<std::size_t>(h)] = self_term(1, h);
  }
  tupe_weights<double> w{.pos_emb = {e.data() + Dm, N - 1, Dm},
                         .pos_q_weight = {uq.data(), Dm, Dm},
                         .pos_q_bias = {buq.data(), Dm},
                         .pos_k_weight = {uk.data(), Dm, Dm},
                         .pos_k_bias = {buk.data(), Dm}};
  w.theta_cls_to_others.emplace(c2o.data(), H);
  w.theta_others_to_cls.emplace(o2c.data(), H);
  if (spec.rel_pos) w.relative_attention_bias.emplace(rel.data(), spec.rel_pos_bins + 1, H);
  return tupe(w, {.num_attention_heads = H,
                  .cls_reset = true,
                  .rel_pos_bins = spec.rel_pos_bins,
                  .max_rel_pos = spec.max_rel_pos});
}

}  // namespace posenc::io
