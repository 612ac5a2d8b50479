"""mok.moe(..., precision="fp8"): the FP8 forward against mok.fp8.moe_reference (the recipe's
oracle in PyTorch) on a Hopper GPU, bitwise equal with and without pre-quantized weights,
across calls, under torch.compile and in a CUDA graph; training steps with the bf16 and the
FP8 dgrad; and the argument errors (no GPU)."""

import pytest
import torch

import mok
from mok import fp8

hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def _problem(T, H, I, E, k, Is, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    bf = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(torch.bfloat16).to(device)  # noqa: E731
    x, w_gate, w_up, w_down = bf(T, H), bf(E, I, H, s=H ** -0.5), bf(E, I, H, s=H ** -0.5), bf(E, H, I, s=I ** -0.5)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    if T > 3:
        ids[3, k - 1] = -1  # a slot routed nowhere
    weights = torch.rand(T, k, generator=g)
    shared = (bf(Is, H, s=H ** -0.5), bf(Is, H, s=H ** -0.5), bf(H, Is, s=Is ** -0.5)) if Is else None
    return x, ids.to(device), weights.to(device), w_gate, w_up, w_down, shared


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("concatenated,shared,limit", [(False, False, None), (True, True, 7.0)])
def test_fp8_forward_matches_the_recipe_oracle(concatenated, shared, limit):
    x, ids, weights, w_gate, w_up, w_down, sh = _problem(700, 512, 256, 8, 2, 256 if shared else 0, seed=5)
    want = fp8.moe_reference(x, ids, weights, w_gate, w_up, w_down, sh, limit)
    gate = torch.cat([w_gate, w_up], dim=1) if concatenated else w_gate
    up = None if concatenated else w_up
    with torch.no_grad():
        y = mok.moe(x, ids, weights, gate, up, w_down, shared=sh, swiglu_limit=limit, precision="fp8")
        experts = fp8.quantize_experts(gate, up, w_down)
        y_given = mok.moe(x, ids, weights, gate, up, w_down, shared=sh, swiglu_limit=limit, precision="fp8",
                          fp8_experts=experts)
        y_again = mok.moe(x, ids, weights, gate, up, w_down, shared=sh, swiglu_limit=limit, precision="fp8")
    mok.check()
    assert torch.isfinite(y).all()
    assert _rel(y, want) < 1e-2  # the recipe's operands, other sums (tests/test_gpu_forward_fp8.cpp: kVsRecipe)
    assert torch.equal(y, y_given) and torch.equal(y, y_again)
    exact = mok.moe(x, ids, weights, gate, up, w_down, shared=sh, swiglu_limit=limit)
    assert 1e-3 < _rel(y, exact) < 0.1  # FP8's error against the bf16 layer, not none


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_fp8_training_step_gives_the_same_bits_on_fewer_sms():
    """mok.set_compute_sms(n): the FP8 forward, the FP8 dgrad and the FP8 weight gradients (the
    defaults with quantize_experts(..., dgrad=True)) on n CTAs give every SM's bits."""
    x, ids, weights, w_gate, w_up, w_down, sh = _problem(600, 384, 384, 8, 2, 128, seed=23)
    experts = fp8.quantize_experts(w_gate, w_up, w_down, dgrad=True)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count

    def step():
        leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w_gate, w_up, w_down, *sh)]
        y = mok.moe(leaves[0], ids, *leaves[1:5], shared=tuple(leaves[5:]), precision="fp8", fp8_experts=experts)
        return [y.detach()] + list(torch.autograd.grad((y.float() ** 2).sum(), leaves))

    every = step()
    try:
        for n in (5, sms // 2):
            mok.set_compute_sms(n)
            for i, (a, b) in enumerate(zip(every, step())):
                assert torch.equal(a, b), f"compute_sms {n}: output {i} differs"
    finally:
        mok.set_compute_sms(0)
    mok.check()


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("concatenated", [False, True])
def test_fp8_training_step_uses_the_bf16_backward(concatenated):
    """Autograd through mok.moe(precision="fp8"): the FP8 forward saves its pre-activations and
    the bf16 backward computes every gradient; they are FP8's distance from the bf16 layer's
    (close, not equal), the same bits eagerly and under torch.compile, and the same with and
    without pre-quantized weights."""
    x, ids, weights, w_gate, w_up, w_down, sh = _problem(500, 256, 256, 8, 2, 128, seed=10)
    gate = torch.cat([w_gate, w_up], dim=1) if concatenated else w_gate
    up = None if concatenated else w_up
    dy = torch.randn_like(x)

    def grads(precision, compiled=False, **kw):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate, w_down, *sh)]
        up_leaf = None if up is None else up.detach().clone().requires_grad_()
        fn = lambda *a: mok.moe(*a, precision=precision, **kw)  # noqa: E731
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        y = fn(leaves[0], ids, leaves[1], leaves[2], up_leaf, leaves[3], tuple(leaves[4:]))
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves] + ([] if up_leaf is None else [up_leaf.grad])

    fp8_grads = grads("fp8")
    bf16_grads = grads("bf16")
    mok.check()
    shared = {5, 6, 7}  # the shared expert's gradients: it stays bf16, its inputs are the same
    for i, (a, b) in enumerate(zip(fp8_grads, bf16_grads)):
        assert torch.isfinite(a.float()).all()
        if i in shared:
            assert torch.equal(a, b)
            continue
        cos = float((a.float() * b.float()).sum() / (a.float().norm() * b.float().norm()))
        assert cos > 0.99 and _rel(a, b) > 1e-4  # FP8's error, not none
    experts = fp8.quantize_experts(gate, up, w_down)
    for other in (grads("fp8", compiled=True), grads("fp8", fp8_experts=experts)):
        for a, b in zip(fp8_grads, other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("concatenated", [False, True])
def test_fp8_training_step_with_the_fp8_dgrad(concatenated):
    """quantize_experts(..., dgrad=True): the backward's dgrad GEMMs in E4M3. Against the same
    FP8 forward with the bf16 dgrad: y, d_w_down and the shared expert's weight gradients (bf16
    GEMMs of dy with h or x) the same bits, the gradients downstream of dh (dx, d_topk_weights,
    d_w_gate, d_w_up) close but not equal (dy and dgate|dup in E4M3); the same bits again, and
    under torch.compile."""
    x, ids, weights, w_gate, w_up, w_down, sh = _problem(600, 384, 384, 8, 2, 128, seed=11)
    gate = torch.cat([w_gate, w_up], dim=1) if concatenated else w_gate
    up = None if concatenated else w_up
    dy = torch.randn_like(x)
    with_dgrad = fp8.quantize_experts(gate, up, w_down, dgrad=True)
    without = fp8.quantize_experts(gate, up, w_down)
    assert without.dgrad() is None and len(with_dgrad.dgrad()) == 4
    assert with_dgrad.down_t.shape == (8, 384, 384) and with_dgrad.gate_up_t.shape == (8, 384, 768)
    assert with_dgrad.gate_up_t_exponents.shape == (8, 3, 6)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731  (the same blocks, transposed: the same bytes)
    t = lambda v: v.transpose(1, 2)  # noqa: E731
    assert torch.equal(u8(with_dgrad.down_t), t(u8(with_dgrad.down)))
    assert torch.equal(with_dgrad.down_t_exponents, t(with_dgrad.down_exponents))
    assert torch.equal(u8(with_dgrad.gate_up_t), torch.cat([t(u8(with_dgrad.gate)), t(u8(with_dgrad.up))], dim=2))
    assert torch.equal(with_dgrad.gate_up_t_exponents,
                       torch.cat([t(with_dgrad.gate_exponents), t(with_dgrad.up_exponents)], dim=2))
    for name in ("gate", "up", "down"):  # (W and W^T from one kernel: W's bytes as W's alone)
        assert torch.equal(u8(getattr(with_dgrad, name)), u8(getattr(without, name))), name
        assert torch.equal(getattr(with_dgrad, name + "_exponents"), getattr(without, name + "_exponents")), name

    def grads(experts, compiled=False):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate, w_down, *sh)]
        up_leaf = None if up is None else up.detach().clone().requires_grad_()
        fn = lambda *a: mok.moe(*a, precision="fp8", fp8_experts=experts)  # noqa: E731
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        mok.set_fp8_weight_gradients(False)  # (the dgrad alone: bf16 weight gradients on both sides)
        try:
            y = fn(leaves[0], ids, leaves[1], leaves[2], up_leaf, leaves[3], tuple(leaves[4:]))
            y.backward(dy)
        finally:
            mok.set_fp8_weight_gradients(True)
        return [y.detach()] + [t.grad for t in leaves] + ([] if up_leaf is None else [up_leaf.grad])

    fp8_dgrad = grads(with_dgrad)
    bf16_dgrad = grads(without)
    mok.check()
    for i, (a, b) in enumerate(zip(fp8_dgrad, bf16_dgrad)):
        assert torch.isfinite(a.float()).all()
        if i in (0, 4, 5, 6, 7):  # y; d_w_down (h^T dy: no dgrad in it); the shared expert's weight gradients
            assert torch.equal(a, b), i
            continue
        cos = float((a.float() * b.float()).sum() / (a.float().norm() * b.float().norm()))
        assert cos > 0.995 and _rel(a, b) > 1e-5, (i, cos)  # E4M3 dgrad's error, not none
    for other in (grads(with_dgrad), grads(with_dgrad, compiled=True)):
        for a, b in zip(fp8_dgrad, other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_fp8_weight_gradients_setting():
    """mok.set_fp8_weight_gradients(True), the default, with the FP8 dgrad: the routed weight
    gradients' GEMMs in E4M3 too. Against the FP8 dgrad with bf16 weight gradients: y, dx, d_topk_weights and the
    shared expert's weight gradients the same bits (the routed weight gradients feed nothing
    else), the routed weight gradients close but not equal; the same bits again, and under
    torch.compile."""
    x, ids, weights, w_gate, w_up, w_down, sh = _problem(600, 384, 384, 8, 2, 128, seed=12)
    dy = torch.randn_like(x)
    experts = fp8.quantize_experts(w_gate, w_up, w_down, dgrad=True)

    def grads(wgrad, compiled=False):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w_gate, w_up, w_down, *sh)]
        fn = lambda *a: mok.moe(*a, precision="fp8", fp8_experts=experts)  # noqa: E731
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        mok.set_fp8_weight_gradients(wgrad)
        try:
            y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3], leaves[4], tuple(leaves[5:]))
            y.backward(dy)
        finally:
            mok.set_fp8_weight_gradients(True)  # (the default)
        return [y.detach()] + [t.grad for t in leaves]

    fp8_wgrad = grads(True)
    bf16_wgrad = grads(False)
    mok.check()
    for i, (a, b) in enumerate(zip(fp8_wgrad, bf16_wgrad)):
        assert torch.isfinite(a.float()).all()
        if i not in (3, 4, 5):  # y, dx, d_topk_weights, the shared expert's weight gradients
            assert torch.equal(a, b), i
            continue
        cos = float((a.float() * b.float()).sum() / (a.float().norm() * b.float().norm()))
        assert cos > 0.995 and _rel(a, b) > 1e-5, (i, cos)  # E4M3 operands' error, not none
    for other in (grads(True), grads(True, compiled=True)):
        for a, b in zip(fp8_wgrad, other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_module_keeps_the_dgrad_operands_where_they_pay():
    """mok.MoE(precision="fp8"): fp8_dgrad None quantizes the dgrad operands only where
    mok.fp8.dgrad_pays (I >= 1024); True or False decides; a training step runs either way."""
    torch.manual_seed(12)
    # (H = 384: a layer shape of its own; test_gpu_memory counts the workspaces of H = 256)
    x = torch.randn(200, 384, device="cuda").to(torch.bfloat16)
    for inter, choice, want in ((128, None, False), (128, True, True), (1536, None, True), (1536, False, False)):
        layer = mok.MoE(384, inter, 8, 2, precision="fp8", fp8_dgrad=choice, device="cuda")
        layer(x).float().square().sum().backward()
        assert (layer._fp8_cache.dgrad() is not None) == want, (inter, choice)
        assert all(torch.isfinite(p.grad.float()).all() for p in (layer.w_gate, layer.w_up, layer.w_down))
    mok.check()


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_fp8_forward_compiles_and_captures():
    x, ids, weights, w_gate, w_up, w_down, sh = _problem(300, 256, 256, 8, 2, 128, seed=6)
    experts = fp8.quantize_experts(w_gate, w_up, w_down)

    def layer(x, ids, weights):
        return mok.moe(x, ids, weights, w_gate, w_up, w_down, shared=sh, precision="fp8", fp8_experts=experts)

    with torch.no_grad():
        eager = layer(x, ids, weights)
        compiled = torch.compile(layer, fullgraph=True)(x, ids, weights)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured = layer(x, ids, weights)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
    mok.check()
    assert torch.equal(eager, compiled) and torch.equal(eager, captured)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("wgrad", [True, False])
def test_fp8_training_step_captured_and_replayed(wgrad):
    """An FP8 training step (the FP8 dgrad, FP8 or bf16 weight gradients, a shared expert)
    captured once in a CUDA graph and replayed with new data and routing: every gradient the
    bits of an eager step on the same inputs (nothing synchronises with the host; the scratch
    comes from the caching allocator inside the capture)."""
    x, ids, weights, w_gate, w_up, w_down, sh = _problem(400, 384, 384, 8, 2, 128, seed=21)
    experts = fp8.quantize_experts(w_gate, w_up, w_down, dgrad=True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w_gate, w_up, w_down, *sh)]
    dy = torch.randn_like(x)

    def step(ls):
        for t in ls:
            t.grad = None
        mok.moe(ls[0], ids, ls[1], ls[2], ls[3], ls[4], shared=tuple(ls[5:]), precision="fp8",
                fp8_experts=experts).backward(dy)

    mok.set_fp8_weight_gradients(wgrad)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(leaves)  # (the workspace is made outside the capture)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        for t in leaves:
            t.grad = None
        with torch.cuda.graph(graph):
            step(leaves)
        in_graph = [t.grad for t in leaves]
        nx, nids, nweights, *_ = _problem(400, 384, 384, 8, 2, 128, seed=22)
        with torch.no_grad():
            leaves[0].copy_(nx), leaves[1].copy_(nweights)
        ids.copy_(nids), dy.copy_(torch.randn_like(dy))
        graph.replay()
        replayed = [g.clone() for g in in_graph]
        eager = [t.detach().clone().requires_grad_() for t in leaves]
        step(eager)
    finally:
        mok.set_fp8_weight_gradients(True)  # (the default)
    mok.check()
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b.grad), i


