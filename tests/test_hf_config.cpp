// Tests of posenc/io/hf_config.hpp on hand-written config.json files modelled on real checkpoints
// (tests/data/configs/). Every expected number is computed here from the published formula (HF
// modeling_rope_utils.py, Press et al. for ALiBi slopes), not taken from the library.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>

#include "posenc/io/hf_config.hpp"

namespace {

using nlohmann::json;

json config(const std::string& name) {
  return posenc::io::read_json(std::string(POSENC_TEST_DATA) + "/configs/" + name + ".json");
}

/// theta_i = base^(-2i/d), i < d/2.
std::vector<double> plain_inv_freq(double base, int d) {
  std::vector<double> f(static_cast<std::size_t>(d / 2));
  for (int i = 0; i < d / 2; ++i) f[static_cast<std::size_t>(i)] = std::pow(base, -2.0 * i / d);
  return f;
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, double rtol = 1e-13) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("i = " << i << ": " << got[i] << " vs " << want[i]);
    CHECK(std::abs(got[i] - want[i]) <= rtol * std::abs(want[i]));
  }
}

}  // namespace

TEST_CASE("hf_config: Llama-3.1 (llama3 scaling)", "[io][hf_config]") {
  const auto cfg = config("llama-3.1-8b");
  const posenc::rope_config rc = posenc::io::rope_config_from_hf(cfg);
  CHECK(rc.head_dim == 128);  // 4096 / 32
  CHECK(rc.rope_theta == 500000.0);
  CHECK(rc.layout == posenc::rope_layout::half);
  CHECK(rc.max_position_embeddings == 131072);
  CHECK(rc.scaling.rope_type == posenc::rope_type::llama3);
  CHECK(rc.scaling.original_max_position_embeddings == 8192);

  // Meta's apply_scaling: wavelength > 8192/1 -> /8, < 8192/4 -> unchanged, else smooth blend.
  auto want = plain_inv_freq(500000.0, 128);
  for (auto& f : want) {
    const double wl = 2 * std::numbers::pi / f;
    if (wl > 8192.0)
      f /= 8.0;
    else if (wl >= 2048.0) {
      const double s = (8192.0 / wl - 1.0) / (4.0 - 1.0);
      f = (1 - s) * f / 8.0 + s * f;
    }
  }
  const posenc::rope r(rc);
  check_close(r.inv_freq(), want);
  CHECK(r.attention_factor() == 1.0);

  const auto enc = posenc::io::encoding_from_hf(cfg);
  CHECK(enc.family == "rope");
  CHECK(enc.model_type == "llama");
  CHECK(std::get<posenc::rope_config>(enc.config).head_dim == 128);
}

TEST_CASE("hf_config: Qwen2 with YaRN (legacy `type` key)", "[io][hf_config]") {
  const auto cfg = config("qwen2-7b-instruct-yarn");
  const posenc::rope_config rc = posenc::io::rope_config_from_hf(cfg);
  CHECK(rc.head_dim == 128);  // 3584 / 28
  CHECK(rc.scaling.rope_type == posenc::rope_type::yarn);
  CHECK(rc.scaling.factor == 4.0);
  CHECK(rc.scaling.truncate);

  // YaRN (Peng et al. sec. 3.2): correction dims for 32 and 1 rotations over 32768 tokens, rounded out.
  const double d = 128, base = 1e6, orig = 32768;
  auto corr = [&](double n) { return d * std::log(orig / (2 * std::numbers::pi * n)) / (2 * std::log(base)); };
  const double low = std::max(std::floor(corr(32)), 0.0), high = std::min(std::ceil(corr(1)), d - 1);
  auto want = plain_inv_freq(base, 128);
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    want[i] = want[i] / 4.0 * ramp + want[i] * (1 - ramp);
  }
  const posenc::rope r(rc);
  check_close(r.inv_freq(), want);
  CHECK(r.attention_factor() == Approx(0.1 * std::log(4.0) + 1.0).epsilon(1e-15));
}

TEST_CASE("hf_config: gpt-oss (yarn, truncate false, explicit head_dim)", "[io][hf_config]") {
  const auto cfg = config("gpt-oss-20b");
  const posenc::rope_config rc = posenc::io::rope_config_from_hf(cfg);
  CHECK(rc.head_dim == 64);  // head_dim wins over 2880 / 64 = 45
  CHECK(rc.rope_theta == 150000.0);
  CHECK_FALSE(rc.scaling.truncate);
  CHECK(rc.scaling.beta_fast == 32.0);

  const double d = 64, base = 150000, orig = 4096;
  auto corr = [&](double n) { return d * std::log(orig / (2 * std::numbers::pi * n)) / (2 * std::log(base)); };
  const double low = std::max(corr(32), 0.0), high = std::min(corr(1), d - 1);  // not rounded
  CHECK(low != std::floor(low));
  auto want = plain_inv_freq(base, 64);
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    want[i] = want[i] / 32.0 * ramp + want[i] * (1 - ramp);
  }
  const posenc::rope r(rc);
  check_close(r.inv_freq(), want);
  CHECK(r.attention_factor() == Approx(0.1 * std::log(32.0) + 1.0).epsilon(1e-15));
}

TEST_CASE("hf_config: Phi-3 LongRoPE (top-level original_max_position_embeddings)", "[io][hf_config]") {
  const auto cfg = config("phi-3-mini-128k-instruct");
  const posenc::rope_config rc = posenc::io::rope_config_from_hf(cfg);
  CHECK(rc.head_dim == 96);
  CHECK(rc.scaling.rope_type == posenc::rope_type::longrope);
  CHECK(rc.scaling.original_max_position_embeddings == 4096);
  REQUIRE(rc.scaling.short_factor.size() == 48);
  REQUIRE(rc.scaling.long_factor.size() == 48);

  const posenc::rope r(rc);
  // Short factors up to the original context (inclusive), long ones beyond (FORMAT.md sec. 3).
  for (std::int64_t L : {std::int64_t{4096}, std::int64_t{4097}}) {
    std::vector<double> want(48);
    for (int i = 0; i < 48; ++i) {
      const double ext = L > 4096 ? 1.0 + 0.9 * i : 1.0 + 0.02 * i;
      want[static_cast<std::size_t>(i)] = 1.0 / (ext * std::pow(10000.0, 2.0 * i / 96));
    }
    INFO("L = " << L);
    check_close(r.inv_freq(L), want, 1e-12);
  }
  // factor = 131072 / 4096 = 32: sqrt(1 + ln 32 / ln 4096).
  CHECK(r.attention_factor() == Approx(std::sqrt(1 + std::log(32.0) / std::log(4096.0))).epsilon(1e-14));
}

TEST_CASE("hf_config: rope_parameters, partial rotary, GPT-J layout, unknown types", "[io][hf_config]") {
  const auto q3 = posenc::io::rope_config_from_hf(config("qwen3-rope-parameters"));
  CHECK(q3.rope_theta == 1e6);  // from inside rope_parameters
  CHECK(q3.head_dim == 128);
  CHECK(q3.scaling.rope_type == posenc::rope_type::default_);
  check_close(posenc::rope(q3).inv_freq(), plain_inv_freq(1e6, 128));

  // Phi-2: partial rotary 0.4 of 80 -> 32 rotated dims.
  const json phi2 = {{"model_type", "phi"},          {"hidden_size", 2560},   {"num_attention_heads", 32},
                     {"partial_rotary_factor", 0.4}, {"rope_theta", 10000.0}, {"max_position_embeddings", 2048}};
  const posenc::rope p2(posenc::io::rope_config_from_hf(phi2));
  CHECK(p2.head_dim() == 80);
  CHECK(p2.rotary_dim() == 32);
  check_close(p2.inv_freq(), plain_inv_freq(10000.0, 32));

  // GPT-J: explicit rotary_dim, rotate_every_two (interleaved) pairs, n_positions.
  const json gptj = {
      {"model_type", "gptj"}, {"n_embd", 4096}, {"n_head", 16}, {"rotary_dim", 64}, {"n_positions", 2048}};
  const auto gj = posenc::io::rope_config_from_hf(gptj);
  CHECK(gj.layout == posenc::rope_layout::interleaved);
  CHECK(gj.head_dim == 256);
  CHECK(gj.max_position_embeddings == 2048);
  CHECK(posenc::rope(gj).rotary_dim() == 64);

  // GPT-NeoX: rotary_pct and rotary_emb_base.
  const json neox = {{"model_type", "gpt_neox"},
                     {"hidden_size", 6144},
                     {"num_attention_heads", 64},
                     {"rotary_pct", 0.25},
                     {"rotary_emb_base", 10000}};
  CHECK(posenc::rope(posenc::io::rope_config_from_hf(neox)).rotary_dim() == 24);

  // Linear and dynamic: factor read as is.
  const json lin = {{"model_type", "llama"},
                    {"hidden_size", 4096},
                    {"num_attention_heads", 32},
                    {"rope_scaling", {{"type", "linear"}, {"factor", 8.0}}}};
  auto want = plain_inv_freq(10000.0, 128);
  for (auto& f : want) f /= 8.0;
  check_close(posenc::rope(posenc::io::rope_config_from_hf(lin)).inv_freq(), want);

  // Unknown type: the error lists the supported ones.
  const json bad = {{"model_type", "llama"},
                    {"hidden_size", 4096},
                    {"num_attention_heads", 32},
                    {"rope_scaling", {{"rope_type", "ntk-by-parts"}, {"factor", 2.0}}}};
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(bad),
                    Catch::Contains("ntk-by-parts") && Catch::Contains("default, linear, dynamic, yarn, longrope") &&
                        Catch::Contains("llama3"));
  // Missing dimensions name the keys.
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(json{{"model_type", "llama"}, {"rope_theta", 1e4}}),
                    Catch::Contains("hidden_size") && Catch::Contains("num_attention_heads"));
  // Wrong types name the key.
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(json{{"head_dim", "64"}}), Catch::Contains("head_dim"));
}

TEST_CASE("hf_config: ALiBi from BLOOM, Falcon and MPT", "[io][hf_config]") {
  // BLOOM-560m: 16 heads (a power of two): m_h = 2^(-8 (h+1) / 16).
  const auto bloom = posenc::io::alibi_config_from_hf(config("bloom-560m"));
  CHECK(bloom.heads == 16);
  CHECK(bloom.max_bias == 8.0);
  const posenc::alibi a(bloom);
  for (posenc::index_t h = 0; h < 16; ++h) CHECK(a.slope(h) == std::pow(2.0, -0.5 * static_cast<double>(h + 1)));
  CHECK(posenc::io::encoding_from_hf(config("bloom-560m")).family == "alibi");

  // Falcon-RW-1B: `alibi: true` wins over its rope keys; Falcon-7B (alibi false) is RoPE, 4544/71 = 64.
  const auto frw = posenc::io::encoding_from_hf(config("falcon-rw-1b"));
  CHECK(frw.family == "alibi");
  CHECK(std::get<posenc::alibi_config>(frw.config).heads == 32);
  const auto f7 = posenc::io::encoding_from_hf(config("falcon-7b"));
  CHECK(f7.family == "rope");
  CHECK(std::get<posenc::rope_config>(f7.config).head_dim == 64);

  // MPT-7B: n_heads, attn_config.alibi_bias_max.
  const auto mpt = posenc::io::encoding_from_hf(config("mpt-7b"));
  CHECK(mpt.family == "alibi");
  CHECK(std::get<posenc::alibi_config>(mpt.config).heads == 32);
  // A non-power-of-two head count with another alibi_bias_max: 12 heads, n = 8, max_bias 16:
  // h < 8: 2^(-16 (h+1) / 8); h >= 8: 2^(-8 (2 (h-8) + 1) / 8) (MPT's gen_slopes interleave).
  json m12 = config("mpt-7b");
  m12["n_heads"] = 12;
  m12["attn_config"]["alibi_bias_max"] = 16;
  const posenc::alibi a12(posenc::io::alibi_config_from_hf(m12));
  for (posenc::index_t h = 0; h < 12; ++h) {
    const double e = h < 8 ? -16.0 * static_cast<double>(h + 1) / 8 : -8.0 * static_cast<double>(2 * (h - 8) + 1) / 8;
    CHECK(a12.slope(h) == std::pow(2.0, e));
  }
  // MPT with ALiBi off falls back to its learned positions (max_seq_len x d_model).
  json mlearn = config("mpt-7b");
  mlearn["attn_config"]["alibi"] = false;
  const auto ml = posenc::io::encoding_from_hf(mlearn);
  CHECK(ml.family == "learned");
  CHECK(std::get<posenc::io::learned_spec>(ml.config).max_positions == 2048);
  CHECK(std::get<posenc::io::learned_spec>(ml.config).d_model == 4096);
}

