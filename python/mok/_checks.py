"""Argument checks of the PyTorch API. They run on real and on fake tensors (torch.compile),
so they look at metadata only; expert-id values are checked on the GPU by the planner."""

GRANULARITY = 64  # H, I and I_s must be multiples of this (one 128-byte bf16 K-slice)


def _require(cond, exc, message):
    """Raises exc(message()) unless cond: the message is formatted only when it is raised
    (formatting every call's messages cost the op host time the GPU waited for)."""
    if not cond:
        raise exc(message())


def _valid(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts):
    """Whether the arguments pass every check of check_moe_args, decided in one pass of plain
    comparisons (~4x cheaper than the checks that name what is wrong, which run only when this
    says no: the GPU waits for this host time before the layer's first launch). Any doubt
    (an unexpected type, a shape that does not unpack) answers False."""
    import torch

    T = torch.Tensor
    bf16 = torch.bfloat16
    try:
        if not (isinstance(x, T) and isinstance(topk_ids, T) and isinstance(topk_weights, T) and
                isinstance(w_gate, T) and isinstance(w_down, T) and (w_up is None or isinstance(w_up, T))):
            return False
        if not (x.dtype == bf16 and topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.dtype == torch.float32
                and w_gate.dtype == bf16 and w_down.dtype == bf16 and (w_up is None or w_up.dtype == bf16)):
            return False
        if x.dim() != 2 or w_gate.dim() != 3 or topk_ids.dim() != 2:
            return False
        tokens, hidden = x.shape
        experts, rows, _ = w_gate.shape
        inter = rows // 2 if w_up is None else rows
        k = topk_ids.shape[1]
        all_experts = experts if num_experts is None else num_experts
        if not (topk_ids.shape[0] == tokens and topk_weights.shape == topk_ids.shape and all_experts % experts == 0
                and 1 <= k <= all_experts and w_gate.shape[2] == hidden and (w_up is not None or rows % 2 == 0)
                and (w_up is None or w_up.shape == w_gate.shape) and w_down.shape == (experts, hidden, inter)
                and hidden > 0 and hidden % GRANULARITY == 0 and inter > 0 and inter % GRANULARITY == 0):
            return False
        device = x.device
        if device.type != "cuda" and device.type != "meta":
            return False
        activations = [x, topk_ids, topk_weights]
        if shared is not None:
            if not (isinstance(shared, (tuple, list)) and len(shared) == 3):
                return False
            sg, su, sd = shared
            if not (isinstance(sg, T) and isinstance(su, T) and isinstance(sd, T) and sg.dim() == 2):
                return False
            inter_s = sg.shape[0]
            if not (sg.dtype == bf16 and su.dtype == bf16 and sd.dtype == bf16 and sg.shape == (inter_s, hidden)
                    and su.shape == (inter_s, hidden) and sd.shape == (hidden, inter_s) and inter_s % GRANULARITY == 0
                    and inter_s > 0):
                return False
            activations += [sg, su, sd]
        if swiglu_limit is not None and not finite_positive(swiglu_limit):
            return False
        weights = (w_gate, w_down) if w_up is None else (w_gate, w_up, w_down)
        for t in activations:
            if t.device != device or not t.is_contiguous():
                return False
        for t in weights:
            if t.device != device or t.stride(-1) != 1:
                return False
        return True
    except Exception:  # (anything unexpected: the full checks say what is wrong)
        return False