def test_fp8_arguments_are_refused_before_the_gpu():
    x, ids, weights, w_gate, w_up, w_down, _ = _problem(8, 128, 128, 4, 2, 0, seed=7, device="meta")
    with pytest.raises(ValueError, match="precision must be 'bf16' or 'fp8', got 'fp16'"):
        mok.moe(x, ids, weights, w_gate, w_up, w_down, precision="fp16")
    with pytest.raises(ValueError, match="fp8_experts was given, but precision is 'bf16'"):
        mok.moe(x, ids, weights, w_gate, w_up, w_down, fp8_experts=object())
    with pytest.raises(TypeError, match="fp8_experts must be what mok.fp8.quantize_experts returns"):
        with torch.no_grad():
            mok.moe(x, ids, weights, w_gate, w_up, w_down, precision="fp8", fp8_experts=(1, 2))
    meta = lambda *shape, dtype=torch.float8_e4m3fn: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    forward = (meta(4, 128, 128), meta(4, 1, 1, dtype=torch.int32), meta(4, 128, 128), meta(4, 1, 1, dtype=torch.int32),
               meta(4, 128, 128), meta(4, 1, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="some of the dgrad operands but not down_t_exponents, gate_up_t, "
                                        "gate_up_t_exponents"):
        with torch.no_grad():
            mok.moe(x, ids, weights, w_gate, w_up, w_down, precision="fp8",
                    fp8_experts=fp8.Fp8Experts(*forward, down_t=meta(4, 128, 128)))
    with pytest.raises(TypeError, match="fp8_experts.down_t must be a torch.float8_e4m3fn"):
        with torch.no_grad():
            mok.moe(x, ids, weights, w_gate, w_up, w_down, precision="fp8",
                    fp8_experts=fp8.Fp8Experts(*forward, meta(4, 128, 128, dtype=torch.bfloat16),
                                               meta(4, 1, 1, dtype=torch.int32), meta(4, 128, 256),
                                               meta(4, 1, 2, dtype=torch.int32)))
    # (weights quantized from another layer: the fake implementations took them, the GPU refused)
    other = (meta(4, 256, 128), meta(4, 2, 1, dtype=torch.int32)) + forward[2:]
    with pytest.raises(ValueError, match=r"fp8_experts.gate shape must be \(4, 128, 128\) for w_down of shape "
                                         r"\(4, 128, 128\), got \(4, 256, 128\)"):
        with torch.no_grad():
            mok.moe(x, ids, weights, w_gate, w_up, w_down, precision="fp8", fp8_experts=fp8.Fp8Experts(*other))
    x2, ids2, weights2, g2, u2, d2, _ = _problem(8, 192, 128, 4, 2, 0, seed=8, device="meta")
    with pytest.raises(ValueError, match="multiples of 128 .* got H = 192, I = 128"):
        with torch.no_grad():
            mok.moe(x2, ids2, weights2, g2, u2, d2, precision="fp8")


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_module_keeps_quantized_weights_until_a_weight_changes():
    torch.manual_seed(9)
    layer = mok.MoE(256, 128, 8, 2, shared_intermediate=128, fused_gate_up=True, precision="fp8", device="cuda")
    x = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    kept = layer._fp8_cache  # (made with the weights, empty until the first call)
    assert kept is not None and kept.dgrad() is None  # (I = 128: dgrad_pays says no)
    with torch.no_grad():
        y = layer(x)
        from mok import fp8_layer

        held = fp8_layer._held[id(kept.gate)]  # (the init copy, filled in place)
        down, down_exponents = kept.down.clone(), kept.down_exponents.clone()
        assert torch.equal(layer(x), y) and layer._fp8_cache is kept and fp8_layer._held[id(kept.gate)] is held
        ids, weights, _ = layer.route(x)
        want = mok.moe(x, ids, weights, layer.w_gate_up, None, layer.w_down, shared=tuple(layer.shared),
                       precision="fp8")
        assert torch.equal(y, want)
        # An optimizer step or load_state_dict: the version counter moves. (Not a power of two: 0.5
        # would leave every E4M3 byte as it was and move only the blocks' exponents.)
        layer.w_down.mul_(1.5)
        y2 = layer(x)
        # Quantized again into a new copy (eagerly: a backward pending from the first call keeps its own)
        again = layer._fp8_cache
        assert again is not kept and torch.equal(kept.down.view(torch.uint8), down.view(torch.uint8))
        assert torch.equal(kept.down_exponents, down_exponents)
        assert not torch.equal(again.down.view(torch.uint8), down.view(torch.uint8))
        want2 = mok.moe(x, ids, weights, layer.w_gate_up, None, layer.w_down, shared=tuple(layer.shared),
                        precision="fp8")
        assert torch.equal(y2, want2) and not torch.equal(y2, y)
    mok.check()
    # A fused AdamW step (its CUDA kernel does not move the weights' version counters): the
    # next forward reads the updated weights, not the old quantized copy.
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    layer.train()
    layer(x).float().square().mean().backward()
    opt.step()
    with torch.no_grad():
        y3 = layer(x)
        ids, weights, _ = layer.route(x)
        want3 = mok.moe(x, ids, weights, layer.w_gate_up, None, layer.w_down, shared=tuple(layer.shared),
                        precision="fp8")
    assert torch.equal(y3, want3) and not torch.equal(y3, y2)
    mok.check()


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_module_in_a_cuda_graph_quantizes_the_weights_of_each_replay():
    """mok.MoE(precision="fp8") captured in a CUDA graph while its cache holds the quantized
    weights: the capture quantizes them again, so a replay after an in-place update (an
    optimizer step) reads the new weights — the bits of an eager call after the same update."""
    torch.manual_seed(12)
    layer = mok.MoE(256, 128, 8, 2, shared_intermediate=128, fused_gate_up=True, precision="fp8", device="cuda")
    x = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        before = layer(x)  # eager: the cache now holds the weights' quantized copy
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        graph.replay()
        assert torch.equal(out, before)
        layer.w_down.mul_(0.5)
        layer.w_gate_up.mul_(1.5)
        graph.replay()
        replayed = out.clone()
        eager = layer(x)
    mok.check()
    assert torch.equal(replayed, eager) and not torch.equal(replayed, before)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_module_under_torch_compile_keeps_its_quantized_weights(monkeypatch):
    """mok.MoE(precision="fp8") under torch.compile(fullgraph=True): the copy the module made
    with its weights is quantized once per optimizer step (two micro-batches a step: once, not
    twice), and every step's outputs and gradients are the bits of the same module's eager
    steps — the FP8 dgrad and weight gradients included (I = 1024: dgrad_pays). Before
    2026-12-05 the compiled module quantized the forward's weights in every call and ran the
    dgrad in bf16."""
    from mok import fp8_layer

    made = []
    quantize_into = fp8_layer._quantize_into
    monkeypatch.setattr(fp8_layer, "_quantize_into", lambda *args: made.append(1) or quantize_into(*args))
    torch.manual_seed(14)
    H, I, E, k, T = 256, 1024, 8, 2, 300
    modules = [mok.MoE(H, I, E, k, router=None, precision="fp8", device="cuda") for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    assert all(m._fp8_cache is not None and m._fp8_cache.dgrad() is not None for m in modules)
    calls = (modules[0], torch.compile(modules[1], fullgraph=True))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in modules]
    for step in range(3):
        for micro in range(2):
            x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
            w = torch.rand(T, k, device="cuda")
            dy = torch.randn_like(x)
            got = []
            for call in calls:
                xx = x.clone().requires_grad_()
                y = call(xx, ids, w)
                y.backward(dy)
                got.append([y, xx.grad])
            for i, (a, b) in enumerate(zip(*got)):
                assert torch.equal(a, b), (step, micro, i)
        for name in ("w_gate", "w_up", "w_down"):
            assert torch.equal(getattr(modules[0], name).grad, getattr(modules[1], name).grad), (step, name)
        assert len(made) == 2 * (step + 1)  # (one quantization a module a step)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    mok.check()


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("train", [False, True])
def test_module_under_reduce_overhead_compile_reads_the_weights_of_each_replay(train):
    """torch.compile(mode="reduce-overhead"): the graphs are captured (no cudagraph skip), each
    replay quantizes the weights it finds — the bits of an eager twin module (same weights, the
    same in-place updates) in the forward and, training, in every gradient (the FP8 dgrad:
    I = 1024) — and writes the module's own copy, a static input as the weights are (its bytes
    the twin's at the end; a private copy in the graph's memory would give the same outputs and
    leave it stale). The copy moves with the module (.cpu() drops it, .cuda() makes it again)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(15)
    inter = 1024 if train else 128
    layer, twin = (mok.MoE(256, inter, 8, 2, router=None, precision="fp8", device="cuda") for _ in range(2))
    twin.load_state_dict(layer.state_dict())
    assert layer.cpu()._fp8_cache is None and layer.cuda()._fp8_cache.gate.is_cuda
    x = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    ids = torch.rand(300, 8, device="cuda").argsort(dim=1)[:, :2].to(torch.int32)
    w = torch.rand(300, 2, device="cuda")
    dy = torch.randn_like(x)
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for i in range(5):
        if i >= 3:  # (an optimizer step's in-place update between replays, on both modules)
            with torch.no_grad():
                for m in (layer, twin):
                    m.w_down.mul_(0.5)
                    m.w_gate.mul_(1.5)
        got, want = [], []
        for call, out in ((compiled, got), (twin, want)):
            if not train:
                with torch.no_grad():
                    out.append(call(x, ids, w).clone())
                continue
            module = layer if call is compiled else twin
            xx = x.clone().requires_grad_()
            y = call(xx, ids, w)
            y.backward(dy)
            out += [y.detach().clone(), xx.grad.clone()] + [getattr(module, n).grad.clone()
                                                           for n in ("w_gate", "w_up", "w_down")]
            for p in module.parameters():
                p.grad = None
        for j, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (i, j)
    mok.check()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    # The replays wrote the module's own copy (a static input), not a private one inside the graph's
    # memory — which would give the same outputs, each replay quantizing again, but leave this copy
    # stale after the updates: it holds the bytes the eager twin made from the current weights.
    for j, (a, b) in enumerate(zip(layer._fp8_cache, twin._fp8_cache)):
        if a is not None:
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), j


def test_module_precision_arguments():
    with pytest.raises(ValueError, match="'precision' must be 'bf16' or 'fp8', got 'int8'"):
        mok.MoE(128, 128, 4, 2, precision="int8", device="meta")
    with pytest.raises(ValueError, match=r"precision=.fp8. runs on the fused kernel \(backend=.mok.\)"):
        mok.MoE(128, 128, 4, 2, precision="fp8", backend="torch", device="meta")
    with pytest.raises(ValueError, match="'fp8_dgrad' must be None, True or False with precision='fp8', got "
                                         "fp8_dgrad=True with precision='bf16'"):
        mok.MoE(128, 128, 4, 2, fp8_dgrad=True, device="meta")
    with pytest.raises(ValueError, match="got fp8_dgrad=1 with precision='fp8'"):
        mok.MoE(128, 128, 4, 2, precision="fp8", fp8_dgrad=1, device="meta")
    layer = mok.MoE(128, 128, 4, 2, precision="fp8", device="meta")
    assert layer._fp8_cache is None  # (meta weights: no copy)
    with pytest.raises(ValueError, match="got fp8_dgrad='yes' with precision='fp8'"):
        layer.fp8_dgrad = "yes"
    layer.fp8_dgrad = True
    assert layer.fp8_dgrad is True and layer._fp8_dgrad()


def test_fp8_module_pickles_and_copies(monkeypatch):
    """torch.save of a whole mok.MoE(precision="fp8") holding a filled copy (its load_state_dict
    post-hook included) and copy.deepcopy keep its settings and leave the copy behind (it is made
    again from the weights); the load hook still runs on the copy. (The quantization stubbed: a
    copy on the CPU.)"""
    import copy
    import io

    from mok import fp8_layer

    _stub_quantization(monkeypatch)
    layer = mok.MoE(128, 128, 4, 2, precision="fp8", fp8_dgrad=True)
    fp8_layer.cached_experts(layer, layer.w_gate, layer.w_up, layer.w_down, dgrad=True)
    assert layer._fp8_cache is not None
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(layer)):
        assert isinstance(other, mok.MoE) and other.precision == "fp8" and other.fp8_dgrad is True
        assert other._fp8_cache is None  # (CPU weights: none made again)
        other.load_state_dict(layer.state_dict())
    assert layer._fp8_cache is not None


def test_cached_experts_know_views_and_inference_tensors(monkeypatch):
    """A view made anew each call of a lasting tensor (DTensor.to_local(), a slice) is that
    tensor's weight: kept while it is unchanged, quantized again after an in-place update (the
    version counter views share). Inference tensors, which have no version counter, are kept
    until mok.fp8.weights_changed()."""
    from mok import fp8_layer

    made = _stub_quantization(monkeypatch)
    owner = type("Owner", (), {})()
    gate, down = torch.zeros(2, 256, 128), torch.zeros(2, 128, 128)
    for _ in range(3):
        fp8_layer.cached_experts(owner, gate.view(gate.shape), None, down[:])
    assert len(made) == 1
    down.add_(1.0)
    fp8_layer.cached_experts(owner, gate.view(gate.shape), None, down[:])
    assert len(made) == 2
    fp8_layer.cached_experts(owner, gate.view(gate.shape), None, down[:, :64])  # (another view: another weight)
    assert len(made) == 3
    with torch.inference_mode():
        frozen = torch.zeros(2, 128, 128)
    other = type("Owner", (), {})()
    for _ in range(2):
        fp8_layer.cached_experts(other, gate, None, frozen)
    assert len(made) == 4
    mok.fp8.weights_changed()
    fp8_layer.cached_experts(other, gate, None, frozen)
    assert len(made) == 5


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_module_keeps_a_copy_for_its_current_weights():
    """The (empty) kept copy follows the module: fp8_dgrad set after construction, and
    load_state_dict(assign=True) into a module made on the meta device, both make the copy a
    first compiled call will use."""
    layer = mok.MoE(256, 128, 8, 2, precision="fp8", device="cuda")
    first = layer._fp8_cache
    assert first is not None and first.dgrad() is None
    layer.fp8_dgrad = True
    assert layer._fp8_cache is not first and layer._fp8_cache.dgrad() is not None
    meta = mok.MoE(256, 128, 8, 2, precision="fp8", device="meta")
    assert meta._fp8_cache is None
    meta.load_state_dict(layer.state_dict(), assign=True)
    assert meta._fp8_cache is not None and meta._fp8_cache.gate.is_cuda and meta._fp8_cache.dgrad() is None


def test_dgrad_pays_where_it_was_measured_faster():
    down = lambda inter: torch.empty(2, 256, inter, device="meta")  # noqa: E731
    sizes = (512, 768, 1024, 1536, 2048, 14336)
    assert [fp8.dgrad_pays(down(i)) for i in sizes] == [False, False, True, True, True, True]


@pytest.mark.parametrize("first", ["mok.fp8", "mok.fp8_layer"])
def test_fp8_modules_import_in_either_order(first):
    """mok.fp8 re-exports the layer's quantize_experts; mok.moe(precision="fp8") imports the
    layer first: either order must work in a fresh interpreter (a circular import did not)."""
    import subprocess
    import sys

    code = f"import {first}, mok.fp8, mok.fp8_layer; assert mok.fp8.quantize_experts is mok.fp8_layer.quantize_experts"
    subprocess.run([sys.executable, "-c", code], check=True)


def _stub_quantization(monkeypatch):
    """cached_experts on the CPU: the weights' checks and the quantization kernels stubbed (the
    copy's gate exponents get the weights' sum, so what a compiled graph reads shows which
    weights it holds); returns the list of quantizations made."""
    from mok import fp8_layer

    made = []

    def quantize_into(w_gate, w_up, w_down, experts):
        made.append(experts.dgrad() is not None)
        experts.gate_exponents.data.fill_(int(w_gate.sum() + w_down.sum()))  # (.data: as a kernel, no version moves)

    monkeypatch.setattr(fp8_layer, "_quantize_into", quantize_into)
    monkeypatch.setattr(fp8_layer, "_check_experts_weights", lambda *args, **kwargs: None)
    return made


def test_cached_experts_are_made_again_only_when_a_weight_changes(monkeypatch):
    """mok.fp8_layer.cached_experts (mok.MoE's and mok.hf's copy), eagerly, on the CPU with the
    quantization stubbed: kept while the weights are unchanged; after an in-place update (version
    counter), a new storage or other weight tensors, quantized into a new copy — the old one,
    which a pending backward may have saved, keeps its bytes; an empty copy made beforehand (as
    mok.MoE makes one) is filled in place; the dgrad operands asked for make a new copy."""
    from mok import fp8_layer

    made = _stub_quantization(monkeypatch)
    owner = type("Owner", (), {})()
    gate, down = torch.zeros(2, 256, 128), torch.zeros(2, 128, 128)
    owner._fp8_cache = empty = fp8_layer.new_cached_experts(gate, None, down, False)
    kept = fp8_layer.cached_experts(owner, gate, None, down)
    assert kept is empty and kept.dgrad() is None and len(made) == 1  # I = 128: dgrad_pays says no
    assert kept.gate.shape == (2, 128, 128) and kept.down_exponents.shape == (2, 1, 1)
    assert fp8_layer.cached_experts(owner, gate, None, down) is kept and len(made) == 1
    down.add_(1.0)  # in place: the version counter moves
    again = fp8_layer.cached_experts(owner, gate, None, down)
    assert again is not kept and owner._fp8_cache is again and len(made) == 2
    assert int(again.gate_exponents[0, 0, 0]) == 2 * 128 * 128 and int(kept.gate_exponents[0, 0, 0]) == 0
    gate = gate.clone()  # a new storage
    assert fp8_layer.cached_experts(owner, gate, None, down) is not again and len(made) == 3
    kept = owner._fp8_cache
    with_dgrad = fp8_layer.cached_experts(owner, gate, None, down, dgrad=True)
    assert with_dgrad is not kept and with_dgrad.gate_up_t.shape == (2, 128, 256) and made[-1] is True
    assert fp8_layer.cached_experts(owner, gate, None, down, dgrad=True) is with_dgrad and len(made) == 4


def test_cached_experts_never_trust_a_temporary(monkeypatch):
    """Weights that are new tensors each call (an autocast cast, a weight changed inside a
    compiled graph) are quantized every call, even when the allocator hands a new one the old
    one's address and version counter: what the copy holds is the tensor objects themselves."""
    from mok import fp8_layer

    made = _stub_quantization(monkeypatch)
    owner = type("Owner", (), {})()
    gate, down = torch.zeros(2, 256, 128), torch.zeros(2, 128, 128)
    addresses = set()
    for i in range(3):
        cast = down + float(i)  # (a temporary of the same shape: the CPU allocator may reuse its address)
        addresses.add(cast.data_ptr())
        experts = fp8_layer.cached_experts(owner, gate, None, cast)
        assert len(made) == i + 1 and int(experts.gate_exponents[0, 0, 0]) == i * 2 * 128 * 128
        del cast, experts
    print("addresses of the temporaries:", len(addresses))


