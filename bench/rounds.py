"""How layer_bench runs and pairs its rounds: the order of a round's timings, the ratio of two
implementations paired by round, and the settle before a timing (bench/NOTES.md has the
measurements behind each)."""
import statistics
import time


def round_order(runnable, r):
    """The (impl, pass) keys of round r: grouped by pass (in the order of `runnable`), each pass's
    implementations rotated by r, so that over len(impls) rounds each is first once (following
    the previous pass, or the previous round's last) and otherwise follows its own pass."""
    passes = list(dict.fromkeys(ps for _, ps in runnable))
    order = []
    for ps in passes:
        keys = [k for k in runnable if k[1] == ps]
        shift = r % len(keys)
        order += keys[shift:] + keys[:shift]
    return order


def paired_ratio(a, b):
    """(median, min, max) over rounds of a's time / b's time in the same round (ms_repeats is in
    round order, and a round times both back to back): the clock's drift between rounds, which
    moves both alike, cancels, where a ratio of the two medians keeps it."""
    ratios = [x / y for x, y in zip(a["ms_repeats"], b["ms_repeats"])]
    return statistics.median(ratios), min(ratios), max(ratios)


SETTLE_ITERS = 3  # iterations a settling call runs (untimed) before it looks at the clock again


def settle(run_some, ms):
    """Runs `run_some` (a few untimed iterations of the pass about to be timed) until `ms` of wall
    time have passed, at least once when ms > 0: an H200 reaches its power limit within ~1 s of
    sustained work and its SM clock falls and dips while the controller settles (bench/NOTES.md),
    so a timing started cold runs at another clock than one on the plateau. Returns the calls."""
    calls = 0
    end = time.perf_counter() + ms / 1e3
    while ms > 0 and (calls == 0 or time.perf_counter() < end):
        run_some()
        calls += 1
    return calls


def round_ratios(records, a="mok", b="mok-py"):
    """{(preset, routing, pass): [a's time / b's time, one a round, in round order]} over the
    records of one or more layer_bench runs (a run's rounds appended after the previous run's)."""
    by = {}
    for r in records:
        by.setdefault((r["preset"], r["routing"], r["pass"], r["impl"], r["commit"], r["date"]), r)
    out = {}
    for (preset, routing, ps, impl, commit, date), r in by.items():
        other = by.get((preset, routing, ps, b, commit, date))
        if impl == a and other is not None:
            out.setdefault((preset, routing, ps), []).extend(x / y for x, y in zip(r["ms_repeats"], other["ms_repeats"]))
    return out


def median_interval(values, draws=2000, seed=0):
    """(median, low, high): the median and a 95 % bootstrap interval of it (seeded: the same
    numbers every time)."""
    import random

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return statistics.median(values), medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main():
    """`python3 bench/rounds.py RUN.json ... [--a mok] [--b mok-py]`: each (preset, pass)'s
    paired ratios round by round, pooled over the runs given, with their median and its 95 %
    bootstrap interval (what a few rounds' median cannot show: a trend over the rounds)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--a", default="mok")
    ap.add_argument("--b", default="mok-py")
    args = ap.parse_args()
    records = []
    for path in args.runs:
        with open(path) as f:
            records += json.load(f)
    print(f"{args.a} / {args.b}, paired by round: median [95 % interval], then every round")
    for (preset, routing, ps), ratios in round_ratios(records, args.a, args.b).items():
        med, lo, hi = median_interval(ratios)
        print(f"{preset:<20}{routing:<9}{ps:<8}{med:6.3f} [{lo:.3f}, {hi:.3f}]  n={len(ratios):<3} "
              + " ".join(f"{x:.3f}" for x in ratios))


if __name__ == "__main__":
    main()
