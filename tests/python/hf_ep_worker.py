"""One process of the Hugging Face expert-parallel test (run by test_hf.py under torchrun, gloo
on the CPU): a tiny saved MoE model loaded with transformers' expert parallelism
(DistributedConfig(ep_size=2, ...), its experts sharded, its router marking other ranks' slots
with a sentinel id) and the "mok_torch" experts implementation, against the same model loaded
whole with transformers' eager experts: logits and every expert weight gradient (this rank's
shard against the whole model's slice). Exits non-zero on a mismatch.

    python -m torch.distributed.run --nproc-per-node 2 hf_ep_worker.py MODEL_DIR all_reduce|all_to_all|tp

(all_reduce, all_to_all: DistributedConfig(ep_size=...) of transformers >= 5.2x; tp: the expert
parallelism of earlier 5.x, DistributedConfig(tp_size=W, enable_expert_parallel=True).)"""

import os
import sys

import torch
import torch.distributed as dist
import transformers
from transformers.distributed import DistributedConfig

import mok.hf


def main():
    path, implementation = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mok.hf.register()
    if implementation == "all_reduce":  # (every rank holds the batch: the EP group is the TP group)
        config = DistributedConfig(tp_size=world, tp_plan={}, ep_size=world, ep_implementation="all_reduce")
    elif implementation == "all_to_all":
        config = DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation="all_to_all")
    else:
        config = DistributedConfig(tp_size=world, enable_expert_parallel=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    whole = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", dtype=torch.float32)
    want = whole(ids).logits
    want.pow(2).mean().backward()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="mok_torch",
                                                              dtype=torch.float32, distributed_config=config)
    got = model(ids).logits
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    got.pow(2).mean().backward()
    failures = []
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        failures.append(f"rank {rank}: logits differ by {(got - want).abs().max().item():.3g}")
    whole_params = dict(whole.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if "experts" not in name:
            continue
        experts = getattr(p, "to_local", lambda: p)().shape[0]
        if experts == whole_params[name].shape[0]:
            failures.append(f"rank {rank}: {name} is not sharded ({experts} experts)")
            continue
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        ref = whole_params[name].grad[rank * experts:(rank + 1) * experts]
        checked += 1
        if not torch.allclose(grad, ref, rtol=1e-4, atol=1e-7):
            failures.append(f"rank {rank}: {name} gradient differs by {(grad - ref).abs().max().item():.3g}")
    if checked == 0:
        failures.append(f"rank {rank}: no expert gradient was checked")
    dist.destroy_process_group()
    if failures:
        print("\n".join(failures), file=sys.stderr)
    else:
        print(f"rank {rank} of {world} ({implementation}): logits and {checked} expert gradients match the whole model")
    # (gloo: leave without the interpreter's teardown, where its worker threads can abort the
    # process — pytorch/pytorch#179291, tests/python/process_group.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failures else 0)


if __name__ == "__main__":
    main()
