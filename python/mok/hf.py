"""Hugging Face transformers backend: the fused kernel as an `experts_implementation`.

    import mok.hf
    mok.hf.register()            # once, before building the model
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="mok")

Works with the experts modules that store `gate_up_proj` [E, 2I, H] (gate rows, then up
rows), `down_proj` [E, H, I], no biases and SiLU (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3);
DeepSeek-V3's shared expert stays in the model's own code. "mok_torch" registers the same
glue over mok.moe_torch (plain PyTorch, any device) for comparisons and CPU tests; "mok_fp8"
runs the routed experts' forward in FP8 (mok.moe(..., precision="fp8"); the backward's dgrad
GEMMs too where mok.fp8.dgrad_pays), the quantized weights kept on the experts module until a
weight changes.

`gate_up_proj` goes to the kernel as it is (w_up None: the kernel reads its gate and up
halves in place, and writes its gradient as one [E, 2I, H] tensor): no copy per call.
"""

from typing import Callable

import torch

from mok.fp8_layer import cached_experts
from mok.ops import moe
from mok.torch_path import moe_torch


def _expert_weights(module: torch.nn.Module):
    """(w_gate_up [E, 2I, H], None, w_down) of a transformers experts module (mok.moe's
    arguments for concatenated gate and up weights), or ValueError naming what does not fit."""
    name = type(module).__name__
    for flag, wanted in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True), ("has_gate", True),
                         ("has_post_expert_norm", False)):
        if getattr(module, flag, wanted) != wanted:
            raise ValueError(f"mok.hf: {name}.{flag} = {getattr(module, flag)!r} is not supported (needs {wanted})")
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    if act not in ("silu", "swish"):
        raise ValueError(f"mok.hf: {name} uses hidden_act = {act!r}; the fused layer is SwiGLU (needs 'silu')")
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"mok.hf: {name} is expert-parallel in transformers; not supported by this backend yet")
    return module.gate_up_proj, None, module.down_proj


def _experts_forward(layer: Callable) -> Callable:
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        w_gate, w_up, w_down = _expert_weights(self)
        y = layer(self, hidden_states, top_k_index, top_k_weights.float(), w_gate, w_up, w_down)
        return y.to(hidden_states.dtype)

    forward.__name__ = f"{layer.__name__}_experts_forward"
    return forward


def _mok(module, x, ids, weights, w_gate, w_up, w_down):
    return moe(x, ids, weights, w_gate, w_up, w_down)


def _mok_fp8(module, x, ids, weights, w_gate, w_up, w_down):
    return moe(x, ids, weights, w_gate, w_up, w_down, precision="fp8",
               fp8_experts=cached_experts(module, w_gate, w_up, w_down))


def _mok_torch(module, x, ids, weights, w_gate, w_up, w_down):
    return moe_torch(x, ids, weights, w_gate, w_up, w_down)


mok_experts_forward = _experts_forward(_mok)
mok_fp8_experts_forward = _experts_forward(_mok_fp8)
mok_torch_experts_forward = _experts_forward(_mok_torch)


def register() -> None:
    """Registers "mok" (the fused kernel), "mok_fp8" (its FP8 forward) and "mok_torch" with
    transformers' experts interface (needs transformers >= 5 with
    `transformers.integrations.moe.ExpertsInterface`)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        raise ImportError("mok.hf.register: needs transformers >= 5 (transformers.integrations.moe.ExpertsInterface)") from e
    ExpertsInterface.register("mok", mok_experts_forward)
    ExpertsInterface.register("mok_fp8", mok_fp8_experts_forward)
    ExpertsInterface.register("mok_torch", mok_torch_experts_forward)
