#!/usr/bin/env python3
"""Turns GPU-check outputs into committed records and readable tables.

  report.py gpucheck --junit ctest.xml [pytest.xml] --bench a.json b.json --gpu G --commit C --date D --out-dir DIR
      writes DIR/<date>-<commit>-bench.json (all benchmark records) and
      DIR/<date>-<commit>-gpucheck.json (each test's name and outcome), prints a table
  report.py table [--results-dir bench/results]
      writes bench/results/README.md: one table per benchmark file, newest first
"""
import argparse
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET


def test_outcomes(junit_path):
    tests = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        status = case.get("status", "")
        if case.find("failure") is not None or case.find("error") is not None or status == "fail":
            outcome = "failed"
        elif case.find("skipped") is not None or status in ("notrun", "disabled", "skipped"):
            outcome = "skipped"
        else:
            outcome = "passed"
        name, group = case.get("name"), case.get("classname")
        tests.append({"name": name if not group or group == name else f"{group}::{name}", "outcome": outcome})
    return tests


def table(records):
    """Markdown: per preset, TFLOP/s of each impl and pass, and ratios to the baselines."""
    by = {}
    for r in records:
        by.setdefault(r["preset"], {})[(r["impl"], r["pass"])] = r
    impls = sorted({r["impl"] for r in records if r["pass"] != "plan"})
    cols = [(i, p) for p in ("fwd", "fwd+bwd") for i in impls]
    head = "| preset | " + " | ".join(f"{i} {p} TFLOP/s" for i, p in cols)
    if "mok" in impls:
        head += " | mok/torch fwd | mok/torch fwd+bwd"
    if "mok-ep1" in impls:
        head += " | EP machinery time / mok fwd | EP machinery time / mok fwd+bwd"
    ep = "mok-ep" in impls and "torch-ep" in impls  # bench/ep_bench.py across GPUs
    if ep:
        head += " | mok-ep/torch-ep fwd | mok-ep/torch-ep fwd+bwd | mok-ep time / mok fwd | mok-ep time / mok fwd+bwd"
    head += " | torch/dense fwd | torch/dense fwd+bwd | torch peak GiB fwd+bwd"
    if "mok" in impls:
        head += " | mok peak GiB fwd+bwd | mok/torch peak"
    head += " | plan µs |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for preset, rs in by.items():
        cell = lambda k: f"{rs[k]['tflops']:.0f}" if k in rs else "–"

        def ratio(a, b, p):  # how many times faster a runs than b: time(b) / time(a)
            if (a, p) not in rs or (b, p) not in rs:
                return "–"
            return f"{rs[(b, p)]['ms'] / rs[(a, p)]['ms']:.3f}"  # (3 digits: the issues' bounds are 1.05, 1.25)

        row = f"| {preset} | " + " | ".join(cell(c) for c in cols)
        if "mok" in impls:
            row += f" | {ratio('mok', 'torch', 'fwd')} | {ratio('mok', 'torch', 'fwd+bwd')}"
        if "mok-ep1" in impls:
            row += f" | {ratio('mok', 'mok-ep1', 'fwd')} | {ratio('mok', 'mok-ep1', 'fwd+bwd')}"
        if ep:
            row += f" | {ratio('mok-ep', 'torch-ep', 'fwd')} | {ratio('mok-ep', 'torch-ep', 'fwd+bwd')}"
            row += f" | {ratio('mok', 'mok-ep', 'fwd')} | {ratio('mok', 'mok-ep', 'fwd+bwd')}"
        # torch/dense as a throughput ratio: dense time over torch time
        row += f" | {ratio('torch', 'dense', 'fwd')} | {ratio('torch', 'dense', 'fwd+bwd')}"
        peak = rs.get(("torch", "fwd+bwd"))
        peak = peak if peak and peak.get("peak_bytes") is not None else None
        row += f" | {peak['peak_bytes'] / 2**30:.2f}" if peak else " | –"
        if "mok" in impls:
            mine = rs.get(("mok", "fwd+bwd"))
            mine = mine if mine and mine.get("peak_bytes") is not None else None
            row += f" | {mine['peak_bytes'] / 2**30:.2f}" if mine else " | –"
            row += f" | {mine['peak_bytes'] / peak['peak_bytes']:.3f}" if mine and peak else " | –"
        plan = rs.get(("plan", "plan"))
        row += f" | {plan['ms'] * 1e3:.1f} |" if plan else " | – |"
        lines.append(row)
    return "\n".join(lines)


