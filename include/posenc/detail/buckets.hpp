// posenc/detail/buckets.hpp — log-spaced relative-position buckets whose boundaries are decided in
// float32, reproduced operation by operation so every bucket equals the canonical implementation's.
// Two families: T5 (t5_bucketizer) and DeBERTa (deberta_bucketizer, at the end of this file). Both
// fold their float32 constants once, never evaluate the log where the canonical code discards it,
// and saturate before any float -> integer conversion (saturate_to_int64).
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

/// A non-negative float32 bucket value as int64 (truncation), saturated at `limit` first: the value
/// may be anything up to +inf for far positions, and converting an out-of-range float to an integer
/// is undefined behaviour.
[[nodiscard]] inline std::int64_t saturate_to_int64(float v, std::int64_t limit) {
  return v >= static_cast<float>(limit) ? limit : static_cast<std::int64_t>(v);
}

/// |r| as unsigned, so that |INT64_MIN| is representable.
[[nodiscard]] inline std::uint64_t magnitude(std::int64_t r) {
  return r < 0 ? std::uint64_t(0) - static_cast<std::uint64_t>(r) : static_cast<std::uint64_t>(r);
}

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
      n = magnitude(r);
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
    const std::int64_t large = max_exact_ + saturate_to_int64(v, last);
    return static_cast<std::int32_t>(offset + (large < last ? large : last));
  }

  [[nodiscard]] bool bidirectional() const { return bidirectional_; }

 private:
  bool bidirectional_;
  std::int64_t nb_ = 0, max_exact_ = 0;
  float f_max_exact_ = 0, f_log_ratio_ = 0, f_span_ = 0;
};

/// DeBERTa's make_log_bucket_position (He et al. 2021, DeBERTa-v2/v3; Hugging Face
/// modeling_deberta_v2.py), for the relative position r = query_position - key_position. Golden
/// FORMAT.md 5.9 gives the float32 sequence implemented here (mid = position_buckets / 2):
///   |r| <= mid:  r                                                  (exact; HF's abs_pos = mid - 1
///                                                                    for |r| < mid only avoids log 0)
///   otherwise:   v = logf(f32(|r|) / f32(mid))                      (float32 division and log)
///                v = v / logf(f32((double)(max_position - 1) / mid))  (the ratio in double, rounded once)
///                v = v * f32(mid - 1)
///                sign(r) * (ceilf(v) + mid)
/// The result is not clipped: the caller maps it to a table row with clip(bucket + span, 0, 2 span - 1).
class deberta_bucketizer {
 public:
  deberta_bucketizer(index_t position_buckets, index_t max_position) {
    require(position_buckets >= 2, "position_buckets", "must be >= 2 when log buckets are used (<= 0: none)",
            position_buckets);
    require(position_buckets <= (index_t{1} << 30), "position_buckets", "must be <= 2^30", position_buckets);
    mid_ = position_buckets / 2;
    f_mid_ = static_cast<float>(mid_);
    f_log_ratio_ = std::log(static_cast<float>(static_cast<double>(max_position - 1) / static_cast<double>(mid_)));
    // A denominator <= 0 (max_position - 1 <= mid) would send every large bucket to +-inf or flip it.
    require(f_log_ratio_ > 0.0f, "max_relative_positions",
            "must exceed position_buckets / 2 + 1 (the log denominator log((max - 1) / mid) must be > 0)",
            max_position, " for position_buckets ", position_buckets);
    f_span_ = static_cast<float>(mid_ - 1);
  }

  /// Bucket of r = query_position - key_position (HF's value before the clip to the table).
  [[nodiscard]] std::int64_t operator()(std::int64_t r) const {
    const std::uint64_t n = magnitude(r);
    if (n <= static_cast<std::uint64_t>(mid_)) return r;
    float v = static_cast<float>(n) / f_mid_;
    v = std::log(v);
    v = v / f_log_ratio_;
    v = v * f_span_;
    // v > 0 here. Far beyond the table the value only needs to stay beyond it: saturate well inside
    // int64 before converting.
    const std::int64_t large = saturate_to_int64(std::ceil(v) + f_mid_, std::int64_t{1} << 40);
    return r > 0 ? large : -large;
  }

  [[nodiscard]] index_t mid() const { return mid_; }

 private:
  std::int64_t mid_ = 0;
  float f_mid_ = 0, f_log_ratio_ = 0, f_span_ = 0;
};

}  // namespace posenc::detail
