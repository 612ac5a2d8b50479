#!/usr/bin/env python3
"""The one-GPU layer benchmark: every implementation on the same inputs, in one run,
interleaved, checked at full size before it is timed.

  layer_bench.py [--preset all|NAME,...] [--routing uniform,zipf1.2] [--repeats 3]
                 [--impl torch-compiled,torch,mok,mok-py,dense] [--iters 10] [--out FILE.json]

impls:
  torch-compiled  the strongest plain-PyTorch layer (torch_baseline.moe_compilable under
                  torch.compile(dynamic=False, fullgraph=True))
  torch           the eager PyTorch layer (torch_baseline.moe_eager)
  mok             the C++ layer, without Python: `mok_bench --serve` in a second process,
                  driven line by line from here (so it interleaves with the others) on the
                  very same inputs (both processes fill them from one hash; the routing
                  goes through a file)
  mok-py          the package: mok.moe from Python (autograd for fwd+bwd)
  dense           the same FLOPs as dense GEMMs through torch.matmul: the ceiling
  torch-fp8       (only when asked for) the compiled PyTorch layer with rowwise-scaled FP8
                  grouped GEMMs (torch._scaled_grouped_mm; bench/torch_fp8.py): issue 19's FP8
                  baseline; fwd+bwd with the dgrad in FP8 too and bf16 weight gradients
  mok-fp8-py      (only when asked for) mok.moe(..., precision="fp8"), the routed weights
                  quantized once beforehand (mok.fp8.quantize_experts; with the dgrad's copies
                  where mok.fp8.dgrad_pays, so fwd+bwd runs the FP8 dgrad there)
  mok-fp8         (only when asked for) the same in C++ (`mok_bench --serve`, impl mok-fp8),
                  forward only
  liger           (only when asked for) a peer: Liger-Kernel's Triton fused MoE
                  (bench/liger_peer.py; scripts/peers.sh fetches it), the shared expert beside
                  it in eager PyTorch; presets with a SwiGLU clamp are refused

Checks, per preset and routing, before anything is timed:
  - torch and torch-compiled: y of 16 sampled tokens against an fp32 per-token computation
    (rel <= 1e-2); torch-compiled's y and every gradient against the eager path's.
  - mok-py: the whole y and, for fwd+bwd, every gradient (dx, d_topk_weights, d_w_gate,
    d_w_up, d_w_down, the shared expert's) against autograd through the eager PyTorch path:
    ‖got − ref‖/‖ref‖ <= 1e-2 and cosine >= 0.9999, nothing non-finite.
  - mok: every output bitwise equal to mok-py's (checksums of the raw bytes), so it passes
    the same full-size check.
  - liger: y and, for fwd+bwd, every gradient against the eager path's as torch-compiled's
    (‖got − ref‖/‖ref‖ <= 1e-2, cosine >= 0.9999).
  - torch-fp8: y and, for fwd+bwd, every gradient against the eager path's with FP8's
    tolerance (cosine >= 0.99, nothing non-finite; the relative errors are recorded).
  - mok-fp8-py: fwd: y against mok.fp8.moe_reference (the FP8 recipe on the same quantized
    operands, fp32, at full size): ‖got − ref‖/‖ref‖ <= 1e-2; its distance from the eager
    bf16 path's y is recorded. fwd+bwd: y and every gradient as torch-fp8's. mok-fp8: y
    bitwise equal to mok-fp8-py's.
A failed check marks the record (`check`: failed) and the failure is printed; a failure to
run (a compile error, a graph break) leaves the implementation out of that preset.

Timing: --repeats rounds; in each, every pass of every implementation in turn, grouped by
pass, the implementations of a pass in an order rotated every round (A B C, B C A, C A B, …;
round_order). What ran just before moves a pass's time by a few % (the GPU's clock and
temperature after a 30 ms forward+backward are not those after a 3 ms forward): so each
implementation of a pass follows the other pass equally often and otherwise its own pass (an
unbalanced order moved mok-py's forward by ~2 %: bench/NOTES.md). Each timing is a warm-up then
--iters iterations with the L2 flushed before each (CUDA events); with --settle-ms, the pass
first runs untimed for that long, so that every implementation is timed on the power limit's
plateau, not on its ramp (settle()). With --queued, a timing enqueues all its iterations before
it waits (torch_baseline.time_ms, mok_bench's time-queued): the host runs ahead of the GPU as in
a training loop, so the host's time per call is hidden unless it exceeds the pass's, and the GPU
does not idle between iterations (synced, the default, it idles while the host reaches the next
call; the record's `timing` says which). --warmup-rounds N runs N whole rounds untimed before
the timed ones. A record
keeps each round's median, p10 and p90 (`ms_repeats`, `ms_p10_repeats`, `ms_p90_repeats`);
`ms` is the median of the rounds' medians, `ms_min`/`ms_max` their range.

Host time (`host_ms`): the median over the timed iterations of the host time to enqueue one
pass (from the call to its return, no synchronisation): what the GPU waits for when it has
nothing queued, as in these timings, and what a training loop must hide behind earlier work.

Peak memory (`peak_bytes`): what one pass needs beyond its inputs and weights, measured the
same way for each: PyTorch's peak allocated bytes over one pass above what was allocated
before it (weight gradients cleared before the pass, so a fwd+bwd counts its gradients);
mok-py adds its workspace (held by the extension, outside PyTorch's allocator); mok counts
its workspace, y and the high-water mark of a caching pool that serves everything the pass
allocates (scratch, saved tensor, dx, gradients).
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_baseline as tb  # noqa: E402
from mok_impls import MokBench, MokPy, check_mok_fp8, checksum, fp8_check, mok_bench_path  # noqa: E402,F401
from rounds import SETTLE_ITERS, paired_ratio, round_order, settle  # noqa: E402

IMPLS = ("torch-compiled", "torch", "mok", "mok-py", "dense")
OPTIONAL_IMPLS = ("torch-fp8", "mok-fp8", "mok-fp8-py", "liger")  # valid in --impl, not run unless named


def full_check(got, ref, names):
    """{name: {rel, cos, passed}} of each output against the reference's."""
    return {n: tb.compare(got[n], ref[n]) for n in names}


