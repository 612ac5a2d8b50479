"""What needs no GPU: the extension's linkage, the fp64 reference, argument checks, the
fake implementation (meta tensors)."""

import shutil
import subprocess

import numpy as np
import pytest
import torch

import mok
from torch_reference import moe_reference, random_problem


def test_extension_does_not_link_torch_or_a_shared_cuda_runtime():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not installed")
    out = subprocess.run([readelf, "-d", mok._C.__file__], check=True, capture_output=True, text=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert needed, "readelf listed no NEEDED entries"
    for lib in needed:
        assert "torch" not in lib and "c10" not in lib, f"mok._C links {lib}"
        assert not lib.startswith("libcudart"), f"mok._C needs {lib}; the CUDA runtime should be static"


@pytest.mark.parametrize("shared,limit,padding", [(0, None, 0.0), (64, None, 0.3), (128, 0.8, 0.2)])
def test_cpp_reference_matches_torch_reference(shared, limit, padding):
    x, ids, w, gate, up, down, sh = random_problem(9, 64, 128, 6, 2, shared, seed=3, padding=padding)
    limit32 = None if limit is None else float(np.float32(limit))  # the library takes the limit as fp32
    expected = moe_reference(x, ids, w, gate, up, down, sh, limit32)
    args = [t.numpy() for t in (x, ids, w.double(), gate, up, down)]
    shared_args = {} if sh is None else dict(shared_gate=sh[0].numpy(), shared_up=sh[1].numpy(), shared_down=sh[2].numpy())
    got = mok.reference_forward(*args, **shared_args, swiglu_limit=limit)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-10, atol=1e-12)


def test_cpp_reference_rejects_bad_expert_id():
    x, ids, w, gate, up, down, _ = random_problem(4, 64, 64, 4, 2, seed=1)
    ids[2, 1] = 4
    with pytest.raises(ValueError, match=r"expert id must be in \[-1, 4\), got 4 at token 2, slot 1"):
        mok.reference_forward(x.numpy(), ids.numpy(), w.double().numpy(), gate.numpy(), up.numpy(), down.numpy())


def _meta_args(T=8, H=128, I=64, E=4, k=2):
    m = dict(device="meta")
    return dict(x=torch.empty(T, H, dtype=torch.bfloat16, **m), topk_ids=torch.empty(T, k, dtype=torch.int32, **m),
                topk_weights=torch.empty(T, k, dtype=torch.float32, **m),
                w_gate=torch.empty(E, I, H, dtype=torch.bfloat16, **m), w_up=torch.empty(E, I, H, dtype=torch.bfloat16, **m),
                w_down=torch.empty(E, H, I, dtype=torch.bfloat16, **m))


def test_fake_implementation_gives_output_metadata():
    args = _meta_args()
    y = mok.moe(**args)
    assert y.device.type == "meta" and y.shape == (8, 128) and y.dtype == torch.bfloat16
    shared = (torch.empty(64, 128, dtype=torch.bfloat16, device="meta"),
              torch.empty(64, 128, dtype=torch.bfloat16, device="meta"),
              torch.empty(128, 64, dtype=torch.bfloat16, device="meta"))
    assert mok.moe(**args, shared=shared, swiglu_limit=7.0).shape == (8, 128)


BAD = [
    ("x dtype", dict(x=torch.empty(8, 128, dtype=torch.float32, device="meta")), TypeError, "'x' dtype must be torch.bfloat16"),
    ("ids dtype", dict(topk_ids=torch.empty(8, 2, dtype=torch.float32, device="meta")), TypeError,
     "'topk_ids' dtype must be torch.int32 or torch.int64"),
    ("weights dtype", dict(topk_weights=torch.empty(8, 2, dtype=torch.bfloat16, device="meta")), TypeError,
     "'topk_weights' dtype must be torch.float32"),
    ("ids rows", dict(topk_ids=torch.empty(7, 2, dtype=torch.int32, device="meta")), ValueError,
     r"'topk_ids' must be \[T, k\] with T = 8"),
    ("k > E", dict(topk_ids=torch.empty(8, 5, dtype=torch.int32, device="meta"),
                   topk_weights=torch.empty(8, 5, dtype=torch.float32, device="meta")), ValueError, r"top-k must be in \[1, E = 4\], got 5"),
    ("w_down shape", dict(w_down=torch.empty(4, 64, 128, dtype=torch.bfloat16, device="meta")), ValueError,
     r"'w_down' shape must be \(4, 128, 64\)"),
    ("H granularity", dict(x=torch.empty(8, 96, dtype=torch.bfloat16, device="meta"),
                           w_gate=torch.empty(4, 64, 96, dtype=torch.bfloat16, device="meta"),
                           w_up=torch.empty(4, 64, 96, dtype=torch.bfloat16, device="meta"),
                           w_down=torch.empty(4, 96, 64, dtype=torch.bfloat16, device="meta")), ValueError,
     "hidden size H must be a positive multiple of 64, got 96"),
    ("device mix", dict(w_up=torch.empty(4, 64, 128, dtype=torch.bfloat16)), ValueError, "'w_up' is on cpu, but x is on meta"),
]


