// posenc/detail/decode_kernels.hpp — the decode path's tile products, for a few query rows against keys
// and values read straight from the cache rows (no packed copies). The row layout, up to 4 rows per
// kv head:
//   row_dots      S = Q K^T   each score a dot product of two contiguous rows
//   add_weighted  O += P V    each output row a sum of value rows weighted by its scores
// and the column layout for more rows (column_dots, add_weighted_rows: see there).
// Both are written on Eigen's packet primitives (Packet16f with AVX-512, Packet8f with AVX, Packet4f
// with SSE, and the double forms), so they vectorize on every target the library builds for.
//   row_dots keeps a register block of 4 rows x 4 keys (2 keys with 16 registers) of packet
//   accumulators; with AVX-512 the 16 accumulators of a block are reduced together by a transpose
//   tree (45 instructions for 16 scores, against about 10 per score one by one: the reductions were
//   as many instructions as the products). Keys are the outer loop, so a block's 4 key rows are
//   reused from L1 by every 4-row block of a group.
//   add_weighted keeps 4 rows x 4 packets of output in registers across the keys of a chunk; for up to
//   4 rows the chunk is the whole tile, for more it is 8 keys, so the chunk's value rows stay in L1
//   for every row block (cache rows 2-4 KiB apart share L1 sets: 32 of them evict each other).
// K and V rows may be stored in half precision: kv_packets widens them inside the loads (vcvtph2ps,
// or a shift for bf16), where the products read them, instead of in a pass of their own.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#if defined(EIGEN_VECTORIZE_AVX512) || (defined(EIGEN_VECTORIZE_AVX2) && defined(__F16C__))
#include <immintrin.h>
#endif

#include "posenc/detail/prefetch.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

template <class T>
struct packet_of {
  using type = typename Eigen::internal::packet_traits<T>::type;
  static constexpr index_t width = Eigen::internal::unpacket_traits<type>::size;
};

/// Loads of one packet of T from K/V rows stored as KV. `direct`: the products can read rows of KV
/// in place (T itself, or f16 / bf16 widened in the register where the ISA has it); otherwise the
/// rows are widened into a T buffer first (kv_storage.hpp).
template <class KV, class T>
struct kv_packets {
  static constexpr bool direct = false;
};

template <class T>
struct kv_packets<T, T> {
  static constexpr bool direct = true;
  static typename packet_of<T>::type load(const T* p) {
    return Eigen::internal::ploadu<typename packet_of<T>::type>(p);
  }
};

