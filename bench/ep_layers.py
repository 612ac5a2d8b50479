"""bench/ep_bench.py's inputs, implementations and measuring helpers, one rank's view: seeded per-rank inputs
and routings, the expert-parallel layer in PyTorch (route, all-to-all of counts and rows,
the local experts' grouped GEMMs, combine; eager or compiled), mok.ep.moe, and the fused
kernel on the rows a rank receives (mok-compute)."""
import statistics

import torch
import torch.distributed as dist

import layer_bench
import torch_baseline as tb

from mok.torch_path import _Exchange  # (all_to_all_single with autograd)


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------

def tensor_seed(seed, rank, name):
    """hash_fill's seed of one rank's tensor: distinct per run seed, rank and tensor."""
    return (seed * 64 + rank) * 16 + tb.TENSOR_SEEDS[name]


def rank_routing(p, world, rank, kind, seed, device):
    """This rank's tokens of one global routing (T x W tokens over E = E_l x W experts, one
    seed on every rank) and the global routing's load ratios (busiest expert / mean, busiest
    receiving rank / mean)."""
    T, E_l, k = p["tokens"], p["experts"], p["top_k"]
    ids, weights = tb.make_routing(T * world, E_l * world, k, kind, seed, device)
    load = tb.max_load_ratio(ids, E_l * world)
    per_rank = torch.bincount((ids // E_l).reshape(-1).long(), minlength=world).double()
    mine = slice(rank * T, (rank + 1) * T)
    return ids[mine].contiguous(), weights[mine].contiguous(), load, float(per_rank.max() / per_rank.mean())


def make_inputs(p, world, rank, routing, seed, device):
    """This rank's problem: its tokens and routing, its experts (gate and up separate for
    mok, concatenated [E_l, 2I, H] for the PyTorch paths, as frameworks store them)."""
    T, H, I, E_l = p["tokens"], p["hidden"], p["intermediate"], p["experts"]
    fill = lambda name, *shape: tb.hash_fill(shape, tensor_seed(seed, rank, name), device)
    d = dict(x=fill("x", T, H), w_gate=fill("gate", E_l, I, H), w_up=fill("up", E_l, I, H),
             w_down=fill("down", E_l, H, I), dy=fill("dy", T, H))
    d["ids"], d["weights"], d["max_load_ratio"], d["max_rank_load_ratio"] = rank_routing(p, world, rank, routing,
                                                                                          seed, device)
    d["local_ids"] = d["ids"] % E_l  # mok-compute: the same rows over this rank's experts
    d["w_gate_up"] = torch.cat([d["w_gate"], d["w_up"]], dim=1)
    d.update(shared=None, shared_gate_up=None, shared_down=None, limit=p["swiglu_limit"] or None)
    return d


def sampled_reference(d, p, world, seed, count=16):
    """(rows, fp32 y of those `count` sampled tokens of this rank), one pair at a time from
    the layer's definition; each owner's experts regenerated from its seeds, one owner at a
    time, so no rank needs another's tensors."""
    T, H, I, E_l, k = p["tokens"], p["hidden"], p["intermediate"], p["experts"], p["top_k"]
    rows = torch.randperm(T, generator=torch.Generator(device="cpu").manual_seed(5))[:count].tolist()
    x, w = d["x"][rows].detach().float(), d["weights"][rows].detach().float()
    ids = d["ids"][rows].long().cpu()
    acc = torch.zeros(len(rows), H, device=x.device, dtype=torch.float32)
    for q in range(world):
        pairs = [(i, j) for i in range(len(rows)) for j in range(k) if int(ids[i, j]) // E_l == q]
        if not pairs:
            continue
        fill = lambda name, *shape: tb.hash_fill(shape, tensor_seed(seed, q, name), x.device)
        gate, up, down = fill("gate", E_l, I, H), fill("up", E_l, I, H), fill("down", E_l, H, I)
        for i, j in pairs:
            e = int(ids[i, j]) % E_l
            h = tb.swiglu(gate[e].float() @ x[i], up[e].float() @ x[i], d["limit"])
            acc[i] += w[i, j] * (down[e].float() @ h)
        del gate, up, down
    return rows, acc


# ---------------------------------------------------------------------------------------
# The NCCL + PyTorch layer: eager pieces, compiled or not, around eager collectives
# ---------------------------------------------------------------------------------------

def route(x, ids, experts):
    """This rank's (token, slot) pairs sorted by expert, hence by destination rank: `order`
    (the flat pair index t·k + j of each sorted row), the rows of x to send in that order,
    and each expert's pair count (searchsorted, not bincount: no data-dependent shape)."""
    k = ids.shape[1]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    bounds = torch.arange(experts, device=ids.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, bounds, right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return order, x.index_select(0, order // k), counts


def exchange_counts(counts, world, group):
    """The per-(source rank, local expert) counts of the rows about to arrive (one small NCCL
    all_to_all), and the split sizes both exchanges need, read on the host in one go (the
    one synchronisation the NCCL path cannot avoid)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(world, -1)
    send_sizes, recv_sizes = torch.stack([counts.view(world, -1).sum(1), received.sum(1)]).tolist()
    return received, send_sizes, recv_sizes


def expert_rows(x_in, recv_counts, w_gate_up, w_down, limit):
    """The rows this rank received through its experts, returned in arrival order. They
    arrive by source rank, each source's sorted by expert ((s, e) segments of
    recv_counts[s, e] rows); the grouped GEMMs need them by expert ((e, s) segments). The
    permutation between the two is arithmetic on the [W, E_l] counts, a searchsorted per
    row: no sort of the rows (Inductor's sort lowering guards on the row count, which
    changes every call)."""
    W, E_l = recv_counts.shape
    by_expert = recv_counts.t().reshape(-1)  # segment sizes in (e, s) order
    ends = torch.cumsum(by_expert, 0)
    arrival = recv_counts.reshape(-1)
    arrival_start = (torch.cumsum(arrival, 0) - arrival).view(W, E_l).t().reshape(-1)  # (e, s) order
    pos = torch.arange(x_in.shape[0], device=x_in.device)
    seg = torch.searchsorted(ends, pos, right=True)
    src = arrival_start[seg] + pos - (ends - by_expert)[seg]  # arrival row of the pos-th row by expert
    offs = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)  # end of each local expert's rows
    gu = torch._grouped_mm(x_in.index_select(0, src), w_gate_up.transpose(-2, -1), offs=offs)
    g, u = gu.split(w_gate_up.shape[1] // 2, dim=-1)
    out = torch._grouped_mm(tb.swiglu(g, u, limit), w_down.transpose(-2, -1), offs=offs)
    return torch.index_copy(torch.empty_like(out), 0, src, out)  # row src[i] <- out[i]


def combine(returned, order, weights):
    """y[t] = Σ_j weights[t, j] · (the result row of pair (t, j)) in fp32, to bf16. The rows
    come back in the order they were sent (by expert): the un-permute is a row scatter and
    the weighted sum is left to Inductor to fuse, as torch_baseline.moe_compilable does."""
    T, k = weights.shape
    per_slot = torch.index_copy(torch.empty_like(returned), 0, order, returned).view(T, k, -1)
    return (per_slot.float() * weights.unsqueeze(-1)).sum(1).to(returned.dtype)


class TorchEp:
    """torch-ep (eager) or torch-compiled-ep, called as torch_baseline's layers are (so
    torch_baseline.TorchImpl drives it): this rank holds the w_gate_up.shape[0] = E_l experts
    [rank·E_l, (rank+1)·E_l) of E = E_l·W; every id in [0, E) (no -1, as the benchmark's
    routings); no shared expert.

    How the compiled pieces meet a row count that changes every call: the expert piece is
    compiled once with the received rows' dimension marked dynamic
    (torch._dynamo.mark_dynamic), everything else static. The other way, padding to a fixed
    capacity, has to cover every pair of every rank landing on one rank: T·k·W rows, W times
    the mean, and the SwiGLU, the gathers and their gradients would then run over all of them
    (deepseek-v3 at W = 8: a 4.3 GB gate|up activation in place of 0.5 GB), while
    torch._grouped_mm with dynamic M costs nothing over static. Only counts of 0 or 1 rows
    (specialised by dynamo) would compile again, within configure_compile's limit; past it,
    or on a graph break, torch.compile raises rather than falling back to eager."""

    def __init__(self, group=None, compiled=False):
        self.group, self.compiled = group, compiled
        pieces = (route, expert_rows, combine)
        if compiled:
            pieces = tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in pieces)
        self.route, self.experts, self.combine = pieces

    def __call__(self, x, ids, weights, w_gate_up, w_down, limit, shared_gate_up=None, shared_down=None):
        if shared_gate_up is not None:
            raise ValueError("ep_bench: the EP layers here have no shared expert")
        world = dist.get_world_size(self.group)
        order, rows, counts = self.route(x, ids, w_gate_up.shape[0] * world)
        recv_counts, send_sizes, recv_sizes = exchange_counts(counts, world, self.group)
        x_in = _Exchange.apply(rows, recv_sizes, send_sizes, self.group)
        if self.compiled:
            torch._dynamo.mark_dynamic(x_in, 0)  # one graph for every row count
        out = self.experts(x_in, recv_counts, w_gate_up, w_down, limit)
        returned = _Exchange.apply(out, send_sizes, recv_sizes, self.group)
        return self.combine(returned, order, weights)


# ---------------------------------------------------------------------------------------
# mok's layers, driven like the PyTorch ones
# ---------------------------------------------------------------------------------------

class MokEp(layer_bench.MokPy):
    """mok.ep.moe on this rank's share (gate and up separate), through `group`: mok-ep's
    mok.ep.ExpertParallel, or a mok-ep-ring{N}'s (comm_sms = N); precision "fp8" (mok-ep-fp8):
    this rank's experts quantized once here, with the dgrad's copies where mok.fp8.dgrad_pays
    (as mok-fp8-py: its backward then runs the FP8 dgrad and weight gradients); recompute
    (mok-ep-recompute): mok.ep.moe's recompute=True."""

    def __init__(self, d, group, precision="bf16", recompute=False):
        super().__init__(d)
        self.group, self.precision, self.recompute = group, precision, recompute
        if precision == "fp8":
            import mok.fp8

            self.fp8_dgrad = bool(mok.fp8.dgrad_pays(d["w_down"]))
            self.experts = mok.fp8.quantize_experts(d["w_gate"], d["w_up"], d["w_down"], dgrad=self.fp8_dgrad)

    def _call(self):
        d = self.d
        extra = dict(recompute=True) if self.recompute else {}
        if self.precision == "fp8":
            extra.update(precision="fp8", fp8_experts=self.experts)
        return self.mok.ep.moe(d["x"], d["ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"],
                               swiglu_limit=d["limit"], group=self.group, **extra)

    def outputs(self, pass_):
        out = super().outputs(pass_)
        self.group.check()  # raises (naming rank and peer) if a kernel recorded an error
        return out


class MokCompute(layer_bench.MokPy):
    """mok.moe on this rank's rows over its own experts (ids mod E_l, computed once)."""

    def _call(self):
        d = self.d
        return self.mok.moe(d["x"], d["local_ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"],
                            swiglu_limit=d["limit"])


def rank_bytes(obj, pass_, device, held):
    """(obj.outputs(pass_), the device bytes outside PyTorch's allocator of the EpRanks that pass
    used): each rank's symmetric region and workspace, measured (outside_allocator) by the call
    that made it and kept in `held` ({id(rank): bytes}, one dict per implementation, across its
    passes) — so a rank made by an earlier pass counts in every pass that uses it (a recompute
    rank serves the forward without autograd and the training step alike; counting only what a
    pass newly made would leave that rank's workspace out of the training step's peak)."""
    group, used = obj.group, []
    rank_for = group.rank_for

    def spy(*args, **kwargs):
        rank = rank_for(*args, **kwargs)
        used.append(rank)
        return rank

    made = {id(r) for r in group._ranks.values()}
    group.rank_for = spy  # (mok.ep's calls look it up on the group object)
    try:
        out, grown = outside_allocator(lambda: obj.outputs(pass_), device)
    finally:
        del group.rank_for
    ids = list(dict.fromkeys(id(r) for r in used))
    fresh = [i for i in ids if i not in made]
    for n, i in enumerate(fresh):  # (what one call made, counted once)
        held[i] = grown if n == 0 else 0
    return out, sum(held.get(i, 0) for i in ids)


def outside_allocator(fn, device):
    """(fn(), device bytes it left allocated outside PyTorch's caching allocator):
    cudaMemGetInfo's drop less the allocator's growth."""
    torch.cuda.synchronize(device)
    free, reserved = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
    out = fn()
    torch.cuda.synchronize(device)
    grown = torch.cuda.memory_reserved(device) - reserved
    return out, max(0, free - torch.cuda.mem_get_info(device)[0] - grown)


# ---------------------------------------------------------------------------------------
# Across ranks
# ---------------------------------------------------------------------------------------

def synced(before):
    """`before`, then every rank lines up: each timed iteration starts together."""
    def run():
        if before:
            before()
        dist.barrier()
    return run


def gather(values, world, device):
    """[world, len(values)] float64 of every rank's values (all ranks call it together)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    every = torch.empty(world * len(values), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, mine)
    return every.view(world, -1)


def all_agree(flags, device):
    """Each flag true only if it is true on every rank (all_reduce MIN)."""
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


def round_stats(times, world, device):
    """One round of one key: (the slowest rank's median, p10, p90, every rank's median);
    times is this rank's sorted iterations."""
    every = gather([statistics.median(times), times[len(times) // 10], times[len(times) * 9 // 10]], world, device)
    med, p10, p90 = every.max(0).values.tolist()
    return med, p10, p90, every[:, 0].tolist()


def exchange_bytes(send_sizes, recv_sizes, rank, row_bytes):
    """(dispatch, combine) bytes this rank sends to other ranks: its pairs' rows routed to
    experts elsewhere, and the result rows of other ranks' pairs it sends back."""
    return ((sum(send_sizes) - send_sizes[rank]) * row_bytes, (sum(recv_sizes) - recv_sizes[rank]) * row_bytes)


def nccl_steps(d, world, group):
    """{exchange: fn}: NCCL's all_to_all_single of this routing's rows alone, each way, and
    the exchange's split sizes."""
    _, rows, counts = route(d["x"].detach(), d["ids"], d["w_gate"].shape[0] * world)
    _, send_sizes, recv_sizes = exchange_counts(counts, world, group)
    arrived = rows.new_empty(sum(recv_sizes), rows.shape[1])
    back = rows.new_empty(rows.shape)
    steps = {"dispatch": lambda: dist.all_to_all_single(arrived, rows, recv_sizes, send_sizes, group=group),
             "combine": lambda: dist.all_to_all_single(back, arrived, send_sizes, recv_sizes, group=group)}
    return steps, send_sizes, recv_sizes


# ---------------------------------------------------------------------------------------
# One preset and routing
# ---------------------------------------------------------------------------------------

def check_outputs(out, ref, sampled=None):
    """{passed, rel, cos, tensors[, sampled]} of one pass's outputs against the reference's
    (and y's sampled rows against fp32); rel and cos are the worst over the tensors."""
    res = layer_bench.full_check(out, ref, out.keys())
    if sampled is not None:
        res["y_sampled_fp32"] = sampled(out["y"])
    return dict(passed=all(r["passed"] for r in res.values()), rel=max(r["rel"] for r in res.values()),
                cos=min(r["cos"] for r in res.values()), tensors=res)
