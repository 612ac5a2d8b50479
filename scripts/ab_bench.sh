#!/usr/bin/env bash
# Before/after timing of the fused layer on one Hopper GPU, in one run: builds mok_bench from
# a base source tree and from this checkout, then bench/ab_serve.py loads each preset in both
# (`mok_bench --serve`), checks that their outputs are bitwise equal and times them in
# rounds, each side once a round, the side that goes first alternating: per preset and pass, the median of the
# rounds' medians, head / base and its range over rounds.
#
#   OUT=<dir> scripts/ab_bench.sh BASE_SRC_DIR [--presets all|NAME,...] [--rounds 5] [--iters 10]
#                                 [--pass fwd,fwd+bwd[,fp8]]   (fp8: the FP8 forward)
#
# BASE_SRC_DIR: the base commit's files, e.g. `mkdir -p .ab/base && git archive <rev> | tar x -C .ab/base`
# (carried to a GPU machine as an ignored folder). Rows: $OUT/ab.json.
set -uo pipefail
base_src=$1; shift
presets=all rounds=5 iters=10 passes=fwd,fwd+bwd
while [ $# -gt 0 ]; do
  case "$1" in
    --presets) presets=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --iters) iters=$2; shift ;;
    --pass) passes=$2; shift ;;
    *) echo "usage: ab_bench.sh BASE_SRC_DIR [--presets all|NAME,...] [--rounds N] [--iters N] [--pass LIST]"; exit 2 ;;
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
python3 bench/ab_serve.py --base build-ab-base/bench/mok_bench --head build-ab-head/bench/mok_bench \
  --preset "$presets" --pass "$passes" --rounds "$rounds" --iters "$iters" --out "$OUT/ab.json" \
  --meta "{\"base\": \"$base_src\", \"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)\"}"
