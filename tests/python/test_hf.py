"""mok as a Hugging Face transformers experts implementation, on four MoE model classes
(tiny random configs, nothing downloaded). On the CPU the glue runs over mok.moe_torch
("mok_torch"); on a Hopper GPU the fused kernel ("mok") runs against the model's eager path."""

import types

import pytest
import torch

import mok

transformers = pytest.importorskip("transformers")
moe_interface = pytest.importorskip("transformers.integrations.moe")
import mok.hf  # noqa: E402

mok.hf.register()

hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
COMMON = dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _config(name):
    t = transformers
    if name == "qwen3_moe":
        return t.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                                num_experts_per_tok=2, head_dim=32, norm_topk_prob=True)
    if name == "mixtral":
        return t.MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    if name == "olmoe":
        return t.OlmoeConfig(**COMMON, intermediate_size=64, num_experts=8, num_experts_per_tok=2)
    return t.DeepseekV3Config(**COMMON, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8,
                              num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                              first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=16, v_head_dim=32)


MODELS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"]


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _models(name, impls, dtype, device):
    torch.manual_seed(0)
    first = transformers.AutoModelForCausalLM.from_config(_config(name), experts_implementation=impls[0], dtype=dtype)
    out = [first.to(device)]
    for impl in impls[1:]:
        m = transformers.AutoModelForCausalLM.from_config(_config(name), experts_implementation=impl, dtype=dtype)
        m.load_state_dict(first.state_dict())
        out.append(m.to(device))
    return out


def _probe(name, forward):
    """Registers `forward` as experts implementation `name`, counting its calls (the list returned),
    so that a silent fall-back to the eager experts cannot pass for it."""
    calls = []
    moe_interface.ExpertsInterface.register(name, lambda self, *a: calls.append(1) or forward(self, *a))
    return calls


@pytest.mark.parametrize("name", MODELS)
def test_glue_matches_eager_on_cpu(name, monkeypatch):
    calls = _probe("mok_torch_probe", mok.hf.mok_torch_experts_forward)
    eager, ours = _models(name, ["eager", "mok_torch_probe"], torch.float32, "cpu")
    ids = torch.randint(0, 128, (2, 9))
    (a, ga), (b, gb) = _logits_and_grads(eager, ids), _logits_and_grads(ours, ids)
    assert calls, "the registered experts function was not called"
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_unsupported_experts_module_is_named():
    module = types.SimpleNamespace(has_bias=True, config=types.SimpleNamespace(hidden_act="silu"))
    with pytest.raises(ValueError, match="has_bias = True is not supported"):
        mok.hf.mok_experts_forward(module, None, None, None)
    module = types.SimpleNamespace(config=types.SimpleNamespace(hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act = 'gelu'"):
        mok.hf.mok_experts_forward(module, None, None, None)


def test_gating_other_than_silu_times_up_is_refused():
    """Experts classes with their own `_apply_gate` (transformers >= 5.2x: DeepSeek-V4's clamp,
    MiniMax-M3's alpha·sigmoid, softcaps) ran silu(gate) * up here and gave wrong outputs (a
    review measured logits 1.09 relative error on a DeepSeek-V4 model); the module's act_fn, not
    the config's hidden_act, is what the default gate calls."""
    class Experts(torch.nn.Module):
        def __init__(self, act_fn, hidden_act=None):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 4))
            self.act_fn, self.config = act_fn, types.SimpleNamespace(hidden_act=hidden_act)

    w = mok.hf._expert_weights(Experts(torch.nn.functional.silu))  # (Lfm2: act_fn silu, no hidden_act)
    assert w[0].shape == (2, 8, 4) and w[1] is None
    with pytest.raises(ValueError, match="act_fn = .* is not SiLU"):
        mok.hf._expert_weights(Experts(torch.nn.GELU(), hidden_act="silu"))
    default_gate = getattr(pytest.importorskip("transformers.integrations.moe"), "_default_apply_gate", None)
    if default_gate is None:
        pytest.skip("this transformers has no _apply_gate (no experts class defines its own)")

    class Clamped(Experts):  # (DeepSeek-V4's gating: mok's swiglu_limit)
        limit = 10.0

        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)

    class NoLimitFound(Clamped):
        limit = None

        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)

    class Softcapped(Clamped):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(10.0 * torch.tanh(gate / 10.0)) * up

    class Default(Experts):
        _apply_gate = default_gate

    clamped = Clamped(torch.nn.functional.silu)
    mok.hf._expert_weights(clamped)
    assert mok.hf._swiglu_limit(clamped) == 10.0
    for wrong in (NoLimitFound, Softcapped):
        with pytest.raises(ValueError, match=f"{wrong.__name__} defines its own gating .* not mok's"):
            mok.hf._expert_weights(wrong(torch.nn.functional.silu))
    mok.hf._expert_weights(Default(torch.nn.SiLU()))
    assert mok.hf._swiglu_limit(Default(torch.nn.SiLU())) is None

    class OwnButPlain(Experts):  # (its own _apply_gate, no clamp: plain SwiGLU, no limit)
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate) * up

    plain = OwnButPlain(torch.nn.functional.silu)
    mok.hf._expert_weights(plain)
    assert mok.hf._swiglu_limit(plain) is None
    # the clamp reaches the layer: the glue over moe_torch against the module's own gating
    x = torch.randn(6, 4) * 20
    ids = torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1], [0, 1], [1, 0]])
    weights = torch.rand(6, 2)
    y = mok.hf.mok_torch_experts_forward(clamped, x, ids, weights)
    want = torch.zeros(6, 4)
    for t in range(6):
        for j in range(2):
            e = ids[t, j]
            h = clamped._apply_gate(x[t] @ clamped.gate_up_proj[e].T)
            want[t] += weights[t, j] * (h @ clamped.down_proj[e].T)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", MODELS)