@pytest.mark.parametrize("optimizer", ["fused", "foreach", "for-loop", "sgd"])
def test_cached_experts_are_made_again_after_every_optimizer_step(monkeypatch, optimizer):
    """A fused AdamW updates the weights without moving their version counters (checked here,
    so a PyTorch that starts moving them still runs the test's point): the copy must be made
    again after any torch.optim step anyway, and after mok.fp8.weights_changed() (writes
    through .data), and kept between steps (gradient accumulation)."""
    from mok import fp8_layer

    made = _stub_quantization(monkeypatch)
    owner = type("Owner", (), {})()
    gate, down = torch.nn.Parameter(torch.zeros(2, 256, 128)), torch.nn.Parameter(torch.zeros(2, 128, 128))
    kind = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}
    opt = (torch.optim.SGD([gate, down], lr=0.1) if optimizer == "sgd"
           else torch.optim.AdamW([gate, down], lr=0.1, **kind[optimizer]))
    fp8_layer.cached_experts(owner, gate, None, down)
    fp8_layer.cached_experts(owner, gate, None, down)
    assert len(made) == 1  # kept: nothing changed
    gate.grad, down.grad = torch.ones_like(gate), torch.ones_like(down)
    versions = (gate._version, down._version)
    opt.step()
    assert not torch.equal(gate.detach(), torch.zeros_like(gate))  # the step changed the weights
    if optimizer == "fused":
        print("fused AdamW moved the version counters:", versions != (gate._version, down._version))
    fp8_layer.cached_experts(owner, gate, None, down)
    fp8_layer.cached_experts(owner, gate, None, down)
    assert len(made) == 2
    down.data.add_(1.0)  # (.data: no version counter moves)
    mok.fp8.weights_changed()
    fp8_layer.cached_experts(owner, gate, None, down)
    assert len(made) == 3


