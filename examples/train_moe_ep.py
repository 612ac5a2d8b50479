#!/usr/bin/env python3
"""Expert-parallel training of train_moe_lm.py's small MoE language model, one process per GPU
under torchrun. Each of the W ranks holds E / W experts of every MoE layer (mok.MoE(group=...))
and a batch of its own; the rest of the model is replicated and its gradients averaged over the
ranks (data parallelism). Each rank's experts get, from the EP backward, the gradient of every
rank's tokens routed to them; it is divided by W like the averaged ones, so that the language-model
loss's update is the one-process update of its mean over all ranks' batches. (The router's
load-balancing loss is each rank's over its own tokens, averaged over the ranks — per micro-batch,
as Megatron's default — not the whole batch's: its gradient differs from one process's by ~5e-4
relative on the tiny model.)

    torchrun --nproc-per-node 8 examples/train_moe_ep.py                 # Hopper GPUs: mok.ep's fused kernels
    torchrun --nproc-per-node 8 examples/train_moe_ep.py --precision fp8 # the routed experts in FP8
    torchrun --nproc-per-node 8 examples/train_moe_ep.py --recompute     # no pre-activations kept
    torchrun --nproc-per-node 2 examples/train_moe_ep.py --backend torch --device cpu --size tiny --steps 40 --check

--backend mok: the fused EP kernels (pull dispatch and push combine through PyTorch symmetric
memory; every call padded to one token count, mok.ep.ExpertParallel(tokens=...)); torch:
mok.moe_torch_ep, the same expert split in plain PyTorch (all-to-all), on any device (gloo on
CPUs). The model starts as the whole model of one process would (the same seed), split: rank r
keeps experts [r E / W, (r + 1) E / W). --check: at step 0 (which then trains on the language-model
loss alone) the ranks' mean loss and their synchronised gradients must equal the whole model's
over every rank's batch, computed in each process. Exits non-zero if that check fails or the loss
does not fall.
"""

import argparse
import math
import os
import sys
import time

# (expert parallelism on GPUs: NVLink multicast stays off)
for _name in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_moe_lm import SIZES, MarkovData, MoeLM, add_run_args, learning_rate, lm_loss, run_args  # noqa: E402

import mok  # noqa: E402
import mok.ep  # noqa: E402

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_gate_up", "w_down")  # (a mok.MoE's routed experts)