#if defined(EIGEN_VECTORIZE_AVX512)
template <>
struct kv_packets<Eigen::half, float> {
  static constexpr bool direct = true;
  static __m512 load(const Eigen::half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
template <>
struct kv_packets<Eigen::bfloat16, float> {
  static constexpr bool direct = true;
  static __m512 load(const Eigen::bfloat16* p) {  // bf16 is a float's upper 16 bits
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
};
#elif defined(EIGEN_VECTORIZE_AVX2) && defined(__F16C__) && !defined(EIGEN_VECTORIZE_AVX512)
template <>
struct kv_packets<Eigen::half, float> {
  static constexpr bool direct = true;
  static __m256 load(const Eigen::half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
template <>
struct kv_packets<Eigen::bfloat16, float> {
  static constexpr bool direct = true;
  static __m256 load(const Eigen::bfloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
};
#endif

/// Rows ahead of the one being read that the products prefetch into L2 when they read the cache in
/// place: reading row j of a kv head, they prefetch the same line of row j + 32 of that head (the next
/// tile's, decode_tile_keys), once per 64-byte line, at the pace they read. A head's rows are 0.5-4 KiB
/// apart in BSHD, short runs the hardware prefetchers do not carry across pages: without it a step
/// from DRAM costs the reads plus the arithmetic, not the larger of the two (bench_read_order on a Zen
/// 5 VM, register-only FMAs on the kernel's reads: 0.47 us per key from DRAM, 0.19 in L2, 0.28-0.30
/// in address order; with this prefetch 0.32-0.34). Paired calls, time with / without (GQA 32/8,
/// d = 128, one core): f32 4 rows (column layout) Lk = 4096 0.76-0.88, Lk = 32768 0.78-0.80; f16 4
/// rows 0.86; f16 1 row, 32 rows ahead against 16: 0.96 (4096), 0.87 (32768). f32 1 row: 0.94-0.97
/// from DRAM, which is where a runtime's cache is (one layer's K/V read after the other layers'; calls
/// rotating over 4-64 layers' caches, Lk = 256 to 4096, 1 and 2 threads), and 0.935 at Lk = 32768 on
/// one cache; only a cache that stays in L2 / L3 between calls (one layer called again and again,
/// Lk <= 1024) pays for the instructions, 1.12-1.23.
inline constexpr index_t decode_prefetch_rows = 32;

/// The column layout (more than 4 rows per kv head) takes a tile head by head, the keys of every kv
/// head and then their values, and prefetches instead the rows it reads a few head passes later: in a
/// pass over one head's rows it prefetches the same lines of a head further in the item (as many as
/// the item has, at most), in this tile or, past the item's last head, in the next tile
/// (decode_attention::column_prefetch). A tile ahead, a call held two tiles of K and V in L2 besides
/// the accumulators (512 KiB with f32 and 8 kv heads of 128), and reading the cache cost 0.14-0.24 us
/// per key on top of the products (docs/decode-measurements.md › Where the 4-row step's time goes
/// from DRAM). Paired calls, time against a tile ahead (GQA 32/8, d = 128, Zen 5 VM, calls rotating over
/// 384-512 MiB of caches; Lk = 4096 / 32768 / 1024 in L3), f32 4 rows: 2 heads later 0.90 / 0.88 /
/// 0.93, 3 heads 0.87 / 0.88 / 0.90, 4 heads 0.89 / 0.90 / 0.94, 5 heads 0.89 / 0.90 / 0.94, 6 heads
/// 0.94 / 0.92 / 0.96; 3 heads on 2 threads 0.93 / 0.93 / 0.96; f32 2 rows 0.94 / 0.95 / 0.93; f16 4
/// rows (staged keys) 0.99 / 0.98 / 0.99. The 1-row step does not use it (1.00).
///
/// The distance is as many head passes as make decode_column_prefetch_bytes of the cache's rows (a pass
/// reads a tile's rows of one head; 48 KiB is the best 3 passes above), at least 1 and at most
/// decode_column_prefetch_heads: 3 at d = 64 and 128, 1 at d = 256 with f32. The same harness, f32 4
/// rows, against 3 heads: d = 64 (GQA 32/8) 4 heads 1.00 / 1.00 / 1.01, and against a tile ahead 3
/// heads 0.96 / 0.93 / 0.98, 6 heads (48 KiB) 0.97 / 0.95 / 0.99; d = 256 (GQA 16/8) 2 heads 0.98-0.99
/// / 0.98 / 0.95-0.98, 1 head 0.96-0.98 / 0.97 / 0.93-0.95.
inline constexpr index_t decode_column_prefetch_bytes = index_t{48} << 10;
inline constexpr index_t decode_column_prefetch_heads = 3;

/// The keys swept across the heads (row_dots_across_heads) prefetch 4 rows ahead instead: a block of
/// 4 keys reads 4 whole token rows in turn (16 KiB in BSHD with f32, 8 kv heads of 128), and the same
/// lines 4 rows further are the next block's, read about a block's time later; into L1 or L2 as
/// with_sweep_locality chooses. A plain read of a 268 MB cache ran fastest the same way on a Zen 5
/// VM (into L1, 4 KiB ahead: 0.75-0.80 of the triad's rate, into L2 0.71-0.74). Paired calls, time
/// against 32 rows ahead into L2 (1 row, GQA 32/8, d = 128, Zen 5 VM, into L1): f32 Lk = 32768
/// 0.90-0.94, 2 threads 0.90, Lk = 4096 0.88, Lk = 1024 0.95; f16 0.97-0.98, bf16 0.98. 2 rows ahead
/// measured 0.96-0.99 (f32) and up to 1.39 (f16), 6 rows 1.04 against 4, both prefetches together
/// 1.12 against this one. The values, read head by head (32 rows of a head in turn, all in one L1 set
/// when rows are 4 KiB apart), keep the L2 prefetch a tile ahead: every product prefetching into L1 4
/// rows ahead measured f16 1.32, f32 4 rows 1.14, f32 1 row 0.97-1.02.
inline constexpr index_t decode_sweep_prefetch_rows = 4;

/// Bytes ahead that the products prefetch, into L1 or L2 as with_sweep_locality chooses, when an item
/// takes its kv heads one after the other (a cache whose heads' rows are adjacent, BHSD: each head's
/// keys and values are two runs of rows read in address order): reading row j of a head, the row
/// this many bytes further. Measured against the same step on a BSHD copy of the cache (1 row, GQA
/// 32/8, d = 128, one core of a Zen 5 VM, f32 and f16, Lk = 4096 and 32768, calls rotating over
/// 384-512 MiB of caches, the variants in turn, medians of per-call ratios, two runs): 4 KiB
/// 1.08-1.27x, 8 KiB 0.97-1.25x, 12 KiB 1.00-1.05x (one run), 16 KiB 1.03-1.20x, 8 KiB the fastest in
/// 7 of the 8 cases (f32 at Lk = 32768 1.25 against 1.20 at 16 KiB in one run); the keys 4 rows and
/// the values one tile (32 rows) ahead into L2, as with the heads inner, 1.14-1.32x.
inline constexpr index_t decode_stream_prefetch_bytes = index_t{8} << 10;

/// The smallest L1 data cache for which the sweeps across the heads (the keys, and the values in
/// chunks: decode_value_chunk_keys) prefetch into L1; below it, or where the size is unknown, into
/// L2. With f32 the block being read and the one prefetched take 32 KiB: a third of a 48 KiB L1 is
/// left to the queries, scores and accumulators, none of a 32 KiB one. Paired calls, 1 row, GQA
/// 32/8, d = 128, time into L2 against into L1 (4 rows ahead for both): on a Zen 4 VM (32 KiB L1)
/// f32 Lk = 4096 0.78 (keys alone 0.91), Lk = 32768 0.76, calls rotating over 16 layers' caches of
/// 1024 keys 0.82; f16 Lk = 32768 0.85, Lk = 4096 1.00, bf16 0.98; 8 or 16 rows ahead into L2
/// 1.00-1.01 against 4. On 2 threads (one binary and one pool, the level switched between turns; two
/// libraries would each bring a pool) f32 Lk = 4096 and 32768 0.82-0.86, keys and values 8, 16 or 32
/// rows ahead against 4 0.97-1.08. On a Zen 5 VM (48 KiB L1) into L1 was the faster (the numbers
/// above and at decode_value_chunk_keys).
inline constexpr index_t decode_sweep_l1_min_bytes = index_t{48} << 10;

/// f(std::integral_constant<int, to_l1 or to_l2>{}): the level the sweeps across the heads prefetch
/// into on this machine (decode_sweep_l1_min_bytes), dispatched per tile.
template <class F>
inline void with_sweep_locality(F&& f) {
  if (l1_data_bytes() >= decode_sweep_l1_min_bytes)
    f(std::integral_constant<int, to_l1>{});
  else
    f(std::integral_constant<int, to_l2>{});
}

/// Keys per chunk when the values of up to 4 rows per kv head are summed in address order, the
/// chunk's keys across the kv heads (as the scores read them), each chunk prefetching the next into
/// L1 (or L2: with_sweep_locality): for f32 values in token rows of at most 4 KiB (two chunks take
/// at most 32 KiB). Head by head, the 32 value rows of a tile read in turn are 32 pages. Paired
/// calls against head by head with the L2 prefetch (1 row, GQA 32/8, d = 128, Zen 5 VM, into L1):
/// f32 Lk = 32768 0.92 (2 threads 0.92), Lk = 4096 0.89, calls rotating over 16 layers' caches of
/// 1024 keys 0.91.
/// Chunks of 4 keys with the L2 prefetch measured 1.10 before, f32 chunks of 8 1.02; f16 and bf16
/// (2 KiB rows) with chunks of 8 0.96-1.05 and chunks of 4 1.06-1.08. Half values are swept in chunks
/// of 8 keys (value_chunk_keys) on every core: the same calls on a Zen 3 VM (32 KiB L1, into L2),
/// against head by head, f16 0.87-0.91 (Lk = 4096, 32768) and 0.94 in L3 (Lk = 1024), bf16 0.87-0.94
/// and 0.90; chunks of 4 f16 0.85-0.94 and 0.99. Measured again on a Zen 5 VM (48 KiB L1, into L1),
/// against head by head: f16 0.86-0.94 (Lk = 4096, 32768), bf16 0.90-0.98, in L3 (Lk = 1024) f16
/// 0.96-1.05, bf16 0.98; 4 rows (the column layout) and f32 1.00.
/// The chunks cost compute (the accumulators loaded and stored every chunk: 150 ns per key against
/// 90 head by head, Zen 4 VM, in L2), and every cheaper order tried there gave it back from DRAM
/// (paired, f32 1 row, time in L3 / from DRAM: chunks of 8 0.90 / 0.96-1.00, of 16 0.85 / 1.01-1.02,
/// head by head 0.78-0.83 / 0.90-1.06; docs/decode-measurements.md, Zen 4).
inline constexpr index_t decode_value_chunk_keys = 4;
/// The largest f32 token row of values (all kv heads) summed that way: two chunks within 32 KiB
/// (value_chunk_keys keeps a chunk of half values within the same bytes).
inline constexpr index_t decode_value_chunk_row_bytes = 4096;
/// Keys per chunk for values stored as KV: the bytes of decode_value_chunk_keys f32 keys, so 8 keys of
/// f16 / bf16 (whose token rows may then be 2 KiB at most).
template <class KV>
inline constexpr index_t value_chunk_keys = static_cast<index_t>(sizeof(float) / sizeof(KV)) * decode_value_chunk_keys;

/// Whether element t of a row of E starts a new 64-byte span of it: the products prefetch once per
/// span, not once per load (a packet of f16 is half a line; column_dots reads 4 elements per step).
template <class E>
constexpr bool starts_line(index_t t) {
  return t % line_elements<E> == 0;
}

/// One stored K/V value as T (the scalar tails of the products).
template <class T, class KV>
inline T kv_value(const KV& x) {
  if constexpr (std::is_same_v<KV, T>) {
    return x;
  } else {
    return static_cast<T>(static_cast<float>(x));
  }
}

/// s[r * s_stride + j] = the sum of the lanes of acc[r][j] (R x J accumulators). The register blocks and
/// this are always inlined: g++ 12 compiled a block left out of line with its accumulators in memory (a
/// load and a store around every FMA), and the accumulators passed to a store_sums it did not inline
/// likewise.
template <int R, int J, class P, class T>
POSENC_ALWAYS_INLINE void store_sums(const P (&acc)[R][J], T* s, index_t s_stride) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) s[r * s_stride + j] = Eigen::internal::predux(acc[r][j]);
}

#if defined(EIGEN_VECTORIZE_AVX512)
/// The 4 x 4 block of float accumulators reduced together: each level adds two vectors' halves into
/// one vector (256-bit halves, then 128-bit lanes, then pairs, then single floats), 16 vectors to 8, 4,
/// 2, 1; the last holds acc[r][j]'s sum in lane 4 r + j.
template <>
POSENC_ALWAYS_INLINE void store_sums<4, 4, __m512, float>(const __m512 (&acc)[4][4], float* s, index_t s_stride) {
  __m512 l1[8], l2[4], l3[2];
  // input order a[4 j + r] puts acc[r][j] in lane 4 r + j at the end
  for (int i = 0; i < 8; ++i) {
    const __m512 x = acc[(2 * i) % 4][(2 * i) / 4], y = acc[(2 * i + 1) % 4][(2 * i + 1) / 4];
    l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i)
    l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    l3[i] = _mm512_add_ps(_mm512_unpacklo_ps(l2[2 * i], l2[2 * i + 1]), _mm512_unpackhi_ps(l2[2 * i], l2[2 * i + 1]));
  const __m512d c = _mm512_castps_pd(l3[0]), e = _mm512_castps_pd(l3[1]);
  const __m512 sums = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, e)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, e)));
  _mm_storeu_ps(s, _mm512_extractf32x4_ps(sums, 0));
  _mm_storeu_ps(s + s_stride, _mm512_extractf32x4_ps(sums, 1));
  _mm_storeu_ps(s + 2 * s_stride, _mm512_extractf32x4_ps(sums, 2));
  _mm_storeu_ps(s + 3 * s_stride, _mm512_extractf32x4_ps(sums, 3));
}
#endif

