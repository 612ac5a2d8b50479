#!/bin/bash
# D: the dx tiles N fastest (MOK_DIAG_DX_N_FASTEST) against the default: backward DRAM bytes (ncu) and time (ab_serve)
source scripts/setup.sh >/dev/null; set +euo pipefail
G="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"; C=${MOK_COMMIT:-unknown}; D=$(date -u +%Y-%m-%dT%H:%M:%SZ); t0=$SECONDS
R=$OUT/r; mkdir -p $R
b() { cmake -S . -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_PYTHON=OFF -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF -DMOK_DIAG_DEFINES="$2" > $R/build-$1.log 2>&1 && cmake --build $1 --target mok_bench -j8 >> $R/build-$1.log 2>&1 || { echo "build $1 failed"; tail -20 $R/build-$1.log; }; }
b bb "" & b bv "MOK_DIAG_DX_N_FASTEST" & wait; echo "builds $((SECONDS-t0)) s"
for bld in bb bv; do
  OUT=$R/ncu-$bld timeout 60 scripts/ncu_forward.sh --build $bld --impl mok --preset mixtral-8x7b --pass fwd+bwd --kernel 'regex:backward_kernel' > /dev/null 2>&1
  r=$R/ncu-$bld/ncu-mixtral-8x7b-mok-raw.txt
  echo "$bld $(grep -E ' dram__bytes_read\.sum ' $r | awk '{print $NF}') $(grep -E ' dram__bytes_write\.sum ' $r | awk '{print $NF}') $(grep -E ' gpu__time_duration\.sum ' $r | awk '{print $NF}') $(grep -E ' lts__t_sector_hit_rate\.pct ' $r | awk '{print $NF}')" | tee -a $OUT/dram.txt
  rm -f $R/ncu-$bld/*sass.csv
done
echo "ncu done $((SECONDS-t0)) s"
timeout 150 python3 bench/ab_serve.py --base bb/bench/mok_bench --head bv/bench/mok_bench --impls mok,mok --preset mixtral-8x7b,deepseek-v3,qwen3-30b-a3b --pass fwd+bwd --rounds 3 --iters 10 --out $OUT/ab-dx.json --meta "{\"gpu\": \"$G\", \"commit\": \"$C\", \"date\": \"$D\", \"base\": \"default\", \"head\": \"MOK_DIAG_DX_N_FASTEST\"}" > $OUT/ab-dx.txt 2>&1
tail -6 $OUT/ab-dx.txt; echo "ab done $((SECONDS-t0)) s"
tar czf $OUT/r.tgz -C $R . ; rm -rf $R
