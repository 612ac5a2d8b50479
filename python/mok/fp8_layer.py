"""The FP8 forward from PyTorch: mok.moe(..., precision="fp8").

The routed experts run in E4M3 with DeepSeek-V3's blockwise power-of-two scales (x and the
SwiGLU output h per 1 x 128 block of a row, quantized inside the layer; the weights per
128 x 128 block), fp32 accumulation promoted every 128 of K; the shared expert, y and the
combine stay as in bf16. On one GPU, or as a rank of an EP group (mok.ep.moe(...,
precision="fp8"): each routed row pulled from its token's rank and quantized before the
kernel), with H and I multiples of 128. Training: the
forward saves its GEMM1's pre-activations; the backward's dgrad GEMMs (dh = dy W_down, dx =
[dgate dup] [W_gate; W_up]) run in E4M3 too when the experts were quantized with
quantize_experts(..., dgrad=True) (dy and dgate|dup quantized per 1 x 128 of a row inside the
kernel: C++ BackwardArgs::fp8, reference::backward_fp8), else in bf16 on the bf16 weights; with
the FP8 dgrad the routed weight gradients' GEMMs run in E4M3 too unless
mok.set_fp8_weight_gradients(False) (bf16 otherwise). The routed weights come from
quantize_experts() (quantize once per weight update and pass them as fp8_experts), or, when none
are given, are
quantized by the call itself: three small kernels that read the bf16 weights and write a
quarter more bytes than E * 3 * I * H, every call (and the dgrad then stays bf16).
"""

import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
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
    # quantize_experts(..., dgrad=True): the backward's dgrad operands (K-major: the E4M3 tensor
    # cores read no other), the same blocks transposed. None: the dgrad runs in bf16.
    down_t: Optional[torch.Tensor] = None               # [E, I, H]: W_down^T
    down_t_exponents: Optional[torch.Tensor] = None     # [E, I / 128, H / 128]
    gate_up_t: Optional[torch.Tensor] = None            # [E, H, 2I]: W_gate^T then W_up^T along K
    gate_up_t_exponents: Optional[torch.Tensor] = None  # [E, H / 128, 2I / 128]

    def dgrad(self):
        """The dgrad operands (down_t, down_t_exponents, gate_up_t, gate_up_t_exponents), or None."""
        fields = (self.down_t, self.down_t_exponents, self.gate_up_t, self.gate_up_t_exponents)
        return None if all(f is None for f in fields) else fields


# Whether the FP8 dgrad is the faster backward for experts of this intermediate size (mok.MoE's
# and the Hugging Face backend's default): measured on an H200 (bench/NOTES.md), FP8 dgrad / bf16
# dgrad forward+backward 0.94-0.95 at I = 2048-14336, 0.94-0.97 at I = 1536; at I = 1024 it was
# 1.03-1.09 until the dh epilogue was rolled (4d4136c) and is 0.96-0.99 since (79cf410, both A/B
# orders: olmoe-1b-7b, qwen3.5-397b); at I = 768 a tie (0.995-0.999), where the bf16 dgrad, the
# more accurate, stays.
DGRAD_MIN_INTERMEDIATE = 1024


def dgrad_pays(w_down: torch.Tensor) -> bool:
    return w_down.shape[2] >= DGRAD_MIN_INTERMEDIATE


def _halves(w_gate, w_up):
    if w_up is not None:
        return w_gate, w_up
    inter = w_gate.shape[1] // 2
    return w_gate[:, :inter], w_gate[:, inter:]  # views: quantize_weights reads them in place


def quantize_experts(w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down: torch.Tensor,
                     dgrad: bool = False) -> Fp8Experts:
    """The routed weights quantized for mok.moe(..., precision="fp8", fp8_experts=...): one
    kernel per matrix on the current stream (mok.fp8.quantize_weights). w_up None: w_gate is
    [E, 2I, H] (gate rows, then up rows); its halves are read in place. dgrad: also the
    backward's dgrad operands (W_down^T, [W_gate^T | W_up^T]: each matrix's transposed
    quantization, from the same kernel and the same read, twice the bytes written), with which a
    training step's dgrad GEMMs run in E4M3 (dgrad_pays: where that is faster)."""
    _check_experts_weights(w_gate, w_up, w_down, dgrad)
    experts = _empty_experts(w_gate, w_up, w_down, dgrad)
    _quantize_into(w_gate, w_up, w_down, experts)
    return experts


