#!/usr/bin/env python3
"""PyTorch baseline of the MoE layer and the dense-GEMM ceiling, in mok_bench's schema.

impl "torch": the path of DESIGN.md §7 — argsort -> gather -> torch._grouped_mm
[gate|up] -> SwiGLU -> torch._grouped_mm down -> weighted sum over the k slots;
fwd+bwd is autograd through the same path.
impl "dense": the layer's GEMMs as if every routed row went to one expert (the same six
GEMMs as mok_bench's dense impl), through torch.matmul: the ceiling.

Each preset is checked against an fp32 per-token computation before it is timed.
Usage: torch_baseline.py [--preset all|NAME,...] [--out FILE.json] [--iters N]
"""
import argparse
import csv
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


def load_presets(path=os.path.join(HERE, "presets.csv")):
    fields = ["name", "tokens", "hidden", "intermediate", "experts", "top_k",
              "shared_intermediate", "swiglu_limit", "model_experts", "model_ep", "note"]
    out = {}
    with open(path) as f:
        for row in csv.reader(line for line in f if line.strip() and not line.startswith("#")):
            p = dict(zip(fields, row))
            for key in fields[1:7] + fields[8:10]:
                p[key] = int(p[key])
            p["swiglu_limit"] = float(p["swiglu_limit"])
            out[p["name"]] = p
    return out


def layer_flops(p, pass_):
    """DESIGN.md's convention: forward = 6·H·(routed pairs)·I, forward+backward = 3x that."""
    return 6.0 * p["hidden"] * p["tokens"] * p["top_k"] * p["intermediate"] * (3 if pass_ == "fwd+bwd" else 1)


def add_run_args(ap, iters):
    """The options every benchmark script shares (output, iterations, provenance)."""
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--commit", default=os.environ.get("MOK_COMMIT", "unknown"))
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


def swiglu(g, u, limit):
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return F.silu(g) * u


