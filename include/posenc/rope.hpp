// posenc/rope.hpp — rotary position embedding (RoPE; Su et al. 2021, RoFormer sec. 3.4) with every
// Hugging Face scaling type, both pair layouts, partial rotary, exact angles, a shareable cos/sin
// table, context shifting and the attention kernel's Q/K-transform hook.
//
//   posenc::rope r(posenc::rope_config{
//       .head_dim = 128, .rope_theta = 5e5, .layout = posenc::rope_layout::half,
//       .scaling = {.rope_type = posenc::rope_type::llama3, .factor = 8, .original_max_position_embeddings = 8192,
//                   .low_freq_factor = 1, .high_freq_factor = 4},
//       .max_position_embeddings = 131072});
//   r.apply(q, k, posenc::view(pos));          // q and k in place, positions [batch, seq]
//   posenc::attention(q, k, v, out, r, opts);  // or fused: r is a Q/K transform of the kernel
//
// Nothing here caches state between calls: dynamic NTK and LongRoPE take the current sequence length
// as an argument (rope::at), or derive it from the positions of the call (FORMAT.md section 3).
// Every object is immutable once constructed and may be shared between threads.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "posenc/detail/kv_storage.hpp"
#include "posenc/detail/prefetch.hpp"
#include "posenc/detail/rope_kernels.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/positions.hpp"
#include "posenc/rope_scaling.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

/// Element types an out-of-place apply() may write the rotation of `In` values into: In's own type, or
/// f16 / bf16 from float. Into half precision the vector is rotated in float and rounded once, as a key
/// is stored when it is appended to a half-precision KV cache (docs/kv-cache.md).
template <class Out, class In>
concept rope_output_for =
    !std::is_const_v<Out> && (std::is_same_v<Out, std::remove_const_t<In>> ||
                              (is_half_storage<Out> && std::is_same_v<std::remove_const_t<In>, float>));

/// Which features form a rotated pair.
enum class rope_layout {
  half,         ///< (i, i + d/2): HF rotate_half, GPT-NeoX, Llama as converted to HF
  interleaved,  ///< (2i, 2i+1): GPT-J rotate_every_two, RoFormer, Meta checkpoints, GGUF "normal"
};

/// How angles and cos/sin are evaluated.
enum class rope_angles {
  /// angle = position * inv_freq in double, reduced mod 2 pi in double, then cos/sin in T:
  /// |error| <= 1e-6 for unit inputs at any position up to 2^24 (float), ~1e-16 relative (double).
  exact,
  /// Hugging Face's float32 path (float32 inv_freq, float32(position) * inv_freq rounded once, float32
  /// cos/sin): reproduces HF checkpoints' outputs, including their error at large positions.
  hf_float32,
};

/// RoPE configuration, keys as in Hugging Face's config.json.
struct rope_config {
  index_t head_dim = 0;
  double rope_theta = 10000.0;
  /// rotary_dim = int(head_dim * partial_rotary_factor) (truncation) unless rotary_dim is set. With
  /// rope_type proportional the whole head rotates and this is the fraction of its frequencies kept
  /// (the others are 0: those dims pass through).
  double partial_rotary_factor = 1.0;
  std::optional<index_t> rotary_dim{};
  rope_layout layout = rope_layout::half;
  rope_scaling scaling{};
  std::optional<std::int64_t> max_position_embeddings{};
  rope_angles angles = rope_angles::exact;
  /// Explicit current sequence length for dynamic / longrope. Unset: apply() derives
  /// max(positions)+1 over the whole positions tensor, bind() (the fused kernel) max(q positions)+1.
  std::optional<std::int64_t> seq_len{};
};

class rope_frequencies;

namespace detail {
/// What a rope_table was built from: its position range and the frequencies (apply() checks them).
struct rope_table_identity {
  std::int64_t first = 0;
  index_t count = 0, rotary_dim = 0;
  rope_layout layout = rope_layout::half;
  std::vector<double> inv_freq{};
  double attention_factor = 1;
  rope_angles angles = rope_angles::exact;
};
}  // namespace detail

