#!/usr/bin/env python3
"""The SM clock and board power while each implementation repeats one pass: whether a layer is
power-bound (at the board's limit the clock, not the work, sets its time) and what energy it
spends a TFLOP of the layer — the figure of merit there.

  clock_power.py [--preset mixtral-8x7b] [--routing uniform] [--impl mok,torch-compiled]
                 [--pass fwd,fwd+bwd] [--seconds 4] [--repeats 2] [--interval-ms 50]
                 [--mok-bench PATH] [--mok-bench-head PATH] [--out FILE.json]

impls: mok_bench's own (`mok`, `mok-fp8`, `mok-fp8-wgrad`, `mok-fp8-bf16dgrad`, `mok-fp8-step` — the
FP8 weight gradients with the weights quantized again every pass, as a step with one micro-batch an
optimizer step —, `mok-pp`, `mok-recompute`, `mok-1block`, `mok-recompute-1block`, `mok-recompute-2block`, `mok-fp8-wgrad-1block`, `mok-fp8-wgrad-2block`, `mok-fp8-2block`, `mok-fp8-bf16dgrad-2block`; through mok_bench --serve; the FP8 backward
variants and the mok-recompute ones forward+backward only), `mok-py`, `torch-compiled`,
`torch`; with --mok-bench-head (a second build, e.g. a diagnostic one), `head:<impl>` runs mok_bench's
<impl> in that binary, so two builds' clocks and power are sampled in the same rounds; `mok-fp8-py`
(mok.moe(precision="fp8"), the weights quantized once) and `torch-fp8` (the compiled PyTorch layer with
rowwise-scaled FP8 GEMMs, bench/torch_fp8.py) as layer_bench runs them; the ceilings `dense` (the
layer's FLOPs as dense torch.matmul GEMMs, layer_bench's), `dense-fp8` (the same GEMMs in E4M3
through torch._scaled_mm, operands quantized beforehand: torch_baseline.dense_fp8_step) and
`dense-fp8-blockwise` (the same with the layer's blockwise recipe, cuBLAS; left out where it cannot run) — at the
power limit, what the same FLOPs cost the best GEMMs this PyTorch has, in BF16 and in FP8.

In each round, every implementation and pass in turn (rotated every round as layer_bench's are:
rounds.round_order) runs back to back for --seconds, queued as in training (the GPU does not idle
between iterations; the L2 flushed before each, as layer_bench times them), while `nvidia-smi`
samples the SM clock, the board power and the active throttle reasons every --interval-ms. The
first --skip-s of each window are dropped (the power controller's ramp). A record: the median
time of the window's iterations, the median (and range) of the samples' clock and power, the
throttle reasons seen, and the energy a TFLOP (median W x median s / the layer's TFLOP of one
pass). Nothing is checked here: layer_bench checks these implementations on the same inputs.

Found with it (bench/NOTES.md, 2026-12-03): mixtral-8x7b's fused forward+backward runs at the
700 W cap with the SM clock ~8 % below its forward's.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BENCH_IMPLS = ("mok", "mok-fp8", "mok-fp8-wgrad", "mok-fp8-bf16dgrad", "mok-fp8-step", "mok-pp", "mok-recompute",
               "mok-1block", "mok-recompute-1block", "mok-recompute-2block", "mok-fp8-wgrad-1block",
               "mok-fp8-wgrad-2block", "mok-fp8-2block", "mok-fp8-bf16dgrad-2block")  # (mok_bench --serve's)
BWD_ONLY = ("mok-fp8-wgrad", "mok-fp8-bf16dgrad", "mok-fp8-step", "mok-recompute", "mok-recompute-1block",
            "mok-recompute-2block", "mok-fp8-wgrad-1block", "mok-fp8-wgrad-2block", "mok-fp8-bf16dgrad-2block")
IMPLS = BENCH_IMPLS + tuple(f"head:{i}" for i in BENCH_IMPLS) + ("mok-py", "mok-fp8-py", "torch-compiled", "torch",
                                                                  "torch-fp8", "dense", "dense-fp8",
                                                                  "dense-fp8-blockwise")
QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def parse_samples(text):
    """[(datetime, sm_mhz, watts, reasons)] of nvidia-smi's `--query-gpu=QUERY --format=csv,noheader,nounits`
    lines (timestamps in the machine's local time, 'YYYY/MM/DD HH:MM:SS.mmm'); lines with a value
    nvidia-smi could not read ('[N/A]', '[Unknown Error]') or cut short are skipped."""
    out = []
    for line in text.splitlines():
        parts = [s.strip() for s in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            out.append((when, float(parts[1]), float(parts[2]), parts[3]))
        except ValueError:
            continue
    return out


def window_stats(samples, start, end, skip_s=0.5):
    """The samples in [start + skip_s, end]: their count, the SM clock's and the power's median,
    min and max, and the throttle reasons seen; None if no sample falls in it."""
    lo = start + datetime.timedelta(seconds=skip_s)
    sel = [s for s in samples if lo <= s[0] <= end]
    if not sel:
        return None
    clock, power = [s[1] for s in sel], [s[2] for s in sel]
    return dict(samples=len(sel), sm_mhz=statistics.median(clock), sm_mhz_min=min(clock), sm_mhz_max=max(clock),
                power_w=statistics.median(power), power_w_min=min(power), power_w_max=max(power),
                throttle_reasons=sorted({s[3] for s in sel}))


def joules_per_tflop(power_w, ms, flops):
    """Energy a TFLOP of the layer: the board's power over one pass's time, per TFLOP of the pass."""
    return power_w * ms * 1e-3 / (flops / 1e12)


def smi_index(device, visible=None):
    """nvidia-smi's -i for CUDA device `device`: its entry of CUDA_VISIBLE_DEVICES (an index or a
    UUID, both of which -i takes) when that is set, else the device number itself."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    entries = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    return entries[device] if device < len(entries) else str(device)


