#!/usr/bin/env python3
"""One pass of a Python implementation inside the NVTX range `measure`, for Nsight Compute to
count what every kernel of that pass moves (scripts/ncu_layer.sh runs it under ncu and sums):
the DRAM bytes of the compiled PyTorch layer's many kernels beside the fused layer's one or two
(bench/NOTES.md: the fused backward's DRAM bytes, and PyTorch's clock at the same power).

  ncu_layer.py [--preset mixtral-8x7b] [--impl torch-compiled|torch|mok-py|mok-fp8-py] [--pass fwd|fwd+bwd]
               [--warmup 3]
  ncu_layer.py --summarize NCU.csv     (ncu's --csv rows of such a run: kernels, DRAM bytes, time,
                                        then a line per kernel name, the longest first)

mok-fp8-py: mok.moe(..., precision="fp8") with the weights quantized once (bench/mok_impls.MokPy:
the FP8 dgrad where it pays, the FP8 weight gradients as the Python default), so the FP8 step's
kernels (quantizations, passes, GEMM kernels) show per kernel name, the launches of one name summed.

Nothing is timed or checked here (layer_bench does both on the same inputs).
"""
import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

IMPLS = ("torch-compiled", "torch", "mok-py", "mok-fp8-py")
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")


def _metric_rows(lines):
    """(kernel launch ID, kernel name, metric, value) of ncu's --csv --print-units base output
    (other lines, e.g. ==PROF==, skipped) for METRICS."""
    rows = [r for r in csv.reader(lines) if len(r) > 3]
    head = next((i for i, r in enumerate(rows) if "Metric Name" in r), None)
    if head is None:
        raise ValueError("no ncu metric rows")
    cols = rows[head]
    ident, name, metric, value = (cols.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Value"))
    return [(r[ident], r[name], r[metric], float(r[value].replace(",", ""))) for r in rows[head + 1:]
            if len(r) == len(cols) and r[metric] in METRICS]


def _sums(entries):
    total = dict.fromkeys(METRICS, 0.0)
    for _, _, metric, value in entries:
        total[metric] += value
    return {"kernels": len({e[0] for e in entries}), "read_gb": total[METRICS[0]] / 1e9,
            "written_gb": total[METRICS[1]] / 1e9, "ms": total[METRICS[2]] / 1e6}


def summarize(lines):
    """The number of kernels of an ncu --csv log and the sums of METRICS over them, as
    {"kernels", "read_gb", "written_gb", "ms"}."""
    return _sums(_metric_rows(lines))


def kernel_name(full):
    """A kernel's name without its return type, parameter list, template arguments and anonymous
    namespaces: 'void ns::(anonymous namespace)::k<4>(P)' -> 'ns::k'. ncu writes some anonymous
    namespaces as '<unnamed>', or cut to 'unnamed>' at the start of the name (mok_bench's kernels)."""
    s = full.strip()
    for anonymous in ("(anonymous namespace)::", "<unnamed>::"):
        s = s.replace(anonymous, "")
    if s.startswith("unnamed>::"):
        s = s[len("unnamed>::"):]
    if s.endswith(")"):  # (the parameter list: the balanced parentheses at the end)
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i]
                break
    kept, depth = [], 0
    for ch in s:  # (template arguments, nested ones too)
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if depth == 0 and ch != ">":
            kept.append(ch)
    s = "".join(kept).strip()
    return s[5:] if s.startswith("void ") else s


def by_kernel(lines):
    """summarize's sums per kernel name (kernel_name: the launches of one kernel together), the
    longest total time first: [(name, sums)]."""
    groups = {}
    for entry in _metric_rows(lines):
        groups.setdefault(kernel_name(entry[1]), []).append(entry)
    return sorted(((k, _sums(v)) for k, v in groups.items()), key=lambda kv: -kv[1]["ms"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mixtral-8x7b")
    ap.add_argument("--impl", default="torch-compiled", choices=IMPLS)
    ap.add_argument("--pass", dest="pass_", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--summarize", default="", help="print the sums of an ncu --csv log instead")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            lines = f.readlines()
        t = summarize(lines)
        print(f"{t['kernels']} kernels, DRAM {t['read_gb']:.2f} GB read, {t['written_gb']:.2f} GB written, "
              f"{t['ms']:.3f} ms of kernels")
        for name, k in by_kernel(lines):
            gbps = (k["read_gb"] + k["written_gb"]) / (k["ms"] / 1e3) if k["ms"] > 0 else 0.0
            print(f"  {k['ms']:8.3f} ms {100 * k['ms'] / t['ms'] if t['ms'] else 0:5.1f} %  {k['kernels']:3d}x  "
                  f"{k['read_gb']:6.2f} GB read {k['written_gb']:6.2f} GB written {gbps:7.0f} GB/s  {name}")
        return
    import torch
    import torch_baseline as tb

    presets = tb.load_presets()
    if args.preset not in presets:
        sys.exit(f"ncu_layer: unknown preset '{args.preset}'; known: {', '.join(presets)}")
    tb.configure_compile()
    d = tb.make_inputs(presets[args.preset], "uniform", seed=args.seed)
    if args.impl in ("mok-py", "mok-fp8-py"):
        from mok_impls import MokPy
        impl = MokPy(d, precision="fp8" if args.impl == "mok-fp8-py" else "bf16")
    else:
        impl = tb.TorchImpl(d, tb.compiled_layer() if args.impl == "torch-compiled" else tb.moe_eager)
    fn, before = impl.step(args.pass_)
    for _ in range(max(args.warmup, 1)):  # (compiles, workspaces)
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    if before is not None:
        before()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measure")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"ncu_layer: {args.preset} {args.impl} {args.pass_}: one pass inside the NVTX range 'measure'")


if __name__ == "__main__":
    main()