/// cos/sin of a position range [first, first + count), built once (in double), stored as T, then
/// immutable: share it between threads, heads, layers and calls. Build with rope::table or
/// rope_frequencies::table. A table belongs to the frequencies it was built from; apply() checks that.
template <class T>
class rope_table {
 public:
  [[nodiscard]] std::int64_t first() const { return id_.first; }
  [[nodiscard]] index_t count() const { return id_.count; }
  [[nodiscard]] index_t rotary_dim() const { return id_.rotary_dim; }
  [[nodiscard]] rope_layout layout() const { return id_.layout; }
  [[nodiscard]] bool contains(std::int64_t p) const { return p >= id_.first && p - id_.first < id_.count; }
  /// Values per position: rotary_dim, cos and sin of each pair (layout: detail/rope_kernels.hpp).
  [[nodiscard]] index_t width() const { return id_.rotary_dim; }
  [[nodiscard]] const T* row(std::int64_t p) const { return data_.get() + (p - id_.first) * width(); }
  /// Bytes of the table (what one pass over it reads).
  [[nodiscard]] std::size_t bytes() const { return values() * sizeof(T); }
  /// The same table stored as U.
  template <class U>
  [[nodiscard]] rope_table<U> converted() const {
    auto data = std::make_shared_for_overwrite<U[]>(values());
    std::copy(data_.get(), data_.get() + values(), data.get());
    return rope_table<U>(id_, std::move(data));
  }

 private:
  friend class rope_frequencies;
  template <class U>
  friend class rope_table;
  rope_table(detail::rope_table_identity id, std::shared_ptr<const T[]> data)
      : id_(std::move(id)), data_(std::move(data)) {}
  [[nodiscard]] std::size_t values() const { return static_cast<std::size_t>(id_.count * width()); }
  detail::rope_table_identity id_{};
  // Not a std::vector: its value-initialization is one more pass over the table, which the attention
  // kernel builds on every call (profile of paired calls, L = 1024, 1 thread: memset took 0.4 % more
  // of the RoPE call than of the no-encoding call; the same with this storage).
  std::shared_ptr<const T[]> data_{};
};

/// RoPE frequencies resolved for one sequence length: inv_freq, attention factor, layout. Everything
/// that rotates lives here; rope (below) resolves the sequence length and forwards. Also what
/// rope::bind returns to the attention kernel (then with a cos/sin table of the call's positions).
class rope_frequencies {
 public:
  rope_frequencies(index_t head_dim, index_t rotary_dim, rope_layout layout, rope_angles angles,
                   std::vector<double> inv_freq, std::vector<float> inv_freq_f32, double attention_factor,
                   std::int64_t seq_len)
      : head_dim_(head_dim), rotary_dim_(rotary_dim), layout_(layout), angles_(angles),
        inv_freq_(std::move(inv_freq)), inv_freq_f32_(std::move(inv_freq_f32)), attention_factor_(attention_factor),
        seq_len_(seq_len) {}

  [[nodiscard]] index_t head_dim() const { return head_dim_; }
  [[nodiscard]] index_t rotary_dim() const { return rotary_dim_; }
  [[nodiscard]] rope_layout layout() const { return layout_; }
  [[nodiscard]] rope_angles angles() const { return angles_; }
  /// inv_freq in double (rotary_dim/2 values); the exact mode rotates with these.
  [[nodiscard]] const std::vector<double>& inv_freq() const { return inv_freq_; }
  /// inv_freq as HF's float32 code computes it; the hf_float32 mode rotates with these.
  [[nodiscard]] const std::vector<float>& inv_freq_hf_float32() const { return inv_freq_f32_; }
  [[nodiscard]] double attention_factor() const { return attention_factor_; }
  /// The sequence length these frequencies were resolved for (0 when it did not matter).
  [[nodiscard]] std::int64_t seq_len() const { return seq_len_; }

  // ---- apply ---------------------------------------------------------------------------------------

  /// Rotate x in place; positions [batch, seq].
  template <class T>
    requires(!std::is_const_v<T>)
  void apply(heads_view<T> x, positions_view pos) const {
    check_x(x, "x");
    check_positions(pos, x, "positions");
    run(heads_view<const T>(x), x, pos, static_cast<const rope_table<T>*>(nullptr));
  }

  /// out = RoPE(in); in and out have the same shape (any layout or strides each) and must not overlap
  /// unless they are the same view, same buffer and strides (then it is the in-place apply). out may
  /// be f16 or bf16 with float in: a key rotated in float and stored, rounded once, into a
  /// half-precision cache.
  template <class In, class Out>
    requires rope_output_for<Out, In>
  void apply(heads_view<In> in, heads_view<Out> out, positions_view pos) const {
    using T = std::remove_const_t<In>;
    check_pair(heads_view<const T>(in), out);
    check_positions(pos, out, "positions");
    run(heads_view<const T>(in), out, pos, static_cast<const rope_table<T>*>(nullptr));
  }

