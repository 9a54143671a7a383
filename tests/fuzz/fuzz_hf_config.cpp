// libFuzzer target: a Hugging Face config.json as arbitrary bytes -> nlohmann::json -> encoding_from_hf,
// then the encoding it names is built (the constructors validate the values the reader passed on)
// and a small rope is applied, so a config that passes both checks is also one that runs. Any input
// must be accepted or rejected with posenc::error (or nlohmann's parse error, before posenc sees it).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "posenc/alibi.hpp"
#include "posenc/io/hf_config.hpp"
#include "posenc/rope.hpp"
#include "posenc/sinusoidal.hpp"

namespace {

// Bound the work per input: a config may legally ask for a 2^40-dim head, which the library would
// try to honour; the fuzzer is after crashes, not after memory exhaustion on valid requests.
constexpr posenc::index_t max_dim = 4096;

void exercise(const posenc::io::hf_encoding& e) {
  if (const auto* r = std::get_if<posenc::rope_config>(&e.config)) {
    if (r->head_dim > max_dim || (r->rotary_dim && *r->rotary_dim > max_dim)) return;
    const posenc::rope rope(*r);
    std::vector<float> x(static_cast<std::size_t>(2 * r->head_dim), 1.0f);
    const auto pos = posenc::contiguous_positions(1, 2, 7);
    rope.apply(posenc::bshd(x.data(), 1, 2, 1, r->head_dim), posenc::view(pos));
  } else if (const auto* a = std::get_if<posenc::alibi_config>(&e.config)) {
    if (a->heads > max_dim) return;
    (void)posenc::alibi_slopes(a->heads, a->max_bias);
  } else if (const auto* t = std::get_if<posenc::t5_config>(&e.config)) {
    (void)posenc::t5_relative_bucket(-100, t->num_buckets, t->max_distance, !t->is_decoder);
  } else if (const auto* s = std::get_if<posenc::io::sinusoidal_spec>(&e.config)) {
    if (s->config.d_model > max_dim) return;
    const posenc::sinusoidal pe(s->config);
    std::vector<float> row(static_cast<std::size_t>(s->config.d_model));
    pe.row(7.0, std::span<float>(row));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {
    return 0;  // not JSON: read_json turns this into posenc::error; nothing of posenc's runs
  }
  try {
    exercise(posenc::io::encoding_from_hf(cfg));
  } catch (const posenc::error&) {
  }
  try {  // the model-level reader, and the RoPE of a few layers (Gemma 3's sliding ones differ)
    const posenc::io::model_attention_config a = posenc::io::attention_config_from_hf(cfg);
    (void)a.scale();
    for (posenc::index_t l = 0; l < std::min<posenc::index_t>(a.num_hidden_layers, 3); ++l) {
      (void)a.options(l);
      (void)a.kv_layer(l);
      (void)a.layer_head_dim(l);
      (void)a.layer_kv_heads(l);
      (void)a.layer_values_from_keys(l);
      exercise(posenc::io::hf_encoding{"rope", a.model_type, posenc::io::rope_config_from_hf(cfg, l)});
    }
  } catch (const posenc::error&) {
  }
  try {  // an encoder-decoder or encoder-only model's encoder
    const auto e = posenc::io::attention_config_from_hf(cfg, posenc::io::attention_stack::encoder);
    if (e.num_hidden_layers > 0) (void)e.options(0);
  } catch (const posenc::error&) {
  }
  try {  // and its RoPE (Moonshine: the encoder's own heads)
    exercise(posenc::io::hf_encoding{"rope", "",
                                     posenc::io::rope_config_from_hf(cfg, posenc::io::attention_stack::encoder)});
  } catch (const posenc::error&) {
  }
  return 0;
}
