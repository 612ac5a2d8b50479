#!/usr/bin/env python3
"""Where mok-py's forward differs from the C++ call's (issue 21): one preset's evaluation
forward timed as layer_bench times it (L2 flush, events around the call), six ways in
alternating rounds:

  mok-py        mok.moe under no_grad (the Python op, as layer_bench's mok-py)
  run-forward   its body (ops._run_forward) called directly: without moe() and call_layer
  direct-train  the extension's forward called with ready tensors: mok.moe's own workspace
                (made for training), a fixed y and scratch (no checks, no allocations)
  direct-off    the same with a workspace made without training and its own scratch (what
                mok_bench's forward uses)
  direct-late   direct-train after 100 µs of host time spent first
  mok           `mok_bench --serve` (the C++ layer in a second process; layer_bench's mok)

then mok-py's host time in the loop split at the extension, and piece by piece. For the
in-process ones the summed GPU time of the pass's kernels (torch.profiler):
events minus kernels is GPU time spent waiting. If the kernels' sums differ, the gap is on the
GPU (workspace, buffers); if only the events do, it is host time.

  py_vs_cpp.py --mok-bench build-gpu/bench/mok_bench [--preset qwen3-30b-a3b,gpt-oss-120b]
               [--rounds 15] [--iters 5] [--queued]

--queued times every way with its iterations enqueued before the first is waited for
(layer_bench --queued): no host time can show, so what differs is on the GPU; each kernel's
median duration is printed for mok-py, direct-train and direct-off.
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
from host_overhead import events_and_kernels, wrapped_extension  # noqa: E402
from mok_impls import MokBench, MokPy  # noqa: E402


def direct(d, training):
    """The extension's forward on d with everything made once (a pass = the capsules + the call)."""
    from mok import _C, ops

    x, ids, weights, gate, up, down = d["x"], d["ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"]
    shared = tuple(d["shared"]) if d["shared"] is not None else (None, None, None)
    T, H = x.shape
    E, _, I = down.shape
    k = ids.shape[1]
    Is = 0 if shared[0] is None else shared[0].shape[0]
    if training:  # mok.moe's own (ops._workspace makes it on first use)
        ws = ops._workspace(x, down, k, Is, d["limit"])
        scratch = torch.empty(ws.forward_scratch_bytes(T), dtype=torch.uint8, device=x.device)
    else:
        ws = _C.Workspace(H, I, E, k, Is, d["limit"], T, x.get_device(), training=False)
        scratch = None
    y = torch.empty_like(x)
    stream = ops._stream(x)
    tensors = (x, ids, weights, gate, up, down, *shared, y, None)

    def fn():
        _C.forward(ws, *ops._capsules(tensors), stream, scratch=None if scratch is None else to_dlpack(scratch))

    return fn, y


def split_host(fn, iters=40):
    """mok-py's host time in the timing loop split at the extension's forward: Python before it,
    the extension, Python after it (medians, ms)."""
    stamps, calls = [], []

    def stamped(entry):  # the extension's entry and exit stamped
        def call(*a, **k):
            t = time.perf_counter()
            entry(*a, **k)
            stamps.append((t, time.perf_counter()))
        return call

    def timed():
        t0 = time.perf_counter()
        fn()
        calls.append((t0, time.perf_counter()))

    with wrapped_extension(stamped):
        tb.time_ms(timed, 2, iters)
    pairs = list(zip(calls[-iters:], stamps[-iters:]))
    return tuple(statistics.median(x) * 1e3 for x in zip(*[(e0 - t0, e1 - e0, t1 - e1) for (t0, t1), (e0, e1) in pairs]))


