#!/usr/bin/env bash
# One device call for both pending patches (bench/pending/README.md): the prebuilt-binary A/B of the combine
# forms (no device build; base = the 8-byte form, MOK_DIAG_COMBINE_NARROW; head = the octet combine), then
# every ctest and the sanitizers (scripts/gpu_check.sh --part ctest) on the checked-out tree. Each step is
# bounded and each result bundle is written as its step ends, so a call cut short keeps what ran
# (~300 s with the default bounds; AB_SECONDS / CTEST_SECONDS change them).
# Before the call, on the CPU machine, on a scratch branch of main:
#   git apply bench/pending/combine-octets.patch && git commit -qam octets   # (its sha: MOK_AB_COMMIT)
#   git apply bench/pending/drop-fp32-scales.patch && git commit -qam drop   # (the tree's sha: MOK_COMMIT)
#   source scripts/setup.sh; ninja -C build mok_bench; mkdir -p .ab/combine/{octets,narrow}; cp build/bench/mok_bench .ab/combine/octets/
#   cmake -S . -B build-narrow -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_DIAG_DEFINES=MOK_DIAG_COMBINE_NARROW \
#     -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF && ninja -C build-narrow mok_bench && cp build-narrow/bench/mok_bench .ab/combine/narrow/
# (~5 min each on 2 cores; build the binaries from the octets commit or from the tree: drop-fp32-scales changes
# no combine code, only what the FP8 quantizations write). Then, from that branch's checkout, carrying .ab/combine:
#   MOK_COMMIT=<tree sha> MOK_AB_COMMIT=<binaries' sha> bash bench/pending/combine-octets-ab.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
: "${MOK_COMMIT:?set MOK_COMMIT to the sha of the checked-out tree}" "${MOK_AB_COMMIT:?set MOK_AB_COMMIT to the sha the binaries were built from}"
R=${OUT:?}; A=$R/ab; mkdir -p "$A" "$R/gc"
B=.ab/combine/narrow/mok_bench; H=.ab/combine/octets/mok_bench
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); D=$(date -u +%FT%TZ); echo "$G"
M="{\"gpu\": \"$G\", \"commit\": \"$MOK_AB_COMMIT\", \"base\": \"MOK_DIAG_COMBINE_NARROW\", \"head\": \"default\", \"date\": \"$D\"}"
ab=${AB_SECONDS:-60}
timeout "$ab" python3 bench/ab_serve.py --base $B --head $H --impls mok,mok --preset deepseek-v3,qwen3-30b-a3b,olmoe-1b-7b \
  --pass fwd --rounds 4 --iters 10 --out "$A/ab-bf16.json" --meta "$M" > "$A/ab-bf16.txt" 2>&1; tail -6 "$A/ab-bf16.txt"
timeout "$ab" python3 bench/ab_serve.py --base $B --head $H --impls mok-fp8,mok-fp8 --preset deepseek-v3,qwen3-30b-a3b,olmoe-1b-7b \
  --pass fwd --rounds 4 --iters 10 --out "$A/ab-fp8.json" --meta "$M" > "$A/ab-fp8.txt" 2>&1; tail -6 "$A/ab-fp8.txt"
tar -C "$R" -czf "$R/ab.tgz" ab && rm -rf "$A"
OUT=$R/gc timeout "${CTEST_SECONDS:-200}" scripts/gpu_check.sh --part ctest > "$R/gc/ctest.txt" 2>&1; echo "gpu_check rc=$?"
tail -8 "$R/gc/ctest.txt"
tar -C "$R" -czf "$R/gc.tgz" gc && rm -rf "$R/gc"; ls "$R"