def check_moe_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts=None,
                   where="mok.moe"):
    """num_experts: the group's E under expert parallelism (the weights hold this rank's E_l).
    w_up None: w_gate holds gate and up concatenated, [E, 2I, H] (gate rows, then up rows)."""
    if _valid(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts):
        return
    import torch

    H, I, Is = _check_layout(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts, where)
    fused = w_up is None
    _require(x.dtype == torch.bfloat16, TypeError, lambda: f"{where}: 'x' dtype must be torch.bfloat16, got {x.dtype}")
    _require(topk_weights.dtype == torch.float32, TypeError,
             lambda: f"{where}: 'topk_weights' dtype must be torch.float32, got {topk_weights.dtype}")
    weights = (("w_gate", w_gate),) + (() if fused else (("w_up", w_up),)) + (("w_down", w_down),)
    tensors = [("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)]
    if shared is not None:
        tensors += list(zip(("shared gate", "shared up", "shared down"), shared))
    for label, t in [(f"'{name}'", w) for name, w in weights] + tensors[3:]:  # (the experts', then the shared expert's)
        _require(t.dtype == torch.bfloat16, TypeError, lambda: f"{where}: {label} dtype must be torch.bfloat16, got {t.dtype}")
    for name, n in (("hidden size H", H), ("intermediate size I", I)):
        _require(n % GRANULARITY == 0 and n > 0, ValueError, lambda: f"{where}: {name} must be a positive multiple of {GRANULARITY}, got {n}")
    if shared is not None:  # (an empty shared expert is none: pass shared=None)
        _require(Is % GRANULARITY == 0 and Is > 0, ValueError,
                 lambda: f"{where}: shared intermediate size must be a positive multiple of {GRANULARITY} (no shared expert: "
                         f"shared=None), got {Is}")
    device = x.device
    for name, t in tensors + list(weights):
        _require(t.device == device, ValueError, lambda: f"{where}: '{name}' is on {t.device}, but x is on {device}")
    for name, t in tensors:
        _require(t.is_contiguous(), ValueError, lambda: f"{where}: '{name}' must be contiguous")
    for name, t in weights:  # strided views with contiguous rows are taken as they are (the
        # kernels' tensor maps take the strides; the extension checks the rest and names them)
        _require(t.stride(-1) == 1, ValueError, lambda: f"{where}: '{name}' must have contiguous rows (stride 1 in its last "
                                                f"dimension), got strides {tuple(t.stride())}")
    if device.type != "meta":
        _require(device.type == "cuda", ValueError, lambda: f"{where}: tensors must be on a CUDA device, got {device}")


def as_limit(v):
    """A swiglu_limit as the custom ops take it: a real number (a NumPy scalar too) as a Python
    float; anything else as it is (the checks then name it)."""
    return float(v) if finite_positive(v) else v


def finite_positive(v) -> bool:
    """Whether v is a finite positive real number (int, float, a NumPy scalar; not a bool): a
    limit, a timeout."""
    import numbers

    return isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < float(v) < float("inf")


def _check_layout(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts, where):
    """The checks every path of the layer makes (the fused one and the PyTorch ones): tensors,
    the index dtype, every shape against x and topk_ids, the expert count, top-k and the SwiGLU
    limit, on metadata only. Returns (H, I, I_s; I_s None without a shared expert)."""
    import torch

    fused = w_up is None
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                    ("w_gate", w_gate), ("w_up", w_gate if fused else w_up), ("w_down", w_down)):
        _require(isinstance(t, torch.Tensor), TypeError, lambda: f"{where}: '{name}' must be a torch.Tensor, got {type(t).__name__}")
    _require(topk_ids.dtype in (torch.int32, torch.int64), TypeError,
             lambda: f"{where}: 'topk_ids' dtype must be torch.int32 or torch.int64, got {topk_ids.dtype}")
    _require(x.dim() == 2, ValueError, lambda: f"{where}: 'x' must be 2-D [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    layout = "[E, 2I, H] (gate and up concatenated: w_up is None)" if fused else "[E, I, H]"
    _require(w_gate.dim() == 3, ValueError, lambda: f"{where}: 'w_gate' must be 3-D {layout}, got shape {tuple(w_gate.shape)}")
    E, rows, _ = w_gate.shape
    _require(E >= 1, ValueError, lambda: f"{where}: 'w_gate' holds no expert, shape {tuple(w_gate.shape)}")
    _require(not fused or rows % 2 == 0, ValueError,
             lambda: f"{where}: 'w_gate' must be {layout}: an even number of rows, got shape {tuple(w_gate.shape)}")
    I = rows // 2 if fused else rows
    _require(topk_ids.dim() == 2 and topk_ids.shape[0] == T, ValueError,
             lambda: f"{where}: 'topk_ids' must be [T, k] with T = {T}, got shape {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    E_all = E if num_experts is None else num_experts
    _require(E_all % E == 0, ValueError, lambda: f"{where}: the {E} local experts must divide num_experts = {E_all}")
    _require(1 <= k <= E_all, ValueError, lambda: f"{where}: top-k must be in [1, E = {E_all}], got {k}")
    _require(tuple(topk_weights.shape) == (T, k), ValueError,
             lambda: f"{where}: 'topk_weights' shape must be {(T, k)}, got {tuple(topk_weights.shape)}")
    _require(tuple(w_gate.shape) == (E, rows, H), ValueError,
             lambda: f"{where}: 'w_gate' shape must be {(E, rows, H)} (H from x), got {tuple(w_gate.shape)}")
    _require(fused or tuple(w_up.shape) == (E, I, H), ValueError,
             lambda: f"{where}: 'w_up' shape must be {(E, I, H)}, got {None if fused else tuple(w_up.shape)}")
    _require(tuple(w_down.shape) == (E, H, I), ValueError,
             lambda: f"{where}: 'w_down' shape must be {(E, H, I)}, got {tuple(w_down.shape)}")
    Is = None
    if shared is not None:
        _require(isinstance(shared, (tuple, list)) and len(shared) == 3, ValueError,
                 lambda: f"{where}: 'shared' must be (gate [I_s, H], up [I_s, H], down [H, I_s]), got {type(shared).__name__}")
        for name, t in zip(("shared gate", "shared up", "shared down"), shared):
            _require(isinstance(t, torch.Tensor), TypeError,
                     lambda: f"{where}: {name} must be a torch.Tensor ('shared' is three tensors or None), got "
                             f"{type(t).__name__}")
        sg, su, sd = shared
        _require(sg.dim() == 2, ValueError, lambda: f"{where}: shared gate must be [I_s, H], got shape {tuple(sg.shape)}")
        Is = sg.shape[0]
        for name, t, shape in (("shared gate", sg, (Is, H)), ("shared up", su, (Is, H)), ("shared down", sd, (H, Is))):
            _require(tuple(t.shape) == shape, ValueError, lambda: f"{where}: {name} shape must be {shape}, got {tuple(t.shape)}")
    if swiglu_limit is not None:
        _require(finite_positive(swiglu_limit), ValueError,
                 lambda: f"{where}: 'swiglu_limit' must be a finite positive number, got {swiglu_limit!r}")
    return H, I, Is


def check_torch_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts=None,
                     where="mok.moe_torch"):
    """The PyTorch paths' checks (mok.moe_torch, mok.moe_torch_ep: any device, any floating
    dtype): the layout mok.moe checks (_check_layout) and floating routing weights, on metadata
    only (fake tensors under torch.compile). num_experts: the group's E (the weights hold E_l)."""
    _check_layout(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts, where)
    _require(topk_weights.is_floating_point(), TypeError,
             lambda: f"{where}: 'topk_weights' must be a floating-point tensor, got {topk_weights.dtype}")
