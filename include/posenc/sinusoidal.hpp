// posenc/sinusoidal.hpp — the absolute sinusoidal encoding (Vaswani et al. 2017, sec. 3.5), added
// to the token embeddings before the first layer.
//
//   PE[p, 2i] = sin(p w_i), PE[p, 2i+1] = cos(p w_i)       (interleaved layout)
//   PE[p, i]  = sin(p w_i), PE[p, n+i]  = cos(p w_i)       (concat layout: tensor2tensor, fairseq,
//                                                            Transformer-XL's R)
//   PE[p, i]  = cos(p w_i), PE[p, n+i]  = sin(p w_i)       (concat_cos_sin layout: MusicGen)
// with the vaswani (base^(-2i/d)) or tensor2tensor (exp(-i ln(base)/(n-1))) schedule; see
// detail/sinusoid.hpp for both, for odd d_model and for the float32 angles of fairseq-style tables
// (sinusoid_angles). Position p takes the row of p + offset (fairseq: padding_idx + 1). Positions are
// arbitrary: per token (int64, positions_view) for add_to, or real-valued (also negative relative
// distances) for table().
//
//   posenc::sinusoidal pe({.d_model = 512});
//   pe.add_to(x, posenc::view(pos));          // x [batch, seq, 512] += PE(pos[b, s])
//   auto t = pe.table<double>(positions);     // [N, 512]
//
// Computing sin/cos per token costs a transcendental per feature. When the same positions recur
// call after call, build the table once and add it with posenc::learned_absolute viewing it (a
// lookup, see docs/sinusoidal.md).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "posenc/detail/sinusoid.hpp"
#include "posenc/encoding.hpp"
#include "posenc/error.hpp"
#include "posenc/positions.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

struct sinusoidal_config {
  index_t d_model = 0;
  double base = 10000.0;
  sinusoid_layout layout = sinusoid_layout::interleaved;
  frequency_schedule schedule = frequency_schedule::vaswani;
  sinusoid_angles angles = sinusoid_angles::exact;
  /// Position p takes the sinusoid of p + offset (fairseq / M2M100: the first token's row is
  /// padding_idx + 1 = 2); in [0, 2^31).
  index_t offset = 0;
};

class sinusoidal {
 public:
  explicit sinusoidal(const sinusoidal_config& config)
      : config_(checked(config)), w_(detail::sinusoid_frequencies(config.d_model, config.base, config.schedule)) {
    if (config.angles == sinusoid_angles::float32)
      w32_ = detail::sinusoid_frequencies_f32(config.d_model, config.base, config.schedule);
  }

  [[nodiscard]] const sinusoidal_config& config() const { return config_; }
  [[nodiscard]] index_t d_model() const { return config_.d_model; }
  /// The n = d_model/2 angular frequencies w_i.
  [[nodiscard]] std::span<const double> frequencies() const { return w_; }

  /// Write the row of one (real) position into out (size d_model).
  template <class T>
  void row(double position, std::span<T> out) const {
    require(static_cast<index_t>(out.size()) == config_.d_model, "out", "must hold d_model values", out.size(),
            " for d_model ", config_.d_model);
    require(std::isfinite(position), "position", "must be finite", position);
    write_row(position, out.data());
  }

  /// Fill out [N, d_model] with the rows of `positions` (N values, any finite reals).
  template <class T>
  void fill_table(std::span<const double> positions, tensor_map<T, 2> out) const {
    require(out.dimension(0) == static_cast<index_t>(positions.size()) && out.dimension(1) == config_.d_model, "out",
            "must be [positions, d_model]", "[", out.dimension(0), ", ", out.dimension(1), "] for ", positions.size(),
            " positions, d_model ", config_.d_model);
    for (std::size_t p = 0; p < positions.size(); ++p)
      require(std::isfinite(positions[p]), "positions", "must be finite", positions[p], " at index ", p);
    for (std::size_t p = 0; p < positions.size(); ++p)
      write_row(positions[p], out.data() + static_cast<index_t>(p) * config_.d_model);
  }

  /// The table [N, d_model] of `positions`.
  template <class T = double>
  [[nodiscard]] Eigen::Tensor<T, 2, Eigen::RowMajor> table(std::span<const double> positions) const {
    Eigen::Tensor<T, 2, Eigen::RowMajor> t(static_cast<index_t>(positions.size()), config_.d_model);
    fill_table<T>(positions, tensor_map<T, 2>(t.data(), t.dimension(0), t.dimension(1)));
    return t;
  }

