#!/usr/bin/env python3
"""mok.moe(..., precision="fp8") forward+backward from Python in three variants, in alternating
rounds on one GPU: the FP8 dgrad (mok.fp8.quantize_experts(..., dgrad=True)) with FP8 weight
gradients (mok.set_fp8_weight_gradients(True), the default) and with bf16 ones, and the same FP8
forward with the bf16 dgrad (quantize_experts(...)). Does Python's FP8 dgrad gain what
mok_bench's mok-fp8 / mok-fp8-bf16dgrad showed, where does mok.fp8.dgrad_pays hold, and what do
the FP8 weight gradients gain and cost in memory?

    python3 bench/fp8_dgrad_py.py --preset deepseek-v3,qwen3-30b-a3b [--rounds 5] [--iters 10] [--out FILE.json]

Per preset: the median over rounds of each variant's round median (ms), FP8 dgrad / bf16 dgrad and
FP8 / bf16 weight gradients paired by round (median, min-max), and each variant's step peak (GiB
above what was allocated before the step). Before timing, the variants' y must be bitwise equal
(the same forward), dx bitwise equal with either weight gradients, and close (cosine >= 0.995)
between the dgrads, as d_w_down between the weight gradients.
"""
import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import torch_baseline as tb  # noqa: E402


def problem(p, seed=1):
    T, H, I, E, k = p["tokens"], p["hidden"], p["intermediate"], p["experts"], p["top_k"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, sc=1.0: ((torch.rand(*s, device="cuda", generator=g) - 0.5) * sc).bfloat16()  # noqa: E731
    x = r(T, H).requires_grad_()
    gate, up = r(E, I, H, sc=H ** -0.5).requires_grad_(), r(E, I, H, sc=H ** -0.5).requires_grad_()
    down = r(E, H, I, sc=I ** -0.5).requires_grad_()
    ids, w = tb.make_routing(T, E, k, "uniform", seed, "cuda")
    return x, ids, w.requires_grad_(), gate, up, down, r(T, H)


VARIANTS = ("fp8-wgrad", "fp8-dgrad", "bf16-dgrad")  # (weight gradients: fp8, bf16, bf16)


def run_preset(name, p, args):
    """One preset's row: the variants checked, then timed in alternating rounds, then each one's
    peak memory over a step (from the allocator's level before it: the step's own bytes)."""
    import mok
    from mok import fp8

    x, ids, w, gate, up, down, dy = problem(p)
    with_dgrad = fp8.quantize_experts(gate, up, down, dgrad=True)
    experts = {"fp8-wgrad": with_dgrad, "fp8-dgrad": with_dgrad, "bf16-dgrad": fp8.quantize_experts(gate, up, down)}

    def step(kind):
        for t in (x, w, gate, up, down):
            t.grad = None
        mok.set_fp8_weight_gradients(kind == "fp8-wgrad")
        try:
            y = mok.moe(x, ids, w, gate, up, down, precision="fp8", fp8_experts=experts[kind])
            y.backward(dy)
        finally:
            mok.set_fp8_weight_gradients(True)  # (the default)
        return y

    outs = {}
    for kind in VARIANTS:
        y = step(kind)
        outs[kind] = (y.detach().clone(), x.grad.clone(), down.grad.clone())
    cos = lambda a, b: float((a.float() * b.float()).sum() / (a.float().norm() * b.float().norm()))  # noqa: E731
    (ya, dxa, _), (yb, dxb, dwb), (yc, dxc, _) = (outs[k] for k in VARIANTS)
    dx_cos, dw_cos = cos(dxb, dxc), cos(outs["fp8-wgrad"][2], dwb)
    if not (torch.equal(ya, yb) and torch.equal(yb, yc) and torch.equal(dxa, dxb)) or not min(dx_cos, dw_cos) >= 0.995:
        sys.exit(f"fp8_dgrad_py: {name}: y equal {torch.equal(ya, yb) and torch.equal(yb, yc)}, dx equal with fp8 "
                 f"weight gradients {torch.equal(dxa, dxb)}, dx cosine {dx_cos:.5f}, d_w_down cosine {dw_cos:.5f}")
    times = {kind: [] for kind in VARIANTS}
    for _ in range(args.rounds):
        for kind in VARIANTS:
            times[kind].append(statistics.median(tb.time_ms(lambda: step(kind), args.warmup, args.iters)))
    peak = {}
    for kind in VARIANTS:
        for t in (x, w, gate, up, down):
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(kind)
        torch.cuda.synchronize()
        peak[kind] = (torch.cuda.max_memory_allocated() - base) / 2**30
    mok.check()
    pair = lambda a, b: [u / v for u, v in zip(times[a], times[b])]  # noqa: E731
    ratio, wratio = pair("fp8-dgrad", "bf16-dgrad"), pair("fp8-wgrad", "fp8-dgrad")
    return dict(preset=name, intermediate=p["intermediate"], dgrad_pays=fp8.dgrad_pays(down), ms=times,
                dx_cosine=dx_cos, d_w_down_cosine=dw_cos, ratio_median=statistics.median(ratio),
                ratio_range=[min(ratio), max(ratio)], wgrad_ratio_median=statistics.median(wratio),
                wgrad_ratio_range=[min(wratio), max(wratio)], step_peak_gib=peak)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3,kimi-k2,mixtral-8x7b,glm-4.5,qwen3-30b-a3b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--meta", default="{}", help="JSON object merged into the output (commit, date)")
    args = ap.parse_args()
    presets = tb.load_presets()
    out = dict(json.loads(args.meta), gpu=torch.cuda.get_device_name(0), rounds=args.rounds, iters=args.iters, rows=[])
    for name in args.preset.split(","):
        row = run_preset(name, presets[name], args)
        out["rows"].append(row)
        ms = {k: statistics.median(v) for k, v in row["ms"].items()}
        gib = row["step_peak_gib"]
        print(f"{name:<18} I {row['intermediate']:>6}  ms fp8 wgrad / fp8 dgrad / bf16 dgrad {ms['fp8-wgrad']:8.3f} "
              f"{ms['fp8-dgrad']:8.3f} {ms['bf16-dgrad']:8.3f}  fp8 dgrad / bf16 dgrad {row['ratio_median']:.3f} "
              f"[{row['ratio_range'][0]:.3f}, {row['ratio_range'][1]:.3f}]  fp8 wgrad / fp8 dgrad "
              f"{row['wgrad_ratio_median']:.3f} [{row['wgrad_ratio_range'][0]:.3f}, {row['wgrad_ratio_range'][1]:.3f}]  "
              f"step peak GiB {gib['fp8-wgrad']:.2f} / {gib['fp8-dgrad']:.2f} / {gib['bf16-dgrad']:.2f}  "
              f"dgrad_pays {row['dgrad_pays']}", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
