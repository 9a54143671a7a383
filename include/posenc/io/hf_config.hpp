// posenc/io/hf_config.hpp — positional encodings from a Hugging Face `config.json`.
//
// One reader function per family turns the config's keys into that family's plain config struct:
//   rope_config_from_hf     RoPE: rope_theta, rope_scaling / rope_parameters (rope_type or legacy
//                           `type`), partial_rotary_factor, head_dim (or hidden_size /
//                           num_attention_heads), max_position_embeddings
//                           (with a layer: that layer's, where sliding layers rotate differently: Gemma 3
//                           and 4; with a stack: that stack's, Moonshine)
//   alibi_config_from_hf    ALiBi: BLOOM (n_head), Falcon (`alibi: true`, slopes scaled by head_dim^-1/2),
//                           MPT (attn_config.alibi, attn_config.alibi_bias_max)
//   t5_config_from_hf       T5: relative_attention_num_buckets, relative_attention_max_distance,
//                           is_decoder
//   learned_spec_from_hf    learned absolute: max_position_embeddings, width, row offset (OPT/BART/BioGPT 2)
//   sinusoidal_spec_from_hf sinusoidal tables a model computes (Marian, Pegasus; fairseq's M2M100 / NLLB,
//                           XGLM, Speech2Text, FSMT in float32, rows offset by pad_token_id + 1; MusicGen)
//   attention_config_from_hf  what a host needs besides the encoding (model_attention_config) for a
//                           decoder, or for either stack of an encoder-decoder model (attention_stack): heads,
//                           kv heads, head_dim, the sliding window and which layers use it (Mistral,
//                           Qwen2, Gemma 2/3, Cohere2, gpt-oss), which layers skip RoPE (Cohere2,
//                           SmolLM3, EXAONE 4.0), Gemma 2's logit softcap, the logit scale where a model
//                           sets its own (Gemma, Gemma 3n, Granite, DeepSeek, GPT-Neo, GPT-2, Falcon-H1),
//                           gpt-oss's attention sinks, Ministral 3's query temperature, the layers whose
//                           heads differ (Gemma 4) or that share another's keys and values (Gemma 3n, 4)
// and `encoding_from_hf` picks the family from model_type and the keys present, through the table
// `hf_families()`: a new family (Shaw, Transformer-XL, DeBERTa, TUPE) is one reader function plus one
// row of that table, and one alternative of hf_encoding::config.
//
// Key names, aliases and defaults follow transformers' configuration classes (the attribute_map of
// BloomConfig / FalconConfig / MptConfig / GPT2Config) and modeling_rope_utils.py. Missing or
// ill-typed keys raise posenc::error naming the key.
//
//   auto cfg = posenc::io::read_json("Llama-3.1-8B/config.json");
//   posenc::rope rope(posenc::io::rope_config_from_hf(cfg));
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "posenc/alibi.hpp"
#include "posenc/error.hpp"
#include "posenc/learned.hpp"
#include "posenc/options.hpp"
#include "posenc/rope.hpp"
#include "posenc/sinusoidal.hpp"
#include "posenc/t5.hpp"

namespace posenc::io {

/// Read a JSON file (config.json); posenc::error naming the path when it cannot be read or parsed.
[[nodiscard]] inline nlohmann::json read_json(const std::filesystem::path& path) {
  std::error_code ec;
  require(!std::filesystem::is_directory(path, ec), "config", "must be a file, not a directory", path.string());
  std::ifstream f(path);
  require(static_cast<bool>(f), "config", "cannot open file", path.string());
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw error("posenc: config " + path.string() + ": not valid JSON: " + e.what());
  } catch (const std::ios_base::failure& e) {  // the stream's own read error (e.g. EIO, EISDIR)
    throw error("posenc: config " + path.string() + ": read error: " + e.what());
  }
}

namespace detail {

using json = nlohmann::json;

/// The first of `keys` that is present and not null (HF's attribute_map aliases), or null.
[[nodiscard]] inline const json* find_key(const json& cfg, std::initializer_list<std::string_view> keys) {
  if (!cfg.is_object()) return nullptr;
  for (auto k : keys) {
    auto it = cfg.find(std::string(k));
    if (it != cfg.end() && !it->is_null()) return &*it;
  }
  return nullptr;
}

template <class V>
[[nodiscard]] V as(const json& v, std::string_view key) {
  const bool ok = std::is_same_v<V, bool>          ? v.is_boolean()
                  : std::is_same_v<V, std::string> ? v.is_string()
                  : std::is_integral_v<V>          ? (v.is_number_integer() ||
                                             (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()))
                                                   : v.is_number();
  require(ok, key, "has the wrong JSON type", v.dump());
  if constexpr (std::is_integral_v<V> && !std::is_same_v<V, bool>) {
    if (v.is_number_float()) {
      // a whole number written as a float (4096.0): in V's range, or the conversion would be undefined
      const double d = v.get<double>();
      require(d >= static_cast<double>(std::numeric_limits<V>::min()) &&
                  d < std::ldexp(1.0, std::numeric_limits<V>::digits),
              key, "is out of the integer range", v.dump());
      return static_cast<V>(d);
    }
  }
  return v.get<V>();
}

/// Optional key (first present alias).
template <class V>
[[nodiscard]] std::optional<V> get(const json& cfg, std::initializer_list<std::string_view> keys) {
  const json* v = find_key(cfg, keys);
  if (!v) return std::nullopt;
  return as<V>(*v, *keys.begin());
}

/// Required key (first present alias); the error lists every alias.
template <class V>
[[nodiscard]] V need(const json& cfg, std::initializer_list<std::string_view> keys, std::string_view family) {
  const json* v = find_key(cfg, keys);
  if (!v) {
    std::string names;
    for (auto k : keys) names += (names.empty() ? "" : " or ") + std::string(k);
    throw error(posenc::detail::concat("posenc: config: ", family, " needs ", names));
  }
  return as<V>(*v, *keys.begin());
}

[[nodiscard]] inline std::string model_type(const json& cfg) {
  return get<std::string>(cfg, {"model_type"}).value_or("");
}

[[nodiscard]] inline bool one_of(std::string_view s, std::initializer_list<std::string_view> set) {
  return std::find(set.begin(), set.end(), s) != set.end();
}

/// Falcon under its model types (RefinedWeb / RefinedWebModel: its first remote-code configs).
[[nodiscard]] inline bool is_falcon(std::string_view model_type) {
  return one_of(model_type, {"falcon", "RefinedWeb", "RefinedWebModel"});
}

/// The aliases of the model width and the head count (the attribute_map of GPT2Config, BloomConfig
/// (n_embed, read by BloomConfig.__init__), MptConfig, T5Config (num_heads), DistilBertConfig (dim),
/// XGLMConfig and Kosmos2TextConfig (attention_heads, embed_dim)).
inline const std::initializer_list<std::string_view> hidden_keys = {"hidden_size", "n_embd", "n_embed",
                                                                    "d_model",     "dim",    "embed_dim"};
inline const std::initializer_list<std::string_view> heads_keys = {"num_attention_heads", "n_head", "n_heads",
                                                                   "num_heads", "attention_heads"};

/// What transformers' configuration class of a model gives a key that its config.json leaves out, where
/// that differs from the generic fallback (kv heads = heads, head_dim = hidden / heads, rope_theta 10000,
/// the whole head rotated, no window). Published configs write these keys (to_diff_dict keeps every
/// model-specific one); a config written by hand may not, and then reads as transformers reads it.
struct class_defaults {
  std::string_view model_type;
  std::optional<index_t> kv_heads{}, head_dim{}, rotary_dim{}, sliding_window{};
  std::optional<double> rope_theta{}, partial_rotary_factor{};
};

/// The class defaults of `model_type` (MistralConfig, Qwen3Config, GPTNeoXConfig, ...), or null.
[[nodiscard]] inline const class_defaults* defaults_of(std::string_view model_type) {
  static const class_defaults table[] = {
      {.model_type = "mistral", .kv_heads = 8, .sliding_window = 4096},
      {.model_type = "ministral", .kv_heads = 8, .sliding_window = 4096},
      {.model_type = "mixtral", .kv_heads = 8, .rope_theta = 1e6},
      {.model_type = "phimoe", .kv_heads = 8, .rope_theta = 1e6},
      {.model_type = "qwen3", .head_dim = 128},
      {.model_type = "qwen3_moe", .kv_heads = 4},
      {.model_type = "starcoder2", .kv_heads = 2},
      {.model_type = "stablelm", .partial_rotary_factor = 0.25},
      {.model_type = "persimmon", .rope_theta = 25000.0, .partial_rotary_factor = 0.5},
      {.model_type = "phi", .partial_rotary_factor = 0.5},
      {.model_type = "nemotron", .partial_rotary_factor = 0.5},
      {.model_type = "gpt_neox", .partial_rotary_factor = 0.25},
      {.model_type = "gptj", .rotary_dim = 64},
      {.model_type = "codegen", .rotary_dim = 64},
      {.model_type = "gemma", .head_dim = 256},
      {.model_type = "gemma4_text", .kv_heads = 4, .head_dim = 256, .sliding_window = 512},
      {.model_type = "olmo3", .sliding_window = 4096, .rope_theta = 500000.0},
      {.model_type = "exaone4", .sliding_window = 4096},
      {.model_type = "seed_oss", .kv_heads = 8, .head_dim = 128},
      {.model_type = "glm4_moe", .kv_heads = 8, .partial_rotary_factor = 0.5},
      {.model_type = "jamba", .kv_heads = 8},
      {.model_type = "lfm2", .kv_heads = 8, .rope_theta = 1e6},
      {.model_type = "bamba", .kv_heads = 8, .partial_rotary_factor = 0.5},
      {.model_type = "bitnet", .kv_heads = 5, .rope_theta = 500000.0},
      {.model_type = "minimax", .rope_theta = 1e6},
      {.model_type = "apertus", .rope_theta = 12e6},
      {.model_type = "csm", .kv_heads = 8, .rope_theta = 500000.0},
  };
  for (const class_defaults& d : table)
    if (d.model_type == model_type) return &d;
  return nullptr;
}

/// defaults_of(model_type(cfg))->*field when there is one, else `fallback`.
template <class V>
[[nodiscard]] V class_default(const json& cfg, std::optional<V> class_defaults::*field, V fallback) {
  const class_defaults* d = defaults_of(model_type(cfg));
  return d != nullptr && (d->*field).has_value() ? *(d->*field) : fallback;
}

/// head_dim (T5's d_kv), else the class default (Gemma, Qwen3), else hidden_size / num_attention_heads
/// (HF's default in every other decoder config class); `heads` when given replaces num_attention_heads
/// (an encoder-decoder model's stack: BartAttention's embed_dim // num_heads).
[[nodiscard]] inline index_t head_dim(const json& cfg, std::string_view family,
                                      std::optional<index_t> stack_heads = std::nullopt) {
  if (auto h = get<index_t>(cfg, {"head_dim", "d_kv"}); h) return *h;
  if (const class_defaults* d = defaults_of(model_type(cfg)); d != nullptr && d->head_dim) return *d->head_dim;
  const std::string what = std::string(family) + " (head_dim, or hidden_size / num_attention_heads)";
  const auto hidden = need<index_t>(cfg, hidden_keys, what);
  const auto heads = stack_heads ? *stack_heads : need<index_t>(cfg, heads_keys, what);
  require(heads > 0 && hidden % heads == 0, "hidden_size", "must be a multiple of num_attention_heads", hidden, " / ",
          heads);
  return hidden / heads;
}

/// The part of a config the readers look at: a multimodal config's `text_config` (Gemma 3) when the
/// top level has no head count; MusicGen's `decoder` (MusicgenConfig composes a T5 text encoder, an
/// EnCodec audio encoder and the decoder that generates); else the config itself.
[[nodiscard]] inline const json& text_part(const json& top) {
  if (find_key(top, heads_keys) != nullptr) return top;
  if (one_of(model_type(top), {"musicgen", "musicgen_melody"}))
    if (const json* d = find_key(top, {"decoder"}); d != nullptr && d->is_object()) return *d;
  const json* text = find_key(top, {"text_config"});
  return text != nullptr && text->is_object() ? *text : top;
}

/// DBRX keeps its attention's keys in attn_config (DbrxAttentionConfig: kv_n_heads, default 1;
/// rope_theta, default 10000; DbrxAttention reads both from there); an empty object when absent, so the
/// class defaults apply.
[[nodiscard]] inline const json& dbrx_attention(const json& cfg) {
  static const json none = json::object();
  const json* a = find_key(cfg, {"attn_config"});
  return a != nullptr && a->is_object() ? *a : none;
}

/// Models whose attention no posenc call reproduces from the config's keys: an error naming why, from
/// the readers of the encoding and of the attention, instead of an answer that is silently wrong.
inline void refuse_unsupported_attention(const json& cfg) {
  const std::string mt = model_type(cfg);
  // JetMoeAttention: num_key_value_heads x num_experts_per_tok query heads of kv_channels each, the
  // key / value heads repeated (tiled) over the experts' heads rather than grouped as in GQA.
  require(mt != "jetmoe", "model_type",
          "jetmoe is not supported: its mixture-of-attention heads share kv heads by tiling, not by GQA groups");
  // Zamba2's shared attention runs on [hidden, embeddings] concatenated: attention_head_dim =
  // 2 hidden_size / num_attention_heads, the logit scale (attention_head_dim / 2)^-1/2, RoPE only with
  // use_mem_rope (Zamba2Attention).
  require(mt != "zamba2", "model_type",
          "zamba2 is not supported: its shared attention block has its own head size, scale and RoPE switch");
  // DogeAttention adds a per-key bias computed from the values (dt_proj) and keeps the top
  // keep_window_size keys of each query; DiffLlamaAttention subtracts two softmaxes (differential attention).
  require(
      mt != "doge", "model_type",
      "doge is not supported: its dynamic mask (a bias from the values, top-k keys per query) is not a posenc mask");
  require(mt != "diffllama", "model_type", "diffllama is not supported: its differential attention is two softmaxes");
  // ProphetNetNgramSelfAttention (and XLM-ProphetNet's copy) adds bucketed relative logits to absolute
  // positions and runs n-gram predicting streams beside the main one.
  require(!one_of(mt, {"prophetnet", "xlm-prophetnet"}), "model_type",
          posenc::detail::concat(mt,
                                 " is not supported: its decoder's n-gram self-attention adds relative logits "
                                 "and predicting streams"));
}

/// Models whose attention adds relative terms to the logits (and DeBERTa its own scale), which a plain
/// attention_options call would leave out: DeBERTa's disentangled c2p / p2c terms with the scale
/// (head_dim (1 + terms))^-1/2 (posenc::io::deberta_config_from_hf reads them), MPNet's relative bucket
/// bias, a BERT-style position_embedding_type relative_key / relative_key_query (Shaw-style relative keys:
/// posenc::shaw). MVP with use_prompt puts prompt_length learned keys and values before every attention's
/// own (MvpAttention).
inline void refuse_relative_attention(const json& cfg) {
  const std::string mt = model_type(cfg);
  require(!one_of(mt, {"deberta", "deberta-v2"}), "model_type",
          posenc::detail::concat(mt,
                                 "'s attention adds disentangled relative terms and scales by (head_dim (1 + "
                                 "terms))^-1/2: read it with posenc::io::deberta_config_from_hf"));
  require(mt != "mpnet", "model_type", "mpnet's attention adds a relative bucket bias to its logits");
  const std::string position_type = get<std::string>(cfg, {"position_embedding_type"}).value_or("absolute");
  require(!one_of(position_type, {"relative_key", "relative_key_query"}), "position_embedding_type",
          "adds relative-position terms to the logits (Shaw et al.: posenc::shaw), which model_attention_config "
          "does not describe",
          position_type);
  require(!(mt == "mvp" && get<bool>(cfg, {"use_prompt"}).value_or(false)), "use_prompt",
          "mvp with prompts attends to prompt_length learned keys and values besides the sequence's", "true");
}

/// The rope block: rope_parameters (transformers >= 4.56 / v5) or rope_scaling; null when absent. A
/// block keyed by layer type (v5's Gemma 3: {"full_attention": {...}, "sliding_attention": {...}})
/// gives the entry of `layer_kind`.
[[nodiscard]] inline const json* rope_block(const json& cfg, std::string_view layer_kind) {
  // Gemma4TextConfig's rope_parameters when the config has none: p-RoPE on the full layers
  static const json gemma4_default =
      json::parse(R"({"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}})");
  const json* b = find_key(cfg, {"rope_parameters", "rope_scaling"});
  if (!b && model_type(cfg) == "gemma4_text") b = &gemma4_default;
  if (!b) return nullptr;
  require(b->is_object(), "rope_scaling", "must be an object or null", b->dump());
  if (!b->contains("full_attention") && !b->contains("sliding_attention")) return b;
  const json* e = find_key(*b, {layer_kind});
  require(e != nullptr && e->is_object(), "rope_parameters",
          "is keyed by layer type and needs an object for the layer's type", layer_kind);
  return e;
}

}  // namespace detail

