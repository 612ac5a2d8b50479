#!/bin/bash
# the SM clock and board power while mok_bench repeats mixtral-8x7b's forward, then its forward+backward
source scripts/setup.sh >/dev/null; set +euo pipefail
( cmake -S . -B build-n -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_PYTHON=OFF -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF > $OUT/build.log 2>&1 && cmake --build build-n --target mok_bench -j$(nproc) >> $OUT/build.log 2>&1 ) || { echo build failed; tail -20 $OUT/build.log; }
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 50 > $OUT/smi.csv 2>&1 &
SMI=$!
for ps in fwd fwd+bwd fwd fwd+bwd; do
  n=$([ $ps = fwd ] && echo 400 || echo 120)
  echo "$ps start $(date -u +%H:%M:%S.%N)" >> $OUT/marks.txt
  build-n/bench/mok_bench --preset mixtral-8x7b --impl mok --pass $ps --iters $n --warmup 5 --no-check > $OUT/bench-$ps.txt 2>&1
  echo "$ps end $(date -u +%H:%M:%S.%N)" >> $OUT/marks.txt
  sleep 1
done
kill $SMI
cat $OUT/marks.txt; tail -3 $OUT/bench-fwd.txt $OUT/bench-fwd+bwd.txt
python3 - "$OUT" <<'PY'
import sys, csv, statistics, datetime
out = sys.argv[1]
rows = [r for r in csv.reader(open(f"{out}/smi.csv")) if len(r) >= 5]
def t(s): return datetime.datetime.strptime(s.strip().split(" ")[-1][:15], "%H:%M:%S.%f")
marks = [l.split() for l in open(f"{out}/marks.txt")]
for i in range(0, len(marks), 2):
    ps, a, b = marks[i][0], t(marks[i][2]), t(marks[i + 1][2])
    a = a + datetime.timedelta(seconds=0.5)  # (start-up and warm-up)
    sel = [r for r in rows if a <= t(r[0]) <= b]
    clk = [float(r[1].split()[0]) for r in sel]; pw = [float(r[2].split()[0]) for r in sel]
    if clk: print(f"{ps:8s} samples {len(sel):4d}  SM MHz median {statistics.median(clk):.0f} [{min(clk):.0f}, {max(clk):.0f}]  W median {statistics.median(pw):.0f} [{min(pw):.0f}, {max(pw):.0f}]  throttle {sorted(set(r[5].strip() for r in sel))}")
PY
