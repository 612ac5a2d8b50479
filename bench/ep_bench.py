#!/usr/bin/env python3
"""Expert parallelism across the GPUs of one node, under torchrun: every implementation on
the same inputs, in one run, interleaved, checked at full size before it is timed.

  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
  torchrun --standalone --nproc-per-node W bench/ep_bench.py [--preset NAME,...]
      [--routing uniform,zipf1.2] [--impl mok-ep,torch-compiled-ep,torch-ep,mok-compute]
      [--ring-sms N,...] [--pass fwd,fwd+bwd] [--repeats 3] [--iters 10] [--out FILE.json]

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
  mok-ep-ring{N}     mok-ep with the ring token buffer, one per N of --ring-sms (run
                     whether --impl names it or not): its own group,
                     mok.ep.ExpertParallel(comm_sms=N), whose N comm SMs per rank pull the
                     rows it receives into a ring while the other SMs compute (mok-ep: every
                     SM pulls them before the fused kernel); checked, timed and recorded as
                     mok-ep is
  mok-ep-once        mok-ep with each peer token pulled once per rank into a local buffer,
                     then its routed rows gathered locally (mok.ep.ExpertParallel(
                     pull_tokens_once=True)); checked, timed and recorded as mok-ep is
  mok-ep-interleave  mok-ep with the forward's GEMM2 tiles of each 4096-row chunk right after
                     the next chunk's GEMM1 tiles (ExpertParallel(interleave_rows=4096)): the
                     result pushes spread over the kernel
  mok-ep-fp8-e4m3    (only when asked for) mok-ep-fp8 with ExpertParallel(pull_fp8_rows=True): each
                     rank quantizes its tokens once in the exchange and peers pull E4M3 rows
  mok-ep-recompute   (only when asked for) mok.ep.moe(..., recompute=True): its own group; the
                     training forward keeps no pre-activations and the backward runs GEMM1 again
                     (the same bits as mok-ep; what a recompute costs in the EP layer)
  mok-ep-capped      (only when asked for) mok-ep with ExpertParallel(capacity_factor=F)
                     (--capacity-factor, default 2): room for F*T*k routed rows a rank instead of
                     the worst case W*T*k (its buffers and saved pre-activations); the same bits
                     while the routing fits — what the cap saves in memory
  mok-ep-fp8         (only when asked for) mok.ep.moe(..., precision="fp8"): the routed experts' forward in E4M3
                     (this rank's experts quantized once beforehand, mok.fp8.quantize_experts,
                     with the dgrad's copies where mok.fp8.dgrad_pays; the rows quantized as they
                     are pulled), its backward as mok-fp8-py's (its own group, no ring; presets
                     with H or I not a multiple of 128 give no record)
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
  - torch-compiled-ep, mok-ep and mok-ep-ring{N}: y and, for fwd+bwd, dx, d_topk_weights,
    d_w_gate, d_w_up, d_w_down against autograd through torch-ep (gate and up are the halves
    of its gate|up gradient); torch-compiled-ep's sampled y against fp32 as well;
  - mok-compute: the same outputs against autograd through torch_baseline.moe_eager on the
    same rows;
  - mok-ep-fp8: the same outputs against torch-ep's with FP8's bar (mok_impls.fp8_check: every
    tensor finite, cosine >= FP8_COSINE; the relative errors recorded).
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
busiest rank's. On the fwd records of every implementation but mok-compute,
`dispatch_gbps` / `combine_gbps` = those bytes over the record's whole forward time: an
effective rate, a lower bound on what the exchange sustained inside the layer.
`nccl_dispatch_ms` / `nccl_combine_ms`: NCCL's all_to_all_single of the same rows with the
same split sizes alone (timed in the rounds like an implementation, slowest rank's median,
median of rounds), and `nccl_dispatch_gbps` / `nccl_combine_gbps` the bytes over them.

Peak memory (`peak_bytes`, the largest over ranks): PyTorch's peak allocated bytes over one
pass above what was allocated before it (weight gradients cleared first, so fwd+bwd counts
them); mok-compute adds its workspace; each mok-ep variant adds the device memory outside
PyTorch's allocator of the EpRanks the pass uses (symmetric region and EpRank workspace:
cudaMemGetInfo's drop less the allocator's growth over the call that made the rank — a rank
made by one pass and used by another, as a recompute rank serves both, counts in both; before
2026-12-06 a pass counted only what its own first call made, so mok-ep-recompute's fwd+bwd
left its rank out). NCCL's own buffers are not counted for anyone.

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
from mok_impls import fp8_check  # noqa: E402
from ep_layers import (MokCompute, MokEp, TorchEp, all_agree, check_outputs, exchange_bytes, gather,  # noqa: E402
                       make_inputs, nccl_steps, rank_bytes, round_stats, sampled_reference, synced)

IMPLS = ("mok-ep", "mok-ep-once", "mok-ep-interleave", "torch-compiled-ep", "torch-ep", "mok-compute")
ONCE = "mok-ep-once"  # mok-ep with pull_tokens_once
INTERLEAVE = "mok-ep-interleave"  # mok-ep with interleave_rows = 4096
FP8 = "mok-ep-fp8"  # mok-ep with precision="fp8" (valid in --impl, not run unless named)
FP8_E4M3 = "mok-ep-fp8-e4m3"  # mok-ep-fp8 pulling E4M3 rows (pull_fp8_rows; the same: only when named)
RECOMPUTE = "mok-ep-recompute"  # mok-ep with recompute=True (only when named)
CAPPED = "mok-ep-capped"  # mok-ep with capacity_factor = --capacity-factor (only when named)
RING = "mok-ep-ring"  # RING + str(N): mok-ep with comm_sms = N (--ring-sms)
EXCHANGES = ("dispatch", "combine")
DEFAULT_PRESETS = "deepseek-v3,qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def ring_impls(spec):
    """The implementations --ring-sms asks for: "4,8" -> ("mok-ep-ring4", "mok-ep-ring8");
    exits naming a value that is not a positive SM count."""
    names = []
    for v in filter(None, (v.strip() for v in spec.split(","))):
        if not v.isdigit() or int(v) < 1:
            sys.exit(f"ep_bench: --ring-sms takes positive SM counts, got '{v}'")
        names.append(f"{RING}{int(v)}")
    return tuple(dict.fromkeys(names))


def impl_names(ring=()):
    """Every implementation, in table order: IMPLS with the ring ones after mok-ep, then mok-ep-fp8,
    its E4M3 pull, mok-ep-recompute and mok-ep-capped."""
    return IMPLS[:1] + tuple(ring) + IMPLS[1:] + (FP8, FP8_E4M3, RECOMPUTE, CAPPED)


def comm_sms(impl):
    """mok.ep.ExpertParallel's comm_sms of mok-ep (0) or of mok-ep-ring{N} (N)."""
    return int(impl[len(RING):]) if impl.startswith(RING) else 0