/// The rope types this reader accepts (HF names; "su" is longrope's old name).
inline constexpr std::string_view supported_rope_types =
    "default, linear, dynamic, yarn, longrope (su), llama3, proportional";

/// A `rope_scaling` / `rope_parameters` object -> rope_scaling. The type is `rope_type`, else the
/// legacy `type`, else "default". An unknown type is an error listing the supported ones.
[[nodiscard]] inline rope_scaling rope_scaling_from_hf(const nlohmann::json& block) {
  using detail::get;
  rope_scaling s;
  if (block.is_null()) return s;
  require(block.is_object(), "rope_scaling", "must be an object or null", block.dump());
  const std::string type = get<std::string>(block, {"rope_type", "type"}).value_or("default");
  if (type == "default")
    s.rope_type = rope_type::default_;
  else if (type == "linear")
    s.rope_type = rope_type::linear;
  else if (type == "dynamic")
    s.rope_type = rope_type::dynamic;
  else if (type == "yarn")
    s.rope_type = rope_type::yarn;
  else if (type == "longrope" || type == "su")
    s.rope_type = rope_type::longrope;
  else if (type == "llama3")
    s.rope_type = rope_type::llama3;
  else if (type == "proportional")
    s.rope_type = rope_type::proportional;
  else
    throw error(posenc::detail::concat("posenc: rope_scaling.rope_type: unsupported type '", type,
                                       "' (supported: ", supported_rope_types, ")"));
  s.factor = get<double>(block, {"factor"});
  s.original_max_position_embeddings = get<std::int64_t>(block, {"original_max_position_embeddings"});
  s.attention_factor = get<double>(block, {"attention_factor"});
  s.beta_fast = get<double>(block, {"beta_fast"});
  s.beta_slow = get<double>(block, {"beta_slow"});
  s.mscale = get<double>(block, {"mscale"});
  s.mscale_all_dim = get<double>(block, {"mscale_all_dim"});
  s.truncate = get<bool>(block, {"truncate"}).value_or(true);
  s.low_freq_factor = get<double>(block, {"low_freq_factor"});
  s.high_freq_factor = get<double>(block, {"high_freq_factor"});
  for (auto [key, out] : {std::pair{"short_factor", &s.short_factor}, std::pair{"long_factor", &s.long_factor}}) {
    const detail::json* v = detail::find_key(block, {key});
    if (!v) continue;
    require(v->is_array(), std::string("rope_scaling.") + key, "must be a list of numbers", v->dump().substr(0, 80));
    for (const auto& x : *v) out->push_back(detail::as<double>(x, std::string("rope_scaling.") + key));
  }
  return s;
}

/// Which stack of a model a reader describes (attention_config_from_hf, rope_config_from_hf,
/// learned_spec_from_hf).
enum class attention_stack {
  /// The causal self-attention a decode loop runs: a decoder-only model's, or an encoder-decoder model's
  /// decoder (BART, Marian, T5, Whisper, ...). An encoder-only model (BERT) has only its encoder.
  decoder,
  /// The bidirectional self-attention of an encoder-decoder model's encoder, or of an encoder-only model.
  encoder,
};

