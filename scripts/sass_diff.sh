#!/usr/bin/env bash
# Whether a change leaves the kernels' machine code as it was: builds the library's kernels
# at BASE (a git worktree) and in the working tree, disassembles each kernel object with
# cuobjdump -sass, and says per object "identical" or how many SASS lines differ (addresses and names of
# anonymous namespaces normalised). A refactor whose SASS is identical is proven neutral in
# speed and results without a GPU; one that differs needs the GPU check.
#   scripts/sass_diff.sh [BASE=HEAD]      (needs nvcc; cuobjdump from the CUDA toolkit, or
#                                          the copy in PyTorch's triton wheel, or $CUOBJDUMP)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh  # (CMake >= 3.28: the system's may be older)
base="${1:-HEAD}"
source scripts/find_cuobjdump.sh
cuobjdump="$(find_cuobjdump)" || { echo "sass_diff.sh: no cuobjdump (install the CUDA toolkit's, or set CUOBJDUMP)"; exit 2; }
work="$(mktemp -d)"
trap 'git worktree remove --force "$work/base-src" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -q --detach "$work/base-src" "$base"
build() {  # $1: source tree, $2: build dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_TESTS=OFF -DMOK_BUILD_PYTHON=OFF > "$2.cfg.log" 2>&1
  cmake --build "$2" --target mok -j"$(nproc)" > "$2.log" 2>&1 || { tail -30 "$2.log"; exit 1; }
}
sass() {  # $1: build dir, $2: out dir
  mkdir -p "$2"
  for o in "$1"/CMakeFiles/mok.dir/src/kernels/*.o "$1"/CMakeFiles/mok.dir/src/kernels/*/*.o; do  # (flat before 066317f)
    [ -f "$o" ] || continue
    "$cuobjdump" -sass "$o" | grep -v '^\s*$' | sed 's@/\*[0-9a-f]*\*/@@; s@_GLOBAL__N__[0-9a-f]*_@_GLOBAL__N__@; s@_cu_[0-9a-f]\{8\}@_cu_@' > "$2/$(basename "$o" .o).sass"
  done
}
echo "building $base and the working tree ..."
build "$work/base-src" "$work/base" && build "$PWD" "$work/head"
sass "$work/base" "$work/base-sass" && sass "$work/head" "$work/head-sass"
for f in "$work"/head-sass/*.sass; do
  b="$(basename "$f")"
  if [ ! -f "$work/base-sass/$b" ]; then echo "$b: new"
  elif cmp -s "$f" "$work/base-sass/$b"; then echo "$b: identical"
  else echo "$b: $(diff "$work/base-sass/$b" "$f" | grep -c '^[<>]') SASS lines differ"
  fi
done