  /// In place, cos/sin read from a table that covers every position.
  template <class T>
    requires(!std::is_const_v<T>)
  void apply(heads_view<T> x, positions_view pos, const rope_table<T>& table) const {
    check_x(x, "x");
    check_positions(pos, x, "positions");
    check_table(table, pos);
    run(heads_view<const T>(x), x, pos, &table);
  }

  /// Out of place with a table.
  template <class In, class Out>
    requires rope_output_for<Out, In>
  void apply(heads_view<In> in, heads_view<Out> out, positions_view pos,
             const rope_table<std::remove_const_t<In>>& table) const {
    using T = std::remove_const_t<In>;
    check_pair(heads_view<const T>(in), out);
    check_positions(pos, out, "positions");
    check_table(table, pos);
    run(heads_view<const T>(in), out, pos, &table);
  }

  /// Context shifting: re-rotate cached (already rotated) keys by `delta` positions, k <- R(delta) k.
  /// Rotations compose, R(delta) R(p) = R(p + delta), so this equals applying RoPE at p + delta (up to
  /// rounding). The attention factor is not applied again. k may be a float, double, f16 or bf16
  /// cache; half-precision keys are widened, rotated in float and rounded back once (the pass-through
  /// tail is not touched).
  template <class S>
    requires(!std::is_const_v<S>)
  void shift(heads_view<S> k, std::int64_t delta) const {
    check_x(k, "k");
    using T = std::conditional_t<is_half_storage<S>, float, S>;
    std::vector<T> row(static_cast<std::size_t>(width()));
    fill_row(delta, row.data(), 1.0);
    [[maybe_unused]] std::vector<float> wide(static_cast<std::size_t>(is_half_storage<S> ? rotary_dim_ : 0));
    const bool il = interleaved();
    for (index_t b = 0; b < k.batch(); ++b)
      for (index_t s = 0; s < k.seq(); ++s)
        for (index_t h = 0; h < k.heads(); ++h) {
          if constexpr (is_half_storage<S>) {
            detail::widen(k.row(b, s, h), wide.data(), rotary_dim_);
            detail::rotate_row_inplace(wide.data(), row.data(), rotary_dim_, il);
            detail::narrow(wide.data(), k.row(b, s, h), rotary_dim_);
          } else {
            detail::rotate_row_inplace(k.row(b, s, h), row.data(), rotary_dim_, il);
          }
        }
  }

  /// cos/sin table for positions first .. first+count-1 (computed in double, stored as T).
  template <class T>
  [[nodiscard]] rope_table<T> table(std::int64_t first, index_t count) const {
    require(count >= 0, "count", "must be >= 0", count);
    require(first <= std::numeric_limits<std::int64_t>::max() - count, "first", "first + count overflows int64",
            first, " + ", count);
    auto data = std::make_shared_for_overwrite<T[]>(static_cast<std::size_t>(count * width()));
    fill_rows(first, count, data.get());
    return rope_table<T>({first, count, rotary_dim_, layout_, inv_freq_, attention_factor_, angles_},
                         std::move(data));
  }

  // ---- kernel hooks ----------------------------------------------------------------------------

  /// Checks the call against these frequencies before the kernel writes anything (the transforms
  /// run on pool threads, where a failed check could not reach the caller with `out` untouched).
  [[nodiscard]] const rope_frequencies& bind(const call_info& info) const {
    require(info.head_dim == head_dim_, "rope", "head_dim must equal the call's q/k head_dim", head_dim_, " vs ",
            info.head_dim);
    return *this;
  }

  /// The attention kernel's Q/K transform: x = [tokens x head_dim] (strided rows) of one head, in
  /// place, token r at position pos[r]. Uses the call's table when bind() built one.
  template <class T>
  void transform_qk(qk_role role, index_t head, std::span<const std::int64_t> pos, matrix_map<T> x) const {
    transform_qk(role, head, pos, const_matrix_map<T>(x.data(), x.rows(), x.cols(), Eigen::OuterStride<>(x.outerStride())),
                 x);
  }

