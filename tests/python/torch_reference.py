"""A pure-PyTorch reference of the layer, one expert at a time, in the dtype of its inputs
(use float64 for an oracle). Independent of the C++ reference."""

import torch


def swiglu(g, u, limit):
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return torch.nn.functional.silu(g) * u


def moe_reference(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None, swiglu_limit=None):
    y = torch.zeros_like(x)
    if shared is not None:
        sg, su, sd = shared
        y += swiglu(x @ sg.T, x @ su.T, swiglu_limit) @ sd.T
    for e in range(w_gate.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        xe = x[tokens]
        out = swiglu(xe @ w_gate[e].T, xe @ w_up[e].T, swiglu_limit) @ w_down[e].T
        y.index_add_(0, tokens, out * topk_weights[tokens, slots].to(x.dtype)[:, None])
    return y


def random_problem(T, H, I, E, k, shared_inter=0, seed=0, device="cpu", dtype=torch.float64, padding=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
    if padding > 0:
        ids[torch.rand(T, k, generator=g) < padding] = -1
    w = torch.softmax(torch.randn(T, k, generator=g), dim=1).to(torch.float32)
    gate = torch.randn(E, I, H, generator=g, dtype=torch.float64) / H ** 0.5
    up = torch.randn(E, I, H, generator=g, dtype=torch.float64) / H ** 0.5
    down = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    shared = None
    if shared_inter:
        shared = (torch.randn(shared_inter, H, generator=g, dtype=torch.float64) / H ** 0.5,
                  torch.randn(shared_inter, H, generator=g, dtype=torch.float64) / H ** 0.5,
                  torch.randn(H, shared_inter, generator=g, dtype=torch.float64) / shared_inter ** 0.5)
    cast = lambda t: t.to(device=device, dtype=dtype)
    return (cast(x), ids.to(device), w.to(device), cast(gate), cast(up), cast(down),
            None if shared is None else tuple(cast(t) for t in shared))
