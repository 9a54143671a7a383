// A Llama-style decode loop over a KV cache (docs/kv-cache.md), checked against one full call.
//
//   prefill   the prompt's keys are rotated once (rope.apply at their positions) and stored in the
//             cache, in f16 like most runtimes; attention runs with RoPE on the queries only;
//   decode    each new token's key is rotated once and appended; one query row per head attends
//             to the cache (the decode strategy: K/V streamed, split across the pool's threads);
//   check     every row equals the same row of one causal call over all tokens with RoPE fused on
//             the raw keys, within the f16 rounding of K and V.
// Run by ctest (label `examples`); exits 1 when a row is off.
#include <posenc/posenc.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  using posenc::index_t;
  constexpr index_t H = 32, Hkv = 8, D = 128, prompt = 100, steps = 28, total = prompt + steps;
  // Model inputs: the projections' q, k, v of every token (what the layer below would produce).
  std::mt19937 rng(0);
  std::normal_distribution<float> n;
  std::vector<float> q(total * H * D), k(total * Hkv * D), v(total * Hkv * D);
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = n(rng);

  const posenc::rope rope(posenc::rope_config{
      .head_dim = D, .rope_theta = 5e5,
      .scaling = {.rope_type = posenc::rope_type::llama3, .factor = 8.0, .original_max_position_embeddings = 8192,
                  .low_freq_factor = 1.0, .high_freq_factor = 4.0},
      .max_position_embeddings = 131072});
  const auto rope_q = rope.queries_only();
  Eigen::ThreadPool pool(2);

  // The cache: rotated keys and values in f16, [1, capacity, Hkv, D] (BSHD, as appended).
  std::vector<Eigen::half> k_cache(total * Hkv * D), v_cache(total * Hkv * D);
  std::vector<float> out(total * H * D);
  // Appends tokens [first, first + count): their keys rotated once, at their positions, and stored in
  // the cache's f16 slots in the same pass (rotated in float, rounded once); their values rounded.
  auto append = [&](index_t first, index_t count) {
    const auto pos = posenc::contiguous_positions(1, count, first);
    rope.apply(posenc::bshd<const float>(k.data() + first * Hkv * D, 1, count, Hkv, D),
               posenc::bshd(k_cache.data() + first * Hkv * D, 1, count, Hkv, D), posenc::view(pos));
    for (index_t i = first * Hkv * D; i < (first + count) * Hkv * D; ++i) v_cache[i] = Eigen::half(v[i]);
  };
  // Queries [first, first + count) against the first first + count cached tokens.
  auto attend = [&](index_t first, index_t count) {
    const index_t cached = first + count;
    posenc::attention<float, Eigen::half>(
        posenc::bshd<const float>(q.data() + first * H * D, 1, count, H, D),
        posenc::bshd<const Eigen::half>(k_cache.data(), 1, cached, Hkv, D),
        posenc::bshd<const Eigen::half>(v_cache.data(), 1, cached, Hkv, D),
        posenc::bshd(out.data() + first * H * D, 1, count, H, D), rope_q,
        posenc::attention_options{.causal = true, .q_offset = first, .pool = &pool});
  };

  append(0, prompt);  // prefill
  attend(0, prompt);
  for (index_t t = prompt; t < total; ++t) {  // decode, one token at a time
    append(t, 1);
    attend(t, 1);
  }

  // One call over all tokens, RoPE fused on the raw float keys.
  std::vector<float> full(out.size());
  posenc::attention(posenc::bshd<const float>(q.data(), 1, total, H, D), posenc::bshd<const float>(k.data(), 1, total, Hkv, D),
                    posenc::bshd<const float>(v.data(), 1, total, Hkv, D), posenc::bshd(full.data(), 1, total, H, D), rope,
                    posenc::attention_options{.causal = true});
  double worst = 0;
  for (std::size_t i = 0; i < out.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(out[i] - full[i])));
  // f16 keeps 11 significant bits: K and V rounded by up to 2^-11 relative move outputs of unit scale by
  // about 1e-3.
  const bool ok = worst < 5e-3;
  std::printf("decode_loop: prefill %td tokens, then %td tokens one by one (f16 cache, RoPE on queries only):\n"
              "             max |decoded - full call| = %.2e (%s)\n",
              prompt, steps, worst, ok ? "ok" : "TOO LARGE");
  return ok ? 0 : 1;
}
