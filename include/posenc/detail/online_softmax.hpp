// posenc/detail/online_softmax.hpp — the running-max / running-sum softmax over key blocks.
//
// Milakov & Gimelshein 2018 ("Online normalizer calculation for softmax", algorithm 3) and
// FlashAttention (Dao et al. 2022, section 3.1): after key block t a row keeps
//   m_t = max(m_{t-1}, max_j s_j),  l_t = exp(m_{t-1} - m_t) l_{t-1} + sum_j exp(s_j - m_t),
// and every accumulator built from earlier blocks (the output, the value-term buckets) is rescaled
// by alpha = exp(m_{t-1} - m_t). At the end out = acc / l and lse = m + log l.
// A row that has seen only -inf scores (masked keys, -inf biases) keeps m = -inf and l = 0 and never
// evaluates exp(-inf - -inf) = NaN.
//
// NaN and +inf follow PyTorch's softmax: a row with a visible NaN or +inf score is NaN (its max is
// NaN or +inf, and exp(s - max) is NaN for that entry), and a -inf score is a masked key. Such a row
// is "poisoned": its weights, l, m and alpha become NaN, so the output row and the log-sum-exp are
// NaN however many blocks follow (before, the final l > 0 test turned such a row into zeros,
// indistinguishable from a row that sees no key). Three checks find it: the row max (+inf, or NaN when
// the reduction reports it), the new l (Eigen's pmax keeps a NaN in its first operand, and the flush
// below puts the score first, so a NaN score gives a NaN weight and a NaN sum), and, for a row whose
// max came out -inf (no weights are computed then), a scan for NaN. A NaN-propagating
// row max (maxCoeff<PropagateNaN>) would find every case alone but made attention 3-4 % slower
// (docs/performance.md › NaN and Inf).
//
// Weights below eps^4 of the row maximum (eps = machine epsilon: 2e-28 in float, 2.4e-63 in double)
// are flushed to zero (flush_below): no number of them can change a row sum that holds the maximum's
// weight 1, but they, and their products with V, are subnormal or close to it, and subnormal
// operands slow down the exp, the P·V product and the rescale on x86. Measured with bench_bias
// (float, one thread, H = 8, d = 128, causal): ALiBi's far keys (weights exp(-90..-104)) made
// attention 1.10-1.19x slower than without an encoding; with FTZ/DAZ set it is 0.98-1.02x, and this
// flush gets the same without touching the caller's floating-point environment.
//
// Attention sinks (gpt-oss; FORMAT.md 5.11): a per-head logit that joins the denominator only,
//   p_ij = exp(s_ij - m) / (sum_j' exp(s_ij' - m) + exp(sink - m)),  m = max(max_j s_ij, sink).
// fold_sink adds it to a row's (m, l) once, after the last key block (or after merging the partial
// states of a split-KV decode), so the row's lse becomes log(sum_j exp(s_ij) + exp(sink)). A row that
// has seen no key (l = 0) stays empty (zero output, lse -inf) and a poisoned row stays NaN.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "posenc/tensor.hpp"

namespace posenc::detail {

/// y 2^m for packets of whole numbers m whose 2^m is a normal float or double (Eigen's pldexp_fast:
/// one multiplication by 2^m built in the exponent field). A function template so that the packet type
/// reaches Eigen's class template as a template parameter: named there directly (Packet16f, an alias
/// of __m512), g++ 12 warns that its attributes are ignored.
template <class P>
inline P times_power_of_two(const P& y, const P& m) {
  return Eigen::internal::pldexp_fast_impl<P>::run(y, m);
}

template <class T>
struct online_softmax {
  using vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  vector m, l, alpha;  ///< running max, running sum, rescale factor of the last step (per row)

