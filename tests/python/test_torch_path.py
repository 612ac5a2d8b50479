"""mok.moe_torch (the plain PyTorch path) and the training example, without a GPU."""

import os
import re
import subprocess
import sys

import pytest
import torch

import mok
from process_group import run_in_two_processes
from torch_reference import moe_reference, random_problem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("shared,limit,padding", [(0, None, 0.0), (32, 0.75, 0.3)])
def test_values_and_gradients_match_reference(shared, limit, padding):
    x, ids, w, gate, up, down, sh = random_problem(37, 64, 48, 6, 2, shared, seed=4, padding=padding)
    w = w.double()
    leaves = lambda: [t.clone().requires_grad_(True) for t in (x, w, gate, up, down) + (sh or ())]
    ours, ref = leaves(), leaves()
    y = mok.moe_torch(ours[0], ids, ours[1], *ours[2:5], shared=ours[5:] or None, swiglu_limit=limit)
    y_ref = moe_reference(ref[0], ids, ref[1], *ref[2:5], tuple(ref[5:]) or None, limit)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_module_torch_backend_on_cpu():
    layer = mok.MoE(64, 64, 4, 2, shared_intermediate=64, backend="torch", dtype=torch.float32)
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad is not None and layer.w_gate.grad is not None
    with pytest.raises(ValueError, match="'backend' must be 'mok'"):
        mok.MoE(64, 64, 4, 2, backend="cuda")
    with pytest.raises(TypeError, match="must be torch.bfloat16 for the fused kernel"):
        mok.MoE(64, 64, 4, 2, dtype=torch.float32)


def test_training_example_loss_falls_on_cpu():
    pytest.importorskip("tqdm")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_moe_lm.py"), "--backend", "torch",
                          "--device", "cpu", "--size", "tiny", "--steps", "40"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "final loss" in run.stdout


@pytest.mark.parametrize("bad,message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--lr", "nan"], "--lr must be a finite positive number, got nan"),
    (["--steps", "3"], r"--warmup \(steps left out of tokens/s\) must be in \[0, --steps\), got 5 with --steps 3"),
    (["--out", "/nonexistent-folder/run.json"], "--out /nonexistent-folder/run.json: the folder /nonexistent-folder does not"),
    (["--backend", "mok-recompute"], r"the mok backends need a Hopper GPU \(--device cuda\)"),  # (a known backend)
    (["--backend", "mok-nope"], "unknown backend 'mok-nope'; known: mok, mok-compiled"),
])
def test_training_example_refuses_bad_options_before_training(bad, message):
    """(--out into a missing folder failed after the whole run, losing it; --steps below --warmup
    wrote a bare NaN into the JSON; --steps 0 blamed --lr-warmup)"""
    pytest.importorskip("tqdm")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_moe_lm.py"), "--backend", "torch",
                          "--device", "cpu", "--size", "tiny", *bad], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and re.search(message, run.stderr), run.stderr[-2000:]


@pytest.mark.parametrize("bad,message", [
    (["--backend", "torch", "--device", "cpu", "--recompute"], r"--recompute runs on the fused bf16 kernels"),
    (["--backend", "torch", "--device", "cpu", "--precision", "fp8"], r"--precision fp8 runs on the fused kernels"),
])
def test_expert_parallel_training_example_refuses_bad_options_before_training(bad, message):
    pytest.importorskip("tqdm")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_moe_ep.py"), "--size", "tiny", *bad],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and re.search(message, run.stderr), run.stderr[-2000:]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_expert_parallel_training_example_matches_one_process_on_cpu():
    """examples/train_moe_ep.py in two gloo processes over mok.moe_torch_ep: at step 0 the ranks'
    mean language-model loss and their synchronised gradients equal the whole model's in one
    process (the experts split, the rest averaged: the LM loss's update is the one-process update),
    and the loss falls."""
    pytest.importorskip("tqdm")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          os.path.join(ROOT, "examples", "train_moe_ep.py"), "--backend", "torch", "--device", "cpu",
                          "--size", "tiny", "--steps", "30", "--check"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "agree" in run.stdout and "DIFFER" not in run.stdout and "final" in run.stdout, run.stdout[-2000:]


