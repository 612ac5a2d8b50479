"""What the GPU tests share: the Hopper marker and the problem they build."""

import pytest
import torch

from torch_reference import moe_reference, random_problem

hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
needs_hopper = pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")


def problem(T=300, H=256, I=192, E=8, k=2, shared=0, seed=0, padding=0.0):
    x, ids, w, gate, up, down, sh = random_problem(T, H, I, E, k, shared, seed=seed, device="cuda",
                                                   dtype=torch.bfloat16, padding=padding)
    return x, ids, w, gate, up, down, sh


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def check_forward(y, args, limit=None):
    """y of mok.moe on args (a problem) within 1e-2 of the fp32 reference, and finite."""
    x, ids, w, gate, up, down, sh = args
    f = lambda t: t.float()
    ref = moe_reference(f(x), ids, w, f(gate), f(up), f(down), None if sh is None else tuple(map(f, sh)), limit)
    assert torch.isfinite(y).all()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err <= 1e-2, err