class Sampler:
    """nvidia-smi in the background, sampling GPU `index` every interval_ms into a file."""

    def __init__(self, index, interval_ms):
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "-i", str(index), f"--query-gpu={QUERY}",
                                          "--format=csv,noheader,nounits", "-lms", str(interval_ms)],
                                         stdout=self.file, stderr=subprocess.STDOUT, text=True)
        except FileNotFoundError:
            sys.exit("clock_power: nvidia-smi not found (it samples the clock and power)")

    def samples(self):
        self.file.flush()
        with open(self.file.name) as f:
            return parse_samples(f.read())

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.file.close()
        os.unlink(self.file.name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mixtral-8x7b")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--impl", default="mok,torch-compiled")
    ap.add_argument("--pass", dest="passes", default="fwd,fwd+bwd")
    ap.add_argument("--seconds", type=float, default=4.0, help="each window's length")
    ap.add_argument("--skip-s", type=float, default=0.5, help="dropped from the start of each window (the ramp)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--interval-ms", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mok-bench", default=os.environ.get("MOK_BENCH", ""))
    ap.add_argument("--mok-bench-head", default="", help="a second mok_bench for the head:<impl> implementations")
    import torch_baseline as tb

    tb.add_run_args(ap, iters=10)
    args = ap.parse_args()
    args.repeats = max(args.repeats, 1)
    tb.check_run_args("clock_power", args, IMPLS)
    if any(i.startswith("head:") for i in args.impls) and not args.mok_bench_head:
        sys.exit("clock_power: head:<impl> needs --mok-bench-head PATH")
    if len(args.routings) != 1:
        sys.exit("clock_power: one --routing at a time")
    if args.seconds <= args.skip_s or args.interval_ms < 10:
        sys.exit(f"clock_power: --seconds ({args.seconds}) must exceed --skip-s ({args.skip_s}) and "
                 f"--interval-ms ({args.interval_ms}) be >= 10")
    import torch

    from mok_impls import MokBench, MokPy, mok_bench_path
    from rounds import round_order

    if not torch.cuda.is_available():
        sys.exit("clock_power: no CUDA GPU")
    presets = tb.load_presets()
    names = args.preset.split(",")
    for n in names:
        if n not in presets:
            sys.exit(f"clock_power: unknown preset '{n}'; known: {', '.join(presets)}")
    servers = {}  # (mok_bench --serve processes: "" the build under test, "head:" the second)
    if any(i in BENCH_IMPLS for i in args.impls):
        servers[""] = MokBench(mok_bench_path(args.mok_bench))
    if any(i.startswith("head:") for i in args.impls):
        servers["head:"] = MokBench(args.mok_bench_head)
    tb.configure_compile()
    gpu = torch.cuda.get_device_name(0)
    sampler = Sampler(smi_index(torch.cuda.current_device()), args.interval_ms)
    records = []

    def emit(rec):
        records.append(rec)
        if args.out:  # (after every record: a run cut short keeps what it measured)
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
    try:
        for name in names:
            p = presets[name]
            torch._dynamo.reset()
            d = tb.make_inputs(p, args.routings[0], seed=args.seed)
            impls = {}
            if "torch-compiled" in args.impls:
                impls["torch-compiled"] = tb.TorchImpl(d, tb.compiled_layer())
            if "torch" in args.impls:
                impls["torch"] = tb.TorchImpl(d, tb.moe_eager)
            if "mok-py" in args.impls:
                impls["mok-py"] = MokPy(d)
            if "mok-fp8-py" in args.impls and not tb.fp8_shape(p):
                print(f"clock_power: {name}: mok-fp8-py left out (precision fp8 needs H and I multiples of 128)")
            elif "mok-fp8-py" in args.impls:  # (the routed weights quantized once, as layer_bench's)
                impls["mok-fp8-py"] = MokPy(d, precision="fp8")
            if "torch-fp8" in args.impls:
                import torch_fp8

                impls["torch-fp8"] = torch_fp8.TorchFp8(d)
            if "dense" in args.impls:  # (the ceilings: the layer's FLOPs as dense GEMMs, BF16 and E4M3)
                impls["dense"] = tb.Steps(tb.dense_step(p))
            if "dense-fp8" in args.impls:
                impls["dense-fp8"] = tb.Steps(tb.dense_fp8_step(p))
            if "dense-fp8-blockwise" in args.impls:  # (left out, named, where this PyTorch or shape cannot run it)
                steps = {}

                def first_step():  # (built and run once: either can fail)
                    steps.update(tb.dense_fp8_step(p, recipe="blockwise"))
                    steps["fwd+bwd"]()

                why = tb.cannot_run(first_step)
                if why is None:
                    impls["dense-fp8-blockwise"] = tb.Steps(steps)
                else:
                    print(f"clock_power: {name}: dense-fp8-blockwise left out: {why}")
            for prefix, server in servers.items():
                server.load(name, args.seed, d)
                for i in args.impls:
                    if i.startswith(prefix) and i[len(prefix):] in BENCH_IMPLS:
                        impls[i] = (server, i[len(prefix):])

            def run(impl, ps, iters):  # one queued timing of `iters` iterations: each one's ms
                if isinstance(impls[impl], tuple):
                    server, bench_impl = impls[impl]
                    return server.call("time-queued", ps, 0, iters, bench_impl)["ms"]
                fn, before = impls[impl].step(ps)
                return tb.time_ms(fn, 0, iters, before, queued=True)

            runnable = [(i, ps) for ps in args.passes for i in args.impls
                        if i in impls and not (i.split(":")[-1] in BWD_ONLY and ps != "fwd+bwd")]
            windows = {key: [] for key in runnable}
            for key in runnable:  # warm-up (compiles, workspaces) and each pass's time, for its iteration count
                run(*key, max(args.warmup, 1))
            per_iter = {key: statistics.median(run(*key, 3)) for key in runnable}
            for r in range(args.repeats):
                for impl, ps in round_order(runnable, r):
                    iters = max(3, int(args.seconds * 1e3 / per_iter[(impl, ps)]))
                    start = datetime.datetime.now()
                    ms = run(impl, ps, iters)
                    end = datetime.datetime.now()
                    time.sleep(2 * args.interval_ms / 1e3)  # (the last samples of the window reach the file)
                    stats = window_stats(sampler.samples(), start, end, args.skip_s)
                    windows[(impl, ps)].append((statistics.median(ms), stats))
                    clock = f"{stats['sm_mhz']:.0f} MHz, {stats['power_w']:.0f} W" if stats else "no samples"
                    print(f"{name:<16} {impl:<19} {ps:<8} round {r}: {statistics.median(ms):8.3f} ms  {clock}", flush=True)
                    time.sleep(1.0)  # (a gap between windows, as between layer_bench's timings)
            for (impl, ps), ws in windows.items():
                flops = tb.layer_flops(p, ps)
                rounds = [dict(ms=m, **s) for m, s in ws if s]
                if not rounds:
                    continue
                ms = statistics.median(w["ms"] for w in rounds)
                power = statistics.median(w["power_w"] for w in rounds)
                emit(dict(preset=name, impl=impl, **{"pass": ps}, routing=args.routings[0], ms=ms,
                          tflops=flops / (ms * 1e-3) / 1e12, sm_mhz=statistics.median(w["sm_mhz"] for w in rounds),
                          power_w=power, joules_per_tflop=joules_per_tflop(power, ms, flops), rounds=rounds,
                          seconds=args.seconds, skip_s=args.skip_s, interval_ms=args.interval_ms, gpu=gpu,
                          commit=args.commit, date=args.date, torch=torch.__version__))
            for obj in impls.values():
                if hasattr(obj, "release"):
                    obj.release()
            impls.clear()
            if any(i in args.impls for i in ("mok-py", "mok-fp8-py")):
                from mok import ops  # one workspace per shape: free this preset's before the next

                ops._workspaces.clear()
            torch.cuda.empty_cache()
    finally:
        sampler.close()
        for server in servers.values():
            server.close()
    print()
    print(f"{'preset':<16}{'impl':<20}{'pass':<9}{'ms':>9}{'TFLOP/s':>9}{'SM MHz':>8}{'W':>6}{'J/TFLOP':>9}  throttle reasons")
    for r in records:
        reasons = sorted({x for w in r["rounds"] for x in w["throttle_reasons"]})
        print(f"{r['preset']:<16}{r['impl']:<20}{r['pass']:<9}{r['ms']:9.3f}{r['tflops']:9.1f}{r['sm_mhz']:8.0f}"
              f"{r['power_w']:6.0f}{r['joules_per_tflop']:9.3f}  {' '.join(reasons)}")
    for line in head_ratios(records):
        print(line)


def head_ratios(records):
    """Lines 'preset pass impl: head/base time R (min–max over rounds)' for every head:<impl> record
    whose <impl> ran in the same rounds from the first build (its rounds' times, round by round)."""
    base = {(r["preset"], r["pass"], r["impl"]): r for r in records if not r["impl"].startswith("head:")}
    lines = []
    for r in records:
        b = base.get((r["preset"], r["pass"], r["impl"][len("head:"):])) if r["impl"].startswith("head:") else None
        if b is None:
            continue
        per_round = [h["ms"] / x["ms"] for h, x in zip(r["rounds"], b["rounds"])]
        lines.append(f"{r['preset']:<16}{r['pass']:<9}{r['impl'][len('head:'):]}: head/base time {r['ms'] / b['ms']:.3f} "
                     f"({min(per_round):.3f}–{max(per_round):.3f} over {len(per_round)} rounds)")
    return lines


if __name__ == "__main__":
    main()
