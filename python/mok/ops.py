"""The PyTorch API: torch.library custom ops with fake implementations, so the layer works
under torch.compile(fullgraph=True); in eager mode the same bodies are called directly
(an autograd.Function), which saves the custom ops' dispatch. Both capture in CUDA graphs."""

import operator
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils.dlpack import to_dlpack

from mok import _C
from mok._buffers import capsules as _capsules
from mok._buffers import empty_grads as _empty_grads
from mok._buffers import gate_up_adjacent as _gate_up_adjacent
from mok._buffers import gate_up_grads as _gate_up_grads
from mok._buffers import scratch as _scratch
from mok._checks import as_limit, check_moe_args
from mok._state import ep_groups
from mok._state import workspaces as _workspaces

try:  # the current stream as an integer in one C call (what Inductor's generated code calls)
    from torch._C import _cuda_getCurrentRawStream as _current_raw_stream
except ImportError:  # pragma: no cover (older PyTorch)
    _current_raw_stream = None


def _stream(x):
    """The handle of the current CUDA stream of x's device. torch.cuda.current_stream builds a
    Stream object through several Python calls: host time the GPU would wait for."""
    if _current_raw_stream is not None:
        return _current_raw_stream(x.get_device())
    return torch.cuda.current_stream(x.device).cuda_stream


# Config::backward_column_blocks of the workspaces made from here on (set_backward_column_blocks).
_backward_column_blocks = 0


def set_backward_column_blocks(blocks: int) -> None:
    """How many blocks of H's columns the one-GPU backward takes x's routed rows in (C++
    Config::backward_column_blocks): 0, the default, is 2 — the backward scratch's largest buffer
    at half its bytes, one more launch of the backward kernel, the same bits — except where the FP8
    dgrad runs (its precision="fp8" workspace) and H <= 2048, where it is 1 (2026-12-07, H100: one
    block 0.931 / 0.954 of the forward+backward time with FP8 weight gradients on qwen3-30b-a3b /
    olmoe-1b-7b, for 11 % more peak memory on qwen3-30b-a3b; 0.945 / 0.956 with bf16 weight gradients); 1 keeps whole rows
    in one launch (2026-12-04, H200: 3.5-4.7 % faster forward+backward on qwen3-30b-a3b's short
    pass, 0-1 % on the large presets, for 13 % more peak memory there). A recompute layer's
    (mok.moe(..., recompute=True)) 0 is 2 where I > H, else 1: its buffer holds whole rows for the
    recompute's GEMM1 whatever the blocks, so blocks save it no memory, only DRAM traffic where
    the expert is wider than the model (2026-12-06, H100: two blocks 0.967 of one's forward+backward
    time on mixtral-8x7b, 1.016 on deepseek-v3, 1.070 on qwen3-30b-a3b).
    Applies to the layers' workspaces made afterwards: a layer shape's next call makes its
    workspace anew."""
    global _backward_column_blocks
    if not isinstance(blocks, int) or isinstance(blocks, bool) or not 0 <= blocks <= 1024:
        raise ValueError("mok.set_backward_column_blocks: blocks must be an int in 0 .. 1024 (0: the default, 2 — 1 where the "
                         f"FP8 dgrad runs and H <= 2048; a recompute layer's 2 where I > H, else 1), got {blocks!r}")
    _backward_column_blocks = blocks


# Config::compute_sms of the workspaces made from here on (set_compute_sms).
_compute_sms = 0


def set_compute_sms(sms: int) -> None:
    """How many SMs the one-GPU layer's persistent kernels take (C++ Config::compute_sms): 0, the
    default, every SM. While a fused kernel runs it holds its SMs to the end, so kernels on other
    streams — FSDP's all-gathers and reduce-scatters, a data-parallel all-reduce overlapped with
    the backward, NCCL's kernels among them — start only where an SM is free; leaving some free
    (e.g. set_compute_sms(torch.cuda.get_device_properties(0).multi_processor_count - 16)) lets
    them run beside the layer, at the layer's cost of the SMs it gives up. Every output and
    gradient is bitwise the same for every value (no reduction order depends on the grid). A value
    of at least the GPU's SM count means every SM (the same as 0). Applies to the workspaces made
    afterwards: a layer shape's next call makes a workspace of its own for the new value (outside
    CUDA graph capture; each value used holds one). mok.ep.ExpertParallel(compute_sms=...) is the
    expert-parallel layer's."""
    global _compute_sms
    try:
        value = operator.index(sms)  # (an int or a NumPy integer; not a bool)
    except TypeError:
        value = None
    if value is None or isinstance(sms, bool) or value < 0:
        raise ValueError(f"mok.set_compute_sms: sms must be an int >= 0 (0: every SM), got {sms!r}")
    _compute_sms = value