TEST_CASE("hf_config: T5 buckets and the relative_attention_bias weight", "[io][hf_config]") {
  const auto cfg = config("t5-small");
  const auto enc = posenc::io::t5_config_from_hf(cfg);
  CHECK(enc.num_buckets == 32);
  CHECK(enc.max_distance == 128);
  CHECK_FALSE(enc.is_decoder);
  CHECK(posenc::io::t5_config_from_hf(cfg, true).is_decoder);
  CHECK(posenc::io::encoding_from_hf(cfg).family == "t5");

  Eigen::Tensor<float, 2, Eigen::RowMajor> w(32, 8);
  for (posenc::index_t b = 0; b < 32; ++b)
    for (posenc::index_t h = 0; h < 8; ++h) w(b, h) = static_cast<float>(100 * b + h);
  const auto t5 = posenc::io::t5_from_hf<float>(cfg, posenc::tensor_map<const float, 2>(w.data(), 32, 8));
  // Bidirectional T5 buckets by hand: r = +1 -> 16 + 1 = 17; r = -3 -> 3; r = +200 (beyond 128) -> 31.
  CHECK(t5.bias(2, 0, 1) == 1702.0f);
  CHECK(t5.bias(5, 3, 0) == 305.0f);
  CHECK(t5.bias(0, 0, 200) == 3100.0f);
  Eigen::Tensor<float, 2, Eigen::RowMajor> w7(32, 7);
  CHECK_THROWS_WITH(posenc::io::t5_from_hf<float>(cfg, posenc::tensor_map<const float, 2>(w7.data(), 32, 7)),
                    Catch::Contains("num_heads"));
}

TEST_CASE("hf_config: learned absolute positions (GPT-2, OPT)", "[io][hf_config]") {
  const auto g = posenc::io::learned_spec_from_hf(config("gpt2"));
  CHECK(g.max_positions == 1024);
  CHECK(g.d_model == 768);
  CHECK(g.options.offset == 0);
  CHECK(posenc::io::encoding_from_hf(config("gpt2")).family == "learned");

  // OPT: table of max_position_embeddings + 2 rows, position p at row p + 2.
  const auto o = posenc::io::learned_spec_from_hf(config("opt-125m"));
  CHECK(o.max_positions == 2050);
  CHECK(o.d_model == 768);
  CHECK(o.options.offset == 2);

  Eigen::Tensor<double, 2, Eigen::RowMajor> w(2050, 768);
  w.setZero();
  w(2, 5) = 1.5;  // position 0
  const auto pe =
      posenc::io::learned_from_hf<double>(config("opt-125m"), posenc::tensor_map<const double, 2>(w.data(), 2050, 768));
  Eigen::Tensor<double, 3, Eigen::RowMajor> x(1, 1, 768);
  x.setZero();
  const auto pos = posenc::contiguous_positions(1, 1);
  pe.add_to(posenc::tensor_map<double, 3>(x.data(), 1, 1, 768), posenc::view(pos));
  CHECK(x(0, 0, 5) == 1.5);
  CHECK_THROWS_WITH(
      posenc::io::learned_from_hf<double>(config("gpt2"), posenc::tensor_map<const double, 2>(w.data(), 2050, 768)),
      Catch::Contains("1024"));
}

TEST_CASE("hf_config: unknown families and unreadable files", "[io][hf_config]") {
  CHECK_THROWS_WITH(posenc::io::encoding_from_hf(json{{"model_type", "mamba"}, {"hidden_size", 768}}),
                    Catch::Contains("mamba") && Catch::Contains("rope") && Catch::Contains("alibi"));
  CHECK_THROWS_WITH(posenc::io::encoding_from_hf(json::array()), Catch::Contains("object"));
  CHECK_THROWS_WITH(posenc::io::read_json("/nonexistent/config.json"), Catch::Contains("cannot open"));
  CHECK(posenc::io::encoding_from_hf_file(std::string(POSENC_TEST_DATA) + "/configs/gpt-oss-20b.json").family ==
        "rope");
  // Every family of the table is listed by name.
  std::vector<std::string> names;
  for (const auto& f : posenc::io::hf_families()) names.emplace_back(f.name);
  CHECK(names == std::vector<std::string>{"t5", "alibi", "rope", "sinusoidal", "learned"});
}

// ---- attention_config_from_hf: small config.json literals modelled on the published checkpoints ----

TEST_CASE("hf_config: attention of Mistral-7B-v0.1 (sliding window on every layer) and v0.3 (null)", "[io][hf_config]") {
  const json v01 = json::parse(R"({
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32000})");
  const auto a = posenc::io::attention_config_from_hf(v01);
  CHECK(a.model_type == "mistral");
  CHECK(a.num_attention_heads == 32);
  CHECK(a.num_key_value_heads == 8);
  CHECK(a.head_dim == 128);  // 4096 / 32
  CHECK(a.num_hidden_layers == 32);
  CHECK(a.sliding_window == 4096);
  CHECK(a.sliding_layers.empty());
  for (posenc::index_t l : {0, 1, 31}) CHECK(a.layer_window(l) == 4096);
  CHECK(a.attn_logit_softcapping == 0.0);
  CHECK_FALSE(a.query_pre_attn_scalar);
  CHECK_FALSE(a.scale());
  CHECK_FALSE(a.has_sinks);
  const posenc::attention_options o = a.options(7);
  CHECK(o.causal);
  CHECK(o.sliding_window == 4096);
  CHECK(o.logit_softcap == 0.0);
  CHECK_FALSE(o.scale);
  CHECK_THROWS_WITH(a.layer_window(32), Catch::Contains("layer: must be in [0, num_hidden_layers)"));

  json v03 = v01;
  v03["sliding_window"] = nullptr;
  v03["vocab_size"] = 32768;
  v03["rope_theta"] = 1000000.0;
  const auto b = posenc::io::attention_config_from_hf(v03);
  CHECK(b.sliding_window == 0);
  CHECK(b.layer_window(5) == 0);
  CHECK(b.options(5).sliding_window == 0);
}

TEST_CASE("hf_config: attention of Gemma-2-9b (softcap 50, query_pre_attn_scalar, alternating windows)", "[io][hf_config]") {
  // google/gemma-2-9b config.json (transformers 4.42 era: no layer_types)
  const json g = json::parse(R"({
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid",
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
    "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_size": 4096,
    "vocab_size": 256000})");
  const auto a = posenc::io::attention_config_from_hf(g);
  CHECK(a.num_attention_heads == 16);
  CHECK(a.num_key_value_heads == 8);
  CHECK(a.head_dim == 256);  // explicit, not 3584 / 16 = 224
  CHECK(a.num_hidden_layers == 42);
  CHECK(a.sliding_window == 4096);
  REQUIRE(a.sliding_layers.size() == 42);
  // HF Gemma2DecoderLayer: is_sliding = not bool(layer_idx % 2)
  for (posenc::index_t l = 0; l < 42; ++l) CHECK(a.layer_window(l) == (l % 2 == 0 ? 4096 : 0));
  CHECK(a.attn_logit_softcapping == 50.0);
  REQUIRE(a.query_pre_attn_scalar);
  CHECK(*a.query_pre_attn_scalar == 256.0);
  CHECK(*a.scale() == 1.0 / 16.0);  // 256^-1/2
  CHECK_FALSE(a.has_sinks);
  const auto o = a.options(1);
  CHECK(o.sliding_window == 0);
  CHECK(o.logit_softcap == 50.0);
  CHECK(*o.scale == 1.0 / 16.0);

  // The same with transformers >= 4.53's layer_types, which wins over the model's rule.
  json with_types = g;
  with_types["num_hidden_layers"] = 4;
  with_types["layer_types"] = {"full_attention", "sliding_attention", "sliding_attention", "full_attention"};
  const auto t = posenc::io::attention_config_from_hf(with_types);
  CHECK(t.layer_window(0) == 0);
  CHECK(t.layer_window(1) == 4096);
  CHECK(t.layer_window(2) == 4096);
  CHECK(t.layer_window(3) == 0);
}

TEST_CASE("hf_config: attention of Gemma 3 (text_config, sliding_window_pattern 6)", "[io][hf_config]") {
  // google/gemma-3-4b-it: a multimodal config; the decoder's keys are in text_config.
  const json g = json::parse(R"({
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"head_dim": 256, "hidden_size": 2560, "model_type": "gemma3_text", "num_attention_heads": 8,
                    "num_hidden_layers": 34, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "attn_logit_softcapping": null, "final_logit_softcapping": null},
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "num_attention_heads": 16}})");
  const auto a = posenc::io::attention_config_from_hf(g);
  CHECK(a.model_type == "gemma3_text");
  CHECK(a.num_attention_heads == 8);
  CHECK(a.num_key_value_heads == 4);
  CHECK(a.head_dim == 256);
  CHECK(a.sliding_window == 1024);
  REQUIRE(a.sliding_layers.size() == 34);
  // HF Gemma3DecoderLayer: is_sliding = bool((layer_idx + 1) % sliding_window_pattern): 5, 11, ... full
  for (posenc::index_t l = 0; l < 34; ++l) CHECK(a.layer_window(l) == ((l + 1) % 6 == 0 ? 0 : 1024));
  CHECK(a.attn_logit_softcapping == 0.0);
  CHECK(*a.scale() == 1.0 / 16.0);
}

TEST_CASE("hf_config: attention of gpt-oss-20b (sinks, layer_types, window 128)", "[io][hf_config]") {
  json g = json::parse(R"({
    "architectures": ["GptOssForCausalLM"], "attention_bias": true, "head_dim": 64, "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
    "sliding_window": 128, "vocab_size": 201088})");
  std::vector<std::string> types;
  for (int l = 0; l < 24; ++l) types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
  g["layer_types"] = types;
  const auto a = posenc::io::attention_config_from_hf(g);
  CHECK(a.num_attention_heads == 64);
  CHECK(a.num_key_value_heads == 8);
  CHECK(a.head_dim == 64);  // explicit; 2880 / 64 = 45
  CHECK(a.has_sinks);
  CHECK(a.sliding_window == 128);
  for (posenc::index_t l = 0; l < 24; ++l) CHECK(a.layer_window(l) == (l % 2 == 0 ? 128 : 0));
  CHECK_FALSE(a.scale());
  CHECK(a.attn_logit_softcapping == 0.0);

  json bad = g;
  bad["layer_types"][3] = "chunked_attention";  // Llama 4's kind: not a window posenc implements
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(bad),
                    Catch::Contains("layer_types: entries must be sliding_attention or full_attention"));
  bad = g;
  bad["layer_types"].erase(0);
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(bad),
                    Catch::Contains("layer_types: must have an entry per layer (num_hidden_layers)"));
}

TEST_CASE("hf_config: attention of Llama-3.1-8B (no window) and Qwen2 (use_sliding_window)", "[io][hf_config]") {
  const auto a = posenc::io::attention_config_from_hf(config("llama-3.1-8b"));
  CHECK(a.num_attention_heads == 32);
  CHECK(a.num_key_value_heads == 8);
  CHECK(a.head_dim == 128);
  CHECK(a.sliding_window == 0);
  CHECK(a.layer_window(0) == 0);
  CHECK_FALSE(a.has_sinks);

  // Qwen2-7B: sliding_window is set but unused (use_sliding_window false).
  json q = json::parse(R"({"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
    "num_key_value_heads": 4, "num_hidden_layers": 28, "max_window_layers": 28, "sliding_window": 131072,
    "use_sliding_window": false, "rope_theta": 1000000.0})");
  const auto b = posenc::io::attention_config_from_hf(q);
  CHECK(b.head_dim == 128);
  CHECK(b.sliding_window == 0);
  CHECK(b.layer_window(27) == 0);
  // With use_sliding_window, layers >= max_window_layers slide (HF Qwen2Config's layer_types).
  q["use_sliding_window"] = true;
  q["sliding_window"] = 4096;
  q["max_window_layers"] = 20;
  const auto c = posenc::io::attention_config_from_hf(q);
  for (posenc::index_t l = 0; l < 28; ++l) CHECK(c.layer_window(l) == (l >= 20 ? 4096 : 0));
  // Qwen2-MoE / Qwen3-MoE: transformers 4.4x slid the layers from max_window_layers on, later versions the
  // even layers below it (Qwen2MoeConfig) or every layer (Qwen3MoeAttention): such a config must list them.
  for (const char* moe : {"qwen2_moe", "qwen3_moe"}) {
    INFO(moe);
    json m = q;
    m["model_type"] = moe;
    CHECK_THROWS_WITH(
        posenc::io::attention_config_from_hf(m),
        Catch::Contains("layer_types: are needed to tell the sliding layers of model_type") && Catch::Contains(moe));
    m["use_sliding_window"] = false;  // as published: no window
    CHECK(posenc::io::attention_config_from_hf(m).layer_window(27) == 0);
    m["use_sliding_window"] = true;
    std::vector<std::string> types(28, "full_attention");
    for (int l = 0; l < 20; l += 2) types[static_cast<std::size_t>(l)] = "sliding_attention";
    m["layer_types"] = types;
    const auto mt = posenc::io::attention_config_from_hf(m);
    for (posenc::index_t l = 0; l < 28; ++l) CHECK(mt.layer_window(l) == (l < 20 && l % 2 == 0 ? 4096 : 0));
  }
  // Hunyuan's configs take a sliding_window its attention never reads (HunYuanMoEV1Model: a causal mask).
  json hy = q;
  hy["model_type"] = "hunyuan_v1_moe";
  hy.erase("use_sliding_window");
  CHECK(posenc::io::attention_config_from_hf(hy).sliding_window == 0);
  CHECK(posenc::io::attention_config_from_hf(hy).layer_window(27) == 0);

  // MHA default and errors naming the key.
  const auto m = posenc::io::attention_config_from_hf(json::parse(R"({"num_attention_heads": 12, "hidden_size": 768})"));
  CHECK(m.num_key_value_heads == 12);
  CHECK(m.head_dim == 64);
  CHECK(m.num_hidden_layers == 0);
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(json::parse(R"({"hidden_size": 768})")),
                    Catch::Contains("num_attention_heads"));
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(
                        json::parse(R"({"num_attention_heads": 12, "num_key_value_heads": 5, "head_dim": 64})")),
                    Catch::Contains("num_key_value_heads: must be > 0 and divide num_attention_heads"));
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(
                        json::parse(R"({"num_attention_heads": 4, "head_dim": 64, "sliding_window": -1})")),
                    Catch::Contains("sliding_window: must be >= 0"));
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(
                        json::parse(R"({"num_attention_heads": 4, "head_dim": 64, "attn_logit_softcapping": -50})")),
                    Catch::Contains("attn_logit_softcapping"));
}

