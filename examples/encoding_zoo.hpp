// examples/encoding_zoo.hpp — every encoding of the library, configured as its canonical model uses it,
// for the side-by-side comparisons of bench/bench_encodings.cpp and examples/demo.cpp.
//
// One attention layer: batch 1, H heads of dimension D (d_model = H D), L tokens at positions 0..L-1.
// Causal or bidirectional as the family's canonical model uses it:
//   none            causal (the baseline of every causal family; each encoding is compared with
//                   `none` under its own mask and logit scale, see options())
//   sinusoidal      bidirectional: the Transformer encoder (Vaswani et al. 2017)
//   learned         causal: GPT-2 (wpe)
//   alibi           causal: BLOOM (Press et al. 2022)
//   t5              bidirectional: the T5 encoder (32 buckets, max_distance 128)
//   shaw            bidirectional: Shaw et al. 2018 encoder self-attention, keys + values, k = 16
//   transformer_xl  causal: Dai et al. 2019 language model, first segment (no memory)
//   deberta         bidirectional: DeBERTa-v3 (position_buckets 256, max_relative_positions 512, c2p+p2c)
//   tupe            bidirectional: TUPE-R on BERT (untied term, [CLS] reset, 32-bin relative bias)
//   rope*           causal: Llama-style decoders; rope_theta 1e4 (default, linear, dynamic, yarn,
//                   longrope), 5e5 (llama3), factors as in the model configs named in describe()
// The input encodings (sinusoidal, learned) are applied with add_to to q and k (as to the layer's
// input; the layer's projections are left out, they cost the same with every encoding).
// Weights are random (normal, magnitudes as in trained models); positions only matter through them.
#pragma once

#include <malloc.h>
#include <posenc/posenc.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace zoo {

using Index = posenc::index_t;

enum class kind {
  none, sinusoidal, learned, alibi, t5, shaw, transformer_xl, deberta, tupe,
  rope, rope_linear, rope_dynamic, rope_yarn, rope_llama3, rope_longrope
};

inline constexpr std::array<kind, 15> all = {
    kind::none, kind::sinusoidal, kind::learned, kind::alibi, kind::t5, kind::shaw, kind::transformer_xl,
    kind::deberta, kind::tupe, kind::rope, kind::rope_linear, kind::rope_dynamic, kind::rope_yarn,
    kind::rope_llama3, kind::rope_longrope};

struct description {
  const char* name;    ///< stable row name (bench rows, CSV files)
  bool causal;         ///< as the canonical model uses the family
  const char* params;  ///< the parameters, with the canonical names
};

inline description describe(kind k) {
  switch (k) {
    case kind::none: return {"none", true, "-"};
    case kind::sinusoidal: return {"sinusoidal", false, "base=10000"};
    case kind::learned: return {"learned", true, "table [max_pos, d_model]"};
    case kind::alibi: return {"alibi", true, "max_bias=8"};
    case kind::t5: return {"t5", false, "num_buckets=32 max_distance=128"};
    case kind::shaw: return {"shaw", false, "max_relative_position=16 keys+values"};
    case kind::transformer_xl: return {"transformer_xl", true, "mem_len=0 clamp_len=-1"};
    case kind::deberta: return {"deberta", false, "position_buckets=256 max_rel=512"};
    case kind::tupe: return {"tupe", false, "cls_reset rel_pos_bins=32"};
    case kind::rope: return {"rope", true, "theta=1e4"};
    case kind::rope_linear: return {"rope_linear", true, "factor=4"};
    case kind::rope_dynamic: return {"rope_dynamic", true, "factor=4 max_pos=4096"};
    case kind::rope_yarn: return {"rope_yarn", true, "factor=4 orig=4096"};
    case kind::rope_llama3: return {"rope_llama3", true, "theta=5e5 factor=8 orig=8192"};
    case kind::rope_longrope: return {"rope_longrope", true, "orig=4096 max_pos=131072"};
  }
  return {"?", false, ""};
}

inline constexpr Index shaw_k = 16, t5_buckets = 32, deberta_buckets = 256, deberta_max_rel = 512, tupe_bins = 32;

/// n draws of N(0, s^2), generated in float (so a double copy holds the same numbers) and stored as W.
template <class W>
std::vector<W> normal(std::size_t n, unsigned seed, float s = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, s);
  std::vector<W> v(n);
  for (auto& e : v) e = static_cast<W>(nd(rng));
  return v;
}

/// The parameter tensors of one encoding (only those of `k` are filled), as W.
template <class W>
struct weights {
  kind k;
  Index H, D, M, max_len;
  std::vector<W> a, b, c, d, e, f, g;  // per family, see make_weights

  /// Bytes of the parameter tensors the caller passes to the encoding (model weights it views).
  [[nodiscard]] std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto* x : {&a, &b, &c, &d, &e, &f, &g}) n += x->size();
    return n * sizeof(W);
  }
};

