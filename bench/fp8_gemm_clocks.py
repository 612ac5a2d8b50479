"""One dense E4M3 GEMM, sustained at the power limit: our FP8 mainloops (bench/fp8_tile_rate's
variants) beside PyTorch's rowwise-scaled `torch._scaled_mm` (`scaled-mm`: CUTLASS's kernel or
cuBLAS's by PyTorch's build — cuBLAS's on the GPU machine, 2026-12-06; each record names the kernels it ran), cuBLAS's GEMM with the layer's own blockwise recipe (`torch.nn.functional.scaled_mm`,
A per 1 x 128, B per 128 x 128: `scaled-mm-blockwise`) and a BF16 `torch.matmul` of the same shape
(`bf16-mm`), each repeated back to back for a window of seconds while nvidia-smi samples the SM
clock and the board power.

    fp8_gemm_clocks.py --tile-rate build/bench/fp8_tile_rate [--m 8192 --n 4096 --k 7168] [--group-rows 2048]
                       [--impl current,current-ss,narrow,narrow+bmc,narrow-ss,scaled-mm,scaled-mm-blockwise,bf16-mm]
                       [--seconds 4] [--rounds 3] [--out FILE.json] [--commit SHA] [--date DATE]

Why (bench/NOTES.md, 2026-12-06): at the 700 W cap the layer's FP8 forward runs at ~1650 MHz and
0.47-0.59 TFLOP/s a MHz, the dense FP8 ceiling (torch._scaled_mm) at ~1350 MHz and 0.80-0.86 —
at the cap the clock falls until the power fits, so the work a clock is what a kernel's structure
decides. This says whether our mainloop alone (no layer around it) already trails that kernel a
clock, and which tile structure closes the gap: `current` is the layer's (128 x 256 tiles),
`narrow` the tile of cuBLAS's FP8 kernels (128 x 128, promoted in step), `narrow+bmc` with its 2-CTA clusters
sharing B, `narrow-ss` and `current-ss` with A's row scales loaded into shared memory with each
stage (as CUTLASS's Hopper blockwise kernel loads them). The tile
variants run as `fp8_tile_rate --only NAME` (their TFLOP/s its median of repeats; the window the
process's run after --skip-s, which covers its start and the ramp); the PyTorch GEMMs run here (one
this PyTorch cannot run is left out, named). All E4M3 operands hold fp8_tile_rate's bytes (the power
drawn depends on the data). --group-rows orders fp8_tile_rate's tiles as the layer orders an
expert's (2048 rows: deepseek-v3's and mixtral-8x7b's experts at their presets; 0 = all of M one
group, the order that streamed all of A once per wave of N-tiles). Nothing is checked: the numbers
are rates, not results.

A record per implementation and round: TFLOP/s, the window's median SM MHz and W (min–max), the
throttle reasons, and TFLOP/s per SM GHz (the work a clock).
"""
import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TILE_VARIANTS = ("current", "a-in-regs", "current-ss", "current-ord", "current-ss-ord", "overlapped", "overlap+mc",
                 "narrow", "narrow+bmc", "narrow-ss", "narrow-ss-ord", "three-wgs",
                 "three-wgs-ss", "overlapped-ss", "overlap+mc-ss")
PEERS = ("scaled-mm", "scaled-mm-blockwise", "bf16-mm")


def parse_tile_rate(text, name):
    """The median TFLOP/s of variant `name` in fp8_tile_rate's output, or None."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == name and "TFLOP/s" in parts:
            return float(parts[parts.index("TFLOP/s") - 1])
    return None


def tile_bytes(m, k, torch):
    """fp8_tile_rate's operand bytes, [m, k] as E4M3: byte i = ((i * 2654435761) >> 13) & 0x77."""
    i = torch.arange(m * k, dtype=torch.int64, device="cuda")
    return (((i * 2654435761) >> 13) & 0x77).to(torch.uint8).view(torch.float8_e4m3fn).view(m, k)


