// posenc/detail/rope_kernels.hpp — the RoPE inner loops: angle -> (cos, sin) and the pair rotation.
//
// A rotation by angle a of the pair (x1, x2) is (x1 cos a - x2 sin a, x2 cos a + x1 sin a)
// (RoFormer eq. 13-15). The cos/sin of one token are computed once into a small "row" and applied to
// every head of that token, so the rotate loops below only stream x: they are contiguous,
// branch-free and vectorize with g++/clang++ -O3 -march=native (docs/rope.md has the -fopt-info-vec
// evidence). A row holds rotary_dim values, per layout:
//   half        [cos_0 .. cos_{h-1} | sin_0 .. sin_{h-1}]            (h = rotary_dim/2)
//   interleaved [cos_0 sin_0 cos_1 sin_1 ..]                           (the pairs of x, in order)
// The interleaved row used to be [cos_0 cos_0 cos_1 cos_1 .. | -sin_0 +sin_0 ..] (twice the width, no
// cos/sin shuffles in the loop); inside attention the table rows come from memory for every head, and
// that width cost more than the two in-register duplications (docs/rope.md, Fused attention).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <vector>

#include "posenc/detail/platform.hpp"
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

/// Write one row from cos/sin values of the h pairs, times `scale` (the attention factor, or 1 when the
/// values already carry it).
template <class T, class Src>
inline void store_row(const Src* c, const Src* s, Src scale, index_t h, bool interleaved, T* row) {
  if (!interleaved) {
    for (index_t k = 0; k < h; ++k) {
      row[k] = static_cast<T>(c[k] * scale);
      row[h + k] = static_cast<T>(s[k] * scale);
    }
  } else {
    for (index_t k = 0; k < h; ++k) {
      row[2 * k] = static_cast<T>(c[k] * scale);
      row[2 * k + 1] = static_cast<T>(s[k] * scale);
    }
  }
}