namespace detail {

/// A stack's own head count where an encoder-decoder config keeps one per stack (BART's
/// decoder_attention_heads, Moonshine's decoder_num_attention_heads, and the encoder_ ones), if any.
[[nodiscard]] inline std::optional<index_t> own_stack_heads(const json& cfg, attention_stack stack) {
  return stack == attention_stack::decoder
             ? get<index_t>(cfg, {"decoder_attention_heads", "decoder_num_attention_heads"})
             : get<index_t>(cfg, {"encoder_attention_heads", "encoder_num_attention_heads"});
}

/// Whether `cfg` (the text part) is a GraniteMoeHybrid that rotates no layer: it carries rope_theta
/// either way, and applies RoPE only with position_embedding_type "rope" (GraniteMoeHybridModel.rotary_emb;
/// the default, None, and the 4.0-H checkpoints' "nope" are NoPE throughout).
[[nodiscard]] inline bool granite_hybrid_without_rope(const json& cfg) {
  return model_type(cfg) == "granitemoehybrid" &&
         get<std::string>(cfg, {"position_embedding_type"}).value_or("") != "rope";
}

/// The head size of Gemma 4's full-attention layers (Gemma4TextConfig.global_head_dim, default 512), for
/// their RoPE and their attention alike.
[[nodiscard]] inline index_t gemma4_global_head_dim(const json& cfg) {
  const index_t d = get<index_t>(cfg, {"global_head_dim"}).value_or(512);
  require(d > 0, "global_head_dim", "must be > 0", d);
  return d;
}

/// rope_config_from_hf for the layers of `layer_kind` ("full_attention" or "sliding_attention") of `cfg`
/// (already the text part), in `stack` of an encoder-decoder model.
[[nodiscard]] inline rope_config rope_config_of(const json& cfg, std::string_view layer_kind,
                                                attention_stack stack = attention_stack::decoder) {
  const json* block = rope_block(cfg, layer_kind);
  const bool keyed_by_layer = block != find_key(cfg, {"rope_parameters", "rope_scaling"});
  const json none;
  const json& b = block ? *block : none;
  const std::string mt = model_type(cfg);
  refuse_unsupported_attention(cfg);
  require(!granite_hybrid_without_rope(cfg), "position_embedding_type",
          "is not rope: the model rotates no layer (run it with posenc::no_position)",
          get<std::string>(cfg, {"position_embedding_type"}).value_or("null"), " for model_type ", mt);

  rope_config r;
  r.scaling = rope_scaling_from_hf(b);
  // M-RoPE (Qwen2-VL, Qwen2.5-VL, GLM-4.1V) rotates sections of the pairs by the temporal, height and width
  // positions of a token; transformers rewrites its type "mrope" to "default" and keeps mrope_section,
  // so the section is what tells it. For image and video tokens it is no 1-D RoPE.
  require(find_key(b, {"mrope_section"}) == nullptr, "rope_scaling.mrope_section",
          "M-RoPE (the 3-D positions of a multimodal model) is not supported");
  // PhiMoE scales cos and sin by short_mscale / long_mscale instead of LongRoPE's computed factor
  // (PhimoeRotaryEmbedding.forward: long_mscale past original_max_position_embeddings, else short_mscale):
  // one attention factor when the two agree, as in the published configs.
  if (find_key(b, {"short_mscale", "long_mscale"}) != nullptr) {
    const auto s = get<double>(b, {"short_mscale"}), l = get<double>(b, {"long_mscale"});
    require(s && l && *s == *l && std::isfinite(*s) && *s > 0.0, "rope_scaling.short_mscale",
            "must equal long_mscale, finite and > 0 (one attention factor at every length)", s.value_or(0.0), " vs ",
            l.value_or(0.0));
    r.scaling.attention_factor = *s;
  }
  // transformers' llama3 reads original_max_position_embeddings from the block only (a KeyError without
  // it); the fallback to max_position_embeddings would give other frequencies, silently.
  if (r.scaling.rope_type == rope_type::llama3)
    require(r.scaling.original_max_position_embeddings.has_value(), "rope_scaling.original_max_position_embeddings",
            "is required by rope_type llama3 (transformers reads it from the rope_scaling block)");
  // A rope_theta / partial_rotary_factor inside the block overrides the top-level one (rope_parameters).
  const json& theta_keys = mt == "dbrx" ? dbrx_attention(cfg) : cfg;
  r.rope_theta = get<double>(b, {"rope_theta"})
                     .value_or(get<double>(theta_keys, {"rope_theta", "rotary_emb_base"})
                                   .value_or(class_default(cfg, &class_defaults::rope_theta, 10000.0)));
  if (auto f = get<double>(b, {"partial_rotary_factor"}); f)
    r.partial_rotary_factor = *f;
  else
    r.partial_rotary_factor = get<double>(cfg, {"partial_rotary_factor", "rotary_pct"})
                                  .value_or(class_default(cfg, &class_defaults::partial_rotary_factor, 1.0));
  // Gemma 3 (transformers 4.5x): the sliding layers rotate with rope_local_base_freq and no scaling
  // (Gemma3TextModel.rotary_emb_local); v5 writes that as the block's sliding_attention entry instead.
  if (layer_kind == "sliding_attention" && !keyed_by_layer) {
    if (auto local = get<double>(cfg, {"rope_local_base_freq"}); local) {
      r.rope_theta = *local;
      r.scaling = rope_scaling{};
    }
    // OLMo 3 scales only its full-attention layers' RoPE (Olmo3Model's sliding_attention rotary is
    // rope_type "default"; v5's Olmo3Config moves a legacy rope_scaling into full_attention only).
    if (mt == "olmo3") r.scaling = rope_scaling{};
  }

  const bool deepseek = one_of(mt, {"deepseek_v2", "deepseek_v3"});
  if (auto h = get<index_t>(cfg, {"qk_rope_head_dim"}); h && deepseek) {
    r.head_dim = *h;  // MLA: only the decoupled rope part of each head (its last qk_rope_head_dim dims) rotates
  } else if (mt == "gemma4_text" && layer_kind == "full_attention") {
    r.head_dim = gemma4_global_head_dim(cfg);  // Gemma4TextAttention's full layers
  } else {
    // Moonshine keeps no num_attention_heads: each stack's rotary embedding is built while the config's
    // num_attention_heads (attribute_map: encoder_num_attention_heads) holds that stack's own count
    // (MoonshineEncoder builds it before its layers set it, MoonshineDecoder after its layers did).
    r.head_dim = head_dim(cfg, "rope", find_key(cfg, heads_keys) ? std::nullopt : own_stack_heads(cfg, stack));
  }
  // Hunyuan's dynamic scaling with an alpha is a fixed NTK base, rope_theta alpha^(d / (d - 2)) with
  // d = head_dim, and no attention factor (HunYuanDenseV1RotaryEmbedding, as the model's own code);
  // transformers' update past max_position_embeddings recomputes plain dynamic-NTK frequencies instead.
  if (auto alpha = get<double>(b, {"alpha"}); alpha && *alpha != 0.0 && r.scaling.rope_type == rope_type::dynamic) {
    require(std::isfinite(*alpha) && *alpha > 0.0 && r.head_dim > 2, "rope_scaling.alpha",
            "must be finite and > 0, with head_dim > 2", *alpha, " with head_dim ", r.head_dim);
    const double d = static_cast<double>(r.head_dim);
    r.rope_theta *= std::pow(*alpha, d / (d - 2.0));
    r.scaling = rope_scaling{};
  }
  // An explicit rotary_dim: GPT-J and CodeGen (rotate_every_two on the first rotary_dim dims) and MiniMax-M2
  // (rotate_half on the first 64 of 128 dims, frequencies over the rotary dims: MiniMaxM2RotaryEmbedding).
  if (one_of(mt, {"gptj", "codegen", "minimax_m2"})) {
    r.rotary_dim = get<index_t>(cfg, {"rotary_dim"});
    if (const class_defaults* d = defaults_of(mt); !r.rotary_dim && d != nullptr) r.rotary_dim = d->rotary_dim;
  }
  // Interleaved pairs: GPT-J / CodeGen (rotate_every_two); Cohere / Cohere2, GLM / GLM-4, Helium and
  // ERNIE 4.5 (their rotate_half pairs x[2i] with x[2i+1], the frequencies repeat_interleaved: modeling_cohere,
  // modeling_glm); Moonshine (the same pairs, the first half of cos / sin repeat_interleaved on the first
  // int(head_dim * 0.9) dims: modeling_moonshine apply_rotary_pos_emb); Llama 4 and DeepSeek-V2 (complex
  // pairs of adjacent dims, view_as_complex) and V3 unless rope_interleave is false
  // (apply_rotary_pos_emb_interleave: q and k de-interleaved alike before rotate_half, so the scores are
  // those of adjacent pairs). GLM-4.5 (glm4_moe) rotates halves.
  const bool interleaved =
      one_of(mt, {"gptj", "codegen", "cohere", "cohere2", "glm", "glm4", "glm4v", "glm4v_text", "helium", "ernie4_5",
                  "ernie4_5_moe", "llama4", "llama4_text", "deepseek_v2", "moonshine"}) ||
      (mt == "deepseek_v3" && get<bool>(cfg, {"rope_interleave"}).value_or(true));
  r.layout = interleaved ? rope_layout::interleaved : rope_layout::half;
  r.max_position_embeddings = get<std::int64_t>(cfg, {"max_position_embeddings", "n_positions", "max_seq_len"});

  // Phi-3 keeps original_max_position_embeddings at the top level; HF's longrope then derives the
  // factor as max_position_embeddings / original (modeling_rope_utils _compute_longrope_parameters).
  if (!r.scaling.original_max_position_embeddings) {
    if (auto orig = get<std::int64_t>(cfg, {"original_max_position_embeddings"}); orig) {
      r.scaling.original_max_position_embeddings = orig;
      if (r.scaling.rope_type == rope_type::longrope) r.scaling.factor.reset();
    }
  }
  return r;
}

}  // namespace detail

/// RoPE from a config: theta (rope_theta / rotary_emb_base, or inside the rope block), the scaling
/// block, rotary fraction (partial_rotary_factor / rotary_pct, or an explicit rotary_dim as GPT-J),
/// head_dim (head_dim, DeepSeek's qk_rope_head_dim, else hidden_size / num_attention_heads),
/// max_position_embeddings (n_positions), and the pair layout: interleaved for GPT-J / CodeGen
/// (rotate_every_two) and DeepSeek, half (rotate_half) otherwise. A multimodal config is read from its
/// text_config. Where a model's sliding layers rotate differently (Gemma 3), this is the RoPE of its
/// full-attention layers: rope_config_from_hf(cfg, layer) gives any layer's.
[[nodiscard]] inline rope_config rope_config_from_hf(const nlohmann::json& cfg) {
  require(cfg.is_object(), "config", "must be a JSON object");
  return detail::rope_config_of(detail::text_part(cfg), "full_attention");
}

/// ALiBi heads and max_bias: BLOOM (n_head), Falcon (num_attention_heads / n_head), MPT (n_heads,
/// attn_config.alibi_bias_max, default 8). The form is the paper's causal one, -m (q - k): BLOOM's
/// +m k differs from it by a per-row constant, which the causal softmax of these decoders cancels.
/// Falcon's slopes are scaled by head_dim^-1/2 (it adds the bias before the logit scale:
/// FalconAttention, alibi_config::slope_scale).
[[nodiscard]] inline alibi_config alibi_config_from_hf(const nlohmann::json& cfg) {
  using detail::get;
  require(cfg.is_object(), "config", "must be a JSON object");
  alibi_config a;
  a.heads = detail::need<index_t>(cfg, detail::heads_keys, "alibi");
  a.max_bias = 8.0;
  if (const detail::json* attn = detail::find_key(cfg, {"attn_config"}); attn && attn->is_object())
    a.max_bias = get<double>(*attn, {"alibi_bias_max"}).value_or(8.0);
  a.form = alibi_form::causal;
  if (detail::is_falcon(detail::model_type(cfg)))
    a.slope_scale = 1.0 / std::sqrt(static_cast<double>(detail::head_dim(cfg, "alibi")));
  return a;
}

/// T5 buckets. `decoder` selects the stack (a T5 config.json describes both; the decoder's
/// self-attention uses unidirectional buckets); unset = the config's is_decoder (default false).
[[nodiscard]] inline t5_config t5_config_from_hf(const nlohmann::json& cfg,
                                                 std::optional<bool> decoder = std::nullopt) {
  using detail::get;
  require(cfg.is_object(), "config", "must be a JSON object");
  t5_config t;
  t.num_buckets = get<index_t>(cfg, {"relative_attention_num_buckets"}).value_or(32);
  t.max_distance = get<index_t>(cfg, {"relative_attention_max_distance"}).value_or(128);
  t.is_decoder = decoder ? *decoder : get<bool>(cfg, {"is_decoder"}).value_or(false);
  return t;
}

/// What a learned absolute table needs: its rows, its width and the row of position 0.
struct learned_spec {
  index_t max_positions = 0;  ///< rows of the embedding table
  index_t d_model = 0;        ///< its width
  learned_options options{};
};

