#!/usr/bin/env python3
"""mok.MoE(precision="fp8") under torch.compile(fullgraph=True): what a compiled training loop
pays a step, with the quantized weights kept across calls (since 2026-12-05: quantized again in
place, once an optimizer step, and the FP8 dgrad and weight gradients where mok.fp8.dgrad_pays)
against the behaviour before (the compiled call quantizing its forward's weights itself, the
dgrad and weight gradients in bf16: the same module holding no copy, `_fp8_cache = None`),
beside the eager FP8 module and the bf16 module compiled.

  fp8_compiled_module.py [--preset deepseek-v3,mixtral-8x7b] [--micro 1,4] [--rounds 3] [--iters 5]
                         [--warmup 2] [--out FILE.json]

A step: `micro` forward+backward passes of the preset's problem (router None: the preset's
routing; the same inputs each pass), the weight gradients accumulated, then
mok.fp8.weights_changed() — what a torch.optim step does to the kept copies (the optimizer's own
time, the same for every variant, left out). Timed queued (tb.time_ms: no idling between steps),
the L2 flushed before each; each round runs every variant once, in an order rotated by the round.
Checked before timing: the kept compiled step's y, dx and weight gradients are the bits of the eager
module's (both take the FP8 dgrad where it pays); the per-call variant's are only finite (its bf16
dgrad differs by design); and a step of two micro-batches quantizes the weights once with the kept
copy, twice without (counted at mok.fp8_layer._quantize_into, which every quantization goes
through) — so a kept variant that silently fell back to the per-call path fails the run also where
the dgrad stays bf16 (I < 1024). Each record is written to --out as it is measured (a run cut short
keeps what it measured).
"""
import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_baseline as tb  # noqa: E402

VARIANTS = ("fp8-compiled", "fp8-compiled-per-call", "fp8-eager", "bf16-compiled")


def make_module(p, d, precision):
    import mok

    m = mok.MoE(p["hidden"], p["intermediate"], p["experts"], p["top_k"], router=None,
                shared_intermediate=p["shared_intermediate"], swiglu_limit=d["limit"], precision=precision,
                device="cuda")
    with torch.no_grad():
        for name, src in (("w_gate", d["w_gate"]), ("w_up", d["w_up"]), ("w_down", d["w_down"])):
            getattr(m, name).copy_(src)
        if d["shared"] is not None:
            for w, src in zip(m.shared, d["shared"]):
                w.copy_(src)
    return m


def step_fn(module, call, d, micro):
    """One training step's work on `module` through `call` (the module or its compiled form)."""
    import mok

    x = d["x"].detach().clone().requires_grad_()

    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        for _ in range(micro):
            call(x, d["ids"], d["weights"]).backward(d["dy"])
        mok.fp8.weights_changed()
    return step, x


def outputs(module, call, d):
    x = d["x"].detach().clone().requires_grad_()
    for p in module.parameters():
        p.grad = None
    y = call(x, d["ids"], d["weights"])
    y.backward(d["dy"])
    got = {"y": y.detach(), "dx": x.grad}
    got.update({n: getattr(module, n).grad for n in ("w_gate", "w_up", "w_down")})
    for p in module.parameters():
        p.grad = None
    return got


def quantizations_a_step(module, call, d, micro=2):
    """How many times one step of `micro` micro-batches quantizes weights (the step's work as
    step_fn's, synchronised), after an optimizer step's mok.fp8.weights_changed()."""
    import mok.fp8
    from mok import fp8_layer

    mok.fp8.weights_changed()

    made = []
    quantize_into = fp8_layer._quantize_into
    fp8_layer._quantize_into = lambda *args: made.append(1) or quantize_into(*args)
    try:
        step_fn(module, call, d, micro)[0]()
        torch.cuda.synchronize()
    finally:
        fp8_layer._quantize_into = quantize_into
    return len(made)