def test_training_example_loss_goes_through_a_compiled_twin():
    """lm_loss takes the compiled module (an OptimizedModule, whose truth value raises) as the
    forward: the regression that stopped the example's -compiled backends on the GPU (2026-12-05)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_moe_lm", os.path.join(ROOT, "examples", "train_moe_lm.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.MoeLM(example.SIZES["tiny"], "torch", torch.device("cpu"), torch.float32, "bf16", None)
    compiled = torch.compile(model, backend="eager")
    inputs = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    eager_loss, eager_balance = example.lm_loss(model, inputs, targets)
    loss, balance = example.lm_loss(model, inputs, targets, compiled)
    assert torch.equal(loss, eager_loss) and torch.equal(balance, eager_balance)


def test_training_example_precision_picks_the_fp8_twins():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_moe_lm", os.path.join(ROOT, "examples", "train_moe_lm.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    pick = example.with_precision
    assert pick(["mok", "torch"], "bf16") == ["mok", "torch"]
    assert pick(["mok", "mok-compiled", "torch"], "fp8") == ["mok-fp8", "mok-fp8-compiled", "torch"]
    assert pick(["mok", "torch-compiled"], "both") == ["mok", "mok-fp8", "torch-compiled"]
    assert pick(["mok", "mok-fp8"], "both") == ["mok", "mok-fp8"]  # (no backend twice)


def test_training_example_schedule_and_spike_measure():
    import importlib.util
    import types
    spec = importlib.util.spec_from_file_location("train_moe_lm", os.path.join(ROOT, "examples", "train_moe_lm.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = types.SimpleNamespace(lr=1.0, lr_warmup=10, steps=110, schedule="cosine")
    lrs = [example.learning_rate(step, args) for step in range(110)]
    assert lrs[:10] == [pytest.approx((s + 1) / 10) for s in range(10)]  # linear warm-up to the peak
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)  # cosine: half-way
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    args.schedule = "constant"
    assert [example.learning_rate(s, args) for s in (5, 10, 109)] == [pytest.approx(0.6), 1.0, 1.0]
    assert example.largest_rise([5.0, 3.0, 4.0, 2.0, 2.5], 0) == pytest.approx(1.0)
    assert example.largest_rise([5.0, 3.0, 4.0, 2.0, 2.5], 3) == pytest.approx(0.5)  # (from step 3 on)


def _ep_rank(rank, world, shared, limit):
    """One process of the two-rank check below: its part of one global problem through
    mok.moe_torch_ep, against mok.moe_torch on the whole problem."""
    import torch.distributed as dist

    T, E_l = 9, 3  # tokens per rank, experts per rank
    x, ids, w, gate, up, down, sh = random_problem(T * world, 32, 16, E_l * world, 2, shared, seed=7, padding=0.2)
    w = w.double()
    mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * E_l, (rank + 1) * E_l)
    leaves = lambda *ts: [t.clone().requires_grad_(True) for t in ts]
    full = leaves(x, w, gate, up, down, *(sh or ()))
    y = mok.moe_torch(full[0], ids, full[1], *full[2:5], shared=full[5:] or None, swiglu_limit=limit)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(8), dtype=y.dtype)
    y.backward(dy)
    part = leaves(x[mine], w[mine], gate[experts], up[experts], down[experts], *(sh or ()))
    y_ep = mok.moe_torch_ep(part[0], ids[mine], part[1], *part[2:5], shared=part[5:] or None, swiglu_limit=limit)
    y_ep.backward(dy[mine])
    torch.testing.assert_close(y_ep, y[mine], rtol=1e-12, atol=1e-12)
    for name, got, want in (("x", part[0], full[0].grad[mine]), ("topk_weights", part[1], full[1].grad[mine]),
                            ("w_gate", part[2], full[2].grad[experts]), ("w_up", part[3], full[3].grad[experts]),
                            ("w_down", part[4], full[4].grad[experts])):
        torch.testing.assert_close(got.grad, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} {name}: {m}")
    if sh:  # the shared expert's gradient is each rank's own tokens' share: their sum is the whole
        grads = [torch.zeros_like(part[5].grad) for _ in range(world)]
        dist.all_gather(grads, part[5].grad)
        torch.testing.assert_close(sum(grads), full[5].grad, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("shared,limit", [(0, None), (16, 0.75)])
def test_expert_parallel_torch_path_matches_one_process(shared, limit):
    run_in_two_processes(_ep_rank, shared, limit)


def _ep_module_rank(rank, world):
    """mok.MoE(backend="torch", group=...) on gloo: each rank's module holds its experts and
    must match one module holding all of them (router, values, gradients)."""
    import torch.distributed as dist

    import mok.ep

    torch.manual_seed(3)  # the same full layer and tokens on every rank
    H, I, E, k, T = 32, 16, 6, 2, 7
    full = mok.MoE(H, I, E, k, backend="torch", dtype=torch.float64)  # (the router stays fp32)
    group = mok.ep.ExpertParallel()
    part = mok.MoE(H, I, E, k, backend="torch", group=group, dtype=torch.float64)
    experts = slice(rank * E // world, (rank + 1) * E // world)
    with torch.no_grad():
        part.router.weight.copy_(full.router.weight)
        for mine, whole in ((part.w_gate, full.w_gate), (part.w_up, full.w_up), (part.w_down, full.w_down)):
            mine.copy_(whole[experts])
    x = torch.randn(world * T, H, dtype=torch.float64)
    mine = slice(rank * T, (rank + 1) * T)
    full(x).backward(torch.ones(world * T, H, dtype=torch.float64))
    part(x[mine]).backward(torch.ones(T, H, dtype=torch.float64))
    torch.testing.assert_close(part(x[mine]), full(x)[mine], rtol=1e-12, atol=1e-12)
    for mine_w, whole in ((part.w_gate, full.w_gate), (part.w_up, full.w_up), (part.w_down, full.w_down)):
        torch.testing.assert_close(mine_w.grad, whole.grad[experts], rtol=1e-10, atol=1e-12)
    router_grads = [torch.zeros_like(part.router.weight.grad) for _ in range(world)]
    dist.all_gather(router_grads, part.router.weight.grad)  # each rank's tokens' share
    torch.testing.assert_close(sum(router_grads), full.router.weight.grad, rtol=1e-5, atol=1e-6)  # fp32


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_expert_parallel_module_with_the_torch_backend_matches_one_process():
    run_in_two_processes(_ep_module_rank)


def _ep_bad_id_rank(rank, world):
    """Rank 0 alone passes an expert id out of range: every rank must raise, naming rank 0 (before
    2026-12-05 rank 0 raised and rank 1 waited in the next exchange until the group's timeout)."""
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64)
    x, w = torch.randn(4, 64, **f64), torch.rand(4, 2, **f64)
    ids = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2]])
    gate, up, down = (torch.randn(2, 64, 64, **f64) for _ in range(3))
    if rank == 0:
        ids[0, 0] = 9
    with pytest.raises(ValueError, match=r"expert id outside \[-1, 4\) on rank 0 of the group"):
        mok.moe_torch_ep(x, ids, w, gate, up, down)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_expert_parallel_torch_path_raises_on_every_rank_for_one_ranks_bad_id():
    run_in_two_processes(_ep_bad_id_rank)