/// Learned absolute positions: GPT-2 (n_positions, n_embd), BERT / RoBERTa / OPT / BART
/// (max_position_embeddings, hidden_size / d_model), MPT without ALiBi
/// (max_seq_len, d_model). OPT, BART, mBART, PLBart, MVP, BioGPT and TrOCR look position p up at row
/// p + 2 and size their table max_position_embeddings + 2 (OPTLearnedPositionalEmbedding,
/// BartLearnedPositionalEmbedding and its copies, BioGptLearnedPositionalEmbedding,
/// TrOCRLearnedPositionalEmbedding); Blenderbot's and BigBird-Pegasus's tables have no offset (arange positions);
/// RoBERTa-style models start real tokens at padding_idx + 1 within max_position_embeddings rows.
/// ELECTRA's table is embedding_size wide (default 128), not hidden_size. A BERT-style config whose
/// position_embedding_type is not "absolute" (relative_key, relative_key_query) adds no table to its
/// embeddings (its checkpoint still holds an unused one): an error. `stack` picks the table where a
/// model's encoder and decoder size theirs apart: Whisper's decoder max_target_positions rows
/// (WhisperPositionalEmbedding) and its encoder's max_source_positions (the sinusoid its checkpoint
/// stores, added to every frame); LED's max_decoder_position_embeddings / max_encoder_position_embeddings.
/// Every other model has one size for both.
[[nodiscard]] inline learned_spec learned_spec_from_hf(const nlohmann::json& cfg,
                                                       attention_stack stack = attention_stack::decoder) {
  using detail::get;
  require(cfg.is_object(), "config", "must be a JSON object");
  const std::string mt = detail::model_type(cfg);
  learned_spec s;
  const std::string position_type = get<std::string>(cfg, {"position_embedding_type"}).value_or("absolute");
  require(position_type == "absolute", "position_embedding_type",
          "is not absolute: the model adds relative-distance terms to its logits, not a learned table", position_type,
          " for model_type ", mt);
  const bool dec = stack == attention_stack::decoder;
  const index_t n = [&] {
    constexpr std::string_view what = "learned positions";
    if (mt == "whisper")
      return detail::need<index_t>(cfg, {dec ? "max_target_positions" : "max_source_positions"}, what);
    if (mt == "led")
      return detail::need<index_t>(cfg, {dec ? "max_decoder_position_embeddings" : "max_encoder_position_embeddings"},
                                   what);
    return detail::need<index_t>(cfg, {"max_position_embeddings", "n_positions", "max_seq_len"}, what);
  }();
  s.d_model = mt == "electra" ? get<index_t>(cfg, {"embedding_size"}).value_or(128)
                              : detail::need<index_t>(cfg, detail::hidden_keys, "learned positions");
  s.max_positions = n;
  if (detail::one_of(mt, {"opt", "bart", "mbart", "plbart", "mvp", "biogpt", "trocr"})) {
    s.options.offset = 2;
    s.max_positions = n + 2;
  } else if (detail::one_of(mt, {"roberta", "xlm-roberta", "camembert", "longformer", "xlm-roberta-xl"})) {
    s.options.offset = get<std::int64_t>(cfg, {"pad_token_id"}).value_or(1) + 1;
  }
  require(s.max_positions > 0 && s.d_model > 0, "config", "learned table must have rows and columns", s.max_positions,
          " x ", s.d_model);
  return s;
}

/// A learned_absolute viewing `weight` (the checkpoint's position-embedding matrix), checked against
/// the config.
template <class W>
[[nodiscard]] learned_absolute<W> learned_from_hf(const nlohmann::json& cfg, tensor_map<const W, 2> weight,
                                                  attention_stack stack = attention_stack::decoder) {
  const learned_spec s = learned_spec_from_hf(cfg, stack);
  require(weight.dimension(0) == s.max_positions && weight.dimension(1) == s.d_model, "weight",
          "must be [max_positions, d_model] as the config says", "[", weight.dimension(0), ", ", weight.dimension(1),
          "] vs [", s.max_positions, ", ", s.d_model, "]");
  return learned_absolute<W>(weight, s.options);
}

namespace detail {

/// Marian's table (MarianSinusoidalPositionalEmbedding; Pegasus copies it), built in NumPy float64.
inline bool marian_sinusoid(std::string_view mt) {
  return one_of(mt, {"marian", "pegasus"});
}
/// fairseq's get_embedding in float32 (M2M100SinusoidalPositionalEmbedding and the models that copy it;
/// PEGASUS-X computes the same schedule on the fly).
inline bool fairseq_sinusoid(std::string_view mt) {
  return one_of(mt, {"m2m_100", "nllb-moe", "speech_to_text", "fsmt", "seamless_m4t", "seamless_m4t_v2",
                     "kosmos_2_text_model", "xglm", "pegasus_x"});
}
/// MusicGen's decoder: fairseq's float32 table with cos before sin (MusicgenSinusoidalPositionalEmbedding,
/// and MusicGen Melody's copy), row = position.
inline bool musicgen_sinusoid(std::string_view mt) {
  return one_of(mt, {"musicgen_decoder", "musicgen_melody_decoder"});
}
/// TrOCR's decoder learns its positions unless use_learned_position_embeddings is false (TrOCRDecoder),
/// and then takes fairseq's table.
inline bool trocr_sinusoidal(const json& c) {
  return model_type(c) == "trocr" && !get<bool>(c, {"use_learned_position_embeddings"}).value_or(true);
}

}  // namespace detail

/// What a sinusoidal table needs: the sinusoid and how many positions the model's table holds.
struct sinusoidal_spec {
  sinusoidal_config config{};
  /// The positions the model's table holds (Marian, Pegasus: max_position_embeddings; transformers fails
  /// beyond it); unset where the model computes any position (the fairseq family grows its table).
  std::optional<index_t> max_positions{};
};

/// Sinusoidal absolute positions, computed by the model rather than stored in its checkpoint. Width
/// d_model (hidden_size); the concat layout [sin | cos], PE added to the token embeddings after their
/// sqrt(d_model) scale (scale_embedding). By model_type:
///   marian, pegasus: MarianSinusoidalPositionalEmbedding._init_weight, base^(-2k/d) in NumPy float64
///     (sinusoid_angles::exact), row = position, max_position_embeddings rows. An odd d_model is an error
///     (the extra channel is a sin there, not posenc's zero).
///   m2m_100 (NLLB-200), nllb-moe, speech_to_text, fsmt, SeamlessM4T's text stacks, Kosmos-2's text model,
///     trocr with use_learned_position_embeddings false: fairseq's get_embedding, the t2t schedule in
///     float32 (sinusoid_angles::float32), row = position + pad_token_id + 1
///     (create_position_ids_from_input_ids; pad_token_id defaults to 1); the table grows.
///   xglm: the same table, row = position + 2 (XGLMSinusoidalPositionalEmbedding adds its offset to the
///     position ids whatever the pad token).
///   pegasus_x: the same schedule in the activations' dtype (float32 for a float model), row = position.
///   musicgen, musicgen_melody (read from their `decoder`): the same float32 table with cos before sin
///     (MusicgenSinusoidalPositionalEmbedding: torch.cat([cos, sin]); sinusoid_layout::concat_cos_sin),
///     row = position, added to the summed codebook embeddings.
/// The fairseq family gives pad tokens its zeroed padding row; posenc gives them their position's row, which
/// only padded (masked) tokens see.
[[nodiscard]] inline sinusoidal_spec sinusoidal_spec_from_hf(const nlohmann::json& top) {
  using detail::get;
  require(top.is_object(), "config", "must be a JSON object");
  const detail::json& cfg = detail::text_part(top);
  const std::string mt = detail::model_type(cfg);
  sinusoidal_spec s;
  s.config.d_model = detail::need<index_t>(cfg, detail::hidden_keys, "sinusoidal positions");
  require(s.config.d_model > 0, "d_model", "must be > 0", s.config.d_model);
  s.config.layout = sinusoid_layout::concat;
  if (detail::marian_sinusoid(mt)) {
    require(s.config.d_model % 2 == 0, "d_model",
            "must be even for a Marian-style table (an odd one puts an extra sin channel where posenc puts a zero)",
            s.config.d_model);
    s.config.schedule = frequency_schedule::vaswani;
    s.max_positions = detail::need<index_t>(cfg, {"max_position_embeddings"}, "sinusoidal positions");
    require(*s.max_positions > 0, "max_position_embeddings", "must be > 0", *s.max_positions);
    return s;
  }
  require(detail::fairseq_sinusoid(mt) || detail::musicgen_sinusoid(mt) || mt == "trocr", "model_type",
          "has no sinusoidal positions posenc reads", mt.empty() ? "(none)" : mt);
  s.config.schedule = frequency_schedule::t2t;
  s.config.angles = sinusoid_angles::float32;
  if (detail::musicgen_sinusoid(mt)) {
    s.config.layout = sinusoid_layout::concat_cos_sin;  // position_ids = arange(seq_len) + past length
  } else if (mt == "xglm") {
    s.config.offset = 2;
  } else if (mt != "pegasus_x") {
    const auto pad = get<index_t>(cfg, {"pad_token_id"}).value_or(1);
    require(pad >= 0 && pad < (index_t{1} << 30), "pad_token_id", "must be in [0, 2^30)", pad);
    s.config.offset = pad + 1;
  }
  return s;
}

/// A t5_relative_bias viewing the checkpoint's relative_attention_bias weight [num_buckets, heads].
template <class W>
[[nodiscard]] t5_relative_bias<W> t5_from_hf(const nlohmann::json& cfg, tensor_map<const W, 2> weight,
                                             std::optional<bool> decoder = std::nullopt) {
  const t5_config t = t5_config_from_hf(cfg, decoder);
  require(weight.dimension(0) == t.num_buckets, "weight", "rows must equal relative_attention_num_buckets",
          weight.dimension(0), " vs ", t.num_buckets);
  if (auto h = detail::get<index_t>(cfg, {"num_heads"}); h)
    require(weight.dimension(1) == *h, "weight", "columns must equal num_heads", weight.dimension(1), " vs ", *h);
  return t5_relative_bias<W>(weight, t);
}

// ---- the attention of a decoder (or an encoder) ----------------------------------------------------