  /// The same out of place: out = rotated in (the pass-through tail copied), in and out [tokens x
  /// head_dim] with their own row strides (in may be out).
  template <class T>
  void transform_qk(qk_role role, index_t head, std::span<const std::int64_t> pos, const_matrix_map<T> in,
                    matrix_map<T> out) const {
    (void)role;  // q and k rotate alike
    (void)head;  // and every head alike
    require(in.cols() == head_dim_ && out.cols() == head_dim_, "x", "columns must equal head_dim", in.cols(),
            " and ", out.cols(), " vs ", head_dim_);
    require(in.rows() == out.rows(), "x", "in and out must have the same rows", in.rows(), " vs ", out.rows());
    require(static_cast<index_t>(pos.size()) == in.rows(), "pos", "must have one position per row", pos.size(),
            " positions for ", in.rows(), " rows");
    const index_t w = width();
    constexpr index_t small = 1024;
    std::array<T, small> stack;  // no zero fill: every use writes the row first
    std::vector<T> heap;
    T* row = stack.data();
    if (w > small) {
      heap.resize(static_cast<std::size_t>(w));
      row = heap.data();
    }
    const auto& table = call_table<T>();
    const bool il = interleaved();
    // The kernel passes the caller's rows (a new page every row in BSHD): fetching a few rows ahead
    // keeps several rows' misses in flight instead of one row's. The table rows too: inside
    // attention the kernel's tiles push them out of L2 between uses (profile of L = 2048, 1 thread:
    // this function's share of the call went from 12.3 / 9.9 % to 9.5 / 8.9 % with them prefetched).
    // Into L1, since they are read 4 rows later (measurements at detail::prefetch_bytes_l1).
    constexpr index_t ahead = 4;
    const index_t row_bytes = head_dim_ * static_cast<index_t>(sizeof(T)), table_bytes = w * static_cast<index_t>(sizeof(T));
    for (index_t r = 0; r < in.rows(); ++r) {
      if (r + ahead < in.rows()) {
        detail::prefetch_bytes_l1(in.data() + (r + ahead) * in.outerStride(), row_bytes);
        const std::int64_t pa = pos[static_cast<std::size_t>(r + ahead)];
        if (table && table->contains(pa)) detail::prefetch_bytes_l1(table->row(pa), table_bytes);
      }
      const std::int64_t p = pos[static_cast<std::size_t>(r)];
      const T* use = row;
      if (table && table->contains(p)) use = table->row(p);
      else fill_row(p, row, attention_factor_);
      const T* src = in.data() + r * in.outerStride();
      T* dst = out.data() + r * out.outerStride();
      if (src == dst) detail::rotate_row_inplace(dst, use, rotary_dim_, il);
      else detail::rotate_row_copy(src, dst, use, rotary_dim_, head_dim_, il);
    }
  }

 private:
  friend class rope;

  [[nodiscard]] bool interleaved() const { return layout_ == rope_layout::interleaved; }
  [[nodiscard]] index_t pairs() const { return rotary_dim_ / 2; }
  /// Values per position of a cos/sin row: rotary_dim in both layouts (detail/rope_kernels.hpp).
  [[nodiscard]] index_t width() const { return rotary_dim_; }

  /// Rows of positions first .. first+count-1 into out (count * width() values).
  template <class T>
  void fill_rows(std::int64_t first, index_t count, T* out) const {
    const index_t w = width(), h = pairs();
    if (angles_ == rope_angles::exact) {
      detail::angles_double_run(first, count, inv_freq_.data(), h, [&](index_t t, const double* c, const double* s) {
        detail::store_row(c, s, attention_factor_, h, interleaved(), out + t * w);
      });
    } else {
      for (index_t t = 0; t < count; ++t) fill_row(first + t, out + t * w, attention_factor_);
    }
  }

  /// The row (detail/rope_kernels.hpp) of one position, cos/sin multiplied by `scale`.
  template <class T>
  void fill_row(std::int64_t p, T* row, double scale) const {
    const index_t h = pairs();
    constexpr index_t small = 512;  // pairs kept on the stack; larger heads use the heap
    if (angles_ == rope_angles::exact) {
      std::array<T, 2 * small> stack;
      std::vector<T> heap(static_cast<std::size_t>(h > small ? 2 * h : 0));
      T* c = h > small ? heap.data() : stack.data();
      detail::angles_exact(static_cast<double>(p), inv_freq_.data(), scale, h, c, c + h);
      detail::store_row(c, c + h, T(1), h, interleaved(), row);
    } else {
      std::array<float, 2 * small> stack;
      std::vector<float> heap(static_cast<std::size_t>(h > small ? 2 * h : 0));
      float* c = h > small ? heap.data() : stack.data();
      detail::angles_hf_float32(p, inv_freq_f32_.data(), scale, h, c, c + h);
      detail::store_row(c, c + h, 1.0f, h, interleaved(), row);
    }
  }