def test_fused_kernel_matches_eager_on_gpu(name):
    # The fused kernel in bf16 must be about as close to the fp32 eager model as the
    # model's own bf16 eager path is (logits and every gradient). The registered function is
    # probed, so a silent fall-back to the eager experts cannot pass for the kernel.
    calls = _probe("mok_probe", mok.hf.mok_experts_forward)
    ref, eager, ours = _models(name, ["eager", "eager", "mok_probe"], torch.float32, "cuda")
    eager.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = torch.randint(0, 128, (4, 64), device="cuda")
    (r, gr), (e, ge), (m, gm) = (_logits_and_grads(x, ids) for x in (ref, eager, ours))
    assert calls, "the fused experts function was not called"
    assert torch.isfinite(m).all()
    assert _rel(m, r) <= 2 * _rel(e, r) + 1e-3, (_rel(m, r), _rel(e, r))
    for n in gr:
        assert _rel(gm[n], gr[n]) <= 2 * _rel(ge[n], gr[n]) + 1e-3, (n, _rel(gm[n], gr[n]), _rel(ge[n], gr[n]))


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", MODELS)
def test_recompute_experts_give_the_bits_of_mok_on_gpu(name):
    # "mok_recompute" (nothing saved for the backward, GEMM1 run again): logits and every
    # gradient bitwise "mok"'s, the fused function probed as above (eager attention: its
    # backward is deterministic, SDPA's need not be; DeepSeek-V3's eager attention takes no
    # fewer key/value heads than heads: transformers 5.17 fails on COMMON's 2 of 4 there).
    calls = _probe("mok_recompute_probe", mok.hf.mok_recompute_experts_forward)
    models = []
    for impl in ("mok", "mok_recompute_probe"):
        config = _config(name)
        if name == "deepseek_v3":
            config.num_key_value_heads = config.num_attention_heads
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=impl,
                                                          attn_implementation="eager", dtype=torch.bfloat16)
        models.append(m.to("cuda"))
    saving, recomputing = models
    ids = torch.randint(0, 128, (4, 64), device="cuda")
    (a, ga), (b, gb) = _logits_and_grads(saving, ids), _logits_and_grads(recomputing, ids)
    mok.check()
    assert calls, "the recompute experts function was not called"
    assert torch.equal(a, b) and ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_fp8_experts_are_close_to_bf16_on_gpu():
    # "mok_fp8" (the routed experts' forward in FP8, the bf16 backward): logits and every
    # gradient within FP8's error of "mok"'s (expert sizes multiples of 128, as FP8 needs).
    # (a config each: from_config records the experts implementation on the config it is given,
    # so two models from one config object would both run the second one)
    config = lambda: transformers.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=128,  # noqa: E731
                                                 num_experts=8, num_experts_per_tok=2, head_dim=32, norm_topk_prob=True)
    torch.manual_seed(0)
    models = []
    for impl in ("mok", "mok_fp8"):
        m = transformers.AutoModelForCausalLM.from_config(config(), experts_implementation=impl, dtype=torch.bfloat16)
        if models:
            m.load_state_dict(models[0].state_dict())
        models.append(m.to("cuda"))
    ids = torch.randint(0, 128, (4, 64), device="cuda")
    (b, gb), (f, gf) = (_logits_and_grads(m, ids) for m in models)
    mok.check()
    cos = lambda a, c: float((a * c).sum() / (a.norm() * c.norm()))  # noqa: E731
    assert torch.isfinite(f).all() and cos(f, b) > 0.99 and _rel(f, b) > 0
    for n in gb:
        assert torch.isfinite(gf[n]).all() and cos(gf[n], gb[n]) > 0.98, n


