"""The benchmark's FP8 pieces, without a GPU: the torch FP8 baseline (torch._scaled_grouped_mm's
layer, its FP8 dgrad and bf16 weight gradients) against the BF16 layer, layer_bench's FP8 records
(torch-fp8 and mok-fp8-py: both passes; mok-fp8: forward only), and the FP8 backward accuracy
study's exact step."""

import pytest
import torch

from bench_support import small_preset  # noqa: E402  (puts bench/ on sys.path)
import layer_bench  # noqa: E402
from mok_impls import MokBench  # noqa: E402
import torch_baseline as tb  # noqa: E402


@pytest.mark.parametrize("shared,limit", [(0, 0.0), (64, 7.0)])
def test_torch_fp8_baseline_is_the_layer_within_fp8_error(shared, limit):
    """torch_fp8.moe_fp8 (the `torch-fp8` baseline, off the GPU through its dequantized
    product) against the bf16 layer: FP8's ~4 % per-operand error leaves the cosine above
    0.99; the quantization itself within one E4M3 step per value."""
    import torch_fp8

    t = torch.randn(8, 256) * torch.logspace(-3, 3, 8).unsqueeze(1)
    values, scales = torch_fp8.quantize_rows(t)
    back = values.float() * scales.unsqueeze(1)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (8,)
    assert ((back - t).abs() <= t.abs() * 2.0 ** -4 + scales.unsqueeze(1) * 2.0 ** -9).all()
    assert torch.equal(values.float().abs().amax(1), torch.full((8,), 448.0))  # each row's amax lands on 448

    p = small_preset(shared=shared, limit=limit, tokens=64)
    d = tb.make_inputs(p, "uniform", seed=6, device="cpu")
    fp8 = torch_fp8.TorchFp8(d, compile=False)
    y = fp8.outputs("fwd")["y"]
    with torch.no_grad():
        ref = tb.moe_compilable(d["x"], d["ids"], d["weights"], d["w_gate_up"], d["w_down"], d["limit"],
                                d["shared_gate_up"], d["shared_down"])
    c = tb.compare(y, ref)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert c["cos"] >= 0.99 and c["rel"] <= 0.1, c
    assert c["rel"] > 1e-3  # (it is FP8: not the bf16 layer itself)

    # forward+backward: every gradient against autograd through the bf16 layer
    got = fp8.outputs("fwd+bwd")
    bf16 = tb.TorchImpl(d, tb.moe_compilable).outputs("fwd+bwd")
    assert set(got) == set(bf16) and torch.equal(got["y"], y)
    for n in got:
        c = tb.compare(got[n], bf16[n])
        assert got[n].shape == bf16[n].shape and c["cos"] >= 0.99 and c["rel"] <= 0.1, (n, c)
    # the dgrad is FP8 (not the bf16 dgrad), the weight gradients bf16 GEMMs of the same rows
    assert tb.compare(got["dx"], bf16["dx"])["rel"] > 1e-3


def test_torch_fp8_grouped_mm_backward_is_its_recipe():
    """Fp8GroupedMM's backward, off the GPU: da is the product of the rowwise-quantized gradient
    and the transposed weights quantized per output column; dw the bf16 product of each expert's
    rows (weight_grad), group by group; offsets with an empty group."""
    import torch_fp8 as tf

    g = torch.Generator().manual_seed(3)
    E, N, K, offs = 3, 32, 64, torch.tensor([5, 5, 19], dtype=torch.int32)
    a = torch.randn(19, K, generator=g).bfloat16().requires_grad_()
    w = torch.randn(E, N, K, generator=g).bfloat16().requires_grad_()
    wq, ws, wtq, wts = tf.quantize_weights(w.detach())
    assert wtq.shape == (E, K, N) and wts.shape == (E, K)
    out = tf.Fp8GroupedMM.apply(a, w, offs, wq, ws, wtq, wts)
    dout = torch.randn(19, N, generator=g).bfloat16()
    out.backward(dout)
    dq, d_s = tf.quantize_rows(dout)
    want_da = torch.cat([(dq[s:e].float() * d_s[s:e, None]) @ (wtq[i].float() * wts[i][:, None]).t()
                         for i, (s, e) in enumerate(zip([0, 5, 5], [5, 5, 19]))]).bfloat16()
    assert torch.equal(a.grad, want_da)
    assert torch.equal(w.grad[1], torch.zeros(N, K, dtype=torch.bfloat16))  # (no rows)
    assert torch.equal(w.grad[2], (dout[5:].float().t() @ a.detach()[5:].float()).bfloat16())


