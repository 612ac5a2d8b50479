"""The argument checks' fast path (mok._checks._valid) never lets through what the full checks
refuse: every variant below, valid or broken in one way, is run through both (on meta and
CPU tensors: no GPU needed)."""
import math

import numpy as np
import pytest
import torch

from mok._checks import _valid, check_moe_args

T, H, I, E, K, IS = 8, 128, 64, 4, 2, 64
BF16 = torch.bfloat16


def base(fused=False, shared=False, device="meta"):
    a = dict(x=torch.empty(T, H, dtype=BF16, device=device),
             topk_ids=torch.empty(T, K, dtype=torch.int32, device=device),
             topk_weights=torch.empty(T, K, dtype=torch.float32, device=device),
             w_gate=torch.empty(E, 2 * I if fused else I, H, dtype=BF16, device=device),
             w_up=None if fused else torch.empty(E, I, H, dtype=BF16, device=device),
             w_down=torch.empty(E, H, I, dtype=BF16, device=device),
             shared=None, swiglu_limit=None, num_experts=None)
    if shared:
        a["shared"] = (torch.empty(IS, H, dtype=BF16, device=device), torch.empty(IS, H, dtype=BF16, device=device),
                       torch.empty(H, IS, dtype=BF16, device=device))
    return a


def mutations():
    """(name, kwargs) of valid variants and of variants broken in one argument."""
    good = [("plain", base()), ("fused", base(fused=True)), ("shared", base(shared=True)),
            ("limit", dict(base(), swiglu_limit=7.0)), ("ep", dict(base(), num_experts=8)),
            ("int64 ids", dict(base(), topk_ids=torch.empty(T, K, dtype=torch.int64, device="meta"))),
            ("strided weights", dict(base(), w_gate=torch.empty(E, 2 * I, H, dtype=BF16, device="meta")[:, :I]))]
    bad = []

    def broken(name, **changes):
        bad.append((name, dict(base(), **changes)))

    broken("x dtype", x=torch.empty(T, H, dtype=torch.float32, device="meta"))
    broken("ids dtype", topk_ids=torch.empty(T, K, dtype=torch.float32, device="meta"))
    broken("weights dtype", topk_weights=torch.empty(T, K, dtype=BF16, device="meta"))
    broken("w_gate dtype", w_gate=torch.empty(E, I, H, dtype=torch.float16, device="meta"))
    broken("w_up dtype", w_up=torch.empty(E, I, H, dtype=torch.float32, device="meta"))
    broken("w_down dtype", w_down=torch.empty(E, H, I, dtype=torch.float32, device="meta"))
    broken("x 3-D", x=torch.empty(1, T, H, dtype=BF16, device="meta"))
    broken("x not a tensor", x=[[0.0] * H] * T)
    broken("w_gate 2-D", w_gate=torch.empty(I, H, dtype=BF16, device="meta"))
    broken("ids rows", topk_ids=torch.empty(T + 1, K, dtype=torch.int32, device="meta"))
    broken("ids 1-D", topk_ids=torch.empty(T, dtype=torch.int32, device="meta"))
    broken("weights shape", topk_weights=torch.empty(T, K + 1, dtype=torch.float32, device="meta"))
    broken("k = 0", topk_ids=torch.empty(T, 0, dtype=torch.int32, device="meta"),
           topk_weights=torch.empty(T, 0, dtype=torch.float32, device="meta"))
    broken("k > E", topk_ids=torch.empty(T, E + 1, dtype=torch.int32, device="meta"),
           topk_weights=torch.empty(T, E + 1, dtype=torch.float32, device="meta"))
    broken("E does not divide num_experts", num_experts=6)
    broken("w_gate hidden", w_gate=torch.empty(E, I, H + 64, dtype=BF16, device="meta"))
    broken("w_up shape", w_up=torch.empty(E, I + 64, H, dtype=BF16, device="meta"))
    broken("w_down shape", w_down=torch.empty(E, H, I + 64, dtype=BF16, device="meta"))
    broken("fused odd rows", w_gate=torch.empty(E, 2 * I + 1, H, dtype=BF16, device="meta"), w_up=None)
    h2 = 96  # not a multiple of 64, consistent everywhere
    broken("H not a multiple of 64", x=torch.empty(T, h2, dtype=BF16, device="meta"),
           w_gate=torch.empty(E, I, h2, dtype=BF16, device="meta"), w_up=torch.empty(E, I, h2, dtype=BF16, device="meta"),
           w_down=torch.empty(E, h2, I, dtype=BF16, device="meta"))
    broken("I not a multiple of 64", w_gate=torch.empty(E, 32, H, dtype=BF16, device="meta"),
           w_up=torch.empty(E, 32, H, dtype=BF16, device="meta"), w_down=torch.empty(E, H, 32, dtype=BF16, device="meta"))
    sg, su, sd = base(shared=True)["shared"]
    broken("shared not 3", shared=(sg, su))
    broken("shared gate 1-D", shared=(sg[0], su, sd))
    broken("shared gate dtype", shared=(sg.float(), su, sd))
    broken("shared up shape", shared=(sg, su[:, :64], sd))
    broken("shared down shape", shared=(sg, su, sd[:64]))
    broken("shared I_s 32", shared=(sg[:32], su[:32], sd[:, :32]))
    broken("shared I_s 0", shared=(sg[:0], su[:0], sd[:, :0]))  # (the kernel refused it after the checks passed)
    broken("shared not contiguous", shared=(sg, su, torch.empty(IS, H, dtype=BF16, device="meta").t()))
    broken("limit negative", swiglu_limit=-1.0)
    broken("limit inf", swiglu_limit=math.inf)
    broken("limit nan", swiglu_limit=math.nan)
    broken("limit not a number", swiglu_limit="7")
    good.append(("NumPy limit", dict(base(), swiglu_limit=np.float32(7.0))))  # (refused as "not a number" before)
    broken("x not contiguous", x=torch.empty(T, 2 * H, dtype=BF16, device="meta")[:, ::2])
    broken("ids not contiguous", topk_ids=torch.empty(K, T, dtype=torch.int32, device="meta").t())
    broken("w_gate rows not contiguous", w_gate=torch.empty(E, H, I, dtype=BF16, device="meta").transpose(1, 2))
    broken("w_down on another device", w_down=torch.empty(E, H, I, dtype=BF16))
    bad.append(("all on the CPU", base(device="cpu")))
    return good, bad


