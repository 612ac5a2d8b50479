#!/usr/bin/env python3
"""The host time of mok.moe's eager path, piece by piece (issue 21): each piece of the
prelude before the layer's first launch timed alone, N times with the GPU synchronised
between calls, medians in µs. What it separates: the Python argument checks, the output
and saved-tensor allocations, the DLPack capsules, the workspace lookup, the extension's
call (C++ checks, tensor maps, launches), autograd.Function.apply's own cost (with 12
arguments, against the C entry it wraps), and the whole eval and training forwards.

  host_sections.py [--preset qwen3-30b-a3b] [--calls 200]
"""
import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_baseline as tb  # noqa: E402


def median_us(fn, calls, sync=True):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(calls):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


class _Nothing(torch.autograd.Function):
    """A Function whose forward does nothing but return its first input's view: the autograd
    bookkeeping of one apply with this many arguments."""

    @staticmethod
    def forward(ctx, *inputs):
        return inputs[0].view_as(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return (g,) + (None,) * 11


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    import mok
    import mok.ops as ops
    from torch.utils.dlpack import to_dlpack

    p = tb.load_presets()[args.preset]
    d = tb.make_inputs(p, "uniform", seed=1)
    x, ids, w, wg, wu, wd, lim = d["x"], d["ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"], d["limit"]
    shared = d["shared"]
    sg, su, sd = shared if shared is not None else (None, None, None)
    for t in (x, w, wg, wu, wd):
        t.requires_grad_()
    E, k, T = wg.shape[0], ids.shape[1], x.shape[0]
    Is = 0 if sg is None else sg.shape[0]
    ws = ops._workspace(x, wd, k, Is, lim)
    n_saved = ops._saved_elements(x, wd, k, sg, lim, E)
    rows = []

    def row(name, us):
        rows.append((name, us))
        print(f"  {name:<58} {us:8.1f} us", flush=True)

    print(f"== {args.preset}: host time of mok.moe's pieces (medians of {args.calls}, GPU synchronised between calls)")
    with torch.no_grad():
        row("mok.moe, eval forward (whole call)", median_us(lambda: mok.moe(x, ids, w, wg, wu, wd, shared, lim), args.calls))
    row("mok.moe, training forward (whole call; graph dropped)",
        median_us(lambda: mok.moe(x, ids, w, wg, wu, wd, shared, lim), args.calls))

    def train_and_backward():
        mok.moe(x, ids, w, wg, wu, wd, shared, lim).backward(d["dy"])
        for t in (x, w, wg, wu, wd):
            t.grad = None
    row("mok.moe, training forward + backward (whole pass)", median_us(train_and_backward, max(20, args.calls // 5)))
    row("  training forward's body without autograd (ops._run_forward)", median_us(
        lambda: ops._run_forward(x, ids, w, wg, wu, wd, sg, su, sd, lim, E, ops.ONE_GPU, training=True), args.calls))
    row("  Python checks (ops._check)", median_us(
        lambda: ops._check(x, ids, w, wg, wu, wd, sg, su, sd, lim, E, ops.ONE_GPU), args.calls))
    row("  torch.empty_like(x) (y)", median_us(lambda: torch.empty_like(x), args.calls))
    row("  torch.empty(saved)", median_us(lambda: torch.empty(n_saved, dtype=torch.bfloat16, device=x.device), args.calls))
    row("  ops._saved_elements", median_us(lambda: ops._saved_elements(x, wd, k, sg, lim, E), args.calls))
    row("  scratch (torch.empty of forward_scratch_bytes)",
        median_us(lambda: ops._scratch(ws.forward_scratch_bytes(T), x.device), args.calls))
    row("  11 DLPack capsules", median_us(lambda: ops._capsules((x, ids, w, wg, wu, wd, sg, su, sd, x, None)), args.calls))
    row("  workspace lookup (ops._workspace)", median_us(lambda: ops._workspace(x, wd, k, Is, lim), args.calls))
    row("  current stream (ops._stream)", median_us(lambda: ops._stream(x), args.calls))
    y = torch.empty_like(x)
    scratch = ops._scratch(ws.forward_scratch_bytes(T), x.device)

    def extension():
        tensors = (*ops._capsules((x, ids, w, wg, wu, wd, sg, su, sd, y, None)), ops._stream(x))
        ops._C.forward(ws, *tensors, scratch=to_dlpack(scratch))
    row("  capsules + the extension's forward (C++ checks, maps, launches)", median_us(extension, args.calls))
    row("  backward's gradient allocations (ops._empty_grads)",
        median_us(lambda: ops._empty_grads(x, w, wg, wu, wd, sg, su, sd, paired=True), args.calls))
    nothing_args = (x, ids, w, wg, wu, wd, sg, su, sd, lim, E, 0)
    row("  autograd.Function.apply, 12 arguments, empty forward", median_us(lambda: _Nothing.apply(*nothing_args), args.calls))
    c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Nothing)
    row("  its C entry (_FunctionBase.apply), same", median_us(lambda: c_apply(*nothing_args), args.calls))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
