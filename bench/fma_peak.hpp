// bench/fma_peak.hpp — the core's FMA peak: packet multiply-adds on registers only.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>

namespace bench_util {

/// The packet of float the products use on this build, and its lanes (multiply-adds per packet FMA).
using fma_packet = Eigen::internal::packet_traits<float>::type;
inline constexpr std::int64_t fma_lanes = Eigen::internal::packet_traits<float>::size;

/// The vector registers of this build (Eigen's count: an int or a size_t expression, as the ISA
/// defines it).
inline constexpr int vector_registers = static_cast<int>(EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS);

/// Independent register chains of a loop that streams operands through FMAs: enough to keep both
/// FMA pipes busy (FMA latency x pipes in flight: 4 x 2 on Zen 3-5 and recent Intel cores) and few
/// enough to leave registers for the operands: 16 of 32 vector registers (AVX-512), 8 of 16 (AVX2).
inline constexpr int fma_chains = std::min(16, vector_registers / 2);

/// `n` packet FMAs in register-only chains (16, or 12 of 16 registers); returns their sum (kept by
/// the caller). Each chain accumulates (c += a b, the kernels' form). On a Zen 3 VM (AVX2): 12 chains
/// 5.8-5.9 G packet FMAs a second, 8 chains 5.5-5.7, 16 chains 0.95 (spilled); written c = c a + b,
/// clang 14 copied the addend into every destination and spilled chains (1.2-1.7 with 8 to 16).
inline float fma_peak(std::int64_t n) {
  namespace in = Eigen::internal;
  constexpr int chains = std::min(16, vector_registers - 4);
  fma_packet c[chains];
  for (auto& x : c) x = in::pset1<fma_packet>(0.f);
  const fma_packet a = in::pset1<fma_packet>(0.999f), b = in::pset1<fma_packet>(1e-3f);
  for (std::int64_t i = 0; i < n; i += chains)
    for (auto& x : c) x = in::pmadd(a, b, x);
  for (int i = 1; i < chains; ++i) c[0] = in::padd(c[0], c[i]);
  return in::predux(c[0]);
}

}  // namespace bench_util
