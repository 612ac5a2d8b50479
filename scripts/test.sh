#!/usr/bin/env bash
# The test command: installs what the build needs, builds everything (CUDA sources
# included) and runs every test: the C++ suite (ctest), then the Python package
# (pip install . into .venv, pytest). GPU tests run on a Hopper GPU and are reported as
# skipped elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
build="${MOK_BUILD_DIR:-build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"

# Python: a virtual environment with PyTorch and the build tools, then the package. With
# MOK_TEST_PINNED_TORCH=1 (CI) the tests run a second time against the pinned PyTorch of
# scripts/torch-pinned.txt, in .venv-pinned.
command -v readelf >/dev/null 2>&1 || apt_install binutils
python_tests() {  # $1: virtual environment, $2: optional pip constraints file
  local venv="$1" constraints=()
  [ -n "${2:-}" ] && constraints=(-c "$2")
  if [ ! -x "$venv/bin/python" ]; then
    python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || apt_install python3-venv
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "${constraints[@]}" "torch>=2.6" numpy pytest tqdm "transformers>=5" accelerate "nanobind>=2.0" \
    "scikit-build-core>=0.10" "cmake>=3.28" ninja
  "$venv/bin/pip" install -q --no-build-isolation --no-deps .
  echo "test.sh: Python tests with PyTorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')" \
       "in $venv${2:+ (pinned by $2)}"
  "$venv/bin/python" -m pytest -q tests/python
}
python_tests "${MOK_VENV:-.venv}"
if [ "${MOK_TEST_PINNED_TORCH:-0}" = 1 ]; then
  # (MOK_TEST_DROP_VENV=1, CI: the first environment removed before the second is made — each
  # holds PyTorch with its CUDA wheels, ~5.7 GB)
  if [ "${MOK_TEST_DROP_VENV:-0}" = 1 ]; then rm -rf "${MOK_VENV:-.venv}"; fi
  python_tests "${MOK_VENV_PINNED:-.venv-pinned}" scripts/torch-pinned.txt
fi