def is_expert(name):
    return ".moe." in name and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def split_model(c, backend, device, dtype, group, seed, precision="bf16", recompute=False):
    """The whole model's initialisation (every expert; the same on every rank), and this rank's
    share of it: the replicated parameters as they are, experts [r E_l, (r + 1) E_l) of each
    MoE layer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    whole = MoeLM(c, "torch" if backend == "torch" else "mok", device, dtype, precision)
    mine = MoeLM(c, backend, device, dtype, precision, group=group, recompute=recompute)
    experts_here = c["experts"] // world
    whole_params = dict(whole.named_parameters())
    with torch.no_grad():
        for name, p in mine.named_parameters():
            src = whole_params[name]
            p.copy_(src[rank * experts_here:(rank + 1) * experts_here] if is_expert(name) else src)
    return whole, mine


def sync_gradients(model, world):
    """The replicated parameters' gradients averaged over the ranks; the experts' (each rank's
    own, holding every rank's tokens) divided by W alike."""
    replicated = [p.grad for n, p in model.named_parameters() if p.grad is not None and not is_expert(n)]
    flat = torch.cat([g.reshape(-1) for g in replicated])
    dist.all_reduce(flat)
    offset = 0
    for g in replicated:
        g.copy_(flat[offset:offset + g.numel()].view_as(g) / world)
        offset += g.numel()
    for n, p in model.named_parameters():
        if p.grad is not None and is_expert(n):
            p.grad.div_(world)


def clip_gradients(model, max_norm):
    """Clips the gradients' global norm (over every rank's experts and the replicated rest) to
    max_norm; returns the norm."""
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (replicated, this rank's experts): one sync a step
    for n, p in model.named_parameters():
        if p.grad is not None:
            sums[int(is_expert(n))] += p.grad.double().pow(2).sum()
    experts = sums[1:].clone()
    dist.all_reduce(experts)
    norm = math.sqrt(float(sums[0] + experts[0]))
    if max_norm > 0 and norm > max_norm:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def check_step(model, whole, batch, c, mean, dtype, rank, world):
    """--check at step 0: the ranks' mean loss and the synchronised gradients against the whole
    model's loss over every rank's batch and its gradients (this rank's experts: their slice)."""
    loss, _ = lm_loss(whole, *batch)
    loss.backward()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    agrees = abs(mean - float(loss)) <= tolerance * abs(float(loss))
    whole_params = dict(whole.named_parameters())
    experts_here = c["experts"] // world
    worst, worst_name = 0.0, None
    for name, p in model.named_parameters():
        want = whole_params[name].grad
        if want is None or p.grad is None:
            continue
        if is_expert(name):
            want = want[rank * experts_here:(rank + 1) * experts_here]
        diff = float((p.grad.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
        if diff > worst:
            worst, worst_name = diff, name
    grads_agree = worst <= (1e-3 if dtype == torch.float32 else 5e-2)
    verdict = torch.tensor([float(agrees and grads_agree)], device=next(model.parameters()).device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"step 0: mean loss over the ranks {mean:.6f}, the whole model's in one process {float(loss):.6f}; "
              f"gradients' largest relative difference {worst:.2e} (rank 0{', ' + worst_name if worst_name else ''}) — "
              f"{'agree' if verdict.item() == 1.0 else 'DIFFER'}")
    return verdict.item() == 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("mok", "torch"), default="mok")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="the routed experts on the mok backend: fp8 = E4M3 forward (and, where mok.fp8.dgrad_pays, "
                         "the FP8 dgrad and weight gradients), bitwise equal to one GPU's FP8 layer")
    ap.add_argument("--recompute", action="store_true",
                    help="mok.MoE(recompute=True): the layers keep no pre-activations for the backward, which runs "
                         "GEMM1 again (bf16, --backend mok; the same bits)")
    add_run_args(ap)
    ap.add_argument("--check", action="store_true", help="step 0's loss against the whole model's in one process")
    args = run_args(ap)
    device = torch.device(args.device)
    if args.backend == "mok" and device.type != "cuda":
        ap.error("--backend mok needs Hopper GPUs (--device cuda); use --backend torch on CPUs")
    if args.precision == "fp8" and args.backend != "mok":
        ap.error("--precision fp8 runs on the fused kernels (--backend mok)")
    if args.recompute and (args.backend != "mok" or args.precision != "bf16"):
        ap.error("--recompute runs on the fused bf16 kernels (--backend mok --precision bf16)")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    c = SIZES[args.size]
    if c["experts"] % world:
        ap.error(f"{world} ranks do not divide the {c['experts']} experts of --size {args.size}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = c["batch"] * c["seq"]
    # (the fused kernels: every call padded to this rank's batch of tokens, one EpRank per layer shape)
    group = mok.ep.ExpertParallel(tokens=tokens if args.backend == "mok" else None)
    whole, model = split_model(c, args.backend, device, dtype, group, args.seed, args.precision, args.recompute)
    if not args.check:
        del whole
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = MarkovData(c["vocab"], args.seed, device)  # (the same chain and batches on every rank)
    batches = data.batches(args.steps, c["batch"] * world, c["seq"])
    mine = slice(rank * c["batch"], (rank + 1) * c["batch"])
    if rank == 0:
        print(f"{args.size}: {world} ranks x {c['experts'] // world} of {c['experts']} experts, "
              f"{c['batch']}x{c['seq']} tokens a rank a step, backend {args.backend} ({args.precision}"
              f"{', recompute' if args.recompute else ''}), on {device.type}")
    losses, ok, seconds = [], True, 0.0
    for step in range(args.steps):
        inputs, targets = (t[mine] for t in batches[step])
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, balance = lm_loss(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        checking = step == 0 and args.check  # (step 0 of --check: the loss alone, comparable with the whole model's)
        (loss if checking else loss + args.balance * balance).backward()
        sync_gradients(model, world)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = float(mean) / world
        if checking:
            ok = check_step(model, whole, batches[0], c, mean, dtype, rank, world) and ok
            del whole
        clip_gradients(model, args.clip)
        opt.step()
        seconds += time.perf_counter() - start
        losses.append(mean)
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean:.4f}  tokens/s {(step + 1) * tokens * world / seconds:,.0f}", flush=True)
    if args.backend == "mok":
        mok.check()
    final = sum(losses[-10:]) / len(losses[-10:])
    ok = ok and final < 0.8 * losses[0]
    if rank == 0:
        print(f"first loss {losses[0]:.3f}, final {final:.3f} (the chain's entropy, the floor: {data.entropy:.2f})")
    dist.destroy_process_group()
    if not ok and rank == 0:
        print("the step-0 check failed or the loss did not fall below 0.8x its first value", file=sys.stderr)
    if device.type == "cpu":
        # (gloo: leave without the interpreter's teardown, where gloo's worker threads can still free
        # tensors and abort the process — pytorch/pytorch#179291, tests/python/process_group.py)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
