#!/usr/bin/env bash
# Compile every cuda/*.cu (compile-only) for sm_90a and sm_80, as CI does on machines without a GPU.
# The kernel sources include only CUDA headers, so no CUDA build of torch is needed. Exit non-zero on any failure.
# Usage: scripts/compile_kernels.sh [-v]   (-v adds ptxas register/spill reports)
set -euo pipefail
cd "$(dirname "$0")/.."
extra=()
[[ "${1:-}" == "-v" ]] && extra=(-Xptxas -v)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for src in cuda/*.cu; do
  obj="$tmp/$(basename "${src%.cu}").o"
  # The -D flags are the ones torch's extension builder adds: they remove implicit half/bf16 conversions.
  if nvcc -c -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
      -D__CUDA_NO_HALF2_OPERATORS__ \
      -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80 \
      "${extra[@]}" "$src" -o "$obj"; then
    echo "ok      $src"
  else
    echo "FAILED  $src"
    status=1
  fi
done
exit $status
