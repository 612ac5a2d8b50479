#!/usr/bin/env python3
"""What could FP8 weight gradients gain on this GPU? (issue 19, before building them into the
fused backward.) Per preset, on uniform routing, the two routed weight-gradient GEMMs of one
backward —

    dW_down[e]      = dy[e]^T  (w h)[e]     (H x I, K = the expert's rows)
    [dW_gate|up][e] = [dg du][e]^T  x[e]    (2I x H)

— timed three ways in interleaved rounds:
  bf16       torch._grouped_mm over the rows (what mok's backward computes today, as a library GEMM);
  fp8-gemm   torch._scaled_grouped_mm on operands already in E4M3, transposed (K-major: the only
             layout Hopper's FP8 wgmma reads), rowwise scales per expert — no promotion at all, so
             an upper bound on any FP8 weight-gradient GEMM, DeepSeek's 1 x 128 recipe included;
  quantize   the passes that make those operands from the bf16 rows (dy, w h, dg|du, x), each
             scaled per 128 rows x 1 column (the recipe's) and transposed, under torch.compile:
             what a fused kernel would have to hide.
A fused FP8 weight gradient can save at most bf16 - fp8-gemm and costs at least part of quantize.

    python3 bench/fp8_wgrad_bound.py --preset deepseek-v3,mixtral-8x7b [--rounds 5] [--iters 10] [--out FILE.json]

Each timing is the median of torch_baseline.time_ms's iterations (the L2 flushed before each, as
layer_bench times). Each expert gets the same number of rows (T k / E rounded down to 128: uniform routing's mean).
The FP8 product is checked against the bf16 one (cosine >= 0.99) before timing.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline as tb  # noqa: E402

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_t(rows, block=128):
    """rows [R, N] bf16 -> (E4M3 [N, R], scales [R / block, N] fp32): per `block` rows x 1 column,
    transposed (the K-major operand of a weight-gradient GEMM whose K is the rows)."""
    R, N = rows.shape
    r = rows.float().view(R // block, block, N)
    scale = r.abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
    q = (r / scale.unsqueeze(1)).to(FP8).view(R, N)
    return q.t().contiguous(), scale


def quantize_all(dy, hw, dgu, x):
    return quantize_t(dy), quantize_t(hw), quantize_t(dgu), quantize_t(x)


def rowwise_t(rows, E):
    """rows [R, N] bf16 of E equal groups -> (E4M3 [N, R], scales [E * N]): one scale per group and
    column (the rowwise recipe _scaled_grouped_mm takes for K-grouped operands)."""
    R, N = rows.shape
    r = rows.float().view(E, R // E, N)
    scale = r.abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX  # [E, N]
    q = (r / scale.unsqueeze(1)).to(FP8).view(R, N)
    return q.t().contiguous(), scale.reshape(-1)


def run_preset(name, p, args):
    T, H, I, E, k = p["tokens"], p["hidden"], p["intermediate"], p["experts"], p["top_k"]
    per = max(128, T * k // E // 128 * 128)
    R = per * E
    g = torch.Generator(device="cuda").manual_seed(5)
    r = lambda *s: (torch.randn(*s, device="cuda", generator=g)).bfloat16()  # noqa: E731
    dy, hw, dgu, x = r(R, H), r(R, I), r(R, 2 * I), r(R, H)
    offs = torch.arange(per, R + 1, per, device="cuda", dtype=torch.int32)

    def bf16():
        return torch._grouped_mm(dy.t(), hw, offs=offs), torch._grouped_mm(dgu.t(), x, offs=offs)

    qa = [rowwise_t(t, E) for t in (dy, hw, dgu, x)]
    (dyq, dys), (hwq, hws), (dguq, dgus), (xq, xs) = qa

    def fp8_gemm():  # mat_a [M, K] row-major, mat_b [K, N] column-major (the K-major copy's view)
        return (torch._scaled_grouped_mm(dyq, hwq.t(), dys, hws, offs=offs, out_dtype=torch.bfloat16),
                torch._scaled_grouped_mm(dguq, xq.t(), dgus, xs, offs=offs, out_dtype=torch.bfloat16))

    quantize = torch.compile(quantize_all, dynamic=False, fullgraph=True)
    ref, got = bf16(), fp8_gemm()
    cos = [tb.compare(b, a)["cos"] for a, b in zip(ref, got)]
    if min(cos) < 0.99:
        sys.exit(f"fp8_wgrad_bound: {name}: FP8 products off the bf16 ones (cosine {cos})")
    variants = {"bf16": bf16, "fp8-gemm": fp8_gemm, "quantize": lambda: quantize(dy, hw, dgu, x)}
    times = {v: [] for v in variants}
    for rnd in range(args.rounds):
        order = list(variants)[rnd % 3:] + list(variants)[:rnd % 3]
        for v in order:
            times[v].append(statistics.median(tb.time_ms(variants[v], 1, args.iters)))
    flops = 2 * R * H * I * 3  # dW_down + dW_gate|up
    med = {v: statistics.median(t) for v, t in times.items()}
    row = {"preset": name, "rows_per_expert": per, "experts": E, "ms": med,
           "ms_rounds": times, "tflops": {v: flops / med[v] / 1e9 for v in ("bf16", "fp8-gemm")},
           "fp8_gemm_over_bf16": [b / a for a, b in zip(times["fp8-gemm"], times["bf16"])],
           "cosine_vs_bf16": cos}
    print(f"{name:16s} rows/expert {per:6d}  bf16 {med['bf16']:7.3f} ms ({row['tflops']['bf16']:5.0f} TFLOP/s)  "
          f"fp8 GEMMs {med['fp8-gemm']:7.3f} ms ({row['tflops']['fp8-gemm']:5.0f})  quantize+transpose {med['quantize']:6.3f} ms  "
          f"bf16/fp8 {statistics.median(row['fp8_gemm_over_bf16']):.3f}  at most saved {med['bf16'] - med['fp8-gemm']:.3f} ms")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="deepseek-v3,mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--meta", default="{}", help="JSON merged into the output (gpu, commit, date)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_wgrad_bound.py needs a CUDA GPU")
    presets = tb.load_presets()
    rows = []
    for name in args.preset.split(","):
        if name not in presets:
            sys.exit(f"fp8_wgrad_bound.py: unknown preset {name!r}")
        rows.append(run_preset(name, presets[name], args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**json.loads(args.meta), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rounds": args.rounds, "iters": args.iters, "timing": "median of tb.time_ms (L2 flushed)",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
