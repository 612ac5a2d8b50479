#!/usr/bin/env python3
"""Accuracy of FP8 backward recipes before any FP8 backward kernel (issue 19), on the CPU in
fp64: one training step (forward, backward) of the routed experts with each recipe's operands
quantized as the kernel would quantize them, against the exact step on the same bf16 inputs.
Cosine and relative error per tensor (y, dx, d_topk_weights, dW_gate, dW_up, dW_down).

Recipes (E4M3 values with power-of-two scales, mok.fp8.quantize; fp64 products and sums):
  bf16        the BF16 layer's roundings: g, u, h, dg, du, w*h, the dx rows and every output in
              bf16, operands bf16 (what the fused BF16 kernel stores between its GEMMs)
  fwd8        the FP8 forward (x and h per 1 x 128 along K, weights per 128 x 128) with the bf16
              backward on its saved pre-activations: what precision="fp8" trains with today
  fwd8+dgrad8 also the backward's dgrad GEMMs in FP8: dh = dy W_down (dy rows per 1 x 128 of
              H, W_down per 128 x 128) and dx = [dg du] [W_gate; W_up] (dg, du per 1 x 128 of I)
  all8        also the weight gradients in FP8, both operands scaled along the token dimension
              (K): per 128 routed rows x 1 column (dy and w*h for dW_down, dg or du and x for
              dW_gate / dW_up), rows in plan order (the expert's tokens ascending)
  all8-blk    as all8, but the activation operands (w*h, x) per 128 routed rows x 128 columns:
              one scale per block of both operands' K block on one side, so the weight-gradient
              GEMMs promote as the forward's (a row scale times a block scale), not by an outer
              product of a row and a column scale

  fp8_backward_accuracy.py [--shape T,H,I,E,k] [--seed 0] [--limit none|7.0]
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
from torch_reference import random_problem  # noqa: E402

RECIPES = ("bf16", "fwd8", "fwd8+dgrad8", "all8", "all8-blk")


def fp8_through(t, block):
    """t (fp64) through E4M3 with power-of-two scales per block, back in fp64 (mok.fp8's
    quantize/dequantize; imported lazily so that --help needs no extension)."""
    from mok.fp8 import dequantize, quantize

    return dequantize(*quantize(t, block), block, dtype=torch.float64)


def bf(t):
    return t.to(torch.bfloat16).to(torch.float64)


def swiglu_parts(g, u, limit):
    """h, and dh -> (dg, du) as a function, with the layer's clamp (g <= limit, |u| <= limit)."""
    gc = g.clamp(max=limit) if limit is not None else g
    uc = u.clamp(-limit, limit) if limit is not None else u
    sig = torch.sigmoid(gc)
    silu = gc * sig
    h = silu * uc

    def backward(dh):
        dg = dh * uc * (sig * (1 + gc * (1 - sig)))
        du = dh * silu
        if limit is not None:
            dg = torch.where(g > limit, torch.zeros_like(dg), dg)
            du = torch.where(u.abs() > limit, torch.zeros_like(du), du)
        return dg, du
    return h, backward


