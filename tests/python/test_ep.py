"""mok.ep: expert parallelism over torch.distributed. The argument checks and the fake
implementations run everywhere; the multi-process test runs tests/python/ep_worker.py under
torchrun on the Hopper GPUs this machine has (one process per GPU, or one on a single GPU)."""

import os
import subprocess
import sys

import pytest
import torch

import mok
import mok.ep
from mok import _C

HERE = os.path.dirname(__file__)
hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def _meta_rank(T, H, I, El, k):
    """A rank's layer arguments on the meta device (the custom ops' fake implementations):
    x [T, H], topk_ids and topk_weights [T, k], w_gate (also passed as w_up) [El, I, H], w_down."""
    m = dict(device="meta")
    return (torch.empty(T, H, dtype=torch.bfloat16, **m), torch.zeros(T, k, dtype=torch.int32, **m),
            torch.empty(T, k, dtype=torch.float32, **m), torch.empty(El, I, H, dtype=torch.bfloat16, **m),
            torch.empty(El, H, I, dtype=torch.bfloat16, **m))


def test_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        mok.ep.ExpertParallel()


@pytest.mark.parametrize("kwargs, message", [
    (dict(comm_sms=-1), "comm_sms must be an int >= 0, got -1"),
    (dict(comm_sms=2.0), "comm_sms must be an int >= 0, got 2.0"),
    (dict(ring_rows=-4096), "ring_rows must be an int >= 0, got -4096"),
    (dict(minibatch_rows=0), "minibatch_rows must be a positive multiple of 128, got 0"),
    (dict(minibatch_rows=1000), "minibatch_rows must be a positive multiple of 128, got 1000"),
    (dict(ring_rows=3000, minibatch_rows=1024), "ring_rows must be 0 or a multiple of minibatch_rows = 1024, got 3000"),
    (dict(pull_tokens_once=1), "pull_tokens_once must be a bool, got 1"),
    (dict(interleave_rows=100), "interleave_rows must be 0 or a positive multiple of 128, got 100"),
    (dict(interleave_rows=4096, comm_sms=4), r"interleave_rows cannot be combined with the ring \(comm_sms = 4"),
    (dict(pull_tokens_once=True, comm_sms=8), r"pull_tokens_once applies to rows pulled before the kernel; the ring "
                                              r"\(comm_sms = 8, ring_rows = 0\) pulls its own"),
    (dict(pull_fp8_rows=1), "pull_fp8_rows must be a bool, got 1"),
    (dict(pull_fp8_rows=True, pull_tokens_once=True), "pull_fp8_rows cannot be combined with pull_tokens_once"),
    (dict(tokens=0), "tokens must be None or an int >= 1, got 0"),
    (dict(tokens=True), "tokens must be None or an int >= 1, got True"),
    (dict(tokens=64.0), "tokens must be None or an int >= 1, got 64.0"),
    (dict(compute_sms=-3), r"compute_sms must be 0 \(every SM\) or a positive int, got -3"),
    (dict(compute_sms=2.5), r"compute_sms must be 0 \(every SM\) or a positive int, got 2.5"),
    (dict(timeout_seconds=-5), "timeout_seconds must be a finite positive number, got -5"),
    (dict(timeout_seconds=float("nan")), "timeout_seconds must be a finite positive number, got nan"),
    (dict(timeout_seconds="x"), "timeout_seconds must be a finite positive number, got 'x'"),
    (dict(capacity_factor=-1), r"capacity_factor must be 0 \(room for the worst case\) or a positive multiple of "
                               r"1/64 \(e.g. 1.25, 1.5, 2\), got -1"),
    (dict(capacity_factor=1.1), r"capacity_factor must be 0 .* got 1.1"),
    (dict(capacity_factor=float("nan")), r"capacity_factor must be 0 .* got nan"),
    (dict(capacity_factor=float("inf")), r"capacity_factor must be 0 .* got inf"),
    (dict(capacity_factor=True), r"capacity_factor must be 0 .* got True"),
    (dict(capacity_factor="2"), r"capacity_factor must be 0 .* got '2'"),
])
def test_ring_arguments_are_checked_before_the_process_group(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mok.ep.ExpertParallel(**kwargs)


def test_moe_checks_its_group_argument():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="'group' must be a mok.ep.ExpertParallel"):
        mok.ep.moe(x, torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2), torch.zeros(1, 64, 64), None, None,
                   group=object())