_device_sms = {}  # (device index -> its SM count, read once)


def _compute_sms_on(device):
    """The compute_sms a workspace on `device` is made with: the setting, or 0 (every SM) where it
    is 0 or at least the device's SM count (so such values share the every-SM workspace)."""
    if _compute_sms == 0:
        return 0
    sms = _device_sms.get(device)
    if sms is None:
        sms = _device_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _compute_sms if _compute_sms < sms else 0


# BackwardArgs::fp8_weight_gradients of the FP8 backwards run from here on (set_fp8_weight_gradients).
_fp8_weight_gradients = True


def set_fp8_weight_gradients(on: bool) -> None:
    """Whether a precision="fp8" training step whose backward runs the FP8 dgrad (its experts
    from mok.fp8.quantize_experts(..., dgrad=True), as mok.MoE keeps them where the dgrad
    pays) also runs the routed weight gradients' GEMMs in E4M3 (C++
    BackwardArgs::fp8_weight_gradients: dy and dgate|dup scaled per channel and 128 routed rows,
    x and w*h per 128 x 128, each quantized transposed in one pass after it is made). True, the
    default: measured faster wherever the FP8 dgrad runs by default (H200, 2026-12-05, mok.moe:
    forward+backward 0.87-0.90x the time with bf16 weight gradients on deepseek-v3, kimi-k2,
    deepseek-v4-pro and mixtral-8x7b, 0.96x on olmoe-1b-7b; a tie at I = 768, where the bf16
    dgrad runs by default), the weight gradients' cosine to the exact layer's 0.9976-0.9979
    against 0.9983-0.9986 with bf16 ones, +0.01-0.15 GiB step peak (docs/fp8.md). False: bf16
    weight-gradient GEMMs, the more accurate. Read when each backward runs (a CUDA graph keeps
    the setting it was captured with); with the bf16 dgrad it has no effect."""
    global _fp8_weight_gradients
    if not isinstance(on, bool):
        raise ValueError(f"mok.set_fp8_weight_gradients: on must be True or False, got {on!r}")
    _fp8_weight_gradients = on


def _workspace(x, w_down, top_k, shared_intermediate, swiglu_limit, precision="bf16", recompute=False):
    """The workspace of this layer shape, precision, training mode and device, made on first use and remade
    for a larger T when one comes (a workspace serves every T up to its max_tokens: variable
    batch or sequence lengths hold one per shape, the size of the largest). It is made for
    training (4*ceil(I/256) bytes per row more than an inference one) so that training steps
    and evaluation under no_grad share one workspace instead of holding two. (An fp8 one
    serves mok.fp8_layer's forwards; their backward is the bf16 one's. recompute: a
    Training::recompute one — its forward saves nothing, its backward runs GEMM1 again into the
    call's scratch; it serves the inference forwards of the layers that train with it too.)"""
    T, H = x.shape
    E, _, I = w_down.shape
    device = x.get_device()
    compute_sms = _compute_sms_on(device)
    # (a recompute workspace's 0 — two blocks where I > H, else one: mok::default_backward_column_blocks —
    # asked for explicitly is its 0: one workspace for both)
    blocks = _backward_column_blocks
    if recompute and blocks and blocks == _C.default_backward_column_blocks(H, I, True):
        blocks = 0
    key = (device, H, I, E, top_k, shared_intermediate, swiglu_limit, precision, recompute, blocks, compute_sms)
    ws = _workspaces.get(key)
    if ws is None or ws.max_tokens < T:
        if torch.cuda.is_current_stream_capturing():
            settings = sorted({k[-3:] for k in _workspaces if k[:-3] == key[:-3]} - {key[-3:]})
            if ws is None and settings:  # (this shape has workspaces, made with other settings)
                raise RuntimeError(
                    f"mok.moe: this layer shape's workspaces were made with other settings (recompute, "
                    f"backward_column_blocks, compute_sms = {', '.join(map(str, settings))}) than now ({recompute}, "
                    f"{blocks}, {compute_sms}: mok.moe's recompute, mok.set_backward_column_blocks, "
                    "mok.set_compute_sms); the new one is allocated outside CUDA graph capture: run the layer once "
                    "with these settings before capturing")
            raise RuntimeError(f"mok.moe: a call with {T} tokens needs a workspace for more tokens than this "
                               f"layer shape has seen ({0 if ws is None else ws.max_tokens}); it is allocated "
                               "outside CUDA graph capture: run the largest token count once before capturing")
        if ws is not None:  # replaced: report what its calls recorded (synchronises, once per growth)
            ws.check(torch.cuda.current_stream(x.device).cuda_stream)
        ws = _C.Workspace(H, I, E, top_k, shared_intermediate, swiglu_limit, T, device, training=True,
                          precision=precision, backward_column_blocks=blocks, compute_sms=compute_sms,
                          recompute=recompute)
        _workspaces[key] = ws
    return ws