  template <class T>
  void check_x(const heads_view<T>& x, const char* name) const {
    require(x.dim() == head_dim_, name, "head_dim must equal the rope's head_dim", x.dim(), " vs ", head_dim_);
  }
  template <class T>
  void check_positions(const positions_view& pos, const heads_view<T>& x, const char* name) const {
    require(pos.dimension(0) == x.batch() && pos.dimension(1) == x.seq(), name, "must be [batch, seq]", "[",
            pos.dimension(0), ", ", pos.dimension(1), "] for batch ", x.batch(), ", seq ", x.seq());
    require(pos.data() != nullptr || pos.size() == 0, name, "data must not be null");
  }
  template <class T, class Out>
  void check_pair(const heads_view<const T>& in, const heads_view<Out>& out) const {
    check_x(in, "in");
    check_x(out, "out");
    require(in.batch() == out.batch() && in.seq() == out.seq() && in.heads() == out.heads(), "out",
            "must have the shape of in", "[", out.batch(), ", ", out.seq(), ", ", out.heads(), "] vs [", in.batch(),
            ", ", in.seq(), ", ", in.heads(), "]");
    bool same = false;
    if constexpr (std::is_same_v<Out, T>) same = in.data() == out.data() && in.strides() == out.strides();
    if (!same && in.size() > 0) {
      const auto* a0 = reinterpret_cast<const char*>(in.data());
      const auto* a1 = reinterpret_cast<const char*>(in.data() + in.extent());
      const auto* b0 = reinterpret_cast<const char*>(out.data());
      const auto* b1 = reinterpret_cast<const char*>(out.data() + out.extent());
      require(a1 <= b0 || b1 <= a0, "out", "must not overlap in (except being the same view: same buffer and strides)");
    }
  }
  template <class T>
  void check_table(const rope_table<T>& t, const positions_view& pos) const {
    require(t.id_.rotary_dim == rotary_dim_ && t.id_.layout == layout_ && t.id_.angles == angles_ &&
                t.id_.attention_factor == attention_factor_ && t.id_.inv_freq == inv_freq_,
            "table", "was built for other frequencies (rotary_dim, layout, angles, inv_freq or attention factor)");
    for (index_t i = 0; i < pos.size(); ++i)
      require(t.contains(pos.data()[i]), "table", "must cover every position", "position ", pos.data()[i],
              " outside [", t.first(), ", ", t.first() + t.count(), ")");
  }

  /// The apply loop: for each token, one cos/sin row (computed or from the table), then every head. An
  /// out in half precision takes each head's rotation in T first (a head_dim row), then rounds it.
  template <class T, class Out>
  void run(heads_view<const T> in, heads_view<Out> out, positions_view pos, const rope_table<T>* table) const {
    constexpr bool narrows = !std::is_same_v<Out, T>;
    bool inplace = false;
    if constexpr (!narrows) inplace = in.data() == out.data() && in.strides() == out.strides();
    const bool il = interleaved();
    std::vector<T> scratch(static_cast<std::size_t>(table ? 0 : width()));
    [[maybe_unused]] std::vector<T> rotated(static_cast<std::size_t>(narrows ? head_dim_ : 0));
    for (index_t b = 0; b < out.batch(); ++b) {
      for (index_t s = 0; s < out.seq(); ++s) {
        const std::int64_t p = pos(b, s);
        const T* row;
        if (table) {
          row = table->row(p);
        } else {
          fill_row(p, scratch.data(), attention_factor_);
          row = scratch.data();
        }
        for (index_t h = 0; h < out.heads(); ++h) {
          if constexpr (narrows) {
            detail::rotate_row_copy(in.row(b, s, h), rotated.data(), row, rotary_dim_, head_dim_, il);
            detail::narrow(rotated.data(), out.row(b, s, h), head_dim_);
          } else if (inplace) {
            detail::rotate_row_inplace(out.row(b, s, h), row, rotary_dim_, il);
          } else {
            detail::rotate_row_copy(in.row(b, s, h), out.row(b, s, h), row, rotary_dim_, head_dim_, il);
          }
        }
      }
    }
  }

