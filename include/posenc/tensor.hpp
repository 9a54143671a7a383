// posenc/tensor.hpp — zero-copy views over host activation buffers.
//
// Activations are rank-4 row-major tensors in one of the two layouts that hosts produce:
//   BSHD [batch, seq, heads, head_dim]  what a projection `x W^T` reshaped produces (flash-attn);
//   BHSD [batch, heads, seq, head_dim]  what PyTorch's scaled_dot_product_attention takes.
// In both, one token of one head is `head_dim` contiguous values; only the stride between tokens
// differs (heads*head_dim vs head_dim). heads_view hides that difference: the kernel asks for the
// [seq x head_dim] matrix of one (batch, head) as a strided Eigen::Map, never a copy.
#pragma once

#include <cstdint>
#include <type_traits>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include "posenc/error.hpp"

namespace posenc {

using index_t = Eigen::Index;

enum class layout {
  bshd,  ///< [batch, seq, heads, head_dim]
  bhsd,  ///< [batch, heads, seq, head_dim]
};

/// Row-major rank-N tensor map over a host buffer (T may be const).
template <class T, int Rank>
using tensor_map = Eigen::TensorMap<Eigen::Tensor<T, Rank, Eigen::RowMajor>>;

/// Row-major dynamic matrix with a runtime row stride over host memory: one (batch, head) slab of a
/// heads_view, a score tile. Two aliases (not one with std::conditional) so that T stays deducible in
/// hook signatures such as `template <class T> void transform_qk(..., matrix_map<T> x)`.
template <class T>
using matrix_map = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, Eigen::Unaligned,
                              Eigen::OuterStride<>>;
template <class T>
using const_matrix_map = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                                    Eigen::Unaligned, Eigen::OuterStride<>>;

/// A rank-4 activation tensor [batch, seq, heads, head_dim] viewed over a host buffer in either
/// layout. T is `float`, `double`, or a const version of them for inputs.
template <class T>
class heads_view {
 public:
  using scalar = std::remove_const_t<T>;
  /// matrix_map<scalar>, or const_matrix_map<scalar> for a const view.
  using matrix_type = std::conditional_t<std::is_const_v<T>, const_matrix_map<scalar>, matrix_map<scalar>>;

  /// View a TensorMap whose dimensions are in memory order (BSHD or BHSD as `order` says).
  heads_view(tensor_map<T, 4> map, layout order) : heads_view(map.data(), map.dimensions(), order) {}

  /// Implicit const view of a mutable one.
  template <class U>
    requires(std::is_const_v<T> && std::is_same_v<const U, T>)
  heads_view(const heads_view<U>& other)  // NOLINT(google-explicit-constructor)
      : data_(other.data()), batch_(other.batch()), seq_(other.seq()), heads_(other.heads()),
        dim_(other.dim()), order_(other.order()) {}

  heads_view(T* data, index_t batch, index_t seq, index_t heads, index_t dim, layout order)
      : data_(data), batch_(batch), seq_(seq), heads_(heads), dim_(dim), order_(order) {
    require(batch >= 0 && seq >= 0 && heads >= 0 && dim >= 0, "heads_view", "dimensions must be >= 0", "[batch ",
            batch, ", seq ", seq, ", heads ", heads, ", head_dim ", dim, "]");
    require(data != nullptr || batch * seq * heads * dim == 0, "heads_view", "data must not be null");
  }

  [[nodiscard]] T* data() const { return data_; }
  [[nodiscard]] index_t batch() const { return batch_; }
  [[nodiscard]] index_t seq() const { return seq_; }
  [[nodiscard]] index_t heads() const { return heads_; }
  [[nodiscard]] index_t dim() const { return dim_; }
  [[nodiscard]] layout order() const { return order_; }
  [[nodiscard]] index_t size() const { return batch_ * seq_ * heads_ * dim_; }

  /// Distance in elements between token s and s+1 of the same (batch, head).
  [[nodiscard]] index_t token_stride() const { return order_ == layout::bshd ? heads_ * dim_ : dim_; }
  /// Distance in elements between head h and h+1 of the same (batch, token).
  [[nodiscard]] index_t head_stride() const { return order_ == layout::bshd ? dim_ : seq_ * dim_; }
  [[nodiscard]] index_t batch_stride() const { return seq_ * heads_ * dim_; }

  /// Pointer to the head_dim contiguous features of token s, head h of batch row b.
  [[nodiscard]] T* row(index_t b, index_t s, index_t h) const {
    return data_ + b * batch_stride() + s * token_stride() + h * head_stride();
  }
  [[nodiscard]] T& operator()(index_t b, index_t s, index_t h, index_t d) const { return row(b, s, h)[d]; }

  /// The [seq x head_dim] matrix of one (batch, head), rows `first .. first+count-1`.
  [[nodiscard]] matrix_type matrix(index_t b, index_t h, index_t first = 0, index_t count = -1) const {
    if (count < 0) count = seq_ - first;
    return matrix_type(row(b, first, h), count, dim_, Eigen::OuterStride<>(token_stride()));
  }

  /// The underlying TensorMap, dimensions in memory order.
  [[nodiscard]] tensor_map<T, 4> tensor() const {
    return order_ == layout::bshd ? tensor_map<T, 4>(data_, batch_, seq_, heads_, dim_)
                                  : tensor_map<T, 4>(data_, batch_, heads_, seq_, dim_);
  }

 private:
  heads_view(T* data, const Eigen::DSizes<index_t, 4>& d, layout order)
      : heads_view(data, d[0], order == layout::bshd ? d[1] : d[2], order == layout::bshd ? d[2] : d[1], d[3],
                   order) {}

  T* data_;
  index_t batch_, seq_, heads_, dim_;
  layout order_;
};

/// View a BSHD buffer [batch, seq, heads, head_dim].
template <class T>
[[nodiscard]] heads_view<T> bshd(T* data, index_t batch, index_t seq, index_t heads, index_t dim) {
  return heads_view<T>(data, batch, seq, heads, dim, layout::bshd);
}
/// View a BHSD buffer [batch, heads, seq, head_dim] (dimensions given in memory order).
template <class T>
[[nodiscard]] heads_view<T> bhsd(T* data, index_t batch, index_t heads, index_t seq, index_t dim) {
  return heads_view<T>(data, batch, seq, heads, dim, layout::bhsd);
}
template <class T>
[[nodiscard]] heads_view<T> bshd(tensor_map<T, 4> map) { return heads_view<T>(map, layout::bshd); }
template <class T>
[[nodiscard]] heads_view<T> bhsd(tensor_map<T, 4> map) { return heads_view<T>(map, layout::bhsd); }

}  // namespace posenc