def prelude_pieces(fn, iters=40):
    """The host time of each piece of mok-py's prelude inside the timing loop (the GPU busy with
    the flush, as layer_bench times it), each piece wrapped and timed alone: the output and the
    scratch from the caching allocator, the capsules, the workspace lookup, the stream and the
    extension's forward. Medians in µs per call, and the whole call's."""
    import mok.ops as ops

    names = ("_workspace", "_scratch", "_capsules", "_stream")
    real = {n: getattr(ops, n) for n in names}
    real_empty_like = torch.empty_like
    times = {n: [] for n in names + ("empty_like", "extension", "whole call")}

    def timed(name, f):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            times[name].append((time.perf_counter() - t) * 1e6)
            return out
        return wrapper

    for n in names:
        setattr(ops, n, timed(n, real[n]))
    torch.empty_like = timed("empty_like", real_empty_like)
    try:
        with wrapped_extension(lambda entry: timed("extension", entry)):
            tb.time_ms(timed("whole call", fn), 2, iters)
    finally:
        for n in names:
            setattr(ops, n, real[n])
        torch.empty_like = real_empty_like
    return {n: statistics.median(v[-iters:]) for n, v in times.items() if v}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mok-bench", required=True)
    ap.add_argument("--preset", default="qwen3-30b-a3b,gpt-oss-120b")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--queued", action="store_true")
    args = ap.parse_args()
    presets = tb.load_presets()
    server = MokBench(args.mok_bench)
    try:
        for name in args.preset.split(","):
            p = presets[name]
            d = tb.make_inputs(p, "uniform", seed=1)
            m = MokPy(d)
            py_fn, _ = m.step("fwd")
            with torch.no_grad():
                y_py = m._call()
            train_fn, y_train = direct(d, True)
            off_fn, y_off = direct(d, False)
            train_fn(), off_fn()
            torch.cuda.synchronize()
            same = torch.equal(y_py.view(torch.int16), y_train.view(torch.int16)) and \
                torch.equal(y_py.view(torch.int16), y_off.view(torch.int16))
            server.load(name, 1, d)
            from mok import ops

            def body_fn():  # mok.moe's body without moe() / call_layer / no_grad
                with torch.no_grad():
                    ops._run_forward(d["x"], d["ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"],
                                     *(d["shared"] or (None, None, None)), d["limit"], d["w_gate"].shape[0],
                                     ops.ONE_GPU, training=False)

            def late_fn():  # direct-train after 100 µs of host time (as if Python took that long first)
                t = time.perf_counter() + 1e-4
                while time.perf_counter() < t:
                    pass
                train_fn()
            fns = {"mok-py": py_fn, "run-forward": body_fn, "direct-train": train_fn, "direct-off": off_fn,
                   "direct-late": late_fn}
            impls = ["mok", "mok-py", "run-forward", "direct-train", "direct-off", "direct-late"]
            rounds = {i: [] for i in impls}
            host = {i: [] for i in impls}
            for r in range(args.rounds):
                for impl in (impls if r % 2 == 0 else impls[::-1]):
                    if impl == "mok":
                        reply = server.call("time-queued" if args.queued else "time", "fwd", 2, args.iters, "mok")
                        ms, h = sorted(reply["ms"]), reply["host_ms"]
                    else:
                        h = []
                        ms = tb.time_ms(fns[impl], 2, args.iters, host=h, queued=args.queued)
                    rounds[impl].append(statistics.median(ms))
                    host[impl].extend(h)
            print(f"\n== {name} fwd (uniform), {args.rounds} rounds of {args.iters}"
                  f"{' (queued)' if args.queued else ''}; y bitwise equal across the "
                  f"in-process calls: {same}")
            print(f"{'impl':14s} {'median ms':>10s} {'paired mok/impl':>16s} {'host ms':>8s} {'events':>8s} "
                  f"{'kernels':>8s} {'waited':>8s}")
            kernels = {}
            for impl in impls:
                paired = statistics.median(a / b for a, b in zip(rounds["mok"], rounds[impl]))
                ev = kern = float("nan")
                if impl != "mok":
                    ev, kern = events_and_kernels(fns[impl], None, 20, queued=args.queued,
                                                  per_kernel=kernels.setdefault(impl, {}))
                print(f"{impl:14s} {statistics.median(rounds[impl]):10.3f} {paired:16.3f} "
                      f"{statistics.median(host[impl]):8.3f} {ev:8.3f} {kern:8.3f} {ev - kern:8.3f}", flush=True)
            for impl in ("mok-py", "direct-train", "direct-off"):
                print(f"  {impl} kernels (median ms a pass): " +
                      ", ".join(f"{n[:60]} {v:.4f}" for n, v in kernels.get(impl, {}).items()))
            print("mok-py's host time in the loop: Python before the extension %.3f ms, the extension %.3f, "
                  "Python after it %.3f" % split_host(py_fn))
            print("its pieces in the loop (each wrapped and timed alone; medians, µs): " +
                  ", ".join(f"{n} {v:.1f}" for n, v in prelude_pieces(py_fn).items()))
            del m, fns
            torch.cuda.empty_cache()
    finally:
        server.close()


if __name__ == "__main__":
    main()