/// s[r * s_stride + j] = dot(q row r, k row j) for R rows x J keys, the dimension d in whole packets
/// (dv = d rounded down to them) and a scalar tail. D > 0: d is D, known at compile time
/// (with_head_dim). `prefetch` != 0 prefetches, into the level Locality names, the line `prefetch`
/// elements past each line of the key rows.
template <int R, int J, index_t D = 0, int Locality = to_l2, class T, class KV>
POSENC_ALWAYS_INLINE void row_dots_block(const T* q, index_t q_stride, const KV* k, index_t k_stride, index_t d_run,
                                         T* s, index_t s_stride, index_t prefetch) {
  using P = typename packet_of<T>::type;
  constexpr index_t W = packet_of<T>::width;
  namespace in = Eigen::internal;
  const index_t d = D > 0 ? D : d_run;
  P acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = in::pset1<P>(T(0));
  const index_t dv = d / W * W;
  for (index_t t = 0; t < dv; t += W) {
    P kp[J];
    for (int j = 0; j < J; ++j) kp[j] = kv_packets<KV, T>::load(k + j * k_stride + t);
    if (prefetch != 0 && starts_line<KV>(t))
      for (int j = 0; j < J; ++j) prefetch_past<Locality>(k + j * k_stride + t, prefetch);
    for (int r = 0; r < R; ++r) {
      const P qp = in::ploadu<P>(q + r * q_stride + t);
      for (int j = 0; j < J; ++j) acc[r][j] = in::pmadd(qp, kp[j], acc[r][j]);
    }
  }
  store_sums<R, J>(acc, s, s_stride);
  for (index_t t = dv; t < d; ++t)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) s[r * s_stride + j] += q[r * q_stride + t] * kv_value<T>(k[j * k_stride + t]);
}

/// Register blocks: 4 rows x J keys of accumulators (J = 4 with 32 vector registers, AVX-512; 2 with
/// 16), so a group of up to 4 rows reads each key once.
#if defined(EIGEN_VECTORIZE_AVX512)
inline constexpr int dot_block_keys = 4;
inline constexpr int weighted_block_packets = 4;
#else
inline constexpr int dot_block_keys = 2;
inline constexpr int weighted_block_packets = 2;
#endif
/// Keys per add_weighted chunk when a group has more than one 4-row block (see the file comment).
inline constexpr index_t weighted_chunk_keys = 8;

