"""The same layer in plain PyTorch (autograd, any device): the baseline MoK is measured
against, and a fallback where the fused kernel cannot run (no Hopper GPU)."""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def _swiglu(g: torch.Tensor, u: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return F.silu(g) * u


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: Optional[Sequence[int]]) -> torch.Tensor:
    """Rows of x grouped by expert (group e ends at offsets[e]) times w[e]^T: one
    torch._grouped_mm (counts None), or a loop over the groups (counts given)."""
    if counts is None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return torch.cat([xe @ w[e].T for e, xe in enumerate(x.split(counts))])


def moe_torch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
              swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """mok.moe's semantics in PyTorch: sort the (token, slot) pairs by expert, gather, grouped
    GEMMs (torch._grouped_mm on CUDA), SwiGLU, weighted sum over the k slots; -1 = no expert.
    Accumulates in the inputs' dtype per GEMM (as PyTorch does), so it is not bitwise equal
    to the fused kernel."""
    T, k = topk_ids.shape
    E = w_gate.shape[0]
    flat = topk_ids.reshape(-1).long()
    valid = flat >= 0
    pairs = torch.arange(flat.numel(), device=flat.device)[valid]
    experts = flat[valid]
    order = torch.argsort(experts, stable=True)
    pairs, experts = pairs[order], experts[order]
    group_sizes = torch.zeros(E, dtype=torch.int64, device=experts.device).index_add(0, experts, torch.ones_like(experts))
    offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    grouped_mm = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    counts = None if grouped_mm else group_sizes.tolist()  # the loop needs sizes on the host
    xs = x.index_select(0, pairs // k)
    g = _grouped(xs, w_gate, offsets, counts)
    u = _grouped(xs, w_up, offsets, counts)
    out = _grouped(_swiglu(g, u, swiglu_limit), w_down, offsets, counts)
    acc = torch.promote_types(x.dtype, torch.float32)  # the weighted sum in fp32 (or fp64)
    weights = topk_weights.reshape(-1)[pairs].unsqueeze(-1).to(acc)
    y = torch.zeros(T, x.shape[1], device=x.device, dtype=acc)
    y = y.index_add(0, pairs // k, out.to(acc) * weights)
    if shared is not None:
        sg, su, sd = shared
        y = y + (_swiglu(x @ sg.T, x @ su.T, swiglu_limit) @ sd.T).to(acc)
    return y.to(x.dtype)


def moe_torch_ep(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                 w_up: torch.Tensor, w_down: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
                 swiglu_limit: Optional[float] = None, group=None) -> torch.Tensor:
    """The expert-parallel layer in plain PyTorch over torch.distributed (the NCCL + PyTorch
    baseline of bench/ep_bench.py, and a fallback off Hopper): this rank holds the
    w_gate.shape[0] = E_l experts [rank·E_l, (rank+1)·E_l) of E = E_l·W; its tokens' (token,
    slot) pairs go, sorted by expert, to the ranks that hold them (all_to_all_single, with
    split sizes read on the host), are regrouped there by local expert for the grouped GEMMs,
    and return the same way; the owner sums the k slots in fp32. Autograd flows through
    the exchanges. -1 = no expert."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    T, k = topk_ids.shape
    H, E_l = x.shape[1], w_gate.shape[0]
    flat = topk_ids.reshape(-1).long()
    valid = flat >= 0
    pairs = torch.arange(flat.numel(), device=flat.device)[valid]
    experts = flat[valid]
    order = torch.argsort(experts, stable=True)  # by global expert, so by destination rank
    pairs, experts = pairs[order], experts[order]
    sent = torch.zeros(world, dtype=torch.int64, device=flat.device).index_add(
        0, experts // E_l, torch.ones_like(experts))
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    send_sizes, recv_sizes = sent.tolist(), received.tolist()  # the exchanges need them on the host
    rows = sum(recv_sizes)
    x_in = all_to_all_single(x.new_empty(rows, H), x.index_select(0, pairs // k), recv_sizes, send_sizes, group=group)
    experts_in = experts.new_empty(rows)
    dist.all_to_all_single(experts_in, experts, recv_sizes, send_sizes, group=group)
    local = experts_in - rank * E_l  # rows arrive by source rank: regroup them by local expert
    regroup = torch.argsort(local, stable=True)
    group_sizes = torch.zeros(E_l, dtype=torch.int64, device=local.device).index_add(0, local, torch.ones_like(local))
    offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    grouped_mm = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    counts = None if grouped_mm else group_sizes.tolist()
    xs = x_in.index_select(0, regroup)
    out = _grouped(_swiglu(_grouped(xs, w_gate, offsets, counts), _grouped(xs, w_up, offsets, counts), swiglu_limit),
                   w_down, offsets, counts)
    out = out.index_select(0, torch.argsort(regroup))  # back to arrival order
    returned = all_to_all_single(out.new_empty(pairs.numel(), H), out, send_sizes, recv_sizes, group=group)
    acc = torch.promote_types(x.dtype, torch.float32)
    weights = topk_weights.reshape(-1)[pairs].unsqueeze(-1).to(acc)
    y = torch.zeros(T, H, device=x.device, dtype=acc).index_add(0, pairs // k, returned.to(acc) * weights)
    if shared is not None:
        sg, su, sd = shared
        y = y + (_swiglu(x @ sg.T, x @ su.T, swiglu_limit) @ sd.T).to(acc)
    return y.to(x.dtype)
