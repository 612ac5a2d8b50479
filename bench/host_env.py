#!/usr/bin/env python3
"""Why mok.moe's forward waits longer for the host in layer_bench than in host_sections
(issue 21): the forward timed as layer_bench times it (tb.time_ms: synchronise, flush the L2,
start event, call), in variants that each change one thing, with the host time of the call
and the offset of its first enqueue (ops._forward_rows' entry and return, from the call's
start). Rounds alternate the variants; medians over all iterations.

  host_env.py [--preset olmoe-1b-7b,gpt-oss-120b] [--rounds 20] [--iters 5]
"""
import gc
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_baseline as tb  # noqa: E402
from mok_impls import HookedExtension, around, diagnostic_args, for_each_preset, preset_problem  # noqa: E402


def main():
    args = diagnostic_args(__doc__, "olmoe-1b-7b,gpt-oss-120b")
    import mok
    import mok.ops as ops

    stamps = []  # per call: its start, _forward_rows' entry, the extension's entry and return, _forward_rows' return
    stamp = lambda: stamps.append(time.perf_counter())  # noqa: E731
    ops._forward_rows = around(ops._forward_rows, stamp, stamp)
    ops._C = HookedExtension(mok._C, {"forward_rows": (stamp, stamp)})
    zero = tb.l2_flusher("zero")
    zero2 = tb.l2_flusher("zero")

    def twice():
        zero()
        zero2()

    def run_preset(name):  # (its tensors go when it returns)
        d, moe_args = preset_problem(name)
        x, _, w, wg, wu, wd, _, _ = moe_args

        def fwd():
            with torch.no_grad():
                t0 = time.perf_counter()
                stamps.append(t0)
                return mok.moe(*moe_args)

        variants = {"layer_bench (flush 256 MB)": dict(flush=zero), "gc disabled": dict(flush=zero, gc=True),
                    "flush 2 x 256 MB": dict(flush=twice), "no flush": dict(flush=lambda: None),
                    "launch graphs off": dict(flush=zero, graphs_off=True)}
        variants["leaves require grad"] = dict(flush=zero, grad=True)
        with torch.no_grad():
            mok.moe(*moe_args)
        key = next(k for k in ops._workspaces if k[1:3] == (x.shape[1], wd.shape[2]))
        ws_graphs = ops._workspaces[key]
        ws_direct = mok._C.Workspace(*key[1:7], ws_graphs.max_tokens, key[0], training=True, replay_launches=False,
                                     precision=key[7], recompute=key[8], backward_column_blocks=key[9],
                                     compute_sms=key[10])
        leaves = (x, w, wg, wu, wd)

        def measure(title):
            res = {v: dict(ms=[], host=[], entry=[], c_in=[], c_out=[], first=[]) for v in variants}
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for v in order:
                    cfg = variants[v]
                    if cfg.get("gc"):
                        gc.disable()
                    for t in leaves:
                        t.requires_grad_(bool(cfg.get("grad")))
                    ops._workspaces[key] = ws_direct if cfg.get("graphs_off") else ws_graphs
                    stamps.clear()
                    host = []
                    ms = tb.time_ms(fwd, 2, args.iters, host=host, flush=cfg["flush"])
                    gc.enable()
                    s = stamps[-5 * args.iters:]
                    for i in range(args.iters):
                        t0, *rest = s[5 * i:5 * i + 5]
                        for k, t in zip(("entry", "c_in", "c_out", "first"), rest):
                            res[v][k].append((t - t0) * 1e3)
                    res[v]["ms"] += ms
                    res[v]["host"] += host
            print(f"== {name} forward, mok.moe, {args.rounds} rounds x {args.iters} (ms; medians), {title}")
            print(f"  {'variant':<28} {'GPU ms':>8} {'p10':>7} {'p90':>7} {'host ms':>8} {'to rows':>8} {'to C':>8} "
                  f"{'C back':>8} {'rows back':>9}")
            for v, m in res.items():
                med = {k: statistics.median(vals) for k, vals in m.items()}
                q = statistics.quantiles(m["ms"], n=10)
                print(f"  {v:<28} {med['ms']:8.3f} {q[0]:7.3f} {q[-1]:7.3f} {med['host']:8.3f} {med['entry']:8.3f} "
                      f"{med['c_in']:8.3f} {med['c_out']:8.3f} {med['first']:9.3f}")

        measure("a fresh process")
        for t in leaves:  # one backward through autograd (its engine's threads start)
            t.requires_grad_()
        mok.moe(*moe_args).backward(d["dy"])
        for t in leaves:
            t.grad = None
        measure("after one backward")
        ops._workspaces[key] = ws_graphs

    for_each_preset(args.preset, run_preset)


if __name__ == "__main__":
    main()