def _run_preset_on_the_cpu(monkeypatch, impls, compiled=None):
    """layer_bench.run_preset's records for `impls` on a small preset on the CPU: inputs on the
    CPU, the GPU timers and peak-memory probe stubbed, both passes, one round."""
    import argparse

    make = tb.make_inputs
    monkeypatch.setattr(tb, "make_inputs", lambda p, routing, seed, device="cuda": make(p, routing, seed, device="cpu"))

    def time_ms(fn, warmup, iters, before=None, host=None, queued=False):
        for _ in range(iters):
            if before:
                before()
            fn()
            if host is not None:
                host.append(0.0)
        return [1.0] * iters
    monkeypatch.setattr(tb, "time_ms", time_ms)
    monkeypatch.setattr(tb, "peak_bytes", lambda fn, before=None: 0)
    args = argparse.Namespace(impls=impls, passes=["fwd", "fwd+bwd"], seed=1, repeats=1, iters=2, warmup=0,
                              compiled=compiled, commit="c", date="d", settle_ms=0, queued=False, warmup_rounds=0)
    records = []
    layer_bench.run_preset(dict(small_preset(tokens=64), name="test"), "uniform", args, None, "cpu", records.append)
    return {(r["impl"], r["pass"]): r for r in records}


def test_layer_bench_times_torch_fp8(monkeypatch):
    """layer_bench.run_preset with torch-fp8 asked for, on the CPU (the layer uncompiled): both
    passes are checked with FP8's tolerance (y and, for fwd+bwd, every gradient) and recorded."""
    import torch_fp8

    fp8_impl = torch_fp8.TorchFp8
    monkeypatch.setattr(torch_fp8, "TorchFp8", lambda d: fp8_impl(d, compile=False))
    got = _run_preset_on_the_cpu(monkeypatch, ["torch", "torch-fp8"])
    assert set(got) == {("torch", "fwd"), ("torch", "fwd+bwd"), ("torch-fp8", "fwd"), ("torch-fp8", "fwd+bwd")}
    fp8 = got[("torch-fp8", "fwd")]
    assert fp8["check"] == "passed" and fp8["check_detail"]["tensors"]["y"]["cos"] >= 0.99
    train = got[("torch-fp8", "fwd+bwd")]["check_detail"]["tensors"]
    assert got[("torch-fp8", "fwd+bwd")]["check"] == "passed" and {"dx", "d_w_down", "d_topk_weights"} <= set(train)


def test_layer_bench_checks_the_pytorch_side_implementations_against_the_eager_path(monkeypatch):
    """torch-compiled (here the uncompiled layer) and the liger peer (a stand-in for Liger's
    Function) go through one check against the eager path: every output, and for torch-compiled
    y against fp32 rows too; a peer that cannot run is left out with its error recorded."""
    import types

    import liger_peer

    apply = lambda x, gu, down, ids, w: tb.moe_compilable(x, ids.long(), w, gu, down, None)  # noqa: E731
    monkeypatch.setattr(liger_peer, "function", lambda: types.SimpleNamespace(apply=apply))
    got = _run_preset_on_the_cpu(monkeypatch, ["torch-compiled", "liger"], compiled=tb.moe_compilable)
    assert set(got) == {(i, ps) for i in ("torch-compiled", "liger") for ps in ("fwd", "fwd+bwd")}
    for (impl, ps), r in got.items():
        assert r["check"] == "passed" and r["check_detail"]["tensors"]["y"]["cos"] >= 0.9999, (impl, ps)
    assert "sampled_rel" in got[("torch-compiled", "fwd")]["check_detail"]
    assert "sampled_rel" not in got[("liger", "fwd")]["check_detail"]

    def missing():
        raise ImportError("liger: not importable")
    monkeypatch.setattr(liger_peer, "function", missing)
    got = _run_preset_on_the_cpu(monkeypatch, ["torch", "liger"])
    assert set(got) == {("torch", "fwd"), ("torch", "fwd+bwd")}  # (no record for a peer that did not run)


