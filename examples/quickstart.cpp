// The README's usage snippet, compiled and run by ctest (label `examples`) so it cannot rot.
#include <posenc/posenc.hpp>

#include <cstdio>
#include <random>
#include <vector>

int main() {
  const posenc::index_t L = 256, H = 32, Hkv = 8, D = 128;
  std::vector<float> q(L * H * D), k(L * Hkv * D), v(L * Hkv * D), out(L * H * D);
  std::mt19937 rng(0);
  std::normal_distribution<float> n;
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = n(rng);

  // --- README snippet -----------------------------------------------------------------------------
  // Llama-3.1 attention: RoPE with llama3 scaling, causal, GQA 32/8, BSHD buffers from your projections.
  posenc::rope rope(posenc::rope_config{
      .head_dim = D, .rope_theta = 5e5,
      .scaling = {.rope_type = posenc::rope_type::llama3, .factor = 8.0, .original_max_position_embeddings = 8192,
                  .low_freq_factor = 1.0, .high_freq_factor = 4.0},
      .max_position_embeddings = 131072});
  posenc::attention(posenc::bshd<const float>(q.data(), 1, L, H, D), posenc::bshd<const float>(k.data(), 1, L, Hkv, D),
                    posenc::bshd<const float>(v.data(), 1, L, Hkv, D), posenc::bshd(out.data(), 1, L, H, D), rope,
                    posenc::attention_options{.causal = true});
  // -------------------------------------------------------------------------------------------------

  // The first query sees only the first key: its output is v of token 0 (kv head 0 for query head 0).
  for (posenc::index_t d = 0; d < D; ++d)
    if (std::abs(out[d] - v[d]) > 1e-5f) {
      std::printf("quickstart: unexpected output %g vs %g at %td\n", out[d], v[d], d);
      return 1;
    }
  std::printf("quickstart: Llama-3.1 RoPE attention over %td tokens, %td heads: ok\n", L, H);
  return 0;
}