TEST_CASE("hf_config: head counts of Falcon (multi_query), BLOOM-176B (n_embed) and T5 (num_heads, d_kv)",
          "[io][hf_config]") {
  // FalconAttention: num_kv_heads = config.num_kv_heads if new_decoder_architecture or not multi_query,
  // else 1; FalconConfig defaults multi_query to true and num_kv_heads to the head count.
  const auto f7 = posenc::io::attention_config_from_hf(config("falcon-7b"));
  CHECK(f7.num_attention_heads == 71);
  CHECK(f7.num_key_value_heads == 1);
  CHECK(f7.head_dim == 64);
  json f = config("falcon-7b");
  f.erase("multi_query");
  CHECK(posenc::io::attention_config_from_hf(f).num_key_value_heads == 1);
  f["multi_query"] = false;
  CHECK(posenc::io::attention_config_from_hf(f).num_key_value_heads == 71);
  // Falcon-40B: the new decoder architecture with 8 kv heads (multi_query is then not read).
  const json f40 = json::parse(R"({"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128,
    "num_kv_heads": 8, "new_decoder_architecture": true, "multi_query": true, "num_hidden_layers": 60})");
  CHECK(posenc::io::attention_config_from_hf(f40).num_key_value_heads == 8);
  CHECK(posenc::io::attention_config_from_hf(config("falcon-rw-1b")).num_key_value_heads == 32);

  // BLOOM-176B writes n_embed (BloomConfig pops it into hidden_size): 14336 / 112 = 128.
  const json b = json::parse(R"({"model_type": "bloom", "n_embed": 14336, "n_head": 112, "n_layer": 70})");
  const auto ba = posenc::io::attention_config_from_hf(b);
  CHECK(ba.num_attention_heads == 112);
  CHECK(ba.head_dim == 128);
  CHECK(ba.num_hidden_layers == 70);

  // T5Config's attribute_map: num_attention_heads -> num_heads, head_dim is d_kv, num_hidden_layers -> num_layers.
  const auto t = posenc::io::attention_config_from_hf(config("t5-small"));
  CHECK(t.num_attention_heads == 8);
  CHECK(t.num_key_value_heads == 8);
  CHECK(t.head_dim == 64);
  CHECK(t.value_head_dim == 64);
  CHECK(t.num_hidden_layers == 6);
}

TEST_CASE("hf_config: DeepSeek-V3 (MLA head sizes, mscale^2 logit scale, interleaved rope part)", "[io][hf_config]") {
  // deepseek-ai/DeepSeek-V3's attention keys; transformers' DeepseekV3Config writes head_dim = qk_rope_head_dim.
  json d = json::parse(R"({"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
    "num_key_value_heads": 128, "num_hidden_layers": 61, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}})");
  const auto a = posenc::io::attention_config_from_hf(d);
  CHECK(a.head_dim == 192);
  CHECK(a.value_head_dim == 128);
  // DeepseekV3Attention: scaling = 192^-0.5 * yarn_get_mscale(40, 1.0)^2, yarn_get_mscale = 0.1 ln(40) + 1.
  const double m = 0.1 * std::log(40.0) + 1.0;
  REQUIRE(a.scale());
  CHECK(std::abs(*a.scale() - m * m / std::sqrt(192.0)) <= 1e-15);
  CHECK(std::abs(*a.options(0).scale - m * m / std::sqrt(192.0)) <= 1e-15);

  // The rotary part: 64 dims in adjacent pairs (apply_rotary_pos_emb_interleave), mscale / mscale_all_dim = 1.
  const posenc::rope_config rc = posenc::io::rope_config_from_hf(d);
  CHECK(rc.head_dim == 64);
  CHECK(rc.layout == posenc::rope_layout::interleaved);
  CHECK(posenc::rope(rc).attention_factor() == 1.0);
  d["rope_interleave"] = false;
  CHECK(posenc::io::rope_config_from_hf(d).layout == posenc::rope_layout::half);
  d["model_type"] = "deepseek_v2";  // DeepSeek-V2 rotates complex pairs of adjacent dims, always
  CHECK(posenc::io::rope_config_from_hf(d).layout == posenc::rope_layout::interleaved);

  // Without mscale_all_dim (or without scaling) the scale is the kernel's default, 192^-1/2.
  d["rope_scaling"].erase("mscale_all_dim");
  CHECK_FALSE(posenc::io::attention_config_from_hf(d).scale());
  d["rope_scaling"] = nullptr;
  CHECK_FALSE(posenc::io::attention_config_from_hf(d).scale());
  d["qk_nope_head_dim"] = INT64_MAX;  // the head size would overflow
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(d), Catch::Contains("qk_rope_head_dim: must be > 0"));
  d.erase("qk_nope_head_dim");
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(d), Catch::Contains("qk_nope_head_dim"));
  // one flag per layer is kept: a layer count no model has is refused instead of allocated
  const json huge = json::parse(R"({"model_type": "gemma2", "head_dim": 8, "num_attention_heads": 2,
    "num_hidden_layers": 1000000000000, "sliding_window": 4})");
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(huge),
                    Catch::Contains("num_hidden_layers: must be in [0, 1000000]"));
}

TEST_CASE("hf_config: Gemma 3's sliding layers rotate with rope_local_base_freq, unscaled", "[io][hf_config]") {
  // google/gemma-3-4b-it (transformers 4.5x): global RoPE theta 1e6 with linear 8, local theta 1e4
  // without scaling (Gemma3TextModel.rotary_emb_local); layers 5, 11, ... are the full ones.
  json g = json::parse(R"({
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"head_dim": 256, "hidden_size": 2560, "model_type": "gemma3_text", "num_attention_heads": 8,
                    "num_hidden_layers": 34, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "max_position_embeddings": 131072,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
                    "sliding_window_pattern": 6}})");
  auto global = plain_inv_freq(1e6, 256);
  for (auto& f : global) f /= 8.0;
  const auto local = plain_inv_freq(1e4, 256);
  const auto full = posenc::io::rope_config_from_hf(g);
  check_close(posenc::rope(full).inv_freq(), global);
  for (posenc::index_t l : {0, 4, 5, 6, 11, 33}) {
    INFO("layer " << l);
    const posenc::rope r(posenc::io::rope_config_from_hf(g, l));
    check_close(r.inv_freq(), (l + 1) % 6 == 0 ? global : local);
  }
  const auto enc = posenc::io::encoding_from_hf(g);  // the family from text_config
  CHECK(enc.family == "rope");
  check_close(posenc::rope(std::get<posenc::rope_config>(enc.config)).inv_freq(), global);

  // transformers v5 writes rope_parameters keyed by layer type.
  json v5 = g;
  auto& t = v5["text_config"];
  t.erase("rope_scaling");
  t.erase("rope_theta");
  t.erase("rope_local_base_freq");
  t["rope_parameters"] =
      json::parse(R"({"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})");
  check_close(posenc::rope(posenc::io::rope_config_from_hf(v5)).inv_freq(), global);
  check_close(posenc::rope(posenc::io::rope_config_from_hf(v5, 0)).inv_freq(), local);
  check_close(posenc::rope(posenc::io::rope_config_from_hf(v5, 5)).inv_freq(), global);
  t["rope_parameters"].erase("sliding_attention");
  CHECK_THROWS_WITH(
      posenc::io::rope_config_from_hf(v5, 0),
      Catch::Contains(
          "rope_parameters: is keyed by layer type and needs an object for the layer's type (got sliding_attention)"));
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(g, 34),
                    Catch::Contains("layer: must be in [0, num_hidden_layers)"));

  // Every other model rotates all its layers alike (Mistral: every layer slides).
  const json mistral = json::parse(R"({"model_type": "mistral", "head_dim": 128, "num_attention_heads": 32,
    "num_hidden_layers": 32, "rope_theta": 10000.0, "sliding_window": 4096})");
  check_close(posenc::rope(posenc::io::rope_config_from_hf(mistral, 3)).inv_freq(), plain_inv_freq(1e4, 128));
}

namespace {

/// HF's interleaved rotation of one head vector at position p (apply_rotary_pos_emb of modeling_cohere.py
/// and modeling_glm.py), written out in double over the first `rot` dims, the rest passed through: the
/// frequencies base^(-2i/rot) repeat_interleaved (emb[j] = p theta_{j/2}), rotate_half pairing x[2i] with
/// x[2i+1] (rot[2i] = -x[2i+1], rot[2i+1] = x[2i]), y = x cos + rot sin.
std::vector<double> hf_interleaved_rotate(const std::vector<double>& x, double p, double base, int rot) {
  const auto inv = plain_inv_freq(base, rot);
  std::vector<double> y = x;
  for (int j = 0; j < rot; ++j) {
    const double emb = p * inv[static_cast<std::size_t>(j / 2)];
    const double r = j % 2 == 0 ? -x[static_cast<std::size_t>(j + 1)] : x[static_cast<std::size_t>(j - 1)];
    y[static_cast<std::size_t>(j)] = x[static_cast<std::size_t>(j)] * std::cos(emb) + r * std::sin(emb);
  }
  return y;
}

/// rope_config `r` applied to one head vector at a few positions, against hf_interleaved_rotate.
void check_interleaved_rotation(const posenc::rope_config& r, double base, int rot) {
  CHECK(r.layout == posenc::rope_layout::interleaved);
  const posenc::rope rope(r);
  const auto d = static_cast<posenc::index_t>(r.head_dim);
  std::vector<double> x(static_cast<std::size_t>(d));
  for (std::size_t j = 0; j < x.size(); ++j) x[j] = std::sin(0.37 * static_cast<double>(j) + 0.1);
  for (std::int64_t p : {1, 17, 1234, 131000}) {
    INFO("position " << p);
    std::vector<double> y = x;
    rope.apply(posenc::bshd(y.data(), 1, 1, 1, d), posenc::positions_view(&p, 1, 1));
    const auto want = hf_interleaved_rotate(x, static_cast<double>(p), base, rot);
    // the angle's rounding grows with it (ulp of 131000 rad: 1.5e-11); a wrong pairing is off by O(1)
    const double tol = 1e-14 * static_cast<double>(p + 1);
    for (std::size_t j = 0; j < y.size(); ++j) CHECK(std::abs(y[j] - want[j]) <= tol);
  }
}

}  // namespace

TEST_CASE("hf_config: Cohere, Cohere2 and GLM rotate adjacent pairs; Cohere2's full layers are NoPE, every 4th",
          "[io][hf_config]") {
  // CohereForAI/c4ai-command-r7b-12-2024 (transformers 4.48: sliding_window_pattern, no layer_types).
  json c2 = json::parse(R"({"architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "hidden_size": 4096,
    "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
    "max_position_embeddings": 132096, "rope_theta": 50000, "rope_scaling": null, "sliding_window": 4096,
    "sliding_window_pattern": 4, "logit_scale": 0.25, "cache_implementation": "hybrid"})");
  check_interleaved_rotation(posenc::io::rope_config_from_hf(c2), 50000.0, 128);

  // Cohere2Attention: sliding_window where (layer_idx + 1) % sliding_window_pattern != 0, and RoPE only there.
  const auto check_layers = [](const posenc::io::model_attention_config& a) {
    REQUIRE(a.num_hidden_layers == 32);
    for (posenc::index_t l = 0; l < 32; ++l) {
      INFO("layer " << l);
      const bool sliding = (l + 1) % 4 != 0;
      CHECK(a.layer_window(l) == (sliding ? 4096 : 0));
      CHECK(a.layer_rotates(l) == sliding);
    }
  };
  check_layers(posenc::io::attention_config_from_hf(c2));
  json no_pattern = c2;  // Cohere2Config's default pattern is 4
  no_pattern.erase("sliding_window_pattern");
  check_layers(posenc::io::attention_config_from_hf(no_pattern));
  json typed = no_pattern;  // transformers >= 4.53 writes layer_types instead
  std::vector<std::string> types;
  for (int l = 0; l < 32; ++l) types.push_back((l + 1) % 4 != 0 ? "sliding_attention" : "full_attention");
  typed["layer_types"] = types;
  check_layers(posenc::io::attention_config_from_hf(typed));
  CHECK(posenc::io::rope_config_from_hf(c2, 2).layout == posenc::rope_layout::interleaved);
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(c2, 3),
                    Catch::Contains("layer: does not rotate its queries and keys (a NoPE layer") &&
                        Catch::Contains("(got 3 of model_type cohere2)"));
  json no_count = c2;  // the pattern needs the layer count
  no_count.erase("num_hidden_layers");
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(no_count),
                    Catch::Contains("num_hidden_layers: is needed to tell the sliding layers of model_type cohere2"));
  no_count["sliding_window"] = nullptr;  // no window: the rotating layers need it all the same
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(no_count),
                    Catch::Contains("num_hidden_layers: is needed to tell the rotating layers of model_type cohere2"));
  json no_window = c2;  // Cohere2Attention rotates only where a window is set: with none, no layer does
  no_window["sliding_window"] = nullptr;
  const auto nw = posenc::io::attention_config_from_hf(no_window);
  CHECK(nw.layer_window(0) == 0);
  CHECK_FALSE(nw.layer_rotates(0));

  // Command R (cohere): the same pairs, every layer rotates, no window.
  const json c1 = json::parse(R"({"model_type": "cohere", "hidden_size": 8192, "num_attention_heads": 64,
    "num_key_value_heads": 64, "num_hidden_layers": 40, "rope_theta": 8000000.0, "use_qk_norm": false})");
  CHECK(posenc::io::rope_config_from_hf(c1).layout == posenc::rope_layout::interleaved);
  CHECK(posenc::io::encoding_from_hf(c1).family == "rope");
  const auto a1 = posenc::io::attention_config_from_hf(c1);
  CHECK(a1.layer_rotates(39));
  CHECK(a1.layer_window(39) == 0);

  // GLM-4 (THUDM/glm-4-9b-hf): the same pairs over the first half of each head, the rest unrotated.
  json glm = json::parse(R"({"model_type": "glm", "hidden_size": 4096, "head_dim": 128, "num_attention_heads": 32,
    "num_key_value_heads": 2, "num_hidden_layers": 40, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
    "max_position_embeddings": 131072})");
  check_interleaved_rotation(posenc::io::rope_config_from_hf(glm), 10000.0, 64);
  for (const char* mt : {"glm4", "helium", "ernie4_5", "ernie4_5_moe"}) {
    INFO(mt);
    glm["model_type"] = mt;
    CHECK(posenc::io::rope_config_from_hf(glm).layout == posenc::rope_layout::interleaved);
  }
  glm["model_type"] = "glm4_moe";  // GLM-4.5: Llama's rotate_half on the rotary part
  CHECK(posenc::io::rope_config_from_hf(glm).layout == posenc::rope_layout::half);
}