@pytest.mark.parametrize("queued", [False, True])
def test_layer_bench_checks_and_times_mok_fp8(monkeypatch, queued):
    """layer_bench.run_preset with mok-fp8-py and mok-fp8 asked for, on the CPU: the FP8 layer
    stubbed by its PyTorch oracle (mok.fp8.moe_reference rounded to bf16; with gradients, the
    bf16 torch layer), the C++ server by an object that answers with the same y's checksum, the
    GPU timers and peak probe stubbed. Both are checked (mok-fp8-py against the oracle, mok-fp8
    bitwise against mok-fp8-py) and recorded for fwd; mok-fp8-py's fwd+bwd is checked against
    the eager path's gradients and recorded, mok-fp8's fwd+bwd neither recorded nor reported as
    a failure; a preset whose
    H or I is not a multiple of 128 records no FP8 implementation and fails nothing. With
    --queued both timers are asked for queued timings (the server's time-queued) and the records
    say so; a warm-up round (with --queued here) is timed but not recorded."""
    import argparse

    import mok
    import mok.fp8

    make = tb.make_inputs
    monkeypatch.setattr(tb, "make_inputs", lambda p, routing, seed, device="cuda": make(p, routing, seed, device="cpu"))
    timers = []

    def time_ms(fn, warmup, iters, before=None, host=None, queued=False):
        timers.append((queued, iters))
        return [1.0] * iters
    monkeypatch.setattr(tb, "time_ms", time_ms)
    monkeypatch.setattr(tb, "peak_bytes", lambda fn, before=None: 0)
    monkeypatch.setattr(mok.fp8, "quantize_experts", lambda g, u, d, dgrad=False: ("quantized", g, u, d))
    seen = {}
    real_moe = mok.moe

    def fake_moe(x, ids, weights, w_gate, w_up, w_down, shared=None, swiglu_limit=None, *, precision="bf16",
                 fp8_experts=None):
        if precision != "fp8":
            return real_moe(x, ids, weights, w_gate, w_up, w_down, shared, swiglu_limit)
        assert fp8_experts == ("quantized", w_gate, w_up, w_down)  # quantized once, passed every call
        if torch.is_grad_enabled():  # (fwd+bwd: a differentiable stand-in, the bf16 torch layer)
            assert shared is None
            return tb.moe_compilable(x, ids, weights, torch.cat([w_gate, w_up], 1), w_down, swiglu_limit)
        y = mok.fp8.moe_reference(x, ids, weights, w_gate, w_up, w_down, shared, swiglu_limit).to(torch.bfloat16)
        seen["checksum"] = layer_bench.checksum(y)
        return y
    monkeypatch.setattr(mok, "moe", fake_moe)

    class Server:
        calls = []
        load = MokBench.load  # (writes the routing files, then calls "load")

        def call(self, *words):
            self.calls.append(words)
            if words[0] == "check":
                return {"checksums": {"y": str(seen["checksum"])}}
            if words[0] in ("time", "time-queued"):
                return {"ms": [1.0] * words[3], "host_ms": [0.0] * words[3]}
            if words[0] == "peak":
                return {"peak_bytes": 0}
            return {"ok": True}

    server = Server()
    args = argparse.Namespace(impls=["torch", "mok-fp8-py", "mok-fp8"], passes=["fwd", "fwd+bwd"], seed=1, repeats=1,
                              iters=2, warmup=0, compiled=None, commit="c", date="d", settle_ms=1, queued=queued,
                              warmup_rounds=int(queued))
    records = []
    preset = dict(name="test", tokens=64, hidden=256, intermediate=128, experts=8, top_k=2, shared_intermediate=0,
                  swiglu_limit=0.0)
    layer_bench.run_preset(preset, "uniform", args, server, "cpu", records.append)
    got = {(r["impl"], r["pass"]): r for r in records}
    assert set(got) == {("torch", "fwd"), ("torch", "fwd+bwd"), ("mok-fp8-py", "fwd"), ("mok-fp8-py", "fwd+bwd"),
                        ("mok-fp8", "fwd")}
    assert got[("mok-fp8-py", "fwd")]["check"] == "passed"
    assert got[("mok-fp8-py", "fwd+bwd")]["check"] == "passed"
    assert got[("mok-fp8-py", "fwd+bwd")]["check_detail"]["fp8_dgrad"] is False  # (I = 128 < 1536)
    assert got[("mok-fp8", "fwd")]["check"] == "passed"
    assert got[("mok-fp8", "fwd")]["check_detail"]["bitwise_equal_to_mok_fp8_py"]
    assert ("check", "fwd", "mok-fp8") in server.calls and ("peak", "fwd", "mok-fp8") in server.calls
    timed = {w[0] for w in server.calls if w[0].startswith("time")}
    assert timed == {"time-queued" if queued else "time"} and {q for q, _ in timers} == {queued}
    assert all(r["timing"] == ("queued" if queued else "synced") for r in records)
    # (a round times mok-fp8's forward once through the server, and torch's fwd and fwd+bwd and
    # mok-fp8-py's fwd and fwd+bwd through time_ms, each after its settle's calls of SETTLE_ITERS iterations)
    rounds = 1 + int(queued)
    assert sum(w[0].startswith("time") and w[3] == 2 for w in server.calls) == rounds
    assert sum(iters == 2 for _, iters in timers) == 4 * rounds
    assert all(r["repeats"] == 1 and r["warmup_rounds"] == int(queued) for r in records)

    records.clear()
    layer_bench.run_preset(small_preset(tokens=64), "uniform", args, server, "cpu", records.append)  # I = 64
    assert {r["impl"] for r in records} == {"torch"} and all(r["check"] != "failed" for r in records)


