"""mok.MoE without a GPU: parameters, the router, and output metadata through the fake op."""

import pytest
import torch

import mok


def test_router_matches_softmax_topk_renormalised():
    layer = mok.MoE(128, 64, 8, 2, router="softmax")
    x = torch.randn(5, 128)
    ids, weights, logits = layer.route(x)
    probs = torch.softmax(x @ layer.router.weight.T, dim=-1)
    top, idx = probs.topk(2, dim=-1)
    assert torch.equal(ids, idx.int()) and ids.dtype == torch.int32
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    assert logits.shape == (5, 8)


def test_sigmoid_router_without_renormalisation():
    layer = mok.MoE(64, 64, 4, 3, router="sigmoid", renormalize=False)
    x = torch.randn(3, 64)
    _, weights, logits = layer.route(x)
    torch.testing.assert_close(weights, torch.sigmoid(logits).topk(3, dim=-1).values)


def test_parameters_and_meta_forward():
    layer = mok.MoE(128, 64, 4, 2, shared_intermediate=64, swiglu_limit=7.0, device="meta")
    names = {n for n, _ in layer.named_parameters()}
    assert {"w_gate", "w_up", "w_down", "shared.0", "shared.1", "shared.2", "router.weight"} <= names
    assert layer.w_down.shape == (4, 128, 64) and layer.w_gate.dtype == torch.bfloat16
    x = torch.empty(2, 3, 128, dtype=torch.bfloat16, device="meta")
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16


def test_print_shows_the_shape_and_the_settings_that_differ_from_the_defaults():
    plain = mok.MoE(128, 64, 8, 2, device="meta").extra_repr()
    assert plain == "hidden=128, intermediate=64, num_experts=8, top_k=2"
    lean = mok.MoE(128, 64, 8, 2, shared_intermediate=64, router="sigmoid", swiglu_limit=7.0, recompute=True,
                   fused_gate_up=True, device="meta")
    assert lean.extra_repr() == ("hidden=128, intermediate=64, num_experts=8, top_k=2, shared_intermediate=64, "
                                 "router='sigmoid', recompute=True, swiglu_limit=7.0, fused_gate_up=True")
    fp8 = mok.MoE(128, 128, 8, 2, router=None, precision="fp8", device="meta")
    assert "router=None, precision='fp8'" in repr(fp8)


def test_initialisation_scale():
    layer = mok.MoE(256, 128, 4, 2)
    assert abs(layer.w_gate.float().std().item() - 256 ** -0.5) < 0.01
    assert abs(layer.w_down.float().std().item() - 128 ** -0.5) < 0.01


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(router="relu"), ValueError, "'router' must be 'softmax', 'sigmoid' or None"),
    (dict(top_k=9), ValueError, r"'top_k' must be in \[1, num_experts = 8\], got 9"),
    (dict(dtype=torch.float16), TypeError, "expert weights must be torch.bfloat16"),
])
def test_bad_construction(kwargs, exc, message):
    args = dict(hidden=64, intermediate=64, num_experts=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        mok.MoE(**args)


def test_routing_arguments_go_together():
    layer = mok.MoE(64, 64, 4, 2, router=None, device="meta")
    x = torch.empty(3, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="has no router"):
        layer(x)
    with pytest.raises(ValueError, match="'topk_ids' was given without 'topk_weights'"):
        layer(x, topk_ids=torch.zeros(3, 2, dtype=torch.int32, device="meta"))


def test_load_balancing_loss():
    layer = mok.MoE(64, 64, 4, 2, backend="torch", dtype=torch.float32, load_balancing=True)
    x = torch.randn(6, 64)
    layer(x)
    ids, _, logits = layer.route(x)
    probs = torch.softmax(logits, -1)
    f = torch.stack([(ids == e).sum() for e in range(4)]).float() / ids.numel()
    torch.testing.assert_close(layer.aux_loss, 4 * (f * probs.mean(0)).sum())
    layer.aux_loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    # Perfect balance (uniform probabilities, every expert chosen equally often) gives 1.
    uniform = layer.load_balancing_loss(torch.zeros(4, 4), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]))
    torch.testing.assert_close(uniform, torch.tensor(1.0))
    with pytest.raises(ValueError, match="'load_balancing' needs a router"):
        mok.MoE(64, 64, 4, 2, router=None, load_balancing=True)


