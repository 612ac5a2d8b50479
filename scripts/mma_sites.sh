#!/usr/bin/env bash
# The tensor-core MMA sites of every kernel in a CUDA object or binary: SASS HGMMA instructions
# with a register accumulator (BF16 and FP8 alike; ptxas's `HGMMA.64x8x16.F16 RZ` placeholders
# not counted), one "count kernel" line per kernel. A timing-only variant (MOK_DIAG_*) that
# leaves a GEMM's results unused can lose that GEMM's MMAs to ptxas's dead-code removal, and
# then times something else than intended (bench/NOTES.md, fourteenth session); --compare says so
# before its timing is trusted.
#   scripts/mma_sites.sh FILE                  the table (kernel names normalised as sass_diff.sh's)
#   scripts/mma_sites.sh --compare BASE HEAD   kernels whose counts differ; exit 1 if any has fewer in HEAD
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find_cuobjdump.sh
cuobjdump="$(find_cuobjdump)" || { echo "mma_sites.sh: no cuobjdump (install the CUDA toolkit's, or set CUOBJDUMP)"; exit 2; }
sites() {
  "$cuobjdump" -sass "$1" |
    sed 's@_GLOBAL__N__[0-9a-f]*_@_GLOBAL__N__@; s@_cu_[0-9a-f]\{8\}@_cu_@' |
    awk '/Function : /{f = $3; if (!(f in n)) n[f] = 0}
         /HGMMA/ && !/HGMMA[^ ]* RZ,/ {n[f]++}
         END {for (k in n) print n[k], k}' | sort -k2
}
if [ "${1:-}" = --compare ]; then
  [ $# -eq 3 ] || { echo "usage: mma_sites.sh --compare BASE HEAD"; exit 2; }
  base="$(sites "$2")" head="$(sites "$3")"
  # (none at all: cuobjdump's output is not what the count expects; say so rather than pass)
  [ "$(echo "$base" | awk '{t += $1} END {print t + 0}')" -gt 0 ] ||
    { echo "mma_sites.sh: no MMA sites found in $2 (not a CUDA binary, or cuobjdump's SASS format changed)"; exit 2; }
  join -1 2 -2 2 -a 1 -a 2 -e 0 -o 0,1.1,2.1 <(echo "$base") <(echo "$head") |
    awk '$2 != $3 {printf "%s: %d MMA sites in the base, %d in the head\n", $1, $2, $3; if ($3 < $2) fewer = 1}
         END {exit fewer}'
else
  [ $# -eq 1 ] || { echo "usage: mma_sites.sh FILE | --compare BASE HEAD"; exit 2; }
  sites "$1"
fi
