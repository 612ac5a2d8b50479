"""mok.moe on a Hopper GPU against the pure-PyTorch fp32 reference, under torch.compile and
CUDA-graph replay. Skipped without one."""

import pytest
import torch

import mok
from gpu_helpers import check_forward as _check
from gpu_helpers import leaf as _leaf
from gpu_helpers import needs_hopper
from gpu_helpers import problem as _problem
from torch_reference import moe_reference

pytestmark = needs_hopper


@pytest.mark.parametrize("shared,limit,padding", [(0, None, 0.0), (128, 0.75, 0.3)])
def test_matches_reference(shared, limit, padding):
    args = _problem(shared=shared, padding=padding)
    x, ids, w, gate, up, down, sh = args
    y = mok.moe(x, ids, w, gate, up, down, shared=sh, swiglu_limit=limit)
    _check(y, args, limit)


def test_int64_ids_and_bitwise_repeatable():
    x, ids, w, gate, up, down, _ = _problem(seed=2)
    y0 = mok.moe(x, ids, w, gate, up, down)
    y1 = mok.moe(x, ids.long(), w, gate, up, down)
    assert torch.equal(y0.view(torch.int16), y1.view(torch.int16))


def test_torch_compile_fullgraph():
    args = _problem(seed=3)
    x, ids, w, gate, up, down, _ = args
    compiled = torch.compile(lambda *a: mok.moe(*a) * 2, fullgraph=True)
    _check(compiled(x, ids, w, gate, up, down) / 2, args)


def test_cuda_graph_replay_with_new_routing():
    args = _problem(seed=4)
    x, ids, w, gate, up, down, _ = args
    mok.moe(x, ids, w, gate, up, down)  # allocates the workspace outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mok.moe(x, ids, w, gate, up, down)
    nx, nids, nw, *_ = _problem(seed=5)
    x.copy_(nx), ids.copy_(nids), w.copy_(nw)
    graph.replay()
    _check(y, (x, ids, w, gate, up, down, None))


def test_bad_expert_id_raises_at_check():
    x, ids, w, gate, up, down, _ = _problem(seed=6)
    ids[3, 1] = 8
    y = mok.moe(x, ids, w, gate, up, down)
    with pytest.raises(ValueError, match="got 8 at rank 0, token 3, slot 1"):
        mok.check()
    assert torch.isnan(y.float()).all()


def test_module_with_router_matches_reference():
    torch.manual_seed(0)
    layer = mok.MoE(256, 192, 8, 2, shared_intermediate=128, device="cuda")
    x = torch.randn(300, 256, device="cuda").bfloat16()
    with torch.no_grad():
        ids, w, _ = layer.route(x)
        y = layer(x)
    shared = tuple(layer.shared)
    _check(y, (x, ids, w, layer.w_gate.detach(), layer.w_up.detach(), layer.w_down.detach(),
               tuple(t.detach() for t in shared)))


@pytest.mark.parametrize("shared,limit,padding", [(0, None, 0.0), (128, 0.75, 0.3)])
def test_gradients_match_reference(shared, limit, padding):
    x, ids, w, gate, up, down, sh = _problem(T=257, shared=shared, padding=padding, seed=6)
    ours = [_leaf(t) for t in (x, w, gate, up, down) + (sh or ())]
    y = mok.moe(ours[0], ids, ours[1], *ours[2:5], shared=ours[5:] or None, swiglu_limit=limit)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [_leaf(t.double()) for t in (x, w, gate, up, down) + (sh or ())]
    y_ref = moe_reference(ref[0], ids, ref[1], *ref[2:5], tuple(ref[5:]) or None, limit)
    y_ref.backward(dy.double())
    for name, a, b in zip(["x", "topk_weights", "w_gate", "w_up", "w_down", "shared_gate", "shared_up",
                           "shared_down"], ours, ref):
        g, r = a.grad.double(), b.grad
        assert torch.isfinite(g).all(), name
        err = ((g - r).norm() / r.norm()).item()
        cos = torch.nn.functional.cosine_similarity(g.flatten(), r.flatten(), dim=0).item()
        assert err <= 1e-2 and cos >= 0.9999, (name, err, cos)


