"""Hugging Face transformers backend: the fused kernel as an `experts_implementation`.

    import mok.hf
    mok.hf.register()            # once, before building the model
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="mok")

Works with the experts modules that store `gate_up_proj` [E, 2I, H] (gate rows, then up
rows), `down_proj` [E, H, I], no biases and transformers' default gating with SiLU,
act_fn(gate) * up (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3), or a class's own `_apply_gate` that
clamps as mok's swiglu_limit does (DeepSeek-V4: found by probing it; other gating and any other
act_fn are refused by name);
DeepSeek-V3's shared expert stays in the model's own code. "mok_torch" registers the same
glue over mok.moe_torch (plain PyTorch, any device) for comparisons and CPU tests; "mok_fp8"
runs the routed experts' forward in FP8 (mok.moe(..., precision="fp8"); the backward's dgrad
GEMMs too where mok.fp8.dgrad_pays), the quantized weights kept on the experts module until a
weight changes. "mok_recompute" is "mok" with recompute=True: a training forward keeps no
gate/up pre-activations for the backward, which runs GEMM1 again (the same bits as "mok"; less
memory across layers than saving them, less time than gradient checkpointing the layer). Before
compiling a model with torch.compile, call mok.hf.prepare(model) once it is on its GPU: it makes
each experts module's quantized copy (else a compiled "mok_fp8" model quantizes in every call) and
the gate checks a fullgraph trace cannot run.

`gate_up_proj` goes to the kernel as it is (w_up None: the kernel reads its gate and up
halves in place, and writes its gradient as one [E, 2I, H] tensor): no copy per call.

Under transformers' expert parallelism its EP plans shard the experts (each rank's experts
module holds num_experts = its local experts) and bring each rank's experts their rows: with the
whole batch on every rank (5.2x's all_reduce implementation, earlier 5.x's enable_expert_parallel)
the router marks the slots routed to other ranks with a sentinel id >= num_experts, weight zero —
such a slot goes to mok.moe as -1, "no expert": it adds nothing and its routing weight gets a zero
gradient, as in transformers' own grouped_mm path — and the ranks' partial outputs are summed;
with all_to_all the rows arrive already exchanged, with local ids. (transformers' collectives run
around the experts: mok.ep's fused dispatch and combine are not used there.)
"""

import warnings
from typing import Callable

import torch

from mok._checks import finite_positive
from mok.fp8_layer import _check_fp8, cached_experts, dgrad_pays, keep_empty_copy
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
    if "_mok_swiglu_limit" not in module.__dict__:  # (once a module: the check calls its act_fn / gate)
        module.__dict__["_mok_swiglu_limit"] = _check_gate(module, name)
    return _local(module.gate_up_proj), None, _local(module.down_proj)


def _swiglu_limit(module) -> "float | None":
    """The clamp the module's gating applies (mok's swiglu_limit), found by _check_gate."""
    return module.__dict__.get("_mok_swiglu_limit")


def _gate_limit(module, name: str) -> "float | None":
    """For a class with its own `_apply_gate`: the limit L with which it computes mok's clamped
    SwiGLU, silu(min(gate, L)) * clamp(up, -L, L) (DeepSeek-V4, HYV4 and GLM-5-Next clamp so), or
    None where it computes silu(gate) * up without a clamp,
    found by running it on probe values past the candidates (the module's `limit` or
    `swiglu_limit`, its config's `swiglu_limit`); ValueError naming the class if none fits."""
    from mok.torch_path import _swiglu

    candidates = []
    for owner, attr in ((module, "limit"), (module, "swiglu_limit"), (getattr(module, "config", None), "swiglu_limit")):
        v = getattr(owner, attr, None)
        if finite_positive(v) and v not in candidates:
            candidates.append(float(v))
    w = getattr(module, "gate_up_proj", None)
    if isinstance(w, torch.Tensor) and w.dim() == 3 and w.device.type != "meta":
        inter = w.shape[1] // 2
        generator = torch.Generator().manual_seed(0)
        for limit in candidates + [None]:  # (None: a gate of its own that does not clamp)
            probe = (torch.rand(16, 2 * inter, generator=generator) * 2 - 1) * 3 * (limit or 4.0)
            probe = probe.to(device=_local(w).device)
            try:
                with torch.no_grad():
                    out = module._apply_gate(probe)
                    want = _swiglu(*probe.chunk(2, dim=-1), limit)
                if out.shape == want.shape and torch.allclose(out.float(), want.float(), rtol=1e-5, atol=1e-6):
                    return limit
            except Exception:
                pass
    raise ValueError(f"mok.hf: {name} defines its own gating ({name}._apply_gate: a clamp, softcap or other "
                     "activation) that is not mok's silu(min(gate, L)) * clamp(up, -L, L) for its limit "
                     f"{candidates or '(none found)'}; the fused layer computes only that")


