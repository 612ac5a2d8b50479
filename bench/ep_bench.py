#!/usr/bin/env python3
"""Expert parallelism across the GPUs of one node, under torchrun: every implementation on
the same inputs, in one run, interleaved, checked at full size before it is timed.

  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
  torchrun --standalone --nproc-per-node W bench/ep_bench.py [--preset NAME,...]
      [--routing uniform,zipf1.2] [--impl mok-ep,torch-compiled-ep,torch-ep,mok-compute]
      [--pass fwd,fwd+bwd] [--repeats 3] [--iters 10] [--out FILE.json]

NVLink multicast stays off (NCCL's NVLS collectives, PyTorch symmetric memory's and
NVSHMEM's multicast objects): a program that uses it can put a shared host's GPUs out of
service. The script sets the three variables above itself before NCCL or symmetric memory
start (NO_MULTICAST), whatever the environment says; keep them in the command line anyway,
for whatever else the launch starts.

The problem: every rank holds a preset's per-rank share (presets.csv): T tokens of hidden H,
routed top-k over the E = experts x W experts of the group, of which rank r holds the
E_l = experts experts [r E_l, (r + 1) E_l). The routing is one global routing of T x W
tokens drawn with one seed (torch_baseline.make_routing over the E experts), rank r taking
tokens [r T, (r + 1) T): every rank sees the same expert popularity, as under one router.
(Seeding each rank's routing separately would shuffle zipf1.2's popular experts per rank and
average the skew away: at W = 8, E = 256 the busiest expert drops from ~30x the mean to ~5x.)
Each rank's tensors come from torch_baseline.hash_fill with seeds of its own.

impls:
  mok-ep             mok.ep.moe: the fused kernels with the exchange, pull and push between
                     ranks through symmetric memory (no host synchronisation)
  torch-compiled-ep  the strongest NCCL + PyTorch layer we can write: mok.moe_torch_ep's
                     split (NCCL all_to_all_single dispatch and combine, split sizes read on
                     the host), with this rank's device work in three torch.compile(
                     dynamic=False, fullgraph=True) pieces: the routing (pairs sorted by
                     expert, the rows to send, per-expert counts), the expert rows (regroup
                     by local expert, gate|up as one torch._grouped_mm over [E_l, 2I, H],
                     SwiGLU, the down torch._grouped_mm, back to arrival order) and the fp32
                     weighted combine. The collectives stay eager between them: their split
                     sizes are host integers, so they cannot live in a graph. A graph break
                     or a recompile-limit fallback to eager raises (configure_compile).
  torch-ep           the same layer in eager PyTorch (the same functions, not compiled): the
                     NCCL + PyTorch baseline as frameworks run it. It is mok.moe_torch_ep's
                     algorithm with gate|up as one weight, and the per-(rank, expert) counts
                     exchanged in place of each row's expert id (the receiver rebuilds those)
  mok-compute        mok.moe on this rank's rows alone (its T tokens over its E_l experts,
                     ids mod E_l, no communication): the compute the EP layer cannot go below

Checks, per preset and routing, before anything is timed (rel = ‖got − ref‖/‖ref‖ <= 1e-2,
cosine >= 0.9999, nothing non-finite: torch_baseline.compare):
  - torch-ep: y of 16 sampled tokens against an fp32 per-token computation from the layer's
    definition (the other ranks' experts regenerated from their seeds);
  - torch-compiled-ep and mok-ep: y and, for fwd+bwd, dx, d_topk_weights, d_w_gate, d_w_up,
    d_w_down against autograd through torch-ep (gate and up are the halves of its gate|up
    gradient); torch-compiled-ep's sampled y against fp32 as well;
  - mok-compute: the same outputs against autograd through torch_baseline.moe_eager on the
    same rows.
A record's `check` is "passed" only if it passed on every rank (all_reduce); a failure to run
(a compile error, a graph break) leaves the implementation out on every rank. Either makes
the exit status 1.

Timing: --repeats rounds; in each, every pass of every implementation in turn (A B C A B C
…), then the NCCL exchanges alone; per key --warmup then --iters iterations, the L2 flushed
and the ranks lined up (barrier) before each (CUDA events). Per round, the slowest rank's
median, p10 and p90 (the layer waits for its slowest rank; the max over an all_gather, which
also gives each rank's): `ms_repeats`, `ms_p10_repeats`, `ms_p90_repeats`; `ms` is the
median of the rounds' medians, `ms_min`/`ms_max` their range, `rank_ms` each rank's median
of its own round medians.

Routing fields: `max_load_ratio` = the busiest expert's pairs over the mean pairs per expert,
over the whole global routing (all ranks' tokens); `max_rank_load_ratio` = the rows the
busiest rank receives over the mean (what EP waits for).

Exchange rates, per GPU (1 GB = 1e9 bytes). `dispatch_bytes`: the bf16 rows (H x 2 bytes) a
rank sends to other ranks in the forward dispatch, one per (token, expert) pair whose expert
lives on another rank (rows for its own experts are not counted); `combine_bytes`: the bf16
result rows it sends back to other ranks in the combine (one per pair it received from
another rank), as the NCCL path moves them (mok-ep's own formats may differ); both are the
busiest rank's. On the fwd records of mok-ep, torch-compiled-ep and torch-ep,
`dispatch_gbps` / `combine_gbps` = those bytes over the record's whole forward time: an
effective rate, a lower bound on what the exchange sustained inside the layer.
`nccl_dispatch_ms` / `nccl_combine_ms`: NCCL's all_to_all_single of the same rows with the
same split sizes alone (timed in the rounds like an implementation, slowest rank's median,
median of rounds), and `nccl_dispatch_gbps` / `nccl_combine_gbps` the bytes over them.

Peak memory (`peak_bytes`, the largest over ranks): PyTorch's peak allocated bytes over one
pass above what was allocated before it (weight gradients cleared first, so fwd+bwd counts
them); mok-compute adds its workspace; mok-ep adds the device memory its first call for the
shape took outside PyTorch's allocator (symmetric region, EpRank workspace: cudaMemGetInfo's
drop less the allocator's growth). NCCL's own buffers are not counted for anyone.

Records keep bench/report.py's fields (preset, impl, pass, routing, tokens, ep = W, ms,
tflops, peak_bytes, gpu, commit, date); TFLOP/s are per GPU (layer_flops of one rank's T
tokens).
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import layer_bench  # noqa: E402
import torch_baseline as tb  # noqa: E402

from mok.torch_path import _Exchange  # noqa: E402  (all_to_all_single with autograd)

IMPLS = ("mok-ep", "torch-compiled-ep", "torch-ep", "mok-compute")
EXCHANGES = ("dispatch", "combine")
DEFAULT_PRESETS = "deepseek-v3,qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


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
    """mok.ep.moe on this rank's share (gate and up separate)."""

    def __init__(self, d, group):
        super().__init__(d)
        self.group = group

    def _call(self):
        d = self.d
        return self.mok.ep.moe(d["x"], d["ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"],
                               swiglu_limit=d["limit"], group=self.group)

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