/// Random weights for encoding `k` of an H x D layer over positions < max_len.
template <class W>
weights<W> make_weights(kind k, Index H, Index D, Index max_len) {
  weights<W> w{k, H, D, H * D, max_len, {}, {}, {}, {}, {}, {}, {}};
  const auto M = static_cast<std::size_t>(H * D), uH = static_cast<std::size_t>(H), uD = static_cast<std::size_t>(D);
  switch (k) {
    case kind::learned: w.a = normal<W>(static_cast<std::size_t>(max_len) * M, 20, 0.5f); break;
    case kind::t5: w.a = normal<W>(static_cast<std::size_t>(t5_buckets) * uH, 21); break;
    case kind::shaw:
      w.a = normal<W>(static_cast<std::size_t>(2 * shaw_k + 1) * uD, 22, 0.5f);
      w.b = normal<W>(static_cast<std::size_t>(2 * shaw_k + 1) * uD, 23, 0.5f);
      break;
    case kind::transformer_xl:  // W_R [H D, d_model], u and v [H, D]
      w.a = normal<W>(M * M, 24, 0.05f);
      w.b = normal<W>(uH * uD, 25, 0.3f);
      w.c = normal<W>(uH * uD, 26, 0.3f);
      break;
    case kind::deberta:  // rel_embeddings [2 buckets, hidden], query_proj and key_proj
      w.a = normal<W>(static_cast<std::size_t>(2 * deberta_buckets) * M, 27);
      w.b = normal<W>(M * M, 28, 0.03f);
      w.c = normal<W>(M, 29);
      w.d = normal<W>(M * M, 30, 0.03f);
      w.e = normal<W>(M, 31);
      break;
    case kind::tupe:  // pos_emb [max_len, d_model], U_q, b_q, U_k, b_k, theta (2 H), relative bias
      w.a = normal<W>(static_cast<std::size_t>(max_len) * M, 32);
      w.b = normal<W>(M * M, 33, 0.03f);
      w.c = normal<W>(M, 34);
      w.d = normal<W>(M * M, 35, 0.03f);
      w.e = normal<W>(M, 36);
      w.f = normal<W>(2 * uH, 37);
      w.g = normal<W>(static_cast<std::size_t>(tupe_bins + 1) * uH, 38);
      break;
    default: break;
  }
  return w;
}

/// The RoPE configuration of a rope* kind (head_dim D).
inline posenc::rope_config rope_config_of(kind k, Index D) {
  posenc::rope_config c{.head_dim = D, .rope_theta = 1e4};
  switch (k) {
    case kind::rope_linear:  // LongChat-style linear interpolation
      c.scaling = {.rope_type = posenc::rope_type::linear, .factor = 4.0};
      break;
    case kind::rope_dynamic:  // HF dynamic NTK: the base grows once seq_len > max_position_embeddings
      c.scaling = {.rope_type = posenc::rope_type::dynamic, .factor = 4.0};
      c.max_position_embeddings = 4096;
      break;
    case kind::rope_yarn:  // Qwen2.5-style YaRN, beta_fast 32 / beta_slow 1
      c.scaling = {.rope_type = posenc::rope_type::yarn, .factor = 4.0, .original_max_position_embeddings = 4096};
      c.max_position_embeddings = 16384;
      break;
    case kind::rope_llama3:  // Llama-3.1
      c.rope_theta = 5e5;
      c.scaling = {.rope_type = posenc::rope_type::llama3, .factor = 8.0, .original_max_position_embeddings = 8192,
                   .low_freq_factor = 1.0, .high_freq_factor = 4.0};
      c.max_position_embeddings = 131072;
      break;
    case kind::rope_longrope: {  // Phi-3-style; the per-pair factors here are a smooth ramp, not Phi-3's
      c.scaling = {.rope_type = posenc::rope_type::longrope, .original_max_position_embeddings = 4096};
      const Index n = D / 2;
      for (Index i = 0; i < n; ++i) {
        const double t = static_cast<double>(i) / static_cast<double>(n - 1);
        c.scaling.short_factor.push_back(1.0 + 0.1 * t);
        c.scaling.long_factor.push_back(1.0 + 30.0 * t * t);
      }
      c.max_position_embeddings = 131072;
      break;
    }
    default: break;
  }
  return c;
}