def test_region_and_saved_sizes_need_no_gpu():
    # Rank of a group of 4: E = 16 experts, 4 local; T = 512 tokens of k = 2.
    region = _C.ep_region_bytes(256, 128, 16, 4, 2, 0, None, 512)
    saved = _C.ep_saved_elements(256, 128, 16, 4, 2, 0, None, 512)
    # x and dy rows, ids and weights of 4 ranks, bf16 combine slots and the backward's partials
    parts = 2 * (2 * 512 * 256) + 2 * (4 * 4 * 512 * 2) + (2 * 512 * 2 * 256 + 4 * 512 * 2)
    assert region % 256 == 0 and parts <= region <= parts + 7 * 256 + 1024
    assert saved >= 4 * 512 * 2 * 128  # gate|up rows for every row the rank can receive (4 ranks' tokens)
    with pytest.raises(ValueError, match="num_local_experts"):
        _C.ep_region_bytes(256, 128, 16, 3, 2, 0, None, 512)


def test_top_k_may_exceed_the_local_experts():
    # E_l = 1 local expert, k = 2 of E = 8 global ones: the checks use the group's E.
    from mok._checks import check_moe_args

    x = torch.zeros(4, 64, dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(4, 2, dtype=torch.int32, device="meta")
    w = torch.zeros(4, 2, device="meta")
    g = torch.zeros(1, 64, 64, dtype=torch.bfloat16, device="meta")
    d = torch.zeros(1, 64, 64, dtype=torch.bfloat16, device="meta")
    check_moe_args(x, ids, w, g, g, d, None, None, num_experts=8)
    with pytest.raises(ValueError, match="top-k must be in"):
        check_moe_args(x, ids, w, g, g, d, None, None)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("nproc", sorted({1, min(torch.cuda.device_count(), 4)}) if hopper else [1])
def test_ep_over_torchrun_matches_one_gpu_bitwise(nproc):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, "ep_worker.py")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("bitwise equal to one GPU") == nproc


def test_fake_implementations_give_output_metadata():
    # Rank of a group of 4: 2 local experts of E = 8, k = 4 (more than the local experts).
    T, H, I, El, E, k = 16, 128, 64, 2, 8, 4
    x, ids, w, gate, down = _meta_rank(T, H, I, El, k)
    y = torch.ops.mok.moe_forward(x, ids, w, gate, gate, down, None, None, None, None, E, 1)
    assert y.shape == (T, H) and y.device.type == "meta"
    y, saved = torch.ops.mok.moe_train_forward(x, ids, w, gate, gate, down, None, None, None, None, E, 1)
    assert saved.shape == (_C.ep_saved_elements(H, I, E, El, k, 0, None, T),) and saved.dtype == torch.bfloat16
    grads = torch.ops.mok.moe_backward(x, x, ids, w, gate, gate, down, None, None, None, saved, None, E, 1)
    # (gate and up alike and contiguous: their gradients as one [2, E_l, I, H] block, d_w_up empty)
    assert [tuple(g.shape) for g in grads] == [(T, H), (T, k), (2, El, I, H), (0,), (El, H, I)]


def test_fake_implementations_size_the_saved_tensor_by_the_groups_capacity_factor(monkeypatch):
    """A group's capacity_factor sizes the saved pre-activations the fake implementations
    promise (what the real call allocates: mok::saved_elements with the rank's Config), bf16 and
    FP8 alike; 1.5 of a rank of a group of 4 holds fewer rows than the worst case."""
    from mok import fp8_layer, ops

    class Group:  # (what the fake implementations read of an ExpertParallel)
        capacity_factor = 1.5

    group = Group()
    monkeypatch.setitem(ops.ep_groups, 7, group)
    T, H, I, El, E, k = 256, 128, 128, 2, 8, 4
    x, ids, w, gate, down = _meta_rank(T, H, I, El, k)
    _, saved = torch.ops.mok.moe_train_forward(x, ids, w, gate, gate, down, None, None, None, None, E, 7)
    want = _C.ep_saved_elements(H, I, E, El, k, 0, None, T, 1.5)
    assert saved.shape == (want,) and want < _C.ep_saved_elements(H, I, E, El, k, 0, None, T)
    assert ops._fake_saved_elements(x, down, k, None, None, E, ops._capacity_factor(7)) == want
    assert fp8_layer is not None and ops._capacity_factor(ops.ONE_GPU) == 0.0


