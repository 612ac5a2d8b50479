"""The fused layer's implementations in bench/layer_bench.py: mok.moe from Python (bf16 and
FP8), `mok_bench --serve` (the C++ layer in a second process), the checksum that compares
their outputs bitwise, the FP8 forward's full-size check, and what the host-time diagnostics
share: HookedExtension (their stand-in for mok.ops' extension), their command line and problems."""
import argparse
import json
import math
import os
import subprocess
import tempfile

import torch

import torch_baseline as tb


def checksum(t, chunk=1 << 26):
    """mok_bench.cu's checksum: the tensor's bytes as 4-byte words w_i, sum of w_i·(2i+1)
    modulo 2^64."""
    w = t.contiguous().view(-1).view(torch.int32)
    total = 0
    for s in range(0, w.numel(), chunk):
        a = w[s:s + chunk].to(torch.int64) & 0xFFFFFFFF
        i = torch.arange(s, s + a.numel(), device=a.device, dtype=torch.int64)
        total += int((a * (2 * i + 1)).sum())
    return total % (1 << 64)


def around(fn, before, after):
    """fn with before() and after() (either None) called around each call."""
    def call(*args, **kwargs):
        if before is not None:
            before()
        result = fn(*args, **kwargs)
        if after is not None:
            after()
        return result
    return call


def diagnostic_args(doc, presets):
    """The host-time diagnostics' command line (host_env.py, forward_stages.py): --preset (a
    comma-separated list; default `presets`), --rounds and --iters."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=presets)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iters", type=int, default=5)
    return ap.parse_args()


def preset_problem(name, device="cuda"):
    """tb.make_inputs' problem of preset `name` (uniform routing, seed 1) and mok.moe's positional
    arguments for it: (d, (x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, swiglu_limit))."""
    d = tb.make_inputs(tb.load_presets()[name], "uniform", seed=1, device=device)
    return d, tuple(d[k] for k in ("x", "ids", "weights", "w_gate", "w_up", "w_down", "shared", "limit"))


def for_each_preset(presets, run):
    """The diagnostics' outer loop: run(name) for each of the comma-separated presets (its
    tensors go when it returns; the allocator's cache is emptied after it), then the versions."""
    for name in presets.split(","):
        run(name)
        torch.cuda.empty_cache()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")


class HookedExtension:
    """mok.ops' extension (mok._C) with calls around some of its functions, for the host-time
    diagnostics (host_env.py, forward_stages.py): hooks = {name: (before, after)}, either None;
    every other name is the extension's own. Install with `ops._C = HookedExtension(...)`."""

    def __init__(self, ext, hooks):
        self._ext = ext
        for name, (before, after) in hooks.items():
            setattr(self, name, around(getattr(ext, name), before, after))

    def __getattr__(self, name):
        return getattr(self._ext, name)


class MokPy(tb.TorchImpl):
    """mok.moe from Python, on the same problem (gate and up as separate tensors); precision
    "fp8": the FP8 layer with the routed weights quantized once here (and the dgrad's
    transposed copies where mok.fp8.dgrad_pays: its backward's dgrad then runs in FP8 too)."""

    def __init__(self, d, precision="bf16"):
        import mok
        import mok.fp8  # noqa: F401 (mok.fp8.quantize_experts below)

        self.mok, self.d, self.precision = mok, d, precision
        self.leaves = [d["x"], d["weights"], d["w_gate"], d["w_up"], d["w_down"]] + list(d["shared"] or ())
        for t in self.leaves:
            t.requires_grad_()
        self.experts, self.fp8_dgrad = None, False
        if precision == "fp8":  # (with the dgrad's transposed weights where the FP8 dgrad is the faster)
            self.fp8_dgrad = bool(mok.fp8.dgrad_pays(d["w_down"]))
            self.experts = mok.fp8.quantize_experts(d["w_gate"], d["w_up"], d["w_down"], dgrad=self.fp8_dgrad)

    def _call(self):
        d = self.d
        extra = {} if self.precision == "bf16" else dict(precision="fp8", fp8_experts=self.experts)
        return self.mok.moe(d["x"], d["ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"], shared=d["shared"],
                            swiglu_limit=d["limit"], **extra)

    def outputs(self, pass_):
        if pass_ == "fwd":
            with torch.no_grad():
                out = {"y": self._call()}
        else:
            self.clear_grads()
            y = self._call()
            y.backward(self.d["dy"])
            d = self.d
            out = {"y": y.detach(), "dx": d["x"].grad, "d_topk_weights": d["weights"].grad, "d_w_gate": d["w_gate"].grad,
                   "d_w_up": d["w_up"].grad, "d_w_down": d["w_down"].grad}
            if d["shared"] is not None:
                out.update(zip(("d_shared_gate", "d_shared_up", "d_shared_down"), (s.grad for s in d["shared"])))
            self.clear_grads()
        self.mok.check()  # raises if a kernel recorded an error
        return out

    def workspace_bytes(self):
        from mok import ops

        return sum(ws.bytes for ws in ops._workspaces.values())


