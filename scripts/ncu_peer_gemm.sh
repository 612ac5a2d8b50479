#!/usr/bin/env bash
# The launch shape of PyTorch's FP8 GEMMs (cuBLAS's kernels: threads, registers, shared memory,
# cluster, grid) on fp8_gemm_clocks' shape, from Nsight Compute's LaunchStats and Occupancy sections
# — what a structure we compare our mainloops against is, without reading its code.
#   scripts/ncu_peer_gemm.sh [OUT_DIR]   (default $OUT or .)
set -euo pipefail
out=${1:-${OUT:-.}}
cd "$(dirname "$0")/.."
for recipe in blockwise rowwise; do
  ncu --kernel-name regex:nvjet --launch-skip 2 --launch-count 1 --section LaunchStats --section Occupancy \
    python3 bench/peer_gemm.py "$recipe" --calls 4 \
    > "$out/ncu-peer-gemm-$recipe.txt" 2>&1 || echo "ncu on the $recipe GEMM failed (see $out/ncu-peer-gemm-$recipe.txt)"
  grep -E "nvjet|Block Size|Registers Per|Shared Memory Config|Dynamic Shared|Static Shared|Grid Size|Cluster Size|Threads  " \
    "$out/ncu-peer-gemm-$recipe.txt" || true
done
