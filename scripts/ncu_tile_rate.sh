#!/usr/bin/env bash
# Hardware counters of bench/fp8_tile_rate's FP8 mainloop variants (Nsight Compute, clocks left
# alone; one launch of each, after a warm-up launch): what each waits on, how busy the tensor pipe,
# shared memory and L2 are. On a Hopper machine with ncu:
#   OUT=<dir> scripts/ncu_tile_rate.sh [--build DIR] [--group-rows G] [--peers]
#                                      [--variants current,a_in_regs,current_ss,overlapped,overlap_mc,narrow,narrow_bmc,narrow_ss,three,three_ss,overlapped_ss,overlap_mc_ss]
# builds fp8_tile_rate if DIR lacks it, and writes per variant $OUT/ncu-tile-<variant>.txt (the
# details page), -raw.txt (every metric), -stalls.txt (the warp-stall metrics) and -sass.csv (the
# source page: each SASS instruction's executions and stall samples), then prints a
# summary per variant; $OUT/ncu-tile.tgz holds the files. --group-rows G: fp8_tile_rate's tile order
# (the layer's inside experts of G rows; default 0, all of M one group). --peers: also cuBLAS's
# blockwise-recipe GEMM of the same shape and bytes (bench/peer_gemm.py: torch.nn.functional.scaled_mm;
# its kernel a peer we compare against), as variant `cublas_blockwise`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/ncu_out}"
build=build-rates
list=current,a_in_regs,overlapped,overlap_mc
group_rows=0
peers=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift ;;
    --variants) list="$2"; shift ;;
    --group-rows) group_rows="$2"; shift ;;
    --peers) peers=1 ;;
    *) echo "usage: ncu_tile_rate.sh [--build DIR] [--group-rows G] [--peers] [--variants LIST]"; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
source scripts/setup.sh || exit 1
set +e
ncu_bin="$(require_ncu ncu_tile_rate.sh)" || exit 1
if [ ! -x "$build/bench/fp8_tile_rate" ]; then
  { cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_PYTHON=OFF -DMOK_BUILD_TESTS=OFF \
      -DMOK_BUILD_EXAMPLES=OFF && cmake --build "$build" --target fp8_tile_rate -j"$(nproc)"; } > "$OUT/ncu-build.log" 2>&1 ||
    { tail -30 "$OUT/ncu-build.log"; exit 1; }
fi
# The variants by their mangled kernel names (tile_kernel<Storage<N, stages, cluster, M, shares B,
# scales in shared memory>, loop>).
declare -A variants=(
  [current]='regex:tile_kernel.*StorageILi256ELi4ELi1ELi128ELb0ELb0EEELi0E'
  [a_in_regs]='regex:tile_kernel.*StorageILi256ELi4ELi1ELi128ELb0ELb0EEELi1E'
  [current_ss]='regex:tile_kernel.*StorageILi256ELi4ELi1ELi128ELb0ELb1EEELi4E'
  [overlapped]='regex:tile_kernel.*StorageILi128ELi4ELi1ELi128ELb0ELb0EEELi0E'
  [overlap_mc]='regex:tile_kernel.*StorageILi128ELi6ELi2ELi128ELb0ELb0EEELi0E'
  [narrow]='regex:tile_kernel.*StorageILi128ELi6ELi1ELi128ELb0ELb0EEELi2E'
  [narrow_bmc]='regex:tile_kernel.*StorageILi128ELi6ELi2ELi128ELb1ELb0EEELi2E'
  [narrow_ss]='regex:tile_kernel.*StorageILi128ELi6ELi1ELi128ELb0ELb1EEELi3E'
  [three]='regex:tile_kernel.*StorageILi128ELi4ELi1ELi192ELb0ELb0EEELi0E'
  [three_ss]='regex:tile_kernel.*StorageILi128ELi4ELi1ELi192ELb0ELb1EEELi3E'
  [overlapped_ss]='regex:tile_kernel.*StorageILi128ELi6ELi1ELi128ELb0ELb1EEELi4E'
  [overlap_mc_ss]='regex:tile_kernel.*StorageILi128ELi6ELi2ELi128ELb0ELb1EEELi4E'
)
variants[cublas_blockwise]='regex:nvjet'
[ "$peers" = 1 ] && list="$list,cublas_blockwise"
rc=0
for v in ${list//,/ }; do
  rep="$(mktemp -d)/ncu-tile-$v"
  if [ "$v" = cublas_blockwise ]; then
    cmd=(python3 bench/peer_gemm.py blockwise --calls 3)
  else
    cmd=("$build/bench/fp8_tile_rate" --only "$(echo "$v" | sed 's/_in_/-in-/; s/_ss/-ss/; s/overlap_mc/overlap+mc/; s/narrow_bmc/narrow+bmc/; s/^three$/three-wgs/; s/^three-ss$/three-wgs-ss/')" \
         --iters 2 --repeats 1 --warmup 1 --group-rows "$group_rows")
  fi
  "$ncu_bin" --clock-control none --kernel-name-base mangled -k "${variants[$v]}" --launch-skip 1 --launch-count 1 \
    --set full -f -o "$rep" "${cmd[@]}" \
    > "$OUT/ncu-tile-$v.log" 2>&1 || { echo "ncu failed on $v:"; tail -20 "$OUT/ncu-tile-$v.log"; rc=1; continue; }
  "$ncu_bin" --import "$rep.ncu-rep" --page details > "$OUT/ncu-tile-$v.txt" 2>&1
  "$ncu_bin" --import "$rep.ncu-rep" --page raw > "$OUT/ncu-tile-$v-raw.txt" 2>&1
  "$ncu_bin" --import "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-tile-$v-sass.csv" 2>&1
  grep -E "issue_stalled.*per_warp_active|inst_executed " "$OUT/ncu-tile-$v-raw.txt" > "$OUT/ncu-tile-$v-stalls.txt"
  echo "== $v"
  grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" "$OUT/ncu-tile-$v.txt" | head -12
  grep -E "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active |sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active |l1tex__data_pipe_lsu_wavefronts_mem_shared.sum |lts__t_sectors_srcunit_tex.sum |smsp__average_warps_issue_stalled_(long_scoreboard|barrier|wait|math_pipe_throttle|mio_throttle|short_scoreboard|membar|sleeping|dispatch_stall|no_instruction|lg_throttle|tex_throttle|selected|not_selected)_per_issue_active.ratio " \
    "$OUT/ncu-tile-$v-raw.txt" | awk '{print "  " $1, $(NF-1), $NF}' | head -30
done
tar czf "$OUT/ncu-tile.tgz" -C "$OUT" $(cd "$OUT" && ls ncu-tile-* 2>/dev/null) && (cd "$OUT" && rm -f ncu-tile-*)
exit "$rc"