def test_cached_experts_are_made_inside_a_graph_capture_and_not_kept(monkeypatch):
    """While a CUDA graph is captured the quantization is made in the capture (so each replay
    reads the weights as they are) and not kept: a copy from before the capture would be
    replayed stale after an optimizer step, and one made inside lives in the graph's memory."""
    from mok import fp8_layer

    made = _stub_quantization(monkeypatch)
    captured = []
    monkeypatch.setattr(fp8_layer, "quantize_experts", lambda g, u, d, dgrad=False: captured.append(1) or len(captured))
    owner = type("Owner", (), {})()
    gate, down = torch.zeros(2, 256, 128), torch.zeros(2, 128, 128)
    kept = fp8_layer.cached_experts(owner, gate, None, down)
    assert len(made) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fp8_layer.cached_experts(owner, gate, None, down) == 1  # made again although nothing changed
    assert fp8_layer.cached_experts(owner, gate, None, down) == 2
    assert owner._fp8_cache is kept and len(made) == 1  # the copy from before, untouched


def test_cached_experts_under_torch_compile_are_quantized_again_in_place(monkeypatch):
    """Under torch.compile(fullgraph=True) a kept copy is the graph's input and
    mok::fp8_refresh_experts writes it in place: quantized again only when a weight changed
    (the version counter, an optimizer step), read with the new values by the same compiled
    graph, no recompilation for another owner of the same shapes; without a kept copy the
    compiled call gets None (the layer then quantizes the forward's weights itself). On the
    CPU with the quantization stubbed."""
    from mok import fp8_layer

    made = _stub_quantization(monkeypatch)
    owners = [torch.nn.Module() for _ in range(2)]
    for i, owner in enumerate(owners):
        owner.gate = torch.nn.Parameter(torch.full((2, 256, 128), float(i)))
        owner.down = torch.nn.Parameter(torch.zeros(2, 128, 128))

    def layer(owner, x):
        experts = fp8_layer.cached_experts(owner, owner.gate, None, owner.down)
        return x if experts is None else x + experts.gate_exponents.float().sum()

    compiled = torch.compile(layer, fullgraph=True)
    x = torch.zeros(4)
    assert torch.equal(compiled(owners[0], x), x) and made == []  # (nothing kept yet: None)
    for owner in owners:
        fp8_layer.cached_experts(owner, owner.gate, None, owner.down)  # (eager: made and kept)
    assert len(made) == 2
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    per_block = 2 * 256 * 128
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, owner in enumerate(owners):
            kept = owner._fp8_cache
            assert torch.equal(compiled(owner, x), x + 2 * i * per_block) and len(made) == 2 + i  # kept
            with torch.no_grad():
                owner.down.add_(1.0)  # the version counter moves
            want = x + 2 * (i * per_block + 2 * 128 * 128)
            assert torch.equal(compiled(owner, x), want) and len(made) == 3 + i and owner._fp8_cache is kept
            assert torch.equal(compiled(owner, x), want) and len(made) == 3 + i
        opt = torch.optim.SGD([owners[0].gate], lr=1.0)
        owners[0].gate.grad = torch.full_like(owners[0].gate, -1.0)
        opt.step()  # (the generation moves: both owners' copies are quantized again at their next call)
        assert torch.equal(compiled(owners[0], x), x + 2 * (per_block + 2 * 128 * 128)) and len(made) == 5
        compiled(owners[1], x)
        assert len(made) == 6


