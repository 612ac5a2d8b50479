"""mok.MoE: an nn.Module holding the expert weights, with an optional standard top-k router."""

import math
from typing import Optional, Tuple

import torch
from torch import nn

from mok._checks import finite_positive
from mok.fp8_layer import cached_experts, dgrad_pays, keep_empty_copy
from mok.ops import moe
from mok.torch_path import moe_torch, moe_torch_ep


def _keep_fp8_copy_after_load(module, incompatible_keys):
    # (load_state_dict(assign=True) puts new parameters in place: the kept copy follows them; a
    # function of the module, not a lambda, so that torch.save(module) can pickle the hook)
    module._keep_fp8_copy()


class MoE(nn.Module):
    """A SwiGLU mixture-of-experts layer computed by the fused kernel.

    Weights: w_gate, w_up [E, I, H], w_down [E, H, I] (bf16) — or with fused_gate_up=True one
    w_gate_up [E, 2I, H] (gate rows, then up rows: the layout of Hugging Face, torchtitan and
    Megatron checkpoints; the kernel reads its halves in place and writes its gradient as one
    tensor) in place of w_gate and w_up — and with shared_intermediate > 0 one shared expert
    (shared_gate, shared_up [I_s, H], shared_down [H, I_s]).
    router: "softmax" or "sigmoid" scores over a bias-free fp32 linear layer, top_k of them,
    renormalised to sum to one if `renormalize`; None: the caller passes topk_ids and
    topk_weights to forward(). backend: "mok" (the fused kernel, Hopper GPU, bf16) or
    "torch" (mok.moe_torch: the same layer in plain PyTorch, any device and dtype).
    load_balancing: after each routed forward, `aux_loss` holds the Switch-Transformer
    load-balancing loss of that call (add coef * aux_loss to the training loss); None after a
    call that was given topk_ids (no router ran).
    group: a mok.ep.ExpertParallel (over a torch.distributed process group of W ranks): this
    module then holds only its rank's num_experts / W experts (rank r: experts
    [r E/W, (r + 1) E/W)), routes its tokens over all num_experts, and the fused kernels
    exchange rows with the other ranks (backend "torch": mok.moe_torch_ep, all-to-all over
    the group's process group, any device, e.g. gloo on CPUs).
    precision: "bf16", or "fp8" (backend "mok"): the routed experts' forward in E4M3 with
    blockwise scales (mok.moe's precision="fp8"; with a group, mok.ep.moe's); the quantized
    routed weights are kept
    (E * 3 * I * H bytes, made with the module's CUDA weights and again when they move) and
    quantized again when a weight changes: other tensors, their storage or version counter, any
    torch.optim optimizer's step (fused ones included), or mok.fp8.weights_changed() after
    writes that neither sees (through `.data`, an optimizer outside torch.optim) — eagerly into a
    new copy, under torch.compile in place (mok.fp8_layer.cached_experts; a compiled backward
    after a forward with other weights is not supported); a CUDA graph captures the
    quantization itself. fp8_dgrad
    (precision "fp8"): whether the backward's dgrad GEMMs (and then the weight gradients' too)
    run in E4M3 (keeping W_down^T and [W_gate^T | W_up^T] quantized as well: E * 3 * I * H
    bytes more); None: where that was measured faster (mok.fp8.dgrad_pays: I >= 1024).
    recompute (backend "mok", bf16; with or without a group): mok.moe's and mok.ep.moe's
    recompute=True — a training forward keeps no pre-activations for the backward, which runs
    GEMM1 again (the same bits).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 shared_intermediate: int = 0, router: Optional[str] = "softmax", renormalize: bool = True,
                 swiglu_limit: Optional[float] = None, backend: str = "mok", load_balancing: bool = False,
                 group=None, fused_gate_up: bool = False, precision: str = "bf16",
                 fp8_dgrad: Optional[bool] = None, recompute: bool = False, device=None,
                 dtype=torch.bfloat16):
        super().__init__()
        if not isinstance(recompute, bool):
            raise ValueError(f"mok.MoE: 'recompute' must be True or False, got {recompute!r}")
        if recompute and (backend != "mok" or precision != "bf16"):
            raise ValueError("mok.MoE: recompute=True runs on the fused bf16 kernel (backend='mok', "
                             f"precision='bf16'), got backend={backend!r}, precision={precision!r}")
        self.recompute = recompute
        if precision not in ("bf16", "fp8"):
            raise ValueError(f"mok.MoE: 'precision' must be 'bf16' or 'fp8', got {precision!r}")
        if precision == "fp8" and backend != "mok":
            raise ValueError("mok.MoE: precision='fp8' runs on the fused kernel (backend='mok')")
        self.precision = precision
        self.fp8_dgrad = fp8_dgrad
        self._fp8_cache = None  # precision "fp8": the routed weights quantized (mok.fp8_layer.cached_experts)
        for name, n in (("hidden", hidden), ("intermediate", intermediate), ("num_experts", num_experts),
                        ("top_k", top_k), ("shared_intermediate", shared_intermediate)):
            if not isinstance(n, int) or isinstance(n, bool) or n < (0 if name == "shared_intermediate" else 1):
                kind = "an int >= 0 (0: no shared expert)" if name == "shared_intermediate" else "a positive int"
                raise ValueError(f"mok.MoE: '{name}' must be {kind}, got {n!r}")
        if backend == "mok":  # (what the fused kernels take; the torch backend takes any size)
            unit = 128 if precision == "fp8" else 64
            for name, n, need in (("hidden", hidden, unit), ("intermediate", intermediate, unit),
                                  ("shared_intermediate", shared_intermediate, 64)):
                if n % need:
                    raise ValueError(f"mok.MoE: '{name}' must be a multiple of {need} for the fused kernel"
                                     f"{' in FP8' if need == 128 else ''}, got {n}")
        if swiglu_limit is not None and not finite_positive(swiglu_limit):
            raise ValueError(f"mok.MoE: 'swiglu_limit' must be None or a finite positive number, got {swiglu_limit!r}")
        if router not in ("softmax", "sigmoid", None):
            raise ValueError(f"mok.MoE: 'router' must be 'softmax', 'sigmoid' or None, got {router!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"mok.MoE: 'top_k' must be in [1, num_experts = {num_experts}], got {top_k}")
        if backend not in ("mok", "torch"):
            raise ValueError(f"mok.MoE: 'backend' must be 'mok' (the fused kernel) or 'torch', got {backend!r}")
        if backend == "mok" and dtype != torch.bfloat16:
            raise TypeError(f"mok.MoE: expert weights must be torch.bfloat16 for the fused kernel, got {dtype}")
        self.backend = backend
        self.group = group
        local_experts = num_experts
        if group is not None:
            from mok.ep import ExpertParallel

            if not isinstance(group, ExpertParallel):
                raise TypeError(f"mok.MoE: 'group' must be a mok.ep.ExpertParallel, got {type(group).__name__}")
            if num_experts % group.world != 0:
                raise ValueError(f"mok.MoE: num_experts = {num_experts} must be a multiple of the group's "
                                 f"{group.world} ranks")
            local_experts = num_experts // group.world
        if load_balancing and router is None:
            raise ValueError("mok.MoE: 'load_balancing' needs a router (router='softmax' or 'sigmoid')")
        self.load_balancing = load_balancing
        self.aux_loss: Optional[torch.Tensor] = None
        self.hidden, self.intermediate, self.num_experts, self.top_k = hidden, intermediate, num_experts, top_k
        self.router_kind, self.renormalize, self.swiglu_limit = router, renormalize, swiglu_limit
        kw = dict(device=device, dtype=dtype)
        self.fused_gate_up = fused_gate_up
        if fused_gate_up:
            self.w_gate_up = nn.Parameter(torch.empty(local_experts, 2 * intermediate, hidden, **kw))
        else:
            self.w_gate = nn.Parameter(torch.empty(local_experts, intermediate, hidden, **kw))
            self.w_up = nn.Parameter(torch.empty(local_experts, intermediate, hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(local_experts, hidden, intermediate, **kw))
        self.shared = None
        if shared_intermediate:
            self.shared = nn.ParameterList([
                nn.Parameter(torch.empty(shared_intermediate, hidden, **kw)),
                nn.Parameter(torch.empty(shared_intermediate, hidden, **kw)),
                nn.Parameter(torch.empty(hidden, shared_intermediate, **kw))])
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=torch.float32) if router else None
        self.reset_parameters()
        self._keep_fp8_copy()
        self.register_load_state_dict_post_hook(_keep_fp8_copy_after_load)

    @property
    def fp8_dgrad(self) -> Optional[bool]:
        return self._fp8_dgrad_choice

    @fp8_dgrad.setter
    def fp8_dgrad(self, value: Optional[bool]):
        if value is not None and (self.precision != "fp8" or not isinstance(value, bool)):
            raise ValueError(f"mok.MoE: 'fp8_dgrad' must be None, True or False with precision='fp8', got "
                             f"fp8_dgrad={value!r} with precision={self.precision!r}")
        self._fp8_dgrad_choice = value
        if "w_down" in self._parameters:  # (set after construction: the kept copy follows)
            self._keep_fp8_copy()

    def _gate_up(self):
        """(w_gate, w_up) as the layers take them: w_up None, w_gate [E, 2I, H], with fused_gate_up."""
        return (self.w_gate_up, None) if self.fused_gate_up else (self.w_gate, self.w_up)

    def _fp8_dgrad(self) -> bool:
        return dgrad_pays(self.w_down) if self.fp8_dgrad is None else self.fp8_dgrad

    def _keep_fp8_copy(self):
        """precision "fp8" with CUDA weights: an (empty) quantized copy of the routed weights of
        their shapes and device (unless the one held fits), made now so that a first call
        under torch.compile keeps its quantization too (mok.fp8_layer.cached_experts)."""
        if self.precision != "fp8":
            return
        gate, up = self._gate_up()
        keep_empty_copy(self, gate, up, self.w_down, self._fp8_dgrad())

    def __getstate__(self):
        # (torch.save of the whole module, copy.deepcopy: without the quantized copy — E * 3 * I * H
        # bytes or more, made again from the weights — and an empty one made on loading)
        state = self.__dict__.copy()
        state["_fp8_cache"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._keep_fp8_copy()

    def _apply(self, fn, recurse=True):
        # (.to(), .cuda(), to_empty(): the weights may move, and the quantized copy with them)
        module = super()._apply(fn, recurse)
        self._keep_fp8_copy()
        return module

    def extra_repr(self) -> str:
        """What print(model) shows beside the router (nn.Module's convention): the shape and the
        settings a run depends on; the defaults left out."""
        parts = [f"hidden={self.hidden}", f"intermediate={self.intermediate}", f"num_experts={self.num_experts}",
                 f"top_k={self.top_k}"]
        if self.shared is not None:
            parts.append(f"shared_intermediate={self.shared[0].shape[0]}")
        if self.group is not None:
            parts.append(f"local_experts={self.w_down.shape[0]} of {self.group.world} ranks")
        for name, value, default in (("router", self.router_kind, "softmax"), ("backend", self.backend, "mok"),
                                     ("precision", self.precision, "bf16"),
                                     ("recompute", self.recompute, False), ("swiglu_limit", self.swiglu_limit, None),
                                     ("fused_gate_up", self.fused_gate_up, False),
                                     ("load_balancing", self.load_balancing, False)):
            if value != default:
                parts.append(f"{name}={value!r}")
        return ", ".join(parts)

    @torch.no_grad()
    def reset_parameters(self):
        if self.w_down.device.type == "meta":
            return
        gate_up = (self.w_gate_up,) if self.fused_gate_up else (self.w_gate, self.w_up)
        for w, fan_in in [(w, self.hidden) for w in gate_up] + [(self.w_down, self.intermediate)]:
            w.normal_(0.0, 1.0 / math.sqrt(fan_in))
        if self.shared is not None:
            i_s = self.shared[0].shape[0]
            for w, fan_in in zip(self.shared, (self.hidden, self.hidden, i_s)):
                w.normal_(0.0, 1.0 / math.sqrt(fan_in))

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(topk_ids int32 [T, k], topk_weights fp32 [T, k], router logits fp32 [T, E]) for x [T, H]."""
        if self.router is None:
            raise ValueError("mok.MoE: this layer has no router (router=None): pass topk_ids and topk_weights")
        logits = self.router(x.float())
        scores = torch.softmax(logits, dim=-1) if self.router_kind == "softmax" else torch.sigmoid(logits)
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids.to(torch.int32), weights, logits

    def load_balancing_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The Switch-Transformer auxiliary loss E * sum_e f_e * P_e: f_e the fraction of the
        T*k routed slots that chose expert e (no gradient), P_e the mean router probability
        of e (softmax over the logits, whatever the router kind). 1 when perfectly balanced."""
        probs = torch.softmax(logits, dim=-1)
        flat = ids.reshape(-1).long()  # index_add, not bincount: no host sync (CUDA graphs)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts = counts.index_add(0, flat, torch.ones_like(flat)).to(probs.dtype)
        fraction = counts / ids.numel()
        return self.num_experts * (fraction * probs.mean(dim=0)).sum()

    def forward(self, x: torch.Tensor, topk_ids: Optional[torch.Tensor] = None,
                topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape = x.shape
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or shape[-1] != self.hidden:
            raise ValueError(f"mok.MoE: x must be [..., hidden = {self.hidden}], got "
                             + (f"shape {tuple(shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
        x2 = x.reshape(-1, self.hidden)
        if topk_ids is None:
            if topk_weights is not None:
                raise ValueError("mok.MoE: 'topk_weights' was given without 'topk_ids'")
            topk_ids, topk_weights, logits = self.route(x2)
            if self.load_balancing:
                self.aux_loss = self.load_balancing_loss(logits, topk_ids)
        elif topk_weights is None:
            raise ValueError("mok.MoE: 'topk_ids' was given without 'topk_weights'")
        else:
            # The routing of x [..., H]: [..., k] with x's leading dimensions, or [T, k] of the
            # flattened tokens (a reshape would otherwise take e.g. [S, B, k] for x [B, S, H]).
            self.aux_loss = None  # (no router ran: no loss of this call)
            leading, tokens = tuple(shape[:-1]), x2.shape[0]
            for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"mok.MoE: '{name}' must be a torch.Tensor, got {type(t).__name__}")
                if tuple(t.shape) not in (leading + (self.top_k,), (tokens, self.top_k)):
                    forms = list(leading + (self.top_k,))
                    if len(leading) != 1:
                        forms = f"{forms} or {[tokens, self.top_k]}"
                    raise ValueError(f"mok.MoE: '{name}' must be {forms} for x of shape {tuple(shape)} and top_k = "
                                     f"{self.top_k}, got shape {tuple(t.shape)}")
        shared = None if self.shared is None else tuple(self.shared)
        gate, up = self._gate_up()
        ids, weights = topk_ids.reshape(-1, self.top_k), topk_weights.reshape(-1, self.top_k)
        if self.group is not None:
            from mok import ep

            if self.backend == "mok" and self.precision == "fp8":
                y = ep.moe(x2, ids, weights, gate, up, self.w_down, shared=shared, swiglu_limit=self.swiglu_limit,
                           group=self.group, precision="fp8",
                           fp8_experts=cached_experts(self, gate, up, self.w_down, dgrad=self._fp8_dgrad(),
                                                      where="mok.MoE"))
            elif self.backend == "mok":
                y = ep.moe(x2, ids, weights, gate, up, self.w_down, shared=shared,
                           swiglu_limit=self.swiglu_limit, group=self.group, recompute=self.recompute)
            else:  # NCCL (or gloo) all-to-all around the PyTorch path: any device
                if self.group.tokens is not None and x2.shape[0] > self.group.tokens:  # (as the fused path)
                    raise ValueError(f"mok.MoE: x has {x2.shape[0]} tokens, more than the group's tokens = "
                                     f"{self.group.tokens} (mok.ep.ExpertParallel(tokens=...))")
                y = moe_torch_ep(x2, ids, weights, gate, up, self.w_down, shared=shared,
                                 swiglu_limit=self.swiglu_limit, group=self.group.group)
        elif self.precision == "fp8":
            y = moe(x2, ids, weights, gate, up, self.w_down, shared=shared, swiglu_limit=self.swiglu_limit,
                    precision="fp8", recompute=self.recompute,
                    fp8_experts=cached_experts(self, gate, up, self.w_down, dgrad=self._fp8_dgrad(), where="mok.MoE"))
        elif self.backend == "mok":
            y = moe(x2, ids, weights, gate, up, self.w_down, shared=shared, swiglu_limit=self.swiglu_limit,
                    recompute=self.recompute)
        else:
            y = moe_torch(x2, ids, weights, gate, up, self.w_down, shared=shared, swiglu_limit=self.swiglu_limit)
        return y.reshape(shape)