def step(x, ids, w, gate, up, down, dy, limit, recipe):
    """(y, dx, d_topk_weights, d_gate, d_up, d_down) of one training step under `recipe`
    (None: exact, fp64 on the given values)."""
    exact = recipe is None
    r16 = (lambda t: t) if exact or recipe != "bf16" else bf  # the BF16 kernel's stores
    f8 = not exact and recipe != "bf16"
    dgrad8 = recipe in ("fwd8+dgrad8", "all8", "all8-blk")
    wgrad8 = recipe in ("all8", "all8-blk")
    act_block = (128, 128) if recipe == "all8-blk" else (128, 1)  # (w*h and x in the weight gradients)
    q = (lambda t, block: fp8_through(t, block)) if f8 else (lambda t, block: t)
    qd = (lambda t, block: fp8_through(t, block)) if dgrad8 else (lambda t, block: t)
    qw = (lambda t, block: fp8_through(t, block)) if wgrad8 else (lambda t, block: t)
    # In the FP8 recipes the backward's intermediates are the BF16 kernel's (bf16 stores).
    s16 = bf if not exact else (lambda t: t)
    T, H = x.shape
    k = ids.shape[1]
    y = torch.zeros_like(x)
    dx = torch.zeros_like(x)
    dw = torch.zeros(T, k, dtype=torch.float64)
    d_gate, d_up, d_down = torch.zeros_like(gate), torch.zeros_like(up), torch.zeros_like(down)
    xq = q(x, (1, 128))
    for e in range(gate.shape[0]):
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        order = torch.argsort(tokens * k + slots)  # plan order: the expert's rows by token
        tokens, slots = tokens[order], slots[order]
        if tokens.numel() == 0:
            continue
        we = w[tokens, slots].to(torch.float64)[:, None]
        rows = xq[tokens]
        wg, wu, wd = (q(m, (128, 128)) for m in (gate[e], up[e], down[e]))
        g, u = r16(rows @ wg.T), r16(rows @ wu.T)
        if f8:
            g, u = s16(g), s16(u)  # (the saved pre-activations are bf16)
        h, swiglu_back = swiglu_parts(g, u, limit)
        h = r16(h)
        o = q(h, (1, 128)) @ wd.T
        y.index_add_(0, tokens, we * o)
        # backward
        dyr = dy[tokens]
        d = qd(dyr, (1, 128)) @ qd(down[e], (128, 128))  # dh = dy . W_down  [rows, I]
        dw[tokens, slots] = (h * d).sum(1)
        dg, du = swiglu_back(we * d)
        dg, du = s16(r16(dg)), s16(r16(du))
        dgu = torch.cat([dg, du], 1)
        wgu = torch.cat([gate[e], up[e]], 0)  # [2I, H]
        dx_rows = s16(r16(qd(dgu, (1, 128)) @ qd(wgu, (128, 128))))
        dx.index_add_(0, tokens, dx_rows)
        wh = s16(r16(we * h))
        d_down[e] = qw(dyr, (128, 1)).T @ qw(wh, act_block)
        xr = x[tokens]
        d_gate[e] = qw(dg, (128, 1)).T @ qw(xr, act_block)
        d_up[e] = qw(du, (128, 1)).T @ qw(xr, act_block)
    outs = (y, dx, dw, d_gate, d_up, d_down)
    if not exact:
        outs = tuple(bf(t) if t is not dw else t for t in outs)  # (bf16 outputs; d_topk_weights fp32)
    return outs


def compare(got, ref):
    g, r = got.reshape(-1), ref.reshape(-1)
    cos = float(g @ r / (g.norm() * r.norm()))
    rel = float((g - r).norm() / r.norm())
    return cos, rel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="512,1024,512,8,4", help="T,H,I,E,k (H and I multiples of 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", default="none")
    args = ap.parse_args()
    T, H, I, E, k = map(int, args.shape.split(","))
    limit = None if args.limit == "none" else float(args.limit)
    x, ids, w, gate, up, down, _ = random_problem(T, H, I, E, k, seed=args.seed)
    x, gate, up, down = bf(x), bf(gate), bf(up), bf(down)  # (the layer's bf16 inputs)
    dy = bf(torch.randn(T, H, generator=torch.Generator().manual_seed(args.seed + 1), dtype=torch.float64))
    ref = step(x, ids, w, gate, up, down, dy, limit, None)
    names = ("y", "dx", "d_topk_weights", "dW_gate", "dW_up", "dW_down")
    print(f"== T {T}, H {H}, I {I}, E {E}, k {k}, clamp {limit}, seed {args.seed}: cosine / relative error "
          "against the exact fp64 step")
    print(f"  {'recipe':<12}" + "".join(f"{n:>20}" for n in names))
    for recipe in RECIPES:
        got = step(x, ids, w, gate, up, down, dy, limit, recipe)
        cells = [compare(a, b) for a, b in zip(got, ref)]
        print(f"  {recipe:<12}" + "".join(f"{c:>11.5f} {r * 100:6.2f} %" for c, r in cells))


if __name__ == "__main__":
    main()