/// f(std::integral_constant<int, R>{}, r) for the row blocks of `rows`: 4 rows at a time, then 3, 2 or 1.
template <class F>
inline void for_row_blocks(index_t rows, F&& f) {
  index_t r = 0;
  for (; r + 4 <= rows; r += 4) f(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

/// S (rows x cols, row-major, row stride s_stride) = Q (rows x d) K^T (K: cols x d, stored as KV);
/// rows of Q and K contiguous, any row strides. Each key row is loaded from memory once; `prefetch` != 0
/// prefetches into L2 the line `prefetch` elements past each line of the key rows (decode_prefetch_rows
/// rows further: decode_attention::rows_ahead).
template <class T, class KV>
void row_dots(const T* q, index_t q_stride, index_t rows, const KV* k, index_t k_stride, index_t cols, index_t d, T* s,
              index_t s_stride, index_t prefetch = 0) {
  constexpr int J = dot_block_keys;
  index_t j = 0;
  for (; j + J <= cols; j += J)
    for_row_blocks(rows, [&](auto R, index_t r) {
      row_dots_block<R(), J>(q + r * q_stride, q_stride, k + j * k_stride, k_stride, d, s + r * s_stride + j, s_stride,
                             r == 0 ? prefetch : 0);
    });
  for (; j < cols; ++j)
    for_row_blocks(rows, [&](auto R, index_t r) {
      row_dots_block<R(), 1>(q + r * q_stride, q_stride, k + j * k_stride, k_stride, d, s + r * s_stride + j, s_stride,
                             r == 0 ? prefetch : 0);
    });
}

/// f(std::integral_constant<index_t, D>{}) with D = d for the usual head dimensions (64, 128, 256),
/// D = 0 (d at run time) for any other. With D known the dimension loop of a register block is
/// unrolled with constant offsets and no tail: measured on the keys swept across the heads (GQA
/// 32/8, 1 row, d = 128, one core of a Zen 5 VM, paired calls), 0.81-0.94x the time of d at run
/// time for an f32 cache (Lk = 512 to 32768), 0.95x for f16 (Lk = 4096).
template <class F>
inline void with_head_dim(index_t d, F&& f) {
  switch (d) {
    case 64:
      f(std::integral_constant<index_t, 64>{});
      break;
    case 128:
      f(std::integral_constant<index_t, 128>{});
      break;
    case 256:
      f(std::integral_constant<index_t, 256>{});
      break;
    default:
      f(std::integral_constant<index_t, 0>{});
      break;
  }
}

/// The scores of a tile of `cols` keys for every kv head, in place from the cache, for one register
/// block of R <= 4 query rows per head, the keys a block at a time across the heads (in BSHD a key's
/// rows of all heads are one contiguous run: address order). q(h): head h's R rows (row stride d); key
/// j of head h at k + j * k_stride + h * k_head; head h's scores at s + h * s_head, R x cols (row
/// stride cols). More rows per head sweep the tile once per block (from L2 after the first). D as
/// row_dots_block; the keys are prefetched `prefetch` elements ahead into the level Locality names
/// (decode_sweep_prefetch_rows rows or decode_stream_prefetch_bytes, with_sweep_locality; 0: none,
/// when the item reads no further tile). The blocks are called here directly, not through row_dots: one
/// call of it per block and head (its row-block dispatch, not inlined) measured 0.88-0.94x the time
/// without it (f32, 1 row, GQA 32/8, d = 128, Lk = 512 to 32768), and f16 0.91x at Lk = 4096.
template <int R, index_t D, int Locality, class T, class KV, class Q>
void row_dots_across_heads(Q&& q, index_t heads, const KV* k, index_t k_stride, index_t k_head, index_t cols, index_t d,
                           T* s, index_t s_head, index_t prefetch) {
  constexpr int J = dot_block_keys;
  index_t j = 0;
  for (; j + J <= cols; j += J)
    for (index_t h = 0; h < heads; ++h)
      row_dots_block<R, J, D, Locality>(q(h), d, k + j * k_stride + h * k_head, k_stride, d, s + h * s_head + j, cols,
                                        prefetch);
  for (; j < cols; ++j)
    for (index_t h = 0; h < heads; ++h)
      row_dots_block<R, 1, D, Locality>(q(h), d, k + j * k_stride + h * k_head, k_stride, d, s + h * s_head + j, cols,
                                        prefetch);
}

/// The scores of a tile for kv heads [0, heads) and all G rows of each group: row_dots_across_heads for
/// each register block of rows (one sweep of the tile per block), the head dim and the prefetch level
/// dispatched here once per tile. q_heads[h]: head h's G rows (row stride d); head h's G x cols scores
/// at s + h * s_head (row stride cols); `prefetch` as row_dots_across_heads, for the first block only.
/// A function of T and KV alone, the queries passed as pointers rather than an accessor of the
/// caller's: instantiated inside the encoding-typed decode step, these blocks (4 row counts x 4 head
/// dims x 2 levels) were compiled again for every encoding, 40 % of clang's backend time for
/// tests/test_attention.cpp.
template <class T, class KV>
void scores_across_heads(const T* const* q_heads, index_t G, index_t heads, const KV* k, index_t k_stride,
                         index_t k_head, index_t cols, index_t d, T* s, index_t s_head, index_t prefetch) {
  for_row_blocks(G, [&](auto R, index_t r) {
    const auto q = [&](index_t h) { return q_heads[h] + r * d; };
    with_head_dim(d, [&](auto D) {
      with_sweep_locality([&](auto L) {
        row_dots_across_heads<R(), D(), L()>(q, heads, k, k_stride, k_head, cols, d, s + r * cols, s_head,
                                             r == 0 ? prefetch : 0);
      });
    });
  });
}

/// The column layout, for groups of more than 4 rows: a packet holds one key's scores for up to W
/// query rows (a lane per row), so the products need no reductions and the softmax runs down the
/// columns. With row_dots a group of 16 rows reads every key row 4 times (once per 4-row block) and
/// reduces every score (measured in L1, 16 rows x 32 keys, d = 128: row_dots and add_weighted at
/// 45-62 % of the FMA peak; pointer bumps between the rows and the reductions bind them).
///   column_dots        S^T = K Q^T  from Q^T [d x lanes]; each key value is broadcast from its row
///                                   (a memory operand of the FMA), each Q^T packet loaded once for
///                                   a block of keys; with AVX-512 two dimensions per broadcast
///                                   (column_pair_block)
///   add_weighted_rows  O += P V     from P^T [keys x lanes]; each value packet is loaded (and widened)
///                                   once per block of weighted_column_rows rows (from L1 after the
///                                   first), the rows' weights broadcast from one contiguous column
///                                   of P^T, each for weighted_column_packets packets

/// Keeps p in a register the optimizer cannot relate to other pointers (an empty asm on GCC and
/// clang; nothing elsewhere).
template <class T>
inline void hide_pointer(const T*& p) {
#if defined(__GNUC__)
  asm("" : "+r"(p));
#else
  (void)p;
#endif
}

/// Packets per column of query rows: 1 or 2 (groups up to two packets wide), 0 when wider.
template <class T>
constexpr int column_packets(index_t rows) {
  constexpr index_t W = packet_of<T>::width;
  return rows <= W ? 1 : rows <= 2 * W ? 2 : 0;
}

/// Keys per column_dots block: KB x NP = 8 accumulators, independent FMA chains enough to cover the
/// FMA latency on two pipes, and KB row pointers, fit the registers (16 with AVX2). With AVX2, 4 keys
/// (4 chains) against 8, paired steps on one core of a Zen 5 VM built with -march=native
/// -mno-avx512f (GQA 32/8, d = 128, Lk = 1024 / 4096 / 32768): 8 keys took 0.82-0.90x the time with
/// f32 and f16 caches, 2 to 4 rows per query head (8 to 16 per kv head), bitwise the same results;
/// built with g++ 12 (3 rows per query head) f32 0.96-0.99, f16 0.87-0.88.
#if defined(EIGEN_VECTORIZE_AVX2)
inline constexpr int column_block_keys = 8;
#else
inline constexpr int column_block_keys = 4;
#endif

/// kr[j] = the key row j of a column_dots block, each pointer opaque to the optimizer: else clang 14
/// rebuilds each from the previous one by a chain of dependent adds inside the loop (62-78 % of the
/// FMA peak measured with it, in L1).
template <int KB, class T>
POSENC_ALWAYS_INLINE void key_row_pointers(const T* k, index_t k_stride, const T* (&kr)[KB]) {
  for (int j = 0; j < KB; ++j) {
    kr[j] = k + j * k_stride;
    hide_pointer(kr[j]);
  }
}

/// step(t) for t = 0, S, 2 S, ... < d (S = 1, or 2 with d even), in that order, several dimensions per
/// iteration so that the key rows are addressed by their pointer plus a constant (one index update per
/// 4 x KB FMAs or more); `prefetch` != 0 prefetches the line `prefetch` elements past each line of the
/// key rows, once per line.
/// With the prefetch, a whole line of dimensions per iteration, the prefetches at its head: the body
/// has no branch. A test per 4 dimensions (the line's first or not) measured slower with clang++ 14
/// -O3 -march=native, which built column_pair_block<8> with its broadcasts stored to the stack and
/// reloaded (45 spills of 512-bit registers): paired steps with / without the test, GQA 32/8,
/// d = 128, Zen 4 VM: f32 4 rows per query head 0.80-0.82 (Lk = 1024 to 32768, 1 and 2 threads),
/// 2 rows 0.78, f16 and bf16 4 rows 0.81-0.82, 1 row (row layout) 1.00; g++ 12 had no spills either
/// way (1.00).
template <int S, int KB, class T, class Step>
POSENC_ALWAYS_INLINE void sweep_dims(const T* (&kr)[KB], index_t d, index_t prefetch, Step&& step) {
  constexpr index_t line = line_elements<T>;
  index_t t = 0;
  if (prefetch != 0) {
    for (; t + line <= d; t += line) {
      for (int j = 0; j < KB; ++j) prefetch_past(kr[j] + t, prefetch);
      for (index_t u = 0; u < line; u += S) step(t + u);
    }
    if (t < d)  // the rows' last, partial line (d * sizeof(T) not a multiple of 64)
      for (int j = 0; j < KB; ++j) prefetch_past(kr[j] + t, prefetch);
  }
  for (; t + 4 <= d; t += 4)
    for (int u = 0; u < 4; u += S) step(t + u);
  for (; t < d; t += S) step(t);
}

/// KB keys of column_dots: acc[j] = sum_t k_j[t] qc[t], one dimension per broadcast (sweep_dims).
template <int KB, int NP, class T>
inline void column_dots_block(const T* qc, index_t d, const T* k, index_t k_stride, T* st, index_t ld, index_t prefetch) {
  using P = typename packet_of<T>::type;
  constexpr index_t W = packet_of<T>::width, L = NP * W;
  namespace in = Eigen::internal;
  P acc[KB][NP];
  for (auto& a : acc)
    for (P& x : a) x = in::pset1<P>(T(0));
  const T* kr[KB];
  key_row_pointers(k, k_stride, kr);
  sweep_dims<1>(kr, d, prefetch, [&](index_t t) {
    P qp[NP];
    for (int i = 0; i < NP; ++i) qp[i] = in::ploadu<P>(qc + t * L + i * W);
    for (int j = 0; j < KB; ++j) {
      const P kb = in::pset1<P>(kr[j][t]);
      for (int i = 0; i < NP; ++i) acc[j][i] = in::pmadd(kb, qp[i], acc[j][i]);
    }
  });
  for (int j = 0; j < KB; ++j)
    for (int i = 0; i < NP; ++i) in::pstoreu(st + j * ld + i * W, acc[j][i]);
}

/// f(std::integral_constant<int, KB>{}, j) for the blocks of KB keys of `cols`, then f(1, j) for each
/// key left.
template <int KB, class F>
inline void for_key_blocks(index_t cols, F&& f) {
  index_t j = 0;
  for (; j + KB <= cols; j += KB) f(std::integral_constant<int, KB>{}, j);
  for (; j < cols; ++j) f(std::integral_constant<int, 1>{}, j);
}

template <int NP, class T>
void column_dots_n(const T* qc, index_t d, const T* k, index_t k_stride, index_t cols, T* st, index_t ld,
                   index_t prefetch) {
  for_key_blocks<column_block_keys / NP>(cols, [&](auto KB, index_t j) {
    column_dots_block<KB(), NP>(qc, d, k + j * k_stride, k_stride, st + j * ld, ld, prefetch);
  });
}

/// Where the pair layout (column_queries with column_pairs, add_weighted_pairs' O) keeps row r (< 16),
/// dimension t: packet 2 (t / 2) + r / 8, lane 2 (r % 8) + t % 2.
constexpr index_t pair_offset(index_t r, index_t t) { return t / 2 * 32 + r / 8 * 16 + r % 8 * 2 + t % 2; }

/// Whether column_dots takes the dimensions in pairs (column_pair_block): float with AVX-512, one packet
/// of 16 rows, d even.
template <class T>
constexpr bool column_pairs(index_t lanes, index_t d) {
#if defined(EIGEN_VECTORIZE_AVX512)
  return std::is_same_v<T, float> && lanes == 16 && d % 2 == 0;
#else
  (void)lanes;
  (void)d;
  return false;
#endif
}

#if defined(EIGEN_VECTORIZE_AVX512)
/// (x[0], x[1]) in every pair of lanes: the two floats as one 64-bit element (vbroadcastsd).
POSENC_ALWAYS_INLINE __m512 broadcast_pair(const float* x) {
  double pair;
  std::memcpy(&pair, x, sizeof pair);
  return _mm512_castpd_ps(_mm512_set1_pd(pair));
}

/// KB keys of column_dots with the dimensions in pairs: each key's pair (k[t], k[t+1]) is broadcast as
/// one 64-bit element to a whole packet and multiplies two packets of queries, lane l of packet i
/// holding row 8 i + l / 2 at dimension t + l % 2 (column_queries); the two lanes of a row are added
/// at the end. One broadcast feeds two FMAs and the KB x 2 accumulators make 16 independent chains,
/// where column_dots_block broadcasts for every FMA into 8. Measured on one core of a Zen 5 VM (GQA
/// 32/8, d = 128): bench_decode_products' column_dots at 0.97-1.00 of the FMA peak against 0.72-0.75
/// one dimension at a time; decode steps in paired calls, time with / without, f32 4 rows per query
/// head 0.94-0.95 (Lk = 1024 to 32768, 1 and 2 threads), 2 rows 0.91, f16 and bf16 4 rows 0.97.
/// NQ = 1 for at most 8 rows: the second packet would hold only zero rows, so it is neither loaded nor
/// multiplied, and lanes 8-15 of the scores are 0 (column_pair_queries). Paired steps, time with / without,
/// both load orders (one core of a Zen 5 VM, calls rotating over 384 MiB of caches, Lk = 4096 / 32768;
/// 8 rows per kv head): Llama-3-70B's 64/8 at d = 128 f32 0.91 / 0.92, f16 0.995 / 0.96; Gemma 4 E2B's
/// full layers (8/1, d = 512) f32 0.93 / 0.94, f16 1.00 / 1.01; 16 rows 1.00 / 0.99; the same results
/// bitwise.
template <int KB, int NQ>
inline void column_pair_block(const float* qp, index_t d, const float* k, index_t k_stride, float* st, index_t ld,
                              index_t prefetch) {
  __m512 acc[KB][NQ];
  for (auto& a : acc)
    for (__m512& x : a) x = _mm512_setzero_ps();
  const float* kr[KB];
  key_row_pointers(k, k_stride, kr);
  sweep_dims<2>(kr, d, prefetch, [&](index_t t) {  // dimensions t, t + 1
    __m512 q[NQ];
    for (int i = 0; i < NQ; ++i) q[i] = _mm512_loadu_ps(qp + t * 16 + i * 16);
    for (int j = 0; j < KB; ++j) {
      const __m512 kb = broadcast_pair(kr[j] + t);
      for (int i = 0; i < NQ; ++i) acc[j][i] = _mm512_fmadd_ps(kb, q[i], acc[j][i]);
    }
  });
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int j = 0; j < KB; ++j) {
    const __m512 hi = NQ == 2 ? acc[j][NQ - 1] : _mm512_setzero_ps();
    _mm512_storeu_ps(st + j * ld, _mm512_add_ps(_mm512_permutex2var_ps(acc[j][0], even, hi),
                                                _mm512_permutex2var_ps(acc[j][0], odd, hi)));
  }
}

/// The pair layout's query packets column_pair_block multiplies: 1 for up to 8 rows, else 2.
constexpr int column_pair_queries(index_t rows) { return rows <= 8 ? 1 : 2; }
#endif

/// S^T (cols x lanes, row stride ld: row j holds key j's scores for every query row; the lanes past
/// `rows` 0) = K Q^T, from qc as column_queries lays out Q (query rows as lanes, zero padded to lanes
/// = 1 or 2 packets) and K (cols x d) rows of T; `prefetch` != 0 prefetches into L2 the line `prefetch`
/// elements past each line of the key rows (a later head's rows: decode_attention::column_prefetch).
template <class T>
void column_dots(const T* qc, index_t rows, index_t lanes, index_t d, const T* k, index_t k_stride, index_t cols,
                 T* st, index_t ld, index_t prefetch = 0) {
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (column_pairs<T>(lanes, d)) {
      const auto blocks = [&](auto NQ) {
        for_key_blocks<column_block_keys>(cols, [&](auto KB, index_t j) {
          column_pair_block<KB(), NQ()>(qc, d, k + j * k_stride, k_stride, st + j * ld, ld, prefetch);
        });
      };
      if (column_pair_queries(rows) == 1)
        blocks(std::integral_constant<int, 1>{});
      else
        blocks(std::integral_constant<int, 2>{});
      return;
    }
  }
#endif
  (void)rows;  // the other layouts multiply the padded lanes too (zeros)
  if (lanes == packet_of<T>::width)
    column_dots_n<1>(qc, d, k, k_stride, cols, st, ld, prefetch);
  else
    column_dots_n<2>(qc, d, k, k_stride, cols, st, ld, prefetch);
}


