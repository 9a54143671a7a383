// posenc/detail/rope_kernels.hpp — the RoPE inner loops: angle -> (cos, sin) and the pair rotation.
//
// A rotation by angle a of the pair (x1, x2) is (x1 cos a - x2 sin a, x2 cos a + x1 sin a)
// (RoFormer eq. 13-15). The cos/sin of one token are computed once into a small "row" and applied to
// every head of that token, so the rotate loops below only stream x: they are contiguous,
// branch-free and vectorize with g++/clang++ -O3 -march=native (docs/rope.md has the -fopt-info-vec
// evidence). A row holds, per layout:
//   half        [cos_0 .. cos_{h-1} | sin_0 .. sin_{h-1}]            (h = rotary_dim/2)
//   interleaved [cos_0 cos_0 cos_1 cos_1 .. | -sin_0 +sin_0 -sin_1 +sin_1 ..]
// so the interleaved loop needs no shuffles of cos/sin: out[2k] = x[2k] c - x[2k+1] s and
// out[2k+1] = x[2k+1] c + x[2k] s become out[j] = x[j] cc[j] + x[j^1] ss[j].
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "posenc/tensor.hpp"

namespace posenc::detail {

/// Reduce a (double) angle to [-pi, pi] by an integer number of turns, Cody-Waite style: 2 pi is
/// split into c1 = float(2 pi) (24 significant bits, so k * c1 is exact for |k| < 2^29) and the
/// double remainder c2, which keeps the reduction error near 1e-16 for |a| up to ~1e9 (positions up to
/// 2^24 times inv_freq <= 1 give |a| < 2^24).
[[nodiscard]] inline double reduce_turns(double a) {
  constexpr double two_pi = 2.0 * std::numbers::pi;
  constexpr double c1 = static_cast<double>(static_cast<float>(two_pi));
  constexpr double c2 = two_pi - c1;  // exact in double: two_pi and c1 share the leading bits
  constexpr double inv_two_pi = 1.0 / two_pi;
  const double k = std::nearbyint(a * inv_two_pi);
  return (a - k * c1) - k * c2;
}

/// Row width for a rotary dim d: half stores d values (h cos + h sin), interleaved 2d (duplicated).
[[nodiscard]] inline index row_width(index rotary_dim, bool interleaved) {
  return interleaved ? 2 * rotary_dim : rotary_dim;
}

/// Write one row from cos/sin values of the h pairs, times `scale` (the attention factor, or 1 when the
/// values already carry it).
template <class T, class Src>
inline void store_row(const Src* c, const Src* s, Src scale, index h, bool interleaved, T* row) {
  if (!interleaved) {
    for (index k = 0; k < h; ++k) {
      row[k] = static_cast<T>(c[k] * scale);
      row[h + k] = static_cast<T>(s[k] * scale);
    }
  } else {
    T* cc = row;
    T* ss = row + 2 * h;
    for (index k = 0; k < h; ++k) {
      cc[2 * k] = cc[2 * k + 1] = static_cast<T>(c[k] * scale);
      ss[2 * k] = static_cast<T>(-(s[k] * scale));
      ss[2 * k + 1] = static_cast<T>(s[k] * scale);
    }
  }
}

/// cos/sin of position * inv_freq for h pairs, the exact way (rope_angles::exact): the angle is formed
/// in double; for T = double it goes to the double cos/sin directly (glibc reduces exactly), for
/// T = float it is first reduced mod 2 pi in double and then the float cos/sin run on |r| <= pi, so the
/// only float error is the final rounding (~6e-8) at any position.
template <class T>
inline void angles_exact(double position, const double* inv_freq, double scale, index h, T* c, T* s) {
  for (index k = 0; k < h; ++k) {
    const double a = position * inv_freq[k];
    if constexpr (std::is_same_v<T, double>) {
      c[k] = std::cos(a) * scale;
      s[k] = std::sin(a) * scale;
    } else {
      const float r = static_cast<float>(reduce_turns(a));
      c[k] = static_cast<T>(static_cast<double>(std::cos(r)) * scale);
      s[k] = static_cast<T>(static_cast<double>(std::sin(r)) * scale);
    }
  }
}

/// cos/sin in double of consecutive positions first .. first+count-1, for tables. Libm's cos/sin cost
/// ~15-30 ns per pair, so they run only at anchors (every `anchor` positions); in between, the angle
/// addition theorem steps by one position with two multiply-adds per value,
///   cos(a + t) = cos a cos t - sin a sin t,   sin(a + t) = sin a cos t + cos a sin t   (t = inv_freq_k),
/// a loop over the pairs that vectorizes. Each step adds ~2 ulp, so values stay within ~1e-14 of
/// cos/sin(position * inv_freq). emit(t, c, s) receives the h values of position first + t.
template <class Emit>
inline void angles_double_run(std::int64_t first, index count, const double* inv_freq, index h, Emit&& emit) {
  constexpr index anchor = 32;
  std::vector<double> buf(static_cast<std::size_t>(4 * h));
  double* __restrict c = buf.data();
  double* __restrict s = c + h;
  double* __restrict c1 = s + h;
  double* __restrict s1 = c1 + h;
  for (index k = 0; k < h; ++k) {
    c1[k] = std::cos(inv_freq[k]);
    s1[k] = std::sin(inv_freq[k]);
  }
  for (index t = 0; t < count; ++t) {
    if (t % anchor == 0) {
      const double p = static_cast<double>(first + t);
      for (index k = 0; k < h; ++k) {
        c[k] = std::cos(p * inv_freq[k]);
        s[k] = std::sin(p * inv_freq[k]);
      }
    } else {
      for (index k = 0; k < h; ++k) {
        const double cn = c[k] * c1[k] - s[k] * s1[k];
        s[k] = s[k] * c1[k] + c[k] * s1[k];
        c[k] = cn;
      }
    }
    emit(t, static_cast<const double*>(c), static_cast<const double*>(s));
  }
}

/// Hugging Face's float32 path (rope_angles::hf_float32): angle = float32(position) * inv_freq rounded to
/// float32 once, float32 cos/sin, then `* attention_scaling` in float32.
inline void angles_hf_float32(std::int64_t position, const float* inv_freq, double scale, index h, float* c, float* s) {
  const float p = static_cast<float>(position);
  const float sc = static_cast<float>(scale);
  for (index k = 0; k < h; ++k) {
    const float a = p * inv_freq[k];
    c[k] = std::cos(a) * sc;
    s[k] = std::sin(a) * sc;
  }
}

// ---- rotate loops --------------------------------------------------------------------------------
// `row` as described at the top; d = rotary_dim, D = head_dim. Features d..D-1 pass through.

/// Half layout, in place: pairs (k, k + h). lo/hi are disjoint halves, hence __restrict.
template <class T>
inline void rotate_half_inplace(T* __restrict lo, T* __restrict hi, const T* __restrict c, const T* __restrict s,
                                index h) {
  for (index k = 0; k < h; ++k) {
    const T x1 = lo[k], x2 = hi[k];
    lo[k] = x1 * c[k] - x2 * s[k];
    hi[k] = x2 * c[k] + x1 * s[k];
  }
}

/// Half layout, out of place.
template <class T>
inline void rotate_half_copy(const T* __restrict in, T* __restrict out, const T* __restrict c,
                             const T* __restrict s, index h) {
  for (index k = 0; k < h; ++k) {
    const T x1 = in[k], x2 = in[h + k];
    out[k] = x1 * c[k] - x2 * s[k];
    out[h + k] = x2 * c[k] + x1 * s[k];
  }
}

// Interleaved layout: out[j] = x[j] cc[j] + x[j^1] ss[j]. Written as the natural pair loop, both
// compilers treat x, cc and ss as stride-2 groups and fully de- and re-interleave them (8 permutes
// per 16 floats, measured 35-50 % slower than the half layout). Written per block of 16 values with
// the in-pair swap spelled out, the block is straight-line code that the SLP vectorizer turns into
// one in-lane shuffle (vpermilps 0xB1) plus a multiply and an FMA per vector; the block loop itself
// must not be loop-vectorized (clang would gather across blocks), hence the pragma.
inline constexpr index interleaved_block = 16;

/// Interleaved layout: out = rotated in. out may be in (in place): each block is loaded whole before
/// it is stored, so in and out carry no __restrict (the SLP vectorization of the block does not
/// need it, verified with -Rpass=slp-vectorizer, docs/rope.md).
template <class T>
inline void rotate_interleaved(const T* in, T* out, const T* __restrict cc, const T* __restrict ss, index h) {
  constexpr index B = interleaved_block;
  const index n = 2 * h;
  index j0 = 0;
#if defined(__clang__)
#pragma clang loop vectorize(disable) interleave(disable)
#endif
  for (; j0 + B <= n; j0 += B) {
    T v[B], sw[B];
    for (index j = 0; j < B; ++j) v[j] = in[j0 + j];
    for (index j = 0; j < B; ++j) sw[j] = v[j ^ 1];
    for (index j = 0; j < B; ++j) out[j0 + j] = v[j] * cc[j0 + j] + sw[j] * ss[j0 + j];
  }
  for (; j0 < n; j0 += 2) {
    const T a = in[j0], b = in[j0 + 1];
    out[j0] = a * cc[j0] + b * ss[j0];
    out[j0 + 1] = b * cc[j0 + 1] + a * ss[j0 + 1];
  }
}

/// Rotate one head vector in place with a prepared row.
template <class T>
inline void rotate_row_inplace(T* x, const T* row, index rotary_dim, bool interleaved) {
  const index h = rotary_dim / 2;
  if (interleaved) rotate_interleaved(x, x, row, row + rotary_dim, h);
  else rotate_half_inplace(x, x + h, row, row + h, h);
}

/// Rotate one head vector out of place (in and out must not overlap) and copy the pass-through tail.
template <class T>
inline void rotate_row_copy(const T* in, T* out, const T* row, index rotary_dim, index head_dim, bool interleaved) {
  const index h = rotary_dim / 2;
  if (interleaved) rotate_interleaved(in, out, row, row + rotary_dim, h);
  else rotate_half_copy(in, out, row, row + h, h);
  for (index j = rotary_dim; j < head_dim; ++j) out[j] = in[j];
}

}  // namespace posenc::detail