  index_t head_dim_, rotary_dim_;
  rope_layout layout_;
  rope_angles angles_;
  std::vector<double> inv_freq_;
  std::vector<float> inv_freq_f32_;
  double attention_factor_;
  std::int64_t seq_len_;
  // cos/sin of the call's position range, set by rope::bind, in both precisions the kernel may run in.
  std::shared_ptr<const rope_table<float>> call_table_f_{};
  std::shared_ptr<const rope_table<double>> call_table_d_{};
  template <class T>
  [[nodiscard]] const auto& call_table() const {
    if constexpr (std::is_same_v<T, float>) return call_table_f_;
    else return call_table_d_;
  }
};

/// RoPE of one model configuration. Validates the configuration on construction (posenc::error names
/// the key); immutable afterwards.
class rope {
 public:
  explicit rope(const rope_config& cfg) : cfg_(cfg), params_(resolve_params(cfg)) {
    detail::validate(params_);
    short_.emplace(make(0));
    if (params_.scaling.rope_type == rope_type::longrope) long_.emplace(make(*params_.original() + 1));
  }

  [[nodiscard]] const rope_config& config() const { return cfg_; }
  [[nodiscard]] index_t head_dim() const { return cfg_.head_dim; }
  [[nodiscard]] index_t rotary_dim() const { return params_.rotary_dim; }
  [[nodiscard]] rope_layout layout() const { return cfg_.layout; }
  [[nodiscard]] rope_angles angles() const { return cfg_.angles; }
  /// Whether inv_freq depends on the sequence length (dynamic, longrope).
  [[nodiscard]] bool uses_seq_len() const { return params_.uses_seq_len(); }

  /// The frequencies for sequence length `seq_len` (dynamic / longrope; the others ignore it).
  [[nodiscard]] rope_frequencies at(std::int64_t seq_len) const {
    require(seq_len >= 0, "seq_len", "must be >= 0", seq_len);
    if (!uses_seq_len()) return *short_;
    if (!detail::beyond_limit(params_, seq_len)) return with_seq_len(*short_, seq_len);
    if (long_) return with_seq_len(*long_, seq_len);
    return make(seq_len);
  }
  /// The sequence length apply() uses for these positions: config().seq_len if set, else
  /// max(positions) + 1 over the whole tensor (all batch rows), as HF's forward does.
  [[nodiscard]] std::int64_t seq_len_for(positions_view pos) const {
    return cfg_.seq_len ? *cfg_.seq_len : std::max<std::int64_t>(sequence_length(pos), 0);
  }

  /// inv_freq (double) at a sequence length (default: config().seq_len, else unscaled).
  [[nodiscard]] std::vector<double> inv_freq(std::optional<std::int64_t> seq_len = std::nullopt) const {
    return at(default_len(seq_len)).inv_freq();
  }
  [[nodiscard]] std::vector<float> inv_freq_hf_float32(std::optional<std::int64_t> seq_len = std::nullopt) const {
    return at(default_len(seq_len)).inv_freq_hf_float32();
  }
  /// The factor on cos and sin (YaRN mscale, LongRoPE's factor; 1 otherwise).
  [[nodiscard]] double attention_factor() const { return detail::attention_factor(params_); }

  // ---- apply: the sequence length comes from the positions (or config().seq_len) -----------------

  template <class T>
    requires(!std::is_const_v<T>)
  void apply(heads_view<T> x, positions_view pos) const {
    at(len_for(pos)).apply(x, pos);
  }
  /// Out of place; out may be f16 / bf16 with float in (rope_frequencies::apply).
  template <class In, class Out>
    requires rope_output_for<Out, In>
  void apply(heads_view<In> in, heads_view<Out> out, positions_view pos) const {
    at(len_for(pos)).apply(in, out, pos);
  }
  /// q and k at the same positions (HF apply_rotary_pos_emb), one sequence length for both.
  template <class T>
    requires(!std::is_const_v<T>)
  void apply_qk(heads_view<T> q, heads_view<T> k, positions_view pos) const {
    const rope_frequencies f = at(len_for(pos));
    f.check_x(q, "q");
    f.check_x(k, "k");
    f.check_positions(pos, q, "positions");
    f.check_positions(pos, k, "positions");
    f.apply(q, pos);
    f.apply(k, pos);
  }
  /// With a table (built by table() for the same sequence length).
  template <class T>
    requires(!std::is_const_v<T>)
  void apply(heads_view<T> x, positions_view pos, const rope_table<T>& table) const {
    at(len_for(pos)).apply(x, pos, table);
  }
  template <class In, class Out>
    requires rope_output_for<Out, In>
  void apply(heads_view<In> in, heads_view<Out> out, positions_view pos,
             const rope_table<std::remove_const_t<In>>& table) const {
    at(len_for(pos)).apply(in, out, pos, table);
  }

