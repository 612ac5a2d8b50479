#!/usr/bin/env python3
"""Where an expert-parallel call's time goes, per kernel, on every rank (torch.profiler,
CUDA activity only): mok-ep (and mok-ep-ring{N}) beside mok-compute, the same inputs as
bench/ep_bench.py.

  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
  torchrun --standalone --nproc-per-node W bench/ep_profile.py [--preset deepseek-v3,...]
      [--routing uniform] [--ring-sms 8] [--iters 5] [--out FILE.json]

Per (preset, implementation, pass): each kernel's mean GPU time per call on each rank, the
sum of kernel times, and the wall time of the calls (CUDA events, ranks lined up before
each call). Kernels overlap nothing here (one stream), so the sum of kernel times against
the wall time shows the gaps between kernels; the fused kernel's time against
mok-compute's shows what the exchange inside it costs.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_baseline as tb  # noqa: E402
from ep_layers import MokCompute, MokEp, make_inputs  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def profile(fn, before, iters):
    """({kernel name: mean ms per call}, mean wall ms per call) of `iters` calls of fn."""
    for _ in range(2):  # warm-up (first calls set up workspaces and symmetric memory)
        if before:
            before()
        fn()
    torch.cuda.synchronize()
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if before:
                before()
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            walls.append(start.elapsed_time(end))
    kernels = {}
    for e in prof.key_averages():
        ms = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3 / iters
        if ms > 0 and e.key not in ("ProfilerStep*",) and not e.key.startswith("cudaDevice"):
            kernels[e.key] = kernels.get(e.key, 0.0) + ms
    return kernels, sorted(walls)[len(walls) // 2]


def short(name):
    """A kernel's name without its template and parameter lists."""
    for cut in ("(", "<"):
        name = name.split(cut)[0]
    return name.replace("mok::kernels::", "").replace("(anonymous namespace)::", "")[:48]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3,qwen3-30b-a3b")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--ring-sms", default="")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.update(NO_MULTICAST)
    import mok.ep

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = {"mok-ep": mok.ep.ExpertParallel()}
    for n in filter(None, args.ring_sms.split(",")):
        groups[f"mok-ep-ring{int(n)}"] = mok.ep.ExpertParallel(comm_sms=int(n))
    presets = tb.load_presets()
    records = []
    for name in args.preset.split(","):
        p = presets[name]
        for routing in args.routing.split(","):
            d = make_inputs(p, world, rank, routing, args.seed, torch.device("cuda", local_rank))
            impls = {impl: MokEp(d, g) for impl, g in groups.items()}
            impls["mok-compute"] = MokCompute(d)
            for impl, obj in impls.items():
                for ps in ("fwd", "fwd+bwd"):
                    fn, before = obj.step(ps)
                    kernels, wall = profile(fn, before, args.iters)
                    everyone = [None] * world
                    dist.all_gather_object(everyone, dict(kernels=kernels, wall_ms=wall))
                    rec = dict(preset=name, routing=routing, impl=impl, **{"pass": ps}, ep=world,
                               ranks=everyone, gpu=torch.cuda.get_device_name())
                    records.append(rec)
                    if rank == 0:
                        print(f"\n{name} {routing} {impl} {ps}: wall ms per rank "
                              + " ".join(f"{r['wall_ms']:.3f}" for r in everyone))
                        names = sorted(everyone[0]["kernels"], key=lambda k: -everyone[0]["kernels"][k])
                        for k in names[:8]:
                            print(f"  {short(k):<50}" + "".join(f"{r['kernels'].get(k, 0.0):>9.3f}" for r in everyone))
                        print(f"  {'sum of kernels':<50}" + "".join(f"{sum(r['kernels'].values()):>9.3f}"
                                                                     for r in everyone))
            for g in groups.values():
                g.release()
            del impls, d
            torch.cuda.empty_cache()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    dist.barrier()
    groups = None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
