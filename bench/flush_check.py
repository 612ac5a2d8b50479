#!/usr/bin/env python3
"""Does the L2 flush explain part of mok-py's gap to mok_bench (issue 21)? layer_bench flushes
with PyTorch's `zero_()` (a fill kernel; tb.FLUSH "zero"), mok_bench with `cudaMemsetAsync` of the byte i & 0xff:
the two leave the GPU a different head start before the pass and a different L2. This times
(1) each flush alone (CUDA events, medians), and (2) in alternating rounds, mok_bench against
the extension called directly (ready tensors, the workspace's own scratch) and against mok.moe,
each after either flush: if the memset flush moves the in-process ratios to ~1, the harness,
not the binding, made that part of the gap.

  flush_check.py --mok-bench build-gpu/bench/mok_bench [--preset mixtral-8x7b,olmoe-1b-7b] [--rounds 15]
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
from mok_impls import MokBench, MokPy  # noqa: E402
from py_vs_cpp import direct  # noqa: E402


def make_flushes():
    return {kind: tb.l2_flusher(kind) for kind in ("zero", "memset")}


def time_with(fn, flush, iters, warmup=2):
    return statistics.median(tb.time_ms(fn, warmup, iters, flush=flush))


def flush_alone(flush, iters=50):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        start.record()
        flush()
        stop.record()
        stop.synchronize()
        ts.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mok-bench", required=True)
    ap.add_argument("--preset", default="mixtral-8x7b,olmoe-1b-7b")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    flushes = make_flushes()
    print("flush alone (µs, median of 50): " + ", ".join(f"{n} {flush_alone(f):.1f}" for n, f in flushes.items()))
    presets = tb.load_presets()
    server = MokBench(args.mok_bench)
    t0 = time.time()
    try:
        for name in args.preset.split(","):
            d = tb.make_inputs(presets[name], "uniform", seed=1)
            py_fn, _ = MokPy(d).step("fwd")
            off_fn, _ = direct(d, False)
            server.load(name, 1, d)
            variants = [(f"{impl} after {fl}", fn, flushes[fl]) for fl in flushes
                        for impl, fn in (("direct-off", off_fn), ("mok-py", py_fn))]
            rounds = {"mok": []} | {v[0]: [] for v in variants}
            for r in range(args.rounds):
                order = ["mok"] + variants
                for item in (order if r % 2 == 0 else order[::-1]):
                    if item == "mok":
                        rounds["mok"].append(statistics.median(server.call("time", "fwd", 2, args.iters, "mok")["ms"]))
                    else:
                        label, fn, flush = item
                        rounds[label].append(time_with(fn, flush, args.iters))
            print(f"\n== {name} fwd, {args.rounds} rounds of {args.iters} ({time.time() - t0:.0f} s)")
            print(f"{'impl':28s} {'median ms':>10s} {'paired mok/impl':>16s}")
            for label, ms in rounds.items():
                paired = statistics.median(a / b for a, b in zip(rounds["mok"], ms))
                print(f"{label:28s} {statistics.median(ms):10.3f} {paired:16.3f}", flush=True)
            torch.cuda.empty_cache()
    finally:
        server.close()


if __name__ == "__main__":
    main()
