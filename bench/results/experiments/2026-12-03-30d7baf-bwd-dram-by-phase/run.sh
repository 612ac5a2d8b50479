#!/bin/bash
# C: the backward's DRAM bytes by phase (MOK_DIAG_BWD_NO_LOADS), the layer benchmark at HEAD, power on mixtral
source scripts/setup.sh >/dev/null; set +euo pipefail
C=${MOK_COMMIT:-unknown}; t0=$SECONDS
b() { cmake -S . -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_PYTHON=OFF -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF -DMOK_DIAG_DEFINES="$2" > $OUT/build-$1.log 2>&1 && cmake --build $1 --target mok_bench -j3 >> $OUT/build-$1.log 2>&1 || { echo "build $1 failed"; tail -20 $OUT/build-$1.log; }; }
( cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_PYTHON=ON -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF -DMOK_PTXAS_VERBOSE=ON > $OUT/build_gpu.log 2>&1 && cmake --build build-gpu -j8 >> $OUT/build_gpu.log 2>&1 && rm -rf build-gpu/pkg && mkdir -p build-gpu/pkg && cp -r python/mok build-gpu/pkg/ && cp build-gpu/_C*.so build-gpu/pkg/mok/ ) || { echo "build-gpu failed"; tail -20 $OUT/build_gpu.log; } &
b n1 "MOK_DIAG_BWD_NO_LOADS=1" & b n2 "MOK_DIAG_BWD_NO_LOADS=2" & b n4 "MOK_DIAG_BWD_NO_LOADS=4" & b n8 "MOK_DIAG_BWD_NO_LOADS=8" & b ne "MOK_DIAG_DH_NO_LOADS" &
wait; echo "builds $((SECONDS-t0)) s"
grep -h "spill" $OUT/build_gpu.log | sort | uniq -c | sort -rn | head -4
for bld in build-gpu n1 n2 n4 n8 ne; do
  OUT=$OUT/ncu-$bld timeout 60 scripts/ncu_forward.sh --build $bld --impl mok --preset mixtral-8x7b --pass fwd+bwd --kernel 'regex:backward_kernel' > /dev/null 2>&1
  r=$OUT/ncu-$bld/ncu-mixtral-8x7b-mok-raw.txt
  echo "$bld $(grep -E ' dram__bytes_read\.sum ' $r | awk '{print $NF}') $(grep -E ' dram__bytes_write\.sum ' $r | awk '{print $NF}') $(grep -E ' gpu__time_duration\.sum ' $r | awk '{print $NF}') $(grep -E ' lts__t_sector_hit_rate\.pct ' $r | awk '{print $NF}')" | tee -a $OUT/dram-by-phase.txt
  rm -f $OUT/ncu-$bld/*sass.csv
done
echo "ncu done $((SECONDS-t0)) s"
for R in uniform zipf1.2; do
  PYTHONPATH=$PWD/build-gpu/pkg timeout 200 python3 bench/layer_bench.py --mok-bench build-gpu/bench/mok_bench --preset all --routing $R \
    --impl mok,mok-py,torch-compiled --pass fwd,fwd+bwd --repeats 3 --iters 10 --out $OUT/layer-$R.json --commit $C > $OUT/layer-$R.log 2>&1; echo "layer_bench $R rc=$? $((SECONDS-t0)) s"
done
PYTHONPATH=$PWD/build-gpu/pkg timeout 100 python3 bench/clock_power.py --mok-bench build-gpu/bench/mok_bench --preset mixtral-8x7b --impl mok,torch-compiled --pass fwd,fwd+bwd --repeats 2 --commit $C --out $OUT/power.json > $OUT/power.log 2>&1; echo "power rc=$? $((SECONDS-t0)) s"
tail -12 $OUT/power.log
cat $OUT/dram-by-phase.txt
