"""The problems every benchmark builds: routings (uniform, zipf1.2), the hash fill that
mok_bench.cu reproduces element for element, and one preset's inputs."""
import math

import torch

ROUTINGS = ("uniform", "zipf1.2")


def make_routing(tokens, experts, top_k, kind, seed, device):
    """(ids int32 [T, k], weights fp32 [T, k]): k distinct experts per token.
    uniform: every expert equally likely. zipf1.2: expert popularity ∝ 1/rank^1.2 (ranks
    shuffled over the experts), k distinct experts drawn without replacement in proportion
    to it (Gumbel top-k). Weights: a softmax of normal scores, normalised per token."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if kind == "uniform":
        scores = torch.rand(tokens, experts, device=device, generator=gen)
    elif kind == "zipf1.2":
        rank = torch.randperm(experts, device=device, generator=gen).double() + 1.0
        log_popularity = -1.2 * torch.log(rank)
        u = torch.rand(tokens, experts, device=device, generator=gen, dtype=torch.float64).clamp_min(1e-300)
        scores = log_popularity - torch.log(-torch.log(u))  # + Gumbel noise
    else:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got '{kind}'")
    ids = scores.topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.randn(tokens, top_k, device=device, generator=gen), dim=1)
    return ids.contiguous(), weights.contiguous()


def max_load_ratio(ids, experts):
    """The busiest expert's rows over the mean rows per expert."""
    counts = torch.bincount(ids.reshape(-1).long(), minlength=experts).double()
    return float(counts.max() / counts.mean())


# Seeds of a problem's tensors: mok_bench.cu's `Tensor` enum mirrors them.
TENSOR_SEEDS = {"x": 1, "gate": 2, "up": 3, "down": 4, "dy": 5, "shared_gate": 6, "shared_up": 7, "shared_down": 8}
_M32 = 0xFFFFFFFF


def hash_fill(shape, seed, device, chunk=1 << 26):
    """bf16 values (hash(i, seed) & 0xff - 128) / 1024 — mok_bench.cu's fill_bits, element
    for element (|v| <= 1/8, exact in bf16, never zeros everywhere), so the C++ benchmark
    process builds the very same inputs."""
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    flat, n = out.view(-1), math.prod(shape)
    mix = (seed * 0x9E3779B9) & _M32
    for start in range(0, n, chunk):
        i = torch.arange(start, min(n, start + chunk), device=device, dtype=torch.int64)
        h = ((i & _M32) * 2654435761) & _M32 ^ mix
        h = h ^ (h >> 15)
        h = (h * 0x2C1B3C6D) & _M32
        h = h ^ (h >> 12)
        flat[start:start + i.numel()] = ((h & 0xFF) - 128).to(torch.bfloat16) * (1.0 / 1024.0)
    return out


def make_inputs(p, routing, seed, device="cuda"):
    """One problem of preset p: the tensors both mok and PyTorch take (gate and up separate
    for mok, concatenated [E, 2I, H] for the PyTorch paths, as frameworks store them)."""
    T, H, I, E, k, Is = p["tokens"], p["hidden"], p["intermediate"], p["experts"], p["top_k"], p["shared_intermediate"]
    fill = lambda name, *shape: hash_fill(shape, seed * 16 + TENSOR_SEEDS[name], device)
    d = dict(x=fill("x", T, H), w_gate=fill("gate", E, I, H), w_up=fill("up", E, I, H), w_down=fill("down", E, H, I),
             dy=fill("dy", T, H))
    d["ids"], d["weights"] = make_routing(T, E, k, routing, seed, device)
    d["w_gate_up"] = torch.cat([d["w_gate"], d["w_up"]], dim=1)
    d["shared"] = None
    d["shared_gate_up"] = d["shared_down"] = None
    if Is:
        sg, su, sd = fill("shared_gate", Is, H), fill("shared_up", Is, H), fill("shared_down", H, Is)
        d["shared"] = (sg, su, sd)
        d["shared_gate_up"], d["shared_down"] = torch.cat([sg, su], dim=0), sd
    d["limit"] = p["swiglu_limit"] if p["swiglu_limit"] > 0 else None
    return d
