// posenc/detail/buckets.hpp — log-spaced relative-position buckets whose boundaries are decided in
// float32, reproduced operation by operation so every bucket equals the canonical implementation's.
//
// T5 (Raffel et al. 2020, sec. 2.1; Hugging Face modeling_t5.py T5Attention._relative_position_bucket),
// reused by TUPE's relative term. The relative position is r = key - query (positive: the key is in
// the future). Golden FORMAT.md 5.5 gives the float32 sequence implemented here:
//   bidirectional:  nb = num_buckets/2, offset = (r > 0) ? nb : 0, n = |r|
//   unidirectional: nb = num_buckets,   offset = 0,              n = max(-r, 0)  (future -> bucket 0)
//   max_exact = nb/2
//   n <  max_exact:  offset + n                                  (exact buckets, no log evaluated)
//   n >= max_exact:  v = f32(n) / f32(max_exact)                 (float32 division)
//                    v = logf(v)
//                    v = v / f32(ln((double)max_distance / max_exact))
//                    v = v * f32(nb - max_exact)
//                    offset + min(max_exact + (int64)trunc(v), nb - 1)
// The log is never evaluated below max_exact: at n = 0 it would be -inf, and converting -inf to an
// integer is undefined behaviour (PyTorch gets away with it only because torch.where discards it).
#pragma once

#include <cmath>
#include <cstdint>

#include "posenc/error.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

/// T5's bucket function with its float32 constants folded once.
class t5_bucketizer {
 public:
  t5_bucketizer(index_t num_buckets, index_t max_distance, bool bidirectional) : bidirectional_(bidirectional) {
    require(num_buckets >= (bidirectional ? 4 : 2), "num_buckets",
            bidirectional ? "must be >= 4 for bidirectional buckets (2 exact buckets per direction)"
                          : "must be >= 2 for unidirectional buckets",
            num_buckets);
    require(num_buckets <= (index_t{1} << 30), "num_buckets", "must be <= 2^30", num_buckets);
    nb_ = bidirectional ? num_buckets / 2 : num_buckets;
    max_exact_ = nb_ / 2;
    // max_distance == max_exact would make the log denominator 0 and every large bucket +inf.
    require(max_distance > max_exact_, "max_distance",
            "must exceed the exact-bucket count num_buckets/4 "
            "(bidirectional) or num_buckets/2 (unidirectional)",
            max_distance, " <= ", max_exact_);
    f_max_exact_ = static_cast<float>(max_exact_);
    f_log_ratio_ = static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact_)));
    f_span_ = static_cast<float>(nb_ - max_exact_);
  }

  /// Bucket of the relative position r = key_position - query_position, in [0, num_buckets).
  [[nodiscard]] std::int32_t operator()(std::int64_t r) const {
    std::int64_t offset = 0;
    std::uint64_t n = 0;  // unsigned so |INT64_MIN| is representable
    if (bidirectional_) {
      offset = r > 0 ? nb_ : 0;
      n = r < 0 ? std::uint64_t(0) - static_cast<std::uint64_t>(r) : static_cast<std::uint64_t>(r);
    } else {
      n = r < 0 ? std::uint64_t(0) - static_cast<std::uint64_t>(r) : 0;
    }
    if (n < static_cast<std::uint64_t>(max_exact_))
      return static_cast<std::int32_t>(offset + static_cast<std::int64_t>(n));
    float v = static_cast<float>(n) / f_max_exact_;
    v = std::log(v);
    v = v / f_log_ratio_;
    v = v * f_span_;
    // v >= 0 here; anything at or beyond the last bucket saturates (and never reaches an
    // out-of-range float -> integer conversion).
    const std::int64_t last = nb_ - 1;
    const std::int64_t large = v >= static_cast<float>(last) ? last : max_exact_ + static_cast<std::int64_t>(v);
    return static_cast<std::int32_t>(offset + (large < last ? large : last));
  }

  [[nodiscard]] bool bidirectional() const { return bidirectional_; }

 private:
  bool bidirectional_;
  std::int64_t nb_ = 0, max_exact_ = 0;
  float f_max_exact_ = 0, f_log_ratio_ = 0, f_span_ = 0;
};

}  // namespace posenc::detail
