#!/usr/bin/env python3
"""Where the host time of one mok.moe call goes: cProfile of N forward (no autograd) and N
forward+backward calls on one preset, printed by cumulative time, and the median host time
to enqueue each (the GPU is synchronised between calls, so nothing else is queued); then
what the GPU waits for: the pass timed as layer_bench times it (L2 flush, events around the
call) and again with the GPU kept busy while the host enqueues (a spin kernel between the
flush and the start event), and the pass's kernels by GPU time (torch.profiler).

  host_overhead.py [--preset qwen3-30b-a3b] [--calls 50] [--top 25]
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_baseline as tb  # noqa: E402
from layer_bench import MokPy  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    p = tb.load_presets()[args.preset]
    d = tb.make_inputs(p, "uniform", seed=1)
    m = MokPy(d)
    for ps in tb.PASSES:
        fn, before = m.step(ps)
        for _ in range(3):  # warm-up: workspace, allocator, autograd
            if before:
                before()
            fn()
        torch.cuda.synchronize()
        plain = []
        for _ in range(args.calls):
            if before:
                before()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            plain.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        host, prof = [], cProfile.Profile()
        for _ in range(args.calls):
            if before:
                before()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prof.enable()
            fn()
            prof.disable()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        print(f"\n== {args.preset} {ps}: host time to enqueue, median {statistics.median(plain):.3f} ms "
              f"(min {min(plain):.3f}); with the profiler on {statistics.median(host):.3f} ms")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
        idle = tb.time_ms(fn, 3, args.calls, before=before)
        busy = tb.time_ms(fn, 3, args.calls, before=lambda: (before and before(), torch.cuda._sleep(4_000_000)))
        print(f"GPU time, median: {statistics.median(idle):.3f} ms as layer_bench times it, "
              f"{statistics.median(busy):.3f} ms with the host ahead (the GPU waited "
              f"{statistics.median(idle) - statistics.median(busy):.3f} ms for the host)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as kprof:
            for _ in range(5):
                if before:
                    before()
                fn()
            torch.cuda.synchronize()
        print(kprof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
