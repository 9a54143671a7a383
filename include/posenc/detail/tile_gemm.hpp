// posenc/detail/tile_gemm.hpp — tile products on pre-packed operands (Eigen's GEBP micro-kernel).
//
// `A * B` on Eigen matrices packs both operands into GEBP's panel layout on every call. The fused
// kernel multiplies each K and V block by several query blocks and each query block by every K
// block, so through Eigen's expressions it re-packed K, V and the scaled queries once per tile: a
// profile of the expression-based kernel (clang 14, L = 1024, d = 128, causal) put the three pack
// routines at 14 % of the time, next to 61 % in the micro-kernel. Here the caller packs an operand
// once and reuses the packed copy in as many products as it likes; only the probability tile P,
// new for every tile, is packed per product.
//
// Eigen's internals are used exactly as general_matrix_matrix_product::run does (Eigen 3.4,
// Eigen/src/Core/products/GeneralMatrixMatrix.h): gemm_pack_lhs / gemm_pack_rhs / gebp_kernel with
// the traits' mr, nr, one depth block (kc = the whole depth: Eigen's own blocking picks kc = depth
// for the kernel's shapes, d <= 256 and key blocks <= 256) and the product's columns in chunks of
// Eigen's nc (computeProductBlockingSizes), so the micro-kernel sees the same blocks as Eigen's GEMM.
//
// In column-major terms every product is C (m x n, column stride ldc) += alpha * A (m x k) * B (k x n).
// The kernel's row-major tiles are the transposes: S (q x keys, row-major) = C with m = keys,
// n = queries; out (q x dv, row-major) = C with m = dv, n = queries.
#pragma once

#include <algorithm>
#include <numeric>

#include <Eigen/Core>

#include "posenc/tensor.hpp"

static_assert(EIGEN_VERSION_AT_LEAST(3, 4, 0), "posenc's tile products use Eigen 3.4's GEBP internals");

namespace posenc::detail {

template <class T>
class tile_gemm {
  using traits = Eigen::internal::gebp_traits<T, T>;
  using row_major_src = Eigen::internal::const_blas_data_mapper<T, index_t, Eigen::RowMajor>;
  using col_major_src = Eigen::internal::const_blas_data_mapper<T, index_t, Eigen::ColMajor>;
  using result = Eigen::internal::blas_data_mapper<T, index_t, Eigen::ColMajor, Eigen::Unaligned, 1>;

 public:
  /// Rows of A per micro-panel: a packed A's row prefix is itself a packed A only at multiples of it.
  static constexpr index_t a_panel = traits::mr;
  /// Columns of B per micro-panel: a packed B's column prefix is itself a packed B only at multiples of it.
  static constexpr index_t b_panel = traits::nr;
  /// Rows after which an operand may be packed piecewise: packing rows [0, r) and [r, n) at offset
  /// r * depth gives the layout of packing all n rows at once, for pack_a and pack_b alike, when r is
  /// a multiple of this (whole micro-panels of A, mr rows, and of B, nr columns).
  static constexpr index_t pack_step = std::lcm(static_cast<index_t>(traits::mr), static_cast<index_t>(traits::nr));
  /// Packed operands live in aligned buffers (the micro-kernel loads A with aligned packet loads).
  using buffer = Eigen::Matrix<T, Eigen::Dynamic, 1>;

  /// A = M, M row-major m x k with row stride ld (a K block: m keys x k = head_dim).
  static void pack_a(T* dst, const T* m, index_t ld, index_t rows, index_t depth) {
    Eigen::internal::gemm_pack_lhs<T, index_t, row_major_src, traits::mr, traits::LhsProgress,
                                   typename traits::LhsPacket4Packing, Eigen::RowMajor>
        pack;
    pack(dst, row_major_src(m, ld), depth, rows);
  }

  /// A = M^T, M row-major k x m with row stride ld (a V block: k keys x m = value_dim).
  static void pack_a_transposed(T* dst, const T* m, index_t ld, index_t rows, index_t depth) {
    Eigen::internal::gemm_pack_lhs<T, index_t, col_major_src, traits::mr, traits::LhsProgress,
                                   typename traits::LhsPacket4Packing, Eigen::ColMajor>
        pack;
    pack(dst, col_major_src(m, ld), depth, rows);
  }

  /// B = M^T, M row-major n x k with row stride ld (queries: n rows x k = head_dim; or P: n query
  /// rows x k keys).
  static void pack_b(T* dst, const T* m, index_t ld, index_t cols, index_t depth) {
    Eigen::internal::gemm_pack_rhs<T, index_t, col_major_src, traits::nr, Eigen::ColMajor> pack;
    pack(dst, col_major_src(m, ld), depth, cols);
  }

  /// Column chunk of the products of an (m x k) by (k x n) shape, as Eigen's blocking chooses it,
  /// rounded to whole micro-panels of B.
  [[nodiscard]] static index_t column_chunk(index_t rows, index_t depth, index_t cols) {
    if (rows <= 0 || depth <= 0 || cols <= 0) return traits::nr;  // empty: nothing is multiplied
    index_t k = depth, m = rows, n = cols;
    Eigen::internal::computeProductBlockingSizes<T, T>(k, m, n, index_t{1});
    return std::max<index_t>(traits::nr, n / traits::nr * traits::nr);
  }

  /// C += alpha A B over packed operands. a_stride: the depth A was packed with (>= depth; a packed
  /// A is reused with a shorter depth, i.e. fewer keys of a V block). chunk: column_chunk().
  static void multiply(T* c, index_t ldc, const T* a, const T* b, index_t rows, index_t depth, index_t cols, T alpha,
                       index_t a_stride, index_t chunk) {
    Eigen::internal::gebp_kernel<T, T, index_t, result, traits::mr, traits::nr> gebp;
    const result res(c, ldc);
    for (index_t j = 0; j < cols; j += chunk) {
      const index_t n = std::min(chunk, cols - j);
      gebp(res.getSubMapper(0, j), a, b + j * depth, rows, depth, n, alpha, a_stride, depth);
    }
  }
};

}  // namespace posenc::detail