@pytest.mark.parametrize("limit", [None, 2.0])
def test_fp8_backward_accuracy_study_is_exact_where_nothing_is_quantized(limit):
    """bench/fp8_backward_accuracy.py writes the layer's backward by hand: its exact step must be
    autograd's through the fp64 reference (y and every gradient, the clamp included), and each
    recipe must cost accuracy in the order it quantizes more."""
    import fp8_backward_accuracy as fa
    from torch_reference import moe_reference, random_problem

    T, H, I, E, k = 80, 256, 128, 3, 2
    x, ids, w, gate, up, down, _ = random_problem(T, H, I, E, k, seed=5)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w.double(), gate, up, down)]
    y = moe_reference(leaves[0], ids, leaves[1], *leaves[2:], swiglu_limit=limit)
    grads = torch.autograd.grad(y, leaves, dy)
    got = fa.step(x, ids, w, gate, up, down, dy, limit, None)
    for a, b in zip(got, (y, grads[0], grads[1], grads[2], grads[3], grads[4])):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)
    cos = {r: [fa.compare(a, b)[0] for a, b in zip(fa.step(x, ids, w, gate, up, down, dy, limit, r), got)]
           for r in fa.RECIPES}
    # (bf16 stores; with a clamp, bf16 pre-activations flip some decisions at the limit: dW_gate
    # reads ~0.9985 at limit 2)
    assert min(cos["bf16"]) > (0.9999 if limit is None else 0.99)
    assert cos["fwd8"][0] < 0.999 and cos["fwd8"][1] > cos["fwd8+dgrad8"][1]  # (y FP8; dx costs more with FP8 dgrad)
    assert cos["all8"][3] < cos["fwd8+dgrad8"][3] and min(cos["all8"][3:]) > 0.99  # (FP8 weight gradients)


def test_fp8_wgrad_bound_operands_are_the_rows_transposed_and_scaled():
    """bench/fp8_wgrad_bound.py's operands: E4M3 [N, R] copies of bf16 rows [R, N] whose
    dequantized values are the rows within E4M3's half step, scaled per 128 rows x 1 column
    (quantize_t) or per group of rows x 1 column (rowwise_t, the layout _scaled_grouped_mm takes)."""
    import fp8_wgrad_bound as wb

    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(512, 48, generator=gen) * torch.logspace(-2, 2, 48)).bfloat16()
    q, scale = wb.quantize_t(rows)
    assert q.shape == (48, 512) and q.dtype == wb.FP8 and scale.shape == (4, 48)
    back = q.float().t().reshape(4, 128, 48) * scale[:, None, :]
    err = (back - rows.float().reshape(4, 128, 48)).abs()
    assert bool((err <= rows.float().reshape(4, 128, 48).abs() * 2 ** -4 + scale[:, None, :] * 2 ** -9).all())
    q2, s2 = wb.rowwise_t(rows, 2)
    assert q2.shape == (48, 512) and s2.shape == (2 * 48,)
    back2 = q2.float().t().reshape(2, 256, 48) * s2.view(2, 1, 48)
    assert torch.allclose(back2, rows.float().reshape(2, 256, 48), rtol=2 ** -3, atol=float(s2.max()) * 2 ** -9)