@torch.library.custom_op("mok_test::read_copy", mutates_args=())
def _read_copy(x: torch.Tensor, w: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """A stand-in layer: reads the kept copy's exponents and saves them for its backward (as
    the FP8 layer saves the dgrad operands)."""
    return x * (exponents.float().sum() + w.sum())


@_read_copy.register_fake
def _(x, w, exponents):
    return torch.empty_like(x)


def _read_copy_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _read_copy_backward(ctx, g):
    x, w, exponents = ctx.saved_tensors
    return g * (exponents.float().sum() + w.sum()), (g * x).sum() * torch.ones_like(w), None


_read_copy.register_autograd(_read_copy_backward, setup_context=_read_copy_setup)


@pytest.mark.parametrize("shape", ["twice", "checkpointed"])
def test_compiled_training_quantizes_once_a_step(monkeypatch, shape):
    """A compiled training forward that calls one module twice (weights shared across layers) or
    under non-reentrant activation checkpointing (its recompute calls it again in the backward):
    it compiles, matches the eager model, and quantizes once an optimizer step — no second
    quantization, no clone of the copy. On the CPU, quantization stubbed, a stand-in layer
    saving the copy for its backward."""
    from torch.utils.checkpoint import checkpoint

    from mok import fp8_layer

    made = _stub_quantization(monkeypatch)

    class Owner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Parameter(torch.full((2, 256, 128), 1e-3))
            self.down = torch.nn.Parameter(torch.full((2, 128, 128), 2e-3))
            self._fp8_cache = fp8_layer.new_cached_experts(self.gate, None, self.down, False)

        def forward(self, x):
            experts = fp8_layer.cached_experts(self, self.gate, None, self.down, dgrad=False)
            return torch.ops.mok_test.read_copy(x, self.down, experts.gate_exponents) + x * self.gate.sum()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = Owner()

        def forward(self, x):
            if shape == "twice":
                return self.moe(self.moe(x)).sum()
            return checkpoint(self.moe, x, use_reentrant=False).sum()

    torch._dynamo.reset()
    models = [Model(), Model()]
    compiled = torch.compile(models[0], fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-9) for m in models]
    for step in range(3):
        before = len(made)
        for call, model in ((compiled, models[0]), (models[1], models[1])):
            x = torch.full((4,), 0.5)
            call(x).backward()
        assert len(made) - before == 2, (step, len(made) - before)  # (one a model)
        torch.testing.assert_close(models[0].moe.down.grad, models[1].moe.down.grad, rtol=1e-5, atol=0)  # (sum order)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("grad", [False, True])