def run_checks(d, p, args, ctx):
    """Runs every implementation once per pass and checks it (module docstring); returns
    ({impl: object}, {impl: {pass: check}}, {impl: {pass: extra peak bytes}}, {impl: error})."""
    passes, name = args.passes, p["name"]
    rows, want = sampled_reference(d, p, ctx.world, args.seed)
    sampled = lambda y: tb.compare(y[rows].detach().float(), want)
    checks = {impl: {} for impl in IMPLS}
    extra = {impl: {} for impl in IMPLS}
    errors = {}

    eager = tb.TorchImpl(d, args.torch_ep)  # the reference: autograd through torch-ep
    ref = {ps: eager.outputs(ps) for ps in passes}
    for ps in passes:
        res = sampled(ref[ps]["y"])
        checks["torch-ep"][ps] = dict(passed=res["passed"], rel=res["rel"], cos=res["cos"],
                                      tensors={"y_sampled_fp32": res})
    impls = {"torch-ep": eager}

    def attempt(impl, make, check_pass):
        if impl not in args.impls:
            return
        try:
            obj = make()
            for ps in passes:
                checks[impl][ps] = check_pass(obj, ps)
            impls[impl] = obj
        except Exception as e:  # a compile error, a graph break, a kernel error: no record
            errors[impl] = f"{type(e).__name__}: {e}"[:2000]
            print(f"  rank {ctx.rank} {name} {impl}: FAILED TO RUN: {errors[impl][:400]}", flush=True)

    attempt("torch-compiled-ep", lambda: tb.TorchImpl(d, args.torch_compiled_ep),
            lambda obj, ps: check_outputs(obj.outputs(ps), ref[ps], sampled))

    def mok_ep_pass(obj, ps):  # its first call per pass sets up the shape's region and EpRank
        out, extra["mok-ep"][ps] = outside_allocator(lambda: obj.outputs(ps), ctx.device)
        return check_outputs(out, ref[ps])

    attempt("mok-ep", lambda: MokEp(d, ctx.group), mok_ep_pass)
    ref.clear()  # (frees the reference outputs before timing)
    local = tb.TorchImpl(dict(d, ids=d["local_ids"]), tb.moe_eager)  # mok-compute's reference

    def mok_compute_pass(obj, ps):
        c = check_outputs(obj.outputs(ps), local.outputs(ps))
        extra["mok-compute"][ps] = obj.workspace_bytes()
        return c

    attempt("mok-compute", lambda: MokCompute(d), mok_compute_pass)
    return impls, checks, extra, errors


