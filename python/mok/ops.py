"""The PyTorch API: torch.library custom ops with fake implementations, so the layer works
under torch.compile(fullgraph=True); in eager mode the same bodies are called directly
(an autograd.Function), which saves the custom ops' dispatch. Both capture in CUDA graphs."""

from typing import List, Optional, Sequence, Tuple

import torch

from mok import _C
from mok._checks import check_moe_args
from mok._state import ep_groups
from mok._state import workspaces as _workspaces


def _workspace(x, w_gate, top_k, shared_intermediate, swiglu_limit):
    """The workspace of this layer shape and device, made on first use and remade for a
    larger T when one comes (a workspace serves every T up to its max_tokens: variable batch
    or sequence lengths hold one per shape, the size of the largest). It is made for training
    (4*ceil(I/256) bytes per row more than an inference one) so that training steps and
    evaluation under no_grad share one workspace instead of holding two."""
    T, H = x.shape
    E, I, _ = w_gate.shape
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = (device, H, I, E, top_k, shared_intermediate, swiglu_limit)
    ws = _workspaces.get(key)
    if ws is None or ws.max_tokens < T:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"mok.moe: a call with {T} tokens needs a workspace for more tokens than this "
                               f"layer shape has seen ({0 if ws is None else ws.max_tokens}); it is allocated "
                               "outside CUDA graph capture: run the largest token count once before capturing")
        if ws is not None:  # replaced: report what its calls recorded (synchronises, once per growth)
            ws.check(torch.cuda.current_stream(x.device).cuda_stream)
        ws = _C.Workspace(H, I, E, top_k, shared_intermediate, swiglu_limit, T, device, training=True)
        _workspaces[key] = ws
    return ws


def _scratch(nbytes, device):
    """One call's scratch from PyTorch's caching allocator: freed when the call returns
    (stream-ordered), so the forward's bytes serve the backward and the next layer."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _saved_elements(x, w_gate, top_k, shared_gate, swiglu_limit):
    T, H = x.shape
    E, I, _ = w_gate.shape
    Is = 0 if shared_gate is None else shared_gate.shape[0]
    return _C.saved_elements(H, I, E, top_k, Is, swiglu_limit, T)


def _run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                 swiglu_limit, training):
    """The fused forward on the current stream: y, and (training) the gate/up pre-activations
    (bf16, flat) the backward reads, else None. The one body of the custom ops and of the
    eager path."""
    shared = None if shared_gate is None else (shared_gate, shared_up, shared_down)
    check_moe_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit)
    y = torch.empty_like(x)
    saved = None
    if training:
        saved = torch.empty(_saved_elements(x, w_gate, topk_ids.shape[1], shared_gate, swiglu_limit),
                            dtype=torch.bfloat16, device=x.device)
    if x.shape[0] == 0:
        return y, saved
    ws = _workspace(x, w_gate, topk_ids.shape[1], 0 if shared_gate is None else shared_gate.shape[0], swiglu_limit)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _C.forward(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, y, saved,
               stream, scratch=_scratch(ws.forward_scratch_bytes(x.shape[0]), x.device))
    return y, saved


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                swiglu_limit: Optional[float]) -> torch.Tensor:
    return _run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                        swiglu_limit, training=False)[0]


@moe_forward.register_fake
def _moe_forward_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                      swiglu_limit):
    shared = None if shared_gate is None else (shared_gate, shared_up, shared_down)
    check_moe_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit)
    return torch.empty_like(x)


@torch.library.custom_op("mok::moe_train_forward", mutates_args=())
def moe_train_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                      w_up: torch.Tensor, w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                      shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                      swiglu_limit: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward of a training step: y, and the gate/up pre-activations (bf16, flat) the
    backward reads."""
    return _run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                        swiglu_limit, training=True)


@moe_train_forward.register_fake
def _moe_train_forward_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                            swiglu_limit):
    shared = None if shared_gate is None else (shared_gate, shared_up, shared_down)
    check_moe_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit)
    n = _saved_elements(x, w_gate, topk_ids.shape[1], shared_gate, swiglu_limit)
    return torch.empty_like(x), x.new_empty((n,), dtype=torch.bfloat16)


# The op overwrites `saved` (the pre-activations become their gradients) without declaring
# it in mutates_args: declared, AOTAutograd refuses the op under torch.compile (a list of
# outputs next to a mutated input; tests/python/test_package.py compiles through it). Nothing
# reads `saved` afterwards: the autograd context refuses a second backward.
@torch.library.custom_op("mok::moe_backward", mutates_args=())
def moe_backward(dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                 shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor], saved: torch.Tensor,
                 swiglu_limit: Optional[float]) -> List[torch.Tensor]:
    """dx, d_topk_weights, d_w_gate, d_w_up, d_w_down[, d_shared_gate, d_shared_up, d_shared_down]."""
    return _run_backward(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                         saved, swiglu_limit)


def _run_backward(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, saved,
                  swiglu_limit):
    """The fused backward on the current stream (the body of the custom op and of the eager path)."""
    dy = dy.contiguous()
    grads = _empty_grads(x, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    ws = _workspace(x, w_gate, topk_ids.shape[1], 0 if shared_gate is None else shared_gate.shape[0], swiglu_limit)
    shared_grads = grads[5:] if shared_gate is not None else (None, None, None)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _C.backward(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, saved,
                dy, *grads[:5], *shared_grads, stream,
                scratch=_scratch(ws.backward_scratch_bytes(w_gate.dtype == torch.float32, x.shape[0]), x.device))
    return grads


def _empty_grads(x, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down):
    grads = [torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w_gate), torch.empty_like(w_up),
             torch.empty_like(w_down)]
    if shared_gate is not None:
        grads += [torch.empty_like(shared_gate), torch.empty_like(shared_up), torch.empty_like(shared_down)]
    return grads