_transformers_names = None  # (transformers' default gate, its SiLU types): _transformers() fills it once


def _transformers():
    """(transformers' default `_apply_gate` or None, the SiLU module types an experts module's
    act_fn may be), imported once, eagerly: register() calls this first, so the glue's first
    call under torch.compile finds them here (torch 2.11's dynamo cannot trace transformers'
    lazy-module import)."""
    global _transformers_names
    if _transformers_names is None:
        default_gate, silu = None, [torch.nn.SiLU]
        try:
            from transformers.integrations import moe as hf_moe
            default_gate = getattr(hf_moe, "_default_apply_gate", None)
        except ImportError:  # (register() needs transformers; a module without it has no custom gate)
            pass
        try:
            from transformers.activations import SiLUActivation
            silu.append(SiLUActivation)
        except ImportError:  # (older or newer transformers: the probe decides)
            pass
        _transformers_names = (default_gate, tuple(silu))
    return _transformers_names


def _check_gate(module: torch.nn.Module, name: str) -> "float | None":
    """The module's gating must be transformers' default, act_fn(gate) * up with act_fn = SiLU,
    or a class's own `_apply_gate` that computes mok's clamped SwiGLU (its limit is returned:
    the layer's swiglu_limit; None without a clamp). Classes with other gating (softcaps,
    alpha·sigmoid: e.g. MiniMax-M3, Inkling2) ran plain SiLU·up here and gave wrong outputs
    without an error; they are refused by name."""
    default_gate, silu_types = _transformers()
    gate = getattr(type(module), "_apply_gate", None)
    if default_gate is not None and gate is not None and gate is not default_gate:
        return _gate_limit(module, name)  # (the probe of the gate itself: act_fn included)
    act_fn = getattr(module, "act_fn", None)
    if isinstance(act_fn, silu_types) or act_fn is torch.nn.functional.silu:
        return None  # (known by its type: no probe, which torch.compile(fullgraph=True) could not trace)
    if callable(act_fn):  # (what the default gate calls; the config's hidden_act may be absent or another key)
        probe = torch.linspace(-12.0, 12.0, 97, dtype=torch.float32)
        try:
            with torch.no_grad():
                # (close, not bitwise: a SiLU written as x * sigmoid(x) differs in the last bits)
                same = torch.allclose(act_fn(probe), torch.nn.functional.silu(probe), rtol=1e-5, atol=1e-6)
        except Exception:
            same = False
        if not same:
            raise ValueError(f"mok.hf: {name}.act_fn = {act_fn!r} is not SiLU; the fused layer is SwiGLU "
                             "(silu(gate) * up)")
        return None
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    if act not in ("silu", "swish"):
        raise ValueError(f"mok.hf: {name} uses hidden_act = {act!r}; the fused layer is SwiGLU (needs 'silu')")
    return None


def _local(w):
    """A parameter as a plain tensor: a DTensor's local shard (transformers' EP plans shard the
    experts' weights; inside the experts forward they are usually local already)."""
    to_local = getattr(w, "to_local", None)
    return to_local() if callable(to_local) else w


