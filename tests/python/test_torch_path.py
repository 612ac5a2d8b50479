"""mok.moe_torch (the plain PyTorch path) and the training example, without a GPU."""

import os
import subprocess
import sys

import pytest
import torch

import mok
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