def group_options(impl, capacity_factor=2.0):
    """mok.ep.ExpertParallel's keyword arguments for a mok-ep variant, or None for the others
    (capacity_factor: mok-ep-capped's)."""
    if impl == CAPPED:
        return dict(capacity_factor=capacity_factor)
    if impl == ONCE:
        return dict(pull_tokens_once=True)
    if impl == INTERLEAVE:
        return dict(interleave_rows=4096)
    if impl in (FP8, RECOMPUTE):
        return dict()
    if impl == FP8_E4M3:
        return dict(pull_fp8_rows=True)
    return dict(comm_sms=comm_sms(impl)) if impl == "mok-ep" or impl.startswith(RING) else None


def run_checks(d, p, args, ctx):
    """Runs every implementation once per pass and checks it (module docstring); returns
    ({impl: object}, {impl: {pass: check}}, {impl: {pass: extra peak bytes}}, {impl: error})."""
    passes, name = args.passes, p["name"]
    rows, want = sampled_reference(d, p, ctx.world, args.seed)
    sampled = lambda y: tb.compare(y[rows].detach().float(), want)
    checks = {impl: {} for impl in args.all_impls}
    extra = {impl: {} for impl in args.all_impls}
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

    held = {impl: {} for impl in args.all_impls}  # {impl: {id(EpRank): bytes outside the allocator}}

    def mok_ep_pass(impl):
        def check_pass(obj, ps):  # its first call per pass may set up a region and EpRank
            out, extra[impl][ps] = rank_bytes(obj, ps, ctx.device, held[impl])
            return check_outputs(out, ref[ps])
        return check_pass

    for impl, group in ctx.groups.items():  # mok-ep and its variants (make() runs at once)
        if impl in (FP8, FP8_E4M3):
            continue
        attempt(impl, lambda: MokEp(d, group, recompute=impl == RECOMPUTE), mok_ep_pass(impl))
    for impl in (FP8, FP8_E4M3):
        def fp8_pass(obj, ps, impl=impl):
            out, extra[impl][ps] = rank_bytes(obj, ps, ctx.device, held[impl])
            return fp8_check(out, ref[ps])

        if impl not in ctx.groups:
            continue
        if tb.fp8_shape(p):
            attempt(impl, lambda: MokEp(d, ctx.groups[impl], precision="fp8"), fp8_pass)
        elif ctx.rank == 0:  # (no record: FP8 needs H and I multiples of 128)
            print(f"  {p['name']} {impl}: skipped (FP8 needs hidden and intermediate multiples of 128; "
                  f"{p['hidden']}, {p['intermediate']})", flush=True)
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
    ran = all_agree([impl not in errors for impl in args.all_impls], ctx.device)
    failed = [impl for impl, ok in zip(args.all_impls, ran) if impl in args.impls and not ok]
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
            if key[0] in ctx.groups:
                ctx.groups[key[0]].check()
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
                  torch=torch.__version__,
                  capacity_factor=ctx.groups[impl].capacity_factor if impl in ctx.groups else None))
    for obj in impls.values():
        obj.release()
    return failed


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------

