#!/usr/bin/env python3
"""Expert parallelism across the GPUs of one node, under torchrun, in mok_bench's schema.

  torchrun --standalone --nproc-per-node W bench/ep_bench.py [--preset NAME,...] [--iters N] [--out FILE.json]

Every rank holds a preset's per-rank share (presets.csv): T tokens routed uniformly
(distinct top-k) over E = experts x W experts, of which it holds E_l = experts. Timed on
the same inputs, forward and forward+backward:
  mok-ep    mok.ep.moe: the fused kernels with the exchange, pull and push between ranks
  torch-ep  mok.moe_torch_ep: NCCL all_to_all_single dispatch/combine around torch._grouped_mm
            (the NCCL + PyTorch baseline; split sizes go through the host)
  mok       mok.moe on this rank's rows alone (T tokens over its E_l experts, no
            communication): the compute the EP layer cannot go below
A record's time is the slowest rank's median (the layer waits for it). mok-ep is checked
against torch-ep on every rank before timing. Keep NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (no NVLink multicast).
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_baseline import add_run_args, layer_flops, load_presets, time_ms  # noqa: E402

import mok  # noqa: E402
import mok.ep  # noqa: E402


def make_inputs(p, world, rank, device):
    """This rank's tokens and experts of one global problem (seeded by rank)."""
    T, H, I, E_l, k = p["tokens"], p["hidden"], p["intermediate"], p["experts"], p["top_k"]
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(T, H, device=device, generator=gen).bfloat16()
    ids = torch.rand(T, E_l * world, device=device, generator=gen).topk(k, dim=1).indices.int()
    weights = torch.softmax(torch.randn(T, k, device=device, generator=gen), dim=1)
    gate = (torch.randn(E_l, I, H, device=device, generator=gen) / H ** 0.5).bfloat16()
    up = (torch.randn(E_l, I, H, device=device, generator=gen) / H ** 0.5).bfloat16()
    down = (torch.randn(E_l, H, I, device=device, generator=gen) / I ** 0.5).bfloat16()
    dy = torch.randn(T, H, device=device, generator=gen).bfloat16()
    return x, ids, weights, gate, up, down, dy


def bench_preset(p, args, world, rank, group, device):
    x, ids, weights, gate, up, down, dy = make_inputs(p, world, rank, device)
    limit = p["swiglu_limit"] or None
    E_l = p["experts"]
    layers = {
        "mok-ep": lambda *t: mok.ep.moe(*t, swiglu_limit=limit, group=group),
        "torch-ep": lambda *t: mok.moe_torch_ep(*t, swiglu_limit=limit),
        # this rank's rows over its own experts: the same GEMM work, no communication
        "mok": lambda x_, ids_, *t: mok.moe(x_, ids_ % E_l, *t, swiglu_limit=limit),
    }
    with torch.no_grad():  # the two EP paths agree before anything is timed
        y_mok = layers["mok-ep"](x, ids, weights, gate, up, down)
        y_torch = layers["torch-ep"](x, ids, weights, gate, up, down)
        group.check()
        err = ((y_mok.float() - y_torch.float()).norm() / y_torch.float().norm()).item()
    errors = [None] * world
    dist.all_gather_object(errors, err)
    if not max(errors) <= 1e-2:
        raise SystemExit(f"ep_bench: mok-ep and torch-ep differ on {p['name']}: relative errors {errors}")
    del y_mok, y_torch

    params = [t.requires_grad_() for t in (x, weights, gate, up, down)]

    def clear_grads():
        for t in params:
            t.grad = None

    records = []
    for impl, layer in layers.items():
        fwd = lambda: layer(x, ids, weights, gate, up, down)
        for pass_, fn, before in (("fwd", lambda: (fwd(), None)[1], None),
                                  ("fwd+bwd", lambda: fwd().backward(dy), clear_grads)):
            def synced_before():  # every rank starts each iteration together
                if before:
                    before()
                dist.barrier()

            with torch.no_grad() if pass_ == "fwd" else torch.enable_grad():
                times = time_ms(fn, args.warmup, args.iters, synced_before)
            if impl == "mok-ep":
                group.check()
            mine = (statistics.median(times), times[len(times) // 10], times[-1 - len(times) // 10])
            all_ranks = [None] * world
            dist.all_gather_object(all_ranks, mine)
            ms, p10, p90 = max(all_ranks)  # the slowest rank's median (and its spread)
            records.append(dict(preset=p["name"], impl=impl, **{"pass": pass_}, tokens=p["tokens"], ep=world, ms=ms,
                                ms_p10=p10, ms_p90=p90, tflops=layer_flops(p, pass_) / (ms * 1e-3) / 1e12, peak_bytes=None,
                                hidden=p["hidden"], intermediate=p["intermediate"], experts=E_l, top_k=p["top_k"],
                                routing="uniform", iters=args.iters, check_error=max(errors),
                                rank_ms=[r[0] for r in all_ranks]))
            if rank == 0:
                print(f"{p['name']:<16} {impl:<9} {pass_:<8} {ms:10.4f} ms {records[-1]['tflops']:8.1f} TFLOP/s per GPU",
                      flush=True)
    clear_grads()
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3,qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b")
    add_run_args(ap, iters=10)
    args = ap.parse_args()
    if "RANK" not in os.environ:
        sys.exit("ep_bench: run it under torchrun (torchrun --standalone --nproc-per-node W bench/ep_bench.py)")
    if not torch.cuda.is_available():
        sys.exit("ep_bench: no CUDA GPU")
    presets = load_presets()
    names = args.preset.split(",")
    for n in names:
        if n not in presets:
            sys.exit(f"ep_bench: unknown preset '{n}'; known: {', '.join(presets)}")
        if presets[n]["shared_intermediate"]:
            sys.exit(f"ep_bench: preset '{n}' has a shared expert, which the benchmark does not model")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = mok.ep.ExpertParallel()
    gpu = torch.cuda.get_device_name(device)
    records = []
    try:
        for n in names:
            records += bench_preset(presets[n], args, world, rank, group, device)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        for r in records:
            r.update(gpu=f"{world}x {gpu}", commit=args.commit, date=args.date)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
        by = {(r["preset"], r["impl"], r["pass"]): r["ms"] for r in records}
        print(f"\nEP = {world} ({gpu}): time ratios, same run")
        print(f"{'preset':<16} {'torch-ep/mok-ep fwd':>20} {'fwd+bwd':>8} {'mok-ep/mok fwd':>15} {'fwd+bwd':>8}")
        for n in names:
            ratio = lambda a, b, s: by[(n, a, s)] / by[(n, b, s)]
            print(f"{n:<16} {ratio('torch-ep', 'mok-ep', 'fwd'):>20.2f} {ratio('torch-ep', 'mok-ep', 'fwd+bwd'):>8.2f} "
                  f"{ratio('mok-ep', 'mok', 'fwd'):>15.2f} {ratio('mok-ep', 'mok', 'fwd+bwd'):>8.2f}")


if __name__ == "__main__":
    main()