@pytest.mark.parametrize("bad", [8, -2])
def test_moe_torch_refuses_an_expert_id_outside_the_range(bad):
    """An id >= E (past the last group's rows) or < -1 (not "no expert") is an error
    (torch._assert_async: no host sync, traceable by torch.compile; a device-side assert on a GPU)."""
    x, ids, w, gate, up, down, _ = random_problem(6, 32, 16, 8, 2, False, seed=3, padding=0.0)
    ids[2, 1] = bad
    with pytest.raises(RuntimeError, match=r"expert id outside \[-1, 8\)"):
        mok.moe_torch(x, ids, w, gate, up, down)
    ids[2, 1] = -1  # ("no expert": fine)
    assert torch.isfinite(mok.moe_torch(x, ids, w, gate, up, down)).all()


def test_moe_torch_checks_its_arguments():
    """The PyTorch paths refuse what mok.moe refuses (bar dtype and device): without the checks a
    topk_ids of fewer rows than x gave y of its rows, a [k] or [T, 1] topk_weights broadcast, a
    negative or zero swiglu_limit gave wrong values, and T = 0 failed in a reshape."""
    x, ids, w, gate, up, down, _ = random_problem(6, 32, 16, 8, 2, False, seed=4, padding=0.0)
    cases = [
        ((x, ids[:3], w[:3]), dict(), ValueError, r"'topk_ids' must be \[T, k\] with T = 6, got shape \(3, 2\)"),
        ((x, ids, w[:, :1]), dict(), ValueError, r"'topk_weights' shape must be \(6, 2\), got \(6, 1\)"),
        ((x, ids, w[0]), dict(), ValueError, r"'topk_weights' shape must be \(6, 2\), got \(2,\)"),
        ((x, ids.float(), w), dict(), TypeError, "'topk_ids' dtype must be torch.int32 or torch.int64"),
        ((x, ids, w), dict(swiglu_limit=-1.0), ValueError, "'swiglu_limit' must be a finite positive number, got -1.0"),
        ((x, ids, w), dict(swiglu_limit=0), ValueError, "'swiglu_limit' must be a finite positive number, got 0"),
    ]
    for (xx, ii, ww), kw, exc, message in cases:
        with pytest.raises(exc, match=message):
            mok.moe_torch(xx, ii, ww, gate, up, down, **kw)
    with pytest.raises(ValueError, match=r"'w_down' shape must be \(8, 32, 16\), got \(8, 16, 32\)"):
        mok.moe_torch(x, ids, w, gate, up, down.transpose(1, 2))
    with pytest.raises(TypeError, match="shared up must be a torch.Tensor"):
        mok.moe_torch(x, ids, w, gate, up, down, shared=(gate[0], None, down[0]))
    y = mok.moe_torch(x[:0], ids[:0], w[:0], gate, up, down)  # no tokens
    assert y.shape == (0, 32)


def test_moe_torch_no_expert_slot_adds_nothing_whatever_its_weight():
    x, ids, w, gate, up, down, _ = random_problem(6, 32, 16, 8, 2, False, seed=5, padding=0.0)
    ids[1, 0], ids[4, 1] = -1, -1
    y = mok.moe_torch(x, ids, w, gate, up, down)
    w_bad = w.clone()
    w_bad[1, 0], w_bad[4, 1] = float("nan"), float("inf")
    assert torch.equal(mok.moe_torch(x, ids, w_bad, gate, up, down), y)
