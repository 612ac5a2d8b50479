#!/usr/bin/env python3
"""One pass of a Python implementation inside the NVTX range `measure`, for Nsight Compute to
count what every kernel of that pass moves (scripts/ncu_layer.sh runs it under ncu and sums):
the DRAM bytes of the compiled PyTorch layer's many kernels beside the fused layer's one or two
(bench/NOTES.md: the fused backward's DRAM bytes, and PyTorch's clock at the same power).

  ncu_layer.py [--preset mixtral-8x7b] [--impl torch-compiled|torch|mok-py] [--pass fwd|fwd+bwd]
               [--warmup 3]

Nothing is timed or checked here (layer_bench does both on the same inputs).
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_baseline as tb  # noqa: E402

IMPLS = ("torch-compiled", "torch", "mok-py")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mixtral-8x7b")
    ap.add_argument("--impl", default="torch-compiled", choices=IMPLS)
    ap.add_argument("--pass", dest="pass_", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
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