def test_backward_bitwise_repeatable_and_compiled():
    x, ids, w, gate, up, down, _ = _problem(seed=8)

    def grads(fn):
        leaves = [_leaf(t) for t in (x, w, gate, up, down)]
        y = fn(leaves[0], ids, *leaves[1:])
        return torch.autograd.grad((y.float() ** 2).sum(), leaves)

    eager = grads(mok.moe)
    again = grads(mok.moe)
    compiled = grads(torch.compile(mok.moe, fullgraph=True))
    for a, b, c in zip(eager, again, compiled):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_fewer_compute_sms_give_the_same_bits_forward_and_backward():
    """mok.set_compute_sms(n) leaves the rest of the SMs to other streams' kernels: the layer's
    persistent kernels then run n CTAs, and every output and gradient is bitwise the one of
    every SM (forward, backward, the shared expert and the clamp); a value of at least the GPU's
    SM count is every SM, served by the every-SM workspace. (The FP8 layer's: test_fp8_layer.py.)"""
    from mok import ops

    x, ids, w, gate, up, down, sh = _problem(seed=21, shared=128, padding=0.2)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count

    def run():
        leaves = [_leaf(t) for t in (x, w, gate, up, down, *sh)]
        y = mok.moe(leaves[0], ids, *leaves[1:5], shared=leaves[5:], swiglu_limit=0.75)
        return [y.detach()] + list(torch.autograd.grad((y.float() ** 2).sum(), leaves))

    every = run()
    try:
        for n in (7, sms // 2, sms + 100):
            mok.set_compute_sms(n)
            keys = set(ops._workspaces)
            got = run()
            made = [ws for key, ws in ops._workspaces.items() if key not in keys]
            if n < sms:  # (a workspace of its own, made with the setting)
                assert len(made) == 1 and made[0].compute_sms == n
            else:
                assert made == []
            for i, (a, b) in enumerate(zip(every, got)):
                assert torch.equal(a, b), f"compute_sms {n}: output {i} differs"
    finally:
        mok.set_compute_sms(0)


@pytest.mark.parametrize("fused", [False, True])
def test_recompute_gives_the_bits_of_the_saving_layer_and_keeps_nothing(fused):
    """recompute=True: a training forward keeps no pre-activations for the backward (what it
    leaves allocated is y alone; the saving layer's is y and its saved tensor), and the
    backward, which runs GEMM1 again, gives every gradient and y bitwise those of the saving
    layer — eager and compiled, with a shared expert and the clamp; fused: w_gate [E, 2I, H]
    and w_up None. The workspace it makes is a Training::recompute one."""
    from mok import ops

    x, ids, w, gate, up, down, sh = _problem(seed=23, shared=128, padding=0.2)
    dy = torch.randn_like(x)
    weights = (torch.cat([gate, up], dim=1), None) if fused else (gate, up)

    def run(layer, recompute):
        leaves = [_leaf(t) for t in (x, w, weights[0], down, *sh)] + ([] if fused else [_leaf(weights[1])])
        up_leaf = None if fused else leaves[-1]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = layer(leaves[0], ids, leaves[1], leaves[2], up_leaf, leaves[3], shared=tuple(leaves[4:7]),
                  swiglu_limit=0.75, recompute=recompute)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        return [y.detach(), *torch.autograd.grad(y, leaves, dy)], held

    saving, held_saving = run(mok.moe, False)
    keys = set(ops._workspaces)
    recomputing, held = run(mok.moe, True)
    made = [ws for key, ws in ops._workspaces.items() if key not in keys]
    assert len(made) <= 1 and all(ws.recompute for ws in made)
    assert any(ws.recompute for ws in ops._workspaces.values())
    saved_bytes = 2 * ops._saved_elements(x, down, ids.shape[1], sh[0], 0.75, down.shape[0])
    y_bytes = x.numel() * x.element_size()
    assert held <= y_bytes + 512 and held_saving >= held + saved_bytes, (held, held_saving, saved_bytes)
    compiled, _ = run(torch.compile(mok.moe, fullgraph=True), True)
    for i, (a, b, c) in enumerate(zip(saving, recomputing, compiled)):
        assert torch.equal(a, b), f"recompute: output {i} differs from the saving layer's"
        assert torch.equal(a, c), f"compiled recompute: output {i} differs from the saving layer's"


def test_module_with_recompute_trains_with_the_bits_of_the_saving_module():
    torch.manual_seed(3)
    layers = [mok.MoE(256, 192, 8, 2, shared_intermediate=128, device="cuda", recompute=r) for r in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(300, 256, device="cuda").bfloat16()
    runs = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y.float() ** 2).sum().backward()
        runs.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):
        assert b is not None and torch.equal(a, b)