  /// Context shifting by `delta` positions, float or half-precision keys (see rope_frequencies::shift).
  /// seq_len: as inv_freq().
  template <class T>
    requires(!std::is_const_v<T>)
  void shift(heads_view<T> k, std::int64_t delta, std::optional<std::int64_t> seq_len = std::nullopt) const {
    at(default_len(seq_len)).shift(k, delta);
  }

  /// cos/sin table for positions [first, first + count). seq_len: as inv_freq().
  template <class T>
  [[nodiscard]] rope_table<T> table(std::int64_t first, index_t count,
                                    std::optional<std::int64_t> seq_len = std::nullopt) const {
    return at(default_len(seq_len)).template table<T>(first, count);
  }

  // ---- kernel hooks -------------------------------------------------------------------------------

  /// Per attention call: resolve the sequence length once — config().seq_len if set, else
  /// max(q positions) + 1 (HF's forward derives it from the query position_ids) — and build a cos/sin
  /// table (angles in double, stored in the call's scalar type) of the call's position range when that range is not much larger than the call's
  /// tokens, so the per-head transforms only stream x. Returns an immutable object.
  [[nodiscard]] rope_frequencies bind(const call_info& info) const {
    const std::int64_t L = cfg_.seq_len ? *cfg_.seq_len : std::max<std::int64_t>(info.q_max + 1, 0);
    rope_frequencies f = at(L);
    (void)f.bind(info);  // the call's head_dim, before any table is built
    const bool has_q = info.q_max >= info.q_min, has_k = info.k_max >= info.k_min;
    if (has_q || has_k) {
      const std::int64_t lo = std::min(has_q ? info.q_min : info.k_min, has_k ? info.k_min : info.q_min);
      const std::int64_t hi = std::max(has_q ? info.q_max : info.k_max, has_k ? info.k_max : info.q_max);
      const std::int64_t tokens = static_cast<std::int64_t>(info.batch) * (info.q_len + info.k_len);
      // The span in unsigned arithmetic: exact for any hi >= lo, no signed overflow.
      const std::uint64_t span = static_cast<std::uint64_t>(hi) - static_cast<std::uint64_t>(lo);
      if (span < static_cast<std::uint64_t>(2 * tokens + 64))
      {
        // In the call's scalar type only (the angles are formed in double either way): a table in
        // the other type too would be one more allocation and pass over [span x rotary_dim] values
        // per call that the kernel never reads.
        const auto count = static_cast<index_t>(span + 1);
        if (info.scalar == scalar_type::float64)
          f.call_table_d_ = std::make_shared<const rope_table<double>>(f.table<double>(lo, count));
        else
          f.call_table_f_ = std::make_shared<const rope_table<float>>(f.table<float>(lo, count));
      }
    }
    return f;
  }

  /// Q/K transform without bind (config().seq_len, else unscaled frequencies).
  template <class T>
  void transform_qk(qk_role role, index_t head, std::span<const std::int64_t> pos, matrix_map<T> x) const {
    at(default_len(std::nullopt)).transform_qk(role, head, pos, x);
  }

  /// This RoPE on the queries only, for a KV cache whose keys were rotated once, when they were
  /// appended (apply / apply_qk at their positions): the kernel then reads the cached keys as they
  /// are and rotates only the new queries (docs/kv-cache.md). What Hugging Face's cache does too: keys
  /// are stored after apply_rotary_pos_emb.
  [[nodiscard]] class rope_queries_only queries_only() const;

