"""bench/ep_bench.py's PyTorch pieces without a GPU: the per-rank expert rows (regrouped by
arithmetic on the counts) against a per-row computation, the compiled pieces against the
eager ones over changing row counts with no recompile, the whole EP layer at W = 1 against
torch_baseline's eager layer, and, in two gloo processes, torch-ep and torch-compiled-ep
against mok.moe_torch_ep (values and gradients). What needs GPUs (mok-ep, NCCL, timing) runs
under torchrun on the GPU machine."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import ep_bench  # noqa: E402
import ep_layers  # noqa: E402
import torch_baseline as tb  # noqa: E402
from process_group import run_in_two_processes  # noqa: E402

H, I = 64, 32
gloo = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                          reason="needs torch.distributed with gloo")


def weights(E, seed):
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).bfloat16()
    w_down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).bfloat16()
    return w_gate_up, w_down


def arrival(counts, seed):
    """Rows as they arrive on a rank: (s, e) segments of counts[s, e] rows, and each row's
    local expert."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.arange(counts.shape[1]).repeat(counts.shape[0]).repeat_interleave(counts.reshape(-1))
    return torch.randn(int(counts.sum()), H, generator=gen).bfloat16(), experts


def per_row(x_in, experts, w_gate_up, w_down, limit):
    """fp32, one row at a time, from the layer's definition."""
    out = []
    for x, e in zip(x_in.float(), experts.tolist()):
        gu = w_gate_up[e].float() @ x
        out.append(w_down[e].float() @ tb.swiglu(gu[:I], gu[I:], limit))
    return torch.stack(out)


@pytest.mark.parametrize("limit", [None, 0.5])
def test_expert_rows_regroup_by_expert_and_return_in_arrival_order(limit):
    counts = torch.tensor([[3, 0, 5, 1], [0, 2, 4, 0], [6, 1, 0, 2]])  # 3 source ranks, 4 local experts
    x_in, experts = arrival(counts, seed=1)
    w_gate_up, w_down = weights(4, seed=2)
    got = ep_layers.expert_rows(x_in, counts, w_gate_up, w_down, limit)
    res = tb.compare(got, per_row(x_in, experts, w_gate_up, w_down, limit))
    assert res["passed"], res


def test_compiled_expert_rows_take_any_row_count_without_recompiling():
    tb.configure_compile()
    torch._dynamo.reset()
    compiled = torch.compile(ep_layers.expert_rows, dynamic=False, fullgraph=True)
    w_gate_up, w_down = weights(4, seed=3)
    gen = torch.Generator().manual_seed(4)
    for call in range(4):
        counts = torch.randint(0, 9, (2, 4), generator=gen)
        counts[0, 0] += 2  # at least 2 rows (dynamo specialises 0 and 1)
        x_in, _ = arrival(counts, seed=10 + call)
        outs = []
        for fn in (ep_layers.expert_rows, compiled):
            leaves = [t.clone().requires_grad_() for t in (x_in, w_gate_up, w_down)]
            if fn is compiled:
                torch._dynamo.mark_dynamic(leaves[0], 0)
            with torch._dynamo.config.patch(error_on_recompile=call > 0):
                y = fn(leaves[0], counts, leaves[1], leaves[2], 0.75)
                y.backward(torch.ones_like(y))
            outs.append([y.detach()] + [t.grad for t in leaves])
        for name, got, want in zip(("y", "dx_in", "d_w_gate_up", "d_w_down"), outs[1], outs[0]):
            res = tb.compare(got, want)
            assert res["passed"], (call, name, res)


def one_rank_layer(x, ids, w, w_gate_up, w_down, limit, compiled):
    """ep_bench's layer with W = 1 and no process group: every row stays on the rank."""
    pieces = (ep_layers.route, ep_layers.expert_rows, ep_layers.combine)
    if compiled:
        pieces = tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in pieces)
    route, experts, combine = pieces
    order, rows, counts = route(x, ids, w_gate_up.shape[0])
    return combine(experts(rows, counts.view(1, -1), w_gate_up, w_down, limit), order, w)