def run_preset(p, routing, args, ctx, emit):
    """Checks, then interleaved timing and peak memory, of every implementation on one
    preset and routing; emits one record per implementation and pass (the same on every
    rank); returns the implementations that failed to run."""
    name, passes, world = p["name"], args.passes, ctx.world
    d = make_inputs(p, world, ctx.rank, routing, args.seed, ctx.device)
    impls, checks, extra, errors = run_checks(d, p, args, ctx)
    ran = all_agree([impl not in errors for impl in IMPLS], ctx.device)
    failed = [impl for impl, ok in zip(IMPLS, ran) if impl in args.impls and not ok]
    keys = [(impl, ps) for ps in passes for impl in args.impls if impl in impls and impl not in failed]
    verdicts = all_agree([checks[impl][ps]["passed"] for impl, ps in keys], ctx.device)
    worst = gather([v for impl, ps in keys for v in (checks[impl][ps]["rel"], -checks[impl][ps]["cos"])], world,
                   ctx.device).max(0).values.tolist() if keys else []
    for i, (impl, ps) in enumerate(keys):
        checks[impl][ps].update(passed=verdicts[i], rel_all_ranks=worst[2 * i], cos_all_ranks=-worst[2 * i + 1])
        if not verdicts[i] and ctx.rank == 0:
            print(f"  {name} {routing} {impl} {ps}: CHECK FAILED: {json.dumps(checks[impl][ps])[:600]}", flush=True)

    nccl, send_sizes, recv_sizes = nccl_steps(d, world, ctx.group.group)
    sent = gather(exchange_bytes(send_sizes, recv_sizes, ctx.rank, p["hidden"] * 2), world, ctx.device)
    dispatch_bytes, combine_bytes = (int(v) for v in sent.max(0).values.tolist())

    def timer(key):
        impl, what = key
        fn, before = (nccl[what], None) if impl == "nccl" else impls[impl].step(what)
        return tb.time_ms(fn, args.warmup, args.iters, synced(before))

    timed = keys + [("nccl", e) for e in EXCHANGES]
    rounds = {key: [] for key in timed}
    for _ in range(args.repeats):
        for key in timed:
            rounds[key].append(round_stats(timer(key), world, ctx.device))
            if key[0] == "mok-ep":
                ctx.group.check()
    nccl_ms = {e: statistics.median(r[0] for r in rounds[("nccl", e)]) for e in EXCHANGES}
    rate = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9 if nbytes else None

    for impl, ps in keys:
        fn, before = impls[impl].step(ps)
        peak = tb.peak_bytes(fn, synced(before)) + extra[impl].get(ps, 0)
        peak = int(gather([peak], world, ctx.device).max())
        medians = [r[0] for r in rounds[(impl, ps)]]
        ms = statistics.median(medians)
        comm = ps == "fwd" and impl != "mok-compute"
        c = checks[impl][ps]
        emit(dict(preset=name, impl=impl, **{"pass": ps}, routing=routing, max_load_ratio=d["max_load_ratio"],
                  max_rank_load_ratio=d["max_rank_load_ratio"], tokens=p["tokens"], ep=world, hidden=p["hidden"],
                  intermediate=p["intermediate"], experts=p["experts"], experts_global=p["experts"] * world,
                  top_k=p["top_k"], shared_intermediate=p["shared_intermediate"], swiglu_limit=p["swiglu_limit"],
                  ms=ms, ms_min=min(medians), ms_max=max(medians), repeats=len(medians), ms_repeats=medians,
                  ms_p10_repeats=[r[1] for r in rounds[(impl, ps)]], ms_p90_repeats=[r[2] for r in rounds[(impl, ps)]],
                  rank_ms=[statistics.median(r[3][q] for r in rounds[(impl, ps)]) for q in range(world)],
                  tflops=tb.layer_flops(p, ps) / (ms * 1e-3) / 1e12, peak_bytes=peak,
                  check="passed" if c["passed"] else "failed", check_detail=c,
                  dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes,
                  dispatch_gbps=rate(dispatch_bytes, ms) if comm else None,
                  combine_gbps=rate(combine_bytes, ms) if comm else None,
                  nccl_dispatch_ms=nccl_ms["dispatch"], nccl_combine_ms=nccl_ms["combine"],
                  nccl_dispatch_gbps=rate(dispatch_bytes, nccl_ms["dispatch"]),
                  nccl_combine_gbps=rate(combine_bytes, nccl_ms["combine"]),
                  iters=args.iters, warmup=args.warmup, gpu=ctx.gpu, commit=args.commit, date=args.date,
                  torch=torch.__version__))
    for obj in impls.values():
        obj.release()
    return failed


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------