  /// log(eps^4) = -4 (digits - 1) ln 2 for the machine epsilon eps = 2^-(digits - 1): -63.77 in float,
  /// -144.2 in double. Weights exp(s - m) below it are dropped (see the header comment). A constant
  /// (the float and the double that 4 log(eps) rounds to), so that flush_weight's initialization
  /// never reads it unset: two static members of a class template initialized at run time are
  /// initialized in no specified order, and in a translation unit that named flush_below first,
  /// flush_weight came out 2 exp(0) = 2 and every weight 0.
  static constexpr T flush_below =
      static_cast<T>(-4.0L * (std::numeric_limits<T>::digits - 1) * 0.693147180559945309417232121458176568L);
  /// 2 exp(flush_below): subtracted from every weight so that exp(flush_below) (within an ulp) is 0.
  static inline const T flush_weight = T(2) * std::exp(flush_below);

  void reset(index_t rows) {
    m.setConstant(rows, -std::numeric_limits<T>::infinity());
    l.setZero(rows);
    alpha.setOnes(rows);
  }

  using packet = typename Eigen::internal::packet_traits<T>::type;
  static constexpr index_t width = Eigen::internal::unpacket_traits<packet>::size;

  /// The largest of row[0 .. n), n > 0. A NaN may or may not be reported (the packet max keeps it only
  /// in its first operand): step checks the sum, and a row whose reported max is -inf, for NaN.
  static T max_of(const T* row, index_t n) {
    T best = row[0];
    index_t j = 1;
    if (n >= width) {
      best = Eigen::internal::predux_max(packet_max(row, n));
      j = n / width * width;
    }
    for (; j < n; ++j) best = std::max(best, row[j]);  // a NaN best stays
    return best;
  }

  /// The lane-wise max over the whole packets of row[0 .. n), n >= width (max_of before its reduction).
  static packet packet_max(const T* row, index_t n) {
    namespace in = Eigen::internal;
    packet acc = in::ploadu<packet>(row);
    for (index_t j = width; j + width <= n; j += width) acc = in::pmax(acc, in::ploadu<packet>(row + j));
    return acc;
  }

  /// exp(x) for x in [flush_below, 0], and NaN for NaN: the exp of every weight and alpha. In float,
  /// the range reduction and polynomial of Eigen 3.4's generic pexp (pexp_float: x = m ln 2 + r with
  /// ln 2 in two parts, Cephes' degree-5 polynomial for exp(r) evaluated in the same order) without
  /// what pexp needs for the rest of the float range: the clamp of x to +-88.7, the final max with x,
  /// and a pldexp that scales by 2^m in four steps so that results and intermediates may be subnormal
  /// or infinite (about 15 instructions). Here m >= -92, so y 2^m (y in [0.7, 1.42]) is a normal float
  /// and one multiplication by 2^m (times_power_of_two) is exact as pldexp's steps are: the same floats
  /// as pexp_float (all 1.1e9 floats of the range compared, built for AVX-512 and for AVX2). Eigen's
  /// AVX-512 pexp builds 2^m that way too but takes ln 2 in one part: up to 3.4 ulp from exp near
  /// flush_below, against 1.24 here (test_mask.cpp). Decode steps (GQA 32/8, d = 128, one core of a
  /// Zen 5 VM, paired calls in both orders, Lk = 4096 and 32768), time against pexp: built for AVX2
  /// (-mno-avx512f) f32 1 row 0.97-0.99, 4 rows 0.97, f16 1 row 0.98; with AVX-512 0.99-1.01.
  static packet exp_of_weight(const packet& x) {
    namespace in = Eigen::internal;
    if constexpr (std::is_same_v<T, float>) {
      const auto k = [](float v) { return in::pset1<packet>(v); };
      const packet m = in::pfloor(in::pmadd(x, k(1.44269504088896341f), k(0.5f)));  // round(x / ln 2)
      packet r = in::pmadd(m, k(-0.693359375f), x);  // x - m ln 2, ln 2 in two parts
      r = in::pmadd(m, k(2.12194440e-4f), r);
      const packet r2 = in::pmul(r, r), r3 = in::pmul(r2, r);
      packet y = in::pmadd(k(1.9875691500e-4f), r, k(1.3981999507e-3f));
      packet y1 = in::pmadd(k(4.1665795894e-2f), r, k(1.6666665459e-1f));
      const packet y2 = in::padd(r, k(1.0f));
      y = in::pmadd(y, r, k(8.3334519073e-3f));
      y1 = in::pmadd(y1, r, k(5.0000001201e-1f));
      y = in::pmadd(y, r3, y1);
      y = in::pmadd(y, r2, y2);  // exp(r)
      return times_power_of_two(y, m);
    } else {
      return in::pexp(x);
    }
  }