@pytest.mark.parametrize("compiled", [False, True])
def test_one_rank_layer_is_the_one_gpu_layer(compiled):
    tb.configure_compile()
    torch._dynamo.reset()
    T, E, k = 40, 8, 3
    ids, w = tb.make_routing(T, E, k, "zipf1.2", seed=5, device="cpu")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).bfloat16()
    w_gate_up, w_down = weights(E, seed=7)
    _, _, counts = ep_layers.route(x, ids, E)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1).long(), minlength=E))
    outs = []
    for layer in (lambda *a: one_rank_layer(*a, compiled), tb.moe_eager):
        leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up, w_down)]
        y = layer(leaves[0], ids, leaves[1], leaves[2], leaves[3], 0.5)
        y.backward(torch.ones_like(y))
        outs.append([y.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("y", "dx", "d_topk_weights", "d_w_gate_up", "d_w_down"), *outs):
        res = tb.compare(got, want)
        assert res["passed"], (name, res)


def test_rank_routing_is_a_slice_of_one_global_routing():
    p = dict(tokens=64, experts=4, top_k=2)
    whole, _ = tb.make_routing(64 * 3, 12, 2, "zipf1.2", seed=9, device="cpu")
    for rank in range(3):
        ids, w, load, rank_load = ep_layers.rank_routing(p, 3, rank, "zipf1.2", seed=9, device="cpu")
        assert torch.equal(ids, whole[rank * 64:(rank + 1) * 64]) and w.shape == (64, 2)
        assert load == tb.max_load_ratio(whole, 12) and rank_load >= 1.0


def test_exchange_bytes_count_rows_to_and_from_other_ranks_only():
    assert ep_layers.exchange_bytes([5, 7, 1], [2, 9, 4], rank=1, row_bytes=10) == (60, 60)
    assert ep_layers.exchange_bytes([5], [5], rank=0, row_bytes=10) == (0, 0)


def test_rank_bytes_count_every_rank_a_pass_uses(monkeypatch):
    """A pass's bytes outside the allocator are those of the EpRanks it used, whichever pass made
    them: a recompute rank, made by the forward without autograd, counts in the training step too
    (it did not before 2026-12-06); a saving group's two ranks each count in their own pass."""

    class Group:
        def __init__(self, sizes):
            self._ranks, self.sizes, self.made = {}, sizes, 0

        def rank_for(self, key):
            if key not in self._ranks:
                self._ranks[key] = object()
                self.made += self.sizes[key]
            return self._ranks[key]

    class Layer:
        def __init__(self, group, keys):
            self.group, self.keys = group, keys

        def outputs(self, pass_):
            return [self.group.rank_for(k) for k in self.keys[pass_]]

    def grown_by(layer):  # stands in for cudaMemGetInfo's drop over the call
        def measure(fn, device):
            before = layer.group.made
            out = fn()
            return out, layer.group.made - before
        return measure

    recompute = Layer(Group({"recompute": 300}), {"fwd": ["recompute"], "fwd+bwd": ["recompute", "recompute"]})
    saving = Layer(Group({"off": 100, "save": 250}), {"fwd": ["off"], "fwd+bwd": ["save", "save"]})
    for layer, want in ((recompute, {"fwd": 300, "fwd+bwd": 300}), (saving, {"fwd": 100, "fwd+bwd": 250})):
        monkeypatch.setattr(ep_layers, "outside_allocator", grown_by(layer))
        held = {}
        got = {ps: ep_layers.rank_bytes(layer, ps, "cpu", held)[1] for ps in ("fwd", "fwd+bwd")}
        assert got == want
        assert "rank_for" not in vars(layer.group)  # the spy is gone after the call


def test_summary_ratios_are_per_round():
    rec = lambda impl, ms: dict(preset="p", routing="uniform", impl=impl, ms=sorted(ms)[1], ms_repeats=ms,
                                check="passed", nccl_dispatch_gbps=100.0, nccl_combine_gbps=None, **{"pass": "fwd"})
    records = [rec("mok-ep", [1.0, 2.0, 1.0]), rec("torch-ep", [2.0, 3.0, 3.0])]
    assert ep_bench.round_ratio({r["impl"]: r for r in records}, "torch-ep", "mok-ep") == 2.0
    table = ep_bench.summary(records).splitlines()
    assert len(table) == 2 and "100.0" in table[1] and table[1].rstrip().endswith("ok")


def test_ring_sms_adds_one_mok_ep_implementation_per_sm_count(monkeypatch):
    assert ep_bench.ring_impls("4,8") == ("mok-ep-ring4", "mok-ep-ring8")
    assert ep_bench.ring_impls("") == ()
    assert [ep_bench.comm_sms(i) for i in ep_bench.impl_names(ep_bench.ring_impls("4,8"))] == [0] + [4, 8] + [0] * 9
    assert [ep_bench.group_options(i, 1.5) for i in ep_bench.impl_names(ep_bench.ring_impls("4"))] == [
        dict(comm_sms=0), dict(comm_sms=4), dict(pull_tokens_once=True), dict(interleave_rows=4096), None, None, None,
        dict(), dict(pull_fp8_rows=True), dict(), dict(capacity_factor=1.5)]
    # (mok-ep-fp8, its E4M3 pull, mok-ep-recompute, mok-ep-capped: groups of their own)
    with pytest.raises(SystemExit, match="--ring-sms takes positive SM counts, got '0'"):
        ep_bench.ring_impls("4,0")
    monkeypatch.setattr(sys, "argv", ["ep_bench.py", "--ring-sms", "4,8"])
    args = ep_bench.parse_args()
    assert args.all_impls == ("mok-ep", "mok-ep-ring4", "mok-ep-ring8", "mok-ep-once", "mok-ep-interleave",
                              "torch-compiled-ep", "torch-ep", "mok-compute", "mok-ep-fp8", "mok-ep-fp8-e4m3",
                              "mok-ep-recompute", "mok-ep-capped")
    assert args.capacity_factor == 2.0
    assert args.impls == list(ep_bench.IMPLS) + ["mok-ep-ring4", "mok-ep-ring8"]  # whatever --impl says
    monkeypatch.setattr(sys, "argv", ["ep_bench.py", "--impl", "mok-ep,mok-ep-fp8"])  # (FP8: only when named)
    assert ep_bench.parse_args().impls == ["mok-ep", "mok-ep-fp8"]
    monkeypatch.setattr(sys, "argv", ["ep_bench.py", "--impl", "mok-ep,mok-ep-recompute"])  # (only when named too)
    assert ep_bench.parse_args().impls == ["mok-ep", "mok-ep-recompute"]
    monkeypatch.setattr(sys, "argv", ["ep_bench.py", "--impl", "mok-ep,mok-ep-capped", "--capacity-factor", "1.25"])
    args = ep_bench.parse_args()
    assert args.impls == ["mok-ep", "mok-ep-capped"] and args.capacity_factor == 1.25
    monkeypatch.setattr(sys, "argv", ["ep_bench.py", "--impl", "mok-ep-ring8,mok-ep", "--ring-sms", "8"])
    assert ep_bench.parse_args().impls == ["mok-ep-ring8", "mok-ep"]
    monkeypatch.setattr(sys, "argv", ["ep_bench.py", "--impl", "mok-ep-ring8"])  # no --ring-sms 8
    with pytest.raises(SystemExit, match="unknown impl 'mok-ep-ring8'"):
        ep_bench.parse_args()


def test_summary_has_a_column_and_a_ratio_per_ring_implementation():
    rec = lambda impl, ms: dict(preset="p", routing="uniform", impl=impl, ms=ms[0], ms_repeats=ms, check="passed",
                                nccl_dispatch_gbps=None, nccl_combine_gbps=None, **{"pass": "fwd"})
    records = [rec("mok-ep", [2.0]), rec("mok-ep-ring16", [1.0]), rec("mok-ep-ring4", [4.0])]
    head, row = ep_bench.summary(records).splitlines()
    assert head.index("mok-ep ms") < head.index("mok-ep-ring4 ms") < head.index("mok-ep-ring16 ms")
    assert head.index("mok-ep/mok-ep-ring4") < head.index("mok-ep/mok-ep-ring16")
    assert row.split()[3:8] == ["2.000", "4.000", "1.000", "-", "-"]  # ms, then the fixed ratios (absent)
    assert row.split()[-5:-3] == ["0.500", "2.000"]  # mok-ep / ring4, mok-ep / ring16


# ---------------------------------------------------------------------------------------
# Two gloo processes: the EP layers against mok.moe_torch_ep
# ---------------------------------------------------------------------------------------

def _ep_rank(rank, world):
    import mok

    tb.configure_compile()
    T, E_l, k = 24, 3, 2
    w_gate_up, w_down = weights(E_l * world, seed=11)
    mine = slice(rank * E_l, (rank + 1) * E_l)
    layers = {"torch-ep": ep_layers.TorchEp(), "torch-compiled-ep": ep_layers.TorchEp(compiled=True)}
    for call, kind in enumerate(("zipf1.2", "uniform", "zipf1.2")):  # row counts change every call
        p = dict(tokens=T, experts=E_l, top_k=k)
        ids, w, _, _ = ep_layers.rank_routing(p, world, rank, kind, seed=12 + call, device="cpu")
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 * rank + call)).bfloat16()
        outs = {}
        for name, layer in list(layers.items()) + [("moe_torch_ep", None)]:
            leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up[mine], w_down[mine])]
            with torch._dynamo.config.patch(error_on_recompile=call > 0):
                if layer is None:
                    gate, up = leaves[2].split(I, dim=1)
                    y = mok.moe_torch_ep(leaves[0], ids, leaves[1], gate, up, leaves[3], swiglu_limit=0.75)
                else:
                    y = layer(leaves[0], ids, leaves[1], leaves[2], leaves[3], 0.75)
                y.backward(torch.ones_like(y))
            outs[name] = [y.detach()] + [t.grad for t in leaves]
        for name in layers:
            for what, got, want in zip(("y", "dx", "d_topk_weights", "d_w_gate_up", "d_w_down"), outs[name],
                                       outs["moe_torch_ep"]):
                res = tb.compare(got, want)
                assert res["passed"], (rank, call, name, what, res)