@moe_backward.register_fake
def _moe_backward_fake(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                       saved, swiglu_limit):
    return _empty_grads(x, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down)


def _train_setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit = inputs
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                          output[1])
    ctx.swiglu_limit = swiglu_limit
    ctx.mark_non_differentiable(output[1])


def _consume(ctx, where):
    """Refuses a second backward through one forward: the fused backward overwrites the
    pre-activations the forward saved."""
    if getattr(ctx, "consumed", False):
        raise RuntimeError(f"{where}: a second backward through the same forward (retain_graph=True) is not "
                           "supported: the fused backward overwrites the pre-activations the forward saved")
    ctx.consumed = True


def _backward_inputs(ctx, grad_y, where):
    """(dy, the train-forward's saved tensors) for its backward, which may run only once."""
    _consume(ctx, where)
    saved = ctx.saved_tensors
    return (grad_y if grad_y is not None else torch.zeros_like(saved[0])), saved


def _input_grads(grads, has_shared, non_tensor_inputs):
    """The train-forward op's input gradients from the backward op's outputs (dx,
    d_topk_weights, d_w_gate, d_w_up, d_w_down[, shared expert's]): none for topk_ids and
    the trailing non-tensor inputs."""
    shared = grads[5:] if has_shared else [None, None, None]
    return (grads[0], None, grads[1], grads[2], grads[3], grads[4], *shared) + (None,) * non_tensor_inputs


def _train_backward(ctx, grad_y, grad_saved):
    dy, saved = _backward_inputs(ctx, grad_y, "mok.moe")
    grads = moe_backward(dy, *saved, ctx.swiglu_limit)
    return _input_grads(grads, saved[6] is not None, 1)


moe_train_forward.register_autograd(_train_backward, setup_context=_train_setup_context)


def _moe_setup_context(ctx, inputs, output):
    pass


def _moe_backward(ctx, grad):
    raise RuntimeError("mok.moe: this call ran without autograd recording (no input required grad "
                       "when it ran); call it with grad enabled to train")


moe_forward.register_autograd(_moe_backward, setup_context=_moe_setup_context)


class _EagerTrainStep(torch.autograd.Function):
    """mok.moe with autograd outside torch.compile: the same forward and backward bodies as
    the custom ops, without the custom-op dispatch (its per-call checks cost about as much host
    time as the whole C++ call)."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                swiglu_limit):
        y, saved = _run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                                swiglu_limit, training=True)
        ctx.save_for_backward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                              saved)
        ctx.swiglu_limit = swiglu_limit
        return y

    @staticmethod
    def backward(ctx, grad_y):
        dy, saved = _backward_inputs(ctx, grad_y, "mok.moe")
        grads = _run_backward(dy, *saved, ctx.swiglu_limit)
        return _input_grads(grads, saved[6] is not None, 1)


def _eager(tensors) -> bool:
    """Whether this call may skip the custom ops: plain CUDA tensors (no fake, meta or other
    subclass), outside torch.compile's tracing."""
    if torch.compiler.is_compiling():
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda for t in tensors)


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
        w_up: torch.Tensor, w_down: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
        swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """The fused MoE layer on the current CUDA stream.

    x [T, H] bf16; topk_ids [T, k] int32/int64 (-1 = no expert); topk_weights [T, k] fp32;
    w_gate, w_up [E, I, H] bf16; w_down [E, H, I] bf16; shared = (gate [I_s, H], up [I_s, H],
    down [H, I_s]) or None; swiglu_limit clamps gate <= limit and |up| <= limit.
    Expert ids out of range set y to NaN and raise at the next call or at mok.check().
    Differentiable (x, topk_weights and every weight) when autograd records the call: the
    forward then saves the gate/up pre-activations (bf16, k*2I*2 bytes per token plus padding)
    and the fused backward computes every gradient in one kernel.
    Under torch.compile (and on fake or meta tensors) it is the custom ops mok::moe_forward /
    mok::moe_train_forward + mok::moe_backward; in eager mode the same bodies are called
    directly (the custom ops' dispatch is host time the GPU would wait for).
    """
    shared = tuple(shared) if shared is not None else (None, None, None)
    tensors = (x, topk_weights, w_gate, w_up, w_down) + tuple(t for t in shared if t is not None)
    train = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if _eager(tensors + (topk_ids,)):
        if train:
            return _EagerTrainStep.apply(x, topk_ids, topk_weights, w_gate, w_up, w_down, *shared, swiglu_limit)
        return _run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, *shared, swiglu_limit, training=False)[0]
    if train:
        return moe_train_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, *shared, swiglu_limit)[0]
    return moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, *shared, swiglu_limit)


def check() -> None:
    """Synchronises and raises if a kernel recorded an error in any workspace, or in any
    expert-parallel rank (mok.ep): ValueError for bad input (an expert id out of range, more
    routed rows than the capacity), RuntimeError for a failure (a timed-out wait, a CUDA error)."""
    for ws in _workspaces.values():
        ws.check(torch.cuda.current_stream().cuda_stream)
    for group in ep_groups.values():  # (empty unless mok.ep was used)
        group.check()
