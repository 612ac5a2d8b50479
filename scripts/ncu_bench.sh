#!/usr/bin/env bash
# Kernel time and DRAM bytes of every launch of mok_bench's C++ layer (every pass of its run profiled:
# the check's, the warm-up's and the timed one, and what the layer's set-up runs), under Nsight Compute
# with clocks and caches left alone (--cache-control none: one kernel's lines stay in L2 for the next,
# as in a real step), summed per kernel name: where an implementation's pass goes, launch by launch,
# in any build (a diagnostic one too), without the Python package that scripts/ncu_layer.sh needs.
# On a Hopper machine with ncu:
#   OUT=<dir> scripts/ncu_bench.sh [--build DIR] [--impl mok-fp8-wgrad,mok] [--preset deepseek-v3]
#                                  [--pass fwd+bwd] [--kernel REGEX] [--diag DEFINES]
# writes $OUT/ncu-bench-<build>-<preset>-<impl>-<pass>.csv (ncu's rows) and prints, per implementation,
# the kernels' summed ms and DRAM GB and a line per kernel name (bench/ncu_layer.py --summarize). The
# sums cover every pass: the forward kernel's launch count is their number (4 with fwd+bwd at 27ca907;
# divide by it for one pass), plus the few set-up launches (weight quantization, fills) outside them;
# --kernel (ncu's -k, e.g. 'regex:quantize_column') keeps only the kernels it matches. --diag: the
# build (made if missing) with -DMOK_DIAG_DEFINES=DEFINES (';' between several), e.g.
# --build build-x --diag MOK_DIAG_X beside a default --build build-ncu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/ncu_out}"
impls=mok-fp8-wgrad
preset=deepseek-v3
pass=fwd+bwd
build=build-ncu
kernel=""
diag=""
while [ $# -gt 0 ]; do
  case "$1" in
    --impl) impls="$2"; shift ;;
    --preset) preset="$2"; shift ;;
    --pass) pass="$2"; shift ;;
    --build) build="$2"; shift ;;
    --kernel) kernel="$2"; shift ;;
    --diag) diag="$2"; shift ;;
    *) echo "usage: ncu_bench.sh [--build DIR] [--impl LIST] [--preset NAME] [--pass fwd|fwd+bwd] [--kernel REGEX] [--diag DEFINES]"; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
source scripts/setup.sh || exit 1
set +e
ncu_bin="$(require_ncu ncu_bench.sh)" || exit 1
mok_bench_build "$build" "$OUT/ncu-bench-build-$(basename "$build").log" "$diag" || exit 1
filter=()
[ -n "$kernel" ] && filter=(-k "$kernel")
rc=0
for impl in ${impls//,/ }; do
  name="ncu-bench-$(basename "$build")-$preset-$impl-${pass/+/-}"
  "$ncu_bin" --clock-control none --cache-control none "${filter[@]}" \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum --csv --print-units base \
    --log-file "$OUT/$name.csv" "$build/bench/mok_bench" --preset "$preset" --impl "$impl" --pass "$pass" \
    --iters 1 --warmup 1 --no-check > "$OUT/$name.log" 2>&1 ||
    { echo "ncu failed on $impl:"; tail -5 "$OUT/$name.log"; rc=1; continue; }
  echo "== $(basename "$build") $preset $impl $pass (every pass; the forward kernel's launches count them): $(python3 bench/ncu_layer.py --summarize "$OUT/$name.csv")"
done
exit "$rc"
