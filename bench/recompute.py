#!/usr/bin/env python3
"""What mok.moe(..., recompute=True) costs and saves against the layer that saves its
pre-activations, and against torch.utils.checkpoint around that layer (non-reentrant: the
whole forward runs again in the backward), on the same inputs.

  recompute.py [--preset deepseek-v3,mixtral-8x7b] [--repeats 3] [--iters 10] [--out FILE.json]

Per preset: the forward+backward time of each variant in rotated rounds (queued, the L2
flushed before each iteration; ratio to the saving layer's time in the same round); the bytes
a training forward leaves allocated until its backward (y and what it keeps for the backward:
a model of L such layers holds L times that at once); the step's peak beyond the inputs; and
every output (y and each gradient) checked bitwise equal to the saving layer's.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = ("save", "recompute", "checkpoint")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3,mixtral-8x7b")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    import torch_baseline as tb

    tb.add_run_args(ap, iters=10)
    args = ap.parse_args()
    if args.repeats < 1 or args.iters < 1:
        sys.exit("recompute: --repeats and --iters must be >= 1")
    import torch
    from torch.utils.checkpoint import checkpoint

    import mok

    presets = tb.load_presets()
    names = args.preset.split(",")
    unknown = [n for n in names if n not in presets]
    if unknown:
        sys.exit(f"recompute: unknown preset(s) {', '.join(unknown)}; known: {', '.join(presets)}")
    if not torch.cuda.is_available():
        sys.exit("recompute: no CUDA GPU")
    gpu = torch.cuda.get_device_name(0)
    records = []
    for name in names:
        p = presets[name]
        d = tb.make_inputs(p, args.routing, seed=args.seed)
        leaves = [d["x"], d["weights"], d["w_gate"], d["w_up"], d["w_down"]] + list(d["shared"] or ())
        for t in leaves:
            t.requires_grad_()

        def layer(x, weights, gate, up, down, *shared, recompute=False):
            return mok.moe(x, d["ids"], weights, gate, up, down, shared=shared or None, swiglu_limit=d["limit"],
                           recompute=recompute)

        calls = {"save": lambda: layer(*leaves),
                 "recompute": lambda: layer(*leaves, recompute=True),
                 "checkpoint": lambda: checkpoint(layer, *leaves, use_reentrant=False)}

        def clear():
            for t in leaves:
                t.grad = None

        def step(v):
            clear()
            calls[v]().backward(d["dy"])

        outputs, held, peak = {}, {}, {}
        for v in VARIANTS:
            step(v)  # (workspaces made, compiled nothing)
            clear()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = calls[v]()
            torch.cuda.synchronize()
            held[v] = torch.cuda.memory_allocated() - base
            y.backward(d["dy"])
            torch.cuda.synchronize()
            peak[v] = torch.cuda.max_memory_allocated() - base
            outputs[v] = [y.detach()] + [t.grad for t in leaves]
            del y
            mok.check()
        for v in VARIANTS[1:]:
            for i, (a, b) in enumerate(zip(outputs["save"], outputs[v])):
                if not torch.equal(a, b):
                    sys.exit(f"recompute: {name}: {v}'s output {i} differs from the saving layer's")
        del outputs
        clear()
        rounds = {v: [] for v in VARIANTS}
        for r in range(args.repeats):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for v in order:
                rounds[v].append(statistics.median(tb.time_ms(lambda: step(v), args.warmup, args.iters,
                                                              queued=True)))
            print(f"{name} round {r}: " + "  ".join(f"{v} {rounds[v][-1]:.3f} ms" for v in VARIANTS), flush=True)
        for v in VARIANTS:
            ratio = [t / s for t, s in zip(rounds[v], rounds["save"])]
            records.append(dict(preset=name, routing=args.routing, variant=v, ms=statistics.median(rounds[v]),
                                rounds=rounds[v], vs_save=statistics.median(ratio),
                                vs_save_range=[min(ratio), max(ratio)], held_bytes=held[v], peak_bytes=peak[v],
                                checked_bitwise=True, gpu=gpu, commit=args.commit, date=args.date,
                                torch=torch.__version__, iters=args.iters))
        from mok import ops

        ops._workspaces.clear()
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    print()
    print(f"forward+backward on {gpu}, medians of {args.repeats} rounds; held: bytes a forward keeps until its "
          "backward; peak: the step's, beyond the inputs")
    print(f"{'preset':<16}{'variant':<12}{'ms':>9}{'vs save':>9}{'range':>16}{'held MiB':>10}{'peak MiB':>10}")
    for r in records:
        lo, hi = r["vs_save_range"]
        print(f"{r['preset']:<16}{r['variant']:<12}{r['ms']:9.3f}{r['vs_save']:9.3f}   [{lo:.3f}, {hi:.3f}]"
              f"{r['held_bytes'] / 2**20:10.1f}{r['peak_bytes'] / 2**20:10.1f}")


if __name__ == "__main__":
    main()
