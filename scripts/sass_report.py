#!/usr/bin/env python3
"""What a kernel's machine code looks like, without a GPU: compiles one kernel source for sm_90a
(the library's flags, -lineinfo) and prints, per kernel, ptxas's registers and spills, the SASS
instruction count, the source files and lines that own the most instructions and branches
(BSSY: a divergent branch's reconvergence point), and the live registers (nvdisasm's register
life ranges): the peak and the source line it is at, and with --live REGEX the range at the
instructions that match (e.g. the combine's slot loads, 'LDG.E.EF').

  python3 scripts/sass_report.py src/kernels/forward/forward.cu [--kernel REGEX] [--live REGEX]
                                 [--top N] [-D NAME ...]

Found this way (bench/NOTES.md, 2026-12-03): __frcp_rn's slow path as most of the SwiGLU
epilogues' code, and an undefined accumulator keeping ~190 registers live through the combine.
Needs nvcc and nvdisasm (the CUDA toolkit's, $NVDISASM, or `pip install nvidia-cuda-nvdisasm`).
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_nvdisasm():
    candidates = [os.environ.get("NVDISASM", ""), shutil.which("nvdisasm") or "", "/usr/local/cuda/bin/nvdisasm"]
    for venv in (".venv-tools", ".venv"):  # pip's nvidia-cuda-nvdisasm wheel
        candidates += glob.glob(os.path.join(ROOT, venv, "lib", "python3*", "site-packages", "nvidia", "cu*", "bin", "nvdisasm"))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("sass_report: no nvdisasm (install the CUDA toolkit's, set NVDISASM, or pip install nvidia-cuda-nvdisasm)")


def compile_cubin(source, defines, out):
    includes = ["-I", os.path.join(ROOT, "include"), "-I", os.path.join(ROOT, "src")]
    generated = os.path.join(ROOT, "build", "generated")
    if os.path.isdir(generated):
        includes += ["-I", generated]
    cmd = ["nvcc", *includes, "-O3", "-std=c++20", "-gencode", "arch=compute_90a,code=sm_90a",
           "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas=-v", "-cubin", *[f"-D{d}" for d in defines],
           "-o", out, source]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"sass_report: nvcc failed:\n{run.stderr[-3000:]}")
    return run.stderr  # ptxas -v reports


def ptxas_by_kernel(report):
    out, name = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name and ("spill" in line or "Used" in line):
            out[name].append(line.split(":", 1)[-1].strip())
            if "Used" in line:  # (what follows is about the functions it calls)
                name = None
    return out


def sections(text):
    """{section name: its lines} from nvdisasm output, one list per .text section."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.([^,\s]+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        if name:
            out[name].append(line)
    return out


def instructions(lines, with_lines):
    """[(address, instruction, source file:line or None, live registers or None)]."""
    rows, where = [], None
    for line in lines:
        m = re.search(r'//## File "(?:.*/)?([^"]+)", line (\d+)', line)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if not m:
            continue
        live = re.search(r"//\s*\|\s*(\d+)", line)
        rows.append((int(m.group(1), 16), m.group(2), where if with_lines else None, int(live.group(1)) if live else None))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name matches this regex")
    ap.add_argument("--live", default="", help="report live registers at instructions matching this regex")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro for nvcc (e.g. a MOK_DIAG_ variant)")
    args = ap.parse_args()
    nvdisasm = find_nvdisasm()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        ptxas = ptxas_by_kernel(compile_cubin(args.source, args.defines, cubin))
        listing = subprocess.run([nvdisasm, "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
        lives = subprocess.run([nvdisasm, "-lrm", "count", "-c", cubin], capture_output=True, text=True, check=True).stdout
    with_lines, with_live = sections(listing), sections(lives)
    for name, lines in with_lines.items():
        if args.kernel and not re.search(args.kernel, name):
            continue
        if name not in ptxas:  # a called device function, not a kernel
            continue
        rows = instructions(lines, True)
        live = {a: n for a, _, _, n in instructions(with_live.get(name, []), False) if n is not None}
        print(f"== {name}")
        for line in ptxas[name]:
            print(f"   ptxas: {line}")
        files = collections.Counter((w or "?").split(":")[0] for _, _, w, _ in rows)
        branches = collections.Counter(w or "?" for _, ins, w, _ in rows if ins.startswith("BSSY"))
        print(f"   {len(rows)} instructions; by file: " + ", ".join(f"{f} {n}" for f, n in files.most_common(args.top)))
        print(f"   BSSY {sum(branches.values())}; by line: " + ", ".join(f"{w} {n}" for w, n in branches.most_common(args.top)))
        if live:
            peak = max(live.values())
            at = collections.Counter(w or "?" for a, _, w, _ in rows if live.get(a) == peak)
            print(f"   live registers: peak {peak} at " + ", ".join(f"{w} ({n})" for w, n in at.most_common(3)))
            if args.live:
                hits = [live[a] for a, ins, _, _ in rows if re.search(args.live, ins) and a in live]
                if hits:
                    print(f"   live at /{args.live}/: {min(hits)}-{max(hits)} over {len(hits)} instructions")
                else:
                    print(f"   no instruction matches /{args.live}/")


if __name__ == "__main__":
    main()
