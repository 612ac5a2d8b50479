#!/usr/bin/env python3
"""Before/after table of mok_bench records from alternating rounds (scripts/ab_bench.sh).

  python3 bench/ab_compare.py BASE_ROUND.json ... --head HEAD_ROUND.json ... [--out FILE.json]

Per (preset, pass): the median over rounds of each side's median ms, head / base of those,
and the range of the per-round ratios (round i's head over round i's base). A ratio below 1
means head is faster. --out writes the rows (machine-readable, with both sides' commits).
"""
import argparse
import json
import statistics
import sys


def load(paths):
    """[{(preset, pass): record}] per round, in the order given."""
    rounds = []
    for path in paths:
        with open(path) as f:
            rounds.append({(r["preset"], r["pass"]): r for r in json.load(f)})
    return rounds


def row(preset, pass_, base_ms, head_ms, **extra):
    """One table row from each side's ms per round (round i of head against round i of base)."""
    per_round = [h / b for h, b in zip(head_ms, base_ms)]
    return dict(preset=preset, **{"pass": pass_}, base_ms=statistics.median(base_ms), head_ms=statistics.median(head_ms),
                ratio=statistics.median(head_ms) / statistics.median(base_ms), ratio_min=min(per_round),
                ratio_max=max(per_round), rounds=len(per_round), **extra)


def compare(base, head):
    """Rows per (preset, pass) present in every round of both sides."""
    keys = [k for k in base[0] if all(k in r for r in base + head)]
    return [row(preset, pass_, [r[(preset, pass_)]["ms"] for r in base], [r[(preset, pass_)]["ms"] for r in head])
            for preset, pass_ in keys]


def table(rows):
    lines = [f"{'preset':<20}{'pass':<9}{'base ms':>10}{'head ms':>10}{'head/base':>11}  range over rounds"]
    for r in rows:
        lines.append(f"{r['preset']:<20}{r['pass']:<9}{r['base_ms']:>10.3f}{r['head_ms']:>10.3f}{r['ratio']:>11.3f}"
                     f"  [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]")
    if rows:
        worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
        lines.append(f"largest change: {worst['preset']} {worst['pass']} {worst['ratio']:.3f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", nargs="+")
    ap.add_argument("--head", nargs="+", required=True)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    base, head = load(args.base), load(args.head)
    n = min(len(base), len(head))
    if n == 0:
        sys.exit("ab_compare: no rounds")
    rows = compare(base[:n], head[:n])
    print(table(rows))
    if args.out:
        first = lambda rounds: next(iter(rounds[0].values()), {})
        meta = dict(gpu=first(head).get("gpu"), base_commit=first(base).get("commit"),
                    head_commit=first(head).get("commit"), date=first(head).get("date"))
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