def test_repeated_steps_are_replayed_from_graphs_bitwise():
    """A training loop repeats its calls (the caching allocator hands back the same blocks):
    from the second call of a forward or backward on, the workspace enqueues it as one CUDA
    graph launch (Config::replay_launches). Every step's output and gradients are the first
    (direct) step's bits; a CUDA graph the user captures afterwards still records the layer."""
    from mok import ops

    x, ids, w, gate, up, down, _ = _problem(T=333, seed=21)
    leaves = [_leaf(t) for t in (x, w, gate, up, down)]

    def step():
        y = mok.moe(leaves[0], ids, *leaves[1:])
        return (y.detach(), *torch.autograd.grad((y.float() ** 2).sum(), leaves))

    first = step()
    ws = next(ws for key, ws in ops._workspaces.items()  # (the saving one of every SM: other tests make others)
              if key[1:4] == (256, 192, 8) and key[-3:] == (False, 0, 0))
    replayed = ws.replayed_calls
    for _ in range(6):
        for a, b in zip(first, step()):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    assert ws.replayed_calls >= replayed + 4, (replayed, ws.replayed_calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mok.moe(x, ids, w, gate, up, down)
    y_direct = mok.moe(x, ids, w, gate, up, down)
    graph.replay()
    assert torch.equal(y.view(torch.int16), y_direct.view(torch.int16))


def test_eager_forward_enqueues_its_rows_first_with_the_bits_of_one_call(monkeypatch):
    """The eager one-GPU forward is two enqueues (the plan and row copy, then the rest: host work
    between them runs while the GPU copies rows); its y is the custom op's (one enqueue) bits, with
    a shared expert and clamp, in evaluation and training. The extension refuses a forward that
    says its rows were enqueued when they were not, naming the argument."""
    from mok import _C, ops
    from torch.utils.dlpack import to_dlpack

    x, ids, w, gate, up, down, sh = _problem(T=333, shared=128, seed=31)
    one_call = torch.ops.mok.moe_forward(x, ids, w, gate, up, down, *sh, 0.75, 8, ops.ONE_GPU)
    enqueued = []

    class Counting:  # the extension, its forward_rows counted
        def __getattr__(self, name):
            return getattr(_C, name)

        def forward_rows(self, *args, **kwargs):
            enqueued.append(args[0])
            return _C.forward_rows(*args, **kwargs)

    monkeypatch.setattr(ops, "_C", Counting())
    with torch.no_grad():
        evaluated = mok.moe(x, ids, w, gate, up, down, shared=sh, swiglu_limit=0.75)
    trained = mok.moe(_leaf(x), ids, w, _leaf(gate), up, down, shared=sh, swiglu_limit=0.75)
    monkeypatch.undo()
    assert len(enqueued) == 2  # (one each: the eager path, evaluation and training)
    for y in (evaluated, trained):
        assert torch.equal(y.detach().view(torch.int16), one_call.view(torch.int16))
    ws = ops._workspace(x, down, 2, 128, 0.75)
    y = torch.empty_like(x)
    scratch = torch.empty(ws.forward_scratch_bytes(333), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="argument 'rows_enqueued': is set, but forward_rows"):
        _C.forward(ws, *ops._capsules((x, ids, w, gate, up, down, *sh, y, None)), ops._stream(x),
                   scratch=to_dlpack(scratch), rows_enqueued=True)


def _on_gpu(value):
    """A meta or CPU tensor of test_checks' variants as a zero-filled CUDA tensor of the same
    shape, strides and dtype; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return tuple(map(_on_gpu, value)) if isinstance(value, tuple) else value
    size = 1 + sum((n - 1) * st for n, st in zip(value.shape, value.stride())) if value.numel() else 0
    return torch.zeros(size, dtype=value.dtype, device="cuda").as_strided(value.shape, value.stride())


def test_eager_path_names_bad_arguments_as_the_checks_do():
    """mok.moe's eager path leaves the checks to the extension and runs the Python ones only
    when the call fails: every broken variant of test_checks.py (on the GPU) raises exactly what
    check_moe_args raises, in evaluation and in training, and every valid one runs."""
    from test_checks import BAD, GOOD
    from mok._checks import check_moe_args

    def call(a):
        return mok.moe(a["x"], a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"],
                       shared=a["shared"], swiglu_limit=a["swiglu_limit"])

    ran = 0
    for name, meta in GOOD + BAD:
        if meta["num_experts"] is not None or not isinstance(meta["x"], torch.Tensor) or \
                any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in meta.values()):
            continue  # (expert parallelism's argument; a list or CPU tensors take the custom ops, not the eager path)
        a = {k: _on_gpu(v) for k, v in meta.items()}
        try:
            check_moe_args(**a)
            expected = None
        except (TypeError, ValueError) as e:
            expected = (type(e), str(e))
        for train in (False, True):
            if train:
                a["topk_weights"] = a["topk_weights"].clone().requires_grad_(True)
            if expected is None:
                y = call(a)
                assert y.shape == a["x"].shape, name
            else:
                with pytest.raises(expected[0]) as got:
                    call(a)
                assert str(got.value) == expected[1], (name, train, str(got.value))
            ran += 1
    assert ran >= 2 * 30, ran
    mok.check()


def test_concatenated_gate_up_is_read_in_place_bitwise():
    """w_gate = [E, 2I, H] with w_up None (as Hugging Face keeps it): the kernel reads the two
    halves in place (no copy: the op allocates nothing of the weights' size but the
    gradient) and writes one [E, 2I, H] gradient whose halves are bitwise the separate
    tensors' gradients; eager and compiled."""
    x, ids, w, gate, up, down, _ = _problem(seed=21, T=500, I=256)
    gate_up = torch.cat([gate, up], dim=1)

    def run(fn, *weights):
        leaves = [_leaf(t) for t in (x, w) + weights + (down,)]
        y = fn(leaves[0], ids, leaves[1], *leaves[2:-1], leaves[-1]) if len(weights) == 2 else \
            fn(leaves[0], ids, leaves[1], leaves[2], None, leaves[3])
        return (y,) + torch.autograd.grad((y.float() ** 2).sum(), leaves)

    y, dx, dw, d_gate, d_up, d_down = run(mok.moe, gate, up)
    for fn in (mok.moe, torch.compile(mok.moe, fullgraph=True)):
        y2, dx2, dw2, d_gate_up, d_down2 = run(fn, gate_up)
        assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2) and torch.equal(d_down, d_down2)
        assert d_gate_up.shape == gate_up.shape
        assert torch.equal(d_gate_up[:, :256], d_gate) and torch.equal(d_gate_up[:, 256:], d_up)
    with torch.no_grad():  # strided halves of one tensor, given as two views
        assert torch.equal(mok.moe(x, ids, w, gate_up[:, :256], gate_up[:, 256:], down), y)

    def peak_growth(*weights):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            mok.moe(x, ids, w, *weights, down)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    assert peak_growth(gate_up, None) == peak_growth(gate, up)  # y and the scratch: no copy of the weights


