// posenc/detail/table.hpp — a 2-D parameter table that is either owned or viewed from host memory.
//
// Learned absolute embeddings [max_positions, d_model] and T5's relative_attention_bias
// [num_buckets, heads] are weights the host already has (an nn.Embedding weight, a safetensors
// tensor): viewing them must not copy. Owning is for callers that build a table here. Owned data
// sit behind a shared_ptr so copies of the encoding share them and the view never dangles.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "posenc/tensor.hpp"

namespace posenc::detail {

template <class W>
class table_storage {
 public:
  using owned_type = Eigen::Tensor<W, 2, Eigen::RowMajor>;

  /// View host memory (no copy; the caller keeps it alive).
  explicit table_storage(tensor_map<const W, 2> view) : view_(view) {}
  /// Take ownership (moved in, no copy).
  explicit table_storage(owned_type owned)
      : owned_(std::make_shared<const owned_type>(std::move(owned))),
        view_(owned_->data(), owned_->dimension(0), owned_->dimension(1)) {}

  [[nodiscard]] const tensor_map<const W, 2>& view() const { return view_; }
  [[nodiscard]] index_t rows() const { return view_.dimension(0); }
  [[nodiscard]] index_t cols() const { return view_.dimension(1); }
  [[nodiscard]] const W* row(index_t r) const { return view_.data() + r * view_.dimension(1); }
  [[nodiscard]] bool owns() const { return owned_ != nullptr; }

 private:
  std::shared_ptr<const owned_type> owned_;
  tensor_map<const W, 2> view_;
};

/// The same values in double and in float, filled once (double first, then `round()`), so that a
/// kernel hook reads its scalar type without converting per tile (T5's and TUPE's per-call tables).
struct dual_values {
  std::vector<double> d;
  std::vector<float> f;
  /// f = d rounded to float.
  void round() { f.assign(d.begin(), d.end()); }
  template <class T>
  [[nodiscard]] const T* data() const {
    if constexpr (std::is_same_v<T, float>) return f.data();
    else return d.data();
  }
};

}  // namespace posenc::detail
