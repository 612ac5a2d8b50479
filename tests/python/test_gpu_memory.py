"""mok.moe's memory on a Hopper GPU: one workspace per layer shape for every token count and
both modes, scratch from PyTorch's allocator, and the backward's rows in the gradients. Skipped
without one."""

import pytest
import torch

import mok
from gpu_helpers import check_forward as _check
from gpu_helpers import leaf as _leaf
from gpu_helpers import needs_hopper
from gpu_helpers import problem as _problem

pytestmark = needs_hopper


def test_backward_rows_across_both_gate_up_gradients_give_the_bits_of_apart():
    """mok.moe's eager backward allocates d_w_gate and d_w_up as one block (a concatenated
    [E, 2I, H] gradient is one): the routed dy rows and w*h may then span both gradients. At this
    shape the dy rows fit only across both, so the block's scratch is smaller; the gradients are
    bitwise those of a backward with the two gradients apart, and a backward whose gradients are
    apart (and whose dx, over dy, takes no rows) refuses the block's smaller scratch, naming it."""
    from mok import _C, ops
    from torch.utils.dlpack import to_dlpack

    T, H, I, E, k = 384, 512, 256, 4, 2
    x, ids, w, gate, up, down, _ = _problem(T=T, H=H, I=I, E=E, k=k, seed=41)
    dy = torch.randn_like(x)
    ws = ops._workspace(x, down, k, 0, None)
    apart, block = ws.backward_scratch_bytes(False, T, False), ws.backward_scratch_bytes(False, T, True)
    assert block < apart

    # The reference: the extension's backward with the two gradients apart, in a scratch of the apart figure.
    _, saved = ops._run_forward(x, ids, w, gate, up, down, None, None, None, None, E, ops.ONE_GPU, training=True)
    grads = ops._empty_grads(x, w, gate, up, down, None, None, None)
    spacer = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # (keeps the next block from abutting)
    grads[3] = torch.empty_like(up)
    assert not ops._gate_up_adjacent(grads[2], grads[3])
    tensors = ops._capsules((x, ids, w, gate, up, down, None, None, None, saved, dy, *grads, None, None, None))
    scratch = torch.empty(apart, dtype=torch.uint8, device="cuda")
    _C.backward(ws, *tensors, ops._stream(x), scratch=to_dlpack(scratch))
    dx, dw, d_gate, d_up, d_down = grads[0], grads[1], grads[2], grads[3], grads[4]
    del spacer

    def run(*weights):
        leaves = [_leaf(t) for t in (x, w) + weights + (down,)]
        y = mok.moe(leaves[0], ids, leaves[1], *leaves[2:-1], leaves[-1]) if len(weights) == 2 else \
            mok.moe(leaves[0], ids, leaves[1], leaves[2], None, leaves[3])
        y.backward(dy)
        return [t.grad for t in leaves]

    dx2, dw2, d_gate2, d_up2, d_down2 = run(gate, up)
    assert d_up2.data_ptr() == d_gate2.data_ptr() + d_gate2.nbytes  # (one block)
    dx3, dw3, d_gate_up, d_down3 = run(torch.cat([gate, up], dim=1))
    for got in ((dx2, dw2, d_gate2, d_up2, d_down2), (dx3, dw3, d_gate_up[:, :I], d_gate_up[:, I:], d_down3)):
        for a, b in zip(got, (dx, dw, d_gate, d_up, d_down)):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)

    # (dx over dy: no dx space, so the dy rows that miss d_w_gate stay in the scratch)
    _, saved = ops._run_forward(x, ids, w, gate, up, down, None, None, None, None, E, ops.ONE_GPU, training=True)
    dx_over_dy = dy.clone()
    tensors = ops._capsules((x, ids, w, gate, up, down, None, None, None, saved, dx_over_dy, dx_over_dy, *grads[1:],
                             None, None, None))
    with pytest.raises(ValueError, match="argument 'scratch'"):
        _C.backward(ws, *tensors, ops._stream(x), scratch=to_dlpack(scratch[:block]))


