// posenc/rope_scaling.hpp — RoPE frequencies of every Hugging Face `rope_type`: inv_freq and the
// attention factor, in float64 and as Hugging Face's float32 code path computes them.
//
// Names and semantics follow transformers' modeling_rope_utils.py (`rope_scaling` /
// `rope_parameters` keys) and the normative summary in the golden vectors' FORMAT.md section 5.2.
// With d = rotary_dim, i = 0 .. d/2-1, theta_i = base^(-2i/d):
//   default   theta_i                                  (Su et al. 2021, RoFormer eq. 15)
//   linear    theta_i / factor                         (Chen et al. 2023, position interpolation)
//   dynamic   theta_i with base' = base (factor L/max_pos - (factor-1))^(d/(d-2)) when L > max_pos
//                                                      (bloc97's "dynamic NTK", HF _compute_dynamic_ntk_parameters)
//   yarn      ramp between theta_i/factor and theta_i over the correction range [low, high],
//             attention factor 0.1 ln(factor) + 1     (Peng et al. 2023, YaRN sec. 3.2-3.4)
//   longrope  1 / (ext_i base^(2i/d)), ext = long_factor if L > original else short_factor,
//             attention factor sqrt(1 + ln f / ln original)   (Ding et al. 2024, LongRoPE; Phi-3)
//   llama3    theta_i / factor for long wavelengths, theta_i for short ones, smooth in between
//                                                      (Meta Llama 3.1 reference code, apply_scaling)
//   proportional  theta_i / factor for the first R = floor(p d / 2) pairs, 0 for the rest (those dims
//             pass through), over the whole head (d = head_dim), p = partial_rotary_factor
//                                                      (Gemma 4's full-attention layers,
//                                                      HF _compute_proportional_rope_parameters)
// Everything here is stateless: the sequence length L of dynamic / longrope is an argument.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <string_view>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

/// HF `rope_type` (legacy key `type`). `default_` is HF's "default" (a C++ keyword).
enum class rope_type { default_, linear, dynamic, yarn, longrope, llama3, proportional };

/// HF's string ("default", "linear", "dynamic", "yarn", "longrope", "llama3"; "su" is longrope's old name).
[[nodiscard]] inline rope_type rope_type_from_string(std::string_view name) {
  if (name == "default") return rope_type::default_;
  if (name == "linear") return rope_type::linear;
  if (name == "dynamic") return rope_type::dynamic;
  if (name == "yarn") return rope_type::yarn;
  if (name == "longrope" || name == "su") return rope_type::longrope;
  if (name == "llama3") return rope_type::llama3;
  if (name == "proportional") return rope_type::proportional;
  throw error(detail::concat(
      "posenc: rope_type: must be one of default, linear, dynamic, yarn, longrope, llama3, proportional (got ", name,
      ")"));
}

[[nodiscard]] inline std::string_view to_string(rope_type t) {
  switch (t) {
    case rope_type::default_: return "default";
    case rope_type::linear: return "linear";
    case rope_type::dynamic: return "dynamic";
    case rope_type::yarn: return "yarn";
    case rope_type::longrope: return "longrope";
    case rope_type::llama3: return "llama3";
    case rope_type::proportional: return "proportional";
  }
  return "?";
}

/// HF `rope_scaling` / `rope_parameters`. Unset optionals are HF's `None` (the default is applied).
struct rope_scaling {
  posenc::rope_type rope_type = posenc::rope_type::default_;
  /// linear, dynamic, yarn, llama3: the context extension factor (> 0). longrope: optional.
  std::optional<double> factor{};
  /// yarn, llama3, longrope: the pretraining context; unset = the config's max_position_embeddings.
  std::optional<std::int64_t> original_max_position_embeddings{};
  /// yarn, longrope: overrides the computed attention factor (scales cos and sin).
  std::optional<double> attention_factor{};
  /// yarn: rotations per context for the correction range (0 or unset = 32 and 1, as HF).
  std::optional<double> beta_fast{}, beta_slow{};
  /// yarn: DeepSeek's mscale / mscale_all_dim (both non-zero: factor m(f, mscale) / m(f, mscale_all_dim)).
  std::optional<double> mscale{}, mscale_all_dim{};
  /// yarn: round the correction range outwards to whole dims (HF default true; gpt-oss uses false).
  bool truncate = true;
  /// llama3: wavelength thresholds original/low_freq_factor and original/high_freq_factor.
  std::optional<double> low_freq_factor{}, high_freq_factor{};
  /// longrope: per-pair rescale factors, rotary_dim/2 each.
  std::vector<double> short_factor{}, long_factor{};
};

