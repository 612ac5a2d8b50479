# Sourced by the other scripts: makes sure the build tools are there, installing what is
# missing (Debian packages; CMake >= 3.28 from PyPI into .venv-tools). Needs the CUDA 13
# toolkit (nvcc) already installed: it does not come from Debian or PyPI.
set -euo pipefail

mok_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v nvcc >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  else
    echo "setup: nvcc not found: install the CUDA 13 toolkit first (nvcc 13.0 or newer)" >&2
    exit 1
  fi
fi
export CUDACXX="${CUDACXX:-$(command -v nvcc)}"

need_apt=()
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
[ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
apt_install() {
  echo "setup: installing $* (Debian packages)"
  local sudo=()
  [ "$(id -u)" = 0 ] || sudo=(sudo)
  { DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "$@" >/dev/null; } ||
    echo "setup: could not install $* with apt-get; the build may fail" >&2
}
[ ${#need_apt[@]} -eq 0 ] || apt_install "${need_apt[@]}"

cmake_ok() {  # is the first cmake on PATH at least 3.28?
  command -v cmake >/dev/null 2>&1 || return 1
  local v
  v=$(cmake --version | head -1 | sed 's/[^0-9.]*\([0-9.]*\).*/\1/')
  [ "$(printf '%s\n3.28\n' "$v" | sort -V | head -1)" = 3.28 ]
}
if ! cmake_ok; then
  if [ ! -x "$mok_root/.venv-tools/bin/cmake" ]; then
    echo "setup: installing CMake >= 3.28 from PyPI into .venv-tools"
    python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || apt_install python3-venv
    python3 -m venv "$mok_root/.venv-tools"
    "$mok_root/.venv-tools/bin/pip" install -q "cmake>=3.28,<5"
  fi
  export PATH="$mok_root/.venv-tools/bin:$PATH"
fi
# require_ncu NAME: prints Nsight Compute's ncu (on PATH, or where the CUDA toolkit or Nsight
# Compute installs it), or says on stderr that NAME found none and fails (the ncu_*.sh scripts:
# ncu_bin="$(require_ncu ncu_x.sh)" || exit 1).
require_ncu() {
  local bin
  bin="$({ command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1; } || true)"
  [ -n "$bin" ] || { echo "$1: no ncu (Nsight Compute) found" >&2; return 1; }
  echo "$bin"
}
# mok_bench_build DIR LOG [DEFINES]: DIR/bench/mok_bench (Release, no tests, examples or Python;
# MOK_DIAG_DEFINES=DEFINES) unless it exists, its output into LOG; on failure prints LOG's tail and
# returns non-zero (the ncu_*.sh scripts).
mok_bench_build() {
  [ -x "$1/bench/mok_bench" ] && return 0
  { cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_EXAMPLES=OFF \
      -DMOK_BUILD_PYTHON=OFF -DMOK_DIAG_DEFINES="${3:-}" &&
    cmake --build "$1" --target mok_bench -j"$(nproc)"; } > "$2" 2>&1 || { tail -30 "$2"; return 1; }
}
echo "setup: $(cmake --version | head -1), nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), $(g++ --version | head -1)"
