"""Expert parallelism over torch.distributed.

    group = mok.ep.ExpertParallel(process_group)          # one per process group
    y = mok.ep.moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, group=group)

Each of the group's W ranks holds E / W experts (rank r: experts [r E_l, (r + 1) E_l)) and
T tokens of its own, routed with global expert ids. The layer's symmetric region lives in
PyTorch symmetric memory (one rendezvous per token count, a collective call); the fused
kernels exchange the routing, pull the rows each rank needs and push the results back on
the device, through that region, with no host synchronisation. Results are bitwise equal to
one GPU computing all ranks' tokens with all experts. Launch with torchrun, one process per
GPU, with NVLink multicast off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

Run on two H200s under torchrun (tests/python/test_ep.py: forward and gradients bitwise
equal to one GPU). `mok.moe_torch_ep` is the same split in plain PyTorch (all-to-all).
"""

from typing import Dict, List, Optional, Sequence

import torch

from mok import _C
from mok._checks import as_limit, finite_positive
from mok._state import ep_groups as _groups
from mok.ops import call_layer


class ExpertParallel:
    """The EP state of one process group: its symmetric regions and EpRanks, one per layer
    shape and token count (created on first use, collectively: every rank of the group must
    make the same calls in the same order, with the same token count — pad to a fixed T, or let
    `tokens` below do it).

    timeout_seconds bounds every wait on a peer inside the kernels (the wait starts when the
    GPU reaches it, so it must cover a peer's host-side pauses: checkpoints, evaluation).
    The fused kernels are persistent and use every SM (or compute_sms): kernels of other
    streams on the same GPU (e.g. NCCL collectives of data parallelism) should not run
    concurrently with them, or set compute_sms to leave SMs free.

    comm_sms > 0 (or ring_rows > 0, which takes 1 SM in 32) turns on the ring: comm_sms SMs of
    each rank pull the rows it receives into a ring of ring_rows rows (0 = all of them),
    minibatch_rows at a time, while the others compute; 0 and 0 (the default): every SM pulls
    the rows before the kernel, once per (token, expert) pair, or, with pull_tokens_once, each
    peer token once into a local buffer ([W, T, H] bf16 more memory) and then every row from
    local memory (fewer bytes over NVLink when tokens have several experts on one rank).
    interleave_rows > 0 (a multiple of 128; no ring) runs the forward's GEMM2 tiles of each
    chunk of that many rows right after the next chunk's GEMM1 tiles, so that the result
    pushes to other ranks spread over the kernel instead of crowding its last third; the same
    bits either way. pull_fp8_rows (precision="fp8" layers; not with pull_tokens_once): each
    rank quantizes its own tokens once and its peers pull E4M3 rows (about half the bytes over
    NVLink) instead of bf16 rows they quantize themselves; the same bits; not yet measured.

    tokens (optional): every call's token count T is padded to this one (rows of zeros with no
    expert, -1, and weight 0; their outputs dropped, their gradients zero), so that calls of
    varying T — a last, shorter batch; packed sequences of varying length — run on one EpRank
    per layer shape, with no new collective set-up or memory and no host synchronisation. A
    call with more tokens is refused. Without it, each new T makes a new rank (collectively,
    on every rank of the group).

    capacity_factor: the routed rows a rank has room for, in units of its own T*k (plus each
    local expert's padding to 128-row tiles); 0, the default, is room for the worst case — every
    token of every rank routed to this rank's experts, W*T*k rows. Each layer's saved
    pre-activations (kept until its backward) and the rank's row buffers are sized by it, so
    at W = 8 a factor of 2 holds about a quarter of the default's. A call whose routing sends a
    rank more rows than that stops on every rank and raises at the next call or at mok.check()
    / check() ("capacity exceeded", the rows needed and the capacity); nothing is dropped.
    Choose it above the imbalance your router allows (a rank receiving at most twice its share:
    2.0). A multiple of 1/64 (e.g. 1.25, 1.5, 2), so that its rows are exact in any arithmetic."""

    def __init__(self, group=None, *, compute_sms: int = 0, timeout_seconds: float = 600.0, comm_sms: int = 0,
                 ring_rows: int = 0, minibatch_rows: int = 4096, pull_tokens_once: bool = False,
                 interleave_rows: int = 0, pull_fp8_rows: bool = False, tokens: Optional[int] = None,
                 capacity_factor: float = 0.0):
        import torch.distributed as dist

        _check_ring(comm_sms, ring_rows, minibatch_rows)
        _check_capacity_factor(capacity_factor)
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
            raise ValueError(f"mok.ep.ExpertParallel: tokens must be None or an int >= 1, got {tokens!r}")
        if not isinstance(compute_sms, int) or isinstance(compute_sms, bool) or compute_sms < 0:
            raise ValueError(f"mok.ep.ExpertParallel: compute_sms must be 0 (every SM) or a positive int, got {compute_sms!r}")
        if not finite_positive(timeout_seconds):
            raise ValueError(f"mok.ep.ExpertParallel: timeout_seconds must be a finite positive number, got "
                             f"{timeout_seconds!r}")
        if not isinstance(pull_tokens_once, bool):
            raise ValueError(f"mok.ep.ExpertParallel: pull_tokens_once must be a bool, got {pull_tokens_once!r}")
        if not isinstance(interleave_rows, int) or isinstance(interleave_rows, bool) or interleave_rows < 0 \
                or interleave_rows % 128:
            raise ValueError(f"mok.ep.ExpertParallel: interleave_rows must be 0 or a positive multiple of 128, "
                             f"got {interleave_rows!r}")
        if interleave_rows and (comm_sms or ring_rows):
            raise ValueError(f"mok.ep.ExpertParallel: interleave_rows cannot be combined with the ring (comm_sms = "
                             f"{comm_sms}, ring_rows = {ring_rows})")
        if not isinstance(pull_fp8_rows, bool):
            raise ValueError(f"mok.ep.ExpertParallel: pull_fp8_rows must be a bool, got {pull_fp8_rows!r}")
        if pull_fp8_rows and pull_tokens_once:
            raise ValueError("mok.ep.ExpertParallel: pull_fp8_rows cannot be combined with pull_tokens_once (which "
                             "pulls each peer token once in bf16)")
        if pull_tokens_once and (comm_sms or ring_rows):
            raise ValueError(f"mok.ep.ExpertParallel: pull_tokens_once applies to rows pulled before the kernel; the "
                             f"ring (comm_sms = {comm_sms}, ring_rows = {ring_rows}) pulls its own")
        if not dist.is_initialized():
            raise RuntimeError("mok.ep.ExpertParallel: torch.distributed is not initialised (launch with torchrun "
                               "and call torch.distributed.init_process_group first)")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"mok.ep.ExpertParallel: group must be a torch.distributed ProcessGroup or None (the "
                            f"default group), got {type(group).__name__}")
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.world > _C.MAX_EP_RANKS:
            raise ValueError(f"mok.ep.ExpertParallel: at most {_C.MAX_EP_RANKS} ranks (one NVLink node), got {self.world}")
        self.compute_sms, self.timeout_seconds = compute_sms, timeout_seconds
        self.comm_sms, self.ring_rows, self.minibatch_rows = comm_sms, ring_rows, minibatch_rows
        self.pull_tokens_once, self.interleave_rows = pull_tokens_once, interleave_rows
        self.pull_fp8_rows = pull_fp8_rows
        self.capacity_factor = float(capacity_factor)
        self.tokens = tokens
        self._ranks: Dict[tuple, object] = {}
        self._regions: List[torch.Tensor] = []
        self.id = id(self)
        _groups[self.id] = self

    def rank_for(self, x, w_down, num_experts, top_k, shared_intermediate, swiglu_limit, training, precision="bf16",
                 fp8_dgrad=False, recompute=False):
        """The EpRank for this shape, token count and precision (collective on first use);
        w_down [E_l, H, I]; fp8_dgrad (precision "fp8", training): one that holds the FP8
        dgrad's rows (mok::Config::fp8_dgrad). recompute (bf16, training): a Training::recompute
        rank — its forward saves nothing and its backward runs GEMM1 again (it also serves the
        forwards without autograd of the layers that train with it). Not training: a rank made
        for training this shape in this precision, if there is one (its forward then saves
        nothing), else one of its own (Training::off). precision None (a bf16
        backward on saved pre-activations, after either precision's forward): any saving rank of
        this shape serves it — it re-plans from the routing and reads only the saved tensor, whose
        layout is the same in both precisions — so an existing one, an fp8 one first (a new rank
        would be a collective set-up and more memory), else a bf16 one (every rank of the group
        holds the same ranks: they make the same calls)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        T, H = x.shape
        E_l, _, I = w_down.shape
        shape = (x.device.index, T, H, I, num_experts, E_l, top_k, shared_intermediate, swiglu_limit, training)
        if precision is None:
            fp8 = [v for v in (("fp8", False), ("fp8", True)) if shape + v + (False,) in self._ranks]
            precision, fp8_dgrad = fp8[0] if fp8 else ("bf16", False)
        if recompute and not (training and precision == "bf16"):  # (mok.ep.moe and mok.MoE refuse these first)
            raise ValueError(f"mok.ep: a recompute rank trains in bf16 (got training={training}, "
                             f"precision={precision!r})")
        key = shape + (precision, fp8_dgrad, recompute)
        rank = self._ranks.get(key)
        if rank is not None:
            return rank
        if not training:  # (a forward without autograd: a rank that trains this shape in this precision serves
            # it, saving nothing — as one GPU's training workspace serves evaluation — instead of a second
            # rank's region and row buffers; the first such rank: every process holds the same ranks in
            # the same order, so all pick the same one)
            trains = [r for k, r in self._ranks.items() if k[:-4] == shape[:-1] and k[-4] and k[-3] == precision]
            if trains:
                return trains[0]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mok.ep: the first call for a shape sets up its symmetric memory; run it once before "
                               "capturing a CUDA graph")
        if E_l * self.world != num_experts:
            raise ValueError(f"mok.ep: {self.world} ranks x {E_l} local experts != num_experts = {num_experts}")
        # Every rank must set up the same shape and token count, and lay out its tokens for its peers
        # alike (E4M3 rows or bf16 ones: each rank reads its peers' regions as its own is written).
        keys = [None] * self.world
        e4m3 = precision == "fp8" and self.pull_fp8_rows
        # (and the settings that lay out the exchanges: a ring on one rank only, or another minibatch,
        # would wait in the kernel until its timeout rather than raise)
        layout = (self.comm_sms, self.ring_rows, self.minibatch_rows, self.pull_tokens_once, self.interleave_rows,
                  self.capacity_factor)
        dist.all_gather_object(keys, key[1:] + (e4m3,) + layout, group=self.group)
        if any(k != keys[0] for k in keys):
            raise ValueError(f"mok.ep: the ranks called the layer with different shapes, token counts or settings "
                             f"(T, H, I, E, E_l, k, I_s, limit, training, precision, FP8 dgrad, recompute, E4M3 rows "
                             f"pulled, comm_sms, ring_rows, minibatch_rows, pull_tokens_once, interleave_rows, "
                             f"capacity_factor per rank: "
                             f"{keys}); pad every rank to one T (mok.ep.ExpertParallel(tokens=...) does), and make "
                             f"the group with the same arguments everywhere")
        nbytes = _C.ep_region_bytes(H, I, num_experts, E_l, top_k, shared_intermediate, swiglu_limit, T)
        region = symm_mem.empty(nbytes, dtype=torch.uint8, device=x.device)
        region.zero_()
        torch.cuda.synchronize(x.device)
        handle = symm_mem.rendezvous(region, self.group)
        # The region may start inside the symmetric allocation: the same offset on every rank.
        offset = region.data_ptr() - int(handle.buffer_ptrs[self.rank])
        ptrs = [int(p) + offset for p in handle.buffer_ptrs]
        rank = _C.EpRank(H, I, num_experts, E_l, top_k, shared_intermediate, swiglu_limit, T, self.rank, ptrs,
                         x.device.index, compute_sms=self.compute_sms, timeout_seconds=self.timeout_seconds,
                         training=training, peers_on_other_gpus=self.world > 1, comm_sms=self.comm_sms,
                         ring_rows=self.ring_rows, minibatch_rows=self.minibatch_rows,
                         pull_tokens_once=self.pull_tokens_once, interleave_rows=self.interleave_rows,
                         precision=precision, fp8_dgrad=fp8_dgrad,
                         pull_fp8_rows=self.pull_fp8_rows and precision == "fp8", recompute=recompute,
                         capacity_factor=self.capacity_factor)
        dist.barrier(group=self.group)  # every region zeroed and every rank built before any call
        self._regions.append(region)
        self._ranks[key] = rank
        return rank

    def release(self) -> None:
        """Frees this group's EpRanks and symmetric regions (after the GPU has finished with
        them); the next call sets them up again, collectively."""
        if self._ranks:
            torch.cuda.synchronize()
        self._ranks.clear()
        self._regions.clear()

    def check(self) -> None:
        """Synchronises and raises ValueError (naming rank and peer) if a kernel recorded an error."""
        for rank in self._ranks.values():
            rank.check(torch.cuda.current_stream().cuda_stream)


def _check_capacity_factor(capacity_factor) -> None:
    """0 or a positive multiple of 1/64 (mok.ops' saved-tensor arithmetic takes ceil(factor*T*k)
    as an integer division, exact for those — and the same as the C++'s in doubles)."""
    import numbers

    f = float(capacity_factor) if isinstance(capacity_factor, numbers.Real) and not isinstance(capacity_factor, bool) \
        else float("nan")
    if not (0 <= f < float("inf") and f * 64 == int(f * 64)):
        raise ValueError(f"mok.ep.ExpertParallel: capacity_factor must be 0 (room for the worst case) or a positive "
                         f"multiple of 1/64 (e.g. 1.25, 1.5, 2), got {capacity_factor!r}")


def _check_ring(comm_sms, ring_rows, minibatch_rows) -> None:
    """Raises ValueError naming the first bad ring argument (mok::Config's rules)."""
    for name, v in (("comm_sms", comm_sms), ("ring_rows", ring_rows), ("minibatch_rows", minibatch_rows)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"mok.ep.ExpertParallel: {name} must be an int >= 0, got {v!r}")
    if minibatch_rows == 0 or minibatch_rows % 128:
        raise ValueError(f"mok.ep.ExpertParallel: minibatch_rows must be a positive multiple of 128, "
                         f"got {minibatch_rows}")
    if ring_rows % minibatch_rows:
        raise ValueError(f"mok.ep.ExpertParallel: ring_rows must be 0 or a multiple of minibatch_rows = "
                         f"{minibatch_rows}, got {ring_rows}")


def _padded_tokens(group: ExpertParallel, x, topk_ids, topk_weights):
    """(x, topk_ids, topk_weights) padded to group.tokens rows (zeros, no expert, weight 0), or None
    when the group has no fixed token count or the call has exactly it; ValueError when it has more."""
    P = group.tokens
    tensors = all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (x, topk_ids, topk_weights))
    if P is None or not tensors or x.shape[0] == P or not x.shape[0] == topk_ids.shape[0] == topk_weights.shape[0]:
        return None  # (bad arguments: the layer's checks name them)
    T = x.shape[0]
    if T > P:
        raise ValueError(f"mok.ep.moe: x has {T} tokens, more than the group's tokens = {P} "
                         f"(mok.ep.ExpertParallel(tokens=...), which every call is padded to)")
    pad = P - T
    ids = torch.cat([topk_ids, topk_ids.new_full((pad, topk_ids.shape[1]), -1)])
    return (torch.nn.functional.pad(x, (0, 0, 0, pad)), ids, torch.nn.functional.pad(topk_weights, (0, 0, 0, pad)))


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
        w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
        swiglu_limit: Optional[float] = None, *, group: ExpertParallel, precision: str = "bf16",
        fp8_experts=None, recompute: bool = False) -> torch.Tensor:
    """This rank's part of the expert-parallel layer: x [T, H] its tokens, topk_ids [T, k]
    global expert ids, w_gate/w_up/w_down its E_l = E / W experts (as for mok.moe: w_up None
    takes w_gate as [E_l, 2I, H]). The shared expert (if any) is applied to this rank's tokens;
    its gradient is this rank's share (all-reduce it with the data-parallel gradients). The
    same custom ops as mok.moe (mok::moe_forward, ...), with this group's id.
    precision="fp8": the routed experts' forward in E4M3 as mok.moe's (each routed row pulled
    from the rank that owns its token and quantized per 1 x 128 before the kernel; results
    bitwise equal to one GPU's FP8 forward over every rank's tokens); fp8_experts: this rank's
    experts from mok.fp8.quantize_experts(w_gate, w_up, w_down[, dgrad=True]), else the call
    quantizes them. Training: the backward on the FP8 forward's activations — with dgrad=True its
    dgrad GEMMs in E4M3 too (the dy rows quantized as they are pulled) and its weight gradients
    as mok.set_fp8_weight_gradients says, as on one GPU (bitwise equal to it either way). The
    ring (comm_sms, ring_rows) is bf16 only.
    recompute=True (bf16): as mok.moe's — the training forward keeps no pre-activations (no
    k*2I*2 bytes a token of this rank's share until the backward) and the backward runs GEMM1
    again first, on the rows it pulls anyway; the same bits as without it. The rank's EpRank is a
    Training::recompute one (the ranks of a group must agree on it, as on every setting), which
    holds one layer's pre-activations for the recompute itself (an EP rank owns its buffers, where
    one GPU's recompute takes them from the backward's scratch): L layers of one shape keep one
    such buffer instead of L saved tensors. Calls without autograd run on that rank too (a layer
    that only infers needs no recompute: without it they get a lighter inference rank)."""
    if not isinstance(group, ExpertParallel):
        raise TypeError(f"mok.ep.moe: 'group' must be a mok.ep.ExpertParallel, got {type(group).__name__}")
    if type(recompute) is not bool:
        raise ValueError(f"mok.ep.moe: recompute must be True or False, got {recompute!r}")
    if recompute and precision == "fp8":
        raise ValueError("mok.ep.moe: recompute=True needs precision='bf16': the FP8 backward reads the "
                         "pre-activations the FP8 forward saved (a recompute would redo GEMM1 in bf16)")
    swiglu_limit = as_limit(swiglu_limit)
    padded = _padded_tokens(group, x, topk_ids, topk_weights)
    if padded is not None:  # (ExpertParallel(tokens=...): this call's T < the group's)
        T = x.shape[0]
        y = moe(*padded, w_gate, w_up, w_down, shared, swiglu_limit, group=group, precision=precision,
                fp8_experts=fp8_experts, recompute=recompute)
        return y[:T]
    num_experts = w_gate.shape[0] * group.world if isinstance(w_gate, torch.Tensor) and w_gate.dim() > 0 else 0
    if precision == "fp8":
        from mok.fp8_layer import moe_fp8

        if group.comm_sms or group.ring_rows:
            raise ValueError(f"mok.ep.moe: precision='fp8' pulls its rows before the kernel; the ring (comm_sms = "
                             f"{group.comm_sms}, ring_rows = {group.ring_rows}) carries bf16 rows only for now")
        return moe_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, fp8_experts,
                       num_experts=num_experts, group_id=group.id)
    if precision != "bf16":
        raise ValueError(f"mok.ep.moe: precision must be 'bf16' or 'fp8', got {precision!r}")
    if fp8_experts is not None:
        raise ValueError("mok.ep.moe: fp8_experts was given, but precision is 'bf16' (pass precision='fp8')")
    return call_layer(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit, num_experts, group.id,
                      recompute)
