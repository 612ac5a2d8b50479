"""The FP8 forward from PyTorch: mok.moe(..., precision="fp8").

The routed experts run in E4M3 with DeepSeek-V3's blockwise power-of-two scales (x and the
SwiGLU output h per 1 x 128 block of a row, quantized inside the layer; the weights per
128 x 128 block), fp32 accumulation promoted every 128 of K; the shared expert, y and the
combine stay as in bf16. For now on one GPU, with H and I multiples of 128. Training: the
forward saves its GEMM1's pre-activations and the backward is the bf16 one (every gradient,
the bf16 weights' included: C++ reference::backward_fp8 with fp8_dgrad = false; the C++ API's
FP8 dgrad, BackwardArgs::fp8, is not used here: it is not faster yet, docs/fp8.md). The routed
weights come from
quantize_experts() (quantize once per weight update and pass them as fp8_experts), or, when
none are given, are quantized by the call itself: three small kernels that read the bf16
weights and write a quarter more bytes than E * 3 * I * H, every call.
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch.utils.dlpack import to_dlpack

from mok import _C

BLOCK = 128  # FP8: H and I multiples of this (the scale blocks)


class Fp8Experts(NamedTuple):
    """The routed weights as the FP8 layer reads them (quantize_experts): E4M3 values
    (torch.float8_e4m3fn) and the int32 exponents of their 128 x 128 blocks (block (i, j) of
    expert e is decode(value) * 2^exponent)."""
    gate: torch.Tensor            # [E, I, H]
    gate_exponents: torch.Tensor  # [E, I / 128, H / 128]
    up: torch.Tensor              # [E, I, H]
    up_exponents: torch.Tensor    # [E, I / 128, H / 128]
    down: torch.Tensor            # [E, H, I]
    down_exponents: torch.Tensor  # [E, H / 128, I / 128]


def _halves(w_gate, w_up):
    if w_up is not None:
        return w_gate, w_up
    inter = w_gate.shape[1] // 2
    return w_gate[:, :inter], w_gate[:, inter:]  # views: quantize_weights reads them in place


def quantize_experts(w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down: torch.Tensor) -> Fp8Experts:
    """The routed weights quantized for mok.moe(..., precision="fp8", fp8_experts=...): one
    kernel per matrix on the current stream (mok.fp8.quantize_weights). w_up None: w_gate is
    [E, 2I, H] (gate rows, then up rows); its halves are read in place."""
    from mok.fp8 import quantize_weights  # (mok.fp8 imports this module: not at the top)

    gate, up = _halves(w_gate, w_up)
    return Fp8Experts(*quantize_weights(gate), *quantize_weights(up), *quantize_weights(w_down))


def cached_experts(owner, w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down: torch.Tensor) -> Optional[Fp8Experts]:
    """quantize_experts(w_gate, w_up, w_down), kept on `owner` (its `_fp8_cache`: a module
    holding the weights) and made again only when a weight's storage or version counter
    changes (an optimizer step, load_state_dict). Under torch.compile: None (the layer then
    quantizes them itself, without a graph break)."""
    if torch.compiler.is_compiling():
        return None
    key = tuple((w.data_ptr(), w._version) for w in (w_gate, w_up, w_down) if w is not None)
    cached = getattr(owner, "_fp8_cache", None)
    if cached is None or cached[0] != key:
        cached = (key, quantize_experts(w_gate, w_up, w_down))
        owner._fp8_cache = cached
    return cached[1]


def _bytes_of(name, t):
    """An E4M3 tensor as the extension takes it (uint8: DLPack has no FP8 type everywhere)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"mok.moe: fp8_experts.{name} must be a torch.float8_e4m3fn (or uint8) tensor, got "
                        + (str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__))
    return t.view(torch.uint8)


def _check_fp8(x, w_down):
    hidden, inter = w_down.shape[1], w_down.shape[2]
    if hidden % BLOCK or inter % BLOCK:
        raise ValueError(f"mok.moe: precision='fp8' needs the hidden size and the experts' intermediate size to be "
                         f"multiples of {BLOCK} (its scale blocks), got H = {hidden}, I = {inter}")


def _run_forward_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                     swiglu_limit, experts, training=False):
    """y, and (training) the pre-activations the bf16 backward reads (else None)."""
    from mok import ops

    num_experts = w_gate.shape[0]
    ops._check(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit,
               num_experts, ops.ONE_GPU)
    _check_fp8(x, w_down)
    y = torch.empty_like(x)
    saved = None
    if training:
        saved = torch.empty(ops._saved_elements(x, w_down, topk_ids.shape[1], shared_gate, swiglu_limit, num_experts),
                            dtype=torch.bfloat16, device=x.device)
    T = x.shape[0]
    if T == 0:
        return y, saved
    if experts is None:
        experts = quantize_experts(w_gate, w_up, w_down)
    names = Fp8Experts._fields
    values = [_bytes_of(n, t) if i % 2 == 0 else t for i, (n, t) in enumerate(zip(names, experts))]
    ws = ops._workspace(x, w_down, topk_ids.shape[1], ops._shared_size(shared_gate), swiglu_limit, precision="fp8")
    tensors = ops._capsules((x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, y,
                             *values))
    _C.forward_fp8(ws, *tensors, ops._stream(x), scratch=to_dlpack(ops._scratch(ws.forward_scratch_bytes(T), x.device)),
                   saved=None if saved is None else to_dlpack(saved))
    return y, saved