@pytest.mark.parametrize("name,override,exc,message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_named(name, override, exc, message):
    args = _meta_args()
    args.update(override)
    with pytest.raises(exc, match=message):
        mok.moe(**args)


def test_cpu_tensors_are_rejected():
    args = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in _meta_args().items()}
    with pytest.raises(ValueError, match="tensors must be on a CUDA device, got cpu"):
        mok.moe(**args)


def test_non_contiguous_and_bad_limit():
    args = _meta_args()
    args["w_gate"] = torch.empty(4, 128, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    with pytest.raises(ValueError, match=r"'w_gate' must have contiguous rows \(stride 1 in its last dimension\)"):
        mok.moe(**args)
    with pytest.raises(ValueError, match="'swiglu_limit' must be a finite positive number"):
        mok.moe(**_meta_args(), swiglu_limit=-1.0)


def test_concatenated_gate_up_and_strided_views_on_fake_tensors():
    # w_up None: w_gate is [E, 2I, H] (gate rows, then up rows) and gets one gradient of that
    # shape, w_up none; a strided view (a half of such a tensor) is taken as it is.
    args = _meta_args()
    gate_up = torch.empty(4, 128, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    x = args["x"].requires_grad_(True)
    y = mok.moe(x, args["topk_ids"], args["topk_weights"], gate_up, None, args["w_down"])
    assert y.shape == (8, 128)
    dx, d_gate_up = torch.autograd.grad(y, [x, gate_up], torch.empty_like(y))
    assert d_gate_up.shape == gate_up.shape and dx.shape == x.shape
    assert mok.moe(x, args["topk_ids"], args["topk_weights"], gate_up[:, :64], gate_up[:, 64:], args["w_down"]).shape == (8, 128)
    with pytest.raises(ValueError, match=r"'w_down' shape must be \(4, 128, 48\)"):  # I = 96 / 2 from w_gate
        mok.moe(x, args["topk_ids"], args["topk_weights"], gate_up[:, :96], None, args["w_down"])
    with pytest.raises(ValueError, match=r"'w_gate' must be \[E, 2I, H\] \(gate and up concatenated: w_up is None\): "
                                         r"an even number of rows"):
        mok.moe(x, args["topk_ids"], args["topk_weights"], gate_up[:, :97], None, args["w_down"])


def test_torch_path_and_module_take_concatenated_gate_up():
    """moe_torch with w_up None equals the separate tensors; MoE(fused_gate_up=True) keeps one
    w_gate_up parameter [E, 2I, H] and trains through it (backend "torch", CPU)."""
    torch.manual_seed(0)
    T, H, I, E, k = 16, 64, 64, 4, 2
    x = torch.randn(T, H)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    w = torch.rand(T, k)
    gate_up, down = torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 8
    fused = mok.moe_torch(x, ids, w, gate_up, None, down)
    separate = mok.moe_torch(x, ids, w, gate_up[:, :I], gate_up[:, I:], down)
    torch.testing.assert_close(fused, separate)
    layer = mok.MoE(H, I, E, k, backend="torch", fused_gate_up=True, dtype=torch.float32)
    assert tuple(layer.w_gate_up.shape) == (E, 2 * I, H) and not hasattr(layer, "w_gate")
    assert "w_gate_up" in layer.state_dict()
    layer(x).square().sum().backward()
    assert layer.w_gate_up.grad is not None and layer.w_gate_up.grad.abs().sum() > 0


def test_autograd_gives_every_gradient_its_shape():
    # Meta tensors run the custom ops' fake implementations: the autograd wiring
    # (which inputs get gradients, of which shape and dtype) is checked without a GPU.
    args = _meta_args()
    for name in ("x", "topk_weights", "w_gate", "w_up", "w_down"):
        args[name].requires_grad_(True)
    y = mok.moe(**args)
    grads = torch.autograd.grad(y, [args[n] for n in ("x", "topk_weights", "w_gate", "w_up", "w_down")],
                                torch.empty_like(y))
    for g, n in zip(grads, ("x", "topk_weights", "w_gate", "w_up", "w_down")):
        assert g.shape == args[n].shape and g.dtype == args[n].dtype, n


@pytest.mark.parametrize("bad", [-1, 1025, 2.0, True, "2", None])
def test_backward_column_blocks_setting_is_checked(bad):
    with pytest.raises(ValueError, match=r"mok.set_backward_column_blocks: blocks must be an int in 0 .. 1024"):
        mok.set_backward_column_blocks(bad)


def test_default_backward_column_blocks_by_precision():
    """A training workspace's backward_column_blocks = 0 (no GPU needed): two blocks, one for an fp8
    workspace where H <= 2048; a recompute one two where I > H, else one, whatever the precision."""
    blocks = mok._C.default_backward_column_blocks
    assert blocks(2048, 768, False) == 2 and blocks(2048, 768, False, "bf16") == 2
    assert blocks(2048, 768, False, "fp8") == 1 and blocks(1024, 512, False, "fp8") == 1
    assert blocks(2880, 2880, False, "fp8") == 2 and blocks(7168, 2048, False, "fp8") == 2
    assert blocks(4096, 14336, True, "fp8") == 2 and blocks(2048, 768, True, "fp8") == 1
    with pytest.raises(ValueError, match=r"mok.default_backward_column_blocks: precision must be 'bf16' or 'fp8', got 'fp16'"):
        blocks(2048, 768, False, "fp16")


def test_backward_column_blocks_setting_keys_new_workspaces():
    from mok import ops

    try:
        mok.set_backward_column_blocks(1)
        assert ops._backward_column_blocks == 1
    finally:
        mok.set_backward_column_blocks(0)
    assert ops._backward_column_blocks == 0


@pytest.mark.parametrize("bad", [-1, 2.0, True, "8", None])
def test_compute_sms_setting_is_checked(bad):  # (the value before it stays)
    with pytest.raises(ValueError, match=r"mok.set_compute_sms: sms must be an int >= 0 \(0: every SM\)"):
        mok.set_compute_sms(bad)


def test_compute_sms_setting_takes_numpy_ints_and_maps_every_sm_to_zero(monkeypatch):
    """The setting takes any integer (a NumPy one from SM arithmetic too); a workspace is made with
    it where it leaves SMs free, and with 0 (the every-SM workspace) where it is at least the
    device's SM count."""
    np = pytest.importorskip("numpy")
    from mok import ops

    monkeypatch.setattr(ops, "_device_sms", {3: 132})
    try:
        mok.set_compute_sms(np.int64(116))
        assert ops._compute_sms == 116 and type(ops._compute_sms) is int and ops._compute_sms_on(3) == 116
        for every in (132, 200, 2**40):
            mok.set_compute_sms(every)
            assert ops._compute_sms_on(3) == 0
        mok.set_compute_sms(0)
        assert ops._compute_sms_on(3) == 0
    finally:
        mok.set_compute_sms(0)


def test_a_setting_changed_before_a_capture_is_named_by_the_capture_error(monkeypatch):
    """A layer shape whose workspaces were made with other settings needs a new one, which cannot
    be allocated inside CUDA graph capture: the error names the settings, not the token count."""
    from mok import ops

    x, w_down = torch.zeros(16, 256), torch.zeros(4, 256, 128)
    key = (x.get_device(), 256, 128, 4, 2, 0, None, "bf16")
    monkeypatch.setattr(ops, "_workspaces", {key + (False, 0, 0): type("Ws", (), {"max_tokens": 64})()})
    monkeypatch.setattr(ops, "_device_sms", {x.get_device(): 132})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(ops, "_compute_sms", 100)
    with pytest.raises(RuntimeError, match=r"made with other settings \(recompute, backward_column_blocks, compute_sms = "
                                           r"\(False, 0, 0\)\) than now \(False, 0, 100"):
        ops._workspace(x, w_down, 2, 0, None)
    monkeypatch.setattr(ops, "_compute_sms", 0)
    with pytest.raises(RuntimeError, match=r"than now \(True, 0, 0: mok.moe's recompute"):
        ops._workspace(x, w_down, 2, 0, None, recompute=True)
    assert ops._workspace(x, w_down, 2, 0, None).max_tokens == 64  # (the settings it was made with: no new one)
    with pytest.raises(RuntimeError, match=r"a call with 100 tokens needs a workspace for more tokens than this layer "
                                           r"shape has seen \(64\)"):
        ops._workspace(torch.zeros(100, 256), w_down, 2, 0, None)


@pytest.mark.parametrize("I, default", [(128, 1), (512, 2)])
def test_the_default_column_blocks_are_a_recompute_workspaces_0(monkeypatch, I, default):
    """A recompute workspace's default is one column block where I <= H, two where I > H:
    mok.set_backward_column_blocks(default) finds the workspace made with 0 (no second one, and none
    to allocate inside a capture), where the other count is a setting of its own, and a saving
    layer's 1 too."""
    from mok import ops

    x, w_down = torch.zeros(16, 256), torch.zeros(4, 256, I)
    key = (x.get_device(), 256, I, 4, 2, 0, None, "bf16")
    made = type("Ws", (), {"max_tokens": 64})()
    monkeypatch.setattr(ops, "_workspaces", {key + (True, 0, 0): made, key + (False, 0, 0): made})
    monkeypatch.setattr(ops, "_device_sms", {x.get_device(): 132})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    try:
        mok.set_backward_column_blocks(default)
        assert ops._workspace(x, w_down, 2, 0, None, recompute=True) is made
        other = 3 - default
        mok.set_backward_column_blocks(other)
        with pytest.raises(RuntimeError, match=rf"than now \(True, {other}, 0: "):
            ops._workspace(x, w_down, 2, 0, None, recompute=True)
        mok.set_backward_column_blocks(1)
        with pytest.raises(RuntimeError, match=r"than now \(False, 1, 0: "):
            ops._workspace(x, w_down, 2, 0, None)
    finally:
        mok.set_backward_column_blocks(0)


@pytest.mark.parametrize("bad", [0, 1, "yes", None])
def test_fp8_weight_gradients_setting_is_checked(bad):
    with pytest.raises(ValueError, match=r"mok.set_fp8_weight_gradients: on must be True or False"):
        mok.set_fp8_weight_gradients(bad)


def test_fp8_weight_gradients_setting_is_read_by_the_backward():
    from mok import ops

    assert ops._fp8_weight_gradients is True  # (the default: measured faster, docs/fp8.md)
    try:
        mok.set_fp8_weight_gradients(False)
        assert ops._fp8_weight_gradients is False
    finally:
        mok.set_fp8_weight_gradients(True)
    assert ops._fp8_weight_gradients is True


@pytest.mark.skipif(mok.cuda_device_count() > 0, reason="checks the message on a machine without a GPU")
def test_workspace_without_gpu_says_so():
    with pytest.raises(ValueError, match="cannot use CUDA device 0"):
        mok._C.Workspace(128, 64, 4, 2, 0, None, 8, 0)


def test_saved_tensor_size_needs_no_gpu():
    # gate + up pre-activations (bf16) over the plan's worst-case rows, plus an 8-element trailer
    T, H, I, E, k = 8, 128, 64, 4, 2
    capacity = max((T * k + E * 127) // 128 * 128, 128)
    assert mok._C.saved_elements(H, I, E, k, 0, None, T) == 2 * capacity * I + 8


def test_compiled_forward_and_backward_trace_through_the_fake_implementations():
    # torch.compile(fullgraph=True) of a training step, on meta tensors: AOTAutograd must
    # accept the custom ops (e.g. no undeclared-then-declared mutation that it refuses).
    args = _meta_args()
    leaves = {n: t.requires_grad_() for n, t in args.items() if n != "topk_ids"}

    def step(x, topk_weights, w_gate, w_up, w_down):
        return mok.moe(x, args["topk_ids"], topk_weights, w_gate, w_up, w_down).float().sum()

    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(**leaves)
    loss.backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves.values())


def test_backward_allocates_gate_and_up_gradients_as_one_block():
    """The backward (eager and custom op) allocates d_w_gate and d_w_up as one [2, E, I, H] block
    (ops._empty_grads(paired=True)): its halves lie one after the other (the backward's rows may
    span both: ops._gate_up_adjacent) and are shaped and laid out like the weights, so autograd
    takes them as .grad without a copy. Not for unlike or strided weights; a concatenated
    [E, 2I, H] gradient is one block by itself."""
    from mok import ops

    E, I, H = 3, 8, 16
    x, w = torch.empty(5, H, dtype=torch.bfloat16), torch.empty(5, 2)
    gate, up, down = (torch.empty(E, I, H, dtype=torch.bfloat16) for _ in range(3))
    grads = ops._empty_grads(x, w, gate, up, down, None, None, None, paired=True)
    assert grads[2].shape == (2, E, I, H) and grads[3].numel() == 0
    d_gate, d_up = ops._gate_up_grads(grads, up)
    assert d_gate.shape == gate.shape and d_up.shape == up.shape
    assert d_gate.stride() == gate.stride() and d_up.stride() == up.stride()
    assert d_up.data_ptr() == d_gate.data_ptr() + d_gate.nbytes and ops._gate_up_adjacent(d_gate, d_up)
    args = (None, x, None, w, gate, up, down, None, None, None)  # (_input_grads reads w_up and shared_gate)
    got = ops._input_grads(grads, args)[3:5]  # (the gradients of w_gate and w_up)
    assert [(g.data_ptr(), g.shape) for g in got] == [(d_gate.data_ptr(), gate.shape), (d_up.data_ptr(), up.shape)]
    apart = ops._empty_grads(x, w, gate, up, down, None, None, None)
    assert apart[2].shape == gate.shape and apart[3].shape == up.shape
    assert apart[2].untyped_storage().data_ptr() != apart[3].untyped_storage().data_ptr()
    strided_up = torch.empty(E, I, 2 * H, dtype=torch.bfloat16)[:, :, :H]
    unpaired = ops._empty_grads(x, w, gate, strided_up, down, None, None, None, paired=True)
    assert unpaired[2].shape == gate.shape and unpaired[3].shape == up.shape
    assert not ops._gate_up_adjacent(*ops._gate_up_grads(unpaired, strided_up))
    gate_up = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
    one = ops._empty_grads(x, w, gate_up, None, down, None, None, None, paired=True)
    assert one[2].shape == gate_up.shape and ops._gate_up_grads(one, None) == (one[2], None)
    assert ops._gate_up_adjacent(one[2], None)
    assert not ops._gate_up_adjacent(torch.empty(E, 2 * I, H), None)  # (f32: no rows in them)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_hands_autograd_the_halves_of_the_gate_up_block(monkeypatch, backend):
    """Under torch.compile the backward op returns W_gate's and W_up's gradients as one block
    (outputs of a torch.library op may not alias); the compiled backward must hand autograd its
    two halves as they are (no copy, each its own values) and size the scratch for a block. Run
    on CPU tensors, with the extension replaced by one that fills each gradient with a constant
    of its own and the checks, workspace and stream faked."""
    from torch.utils.dlpack import from_dlpack

    from mok import ops

    asked, pointers = [], []

    class Workspace:
        def forward_scratch_bytes(self, tokens):
            return 16

        def backward_scratch_bytes(self, f32_grads, tokens, gate_up_adjacent, dx_apart, fp8_dgrad=False, fp8_wgrad=False):
            assert dx_apart  # (dx is a tensor of its own)
            asked.append(gate_up_adjacent)
            return 16

    class Extension:
        ep_saved_elements = staticmethod(mok._C.ep_saved_elements)

        @staticmethod
        def forward(ws, *t, scratch=None, rows_enqueued=False):  # (x .. shared_down, y, saved, stream)
            from_dlpack(t[9]).fill_(0.5)

        @staticmethod
        def backward(ws, *t, scratch=None, fp8_dgrad=None, fp8_wgrad=False):  # (x .. shared_down, saved, dy, dx, d_topk_weights, d_w_gate, d_w_up, d_w_down, ...)
            grads = [from_dlpack(t[i]) for i in range(11, 16)]  # (a capsule is consumed once)
            for grad, value in zip(grads, (1.0, 2.0, 3.0, 4.0, 5.0)):
                grad.fill_(value)
            pointers.append((grads[2].data_ptr(), grads[3].data_ptr()))

    monkeypatch.setattr(ops, "_C", Extension())
    monkeypatch.setattr(ops, "_check", lambda *args: None)
    monkeypatch.setattr(ops, "_workspace", lambda *args, **kwargs: Workspace())
    monkeypatch.setattr(ops, "_stream", lambda x: 0)
    T, H, I, E, k = 8, 128, 64, 4, 2
    g = torch.Generator().manual_seed(3)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
    leaves = [torch.randn(T, H, generator=g).bfloat16(), torch.rand(T, k, generator=g),
              *(torch.randn(E, I, H, generator=g).bfloat16() for _ in range(2)), torch.randn(E, H, I, generator=g).bfloat16()]
    for t in leaves:
        t.requires_grad_()

    def step(x, topk_weights, w_gate, w_up, w_down):
        return mok.moe(x, ids, topk_weights, w_gate, w_up, w_down).float().sum()

    torch._dynamo.reset()
    torch.compile(step, backend=backend, fullgraph=True)(*leaves).backward()
    x, w, gate, up, down = leaves
    assert asked == [True] and len(pointers) == 1
    for t, value in ((x, 1.0), (w, 2.0), (gate, 3.0), (up, 4.0), (down, 5.0)):
        assert t.grad.shape == t.shape and torch.all(t.grad == value), (t.shape, t.grad.flatten()[:4])
    assert (gate.grad.data_ptr(), up.grad.data_ptr()) == pointers[0]  # the block's halves themselves
    assert up.grad.data_ptr() == gate.grad.data_ptr() + gate.grad.nbytes


def test_recompute_saves_nothing_and_traces_through_the_fake_implementations():
    """recompute=True: the train-forward op's saved tensor is empty (the backward runs GEMM1
    again), every gradient keeps its shape, and a compiled step traces through the ops."""
    args = _meta_args()
    for name in ("x", "topk_weights", "w_gate", "w_up", "w_down"):
        args[name].requires_grad_(True)
    y, saved = torch.ops.mok.moe_train_forward(args["x"], args["topk_ids"], args["topk_weights"], args["w_gate"],
                                               args["w_up"], args["w_down"], None, None, None, None, 4, 0, True)
    assert saved.shape == (0,) and y.shape == args["x"].shape
    _, kept = torch.ops.mok.moe_train_forward(args["x"], args["topk_ids"], args["topk_weights"], args["w_gate"],
                                              args["w_up"], args["w_down"], None, None, None, None, 4, 0)
    assert kept.numel() == mok._C.saved_elements(128, 64, 4, 2, 0, None, 8)
    names = ("x", "topk_weights", "w_gate", "w_up", "w_down")
    y = mok.moe(**args, recompute=True)
    grads = torch.autograd.grad(y, [args[n] for n in names], torch.empty_like(y))
    for g, n in zip(grads, names):
        assert g.shape == args[n].shape and g.dtype == args[n].dtype, n

    def step(x, topk_weights, w_gate, w_up, w_down):
        return mok.moe(x, args["topk_ids"], topk_weights, w_gate, w_up, w_down, recompute=True).float().sum()

    leaves = {n: args[n].detach().requires_grad_() for n in names}
    torch.compile(step, backend="aot_eager", fullgraph=True)(**leaves).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves.values())


def test_recompute_hands_the_backward_no_saved_tensor(monkeypatch):
    """The custom ops' backward gets saved=None after a recomputing forward (the extension then
    takes the recompute path), and the saved tensor after a saving one."""
    from mok import ops

    seen = []
    real = ops.moe_backward

    def spy(*args):
        seen.append(args[10])
        return real(*args)

    monkeypatch.setattr(ops, "moe_backward", spy)
    for recompute in (True, False):
        args = _meta_args()
        args["x"].requires_grad_(True)
        mok.moe(**args, recompute=recompute).sum().backward()
    assert seen[0] is None and seen[1] is not None and seen[1].numel() == mok._C.saved_elements(128, 64, 4, 2, 0,
                                                                                               None, 8)


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_recompute_argument_is_checked(bad):
    with pytest.raises(ValueError, match=r"mok.moe: recompute must be True or False, got"):
        mok.moe(**_meta_args(), recompute=bad)
    with pytest.raises(ValueError, match=r"mok.MoE: 'recompute' must be True or False, got"):
        mok.MoE(128, 64, 4, 2, recompute=bad, device="meta")


def test_recompute_is_refused_where_it_does_not_run():
    with pytest.raises(ValueError, match=r"recompute=True needs precision='bf16'"):
        mok.moe(**_meta_args(), precision="fp8", recompute=True)
    for kw, named in ((dict(backend="torch"), "backend='torch'"), (dict(precision="fp8"), "precision='fp8'")):
        with pytest.raises(ValueError, match=r"mok.MoE: recompute=True runs on the fused bf16 kernel .*" + named):
            mok.MoE(128, 128, 4, 2, recompute=True, device="meta", **kw)
    with pytest.raises(ValueError, match=r"mok.Workspace: recompute=True needs training=True"):
        mok._C.Workspace(128, 64, 4, 2, 0, None, 8, 0, training=False, recompute=True)
