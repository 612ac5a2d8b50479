#!/usr/bin/env bash
# Hardware counters of one fused kernel launch per implementation (Nsight Compute, clocks
# left alone): where the consumers stall, how busy the tensor pipe is. On a Hopper machine
# with ncu:
#   OUT=<dir> scripts/ncu_forward.sh [--impl mok,mok-fp8,mok-pp] [--preset deepseek-v3] [--build DIR]
#                                    [--pass fwd|fwd+bwd] [--kernel REGEX]
# writes, per impl, $OUT/ncu-<preset>-<impl>.txt (ncu's details page: speed of light,
# compute and memory workload, warp states, scheduler), $OUT/ncu-<preset>-<impl>-stalls.txt
# (the raw page's warp-stall metrics, one line each: instruction fetch is `no_instruction`)
# $OUT/ncu-<preset>-<impl>-raw.txt (every metric: dram__bytes_read.sum is the launch's DRAM reads)
# and $OUT/ncu-<preset>-<impl>-sass.csv (the source page: each SASS instruction's executions
# and warp-stall samples), and prints the tensor-pipe and stall summary lines. The kernel is
# the one mok_bench times (its second launch, after a warm-up), on the preset's own inputs,
# without the sampled fp64 check: the forward by default; the backward with
# --pass fwd+bwd --kernel 'regex:backward(_fp8)?_kernel'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/ncu_out}"
impls=mok,mok-fp8
preset=deepseek-v3
build=build-gpu
pass=fwd
kernel='regex:forward(_fp8|_pingpong)?_kernel'
while [ $# -gt 0 ]; do
  case "$1" in
    --impl) impls="$2"; shift ;;
    --preset) preset="$2"; shift ;;
    --build) build="$2"; shift ;;
    --pass) pass="$2"; shift ;;
    --kernel) kernel="$2"; shift ;;
    *) echo "usage: ncu_forward.sh [--impl LIST] [--preset NAME] [--build DIR] [--pass fwd|fwd+bwd] [--kernel REGEX]"; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
source scripts/setup.sh || exit 1
set +e
ncu_bin="$(require_ncu ncu_forward.sh)" || exit 1
mok_bench_build "$build" "$OUT/ncu-build.log" || exit 1
rc=0
for impl in ${impls//,/ }; do
  rep="$(mktemp -d)/ncu-$preset-$impl"
  "$ncu_bin" --clock-control none -k "$kernel" --launch-skip 1 --launch-count 1 --set full \
    --import-source no -f -o "$rep" \
    "$build/bench/mok_bench" --preset "$preset" --impl "$impl" --pass "$pass" --iters 1 --warmup 1 --no-check \
    > "$OUT/ncu-$preset-$impl.log" 2>&1 || { echo "ncu failed on $impl:"; tail -20 "$OUT/ncu-$preset-$impl.log"; rc=1; continue; }
  "$ncu_bin" --import "$rep.ncu-rep" --page details > "$OUT/ncu-$preset-$impl.txt" 2>&1
  "$ncu_bin" --import "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-$preset-$impl-sass.csv" 2>&1
  "$ncu_bin" --import "$rep.ncu-rep" --page raw > "$OUT/ncu-$preset-$impl-raw.txt" 2>&1
  grep -E "issue_stalled|inst_executed " "$OUT/ncu-$preset-$impl-raw.txt" > "$OUT/ncu-$preset-$impl-stalls.txt"
  echo "== $preset $impl"
  grep -E " dram__bytes_(read|write)\.sum |lts__t_sector_hit_rate\.pct " "$OUT/ncu-$preset-$impl-raw.txt" | head -4
  grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L2 Hit Rate|Shared Memory|Issue Slots Busy|Executed Ipc Active|No Eligible|Warp Cycles Per Issued" "$OUT/ncu-$preset-$impl.txt" | head -24
done
exit "$rc"