def moe_torch(x, ids, weights, w_gate_up, w_down, limit):
    """The PyTorch MoE layer (no shared expert in the benchmark presets)."""
    T, k = ids.shape
    E, two_i, _ = w_gate_up.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x.index_select(0, order // k)
    gu = torch._grouped_mm(xs, w_gate_up.transpose(-2, -1), offs=offs)
    g, u = gu.split(two_i // 2, dim=-1)
    out = torch._grouped_mm(swiglu(g, u, limit), w_down.transpose(-2, -1), offs=offs)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = out.index_select(0, inverse).view(T, k, -1)
    return (per_slot.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def reference_rows(x, ids, weights, w_gate_up, w_down, limit, rows):
    """fp32, one token at a time, straight from the layer's definition."""
    I = w_down.shape[-1]
    out = []
    for t in rows.tolist():
        acc = torch.zeros(x.shape[1], device=x.device, dtype=torch.float32)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w_gate_up[e].float() @ x[t].float()
            acc += weights[t, j] * (w_down[e].float() @ swiglu(gu[:I], gu[I:], limit))
        out.append(acc)
    return torch.stack(out)


def time_ms(fn, warmup, iters, before=None):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # > 4x the 60 MB L2
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(iters):
        if before:
            before()
        flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times


def peak_bytes(fn, before=None):
    """Peak device memory one pass allocates above what was allocated before it."""
    if before:
        before()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def make_inputs(p, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, H, I, E, k = p["tokens"], p["hidden"], p["intermediate"], p["experts"], p["top_k"]
    dev = "cuda"
    x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
    ids = torch.rand(T, E, device=dev, generator=gen).topk(k, dim=1).indices.int()  # uniform, distinct
    weights = torch.softmax(torch.randn(T, k, device=dev, generator=gen), dim=1)
    w_gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=gen) / H ** 0.5).bfloat16()
    w_down = (torch.randn(E, H, I, device=dev, generator=gen) / I ** 0.5).bfloat16()
    dy = torch.randn(T, H, device=dev, generator=gen).bfloat16()
    return x, ids, weights, w_gate_up, w_down, dy


def bench_torch(p, args, record):
    x, ids, weights, w_gate_up, w_down, dy = make_inputs(p, seed=1)
    limit = p["swiglu_limit"]
    # Correctness first: sampled tokens against the fp32 per-token computation.
    rows = torch.randperm(p["tokens"], device="cuda")[:16]
    with torch.no_grad():
        y = moe_torch(x, ids, weights, w_gate_up, w_down, limit)
        ref = reference_rows(x, ids, weights, w_gate_up, w_down, limit, rows)
    err = ((y[rows].float() - ref).norm() / ref.norm()).item()
    if not err <= 1e-2:
        raise SystemExit(f"torch baseline wrong on {p['name']}: relative error {err:.3e}")
    del y

    params = [t.requires_grad_() for t in (x, weights, w_gate_up, w_down)]

    def clear_grads():
        for t in params:
            t.grad = None

    fwd = lambda: moe_torch(x, ids, weights, w_gate_up, w_down, limit)
    fwd_bwd = lambda: fwd().backward(dy)
    for name, fn, before in (("fwd", fwd, None), ("fwd+bwd", fwd_bwd, clear_grads)):
        times = time_ms(fn, args.warmup, args.iters, before)
        record(p, "torch", name, times, peak_bytes(fn, before), check_error=err)
    clear_grads()


def bench_dense(p, args, record):
    T, H, I, k = p["tokens"], p["hidden"], p["intermediate"], p["top_k"]
    M = T * k
    gen = torch.Generator(device="cuda").manual_seed(2)
    r = lambda *s: (torch.rand(*s, device="cuda", generator=gen) - 0.5).bfloat16()
    x, w1, w2, hid, dy, dgu = r(M, H), r(2 * I, H), r(H, I), r(M, I), r(M, H), r(M, 2 * I)

    def fwd():
        x @ w1.t()
        hid @ w2.t()

    def fwd_bwd():
        fwd()
        dy @ w2            # dgrad down
        dy.t() @ hid       # wgrad down
        dgu @ w1           # dgrad gate|up
        dgu.t() @ x        # wgrad gate|up

    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        record(p, "dense", name, time_ms(fn, args.warmup, args.iters), peak_bytes(fn))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="all")
    ap.add_argument("--impl", default="torch,dense")
    add_run_args(ap, iters=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_baseline: no CUDA GPU")
    presets = load_presets()
    names = [n for n, p in presets.items() if p["tokens"] >= 8192] if args.preset == "all" else args.preset.split(",")
    for n in names:
        if n not in presets:
            sys.exit(f"torch_baseline: unknown preset '{n}'; known: {', '.join(presets)}")
        if presets[n]["shared_intermediate"]:
            sys.exit(f"torch_baseline: preset '{n}' has a shared expert, which the baseline does not model")
    gpu = torch.cuda.get_device_name(0)
    records = []

    def record(p, impl, pass_, times, peak, check_error=None):
        ms = statistics.median(times)
        flops = layer_flops(p, pass_)
        rec = dict(preset=p["name"], impl=impl, **{"pass": pass_}, tokens=p["tokens"], ep=1, ms=ms,
                   ms_p10=times[len(times) // 10], ms_p90=times[len(times) * 9 // 10],
                   tflops=flops / (ms * 1e-3) / 1e12, peak_bytes=int(peak), gpu=gpu, commit=args.commit,
                   date=args.date, hidden=p["hidden"], intermediate=p["intermediate"], experts=p["experts"],
                   top_k=p["top_k"], routing="uniform", iters=args.iters, torch=torch.__version__)
        if check_error is not None:
            rec["check_rel_error"] = check_error
        records.append(rec)
        print(f"{p['name']:<16} {impl:<6} {pass_:<8} {ms:10.4f} ms {rec['tflops']:8.1f} TFLOP/s "
              f"peak {peak / 2**30:7.2f} GiB", flush=True)
        if args.out:  # rewritten after every record: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)

    for i, n in enumerate(names):
        print(f"[{i + 1}/{len(names)}] {n}", flush=True)
        for impl in args.impl.split(","):
            {"torch": bench_torch, "dense": bench_dense}[impl](presets[n], args, record)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
