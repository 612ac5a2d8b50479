#!/usr/bin/env python3
"""Before/after of the fused layer on one GPU, cheaply: two `mok_bench --serve` processes
(a base build and a head build) load the same problem once per preset, must give bitwise
equal outputs, and are then timed in rounds, each side once a round, the side that goes first
alternating (base head, head base, ...): with the same binary on both sides the second side
read up to ~3 % faster on the large presets when base always went first (bench/NOTES.md).

  python3 bench/ab_serve.py --base BASE/bench/mok_bench --head HEAD/bench/mok_bench
      [--preset all|NAME,...] [--routing uniform] [--rounds 5] [--iters 10] [--out FILE.json]
      [--impls BASE_IMPL,HEAD_IMPL]

--impls compares two of mok_bench's implementations (e.g. one build, --impls mok,mok-pp: the
cooperative forward against the ping-pong one); --head defaults to --base.

Per (preset, pass): each side's median over rounds of its round medians, head / base, the
range of the per-round ratios, and whether the two builds' outputs (y, dx, d_topk_weights,
every weight gradient: mok_bench's checksums) are bitwise equal. scripts/ab_bench.sh does
the same with whole mok_bench runs (a fixed cost of ~10 s per record: the fp64 check and
the set-up); this loads each problem once.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ab_compare  # noqa: E402
import torch_baseline as tb  # noqa: E402
from layer_bench import MokBench  # noqa: E402


def record_meta(given):
    """The record's gpu, commit and date: --meta's where it gives them, else this GPU's name
    (nvidia-smi), $MOK_COMMIT and the time now (UTC) — every result file names all three."""
    import datetime
    import subprocess

    meta = json.loads(given)
    if "gpu" not in meta:
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.split("\n")
            meta["gpu"] = names[0].strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            meta["gpu"] = "unknown"
    meta.setdefault("commit", os.environ.get("MOK_COMMIT", "unknown"))
    meta.setdefault("date", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return meta


def rows_of(times, same):
    """ab_compare's rows from {(preset, pass): {"base": [ms per round], "head": [...]}}, over the
    rounds both sides completed (a run stopped mid-round still writes the rounds before)."""
    rows = []
    for (preset, pass_), t in times.items():
        n = min(len(t["base"]), len(t["head"]))
        if n:
            rows.append(ab_compare.row(preset, pass_, t["base"][:n], t["head"][:n], bitwise_equal=same.get((preset, pass_))))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--head", default="")
    ap.add_argument("--impls", default="mok,mok", help="mok_bench impls of base and head (mok, mok-pp, mok-fp8, mok-fp8-bf16dgrad, mok-fp8-wgrad, "
                    "mok-fp8-step, mok-recompute, mok-1block, mok-recompute-1block, mok-recompute-2block, mok-fp8-wgrad-1block, mok-fp8-wgrad-2block, mok-fp8-2block, mok-fp8-bf16dgrad-2block)")
    ap.add_argument("--preset", default="all")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--pass", dest="passes", default="fwd,fwd+bwd",
                    help="fwd, fwd+bwd, and fp8 (the FP8 forward: mok_bench's impl mok-fp8, pass fwd)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--meta", default="{}", help="JSON object merged into the output (gpu, commits, date)")
    args = ap.parse_args()
    presets = tb.load_presets()
    names = tb.benchmark_presets(presets) if args.preset == "all" else args.preset.split(",")
    passes = args.passes.split(",")
    impl = dict(zip(("base", "head"), args.impls.split(",")))
    if len(impl) != 2 or args.impls.count(",") != 1:
        sys.exit(f"ab_serve: --impls takes two implementations, BASE,HEAD; got '{args.impls}'")
    servers = {"base": MokBench(args.base), "head": MokBench(args.head or args.base)}
    times, same = {}, {}
    try:
        for name in names:
            p = presets[name]
            ids, weights = tb.make_routing(p["tokens"], p["experts"], p["top_k"], args.routing, args.seed, "cpu")
            with tempfile.TemporaryDirectory() as tmp:
                ids_path, w_path = os.path.join(tmp, "ids.i32"), os.path.join(tmp, "weights.f32")
                ids.numpy().tofile(ids_path)
                weights.numpy().tofile(w_path)
                for s in servers.values():
                    s.call("load", name, args.seed, ids_path, w_path)
            for ps in passes:
                fp8 = ps == "fp8" or any("fp8" in i for i in impl.values())
                if fp8 and (p["hidden"] % 128 or p["intermediate"] % 128):
                    print(f"{name:<20}{ps:<9}skipped: Precision::fp8 needs H and I multiples of 128", flush=True)
                    continue
                calls = {side: ("fwd", "mok-fp8") if ps == "fp8" else (ps, impl[side]) for side in servers}
                sums = {side: s.call("check", *calls[side])["checksums"] for side, s in servers.items()}
                same[(name, ps)] = sums["base"] == sums["head"]
                t = times[(name, ps)] = {"base": [], "head": []}
                for r in range(args.rounds):
                    for side in ("base", "head") if r % 2 == 0 else ("head", "base"):
                        s, c = servers[side], calls[side]
                        t[side].append(statistics.median(s.call("time", c[0], args.warmup, args.iters, *c[1:])["ms"]))
                print(f"{name:<20}{ps:<9}base {statistics.median(t['base']):8.3f}  head "
                      f"{statistics.median(t['head']):8.3f}  bitwise equal: {same[(name, ps)]}", flush=True)
    finally:
        for s in servers.values():
            s.close()
        rows = rows_of(times, same)
        print(ab_compare.table(rows))
        if args.out:
            with open(args.out, "w") as f:
                base_impl, head_impl = args.impls.split(",")
                json.dump(dict(record_meta(args.meta), routing=args.routing, iters=args.iters, order="alternating",
                               base_impl=base_impl, head_impl=head_impl, rows=rows), f, indent=1)
    if not all(same.values()):
        sys.exit("ab_serve: the two builds' outputs differ on " + ", ".join(f"{n} {ps}" for (n, ps), v in same.items()
                                                                        if not v))


if __name__ == "__main__":
    main()