/// cos/sin of position * inv_freq for h pairs, the exact way (rope_angles::exact): the angle is formed
/// in double; for T = double it goes to the double cos/sin directly (glibc reduces exactly), for
/// T = float it is first reduced mod 2 pi in double and then the float cos/sin run on |r| <= pi, so the
/// only float error is the final rounding (~6e-8) at any position.
template <class T>
inline void angles_exact(double position, const double* inv_freq, double scale, index_t h, T* c, T* s) {
  for (index_t k = 0; k < h; ++k) {
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
inline void angles_double_run(std::int64_t first, index_t count, const double* inv_freq, index_t h, Emit&& emit) {
  constexpr index_t anchor = 32;
  std::vector<double> buf(static_cast<std::size_t>(4 * h));
  double* __restrict c = buf.data();
  double* __restrict s = c + h;
  double* __restrict c1 = s + h;
  double* __restrict s1 = c1 + h;
  for (index_t k = 0; k < h; ++k) {
    c1[k] = std::cos(inv_freq[k]);
    s1[k] = std::sin(inv_freq[k]);
  }
  for (index_t t = 0; t < count; ++t) {
    if (t % anchor == 0) {
      const double p = static_cast<double>(first + t);
      for (index_t k = 0; k < h; ++k) {
        c[k] = std::cos(p * inv_freq[k]);
        s[k] = std::sin(p * inv_freq[k]);
      }
    } else {
      for (index_t k = 0; k < h; ++k) {
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
inline void angles_hf_float32(std::int64_t position, const float* inv_freq, double scale, index_t h, float* c, float* s) {
  const float p = static_cast<float>(position);
  const float sc = static_cast<float>(scale);
  for (index_t k = 0; k < h; ++k) {
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
                                index_t h) {
  for (index_t k = 0; k < h; ++k) {
    const T x1 = lo[k], x2 = hi[k];
    lo[k] = x1 * c[k] - x2 * s[k];
    hi[k] = x2 * c[k] + x1 * s[k];
  }
}

/// Half layout, out of place.
template <class T>
inline void rotate_half_copy(const T* __restrict in, T* __restrict out, const T* __restrict c,
                             const T* __restrict s, index_t h) {
  for (index_t k = 0; k < h; ++k) {
    const T x1 = in[k], x2 = in[h + k];
    out[k] = x1 * c[k] - x2 * s[k];
    out[h + k] = x2 * c[k] + x1 * s[k];
  }
}

// Interleaved layout, row [c_0 s_0 c_1 s_1 ..]: out[2k] = x[2k] c_k - x[2k+1] s_k and
// out[2k+1] = x[2k+1] c_k + x[2k] s_k, i.e. per 8-lane vector out = x * dup_even(row) +
// swap_pairs(x) * dup_odd(row) * (-1, +1, ..). Written as the natural pair loop, both compilers
// de- and re-interleave x (stride-2 groups, 8 permutes per 16 floats); written per block with the
// lane patterns as array indices, clang turns the duplications into gathers. So the block is spelled
// with GCC/Clang vector extensions (__builtin_shufflevector, both compilers since GCC 12): g++ 12 and
// clang++ 14 -O3 -march=native emit one vmovups of x and of the row, vpermilps $177 (pair swap),
// vmovsldup / vmovshdup (or vpermilps $160 / $245), two vmulps and one vfmadd per 8 floats; without
// AVX the same source becomes SSE shuffles. Other compilers (no POSENC_VECTOR_EXTENSIONS,
// detail/platform.hpp) run the scalar pair loop.
// POSENC_ROPE_SCALAR forces the scalar loop (the test suite builds test_rope both ways).
#if defined(POSENC_VECTOR_EXTENSIONS) && !defined(POSENC_ROPE_SCALAR)
#define POSENC_ROPE_VECTOR_EXTENSIONS 1
#endif

#ifdef POSENC_ROPE_VECTOR_EXTENSIONS
template <class T>
struct pair_vector;  // 8 lanes = 4 pairs (explicit: g++ drops vector_size on a dependent type)
template <>
struct pair_vector<float> {
  using type = float __attribute__((vector_size(32)));
};
template <>
struct pair_vector<double> {
  using type = double __attribute__((vector_size(64)));
};
#endif

/// Interleaved layout: out = rotated in. out may be in (in place): each vector is loaded whole
/// before it is stored, so in and out carry no __restrict.
template <class T>
inline void rotate_interleaved(const T* in, T* out, const T* __restrict cs, index_t h) {
  const index_t n = 2 * h;
  index_t j0 = 0;
#ifdef POSENC_ROPE_VECTOR_EXTENSIONS
  using V = typename pair_vector<T>::type;
  constexpr index_t lanes = 8;
  const V sign = {-1, 1, -1, 1, -1, 1, -1, 1};
  for (; j0 + lanes <= n; j0 += lanes) {
    V x, r;
    std::memcpy(&x, in + j0, sizeof(V));  // unaligned loads; memcpy is how vector types alias T
    std::memcpy(&r, cs + j0, sizeof(V));
    const V swapped = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
    const V c = __builtin_shufflevector(r, r, 0, 0, 2, 2, 4, 4, 6, 6);
    const V s = __builtin_shufflevector(r, r, 1, 1, 3, 3, 5, 5, 7, 7);
    const V o = x * c + swapped * (s * sign);
    std::memcpy(out + j0, &o, sizeof(V));
  }
#endif
  // The rest when rotary_dim is not a multiple of 8, or everything on a compiler without
  // __builtin_shufflevector (GCC < 12, MSVC).
  for (; j0 < n; j0 += 2) {
    const T a = in[j0], b = in[j0 + 1], c = cs[j0], s = cs[j0 + 1];
    out[j0] = a * c - b * s;
    out[j0 + 1] = b * c + a * s;
  }
}

/// Rotate one head vector in place with a prepared row.
template <class T>
inline void rotate_row_inplace(T* x, const T* row, index_t rotary_dim, bool interleaved) {
  const index_t h = rotary_dim / 2;
  if (interleaved) rotate_interleaved(x, x, row, h);
  else rotate_half_inplace(x, x + h, row, row + h, h);
}

/// Rotate one head vector out of place (in and out must not overlap) and copy the pass-through tail.
template <class T>
inline void rotate_row_copy(const T* in, T* out, const T* row, index_t rotary_dim, index_t head_dim, bool interleaved) {
  const index_t h = rotary_dim / 2;
  if (interleaved) rotate_interleaved(in, out, row, h);
  else rotate_half_copy(in, out, row, row + h, h);
  for (index_t j = rotary_dim; j < head_dim; ++j) out[j] = in[j];
}

}  // namespace posenc::detail