GOOD, BAD = mutations()


@pytest.mark.parametrize("name,args", GOOD, ids=[n for n, _ in GOOD])
def test_fast_path_takes_valid_arguments(name, args):
    assert _valid(**args), name
    check_moe_args(**args)


@pytest.mark.parametrize("name,args", BAD, ids=[n for n, _ in BAD])
def test_fast_path_refuses_what_the_checks_refuse(name, args):
    assert not _valid(**args), name
    with pytest.raises((TypeError, ValueError)):
        check_moe_args(**args)


def test_a_partial_shared_expert_and_no_experts_are_named():
    """shared=(None, up, down) ran with no shared expert on fake tensors, (gate, None, down)
    raised an AttributeError, and E = 0 a ZeroDivisionError; mok.moe names them now."""
    import mok

    a = base(shared=True)
    sg, su, sd = a["shared"]
    args = (a["x"], a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"])
    for shared, name in (((None, su, sd), "shared gate"), ((sg, None, sd), "shared up"), ((sg, su, 1.0), "shared down")):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
            mok.moe(*args, shared=shared)
    empty = torch.empty(0, I, H, dtype=BF16, device="meta")
    with pytest.raises(ValueError, match=r"'w_gate' holds no expert, shape \(0, 64, 128\)"):
        mok.moe(a["x"], a["topk_ids"], a["topk_weights"], empty, empty, torch.empty(0, H, I, dtype=BF16, device="meta"))