def round_ratio(rs, a, b):
    """time(a) / time(b) per interleaved round: the median over rounds (layer_bench.paired_ratio), or None."""
    return layer_bench.paired_ratio(rs[a], rs[b])[0] if a in rs and b in rs else None


def summary(records):
    """A short table per preset, routing and pass: ms of each implementation, round ratios,
    NCCL's exchange rates alone, checks."""
    by = {}
    for r in records:
        by.setdefault((r["preset"], r["routing"], r["pass"]), {})[r["impl"]] = r
    ring = sorted({comm_sms(r["impl"]) for r in records if r["impl"].startswith(RING)})
    impls = [i for i in impl_names(f"{RING}{n}" for n in ring) if any(r["impl"] == i for r in records)]
    ratios = (("torch-ep", "mok-ep"), ("torch-compiled-ep", "mok-ep"), ("mok-ep", "mok-compute")) + tuple(
        ("mok-ep", i) for i in impls if i.startswith(RING) or i in (ONCE, INTERLEAVE, FP8, RECOMPUTE, CAPPED)) + (
        ((FP8, FP8_E4M3),) if FP8 in impls and FP8_E4M3 in impls else ())
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
    """This process's place in the group: world, rank, device, mok's EP groups, GPU name."""

    def __init__(self, groups):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.groups = groups  # {mok-ep and its variants: its mok.ep.ExpertParallel}
        self.group = groups["mok-ep"]  # (its process group carries the NCCL exchanges)
        self.gpu = f"{self.world}x {torch.cuda.get_device_name(self.device)}"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=DEFAULT_PRESETS)
    ap.add_argument("--routing", default=",".join(tb.ROUTINGS))
    ap.add_argument("--impl", default=",".join(IMPLS))
    ap.add_argument("--ring-sms", default="", metavar="N,...", help="comm SM counts: one mok-ep-ring{N} for each")
    ap.add_argument("--pass", dest="passes", default=",".join(tb.PASSES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--capacity-factor", type=float, default=2.0, help="mok-ep-capped's (a multiple of 1/64)")
    tb.add_run_args(ap, iters=10)
    args = ap.parse_args()
    args.all_impls = impl_names(ring_impls(args.ring_sms))
    tb.check_run_args("ep_bench", args, args.all_impls)
    args.impls += [i for i in args.all_impls if i.startswith(RING) and i not in args.impls]
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
    ctx = Context({impl: mok.ep.ExpertParallel(**group_options(impl, args.capacity_factor)) for impl in args.all_impls
                   if group_options(impl) is not None})
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
            for group in ctx.groups.values():
                group.release()  # this shape's regions and EpRanks (set up again, collectively, next time)
            ops._workspaces.clear()
            torch.cuda.empty_cache()
    dist.barrier()
    ctx.group = ctx.groups = None  # mok.ep's groups are weak: these go before their process group
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
