#!/usr/bin/env python3
"""What leaving SMs to other streams (mok.set_compute_sms) costs the fused layer, and what it
buys work on another stream: the case of FSDP's all-gathers and reduce-scatters beside the MoE
layer.

  sm_share.py [--preset deepseek-v3] [--pass fwd+bwd] [--sms 0,-8,-16,-32] [--side-kernels 1000]
              [--side-elems 1048576] [--repeats 3] [--iters 10] [--out FILE.json]

--sms: the compute_sms settings timed (0: every SM; a negative n: the GPU's SMs + n, i.e. |n|
SMs left free; a positive n: n SMs). The other stream's work is a stand-in for communication
kernels: a chain of --side-kernels elementwise kernels (`add_` on --side-elems fp32 elements),
kernels that need SMs of their own. No other kernel's CTA fits beside one of the layer's on an
SM (the layer's CTAs take the whole register file; NCCL's, of 512 or more threads, would not fit
either). One GPU has no real collective to time (NCCL refuses two ranks on one device), so this
measures the scheduling — whether the other stream's kernels start while the layer runs — not
a link's bandwidth.

In each round every setting in turn (rotated by round) times, queued with the L2 flushed before
each iteration, --iters iterations of: the layer alone; the side chain alone; both (the chain on
its own stream, released by an event recorded just before the layer's first launch, and joined
at the iteration's end). A record: the three medians; hidden = (layer + side - both) / side, the
share of the side chain's time that ran under the layer (1: all of it; 0: none, it ran after);
and the layer's time alone against the first setting's (every SM by default), round by round. The layer's outputs do not
depend on the setting (tests/python/test_gpu.py checks the bits), so nothing is checked here.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def resolve_sms(values, sms):
    """The compute_sms settings of --sms's values on a GPU of `sms` SMs, each once: 0 and sms are 0
    (every SM, as mok.set_compute_sms takes them), a negative n is sms + n (|n| left free), a
    positive n is n; refuses a setting that leaves the layer no SM or asks for more than the GPU has."""
    out = []
    for v in values:
        n = sms + v if v < 0 else v
        if v != 0 and not 0 < n <= sms:
            raise ValueError(f"sm_share: --sms {v} gives {n} SMs on a GPU of {sms}: must be 1 .. {sms}")
        out.append(0 if n == sms else n)
    return list(dict.fromkeys(out))


def hidden_share(layer_ms, side_ms, both_ms):
    """The share of the side chain's time that ran under the layer: (layer + side - both) / side,
    clamped to [0, 1] (timing noise can push it a little outside)."""
    if side_ms <= 0:
        return 0.0
    return min(1.0, max(0.0, (layer_ms + side_ms - both_ms) / side_ms))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--pass", dest="pass_", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
    ap.add_argument("--sms", default="0,-8,-16,-32")
    ap.add_argument("--side-kernels", type=int, default=1000)
    ap.add_argument("--side-elems", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    import torch_baseline as tb

    tb.add_run_args(ap, iters=10)
    args = ap.parse_args()
    try:
        values = [int(v) for v in args.sms.split(",")]
    except ValueError:
        sys.exit(f"sm_share: --sms must be a comma-separated list of ints, got {args.sms!r}")
    if args.repeats < 1 or args.iters < 1 or args.side_kernels < 1 or args.side_elems < 1:
        sys.exit("sm_share: --repeats, --iters, --side-kernels and --side-elems must be >= 1")
    import torch

    import mok
    from mok_impls import MokPy

    if not torch.cuda.is_available():
        sys.exit("sm_share: no CUDA GPU")
    presets = tb.load_presets()
    if args.preset not in presets:
        sys.exit(f"sm_share: unknown preset '{args.preset}'; known: {', '.join(presets)}")
    p = presets[args.preset]
    gpu_sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        settings = resolve_sms(values, gpu_sms)
    except ValueError as e:
        sys.exit(str(e))
    d = tb.make_inputs(p, args.routing, seed=args.seed)
    side_stream = torch.cuda.Stream()
    side_buf = torch.zeros(args.side_elems, device="cuda")

    def side():  # on the current stream
        for _ in range(args.side_kernels):
            side_buf.add_(1.0)

    layer = MokPy(d)
    fn, before = layer.step(args.pass_)
    for n in settings:  # (each setting's workspace made up front, outside the timings; the setting is
        mok.set_compute_sms(n)  # read at every call, so each timing sets it again)
        if before:
            before()
        fn()
    mok.set_compute_sms(0)
    torch.cuda.synchronize()
    from mok import ops

    made = {ws.compute_sms for ws in ops._workspaces.values()}
    if not set(settings) <= made:  # (the setting reached the workspaces the calls used)
        sys.exit(f"sm_share: no workspace was made for compute_sms {sorted(set(settings) - made)}")

    def timed(n, what):
        def both():
            main = torch.cuda.current_stream()
            go = torch.cuda.Event()
            go.record(main)
            side_stream.wait_event(go)
            fn()
            with torch.cuda.stream(side_stream):
                side()
            main.wait_stream(side_stream)
        body = {"layer": fn, "side": side, "both": both}[what]
        mok.set_compute_sms(n)
        try:
            return statistics.median(tb.time_ms(body, args.warmup, args.iters, before if what != "side" else None,
                                                queued=True))
        finally:
            mok.set_compute_sms(0)

    rounds = {n: [] for n in settings}
    for r in range(args.repeats):
        shift = r % len(settings)
        for n in settings[shift:] + settings[:shift]:
            t = {what: timed(n, what) for what in ("layer", "side", "both")}
            rounds[n].append(t)
            print(f"round {r}  compute_sms {n:>3}: layer {t['layer']:8.3f} ms  side {t['side']:7.3f} ms  both "
                  f"{t['both']:8.3f} ms  hidden {hidden_share(t['layer'], t['side'], t['both']):.2f}", flush=True)
    gpu = torch.cuda.get_device_name(0)
    base = rounds[settings[0]]
    records = []
    for n in settings:
        med = {what: statistics.median(t[what] for t in rounds[n]) for what in ("layer", "side", "both")}
        slowdown = [t["layer"] / b["layer"] for t, b in zip(rounds[n], base)]
        records.append(dict(preset=args.preset, routing=args.routing, **{"pass": args.pass_}, compute_sms=n,
                            sms=gpu_sms, layer_ms=med["layer"], side_ms=med["side"], both_ms=med["both"],
                            hidden=hidden_share(med["layer"], med["side"], med["both"]),
                            layer_vs_first=statistics.median(slowdown), rounds=rounds[n],
                            side_kernels=args.side_kernels, side_elems=args.side_elems, gpu=gpu,
                            commit=args.commit, date=args.date, torch=torch.__version__))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    print()
    print(f"{args.preset} {args.pass_} on {gpu} ({gpu_sms} SMs); side: {args.side_kernels} x add_ of "
          f"{args.side_elems} fp32; medians of {args.repeats} rounds")
    print(f"{'compute_sms':>11}{'layer ms':>10}{'side ms':>9}{'both ms':>10}{'hidden':>8}{'layer / first':>15}")
    for r in records:
        print(f"{r['compute_sms']:>11}{r['layer_ms']:10.3f}{r['side_ms']:9.3f}{r['both_ms']:10.3f}{r['hidden']:8.2f}"
              f"{r['layer_vs_first']:15.3f}")


if __name__ == "__main__":
    main()
