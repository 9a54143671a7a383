// Peak resident memory of one fused Transformer-XL attention call (float, BSHD, H = 8, d = 64,
// d_model = 512), against the bytes of q, k, v and out together (target: peak <= 1.25x), like
// attention_memory.cpp. The per-call table W_R R holds one [H, D] row per distance the call can
// see: k_len rows without clamp_len (as large as K), clamp_len + 1 rows with it.
// Usage: transformer_xl_memory [L] [memory] [clamp_len] [threads]   (defaults 16384, L/2, -1, 2)
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include <posenc/attention.hpp>
#include <posenc/transformer_xl.hpp>

int main(int argc, char** argv) {
  const posenc::index_t L = argc > 1 ? std::atol(argv[1]) : 16384, H = 8, d = 64, M = H * d;
  const posenc::index_t mlen = argc > 2 ? std::atol(argv[2]) : L / 2, Sk = L + mlen;
  const std::int64_t clamp_len = argc > 3 ? std::atol(argv[3]) : -1;
  const int threads = argc > 4 ? std::atoi(argv[4]) : 2;
  const auto nq = static_cast<std::size_t>(L * M), nk = static_cast<std::size_t>(Sk * M);
  // Touch every page so the buffers are resident before the call (the baseline the target counts).
  std::vector<float> q(nq), k(nk), v(nk), out(nq);
  for (std::size_t i = 0; i < nq; ++i) q[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
  for (std::size_t i = 0; i < nk; ++i) {
    k[i] = static_cast<float>((i * 40503u) % 1000) * 1e-3f - 0.5f;
    v[i] = static_cast<float>(i % 977) * 1e-3f;
  }
  std::vector<float> w(static_cast<std::size_t>(M * M)), u(static_cast<std::size_t>(M)), rv(static_cast<std::size_t>(M));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((i * 7919u) % 1000) * 1e-4f - 0.05f;
  for (std::size_t i = 0; i < u.size(); ++i) u[i] = rv[i] = static_cast<float>(i % 13) * 1e-2f;
  const posenc::transformer_xl<float> enc(posenc::tensor_map<const float, 2>(w.data(), M, M),
                                          posenc::tensor_map<const float, 2>(u.data(), H, d),
                                          posenc::tensor_map<const float, 2>(rv.data(), H, d),
                                          {.d_model = M, .n_head = H, .d_head = d, .clamp_len = clamp_len});
  std::unique_ptr<Eigen::ThreadPool> pool = threads > 1 ? std::make_unique<Eigen::ThreadPool>(threads) : nullptr;
  posenc::attention_options opt = posenc::transformer_xl_options(L, Sk);
  opt.pool = pool.get();
  posenc::attention<float>(posenc::bshd<const float>(q.data(), 1, L, H, d), posenc::bshd<const float>(k.data(), 1, Sk, H, d),
                           posenc::bshd<const float>(v.data(), 1, Sk, H, d), posenc::bshd(out.data(), 1, L, H, d), enc,
                           opt);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double peak = static_cast<double>(ru.ru_maxrss) * 1024.0;  // ru_maxrss is in KiB on Linux
  const double tensors = static_cast<double>(2 * nq + 2 * nk) * sizeof(float);
  double check = 0;
  for (std::size_t i = 0; i < nq; i += 4099) check += out[i];
  std::printf("L=%ld memory=%ld clamp_len=%ld H=%ld d=%ld threads=%d  q+k+v+out = %.1f MiB  peak RSS = %.1f MiB  "
              "ratio = %.3f  (checksum %g)\n",
              static_cast<long>(L), static_cast<long>(mlen), static_cast<long>(clamp_len), static_cast<long>(H),
              static_cast<long>(d), threads, tensors / 1048576.0, peak / 1048576.0, peak / tensors, check);
  return peak <= 1.25 * tensors ? 0 : 1;
}