def mok_bench_path(given=""):
    """The mok_bench executable: `given` (--mok-bench) if set, else build-gpu's, else build's
    (the first that exists; build-gpu's, for MokBench's message, if neither does)."""
    if given:
        return given
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidates = [os.path.join(root, d, "bench", "mok_bench") for d in ("build-gpu", "build")]
    return next((c for c in candidates if os.path.exists(c)), candidates[0])


class MokBench:
    """`mok_bench --serve`: the C++ layer in a second process, one command a line."""

    def __init__(self, path):
        if not os.access(path, os.X_OK):
            raise SystemExit(f"layer_bench: {path} not found: build it (cmake --build <dir> --target mok_bench) "
                             "or pass --mok-bench")
        self.proc = subprocess.Popen([path, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, *words):
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        while line and not line.startswith("{"):  # (only JSON answers count)
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mok_bench --serve exited (code {self.proc.poll()}) on '{' '.join(map(str, words))}'")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def load(self, preset, seed, d):
        """`load`: the preset with d's routing (ids and weights through two temporary files);
        x, the weights and dy come from the same seeded fill as layer_bench's."""
        with tempfile.TemporaryDirectory() as tmp:
            ids_path, w_path = os.path.join(tmp, "ids.i32"), os.path.join(tmp, "weights.f32")
            d["ids"].cpu().numpy().tofile(ids_path)
            d["weights"].detach().cpu().numpy().tofile(w_path)
            return self.call("load", preset, seed, ids_path, w_path)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


FP8_COSINE = 0.99  # every tensor of an FP8 pass against the eager bf16 path's


def fp8_check(out, ref):
    """An FP8 pass's check against the eager bf16 path's outputs: every tensor finite, cosine >=
    FP8_COSINE (each E4M3 operand costs ~4 % relative error on random data; the recipes read
    ~0.998 there, bench/NOTES.md), the relative errors recorded; rel and cos are the worst over the
    tensors (as ep_layers.check_outputs' are: ep_bench gathers them over the ranks)."""
    tensors = {n: tb.compare(out[n], ref[n]) for n in out}
    return dict(passed=all(math.isfinite(c["rel"]) and c["cos"] >= FP8_COSINE for c in tensors.values()),
                rel=max(c["rel"] for c in tensors.values()), cos=min(c["cos"] for c in tensors.values()), tensors=tensors)


def check_mok_fp8(d, ref, passes, checks, impls, args, fail):
    """mok-fp8-py's full-size checks — fwd: y against mok.fp8.moe_reference (the FP8 recipe's
    oracle; its distance from the eager bf16 y recorded); fwd+bwd: y and every gradient against
    the eager bf16 path's (fp8_check), with the FP8 dgrad where mok.fp8.dgrad_pays — and returns
    the checksum of its forward's y for mok-fp8's bitwise comparison (None if it did not run).
    mok-fp8 (the C++ server) is timed in the forward only."""
    import mok.fp8

    for ps in passes:
        if ps != "fwd":
            checks["mok-fp8"][ps] = dict(passed=None, error="forward only")  # (no record, no failure)
    try:
        m = MokPy(d, precision="fp8")
        sums = None
        if "fwd" in passes:
            y = m.outputs("fwd")["y"]
            with torch.no_grad():
                recipe = mok.fp8.moe_reference(d["x"], d["ids"], d["weights"], d["w_gate"], d["w_up"], d["w_down"],
                                               d["shared"], d["limit"])
            c = tb.compare(y, recipe)
            del recipe
            exact = tb.compare(y, ref["fwd"]["y"])
            checks["mok-fp8-py"]["fwd"] = dict(passed=bool(math.isfinite(c["rel"]) and c["rel"] <= 1e-2),
                                               rel_vs_recipe=c["rel"], tensors={"y": exact})
            sums = {"y": checksum(y)}
        for ps in passes:
            if ps != "fwd":
                checks["mok-fp8-py"][ps] = dict(fp8_check(m.outputs(ps), ref[ps]), fp8_dgrad=m.fp8_dgrad)
        if "mok-fp8-py" in args.impls:
            impls["mok-fp8-py"] = m
        return sums
    except Exception as e:
        for ps in passes:
            fail("mok-fp8-py", ps, e)
        return None
