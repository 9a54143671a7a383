// posenc/detail/sinusoid.hpp — the sinusoid mechanics shared by every family that writes
// sin/cos of "position x frequency" rows: the absolute sinusoidal encoding (sinusoidal.hpp) and,
// later, Transformer-XL's relative table R (which is the concat layout of the same rows).
//
// Two frequency schedules exist in the canonical code:
//   vaswani  w_i = base^(-2i/d_model)                (Vaswani et al. 2017, sec. 3.5; Transformer-XL's
//                                                     inv_freq = 1/base^(arange(0, d, 2)/d))
//   t2t      w_i = exp(-i ln(base) / max(n-1, 1))    (tensor2tensor get_timing_signal_1d, fairseq's
//                                                     SinusoidalPositionalEmbedding), n = d_model/2
// and three layouts of a row:
//   interleaved     [sin w0, cos w0, sin w1, cos w1, ...]   (Vaswani; HF create_sinusoidal_embeddings)
//   concat          [sin w0 .. sin w(n-1) | cos w0 .. cos w(n-1)]   (tensor2tensor, Transformer-XL)
//   concat_cos_sin  [cos w0 .. cos w(n-1) | sin w0 .. sin w(n-1)]   (MusicGen)
// With an odd d_model there are n = d_model/2 (rounded down) frequencies and the last channel is
// zero, as tensor2tensor/fairseq pad it (golden FORMAT.md 5.1).
//
// Angles are formed in double (position * w_i) whatever the output type: a float angle loses
// ~1e-7 * position radians, which is already visible at position 1e4 (FORMAT.md sec. 4).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

/// Order of the sin and cos channels in a row.
enum class sinusoid_layout {
  interleaved,  ///< [sin w0, cos w0, sin w1, cos w1, ...]
  concat,       ///< [sin w0 .. sin w(n-1), cos w0 .. cos w(n-1)]
  /// [cos w0 .. cos w(n-1), sin w0 .. sin w(n-1)]: MusicGen's get_embedding (torch.cat([cos, sin])).
  concat_cos_sin,
};

/// How the n = d_model/2 frequencies are spaced.
enum class frequency_schedule {
  vaswani,  ///< w_i = base^(-2i/d_model)
  t2t,      ///< w_i = exp(-i ln(base) / max(n-1, 1))
};

/// How the angle position x w_i and its sin / cos are evaluated.
enum class sinusoid_angles {
  /// In double, rounded once to the output type (the reference: golden FORMAT.md 5.1; NumPy-built
  /// tables such as Marian's and Pegasus's).
  exact,
  /// PyTorch's float32 path, as the fairseq-style tables of M2M100 / NLLB, XGLM, Speech2Text and FSMT
  /// compute them (get_embedding): w_i = exp(float(k) * float(-ln(base) / m)) in float (k, m = i, n - 1 for
  /// t2t; 2i, d_model for vaswani, as PyTorch's PositionalEncoding tutorial writes it), the angle
  /// float(position) * w_i rounded to float, sin / cos in float. A float angle is off by up to ~6e-8 x
  /// position radians, so these rows differ from exact ones by up to 1.4e-4 at positions near 2000 (d_model
  /// 1024): the table the model was trained with. PyTorch's vectorized exp, sin and cos are within an ulp of
  /// the correctly rounded ones used here, so a frequency may differ from the model's by an ulp.
  float32,
};

namespace detail {

/// The channels of frequency i's sin and cos in a row of n frequencies.
struct sinusoid_channels {
  index_t sin, cos;
};
[[nodiscard]] inline sinusoid_channels channels_of(sinusoid_layout layout, index_t i, index_t n) {
  switch (layout) {
    case sinusoid_layout::interleaved:
      return {2 * i, 2 * i + 1};
    case sinusoid_layout::concat:
      return {i, n + i};
    case sinusoid_layout::concat_cos_sin:
      return {n + i, i};
  }
  return {i, n + i};
}

/// The n = d_model/2 angular frequencies of a sinusoid row (checked arguments).
[[nodiscard]] inline std::vector<double> sinusoid_frequencies(index_t d_model, double base, frequency_schedule schedule) {
  require(d_model > 0, "d_model", "must be > 0", d_model);
  require(std::isfinite(base) && base > 0.0, "base", "must be finite and > 0", base);
  const index_t n = d_model / 2;
  std::vector<double> w(static_cast<std::size_t>(n));
  const double log_base = std::log(base);
  for (index_t i = 0; i < n; ++i) {
    if (schedule == frequency_schedule::vaswani) {
      // base^(-2i/d): the exponent in double, as NumPy's/PyTorch's `base ** (arange(0, d, 2) / d)`.
      w[static_cast<std::size_t>(i)] = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d_model));
    } else {
      const double denom = static_cast<double>(n - 1 > 1 ? n - 1 : 1);
      w[static_cast<std::size_t>(i)] = std::exp(-static_cast<double>(i) * log_base / denom);
    }
  }
  return w;
}