/// What a host needs from config.json besides the positional encoding to run a model's attention.
struct model_attention_config {
  std::string model_type;
  index_t num_attention_heads = 0;
  index_t num_key_value_heads = 0;  ///< = num_attention_heads when the config has none (MHA)
  index_t head_dim = 0;             ///< of q and k: head_dim, else hidden_size / num_attention_heads
  index_t value_head_dim = 0;       ///< of v: = head_dim, except DeepSeek's MLA (v_head_dim)
  index_t num_hidden_layers = 0;    ///< of the stack read; 0 when the config does not say
  /// Whether the stack's self-attention is causal: a decoder's; not an encoder's (an encoder-decoder
  /// model's encoder, or an encoder-only model such as BERT unless its config sets is_decoder).
  bool causal = true;
  /// The sliding window W (0 = none): a query at p sees keys p - W + 1 .. p (HF's sliding-window
  /// mask; attention_options::sliding_window).
  index_t sliding_window = 0;
  /// Per layer, whether it uses the window (Gemma 2/3, Cohere2, gpt-oss, Qwen2 alternate sliding and
  /// full layers); empty = every layer does when sliding_window > 0 (Mistral).
  std::vector<bool> sliding_layers{};
  /// Per layer, whether it rotates its queries and keys with the model's RoPE: false for a NoPE layer
  /// (Cohere2's full-attention layers, SmolLM3's no_rope_layers); empty = every layer does.
  std::vector<bool> rope_layers{};
  /// Gemma 2's attn_logit_softcapping (0 = none): attention_options::logit_softcap.
  double attn_logit_softcapping = 0.0;
  /// Gemma's query_pre_attn_scalar: the logit scale is query_pre_attn_scalar^-1/2, not head_dim^-1/2.
  std::optional<double> query_pre_attn_scalar{};
  /// The logit scale where the model's attention sets it outright: Granite's attention_multiplier
  /// (GraniteAttention.scaling, 1 by default); Gemma 3n's 1 (Gemma3nTextAttention.scaling: its q and k
  /// are RMS-normed instead); 1 for GPT-Neo (GPTNeoSelfAttention._attn does not scale) and for GPT-2 /
  /// GPTBigCode with scale_attn_weights false; Falcon-H1's key_multiplier x head_dim^-1/2
  /// (FalconH1Attention multiplies the keys by it: pass k_proj's keys unscaled); MPT's
  /// attn_config.softmax_scale when set (MptAttention).
  std::optional<double> logit_scale{};
  /// GPT-2's scale_attn_by_inverse_layer_idx: layer l's logits are divided by l + 1 as well
  /// (GPT2Attention._attn); options(layer) applies it.
  bool scale_by_inverse_layer = false;
  /// Ministral 3's query temperature (the rope block's llama_4_scaling_beta, 0 = none, over periods of
  /// its original_max_position_embeddings): the host multiplies the query of position p by
  /// query_scale(p) before the call (Ministral3Attention, after RoPE). No logit scale of a call can
  /// do it: it grows with each query's position. 1 below the first period.
  double query_scale_beta = 0.0;
  std::int64_t query_scale_period = 0;
  /// DeepSeek-V2/V3 with YaRN and mscale_all_dim: the logit scale is head_dim^-1/2 times this
  /// (yarn_get_mscale(factor, mscale_all_dim)^2, DeepseekV3Attention.scaling); 1 otherwise.
  double scale_factor = 1.0;
  /// Whether the attention has per-head sinks (gpt-oss: the `sinks` weight of each layer, [heads],
  /// passed as attention_options::sinks).
  bool has_sinks = false;
  /// Per layer, head_dim of q, k and v where layers differ (Gemma 4's full-attention layers: global_head_dim);
  /// empty = head_dim in every layer (layer_head_dim).
  std::vector<index_t> head_dims{};
  /// Per layer, the kv heads where layers differ (Gemma 4's full-attention layers with attention_k_eq_v:
  /// num_global_key_value_heads); empty = num_key_value_heads in every layer (layer_kv_heads).
  std::vector<index_t> kv_heads{};
  /// Per layer, whether its values are its keys' projection (Gemma 4's attention_k_eq_v, full-attention
  /// layers: V = v_norm(k_proj(x)), taken before k_norm and RoPE; the checkpoint has no v_proj there);
  /// empty = none. The call still takes k and v as two tensors.
  std::vector<bool> values_from_keys{};
  /// Per layer, the layer whose keys and values it attends to; empty = every layer its own. Gemma 3n's
  /// and Gemma 4's last num_kv_shared_layers layers compute none: each reads the cache of the last
  /// earlier layer of its own type (kv_layer).
  std::vector<index_t> kv_layers{};

  /// 1 + query_scale_beta ln(1 + floor(position / query_scale_period)); 1 without a query temperature.
  [[nodiscard]] double query_scale(std::int64_t position) const {
    if (query_scale_beta == 0.0) return 1.0;
    require(position >= 0, "position", "must be >= 0", position);
    require(query_scale_period > 0, "query_scale_period", "must be > 0 with a query_scale_beta", query_scale_period);
    return 1.0 + query_scale_beta *
                     std::log1p(std::floor(static_cast<double>(position) / static_cast<double>(query_scale_period)));
  }
  /// The window of layer `layer` (0 for a full-attention layer).
  [[nodiscard]] index_t layer_window(index_t layer) const {
    check_layer(layer);
    if (sliding_window == 0) return 0;
    if (sliding_layers.empty()) return sliding_window;
    return sliding_layers[static_cast<std::size_t>(layer)] ? sliding_window : 0;
  }
  /// head_dim of layer `layer`'s q, k and v (a host sizes that layer's cache by it).
  [[nodiscard]] index_t layer_head_dim(index_t layer) const {
    check_layer(layer);
    return head_dims.empty() ? head_dim : head_dims[static_cast<std::size_t>(layer)];
  }
  /// The kv heads of layer `layer`.
  [[nodiscard]] index_t layer_kv_heads(index_t layer) const {
    check_layer(layer);
    return kv_heads.empty() ? num_key_value_heads : kv_heads[static_cast<std::size_t>(layer)];
  }
  /// Whether layer `layer`'s values are its keys' projection (values_from_keys).
  [[nodiscard]] bool layer_values_from_keys(index_t layer) const {
    check_layer(layer);
    return !values_from_keys.empty() && values_from_keys[static_cast<std::size_t>(layer)];
  }
  /// The layer whose K/V cache layer `layer` attends to: itself, or for a layer that shares another's
  /// keys and values (kv_layers) that layer. A host appends keys and values only for layers with
  /// kv_layer(l) == l, and passes layer kv_layer(l)'s cache as k and v of layer l's call.
  [[nodiscard]] index_t kv_layer(index_t layer) const {
    check_layer(layer);
    return kv_layers.empty() ? layer : kv_layers[static_cast<std::size_t>(layer)];
  }
  /// Whether layer `layer` rotates its queries and keys (rope_config_from_hf(cfg, layer)); a NoPE
  /// layer runs the kernel with posenc::no_position{}.
  [[nodiscard]] bool layer_rotates(index_t layer) const {
    check_layer(layer);
    return rope_layers.empty() || rope_layers[static_cast<std::size_t>(layer)];
  }
  /// The logit scale the model uses, when it is not the encoding's (Gemma: query_pre_attn_scalar^-1/2;
  /// Granite and Gemma 3n: logit_scale).
  [[nodiscard]] std::optional<double> scale() const {
    if (logit_scale) return *logit_scale;
    if (query_pre_attn_scalar) return 1.0 / std::sqrt(*query_pre_attn_scalar);
    if (scale_factor != 1.0) return scale_factor / std::sqrt(static_cast<double>(head_dim));
    return std::nullopt;
  }
  /// attention_options of a layer of the stack: causal (a decoder), window, softcap, scale (sinks, masks,
  /// positions and the pool are the host's). An encoder-decoder model's cross-attention takes the decoder's
  /// heads and scale, not causal, with the encoder's output as keys and values.
  [[nodiscard]] attention_options options(index_t layer) const {
    attention_options o;
    o.causal = causal;
    o.sliding_window = layer_window(layer);
    o.logit_softcap = attn_logit_softcapping;
    o.scale = scale();
    if (scale_by_inverse_layer)
      o.scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim))) / static_cast<double>(layer + 1);
    return o;
  }

 private:
  void check_layer(index_t layer) const {
    require(layer >= 0 && (num_hidden_layers == 0 || layer < num_hidden_layers), "layer",
            "must be in [0, num_hidden_layers)", layer, " for ", num_hidden_layers, " layers");
  }
};

