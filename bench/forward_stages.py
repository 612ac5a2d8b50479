#!/usr/bin/env python3
"""Where an eager mok.moe forward waits (issue 21): mok.moe's forward timed as layer_bench
times it (synchronise, flush the L2, start event, call), with CUDA events recorded on the
stream right after each of its two enqueues — the plan and row copy (forward_rows) and the
fused kernel (forward) — and the host time of each. Per iteration the GPU time splits into

  to rows    start -> the row copy's end (the flush is before the start: the GPU waits here
             only if the host enqueues the plan after the flush has finished)
  to kernel  the row copy's end -> the fused kernel's end (the kernel, plus any wait for the
             second enqueue after the rows are copied)

and the iterations are ranked by their total: if the slow ones spend their extra time in
`to rows`, the first enqueue is late; in `to kernel`, the second enqueue (or the kernel). Last,
the iterations grouped by the addresses of y and the scratch the caching allocator gave them
(whether slower kernels go with other addresses).

  forward_stages.py [--preset olmoe-1b-7b,gpt-oss-120b,glm-4.5] [--rounds 20] [--iters 5]
"""
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_baseline as tb  # noqa: E402
from mok_impls import HookedExtension, diagnostic_args, for_each_preset, preset_problem  # noqa: E402


def main():
    args = diagnostic_args(__doc__, "olmoe-1b-7b,gpt-oss-120b,glm-4.5")
    import mok
    import mok.ops as ops

    ev = {n: torch.cuda.Event(enable_timing=True) for n in ("start", "rows", "kernel", "end")}
    host = {}

    def after(stage):  # an event on the stream and the host time, once the enqueue returns
        def mark():
            ev[stage].record()
            host[stage] = time.perf_counter()
        return mark
    ops._C = HookedExtension(mok._C, {"forward_rows": (None, after("rows")), "forward": (None, after("kernel"))})
    scratch_ptr = []  # the scratch each call got from the caching allocator (ops._scratch)
    allocate = ops._scratch

    def recording_scratch(nbytes, device):
        t = allocate(nbytes, device)
        scratch_ptr.append(t.data_ptr())
        return t
    ops._scratch = recording_scratch
    flush = tb.l2_flusher(tb.FLUSH)
    for e in ev.values():  # (created on the device at their first record)
        e.record()

    def run_preset(name):  # (its tensors go when it returns)
        _, moe_args = preset_problem(name)

        def fwd():
            with torch.no_grad():
                return mok.moe(*moe_args)
        for _ in range(3):
            fwd()
        rows = []
        for _ in range(args.rounds * args.iters):
            torch.cuda.synchronize()
            flush()
            ev["start"].record()
            t0 = time.perf_counter()
            y = fwd()
            t1 = time.perf_counter()
            ev["end"].record()
            ev["end"].synchronize()
            rows.append(dict(total=ev["start"].elapsed_time(ev["end"]), to_rows=ev["start"].elapsed_time(ev["rows"]),
                             to_kernel=ev["rows"].elapsed_time(ev["kernel"]),
                             host_rows=(host["rows"] - t0) * 1e3, host_kernel=(host["kernel"] - t0) * 1e3,
                             host=(t1 - t0) * 1e3, at=(y.data_ptr(), scratch_ptr[-1])))
            del y
        rows.sort(key=lambda r: r["total"])
        n = len(rows)
        fifth = max(1, n // 5)
        groups = {"fastest fifth": rows[:fifth], "middle": rows[fifth:n - fifth], "slowest fifth": rows[n - fifth:]}
        print(f"== {name} forward, mok.moe, {n} iterations (ms; means of each group)")
        print(f"  {'iterations':<15} {'total':>8} {'to rows':>8} {'to kernel':>9} {'host: rows':>11} {'kernel':>8} "
              f"{'call':>7}")
        for g, rs in groups.items():
            m = {k: statistics.fmean(r[k] for r in rs) for k in rows[0] if k != "at"}
            print(f"  {g:<15} {m['total']:8.3f} {m['to_rows']:8.3f} {m['to_kernel']:9.3f} {m['host_rows']:11.3f} "
                  f"{m['host_kernel']:8.3f} {m['host']:7.3f}")
        # Whether the slow iterations are those whose y or scratch the allocator placed elsewhere:
        # the mean total of each (y, scratch) address pair the iterations got.
        by_at = {}
        for r in rows:
            by_at.setdefault(r["at"], []).append(r["total"])
        print(f"  (y, scratch) addresses: {len(by_at)} distinct pair(s); per pair: " +
              ", ".join(f"{len(v)} at {statistics.fmean(v):.3f}" for v in sorted(by_at.values(), key=len, reverse=True)))

    for_each_preset(args.preset, run_preset)


if __name__ == "__main__":
    main()