TEST_CASE("hf_config: NoPE layers (SmolLM3, Llama 4), Qwen2's max_window_layers, Qwen3-Next's linear blocks",
          "[io][hf_config]") {
  // HuggingFaceTB/SmolLM3-3B: no_rope_layers, 1 = RoPE; layer_types all full; use_sliding_window false.
  json s = json::parse(R"({"model_type": "smollm3", "hidden_size": 2048, "num_attention_heads": 16,
    "num_key_value_heads": 4, "num_hidden_layers": 36, "rope_theta": 5000000.0, "max_position_embeddings": 65536,
    "use_sliding_window": false, "sliding_window": null, "no_rope_layer_interval": 4})");
  std::vector<int> list;
  for (int l = 0; l < 36; ++l) list.push_back(l % 4 == 3 ? 0 : 1);
  list[5] = 0;  // a list that no interval rule gives: read as written
  s["no_rope_layers"] = list;
  s["layer_types"] = std::vector<std::string>(36, "full_attention");
  const auto a = posenc::io::attention_config_from_hf(s);
  for (posenc::index_t l = 0; l < 36; ++l) {
    INFO("layer " << l);
    CHECK(a.layer_rotates(l) == (list[static_cast<std::size_t>(l)] == 1));
    CHECK(a.layer_window(l) == 0);
  }
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(s, 5), Catch::Contains("a NoPE layer"));
  CHECK(posenc::io::rope_config_from_hf(s, 4).rope_theta == 5e6);
  // Without the list, SmolLM3Config's default: every no_rope_layer_interval-th layer is NoPE.
  json by_interval = s;
  by_interval.erase("no_rope_layers");
  by_interval["no_rope_layer_interval"] = 3;
  const auto b = posenc::io::attention_config_from_hf(by_interval);
  for (posenc::index_t l = 0; l < 36; ++l) CHECK(b.layer_rotates(l) == ((l + 1) % 3 != 0));
  by_interval.erase("num_hidden_layers");
  by_interval.erase("layer_types");
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(by_interval),
                    Catch::Contains("num_hidden_layers: is needed to tell the NoPE layers of model_type smollm3"));
  // use_sliding_window false keeps a configured window off (no layer_types to say otherwise).
  json off = s;
  off.erase("layer_types");
  off["sliding_window"] = 4096;
  CHECK(posenc::io::attention_config_from_hf(off).layer_window(0) == 0);
  off["use_sliding_window"] = true;  // SmolLM3Config would then slide the NoPE layers: ask for layer_types
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(off),
                    Catch::Contains("layer_types: are needed to tell the sliding layers of model_type smollm3"));
  off["layer_types"] = std::vector<std::string>(36, "sliding_attention");
  CHECK(posenc::io::attention_config_from_hf(off).layer_window(0) == 4096);
  json short_list = s;
  short_list["no_rope_layers"] = std::vector<int>(35, 1);
  CHECK_THROWS_WITH(
      posenc::io::attention_config_from_hf(short_list),
      Catch::Contains("no_rope_layers: must have an entry per layer (num_hidden_layers) (got 35 for 36)"));

  // Qwen2Config's max_window_layers defaults to 28.
  const json q = json::parse(R"({"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
    "num_key_value_heads": 4, "num_hidden_layers": 32, "sliding_window": 4096, "use_sliding_window": true})");
  const auto qa = posenc::io::attention_config_from_hf(q);
  for (posenc::index_t l = 0; l < 32; ++l) CHECK(qa.layer_window(l) == (l >= 28 ? 4096 : 0));

  // Qwen/Qwen3-Next-80B-A3B: linear-attention blocks between the full-attention layers.
  json next = json::parse(R"({"model_type": "qwen3_next", "hidden_size": 2048, "head_dim": 256,
    "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 4, "partial_rotary_factor": 0.25,
    "rope_theta": 10000000, "layer_types": ["linear_attention", "linear_attention", "linear_attention",
    "full_attention"]})");
  const auto nx = posenc::io::attention_config_from_hf(next);
  CHECK(nx.layer_window(3) == 0);
  CHECK(nx.layer_rotates(3));
  CHECK(posenc::rope(posenc::io::rope_config_from_hf(next, 3)).rotary_dim() == 64);

  // Llama 4 (text_config of meta-llama/Llama-4-Scout-17B-16E): complex pairs of adjacent dims
  // (apply_rotary_emb's view_as_complex), and chunked local attention, which posenc has no option for.
  const json l4 = json::parse(R"({"model_type": "llama4", "text_config": {"model_type": "llama4_text",
    "hidden_size": 5120, "head_dim": 128, "num_attention_heads": 40, "num_key_value_heads": 8,
    "num_hidden_layers": 48, "rope_theta": 500000.0, "attention_chunk_size": 8192, "no_rope_layers": [],
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}})");
  CHECK(posenc::io::rope_config_from_hf(l4).layout == posenc::rope_layout::interleaved);
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(l4),
                    Catch::Contains("attention_chunk_size: chunked attention (Llama 4) is not supported"));
  json l4_unchunked = l4;  // Llama4TextConfig's empty no_rope_layers: every 4th layer is NoPE
  l4_unchunked["text_config"].erase("attention_chunk_size");
  const auto la = posenc::io::attention_config_from_hf(l4_unchunked);
  for (posenc::index_t l = 0; l < 48; ++l) CHECK(la.layer_rotates(l) == ((l + 1) % 4 != 0));
}

TEST_CASE("hf_config: logit scales set outright (Granite's attention_multiplier, Gemma 3n); Granite 4.0-H is NoPE",
          "[io][hf_config]") {
  // ibm-granite/granite-3.1-8b-instruct: GraniteAttention.scaling = attention_multiplier (1/128, where
  // head_dim^-1/2 would be 1/11.3).
  json g = json::parse(R"({"model_type": "granite", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 40, "rope_theta": 10000000.0, "attention_multiplier": 0.0078125,
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 16.0})");
  const auto a = posenc::io::attention_config_from_hf(g);
  REQUIRE(a.scale());
  CHECK(*a.scale() == 0.0078125);
  CHECK(*a.options(0).scale == 0.0078125);
  CHECK(a.layer_rotates(39));
  g.erase("attention_multiplier");  // GraniteConfig's default is 1, not head_dim^-1/2
  CHECK(*posenc::io::attention_config_from_hf(g).scale() == 1.0);
  g["attention_multiplier"] = -1.0;
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(g),
                    Catch::Contains("attention_multiplier: must be finite and > 0"));

  // ibm-granite/granite-4.0-h-tiny: layer_types name mamba and attention blocks (no window), and
  // position_embedding_type "nope": no layer rotates (GraniteMoeHybridModel.rotary_emb is None).
  json h = json::parse(R"({"model_type": "granitemoehybrid", "hidden_size": 1536, "num_attention_heads": 12,
    "num_key_value_heads": 4, "num_hidden_layers": 8, "attention_multiplier": 0.0078125,
    "position_embedding_type": "nope", "rope_theta": 10000,
    "layer_types": ["mamba", "mamba", "mamba", "attention", "mamba", "mamba", "mamba", "attention"]})");
  const auto b = posenc::io::attention_config_from_hf(h);
  CHECK(*b.scale() == 0.0078125);
  for (posenc::index_t l = 0; l < 8; ++l) {
    CHECK_FALSE(b.layer_rotates(l));
    CHECK(b.layer_window(l) == 0);
  }
  // It carries rope_theta all the same: the RoPE readers refuse it rather than return one.
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(h),
                    Catch::Contains("position_embedding_type: is not rope: the model rotates no layer"));
  CHECK_THROWS_WITH(posenc::io::encoding_from_hf(h), Catch::Contains("position_embedding_type: is not rope"));
  h["position_embedding_type"] = "rope";
  CHECK(posenc::io::attention_config_from_hf(h).layer_rotates(3));
  CHECK(posenc::io::encoding_from_hf(h).family == "rope");

  // google/gemma-3n-E4B: Gemma3nTextAttention.scaling is 1 (q and k are RMS-normed), whatever a
  // query_pre_attn_scalar in the config says.
  const json n = json::parse(R"({"model_type": "gemma3n", "text_config": {"model_type": "gemma3n_text",
    "hidden_size": 2048, "head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
    "num_hidden_layers": 35, "query_pre_attn_scalar": 256, "sliding_window": 512, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0}})");
  CHECK(*posenc::io::attention_config_from_hf(n).scale() == 1.0);
  CHECK(posenc::io::attention_config_from_hf(n).kv_layer(34) == 34);  // no num_kv_shared_layers: its own

  // Its last num_kv_shared_layers = 15 layers compute no keys or values: from F = 35 - 15 = 20 on, each reads
  // the cache of the last layer before 20 of its own type (Gemma3nTextAttention.kv_shared_layer_index).
  // Every 5th layer is full: 19 serves the full layers 24, 29, 34, 18 the sliding ones.
  json shared = n;
  std::vector<std::string> types;
  for (int l = 0; l < 35; ++l) types.push_back((l + 1) % 5 == 0 ? "full_attention" : "sliding_attention");
  shared["text_config"]["layer_types"] = types;
  shared["text_config"]["num_kv_shared_layers"] = 15;
  const auto sa = posenc::io::attention_config_from_hf(shared);
  for (posenc::index_t l = 0; l < 35; ++l) {
    INFO("layer " << l);
    const bool full = (l + 1) % 5 == 0;
    CHECK(sa.kv_layer(l) == (l < 20 ? l : full ? 19 : 18));
    CHECK(sa.layer_window(l) == (full ? 0 : 512));
  }
  shared["text_config"]["num_kv_shared_layers"] = 35;
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(shared),
                    Catch::Contains("num_kv_shared_layers: must be in [0, num_hidden_layers)"));
  shared["text_config"]["num_kv_shared_layers"] = 31;  // layers 0-3 are all sliding: a full layer has no source
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(shared),
                    Catch::Contains("leaves layer 4 (full_attention) no earlier layer of its type"));
  shared["text_config"]["num_kv_shared_layers"] = 15;
  shared["text_config"].erase("layer_types");
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(shared),
                    Catch::Contains("layer_types: must list every layer's type"));
}

