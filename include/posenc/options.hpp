// posenc/options.hpp — what an attention call needs besides q, k, v and the encoding: scale,
// masks, positions, threads. Shared by the fused kernel (attention.hpp) and the reference
// attention (reference.hpp), so both read one set of conventions (docs/design.md):
//  * positions: queries at q_positions (default q_offset + i), keys at k_positions (default j);
//  * causal: a query at position p sees the keys at positions <= p (KV cache, packed sequences);
//  * sliding window (with causal): a query at position p sees the keys at positions p - W + 1 .. p;
//  * padding: key_padding_mask [batch, k_len], nonzero = padding (FORMAT.md), attention_mask (Hugging
//    Face: 1 = token, 0 = padding) and/or kv_lengths (keys j >= kv_lengths[b] are padding); a key is
//    padding when any of them says so;
//  * logit softcap and attention sinks of decoders (Gemma 2, gpt-oss; docs/masks.md);
//  * a query that sees no key gets an all-zero output (and log-sum-exp -inf).
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include <unsupported/Eigen/CXX11/ThreadPool>

#include "posenc/positions.hpp"

namespace posenc {

/// Which strategy runs a call (docs/design.md › Strategies): automatic picks decode for at most 32 query
/// rows per kv head (its group of query heads x q_len) or at most 2 queries per head (any group), and
/// tiled otherwise; forcing one is for tests and measurements. Both give the same attention up to
/// rounding.
enum class attention_path {
  automatic,
  tiled,   ///< query blocks x packed K/V blocks (GEBP): prefill, many rows
  decode,  ///< the group's few rows against K/V streamed from the cache, split-KV across threads
};

struct attention_options {
  /// Logit scale; unset = the encoding's logit_scale(head_dim), else 1/sqrt(head_dim).
  std::optional<double> scale{};
  /// Causal by positions: key visible iff k_position <= q_position.
  bool causal = false;
  /// Sliding window W (requires causal; 0 = off): key visible iff 0 <= q_position - k_position < W
  /// (Hugging Face Mistral / Gemma 2-3 / gpt-oss sliding-window layers).
  index_t sliding_window = 0;
  /// Logit softcap c (0 = off; else finite and > 0): s = c tanh(s / c) on the scaled logits (q.k and
  /// the encoding's score terms), before position biases and masks (Gemma 2's attn_logit_softcapping).
  double logit_softcap = 0.0;
  /// Attention sinks, one logit per query head (empty = none): exp(sinks[h]) joins each row's softmax
  /// denominator and contributes no value (gpt-oss). lse then includes it (docs/masks.md).
  std::span<const double> sinks{};
  /// Position of the first query when q_positions is not given (tokens already in the KV cache).
  std::int64_t q_offset = 0;
  /// Explicit positions [batch, q_len] / [batch, k_len]; override q_offset and 0..k_len-1.
  std::optional<positions_view> q_positions{};
  std::optional<positions_view> k_positions{};
  /// [batch, k_len], nonzero = padding key (never attended).
  std::optional<tensor_map<const std::int64_t, 2>> key_padding_mask{};
  /// [batch, k_len], Hugging Face's attention_mask: 1 = token, 0 = padding (other values are an error).
  std::optional<tensor_map<const std::int64_t, 2>> attention_mask{};
  /// Valid key count per batch row (size batch); keys j >= kv_lengths[b] are padding.
  std::span<const std::int64_t> kv_lengths{};
  /// Thread pool for (batch, head, query block) work items; null = the calling thread only. The decode
  /// strategy works on the calling thread too, with up to n - 1 of a pool's n threads.
  Eigen::ThreadPoolInterface* pool = nullptr;
  /// Tile sizes; 0 = the kernel's measured defaults.
  index_t q_block = 0;
  index_t k_block = 0;
  /// Strategy; automatic = chosen by shape (never by thread count).
  attention_path path = attention_path::automatic;
};

}  // namespace posenc
