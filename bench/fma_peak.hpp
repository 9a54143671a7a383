// bench/fma_peak.hpp — the core's FMA peak: packet multiply-adds on registers only.
#pragma once

#include <Eigen/Core>
#include <cstdint>

namespace bench_util {

/// The packet of float the products use on this build, and its lanes (multiply-adds per packet FMA).
using fma_packet = Eigen::internal::packet_traits<float>::type;
inline constexpr std::int64_t fma_lanes = Eigen::internal::packet_traits<float>::size;

/// `n` packet FMAs in 16 register-only chains; returns their sum (kept by the caller).
inline float fma_peak(std::int64_t n) {
  namespace in = Eigen::internal;
  constexpr int chains = 16;
  fma_packet c[chains];
  for (auto& x : c) x = in::pset1<fma_packet>(0.f);
  const fma_packet a = in::pset1<fma_packet>(0.999f), b = in::pset1<fma_packet>(1e-3f);
  for (std::int64_t i = 0; i < n; i += chains)
    for (auto& x : c) x = in::pmadd(x, a, b);
  for (int i = 1; i < chains; ++i) c[0] = in::padd(c[0], c[i]);
  return in::predux(c[0]);
}

}  // namespace bench_util
