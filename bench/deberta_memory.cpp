// Peak resident memory of one fused DeBERTa-v3-base attention call (H = 12, d = 64, position_buckets
// 256, max_relative_positions 512, c2p + p2c, float, BSHD, HF attention_mask with padding) at
// L = 16384, against q + k + v + out plus what the encoding keeps: the layer's inputs it viewed
// (rel_embeddings, two projections) and its projected tables Kr, Qr (per head, float and double, plain and packed),
// and the per-call row table and key padding mask (target: peak <= 1.25x). The peak RSS of the
// whole process (getrusage ru_maxrss) is the measurement. Usage: deberta_memory [L] [threads]
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include <posenc/deberta.hpp>

int main(int argc, char** argv) {
  const posenc::index_t L = argc > 1 ? std::atol(argv[1]) : 16384, H = 12, d = 64, Dm = H * d, span = 256;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const auto n = static_cast<std::size_t>(L * H * d);
  std::vector<float> q(n), k(n), v(n), out(n);
  for (std::size_t i = 0; i < n; ++i) {  // touch every page: resident before the call
    q[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    k[i] = static_cast<float>((i * 40503u) % 1000) * 1e-3f - 0.5f;
    v[i] = static_cast<float>(i % 977) * 1e-3f;
  }
  std::vector<float> rel(static_cast<std::size_t>(2 * span * Dm)), w(static_cast<std::size_t>(Dm * Dm)),
      b(static_cast<std::size_t>(Dm));
  for (std::size_t i = 0; i < rel.size(); ++i) rel[i] = static_cast<float>(i % 131) * 1e-3f;
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 89) * 1e-4f - 4e-3f;
  posenc::deberta_weights<float> weights(posenc::tensor_map<const float, 2>(rel.data(), 2 * span, Dm));
  const posenc::deberta_linear<float> lin(posenc::tensor_map<const float, 2>(w.data(), Dm, Dm),
                                          posenc::tensor_map<const float, 1>(b.data(), Dm));
  weights.query_proj = lin;
  weights.key_proj = lin;
  const posenc::deberta_disentangled enc({.heads = H, .head_dim = d, .position_buckets = span,
                                          .max_relative_positions = 512},
                                         weights);
  std::vector<std::int64_t> mask(static_cast<std::size_t>(L), 1);
  for (posenc::index_t j = L - L / 16; j < L; ++j) mask[static_cast<std::size_t>(j)] = 0;
  std::unique_ptr<Eigen::ThreadPool> pool = threads > 1 ? std::make_unique<Eigen::ThreadPool>(threads) : nullptr;
  posenc::attention_options opt;
  opt.pool = pool.get();
  posenc::deberta_attention<float>(posenc::bshd<const float>(q.data(), 1, L, H, d),
                                   posenc::bshd<const float>(k.data(), 1, L, H, d),
                                   posenc::bshd<const float>(v.data(), 1, L, H, d), posenc::bshd(out.data(), 1, L, H, d),
                                   enc, posenc::tensor_map<const std::int64_t, 2>(mask.data(), 1, L), opt);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double peak = static_cast<double>(ru.ru_maxrss) * 1024.0;  // KiB on Linux
  const double tensors = 4.0 * static_cast<double>(n) * sizeof(float);
  const double inputs = static_cast<double>((rel.size() + w.size() + b.size()) * sizeof(float));
  // Kr and Qr per head, float and double, plain and packed for the tile products.
  const double tables = 2.0 * 2.0 * static_cast<double>(H * 2 * span * d) * (sizeof(float) + sizeof(double)) +
                        static_cast<double>(2 * L - 1) * sizeof(std::int32_t) + static_cast<double>(L) * 8.0;
  const double base = tensors + inputs + tables;
  double check = 0;
  for (std::size_t i = 0; i < n; i += 4099) check += out[i];
  std::printf("L=%ld H=%ld d=%ld threads=%d  q+k+v+out = %.1f MiB  + layer inputs %.1f MiB + tables %.1f MiB"
              "  peak RSS = %.1f MiB  ratio = %.3f  (checksum %g)\n",
              static_cast<long>(L), static_cast<long>(H), static_cast<long>(d), threads, tensors / 1048576.0,
              inputs / 1048576.0, tables / 1048576.0, peak / 1048576.0, peak / base, check);
  return peak <= 1.25 * base ? 0 : 1;
}