/// dst[r dst_stride + j] = src[j src_stride + r] for r < rows, j < cols (the column layout's scores
/// to rows, for the hooks and masks, and back).
template <class T>
void transpose_into(const T* src, index_t src_stride, index_t rows, index_t cols, T* dst, index_t dst_stride) {
  for (index_t r = 0; r < rows; ++r)
    for (index_t j = 0; j < cols; ++j) dst[r * dst_stride + j] = src[j * src_stride + r];
}

#if defined(EIGEN_VECTORIZE_AVX512)
/// An 8 x 8 transpose of float pairs (64-bit elements): row k at dst + k dst_stride (8 pairs, 16
/// floats) = pair k of the 8 rows at src + r src_stride. Rows of src from src_rows on read as zeros,
/// rows of dst from dst_rows on are not written. A packet of the pair layout (pair_offset) is one
/// pair of 8 rows, so this turns 8 rows x 8 pairs into it and back: three rounds of two-source
/// permutes (24 for 64 pairs). Copied float by float instead (a load and a store each, 16 rows x 128
/// per kv head in and out), a 4-row GQA 32/8 step took, in turns in one process on a Zen 5 VM, 1.30x
/// the time at Lk = 32, 1.12x at 128, 1.04x at 512, 1.00x at 4096 (one thread; two: 1.20, 1.07, 1.02,
/// 1.00): a cost per call, about 8 us of a 26 us step at Lk = 32.
POSENC_ALWAYS_INLINE void transpose_pairs_8x8(const float* src, index_t src_stride, index_t src_rows, float* dst,
                                              index_t dst_stride, index_t dst_rows) {
  __m512d a[8], b[8];
  for (index_t r = 0; r < 8; ++r)
    a[r] = r < src_rows ? _mm512_loadu_pd(reinterpret_cast<const double*>(src + r * src_stride)) : _mm512_setzero_pd();
  // rows 2k and 2k + 1 interleaved: pairs 0-3 in b[2k], 4-7 in b[2k + 1]
  const __m512i lo2 = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), hi2 = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
  for (int k = 0; k < 4; ++k) {
    b[2 * k] = _mm512_permutex2var_pd(a[2 * k], lo2, a[2 * k + 1]);
    b[2 * k + 1] = _mm512_permutex2var_pd(a[2 * k], hi2, a[2 * k + 1]);
  }
  // 4 rows at a time: a[4 h + m] holds rows 4 h .. 4 h + 3 of pairs 2 m and 2 m + 1
  const __m512i lo4 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi4 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int h = 0; h < 2; ++h)
    for (int half = 0; half < 2; ++half) {
      const __m512d x = b[4 * h + half], y = b[4 * h + 2 + half];
      a[4 * h + 2 * half] = _mm512_permutex2var_pd(x, lo4, y);
      a[4 * h + 2 * half + 1] = _mm512_permutex2var_pd(x, hi4, y);
    }
  // all 8 rows: pair 2 m from the low halves of a[m] and a[4 + m], pair 2 m + 1 from the high halves
  const __m512i lo8 = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), hi8 = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  for (index_t m = 0; m < 4; ++m) {
    if (2 * m < dst_rows)
      _mm512_storeu_pd(reinterpret_cast<double*>(dst + 2 * m * dst_stride),
                       _mm512_permutex2var_pd(a[m], lo8, a[4 + m]));
    if (2 * m + 1 < dst_rows)
      _mm512_storeu_pd(reinterpret_cast<double*>(dst + (2 * m + 1) * dst_stride),
                       _mm512_permutex2var_pd(a[m], hi8, a[4 + m]));
  }
}
#endif

