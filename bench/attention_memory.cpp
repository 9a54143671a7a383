// Peak resident memory of one fused attention call at L = 32768, H = 8, d = 128 (float, BSHD,
// causal), against the bytes of q, k, v and out together (target: peak <= 1.25x). Not a Google
// Benchmark binary: the peak RSS of the whole process (getrusage ru_maxrss) is the measurement.
// Usage: attention_memory [L] [threads] [none|shaw]
// `shaw`: Shaw et al. relative keys and values (k = 64, tables [129, d] shared by the heads), whose
// per-tile products and per-bucket value mass must not add anything proportional to L x L.
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include <posenc/attention.hpp>
#include <posenc/shaw.hpp>
#include <string>

int main(int argc, char** argv) {
  const posenc::index_t L = argc > 1 ? std::atol(argv[1]) : 32768, H = 8, d = 128;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const std::string encoding = argc > 3 ? argv[3] : "none";
  if (encoding != "none" && encoding != "shaw") {
    std::fprintf(stderr, "attention_memory: encoding must be none or shaw (got %s)\n", encoding.c_str());
    return 2;
  }
  const auto n = static_cast<std::size_t>(L * H * d);
  // Touch every page so the buffers are resident before the call (the baseline the target counts).
  std::vector<float> q(n), k(n), v(n), out(n);
  for (std::size_t i = 0; i < n; ++i) {
    q[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    k[i] = static_cast<float>((i * 40503u) % 1000) * 1e-3f - 0.5f;
    v[i] = static_cast<float>(i % 977) * 1e-3f;
  }
  std::unique_ptr<Eigen::ThreadPool> pool = threads > 1 ? std::make_unique<Eigen::ThreadPool>(threads) : nullptr;
  posenc::attention_options opt;
  opt.causal = true;
  opt.pool = pool.get();
  const auto Q = posenc::bshd<const float>(q.data(), 1, L, H, d), K = posenc::bshd<const float>(k.data(), 1, L, H, d),
             V = posenc::bshd<const float>(v.data(), 1, L, H, d);
  if (encoding == "shaw") {
    const posenc::index_t rel = 64, rows = 2 * rel + 1;
    std::vector<float> wk(static_cast<std::size_t>(rows * d)), wv(wk.size());
    for (std::size_t i = 0; i < wk.size(); ++i) {
      wk[i] = static_cast<float>(i % 13) * 1e-2f;
      wv[i] = static_cast<float>(i % 7) * 1e-2f;
    }
    const posenc::shaw_relative<float> shaw(posenc::tensor_map<const float, 2>(wk.data(), rows, d),
                                            posenc::tensor_map<const float, 2>(wv.data(), rows, d),
                                            {.max_relative_position = rel});
    posenc::attention<float>(Q, K, V, posenc::bshd(out.data(), 1, L, H, d), shaw, opt);
  } else {
    posenc::attention<float>(Q, K, V, posenc::bshd(out.data(), 1, L, H, d), posenc::no_position{}, opt);
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double peak = static_cast<double>(ru.ru_maxrss) * 1024.0;  // ru_maxrss is in KiB on Linux
  const double tensors = 4.0 * static_cast<double>(n) * sizeof(float);
  double check = 0;
  for (std::size_t i = 0; i < n; i += 4099) check += out[i];
  std::printf("%s L=%ld H=%ld d=%ld threads=%d  q+k+v+out = %.1f MiB  peak RSS = %.1f MiB  ratio = %.3f  (checksum %g)\n",
              encoding.c_str(), static_cast<long>(L), static_cast<long>(H), static_cast<long>(d), threads, tensors / 1048576.0,
              peak / 1048576.0, peak / tensors, check);
  return peak <= 1.25 * tensors ? 0 : 1;
}