 private:
  static detail::rope_freq_params resolve_params(const rope_config& c) {
    require(c.head_dim > 0, "head_dim", "must be > 0", c.head_dim);
    index_t rot = 0;
    const bool proportional = c.scaling.rope_type == rope_type::proportional;
    if (proportional) {
      // The frequencies span the whole head; partial_rotary_factor is the fraction of them kept
      // (HF _compute_proportional_rope_parameters: "always an encoding the size of head_dim").
      require(!c.rotary_dim || *c.rotary_dim == c.head_dim, "rotary_dim",
              "must be unset or head_dim for rope_type proportional", c.rotary_dim.value_or(0));
      rot = c.head_dim;
    } else if (c.rotary_dim) {
      rot = *c.rotary_dim;
    } else {
      require(std::isfinite(c.partial_rotary_factor) && c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1,
              "partial_rotary_factor", "must be in (0, 1]", c.partial_rotary_factor);
      // HF: int(head_dim * partial_rotary_factor), truncation of the double product.
      rot = static_cast<index_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
    }
    require(rot > 0 && rot <= c.head_dim, "rotary_dim", "must be in [1, head_dim]", rot, ", head_dim ", c.head_dim);
    require(rot % 2 == 0, "rotary_dim", "must be even (features rotate in pairs)", rot);
    if (c.seq_len) require(*c.seq_len >= 0, "seq_len", "must be >= 0", *c.seq_len);
    detail::rope_freq_params p;
    p.rotary_dim = rot;
    p.base = c.rope_theta;
    if (proportional) p.proportion = c.partial_rotary_factor;
    p.max_position_embeddings = c.max_position_embeddings;
    p.scaling = c.scaling;
    return p;
  }

  [[nodiscard]] rope_frequencies make(std::int64_t L) const {
    return rope_frequencies(cfg_.head_dim, params_.rotary_dim, cfg_.layout, cfg_.angles, detail::inv_freq(params_, L),
                            detail::inv_freq_hf_float32(params_, L), detail::attention_factor(params_),
                            uses_seq_len() ? L : 0);
  }
  static rope_frequencies with_seq_len(rope_frequencies f, std::int64_t L) {
    f.seq_len_ = L;
    return f;
  }
  [[nodiscard]] std::int64_t default_len(std::optional<std::int64_t> seq_len) const {
    if (seq_len) return *seq_len;
    return cfg_.seq_len ? *cfg_.seq_len : 0;
  }
  [[nodiscard]] std::int64_t len_for(positions_view pos) const { return uses_seq_len() ? seq_len_for(pos) : 0; }

  rope_config cfg_;
  detail::rope_freq_params params_;
  std::optional<rope_frequencies> short_{}, long_{};
};

/// RoPE on the queries only (rope::queries_only): keys are read as given, already rotated. The
/// sequence length of the call (dynamic NTK, LongRoPE) is resolved as rope::bind does, from the
/// queries' positions; the keys keep the frequencies they were rotated with, as in an HF cache.
class rope_queries_only {
 public:
  static constexpr bool transforms_keys = false;

  /// What bind returns to the kernel: the call's frequencies (and cos/sin table of the query
  /// positions), applied to queries only.
  class bound {
   public:
    static constexpr bool transforms_keys = false;
    explicit bound(rope_frequencies f) : f_(std::move(f)) {}
    template <class T>
    void transform_qk(qk_role role, index_t head, std::span<const std::int64_t> pos, matrix_map<T> x) const {
      f_.transform_qk(role, head, pos, x);
    }
    template <class T>
    void transform_qk(qk_role role, index_t head, std::span<const std::int64_t> pos, const_matrix_map<T> in,
                      matrix_map<T> out) const {
      f_.transform_qk(role, head, pos, in, out);
    }
    [[nodiscard]] const rope_frequencies& frequencies() const { return f_; }

   private:
    rope_frequencies f_;
  };

  explicit rope_queries_only(rope r) : rope_(std::move(r)) {}
  [[nodiscard]] const rope& encoding() const { return rope_; }

  [[nodiscard]] bound bind(const call_info& info) const {
    call_info queries = info;  // the table covers the queries' positions only: keys are never rotated
    queries.k_min = 0;
    queries.k_max = -1;
    return bound(rope_.bind(queries));
  }
  template <class T>
  void transform_qk(qk_role role, index_t head, std::span<const std::int64_t> pos, matrix_map<T> x) const {
    rope_.transform_qk(role, head, pos, x);
  }

 private:
  rope rope_;
};

inline rope_queries_only rope::queries_only() const { return rope_queries_only(*this); }

}  // namespace posenc
