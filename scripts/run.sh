#!/usr/bin/env bash
# The main job: builds MoK and runs one preset, checked (default: small).
#   scripts/run.sh [--preset NAME]
# Without a GPU it runs the CPU reference and says so; on a Hopper GPU it also runs the
# GPU parts that exist.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
build="${MOK_BUILD_DIR:-build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target mok_demo
"$build/mok_demo" "$@"
