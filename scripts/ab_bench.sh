#!/usr/bin/env bash
# Before/after timing of the fused layer on one Hopper GPU, in one run: builds mok_bench from
# a base source tree and from this checkout, then runs them in alternating rounds (base,
# head, base, head, ...) on the same presets, and prints bench/ab_compare.py's table
# (per preset and pass: median of the rounds' medians, head / base, its range over rounds).
#
#   OUT=<dir> scripts/ab_bench.sh BASE_SRC_DIR [--presets all|NAME,...] [--rounds 3] [--iters 10]
#
# BASE_SRC_DIR: the base commit's files, e.g. `git archive <rev> | tar x -C .ab/base`
# (carried to a GPU machine as an ignored folder). Records: $OUT/ab-{base,head}-<round>.json.
set -uo pipefail
base_src=$1; shift
presets=all rounds=3 iters=10
while [ $# -gt 0 ]; do
  case "$1" in
    --presets) presets=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --iters) iters=$2; shift ;;
    *) echo "usage: ab_bench.sh BASE_SRC_DIR [--presets all|NAME,...] [--rounds N] [--iters N]"; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-ab-out}
mkdir -p "$OUT"
jobs=$(nproc)
build() {  # $1: source, $2: build dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF \
    > "$2.log" 2>&1 && cmake --build "$2" --target mok_bench -j"$jobs" >> "$2.log" 2>&1 ||
    { echo "ab_bench.sh: building $1 failed"; tail -30 "$2.log"; exit 1; }
}
build "$base_src" build-ab-base
build . build-ab-head
for r in $(seq 1 "$rounds"); do
  for side in base head; do
    build-ab-$side/bench/mok_bench --preset "$presets" --impl mok --pass fwd,fwd+bwd --iters "$iters" \
      --out "$OUT/ab-$side-$r.json" > "$OUT/ab-$side-$r.log" 2>&1 || echo "ab_bench.sh: $side round $r failed (see its log)"
  done
done
python3 bench/ab_compare.py "$OUT"/ab-base-*.json --head "$OUT"/ab-head-*.json
