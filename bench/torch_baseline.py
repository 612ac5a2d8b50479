"""The PyTorch implementations of the MoE layer the fused kernel is measured against, the
dense-GEMM ceiling, and what every benchmark shares (presets, routings, inputs, timing,
peak memory, full-size comparison; the problems themselves in bench/problems.py). bench/layer_bench.py runs them next to mok in one
process (`--impl torch-compiled,torch,dense` times the PyTorch ones alone).

impl "torch-compiled": the strongest plain-PyTorch layer we can write — pairs sorted by
  expert (torch.sort, offsets by searchsorted: no bincount, no graph break), gate|up as one
  torch._grouped_mm over the concatenated [E, 2I, H] weight (as frameworks store it),
  SwiGLU, the down torch._grouped_mm, the un-permute as a row scatter (index_copy) and the
  fp32 weighted sum over the k slots (+ the shared expert) fused by Inductor into one
  reduction — under torch.compile(dynamic=False, fullgraph=True): a graph break or a
  recompile-limit fallback to eager is an error, not a record.
impl "torch": the same layer in eager PyTorch, as the project first measured it (argsort,
  bincount, gather, _grouped_mm, SwiGLU, _grouped_mm, inverse-index gather, fp32 [T, k, H]
  weighted sum); fwd+bwd is autograd through it.
impl "dense": the layer's GEMMs as if every routed row went to one expert (+ the shared
  expert's), through torch.matmul: the ceiling a grouped kernel is measured against.
impl "dense-fp8" (bench/clock_power.py): the same GEMMs in E4M3 through torch._scaled_mm
  (row-wise fp32 scales, bf16 out), every operand quantized and laid out beforehand: the
  FP8 ceiling, without any quantization's cost; "dense-fp8-blockwise" the same GEMMs with the
  layer's own blockwise recipe (torch.nn.functional.scaled_mm, cuBLAS).
"""
import csv
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The problems (routings, the hash fill, a preset's inputs), used by every benchmark as tb.*
from problems import (ROUTINGS, TENSOR_SEEDS, hash_fill, make_inputs, make_routing,  # noqa: E402,F401
                      max_load_ratio)
PASSES = ("fwd", "fwd+bwd")


def load_presets(path=os.path.join(HERE, "presets.csv")):
    fields = ["name", "tokens", "hidden", "intermediate", "experts", "top_k",
              "shared_intermediate", "swiglu_limit", "model_experts", "model_ep", "note"]
    out = {}
    with open(path) as f:
        for row in csv.reader(line for line in f if line.strip() and not line.startswith("#")):
            p = dict(zip(fields, row))
            for key in fields[1:7] + fields[8:10]:
                p[key] = int(p[key])
            p["swiglu_limit"] = float(p["swiglu_limit"])
            out[p["name"]] = p
    return out


def fp8_shape(p):
    """Whether the FP8 layer takes preset p's shape: H and I multiples of its 128-wide scale blocks."""
    return p["hidden"] % 128 == 0 and p["intermediate"] % 128 == 0


def benchmark_presets(presets):
    """The presets `--preset all` means: every one-GPU share of a real model (not the
    CPU-sized check cases)."""
    return [n for n, p in presets.items() if p["tokens"] >= 8192]


def layer_flops(p, pass_):
    """docs/design.md's FLOP convention: forward = 6·H·(routed pairs·I + T·I_s), forward+backward = 3x that."""
    fwd = 6.0 * p["hidden"] * p["tokens"] * (p["top_k"] * p["intermediate"] + p["shared_intermediate"])
    return fwd * (3 if pass_ == "fwd+bwd" else 1)


def add_run_args(ap, iters):
    """The options every benchmark script shares (output, iterations, provenance)."""
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--commit", default=os.environ.get("MOK_COMMIT", "unknown"))
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


def check_run_args(prog, args, known_impls):
    """Exits naming the bad value if --impl, --pass, --routing, --repeats or --iters of a
    driver (layer_bench.py, ep_bench.py) asks for what does not exist; splits the lists into
    args.impls, args.passes, args.routings."""
    args.impls, args.passes, args.routings = args.impl.split(","), args.passes.split(","), args.routing.split(",")
    for what, values, known in (("impl", args.impls, known_impls), ("pass", args.passes, PASSES),
                                ("routing", args.routings, ROUTINGS)):
        for v in values:
            if v not in known:
                sys.exit(f"{prog}: unknown {what} '{v}'; known: {', '.join(known)}")
    if args.repeats < 1 or args.iters < 1:
        sys.exit(f"{prog}: --repeats and --iters must be >= 1")


def record_sink(records, out, impl_width=15, unit="TFLOP/s", echo=True):
    """emit(record): appends it, prints one line (when echo) and rewrites `out` (JSON) — after
    every record, so a run cut short keeps what it measured."""
    def emit(rec):
        records.append(rec)
        if not echo:
            return
        print(f"{rec['preset']:<16} {rec['routing']:<8} {rec['impl']:<{impl_width}} {rec['pass']:<8} {rec['ms']:9.3f} ms "
              f"[{rec['ms_min']:.3f}, {rec['ms_max']:.3f}] {rec['tflops']:7.1f} {unit} "
              f"peak {rec['peak_bytes'] / 2**30:6.2f} GiB  check {rec['check']}", flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(records, f, indent=1)
    return emit


# ---------------------------------------------------------------------------------------
# The PyTorch layers
# ---------------------------------------------------------------------------------------

def swiglu(g, u, limit):
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return F.silu(g) * u


def shared_mlp(x, shared_gate_up, shared_down, limit):
    g, u = (x @ shared_gate_up.t()).chunk(2, dim=-1)
    return swiglu(g, u, limit) @ shared_down.t()


def moe_eager(x, ids, weights, w_gate_up, w_down, limit, shared_gate_up=None, shared_down=None):
    """The eager PyTorch layer first measured against: argsort, bincount, gather, grouped GEMMs, inverse-index
    gather, fp32 [T, k, H] weighted sum."""
    T, k = ids.shape
    E, two_i, _ = w_gate_up.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x.index_select(0, order // k)
    gu = torch._grouped_mm(xs, w_gate_up.transpose(-2, -1), offs=offs)
    g, u = gu.split(two_i // 2, dim=-1)
    out = torch._grouped_mm(swiglu(g, u, limit), w_down.transpose(-2, -1), offs=offs)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = out.index_select(0, inverse).view(T, k, -1)
    y = (per_slot.float() * weights.unsqueeze(-1)).sum(1)
    if shared_gate_up is not None:
        y = y + shared_mlp(x, shared_gate_up, shared_down, limit).float()
    return y.to(x.dtype)


def moe_compilable(x, ids, weights, w_gate_up, w_down, limit, shared_gate_up=None, shared_down=None):
    """The layer written for torch.compile (every id in [0, E), as the benchmark's routings):
    static shapes throughout, the un-permute as a scatter of rows, and the fp32 combine left
    to Inductor to fuse (no fp32 [T, k, H] in memory)."""
    T, k = ids.shape
    E, two_i, H = w_gate_up.shape
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    bounds = torch.arange(E, device=ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)  # end of each expert's rows
    xs = x.index_select(0, order // k)
    gu = torch._grouped_mm(xs, w_gate_up.transpose(-2, -1), offs=offs)
    g, u = gu.split(two_i // 2, dim=-1)
    out = torch._grouped_mm(swiglu(g, u, limit), w_down.transpose(-2, -1), offs=offs)
    per_slot = torch.index_copy(torch.empty_like(out), 0, order, out)  # row order[i] <- out[i]
    y = (per_slot.view(T, k, H).float() * weights.unsqueeze(-1)).sum(1)
    if shared_gate_up is not None:
        y = y + shared_mlp(x, shared_gate_up, shared_down, limit).float()
    return y.to(x.dtype)


def configure_compile():
    """Every preset and both passes must compile (presets differ in shape, so each is a new
    graph): a raised recompile limit, and an error instead of a silent eager fallback."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 1024
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True


def compiled_layer():
    return torch.compile(moe_compilable, dynamic=False, fullgraph=True)


def reference_rows(d, rows):
    """fp32, one token at a time, straight from the layer's definition."""
    x, ids, weights, limit = d["x"], d["ids"], d["weights"], d["limit"]
    I = d["w_down"].shape[-1]
    out = []
    for t in rows.tolist():
        acc = torch.zeros(x.shape[1], device=x.device, dtype=torch.float32)
        xt = x[t].float()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = d["w_gate_up"][e].float() @ xt
            acc += weights[t, j] * (d["w_down"][e].float() @ swiglu(gu[:I], gu[I:], limit))
        if d["shared"] is not None:
            sg, su, sd = (s.float() for s in d["shared"])
            acc += sd @ swiglu(sg @ xt, su @ xt, limit)
        out.append(acc)
    return torch.stack(out)


def sampled_error(d, y, count=16, seed=5):
    """Relative error of y's rows for `count` random tokens against reference_rows."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = torch.randperm(y.shape[0], generator=gen)[:count].to(y.device)
    with torch.no_grad():
        ref = reference_rows(d, rows)
    return ((y[rows].detach().float() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------------------------------
# Comparison, timing, memory
# ---------------------------------------------------------------------------------------

REL_TOL, COS_TOL = 1e-2, 0.9999


def compare(got, ref, chunk=1 << 26):
    """Relative error ‖got − ref‖/‖ref‖ and cosine of two whole tensors, accumulated in
    fp64 over chunks; NaN or Inf anywhere fails."""
    g, r = got.reshape(-1), ref.reshape(-1)
    if g.numel() != r.numel():
        return dict(rel=float("inf"), cos=0.0, passed=False)
    gg = rr = gr = dd = 0.0
    finite = True
    for s in range(0, g.numel(), chunk):
        a, b = g[s:s + chunk].double(), r[s:s + chunk].double()
        finite = finite and bool(torch.isfinite(a).all())
        gg += float((a * a).sum())
        rr += float((b * b).sum())
        gr += float((a * b).sum())
        dd += float(((a - b) ** 2).sum())
    rel = math.sqrt(dd) / math.sqrt(rr) if rr > 0 else (0.0 if dd == 0 else float("inf"))
    cos = gr / math.sqrt(gg * rr) if gg > 0 and rr > 0 else (1.0 if gg == rr == 0 else 0.0)
    return dict(rel=rel, cos=cos, passed=bool(finite and rel <= REL_TOL and cos >= COS_TOL))


FLUSH = "zero"  # how time_ms flushes the L2: l2_flusher's kind (layer_bench --flush)


def l2_flusher(kind):
    """A function that overwrites 256 MB (> 4x the 60 MB L2) on the current stream: "zero" with
    PyTorch's zero_() (a fill kernel), "memset" with cudaMemsetAsync of a byte that changes every
    call (what mok_bench's time_iterations does; the CUDA runtime through ctypes)."""
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    if kind == "zero":
        return buf.zero_
    if kind != "memset":
        raise ValueError(f"l2_flusher: kind must be 'zero' or 'memset', got {kind!r}")
    import ctypes
    import ctypes.util

    lib = None
    for name in ("libcudart.so", "libcudart.so.13", ctypes.util.find_library("cudart"),
                 "/usr/local/cuda/lib64/libcudart.so"):
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            continue
        if lib is not None:
            break
    if lib is None:
        raise RuntimeError("l2_flusher('memset'): no CUDA runtime library (libcudart.so) found")
    lib.cudaMemsetAsync.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
    count = [0]

    def memset():
        count[0] += 1
        err = lib.cudaMemsetAsync(buf.data_ptr(), count[0] & 0xff, buf.numel(), torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"cudaMemsetAsync failed with error {err}")
    return memset


def time_ms(fn, warmup, iters, before=None, host=None, flush=None, queued=False):
    """Each iteration's ms (sorted), CUDA events around fn, the L2 flushed before each (flush:
    an l2_flusher, else one of kind FLUSH). With `host` (a list), each iteration's host time to
    enqueue fn (ms, unsorted) is appended. Synced (the default), each iteration waits for its
    stop event, so the GPU idles while the host reaches the next; `queued` enqueues every
    iteration before waiting once (mok_bench's time_iterations likewise): the host runs ahead of
    the GPU as in a training loop, and the GPU goes from one iteration to the next's flush
    without idling."""
    flush = flush or l2_flusher(FLUSH)
    for _ in range(warmup):
        if before:
            before()
        fn()
    # Events for every iteration, made (and created on the device, at their first record) before
    # the loop, as mok_bench does: made between the flush and the start event, they would take
    # host time from the flush's head start (the GPU is busy with the flush while the host
    # reaches the pass's first launch).
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters if queued else 1)]
    for start, stop in events:
        start.record()
        stop.record()
    times = []
    for i in range(iters):
        start, stop = events[i if queued else 0]
        if before:
            before()
        flush()
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        stop.record()
        if not queued:
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        if host is not None:
            host.append((t1 - t0) * 1e3)
    if queued:
        torch.cuda.synchronize()
        times = [start.elapsed_time(stop) for start, stop in events]
    times.sort()
    return times


def peak_bytes(fn, before=None):
    """Peak device memory one pass allocates through PyTorch's allocator above what was
    allocated before it (inputs, weights; weight gradients cleared by `before`)."""
    if before:
        before()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def dense_step(p, seed=2):
    """{pass: fn} of the dense ceiling: the routed rows (T·k) through one [I, H] SwiGLU
    MLP's GEMMs (+ the shared expert's T rows through [I_s, H]), torch.matmul."""
    T, H, k = p["tokens"], p["hidden"], p["top_k"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: (torch.rand(*s, device="cuda", generator=gen) - 0.5).bfloat16()
    chains = [(T * k, p["intermediate"])] + ([(T, p["shared_intermediate"])] if p["shared_intermediate"] else [])
    tensors = [(r(M, H), r(2 * I, H), r(H, I), r(M, I), r(M, H), r(M, 2 * I)) for M, I in chains]

    def fwd():
        for x, w1, w2, hid, _, _ in tensors:
            x @ w1.t()
            hid @ w2.t()

    def fwd_bwd():
        fwd()
        for x, w1, w2, hid, dy, dgu in tensors:
            dy @ w2            # dgrad down
            dy.t() @ hid       # wgrad down
            dgu @ w1           # dgrad gate|up
            dgu.t() @ x        # wgrad gate|up

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def fp8_gemm(a, b_rows, recipe="rowwise"):
    """A closure of a [M, K] @ b_rows [N, K]^T in E4M3 into bf16, no fast accumulation (b_rows.t() is
    the column-major B the GEMMs take), with scales of one: "rowwise" torch._scaled_mm, fp32 scales
    per row of A and column of B; "blockwise" torch.nn.functional.scaled_mm with the layer's recipe
    (A per 1 x 128 of K: [M, K/128] M-major; B per 128 x 128 block: [N/128, K/128] with K/128 padded
    to a multiple of 4, as cuBLAS wants). Raises ValueError for a blockwise K or N not a multiple of 128."""
    M, K, N = a.shape[0], a.shape[1], b_rows.shape[0]
    if recipe == "rowwise":
        scale_a = torch.ones(M, 1, device="cuda", dtype=torch.float32)
        scale_b = torch.ones(1, N, device="cuda", dtype=torch.float32)
        return lambda: torch._scaled_mm(a, b_rows.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                        use_fast_accum=False)
    if K % 128 or N % 128:
        raise ValueError(f"fp8_gemm: the blockwise recipe needs K and N multiples of 128 (a GEMM of "
                         f"M {M}, N {N}, K {K})")
    F = torch.nn.functional
    scale_a = torch.ones(K // 128, M, device="cuda", dtype=torch.float32).t()  # [M, K/128], M-major
    scale_b = torch.ones(N // 128, -(-K // 512) * 4, device="cuda", dtype=torch.float32)  # [N/128, K/128 padded]
    return lambda: F.scaled_mm(a, b_rows.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b.t(),
                               F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


def cannot_run(fn):
    """None if fn() runs on this GPU and PyTorch, else the first line of why not (a peer GEMM or
    ceiling this PyTorch or shape cannot run is left out, named, rather than stopping a benchmark)."""
    try:
        fn()
        torch.cuda.synchronize()
        return None
    except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as e:
        return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


def dense_fp8_step(p, seed=2, recipe="rowwise"):
    """{pass: fn} of the dense FP8 ceiling: dense_step's GEMMs in E4M3 (fp8_gemm, `recipe`: "rowwise",
    the fastest FP8 GEMM of the layer's accuracy PyTorch offers on sm_90 — CUTLASS's or cuBLAS's by
    PyTorch's build —, or "blockwise", the layer's own recipe through cuBLAS), each operand quantized
    and transposed as its GEMM needs it beforehand — the backward's weight gradients too (K = the
    rows; their B, an activation there, scaled per 128 x 128 block in the blockwise recipe). The same
    FLOPs as the layer; no quantization inside the timing."""
    if recipe not in ("rowwise", "blockwise"):
        raise ValueError(f"dense_fp8_step: recipe {recipe!r}: 'rowwise' or 'blockwise'")
    T, H, k = p["tokens"], p["hidden"], p["top_k"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e4m3 = lambda *s: (torch.rand(*s, device="cuda", generator=gen) - 0.5).to(torch.float8_e4m3fn)

    def gemm(a, b_rows):
        return fp8_gemm(a, b_rows, recipe)

    chains = [(T * k, p["intermediate"])] + ([(T, p["shared_intermediate"])] if p["shared_intermediate"] else [])
    forward, backward = [], []
    for M, I in chains:
        x, w1, hid, w2 = e4m3(M, H), e4m3(2 * I, H), e4m3(M, I), e4m3(H, I)
        forward += [gemm(x, w1), gemm(hid, w2)]  # gate|up [M, 2I], down [M, H]
        dy, dgu = e4m3(M, H), e4m3(M, 2 * I)
        backward += [gemm(dy, w2.t().contiguous()),               # dgrad down [M, I]
                     gemm(dy.t().contiguous(), hid.t().contiguous()),  # wgrad down [H, I] (K = M)
                     gemm(dgu, w1.t().contiguous()),              # dgrad gate|up [M, H]
                     gemm(dgu.t().contiguous(), x.t().contiguous())]  # wgrad gate|up [2I, H] (K = M)

    def fwd():
        for g in forward:
            g()

    def fwd_bwd():
        fwd()
        for g in backward:
            g()

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


class Steps:
    """{pass: fn} (dense_step's, dense_fp8_step's) as the implementations' step(pass): (fn, None)."""

    def __init__(self, steps):
        self.steps = steps

    def step(self, pass_):
        return self.steps[pass_], None


# ---------------------------------------------------------------------------------------
# The PyTorch implementations as timed closures
# ---------------------------------------------------------------------------------------

class TorchImpl:
    """One PyTorch implementation (eager or compiled) on one problem: its leaves (x,
    weights, w_gate_up, w_down, shared) require grad; run(pass) gives the outputs."""

    def __init__(self, d, layer):
        self.d, self.layer = d, layer
        self.leaves = [d["x"], d["weights"], d["w_gate_up"], d["w_down"]]
        if d["shared"] is not None:
            self.leaves += [d["shared_gate_up"], d["shared_down"]]
        for t in self.leaves:
            t.requires_grad_()

    def clear_grads(self):
        for t in self.leaves:
            t.grad = None

    def _call(self):
        d = self.d
        return self.layer(d["x"], d["ids"], d["weights"], d["w_gate_up"], d["w_down"], d["limit"],
                          d["shared_gate_up"], d["shared_down"])

    def step(self, pass_):
        if pass_ == "fwd":
            def fwd():
                with torch.no_grad():
                    return self._call()
            return fwd, None
        return (lambda: self._call().backward(self.d["dy"])), self.clear_grads

    def outputs(self, pass_):
        """{name: tensor} of one pass, named as mok's outputs."""
        if pass_ == "fwd":
            with torch.no_grad():
                return {"y": self._call()}
        self.clear_grads()
        y = self._call()
        y.backward(self.d["dy"])
        d, I = self.d, self.d["w_down"].shape[-1]
        out = {"y": y.detach(), "dx": d["x"].grad, "d_topk_weights": d["weights"].grad,
               "d_w_gate": d["w_gate_up"].grad[:, :I], "d_w_up": d["w_gate_up"].grad[:, I:],
               "d_w_down": d["w_down"].grad}
        if d["shared"] is not None:
            Is = d["shared_down"].shape[-1]
            g = d["shared_gate_up"].grad
            out.update(d_shared_gate=g[:Is], d_shared_up=g[Is:], d_shared_down=d["shared_down"].grad)
        self.clear_grads()
        return out

    def release(self):
        self.clear_grads()
        for t in self.leaves:
            t.requires_grad_(False)