def run_preset(p, routing, args, server, gpu, emit):
    """Checks, then interleaved timing and peak memory, of every implementation on one
    preset and routing; emits one record per implementation and pass."""
    name = p["name"]
    d = tb.make_inputs(p, routing, seed=args.seed)
    load_ratio = tb.max_load_ratio(d["ids"], p["experts"])
    passes = args.passes
    checks = {impl: {} for impl in IMPLS + OPTIONAL_IMPLS}  # impl -> pass -> dict(passed, tensors | error)
    peak_extra = {}

    def fail(impl, ps, err):
        checks[impl][ps] = dict(passed=False, error=str(err)[:2000])
        print(f"  {name} {routing} {impl} {ps}: FAILED: {str(err)[:400]}", flush=True)

    # The reference: autograd through the eager PyTorch path (its y also against fp32 rows).
    eager = tb.TorchImpl(d, tb.moe_eager)
    ref = {ps: eager.outputs(ps) for ps in passes}
    eager_err = tb.sampled_error(d, ref[passes[0]]["y"])
    impls = {}
    if "torch" in args.impls:
        impls["torch"] = eager
        for ps in passes:
            checks["torch"][ps] = dict(passed=eager_err <= 1e-2, sampled_rel=eager_err)
    else:
        eager.release()

    def check_against_eager(impl, make, sampled=False):
        """A PyTorch-side implementation (make(): a TorchImpl) checked as the eager path's twin: every
        output (rel <= 1e-2, cosine >= 0.9999) and, sampled, y against fp32 rows; a failure to make or
        run it (a compile error, a graph break, a peer not installed) leaves it out."""
        try:
            t = make()
            impls[impl] = t
            for ps in passes:  # (the first call of each pass compiles, or autotunes a peer's kernels)
                out = t.outputs(ps)
                res = full_check(out, ref[ps], out.keys())
                c = dict(passed=all(r["passed"] for r in res.values()), tensors=res)
                if sampled:
                    c["sampled_rel"] = tb.sampled_error(d, out["y"])
                    c["passed"] = c["passed"] and c["sampled_rel"] <= 1e-2
                checks[impl][ps] = c
                del out
        except Exception as e:
            for ps in passes:
                fail(impl, ps, e)
            impls.pop(impl, None)

    if "torch-compiled" in args.impls:
        check_against_eager("torch-compiled", lambda: tb.TorchImpl(d, args.compiled), sampled=True)

    sums = {}
    if "mok-py" in args.impls or "mok" in args.impls:
        try:
            m = MokPy(d)
            for ps in passes:
                out = m.outputs(ps)
                res = full_check(out, ref[ps], out.keys())
                checks["mok-py"][ps] = dict(passed=all(r["passed"] for r in res.values()), tensors=res)
                sums[ps] = {n: checksum(t) for n, t in out.items()}
                del out
            if "mok-py" in args.impls:
                impls["mok-py"] = m
                peak_extra["mok-py"] = m.workspace_bytes()
        except Exception as e:
            for ps in passes:
                fail("mok-py", ps, e)
    fp8_sums = None
    fp8_shape = tb.fp8_shape(p)
    if ("mok-fp8-py" in args.impls or "mok-fp8" in args.impls) and not fp8_shape:
        for impl in ("mok-fp8", "mok-fp8-py"):
            for ps in passes:
                checks[impl][ps] = dict(passed=None, error="precision fp8 needs H and I multiples of 128")
    elif "mok-fp8-py" in args.impls or "mok-fp8" in args.impls:
        fp8_sums = check_mok_fp8(d, ref, passes, checks, impls, args, fail)
    if "mok" in args.impls or ("mok-fp8" in args.impls and fp8_shape):
        try:
            server.load(name, args.seed, d)
            for impl in ("mok", "mok-fp8"):
                if impl in args.impls and (impl == "mok" or fp8_shape):
                    impls[impl] = server
        except Exception as e:
            for ps in passes:
                fail("mok", ps, e)
        if "mok-fp8" in impls and "fwd" in passes:
            try:
                got = {n: int(v) for n, v in server.call("check", "fwd", "mok-fp8")["checksums"].items()}
                same = fp8_sums is not None and got == fp8_sums
                checks["mok-fp8"]["fwd"] = dict(passed=same and checks["mok-fp8-py"].get("fwd", {}).get("passed", False),
                                                bitwise_equal_to_mok_fp8_py=same)
            except Exception as e:
                fail("mok-fp8", "fwd", e)
        if "mok" in impls:
            for ps in passes:
                try:
                    got = {n: int(v) for n, v in server.call("check", ps)["checksums"].items()}
                    want = sums.get(ps)
                    same = want is not None and got == want
                    checks["mok"][ps] = dict(passed=same and checks["mok-py"].get(ps, {}).get("passed", False),
                                             bitwise_equal_to_mok_py=same,
                                             differing=sorted(n for n in got if want is None or got[n] != want.get(n)))
                except Exception as e:
                    fail("mok", ps, e)
    if "torch-fp8" in args.impls:
        import torch_fp8

        try:
            f = torch_fp8.TorchFp8(d)
            for ps in passes:
                checks["torch-fp8"][ps] = fp8_check(f.outputs(ps), ref[ps])
            impls["torch-fp8"] = f
        except Exception as e:  # (an unsupported GPU or PyTorch, a compile error)
            for ps in passes:
                fail("torch-fp8", ps, e)
    if "liger" in args.impls:
        import liger_peer

        check_against_eager("liger", lambda: liger_peer.Liger(d))  # (not installed, a clamp, a Triton error: left out)
    if "dense" in args.impls:
        impls["dense"] = tb.dense_step(p)
        for ps in passes:
            checks["dense"][ps] = dict(passed=None)  # not the layer: nothing to check
    for impl in args.impls:
        for ps in passes:
            c = checks[impl].get(ps)
            if c is not None and c.get("passed") is False and "error" not in c:
                print(f"  {name} {routing} {impl} {ps}: CHECK FAILED: {json.dumps(c)[:600]}", flush=True)
    del ref

    host = {}  # (impl, pass) -> host ms to enqueue one pass, every timed iteration

    def timer(impl, ps):
        obj, h = impls[impl], host.setdefault((impl, ps), [])
        if impl in ("mok", "mok-fp8"):
            command = "time-queued" if args.queued else "time"

            def run():
                settle(lambda: obj.call(command, ps, 0, SETTLE_ITERS, impl), args.settle_ms)
                reply = obj.call(command, ps, args.warmup, args.iters, impl)
                h.extend(reply["host_ms"])
                return sorted(reply["ms"])
            return run
        if impl == "dense":
            fn, before = obj[ps], None
        else:
            fn, before = obj.step(ps)

        def run():
            settle(lambda: tb.time_ms(fn, 0, SETTLE_ITERS, before, queued=args.queued), args.settle_ms)
            return tb.time_ms(fn, args.warmup, args.iters, before, host=h, queued=args.queued)
        return run

    runnable = [(impl, ps) for ps in passes for impl in args.impls if impl in impls and "error" not in checks[impl].get(ps, {})]
    rounds = {key: [] for key in runnable}
    # Rounds r < 0 are --warmup-rounds, untimed (the first rounds after a preset's checks run slow:
    # bench/NOTES.md). Balanced: each implementation of a pass follows another pass equally often
    # (the GPU's clock and temperature after a pass move the next one's time by a few %: round_order).
    for r in range(-args.warmup_rounds, args.repeats):
        if r == 0:
            host.clear()
        for key in round_order(runnable, r):
            try:
                ms = timer(*key)()
                if r >= 0:
                    rounds[key].append(ms)
            except Exception as e:
                fail(*key, e)
                rounds[key] = None
                runnable = [k for k in runnable if k != key]
    for impl, ps in runnable:
        obj = impls[impl]
        if impl in ("mok", "mok-fp8"):
            peak = obj.call("peak", ps, impl)["peak_bytes"]
        elif impl == "dense":
            peak = tb.peak_bytes(obj[ps])
        else:
            fn, before = obj.step(ps)
            peak = tb.peak_bytes(fn, before) + peak_extra.get(impl, 0)
        medians = [statistics.median(t) for t in rounds[(impl, ps)]]
        ms = statistics.median(medians)
        c = checks[impl].get(ps, {})
        emit(dict(preset=name, impl=impl, **{"pass": ps}, routing=routing, max_load_ratio=load_ratio,
                  tokens=p["tokens"], ep=1, hidden=p["hidden"], intermediate=p["intermediate"], experts=p["experts"],
                  top_k=p["top_k"], shared_intermediate=p["shared_intermediate"], swiglu_limit=p["swiglu_limit"],
                  ms=ms, ms_min=min(medians), ms_max=max(medians), repeats=len(medians), ms_repeats=medians,
                  ms_p10_repeats=[t[len(t) // 10] for t in rounds[(impl, ps)]],
                  ms_p90_repeats=[t[len(t) * 9 // 10] for t in rounds[(impl, ps)]],
                  tflops=tb.layer_flops(p, ps) / (ms * 1e-3) / 1e12, peak_bytes=int(peak),
                  host_ms=statistics.median(host[(impl, ps)]) if host.get((impl, ps)) else None,
                  check={True: "passed", False: "failed", None: "n/a"}[c.get("passed")], check_detail=c,
                  iters=args.iters, warmup=args.warmup, flush=tb.FLUSH, timing="queued" if args.queued else "synced",
                  settle_ms=args.settle_ms, warmup_rounds=args.warmup_rounds, gpu=gpu, commit=args.commit,
                  date=args.date, torch=torch.__version__))
    for obj in impls.values():  # (the PyTorch implementations give back their leaves and weights)
        if hasattr(obj, "release"):
            obj.release()


def summary(records):
    """A short table: TFLOP/s per implementation, mok's ratios to torch-compiled (and to liger
    where it ran) and, with both mok and mok-py, mok-py's speed relative to the C++ call (paired
    by round, paired_ratio)."""
    by = {(r["preset"], r["routing"], r["pass"], r["impl"]): r for r in records}
    keys = list(dict.fromkeys((r["preset"], r["routing"], r["pass"]) for r in records))
    impls = [i for i in IMPLS + OPTIONAL_IMPLS if any(r["impl"] == i for r in records)]
    peer = "liger" in impls  # (mok's ratio to the peer: a column of its own)
    lines = [f"{'preset':<18}{'routing':<9}{'pass':<8}" + "".join(f"{i:>15}" for i in impls) +
             f"{'mok/compiled':>14}{'mok-py/compiled':>16}" + (f"{'mok/liger':>11}" if peer else "") +
             f"{'mok-py vs mok [range]':>24}{'checks':>8}"]
    for key in keys:
        row = f"{key[0]:<18}{key[1]:<9}{key[2]:<8}"
        for i in impls:
            r = by.get(key + (i,))
            row += f"{r['tflops']:>15.1f}" if r else f"{'-':>15}"
        ratios = [("torch-compiled", "mok", 14), ("torch-compiled", "mok-py", 16)] + ([("liger", "mok", 11)] if peer else [])
        for b, i, w in ratios:
            base, r = by.get(key + (b,)), by.get(key + (i,))
            row += f"{base['ms'] / r['ms']:>{w}.3f}" if r and base else f"{'-':>{w}}"
        c, py = by.get(key + ("mok",)), by.get(key + ("mok-py",))
        if c and py:
            med, lo, hi = paired_ratio(c, py)
            row += f"{f'{med:.3f} [{lo:.3f}, {hi:.3f}]':>24}"
        else:
            row += f"{'-':>24}"
        bad = [r["impl"] for k, r in by.items() if k[:3] == key and r["check"] == "failed"]
        row += f"{'ok' if not bad else 'FAIL':>8}"
        lines.append(row)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="all")
    ap.add_argument("--routing", default=",".join(tb.ROUTINGS))
    ap.add_argument("--impl", default=",".join(IMPLS))
    ap.add_argument("--pass", dest="passes", default=",".join(tb.PASSES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="before each timing, run its pass untimed for this long (the power ramp: settle()); 0: not")
    ap.add_argument("--queued", action="store_true",
                    help="enqueue a timing's iterations before waiting for them (the host ahead of the GPU, as in "
                         "training); default: wait for each")
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="whole rounds run untimed first, in the timed rounds' order (the first rounds after a "
                         "preset's checks run slow: bench/NOTES.md)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--flush", choices=("zero", "memset"), default=tb.FLUSH,
                    help="how each iteration flushes the L2 in this process (torch_baseline.l2_flusher); "
                         "mok_bench always uses memset")
    ap.add_argument("--mok-bench", default=os.environ.get("MOK_BENCH", ""),
                    help="the mok_bench executable (default: build-gpu/bench/mok_bench, else build/bench/mok_bench)")
    tb.add_run_args(ap, iters=10)
    args = ap.parse_args()
    tb.check_run_args("layer_bench", args, IMPLS + OPTIONAL_IMPLS)
    if args.warmup_rounds < 0 or not 0 <= args.settle_ms < math.inf:  # (inf never settled; NaN turned it off)
        sys.exit(f"layer_bench: --warmup-rounds and --settle-ms must be >= 0 (and finite), got {args.warmup_rounds} and "
                 f"{args.settle_ms}")
    tb.FLUSH = args.flush
    if not torch.cuda.is_available():
        sys.exit("layer_bench: no CUDA GPU")
    presets = tb.load_presets()
    names = tb.benchmark_presets(presets) if args.preset == "all" else args.preset.split(",")
    for n in names:
        if n not in presets:
            sys.exit(f"layer_bench: unknown preset '{n}'; known: {', '.join(presets)}")
    server = None
    if "mok" in args.impls or "mok-fp8" in args.impls:
        server = MokBench(mok_bench_path(args.mok_bench))
    tb.configure_compile()
    gpu = torch.cuda.get_device_name(0)
    records = []
    emit = tb.record_sink(records, args.out)

    try:
        for i, n in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {n}", flush=True)
            torch._dynamo.reset()  # each preset compiles afresh (a new shape is a new graph anyway)
            args.compiled = tb.compiled_layer()
            for routing in args.routings:
                run_preset(presets[n], routing, args, server, gpu, emit)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            if any(i in args.impls for i in ("mok-py", "mok", "mok-fp8-py")):
                from mok import ops  # one workspace per shape: free this preset's before the next

                ops._workspaces.clear()
    finally:
        if server:
            server.close()
    print()
    print(summary(records))
    failed = [r for r in records if r["check"] == "failed"]
    if failed:
        print(f"\n{len(failed)} record(s) failed their check")
        sys.exit(1)


if __name__ == "__main__":
    main()
