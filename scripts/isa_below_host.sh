#!/usr/bin/env bash
# Prints the environment assignments that make ATen, MKL and oneDNN run as a CPU one step below this one,
# for the second pass of `make test`: SIMD kernels of another width give other bits, and the bitwise
# suites must hold on them too. A pass at the host's own ISA would only repeat the first.
#   AVX-512 host -> an AVX2-only x86-64 CPU (ATen avx2, MKL AVX2, oneDNN AVX2)
#   AVX2 host    -> an x86-64 CPU without AVX (ATen's scalar kernels, MKL SSE4.2, oneDNN SSE4.1)
#   otherwise    -> ATen's scalar kernels
set -euo pipefail
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
if [[ " $flags " == *" avx512f "* ]]; then
  echo "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"
elif [[ " $flags " == *" avx2 "* ]]; then
  echo "ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41"
else
  echo "ATEN_CPU_CAPABILITY=default"
fi