def test_second_backward_through_one_forward_is_refused():
    x, ids, w, gate, up, down, _ = _problem(seed=9)
    leaves = [_leaf(t) for t in (x, w, gate, up, down)]
    y = mok.moe(leaves[0], ids, *leaves[1:])
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.sum().backward()


def test_second_backward_through_a_recomputing_forward_runs():
    """With recompute nothing is consumed: retain_graph=True and a second backward accumulate
    the same gradients again (bf16 doubling is exact)."""
    x, ids, w, gate, up, down, _ = _problem(seed=9)
    leaves = [_leaf(t) for t in (x, w, gate, up, down)]
    y = mok.moe(leaves[0], ids, *leaves[1:], recompute=True)
    y.sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    y.sum().backward()
    for t, g in zip(leaves, first):
        assert torch.equal(t.grad, g + g)


@pytest.mark.parametrize("recompute", [False, True])
def test_cuda_graph_of_forward_and_backward(recompute):
    # A training step captured once and replayed with new routing and data: gradients must
    # match an eager step on the same inputs bit for bit (nothing synchronises with the host).
    # recompute: the captured step recomputes GEMM1 in its backward; the eager one saves.
    x, ids, w, gate, up, down, _ = _problem(seed=10)
    leaves = [_leaf(t) for t in (x, w, gate, up, down)]
    dy = torch.randn_like(x)

    def step():
        for t in leaves:
            t.grad = None
        mok.moe(leaves[0], ids, *leaves[1:], recompute=recompute).backward(dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # allocates the workspaces outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        mok.moe(leaves[0], ids, *leaves[1:], recompute=recompute).backward(dy)
    grads_in_graph = [t.grad for t in leaves]
    nx, nids, nw, *_ = _problem(seed=11)
    with torch.no_grad():
        leaves[0].copy_(nx), leaves[1].copy_(nw)
    ids.copy_(nids), dy.copy_(torch.randn_like(dy))
    graph.replay()
    replayed = [g.clone() for g in grads_in_graph]
    eager = [_leaf(t.detach()) for t in leaves]
    mok.moe(eager[0], ids, *eager[1:]).backward(dy)
    for a, b in zip(replayed, eager):
        assert torch.equal(a, b.grad)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_activation_checkpointing_gives_the_same_bits(precision):
    """torch.utils.checkpoint around the layer (the forward recomputed in the backward, as large
    MoE trainings run): output and every gradient bitwise equal to the layer without it (the
    kernels are deterministic, and the recompute makes its own saved activations)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1)
    layer = mok.MoE(256, 256, 8, 2, shared_intermediate=128, device="cuda", precision=precision)
    x = torch.randn(300, 256, device="cuda").bfloat16()
    dy = torch.randn(300, 256, device="cuda").bfloat16()
    runs = []
    for wrapped in (False, True):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = checkpoint(layer, xi, use_reentrant=False) if wrapped else layer(xi)
        y.backward(dy)
        mok.check()
        runs.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):
        assert b is not None and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