namespace detail {

/// DeepSeek's multi-head latent attention, once its keys and values are expanded per head: q and k of
/// qk_nope_head_dim + qk_rope_head_dim (the rope part last), v of v_head_dim, and with YaRN the logit
/// scale times yarn_get_mscale(factor, mscale_all_dim)^2 (DeepseekV3Attention.__init__; transformers'
/// DeepseekV3Config also writes head_dim = qk_rope_head_dim, which is the rotary part, not the head).
inline void read_mla_heads(const json& cfg, model_attention_config& a) {
  const auto nope = need<index_t>(cfg, {"qk_nope_head_dim"}, "DeepSeek attention");
  const auto rope = need<index_t>(cfg, {"qk_rope_head_dim"}, "DeepSeek attention");
  require(nope >= 0 && rope > 0 && nope <= std::numeric_limits<index_t>::max() - rope, "qk_rope_head_dim",
          "must be > 0, with qk_nope_head_dim >= 0 and their sum an index", rope, ", ", nope);
  a.head_dim = nope + rope;
  a.value_head_dim = get<index_t>(cfg, {"v_head_dim"}).value_or(a.head_dim);
  require(a.value_head_dim > 0, "v_head_dim", "must be > 0", a.value_head_dim);
  const json* block = rope_block(cfg, "full_attention");
  if (block == nullptr) return;
  const double m_all = get<double>(*block, {"mscale_all_dim"}).value_or(0.0);
  if (m_all == 0.0) return;
  const double factor = need<double>(*block, {"factor"}, "DeepSeek attention with mscale_all_dim");
  require(std::isfinite(m_all) && std::isfinite(factor) && factor > 0.0, "rope_scaling.factor",
          "must be finite and > 0 (with a finite mscale_all_dim)", factor, ", ", m_all);
  const double m = factor <= 1.0 ? 1.0 : 0.1 * m_all * std::log(factor) + 1.0;  // yarn_get_mscale
  a.scale_factor = m * m;
  require(std::isfinite(a.scale_factor) && a.scale_factor > 0.0, "rope_scaling.mscale_all_dim",
          "must give a finite, non-zero logit scale", m_all, " with factor ", factor);
}

/// rule(i) for each layer of `a`, whose num_hidden_layers must then be known (`which`: the layers the
/// list tells, for the error), as a list of T (whether each layer is one of them, by default).
template <class T = bool, class Rule>
[[nodiscard]] std::vector<T> per_layer(const model_attention_config& a, std::string_view which, Rule rule) {
  require(a.num_hidden_layers > 0, "num_hidden_layers",
          posenc::detail::concat("is needed to tell the ", which, " layers of model_type ", a.model_type));
  std::vector<T> v(static_cast<std::size_t>(a.num_hidden_layers));
  for (index_t i = 0; i < a.num_hidden_layers; ++i) v[static_cast<std::size_t>(i)] = rule(i);
  return v;
}

/// A per-layer list of `n` entries (`key`) gives the layer count: it must match num_hidden_layers when the
/// config has one, and sets it otherwise.
inline void take_layer_count(model_attention_config& a, std::size_t n, std::string_view key) {
  require(a.num_hidden_layers == 0 || static_cast<index_t>(n) == a.num_hidden_layers, key,
          "must have an entry per layer (num_hidden_layers)", n, " for ", a.num_hidden_layers);
  a.num_hidden_layers = static_cast<index_t>(n);
}

/// GPT-Neo's local layers (GPTNeoSelfAttention: a query at i sees keys i - window_size < j <= i, the
/// window of attention_options::sliding_window): attention_layers, one "global" or "local" per layer,
/// else attention_types expanded as GPTNeoConfig.expand_attention_types_params does ([[pattern, n]]:
/// the pattern n times; default [[["global", "local"], 12]]); window_size defaults to 256.
inline void read_gpt_neo_windows(const json& cfg, model_attention_config& a) {
  a.sliding_window = get<index_t>(cfg, {"window_size"}).value_or(256);
  require(a.sliding_window > 0, "window_size", "must be > 0", a.sliding_window);
  std::vector<std::string> kinds;
  if (const json* layers = find_key(cfg, {"attention_layers"}); layers) {
    require(layers->is_array(), "attention_layers", "must be a list of \"global\" / \"local\"", layers->dump());
    for (const auto& k : *layers) kinds.push_back(as<std::string>(k, "attention_layers"));
  } else {
    static const json fallback = json::parse(R"([[["global", "local"], 12]])");
    const json* types = find_key(cfg, {"attention_types"});
    for (const auto& item : types ? *types : fallback) {
      require(item.is_array() && item.size() == 2 && item[0].is_array(), "attention_types",
              "entries must be [[kinds...], repeats]", item.dump());
      const auto n = as<index_t>(item[1], "attention_types");
      require(n >= 0 && n <= 1'000'000, "attention_types", "repeats must be in [0, 1000000]", n);
      for (index_t r = 0; r < n; ++r)
        for (const auto& k : item[0]) kinds.push_back(as<std::string>(k, "attention_types"));
    }
  }
  take_layer_count(a, kinds.size(), "attention_layers");
  for (const std::string& k : kinds) {
    require(one_of(k, {"global", "local"}), "attention_layers", "entries must be global or local", k);
    a.sliding_layers.push_back(k == "local");
  }
}

/// The sliding window and its layers (attention_config_from_hf). `use_sliding_window` false turns the
/// window off (Qwen2 / Qwen3 and SmolLM3 default to false: their sliding_window is unused without it).
/// Which layers slide: layer_types when present; else Gemma 2 the even layers (Gemma2DecoderLayer);
/// Qwen2 / Qwen3 the layers from max_window_layers on (default 28, Qwen2Config.layer_types; the MoE models
/// need layer_types, their rule changed between transformers versions); Hunyuan none (its window key is
/// unused); a model with a sliding_window_pattern P all but every P-th layer, (i + 1) % P != 0
/// (Gemma3DecoderLayer, Cohere2Attention, Olmo3Config; P defaults to 6 for Gemma 3 and 4, 4 for Cohere2,
/// OLMo 3 and EXAONE 4.0; read_gemma4_geometry makes Gemma 4's last layer full); GPT-Neo its local layers
/// (read_gpt_neo_windows); every other model every layer (Mistral).
inline void read_window_layers(const json& cfg, model_attention_config& a) {
  const std::string& mt = a.model_type;
  if (mt == "gpt_neo") return read_gpt_neo_windows(cfg, a);
  // Llama 4's local layers attend within fixed chunks of attention_chunk_size tokens, not a window
  // sliding with the query: no attention_options does that.
  require(find_key(cfg, {"attention_chunk_size"}) == nullptr, "attention_chunk_size",
          "chunked attention (Llama 4) is not supported");
  // absent: the class default (MistralConfig's 4096); null: no window
  const bool window_key = cfg.contains("sliding_window") || cfg.contains("sliding_window_size");
  a.sliding_window = window_key ? get<index_t>(cfg, {"sliding_window", "sliding_window_size"}).value_or(0)
                                : class_default<index_t>(cfg, &class_defaults::sliding_window, 0);
  require(a.sliding_window >= 0, "sliding_window", "must be >= 0 or null", a.sliding_window);
  const bool qwen = one_of(mt, {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"});
  if (!get<bool>(cfg, {"use_sliding_window"}).value_or(!(qwen || mt == "smollm3"))) a.sliding_window = 0;
  // Hunyuan's configs accept a sliding_window that its attention and masks never read
  // (HunYuanMoEV1Model builds only a causal mask).
  if (one_of(mt, {"hunyuan_v1_dense", "hunyuan_v1_moe"})) a.sliding_window = 0;
  if (const json* types = find_key(cfg, {"layer_types"}); types) {
    require(types->is_array(), "layer_types", "must be an array", types->dump());
    take_layer_count(a, types->size(), "layer_types");
    for (const auto& t : *types) {
      // Besides the two attention kinds: GraniteMoeHybrid's "attention" (full) and the blocks of hybrid
      // models that are not attention at all (Qwen3-Next's and MiniMax's linear_attention, GraniteMoeHybrid's
      // mamba, LFM2's conv), which have no window. Any other kind may mask in a way posenc does not
      // (Llama 4's chunked_attention): an error, not a full layer.
      const std::string kind = as<std::string>(t, "layer_types");
      require(one_of(kind, {"sliding_attention", "full_attention", "attention", "linear_attention", "mamba", "conv"}),
              "layer_types",
              "entries must be sliding_attention or full_attention (or a block that is not attention: "
              "linear_attention, mamba, conv)",
              kind);
      a.sliding_layers.push_back(kind == "sliding_attention");
    }
    return;
  }
  if (a.sliding_window == 0) return;
  // SmolLM3Config slides only its NoPE layers when it derives layer_types itself; its configs carry them.
  require(mt != "smollm3", "layer_types", "are needed to tell the sliding layers of model_type smollm3");
  // Qwen2-MoE and Qwen3-MoE with use_sliding_window: transformers 4.4x slid the layers from max_window_layers
  // on; later Qwen2MoeConfig slides the even layers below it and Qwen3MoeAttention every layer. The
  // published configs keep the window off; one that turns it on must say which layers slide.
  require(!one_of(mt, {"qwen2_moe", "qwen3_moe"}), "layer_types",
          posenc::detail::concat("are needed to tell the sliding layers of model_type ", mt,
                                 " with use_sliding_window (transformers' rule changed between versions)"));
  std::optional<index_t> pattern = get<index_t>(cfg, {"sliding_window_pattern"});
  if (!pattern && one_of(mt, {"gemma3", "gemma3_text", "gemma4_text"})) pattern = 6;
  if (!pattern && one_of(mt, {"cohere2", "olmo3", "exaone4"})) pattern = 4;
  if (mt != "gemma2" && !qwen && !pattern) return;  // every layer
  if (pattern) require(*pattern > 0, "sliding_window_pattern", "must be > 0", *pattern);
  const index_t first_window_layer = qwen ? get<index_t>(cfg, {"max_window_layers"}).value_or(28) : 0;
  a.sliding_layers = per_layer(a, "sliding", [&](index_t i) {
    if (mt == "gemma2") return i % 2 == 0;
    if (qwen) return i >= first_window_layer;
    return (i + 1) % *pattern != 0;
  });
}

/// Gemma 4's two head shapes (attention_config_from_hf, after read_window_layers; Gemma4TextAttention): a
/// full-attention layer has global_head_dim (default 512) wide heads, and with attention_k_eq_v
/// num_global_key_value_heads kv heads (default num_key_value_heads) whose values are the keys' projection.
/// The sliding layers keep head_dim and num_key_value_heads; the last layer is always full. A bidirectional text stack
/// (use_bidirectional_attention "all": a symmetric window of sliding_window / 2 + 1) is refused; "vision"
/// makes only an image's own tokens see each other, text stays causal.
inline void read_gemma4_geometry(const json& cfg, model_attention_config& a) {
  if (a.model_type != "gemma4_text") return;
  const auto bidirectional = get<std::string>(cfg, {"use_bidirectional_attention"});
  require(bidirectional.value_or("") != "all", "use_bidirectional_attention",
          "all (Gemma 4's bidirectional text attention) is not supported: posenc's window is causal", "all");
  // Gemma4TextConfig.__post_init__ forces the last layer to full_attention (with a warning), whether
  // layer_types listed it or its default pattern made it
  if (!a.sliding_layers.empty()) a.sliding_layers.back() = false;
  const index_t global_head_dim = gemma4_global_head_dim(cfg);
  const bool k_eq_v = get<bool>(cfg, {"attention_k_eq_v"}).value_or(false);
  const index_t global_kv = k_eq_v ? get<index_t>(cfg, {"num_global_key_value_heads"}).value_or(a.num_key_value_heads)
                                   : a.num_key_value_heads;
  require(global_kv > 0 && a.num_attention_heads % global_kv == 0, "num_global_key_value_heads",
          "must be > 0 and divide num_attention_heads", global_kv, " for ", a.num_attention_heads);
  const auto full = [&](index_t l) {
    return a.sliding_layers.empty() || !a.sliding_layers[static_cast<std::size_t>(l)];
  };
  a.head_dims =
      per_layer<index_t>(a, "full-attention", [&](index_t l) { return full(l) ? global_head_dim : a.head_dim; });
  a.kv_heads =
      per_layer<index_t>(a, "full-attention", [&](index_t l) { return full(l) ? global_kv : a.num_key_value_heads; });
  if (k_eq_v) a.values_from_keys = per_layer(a, "full-attention", full);
}

/// The layers that share another layer's keys and values (attention_config_from_hf, after
/// read_window_layers): num_kv_shared_layers S > 0 (Gemma 3n, Gemma 4). With F = num_hidden_layers - S > 0,
/// layer l >= F reads the cache of the last layer j < F whose layer_types entry is l's
/// (Gemma3nTextAttention.kv_shared_layer_index, and Gemma 4's copy); the published configs list the types.
inline void read_kv_sharing(const json& cfg, model_attention_config& a) {
  const index_t shared = get<index_t>(cfg, {"num_kv_shared_layers"}).value_or(0);
  if (shared == 0) return;
  const index_t L = a.num_hidden_layers;
  require(shared > 0 && shared < L, "num_kv_shared_layers", "must be in [0, num_hidden_layers)", shared, " for ", L,
          " layers");
  const json* types = find_key(cfg, {"layer_types"});
  require(types != nullptr && types->is_array() && types->size() == static_cast<std::size_t>(L), "layer_types",
          "must list every layer's type to tell which layers share keys and values (num_kv_shared_layers)");
  std::vector<std::string> kinds;
  for (const json& t : *types) kinds.push_back(as<std::string>(t, "layer_types"));
  const index_t first = L - shared;
  std::map<std::string, index_t, std::less<>> last_of_kind;  // before F
  for (index_t j = 0; j < first; ++j) last_of_kind[kinds[static_cast<std::size_t>(j)]] = j;
  a.kv_layers.resize(static_cast<std::size_t>(L));
  for (index_t l = 0; l < L; ++l) {
    index_t source = l;
    if (l >= first) {
      const auto it = last_of_kind.find(kinds[static_cast<std::size_t>(l)]);
      require(it != last_of_kind.end(), "num_kv_shared_layers",
              posenc::detail::concat("leaves layer ", l, " (", kinds[static_cast<std::size_t>(l)],
                                     ") no earlier layer of its type to share keys and values with"));
      source = it->second;
    }
    a.kv_layers[static_cast<std::size_t>(l)] = source;
  }
}

/// The layers that rotate (attention_config_from_hf, after read_window_layers). no_rope_layers (SmolLM3,
/// Llama 4: 1 = RoPE, 0 = NoPE, an entry per layer at least); without it (None, or Llama 4's empty
/// list) SmolLM3 and Llama 4 skip RoPE in every no_rope_layer_interval-th layer (default 4),
/// (i + 1) % interval == 0 (SmolLM3Config, Llama4TextConfig). Cohere2 rotates only in its sliding
/// layers (Cohere2Attention applies RoPE where the layer's sliding_window is set): none rotates when
/// sliding_window is null. EXAONE 4.0 likewise once it has a window (Exaone4Attention: "global NoPE
/// for hybrid attention"), every layer without one. GraniteMoeHybrid rotates only with position_embedding_type "rope"
/// (granite_hybrid_without_rope).
inline void read_rope_layers(const json& cfg, model_attention_config& a) {
  const std::string& mt = a.model_type;
  const index_t L = a.num_hidden_layers;
  const json* list = find_key(cfg, {"no_rope_layers"});
  const bool by_interval = one_of(mt, {"smollm3", "llama4", "llama4_text"});
  const bool default_list = by_interval && list && list->is_array() && list->empty();  // Llama 4's []
  if (list && !default_list) {
    require(list->is_array(), "no_rope_layers", "must be a list of 0 / 1 per layer", list->dump().substr(0, 80));
    require(L > 0 && static_cast<index_t>(list->size()) >= L, "no_rope_layers",
            "must have an entry per layer (num_hidden_layers)", list->size(), " for ", L);
    a.rope_layers = per_layer(
        a, "NoPE", [&](index_t i) { return as<index_t>((*list)[static_cast<std::size_t>(i)], "no_rope_layers") != 0; });
  } else if (by_interval) {
    const index_t interval = get<index_t>(cfg, {"no_rope_layer_interval"}).value_or(4);
    require(interval > 0, "no_rope_layer_interval", "must be > 0", interval);
    a.rope_layers = per_layer(a, "NoPE", [&](index_t i) { return (i + 1) % interval != 0; });
  } else if (mt == "cohere2" || (mt == "exaone4" && a.sliding_window > 0)) {
    a.rope_layers = per_layer(a, "rotating", [&](index_t i) { return a.layer_window(i) > 0; });
  } else if (granite_hybrid_without_rope(cfg)) {
    a.rope_layers = per_layer(a, "rotating", [](index_t) { return false; });
  }
}

/// The logit scale where a model sets its own (attention_config_from_hf, after the head sizes): Granite's
/// attention_multiplier (GraniteAttention.scaling, default 1); 1 for Gemma 3n (Gemma3nTextAttention: q and k
/// are RMS-normed), GPT-Neo (GPTNeoSelfAttention._attn does not scale) and GPT-2 / GPTBigCode with
/// scale_attn_weights false; GPT-2's scale_attn_by_inverse_layer_idx; MPT's attn_config.softmax_scale when
/// set (MptAttention); Falcon-H1's key_multiplier x head_dim^-1/2 (FalconH1Attention scales the keys).
inline void read_logit_scale(const json& cfg, model_attention_config& a) {
  const std::string& mt = a.model_type;
  if (one_of(mt, {"granite", "granitemoe", "granitemoeshared", "granitemoehybrid"})) {
    a.logit_scale = get<double>(cfg, {"attention_multiplier"}).value_or(1.0);
    require(*a.logit_scale > 0.0 && std::isfinite(*a.logit_scale), "attention_multiplier", "must be finite and > 0",
            *a.logit_scale);
  }
  if (one_of(mt, {"gemma3n", "gemma3n_text", "gemma4_text", "gpt_neo"})) a.logit_scale = 1.0;
  if (one_of(mt, {"gpt2", "gpt_bigcode"}) && !get<bool>(cfg, {"scale_attn_weights"}).value_or(true))
    a.logit_scale = 1.0;
  a.scale_by_inverse_layer = mt == "gpt2" && get<bool>(cfg, {"scale_attn_by_inverse_layer_idx"}).value_or(false);
  if (const json* attn = find_key(cfg, {"attn_config"}); mt == "mpt" && attn && attn->is_object())
    if (auto s = get<double>(*attn, {"softmax_scale"}); s) {
      require(*s > 0.0 && std::isfinite(*s), "attn_config.softmax_scale", "must be finite and > 0, or null", *s);
      a.logit_scale = *s;
    }
  if (mt == "falcon_h1") {
    const double m = get<double>(cfg, {"key_multiplier"}).value_or(1.0);
    require(m > 0.0 && std::isfinite(m), "key_multiplier", "must be finite and > 0", m);
    a.logit_scale = m / std::sqrt(static_cast<double>(a.head_dim));
  }
}

/// Ministral 3's query temperature: the rope block's llama_4_scaling_beta over periods of its
/// original_max_position_embeddings (Ministral3Attention; model_attention_config::query_scale).
inline void read_query_scale(const json& cfg, model_attention_config& a) {
  const json* block = rope_block(cfg, "full_attention");
  if (block == nullptr) return;
  const auto beta = get<double>(*block, {"llama_4_scaling_beta"});
  if (!beta || *beta == 0.0) return;
  a.query_scale_period = need<std::int64_t>(*block, {"original_max_position_embeddings"}, "llama_4_scaling_beta");
  require(std::isfinite(*beta) && a.query_scale_period > 0, "llama_4_scaling_beta",
          "must be finite, with original_max_position_embeddings > 0", *beta, ", ", a.query_scale_period);
  a.query_scale_beta = *beta;
}

/// Encoder-decoder models: transformers' attribute_map points their num_attention_heads and
/// num_hidden_layers at the encoder (BartConfig, MarianConfig, M2M100Config, WhisperConfig, ...), and the
/// decoder has keys of its own; the T5 family shares num_heads and has num_decoder_layers. Also any config
/// that says is_encoder_decoder.
inline bool is_encoder_decoder(const json& cfg) {
  if (get<bool>(cfg, {"is_encoder_decoder"}).value_or(false)) return true;
  return one_of(model_type(cfg),
                {"bart", "mbart", "plbart", "mvp", "marian", "pegasus", "pegasus_x", "m2m_100", "nllb-moe",
                 "blenderbot", "blenderbot-small", "fsmt", "whisper", "speech_to_text", "led", "bigbird_pegasus",
                 "seamless_m4t", "seamless_m4t_v2", "moonshine", "t5", "mt5", "umt5", "longt5",
                 "switch_transformers"});
}

/// Encoder-only models: one bidirectional stack, causal only when the config sets is_decoder
/// (BertSelfAttention and its copies).
inline bool is_encoder_only(std::string_view mt) {
  return one_of(mt, {"bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "distilbert", "electra", "albert",
                     "deberta", "deberta-v2", "mpnet", "roformer", "ernie", "megatron-bert", "data2vec-text", "xmod",
                     "longformer", "modernbert"});
}

/// A stack other than the decoder exists only in encoder-decoder and encoder-only models (`mt`: the
/// model_type to name).
inline void require_stack(const json& cfg, const std::string& mt, attention_stack stack) {
  require(stack == attention_stack::decoder || is_encoder_decoder(cfg) || is_encoder_only(mt), "stack",
          posenc::detail::concat("must be decoder for model_type ", mt.empty() ? "(none)" : mt,
                                 ": it has no encoder (a decoder-only model)"));
}

/// Encoders that attend locally, which no posenc call reproduces (attention_options::sliding_window is a
/// causal window): LED and Longformer (attention_window, with global tokens), PEGASUS-X (global and local
/// blocks), LongT5 (local or transient-global), ModernBERT (a symmetric local_attention window in all
/// but every global_attn_every_n_layers-th layer), BigBird-Pegasus with attention_type block_sparse (its
/// default).
inline void refuse_local_encoder(const json& cfg) {
  const std::string mt = model_type(cfg);
  require(!one_of(mt, {"led", "longformer", "pegasus_x", "longt5", "modernbert"}), "model_type",
          posenc::detail::concat(mt, "'s encoder is not supported: it attends within local windows or blocks"));
  if (mt == "bigbird_pegasus")
    require(get<std::string>(cfg, {"attention_type"}).value_or("block_sparse") != "block_sparse", "attention_type",
            "block_sparse (BigBird's encoder attention) is not supported: only original_full", "block_sparse");
}

/// The heads, head_dim and layer count of a decoder-only or encoder-only model (attention_config_from_hf).
/// Falcon without new_decoder_architecture and with multi_query (its default) has one kv head
/// (FalconAttention), GPTBigCode (StarCoder) with multi_query (its default) too; DBRX reads its kv heads
/// from attn_config.kv_n_heads (default 1); DeepSeek-V2/V3's MLA heads are qk_nope_head_dim +
/// qk_rope_head_dim for q and k and v_head_dim for v.
inline void read_decoder_heads(const json& cfg, model_attention_config& a) {
  const std::string& mt = a.model_type;
  a.num_attention_heads = need<index_t>(cfg, heads_keys, "attention");
  require(a.num_attention_heads > 0, "num_attention_heads", "must be > 0", a.num_attention_heads);
  a.num_key_value_heads = get<index_t>(cfg, {"num_key_value_heads", "n_head_kv", "num_kv_heads"})
                              .value_or(class_default(cfg, &class_defaults::kv_heads, a.num_attention_heads));
  if (is_falcon(mt) && !get<bool>(cfg, {"new_decoder_architecture"}).value_or(false) &&
      get<bool>(cfg, {"multi_query"}).value_or(true))
    a.num_key_value_heads = 1;
  // GPTBigCodeAttention: kv_heads = 1 if multi_query (default true) else the query heads; StarCoder's
  // configs carry no num_key_value_heads
  if (mt == "gpt_bigcode")
    a.num_key_value_heads = get<bool>(cfg, {"multi_query"}).value_or(true) ? 1 : a.num_attention_heads;
  if (mt == "dbrx") a.num_key_value_heads = get<index_t>(dbrx_attention(cfg), {"kv_n_heads"}).value_or(1);
  a.head_dim = head_dim(cfg, "attention");
  if (one_of(mt, {"deepseek_v2", "deepseek_v3"})) read_mla_heads(cfg, a);
  a.num_hidden_layers = get<index_t>(cfg, {"num_hidden_layers", "n_layer", "num_layers", "n_layers"}).value_or(0);
}

/// The heads, head_dim and layer count of an encoder-decoder model's stack (attention_config_from_hf):
/// the stack's own keys (BartConfig's decoder_attention_heads / decoder_layers, T5's num_decoder_layers,
/// Moonshine's decoder_num_attention_heads), else the keys both stacks share (T5's num_heads, and
/// num_layers, which num_decoder_layers defaults to). Kv heads come only from the stack's
/// own key (Moonshine), else equal the heads: WhisperConfig's attribute_map makes num_key_value_heads the
/// encoder's head count. head_dim is d_kv / head_dim, else d_model / the stack's heads (BartAttention).
inline void read_stack_heads(const json& cfg, attention_stack stack, model_attention_config& a) {
  const bool dec = stack == attention_stack::decoder;
  const std::optional<index_t> own_heads = own_stack_heads(cfg, stack);
  a.num_attention_heads = own_heads ? *own_heads : need<index_t>(cfg, heads_keys, "attention");
  require(a.num_attention_heads > 0, dec ? "decoder_attention_heads" : "encoder_attention_heads", "must be > 0",
          a.num_attention_heads);
  a.num_key_value_heads =
      (dec ? get<index_t>(cfg, {"decoder_num_key_value_heads"}) : get<index_t>(cfg, {"encoder_num_key_value_heads"}))
          .value_or(a.num_attention_heads);
  a.head_dim = head_dim(cfg, "attention", a.num_attention_heads);
  const std::optional<index_t> own_layers =
      dec ? get<index_t>(cfg, {"decoder_layers", "num_decoder_layers", "decoder_num_hidden_layers"})
          : get<index_t>(cfg, {"encoder_layers", "encoder_num_hidden_layers"});
  a.num_hidden_layers = own_layers ? *own_layers : get<index_t>(cfg, {"num_layers", "num_hidden_layers"}).value_or(0);
}

}  // namespace detail

/// Reads model_attention_config of one stack from a config.json (a multimodal config's `text_config` when
/// the top level has no num_attention_heads: Gemma 3). An encoder-decoder model (detail::is_encoder_decoder)
/// gives its decoder's self-attention by default and its encoder's with attention_stack::encoder
/// (detail::read_stack_heads); a decoder-only or encoder-only model its one stack (detail::read_decoder_heads),
/// and asking a decoder-only model for its encoder is an error. An encoder that attends locally is refused
/// (detail::refuse_local_encoder), as are JetMoE, Zamba2, Doge, DiffLlama and (XLM-)ProphetNet
/// (detail::refuse_unsupported_attention), and models whose logits take relative terms this struct does not
/// describe (DeBERTa, MPNet, BERT's relative_key, MVP's prompts: detail::refuse_relative_attention). Which
/// layers slide: detail::read_window_layers (layer_types, transformers >= 4.53, when present; else each
/// model's rule); which rotate: detail::read_rope_layers; the logit scale: detail::read_logit_scale.
[[nodiscard]] inline model_attention_config attention_config_from_hf(const nlohmann::json& top,
                                                                     attention_stack stack = attention_stack::decoder) {
  using detail::get;
  require(top.is_object(), "config", "must be a JSON object");
  const detail::json& cfg = detail::text_part(top);

  model_attention_config a;
  a.model_type = detail::model_type(cfg);
  if (a.model_type.empty()) a.model_type = detail::model_type(top);
  const std::string mt = a.model_type;
  detail::refuse_unsupported_attention(cfg);
  detail::refuse_relative_attention(cfg);
  const bool encoder_decoder = detail::is_encoder_decoder(cfg), encoder_only = detail::is_encoder_only(mt);
  detail::require_stack(cfg, mt, stack);
  a.causal = encoder_decoder ? stack == attention_stack::decoder
                             : !encoder_only || get<bool>(cfg, {"is_decoder"}).value_or(false);
  if (!a.causal || encoder_only) detail::refuse_local_encoder(cfg);
  // a decoder-only model with a decoder's keys (TrOCR, Speech2Text2) reads them as a decoder stack
  if (encoder_decoder || detail::find_key(cfg, {"decoder_attention_heads"}) != nullptr)
    detail::read_stack_heads(cfg, stack, a);
  else
    detail::read_decoder_heads(cfg, a);
  require(a.num_key_value_heads > 0 && a.num_attention_heads % a.num_key_value_heads == 0, "num_key_value_heads",
          "must be > 0 and divide num_attention_heads", a.num_key_value_heads, " for ", a.num_attention_heads);
  require(a.head_dim > 0, "head_dim", "must be > 0", a.head_dim);
  if (a.value_head_dim == 0) a.value_head_dim = a.head_dim;
  // bounded: the per-layer list below has one entry per layer (the largest published model has under 200)
  require(a.num_hidden_layers >= 0 && a.num_hidden_layers <= 1'000'000, "num_hidden_layers", "must be in [0, 1000000]",
          a.num_hidden_layers);

  if (a.causal) detail::read_window_layers(cfg, a);
  detail::read_gemma4_geometry(cfg, a);
  detail::read_kv_sharing(cfg, a);
  detail::read_rope_layers(cfg, a);

  a.attn_logit_softcapping = get<double>(cfg, {"attn_logit_softcapping"}).value_or(0.0);
  require(std::isfinite(a.attn_logit_softcapping) && a.attn_logit_softcapping >= 0.0, "attn_logit_softcapping",
          "must be finite and >= 0, or null", a.attn_logit_softcapping);
  a.query_pre_attn_scalar = get<double>(cfg, {"query_pre_attn_scalar"});
  if (a.query_pre_attn_scalar)
    require(*a.query_pre_attn_scalar > 0.0 && std::isfinite(*a.query_pre_attn_scalar), "query_pre_attn_scalar",
            "must be finite and > 0", *a.query_pre_attn_scalar);
  detail::read_logit_scale(cfg, a);
  a.has_sinks = mt == "gpt_oss";
  detail::read_query_scale(cfg, a);
  return a;
}

/// The RoPE of one stack of an encoder-decoder model that rotates in both (Moonshine: each stack's
/// head_dim is hidden_size over its own heads); rope_config_from_hf(cfg) is the decoder's.
[[nodiscard]] inline rope_config rope_config_from_hf(const nlohmann::json& cfg, attention_stack stack) {
  require(cfg.is_object(), "config", "must be a JSON object");
  const detail::json& text = detail::text_part(cfg);
  detail::require_stack(text, detail::model_type(text), stack);
  return detail::rope_config_of(text, "full_attention", stack);
}

/// The RoPE of layer `layer`: rope_config_from_hf(cfg) for a full-attention layer; for a sliding one
/// (attention_config_from_hf(cfg).layer_window(layer) > 0) the rope block's sliding_attention entry
/// when it is keyed by layer type (transformers v5), else Gemma 3's rope_local_base_freq without
/// scaling (Gemma3TextModel.rotary_emb_local); every other model rotates all its layers alike. A NoPE
/// layer (model_attention_config::layer_rotates false) is an error: it has no RoPE to build.
[[nodiscard]] inline rope_config rope_config_from_hf(const nlohmann::json& cfg, index_t layer) {
  const model_attention_config a = attention_config_from_hf(cfg);
  require(a.layer_rotates(layer), "layer",
          "does not rotate its queries and keys (a NoPE layer, model_attention_config::layer_rotates): run it with "
          "posenc::no_position",
          layer, " of model_type ", a.model_type);
  return detail::rope_config_of(detail::text_part(cfg),
                                a.layer_window(layer) > 0 ? "sliding_attention" : "full_attention");
}

// ---- family dispatch -----------------------------------------------------------------------------

/// Which family a config uses, with that family's config.
struct hf_encoding {
  std::string family;  ///< "rope", "alibi", "t5", "sinusoidal", "learned"
  std::string model_type;
  std::variant<rope_config, alibi_config, t5_config, learned_spec, sinusoidal_spec> config;
};

/// One row per family, tried in order: `matches` looks at model_type and keys, `read` builds it.
struct hf_family {
  std::string_view name;
  bool (*matches)(const nlohmann::json& cfg);
  hf_encoding (*read)(const nlohmann::json& cfg);
};

namespace detail {

inline bool is_t5(const json& c) {
  // MPNet has relative_attention_num_buckets too, but scales its logits and adds a learned table
  return one_of(model_type(c), {"t5", "mt5", "umt5", "longt5", "switch_transformers"}) ||
         (find_key(c, {"relative_attention_num_buckets"}) != nullptr && model_type(c) != "mpnet");
}
inline bool is_alibi(const json& c) {
  const std::string mt = model_type(c);
  if (mt == "bloom") return true;
  if (mt == "mpt") {  // HF MptAttentionConfig defaults alibi to true
    const json* a = find_key(c, {"attn_config"});
    return !(a && a->is_object()) || get<bool>(*a, {"alibi"}).value_or(true);
  }
  return get<bool>(c, {"alibi"}).value_or(false);  // Falcon / RefinedWeb: `alibi: true`
}
inline bool is_rope(const json& c) {
  return find_key(c, {"rope_theta", "rope_scaling", "rope_parameters", "rotary_emb_base", "rotary_pct",
                      "partial_rotary_factor", "rotary_dim", "qk_rope_head_dim"}) != nullptr ||
         one_of(model_type(c),
                {"llama",   "mistral",     "mixtral",     "qwen2",     "qwen2_moe",   "qwen3",     "qwen3_moe",
                 "phi",     "phi3",        "gemma",       "gemma2",    "gemma3_text", "gpt_neox",  "gptj",
                 "codegen", "falcon",      "gpt_oss",     "olmo",      "olmo2",       "stablelm",  "starcoder2",
                 "cohere",  "deepseek_v2", "deepseek_v3", "internlm2", "granite",     "persimmon", "dbrx",
                 "olmo3",   "olmoe",       "phimoe",      "nemotron",  "ministral",   "exaone4"});
}
inline bool is_sinusoidal(const json& c) {
  const std::string mt = model_type(c);
  return marian_sinusoid(mt) || fairseq_sinusoid(mt) || musicgen_sinusoid(mt) || trocr_sinusoidal(c);
}
inline bool is_learned(const json& c) {
  const std::string mt = model_type(c);
  if (mt == "mpt") return true;  // reached only when ALiBi is off: learned_pos_emb
  return one_of(mt, {"gpt2", "gpt_neo", "opt", "bart", "mbart", "plbart", "mvp", "blenderbot", "blenderbot-small",
                     "bigbird_pegasus", "bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "distilbert",
                     "electra", "longformer", "biogpt", "gpt_bigcode", "trocr", "whisper", "led"});
}

}  // namespace detail

/// The family table. Order matters: Falcon has rope keys in its config even when it uses ALiBi.
[[nodiscard]] inline std::span<const hf_family> hf_families() {
  static const hf_family table[] = {
      {"t5", detail::is_t5,
       [](const nlohmann::json& c) {
         return hf_encoding{"t5", detail::model_type(c), t5_config_from_hf(c)};
       }},
      {"alibi", detail::is_alibi,
       [](const nlohmann::json& c) {
         return hf_encoding{"alibi", detail::model_type(c), alibi_config_from_hf(c)};
       }},
      {"rope", detail::is_rope,
       [](const nlohmann::json& c) {
         return hf_encoding{"rope", detail::model_type(c), rope_config_from_hf(c)};
       }},
      {"sinusoidal", detail::is_sinusoidal,
       [](const nlohmann::json& c) {
         return hf_encoding{"sinusoidal", detail::model_type(c), sinusoidal_spec_from_hf(c)};
       }},
      {"learned", detail::is_learned,
       [](const nlohmann::json& c) {
         return hf_encoding{"learned", detail::model_type(c), learned_spec_from_hf(c)};
       }},
  };
  return table;
}

/// Detect the family of a config.json and read it; posenc::error when no family matches.
[[nodiscard]] inline hf_encoding encoding_from_hf(const nlohmann::json& top) {
  require(top.is_object(), "config", "must be a JSON object");
  const nlohmann::json& cfg = detail::text_part(top);  // Gemma 3's text_config
  for (const hf_family& f : hf_families())
    if (f.matches(cfg)) return f.read(cfg);
  std::string names;
  for (const hf_family& f : hf_families()) names += (names.empty() ? "" : ", ") + std::string(f.name);
  throw error("posenc: config: cannot tell the positional encoding of model_type '" + detail::model_type(cfg) +
              "' (families read: " + names + ")");
}

/// Same, reading the file first.
[[nodiscard]] inline hf_encoding encoding_from_hf_file(const std::filesystem::path& config_json) {
  return encoding_from_hf(read_json(config_json));
}

}  // namespace posenc::io