def _routing(module: torch.nn.Module, top_k_index: torch.Tensor, experts: int) -> torch.Tensor:
    """top_k_index as mok.moe takes it. Under transformers' expert parallelism the slots routed to
    other ranks carry a sentinel id >= the module's local expert count `experts`: -1 here (no
    expert). transformers >= 5.2x flags such modules (`_is_expert_parallel`). Without the flag
    (older versions) a module can be expert-parallel only in an initialized process group; there
    ids >= num_experts are taken for sentinels (transformers' own grouped_mm forward skips them
    alike). A module flagged not expert-parallel, or one outside any process group, keeps its ids,
    so an out-of-range id is an error (mok.moe names it), not a slot silently dropped."""
    flag = getattr(module, "_is_expert_parallel", None)
    if flag is False or (flag is None and not _in_process_group()):
        return top_k_index
    return top_k_index.masked_fill(top_k_index >= experts, -1)


def _fit_slots(ids: torch.Tensor, weights: torch.Tensor, experts: int):
    """Under expert parallelism a rank may hold fewer experts than top_k (Mixtral at EP 8: one
    expert a rank, top-2), while mok.moe takes k <= E. A router's top-k experts are distinct, so
    a token has at most `experts` slots on this rank: its valid slots first, in slot order (a
    stable sort on "is a sentinel"), and the columns past `experts` — sentinels only — dropped;
    the weights gathered alike (their gradient goes back to the slots they came from)."""
    if ids.shape[-1] <= experts:
        return ids, weights
    order = torch.sort((ids < 0).to(torch.int8), dim=-1, stable=True).indices[..., :experts]
    return ids.gather(-1, order), weights.gather(-1, order)


