#!/usr/bin/env python3
"""End to end through Hugging Face transformers: a Qwen3-MoE model with Qwen3-30B-A3B's
layer shapes, trained forward+backward with each experts implementation, from one
initialisation on the same tokens.

  hf_bench.py [--impls mok,grouped_mm] [--size qwen3-30b-a3b|tiny] [--layers 4] [--batch 2]
              [--seq 4096] [--steps 10] [--warmup 3] [--repeats 3] [--out FILE.json]

impls: transformers' `experts_implementation` names — `grouped_mm` (transformers' own
torch._grouped_mm backend), `eager`, and this package's `mok` (the fused kernel, via
mok.hf.register()) and `mok_torch` (the same glue over mok.moe_torch, any device).

What it reports per implementation (records in one JSON file):
  - tokens/s of one training step (forward, loss, backward; no optimizer step, whose cost
    does not depend on the experts): batch·seq over the median step time of each round,
    rounds interleaved (A B A B …), `ms_repeats` per round;
  - the loss of the first step, and its relative difference to the first implementation's
    (`loss_rel_diff`; the same initialisation and tokens, so only the experts' arithmetic
    differs);
  - where one step's GPU time goes (`profile_ms`): the experts modules, the attention
    modules (forward and backward each, bracketed by CUDA events from module and tensor
    hooks) and the rest (embedding, norms, router, LM head, loss, the glue);
  - peak memory of a step above the model and its gradients' previous values
    (`peak_bytes`, PyTorch's allocator + mok's workspaces).
The vocabulary is 32768 (Qwen3's is 151936), so that the LM head does not dominate a
4-layer model; the layer shapes are Qwen3-30B-A3B's (hidden 2048, 128 experts of 768,
top-8, 32 query heads and 4 KV heads of 128).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

SIZES = {
    "qwen3-30b-a3b": dict(vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128),
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                 num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU, the host clock on the CPU
    (where every operation is synchronous)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


class ModuleTimes:
    """Per module kind (experts, attention): marks at the start and end of its forward and
    of its backward. The backward's start is the gradient of the module's output arriving,
    its end the gradient of the module's input being complete (tensor hooks); the experts'
    input also feeds the router, so their backward includes the router's (small) backward."""

    def __init__(self, model, clock):
        self.clock, self.marks, self.handles = clock, {}, []
        for layer in model.model.layers:
            self._watch("attention", layer.self_attn)
            self._watch("experts", layer.mlp.experts)

    def _watch(self, kind, module):
        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            self.marks.setdefault((kind, "fwd"), []).append([self.clock.mark(), None])
            if torch.is_grad_enabled() and x is not None and x.requires_grad:
                x.register_hook(lambda g: self._end(kind, "bwd"))

        def post(mod, args, kwargs, out):
            self.marks[(kind, "fwd")][-1][1] = self.clock.mark()
            y = out[0] if isinstance(out, tuple) else out
            if torch.is_grad_enabled() and y.requires_grad:
                y.register_hook(lambda g: self._start(kind, "bwd"))

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(module.register_forward_hook(post, with_kwargs=True))

    def _start(self, kind, phase):
        self.marks.setdefault((kind, phase), []).append([self.clock.mark(), None])

    def _end(self, kind, phase):
        pending = [m for m in self.marks.get((kind, phase), []) if m[1] is None]
        if pending:
            pending[-1][1] = self.clock.mark()

    def totals(self):
        """{kind phase: ms} summed over the layers (after a synchronisation)."""
        self.clock.sync()
        return {f"{k} {p}": sum(self.clock.ms(a, b) for a, b in m if b is not None) for (k, p), m in self.marks.items()}

    def close(self):
        for h in self.handles:
            h.remove()


def build(args, impl, device):
    import transformers

    cfg = transformers.Qwen3MoeConfig(**SIZES[args.size], num_hidden_layers=args.layers, norm_topk_prob=True,
                                      max_position_embeddings=max(args.seq, 128))
    torch.manual_seed(args.seed)  # one initialisation for every implementation
    dtype = torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=impl, dtype=dtype)
    return model.to(device)


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def workspace_bytes():
    from mok import _state

    return sum(ws.bytes for ws in _state.workspaces.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="mok,grouped_mm")
    ap.add_argument("--size", choices=sorted(SIZES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="")
    ap.add_argument("--commit", default=os.environ.get("MOK_COMMIT", "unknown"))
    args = ap.parse_args()
    if args.steps < 1 or args.repeats < 1:
        sys.exit("hf_bench: --steps and --repeats must be >= 1")
    impls = args.impls.split(",")
    if any(i.startswith("mok") for i in impls):
        import mok.hf

        mok.hf.register()
    device = torch.device(args.device)
    clock = Clock(device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, SIZES[args.size]["vocab_size"], (args.batch, args.seq), generator=gen).to(device)
    models = {impl: build(args, impl, device) for impl in impls}

    first_loss, rounds = {}, {impl: [] for impl in impls}
    for impl, model in models.items():  # correctness first: the first step's loss
        first_loss[impl] = float(step(model, ids))
        for _ in range(args.warmup):
            step(model, ids)
    for _ in range(args.repeats):
        for impl, model in models.items():
            times = []
            for _ in range(args.steps):
                clock.sync()
                a = clock.mark()
                step(model, ids)
                b = clock.mark()
                clock.sync()
                times.append(clock.ms(a, b))
            rounds[impl].append(statistics.median(times))

    records = []
    ref = impls[0]
    for impl, model in models.items():
        watch = ModuleTimes(model, clock)
        clock.sync()
        if device.type == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        a = clock.mark()
        step(model, ids)
        b = clock.mark()
        parts = watch.totals()
        watch.close()
        total = clock.ms(a, b)
        parts["rest"] = total - sum(parts.values())
        peak = None
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated() - base + (workspace_bytes() if impl.startswith("mok") else 0)
        ms = statistics.median(rounds[impl])
        records.append(dict(
            bench="hf_qwen3_moe", impl=impl, size=args.size, layers=args.layers, batch=args.batch, seq=args.seq,
            tokens_per_s=args.batch * args.seq / (ms * 1e-3), ms=ms, ms_repeats=rounds[impl], steps=args.steps,
            repeats=args.repeats, first_loss=first_loss[impl],
            loss_rel_diff=abs(first_loss[impl] - first_loss[ref]) / abs(first_loss[ref]), profile_ms=parts,
            profile_total_ms=total, peak_bytes=peak, device=str(device),
            gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
            commit=args.commit, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")))
    print(f"{'impl':12s} {'tokens/s':>10s} {'step ms':>9s} {'first loss':>11s} {'rel diff':>9s}  profile (ms)")
    for r in records:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["profile_ms"].items()))
        print(f"{r['impl']:12s} {r['tokens_per_s']:10,.0f} {r['ms']:9.2f} {r['first_loss']:11.5f} "
              f"{r['loss_rel_diff']:9.2e}  {parts}")
    for r in records[1:]:
        print(f"{records[0]['impl']} / {r['impl']} tokens/s: {records[0]['tokens_per_s'] / r['tokens_per_s']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