_EXPERT_ARGS = 6  # the custom ops' trailing tensors: Fp8Experts' fields (None: quantized by the call)


def _experts(args):
    gate = args[0]
    return None if gate is None else Fp8Experts(*args)


@torch.library.custom_op("mok::moe_forward_fp8", mutates_args=())
def moe_forward_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                    shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                    swiglu_limit: Optional[float], gate: Optional[torch.Tensor], gate_exponents: Optional[torch.Tensor],
                    up: Optional[torch.Tensor], up_exponents: Optional[torch.Tensor], down: Optional[torch.Tensor],
                    down_exponents: Optional[torch.Tensor]) -> torch.Tensor:
    """The FP8 forward under torch.compile (the quantized weights None: quantized by the call)."""
    experts = _experts((gate, gate_exponents, up, up_exponents, down, down_exponents))
    return _run_forward_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                            swiglu_limit, experts)[0]


@moe_forward_fp8.register_fake
def _moe_forward_fp8_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                          swiglu_limit, gate, gate_exponents, up, up_exponents, down, down_exponents):
    from mok import ops

    ops._check(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit,
               w_gate.shape[0], ops.ONE_GPU)
    _check_fp8(x, w_down)
    return torch.empty_like(x)


@torch.library.custom_op("mok::moe_train_forward_fp8", mutates_args=())
def moe_train_forward_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                          w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                          shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                          swiglu_limit: Optional[float], gate: Optional[torch.Tensor],
                          gate_exponents: Optional[torch.Tensor], up: Optional[torch.Tensor],
                          up_exponents: Optional[torch.Tensor], down: Optional[torch.Tensor],
                          down_exponents: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward of a training step under torch.compile: y and the saved pre-activations."""
    experts = _experts((gate, gate_exponents, up, up_exponents, down, down_exponents))
    return _run_forward_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                            swiglu_limit, experts, training=True)


@moe_train_forward_fp8.register_fake
def _moe_train_forward_fp8_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                                swiglu_limit, gate, gate_exponents, up, up_exponents, down, down_exponents):
    from mok import ops

    y = _moe_forward_fp8_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                              swiglu_limit, gate, gate_exponents, up, up_exponents, down, down_exponents)
    n = ops._saved_elements(x, w_down, topk_ids.shape[1], shared_gate, swiglu_limit, w_gate.shape[0])
    return y, x.new_empty((n,), dtype=torch.bfloat16)


# The FP8 train-forward's inputs: mok.ops' tensors, swiglu_limit, then the quantized weights
# (no gradient: it goes to the bf16 weights they were made from).
_TRAILING = 1 + _EXPERT_ARGS


def _save(ctx, inputs, saved):
    """What the bf16 backward reads (mok.ops._save), from the FP8 train-forward's inputs."""
    from mok import ops

    ops._save(ctx, inputs, saved, inputs[ops._TENSOR_INPUTS], inputs[3].shape[0], ops.ONE_GPU)


def _train_setup_context(ctx, inputs, output):
    _save(ctx, inputs, output[1])
    ctx.mark_non_differentiable(output[1])


def _train_backward(ctx, grad_y, grad_saved):
    from mok import ops

    args = ops._backward_inputs(ctx, grad_y)
    return ops._input_grads(ops.moe_backward(*args), args, _TRAILING)


moe_train_forward_fp8.register_autograd(_train_backward, setup_context=_train_setup_context)


class _EagerTrainStep(torch.autograd.Function):
    """The FP8 forward with the bf16 backward outside torch.compile (mok.ops' eager path's twin)."""

    @staticmethod
    def forward(ctx, *inputs):
        y, saved = _run_forward_fp8(*inputs[:10], _experts(inputs[10:]), training=True)
        _save(ctx, inputs, saved)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        from mok import ops

        args = ops._backward_inputs(ctx, grad_y)
        return ops._input_grads(ops._run_backward(*args), args, _TRAILING)


def moe_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, fp8_experts):
    """mok.moe(..., precision="fp8") (see mok.moe and this module's docstring)."""
    from mok import ops

    shared = tuple(shared) if shared is not None else (None, None, None)
    tensors = tuple(t for t in (x, topk_weights, w_gate, w_up, w_down, *shared) if t is not None)
    train = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if fp8_experts is not None and not isinstance(fp8_experts, Fp8Experts):
        raise TypeError("mok.moe: fp8_experts must be what mok.fp8.quantize_experts returns (an Fp8Experts), got "
                        f"{type(fp8_experts).__name__}")
    args = (x, topk_ids, topk_weights, w_gate, w_up, w_down, *shared, swiglu_limit,
            *(fp8_experts if fp8_experts is not None else (None,) * _EXPERT_ARGS))
    if ops._eager(tensors + (topk_ids,)):
        if train:
            return _EagerTrainStep.apply(*args)
        return _run_forward_fp8(*args[:10], fp8_experts)[0]
    if train:
        return moe_train_forward_fp8(*args)[0]
    return moe_forward_fp8(*args)