def _in_process_group() -> bool:
    """Whether torch.distributed has a process group (transformers' expert parallelism needs one)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _autocast_to_bf16(x: torch.Tensor, weights):
    """Under bf16 autocast (HF Trainer's bf16=True keeps fp32 weights), x and fp32 expert weights
    as bf16, as autocast casts a linear layer's operands (the casts are differentiable: the fp32
    weights get their gradients); else as they are (a dtype mok refuses is named by mok.moe)."""
    device = x.device.type
    if not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16):
        return x, weights
    cast = lambda t: t if t is None or t.dtype == torch.bfloat16 else t.to(torch.bfloat16)  # noqa: E731
    return cast(x), tuple(cast(w) for w in weights)


def _experts_forward(layer: Callable, autocast: bool = False) -> Callable:
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        w_gate, w_up, w_down = _expert_weights(self)
        ids = _routing(self, top_k_index, w_down.shape[0])
        weights = top_k_weights.float()
        if ids is not top_k_index:  # (expert-parallel: sentinels masked; fewer local experts than k possible)
            ids, weights = _fit_slots(ids, weights, w_down.shape[0])
        x = hidden_states
        if autocast:  # (the bf16 fused kernel; mok_torch takes any dtype, and "mok_fp8" keeps its
            # quantized weights keyed on the weights it is given, which a per-call cast would defeat)
            x, (w_gate, w_up, w_down) = _autocast_to_bf16(x, (w_gate, w_up, w_down))
        y = layer(self, x, ids, weights, w_gate, w_up, w_down)
        return y.to(hidden_states.dtype)

    forward.__name__ = f"{layer.__name__}_experts_forward"
    return forward


def _mok(module, x, ids, weights, w_gate, w_up, w_down):
    return moe(x, ids, weights, w_gate, w_up, w_down, swiglu_limit=_swiglu_limit(module))


def _mok_recompute(module, x, ids, weights, w_gate, w_up, w_down):
    return moe(x, ids, weights, w_gate, w_up, w_down, swiglu_limit=_swiglu_limit(module), recompute=True)


def _mok_fp8(module, x, ids, weights, w_gate, w_up, w_down):
    return moe(x, ids, weights, w_gate, w_up, w_down, swiglu_limit=_swiglu_limit(module), precision="fp8",
               fp8_experts=cached_experts(module, w_gate, w_up, w_down, where="mok.hf"))


def _mok_torch(module, x, ids, weights, w_gate, w_up, w_down):
    return moe_torch(x, ids, weights, w_gate, w_up, w_down, swiglu_limit=_swiglu_limit(module))


mok_experts_forward = _experts_forward(_mok, autocast=True)
mok_recompute_experts_forward = _experts_forward(_mok_recompute, autocast=True)
mok_fp8_experts_forward = _experts_forward(_mok_fp8)
mok_torch_experts_forward = _experts_forward(_mok_torch)


_IMPLEMENTATIONS = ("mok", "mok_recompute", "mok_fp8", "mok_torch")  # (what register() registers)


def prepare(model: torch.nn.Module) -> int:
    """Readies every experts module of `model` that runs a mok implementation for a
    first call under torch.compile, and returns how many it readied. The glue's first look at a
    module — its layout flags and gating (a class's own `_apply_gate` is probed by running it,
    which a fullgraph trace cannot do) — is made now, and with "mok_fp8" and bf16 CUDA weights the
    module gets its quantized copy (empty, of the weights' shapes, with the dgrad operands where
    mok.fp8.dgrad_pays): else a model compiled before any eager call quantizes its experts' weights
    in every call and runs the bf16 dgrad (the copy is made by the first eager call otherwise).
    Call it after the model is on its GPU and sharded (transformers' expert parallelism: each
    rank's local experts) and again after moving it; calling it twice keeps a copy that fits.
    (Weights sharded by FSDP are gathered into new tensors for every forward, so no copy is kept
    across calls there, prepared or not.) A module that does not fit the glue, or FP8 shapes that
    are not multiples of 128, raise here (ValueError naming the class), as its first call would;
    a model whose config names a mok implementation but holds no experts module it can find is
    warned about (prepare then returns 0)."""
    readied, named = 0, False
    for module in model.modules():
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        named = named or impl in _IMPLEMENTATIONS
        # (an experts class transformers dispatches: its decorator sets is_transposed in every 5.x
        # release — is_concatenated and has_gate came later —; a dense MLP or shared expert of the
        # same config has none)
        if impl not in _IMPLEMENTATIONS or not hasattr(module, "is_transposed") or not hasattr(
                module, "down_proj"):
            continue
        w_gate, w_up, w_down = _expert_weights(module)
        if impl == "mok_fp8":
            _check_fp8(w_down, where=f"mok.hf.prepare ({type(module).__name__})")
            keep_empty_copy(module, w_gate, w_up, w_down, dgrad_pays(w_down))
        readied += 1
    if named and not readied:
        warnings.warn("mok.hf.prepare: the model's config names a mok experts implementation, but no experts "
                      "module (a transformers experts class with `is_transposed` and `down_proj`) was found to "
                      "ready", stacklevel=2)
    return readied


def register() -> None:
    """Registers "mok" (the fused kernel), "mok_recompute" (the same, recomputing GEMM1 in the
    backward instead of saving its output), "mok_fp8" (its FP8 forward) and "mok_torch" with
    transformers' experts interface (needs transformers >= 5 with
    `transformers.integrations.moe.ExpertsInterface`)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        raise ImportError("mok.hf.register: needs transformers >= 5 (transformers.integrations.moe.ExpertsInterface)") from e
    _transformers()  # (imported now, outside any torch.compile trace)
    ExpertsInterface.register("mok", mok_experts_forward)
    ExpertsInterface.register("mok_recompute", mok_recompute_experts_forward)
    ExpertsInterface.register("mok_fp8", mok_fp8_experts_forward)
    ExpertsInterface.register("mok_torch", mok_torch_experts_forward)
