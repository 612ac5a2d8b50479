"""The dense ceilings a grouped MoE layer is measured against, on this GPU: the layer's two
GEMM shapes as single dense GEMMs (all routed rows through one expert), in BF16 (torch.matmul)
and in FP8 E4M3 with row-wise scales (torch._scaled_mm, fp32 scales per row of A and column
of B, bf16 out: the fastest FP8 path PyTorch offers on sm_90). Prints TFLOP/s per shape.

    python3 bench/dense_ceiling.py [--preset deepseek-v3,qwen3-30b-a3b] [--iters 20]
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_baseline import load_presets  # noqa: E402


def timed(fn, iters):
    for _ in range(3):
        fn()
    ms = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3,qwen3-30b-a3b")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"{'preset':16} {'gemm':6} {'M':>7} {'N':>6} {'K':>6} {'bf16':>8} {'fp8':>8} {'fp8/bf16':>8}")
    presets = load_presets()
    for name in args.preset.split(","):
        if name not in presets:
            sys.exit(f"dense_ceiling.py: unknown preset {name!r} (bench/presets.csv: {', '.join(presets)})")
        p = presets[name]
        rows = p["tokens"] * p["top_k"]
        for gemm, (n, k) in (("gemm1", (2 * p["intermediate"], p["hidden"])), ("gemm2", (p["hidden"], p["intermediate"]))):
            a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            flop = 2.0 * rows * n * k
            t16 = timed(lambda: a @ b.t(), args.iters)
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            sa = torch.ones(rows, 1, device="cuda", dtype=torch.float32)
            sb = torch.ones(1, n, device="cuda", dtype=torch.float32)
            t8 = timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), args.iters)
            print(f"{name:16} {gemm:6} {rows:7d} {n:6d} {k:6d} {flop / t16 / 1e9:8.1f} {flop / t8 / 1e9:8.1f} {t16 / t8:8.2f}")


if __name__ == "__main__":
    main()
