#!/usr/bin/env python3
"""One pass of a Python implementation inside the NVTX range `measure`, for Nsight Compute to
count what every kernel of that pass moves (scripts/ncu_layer.sh runs it under ncu and sums):
the DRAM bytes of the compiled PyTorch layer's many kernels beside the fused layer's one or two
(bench/NOTES.md: the fused backward's DRAM bytes, and PyTorch's clock at the same power).

  ncu_layer.py [--preset mixtral-8x7b] [--impl torch-compiled|torch|mok-py] [--pass fwd|fwd+bwd]
               [--warmup 3]
  ncu_layer.py --summarize NCU.csv     (ncu's --csv rows of such a run: kernels, DRAM bytes, time)

Nothing is timed or checked here (layer_bench does both on the same inputs).
"""
import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

IMPLS = ("torch-compiled", "torch", "mok-py")
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")


def summarize(lines):
    """ncu's --csv --print-units base output (other lines, e.g. ==PROF==, skipped): the number of
    kernels and the sums of METRICS over them, as {"kernels", "read_gb", "written_gb", "ms"}."""
    rows = [r for r in csv.reader(lines) if len(r) > 3]
    head = next((i for i, r in enumerate(rows) if "Metric Name" in r), None)
    if head is None:
        raise ValueError("no ncu metric rows")
    cols = rows[head]
    ident, metric, value = (cols.index(c) for c in ("ID", "Metric Name", "Metric Value"))
    kernels, total = set(), dict.fromkeys(METRICS, 0.0)
    for r in rows[head + 1:]:
        if len(r) == len(cols) and r[metric] in total:
            kernels.add(r[ident])
            total[r[metric]] += float(r[value].replace(",", ""))
    return {"kernels": len(kernels), "read_gb": total[METRICS[0]] / 1e9, "written_gb": total[METRICS[1]] / 1e9,
            "ms": total[METRICS[2]] / 1e6}


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
            t = summarize(f)
        print(f"{t['kernels']} kernels, DRAM {t['read_gb']:.2f} GB read, {t['written_gb']:.2f} GB written, "
              f"{t['ms']:.3f} ms of kernels")
        return
    import torch
    import torch_baseline as tb

    presets = tb.load_presets()
    if args.preset not in presets:
        sys.exit(f"ncu_layer: unknown preset '{args.preset}'; known: {', '.join(presets)}")
    tb.configure_compile()
    d = tb.make_inputs(presets[args.preset], "uniform", seed=args.seed)
    if args.impl == "mok-py":
        from mok_impls import MokPy
        impl = MokPy(d)
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