TEST_CASE("hf_config: Gemma 4's two head shapes, p-RoPE on its full layers, shared and key-derived values",
          "[io][hf_config]") {
  // google/gemma-4-e2b-it's text part (convert_gemma4_weights' variant table and Gemma4TextConfig's defaults):
  // 35 layers, every 5th full; sliding layers 1 kv head of 256, full layers 1 of global_head_dim 512;
  // the last 20 layers share the keys and values of layers 13 (sliding) and 14 (full); logits unscaled
  // (q and k are RMS-normed: Gemma4TextAttention.scaling = 1).
  std::vector<std::string> types;
  for (int l = 0; l < 35; ++l) types.push_back((l + 1) % 5 == 0 ? "full_attention" : "sliding_attention");
  json e2b = json::parse(R"({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text",
    "hidden_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
    "global_head_dim": 512, "num_hidden_layers": 35, "num_kv_shared_layers": 20, "sliding_window": 512,
    "attention_k_eq_v": false, "max_position_embeddings": 131072, "final_logit_softcapping": 30.0,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
      "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}}})");
  e2b["text_config"]["layer_types"] = types;
  const auto a = posenc::io::attention_config_from_hf(e2b);
  CHECK(a.model_type == "gemma4_text");
  CHECK(*a.scale() == 1.0);
  for (posenc::index_t l = 0; l < 35; ++l) {
    INFO("layer " << l);
    const bool full = (l + 1) % 5 == 0;
    CHECK(a.layer_head_dim(l) == (full ? 512 : 256));
    CHECK(a.layer_kv_heads(l) == 1);
    CHECK_FALSE(a.layer_values_from_keys(l));
    CHECK(a.layer_window(l) == (full ? 0 : 512));
    CHECK(a.kv_layer(l) == (l < 15 ? l : full ? 14 : 13));
    CHECK(a.options(l).scale == 1.0);
    CHECK(posenc::io::rope_config_from_hf(e2b, l).head_dim == (full ? 512 : 256));
  }
  // The full layers' p-RoPE: the 64 highest of 1e6^(-2i/512) over the whole 512-wide head, halves paired.
  const posenc::rope_config rf = posenc::io::rope_config_from_hf(e2b);
  CHECK(rf.scaling.rope_type == posenc::rope_type::proportional);
  const auto inv = posenc::rope(rf).inv_freq();
  REQUIRE(inv.size() == 256);
  for (std::size_t i = 0; i < 256; ++i)
    CHECK(inv[i] == Approx(i < 64 ? std::pow(1e6, -2.0 * static_cast<double>(i) / 512.0) : 0.0).epsilon(1e-14));
  CHECK(posenc::rope(rf).rotary_dim() == 512);
  // The sliding layers: plain RoPE, theta 1e4 over all 256 dims.
  const posenc::rope_config rs = posenc::io::rope_config_from_hf(e2b, 0);
  CHECK(rs.scaling.rope_type == posenc::rope_type::default_);
  check_close(posenc::rope(rs).inv_freq(), plain_inv_freq(10000.0, 256), 1e-14);
  CHECK(posenc::io::encoding_from_hf(e2b).family == "rope");

  // gemma-4-31B's text part: full layers 4 kv heads of 512 whose values are the keys' projection
  // (attention_k_eq_v), sliding layers 16 of 256, window 1024, [s x 5, F] x 10, no sharing.
  json b31 = e2b;
  auto& t = b31["text_config"];
  t["hidden_size"] = 5376;
  t["num_attention_heads"] = 32;
  t["num_key_value_heads"] = 16;
  t["num_global_key_value_heads"] = 4;
  t["attention_k_eq_v"] = true;
  t["num_hidden_layers"] = 60;
  t["num_kv_shared_layers"] = 0;
  t["sliding_window"] = 1024;
  t["use_bidirectional_attention"] = "vision";  // image tokens see their own image; text stays causal
  t.erase("layer_types");                       // Gemma4TextConfig's default: every 6th layer full
  const auto c = posenc::io::attention_config_from_hf(b31);
  for (posenc::index_t l = 0; l < 60; ++l) {
    INFO("layer " << l);
    const bool full = (l + 1) % 6 == 0;
    CHECK(c.layer_head_dim(l) == (full ? 512 : 256));
    CHECK(c.layer_kv_heads(l) == (full ? 4 : 16));
    CHECK(c.layer_values_from_keys(l) == full);
    CHECK(c.layer_window(l) == (full ? 0 : 1024));
    CHECK(c.kv_layer(l) == l);
  }
  CHECK(c.causal);
  // Without rope_parameters: the class's (p-RoPE 0.25 at 1e6 on full layers, 1e4 on sliding ones).
  t.erase("rope_parameters");
  CHECK(posenc::io::rope_config_from_hf(b31).scaling.rope_type == posenc::rope_type::proportional);
  CHECK(posenc::io::rope_config_from_hf(b31).partial_rotary_factor == 0.25);
  CHECK(posenc::io::rope_config_from_hf(b31).rope_theta == 1e6);
  CHECK(posenc::io::rope_config_from_hf(b31, 0).rope_theta == 1e4);
  // A last layer listed as sliding is full (Gemma4TextConfig.__post_init__ forces it).
  json last = e2b;
  last["text_config"]["layer_types"][34] = "sliding_attention";
  CHECK(posenc::io::attention_config_from_hf(last).layer_window(34) == 0);
  CHECK(posenc::io::attention_config_from_hf(last).layer_head_dim(34) == 512);
  // Bidirectional text attention (a symmetric window) is refused; kv heads must divide the heads.
  t["use_bidirectional_attention"] = "all";
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(b31), Catch::Contains("use_bidirectional_attention: all"));
  t["use_bidirectional_attention"] = nullptr;
  t["num_global_key_value_heads"] = 5;
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(b31),
                    Catch::Contains("num_global_key_value_heads: must be > 0 and divide num_attention_heads"));
}

TEST_CASE("hf_config: llama3 scaling needs original_max_position_embeddings in its block, as transformers",
          "[io][hf_config]") {
  json cfg = config("llama-3.1-8b");
  cfg["rope_scaling"].erase("original_max_position_embeddings");
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(cfg),
                    Catch::Contains("rope_scaling.original_max_position_embeddings: is required by rope_type llama3"));
  cfg["original_max_position_embeddings"] = 8192;  // a top-level key is not read by llama3 either
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(cfg), Catch::Contains("original_max_position_embeddings"));
}

// Found by the config.json fuzzer: a whole number written as a float beyond the integer range was
// converted to an integer (undefined behaviour) instead of being rejected.
TEST_CASE("hf_config: a whole-number float beyond the integer range is an error naming the key", "[io][hf_config][errors]") {
  const auto cfg = nlohmann::json::parse(
      R"({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 2.44444e58})");
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(cfg),
                    Catch::Contains("max_position_embeddings") && Catch::Contains("out of the integer range"));
  const auto ok = nlohmann::json::parse(
      R"({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 4096.0})");
  CHECK(posenc::io::rope_config_from_hf(ok).max_position_embeddings == 4096);
}

TEST_CASE(
    "hf_config: kv heads of StarCoder (multi_query) and DBRX (attn_config); JetMoE, Zamba2, Doge, DiffLlama refused",
    "[io][hf_config]") {
  // bigcode/starcoderbase: GPTBigCodeAttention has kv_heads = 1 if multi_query (default true) else n_head; its
  // config has no num_key_value_heads.
  json sc = json::parse(R"({"model_type": "gpt_bigcode", "n_embd": 6144, "n_head": 48, "n_layer": 40,
    "n_positions": 8192, "multi_query": true, "scale_attn_weights": true})");
  auto a = posenc::io::attention_config_from_hf(sc);
  CHECK(a.num_attention_heads == 48);
  CHECK(a.num_key_value_heads == 1);
  CHECK(a.head_dim == 128);
  sc.erase("multi_query");
  CHECK(posenc::io::attention_config_from_hf(sc).num_key_value_heads == 1);
  sc["multi_query"] = false;
  CHECK(posenc::io::attention_config_from_hf(sc).num_key_value_heads == 48);

  // databricks/dbrx-base: DbrxAttention reads kv_n_heads and rope_theta from attn_config (DbrxAttentionConfig
  // defaults: 1 and 10000); n_layers and max_seq_len are its names for the layer count and context.
  json dbrx = json::parse(R"({"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40,
    "max_seq_len": 32768, "attn_config": {"kv_n_heads": 8, "rope_theta": 500000.0, "clip_qkv": 8}})");
  a = posenc::io::attention_config_from_hf(dbrx);
  CHECK(a.num_key_value_heads == 8);
  CHECK(a.head_dim == 128);
  CHECK(a.num_hidden_layers == 40);
  const auto enc = posenc::io::encoding_from_hf(dbrx);
  REQUIRE(enc.family == "rope");
  const auto& rc = std::get<posenc::rope_config>(enc.config);
  CHECK(rc.rope_theta == 500000.0);
  CHECK(rc.layout == posenc::rope_layout::half);
  CHECK(rc.max_position_embeddings == 32768);
  check_close(posenc::rope(rc).inv_freq(), plain_inv_freq(500000.0, 128));
  dbrx["attn_config"] = json::object();
  CHECK(posenc::io::attention_config_from_hf(dbrx).num_key_value_heads == 1);
  CHECK(posenc::io::rope_config_from_hf(dbrx).rope_theta == 10000.0);
  // MPT's layer count is n_layers too.
  CHECK(posenc::io::attention_config_from_hf(config("mpt-7b")).num_hidden_layers == 32);

  // Attention no posenc call reproduces from the config: refused by both readers.
  for (const char* mt : {"jetmoe", "zamba2", "doge", "diffllama"}) {
    INFO(mt);
    const json c = {{"model_type", mt},
                    {"hidden_size", 2048},
                    {"num_attention_heads", 16},
                    {"num_hidden_layers", 4},
                    {"rope_theta", 10000.0}};
    CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(c),
                      Catch::Contains(std::string("model_type: ") + mt + " is not supported"));
    CHECK_THROWS_WITH(posenc::io::encoding_from_hf(c), Catch::Contains(std::string(mt) + " is not supported"));
  }
}

TEST_CASE("hf_config: logit scales of GPT-Neo, GPT-2 and Falcon-H1, Ministral 3's query scale; GPT-Neo's local layers",
          "[io][hf_config]") {
  // EleutherAI/gpt-neo-1.3B: GPTNeoSelfAttention._attn does not scale q k^T; its odd layers are local
  // (keys i - window_size < j <= i, window_size 256).
  json neo = json::parse(R"({"model_type": "gpt_neo", "hidden_size": 2048, "num_heads": 16, "num_layers": 24,
    "max_position_embeddings": 2048, "window_size": 256, "attention_types": [[["global", "local"], 12]]})");
  auto a = posenc::io::attention_config_from_hf(neo);
  REQUIRE(a.scale());
  CHECK(*a.scale() == 1.0);
  CHECK(a.num_hidden_layers == 24);
  for (posenc::index_t l = 0; l < 24; ++l) {
    INFO("layer " << l);
    CHECK(a.layer_window(l) == (l % 2 == 1 ? 256 : 0));
    CHECK(a.options(l).sliding_window == (l % 2 == 1 ? 256 : 0));
    CHECK(*a.options(l).scale == 1.0);
  }
  // the expanded list GPTNeoConfig also writes (attention_layers), read first; window_size's default 256
  neo["attention_layers"] = {"local", "local", "global"};
  neo["num_layers"] = 3;
  neo.erase("window_size");
  a = posenc::io::attention_config_from_hf(neo);
  CHECK(a.layer_window(0) == 256);
  CHECK(a.layer_window(1) == 256);
  CHECK(a.layer_window(2) == 0);
  neo.erase("attention_layers");
  neo["attention_types"] = json::parse(R"([[["local"], 2], [["global"], 1]])");
  a = posenc::io::attention_config_from_hf(neo);
  CHECK(a.layer_window(1) == 256);
  CHECK(a.layer_window(2) == 0);
  neo["attention_types"] = json::parse(R"([[["local", "global"], 2]])");
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(neo),
                    Catch::Contains("attention_layers: must have an entry per layer (num_hidden_layers)"));
  neo["attention_types"] = json::parse(R"([[["local", "sparse"], 1], [["global"], 1]])");
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(neo),
                    Catch::Contains("entries must be global or local (got sparse)"));

  // GPT2Attention._attn: / sqrt(head_dim) only with scale_attn_weights (default true), and / (layer + 1)
  // as well with scale_attn_by_inverse_layer_idx (stanford-crfm's GPT-2 runs).
  json g = config("gpt2");
  CHECK_FALSE(posenc::io::attention_config_from_hf(g).scale());
  g["scale_attn_by_inverse_layer_idx"] = true;
  a = posenc::io::attention_config_from_hf(g);
  for (posenc::index_t l : {0, 1, 11}) CHECK(*a.options(l).scale == Approx(1.0 / 8.0 / (l + 1)).epsilon(1e-15));
  g["scale_attn_weights"] = false;
  a = posenc::io::attention_config_from_hf(g);
  for (posenc::index_t l : {0, 1, 11}) CHECK(*a.options(l).scale == Approx(1.0 / (l + 1)).epsilon(1e-15));
  const json sc = json::parse(R"({"model_type": "gpt_bigcode", "n_embd": 1024, "n_head": 16, "n_layer": 2,
    "n_positions": 2048, "scale_attn_weights": false})");
  CHECK(*posenc::io::attention_config_from_hf(sc).scale() == 1.0);

  // tiiuae/Falcon-H1: FalconH1Attention multiplies the keys by key_multiplier and scales by head_dim^-1/2.
  json fh = json::parse(R"({"model_type": "falcon_h1", "hidden_size": 1536, "num_attention_heads": 12,
    "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 24, "rope_theta": 1e11,
    "key_multiplier": 0.390625})");
  CHECK(*posenc::io::attention_config_from_hf(fh).scale() == Approx(0.390625 / 8.0).epsilon(1e-15));
  fh.erase("key_multiplier");
  CHECK(*posenc::io::attention_config_from_hf(fh).scale() == Approx(1.0 / 8.0).epsilon(1e-15));
  // mosaicml/mpt-7b: MptAttention's softmax_scale is attn_config.softmax_scale, head_dim^-1/2 when null.
  json mpt = config("mpt-7b");
  CHECK_FALSE(posenc::io::attention_config_from_hf(mpt).scale());
  mpt["attn_config"]["softmax_scale"] = 0.05;
  CHECK(*posenc::io::attention_config_from_hf(mpt).options(0).scale == 0.05);

  // mistralai/Ministral-3-8B-Instruct-2512: Ministral3Attention multiplies each query by
  // 1 + beta ln(1 + floor(p / original_max_position_embeddings)).
  json mi = json::parse(R"({"model_type": "mistral3", "text_config": {"model_type": "ministral3",
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_hidden_layers": 34, "max_position_embeddings": 262144, "rope_parameters": {"rope_type": "yarn",
    "factor": 16.0, "original_max_position_embeddings": 16384, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
    "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1, "rope_theta": 1000000000.0}}})");
  const auto ma = posenc::io::attention_config_from_hf(mi);
  CHECK(ma.query_scale_beta == 0.1);
  for (std::int64_t p : {0, 1, 16383, 16384, 32767, 32768, 131071, 262143}) {
    INFO("position " << p);
    CHECK(ma.query_scale(p) == Approx(1.0 + 0.1 * std::log(1.0 + std::floor(p / 16384.0))).epsilon(1e-15));
  }
  CHECK(posenc::io::attention_config_from_hf(config("llama-3.1-8b")).query_scale(100000) == 1.0);
  posenc::io::model_attention_config by_hand;
  by_hand.query_scale_beta = 0.1;  // without a period
  CHECK_THROWS_WITH(by_hand.query_scale(5), Catch::Contains("query_scale_period: must be > 0"));
  mi["text_config"]["rope_parameters"].erase("original_max_position_embeddings");
  mi["text_config"]["rope_parameters"]["rope_type"] = "default";
  CHECK_THROWS_WITH(posenc::io::attention_config_from_hf(mi),
                    Catch::Contains("llama_4_scaling_beta needs original_max_position_embeddings"));
}