ONE_GPU = 0  # the group id of the one-GPU layer (an EP group's is its mok.ep.ExpertParallel.id)


def _where(group_id):
    return "mok.moe" if group_id == ONE_GPU else "mok.ep.moe"


def _check(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit,
           num_experts, group_id):
    parts = (shared_gate, shared_up, shared_down)
    shared = None if all(t is None for t in parts) else parts  # (a partial triple: named by the checks)
    check_moe_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts,
                   _where(group_id))


def _shared_size(shared_gate):
    return 0 if shared_gate is None else shared_gate.shape[0]


def _saved_elements(x, w_down, top_k, shared_gate, swiglu_limit, num_experts, capacity_factor=0.0):
    E_l, H, I = w_down.shape
    return _C.ep_saved_elements(H, I, num_experts, E_l, top_k, _shared_size(shared_gate), swiglu_limit, x.shape[0],
                                capacity_factor)


def _capacity_factor(group_id):
    """The layer's capacity factor: its mok.ep.ExpertParallel's (0 on one GPU: room for every row;
    0 for a group id with no group, which only metadata calls of the fake implementations make —
    a real call refuses it when it looks its group up)."""
    group = ep_groups.get(group_id) if group_id != ONE_GPU else None
    return group.capacity_factor if group is not None else 0.0


_TILE_ROWS, _SAVED_TRAILER = 128, 8  # (C++'s detail::kTileRows and kSavedTrailer)


