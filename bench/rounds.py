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
