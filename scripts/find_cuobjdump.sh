# find_cuobjdump: prints a cuobjdump to use — $CUOBJDUMP, the CUDA toolkit's on PATH, or the copy
# in PyTorch's triton wheel (.venv's or the system Python's); fails if none. Sourced by
# sass_diff.sh and mma_sites.sh.
find_cuobjdump() {
  local c="${CUOBJDUMP:-$(command -v cuobjdump || true)}" py
  if [ -z "$c" ]; then
    for py in .venv/bin/python python3; do
      c="$($py -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))' 2>/dev/null || true)"
      [ -x "$c" ] && break
    done
  fi
  [ -n "$c" ] && [ -x "$c" ] && echo "$c"
}