/// Write (or, with Accumulate, add) the row of `position` into out[0 .. d_model): the angle
/// position * w_i and its sin/cos in the frequencies' type W, one rounding to T at the end. W = double is
/// the exact row; W = float the float32 path (sinusoid_angles::float32: the position rounded to float, the
/// angle rounded to float).
template <bool Accumulate, class W, class T>
void sinusoid_row_in(double position, std::span<const W> w, sinusoid_layout layout, index_t d_model, T* out) {
  const index_t n = static_cast<index_t>(w.size());
  const W p = static_cast<W>(position);
  for (index_t i = 0; i < n; ++i) {
    const W a = p * w[static_cast<std::size_t>(i)];
    const T s = static_cast<T>(std::sin(a)), c = static_cast<T>(std::cos(a));
    const auto [is, ic] = channels_of(layout, i, n);
    if constexpr (Accumulate) {
      out[is] += s;
      out[ic] += c;
    } else {
      out[is] = s;
      out[ic] = c;
    }
  }
  // Odd d_model: the zero channel last (adding zero leaves it unchanged).
  if constexpr (!Accumulate) {
    if (2 * n < d_model) out[d_model - 1] = T(0);
  }
}

/// sinusoid_row_in with double frequencies (sinusoid_frequencies): the exact row.
template <bool Accumulate, class T>
void sinusoid_row(double position, std::span<const double> w, sinusoid_layout layout, index_t d_model, T* out) {
  sinusoid_row_in<Accumulate>(position, w, layout, d_model, out);
}

/// sinusoid_row_in with float frequencies (sinusoid_frequencies_f32): the float32 path.
template <bool Accumulate, class T>
void sinusoid_row(double position, std::span<const float> w, sinusoid_layout layout, index_t d_model, T* out) {
  sinusoid_row_in<Accumulate>(position, w, layout, d_model, out);
}

/// The n = d_model/2 frequencies as PyTorch's float32 code computes them (sinusoid_angles::float32).
[[nodiscard]] inline std::vector<float> sinusoid_frequencies_f32(index_t d_model, double base,
                                                                 frequency_schedule schedule) {
  require(d_model > 0, "d_model", "must be > 0", d_model);
  require(std::isfinite(base) && base > 0.0, "base", "must be finite and > 0", base);
  const index_t n = d_model / 2;
  // the Python scalar -ln(base) / m meets a float32 tensor: PyTorch rounds it to float before the multiply
  const bool t2t = schedule == frequency_schedule::t2t;
  const double m = t2t ? static_cast<double>(n - 1 > 1 ? n - 1 : 1) : static_cast<double>(d_model);
  const float step = static_cast<float>(-std::log(base) / m);
  std::vector<float> w(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) w[static_cast<std::size_t>(i)] = std::exp(static_cast<float>(t2t ? i : 2 * i) * step);
  return w;
}

/// Write the row of the angles whose sines and cosines are sn[i], cs[i] (i < n) into out[0 .. d_model).
template <class T>
void sinusoid_row_from(const double* sn, const double* cs, index_t n, sinusoid_layout layout, index_t d_model, T* out) {
  // channels_of is affine in i: the first channels and a stride of 2 (interleaved) or 1 (two halves)
  const auto [s0, c0] = channels_of(layout, 0, n);
  const index_t step = layout == sinusoid_layout::interleaved ? 2 : 1;
  for (index_t i = 0; i < n; ++i) out[s0 + step * i] = static_cast<T>(sn[i]);
  for (index_t i = 0; i < n; ++i) out[c0 + step * i] = static_cast<T>(cs[i]);
  if (2 * n < d_model) out[d_model - 1] = T(0);
}

/// Rows of consecutive positions p, p+1, ... by rotation: (sin, cos)((p+1)w) is (sin, cos)(pw)
/// rotated by w — 4 multiply-adds per frequency instead of a sin and a cos. Each step adds about
/// one ulp of error, so the walk restarts from an exact sin/cos every `anchor_every` rows (error
/// <= ~2 * anchor_every ulp of 1, ~1.4e-14 for 32: far below float's resolution, which is the only
/// output type this path is used for; double outputs are computed exactly).
class sinusoid_walker {
 public:
  static constexpr int anchor_every = 32;

  explicit sinusoid_walker(std::span<const double> w)
      : w_(w), n_(static_cast<index_t>(w.size())), sn_(w.size()), cs_(w.size()), sw_(w.size()), cw_(w.size()) {
    for (std::size_t i = 0; i < w.size(); ++i) {
      sw_[i] = std::sin(w[i]);
      cw_[i] = std::cos(w[i]);
    }
  }

  /// Move to `position` (exactly, or by one rotation when it follows the previous one).
  void go(std::int64_t position) {
    if (valid_ && position == position_ + 1 && steps_ < anchor_every) {
      for (index_t i = 0; i < n_; ++i) {
        const double s = sn_[i], c = cs_[i];
        sn_[i] = s * cw_[i] + c * sw_[i];
        cs_[i] = c * cw_[i] - s * sw_[i];
      }
      ++steps_;
    } else {
      const double p = static_cast<double>(position);
      for (index_t i = 0; i < n_; ++i) {
        sn_[i] = std::sin(p * w_[i]);
        cs_[i] = std::cos(p * w_[i]);
      }
      steps_ = 0;
      valid_ = true;
    }
    position_ = position;
  }

  template <class T>
  void write(sinusoid_layout layout, index_t d_model, T* out) const {
    sinusoid_row_from(sn_.data(), cs_.data(), n_, layout, d_model, out);
  }

 private:
  std::span<const double> w_;
  index_t n_;
  std::vector<double> sn_, cs_, sw_, cw_;
  std::int64_t position_ = 0;
  int steps_ = 0;
  bool valid_ = false;
};

}  // namespace detail
}  // namespace posenc
