#!/usr/bin/env bash
# Prebuilt-binary A/B of the combine forms (no device build; bench/pending/README.md). base: the 8-byte
# form (MOK_DIAG_COMBINE_NARROW), head: the octet combine as the patch builds it. Before the call, on
# the CPU machine, with bench/pending/combine-octets.patch applied:
#   ninja -C build mok_bench; mkdir -p .ab/combine/{octets2,narrow}; cp build/bench/mok_bench .ab/combine/octets2/
#   cmake -S . -B build-narrow -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_DIAG_DEFINES=MOK_DIAG_COMBINE_NARROW \
#     -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF && ninja -C build-narrow mok_bench && cp build-narrow/bench/mok_bench .ab/combine/narrow/
# then run: bash bench/pending/combine-octets-ab.sh, carrying .ab/combine with MOK_COMMIT=<the sha the binaries were built from> (the device copy's HEAD is main's, not the patched tree's).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=.ab/combine/narrow/mok_bench; H=.ab/combine/octets2/mok_bench
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); D=$(date -u +%FT%TZ)
meta() { echo "{\"gpu\": \"$G\", \"commit\": \"$1\", \"base\": \"MOK_DIAG_COMBINE_NARROW\", \"head\": \"$2\", \"date\": \"$D\"}"; }
: "${MOK_COMMIT:?set MOK_COMMIT to the sha the two binaries were built from}"
M=$(meta "$MOK_COMMIT" default)
A=$OUT/ab; mkdir -p $A; echo "$G"
python3 bench/ab_serve.py --base $B --head $H --impls mok,mok --preset deepseek-v3,qwen3-30b-a3b,olmoe-1b-7b --pass fwd,fwd+bwd --rounds 5 --iters 10 --out $A/ab-bf16.json --meta "$M" 2>&1 | tail -9
python3 bench/ab_serve.py --base $B --head $H --impls mok-fp8,mok-fp8 --preset deepseek-v3,qwen3-30b-a3b,olmoe-1b-7b --pass fwd --rounds 5 --iters 10 --out $A/ab-fp8.json --meta "$M" 2>&1 | tail -6
python3 bench/clock_power.py --mok-bench $B --mok-bench-head $H --impl mok,head:mok,mok-fp8,head:mok-fp8 --pass fwd --preset qwen3-30b-a3b,deepseek-v3 --repeats 2 --seconds 3 --out $A/sus.json 2>&1 | grep "head/base"