def round_ratio(rs, a, b):
    """time(a) / time(b) per interleaved round: the median over rounds, or None."""
    if a not in rs or b not in rs:
        return None
    return statistics.median(x / y for x, y in zip(rs[a]["ms_repeats"], rs[b]["ms_repeats"]))


def summary(records):
    """A short table per preset, routing and pass: ms of each implementation, round ratios,
    NCCL's exchange rates alone, checks."""
    by = {}
    for r in records:
        by.setdefault((r["preset"], r["routing"], r["pass"]), {})[r["impl"]] = r
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    ratios = (("torch-ep", "mok-ep"), ("torch-compiled-ep", "mok-ep"), ("mok-ep", "mok-compute"))
    lines = [f"{'preset':<16}{'routing':<9}{'pass':<8}" + "".join(f"{i + ' ms':>20}" for i in impls) +
             "".join(f"{a + '/' + b:>28}" for a, b in ratios) + f"{'NCCL disp GB/s':>16}{'comb GB/s':>11}{'checks':>8}"]
    for key, rs in by.items():
        row = f"{key[0]:<16}{key[1]:<9}{key[2]:<8}"
        row += "".join(f"{rs[i]['ms']:>20.3f}" if i in rs else f"{'-':>20}" for i in impls)
        for a, b in ratios:
            v = round_ratio(rs, a, b)
            row += f"{v:>28.3f}" if v is not None else f"{'-':>28}"
        r0 = next(iter(rs.values()))
        row += "".join(f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"
                       for v, w in ((r0["nccl_dispatch_gbps"], 16), (r0["nccl_combine_gbps"], 11)))
        row += f"{'ok' if all(r['check'] == 'passed' for r in rs.values()) else 'FAIL':>8}"
        lines.append(row)
    return "\n".join(lines)


class Context:
    """This process's place in the group: world, rank, device, mok's EP group, GPU name."""

    def __init__(self, group):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.gpu = f"{self.world}x {torch.cuda.get_device_name(self.device)}"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=DEFAULT_PRESETS)
    ap.add_argument("--routing", default=",".join(tb.ROUTINGS))
    ap.add_argument("--impl", default=",".join(IMPLS))
    ap.add_argument("--pass", dest="passes", default=",".join(tb.PASSES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    tb.add_run_args(ap, iters=10)
    args = ap.parse_args()
    tb.check_run_args("ep_bench", args, IMPLS)
    presets = tb.load_presets()
    args.names = args.preset.split(",")
    for n in args.names:
        if n not in presets:
            sys.exit(f"ep_bench: unknown preset '{n}'; known: {', '.join(presets)}")
        if presets[n]["shared_intermediate"]:
            sys.exit(f"ep_bench: preset '{n}' has a shared expert, which the benchmark does not model")
    args.presets = [presets[n] for n in args.names]
    return args


def main():
    args = parse_args()
    os.environ.update(NO_MULTICAST)  # before NCCL, symmetric memory or NVSHMEM read them
    if "RANK" not in os.environ:
        sys.exit("ep_bench: run it under torchrun (torchrun --standalone --nproc-per-node W bench/ep_bench.py)")
    if not torch.cuda.is_available():
        sys.exit("ep_bench: no CUDA GPU")
    import mok.ep
    from mok import ops

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    ctx = Context(mok.ep.ExpertParallel())
    tb.configure_compile()
    records, failed = [], []

    emit = tb.record_sink(records, args.out, impl_width=18, unit="TFLOP/s per GPU", echo=ctx.rank == 0)

    # (An exception leaves without a barrier: a rank waiting there for a peer stuck in a
    # collective would hang; exiting lets torchrun stop the others.)
    for i, p in enumerate(args.presets):
        if ctx.rank == 0:
            print(f"[{i + 1}/{len(args.presets)}] {p['name']} on {ctx.gpu}", flush=True)
        torch._dynamo.reset()  # each preset compiles afresh (a new shape is a new graph anyway)
        args.torch_ep, args.torch_compiled_ep = TorchEp(), TorchEp(compiled=True)
        for routing in args.routings:
            failed += [(p["name"], routing, impl) for impl in run_preset(p, routing, args, ctx, emit)]
            ctx.group.release()  # this shape's regions and EpRanks (set up again, collectively, next time)
            ops._workspaces.clear()
            torch.cuda.empty_cache()
    dist.barrier()
    ctx.group = None  # mok.ep's groups are weak: this one goes before its process group
    dist.destroy_process_group()
    bad = [r for r in records if r["check"] == "failed"]
    if ctx.rank == 0:
        print(f"\nEP = {ctx.world} ({ctx.gpu}): ms (slowest rank, median of rounds), time ratios per round (median)")
        print(summary(records))
        for n, routing, impl in failed:
            print(f"{n} {routing}: {impl} failed to run")
        if bad:
            print(f"\n{len(bad)} record(s) failed their check")
    if bad or failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