def test_backward_column_blocks_setting_gives_the_bits_of_the_default():
    """mok.set_backward_column_blocks(1): the layer's next workspace keeps x's routed rows whole
    in one backward launch (the default takes them in two column blocks): the same gradients bit
    for bit, and a backward scratch larger by exactly the x rows' other half."""
    from mok import ops

    T, H, I, E, k = 300, 512, 256, 4, 2
    x, ids, w, gate, up, down, _ = _problem(T=T, H=H, I=I, E=E, k=k, seed=57)
    dy = torch.randn_like(x)

    def step():
        leaves = [t.clone().requires_grad_(True) for t in (x, w, gate, up, down)]
        y = mok.moe(leaves[0], ids, *leaves[1:])
        y.backward(dy)
        ws = ops._workspace(x, down, k, 0, None)
        return [t.grad for t in leaves], ws

    blocked, ws_blocked = step()
    try:
        mok.set_backward_column_blocks(1)
        whole, ws_whole = step()
    finally:
        mok.set_backward_column_blocks(0)
    assert ws_whole is not ws_blocked
    for a, b in zip(blocked, whole):
        assert torch.equal(a, b)
    # (the other 256 columns of every plan row: 2 bytes x capacity rows, capacity >= T k)
    grow = ws_whole.backward_scratch_bytes(False, T, True) - ws_blocked.backward_scratch_bytes(False, T, True)
    assert grow % (2 * (H - 256)) == 0 and grow // (2 * (H - 256)) >= T * k


def test_recompute_in_column_blocks_gives_the_bits_of_one_block():
    """mok.moe(..., recompute=True) runs its backward in one column block by default; with
    mok.set_backward_column_blocks(2) in two (the recompute's GEMM1 on whole x rows, then the first
    block's columns gathered over them): the gradients bit for bit those of one block and of the
    saving layer, at the same backward scratch (the x rows' room holds whole rows either way)."""
    from mok import ops

    T, H, I, E, k = 300, 768, 256, 4, 2
    x, ids, w, gate, up, down, _ = _problem(T=T, H=H, I=I, E=E, k=k, seed=58)
    dy = torch.randn_like(x)

    def step(recompute):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, gate, up, down)]
        y = mok.moe(leaves[0], ids, *leaves[1:], recompute=recompute)
        y.backward(dy)
        ws = ops._workspace(x, down, k, 0, None, recompute=recompute)
        return [t.grad for t in leaves], ws

    saving, _ = step(False)
    one, ws_one = step(True)
    try:
        mok.set_backward_column_blocks(2)
        two, ws_two = step(True)
    finally:
        mok.set_backward_column_blocks(0)
    assert ws_two is not ws_one
    for a, b, c in zip(one, two, saving):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert ws_two.backward_scratch_bytes(False, T, True) == ws_one.backward_scratch_bytes(False, T, True)


def test_evaluation_and_training_share_one_workspace():
    """An evaluation call under no_grad and a training step of the same shape use one
    workspace (a training workspace also serves inference): no second copy of the buffers."""
    from mok import ops

    x, ids, w, gate, up, down, _ = _problem(T=211, H=256, I=128, E=4, seed=9)
    before = len(ops._workspaces)
    with torch.no_grad():
        y_eval = mok.moe(x, ids, w, gate, up, down)
    params = [t.clone().requires_grad_(True) for t in (w, gate, up, down)]
    y_train = mok.moe(x, ids, *params)
    y_train.float().sum().backward()
    assert len(ops._workspaces) == before + 1
    assert torch.equal(y_eval, y_train.detach())


def test_one_workspace_serves_every_token_count():
    """Variable batch or sequence lengths: one workspace per layer shape, grown to the largest
    T seen. After 120 distinct token counts (forward + backward each) the device memory held
    (cudaMemGetInfo, with PyTorch's cache emptied) is what it was after the largest one, and a
    T's results do not depend on the workspace's size (bitwise) and match the reference."""
    from mok import ops

    H, I, E, k, t_max = 256, 128, 8, 2, 1000
    rng = torch.Generator().manual_seed(31)
    counts = (torch.randperm(t_max - 1, generator=rng)[:120] + 1).tolist()  # distinct, in [1, t_max)
    x, ids, w, gate, up, down, _ = _problem(T=t_max, H=H, I=I, E=E, seed=33)
    params = [t.clone().requires_grad_(True) for t in (gate, up, down)]
    key_count = len(ops._workspaces)

    def step(T):  # (results kept on the host: on the GPU they would be what grows)
        xs = x[:T].clone().requires_grad_(True)
        y = mok.moe(xs, ids[:T], w[:T], *params)
        y.float().square().sum().backward()
        return y.detach().cpu(), xs.grad.cpu()

    small = step(counts[0])  # in a workspace made for counts[0] tokens
    step(t_max)  # grows it to t_max
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    results = {T: step(T) for T in counts}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_after = torch.cuda.mem_get_info()[0]
    assert len(ops._workspaces) == key_count + 1
    assert ops._workspace(x, down, k, 0, None).max_tokens == t_max
    assert free_before - free_after < 2 << 20, f"{(free_before - free_after) / 2**20:.1f} MiB more held after {len(counts)} token counts"
    assert torch.equal(results[counts[0]][0], small[0]) and torch.equal(results[counts[0]][1], small[1])
    for T in sorted(counts)[:3] + sorted(counts)[-2:]:
        _check(results[T][0].cuda(), (x[:T], ids[:T], w[:T], gate, up, down, None))
        with torch.no_grad():  # the forward alone, again: bitwise the same
            assert torch.equal(mok.moe(x[:T], ids[:T], w[:T], gate, up, down).cpu(), results[T][0])