TEST_CASE("hf_config: EXAONE 4.0's full layers are NoPE; OLMo 3's sliding layers rotate unscaled", "[io][hf_config]") {
  // LGAI-EXAONE/EXAONE-4.0-32B: Exaone4Attention rotates where sliding_window is None or the layer slides
  // ("global NoPE for hybrid attention"); the 1.2B has no window and rotates every layer.
  json ex = json::parse(R"({"model_type": "exaone4", "hidden_size": 5120, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 8, "sliding_window": 4096,
    "rope_theta": 1000000.0, "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
    "full_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]})");
  auto a = posenc::io::attention_config_from_hf(ex);
  for (posenc::index_t l = 0; l < 8; ++l) {
    INFO("layer " << l);
    const bool sliding = l % 4 != 3;
    CHECK(a.layer_window(l) == (sliding ? 4096 : 0));
    CHECK(a.layer_rotates(l) == sliding);
  }
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(ex, 3), Catch::Contains("layer: does not rotate"));
  ex["sliding_window"] = nullptr;
  ex["layer_types"] = std::vector<std::string>(8, "full_attention");
  a = posenc::io::attention_config_from_hf(ex);
  for (posenc::index_t l = 0; l < 8; ++l) CHECK(a.layer_rotates(l));

  // allenai/Olmo-3-1025-7B: YaRN on the full-attention layers only (Olmo3Model's sliding_attention rotary is
  // rope_type "default" with the same theta); without layer_types every 4th layer is full (Olmo3Config).
  json ol = json::parse(R"({"model_type": "olmo3", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 32, "num_hidden_layers": 8, "sliding_window": 4096, "rope_theta": 500000,
    "max_position_embeddings": 65536, "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
    "original_max_position_embeddings": 8192, "attention_factor": 1.2079441541679836, "beta_fast": 32,
    "beta_slow": 1}})");
  a = posenc::io::attention_config_from_hf(ol);
  for (posenc::index_t l = 0; l < 8; ++l) {
    INFO("layer " << l);
    const bool sliding = (l + 1) % 4 != 0;
    CHECK(a.layer_window(l) == (sliding ? 4096 : 0));
    const posenc::rope_config r = posenc::io::rope_config_from_hf(ol, l);
    CHECK(r.rope_theta == 500000.0);
    if (sliding) {
      CHECK(r.scaling.rope_type == posenc::rope_type::default_);
      check_close(posenc::rope(r).inv_freq(), plain_inv_freq(500000.0, 128));
      CHECK(posenc::rope(r).attention_factor() == 1.0);
    } else {
      CHECK(r.scaling.rope_type == posenc::rope_type::yarn);
      CHECK(posenc::rope(r).attention_factor() == 1.2079441541679836);
    }
  }
  CHECK(posenc::io::encoding_from_hf(ol).family == "rope");
}

TEST_CASE("hf_config: learned tables of Blenderbot, BioGPT and ELECTRA; relative BERT and MPNet refused",
          "[io][hf_config]") {
  // BlenderbotLearnedPositionalEmbedding looks position p up at row p (arange), max_position_embeddings rows.
  for (const char* mt : {"blenderbot", "blenderbot-small"}) {
    const auto s = posenc::io::learned_spec_from_hf(
        json{{"model_type", mt}, {"d_model", 1280}, {"max_position_embeddings", 128}, {"encoder_attention_heads", 32}});
    CHECK(s.max_positions == 128);
    CHECK(s.options.offset == 0);
  }
  // microsoft/biogpt: BioGptLearnedPositionalEmbedding (OPT's): offset 2, max_position_embeddings + 2 rows.
  const auto bio = posenc::io::learned_spec_from_hf(json::parse(
      R"({"model_type": "biogpt", "hidden_size": 1024, "num_attention_heads": 16, "max_position_embeddings": 1024})"));
  CHECK(bio.max_positions == 1026);
  CHECK(bio.options.offset == 2);
  // google/electra-small-discriminator: ElectraEmbeddings' tables are embedding_size wide (128), not hidden_size.
  json el = json::parse(R"({"model_type": "electra", "hidden_size": 256, "embedding_size": 128,
    "num_attention_heads": 4, "max_position_embeddings": 512})");
  CHECK(posenc::io::learned_spec_from_hf(el).d_model == 128);
  // position_embedding_type relative_key(_query): no absolute table is added (its weight is unused).
  el["position_embedding_type"] = "relative_key";
  CHECK_THROWS_WITH(posenc::io::encoding_from_hf(el),
                    Catch::Contains("position_embedding_type: is not absolute") && Catch::Contains("relative_key"));
  // MPNet's bucket key does not make it T5 (it scales its logits and adds a learned table).
  CHECK_THROWS_WITH(posenc::io::encoding_from_hf(json::parse(R"({"model_type": "mpnet", "hidden_size": 768,
    "num_attention_heads": 12, "max_position_embeddings": 514, "relative_attention_num_buckets": 32})")),
                    Catch::Contains("cannot tell the positional encoding of model_type 'mpnet'"));
}

TEST_CASE("hf_config: Falcon's ALiBi slopes, PhiMoE's mscale, Hunyuan's alpha, MiniMax-M2's rotary_dim; M-RoPE refused",
          "[io][hf_config]") {
  // tiiuae/falcon-rw-1b: FalconAttention computes (q k^T + alibi) * head_dim^-1/2, so each BLOOM slope
  // 2^(-8 (h+1) / 32) reaches the softmax divided by sqrt(64).
  const posenc::alibi frw(posenc::io::alibi_config_from_hf(config("falcon-rw-1b")));
  for (posenc::index_t h = 0; h < 32; ++h)
    CHECK(frw.slope(h) == Approx(std::pow(2.0, -8.0 * static_cast<double>(h + 1) / 32) / 8.0).epsilon(1e-15));
  CHECK(posenc::io::alibi_config_from_hf(config("bloom-560m")).slope_scale == 1.0);

  // microsoft/Phi-3.5-MoE-instruct: PhimoeRotaryEmbedding scales cos and sin by short_mscale / long_mscale
  // (1.2432 in both), not by LongRoPE's sqrt(1 + ln 32 / ln 4096).
  json pm = config("phi-3-mini-128k-instruct");
  pm["model_type"] = "phimoe";
  pm["rope_scaling"]["short_mscale"] = 1.243163121016122;
  pm["rope_scaling"]["long_mscale"] = 1.243163121016122;
  const posenc::rope pr(posenc::io::rope_config_from_hf(pm));
  CHECK(pr.attention_factor() == 1.243163121016122);
  pm["rope_scaling"]["long_mscale"] = 1.5;
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(pm), Catch::Contains("short_mscale: must equal long_mscale"));

  // tencent/Hunyuan-7B-Instruct: dynamic scaling with alpha 1000 is a fixed base theta alpha^(d / (d - 2)).
  const json hy = json::parse(R"({"model_type": "hunyuan_v1_dense", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 10000.0, "max_position_embeddings": 32768,
    "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, "beta_slow": 1}})");
  const posenc::rope_config hr = posenc::io::rope_config_from_hf(hy);
  const double base = 10000.0 * std::pow(1000.0, 128.0 / 126.0);
  CHECK(hr.rope_theta == Approx(base).epsilon(1e-14));
  CHECK(hr.scaling.rope_type == posenc::rope_type::default_);
  check_close(posenc::rope(hr).inv_freq(40000), plain_inv_freq(base, 128), 1e-12);

  // Qwen2.5-VL as transformers re-saves it: rope_type "default" beside mrope_section (M-RoPE); GLM-4.1V's text
  // part rotates adjacent pairs (rotate_half_llm with repeat_interleaved frequencies).
  const json vl = json::parse(R"({"model_type": "qwen2_5_vl", "hidden_size": 3584, "num_attention_heads": 28,
    "num_key_value_heads": 4, "rope_theta": 1000000.0, "rope_scaling": {"type": "default", "rope_type": "default",
    "mrope_section": [16, 24, 24]}})");
  CHECK_THROWS_WITH(posenc::io::encoding_from_hf(vl), Catch::Contains("rope_scaling.mrope_section: M-RoPE"));
  const json glm = json::parse(R"({"model_type": "glm4v_text", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.5, "rope_theta": 10000.0})");
  CHECK(posenc::io::rope_config_from_hf(glm).layout == posenc::rope_layout::interleaved);

  // MiniMaxAI/MiniMax-M2: rotary_dim 64 of head_dim 128, rotate-half on the first 64 dims with
  // theta^(-2i / 64) (MiniMaxM2RotaryEmbedding); the other 64 pass through.
  const json mm = json::parse(R"({"model_type": "minimax_m2", "hidden_size": 3072, "num_attention_heads": 48,
    "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "rope_theta": 5000000})");
  const posenc::rope mr(posenc::io::rope_config_from_hf(mm));
  CHECK(mr.rotary_dim() == 64);
  CHECK(mr.layout() == posenc::rope_layout::half);
  check_close(mr.inv_freq(), plain_inv_freq(5000000.0, 64));
}

TEST_CASE("hf_config: keys a config leaves out take its configuration class's defaults", "[io][hf_config]") {
  // The defaults of transformers' configuration classes (MistralConfig(num_key_value_heads=8,
  // sliding_window=4096), Qwen3Config(head_dim=128), GPTNeoXConfig(rotary_pct=0.25), ...), read off the
  // sources; -1 = the generic fallback (kv heads = heads, head_dim = hidden / heads, theta 10000, all dims).
  struct expected {
    const char* model_type;
    posenc::index_t kv_heads, head_dim, window;
    double theta, partial;
  };
  const expected rows[] = {
      {"mistral", 8, -1, 4096, -1, -1},  {"ministral", 8, -1, 4096, -1, -1},  {"mixtral", 8, -1, -1, 1e6, -1},
      {"phimoe", 8, -1, -1, 1e6, -1},    {"qwen3", -1, 128, -1, -1, -1},      {"qwen3_moe", 4, -1, -1, -1, -1},
      {"starcoder2", 2, -1, -1, -1, -1}, {"stablelm", -1, -1, -1, -1, 0.25},  {"persimmon", -1, -1, -1, 25000, 0.5},
      {"phi", -1, -1, -1, -1, 0.5},      {"nemotron", -1, -1, -1, -1, 0.5},   {"gpt_neox", -1, -1, -1, -1, 0.25},
      {"gemma", -1, 256, -1, -1, -1},    {"olmo3", -1, -1, 4096, 500000, -1}, {"exaone4", -1, -1, 4096, -1, -1},
      {"seed_oss", 8, 128, -1, -1, -1},  {"glm4_moe", 8, -1, -1, -1, 0.5},    {"lfm2", 8, -1, -1, 1e6, -1},
      {"bamba", 8, -1, -1, -1, 0.5},     {"bitnet", 5, -1, -1, 500000, -1},   {"minimax", -1, -1, -1, 1e6, -1},
      {"apertus", -1, -1, -1, 12e6, -1}, {"csm", 8, -1, -1, 500000, -1},      {"llama", -1, -1, -1, -1, -1},
  };
  for (const expected& e : rows) {
    INFO(e.model_type);
    const json c = {
        {"model_type", e.model_type}, {"hidden_size", 2560}, {"num_attention_heads", 40}, {"num_hidden_layers", 8}};
    const auto a = posenc::io::attention_config_from_hf(c);
    CHECK(a.num_key_value_heads == (e.kv_heads > 0 ? e.kv_heads : 40));
    CHECK(a.head_dim == (e.head_dim > 0 ? e.head_dim : 64));
    CHECK(a.sliding_window == (e.window > 0 ? e.window : 0));
    const posenc::rope_config r = posenc::io::rope_config_from_hf(c);
    CHECK(r.head_dim == a.head_dim);
    CHECK(r.rope_theta == (e.theta > 0 ? e.theta : 10000.0));
    CHECK(r.partial_rotary_factor == (e.partial > 0 ? e.partial : 1.0));
  }
  // GPT-J and CodeGen rotate rotary_dim = 64 dims unless the config says otherwise.
  const json gj = {{"model_type", "gptj"}, {"n_embd", 4096}, {"n_head", 16}};
  CHECK(posenc::io::rope_config_from_hf(gj).rotary_dim == 64);
  // MistralConfig's window applies only when the key is absent: null (Mistral-7B-v0.3) is no window, and a
  // value given wins; OLMo 3's and EXAONE 4.0's default window takes every 4th layer out.
  json m = {{"model_type", "mistral"},
            {"hidden_size", 4096},
            {"num_attention_heads", 32},
            {"num_hidden_layers", 4},
            {"sliding_window", nullptr}};
  CHECK(posenc::io::attention_config_from_hf(m).sliding_window == 0);
  m["sliding_window"] = 1024;
  CHECK(posenc::io::attention_config_from_hf(m).sliding_window == 1024);
  for (const char* mt : {"olmo3", "exaone4"}) {
    const auto a = posenc::io::attention_config_from_hf(
        json{{"model_type", mt}, {"hidden_size", 4096}, {"num_attention_heads", 32}, {"num_hidden_layers", 8}});
    for (posenc::index_t l = 0; l < 8; ++l) CHECK(a.layer_window(l) == ((l + 1) % 4 != 0 ? 4096 : 0));
  }
}