@pytest.mark.parametrize("step", ["bf16", "fp8", "fp8-dgrad"])
def test_eager_training_steps_unpack_their_saved_tensors_once(monkeypatch, step):
    """Non-reentrant activation checkpointing lets a backward unpack each saved tensor once: the
    eager training steps (outside torch.compile; the fused kernels stood in for by CPU functions)
    give the same gradients with and without it, and the FP8 step hands its saved dgrad operands
    to the backward. (Found by review 2026-12-05: the FP8 step read ctx.saved_tensors twice.)"""
    from torch.utils.checkpoint import checkpoint

    from mok import fp8_layer, ops

    T, H, I, E, k = 8, 128, 128, 4, 2
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen).bfloat16().requires_grad_(True)
    ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    w = torch.rand(T, k, generator=gen).requires_grad_(True)
    gate, up = (torch.randn(E, I, H, generator=gen).bfloat16().requires_grad_(True) for _ in range(2))
    down = torch.randn(E, H, I, generator=gen).bfloat16().requires_grad_(True)
    dgrad = tuple(torch.full((2,), float(i)) for i in range(4))
    seen = []

    def forward(x, ids, w, gate, up, down, *rest, **kwargs):  # (y: a differentiable-looking stand-in)
        return (x.float() * 2).bfloat16(), torch.arange(16, dtype=torch.bfloat16)

    def backward(dy, x, ids, w, gate, up, down, sg, su, sd, saved, *layer, fp8_dgrad=None):
        seen.append(fp8_dgrad)
        assert torch.equal(saved, torch.arange(16, dtype=torch.bfloat16))
        return [(dy.float() * 2).bfloat16(), torch.ones_like(w), torch.ones_like(gate), torch.ones_like(up),
                torch.ones_like(down)]

    monkeypatch.setattr(ops, "_run_forward", forward)
    monkeypatch.setattr(fp8_layer, "_run_forward_fp8", forward)
    monkeypatch.setattr(ops, "_run_backward", backward)

    def layer(x):
        tensors = (x, ids, w, gate, up, down, None, None, None)
        if step == "bf16":
            return ops._EagerTrainStep.apply(None, False, *tensors, None, E, 0)
        experts = (x,) * fp8_layer._FORWARD_ARGS + (dgrad if step == "fp8-dgrad" else (None,) * 4)
        return fp8_layer._EagerTrainStep.apply(*tensors, None, E, 0, *experts)

    grads = []
    for wrapped in (layer, lambda x: checkpoint(layer, x, use_reentrant=False)):
        for t in (x, w, gate, up, down):
            t.grad = None
        wrapped(x).float().sum().backward()
        grads.append([t.grad.clone() for t in (x, w, gate, up, down)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert torch.equal(grads[0][0], torch.full_like(x, 2))  # (dy = 1: the stand-in backward doubles it)
    assert len(seen) == 2  # (one backward each way)
    for operands in seen:
        if step == "fp8-dgrad":
            assert len(operands) == 4 and all(map(torch.equal, operands, dgrad))
        else:
            assert operands is None


def test_activation_checkpointing_traces_through_the_layer():
    # (meta tensors: the custom ops' fake implementations; the bits are checked on a GPU, test_gpu.py)
    from torch.utils.checkpoint import checkpoint

    layer = mok.MoE(128, 64, 8, 2, shared_intermediate=64, device="meta")
    x = torch.empty(16, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).float().sum().backward()
    assert x.grad.shape == x.shape and all(p.grad is not None and p.grad.shape == p.shape for p in layer.parameters())


@pytest.mark.parametrize("kwargs,message", [
    (dict(hidden=100), "'hidden' must be a multiple of 64 for the fused kernel, got 100"),
    (dict(hidden=64, precision="fp8"), "'hidden' must be a multiple of 128 for the fused kernel in FP8, got 64"),
    (dict(top_k=1.5), "'top_k' must be a positive int, got 1.5"),
    (dict(num_experts=0), "'num_experts' must be a positive int, got 0"),
    (dict(shared_intermediate=-64), r"'shared_intermediate' must be an int >= 0 \(0: no shared expert\), got -64"),
    (dict(shared_intermediate=96), "'shared_intermediate' must be a multiple of 64 for the fused kernel, got 96"),
    (dict(swiglu_limit=-1.0), "'swiglu_limit' must be None or a finite positive number, got -1.0"),
    (dict(swiglu_limit=float("nan")), "'swiglu_limit' must be None or a finite positive number, got nan"),
])
def test_sizes_the_fused_kernel_cannot_take_are_refused_at_construction(kwargs, message):
    args = dict(hidden=128, intermediate=128, num_experts=8, top_k=2, device="meta")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        mok.MoE(**args)
    if "precision" not in kwargs and "hidden" in kwargs:  # (the torch backend takes any size)
        mok.MoE(**dict(args, backend="torch", dtype=torch.float32))


@pytest.mark.parametrize("backend", ["torch", "mok"])
def test_forward_refuses_routing_that_does_not_fit_x(backend):
    """forward reshapes x [..., H] to [T, H]: without these checks a routing of another layout
    (e.g. [S, B, k] for x [B, S, H]) or an x of the wrong width was silently taken as tokens."""
    device = "cpu" if backend == "torch" else "meta"
    layer = mok.MoE(64, 64, 4, 2, router=None, backend=backend, device=device)
    x = torch.zeros(2, 3, 64, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(2, 3, 2, dtype=torch.int32, device=device)
    w = torch.full((2, 3, 2), 0.5, device=device)
    assert layer(x, ids, w).shape == x.shape
    assert layer(x, ids.reshape(6, 2), w.reshape(6, 2)).shape == x.shape  # (the flattened tokens' routing)
    with pytest.raises(ValueError, match=r"'topk_ids' must be \[2, 3, 2\] or \[6, 2\] .* got shape \(3, 2, 2\)"):
        layer(x, ids.transpose(0, 1), w.transpose(0, 1))
    with pytest.raises(ValueError, match=r"'topk_weights' must be .* got shape \(2, 3, 1\)"):
        layer(x, ids, w[..., :1])
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., hidden = 64\], got shape \(5, 128\)"):
        layer(torch.zeros(5, 128, dtype=torch.bfloat16, device=device))


def test_aux_loss_is_none_after_a_call_with_the_routing_given():
    layer = mok.MoE(64, 64, 4, 2, backend="torch", load_balancing=True)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    layer(x)
    assert layer.aux_loss is not None
    ids, w, _ = layer.route(x)
    layer(x, ids, w)
    assert layer.aux_loss is None  # (it was the previous call's loss, whose graph may be freed)


def test_saved_length_in_python_is_the_cpp_one():
    """mok.ops._saved_length (the fake implementations' formula of a symbolic T) gives
    mok::saved_elements' length for every shape and token count tried: one GPU and EP ranks,
    with and without a shared expert, T from 0 past a tile boundary, and EP ranks' capacity
    factors (mok.ep.ExpertParallel's: multiples of 1/64, below and above the worst case)."""
    from mok import _C, ops

    for H, I, E, E_l, k, I_s in ((64, 64, 4, 4, 2, 0), (128, 192, 8, 2, 3, 64), (7168, 2048, 256, 32, 8, 2048),
                                 (2048, 768, 128, 128, 8, 0), (4096, 14336, 8, 8, 2, 0), (512, 256, 64, 1, 6, 128)):
        for T in (0, 1, 5, 127, 128, 129, 1000, 8192, 16385):
            for factor in (0.0, 1 / 64, 0.5, 1.0, 1.25, 1.984375, 2.0, 3.0, 64.0):
                want = _C.ep_saved_elements(H, I, E, E_l, k, I_s, None, T, factor)
                got = ops._saved_length(T, H, I, E, E_l, k, I_s, factor)
                assert got == want, (H, I, E, E_l, k, I_s, T, factor)
            # (a factor caps the rows below the worst case only where W > 1 and it is below W)
            assert _C.ep_saved_elements(H, I, E, E_l, k, I_s, None, T, 1.0) <= _C.ep_saved_elements(
                H, I, E, E_l, k, I_s, None, T)


def test_training_under_dynamic_shapes_compiles_once_for_every_token_count():
    """A training call with a dynamic token count traces without specialising T (the saved
    tensor's length a formula of T): 19 token counts, two compilations (the first static, then
    one dynamic), fullgraph. On meta tensors (the fake implementations)."""
    H, I, E, k = 64, 64, 4, 2
    gate = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    down = torch.empty(E, H, I, dtype=torch.bfloat16, device="meta", requires_grad=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer = torch.compile(lambda x, ids, w: mok.moe(x, ids, w, gate, None, down), backend=backend, fullgraph=True)
    for T in range(100, 2000, 100):
        x = torch.empty(T, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
        y = layer(x, torch.empty(T, k, dtype=torch.int64, device="meta"), torch.empty(T, k, device="meta"))
        assert y.shape == (T, H)
    assert len(graphs) == 2