def _check_experts_weights(w_gate, w_up, w_down, dgrad, where="mok.fp8.quantize_experts"):
    from mok.fp8 import _check_weight  # (mok.fp8 imports this module: not at the top)

    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w is not None:
            _check_weight(w, where, name)
            if w.device != w_gate.device:
                raise ValueError(f"{where}: {name} is on {w.device}, but w_gate is on {w_gate.device}")
    if w_up is None and w_gate.shape[1] % 2:
        raise ValueError(f"{where}: w_gate [E, 2I, H] (gate rows, then up rows; w_up None) must have an even number of "
                         f"rows, got shape {tuple(w_gate.shape)}")
    gate, up = _halves(w_gate, w_up)
    E, inter, hidden = gate.shape
    if up.shape != gate.shape or w_down.shape != (E, hidden, inter):
        raise ValueError(f"{where}: the experts' shapes disagree: w_gate {tuple(w_gate.shape)}, w_up "
                         f"{None if w_up is None else tuple(w_up.shape)}, w_down {tuple(w_down.shape)} (want gate and "
                         f"up [E, I, H] each, or w_gate [E, 2I, H] and w_up None, and w_down [E, H, I])")
    if dgrad:  # (the dgrad operands' halves meet at a block boundary)
        _check_fp8(w_down, where)


def _value_shapes(w_gate, w_up, w_down, dgrad: bool):
    """The [E, rows, cols] of quantize_experts' E4M3 tensors: gate, up, down, and (dgrad)
    W_down^T and [W_gate^T | W_up^T]."""
    gate, up = _halves(w_gate, w_up)
    shapes = [tuple(gate.shape), tuple(up.shape), tuple(w_down.shape)]
    if dgrad:
        E, inter, hidden = gate.shape
        shapes += [(E, inter, hidden), (E, hidden, 2 * inter)]
    return shapes


