#!/bin/bash
# A: dW_gate|up's order (default N fastest where 2I > H) against the old order; dW_down's variant; ncu DRAM bytes
source scripts/setup.sh >/dev/null; set +euo pipefail
G="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"; C=${MOK_COMMIT:-unknown}; D=$(date -u +%Y-%m-%dT%H:%M:%SZ)
b() { cmake -S . -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_PYTHON=OFF -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF -DMOK_PTXAS_VERBOSE=ON -DMOK_DIAG_DEFINES="$2" > $OUT/build-$1.log 2>&1 && cmake --build $1 --target mok_bench -j6 >> $OUT/build-$1.log 2>&1 || { echo "build $1 failed"; tail -20 $OUT/build-$1.log; }; }
t0=$SECONDS
b bb "" & b bw "MOK_DIAG_WGU_M_FASTEST" & b bd "MOK_DIAG_WD_N_FASTEST" & wait
echo "builds $((SECONDS-t0)) s"
grep -h "spill" $OUT/build-bb.log | sort | uniq -c | sort -rn | head -5
python3 bench/ab_serve.py --base bb/bench/mok_bench --head bw/bench/mok_bench --impls mok,mok --preset mixtral-8x7b,gpt-oss-120b,deepseek-v3 --pass fwd+bwd --rounds 3 --iters 10 --out $OUT/ab-wgu.json --meta "{\"gpu\": \"$G\", \"commit\": \"$C\", \"date\": \"$D\", \"base\": \"default (N fastest where 2I > H)\", \"head\": \"MOK_DIAG_WGU_M_FASTEST\"}" > $OUT/ab-wgu.txt 2>&1
tail -8 $OUT/ab-wgu.txt; echo "ab-wgu done $((SECONDS-t0)) s"
for bld in bb bw; do OUT=$OUT/ncu-$bld scripts/ncu_forward.sh --build $bld --impl mok --preset mixtral-8x7b --pass fwd+bwd --kernel 'regex:backward_kernel' 2>&1 | tail -16; echo "ncu $bld done $((SECONDS-t0)) s"; done
python3 bench/ab_serve.py --base bb/bench/mok_bench --head bd/bench/mok_bench --impls mok,mok --preset deepseek-v3,kimi-k2,glm-4.5 --pass fwd+bwd --rounds 3 --iters 10 --out $OUT/ab-wd.json --meta "{\"gpu\": \"$G\", \"commit\": \"$C\", \"date\": \"$D\", \"base\": \"default\", \"head\": \"MOK_DIAG_WD_N_FASTEST\"}" > $OUT/ab-wd.txt 2>&1
tail -8 $OUT/ab-wd.txt; echo "ab-wd done $((SECONDS-t0)) s"