def _rank_experts(experts, rank, ranks, flagged):
    """Rank `rank` of `ranks` under transformers' expert parallelism, as its EP plan leaves the
    experts module: its share of the weights, num_experts the local count, and (flagged True, as
    transformers >= 5.2x marks it; None: a transformers without the flag) _is_expert_parallel."""
    import copy

    local = copy.deepcopy(experts)
    E_l = experts.num_experts // ranks
    mine = slice(rank * E_l, (rank + 1) * E_l)
    local.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[mine].clone())
    local.down_proj = torch.nn.Parameter(experts.down_proj.detach()[mine].clone())
    local.num_experts = E_l
    if flagged:
        local._is_expert_parallel = True
    elif "_is_expert_parallel" in vars(local):
        del local._is_expert_parallel
    return local


@pytest.mark.parametrize("flagged,ranks", [(True, 2), (None, 2), (True, 8)])
def test_expert_parallel_ranks_add_up_to_the_whole_layer_on_cpu(flagged, ranks, monkeypatch):
    """Each rank's experts module sees every token with local ids and a sentinel (= its expert count)
    where a slot's expert is another rank's, that slot's weight zeroed (transformers' EP router);
    the glue's partial outputs summed over the ranks are the whole layer's output, and its weight,
    x and routing-weight gradients the whole layer's (on the CPU, over mok.moe_torch). Unflagged
    (older transformers), the ranks are taken to be in a process group, as expert parallelism needs.
    8 ranks of 8 experts: one expert a rank, fewer than top_k = 2 (Mixtral at EP 8): the glue keeps
    each token's slots on the rank (mok.moe takes k <= E; found by review 2026-12-05)."""
    monkeypatch.setattr(mok.hf, "_in_process_group", lambda: True)
    experts = _models("qwen3_moe", ["mok_torch"], torch.float32, "cpu")[0].model.layers[0].mlp.experts
    E, k, T = experts.num_experts, 2, 24
    assert E % ranks == 0 and (ranks < 8 or E // ranks < k)
    E_l = E // ranks
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, experts.gate_up_proj.shape[2], generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    whole = mok.hf.mok_torch_experts_forward(experts, xa, ids, wa)
    dy = torch.randn(whole.shape, generator=gen)
    whole.backward(dy)
    total, dx, dw = torch.zeros_like(whole), torch.zeros_like(x), torch.zeros_like(w)
    for r in range(ranks):
        local = _rank_experts(experts, r, ranks, flagged)
        mine = ids // E_l == r
        lids = torch.where(mine, ids % E_l, torch.full_like(ids, E_l))
        xb, wb = x.clone().requires_grad_(), w.masked_fill(~mine, 0.0).requires_grad_()
        part = mok.hf.mok_torch_experts_forward(local, xb, lids, wb)
        part.backward(dy)
        total += part.detach()
        dx += xb.grad
        dw += wb.grad.masked_fill(~mine, 0.0)  # (transformers masks the other ranks' slots)
        assert torch.all(wb.grad[~mine] == 0), "a sentinel slot's weight got a gradient"
        for name in ("gate_up_proj", "down_proj"):
            torch.testing.assert_close(getattr(local, name).grad, getattr(experts, name).grad[r * E_l:(r + 1) * E_l],
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")
    torch.testing.assert_close(total, whole.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, xa.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, wa.grad, rtol=1e-5, atol=1e-6)


def test_a_module_flagged_not_expert_parallel_keeps_its_ids(monkeypatch):
    module = types.SimpleNamespace(_is_expert_parallel=False)
    ids = torch.tensor([[0, 8], [3, 9]])
    assert torch.equal(mok.hf._routing(module, ids, 8), ids)  # (mok.moe then reports id 8 as out of range)
    module._is_expert_parallel = True
    assert torch.equal(mok.hf._routing(module, ids, 8), torch.tensor([[0, -1], [3, -1]]))
    # Unflagged (older transformers): sentinels only where expert parallelism is possible at all
    unflagged = types.SimpleNamespace()
    monkeypatch.setattr(mok.hf, "_in_process_group", lambda: True)
    assert torch.equal(mok.hf._routing(unflagged, ids, 8), torch.tensor([[0, -1], [3, -1]]))
    monkeypatch.setattr(mok.hf, "_in_process_group", lambda: False)
    assert torch.equal(mok.hf._routing(unflagged, ids, 8), ids)


def test_an_out_of_range_id_outside_a_process_group_is_an_error_not_a_dropped_slot():
    """A single-process model whose router gives an id >= num_experts (a bug): the glue keeps the
    id and the layer names it, where transformers' grouped_mm path would skip the slot."""
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    experts = _models("qwen3_moe", ["mok_torch"], torch.float32, "cpu")[0].model.layers[0].mlp.experts
    x = torch.randn(3, experts.gate_up_proj.shape[2])
    ids = torch.tensor([[0, 1], [2, experts.num_experts], [4, 5]])
    with pytest.raises(RuntimeError, match=rf"expert id outside \[-1, {experts.num_experts}\)"):
        mok.hf.mok_torch_experts_forward(experts, x, ids, torch.rand(3, 2))


def test_a_process_group_makes_expert_parallelism_possible(tmp_path):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    assert not mok.hf._in_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert mok.hf._in_process_group()
    finally:
        dist.destroy_process_group()
    assert not mok.hf._in_process_group()


def _expert_parallel_styles():
    """The expert parallelism this transformers offers: DistributedConfig(ep_size=...) with its
    all_reduce and all_to_all implementations (>= 5.2x), or enable_expert_parallel over the TP
    group (earlier 5.x: "tp"); none without transformers.distributed."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return []
    fields = getattr(DistributedConfig, "__dataclass_fields__", {})
    if "ep_size" in fields:
        return ["all_reduce", "all_to_all"]
    return ["tp"] if "enable_expert_parallel" in fields else []


@pytest.mark.skipif(not _expert_parallel_styles(), reason="needs a transformers with expert parallelism")
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("implementation", _expert_parallel_styles() or ["none"])
def test_transformers_expert_parallelism_over_two_cpu_processes(implementation, tmp_path):
    """The glue under transformers' own expert parallelism (its EP plans, router sentinels and
    sharded experts; two gloo processes on the CPU, over mok.moe_torch): logits and expert
    gradients as the whole model's with transformers' eager experts."""
    pytest.importorskip("accelerate")  # (transformers loads a distributed model through it)
    import os
    import subprocess
    import sys

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe"), dtype=torch.float32).save_pretrained(tmp_path)
    worker = os.path.join(os.path.dirname(__file__), "hf_ep_worker.py")
    # CPU processes also on a GPU machine: transformers' distributed set-up otherwise binds each
    # rank to cuda:LOCAL_RANK, which a one-GPU machine lacks for rank 1.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", worker,
                          str(tmp_path), implementation], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("match the whole model") == 2, run.stdout[-2000:]


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_expert_parallel_ranks_add_up_to_the_whole_layer_on_gpu():
    """The fused kernel ("mok") on a rank's experts with transformers' sentinel ids: the ranks'
    partial outputs add up to the whole layer's (bf16: each partial is rounded, so within bf16's
    error), and a sentinel slot's routing weight gets an exactly zero gradient."""
    experts = _models("qwen3_moe", ["mok"], torch.bfloat16, "cuda")[0].model.layers[0].mlp.experts
    E, k, T, ranks = experts.num_experts, 2, 64, 2
    E_l = E // ranks
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, experts.gate_up_proj.shape[2], generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).cuda()
    w = torch.rand(T, k, generator=gen).cuda()
    whole = mok.hf.mok_experts_forward(experts, x, ids, w).float()
    total = torch.zeros_like(whole)
    for r in range(ranks):
        local = _rank_experts(experts, r, ranks, True)
        mine = ids // E_l == r
        wb = w.masked_fill(~mine, 0.0).requires_grad_()
        part = mok.hf.mok_experts_forward(local, x, torch.where(mine, ids % E_l, torch.full_like(ids, E_l)), wb)
        part.float().pow(2).sum().backward()
        mok.check()
        assert torch.all(wb.grad[~mine] == 0) and torch.isfinite(part).all()
        total += part.detach().float()
    assert _rel(total, whole) < 1e-2, _rel(total, whole)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_a_rank_no_token_picked_adds_nothing_on_gpu():
    """Under transformers' EP a rank whose experts no token picked (a short batch over many ranks)
    gets only sentinel ids: every slot -1 to the fused kernel. Its output is zero, and its routing
    weights' and experts' gradients are zero and finite. (Random routing weights and dy: with
    zeros, a sentinel sent to a local expert would also give zeros.)"""
    experts = _models("qwen3_moe", ["mok"], torch.bfloat16, "cuda")[0].model.layers[0].mlp.experts
    local = _rank_experts(experts, 3, 4, True)  # (experts 6 and 7 of 8)
    T, k = 5, 2
    x = torch.randn(T, experts.gate_up_proj.shape[2], device="cuda").bfloat16().requires_grad_()
    ids = torch.full((T, k), local.num_experts, device="cuda")  # (all routed to other ranks)
    w = torch.rand(T, k, device="cuda", requires_grad=True)
    y = mok.hf.mok_experts_forward(local, x, ids, w)
    y.float().backward(torch.randn(y.shape, device="cuda"))
    mok.check()
    assert torch.all(y == 0)
    for g in (x.grad, w.grad, local.gate_up_proj.grad, local.down_proj.grad):
        assert g is not None and torch.isfinite(g.float()).all() and torch.all(g == 0)