  /// The table [count, d_model] of positions first, first+1, ..., first+count-1.
  template <class T = double>
  [[nodiscard]] Eigen::Tensor<T, 2, Eigen::RowMajor> table(index_t count, double first = 0.0) const {
    require(count >= 0, "count", "must be >= 0", count);
    std::vector<double> p(static_cast<std::size_t>(count));
    for (index_t i = 0; i < count; ++i) p[static_cast<std::size_t>(i)] = first + static_cast<double>(i);
    return table<T>(p);
  }

  /// Input encoding: x[b, s, :] += PE(pos[b, s]) in place. x is [batch, seq, d_model]; pos is
  /// [batch, seq], or [1, seq] to use the same positions for every batch row.
  template <class T>
  requires std::is_floating_point_v<T>
  void add_to(tensor_map<T, 3> x, positions_view pos) const {
    const index_t B = x.dimension(0), S = x.dimension(1), D = x.dimension(2);
    require(D == config_.d_model, "x", "last dimension must equal d_model", D, " vs ", config_.d_model);
    require((pos.dimension(0) == B || pos.dimension(0) == 1) && pos.dimension(1) == S, "pos",
            "must be [batch, seq] or [1, seq]", "[", pos.dimension(0), ", ", pos.dimension(1), "] for x [", B, ", ", S,
            ", ", D, "]");
    if (B == 0 || S == 0 || D == 0) return;
    const bool shared = pos.dimension(0) == 1;
    std::vector<T> pe(static_cast<std::size_t>(D));
    // float outputs of exact angles walk consecutive positions by rotation (detail::sinusoid_walker,
    // error ~1e-14, invisible in float); double outputs take sin/cos of the exact double angle for every
    // row, and the float32 path its own float angles.
    std::optional<detail::sinusoid_walker> walker;
    if constexpr (std::is_same_v<T, float>)
      if (config_.angles == sinusoid_angles::exact) walker.emplace(w_);
    const auto make_row = [&](std::int64_t p) {
      if (walker && p <= std::numeric_limits<std::int64_t>::max() - config_.offset) {
        walker->go(p + config_.offset);
        walker->template write<T>(config_.layout, D, pe.data());
      } else {
        write_row(static_cast<double>(p), pe.data());
      }
    };
    // Token-major so one computed row serves every batch row at the same position (the usual
    // case: identical position rows); a differing position computes its own row exactly.
    for (index_t s = 0; s < S; ++s) {
      const std::int64_t first = pos(0, s);
      make_row(first);
      bool have_first = true;
      for (index_t b = 0; b < B; ++b) {
        const std::int64_t p = shared ? first : pos(b, s);
        if (p != first) {
          write_row(static_cast<double>(p), pe.data());
          have_first = false;
        } else if (!have_first) {
          write_row(static_cast<double>(p), pe.data());
          have_first = true;
        }
        T* row = x.data() + (b * S + s) * D;
        for (index_t d = 0; d < D; ++d) row[d] += pe[static_cast<std::size_t>(d)];
      }
    }
  }

 private:
  static const sinusoidal_config& checked(const sinusoidal_config& c) {
    require(c.offset >= 0 && c.offset < (index_t{1} << 31), "offset", "must be in [0, 2^31)", c.offset);
    require(c.layout == sinusoid_layout::interleaved || c.layout == sinusoid_layout::concat ||
                c.layout == sinusoid_layout::concat_cos_sin,
            "layout", "must be interleaved, concat or concat_cos_sin", static_cast<int>(c.layout));
    return c;
  }
  /// The row of `position` (its sinusoid at position + offset) into out[0 .. d_model).
  template <class T>
  void write_row(double position, T* out) const {
    const double at = position + static_cast<double>(config_.offset);
    if (config_.angles == sinusoid_angles::float32)
      detail::sinusoid_row<false>(at, std::span<const float>(w32_), config_.layout, config_.d_model, out);
    else
      detail::sinusoid_row<false>(at, std::span<const double>(w_), config_.layout, config_.d_model, out);
  }

  sinusoidal_config config_;
  std::vector<double> w_;
  std::vector<float> w32_;  // sinusoid_angles::float32 only
};

}  // namespace posenc