TEST_CASE("hf_config: the decoder and encoder stacks of encoder-decoder models; encoder-only BERT is not causal",
          "[io][hf_config]") {
  using posenc::io::attention_config_from_hf;
  using posenc::io::attention_stack;
  // facebook/blenderbot-3B: BlenderbotConfig's attribute_map points num_attention_heads / num_hidden_layers at
  // the encoder (its config.json writes num_hidden_layers = encoder_layers = 2); the decoder layers are built
  // with decoder_attention_heads and there are decoder_layers of them. BlenderbotAttention: head_dim =
  // d_model // heads (2560 / 32 = 80).
  const json bb = json::parse(R"({"model_type": "blenderbot", "d_model": 2560, "encoder_attention_heads": 32,
    "decoder_attention_heads": 32, "encoder_layers": 2, "decoder_layers": 24, "num_hidden_layers": 2,
    "max_position_embeddings": 128, "is_encoder_decoder": true})");
  const auto dec = attention_config_from_hf(bb);
  CHECK(dec.num_attention_heads == 32);
  CHECK(dec.num_key_value_heads == 32);
  CHECK(dec.head_dim == 2560 / 32);
  CHECK(dec.num_hidden_layers == 24);
  CHECK(dec.causal);
  CHECK(dec.options(23).causal);
  CHECK_FALSE(dec.scale().has_value());  // BlenderbotAttention: head_dim^-1/2, the kernel's default
  const auto enc = attention_config_from_hf(bb, attention_stack::encoder);
  CHECK(enc.num_hidden_layers == 2);
  CHECK(enc.head_dim == 80);
  CHECK_FALSE(enc.causal);
  CHECK_FALSE(enc.options(1).causal);
  CHECK(enc.options(1).sliding_window == 0);
  CHECK_THROWS_WITH(enc.options(2), Catch::Contains("layer: must be in [0, num_hidden_layers)"));

  // Speech2TextConfig: 12 encoder and 6 decoder layers; heads differing per stack read from each stack's key.
  json s2t = json::parse(R"({"model_type": "speech_to_text", "d_model": 256, "encoder_attention_heads": 4,
    "decoder_attention_heads": 8, "encoder_layers": 12, "decoder_layers": 6, "max_source_positions": 6000,
    "max_target_positions": 1024})");
  CHECK(attention_config_from_hf(s2t).num_attention_heads == 8);
  CHECK(attention_config_from_hf(s2t).head_dim == 256 / 8);
  CHECK(attention_config_from_hf(s2t).num_hidden_layers == 6);
  CHECK(attention_config_from_hf(s2t, attention_stack::encoder).num_attention_heads == 4);
  CHECK(attention_config_from_hf(s2t, attention_stack::encoder).head_dim == 256 / 4);
  CHECK(attention_config_from_hf(s2t, attention_stack::encoder).num_hidden_layers == 12);
  // WhisperConfig's attribute_map aliases num_key_value_heads to encoder_attention_heads: an MHA decoder.
  const json whisper = json::parse(R"({"model_type": "whisper", "d_model": 384, "encoder_attention_heads": 6,
    "decoder_attention_heads": 6, "encoder_layers": 4, "decoder_layers": 4, "num_hidden_layers": 4,
    "max_source_positions": 1500, "max_target_positions": 448})");
  CHECK(attention_config_from_hf(whisper).num_key_value_heads == 6);
  CHECK(attention_config_from_hf(whisper).head_dim == 64);
  // Moonshine's stacks have their own kv heads (decoder_num_key_value_heads; null = the heads).
  const json moon = json::parse(R"({"model_type": "moonshine", "hidden_size": 288, "encoder_num_attention_heads": 8,
    "decoder_num_attention_heads": 8, "encoder_num_key_value_heads": null, "decoder_num_key_value_heads": 2,
    "encoder_num_hidden_layers": 6, "decoder_num_hidden_layers": 5})");
  CHECK(attention_config_from_hf(moon).num_key_value_heads == 2);
  CHECK(attention_config_from_hf(moon).num_hidden_layers == 5);
  CHECK(attention_config_from_hf(moon).head_dim == 288 / 8);
  CHECK(attention_config_from_hf(moon, attention_stack::encoder).num_key_value_heads == 8);

  // T5Config: num_decoder_layers (None = num_layers) for the decoder, num_layers for the encoder; heads are
  // num_heads of d_kv in both (mT5: 6 x 64 = 384, not d_model / 6).
  const json t5e = json::parse(R"({"model_type": "t5", "d_model": 512, "d_kv": 64, "num_heads": 8, "num_layers": 16,
    "num_decoder_layers": 6, "relative_attention_num_buckets": 32})");
  CHECK(attention_config_from_hf(t5e).num_hidden_layers == 6);
  CHECK(attention_config_from_hf(t5e, attention_stack::encoder).num_hidden_layers == 16);
  const json mt5 = json::parse(R"({"model_type": "mt5", "d_model": 512, "d_kv": 64, "num_heads": 6, "num_layers": 8,
    "num_decoder_layers": null})");
  CHECK(attention_config_from_hf(mt5).num_hidden_layers == 8);
  CHECK(attention_config_from_hf(mt5).head_dim == 64);
  CHECK(attention_config_from_hf(config("t5-small"), attention_stack::encoder).num_attention_heads == 8);

  // BertSelfAttention is causal only with is_decoder; DistilBertConfig's keys are dim, n_heads and n_layers.
  json bert = json::parse(R"({"model_type": "bert", "hidden_size": 768, "num_attention_heads": 12,
    "num_hidden_layers": 12, "max_position_embeddings": 512})");
  CHECK_FALSE(attention_config_from_hf(bert).causal);
  CHECK_FALSE(attention_config_from_hf(bert).options(0).causal);
  CHECK_FALSE(attention_config_from_hf(bert, attention_stack::encoder).causal);
  bert["is_decoder"] = true;
  CHECK(attention_config_from_hf(bert).options(0).causal);
  const auto distil = attention_config_from_hf(
      json::parse(R"({"model_type": "distilbert", "dim": 768, "n_heads": 12, "n_layers": 6})"));
  CHECK(distil.head_dim == 64);
  CHECK(distil.num_hidden_layers == 6);
  CHECK_FALSE(distil.causal);

  // XGLMConfig: attention_heads and num_layers, decoder-only.
  const json xglm = json::parse(
      R"({"model_type": "xglm", "d_model": 1024, "attention_heads": 16, "num_layers": 24, "max_position_embeddings": 2048})");
  CHECK(attention_config_from_hf(xglm).num_attention_heads == 16);
  CHECK(attention_config_from_hf(xglm).head_dim == 64);
  CHECK(attention_config_from_hf(xglm).num_hidden_layers == 24);
  CHECK(attention_config_from_hf(xglm).causal);

  // A decoder-only model has no encoder; encoders attending locally and ProphetNet are refused.
  CHECK_THROWS_WITH(attention_config_from_hf(xglm, attention_stack::encoder),
                    Catch::Contains("stack: must be decoder for model_type xglm"));
  CHECK_THROWS_WITH(attention_config_from_hf(config("llama-3.1-8b"), attention_stack::encoder),
                    Catch::Contains("has no encoder"));
  const json led = json::parse(R"({"model_type": "led", "d_model": 1024, "encoder_attention_heads": 16,
    "decoder_attention_heads": 16, "encoder_layers": 12, "decoder_layers": 12, "attention_window": [1024, 1024]})");
  CHECK(attention_config_from_hf(led).num_hidden_layers == 12);
  CHECK_THROWS_WITH(attention_config_from_hf(led, attention_stack::encoder),
                    Catch::Contains("led's encoder is not supported"));
  json bp = json::parse(R"({"model_type": "bigbird_pegasus", "d_model": 1024, "encoder_attention_heads": 16,
    "decoder_attention_heads": 16, "encoder_layers": 16, "decoder_layers": 16})");
  CHECK_THROWS_WITH(attention_config_from_hf(bp, attention_stack::encoder), Catch::Contains("attention_type:"));
  bp["attention_type"] = "original_full";
  CHECK_FALSE(attention_config_from_hf(bp, attention_stack::encoder).causal);
  CHECK_THROWS_WITH(
      attention_config_from_hf(json{{"model_type", "longformer"}, {"hidden_size", 768}, {"num_attention_heads", 12}}),
      Catch::Contains("longformer's encoder is not supported"));
  CHECK_THROWS_WITH(attention_config_from_hf(json::parse(R"({"model_type": "prophetnet", "hidden_size": 1024,
    "num_encoder_attention_heads": 16, "num_decoder_attention_heads": 16})")),
                    Catch::Contains("prophetnet is not supported"));
  CHECK_THROWS_WITH(attention_config_from_hf(json{{"model_type", "xlm-prophetnet"}, {"hidden_size", 1024}}),
                    Catch::Contains("xlm-prophetnet is not supported"));
  // A Longformer marked is_decoder still attends locally.
  CHECK_THROWS_WITH(attention_config_from_hf(json{{"model_type", "longformer"}, {"hidden_size", 768},
                                                  {"num_attention_heads", 12}, {"is_decoder", true}}),
                    Catch::Contains("longformer's encoder is not supported"));

  // Relative terms a plain attention call would leave out: DeBERTa (c2p / p2c and its own scale), MPNet's
  // bucket bias, BERT's relative_key (Shaw), MVP's prompt keys and values.
  CHECK_THROWS_WITH(attention_config_from_hf(json{{"model_type", "deberta-v2"}, {"hidden_size", 768},
                                                  {"num_attention_heads", 12}}),
                    Catch::Contains("deberta-v2's attention adds disentangled relative terms"));
  CHECK_THROWS_WITH(
      attention_config_from_hf(json{{"model_type", "mpnet"}, {"hidden_size", 768}, {"num_attention_heads", 12}}),
      Catch::Contains("mpnet's attention adds a relative bucket bias"));
  json rel = bert;
  rel["position_embedding_type"] = "relative_key_query";
  CHECK_THROWS_WITH(attention_config_from_hf(rel), Catch::Contains("position_embedding_type: adds relative-position"));
  json mvp = json::parse(R"({"model_type": "mvp", "d_model": 1024, "encoder_attention_heads": 16,
    "decoder_attention_heads": 16, "encoder_layers": 12, "decoder_layers": 12, "use_prompt": false})");
  CHECK(attention_config_from_hf(mvp).num_hidden_layers == 12);
  mvp["use_prompt"] = true;
  CHECK_THROWS_WITH(attention_config_from_hf(mvp), Catch::Contains("use_prompt: mvp with prompts"));

  // TrOCRConfig, decoder-only: its attribute_map points num_attention_heads / num_hidden_layers at
  // decoder_attention_heads / decoder_layers.
  const auto trocr = attention_config_from_hf(json::parse(R"({"model_type": "trocr", "d_model": 1024,
    "decoder_attention_heads": 16, "decoder_layers": 12, "max_position_embeddings": 512})"));
  CHECK(trocr.num_attention_heads == 16);
  CHECK(trocr.head_dim == 64);
  CHECK(trocr.num_hidden_layers == 12);
  CHECK(trocr.causal);
}

