#!/usr/bin/env bash
# DRAM bytes and kernel time of every kernel in one pass of a Python implementation of the layer
# (bench/ncu_layer.py, inside its NVTX range `measure`), under Nsight Compute with clocks and caches
# left alone (--cache-control none: one kernel's lines stay in L2 for the next, as in a real step),
# summed over the pass. On a Hopper machine with ncu and the package built:
#   OUT=<dir> PYTHONPATH=build-gpu/pkg scripts/ncu_layer.sh [--preset mixtral-8x7b]
#                                                           [--impl torch-compiled,mok-py,mok-fp8-py] [--pass fwd+bwd]
# writes $OUT/ncu-layer-<preset>-<impl>-<pass>.csv (ncu's rows) and prints, per implementation, the
# kernels, their summed DRAM GB read and written and summed kernel ms, then the same per kernel
# name, its launches summed (for mok-fp8-py: the FP8 step's quantizations, transposing passes and
# GEMM kernels). The fused kernels' stall reasons come from scripts/ncu_forward.sh, one kernel at a time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/ncu_out}"
impls=torch-compiled,mok-py
preset=mixtral-8x7b
pass=fwd+bwd
while [ $# -gt 0 ]; do
  case "$1" in
    --impl) impls="$2"; shift ;;
    --preset) preset="$2"; shift ;;
    --pass) pass="$2"; shift ;;
    *) echo "usage: ncu_layer.sh [--impl LIST] [--preset NAME] [--pass fwd|fwd+bwd]"; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
source scripts/setup.sh || exit 1
set +e
ncu_bin="$(require_ncu ncu_layer.sh)" || exit 1
rc=0
for impl in ${impls//,/ }; do
  csv="$OUT/ncu-layer-$preset-$impl-${pass/+/-}.csv"
  "$ncu_bin" --clock-control none --cache-control none --nvtx --nvtx-include "measure/" \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum --csv --print-units base \
    --log-file "$csv" python3 bench/ncu_layer.py --preset "$preset" --impl "$impl" --pass "$pass" \
    > "$OUT/ncu-layer-$preset-$impl-${pass/+/-}.log" 2>&1 || { echo "ncu failed on $impl:"; tail -5 "$OUT/ncu-layer-$preset-$impl-${pass/+/-}.log"; rc=1; continue; }
  echo "$preset $impl $pass: $(python3 bench/ncu_layer.py --summarize "$csv")"  # (then a line per kernel)
done
exit "$rc"