namespace detail {

/// Everything the frequency formulas need, resolved from a rope_config.
struct rope_freq_params {
  index_t rotary_dim = 0;  ///< d (even, > 0)
  double base = 10000.0;
  /// proportional: the fraction p of the head's pairs that rotate (rope_config::partial_rotary_factor).
  double proportion = 1.0;
  std::optional<std::int64_t> max_position_embeddings{};
  rope_scaling scaling{};

  [[nodiscard]] index_t pairs() const { return rotary_dim / 2; }
  /// `orig` of FORMAT.md 5.2: original_max_position_embeddings, else max_position_embeddings.
  [[nodiscard]] std::optional<std::int64_t> original() const {
    return scaling.original_max_position_embeddings ? scaling.original_max_position_embeddings
                                                    : max_position_embeddings;
  }
  /// Whether inv_freq depends on the current sequence length.
  [[nodiscard]] bool uses_seq_len() const {
    return scaling.rope_type == rope_type::dynamic || scaling.rope_type == rope_type::longrope;
  }
};

inline void require_positive(const std::optional<double>& v, std::string_view name, bool needed) {
  if (!v) {
    require(!needed, name, "is required for this rope_type");
    return;
  }
  require(std::isfinite(*v) && *v > 0, name, "must be finite and > 0", *v);
}

/// Validate the scaling block against the resolved dims (throws posenc::error naming the key).
inline void validate(const rope_freq_params& p) {
  const rope_scaling& s = p.scaling;
  const rope_type t = s.rope_type;
  require(std::isfinite(p.base) && p.base > 0, "rope_theta", "must be finite and > 0", p.base);
  if (p.max_position_embeddings)
    require(*p.max_position_embeddings > 0, "max_position_embeddings", "must be > 0", *p.max_position_embeddings);
  if (s.original_max_position_embeddings)
    require(*s.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings",
            "must be > 0", *s.original_max_position_embeddings);
  const bool needs_factor = t == rope_type::linear || t == rope_type::dynamic || t == rope_type::yarn ||
                            t == rope_type::llama3;
  require_positive(s.factor, "rope_scaling.factor", needs_factor);
  require_positive(s.attention_factor, "rope_scaling.attention_factor", false);
  switch (t) {
    case rope_type::default_:
    case rope_type::linear: break;
    case rope_type::proportional:
      require(std::isfinite(p.proportion) && p.proportion > 0 && p.proportion <= 1, "partial_rotary_factor",
              "must be in (0, 1]", p.proportion);
      break;
    case rope_type::dynamic:
      require(p.max_position_embeddings.has_value(), "max_position_embeddings", "is required by rope_type dynamic");
      // base' has the exponent d/(d-2).
      require(p.rotary_dim > 2, "rotary_dim", "must be > 2 for rope_type dynamic", p.rotary_dim);
      break;
    case rope_type::yarn: {
      require(p.original().has_value(), "rope_scaling.original_max_position_embeddings",
              "is required by rope_type yarn (or max_position_embeddings)");
      // corr() divides by ln(base).
      require(p.base != 1.0, "rope_theta", "must not be 1 for rope_type yarn", p.base);
      for (auto [v, name] : {std::pair{s.beta_fast, "rope_scaling.beta_fast"}, std::pair{s.beta_slow, "rope_scaling.beta_slow"}})
        if (v) require(std::isfinite(*v) && *v >= 0, name, "must be finite and >= 0 (0 = default)", *v);
      for (auto [v, name] : {std::pair{s.mscale, "rope_scaling.mscale"}, std::pair{s.mscale_all_dim, "rope_scaling.mscale_all_dim"}})
        if (v) require(std::isfinite(*v), name, "must be finite", *v);
      break;
    }
    case rope_type::longrope: {
      require(p.original().has_value(), "rope_scaling.original_max_position_embeddings",
              "is required by rope_type longrope (or max_position_embeddings)");
      require(*p.original() > 1, "rope_scaling.original_max_position_embeddings",
              "must be > 1 for rope_type longrope (ln(original) divides)", *p.original());
      const auto n = static_cast<std::size_t>(p.pairs());
      require(s.short_factor.size() == n, "rope_scaling.short_factor", "must have rotary_dim/2 entries",
              s.short_factor.size(), " entries, rotary_dim/2 = ", n);
      require(s.long_factor.size() == n, "rope_scaling.long_factor", "must have rotary_dim/2 entries",
              s.long_factor.size(), " entries, rotary_dim/2 = ", n);
      for (std::size_t i = 0; i < n; ++i) {
        require(std::isfinite(s.short_factor[i]) && s.short_factor[i] > 0, "rope_scaling.short_factor",
                "entries must be finite and > 0", s.short_factor[i], " at index ", i);
        require(std::isfinite(s.long_factor[i]) && s.long_factor[i] > 0, "rope_scaling.long_factor",
                "entries must be finite and > 0", s.long_factor[i], " at index ", i);
      }
      if (!s.factor && !s.attention_factor)
        require(p.max_position_embeddings.has_value(), "max_position_embeddings",
                "is required by rope_type longrope when neither factor nor attention_factor is set");
      break;
    }
    case rope_type::llama3:
      require(p.original().has_value(), "rope_scaling.original_max_position_embeddings",
              "is required by rope_type llama3");
      require_positive(s.low_freq_factor, "rope_scaling.low_freq_factor", true);
      require_positive(s.high_freq_factor, "rope_scaling.high_freq_factor", true);
      require(*s.high_freq_factor > *s.low_freq_factor, "rope_scaling.high_freq_factor",
              "must be > low_freq_factor", *s.high_freq_factor, " <= ", *s.low_freq_factor);
      break;
  }
}

/// YaRN correction range [low, high] in pair indices (FORMAT.md 5.2; YaRN sec. 3.2 "NTK-by-parts":
/// the dim whose wavelength makes `n` rotations over the original context).
struct yarn_range {
  double low = 0, high = 0;
};
[[nodiscard]] inline yarn_range yarn_correction_range(const rope_freq_params& p) {
  const rope_scaling& s = p.scaling;
  const double d = static_cast<double>(p.rotary_dim);
  const double orig = static_cast<double>(*p.original());
  const double beta_fast = s.beta_fast && *s.beta_fast != 0 ? *s.beta_fast : 32.0;
  const double beta_slow = s.beta_slow && *s.beta_slow != 0 ? *s.beta_slow : 1.0;
  const auto corr = [&](double n) { return d * std::log(orig / (n * 2.0 * std::numbers::pi)) / (2.0 * std::log(p.base)); };
  double low = corr(beta_fast), high = corr(beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, d - 1);
  if (low == high) high += 0.001;  // HF: avoid a zero-width ramp
  return {low, high};
}

/// YaRN's m(s, k) = 0.1 k ln(s) + 1 for s > 1, else 1 (YaRN eq. 22; HF get_mscale).
[[nodiscard]] inline double yarn_mscale(double scale, double k) { return scale <= 1 ? 1.0 : 0.1 * k * std::log(scale) + 1.0; }

/// The factor that multiplies cos and sin (HF's attention_scaling).
[[nodiscard]] inline double attention_factor(const rope_freq_params& p) {
  const rope_scaling& s = p.scaling;
  switch (s.rope_type) {
    case rope_type::yarn: {
      if (s.attention_factor) return *s.attention_factor;
      const double f = *s.factor;
      if (s.mscale && s.mscale_all_dim && *s.mscale != 0 && *s.mscale_all_dim != 0)
        return yarn_mscale(f, *s.mscale) / yarn_mscale(f, *s.mscale_all_dim);
      return yarn_mscale(f, 1.0);
    }
    case rope_type::longrope: {
      if (s.attention_factor) return *s.attention_factor;
      const double orig = static_cast<double>(*p.original());
      const double f = s.factor ? *s.factor : static_cast<double>(*p.max_position_embeddings) / orig;
      return f <= 1 ? 1.0 : std::sqrt(1.0 + std::log(f) / std::log(orig));
    }
    default: return 1.0;
  }
}

/// Whether dynamic / longrope switch to their scaled frequencies at sequence length L (strictly
/// greater, FORMAT.md section 3).
[[nodiscard]] inline bool beyond_limit(const rope_freq_params& p, std::int64_t seq_len) {
  if (p.scaling.rope_type == rope_type::dynamic) return seq_len > *p.max_position_embeddings;
  if (p.scaling.rope_type == rope_type::longrope) return seq_len > *p.original();
  return false;
}

/// proportional: the pairs that rotate, int(p * d // 2) as Python computes it (a float floor-divided).
[[nodiscard]] inline index_t proportional_pairs(const rope_freq_params& p) {
  return std::min(p.pairs(), static_cast<index_t>(std::floor(p.proportion * static_cast<double>(p.rotary_dim) / 2.0)));
}

/// inv_freq in float64 for the current sequence length (ignored by types that do not use it).
[[nodiscard]] inline std::vector<double> inv_freq(const rope_freq_params& p, std::int64_t seq_len) {
  const index_t n = p.pairs();
  const double d = static_cast<double>(p.rotary_dim);
  const rope_scaling& s = p.scaling;
  const auto theta = [&](double base, index_t i) { return 1.0 / std::pow(base, static_cast<double>(2 * i) / d); };
  std::vector<double> f(static_cast<std::size_t>(n));
  switch (s.rope_type) {
    case rope_type::default_:
      for (index_t i = 0; i < n; ++i) f[i] = theta(p.base, i);
      break;
    case rope_type::linear:
      for (index_t i = 0; i < n; ++i) f[i] = theta(p.base, i) / *s.factor;
      break;
    case rope_type::proportional:  // the tail stays 0: cos 1, sin 0
      for (index_t i = 0; i < proportional_pairs(p); ++i) f[i] = theta(p.base, i) / s.factor.value_or(1.0);
      break;
    case rope_type::dynamic: {
      double base = p.base;
      if (beyond_limit(p, seq_len)) {
        const double L = static_cast<double>(seq_len), mpe = static_cast<double>(*p.max_position_embeddings);
        base = p.base * std::pow(*s.factor * L / mpe - (*s.factor - 1.0), d / (d - 2.0));
      }
      for (index_t i = 0; i < n; ++i) f[i] = theta(base, i);
      break;
    }
    case rope_type::yarn: {
      const yarn_range r = yarn_correction_range(p);
      for (index_t i = 0; i < n; ++i) {
        const double t = theta(p.base, i);
        const double ramp = std::clamp((static_cast<double>(i) - r.low) / (r.high - r.low), 0.0, 1.0);
        const double w = 1.0 - ramp;  // extrapolation weight: 1 for high frequencies (kept), 0 for low
        f[i] = (t / *s.factor) * (1.0 - w) + t * w;
      }
      break;
    }
    case rope_type::longrope: {
      const std::vector<double>& ext = beyond_limit(p, seq_len) ? s.long_factor : s.short_factor;
      for (index_t i = 0; i < n; ++i) f[i] = 1.0 / (ext[i] * std::pow(p.base, static_cast<double>(2 * i) / d));
      break;
    }
    case rope_type::llama3: {
      const double orig = static_cast<double>(*p.original());
      const double lo = *s.low_freq_factor, hi = *s.high_freq_factor;
      const double low_wl = orig / lo, high_wl = orig / hi;
      for (index_t i = 0; i < n; ++i) {
        const double t = theta(p.base, i);
        const double wl = 2.0 * std::numbers::pi / t;
        if (wl > low_wl) {
          f[i] = t / *s.factor;
        } else if (wl < high_wl) {
          f[i] = t;
        } else {
          const double sm = (orig / wl - lo) / (hi - lo);
          f[i] = (1.0 - sm) * t / *s.factor + sm * t;
        }
      }
      break;
    }
  }
  return f;
}

/// a * b rounded to float32 on its own. HF's tensor ops round every product, but a compiler may fuse
/// `a * b + c` into one FMA (g++ does by default); the volatile keeps the product a separate rounding.
/// Only used where inv_freq is built (once per configuration), never in the rotate loops.
[[nodiscard]] inline float rounded_mul(float a, float b) {
  volatile float p = a * b;
  return p;
}

/// inv_freq as Hugging Face computes it in float32 (modeling_rope_utils.py): the exponent
/// float32(arange(0, d, 2)) / d in float32, float32 pow of float32(base), float32 reciprocal, and the
/// scaling arithmetic on float32 tensors with Python scalars rounded to float32. Used only by
/// rope_angles::hf_float32 (checkpoint parity).
[[nodiscard]] inline std::vector<float> inv_freq_hf_float32(const rope_freq_params& p, std::int64_t seq_len) {
  const index_t n = p.pairs();
  const float d = static_cast<float>(p.rotary_dim);
  const rope_scaling& s = p.scaling;
  // base ** (arange(0, dim, 2).float() / dim): one float32 division, one float32 pow.
  const auto pos_freq = [&](double base, index_t i) {
    return std::pow(static_cast<float>(base), static_cast<float>(2 * i) / d);
  };
  std::vector<float> f(static_cast<std::size_t>(n));
  switch (s.rope_type) {
    case rope_type::default_:
      for (index_t i = 0; i < n; ++i) f[i] = 1.0f / pos_freq(p.base, i);
      break;
    case rope_type::linear: {
      const float factor = static_cast<float>(*s.factor);
      for (index_t i = 0; i < n; ++i) f[i] = (1.0f / pos_freq(p.base, i)) / factor;
      break;
    }
    case rope_type::proportional: {  // inv_freq /= factor on the float32 tensor, zeros for the rest
      const float factor = static_cast<float>(s.factor.value_or(1.0));
      for (index_t i = 0; i < proportional_pairs(p); ++i) f[i] = (1.0f / pos_freq(p.base, i)) / factor;
      break;
    }
    case rope_type::dynamic: {
      // HF's forward passes seq_len as a 0-dim int64 tensor, so the new base is float32 tensor
      // arithmetic: factor * L / max_pos - (factor - 1), ** (d / (d - 2)), * base, each rounded to float32.
      float base = static_cast<float>(p.base);
      if (beyond_limit(p, seq_len)) {
        const float L = static_cast<float>(seq_len), mpe = static_cast<float>(*p.max_position_embeddings);
        const double dd = static_cast<double>(p.rotary_dim);
        const float ratio = (static_cast<float>(*s.factor) * L) / mpe - static_cast<float>(*s.factor - 1.0);
        base = base * std::pow(ratio, static_cast<float>(dd / (dd - 2.0)));
      }
      for (index_t i = 0; i < n; ++i) f[i] = 1.0f / pos_freq(base, i);
      break;
    }
    case rope_type::yarn: {
      const yarn_range r = yarn_correction_range(p);  // Python floats
      const float factor = static_cast<float>(*s.factor);
      const float low = static_cast<float>(r.low), width = static_cast<float>(r.high - r.low);
      for (index_t i = 0; i < n; ++i) {
        const float pf = pos_freq(p.base, i);
        const float extrapolation = 1.0f / pf;
        const float interpolation = 1.0f / (factor * pf);
        const float ramp = std::clamp((static_cast<float>(i) - low) / width, 0.0f, 1.0f);
        const float w = 1.0f - ramp;
        f[i] = rounded_mul(interpolation, 1.0f - w) + rounded_mul(extrapolation, w);
      }
      break;
    }
    case rope_type::longrope: {
      const std::vector<double>& ext = beyond_limit(p, seq_len) ? s.long_factor : s.short_factor;
      for (index_t i = 0; i < n; ++i) {
        const float denom = static_cast<float>(ext[i]) * pos_freq(p.base, i);
        f[i] = 1.0f / denom;
      }
      break;
    }
    case rope_type::llama3: {
      const float factor = static_cast<float>(*s.factor);
      const float orig = static_cast<float>(*p.original());
      const double orig_d = static_cast<double>(*p.original());
      const float low_wl = static_cast<float>(orig_d / *s.low_freq_factor);
      const float high_wl = static_cast<float>(orig_d / *s.high_freq_factor);
      const float two_pi = static_cast<float>(2.0 * std::numbers::pi);
      const float hi_minus_lo = static_cast<float>(*s.high_freq_factor - *s.low_freq_factor);
      for (index_t i = 0; i < n; ++i) {
        const float t = 1.0f / pos_freq(p.base, i);
        // torch's scalar / tensor is tensor.reciprocal() * scalar.
        const float wl = (1.0f / t) * two_pi;
        const float scaled = wl > low_wl ? t / factor : t;
        if (!(wl < high_wl) && !(wl > low_wl)) {
          const float sm = (rounded_mul(1.0f / wl, orig) - static_cast<float>(*s.low_freq_factor)) / hi_minus_lo;
          f[i] = rounded_mul(1.0f - sm, scaled) / factor + rounded_mul(sm, scaled);
        } else {
          f[i] = scaled;
        }
      }
      break;
    }
  }
  return f;
}

}  // namespace detail
}  // namespace posenc
