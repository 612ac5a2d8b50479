"""The PyTorch API: a torch.library custom op with a fake implementation, so the layer
works under torch.compile(fullgraph=True) and CUDA-graph capture."""

from typing import Optional, Sequence

import torch

from mok import _C
from mok._checks import check_moe_args

_workspaces = {}


def _workspace(x, w_gate, top_k, shared_intermediate, swiglu_limit):
    T, H = x.shape
    E, I, _ = w_gate.shape
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = (device, T, H, I, E, top_k, shared_intermediate, swiglu_limit)
    ws = _workspaces.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mok.moe: the first call for a shape allocates its workspace; "
                               "run it once before capturing a CUDA graph")
        ws = _C.Workspace(H, I, E, top_k, shared_intermediate, swiglu_limit, T, device)
        _workspaces[key] = ws
    return ws


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                swiglu_limit: Optional[float]) -> torch.Tensor:
    shared = None if shared_gate is None else (shared_gate, shared_up, shared_down)
    check_moe_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit)
    y = torch.empty_like(x)
    if x.shape[0] == 0:
        return y
    ws = _workspace(x, w_gate, topk_ids.shape[1], 0 if shared_gate is None else shared_gate.shape[0], swiglu_limit)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _C.forward(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, y, stream)
    return y


@moe_forward.register_fake
def _moe_forward_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                      swiglu_limit):
    shared = None if shared_gate is None else (shared_gate, shared_up, shared_down)
    check_moe_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit)
    return torch.empty_like(x)


def _moe_backward(ctx, grad):
    raise NotImplementedError("mok.moe: the fused backward is not built yet; this release is forward-only")


def _moe_setup_context(ctx, inputs, output):
    pass


moe_forward.register_autograd(_moe_backward, setup_context=_moe_setup_context)


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
        w_up: torch.Tensor, w_down: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
        swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """The fused MoE layer on the current CUDA stream.

    x [T, H] bf16; topk_ids [T, k] int32/int64 (-1 = no expert); topk_weights [T, k] fp32;
    w_gate, w_up [E, I, H] bf16; w_down [E, H, I] bf16; shared = (gate [I_s, H], up [I_s, H],
    down [H, I_s]) or None; swiglu_limit clamps gate <= limit and |up| <= limit.
    Expert ids out of range set y to NaN and raise at the next call or at mok.check().
    """
    shared = tuple(shared) if shared is not None else (None, None, None)
    return moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, *shared, swiglu_limit)


def check() -> None:
    """Synchronises and raises ValueError if a kernel recorded an error (bad expert id,
    capacity, a timed-out wait) in any workspace."""
    for ws in _workspaces.values():
        ws.check(torch.cuda.current_stream().cuda_stream)