def test_compiled_refresh_writes_the_graph_inputs_themselves(monkeypatch, grad):
    """The code Inductor makes calls mok::fp8_refresh_experts on the kept copy's own tensors (the
    graph's inputs), with no clone of them and no copy back, in an inference graph and in a
    training one (a copy a call would cost as much as quantizing). On the CPU, quantization
    stubbed."""
    import re

    from torch._inductor.utils import run_and_get_code

    from mok import fp8_layer

    _stub_quantization(monkeypatch)
    owner = torch.nn.Module()
    owner.gate = torch.nn.Parameter(torch.ones(2, 256, 128))
    owner.down = torch.nn.Parameter(torch.zeros(2, 128, 128))
    fp8_layer.cached_experts(owner, owner.gate, None, owner.down)

    def layer(owner, x):
        experts = fp8_layer.cached_experts(owner, owner.gate, None, owner.down)
        return x * (owner.down.sum() + 1) + experts.gate_exponents.float().sum()

    torch._dynamo.reset()
    x = torch.ones(4, requires_grad=grad)
    _, codes = run_and_get_code(torch.compile(layer, fullgraph=True), owner, x)
    code = "\n".join(codes)
    calls = re.findall(r"torch\.ops\.mok\.fp8_refresh_experts\.default\(([^)]*)\)", code)
    assert len(calls) == 1, code
    inputs = [a.strip() for a in calls[0].split(",")]
    assert all(re.fullmatch(r"(arg|primals_)\d+(_\d+)?|None", a) for a in inputs), calls  # (graph inputs)
    assert ".clone(" not in code and "copy_(" not in code, code


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_quantize_experts_names_bad_weights():
    """quantize_experts(..., dgrad=True) refuses weights of the wrong dtype or device, naming
    them, and experts whose shapes disagree, before anything is written."""
    g = torch.randn(2, 256, 384, device="cuda").bfloat16()
    d = torch.randn(2, 384, 256, device="cuda").bfloat16()
    with pytest.raises(TypeError, match=r"^mok\.fp8\.quantize_experts: w_up must be a CUDA bfloat16 tensor"):
        fp8.quantize_experts(g, g.float(), d, dgrad=True)
    with pytest.raises(ValueError, match=r"^mok\.fp8\.quantize_experts: w_down must be a CUDA bfloat16 tensor"):
        fp8.quantize_experts(g, g, d.cpu(), dgrad=True)
    with pytest.raises(ValueError, match=r"^mok\.fp8\.quantize_experts: the experts' shapes disagree"):
        fp8.quantize_experts(g, g, d[:, :256], dgrad=True)
    with pytest.raises(ValueError, match=r"^mok\.fp8\.quantize_experts: the experts' shapes disagree"):
        fp8.quantize_experts(g, g[:, :128], d, dgrad=True)
    # (without the dgrad operands too: an Fp8Experts whose parts do not fit together is no use)
    with pytest.raises(ValueError, match=r"^mok\.fp8\.quantize_experts: the experts' shapes disagree"):
        fp8.quantize_experts(g, g, d[:, :256])
    with pytest.raises(ValueError, match=r"must have an even number of rows, got shape \(2, 257, 384\)"):
        fp8.quantize_experts(torch.randn(2, 257, 384, device="cuda").bfloat16(), None, d)
    # The extension's W-and-W^T entry: values_t and exponents_t together, never with transpose.
    from torch.utils.dlpack import to_dlpack

    from mok import _C

    v = torch.empty(2, 256, 384, dtype=torch.uint8, device="cuda")
    x = torch.empty(2, 2, 3, dtype=torch.int32, device="cuda")
    vt = torch.empty(2, 384, 256, dtype=torch.uint8, device="cuda")
    xt = torch.empty(2, 3, 2, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="values_t and exponents_t go together"):
        _C.fp8_quantize_weights(to_dlpack(g), to_dlpack(v), to_dlpack(x), stream, False, to_dlpack(vt))
    with pytest.raises(ValueError, match="values_t with transpose=True"):
        _C.fp8_quantize_weights(to_dlpack(g), to_dlpack(vt), to_dlpack(xt), stream, True, to_dlpack(vt), to_dlpack(xt))
    with pytest.raises(ValueError, match="argument 'values_t': shape must be \\[2, 384, 256\\]"):
        _C.fp8_quantize_weights(to_dlpack(g), to_dlpack(v), to_dlpack(x), stream, False, to_dlpack(v), to_dlpack(xt))
    square = torch.randn(2, 256, 256, device="cuda").bfloat16()  # (W^T has W's shape: only the overlap check is left)
    vs, xs = torch.empty(2, 256, 256, dtype=torch.uint8, device="cuda"), torch.empty(2, 2, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="argument 'values': must not overlap 'values_t'"):
        _C.fp8_quantize_weights(to_dlpack(square), to_dlpack(vs), to_dlpack(xs), stream, False, to_dlpack(vs), to_dlpack(xs))