/// qc = the queries Q (rows x d, row stride q_stride) as column_dots reads them: Q^T [d x lanes], the
/// rows as lanes, zero padded; or where column_pairs, [d / 2 x 2 packets of 16], lane l of packet i
/// holding row 8 i + l / 2 at dimension 2 t2 + l % 2 for pair t2 (pair_offset).
template <class T>
void column_queries(const T* q, index_t q_stride, index_t rows, index_t d, index_t lanes, T* qc) {
  if (!column_pairs<T>(lanes, d)) {
    std::fill(qc, qc + d * lanes, T(0));
    transpose_into(q, q_stride, d, rows, qc, lanes);
    return;
  }
  index_t t = 0;
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    for (; t + 16 <= d; t += 16)  // 8 pairs of 16 rows, the missing rows as zeros
      for (index_t i = 0; i < 2; ++i) {
        const index_t n = std::clamp<index_t>(rows - 8 * i, 0, 8);
        transpose_pairs_8x8(n > 0 ? q + 8 * i * q_stride + t : q, q_stride, n, qc + pair_offset(8 * i, t), 32, 8);
      }
  }
#endif
  std::fill(qc + pair_offset(0, t), qc + d * lanes, T(0));
  for (index_t r = 0; r < rows; ++r)
    for (index_t u = t; u < d; ++u) qc[pair_offset(r, u)] = q[r * q_stride + u];
}

/// The register block of add_weighted_rows: rows of the output x packets of each (with AVX-512, 8 x 2:
/// 16 accumulators, 2 value packets and a weight; otherwise 8 x 1 of 16 registers). Measured with
/// AVX-512 (4 query rows = 16 per kv head, GQA 32/8, d = 128, one core of a Zen 5 VM, paired calls)
/// against 16 x 1, a weight broadcast for every FMA: 8 x 2 f32 0.93-0.95 (Lk = 4096 and 32768), f16
/// 0.96-0.97, two threads 0.995; 12 x 2 0.95, 8 x 3 0.94-0.98 (d = 128 leaves it a 2-packet tail).
#if defined(EIGEN_VECTORIZE_AVX512)
inline constexpr int weighted_column_rows = 8;
inline constexpr int weighted_column_packets = 2;
#else
inline constexpr int weighted_column_rows = 8;
inline constexpr int weighted_column_packets = 1;
#endif

/// f(std::integral_constant<int, R>{}) for the runtime r in [1, N].
template <int N, class F, int... I>
inline void with_rows_impl(index_t r, F&& f, std::integer_sequence<int, I...>) {
  (void)((r == I + 1 ? (f(std::integral_constant<int, I + 1>{}), true) : false) || ...);
}
template <int N, class F>
inline void with_rows(index_t r, F&& f) {
  with_rows_impl<N>(r, f, std::make_integer_sequence<int, N>{});
}