def _saved_length(tokens, hidden, inter, num_experts, local_experts, top_k, shared_inter, capacity_factor=0.0):
    """mok::saved_elements (workspace.cpp) in Python arithmetic, so that a symbolic token count
    stays symbolic: every routed pair of the group's ranks landing here (capacity_factor 0, the
    worst case) or ceil(capacity_factor * T * k) of them, whichever is fewer (the factor a
    multiple of 1/64: an exact integer division), plus each local expert's padding to 128-row
    tiles, whole tiles, at least one; the shared expert's rows padded to tiles; 2 bf16 a row and
    column (gate and up pre-activations), and the trailer. tests/python/test_module.py checks it
    against the C++."""
    ep = num_experts // local_experts
    rows = ep * tokens * top_k
    if capacity_factor > 0:
        sixty_fourths = int(capacity_factor * 64)
        rows = torch.sym_min(rows, (sixty_fourths * tokens * top_k + 63) // 64)
    rows = rows + local_experts * (_TILE_ROWS - 1)
    rows = torch.sym_max(rows // _TILE_ROWS * _TILE_ROWS, _TILE_ROWS)
    padded = (tokens + _TILE_ROWS - 1) // _TILE_ROWS * _TILE_ROWS if shared_inter else 0
    return 2 * (rows * inter + padded * shared_inter) + _SAVED_TRAILER


def _fake_saved_elements(x, w_down, top_k, shared_gate, swiglu_limit, num_experts, capacity_factor=0.0):
    """The saved tensor's length in a fake implementation: with a symbolic token count (dynamic
    shapes under torch.compile) as a formula of it — the C++ function takes an int and would
    specialise T to a constant, every new T a recompilation and eager after the recompile limit
    (found by review 2026-12-05)."""
    if isinstance(x.shape[0], torch.SymInt):
        E_l, H, I = w_down.shape
        return _saved_length(x.shape[0], H, I, num_experts, E_l, top_k, _shared_size(shared_gate), capacity_factor)
    return _saved_elements(x, w_down, top_k, shared_gate, swiglu_limit, num_experts, capacity_factor)


def _ep_group(group_id):
    group = ep_groups.get(group_id)
    if group is None:
        raise RuntimeError(f"mok.ep.moe: expert-parallel group {group_id} no longer exists (its ExpertParallel was "
                           "released or garbage-collected)")
    return group


def _forward_rows(x, topk_ids, w_down, shared_gate, swiglu_limit, recompute=False):
    """The first of the eager one-GPU forward's two enqueues (mok::forward_rows): the plan and
    x's routed rows, which need only the workspace and the scratch, so that the GPU copies rows
    while the host allocates y and the saved tensor. (ws, scratch) for _run_forward's `rows`."""
    ws = _workspace(x, w_down, topk_ids.shape[1], _shared_size(shared_gate), swiglu_limit, recompute=recompute)
    scratch = _scratch(ws.forward_scratch_bytes(x.shape[0]), x.device)
    _C.forward_rows(ws, to_dlpack(x), to_dlpack(topk_ids), _stream(x), to_dlpack(scratch))
    return ws, scratch


def _run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                 swiglu_limit, num_experts, group_id, training, check=True, rows=None, recompute=False):
    """The fused forward on the current stream, on one GPU or as a rank of an EP group: y, and
    (training without recompute) the gate/up pre-activations (bf16, flat) the backward reads,
    else None (recompute: the backward runs GEMM1 again). The one
    body of the custom ops and of the eager path. w_up None: the extension takes the two
    halves of the concatenated w_gate as views (no Python slicing: host time before the first
    launch, which the GPU waits for). check=False: the caller leaves the checks to the
    extension, which refuses every call the Python checks refuse, and runs them itself when
    the call fails, for their message (call_layer's eager path). rows: _forward_rows' (ws,
    scratch) when it has enqueued this call's rows (one GPU)."""
    if check:
        _check(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit,
               num_experts, group_id)
    k, T = topk_ids.shape[1], x.shape[0]
    y = torch.empty_like(x)
    saved = None
    if training and not recompute:
        saved = torch.empty(_saved_elements(x, w_down, k, shared_gate, swiglu_limit, num_experts,
                                            _capacity_factor(group_id)),
                            dtype=torch.bfloat16, device=x.device)
    if group_id == ONE_GPU and T == 0:
        return y, saved
    tensors = (*_capsules((x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, y,
                           saved)), _stream(x))
    if rows is not None:
        _C.forward(rows[0], *tensors, scratch=to_dlpack(rows[1]), rows_enqueued=True)
    elif group_id == ONE_GPU:
        ws = _workspace(x, w_down, k, _shared_size(shared_gate), swiglu_limit, recompute=recompute)
        _C.forward(ws, *tensors, scratch=to_dlpack(_scratch(ws.forward_scratch_bytes(T), x.device)))
    else:
        # (recompute: the layer's Training::recompute rank, with or without autograd, as on one GPU)
        rank = _ep_group(group_id).rank_for(x, w_down, num_experts, k, _shared_size(shared_gate), swiglu_limit,
                                            training or recompute, recompute=recompute)
        _C.ep_forward(rank, *tensors)
    return y, saved


def _run_backward(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, saved,
                  swiglu_limit, num_experts, group_id, fp8_dgrad=None):
    """The fused backward on the current stream (the body of the custom op and of the eager
    path): _empty_grads' list, W_gate's and W_up's gradients as one block where they pair
    (_input_grads splits it). fp8_dgrad: (down_t, down_t_exponents, gate_up_t,
    gate_up_t_exponents) of mok.fp8.quantize_experts(..., dgrad=True): the dgrad GEMMs in E4M3
    (after mok.fp8_layer's FP8 forward; with FP8 weight gradients unless
    set_fp8_weight_gradients(False)). saved None: the forward ran with recompute (bf16): the
    backward runs GEMM1 again first, on the recompute workspace (or EP rank)."""
    dy = dy.contiguous()
    grads = _empty_grads(x, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, paired=True)
    d_gate, d_up = _gate_up_grads(grads, w_up)
    shared_grads = grads[5:] if shared_gate is not None else (None, None, None)
    tensors = (*_capsules((x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, saved,
                           dy, grads[0], grads[1], d_gate, d_up, grads[4], *shared_grads)), _stream(x))
    k = topk_ids.shape[1]
    if group_id == ONE_GPU:
        fp8 = fp8_dgrad is not None
        ws = _workspace(x, w_down, k, _shared_size(shared_gate), swiglu_limit, precision="fp8" if fp8 else "bf16",
                        recompute=saved is None)
        # (dx, grads[0], is a tensor of its own: the dy rows that miss the gradients may continue in it)
        wgrad = fp8 and _fp8_weight_gradients
        nbytes = ws.backward_scratch_bytes(False, x.shape[0], _gate_up_adjacent(d_gate, d_up), True, fp8, wgrad)
        dgrad = None
        if fp8:  # (E4M3 values as uint8: DLPack has no FP8 type everywhere)
            dgrad = tuple(to_dlpack(t.view(torch.uint8) if i % 2 == 0 else t) for i, t in enumerate(fp8_dgrad))
        _C.backward(ws, *tensors, scratch=to_dlpack(_scratch(nbytes, x.device)), fp8_dgrad=dgrad, fp8_wgrad=wgrad)
    else:
        # (the rank of this shape that a forward made; with the FP8 dgrad its fp8 one; after a
        # recompute forward its recompute one)
        dgrad_rank = (dict(precision="fp8", fp8_dgrad=True) if fp8_dgrad is not None
                      else dict(precision="bf16", recompute=True) if saved is None else dict(precision=None))
        rank = _ep_group(group_id).rank_for(x, w_down, num_experts, k, _shared_size(shared_gate), swiglu_limit, True,
                                            **dgrad_rank)
        dgrad = None
        if fp8_dgrad is not None:
            dgrad = tuple(to_dlpack(t.view(torch.uint8) if i % 2 == 0 else t) for i, t in enumerate(fp8_dgrad))
        _C.ep_backward(rank, *tensors, fp8_dgrad=dgrad, fp8_wgrad=fp8_dgrad is not None and _fp8_weight_gradients)
    return grads


# The custom ops serve torch.compile and fake tensors; one set for one GPU (group_id 0) and
# for a rank of an expert-parallel group (mok.ep). w_up None: w_gate is [E, 2I, H].
@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                swiglu_limit: Optional[float], num_experts: int, group_id: int,
                recompute: bool = False) -> torch.Tensor:
    """The forward without autograd (recompute: on the workspace of the layers that train with
    recompute, so that they hold one)."""
    return _run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                        swiglu_limit, num_experts, group_id, training=False, recompute=recompute)[0]


