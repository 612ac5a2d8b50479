#!/usr/bin/env python3
"""Where the host time of one mok.moe call goes: cProfile of N forward (no autograd) and N
forward+backward calls on one preset, printed by cumulative time, and the median host time
to enqueue each (the GPU is synchronised between calls, so nothing else is queued); then
what the GPU waits for: the pass timed as layer_bench times it (L2 flush, events around the
call) and again with the GPU kept busy while the host enqueues (a spin kernel between the
flush and the start event), where the host time before the first launch goes (Python, then
the extension) and how long the GPU idles for it, and the pass's kernels by GPU time
(torch.profiler).

  host_overhead.py [--preset qwen3-30b-a3b] [--calls 50] [--top 25]
"""
import argparse
import contextlib
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


def events_and_kernels(fn, before, iters, warmup=3, queued=False, per_kernel=None):
    """Median event time of one pass (tb.time_ms: L2 flush, events around the call; queued: its
    iterations enqueued before the first is waited for) and the median over iterations of the
    summed durations of the layer's own kernels (names with 'mok', from torch.profiler) in the
    same run: their difference is GPU time spent on nothing (waiting for the host, or between
    launches); a change in the kernels' sum is the kernels' speed. per_kernel (a dict): filled
    with each such kernel's median duration (ms) per pass, by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        times = tb.time_ms(fn, warmup, iters, before=before, queued=queued)
    cuda = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    sums, names = [], []  # a pass: the layer's kernels after a flush (or spin) kernel, the first work of an iteration
    for start, end, name in cuda:
        if "mok" in name:
            if sums:
                sums[-1] += (end - start) / 1e3
                names[-1][name] = names[-1].get(name, 0.0) + (end - start) / 1e3
        elif end - start > 20:  # (µs) the 256 MB flush or the spin; not the layer's counter memsets
            if not sums or sums[-1] > 0:
                sums.append(0.0)
                names.append({})
        elif names:  # (not summed: another kernel or memset inside the pass)
            names[-1]["(other) " + name] = names[-1].get("(other) " + name, 0.0) + (end - start) / 1e3
    if per_kernel is not None:
        for n in dict.fromkeys(k for pass_ in names for k in pass_):
            per_kernel[n] = statistics.median(pass_.get(n, 0.0) for pass_ in names if pass_)
    return statistics.median(times), statistics.median(sums)  # (the warm-up runs before the first flush)


@contextlib.contextmanager
def wrapped_extension(wrap):
    """mok.ops._C replaced, for the block, by a proxy whose entry points (forward_rows, the eager
    forward's first enqueue; forward; backward) are wrap(the extension's own) and whose other
    attributes are the extension's. (The FP8 layer calls the extension from mok.fp8_layer: not marked.)"""
    import mok.ops as ops

    real = ops._C

    class Wrapped:
        forward_rows = staticmethod(wrap(real.forward_rows))
        forward = staticmethod(wrap(real.forward))
        backward = staticmethod(wrap(real.backward))

        def __getattr__(self, name):
            return getattr(real, name)

    ops._C = Wrapped()
    try:
        yield
    finally:
        ops._C = real


def first_launch(fn, before, calls):
    """Where the host time before the pass's first launch goes, from one torch.profiler trace
    (CPU and CUDA activity, one clock): per call, the Python prelude (the call's start to the
    extension's entry, marked by wrapping mok.ops._C's entry points), the extension's work up
    to its first launch (cudaLaunch* or cudaMemsetAsync), and on the GPU the idle time from the
    flush's end to the layer's first kernel and between the layer's kernels (the largest gap
    named by the kernels around it). Medians in µs."""
    def marked(entry):  # the extension's entry points marked in the trace
        def call(*a, **k):
            with torch.profiler.record_function("mok_C"):
                return entry(*a, **k)
        return call

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    with wrapped_extension(marked):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                if before:
                    before()
                flush.zero_()
                with torch.profiler.record_function("mok_call"):
                    fn()
                torch.cuda.synchronize()
    ev = sorted(prof.events(), key=lambda e: e.time_range.start)
    span = lambda e: (e.name, e.time_range.start, e.time_range.end)  # noqa: E731
    return pass_timeline([span(e) for e in ev if e.device_type == torch.autograd.DeviceType.CPU],
                         [span(e) for e in ev if e.device_type == torch.autograd.DeviceType.CUDA])


def pass_timeline(cpu, gpu, long_us=20.0):
    """first_launch's arithmetic on (name, start, end) spans in µs, each list sorted by start:
    CPU spans hold the calls ("mok_call"), the extension's entries ("mok_C") and the CUDA
    runtime calls; GPU spans the kernels, the layer's named with "mok", a flush being any other
    kernel longer than long_us. Returns the medians of (Python before the extension, the
    extension before its first launch, the GPU's idle time from a flush to the layer's first
    kernel, its idle time between the layer's kernels up to the next flush) and the median
    pass's largest gap between two layer kernels as (µs, kernel before, kernel after)."""
    flushes = [g for g in gpu if "mok" not in g[0] and g[2] - g[1] > long_us]
    first_idle, inner, largest = [], [], []
    for i, (_, _, f_end) in enumerate(flushes):
        nxt = flushes[i + 1][1] if i + 1 < len(flushes) else float("inf")
        ks = [g for g in gpu if "mok" in g[0] and f_end <= g[1] < nxt]
        if not ks:
            continue
        first_idle.append(ks[0][1] - f_end)
        gaps = [(b[1] - a[2], a[0], b[0]) for a, b in zip(ks, ks[1:])]
        inner.append(sum(max(0.0, g[0]) for g in gaps))
        if gaps:
            largest.append(max(gaps))
    py, cxx = [], []
    for _, t0, t1 in (c for c in cpu if c[0] == "mok_call"):
        entry = next((c[1] for c in cpu if c[0] == "mok_C" and t0 <= c[1] <= t1), None)
        launch = next((c[1] for c in cpu if t0 <= c[1] <= t1 and (c[0].startswith("cudaLaunch") or c[0] == "cudaMemsetAsync")),
                      None)
        if entry is not None and launch is not None:
            py.append(entry - t0)
            cxx.append(launch - entry)
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    big = sorted(largest)[len(largest) // 2] if largest else (float("nan"), "", "")
    return med(py), med(cxx), med(first_idle), med(inner), big


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
        for mode, pre in (("as layer_bench times it", before),
                          ("behind a 4M-cycle spin kernel", lambda: (before and before(), torch.cuda._sleep(4_000_000)))):
            ev, kern = events_and_kernels(fn, pre, args.calls)
            print(f"GPU time {mode}: events {ev:.3f} ms, the pass's kernels {kern:.3f} ms (medians; the rest: "
                  f"idle waiting for the host, or the flush's tail)")
        py, cxx, idle, inner, big = first_launch(fn, before, args.calls)
        print(f"Before the first launch (medians): Python {py:.1f} us, then the extension {cxx:.1f} us; the GPU idle "
              f"from the flush's end to the layer's first kernel {idle:.1f} us, between the layer's kernels {inner:.1f} "
              f"us (the median call's largest gap {big[0]:.1f} us, after {big[1][:60]!r}, before {big[2][:60]!r})")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as kprof:
            for _ in range(5):
                if before:
                    before()
                fn()
            torch.cuda.synchronize()
        print(kprof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