def test_compiled_ep_training_step_traces_through_the_fake_implementations():
    m = dict(device="meta")
    T, H, I, El, E, k = 16, 128, 64, 2, 8, 4
    ids = torch.zeros(T, k, dtype=torch.int32, **m)
    leaves = [torch.empty(T, H, dtype=torch.bfloat16, **m), torch.empty(T, k, dtype=torch.float32, **m),
              torch.empty(El, I, H, dtype=torch.bfloat16, **m), torch.empty(El, I, H, dtype=torch.bfloat16, **m),
              torch.empty(El, H, I, dtype=torch.bfloat16, **m)]
    for t in leaves:
        t.requires_grad_()

    def step(x, w, gate, up, down):
        y, _ = torch.ops.mok.moe_train_forward(x, ids, w, gate, up, down, None, None, None, None, E, 1)
        return y.float().sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


def test_recompute_fake_implementations_save_nothing_in_a_group():
    """recompute=True in a group (id 1): the train-forward op's saved tensor is empty and the
    backward takes None for it, as on one GPU; a compiled step traces through them."""
    T, H, I, El, E, k = 16, 128, 64, 2, 8, 4
    x, ids, w, gate, down = _meta_rank(T, H, I, El, k)
    y, saved = torch.ops.mok.moe_train_forward(x, ids, w, gate, gate, down, None, None, None, None, E, 1, True)
    assert y.shape == (T, H) and saved.shape == (0,) and saved.dtype == torch.bfloat16
    grads = torch.ops.mok.moe_backward(x, x, ids, w, gate, gate, down, None, None, None, None, None, E, 1)
    assert [tuple(g.shape) for g in grads] == [(T, H), (T, k), (2, El, I, H), (0,), (El, H, I)]
    leaves = [t.clone().requires_grad_() for t in (x, w, gate, gate, down)]

    def step(x, w, gate, up, down):
        y, _ = torch.ops.mok.moe_train_forward(x, ids, w, gate, up, down, None, None, None, None, E, 1, True)
        return y.float().sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


def test_a_recompute_rank_needs_training():
    with pytest.raises(ValueError, match=r"mok.EpRank: recompute=True needs training=True"):
        _C.EpRank(128, 64, 8, 8, 2, 0, None, 16, 0, [0], 0, training=False, recompute=True)


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_forward_without_autograd_runs_on_the_rank_that_trains_its_shape(single_process_group):
    """rank_for(training=False) takes the rank made for training this shape and precision (a save
    or recompute rank: its forward then saves nothing) instead of setting up a second rank; its
    own Training::off rank when it exists already; never a rank of another precision or shape."""
    group = mok.ep.ExpertParallel()
    x, w_down = torch.zeros(16, 64), torch.zeros(4, 64, 32)
    shape = (x.device.index, 16, 64, 32, 4, 4, 2, 0, None)
    trains, other, fp8 = object(), object(), object()
    group._ranks = {shape[:4] + (8,) + shape[5:] + (True, "bf16", False, False): other,  # (another E)
                    shape + (True, "fp8", False, False): fp8,
                    shape + (True, "bf16", False, False): trains}
    assert group.rank_for(x, w_down, 4, 2, 0, None, False) is trains
    assert group.rank_for(x, w_down, 4, 2, 0, None, False, precision="fp8") is fp8
    recomputes = object()
    group._ranks = {shape + (True, "bf16", False, True): recomputes}
    assert group.rank_for(x, w_down, 4, 2, 0, None, False) is recomputes
    off = object()
    group._ranks = {shape + (True, "bf16", False, False): trains, shape + (False, "bf16", False, False): off}
    assert group.rank_for(x, w_down, 4, 2, 0, None, False) is off  # (its own, made first)