@moe_forward.register_fake
def _moe_forward_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                      swiglu_limit, num_experts, group_id, recompute=False):
    _check(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit,
           num_experts, group_id)
    return torch.empty_like(x)


@torch.library.custom_op("mok::moe_train_forward", mutates_args=())
def moe_train_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                      w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared_gate: Optional[torch.Tensor],
                      shared_up: Optional[torch.Tensor], shared_down: Optional[torch.Tensor],
                      swiglu_limit: Optional[float], num_experts: int, group_id: int,
                      recompute: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward of a training step: y, and the gate/up pre-activations (bf16, flat) the
    backward reads — with recompute an empty tensor: the backward runs GEMM1 again."""
    y, saved = _run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                            swiglu_limit, num_experts, group_id, training=True, recompute=recompute)
    return y, saved if saved is not None else x.new_empty((0,), dtype=torch.bfloat16)


@moe_train_forward.register_fake
def _moe_train_forward_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                            swiglu_limit, num_experts, group_id, recompute=False):
    _check(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, swiglu_limit,
           num_experts, group_id)
    n = 0 if recompute else _fake_saved_elements(x, w_down, topk_ids.shape[1], shared_gate, swiglu_limit, num_experts,
                                                 _capacity_factor(group_id))
    return torch.empty_like(x), x.new_empty((n,), dtype=torch.bfloat16)


# The op overwrites `saved` (the pre-activations become their gradients) without declaring
# it in mutates_args: declared, AOTAutograd refuses the op under torch.compile (a list of
# outputs next to a mutated input; tests/python/test_package.py compiles through it). Nothing
# reads `saved` afterwards: the autograd context refuses a second backward.
@torch.library.custom_op("mok::moe_backward", mutates_args=())
def moe_backward(dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w_gate: torch.Tensor, w_up: Optional[torch.Tensor], w_down: torch.Tensor,
                 shared_gate: Optional[torch.Tensor], shared_up: Optional[torch.Tensor],
                 shared_down: Optional[torch.Tensor], saved: Optional[torch.Tensor], swiglu_limit: Optional[float],
                 num_experts: int, group_id: int, down_t: Optional[torch.Tensor] = None,
                 down_t_exponents: Optional[torch.Tensor] = None, gate_up_t: Optional[torch.Tensor] = None,
                 gate_up_t_exponents: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """dx, d_topk_weights, d_w_gate, d_w_up, d_w_down[, d_shared_gate, d_shared_up, d_shared_down];
    d_w_gate and d_w_up as one [2, E, I, H] block in d_w_gate's place (d_w_up empty) when both
    weights are contiguous and alike (_input_grads takes its halves). saved None: the forward ran
    with recompute (GEMM1 runs again). down_t .. gate_up_t_exponents: the FP8 dgrad's operands
    (mok.fp8_layer), else None."""
    dgrad = None if down_t is None else (down_t, down_t_exponents, gate_up_t, gate_up_t_exponents)
    return _run_backward(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                         saved, swiglu_limit, num_experts, group_id, fp8_dgrad=dgrad)


@moe_backward.register_fake
def _moe_backward_fake(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                       saved, swiglu_limit, num_experts, group_id, *fp8_dgrad):
    return _empty_grads(x, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, paired=True)


_TENSOR_INPUTS = 9  # x .. shared_down; then swiglu_limit, num_experts, group_id (and the ops' recompute)


def _save(ctx, inputs, saved, swiglu_limit, num_experts, group_id, extra=()):
    """What the backward reads (its inputs: _backward_inputs): the train-forward's tensor
    inputs (the first _TENSOR_INPUTS of `inputs`), the saved pre-activations, and the layer's
    swiglu_limit, num_experts and group id (mok.fp8_layer's train-forward saves the same, and
    its dgrad operands as `extra`, which _backward_inputs returns beside the arguments). saved
    None: the forward ran with recompute."""
    ctx.save_for_backward(*inputs[:_TENSOR_INPUTS], saved, *extra)
    ctx.swiglu_limit, ctx.num_experts, ctx.group_id = swiglu_limit, num_experts, group_id
    ctx.recomputes = saved is None  # (nothing to consume: a second backward may run)


def _train_setup_context(ctx, inputs, output):
    recompute = inputs[_TENSOR_INPUTS + 3]  # (the op's inputs come with their defaults filled in)
    _save(ctx, inputs, None if recompute else output[1], *inputs[_TENSOR_INPUTS:_TENSOR_INPUTS + 3])
    ctx.mark_non_differentiable(output[1])


def _backward_inputs(ctx, grad_y):
    """The arguments of the backward of one train-forward, which may run only once where the
    forward saved its pre-activations (the fused backward overwrites them; with recompute any
    number of times); and the tensors _save kept after the pre-activations (`extra`: a tuple,
    None if none). ctx.saved_tensors is read once a backward: under non-reentrant activation
    checkpointing a saved tensor may be unpacked only once."""
    if getattr(ctx, "consumed", False) and not ctx.recomputes:
        raise RuntimeError(f"{_where(ctx.group_id)}: a second backward through the same forward (retain_graph=True) "
                           "is not supported: the fused backward overwrites the pre-activations the forward saved")
    ctx.consumed = True
    tensors = ctx.saved_tensors
    saved, extra = tensors[:_TENSOR_INPUTS + 1], tuple(tensors[_TENSOR_INPUTS + 1:])
    dy = grad_y if grad_y is not None else torch.zeros_like(saved[0])
    return (dy, *saved, ctx.swiglu_limit, ctx.num_experts, ctx.group_id), extra or None


def _input_grads(grads, args, trailing=3):
    """The train-forward's input gradients from the backward's outputs (dx, d_topk_weights,
    d_w_gate, d_w_up, d_w_down[, the shared expert's]): none for topk_ids, for an absent w_up
    or shared expert, and for the `trailing` inputs after the tensors (here swiglu_limit,
    num_experts, group_id; mok.fp8_layer's: swiglu_limit and the six quantized weights)."""
    w_up, shared_gate = args[5], args[7]
    shared = grads[5:] if shared_gate is not None else [None, None, None]
    return (grads[0], None, grads[1], *_gate_up_grads(grads, w_up), grads[4], *shared) + (None,) * trailing


def _train_backward(ctx, grad_y, grad_saved):
    args, _ = _backward_inputs(ctx, grad_y)
    return _input_grads(moe_backward(*args), args, trailing=4)


moe_train_forward.register_autograd(_train_backward, setup_context=_train_setup_context)


def _no_backward(ctx, grad):
    raise RuntimeError(f"{_where(ctx.group_id)}: this call ran without autograd recording (no input required grad "
                       "when it ran); call it with grad enabled to train")


def _forward_setup_context(ctx, inputs, output):
    ctx.group_id = inputs[_TENSOR_INPUTS + 2]


moe_forward.register_autograd(_no_backward, setup_context=_forward_setup_context)


class _EagerTrainStep(torch.autograd.Function):
    """The layer with autograd outside torch.compile: the same forward and backward bodies as
    the custom ops, without the custom-op dispatch (its per-call checks cost about as much host
    time as the whole C++ call). apply(rows, recompute, *inputs): rows as _run_forward's."""

    @staticmethod
    def forward(ctx, rows, recompute, *inputs):
        y, saved = _run_forward(*inputs, training=True, check=inputs[-1] != ONE_GPU, rows=rows, recompute=recompute)
        _save(ctx, inputs, saved, *inputs[_TENSOR_INPUTS:])
        return y

    @staticmethod
    def backward(ctx, grad_y):
        args, _ = _backward_inputs(ctx, grad_y)
        return (None, None, *_input_grads(_run_backward(*args), args))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager(tensors) -> bool:
    """Whether this call may skip the custom ops: plain CUDA tensors (no fake, meta or other
    subclass), outside torch.compile's tracing."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if type(t) not in _PLAIN or not t.is_cuda:
            return False
    return True


def call_layer(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts, group_id,
               recompute=False):
    """mok.moe and mok.ep.moe: the eager path or the custom ops, with autograd when it records.
    recompute: the training forward saves nothing and the backward runs GEMM1 again.
    The eager path of one GPU leaves the argument checks to the extension (the same checks in
    C++; the GPU waits for every µs of host time before the layer's first launch) and runs the
    Python ones only when the call fails, so that a bad argument is named as the custom ops name
    it (tests/python/test_gpu.py runs every broken variant of test_checks.py through both). It
    enqueues the plan and the row copy first (_forward_rows), then the rest."""
    if shared is None:
        shared = (None, None, None)
    elif (not isinstance(shared, (tuple, list)) or len(shared) != 3
          or not all(isinstance(t, torch.Tensor) for t in shared)):  # (names it)
        check_moe_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts,
                       _where(group_id))
    args = (x, topk_ids, topk_weights, w_gate, w_up, w_down, *shared, swiglu_limit, num_experts, group_id)
    tensors = [t for t in args[:9] if t is not None]
    train = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not _eager(tensors):
        return moe_train_forward(*args, recompute)[0] if train else moe_forward(*args, recompute)
    try:
        rows = None
        if group_id == ONE_GPU and x.shape[0] > 0:
            rows = _forward_rows(x, topk_ids, w_down, shared[0], swiglu_limit, recompute)
        if train:
            return _EagerTrainStep.apply(rows, recompute, *args)
        return _run_forward(*args, training=False, check=group_id != ONE_GPU, rows=rows, recompute=recompute)[0]
    except Exception:
        if group_id != ONE_GPU:
            raise
        try:  # what the custom ops would raise, if the checks find it (not chained to the extension's)
            _check(*args)
        except (TypeError, ValueError) as named:
            raise named from None
        raise


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
        w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
        swiglu_limit: Optional[float] = None, *, precision: str = "bf16", fp8_experts=None,
        recompute: bool = False) -> torch.Tensor:
    """The fused MoE layer on the current CUDA stream.

    x [T, H] bf16; topk_ids [T, k] int32/int64 (-1 = no expert); topk_weights [T, k] fp32;
    w_gate, w_up [E, I, H] bf16 — or w_gate [E, 2I, H] (gate rows, then up rows, as Hugging
    Face, torchtitan and Megatron keep them) and w_up None; w_down [E, H, I] bf16; expert
    weights may be strided views with contiguous rows (no copy is made); shared = (gate
    [I_s, H], up [I_s, H], down [H, I_s]) or None; swiglu_limit clamps gate <= limit and
    |up| <= limit. Any T: one workspace per layer shape serves every token count.
    Expert ids out of range set y to NaN and raise at the next call or at mok.check().
    Differentiable (x, topk_weights and every weight) when autograd records the call: the
    forward then saves the gate/up pre-activations (bf16, k*2I*2 bytes per token plus padding)
    and the fused backward computes every gradient in one kernel (a concatenated w_gate's
    gradient is one [E, 2I, H] tensor).
    Under torch.compile (and on fake or meta tensors) it is the custom ops mok::moe_forward /
    mok::moe_train_forward + mok::moe_backward; in eager mode the same bodies are called
    directly (the custom ops' dispatch is host time the GPU would wait for).
    precision="fp8": the routed experts' forward in E4M3 with blockwise power-of-two scales
    (mok.fp8_layer; H and I multiples of 128; the backward, if autograd records, runs on the
    FP8 forward's activations); fp8_experts: the routed weights from
    mok.fp8.quantize_experts(w_gate, w_up, w_down), else the call quantizes them itself. Made
    with quantize_experts(..., dgrad=True), the backward's dgrad GEMMs run in E4M3 too (else in
    bf16; mok.fp8.dgrad_pays(w_down) says where that is faster).
    recompute=True (bf16; mok.ep.moe takes it too): the training forward saves nothing (no
    k*2I*2 bytes a token kept until the backward) and the backward runs GEMM1 again first, in
    the call's scratch — the same bits as without it, for GEMM1's work again and a larger
    backward scratch (the recompute buffer, k*2I*2 bytes a token plus padding, held only
    during the backward); faster than torch.utils.checkpoint around the layer, which runs the
    whole forward again (README, "Recompute").
    """
    if type(recompute) is not bool:
        raise ValueError(f"mok.moe: recompute must be True or False, got {recompute!r}")
    swiglu_limit = as_limit(swiglu_limit)
    if recompute and precision == "fp8":
        raise ValueError("mok.moe: recompute=True needs precision='bf16': the FP8 backward reads the pre-activations "
                         "the FP8 forward saved (a recompute would redo GEMM1 in bf16)")
    if precision == "fp8":
        from mok.fp8_layer import moe_fp8

        return moe_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, fp8_experts)
    if precision != "bf16":
        raise ValueError(f"mok.moe: precision must be 'bf16' or 'fp8', got {precision!r}")
    if fp8_experts is not None:
        raise ValueError("mok.moe: fp8_experts was given, but precision is 'bf16' (pass precision='fp8')")
    num_experts = w_gate.shape[0] if isinstance(w_gate, torch.Tensor) and w_gate.dim() > 0 else 0
    return call_layer(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts, ONE_GPU,
                      recompute)


def check() -> None:
    """Synchronises and raises if a kernel recorded an error in any workspace, or in any
    expert-parallel rank (mok.ep): ValueError for bad input (an expert id out of range, more
    routed rows than the capacity), RuntimeError for a failure (a timed-out wait, a CUDA error)."""
    for key, ws in _workspaces.items():  # (each on its own device's stream: key[0], the device index)
        ws.check(torch.cuda.current_stream(key[0]).cuda_stream)
    for group in ep_groups.values():  # (empty unless mok.ep was used)
        group.check()