def test_scratch_comes_from_pytorch_and_backward_needs_less_than_forward():
    """The op hands each call its scratch from PyTorch's caching allocator (the workspace
    keeps none), and with bf16 gradients the backward keeps its dy rows and w*h in the
    W_gate / W_up gradient buffers: its scratch is no larger than the forward's (bf16 slots
    with the x rows under them). With f32 gradients those rows are scratch too."""
    from mok import ops

    x, ids, w, gate, up, down, _ = _problem(T=300, H=256, I=512, E=8, seed=12)
    params = [t.clone().requires_grad_(True) for t in (w, gate, up, down)]
    mok.moe(x, ids, *params).float().sum().backward()
    torch.cuda.synchronize()
    ws = ops._workspace(x, down, ids.shape[1], 0, None)
    assert ws.bytes < ws.forward_scratch_bytes()  # plan, counters, partials: no scratch of its own
    assert ws.backward_scratch_bytes(False) <= ws.forward_scratch_bytes()
    assert ws.backward_scratch_bytes(False) < ws.backward_scratch_bytes(True)
    assert ws.forward_scratch_bytes(100) < ws.forward_scratch_bytes()  # a call's scratch follows its T
    assert all(torch.isfinite(p.grad).all() for p in params)


def test_backward_dy_rows_continued_in_dx_give_the_bits_of_dy_rows_in_scratch():
    """mok.moe's backward lets the routed dy rows that miss the gate/up gradient block continue
    in dx (a tensor of its own, written last): its scratch is smaller than with dx over dy, and
    its gradients are bitwise those of the extension's backward whose dx is dy's storage (dx
    then takes no rows: they stay in the scratch of the larger figure)."""
    from mok import _C, ops
    from torch.utils.dlpack import to_dlpack

    T, H, I, E, k = 2048, 256, 256, 8, 2
    x, ids, w, gate, up, down, _ = _problem(T=T, H=H, I=I, E=E, k=k, seed=43)
    dy = torch.randn_like(x)
    ws = ops._workspace(x, down, k, 0, None)
    kept, apart = ws.backward_scratch_bytes(False, T, True, False), ws.backward_scratch_bytes(False, T, True, True)
    assert apart < kept

    _, saved = ops._run_forward(x, ids, w, gate, up, down, None, None, None, None, E, ops.ONE_GPU, training=True)
    grads = ops._empty_grads(x, w, gate, up, down, None, None, None, paired=True)
    d_gate, d_up = ops._gate_up_grads(grads, up)
    dx_over_dy = dy.clone()  # dx and dy one tensor: no dx space
    tensors = ops._capsules((x, ids, w, gate, up, down, None, None, None, saved, dx_over_dy, dx_over_dy, grads[1],
                             d_gate, d_up, grads[4], None, None, None))
    scratch = torch.full((kept,), 0xff, dtype=torch.uint8, device="cuda")
    _C.backward(ws, *tensors, ops._stream(x), scratch=to_dlpack(scratch))
    expected = (dx_over_dy, grads[1], d_gate, d_up, grads[4])

    leaves = [_leaf(t) for t in (x, w, gate, up, down)]
    mok.moe(leaves[0], ids, *leaves[1:]).backward(dy)
    for got, want in zip([t.grad for t in leaves], expected):
        assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
                           want.view(torch.int16) if want.dtype == torch.bfloat16 else want)
