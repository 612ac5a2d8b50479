"""One process of the expert-parallel test (run by test_ep.py under torchrun): every rank
builds the same global problem, computes its part with mok.ep, and compares with one GPU
computing every token with every expert (mok.moe): forward bitwise, gradients bitwise for
x, topk_weights and its experts' weights, through mok.ep.moe and through mok.MoE(group=...),
in bf16 (saving the pre-activations or with recompute=True) and with precision="fp8" (the FP8
gradients finite too).
Exits non-zero on any mismatch."""

import os
import sys

import torch
import torch.distributed as dist

import mok
import mok.ep
import mok.fp8

sys.path.insert(0, os.path.dirname(__file__))
from torch_reference import random_problem  # noqa: E402


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    T, H, I, E, k = 256, 256, 192, 8 * world, 2
    x, ids, w, gate, up, down, _ = random_problem(T * world, H, I, E, k, 0, seed=5, device=device,
                                                  dtype=torch.bfloat16, padding=0.1)
    dy = torch.randn(T * world, H, device=device, generator=torch.Generator(device).manual_seed(6)).bfloat16()
    group = mok.ep.ExpertParallel()
    mine = slice(rank * T, (rank + 1) * T)
    experts = slice(rank * (E // world), (rank + 1) * (E // world))
    failures = []

    # Forward (no grad), twice: call numbers advance on the device.
    with torch.no_grad():
        y_one = mok.moe(x, ids, w, gate, up, down)
        for call in range(2):
            y = mok.ep.moe(x[mine].contiguous(), ids[mine].contiguous(), w[mine].contiguous(), gate[experts].contiguous(),
                           up[experts].contiguous(), down[experts].contiguous(), group=group)
            group.check()
            if not torch.equal(y.view(torch.int16), y_one[mine].view(torch.int16)):
                failures.append(f"rank {rank}: forward call {call} differs from one GPU")

    # Training step: gradients against one GPU's, with the rows pulled once per pair (the
    # default), with each peer token pulled once (pull_tokens_once), and with every call padded
    # to a fixed token count (ExpertParallel(tokens=...): rows of no expert after this rank's).
    def leaves(*ts):
        return [t.detach().clone().requires_grad_() for t in ts]

    xa, wa, ga, ua, da = leaves(x, w, gate, up, down)
    ya = mok.moe(xa, ids, wa, ga, ua, da)
    ya.backward(dy)

    # recompute=True: the forward keeps no pre-activations and the backward runs GEMM1 again on
    # the group's Training::recompute rank — the same bits; the forward without autograd then
    # runs on that rank too (one recompute rank for both, none other made).
    cases = (("", group, False), (" (tokens pulled once)", mok.ep.ExpertParallel(pull_tokens_once=True), False),
             (" (padded to a fixed T + 40)", mok.ep.ExpertParallel(tokens=T + 40), False),
             (" with recompute", group, True),
             (" with recompute (padded to a fixed T + 40)", mok.ep.ExpertParallel(tokens=T + 40), True),
             (" with capacity_factor 0.75", mok.ep.ExpertParallel(capacity_factor=0.75), False))
    for how, g, recompute in cases:
        xb, wb, gb, ub, db = leaves(x[mine].contiguous(), w[mine].contiguous(), gate[experts].contiguous(),
                                    up[experts].contiguous(), down[experts].contiguous())
        yb = mok.ep.moe(xb, ids[mine].contiguous(), wb, gb, ub, db, group=g, recompute=recompute)
        yb.backward(dy[mine].contiguous())
        outputs = [("training forward", yb.detach())]
        # (a forward without autograd after training: on the rank that trains, saving nothing —
        # with recompute always, without it since 2026-12-06 — no second rank made)
        with torch.no_grad():
            outputs.append(("forward without autograd",
                            mok.ep.moe(xb, ids[mine].contiguous(), wb, gb, ub, db, group=g, recompute=recompute)))
        g.check()
        if recompute:
            recomputing = [key for key, r in g._ranks.items() if r.recompute]
            if len(recomputing) != 1 or recomputing[0][-1] is not True:
                failures.append(f"rank {rank}: recompute{how} made {len(recomputing)} recompute ranks, not one")
        if g is not group and len(g._ranks) != 1:  # (a group of its own: no other rank made)
            failures.append(f"rank {rank}: training{how} and a forward without autograd made {len(g._ranks)} ranks, "
                            "not one")
        if g.capacity_factor:  # (the rank and the saved tensor sized by it: fewer rows than the worst case)
            want = mok._C.ep_saved_elements(H, I, E, E // world, k, 0, None, T, g.capacity_factor)
            if [r.saved_elements for r in g._ranks.values()] != [want] or \
                    want >= mok._C.ep_saved_elements(H, I, E, E // world, k, 0, None, T):
                failures.append(f"rank {rank}: capacity_factor {g.capacity_factor}: saved elements "
                                f"{[r.saved_elements for r in g._ranks.values()]}, want one rank of {want}")
        for what, got in outputs:
            if not torch.equal(got.view(torch.int16), ya.detach()[mine].view(torch.int16)):
                failures.append(f"rank {rank}: {what}{how} differs from one GPU")
        for name, got, want in (("dx", xb.grad, xa.grad[mine]), ("d_topk_weights", wb.grad, wa.grad[mine]),
                                ("d_w_gate", gb.grad, ga.grad[experts]), ("d_w_up", ub.grad, ua.grad[experts]),
                                ("d_w_down", db.grad, da.grad[experts])):
            if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                failures.append(f"rank {rank}: {name}{how} differs from one GPU")

    # The same through the module: mok.MoE(..., group=...) holds only this rank's experts.
    def rank_module(I, weights, **kwargs):
        """mok.MoE(..., group=...) holding this rank's share of the whole layer's experts."""
        module = mok.MoE(H, I, E, k, router=None, device=device, **kwargs)
        with torch.no_grad():
            for param, full in zip((module.w_gate, module.w_up, module.w_down), weights):
                param.copy_(full[experts])
        return module

    for recompute in (False, True):
        what = "mok.MoE(group=..., recompute=True)" if recompute else "mok.MoE(group=...)"
        layer = rank_module(I, (gate, up, down), group=group, recompute=recompute)
        xc = x[mine].detach().clone().requires_grad_()
        yc = layer(xc, ids[mine].contiguous(), w[mine].contiguous())
        yc.backward(dy[mine].contiguous())
        group.check()
        if not torch.equal(yc.detach().view(torch.int16), y_one[mine].view(torch.int16)):
            failures.append(f"rank {rank}: {what} forward differs from one GPU")
        for name, got, want in (("dx", xc.grad, xa.grad[mine]), ("d_w_gate", layer.w_gate.grad, ga.grad[experts]),
                                ("d_w_up", layer.w_up.grad, ua.grad[experts]),
                                ("d_w_down", layer.w_down.grad, da.grad[experts])):
            if got is None or not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                failures.append(f"rank {rank}: {what} {name} differs from one GPU")

    # Two layers of one shape in a row (one EpRank serves both, as in a model): the first
    # layer's backward runs after the second's forward and backward, saving or recomputing.
    _, ids2, w2, gate2, up2, down2, _ = random_problem(T * world, H, I, E, k, 0, seed=8, device=device,
                                                       dtype=torch.bfloat16, padding=0.1)
    one = leaves(x, w, gate, up, down, w2, gate2, up2, down2)
    mok.moe(mok.moe(one[0], ids, *one[1:5]), ids2, *one[5:]).backward(dy)
    for recompute in (False, True):
        ep = leaves(x[mine].contiguous(), w[mine].contiguous(), gate[experts].contiguous(),
                    up[experts].contiguous(), down[experts].contiguous(), w2[mine].contiguous(),
                    gate2[experts].contiguous(), up2[experts].contiguous(), down2[experts].contiguous())
        y1 = mok.ep.moe(ep[0], ids[mine].contiguous(), *ep[1:5], group=group, recompute=recompute)
        mok.ep.moe(y1, ids2[mine].contiguous(), *ep[5:], group=group, recompute=recompute).backward(
            dy[mine].contiguous())
        group.check()
        cuts = (mine, mine, experts, experts, experts, mine, experts, experts, experts)
        names = ("dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down") + tuple(
            f"layer 2 {n}" for n in ("d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"))
        for name, got, want, cut in zip(names, ep, one, cuts):
            if not torch.equal(got.grad.view(torch.uint8), want.grad[cut].contiguous().view(torch.uint8)):
                failures.append(f"rank {rank}: two layers{' with recompute' if recompute else ''}: {name} differs "
                                f"from one GPU")

    # FP8 (precision="fp8"): the routed experts' forward in E4M3; the group's backward on its
    # activations in bf16, or with the FP8 dgrad (dgrad=True) and FP8 or bf16 weight gradients —
    # each bitwise equal to one GPU's FP8 forward with the same backward. Without dgrad this
    # rank's experts are quantized by the call itself.
    x8, ids8, w8, gate8, up8, down8, _ = random_problem(T * world, H, 256, E, k, 0, seed=7, device=device,
                                                        dtype=torch.bfloat16, padding=0.1)
    e4m3 = mok.ep.ExpertParallel(pull_fp8_rows=True)  # (peers pull E4M3 rows, quantized once by their owner)
    one_gpu = {}  # (dgrad, wgrad): one GPU's y and gradients, for the module below

    def differs(got, want):  # (not bitwise equal, or not finite: unwritten memory would be either)
        return (got is None or not torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
                or not torch.isfinite(got.float()).all())

    padded = mok.ep.ExpertParallel(tokens=T + 24)  # (every call padded to a fixed token count)
    for dgrad, wgrad, fp8_group in ((False, False, group), (True, False, e4m3), (True, True, group), (True, True, e4m3),
                                    (True, True, padded)):
        mok.set_fp8_weight_gradients(wgrad)
        how = f" (FP8 dgrad, {'FP8' if wgrad else 'bf16'} weight gradients)" if dgrad else ""
        how += " (E4M3 rows pulled)" if fp8_group is e4m3 else " (padded to T + 24 tokens)" if fp8_group is padded else ""
        xa, wa, ga, ua, da = leaves(x8, w8, gate8, up8, down8)
        ya = mok.moe(xa, ids8, wa, ga, ua, da, precision="fp8",
                     fp8_experts=mok.fp8.quantize_experts(gate8, up8, down8, dgrad=dgrad))
        ya.backward(dy)
        one_gpu[dgrad, wgrad] = (ya.detach(), xa.grad, wa.grad, ga.grad, ua.grad, da.grad)
        mine_experts = [t[experts].contiguous() for t in (gate8, up8, down8)]
        q8 = mok.fp8.quantize_experts(*mine_experts, dgrad=True) if dgrad else None
        with torch.no_grad():
            y8 = mok.ep.moe(x8[mine].contiguous(), ids8[mine].contiguous(), w8[mine].contiguous(), *mine_experts,
                            group=fp8_group, precision="fp8", fp8_experts=q8)
        xb, wb, gb, ub, db = leaves(x8[mine].contiguous(), w8[mine].contiguous(), *mine_experts)
        yb = mok.ep.moe(xb, ids8[mine].contiguous(), wb, gb, ub, db, group=fp8_group, precision="fp8", fp8_experts=q8)
        yb.backward(dy[mine].contiguous())
        fp8_group.check()
        for name, got, want in (("forward", y8, ya.detach()[mine]), ("training forward", yb.detach(), ya.detach()[mine]),
                                ("dx", xb.grad, xa.grad[mine]), ("d_topk_weights", wb.grad, wa.grad[mine]),
                                ("d_w_gate", gb.grad, ga.grad[experts]), ("d_w_up", ub.grad, ua.grad[experts]),
                                ("d_w_down", db.grad, da.grad[experts])):
            if differs(got, want):
                failures.append(f"rank {rank}: FP8 {name}{how} differs from one GPU")

    # The module in fp8: mok.MoE(group=..., precision="fp8") quantizes this rank's experts itself
    # (cached), with the FP8 dgrad (and FP8 weight gradients) or without.
    for fp8_dgrad, fp8_group in ((False, group), (True, e4m3)):
        mok.set_fp8_weight_gradients(True)
        layer8 = rank_module(256, (gate8, up8, down8), group=fp8_group, precision="fp8", fp8_dgrad=fp8_dgrad)
        xc = x8[mine].detach().clone().requires_grad_()
        yc = layer8(xc, ids8[mine].contiguous(), w8[mine].contiguous())
        yc.backward(dy[mine].contiguous())
        fp8_group.check()
        y_want, dx_want, _, dg_want, du_want, dd_want = one_gpu[fp8_dgrad, fp8_dgrad]
        for name, got, want in (("forward", yc.detach(), y_want[mine]), ("dx", xc.grad, dx_want[mine]),
                                ("d_w_gate", layer8.w_gate.grad, dg_want[experts]),
                                ("d_w_up", layer8.w_up.grad, du_want[experts]),
                                ("d_w_down", layer8.w_down.grad, dd_want[experts])):
            if differs(got, want):
                failures.append(f"rank {rank}: mok.MoE(group=..., precision='fp8', fp8_dgrad={fp8_dgrad}) {name} "
                                "differs from one GPU")
    mok.set_fp8_weight_gradients(True)

    dist.barrier()
    dist.destroy_process_group()
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)
    print(f"rank {rank} of {world}: forward and gradients bitwise equal to one GPU")


if __name__ == "__main__":
    main()
