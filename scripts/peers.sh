#!/usr/bin/env bash
# The benchmark's peers that are not the library's dependencies, into .peers/ (git-ignored):
# Liger-Kernel's pure-Python wheel (its Triton fused MoE: layer_bench --impl liger,
# bench/liger_peer.py), unpacked so that a device call can carry the folder (`carry: [".peers"]`)
# to a machine without network; bench/liger_peer.py puts .peers on sys.path. Needs pip and
# network here; nothing is built.
#   scripts/peers.sh            then e.g. scripts/gpu_check.sh --part bench --impl mok,torch-compiled,liger
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
wheel=liger-kernel==0.8.5  # (bench/liger_peer.py's WHEEL)
rm -rf .peers
mkdir -p .peers/wheels
"$py" -m pip download -q --no-deps --only-binary=:all: -d .peers/wheels "$wheel"
for w in .peers/wheels/*.whl; do "$py" -m zipfile -e "$w" .peers/; done
rm -rf .peers/wheels
# Liger's recorded Triton tuning results (gpu_check.sh's liger_cache; one archive a GPU model, the
# newest record's), so a device call need not tune again what an earlier one did.
for t in $(ls bench/results/experiments/*-liger/liger-autotune-*.tgz 2>/dev/null | sort); do cp "$t" .peers/; done
echo "peers.sh: $wheel in .peers/ ($(du -sh .peers | cut -f1)); tuning results: $(cd .peers && ls liger-autotune-*.tgz 2>/dev/null | tr '\n' ' ')"