def cmd_gpucheck(a):
    records = []
    for path in a.bench:
        if os.path.exists(path):
            with open(path) as f:
                records += json.load(f)
        else:
            print(f"report: missing {path}", file=sys.stderr)
    tests = []
    for path in a.junit:  # ctest's and pytest's JUnit reports
        if os.path.exists(path):
            tests += test_outcomes(path)
        else:
            print(f"report: missing {path}", file=sys.stderr)
    for item in a.extra:  # "name=outcome" from checks outside ctest (compute-sanitizer)
        name, _, outcome = item.rpartition("=")
        tests.append({"name": name, "outcome": outcome})
    stem = f"{a.date[:10]}-{a.commit}"
    os.makedirs(a.out_dir, exist_ok=True)
    if a.bench:  # gpu_check.sh --part tests gives no benchmark, --part bench no tests
        with open(os.path.join(a.out_dir, f"{stem}-bench.json"), "w") as f:
            json.dump(records, f, indent=1)
        print(table(records))
    if not (a.junit or a.extra):
        return
    summary = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    with open(os.path.join(a.out_dir, f"{stem}-gpucheck.json"), "w") as f:
        json.dump({"gpu": a.gpu, "commit": a.commit, "date": a.date, "summary": summary, "tests": tests}, f, indent=1)
    print(f"\ntests on {a.gpu}: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped")
    for t in tests:
        if t["outcome"] != "passed":
            print(f"  {t['outcome']}: {t['name']}")


def result_files(results_dir):
    """(path, records) of every results file, newest run first (by the runs' dates)."""
    runs = []
    for path in glob.glob(os.path.join(results_dir, "*-bench.json")):
        with open(path) as f:
            records = json.load(f)
        if records:
            runs.append((records[0]["date"], path, records))
    return [(path, records) for _, path, records in sorted(runs, reverse=True)]


def cmd_table(a):
    out = ["# Benchmark results", "",
           "Generated by `python3 bench/report.py table` from the `*-bench.json` files here.",
           "TFLOP/s use DESIGN.md's convention (forward = 6·H·(routed pairs·I + T·I_s), fwd+bwd = 3× forward);",
           "ratios are time ratios taken in the same run. `torch`: PyTorch path (argsort, gather,",
           "`torch._grouped_mm`, SwiGLU, weighted sum; autograd for fwd+bwd). `dense`: cuBLAS/torch.matmul GEMMs",
           "with the same FLOPs (the ceiling; `cublas` is the same GEMMs called from C++). `plan`: the device planner alone.",
           "Peak memory: what one fwd+bwd needs beyond its inputs and weights (torch: peak allocated above the",
           "inputs; mok: workspace + saved tensor + y + dx + d_topk_weights + bf16 weight gradients).",
           "", "![TFLOP/s of the newest run](latest.svg)", ""]
    for path, records in result_files(a.results_dir):
        r0 = records[0]
        out += [f"## {os.path.basename(path)}", "",
                f"GPU {r0['gpu']}, commit {r0['commit']}, {r0['date']}, median of {r0.get('iters', '?')} iterations", "",
                table(records), ""]
    with open(os.path.join(a.results_dir, "README.md"), "w") as f:
        f.write("\n".join(out))


def cmd_plot(a):
    """Bar chart of the newest full results file: TFLOP/s of mok, torch and the dense ceiling per
    preset, forward and forward+backward (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The newest full run (partial runs, e.g. an EP overhead check, have no PyTorch records).
    _, records = next((path, r) for path, r in result_files(a.results_dir) if any(x["impl"] == "torch" for x in r))
    by = {(r["preset"], r["impl"], r["pass"]): r["tflops"] for r in records}
    presets = list(dict.fromkeys(r["preset"] for r in records))
    impls = [("mok", "MoK (fused)"), ("torch", "PyTorch"), ("dense", "dense GEMM ceiling")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=True)
    width = 0.8 / len(impls)
    for ax, pass_ in zip(axes, ("fwd", "fwd+bwd")):
        for i, (impl, label) in enumerate(impls):
            xs = [j + (i - 1) * width for j in range(len(presets))]
            ax.bar(xs, [by.get((p, impl, pass_), 0) for p in presets], width, label=label)
        ax.set_xticks(range(len(presets)), presets, rotation=35, ha="right")
        ax.set_title(pass_)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[0].legend()
    r0 = records[0]
    fig.suptitle(f"{r0['gpu']}, commit {r0['commit']}, {r0['date'][:10]}")
    fig.tight_layout()
    fig.savefig(os.path.join(a.results_dir, "latest.svg"), metadata={"Date": None})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpucheck")
    g.add_argument("--junit", nargs="*", default=[])
    g.add_argument("--bench", nargs="*", default=[])
    g.add_argument("--gpu", required=True)
    g.add_argument("--commit", required=True)
    g.add_argument("--date", required=True)
    g.add_argument("--out-dir", required=True)
    g.add_argument("--extra", nargs="*", default=[])
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    for name in ("table", "plot"):
        sub.add_parser(name).add_argument("--results-dir", default=results)
    a = ap.parse_args()
    {"gpucheck": cmd_gpucheck, "table": cmd_table, "plot": cmd_plot}[a.cmd](a)


if __name__ == "__main__":
    main()
