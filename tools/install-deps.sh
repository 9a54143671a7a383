#!/usr/bin/env bash
# Install what posenc's build, tests and benchmarks need from Debian 12 packages; a no-op (and no
# network) when everything is already there. Works as root or through sudo. python3-matplotlib draws
# the pictures of the demo and of the benchmarks (tools/plot_demo.py, tools/plot_bench.py).
# libclang-rt-14-dev: clang's sanitizer and libFuzzer runtimes (the tsan and fuzz presets).
# libopenmpi-dev + openmpi-bin: examples/ring_attention_mpi and its tests (label mpi).
set -euo pipefail
pkgs=(cmake ninja-build g++ clang libclang-rt-14-dev libeigen3-dev catch2 libbenchmark-dev nlohmann-json3-dev python3-matplotlib python3-numpy libopenmpi-dev openmpi-bin)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
