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