def test_group_argument_and_expert_ids_of_the_torch_ep_path_are_checked(single_process_group):
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or None"):
        mok.ep.ExpertParallel("nope")
    f64 = dict(dtype=torch.float64)
    x = torch.randn(4, 64, **f64)
    ids = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2]], dtype=torch.int32)
    w = torch.rand(4, 2, **f64)
    gate, up, down = torch.randn(4, 32, 64, **f64), torch.randn(4, 32, 64, **f64), torch.randn(4, 64, 32, **f64)
    y = mok.moe_torch_ep(x, ids, w, gate, up, down)
    torch.testing.assert_close(y, mok.moe_torch(x, ids, w, gate, up, down), rtol=1e-12, atol=1e-12)
    for bad in (-2, 4):  # (-2 was taken for "no expert", 4 was an IndexError)
        wrong = ids.clone()
        wrong[1, 1] = bad
        with pytest.raises(ValueError, match=r"'topk_ids' has an expert id outside \[-1, 4\)"):
            mok.moe_torch_ep(x, wrong, w, gate, up, down)
    with pytest.raises(ValueError, match=r"'topk_weights' shape must be \(4, 2\), got \(4, 1\)"):
        mok.moe_torch_ep(x, ids, w[:, :1], gate, up, down)
    layer = mok.MoE(64, 32, 4, 2, router=None, backend="torch", dtype=torch.float64,
                    group=mok.ep.ExpertParallel(tokens=2))
    with pytest.raises(ValueError, match="x has 4 tokens, more than the group's tokens = 2"):
        layer(x, ids, w)  # (as the fused path refuses it)


