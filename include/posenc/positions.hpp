// posenc/positions.hpp — explicit per-token positions.
//
// Every encoding takes positions as int64 per token, [batch, seq], instead of assuming 0..S-1:
// that is what KV-cache decoding (an offset), packed sequences (restarts) and left padding
// (shifted starts) need, and it is what Hugging Face passes as `position_ids`.
#pragma once

#include <cstdint>
#include <span>

#include "posenc/tensor.hpp"

namespace posenc {

/// Read-only view of positions [batch, seq].
using positions_view = tensor_map<const std::int64_t, 2>;
/// Owning positions [batch, seq], row-major (what the helpers below return).
using positions = Eigen::Tensor<std::int64_t, 2, Eigen::RowMajor>;

/// View an owning positions tensor.
[[nodiscard]] inline positions_view view(const positions& p) {
  return positions_view(p.data(), p.dimension(0), p.dimension(1));
}

/// offset, offset+1, ..., offset+seq-1 in every batch row (prefill at offset 0; a decode step
/// after `offset` cached tokens).
[[nodiscard]] inline positions contiguous_positions(index_t batch, index_t seq, std::int64_t offset = 0) {
  require(batch >= 0, "batch", "must be >= 0", batch);
  require(seq >= 0, "seq", "must be >= 0", seq);
  positions p(batch, seq);
  for (index_t b = 0; b < batch; ++b)
    for (index_t s = 0; s < seq; ++s) p(b, s) = offset + s;
  return p;
}

/// Packed sequences (flash-attn's varlen convention): cu_seqlens = [0, n0, n0+n1, ...] holds the
/// cumulative lengths; the result is one row [1, cu_seqlens.back()] whose positions restart at 0 at
/// every boundary.
[[nodiscard]] inline positions positions_from_cu_seqlens(std::span<const std::int64_t> cu_seqlens) {
  require(!cu_seqlens.empty(), "cu_seqlens", "must hold at least one entry");
  require(cu_seqlens.front() == 0, "cu_seqlens", "must start at 0", cu_seqlens.front());
  for (std::size_t i = 1; i < cu_seqlens.size(); ++i)
    require(cu_seqlens[i] >= cu_seqlens[i - 1], "cu_seqlens", "must be non-decreasing", cu_seqlens[i - 1], " then ",
            cu_seqlens[i], " at index ", i);
  positions p(1, cu_seqlens.back());
  for (std::size_t i = 1; i < cu_seqlens.size(); ++i)
    for (std::int64_t t = cu_seqlens[i - 1]; t < cu_seqlens[i]; ++t) p(0, t) = t - cu_seqlens[i - 1];
  return p;
}

/// Checks that a Hugging Face attention_mask holds only 0 (padding) and 1 (token) (posenc::error).
inline void check_attention_mask(tensor_map<const std::int64_t, 2> attention_mask) {
  for (index_t b = 0; b < attention_mask.dimension(0); ++b)
    for (index_t s = 0; s < attention_mask.dimension(1); ++s)
      require(attention_mask(b, s) == 0 || attention_mask(b, s) == 1, "attention_mask",
              "entries must be 0 or 1 (1 = token, 0 = padding)", attention_mask(b, s), " at [", b, ", ", s, "]");
}

/// Left-padded batches (Hugging Face's generate): positions = cumsum(mask) - 1 over each row, so the
/// first real token is at 0 whatever the padding before it. `attention_mask` is [batch, seq] with
/// 1 = real token, 0 = padding (HF's convention). Padding slots get position 1, as HF's
/// `position_ids.masked_fill_(attention_mask == 0, 1)` does; they are masked out of attention anyway.
[[nodiscard]] inline positions positions_from_attention_mask(tensor_map<const std::int64_t, 2> attention_mask) {
  const index_t batch = attention_mask.dimension(0), seq = attention_mask.dimension(1);
  check_attention_mask(attention_mask);
  positions p(batch, seq);
  for (index_t b = 0; b < batch; ++b) {
    std::int64_t count = 0;
    for (index_t s = 0; s < seq; ++s) {
      count += attention_mask(b, s);
      p(b, s) = attention_mask(b, s) != 0 ? count - 1 : 1;
    }
  }
  return p;
}

/// max(positions) + 1 over the whole tensor (all batch rows): the "current sequence length" that
/// HF's dynamic NTK and LongRoPE use. 0 for an empty tensor.
[[nodiscard]] inline std::int64_t sequence_length(positions_view p) {
  std::int64_t m = -1;
  for (index_t i = 0; i < p.size(); ++i) m = p.data()[i] > m ? p.data()[i] : m;
  return m + 1;
}

}  // namespace posenc
