"""The same layer in plain PyTorch (autograd, any device): the baseline MoK is measured
against, and a fallback where the fused kernel cannot run (no Hopper GPU)."""

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mok._checks import check_torch_args


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


def _pairs_by_expert(topk_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs that have an expert, as flat indices t·k + j sorted by expert
    (stable: token order inside an expert), and their experts."""
    flat = topk_ids.reshape(-1).long()
    valid = flat >= 0
    pairs = torch.arange(flat.numel(), device=flat.device)[valid]
    experts = flat[valid]
    order = torch.argsort(experts, stable=True)
    return pairs[order], experts[order]


def _gate_up(xs, w_gate, w_up, offsets, counts):
    """The gate and up pre-activations of the grouped rows: two grouped GEMMs, or one over
    w_gate = [E, 2I, H] (gate rows, then up rows) when w_up is None."""
    if w_up is not None:
        return _grouped(xs, w_gate, offsets, counts), _grouped(xs, w_up, offsets, counts)
    return _grouped(xs, w_gate, offsets, counts).chunk(2, dim=-1)


def _experts(xs: torch.Tensor, experts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
             limit: Optional[float]) -> torch.Tensor:
    """Rows xs, sorted by their expert (ids in [0, E)), through the SwiGLU experts."""
    E = w_gate.shape[0]
    group_sizes = torch.zeros(E, dtype=torch.int64, device=experts.device).index_add(0, experts, torch.ones_like(experts))
    offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    grouped_mm = xs.is_cuda and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    counts = None if grouped_mm else group_sizes.tolist()  # the loop needs sizes on the host
    g, u = _gate_up(xs, w_gate, w_up, offsets, counts)
    return _grouped(_swiglu(g, u, limit), w_down, offsets, counts)


def _combine(x: torch.Tensor, k: int, topk_weights: torch.Tensor, pairs: torch.Tensor, rows: torch.Tensor,
             shared: Optional[Sequence[torch.Tensor]], limit: Optional[float]) -> torch.Tensor:
    """y[t] = shared(x[t]) + the weighted sum of the result rows of t's pairs, in fp32 (or fp64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    weights = topk_weights.reshape(-1)[pairs].unsqueeze(-1).to(acc)
    y = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=acc).index_add(0, pairs // k, rows.to(acc) * weights)
    if shared is not None:
        sg, su, sd = shared
        y = y + (_swiglu(x @ sg.T, x @ su.T, limit) @ sd.T).to(acc)
    return y.to(x.dtype)


def moe_torch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
              w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
              swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """mok.moe's semantics (and arguments: w_up None takes w_gate as [E, 2I, H]) in PyTorch: sort the (token, slot) pairs by expert, gather, grouped
    GEMMs (torch._grouped_mm on CUDA), SwiGLU, scatter the result rows back to their slots,
    weighted sum over the k slots in fp32; -1 = no expert.

    Written for torch.compile on CUDA: every shape is static (no boolean indexing, no
    bincount), so `torch.compile(model)` takes the layer whole. A padding slot (-1) becomes a
    row of zeros at the end of the last expert's group: zeros in, zeros out, no gradient.
    Accumulates in the inputs' dtype per GEMM (as PyTorch does), so it is not bitwise equal
    to the fused kernel."""
    check_torch_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit)
    T, k = topk_ids.shape
    E = w_gate.shape[0]
    flat = topk_ids.reshape(-1)
    # An id >= E would land past the last group's rows, one < -1 pass for "no expert": an error
    # instead (no host sync, and it compiles; on a GPU a device-side assert)
    torch._assert_async(((flat >= -1) & (flat < E)).all(), f"mok.moe_torch: topk_ids has an expert id outside [-1, {E})")
    valid = flat >= 0
    sorted_ids, order = torch.sort(torch.where(valid, flat, E - 1), stable=True)
    keep = valid.index_select(0, order).unsqueeze(-1)
    xs = torch.where(keep, x.index_select(0, order // k), 0)
    if xs.is_cuda and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        bounds = torch.arange(E, device=flat.device, dtype=sorted_ids.dtype)
        offsets, counts = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32), None
    else:  # the loop needs the group sizes on the host
        offsets, counts = None, torch.bincount(sorted_ids.long(), minlength=E).tolist()
    g, u = _gate_up(xs, w_gate, w_up, offsets, counts)
    rows = _grouped(_swiglu(g, u, swiglu_limit), w_down, offsets, counts)
    per_slot = torch.index_copy(torch.empty_like(rows), 0, order, rows).view(T, k, rows.shape[-1])  # slot order[i] <- row i
    acc = torch.promote_types(x.dtype, torch.float32)
    # (a "no expert" slot adds nothing, whatever its weight: a NaN there made the row NaN)
    weights = torch.where(topk_ids >= 0, topk_weights.to(acc), 0)
    y = (per_slot.to(acc) * weights.unsqueeze(-1)).sum(1)
    if shared is not None:
        sg, su, sd = shared
        y = y + (_swiglu(x @ sg.T, x @ su.T, swiglu_limit) @ sd.T).to(acc)
    return y.to(x.dtype)


class _Exchange(torch.autograd.Function):
    """all_to_all_single of rows with autograd: rows split by send_sizes, piece q to rank q;
    the pieces that arrive are concatenated in rank order (recv_sizes). The gradient goes
    back the same way. (torch.distributed.nn.functional.all_to_all_single does this too but
    is deprecated in torch 2.15.)"""

    @staticmethod
    def forward(ctx, rows, recv_sizes, send_sizes, group):
        import torch.distributed as dist

        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        out = rows.new_empty(sum(recv_sizes), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        recv_sizes, send_sizes = ctx.sizes
        out = grad.new_empty(sum(send_sizes), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), send_sizes, recv_sizes, group=ctx.group)
        return out, None, None, None


def moe_torch_ep(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                 w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
                 swiglu_limit: Optional[float] = None, group=None) -> torch.Tensor:
    """The expert-parallel layer in plain PyTorch over torch.distributed (the NCCL + PyTorch
    baseline of bench/ep_bench.py, and a fallback off Hopper): this rank holds the
    w_gate.shape[0] = E_l experts [rank·E_l, (rank+1)·E_l) of E = E_l·W; its tokens' (token,
    slot) pairs go, sorted by expert, to the ranks that hold them (all_to_all_single, with
    split sizes read on the host), are regrouped there by local expert for the grouped GEMMs,
    and return the same way; the owner sums the k slots in fp32. Autograd flows through
    the exchanges. -1 = no expert."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    E_l = w_gate.shape[0] if isinstance(w_gate, torch.Tensor) and w_gate.dim() == 3 else 1
    check_torch_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts=E_l * world,
                     where="mok.moe_torch_ep")
    k = topk_ids.shape[1]
    # (the exchanges read their sizes on the host anyway: the ids' range is checked there too, and
    # travels with the sizes, so that every rank raises — one rank raising alone left the others
    # waiting in the next exchange until the group's timeout)
    outside = (topk_ids < -1) | (topk_ids >= E_l * world)
    bad = bool(topk_ids.numel() and outside.any())
    pairs, experts = _pairs_by_expert(topk_ids.masked_fill(outside, -1) if bad else topk_ids)  # sorted by expert
    counts = torch.zeros(world, dtype=torch.int64, device=experts.device).index_add(
        0, experts // E_l, torch.ones_like(experts))
    sent = torch.stack([counts, torch.full_like(counts, int(bad))], dim=1)  # [world, (pairs, a bad id)]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    send_sizes, (recv_sizes, flags) = counts.tolist(), received.t().tolist()  # (the exchanges need them on the host)
    if any(flags):
        ranks = [r for r, f in enumerate(flags) if f]
        raise ValueError(f"mok.moe_torch_ep: 'topk_ids' has an expert id outside [-1, {E_l * world}) on rank"
                         f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of the group (-1 = no expert; "
                         f"{world} ranks of {E_l} experts)")
    arrived = sum(recv_sizes)
    x_in = _Exchange.apply(x.index_select(0, pairs // k), recv_sizes, send_sizes, group)
    experts_in = experts.new_empty(arrived)
    dist.all_to_all_single(experts_in, experts, recv_sizes, send_sizes, group=group)
    local = experts_in - rank * E_l  # rows arrive by source rank: regroup them by local expert
    regroup = torch.argsort(local, stable=True)
    rows = _experts(x_in.index_select(0, regroup), local[regroup], w_gate, w_up, w_down, swiglu_limit)
    rows = rows.index_select(0, torch.argsort(regroup))  # back to arrival order
    returned = _Exchange.apply(rows, send_sizes, recv_sizes, group)
    return _combine(x, k, topk_weights, pairs, returned, shared, swiglu_limit)
