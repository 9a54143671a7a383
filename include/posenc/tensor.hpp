// posenc/tensor.hpp — zero-copy views over host activation buffers.
//
// Activations are rank-4 tensors [batch, seq, heads, head_dim] in the layouts hosts produce:
//   BSHD [batch, seq, heads, head_dim]  what a projection `x W^T` reshaped produces (flash-attn);
//   BHSD [batch, heads, seq, head_dim]  what PyTorch's scaled_dot_product_attention takes;
//   and any strided view of them: the first tokens of a preallocated KV cache, the q, k or v heads of
//   a fused QKV projection, cache rows padded past their heads.
// In all of them one token of one head is `head_dim` contiguous values; only the distances between
// tokens, heads and batch rows differ. heads_view hides that difference: the kernel asks for the
// [seq x head_dim] matrix of one (batch, head) as a strided Eigen::Map, never a copy.
#pragma once

#include <algorithm>
#include <array>
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

/// Distances in elements between consecutive batch rows, tokens and heads of a heads_view. The
/// head_dim values of one (batch, token, head) are always contiguous.
struct view_strides {
  index_t batch = 0;
  index_t token = 0;
  index_t head = 0;
  friend bool operator==(const view_strides&, const view_strides&) = default;
};

/// A rank-4 activation tensor [batch, seq, heads, head_dim] viewed over a host buffer: BSHD, BHSD or
/// any strides (view_strides). T is `float`, `double`, `Eigen::half`, `Eigen::bfloat16`, or a const
/// version of them for inputs.
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
        dim_(other.dim()), strides_(other.strides()), order_(other.order()) {}

  /// A dense buffer in the layout `order`.
  heads_view(T* data, index_t batch, index_t seq, index_t heads, index_t dim, layout order)
      : heads_view(data, batch, seq, heads, dim, dense_strides(seq, heads, dim, order), order) {}

  /// Any strides. A view that is written to (T not const) must not reach one element twice: checked
  /// here, so that no two threads of a call ever write the same output.
  heads_view(T* data, index_t batch, index_t seq, index_t heads, index_t dim, view_strides strides)
      : heads_view(data, batch, seq, heads, dim, strides,
                   strides.token >= strides.head ? layout::bshd : layout::bhsd) {}

  [[nodiscard]] T* data() const { return data_; }
  [[nodiscard]] index_t batch() const { return batch_; }
  [[nodiscard]] index_t seq() const { return seq_; }
  [[nodiscard]] index_t heads() const { return heads_; }
  [[nodiscard]] index_t dim() const { return dim_; }
  [[nodiscard]] layout order() const { return order_; }
  /// The number of elements viewed, batch x seq x heads x head_dim.
  [[nodiscard]] index_t size() const { return batch_ * seq_ * heads_ * dim_; }
  /// Elements from data() to one past the last element viewed (size() for a dense view; 0 if empty):
  /// the span of host memory the view reaches.
  [[nodiscard]] index_t extent() const {
    if (size() == 0) return 0;
    return (batch_ - 1) * strides_.batch + (seq_ - 1) * strides_.token + (heads_ - 1) * strides_.head + dim_;
  }
  [[nodiscard]] view_strides strides() const { return strides_; }
  /// Whether the view is a whole dense BSHD or BHSD buffer (what tensor() can return).
  [[nodiscard]] bool dense() const { return strides_ == dense_strides(seq_, heads_, dim_, order_); }

  /// Distance in elements between token s and s+1 of the same (batch, head).
  [[nodiscard]] index_t token_stride() const { return strides_.token; }
  /// Distance in elements between head h and h+1 of the same (batch, token).
  [[nodiscard]] index_t head_stride() const { return strides_.head; }
  /// Distance in elements between batch row b and b+1 of the same (token, head).
  [[nodiscard]] index_t batch_stride() const { return strides_.batch; }

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

  /// Tokens `first .. first+count-1` of every (batch, head), with the same strides: the filled part of
  /// a preallocated cache, in either layout and for any batch.
  [[nodiscard]] heads_view slice_tokens(index_t first, index_t count) const {
    require(first >= 0 && count >= 0 && first + count <= seq_, "slice_tokens", "must lie within the view's tokens",
            "[", first, ", ", first + count, ") of ", seq_);
    return heads_view(count == 0 ? data_ : data_ + first * strides_.token, batch_, count, heads_, dim_, strides_,
                      order_);
  }
  /// Heads `first .. first+count-1` of every (batch, token), with the same strides: the q, k or v heads
  /// of a fused projection buffer [batch, seq, heads + 2 kv_heads, head_dim].
  [[nodiscard]] heads_view slice_heads(index_t first, index_t count) const {
    require(first >= 0 && count >= 0 && first + count <= heads_, "slice_heads", "must lie within the view's heads",
            "[", first, ", ", first + count, ") of ", heads_);
    return heads_view(count == 0 ? data_ : data_ + first * strides_.head, batch_, seq_, count, dim_, strides_,
                      order_);
  }

  /// The underlying TensorMap, dimensions in memory order; the view must be dense().
  [[nodiscard]] tensor_map<T, 4> tensor() const {
    require(dense(), "tensor", "needs a dense BSHD or BHSD view (a strided view has no TensorMap)", "strides [",
            strides_.batch, ", ", strides_.token, ", ", strides_.head, "]");
    return order_ == layout::bshd ? tensor_map<T, 4>(data_, batch_, seq_, heads_, dim_)
                                  : tensor_map<T, 4>(data_, batch_, heads_, seq_, dim_);
  }

 private:
  heads_view(T* data, const Eigen::DSizes<index_t, 4>& d, layout order)
      : heads_view(data, d[0], order == layout::bshd ? d[1] : d[2], order == layout::bshd ? d[2] : d[1], d[3],
                   order) {}

  heads_view(T* data, index_t batch, index_t seq, index_t heads, index_t dim, view_strides strides, layout order)
      : data_(data), batch_(batch), seq_(seq), heads_(heads), dim_(dim), strides_(strides), order_(order) {
    require(batch >= 0 && seq >= 0 && heads >= 0 && dim >= 0, "heads_view", "dimensions must be >= 0", "[batch ",
            batch, ", seq ", seq, ", heads ", heads, ", head_dim ", dim, "]");
    require(strides.batch >= 0 && strides.token >= 0 && strides.head >= 0, "heads_view", "strides must be >= 0",
            "[batch ", strides.batch, ", token ", strides.token, ", head ", strides.head, "]");
    require(data != nullptr || size() == 0, "heads_view", "data must not be null");
    if constexpr (!std::is_const_v<T>)
      require(rows_disjoint(), "heads_view", "the strides of a written view must not reach an element twice",
              "[batch ", batch, ", seq ", seq, ", heads ", heads, ", head_dim ", dim, "] with strides [batch ",
              strides.batch, ", token ", strides.token, ", head ", strides.head, "]");
  }

  static view_strides dense_strides(index_t seq, index_t heads, index_t dim, layout order) {
    return order == layout::bshd ? view_strides{seq * heads * dim, heads * dim, dim}
                                 : view_strides{seq * heads * dim, dim, seq * dim};
  }

  /// Whether no two (batch, token, head) rows share an element: with the dimensions of more than one
  /// entry sorted by stride, each stride clears everything the smaller ones reach (a sufficient
  /// condition that every layout a host allocates meets).
  [[nodiscard]] bool rows_disjoint() const {
    if (size() == 0) return true;
    std::array<std::array<index_t, 2>, 3> d{{{strides_.batch, batch_}, {strides_.token, seq_}, {strides_.head, heads_}}};
    std::sort(d.begin(), d.end());
    index_t reach = dim_;
    for (const auto& [stride, count] : d) {
      if (count <= 1) continue;
      if (stride < reach) return false;
      reach = (count - 1) * stride + reach;
    }
    return true;
  }

  T* data_;
  index_t batch_, seq_, heads_, dim_;
  view_strides strides_;
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
/// View a buffer with any strides (view_strides), e.g. a cache whose token rows are padded.
template <class T>
[[nodiscard]] heads_view<T> strided(T* data, index_t batch, index_t seq, index_t heads, index_t dim,
                                    view_strides strides) {
  return heads_view<T>(data, batch, seq, heads, dim, strides);
}
template <class T>
[[nodiscard]] heads_view<T> bshd(tensor_map<T, 4> map) { return heads_view<T>(map, layout::bshd); }
template <class T>
[[nodiscard]] heads_view<T> bhsd(tensor_map<T, 4> map) { return heads_view<T>(map, layout::bhsd); }

}  // namespace posenc