  /// The weights of a packet of scores against the max m in packet ops, to_weights' formula: a local
  /// object, so that the constants stay in registers across the stores of a loop.
  struct packet_weights {
    packet m;
    packet c = Eigen::internal::pset1<packet>(flush_below), w = Eigen::internal::pset1<packet>(flush_weight),
           zero = Eigen::internal::pset1<packet>(T(0));
    explicit packet_weights(const packet& m_new) : m(m_new) {}
    packet operator()(const packet& s) const {  // pmax keeps a NaN in its first operand, where the score is
      namespace in = Eigen::internal;
      return in::pmax(in::psub(exp_of_weight(in::pmax(in::psub(s, m), c)), w), zero);
    }
  };

  /// row[j] = w_j = max(exp(max(s_j - m, c)) - 2 exp(c), 0) with c = flush_below, in place; returns
  /// sum_j w_j. Every step is a packet op written out (Eigen 3.4 evaluates `select` one scalar at a
  /// time, measured 2.8 ns per score; an Eigen expression per row cost 11 % of a decode step on its
  /// 32-key rows). Masked keys (-inf) and weights below 2 exp(c) become exactly 0; the exp never sees
  /// an argument whose result is subnormal; the others move by 2 exp(c) (4e-28 in float), far below
  /// one ulp of the sum. pmax keeps a NaN in its first operand, where the score is.
  static T to_weights(T* row, index_t n, T m_new) {
    T total = Eigen::internal::predux(packets_to_weights(row, n, m_new));
    for (index_t j = n / width * width; j < n; ++j) {
      row[j] = std::max(std::exp(std::max(row[j] - m_new, flush_below)) - flush_weight, T(0));  // NaN stays first
      total += row[j];
    }
    return total;
  }

  /// to_weights over the whole packets of row[0 .. n) only; returns the weights' lane-wise sum.
  static packet packets_to_weights(T* row, index_t n, T m_new) {
    namespace in = Eigen::internal;
    const packet_weights weight(in::pset1<packet>(m_new));
    packet sum = in::pset1<packet>(T(0));
    for (index_t j = 0; j + width <= n; j += width) {
      const packet w = weight(in::ploadu<packet>(row + j));
      in::pstoreu(row + j, w);
      sum = in::padd(sum, w);
    }
    return sum;
  }

  /// alpha = exp(shift) for shift = m_old - m_new <= 0: 1 without an exp when the max did not move,
  /// which after a row's first blocks is the common case (a 1-row GQA 32/8 decode step, f16 or f32
  /// cache, Lk = 1024 to 32768, took 0.97-1.00x the time without the exp call, one core of a Zen 5
  /// VM, both ways in turns in one process); 0 below flush_below, m_old = -inf included.
  static T rescale_factor(T shift) { return shift == T(0) ? T(1) : shift < flush_below ? T(0) : std::exp(shift); }

  /// Replaces the scores s (rows x cols, masked entries -inf) by exp(s - m_new) in place and updates
  /// m, l and alpha. Returns whether some alpha differs from 1 (the accumulators need rescaling).
  bool step(matrix_map<T> s) {
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (std::is_same_v<T, float>)
      if (s.rows() <= 4 && s.cols() > 0 && s.cols() % width == 0) return step_rows4(s);
#endif
    return step_by_row(s);
  }