def test_fp32_weights_under_bf16_autocast_reach_the_kernel_as_bf16(monkeypatch):
    """HF Trainer's bf16=True keeps fp32 weights under autocast: the "mok" glue casts x and the
    expert weights to bf16 as autocast casts a linear layer's (the fused kernel takes bf16 only),
    and the fp32 weights get their gradients through the casts. (A CPU stand-in for the kernel.)"""
    seen = []

    def stand_in(x, ids, weights, w_gate, w_up, w_down, swiglu_limit=None):
        seen.append((x.dtype, w_gate.dtype, w_down.dtype))
        return mok.moe_torch(x, ids, weights, w_gate, w_up, w_down, swiglu_limit=swiglu_limit)

    monkeypatch.setattr(mok.hf, "moe", stand_in)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 128, 64) / 8)
            self.down_proj = torch.nn.Parameter(torch.randn(2, 64, 64) / 8)
            self.act_fn, self.config = torch.nn.functional.silu, types.SimpleNamespace(hidden_act="silu")

    module = Experts()
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    weights = torch.rand(5, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mok.hf.mok_experts_forward(module, x, ids, weights)
    assert seen[-1] == (torch.bfloat16, torch.bfloat16, torch.bfloat16) and y.dtype == torch.float32
    y.sum().backward()
    assert module.gate_up_proj.grad.dtype == torch.float32 and module.gate_up_proj.grad.abs().sum() > 0
    mok.hf.mok_experts_forward(module, x, ids, weights)  # (no autocast: as given; the kernel names fp32)
    assert seen[-1] == (torch.float32, torch.float32, torch.float32)


def test_the_gate_check_traces_under_fullgraph_compile():
    """An experts module whose act_fn is transformers' SiLU is known by its type, so the glue's
    first look at a module (its weights and gate check) traces under
    torch.compile(fullgraph=True): the SiLU probe's allclose did not (a data-dependent operator;
    found by review 2026-12-05). (The glue over mok.moe_torch is not compiled here: on the CPU its
    grouping reads counts on the host.)"""
    experts = _models("qwen3_moe", ["mok_torch"], torch.float32, "cpu")[0].model.layers[0].mlp.experts
    experts.__dict__.pop("_mok_swiglu_limit", None)  # (as a module never called)
    x = torch.randn(3, experts.gate_up_proj.shape[2])

    def first_rows(x):
        gate_up, _, down = mok.hf._expert_weights(experts)
        return x @ gate_up[0].T + down.sum()

    torch._dynamo.reset()
    got = torch.compile(first_rows, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(got, first_rows(x))
    assert mok.hf._swiglu_limit(experts) is None


def _fp8_config(inter):
    # (FP8 needs H and I multiples of 128; a config each: from_config records the experts
    # implementation on the config object it is given)
    return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=inter, num_experts=8,
                                       num_experts_per_tok=2, head_dim=32, norm_topk_prob=True)


def test_prepare_readies_the_mok_experts_modules_before_a_compiled_call():
    """mok.hf.prepare(model) makes the glue's first look at each experts module that runs a mok
    implementation (the gate check, which a fullgraph trace cannot run for a class's own gate)
    and counts them; other implementations are left alone. On the CPU "mok_fp8" gets no quantized
    copy (the kernels are CUDA's); FP8 shapes that are not multiples of 128 are refused here,
    naming the class, as the first call would."""
    for name in MODELS:  # (DeepSeek-V3: a dense first layer and shared experts, which are not experts modules)
        model = _models(name, ["mok_torch"], torch.float32, "cpu")[0]
        experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
        assert len(experts) == (1 if name == "deepseek_v3" else 2), name
        for m in experts:
            m.__dict__.pop("_mok_swiglu_limit", None)  # (as modules never called)
        assert mok.hf.prepare(model) == len(experts), name
        assert all("_mok_swiglu_limit" in m.__dict__ for m in experts), name
    assert mok.hf.prepare(_models("qwen3_moe", ["eager"], torch.float32, "cpu")[0]) == 0
    assert mok.hf.prepare(_models("qwen3_moe", ["mok_recompute"], torch.float32, "cpu")[0]) == 2
    # transformers 5.0-5.5's decorator sets is_transposed but not is_concatenated (nor, before 5.3,
    # has_gate): such modules are readied too (the glue takes the missing flags as their defaults)
    model = _models("qwen3_moe", ["mok_torch"], torch.float32, "cpu")[0]
    for m in model.modules():
        if hasattr(m, "gate_up_proj"):
            del m.is_concatenated, m.has_gate
    assert mok.hf.prepare(model) == 2
    for m in model.modules():  # (a model whose experts the glue cannot find: a warning, not silence)
        if hasattr(m, "gate_up_proj"):
            del m.is_transposed
    with pytest.warns(UserWarning, match="names a mok experts implementation, but no experts module"):
        assert mok.hf.prepare(model) == 0

    fp8 = transformers.AutoModelForCausalLM.from_config(_fp8_config(128), experts_implementation="mok_fp8",
                                                        dtype=torch.bfloat16)
    assert mok.hf.prepare(fp8) == 2
    assert all(getattr(m, "_fp8_cache", None) is None for m in fp8.modules() if hasattr(m, "gate_up_proj"))
    odd = transformers.AutoModelForCausalLM.from_config(_fp8_config(64), experts_implementation="mok_fp8",
                                                        dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"mok.hf.prepare \(Qwen3MoeExperts\).*multiples of 128.*I = 64"):
        mok.hf.prepare(odd)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_prepared_fp8_model_compiled_first_keeps_its_quantized_weights(monkeypatch):
    """"mok_fp8" experts modules compiled (fullgraph) before any eager call: after mok.hf.prepare
    each holds its (empty) quantized copy, so the compiled modules quantize once per optimizer
    step (two micro-batches a step: once a module, not twice) with the FP8 dgrad (I = 1024:
    dgrad_pays) — the logits and every gradient the bits of an eager twin model's (only the
    experts compiled: Inductor's fusions elsewhere would change bits). Unprepared, a compiled
    module quantized in every call and ran the bf16 dgrad, whose gradients differ."""
    from mok import fp8_layer

    made = []
    quantize_into = fp8_layer._quantize_into
    monkeypatch.setattr(fp8_layer, "_quantize_into", lambda *args: made.append(1) or quantize_into(*args))
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        m = transformers.AutoModelForCausalLM.from_config(_fp8_config(1024), experts_implementation="mok_fp8",
                                                          dtype=torch.bfloat16)
        if models:
            m.load_state_dict(models[0].state_dict())
        models.append(m.to("cuda"))
    assert mok.hf.prepare(models[1]) == 2
    kept = [m._fp8_cache for m in models[1].modules() if hasattr(m, "gate_up_proj")]
    assert all(c is not None and c.dgrad() is not None for c in kept)
    torch._dynamo.reset()
    for m in models[1].modules():
        if hasattr(m, "gate_up_proj"):
            m.compile(fullgraph=True)
    calls = models
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in models]
    for step in range(2):
        made_before = len(made)
        for micro in range(2):
            ids = torch.randint(0, 128, (2, 96), device="cuda")
            got = []
            for call in calls:
                logits = call(ids).logits
                logits.float().pow(2).mean().backward()
                got.append(logits)
            assert torch.equal(got[0], got[1]), (step, micro)
        grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in models]
        assert grads[0].keys() == grads[1].keys()
        for n in grads[0]:
            assert torch.equal(grads[0][n], grads[1][n]), (step, n)
        assert len(made) - made_before == 4  # (two modules in each model: once a module a step)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert [m._fp8_cache for m in models[1].modules() if hasattr(m, "gate_up_proj")] == kept  # (the same copies)
    mok.check()
