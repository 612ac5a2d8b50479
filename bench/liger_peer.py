"""A peer implementation for layer_bench (`liger`): Liger-Kernel's Triton fused MoE
(`liger_kernel.ops.fused_moe.LigerFusedMoEFunction`: routing metadata in three Triton kernels,
the gather fused into GEMM1 with SwiGLU, GEMM2, a weighted gather-sum; its backward recomputes
dO @ W_down^T instead of keeping the expert output rows). It is the fused MoE layer research
groups reach for on Hopper besides the compiled PyTorch path (bench/NOTES.md, issue 18).

Not installed with the project: `scripts/peers.sh` downloads the pinned wheel (pure Python; it
needs Triton, which PyTorch's CUDA wheels bring) into `.peers/` (a device call carries it),
which function() below puts on sys.path. Its kernels autotune on their first call per shape (on an
H100 ~4 minutes for qwen3-30b-a3b, more than 9 for deepseek-v3), which layer_bench's checks take
before anything is timed; scripts/gpu_check.sh keeps the tuning results between calls.

What it computes is the routed layer with gate and up concatenated as [E, 2I, H] (gate rows
first: layer_bench's `w_gate_up`), int32 expert ids, the routing weights applied in the
gather-sum. It has no SwiGLU clamp (presets with one are refused: nothing to compare) and no
shared expert: where a preset has one, its MLP runs beside it in eager PyTorch (bf16 GEMMs, as
torch_baseline.shared_mlp) and is added in fp32, as a user of the library would have to.
Its routing-weight gradient accumulates with atomics (bf16): not deterministic, unlike mok's.
"""
import os
import sys

import torch

import torch_baseline as tb

PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".peers")  # (scripts/peers.sh)

WHEEL = "liger-kernel==0.8.5"  # (scripts/peers.sh downloads this one)


def function():
    """LigerFusedMoEFunction (from .peers/ where scripts/peers.sh put it, else an installed
    liger-kernel), or ImportError naming how to get it."""
    if os.path.isdir(PEERS) and PEERS not in sys.path:
        sys.path.insert(0, PEERS)
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as e:
        raise ImportError(f"liger: {WHEEL} is not importable ({e}); run scripts/peers.sh (a device call then "
                          "carries .peers)") from e
    return LigerFusedMoEFunction


def liger_layer(fn):
    """The layer with torch_baseline's signature over Liger's autograd Function `fn` (no clamp:
    Liger refuses a problem with one)."""

    def layer(x, ids, weights, w_gate_up, w_down, limit, shared_gate_up=None, shared_down=None):
        y = fn.apply(x, w_gate_up, w_down, ids.to(torch.int32), weights)
        if shared_gate_up is not None:
            y = (y.float() + tb.shared_mlp(x, shared_gate_up, shared_down, limit).float()).to(x.dtype)
        return y

    return layer


class Liger(tb.TorchImpl):
    """The `liger` implementation on one problem (layer_bench's inputs; TorchImpl's leaves and
    outputs). fn: Liger's Function (default: the installed one; the CPU tests pass a stand-in)."""

    def __init__(self, d, fn=None):
        if d["limit"] is not None:
            raise ValueError(f"liger: its fused MoE has no SwiGLU clamp (this preset's swiglu_limit is {d['limit']})")
        super().__init__(d, liger_layer(fn if fn is not None else function()))