 private:
#if defined(EIGEN_VECTORIZE_AVX512)
  /// Lanes 4 r .. 4 r + 3 of the result: op over the 16 lanes of x[r], for 4 packets reduced together
  /// (halves, then 128-bit blocks, then pairs: with AVX512DQ the additions of Eigen's predux, lane for lane).
  template <class Op>
  static __m512 reduce_4(const __m512 (&x)[4], Op op) {
    const __m512 a = op(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
    const __m512 b = op(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
    const __m512 c = op(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    const __m512 d = op(c, _mm512_permute_ps(c, 0x4E));
    return op(d, _mm512_permute_ps(d, 0xB1));
  }

  /// step for up to 4 rows of whole packets (float, AVX-512; a decode tile of one row per query head of GQA 32/8):
  /// each row's packet max and packet sum built as step_by_row builds them (packet_max, packets_to_weights), the 4
  /// horizontal reductions of each done together (reduce_4) instead of one per row: the same weights and maxima as
  /// step_by_row (l within an ulp: the compiler may fuse alpha l + sum in either). A row whose max or running max
  /// is not finite (nothing visible in the block, +inf, NaN) sends the whole step to step_by_row before anything is
  /// written. Measured on one core of a Zen 5 VM: the softmax of a tile of 8 kv heads x 4 rows x 32 keys 0.79x the
  /// time of step_by_row; a 1-row GQA 32/8 decode step (both ways in turns in one process, Lk = 1024 to 32768)
  /// 0.97-0.98x with an f16 cache, where the step's arithmetic is what keeps it from the memory's rate, 0.99-1.01x
  /// with f32.
  bool step_rows4(matrix_map<T> s) {
    const index_t rows = s.rows(), n = s.cols(), ld = s.outerStride();
    const auto row = [&](index_t r) { return s.data() + r * ld; };
    __m512 part[4];  // rows past the last repeat row 0; their lanes are not read
    for (index_t r = 0; r < 4; ++r) part[r] = packet_max(row(r < rows ? r : 0), n);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, reduce_4(part, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }));
    float m_new[4];
    for (index_t r = 0; r < rows; ++r) {
      const float row_max = lanes[4 * r];
      if (!(std::abs(row_max) < std::numeric_limits<float>::infinity()) || std::isnan(m(r))) return step_by_row(s);
      m_new[r] = std::max(m(r), row_max);
    }
    for (index_t r = 0; r < 4; ++r) part[r] = r < rows ? packets_to_weights(row(r), n, m_new[r]) : _mm512_setzero_ps();
    _mm512_store_ps(lanes, reduce_4(part, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
    bool rescale = false;
    for (index_t r = 0; r < rows; ++r) {
      alpha(r) = rescale_factor(m(r) - m_new[r]);
      rescale = rescale || alpha(r) != 1.f;
      l(r) = alpha(r) * l(r) + lanes[4 * r];
      m(r) = m_new[r];
      if (std::isnan(l(r))) {  // a NaN score the row max did not report (header comment)
        poison_row(row(r), n, r);
        rescale = true;
      }
    }
    return rescale;
  }
#endif

  /// Row i of a step becomes NaN: its weights (row[0 .. n)), m, l and alpha.
  void poison_row(T* row, index_t n, index_t i) {
    std::fill(row, row + n, std::numeric_limits<T>::quiet_NaN());
    m(i) = l(i) = alpha(i) = std::numeric_limits<T>::quiet_NaN();
  }

  /// step one row at a time.
  bool step_by_row(matrix_map<T> s) {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    constexpr T pos_inf = std::numeric_limits<T>::infinity();
    bool rescale = false;
    for (index_t i = 0; i < s.rows(); ++i) {
      T* row = s.data() + i * s.outerStride();
      const index_t n = s.cols();
      const T row_max = n == 0 ? neg_inf : max_of(row, n);
      if (std::isnan(m(i)) || std::isnan(row_max) || row_max == pos_inf ||
          (row_max == neg_inf && std::any_of(row, row + n, [](T x) { return std::isnan(x); }))) {  // poisoned (header comment)
        poison_row(row, n, i);
        rescale = true;
        continue;
      }
      const T m_new = std::max(m(i), row_max);
      if (m_new == neg_inf) {  // nothing visible so far: weights 0, nothing to rescale
        std::fill(row, row + n, T(0));
        alpha(i) = T(1);
        continue;
      }
      alpha(i) = rescale_factor(m(i) - m_new);  // m(i) = -inf gives 0: the accumulators are still zero
      rescale = rescale || alpha(i) != T(1);
      l(i) = alpha(i) * l(i) + to_weights(row, n, m_new);
      m(i) = m_new;
      if (std::isnan(l(i))) {  // a NaN score the row max did not report (header comment)
        poison_row(row, n, i);
        rescale = true;
      }
    }
    return rescale;
  }

 public:
  /// Whether every lane of a comparison's result is true.
  static bool all_lanes(const packet& mask) {
    namespace in = Eigen::internal;
    return !in::predux_any(in::pandnot(in::ptrue(mask), mask));
  }

  /// step for scores stored by column (decode_kernels.hpp, the column layout): st[j * ld + i] is row
  /// i's score of key j, for n keys, with ld = rows() a multiple of the packet width (every lane is a
  /// row: padding rows are computed like the others and ignored by the caller). The same rules as
  /// step, row by row (the weights are the same numbers; the sums are added in another order). A
  /// packet of rows whose max and running max are all finite, the common case, is done in packet
  /// ops throughout (alpha included: a scalar exp per row cost 8 % of a 16-row decode step); a packet
  /// with a row that saw only -inf, a +inf or a NaN is done row by row. Returns whether some alpha
  /// differs from 1.
  bool step_columns(T* st, index_t n, index_t ld) {
    namespace in = Eigen::internal;
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    constexpr T pos_inf = std::numeric_limits<T>::infinity();
    const packet pc = in::pset1<packet>(flush_below), zero = in::pset1<packet>(T(0)), one = in::pset1<packet>(T(1)),
                 ninf = in::pset1<packet>(neg_inf), pinf = in::pset1<packet>(pos_inf);
    bool rescale = false;
    for (index_t c = 0; c < ld; c += width) {
      packet mx = ninf;
      for (index_t j = 0; j < n; ++j) mx = in::pmax(in::ploadu<packet>(st + j * ld + c), mx);
      const packet m_old = in::ploadu<packet>(m.data() + c);
      // finite: x == x and |x| < inf (a NaN fails both compares)
      const packet finite = in::pand(in::pcmp_lt(in::pabs(mx), pinf), in::pcmp_eq(m_old, m_old));
      if (!all_lanes(finite)) {
        rescale = step_columns_by_row(st, n, ld, c, mx) || rescale;
        continue;
      }
      const packet m_new = in::pmax(m_old, mx);
      const packet shift = in::psub(m_old, m_new);  // -inf for a row's first visible block: alpha 0
      const packet a = in::pselect(in::pcmp_lt(shift, pc), zero, exp_of_weight(in::pmax(shift, pc)));
      const packet_weights weight(m_new);
      packet sum = zero;
      for (index_t j = 0; j < n; ++j) {
        T* x = st + j * ld + c;
        const packet w = weight(in::ploadu<packet>(x));
        in::pstoreu(x, w);
        sum = in::padd(sum, w);
      }
      const packet l_new = in::pmadd(a, in::ploadu<packet>(l.data() + c), sum);
      in::pstoreu(alpha.data() + c, a);
      in::pstoreu(l.data() + c, l_new);
      in::pstoreu(m.data() + c, m_new);
      rescale = rescale || !all_lanes(in::pcmp_eq(a, one));
      if (!all_lanes(in::pcmp_eq(l_new, l_new)))  // a NaN score the max did not report
        for (index_t i = c; i < c + width; ++i)
          if (std::isnan(l(i))) poison_column(st, n, ld, i);
    }
    return rescale;
  }

 private:
  /// step_columns for the rows c .. c+width of a packet with an unusual row, one row at a time
  /// (step's per-row rules); col_max holds the packet's column maxima.
  bool step_columns_by_row(T* st, index_t n, index_t ld, index_t c, const packet& col_max) {
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    constexpr T pos_inf = std::numeric_limits<T>::infinity();
    T row_maxes[width];
    Eigen::internal::pstoreu(row_maxes, col_max);
    bool rescale = false;
    for (index_t i = c; i < c + width; ++i) {
      const T row_max = row_maxes[i - c];
      bool poisoned = std::isnan(m(i)) || std::isnan(row_max) || row_max == pos_inf;
      for (index_t j = 0; !poisoned && row_max == neg_inf && j < n; ++j) poisoned = std::isnan(st[j * ld + i]);
      if (poisoned) {
        poison_column(st, n, ld, i);
        rescale = true;
        continue;
      }
      const T m_new = std::max(m(i), row_max);
      alpha(i) = T(1);
      if (m_new == neg_inf) {  // nothing visible so far: weights 0, nothing to rescale
        for (index_t j = 0; j < n; ++j) st[j * ld + i] = T(0);
        continue;
      }
      alpha(i) = rescale_factor(m(i) - m_new);
      rescale = rescale || alpha(i) != T(1);
      T sum = 0;
      for (index_t j = 0; j < n; ++j) {
        T& x = st[j * ld + i];
        x = std::max(std::exp(std::max(x - m_new, flush_below)) - flush_weight, T(0));
        sum += x;
      }
      l(i) = alpha(i) * l(i) + sum;
      m(i) = m_new;
      if (std::isnan(l(i))) poison_column(st, n, ld, i);
    }
    return rescale;
  }

  /// Row i of a column-layout step becomes NaN: its weights, m, l and alpha.
  void poison_column(T* st, index_t n, index_t ld, index_t i) {
    constexpr T nan = std::numeric_limits<T>::quiet_NaN();
    for (index_t j = 0; j < n; ++j) st[j * ld + i] = nan;
    m(i) = l(i) = alpha(i) = nan;
  }

 public:
  /// Folds the sink logit into row i (header comment) and returns the factor by which the row's
  /// accumulators must be multiplied (exp(m_old - m_new); 1 when nothing changes). Also stored in
  /// alpha(i).
  T fold_sink(index_t i, T sink) {
    alpha(i) = T(1);
    if (!(l(i) > T(0))) return T(1);  // no key seen (stays empty) or poisoned (stays NaN)
    const T m_new = std::max(m(i), sink);
    alpha(i) = std::exp(m(i) - m_new);
    l(i) = alpha(i) * l(i) + std::exp(sink - m_new);
    m(i) = m_new;
    return alpha(i);
  }

  /// Natural-log log-sum-exp of row i (-inf when the row saw no finite score, NaN when poisoned).
  [[nodiscard]] T lse(index_t i) const {
    if (l(i) > T(0)) return m(i) + std::log(l(i));
    return std::isnan(l(i)) ? l(i) : -std::numeric_limits<T>::infinity();
  }

  /// Writes row i of the result, acc / l: zeros when the row saw no key, NaN when it is poisoned.
  template <class Dst, class Acc>
  void finish_row(index_t i, Dst&& dst, const Acc& acc) const {
    if (l(i) > T(0))
      dst = acc * (T(1) / l(i));
    else if (std::isnan(l(i)))
      dst.setConstant(l(i));
    else
      dst.setZero();  // the row sees no key
  }
};

}  // namespace posenc::detail
