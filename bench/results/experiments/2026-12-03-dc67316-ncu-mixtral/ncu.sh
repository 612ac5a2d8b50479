#!/bin/bash
# ncu of mixtral-8x7b's BF16 forward and backward kernels (clocks left alone): why the backward's mainloops run slower per FLOP
source scripts/setup.sh >/dev/null; set +euo pipefail
date -u
( cmake -S . -B build-n -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_PYTHON=OFF -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF > $OUT/build.log 2>&1 && cmake --build build-n --target mok_bench -j$(nproc) >> $OUT/build.log 2>&1 ) || { echo build failed; tail -20 $OUT/build.log; }
date -u
OUT=$OUT/fwd timeout 200 scripts/ncu_forward.sh --build build-n --impl mok --preset mixtral-8x7b --pass fwd
date -u
OUT=$OUT/bwd timeout 250 scripts/ncu_forward.sh --build build-n --impl mok --preset mixtral-8x7b --pass fwd+bwd --kernel 'regex:backward_kernel'
date -u
for d in fwd bwd; do f=$OUT/$d/ncu-mixtral-8x7b-mok.txt; [ -f $f ] && { echo "== $d"; grep -E "Tensor|tensor" $f | head -8; grep -E "DRAM Throughput|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Mem Pipes" $f | head -8; }; done
for d in fwd bwd; do f=$OUT/$d/ncu-mixtral-8x7b-mok-stalls.txt; [ -f $f ] && { echo "== $d stalls"; sort -k3 -g -r $f 2>/dev/null | head -8; }; done
