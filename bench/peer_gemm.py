"""PyTorch's FP8 GEMM on bench/fp8_gemm_clocks.py's shape and bytes, called a few times: the process
Nsight Compute profiles when it looks at cuBLAS's kernels beside ours (scripts/ncu_peer_gemm.sh,
scripts/ncu_tile_rate.sh --peers).

    peer_gemm.py rowwise|blockwise [--m 8192 --n 4096 --k 7168] [--calls 4]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", choices=("rowwise", "blockwise"))
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    import torch

    import torch_baseline as tb
    from fp8_gemm_clocks import tile_bytes

    gemm = tb.fp8_gemm(tile_bytes(args.m, args.k, torch), tile_bytes(args.n, args.k, torch), args.recipe)
    for _ in range(args.calls):
        gemm()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
