#!/usr/bin/env python3
"""mok.moe(..., precision="fp8") forward+backward from Python with the FP8 dgrad
(mok.fp8.quantize_experts(..., dgrad=True)) against the same FP8 forward with the bf16 dgrad
(quantize_experts(...)), in alternating rounds on one GPU: does Python's FP8 dgrad gain what
mok_bench's mok-fp8 / mok-fp8-bf16dgrad showed, and where does mok.fp8.dgrad_pays hold?

    python3 bench/fp8_dgrad_py.py --preset deepseek-v3,qwen3-30b-a3b [--rounds 5] [--iters 10] [--out FILE.json]

Per preset: the median over rounds of each variant's round median (ms), and FP8 dgrad / bf16
dgrad paired by round (median, min-max). Before timing, the two variants' y must be bitwise
equal (the same forward) and their dx close (cosine >= 0.995: the E4M3 dgrad's error).
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


def run_preset(name, p, args):
    """One preset's row: both variants checked, then timed in alternating rounds."""
    import mok
    from mok import fp8

    x, ids, w, gate, up, down, dy = problem(p)
    experts = {"fp8-dgrad": fp8.quantize_experts(gate, up, down, dgrad=True),
               "bf16-dgrad": fp8.quantize_experts(gate, up, down)}

    def step(kind):
        for t in (x, w, gate, up, down):
            t.grad = None
        y = mok.moe(x, ids, w, gate, up, down, precision="fp8", fp8_experts=experts[kind])
        y.backward(dy)
        return y

    outs = {}
    for kind in experts:
        y = step(kind)
        outs[kind] = (y.detach().clone(), x.grad.clone())
    (ya, dxa), (yb, dxb) = outs["fp8-dgrad"], outs["bf16-dgrad"]
    cos = float((dxa.float() * dxb.float()).sum() / (dxa.float().norm() * dxb.float().norm()))
    if not torch.equal(ya, yb) or not cos >= 0.995:
        sys.exit(f"fp8_dgrad_py: {name}: y equal {torch.equal(ya, yb)}, dx cosine {cos:.5f}")
    times = {kind: [] for kind in experts}
    for _ in range(args.rounds):
        for kind in experts:
            times[kind].append(statistics.median(tb.time_ms(lambda: step(kind), args.warmup, args.iters)))
    mok.check()
    ratio = [a / b for a, b in zip(times["fp8-dgrad"], times["bf16-dgrad"])]
    return dict(preset=name, intermediate=p["intermediate"], dgrad_pays=fp8.dgrad_pays(down), ms=times,
                dx_cosine=cos, ratio_median=statistics.median(ratio), ratio_range=[min(ratio), max(ratio)])


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
        print(f"{name:<18} I {row['intermediate']:>6}  fp8 dgrad {statistics.median(row['ms']['fp8-dgrad']):8.3f} ms  "
              f"bf16 dgrad {statistics.median(row['ms']['bf16-dgrad']):8.3f} ms  ratio {row['ratio_median']:.3f} "
              f"[{row['ratio_range'][0]:.3f}, {row['ratio_range'][1]:.3f}]  dgrad_pays {row['dgrad_pays']}", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
