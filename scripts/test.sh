#!/usr/bin/env bash
# The test command: installs what the build needs, builds everything (CUDA sources
# included) and runs every test. GPU tests run on a Hopper GPU and are reported as
# skipped elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
build="${MOK_BUILD_DIR:-build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)" "$@"