def timed_loop(fn, seconds, skip_s, batch=20):
    """Runs fn back to back for `seconds`; the median ms of one call over the batches of `batch`
    calls that began after the first skip_s (the window the clock samples describe)."""
    import torch

    times, start = [], time.monotonic()
    while time.monotonic() - start < seconds:
        began = time.monotonic() - start
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        if began >= skip_s:
            times.append(a.elapsed_time(b) / batch)
    return statistics.median(times)


def kernel_names(fn):
    """The CUDA kernels one call of fn launches (torch.profiler), or ["?"] if it cannot say: which
    library's GEMM a PyTorch call ran (rowwise _scaled_mm is CUTLASS's or cuBLAS's by build)."""
    import torch

    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = sorted({e.key for e in prof.key_averages() if "cuda" in str(getattr(e, "device_type", "")).lower()})
        return names or ["?"]
    except Exception as e:  # (a diagnostic: never the reason a run stops)
        return [f"? ({type(e).__name__})"]


def run_tile_variant(args, impl, M, N, K, iters, repeats, warmup):
    """fp8_tile_rate --only impl: (its median TFLOP/s over the repeats after `warmup` untimed ones,
    when its warm-up began). Exits naming the variant if it fails."""
    cmd = [args.tile_rate, "--only", impl, "--m", str(M), "--n", str(N), "--k", str(K), "--iters", str(iters),
           "--repeats", str(repeats), "--group-rows", str(args.group_rows), "--warmup", str(warmup)]
    began, out = None, []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:  # (the "timing" line: the process's set-up is over)
            if line.startswith("timing ") and began is None:
                began = datetime.datetime.now()
            out.append(line)
        rc = proc.wait(timeout=120)
    text = "".join(out)
    tflops = parse_tile_rate(text, impl)
    if rc != 0 or tflops is None or began is None:
        sys.exit(f"fp8_gemm_clocks: fp8_tile_rate --only {impl} failed ({rc}): {text[-600:]}")
    return tflops, began


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tile-rate", default="", help="bench/fp8_tile_rate (needed for its variants)")
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--group-rows", type=int, default=2048, help="fp8_tile_rate's tile order (0: all of M)")
    ap.add_argument("--impl", default="current,current-ss,narrow,narrow+bmc,narrow-ss,scaled-mm,scaled-mm-blockwise,bf16-mm")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--skip-s", type=float, default=1.0, help="dropped from the start of each window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interval-ms", type=int, default=50)
    ap.add_argument("--out", default="")
    ap.add_argument("--commit", default="")
    ap.add_argument("--date", default="")
    args = ap.parse_args()
    impls = [i for i in args.impl.split(",") if i]
    bad = [i for i in impls if i not in TILE_VARIANTS + PEERS]
    if bad or not impls:
        sys.exit(f"fp8_gemm_clocks: --impl {args.impl}: each one of {', '.join(TILE_VARIANTS + PEERS)}")
    if any(i in TILE_VARIANTS for i in impls) and not os.access(args.tile_rate, os.X_OK):
        sys.exit(f"fp8_gemm_clocks: --tile-rate '{args.tile_rate}' is not an executable fp8_tile_rate")
    if args.m % 256 or args.n % 256 or args.k % 1024:
        sys.exit(f"fp8_gemm_clocks: --m {args.m} and --n {args.n} must be multiples of 256, --k {args.k} of 1024")
    if args.group_rows < 0 or args.group_rows % 256 or (args.group_rows and args.m % args.group_rows):
        sys.exit(f"fp8_gemm_clocks: --group-rows {args.group_rows}: a multiple of 256 that divides --m {args.m}, or 0")
    if args.seconds <= args.skip_s or args.rounds < 1:
        sys.exit(f"fp8_gemm_clocks: --seconds ({args.seconds}) must exceed --skip-s ({args.skip_s}), --rounds >= 1")
    import torch

    import torch_baseline as tb
    from clock_power import Sampler, smi_index, window_stats
    from rounds import round_order

    if not torch.cuda.is_available():
        sys.exit("fp8_gemm_clocks: no CUDA GPU")
    M, N, K = args.m, args.n, args.k
    flop = 2.0 * M * N * K
    a8, b8 = tile_bytes(M, K, torch), tile_bytes(N, K, torch)
    a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    peers = {"scaled-mm": tb.fp8_gemm(a8, b8, "rowwise"), "scaled-mm-blockwise": tb.fp8_gemm(a8, b8, "blockwise"),
             "bf16-mm": lambda: torch.matmul(a16, b16)}
    for name in [i for i in impls if i in PEERS]:  # (one this PyTorch cannot run is left out, named)
        why = tb.cannot_run(peers[name])
        if why is not None:
            print(f"fp8_gemm_clocks: {name} left out: {why}")
            impls.remove(name)
    kernels = {name: kernel_names(peers[name]) for name in impls if name in PEERS}
    for name, ks in kernels.items():
        print(f"fp8_gemm_clocks: {name} runs {', '.join(ks)}")
    if not impls:
        sys.exit("fp8_gemm_clocks: nothing left to run")
    # fp8_tile_rate: ~0.25 s a repeat at 1000 TFLOP/s; untimed ones for the first skip_s (the window's
    # ramp, dropped from the clock samples too), timed ones for the rest
    launch_s = flop / 1e15
    iters = max(1, int(0.25 / launch_s))
    warmup = max(1, math.ceil(args.skip_s / 0.25))
    repeats = max(3, int((args.seconds - args.skip_s) / 0.25))
    gpu = torch.cuda.get_device_name(0)
    sampler = Sampler(smi_index(torch.cuda.current_device()), args.interval_ms)
    records = []
    try:
        for r in range(args.rounds):
            for impl, _ in round_order([(i, "gemm") for i in impls], r):  # (rotated: each first once)
                if impl in PEERS:
                    start = datetime.datetime.now()
                    ms = timed_loop(peers[impl], args.seconds, args.skip_s)
                    tflops = flop / (ms * 1e-3) / 1e12
                else:
                    tflops, start = run_tile_variant(args, impl, M, N, K, iters, repeats, warmup)
                end = datetime.datetime.now()
                time.sleep(2 * args.interval_ms / 1e3)  # (the window's last samples written)
                stats = window_stats(sampler.samples(), start, end, args.skip_s)
                if stats is None:
                    sys.exit(f"fp8_gemm_clocks: no nvidia-smi sample in {impl}'s window")
                rec = dict(impl=impl, round=r, m=M, n=N, k=K, group_rows=args.group_rows, kernels=kernels.get(impl),
                           tflops=tflops,
                           tflops_per_ghz=tflops / (stats["sm_mhz"] / 1e3), **stats, seconds=args.seconds,
                           skip_s=args.skip_s, gpu=gpu, commit=args.commit, date=args.date, torch=torch.__version__)
                records.append(rec)
                print(f"round {r}  {impl:<19} {tflops:7.1f} TFLOP/s  {stats['sm_mhz']:5.0f} MHz  {stats['power_w']:4.0f} W"
                      f"  {rec['tflops_per_ghz']:6.1f} TFLOP/s a GHz", flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(records, f, indent=1)
    finally:
        sampler.close()
    print(f"\n{gpu}, E4M3 GEMM M {M} N {N} K {K} (tile groups of {args.group_rows or M} rows), "
          f"medians of {args.rounds} rounds")
    print(f"{'impl':<19} {'TFLOP/s':>8} {'SM MHz':>7} {'W':>5} {'TFLOP/s a GHz':>14}  throttle")
    for impl in impls:
        rs = [x for x in records if x["impl"] == impl]
        reasons = sorted({t for x in rs for t in x["throttle_reasons"]})
        print(f"{impl:<19} {statistics.median(x['tflops'] for x in rs):8.1f} "
              f"{statistics.median(x['sm_mhz'] for x in rs):7.0f} {statistics.median(x['power_w'] for x in rs):5.0f} "
              f"{statistics.median(x['tflops_per_ghz'] for x in rs):14.1f}  {' '.join(reasons)}")


if __name__ == "__main__":
    main()