/// Builds encoding `w.k` from its weights and calls f(encoding). `none` passes posenc::no_position.
template <class W, class F>
decltype(auto) with_encoding(const weights<W>& w, F&& f) {
  const Index H = w.H, D = w.D, M = w.M;
  switch (w.k) {
    case kind::sinusoidal: return f(posenc::sinusoidal({.d_model = M}));
    case kind::learned:
      return f(posenc::learned_absolute<W>(posenc::tensor_map<const W, 2>(w.a.data(), w.max_len, M)));
    case kind::alibi: return f(posenc::alibi({.heads = H}));
    case kind::t5:
      return f(posenc::t5_relative_bias<W>(posenc::tensor_map<const W, 2>(w.a.data(), t5_buckets, H),
                                           {.num_buckets = t5_buckets, .max_distance = 128}));
    case kind::shaw:
      return f(posenc::shaw_relative<W>(
          posenc::shaw_table<W>(posenc::tensor_map<const W, 2>(w.a.data(), 2 * shaw_k + 1, D)),
          posenc::shaw_table<W>(posenc::tensor_map<const W, 2>(w.b.data(), 2 * shaw_k + 1, D)),
          {.max_relative_position = shaw_k}));
    case kind::transformer_xl:
      return f(posenc::transformer_xl<W>(posenc::tensor_map<const W, 2>(w.a.data(), M, M),
                                         posenc::tensor_map<const W, 2>(w.b.data(), H, D),
                                         posenc::tensor_map<const W, 2>(w.c.data(), H, D),
                                         {.d_model = M, .n_head = H, .d_head = D}));
    case kind::deberta: {
      posenc::deberta_weights<W> dw(posenc::tensor_map<const W, 2>(w.a.data(), 2 * deberta_buckets, M));
      dw.query_proj = posenc::deberta_linear<W>(posenc::tensor_map<const W, 2>(w.b.data(), M, M),
                                                posenc::tensor_map<const W, 1>(w.c.data(), M));
      dw.key_proj = posenc::deberta_linear<W>(posenc::tensor_map<const W, 2>(w.d.data(), M, M),
                                              posenc::tensor_map<const W, 1>(w.e.data(), M));
      return f(posenc::deberta_disentangled(
          {.heads = H, .head_dim = D, .position_buckets = deberta_buckets, .max_relative_positions = deberta_max_rel},
          dw));
    }
    case kind::tupe: {
      posenc::tupe_weights<W> tw{.pos_emb = {w.a.data(), w.max_len, M},
                                 .pos_q_weight = {w.b.data(), M, M},
                                 .pos_q_bias = {w.c.data(), M},
                                 .pos_k_weight = {w.d.data(), M, M},
                                 .pos_k_bias = {w.e.data(), M}};
      tw.theta_cls_to_others.emplace(w.f.data(), H);
      tw.theta_others_to_cls.emplace(w.f.data() + H, H);
      tw.relative_attention_bias.emplace(w.g.data(), tupe_bins + 1, H);
      return f(posenc::tupe(tw, {.num_attention_heads = H, .rel_pos_bins = tupe_bins}));
    }
    case kind::rope:
    case kind::rope_linear:
    case kind::rope_dynamic:
    case kind::rope_yarn:
    case kind::rope_llama3:
    case kind::rope_longrope: return f(posenc::rope(rope_config_of(w.k, D)));
    case kind::none: break;
  }
  return f(posenc::no_position{});
}

/// The attention options of one layer call with `enc` of kind k over L tokens: the family's mask
/// and logit scale (the `none` baseline of an encoding takes the same options).
template <class E>
posenc::attention_options options(kind k, const E& enc, Index L, Index D) {
  posenc::attention_options opt;
  if (k == kind::transformer_xl) opt = posenc::transformer_xl_options(L, L);
  opt.causal = describe(k).causal;
  if constexpr (posenc::attention_encoding<E>) opt.scale = posenc::default_logit_scale(enc, D);
  else opt.scale = posenc::no_position::logit_scale(D);
  (void)L;
  return opt;
}

/// What bind() sees for a call of batch 1, H heads of dimension D, keys at 0..L-1 and queries at
/// opt.q_offset + i, in scalar type `scalar`.
inline posenc::call_info call_info_of(Index L, Index H, Index D, const posenc::attention_options& opt,
                                      const posenc::positions& q_pos, const posenc::positions& k_pos,
                                      posenc::scalar_type scalar) {
  return {.batch = 1, .heads = H, .kv_heads = H, .q_len = L, .k_len = L, .head_dim = D, .value_dim = D,
          .scalar = scalar, .q_positions = posenc::view(q_pos), .k_positions = posenc::view(k_pos),
          .q_min = opt.q_offset, .q_max = opt.q_offset + L - 1, .k_min = 0, .k_max = L - 1};
}

/// Heap bytes in use (glibc mallinfo2: all arenas, mmapped blocks included).
inline std::size_t heap_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

/// Heap bytes the encoding's per-call preparation holds: in use while bind()'s result is alive,
/// minus before. 0 for an encoding without bind.
template <class E>
std::size_t bind_bytes(const E& enc, const posenc::call_info& info) {
  if constexpr (posenc::has_bind<E>) {
    const std::size_t before = heap_in_use();
    const auto& bound = enc.bind(info);
    (void)bound;
    return heap_in_use() - std::min(before, heap_in_use());
  } else {
    (void)enc;
    (void)info;
    return 0;
  }
}

}  // namespace zoo