def _empty_experts(w_gate, w_up, w_down, dgrad: bool) -> Fp8Experts:
    """Uninitialised tensors of quantize_experts' shapes, on the weights' device: each matrix's
    E4M3 values and the exponents of its 128 x 128 blocks."""
    device = w_gate.device
    fields = []
    for E, rows, cols in _value_shapes(w_gate, w_up, w_down, dgrad):
        fields += [torch.empty(E, rows, cols, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(E, -(-rows // BLOCK), -(-cols // BLOCK), dtype=torch.int32, device=device)]
    return Fp8Experts(*fields)


def _quantize_into(w_gate, w_up, w_down, experts: Fp8Experts) -> None:
    """quantize_experts' bytes written into the tensors of `experts` (_empty_experts' shapes),
    on the current stream: one kernel per matrix; with the dgrad operands, each kernel writes
    the matrix's transposed quantization too, from the same read."""
    gate, up = _halves(w_gate, w_up)
    transposed = [(), (), ()]
    if experts.dgrad() is not None:
        inter, ib = gate.shape[1], gate.shape[1] // BLOCK  # (I a multiple of 128: _check_fp8)
        gate_up_t, gate_up_t_exponents = experts.gate_up_t, experts.gate_up_t_exponents
        transposed = [(gate_up_t[:, :, :inter], gate_up_t_exponents[:, :, :ib]),
                      (gate_up_t[:, :, inter:], gate_up_t_exponents[:, :, ib:]),
                      (experts.down_t, experts.down_t_exponents)]
    stream = torch.cuda.current_stream(gate.device).cuda_stream
    forward = ((experts.gate, experts.gate_exponents), (experts.up, experts.up_exponents),
               (experts.down, experts.down_exponents))
    for w, (v, x), t in zip((gate, up, w_down), forward, transposed):
        t = (to_dlpack(t[0].view(torch.uint8)), to_dlpack(t[1])) if t else ()
        _C.fp8_quantize_weights(to_dlpack(w.detach()), to_dlpack(v.view(torch.uint8)), to_dlpack(x), stream, False,
                                *t)


_weights_generation = 0  # moves on every optimizer step and weights_changed(): part of every cache key


def weights_changed() -> None:
    """Mark every quantized copy that mok.MoE and the Hugging Face backend keep as stale (each is
    quantized again at its owner's next call, eager or compiled). Needed only after expert weights change where neither their
    version counters nor a torch.optim optimizer's step see it: writes through `.data`, or an
    optimizer that is not a torch.optim.Optimizer. Every torch.optim step (fused and foreach
    ones too, which do not all move the version counters) already does this."""
    global _weights_generation
    _weights_generation += 1


def _after_optimizer_step(optimizer, args, kwargs):  # (torch.optim's global step post-hook)
    weights_changed()


register_optimizer_step_post_hook(_after_optimizer_step)


def _fits(experts: Optional[Fp8Experts], w_gate, w_up, w_down, dgrad: bool) -> bool:
    """Whether a kept copy has the shapes, device and dgrad operands these weights need."""
    if experts is None or (experts.dgrad() is not None) != dgrad or experts.gate.device != w_gate.device:
        return False
    return [tuple(t.shape) for t in experts[::2] if t is not None] == _value_shapes(w_gate, w_up, w_down, dgrad)


# What each kept copy holds: {id(copy's first tensor): (weakref to that tensor, generation, the
# weights' _identity)} — kept here, not on the tensor (a weak reference in a tensor's __dict__ would
# make torch.save of a module holding the copy fail); an entry goes with its tensor.
_held = {}


def _identity(w: torch.Tensor):
    """What says a weight is unchanged: (the tensor that owns its view — a view made anew each
    call of a lasting tensor, DTensor.to_local() or a slice, is that tensor's —, the view's place
    in it, the version counter: views share their base's). _remember keeps the owner by a weak
    reference, so a temporary made anew each call (an autocast cast, a weight changed inside a
    compiled graph) never matches, however the allocator reuses its address. Inference tensors
    have no version counter: only mok.fp8.weights_changed() (or other tensors) says they changed."""
    owner = w._base if w._base is not None else w
    return owner, (w.data_ptr(), tuple(w.shape), w.stride(), -1 if w.is_inference() else w._version)


def _holds(experts: Fp8Experts, weights, generation) -> bool:
    """Whether the copy holds these weights as they are (_identity of each) and no optimizer step
    (weights_changed) came since."""
    entry = _held.get(id(experts.gate))
    if entry is None or entry[0]() is not experts.gate or entry[1] != generation or len(entry[2]) != len(weights):
        return False
    for (ref, place), w in zip(entry[2], weights):
        owner, now = _identity(w)
        if ref() is not owner or place != now:
            return False
    return True


def _forget(experts: Fp8Experts) -> None:
    _held.pop(id(experts.gate), None)


def _remember(experts: Fp8Experts, weights, generation) -> None:
    key = id(experts.gate)
    if key not in _held:
        weakref.finalize(experts.gate, _held.pop, key, None)
    _held[key] = (weakref.ref(experts.gate), generation,
                  tuple((weakref.ref(owner), place) for owner, place in map(_identity, weights)))


def _refresh(w_gate, w_up, w_down, experts: Fp8Experts, where: str) -> None:
    """Quantize the weights into the copy `experts`, in place, unless it holds them as they are
    (_holds; the copy is known by its first tensor, the same Python object in every eager or
    compiled call). While a CUDA graph is captured: always (each replay quantizes the weights
    it finds), and what it held is forgotten (the capture ran no kernel)."""
    weights = tuple(w for w in (w_gate, w_up, w_down) if w is not None)
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if not capturing and _holds(experts, weights, _weights_generation):
        return
    _check_experts_weights(w_gate, w_up, w_down, experts.dgrad() is not None, where)
    _forget(experts)  # (not valid while it is written)
    experts.gate._mok_filled = True  # (eagerly, a later change then makes a new copy: cached_experts)
    _quantize_into(w_gate, w_up, w_down, experts)
    if not capturing:
        _remember(experts, weights, _weights_generation)


# mok::fp8_refresh_experts writes the kept copy in place without declaring it in mutates_args (as
# mok::moe_backward overwrites `saved`): declared, AOTAutograd refuses a graph that calls one module
# twice (the second call "mutates" what the first saved for its backward), and a compiled
# activation-checkpointing recompute clones the whole copy to write the clone. It writes only when
# the copy does not hold the weights (_holds) — never while a graph that read it may still read it
# with other weights, except as docs/fp8.md says. Its outputs, fresh copies of the (small)
# exponent tensors, are what the layer reads with the values: so the layer runs after it.
@torch.library.custom_op("mok::fp8_refresh_experts", mutates_args=())
def fp8_refresh_experts(w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down: torch.Tensor,
                        gate: torch.Tensor, gate_exponents: torch.Tensor, up: torch.Tensor, up_exponents: torch.Tensor,
                        down: torch.Tensor, down_exponents: torch.Tensor, down_t: Optional[torch.Tensor],
                        down_t_exponents: Optional[torch.Tensor], gate_up_t: Optional[torch.Tensor],
                        gate_up_t_exponents: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """_refresh under torch.compile: the kept copy (the compiled graph's input) written in place
    when stale; returns its exponent tensors copied, in Fp8Experts' order."""
    experts = Fp8Experts(gate, gate_exponents, up, up_exponents, down, down_exponents, down_t, down_t_exponents,
                         gate_up_t, gate_up_t_exponents)
    _refresh(w_gate, w_up, w_down, experts, "mok.moe")
    return [e.clone() for e in experts[1::2] if e is not None]


@fp8_refresh_experts.register_fake
def _fp8_refresh_experts_fake(w_gate, w_up, w_down, *experts):
    return [torch.empty_like(e) for e in experts[1::2] if e is not None]


def _refreshed(w_gate, w_up, w_down, kept: Fp8Experts) -> Fp8Experts:
    """The kept copy as a compiled layer reads it: refreshed by mok::fp8_refresh_experts, its
    exponents the op's outputs."""
    exponents = iter(torch.ops.mok.fp8_refresh_experts(w_gate, w_up, w_down, *kept))
    fields = [t if i % 2 == 0 or t is None else next(exponents) for i, t in enumerate(kept)]
    return Fp8Experts(*fields)


def new_cached_experts(w_gate, w_up, w_down, dgrad: bool) -> Fp8Experts:
    """An empty copy for cached_experts (a module makes it with its weights, so that its first
    call under torch.compile already has one): marked as a static address, as modules'
    parameters are, so a CUDA graph of torch.compile (mode="reduce-overhead") may write it."""
    experts = _empty_experts(w_gate, w_up, w_down, dgrad)
    for t in experts:
        if t is not None:
            torch._dynamo.mark_static_address(t, guard=False)
    return experts


def keep_empty_copy(owner, w_gate, w_up, w_down, dgrad: bool) -> None:
    """Gives `owner` (a module holding the weights) an empty copy for cached_experts, of these
    weights' shapes and device, so that its first call under torch.compile already has one — kept
    if the one it holds fits; none for weights that are not bf16 on a CUDA device (the FP8 path's
    checks name those in the call)."""
    if not w_gate.is_cuda or w_gate.dtype != torch.bfloat16:
        owner._fp8_cache = None
    elif not _fits(getattr(owner, "_fp8_cache", None), w_gate, w_up, w_down, dgrad):
        owner._fp8_cache = None  # (the old copy goes before the new one is made)
        owner._fp8_cache = new_cached_experts(w_gate, w_up, w_down, dgrad)


def cached_experts(owner, w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down: torch.Tensor,
                   dgrad: Optional[bool] = None, where: str = "mok.fp8_layer.cached_experts") -> Optional[Fp8Experts]:
    """quantize_experts(w_gate, w_up, w_down, dgrad), kept on `owner` (its `_fp8_cache`: a
    module holding the weights) and quantized again when the weights are other tensors or a
    weight's storage or version counter changed (load_state_dict, in-place updates), after any
    torch.optim optimizer's step (a fused AdamW updates the weights without moving their
    version counters), and after weights_changed(). dgrad None: dgrad_pays(w_down). `where`
    names the caller in errors (mok.MoE, mok.hf).

    Eagerly, a change makes a new copy (a backward still pending from an earlier forward keeps
    the one it saved; an empty copy made beforehand, mok.MoE's, is filled in place). Under
    torch.compile the copy is the graph's input and the custom op mok::fp8_refresh_experts
    writes it in place — if the owner holds one of the right shapes and device (mok.MoE makes
    one with its weights); else None (the layer then quantizes the forward's weights itself and
    the dgrad runs in bf16). While an eager CUDA graph is captured: made in the capture and not
    kept (each replay quantizes the weights it finds)."""
    dgrad = dgrad_pays(w_down) if dgrad is None else dgrad
    kept = getattr(owner, "_fp8_cache", None)
    fits = _fits(kept, w_gate, w_up, w_down, dgrad)
    if torch.compiler.is_compiling():
        if not fits:
            return None
        return _refreshed(w_gate, w_up, w_down, kept)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # In a CUDA graph the quantization is captured too, so every replay reads the weights as
        # they are then (a copy kept from before the capture would be replayed stale after the
        # optimizer's steps); the captured copy lives in the graph's memory, not in the cache.
        return quantize_experts(w_gate, w_up, w_down, dgrad=dgrad)
    weights = tuple(w for w in (w_gate, w_up, w_down) if w is not None)
    if fits and _holds(kept, weights, _weights_generation):
        return kept
    if not fits or getattr(kept.gate, "_mok_filled", False):  # (a copy that was ever filled: a new one)
        kept = owner._fp8_cache = None  # (the old copy goes before the new one is made)
        kept = owner._fp8_cache = new_cached_experts(w_gate, w_up, w_down, dgrad)
    _refresh(w_gate, w_up, w_down, kept, where)
    return kept


def _bytes_of(name, t, where="mok.moe"):
    """An E4M3 tensor as the extension takes it (uint8: DLPack has no FP8 type everywhere)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"{where}: fp8_experts.{name} must be a torch.float8_e4m3fn (or uint8) tensor, got "
                        + (str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__))
    return t.view(torch.uint8)


def _check_fp8(w_down, where="mok.moe"):
    hidden, inter = w_down.shape[1], w_down.shape[2]
    if hidden % BLOCK or inter % BLOCK:
        raise ValueError(f"{where}: precision='fp8' needs the hidden size and the experts' intermediate size to be "
                         f"multiples of {BLOCK} (its scale blocks), got H = {hidden}, I = {inter}")


def _run_forward_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                     swiglu_limit, num_experts, group_id, experts, training=False):
    """y, and (training) the pre-activations the bf16 backward reads (else None); on one GPU
    or as a rank of an EP group (mok.ep: group_id, num_experts the group's)."""
    from mok import ops

    ops._check(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit,
               num_experts, group_id)
    _check_fp8(w_down, ops._where(group_id))
    y = torch.empty_like(x)
    saved = None
    k, T = topk_ids.shape[1], x.shape[0]
    if training:
        saved = torch.empty(ops._saved_elements(x, w_down, k, shared_gate, swiglu_limit, num_experts,
                                                ops._capacity_factor(group_id)),
                            dtype=torch.bfloat16, device=x.device)
    if group_id == ops.ONE_GPU and T == 0:
        return y, saved
    if experts is None:
        experts = quantize_experts(w_gate, w_up, w_down)
    names = Fp8Experts._fields[:_FORWARD_ARGS]
    values = [_bytes_of(n, t, ops._where(group_id)) if i % 2 == 0 else t for i, (n, t) in enumerate(zip(names, experts))]
    tensors = ops._capsules((x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, y,
                             *values))
    saved_capsule = None if saved is None else to_dlpack(saved)
    if group_id == ops.ONE_GPU:
        ws = ops._workspace(x, w_down, k, ops._shared_size(shared_gate), swiglu_limit, precision="fp8")
        _C.forward_fp8(ws, *tensors, ops._stream(x),
                       scratch=to_dlpack(ops._scratch(ws.forward_scratch_bytes(T), x.device)), saved=saved_capsule)
    else:
        rank = ops._ep_group(group_id).rank_for(x, w_down, num_experts, k, ops._shared_size(shared_gate),
                                                swiglu_limit, training, precision="fp8",
                                                fp8_dgrad=training and experts.dgrad() is not None)
        _C.ep_forward_fp8(rank, *tensors, ops._stream(x), saved=saved_capsule)
    return y, saved


# The custom ops' trailing tensors: Fp8Experts' fields (None: quantized by the call), the first
# _FORWARD_ARGS the forward's, then the dgrad's (None: the dgrad in bf16).
_EXPERT_ARGS, _FORWARD_ARGS = len(Fp8Experts._fields), 6


def _experts(args):
    """The Fp8Experts of a custom op's trailing tensors (None: none given)."""
    gate = args[0]
    return None if gate is None else Fp8Experts(*args)


def _check_experts(experts, where="mok.moe", w_down=None):
    """A given Fp8Experts: tensors in every forward field, the dgrad fields all or none, and (with
    the layer's w_down [E, H, I]) every field's shape (errors named for `where`, the caller:
    mok.moe or mok.ep.moe; metadata only, so the fake implementations check them too)."""
    if experts is None:
        return
    fields = Fp8Experts._fields
    for name, t in zip(fields, experts):
        if t is None and fields.index(name) < _FORWARD_ARGS:
            raise TypeError(f"{where}: fp8_experts.{name} is None (make fp8_experts with mok.fp8.quantize_experts)")
    dgrad = experts[_FORWARD_ARGS:]
    if any(t is None for t in dgrad) and any(t is not None for t in dgrad):
        missing = [n for n, t in zip(fields[_FORWARD_ARGS:], dgrad) if t is None]
        raise TypeError(f"{where}: fp8_experts has some of the dgrad operands but not {', '.join(missing)} "
                        "(all four or none: mok.fp8.quantize_experts(..., dgrad=True))")
    if experts.dgrad() is not None:
        for name, t in zip(fields[_FORWARD_ARGS::2], dgrad[::2]):
            _bytes_of(name, t, where)
    if isinstance(w_down, torch.Tensor) and w_down.dim() == 3:
        E, H, I = w_down.shape
        Hb, Ib = -(-H // 128), -(-I // 128)
        expected = dict(gate=(E, I, H), gate_exponents=(E, Ib, Hb), up=(E, I, H), up_exponents=(E, Ib, Hb),
                        down=(E, H, I), down_exponents=(E, Hb, Ib), down_t=(E, I, H), down_t_exponents=(E, Ib, Hb),
                        gate_up_t=(E, H, 2 * I), gate_up_t_exponents=(E, Hb, 2 * Ib))
        for name, t in zip(fields, experts):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: fp8_experts.{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"{where}: fp8_experts.{name} shape must be {expected[name]} for w_down of shape "
                                 f"{tuple(w_down.shape)}, got {tuple(t.shape)} (quantized from other weights?)")


@torch.library.custom_op("mok::moe_forward_fp8", mutates_args=())
def moe_forward_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                    shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                    swiglu_limit: Optional[float], num_experts: int, group_id: int, gate: Optional[torch.Tensor],
                    gate_exponents: Optional[torch.Tensor],
                    up: Optional[torch.Tensor], up_exponents: Optional[torch.Tensor], down: Optional[torch.Tensor],
                    down_exponents: Optional[torch.Tensor], down_t: Optional[torch.Tensor],
                    down_t_exponents: Optional[torch.Tensor], gate_up_t: Optional[torch.Tensor],
                    gate_up_t_exponents: Optional[torch.Tensor]) -> torch.Tensor:
    """The FP8 forward under torch.compile (the quantized weights None: quantized by the call)."""
    experts = _experts((gate, gate_exponents, up, up_exponents, down, down_exponents, down_t, down_t_exponents,
                        gate_up_t, gate_up_t_exponents))
    return _run_forward_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                            swiglu_limit, num_experts, group_id, experts)[0]


@moe_forward_fp8.register_fake
def _moe_forward_fp8_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                          swiglu_limit, num_experts, group_id, *experts):
    from mok import ops

    ops._check(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit,
               num_experts, group_id)
    _check_fp8(w_down, ops._where(group_id))
    return torch.empty_like(x)


@torch.library.custom_op("mok::moe_train_forward_fp8", mutates_args=())
def moe_train_forward_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                          w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                          shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                          swiglu_limit: Optional[float], num_experts: int, group_id: int,
                          gate: Optional[torch.Tensor], gate_exponents: Optional[torch.Tensor],
                          up: Optional[torch.Tensor],
                          up_exponents: Optional[torch.Tensor], down: Optional[torch.Tensor],
                          down_exponents: Optional[torch.Tensor], down_t: Optional[torch.Tensor],
                          down_t_exponents: Optional[torch.Tensor], gate_up_t: Optional[torch.Tensor],
                          gate_up_t_exponents: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward of a training step under torch.compile: y and the saved pre-activations."""
    experts = _experts((gate, gate_exponents, up, up_exponents, down, down_exponents, down_t, down_t_exponents,
                        gate_up_t, gate_up_t_exponents))
    return _run_forward_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                            swiglu_limit, num_experts, group_id, experts, training=True)


@moe_train_forward_fp8.register_fake
def _moe_train_forward_fp8_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                                swiglu_limit, num_experts, group_id, *experts):
    from mok import ops

    y = _moe_forward_fp8_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                              swiglu_limit, num_experts, group_id, *experts)
    n = ops._fake_saved_elements(x, w_down, topk_ids.shape[1], shared_gate, swiglu_limit, num_experts,
                                 ops._capacity_factor(group_id))
    return y, x.new_empty((n,), dtype=torch.bfloat16)


# The FP8 train-forward's inputs: mok.ops' tensors, swiglu_limit, num_experts, group_id (as
# mok.ops'), then the quantized weights (no gradient: it goes to the bf16 weights they were made from).
_LAYER_ARGS = 3
_TRAILING = _LAYER_ARGS + _EXPERT_ARGS
_LEADING = 9 + _LAYER_ARGS  # (the inputs before the quantized weights: mok.ops._TENSOR_INPUTS + _LAYER_ARGS)


def _save(ctx, inputs, saved):
    """What the backward reads (mok.ops._save), from the FP8 train-forward's inputs: the bf16
    backward's, and the dgrad operands when given."""
    from mok import ops

    dgrad = inputs[ops._TENSOR_INPUTS + _LAYER_ARGS + _FORWARD_ARGS:]
    extra = tuple(dgrad) if dgrad[0] is not None else ()
    ops._save(ctx, inputs, saved, *inputs[ops._TENSOR_INPUTS:ops._TENSOR_INPUTS + _LAYER_ARGS], extra=extra)


def _train_setup_context(ctx, inputs, output):
    _save(ctx, inputs, output[1])
    ctx.mark_non_differentiable(output[1])


def _train_backward(ctx, grad_y, grad_saved):
    from mok import ops

    args, dgrad = ops._backward_inputs(ctx, grad_y)
    dgrad = dgrad or (None,) * 4
    return ops._input_grads(ops.moe_backward(*args, *dgrad), args, _TRAILING)


moe_train_forward_fp8.register_autograd(_train_backward, setup_context=_train_setup_context)


class _EagerTrainStep(torch.autograd.Function):
    """The FP8 forward with the bf16 backward outside torch.compile (mok.ops' eager path's twin)."""

    @staticmethod
    def forward(ctx, *inputs):
        y, saved = _run_forward_fp8(*inputs[:_LEADING], _experts(inputs[_LEADING:]), training=True)
        _save(ctx, inputs, saved)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        from mok import ops

        args, dgrad = ops._backward_inputs(ctx, grad_y)
        return ops._input_grads(ops._run_backward(*args, fp8_dgrad=dgrad), args, _TRAILING)


def moe_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, fp8_experts, num_experts=None,
            group_id=0):
    """mok.moe(..., precision="fp8") (see mok.moe and this module's docstring); with group_id
    and the group's num_experts, mok.ep.moe(..., precision="fp8")."""
    from mok import ops

    if num_experts is None:
        num_experts = w_gate.shape[0] if isinstance(w_gate, torch.Tensor) and w_gate.dim() > 0 else 0
    shared = tuple(shared) if shared is not None else (None, None, None)
    tensors = tuple(t for t in (x, topk_weights, w_gate, w_up, w_down, *shared) if t is not None)
    train = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    where = ops._where(group_id)
    if fp8_experts is not None and not isinstance(fp8_experts, Fp8Experts):
        raise TypeError(f"{where}: fp8_experts must be what mok.fp8.quantize_experts returns (an Fp8Experts), got "
                        f"{type(fp8_experts).__name__}")
    _check_experts(fp8_experts, where, w_down)
    args = (x, topk_ids, topk_weights, w_gate, w_up, w_down, *shared, swiglu_limit, num_experts, group_id,
            *(fp8_experts if fp8_experts is not None else (None,) * _EXPERT_ARGS))
    if ops._eager(tensors + (topk_ids,)):
        if train:
            return _EagerTrainStep.apply(*args)
        return _run_forward_fp8(*args[:_LEADING], fp8_experts)[0]
    if train:
        return moe_train_forward_fp8(*args)[0]
    return moe_forward_fp8(*args)