def write(out, records, checks):
    if out:
        with open(out, "w") as f:
            json.dump(dict(records=records, checks=checks), f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3,mixtral-8x7b")
    ap.add_argument("--micro", default="1,4", help="comma-separated micro-batches an optimizer step")
    ap.add_argument("--rounds", type=int, default=3)
    tb.add_run_args(ap, iters=5)
    ap.set_defaults(warmup=2)
    args = ap.parse_args()
    import mok
    import mok.fp8

    tb.configure_compile()
    presets = tb.load_presets()
    gpu = torch.cuda.get_device_name()
    records, checks = [], {}
    for name in args.preset.split(","):
        p = presets[name]
        d = tb.make_inputs(p, "uniform", seed=1)
        modules = {v: make_module(p, d, "bf16" if v.startswith("bf16") else "fp8") for v in VARIANTS}
        modules["fp8-compiled-per-call"]._fp8_cache = None  # (no copy: cached_experts gives None when compiled)
        calls = {v: (m if v == "fp8-eager" else torch.compile(m, fullgraph=True)) for v, m in modules.items()}
        kept, eager = outputs(modules["fp8-compiled"], calls["fp8-compiled"], d), outputs(modules["fp8-eager"],
                                                                                      calls["fp8-eager"], d)
        per_call = outputs(modules["fp8-compiled-per-call"], calls["fp8-compiled-per-call"], d)
        checks[name] = dict(
            kept_equals_eager={k: bool(torch.equal(kept[k], eager[k])) for k in kept},
            per_call_finite={k: bool(torch.isfinite(v.float()).all()) for k, v in per_call.items()},
            fp8_dgrad=bool(modules["fp8-compiled"]._fp8_cache.dgrad() is not None),
            quantizations_a_step_of_two={v: quantizations_a_step(modules[v], calls[v], d)
                                         for v in ("fp8-compiled", "fp8-compiled-per-call", "fp8-eager")})
        print(f"{name}: checks {json.dumps(checks[name])}", flush=True)
        write(args.out, records, checks)
        del kept, eager, per_call
        flops = tb.layer_flops(p, "fwd+bwd")
        for micro in (int(m) for m in args.micro.split(",")):
            steps = {v: step_fn(modules[v], calls[v], d, micro)[0] for v in VARIANTS}
            times = {v: [] for v in VARIANTS}
            for r in range(args.rounds):
                order = list(VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)])
                for v in order:
                    times[v].append(statistics.median(tb.time_ms(steps[v], args.warmup, args.iters, queued=True)))
            for v in VARIANTS:
                ms = statistics.median(times[v])
                rec = dict(preset=name, micro=micro, impl=v, ms=ms, ms_repeats=times[v],
                           tflops=flops * micro / (ms * 1e-3) / 1e12, gpu=gpu, commit=args.commit, date=args.date)
                records.append(rec)
            write(args.out, records, checks)
            base = times["fp8-compiled-per-call"]
            for v in ("fp8-compiled", "fp8-eager", "bf16-compiled"):
                ratios = [b / a for a, b in zip(times[v], base)]
                print(f"{name:16s} micro {micro}: per-call / {v:14s} {statistics.median(ratios):.3f} "
                      f"[{min(ratios):.3f}, {max(ratios):.3f}]  ({statistics.median(times[v]):.2f} ms a step)",
                      flush=True)
        del modules, calls, steps, d
        torch.cuda.empty_cache()
    print("checks:", json.dumps(checks))
    print(f"{'preset':16s} {'micro':>5s} " + " ".join(f"{v:>22s}" for v in VARIANTS) + "   (TFLOP/s)")
    for name in args.preset.split(","):
        for micro in sorted({r["micro"] for r in records if r["preset"] == name}):
            row = {r["impl"]: r["tflops"] for r in records if r["preset"] == name and r["micro"] == micro}
            print(f"{name:16s} {micro:5d} " + " ".join(f"{row[v]:22.1f}" for v in VARIANTS))
    print(f"torch {torch.__version__}, {gpu}")
    write(args.out, records, checks)
    once = {"fp8-compiled": 1, "fp8-compiled-per-call": 2, "fp8-eager": 1}
    ok = all(all(c["kept_equals_eager"].values()) and all(c["per_call_finite"].values())
             and c["quantizations_a_step_of_two"] == once for c in checks.values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
