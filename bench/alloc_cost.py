#!/usr/bin/env python3
"""The host cost of the PyTorch calls mok.moe's eager path makes before its first launch
(issue 21), each timed alone in a loop while the GPU is busy (a long spin kernel enqueued
first, as in a training step or after layer_bench's L2 flush), medians in µs: the output
and scratch allocations (several spellings, and the raw caching-allocator entry), a DLPack
capsule, the current stream, and for reference mok.moe's whole evaluation forward. Then the
same after one torch.profiler session (does the profiler leave the CUDA calls slower?).

  alloc_cost.py [--preset qwen3-30b-a3b] [--calls 400]
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils.dlpack import to_dlpack

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_baseline as tb  # noqa: E402


def busy_median_us(fn, calls):
    """fn's host time, the GPU kept busy: a spin kernel of ~50 ms is enqueued every 100 calls."""
    for _ in range(5):
        fn()
    ts = []
    for i in range(calls):
        if i % 100 == 0:
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def pieces(d, calls):
    import mok
    from mok import ops

    x, dev = d["x"], d["x"].device
    idx = x.get_device()
    n = 1 << 30
    raw_alloc = torch.cuda.caching_allocator_alloc
    raw_free = torch.cuda.caching_allocator_delete
    stream = torch.cuda.current_stream().cuda_stream

    def raw():
        raw_free(raw_alloc(n, idx, stream))

    def moe():
        with torch.no_grad():
            mok.moe(d["x"], d["ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"], shared=d["shared"],
                    swiglu_limit=d["limit"])

    ws = ops._workspace(x, d["w_down"], d["ids"].shape[1], 0 if d["shared"] is None else d["shared"][0].shape[0],
                        d["limit"])
    out = {
        "empty_like(x)": lambda: torch.empty_like(x),
        "empty(n, uint8, device=torch.device)": lambda: torch.empty(n, dtype=torch.uint8, device=dev),
        "empty(n, uint8, device=int)": lambda: torch.empty(n, dtype=torch.uint8, device=idx),
        "x.new_empty(n, uint8)": lambda: x.new_empty(n, dtype=torch.uint8),
        "caching_allocator alloc+delete": raw,
        "to_dlpack(x)": lambda: to_dlpack(x),
        "_stream(x)": lambda: ops._stream(x),
        "_workspace(...)": lambda: ops._workspace(x, d["w_down"], d["ids"].shape[1], 0, d["limit"]),
        "ws.forward_scratch_bytes(T)": lambda: ws.forward_scratch_bytes(x.shape[0]),
        "torch.is_grad_enabled()": torch.is_grad_enabled,
        "mok.moe eval (whole)": moe,
    }
    return {name: busy_median_us(fn, calls) for name, fn in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    d = tb.make_inputs(tb.load_presets()[args.preset], "uniform", seed=1)
    before = pieces(d, args.calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        torch.empty_like(d["x"])
        torch.cuda.synchronize()
    after = pieces(d, args.calls)
    print(f"\nhost µs per call, GPU busy ({args.preset}, {args.calls} calls, medians)")
    print(f"{'piece':40s} {'before':>8s} {'after profiler':>15s}")
    for name in before:
        print(f"{name:40s} {before[name]:8.2f} {after[name]:15.2f}")


if __name__ == "__main__":
    main()