@gloo
def test_torch_ep_and_torch_compiled_ep_match_moe_torch_ep_in_two_processes():
    run_in_two_processes(_ep_rank)


def test_fp8_check_carries_the_worst_rel_and_cos_that_run_preset_gathers():
    """run_preset reads checks[impl][pass]["rel"] and ["cos"] of every implementation that ran
    (gathered over the ranks): mok-ep-fp8's fp8_check must carry them as check_outputs does."""
    import mok_impls

    gen = torch.Generator().manual_seed(3)
    ref = {"y": torch.randn(64, H, generator=gen), "dx": torch.randn(64, H, generator=gen)}
    out = {"y": ref["y"] * 1.001, "dx": ref["dx"] + 0.05 * torch.randn(64, H, generator=gen)}
    fp8, bf16 = mok_impls.fp8_check(out, ref), ep_layers.check_outputs(out, ref)
    for c in (fp8, bf16):
        assert {"passed", "rel", "cos", "tensors"} <= set(c)
    assert fp8["rel"] == max(t["rel"] for t in fp8["tensors"].values()) == fp8["tensors"]["dx"]["rel"]
    assert fp8["cos"] == min(t["cos"] for t in fp8["tensors"].values()) == fp8["tensors"]["dx"]["cos"]
    assert fp8["passed"] and fp8["cos"] < 1.0