/// R output rows, NP packets from column t: o_r[t .. t+NP*W) = a_r o_r[..] + sum_j pt[j][r] v_j[t ..
/// t+NP*W) (a_r = alpha[r], or 1 without alpha), the R x NP accumulators in registers over all
/// `cols` keys: each value packet is loaded once for the R rows, each weight once for the NP packets.
template <int R, int NP, class T, class KV>
POSENC_ALWAYS_INLINE void add_weighted_rows_packets(const T* pt, index_t ld, const KV* v, index_t v_stride,
                                                    index_t cols, index_t t, T* o, index_t o_stride, const T* alpha,
                                                    index_t prefetch) {
  using P = typename packet_of<T>::type;
  constexpr index_t W = packet_of<T>::width;
  namespace in = Eigen::internal;
  P acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) acc[r][i] = in::ploadu<P>(o + r * o_stride + t + i * W);
  if (alpha != nullptr)
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NP; ++i) acc[r][i] = in::pmul(acc[r][i], in::pset1<P>(alpha[r]));
  for (index_t j = 0; j < cols; ++j) {
    P vp[NP];
    for (int i = 0; i < NP; ++i) vp[i] = kv_packets<KV, T>::load(v + j * v_stride + t + i * W);
    if (prefetch != 0)
      for (int i = 0; i < NP; ++i)
        if (starts_line<KV>(t + i * W)) prefetch_past(v + j * v_stride + t + i * W, prefetch);
    const T* w = pt + j * ld;
    for (int r = 0; r < R; ++r) {
      const P wr = in::pset1<P>(w[r]);
      for (int i = 0; i < NP; ++i) acc[r][i] = in::pmadd(wr, vp[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) in::pstoreu(o + r * o_stride + t + i * W, acc[r][i]);
}

/// R output rows over the whole width dv: weighted_column_packets packets at a time, then single
/// packets, then a scalar tail.
template <int R, class T, class KV>
inline void add_weighted_rows_block(const T* pt, index_t ld, const KV* v, index_t v_stride, index_t cols, index_t dv,
                                    T* o, index_t o_stride, const T* alpha, index_t prefetch) {
  constexpr index_t W = packet_of<T>::width;
  constexpr int NP = weighted_column_packets;
  index_t t = 0;
  for (; t + NP * W <= dv; t += NP * W)
    add_weighted_rows_packets<R, NP>(pt, ld, v, v_stride, cols, t, o, o_stride, alpha, prefetch);
  for (; t + W <= dv; t += W) add_weighted_rows_packets<R, 1>(pt, ld, v, v_stride, cols, t, o, o_stride, alpha, prefetch);
  for (; t < dv; ++t)
    for (int r = 0; r < R; ++r) {
      T sum = alpha != nullptr ? alpha[r] * o[r * o_stride + t] : o[r * o_stride + t];
      for (index_t j = 0; j < cols; ++j) sum += pt[j * ld + r] * kv_value<T>(v[j * v_stride + t]);
      o[r * o_stride + t] = sum;
    }
}

/// O (rows x dv, row stride o_stride) = diag(alpha) O + P V with P given as P^T (cols x rows, row
/// stride ld) and V (cols x dv) stored as KV; alpha may be null (no rescale). Each value packet is
/// loaded once per weighted_column_rows rows; `prefetch` != 0 prefetches into L2 the line `prefetch`
/// elements past each line of the value rows.
template <class T, class KV>
void add_weighted_rows(const T* pt, index_t ld, index_t rows, const KV* v, index_t v_stride, index_t cols, index_t dv,
                       T* o, index_t o_stride, const T* alpha, index_t prefetch = 0) {
  constexpr int B = weighted_column_rows;
  for (index_t r = 0; r < rows; r += B)
    with_rows<B>(std::min<index_t>(B, rows - r), [&](auto R) {
      add_weighted_rows_block<R()>(pt + r, ld, v, v_stride, cols, dv, o + r * o_stride, o_stride,
                                   alpha != nullptr ? alpha + r : nullptr, r == 0 ? prefetch : 0);
    });
}

#if defined(EIGEN_VECTORIZE_AVX512)
/// Keys per chunk of add_weighted_pairs: its weights stay in registers (2 packets a key) while the
/// chunk's value rows are read across the whole width, so that a chunk puts 8 lines into each L1 set
/// where rows are 4 KiB apart (f32, 8 kv heads of 128), not a tile's 32. Taking the keys of the whole
/// tile per line instead (16 accumulators across all 32 keys) ran at 0.69-0.75 of the FMA peak on such
/// rows and 0.79-0.89 with each head's rows adjacent or 64 bytes longer; these chunks at 0.85 in place
/// and 0.88 adjacent (bench_decode_products, one core of a Zen 5 VM; 0.92-0.93 and 0.93-0.94 since
/// each chunk duplicates its own weights: weighted_pairs_chunk). Decode steps, paired calls against
/// the whole-tile loop, the same results bitwise (GQA 32/8, d = 128, 4 rows per query head, calls
/// rotating over 384 MiB of caches): 0.966-0.968 (Lk = 4096, both orders; 0.987 in a run on a slow
/// machine), 0.966 (32768), 0.961 and 0.998 on 2 threads.
inline constexpr int weighted_pair_chunk_keys = 8;

/// O += P V for up to 16 rows in the pair layout of column_queries (lane l of packet i of dimension pair
/// p: row 8 i + l / 2, dimension 2 p + l % 2), so that each value pair (v[t], v[t+1]) is broadcast once
/// (broadcast_pair) for two FMAs against the weights duplicated the same way (duplicate_lanes), and each
/// value line is read once for all the rows. NPR dimension pairs from dimension t, over the KC keys of
/// rows vr whose weights are w; the accumulators first multiplied by alpha (duplicated as the weights
/// are) unless it is null.
template <int NPR, int KC>
POSENC_ALWAYS_INLINE void weighted_pairs_group(const __m512 (&w)[KC][2], const float* const (&vr)[KC], index_t t,
                                               float* oc, const __m512* alpha, index_t prefetch) {
  __m512 acc[NPR][2];
  for (int i = 0; i < NPR; ++i)
    for (int g = 0; g < 2; ++g) acc[i][g] = _mm512_loadu_ps(oc + (t / 2 + i) * 32 + g * 16);
  if (alpha != nullptr)
    for (int g = 0; g < 2; ++g)
      for (int i = 0; i < NPR; ++i) acc[i][g] = _mm512_mul_ps(acc[i][g], alpha[g]);
  if (prefetch != 0 && starts_line<float>(t))
    for (int j = 0; j < KC; ++j) prefetch_past(vr[j] + t, prefetch);
  for (int j = 0; j < KC; ++j)
    for (int i = 0; i < NPR; ++i) {
      const __m512 b = broadcast_pair(vr[j] + t + 2 * i);
      acc[i][0] = _mm512_fmadd_ps(b, w[j][0], acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(b, w[j][1], acc[i][1]);
    }
  for (int i = 0; i < NPR; ++i)
    for (int g = 0; g < 2; ++g) _mm512_storeu_ps(oc + (t / 2 + i) * 32 + g * 16, acc[i][g]);
}

/// x's 16 lanes (one per query row) each twice, as the pair layout's lanes take them: lanes 0-7 in
/// out[0] (x[0], x[0], x[1], x[1], ...), lanes 8-15 in out[1].
POSENC_ALWAYS_INLINE void duplicate_lanes(const float* x, __m512 (&out)[2]) {
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  const __m512 p = _mm512_loadu_ps(x);
  out[0] = _mm512_permutexvar_ps(lo, p);
  out[1] = _mm512_permutexvar_ps(hi, p);
}

/// One chunk of KC keys over the whole width dv, its weights (P^T's rows, row stride ld) and alpha
/// (16 lanes, or null) duplicated into registers here: 4 dimension pairs at a time (8 accumulators
/// beside the chunk's 2 KC weight packets), then single pairs. Each accumulator still takes its keys in order, so the sums are the
/// same as with all the tile's keys at once. Duplicating the weights of the whole tile into a buffer
/// first, and loading them from it per chunk, held the product at 0.88-0.90 of the FMA peak against
/// 0.92-0.94 (bench_decode_products, one core of a Zen 5 VM, the two builds in turn); decode steps,
/// paired calls against it (f32 4 rows per query head, GQA 32/8, d = 128, calls rotating over
/// 384 MiB of caches): 0.974-0.987 (Lk = 1024 to 32768, one thread), 0.977 and 1.007 on two. Chunks
/// of 10 to 12 keys (tails of 2 to 10) ran at 0.83-0.89.
template <int KC>
inline void weighted_pairs_chunk(const float* pt, index_t ld, const float* v, index_t v_stride, index_t dv, float* oc,
                                 const float* alpha, index_t prefetch) {
  __m512 w[KC][2], a[2];
  for (int j = 0; j < KC; ++j) duplicate_lanes(pt + j * ld, w[j]);
  if (alpha != nullptr) duplicate_lanes(alpha, a);
  const __m512* ap = alpha != nullptr ? a : nullptr;
  const float* vr[KC];
  key_row_pointers(v, v_stride, vr);
  index_t t = 0;
  for (; t + 8 <= dv; t += 8) weighted_pairs_group<4>(w, vr, t, oc, ap, prefetch);
  for (; t < dv; t += 2) weighted_pairs_group<1>(w, vr, t, oc, ap, prefetch);
}

/// O (pair layout, oc [dv / 2 x 32]) = diag(alpha) O + P V from P^T (cols x 16 lanes, row stride ld) and
/// V (cols x dv, dv even) in f32: weighted_pair_chunk_keys keys at a time, alpha applied with the first
/// chunk.
inline void add_weighted_pairs(const float* pt, index_t ld, const float* v, index_t v_stride, index_t cols, index_t dv,
                               float* oc, const float* alpha, index_t prefetch) {
  for_key_blocks<weighted_pair_chunk_keys>(cols, [&](auto KC, index_t j) {
    weighted_pairs_chunk<KC()>(pt + j * ld, ld, v + j * v_stride, v_stride, dv, oc, j == 0 ? alpha : nullptr, prefetch);
  });
}
#endif

/// acc (rows x dv, row stride dv) = oc in the pair layout (add_weighted_pairs), rows <= 16, dv even.
template <class T>
void unpair_rows(const T* oc, index_t rows, index_t dv, T* acc) {
  index_t t = 0;
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    for (; t + 16 <= dv; t += 16)  // 8 pairs of the 16 rows (transpose_pairs_8x8)
      for (index_t i = 0; 8 * i < rows && i < 2; ++i)
        transpose_pairs_8x8(oc + pair_offset(8 * i, t), 32, 8, acc + 8 * i * dv + t, dv,
                            std::min<index_t>(rows - 8 * i, 8));
  }
#endif
  for (index_t r = 0; r < rows; ++r)
    for (index_t u = t; u < dv; ++u) acc[r * dv + u] = oc[pair_offset(r, u)];
}

/// R output rows, N packets each from column t: o_r[t .. t+N*W) += sum_j p_r[j] v_j[t .. t+N*W), the
/// R x N accumulators in registers, each value packet loaded once for the R rows; `prefetch` as
/// add_weighted. Lines are found from the block's first column, so a block narrower than a line (f16 /
/// bf16 values with AVX2: 2 packets, 32 bytes) prefetches each line twice. Once per line took 1.05-1.10x
/// the time at Lk = 4096 and 32768 on a Zen 3 VM (1 row, GQA 32/8, d = 128, f16, paired
/// calls rotating over 512 MiB of caches); a prefetch at every packet, here and in row_dots_block
/// (twice per line for f32 too), 0.97-0.99x for f32 and 0.94-1.00x for f16 there: not kept, 2-4 % on
/// one machine.
template <int R, int N, int Locality = to_l2, class T, class KV>
POSENC_ALWAYS_INLINE void add_weighted_block(const T* p, index_t p_stride, const KV* v, index_t v_stride, index_t cols,
                                             T* o, index_t o_stride, index_t prefetch) {
  using P = typename packet_of<T>::type;
  constexpr index_t W = packet_of<T>::width;
  namespace in = Eigen::internal;
  P acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = in::ploadu<P>(o + r * o_stride + i * W);
  for (index_t j = 0; j < cols; ++j) {
    P vp[N];
    for (int i = 0; i < N; ++i) vp[i] = kv_packets<KV, T>::load(v + j * v_stride + i * W);
    if (prefetch != 0)
      for (int i = 0; i < N; ++i)
        if (starts_line<KV>(i * W)) prefetch_past<Locality>(v + j * v_stride + i * W, prefetch);
    for (int r = 0; r < R; ++r) {
      const P w = in::pset1<P>(p[r * p_stride + j]);
      for (int i = 0; i < N; ++i) acc[r][i] = in::pmadd(w, vp[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) in::pstoreu(o + r * o_stride + i * W, acc[r][i]);
}

/// add_weighted for one block of R rows over the whole width dv: N packets at a time, then single
/// packets, then a scalar tail.
template <int R, int Locality, class T, class KV>
inline void add_weighted_width(const T* p, index_t p_stride, const KV* v, index_t v_stride, index_t cols, index_t dv,
                               T* o, index_t o_stride, index_t prefetch) {
  constexpr index_t W = packet_of<T>::width;
  constexpr int N = weighted_block_packets;
  index_t t = 0;
  for (; t + N * W <= dv; t += N * W)
    add_weighted_block<R, N, Locality>(p, p_stride, v + t, v_stride, cols, o + t, o_stride, prefetch);
  for (; t + W <= dv; t += W)
    add_weighted_block<R, 1, Locality>(p, p_stride, v + t, v_stride, cols, o + t, o_stride, prefetch);
  for (; t < dv; ++t)
    for (index_t r = 0; r < R; ++r) {
      T sum = o[r * o_stride + t];
      for (index_t j = 0; j < cols; ++j) sum += p[r * p_stride + j] * kv_value<T>(v[j * v_stride + t]);
      o[r * o_stride + t] = sum;
    }
}

/// O (rows x dv, row stride o_stride) += P (rows x cols, row stride p_stride) V (cols x dv, stored as
/// KV). Each value row is loaded from memory once; `prefetch` != 0 prefetches the line `prefetch`
/// elements past each line of the value rows (decode_prefetch_rows rows further:
/// decode_attention::rows_ahead), into L2 (Locality to_l2) or L1 (to_l1). The row blocks are
/// dispatched once per chunk of keys (for up to 4 rows, once per call), each then runs over the whole
/// width.
template <int Locality = to_l2, class T, class KV>
void add_weighted(const T* p, index_t p_stride, index_t rows, const KV* v, index_t v_stride, index_t cols, index_t dv,
                  T* o, index_t o_stride, index_t prefetch = 0) {
  const index_t chunk = rows <= 4 ? cols : weighted_chunk_keys;
  for (index_t j0 = 0; j0 < cols; j0 += chunk) {
    const index_t nj = std::min(chunk, cols - j0);
    for_row_blocks(rows, [&](auto R, index_t r) {
      add_weighted_width<R(), Locality>(p + r * p_stride + j0, p_stride, v + j0 * v_stride, v_stride, nj, dv,
                                        o + r * o_stride, o_stride, r == 0 ? prefetch : 0);
    });
  }
}

}  // namespace posenc::detail