def test_moe_module_with_a_group_holds_its_share_of_the_experts(single_process_group):
    group = mok.ep.ExpertParallel()
    assert group.world == 1 and group.rank == 0
    assert (group.comm_sms, group.ring_rows, group.minibatch_rows) == (0, 0, 4096)
    ring = mok.ep.ExpertParallel(comm_sms=8, ring_rows=8192, minibatch_rows=1024)
    assert (ring.comm_sms, ring.ring_rows, ring.minibatch_rows) == (8, 8192, 1024)
    layer = mok.MoE(128, 64, 8, 2, group=group, device="meta")
    assert layer.w_gate.shape == (8, 64, 128)  # one rank: every expert
    x = torch.empty(4, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    y = layer(x)  # router on meta, then the EP op's fake implementation
    assert y.shape == (4, 128)
    y.float().sum().backward()
    assert layer.w_down.grad.shape == layer.w_down.shape and x.grad.shape == x.shape
    with pytest.raises(TypeError, match="must be a mok.ep.ExpertParallel"):
        mok.MoE(128, 64, 8, 2, group=object(), device="meta")


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_recompute_in_a_group_is_checked(single_process_group, bad):
    group = mok.ep.ExpertParallel()
    x, ids, w, gate, down = _meta_rank(16, 128, 128, 8, 2)
    with pytest.raises(ValueError, match=r"mok.ep.moe: recompute must be True or False, got"):
        mok.ep.moe(x, ids, w, gate, gate, down, group=group, recompute=bad)
    with pytest.raises(ValueError, match=r"mok.ep.moe: recompute=True needs precision='bf16'"):
        mok.ep.moe(x, ids, w, gate, gate, down, group=group, precision="fp8", recompute=True)
    with pytest.raises(ValueError, match=r"mok.ep: a recompute rank trains in bf16"):
        group.rank_for(x, down, 8, 2, 0, None, False, recompute=True)


def test_moe_module_with_a_group_and_recompute_traces_through_the_fake_implementations(single_process_group):
    layer = mok.MoE(128, 64, 8, 2, group=mok.ep.ExpertParallel(), recompute=True, device="meta")
    assert layer.recompute
    x = torch.empty(4, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    y = layer(x)
    assert y.shape == (4, 128)
    y.float().sum().backward()
    assert layer.w_gate.grad.shape == layer.w_gate.shape and x.grad.shape == x.shape


def test_fp8_fake_implementations_give_the_ep_output_metadata():
    # Rank of a group of 4: 2 local experts of E = 8, k = 4; H and I multiples of 128 (FP8's blocks).
    T, H, I, El, E, k = 16, 128, 128, 2, 8, 4
    x, ids, w, gate, down = _meta_rank(T, H, I, El, k)
    none = (None,) * 10  # (the quantized weights: made by the call)
    y = torch.ops.mok.moe_forward_fp8(x, ids, w, gate, gate, down, None, None, None, None, E, 1, *none)
    assert y.shape == (T, H) and y.device.type == "meta"
    y, saved = torch.ops.mok.moe_train_forward_fp8(x, ids, w, gate, gate, down, None, None, None, None, E, 1, *none)
    assert saved.shape == (_C.ep_saved_elements(H, I, E, El, k, 0, None, T),) and saved.dtype == torch.bfloat16


def test_compiled_ep_fp8_training_step_traces_through_the_fake_implementations():
    m = dict(device="meta")
    T, H, I, El, E, k = 16, 128, 128, 2, 8, 4
    ids = torch.zeros(T, k, dtype=torch.int32, **m)
    leaves = [torch.empty(T, H, dtype=torch.bfloat16, **m), torch.empty(T, k, dtype=torch.float32, **m),
              torch.empty(El, I, H, dtype=torch.bfloat16, **m), torch.empty(El, I, H, dtype=torch.bfloat16, **m),
              torch.empty(El, H, I, dtype=torch.bfloat16, **m)]
    for t in leaves:
        t.requires_grad_()
    q = lambda *shape, dtype=torch.float8_e4m3fn: torch.empty(*shape, dtype=dtype, **m)  # noqa: E731
    experts = (q(El, I, H), q(El, 1, 1, dtype=torch.int32), q(El, I, H), q(El, 1, 1, dtype=torch.int32),
               q(El, H, I), q(El, 1, 1, dtype=torch.int32), None, None, None, None)

    def step(x, w, gate, up, down):
        y, _ = torch.ops.mok.moe_train_forward_fp8(x, ids, w, gate, up, down, None, None, None, None, E, 1, *experts)
        return y.float().sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


def test_fp8_in_a_group_is_checked(single_process_group, monkeypatch):
    T, H, I, E, k = 8, 128, 128, 4, 2
    x, ids, w, gate, down = _meta_rank(T, H, I, E, k)
    group = mok.ep.ExpertParallel()
    with torch.no_grad():
        assert mok.ep.moe(x, ids, w, gate, gate, down, group=group, precision="fp8").shape == (T, H)
        with pytest.raises(ValueError, match="precision must be 'bf16' or 'fp8', got 'fp16'"):
            mok.ep.moe(x, ids, w, gate, gate, down, group=group, precision="fp16")
        with pytest.raises(ValueError, match="fp8_experts was given, but precision is 'bf16'"):
            mok.ep.moe(x, ids, w, gate, gate, down, group=group, fp8_experts=object())
        ring = mok.ep.ExpertParallel(comm_sms=2)
        with pytest.raises(ValueError, match=r"the ring \(comm_sms = 2, ring_rows = 0\) carries bf16 rows only"):
            mok.ep.moe(x, ids, w, gate, gate, down, group=ring, precision="fp8")
        q = lambda *shape, dtype=torch.float8_e4m3fn: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
        forward = (q(E, I, H), q(E, 1, 1, dtype=torch.int32), q(E, I, H), q(E, 1, 1, dtype=torch.int32),
                   q(E, H, I), q(E, 1, 1, dtype=torch.int32))
        with pytest.raises(TypeError, match="some of the dgrad operands but not down_t_exponents"):
            mok.ep.moe(x, ids, w, gate, gate, down, group=group, precision="fp8",
                       fp8_experts=mok.fp8.Fp8Experts(*forward, down_t=q(E, I, H)))
    layer = mok.MoE(H, I, E, k, group=group, precision="fp8", fp8_dgrad=True, device="meta")
    asked = []
    monkeypatch.setattr(mok.module, "cached_experts",  # (meta weights: none kept; the op's fake stands in)
                        lambda *args, **kwargs: asked.append(kwargs.get("dgrad")))
    xg = torch.empty(T, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    y = layer(xg)  # router on meta, then the FP8 EP op's fake implementation
    assert y.shape == (T, H) and asked == [True]
    y.float().sum().backward()
    assert layer.w_down.grad.shape == layer.w_down.shape and xg.grad.shape == xg.shape


def _ranks_with_different_e4m3_pulls(rank, world):
    """One process of a gloo pair: rank 0's group pulls E4M3 rows, rank 1's bf16 ones. Each rank
    lays out its tokens for its peers as its own setting says and reads theirs the same way, so
    the first FP8 call must refuse before anything is set up (the exchange would read garbage)."""
    torch.cuda.is_current_stream_capturing = lambda: False  # (a CPU build of PyTorch raises there)
    group = mok.ep.ExpertParallel(pull_fp8_rows=rank == 0)
    T, H, I, E_l = 8, 128, 128, 2
    x, w_down = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(E_l, H, I, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="E4M3 rows pulled"):
        group.rank_for(x, w_down, E_l * world, 2, 0, None, False, precision="fp8")


def _ranks_that_disagree_on_recompute(rank, world):
    """One process of a gloo pair: rank 0 trains its layer with recompute=True, rank 1 saves. Their
    EpRanks would differ (a Training::recompute one and a saving one) and wait on each other's
    calls in the kernels: the first call must refuse, naming the setting."""
    torch.cuda.is_current_stream_capturing = lambda: False  # (a CPU build of PyTorch raises there)
    group = mok.ep.ExpertParallel()
    T, H, I, E_l = 8, 128, 128, 2
    x, w_down = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(E_l, H, I, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="FP8 dgrad, recompute, E4M3 rows"):
        group.rank_for(x, w_down, E_l * world, 2, 0, None, True, recompute=rank == 0)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("worker", [_ranks_with_different_e4m3_pulls, _ranks_that_disagree_on_recompute])
def test_a_group_whose_ranks_pull_rows_differently_or_disagree_on_recompute_is_refused(worker):
    sys.path.insert(0, HERE)
    from process_group import run_in_two_processes

    run_in_two_processes(worker)


def test_a_fixed_token_count_pads_every_call_to_it(single_process_group, monkeypatch):
    """ExpertParallel(tokens=P): a call of T < P tokens reaches the layer as P rows (zeros, no
    expert, weight 0) and returns T rows; gradients flow to the T rows; T > P is refused."""
    seen = []
    layer = mok.ep.call_layer
    monkeypatch.setattr(mok.ep, "call_layer", lambda x, ids, w, *a: seen.append((x, ids, w)) or layer(x, ids, w, *a))
    m = dict(device="meta")
    T, P, H, I, E, k = 10, 16, 128, 64, 4, 2
    x, ids, w, gate, down = _meta_rank(T, H, I, E, k)
    x.requires_grad_(), w.requires_grad_()
    group = mok.ep.ExpertParallel(tokens=P)
    y = mok.ep.moe(x, ids, w, gate, gate, down, group=group)
    assert y.shape == (T, H) and [tuple(t.shape) for t in seen[0]] == [(P, H), (P, k), (P, k)]
    y.float().sum().backward()
    assert x.grad.shape == (T, H) and w.grad.shape == (T, k)
    seen.clear()
    assert mok.ep.moe(torch.empty(P, H, dtype=torch.bfloat16, **m), torch.zeros(P, k, dtype=torch.int32, **m),
                      torch.empty(P, k, **m), gate, gate, down, group=group).shape == (P, H)
    assert tuple(seen[0][0].shape) == (P, H)  # (exactly P: nothing padded)
    with pytest.raises(ValueError, match="x has 17 tokens, more than the group's tokens = 16"):
        mok.ep.moe(torch.empty(17, H, dtype=torch.bfloat16, **m), torch.zeros(17, k, dtype=torch.int32, **m),
                   torch.empty(17, k, **m), gate, gate, down, group=group)
    # the padding itself: zero rows, no expert, weight 0, after the call's own rows
    xs, ids_s, ws = torch.randn(3, 4), torch.tensor([[1, 2], [0, -1], [3, 1]]), torch.rand(3, 2)
    px, pids, pw = mok.ep._padded_tokens(types_group(5), xs, ids_s, ws)
    assert torch.equal(px[:3], xs) and torch.all(px[3:] == 0)
    assert torch.equal(pids[:3], ids_s) and torch.all(pids[3:] == -1) and pids.dtype == ids_s.dtype
    assert torch.equal(pw[:3], ws) and torch.all(pw[3:] == 0)


def types_group(tokens):
    """A stand-in with the one field _padded_tokens reads."""
    import types

    return types.SimpleNamespace(tokens=tokens)


def test_fp8_errors_in_a_group_name_mok_ep_moe(single_process_group):
    T, H, I, E, k = 8, 128, 64, 4, 2  # (I = 64: not a multiple of FP8's 128-blocks)
    x, ids, w, gate, down = _meta_rank(T, H, I, E, k)
    group = mok.ep.ExpertParallel()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"^mok\.ep\.moe: precision='fp8' needs the hidden size"):
            mok.ep.moe(x, ids, w, gate, gate, down, group=group, precision="fp8")
        with pytest.raises(TypeError, match=r"^mok\.ep\.moe: fp8_experts must be what mok\.fp8\.quantize_experts"):
            mok.ep.moe(x, ids, w, gate, gate, down, group=group, precision="fp8", fp8_experts=(1, 2))