TEST_CASE("hf_config: Moonshine rotates adjacent pairs of the first 90 % of each stack's head", "[io][hf_config]") {
  // MoonshineConfig keeps a head count per stack and no num_attention_heads; its apply_rotary_pos_emb
  // repeat_interleaves the first half of cos / sin and pairs x[2i] with x[2i+1] on the first
  // int(head_dim * partial_rotary_factor) dims (hf_interleaved_rotate). Moonshine-tiny's sizes:
  // head_dim 288 / 8 = 36, rotary dims int(32.4) = 32.
  json tiny = json::parse(R"({"model_type": "moonshine", "hidden_size": 288, "encoder_num_attention_heads": 8,
    "decoder_num_attention_heads": 8, "encoder_num_hidden_layers": 6, "decoder_num_hidden_layers": 6,
    "max_position_embeddings": 194, "partial_rotary_factor": 0.9, "rope_theta": 10000.0,
    "pad_head_dim_to_multiple_of": 8, "is_encoder_decoder": true})");
  const auto enc = posenc::io::encoding_from_hf(tiny);
  CHECK(enc.family == "rope");
  const auto& r = std::get<posenc::rope_config>(enc.config);
  CHECK(r.head_dim == 36);
  check_interleaved_rotation(r, 10000.0, 32);
  CHECK(posenc::io::attention_config_from_hf(tiny).head_dim == 36);  // the padding only pads q, k, v with zeros
  // Moonshine-base's sizes: 416 / 8 = 52, int(46.8) = 46.
  json base = tiny;
  base["hidden_size"] = 416;
  check_interleaved_rotation(posenc::io::rope_config_from_hf(base), 10000.0, 46);
  // Each stack's rotary embedding takes that stack's heads (4 encoder heads: 72 dims, int(64.8) = 64).
  json mixed = tiny;
  mixed["encoder_num_attention_heads"] = 4;
  CHECK(posenc::io::rope_config_from_hf(mixed).head_dim == 36);
  const auto re = posenc::io::rope_config_from_hf(mixed, posenc::io::attention_stack::encoder);
  CHECK(re.head_dim == 72);
  check_interleaved_rotation(re, 10000.0, 64);
  CHECK(posenc::io::attention_config_from_hf(mixed, posenc::io::attention_stack::encoder).head_dim == 72);
  // A decoder-only model has no encoder to read.
  const json llama = json::parse(R"({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32})");
  CHECK(posenc::io::rope_config_from_hf(llama, posenc::io::attention_stack::decoder).head_dim == 128);
  CHECK_THROWS_WITH(posenc::io::rope_config_from_hf(llama, posenc::io::attention_stack::encoder),
                    Catch::Contains("stack: must be decoder for model_type llama"));
}

TEST_CASE("hf_config: sinusoidal positions of Marian, Pegasus and the fairseq family; more learned tables (Whisper, LED)",
          "[io][hf_config]") {
  using posenc::io::encoding_from_hf;
  using posenc::io::sinusoidal_spec;
  // Helsinki-NLP/opus-mt-en-de: MarianSinusoidalPositionalEmbedding._init_weight builds
  // pos / 10000^(2 (j // 2) / d) in NumPy float64, sin of the even j in the first half, cos of the odd j in
  // the second, rounded to float32; row = position, max_position_embeddings rows.
  const json marian = json::parse(R"({"model_type": "marian", "d_model": 512, "encoder_attention_heads": 8,
    "decoder_attention_heads": 8, "encoder_layers": 6, "decoder_layers": 6, "max_position_embeddings": 512,
    "pad_token_id": 58100, "scale_embedding": true})");
  const auto me = encoding_from_hf(marian);
  CHECK(me.family == "sinusoidal");
  const auto ms = std::get<sinusoidal_spec>(me.config);
  CHECK(ms.max_positions == 512);
  CHECK(ms.config.offset == 0);
  const posenc::sinusoidal mpe(ms.config);
  const auto mt = mpe.table<float>(512);
  for (int pos : {0, 1, 7, 300, 511})
    for (int j = 0; j < 512; ++j) {
      const double angle = pos / std::pow(10000.0, 2.0 * (j / 2) / 512.0);
      const float want = static_cast<float>(j % 2 == 0 ? std::sin(angle) : std::cos(angle));
      const int col = j % 2 == 0 ? j / 2 : 256 + j / 2;
      INFO("pos " << pos << " j " << j);
      CHECK(std::abs(mt(pos, col) - want) <= 6e-8f);  // the same double value, up to an ulp of its angle
    }
  const json pegasus = json::parse(R"({"model_type": "pegasus", "d_model": 1024, "max_position_embeddings": 1024})");
  CHECK(std::get<sinusoidal_spec>(encoding_from_hf(pegasus).config).config.angles == posenc::sinusoid_angles::exact);
  CHECK_THROWS_WITH(posenc::io::sinusoidal_spec_from_hf(
                        json{{"model_type", "marian"}, {"d_model", 511}, {"max_position_embeddings", 512}}),
                    Catch::Contains("d_model: must be even"));

  // facebook/nllb-200-distilled-600M (model_type m2m_100), pad_token_id 1: fairseq's get_embedding in float32,
  // row = position + pad + 1 (create_position_ids_from_input_ids), a table that grows with the sequence.
  const json nllb = json::parse(R"({"model_type": "m2m_100", "d_model": 1024, "encoder_attention_heads": 16,
    "decoder_attention_heads": 16, "max_position_embeddings": 1024, "pad_token_id": 1, "scale_embedding": true})");
  const auto ne = encoding_from_hf(nllb);
  CHECK(ne.family == "sinusoidal");
  const auto ns = std::get<sinusoidal_spec>(ne.config);
  CHECK(ns.config.d_model == 1024);
  CHECK(ns.config.layout == posenc::sinusoid_layout::concat);
  CHECK(ns.config.schedule == posenc::frequency_schedule::t2t);
  CHECK(ns.config.angles == posenc::sinusoid_angles::float32);
  CHECK(ns.config.offset == 2);
  CHECK_FALSE(ns.max_positions.has_value());
  // get_embedding written out: emb = ln(10000) / 511 (a Python float, rounded to float against the float
  // tensor), w = exp(i * -emb), angle = row * w, all float.
  std::vector<float> row(1024);
  posenc::sinusoidal(ns.config).row(100.0, std::span<float>(row));
  for (int c = 0; c < 1024; ++c) {
    const int i = c % 512;
    const float w = std::exp(static_cast<float>(i) * static_cast<float>(-(std::log(10000.0) / 511.0)));
    const float a = 102.0f * w;
    CHECK(row[static_cast<std::size_t>(c)] == (c < 512 ? std::sin(a) : std::cos(a)));
  }
  for (const char* mt_name : {"nllb-moe", "speech_to_text", "fsmt", "seamless_m4t", "kosmos_2_text_model"}) {
    json c = json{{"model_type", mt_name}, {"d_model", 256}, {"pad_token_id", 0}};
    CHECK(std::get<sinusoidal_spec>(encoding_from_hf(c).config).config.offset == 1);
    c.erase("pad_token_id");  // the classes' default pad_token_id is 1
    CHECK(std::get<sinusoidal_spec>(encoding_from_hf(c).config).config.offset == 2);
  }
  // Kosmos-2 (microsoft/kosmos-2-patch14-224): the text model's table, from the config's text_config.
  const auto k2 = encoding_from_hf(json::parse(R"({"model_type": "kosmos-2", "text_config": {"model_type":
    "kosmos_2_text_model", "embed_dim": 2048, "attention_heads": 32, "layers": 24, "pad_token_id": 1}})"));
  CHECK(std::get<sinusoidal_spec>(k2.config).config.d_model == 2048);
  CHECK(std::get<sinusoidal_spec>(k2.config).config.offset == 2);
  // MusicGen (facebook/musicgen-small): read from the composite config's decoder. get_embedding as fairseq's
  // in float32 but torch.cat([cos, sin]); position_ids = arange(seq_len) + past length: row = position.
  const json musicgen = json::parse(R"({"model_type": "musicgen", "is_encoder_decoder": true,
    "text_encoder": {"model_type": "t5", "d_model": 768, "num_heads": 12, "num_layers": 12},
    "audio_encoder": {"model_type": "encodec"},
    "decoder": {"model_type": "musicgen_decoder", "hidden_size": 1024, "num_attention_heads": 16,
      "num_hidden_layers": 24, "ffn_dim": 4096, "max_position_embeddings": 2048, "num_codebooks": 4,
      "scale_embedding": false, "pad_token_id": 2048}})");
  const auto mg = encoding_from_hf(musicgen);
  CHECK(mg.family == "sinusoidal");
  CHECK(mg.model_type == "musicgen_decoder");
  const auto mgs = std::get<sinusoidal_spec>(mg.config);
  CHECK(mgs.config.layout == posenc::sinusoid_layout::concat_cos_sin);
  CHECK(mgs.config.offset == 0);
  CHECK_FALSE(mgs.max_positions.has_value());
  posenc::sinusoidal(mgs.config).row(100.0, std::span<float>(row));
  for (int c = 0; c < 1024; ++c) {
    const int i = c % 512;
    const float w = std::exp(static_cast<float>(i) * static_cast<float>(-(std::log(10000.0) / 511.0)));
    const float a = 100.0f * w;
    CHECK(row[static_cast<std::size_t>(c)] == (c < 512 ? std::cos(a) : std::sin(a)));
  }
  CHECK(posenc::io::sinusoidal_spec_from_hf(musicgen).config.d_model == 1024);
  const auto mga = posenc::io::attention_config_from_hf(musicgen);  // MusicgenAttention: BART's
  CHECK(mga.num_attention_heads == 16);
  CHECK(mga.num_key_value_heads == 16);
  CHECK(mga.head_dim == 64);
  CHECK(mga.num_hidden_layers == 24);
  CHECK(mga.causal);
  json melody = musicgen;  // MusicGen Melody's decoder copies the table
  melody["model_type"] = "musicgen_melody";
  melody["decoder"]["model_type"] = "musicgen_melody_decoder";
  CHECK(std::get<sinusoidal_spec>(encoding_from_hf(melody).config).config.layout ==
        posenc::sinusoid_layout::concat_cos_sin);
  // XGLM adds its offset 2 to the position ids whatever the pad token; PEGASUS-X has no offset.
  CHECK(std::get<sinusoidal_spec>(
            encoding_from_hf(json{{"model_type", "xglm"}, {"d_model", 1024}, {"pad_token_id", 5}}).config)
            .config.offset == 2);
  CHECK(std::get<sinusoidal_spec>(encoding_from_hf(json{{"model_type", "pegasus_x"}, {"d_model", 1024}}).config)
            .config.offset == 0);
  // TrOCR learns its positions (+2, as BART) unless use_learned_position_embeddings is false.
  json trocr = json{{"model_type", "trocr"}, {"d_model", 1024}, {"max_position_embeddings", 512}};
  CHECK(encoding_from_hf(trocr).family == "learned");
  CHECK(std::get<posenc::io::learned_spec>(encoding_from_hf(trocr).config).max_positions == 514);
  CHECK(std::get<posenc::io::learned_spec>(encoding_from_hf(trocr).config).options.offset == 2);
  trocr["use_learned_position_embeddings"] = false;
  CHECK(encoding_from_hf(trocr).family == "sinusoidal");
  CHECK(std::get<sinusoidal_spec>(encoding_from_hf(trocr).config).config.offset == 2);
  // PLBart and MVP: BartLearnedPositionalEmbedding copies (+2); BigBird-Pegasus: no offset.
  for (const char* mt_name : {"plbart", "mvp"}) {
    const auto l = posenc::io::learned_spec_from_hf(
        json{{"model_type", mt_name}, {"d_model", 768}, {"max_position_embeddings", 1024}});
    CHECK(l.max_positions == 1026);
    CHECK(l.options.offset == 2);
  }
  const auto bp = std::get<posenc::io::learned_spec>(
      encoding_from_hf(json{{"model_type", "bigbird_pegasus"}, {"d_model", 1024}, {"max_position_embeddings", 4096}})
          .config);
  CHECK(bp.max_positions == 4096);
  CHECK(bp.options.offset == 0);
  CHECK_THROWS_WITH(posenc::io::sinusoidal_spec_from_hf(json{{"model_type", "gpt2"}, {"n_embd", 768}}),
                    Catch::Contains("model_type: has no sinusoidal positions posenc reads"));

  // openai/whisper-tiny: the decoder's WhisperPositionalEmbedding has max_target_positions rows (448), row =
  // position; the encoder adds the first max_source_positions rows (1500) of the sinusoid its checkpoint stores.
  const json whisper = json::parse(R"({"model_type": "whisper", "d_model": 384, "encoder_attention_heads": 6,
    "decoder_attention_heads": 6, "encoder_layers": 4, "decoder_layers": 4, "max_source_positions": 1500,
    "max_target_positions": 448, "pad_token_id": 50257})");
  CHECK(encoding_from_hf(whisper).family == "learned");
  const auto wd = posenc::io::learned_spec_from_hf(whisper);
  CHECK(wd.max_positions == 448);
  CHECK(wd.d_model == 384);
  CHECK(wd.options.offset == 0);
  CHECK(posenc::io::learned_spec_from_hf(whisper, posenc::io::attention_stack::encoder).max_positions == 1500);
  std::vector<float> table(1500 * 384, 0.0f);
  CHECK_NOTHROW(posenc::io::learned_from_hf<float>(whisper, posenc::tensor_map<const float, 2>(table.data(), 1500, 384),
                                                    posenc::io::attention_stack::encoder));
  CHECK_THROWS_WITH(
      posenc::io::learned_from_hf<float>(whisper, posenc::tensor_map<const float, 2>(table.data(), 1500, 384)),
      Catch::Contains("weight: must be [max_positions, d_model]") && Catch::Contains("[448, 384]"));
  // LEDLearnedPositionalEmbedding: no offset, max_decoder_position_embeddings / max_encoder_position_embeddings.
  const json led = json::parse(R"({"model_type": "led", "d_model": 1024, "max_encoder_position_embeddings": 16384,
    "max_decoder_position_embeddings": 1024})");
  CHECK(posenc::io::learned_spec_from_hf(led).max_positions == 1024);
  CHECK(posenc::io::learned_spec_from_hf(led, posenc::io::attention_stack::encoder).max_positions == 16384);
}
