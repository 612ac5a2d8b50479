#!/usr/bin/env python3
"""Turns GPU-check outputs into committed records and readable tables.

  report.py gpucheck --junit ctest.xml [pytest.xml] --bench a.json b.json --gpu G --commit C --date D --out-dir DIR
      writes DIR/<date>-<commit>-bench.json (all benchmark records) and
      DIR/<date>-<commit>-gpucheck.json (each test's name and outcome), prints a table
  report.py table [--results-dir bench/results]
      writes bench/results/README.md: one table per benchmark file, newest first
  report.py plot [--results-dir bench/results]
      writes bench/results/latest.svg from the newest layer benchmark file
  report.py train-plot --input RUN.json --output RUN.svg
      loss curves and tokens/s of a training-example record (examples/train_moe_lm.py --out)
"""
import argparse
import glob
import json
import os
import statistics
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


LAYER_IMPLS = ("mok", "mok-py", "torch-compiled", "torch", "dense", "mok-fp8", "mok-fp8-py", "torch-fp8", "liger")
EP_IMPLS = ("mok-ep", "torch-compiled-ep", "torch-ep", "mok-compute")


def measured(rs, impl):
    """Whether the run timed `impl` — or, for a tuple of implementations, every one of them."""
    return all(i in rs for i in impl) if isinstance(impl, tuple) else impl in rs


def round_times(rs, impl):
    """Each round's time of `impl`; of a tuple of implementations, the faster one's in each round."""
    times = [rs[i].get("ms_repeats") or [rs[i]["ms"]] for i in (impl if isinstance(impl, tuple) else (impl,))]
    return [min(t) for t in zip(*times)]


# PyTorch's strongest layer for an FP8 comparison: compiled BF16 or rowwise FP8, whichever is faster
# in the round (torch-fp8's forward beats the compiled BF16 layer on the large presets, its
# training step does not): a ratio to it is a ratio to the best PyTorch timed beside it.
BEST_TORCH = ("torch-compiled", "torch-fp8")


def round_ratio(rs, a, b):
    """How many times faster a runs than b, per interleaved round (time(b) / time(a) of the
    same round; b a tuple: the faster of them in each round): (median, min, max), or None."""
    if not measured(rs, a) or not measured(rs, b):
        return None
    ta, tb_ = round_times(rs, a), round_times(rs, b)
    ratios = sorted(y / x for x, y in zip(ta, tb_))
    n = len(ratios)
    med = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    return med, ratios[0], ratios[-1]


def fmt_ratio(r):
    if r is None:
        return "–"
    med, lo, hi = r
    return f"{med:.3f}" if lo == hi else f"{med:.3f} ({lo:.3f}–{hi:.3f})"


def layer_table(records):
    """Markdown tables of bench/layer_bench.py (one GPU) or bench/ep_bench.py (EP) records,
    one per routing and pass: TFLOP/s of each implementation, ratios per interleaved round
    (median and range) to the compiled and eager PyTorch baselines and to the ceiling or the
    compute-only floor, peak memory, the busiest expert's load, checks."""
    ep = any(r["impl"] in EP_IMPLS for r in records)
    if ep:
        me, base, eager = "mok-ep", "torch-compiled-ep", "torch-ep"
        ratios = [(f"{me} / {base}", me, base), (f"{me} / {eager}", me, eager),
                  (f"mok-compute time / {me} time", me, "mok-compute")]
        # mok-ep's variants (ring SM counts, FP8 with bf16 or E4M3 pulls): a column each, after the
        # four, and their ratios to the compiled baseline and to mok-ep
        variants = sorted({r["impl"] for r in records if r["impl"].startswith("mok-ep") and r["impl"] not in EP_IMPLS})
        ratios += [(f"{v} / {base}", v, base) for v in variants] + [(f"{v} / {me}", v, me) for v in variants]
        if {"mok-ep-fp8", "mok-ep-fp8-e4m3"} <= set(variants):
            ratios.append(("mok-ep-fp8-e4m3 / mok-ep-fp8", "mok-ep-fp8-e4m3", "mok-ep-fp8"))
        order = EP_IMPLS + tuple(variants)
    else:
        me, base, eager = "mok", "torch-compiled", "torch"
        ratios = [(f"mok / {base}", "mok", base), (f"mok-py / {base}", "mok-py", base), ("mok / torch", "mok", eager),
                  ("mok / dense", "mok", "dense"), ("mok / liger", "mok", "liger")]  # (liger: a peer, layer_bench --impl)
        if any(r["impl"] in ("mok-fp8", "torch-fp8") for r in records):  # issue 19's ratios
            ratios += [("mok-fp8 / mok", "mok-fp8", "mok"), ("mok-fp8 / torch-fp8", "mok-fp8", "torch-fp8"),
                       ("mok-fp8-py / mok-py", "mok-fp8-py", "mok-py"), ("mok-fp8-py / torch-fp8", "mok-fp8-py", "torch-fp8"),
                       ("mok-fp8 / faster PyTorch", "mok-fp8", BEST_TORCH),
                       ("mok-fp8-py / faster PyTorch", "mok-fp8-py", BEST_TORCH)]
        order = LAYER_IMPLS
    out = []
    impls_run = {r["impl"] for r in records}
    if {"torch-fp8"} & impls_run and "torch-compiled" not in impls_run:
        out += ["This run timed no torch-compiled: its ratios to torch-fp8 are not ratios to PyTorch's strongest "
                "layer (the compiled BF16 one is faster in forward+backward, and on the fine-grained presets in the "
                "forward too).", ""]
    for routing in dict.fromkeys(r.get("routing", "uniform") for r in records):
        for ps in ("fwd", "fwd+bwd"):
            by = {}
            for r in records:
                if r.get("routing", "uniform") == routing and r["pass"] == ps:
                    by.setdefault(r["preset"], {})[r["impl"]] = r
            if not by:
                continue
            impls = [i for i in order if any(i in rs for rs in by.values())]
            # only ratios this run measured both sides of (an FP8 run without torch-compiled gets no
            # mok / torch-compiled column: no ratio to a baseline that was not timed beside it)
            shown = [(t, a, b) for t, a, b in ratios if any(measured(rs, a) and measured(rs, b) for rs in by.values())]
            show_peak = any(i in rs for rs in by.values() for i in (me, base))
            head = ("| preset | " + " | ".join(f"{i} TFLOP/s" for i in impls) + "".join(f" | {t}" for t, _, _ in shown) +
                    (f" | peak GiB {me} | peak GiB {base} | peak {me} / {base}" if show_peak else "") +
                    " | busiest expert / mean")
            if ep and ps == "fwd":
                head += f" | {me} dispatch GB/s (lower bound) | NCCL dispatch alone GB/s"
            out += [f"### {ps}, routing {routing}" + (f", EP = {records[0].get('ep')}" if ep else ""), "",
                    head + " | checks |"]
            out.append("|" + "---|" * (out[-1].count("|") - 1))
            for preset, rs in by.items():
                row = f"| {preset} | " + " | ".join(f"{rs[i]['tflops']:.0f}" if i in rs else "–" for i in impls)
                row += "".join(f" | {fmt_ratio(round_ratio(rs, a, b))}" for _, a, b in shown)
                if show_peak:
                    peak = {i: rs[i]["peak_bytes"] for i in (me, base) if i in rs and rs[i].get("peak_bytes")}
                    row += "".join(f" | {peak[i] / 2**30:.2f}" if i in peak else " | –" for i in (me, base))
                    row += f" | {peak[me] / peak[base]:.3f}" if len(peak) == 2 else " | –"
                load = next(iter(rs.values())).get("max_load_ratio")
                row += f" | {load:.2f}" if load is not None else " | –"
                if ep and ps == "fwd":
                    gbps = rs.get(me, {}).get("dispatch_gbps")
                    nccl = next((r.get("nccl_dispatch_gbps") for r in rs.values() if r.get("nccl_dispatch_gbps")), None)
                    row += f" | {gbps:.0f}" if gbps else " | –"
                    row += f" | {nccl:.0f}" if nccl else " | –"
                bad = [i for i, r in rs.items() if r.get("check") == "failed"]
                row += f" | {'FAILED: ' + ', '.join(bad) if bad else 'passed'} |"
                out.append(row)
            out.append("")
    return "\n".join(out)


def is_layer_run(records):
    return any("ms_repeats" in r for r in records)


def has_baseline(records):
    """Whether the run timed the strongest PyTorch baseline beside mok (speed claims need it)."""
    return any(r["impl"] in ("torch-compiled", "torch-compiled-ep") for r in records)


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
        print(layer_table(records) if is_layer_run(records) else table(records))
    if not (a.junit or a.extra):
        return
    summary = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    part = "" if a.part in ("", "all", "tests") else f"-{a.part}"  # (a half of the tests: its own file)
    with open(os.path.join(a.out_dir, f"{stem}{part}-gpucheck.json"), "w") as f:
        json.dump({"gpu": a.gpu, "commit": a.commit, "date": a.date, "part": a.part or "tests", "summary": summary,
                   "tests": tests}, f, indent=1)
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


LAYER_NOTE = [
    "Layer runs (`bench/layer_bench.py`, one GPU): every implementation on the same inputs in one",
    "process, interleaved round by round (A B C …; runs after a1125b3 reverse the order every other round; runs after 1d82427 "
    "time each pass's implementations together and rotate them by one each round); a",
    "ratio is time(other) / time(mok) per round,",
    "quoted as the median over rounds with the min–max in brackets; TFLOP/s from the median of the",
    "rounds' medians. `mok`: the C++ layer (`mok_bench --serve`, no Python); `mok-py`: `mok.moe` from",
    "Python (autograd for fwd+bwd); `torch-compiled`: the best plain-PyTorch layer we could write",
    "(`torch._grouped_mm`, static shapes, SwiGLU and the fp32 combine fused by Inductor) under",
    "`torch.compile(dynamic=False, fullgraph=True)`; `torch`: the same layer in eager PyTorch",
    "(the path the project first measured against); `dense`: the same FLOPs as dense GEMMs (`torch.matmul`), the ceiling. `fwd` is a",
    "forward without autograd; `fwd+bwd` a training forward and its backward into bf16 gradients.",
    "Routing `uniform`: k distinct experts per token, uniformly; `zipf1.2`: expert popularity ∝",
    "1/rank^1.2 (k distinct per token). Checks (all at full size, before timing): mok-py's y and",
    "every gradient against autograd through eager PyTorch (rel ≤ 1e-2, cosine ≥ 0.9999); mok's",
    "outputs bitwise equal to mok-py's; torch-compiled against eager and, like eager, sampled rows",
    "against fp32. Peak memory: bytes one pass needs above the inputs and weights (gradients cleared",
    "before the pass, so fwd+bwd counts them); PyTorch's allocator peak for the Python impls, plus",
    "mok-py's workspace (outside that allocator); mok: workspace + y + its pool's high-water mark.",
]


# ab_serve files of one build comparing two implementations, written before ab_serve recorded them
# (gpu_check --part fp8wgrad): the implementations, by the file name's ending.
AB_IMPLS_BY_NAME = {"-fp8-wgrad-ab.json": ("mok-fp8", "mok-fp8-wgrad")}


def ab_files(results_dir):
    """Before/after files (scripts/ab_bench.sh, ab_serve with two builds) and ab_serve's one-build
    comparisons of two implementations (gpu_check's fp8wgrad and fp8bench parts), newest first."""
    paths = set()
    for pattern in ("*-vs-*-ab*.json", "*-fp8-wgrad-ab.json", "*-fp8-vs-bf16-*.json"):
        paths.update(glob.glob(os.path.join(results_dir, pattern)))
    return sorted(paths, key=lambda p: (os.path.basename(p)[:10], os.path.basename(p)), reverse=True)


def ab_impls(path, d):
    """(base impl, head impl) of an ab_serve file that compared two implementations, else None."""
    if "base_impl" in d and d["base_impl"] != d.get("head_impl"):
        return d["base_impl"], d["head_impl"]
    return next((v for k, v in AB_IMPLS_BY_NAME.items() if path.endswith(k)), None)


def ab_tables(results_dir):
    """Lines of bench/results/README.md for the before/after files (scripts/ab_bench.sh), newest first."""
    out = []
    for path in ab_files(results_dir):
        with open(path) as f:
            d = json.load(f)
        rows = d.get("rows", [])
        if not rows:
            continue
        if not out:
            out += ["## Before / after (scripts/ab_bench.sh, bench/ab_serve.py)", "",
                    "One GPU, one run: mok_bench built from a base tree and from the head (or one build's two",
                    "implementations, e.g. mok against mok-fp8), the same problem loaded in both, outputs checked",
                    "bitwise equal, then timed in alternating rounds (base, head, …).",
                    "head/base: median over rounds of the round medians; range: the per-round ratios.", ""]
        impls = ab_impls(path, d)
        sides = (f"commit {d.get('commit', '?')}, base {impls[0]}, head {impls[1]} (one build; their outputs differ by "
                 f"design where the precisions do)" if impls else
                 f"base {d.get('base_commit', '?')}, head {d.get('head_commit', '?')}")
        out += [f"### {os.path.basename(path)}", "",
                f"GPU {d.get('gpu', '?')}, {sides}, "
                f"{d.get('date', '?')}, {rows[0].get('rounds', '?')} rounds of {d.get('iters', '?')} iterations, "
                f"routing {d.get('routing', '?')}" + (f". {d['note']}" if d.get("note") else ""), "",
                "| preset | pass | base ms | head ms | head/base | range | bitwise equal |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            spread = f"{r['ratio_min']:.3f}–{r['ratio_max']:.3f}" if "ratio_min" in r else "one round"
            out.append(f"| {r['preset']} | {r['pass']} | {r['base_ms']:.3f} | {r['head_ms']:.3f} | {r['ratio']:.3f} | "
                       f"{spread} | {r.get('bitwise_equal', 'not checked')} |")
        out.append("")
    return out


def largest_rise(losses, start):
    """The highest a loss rose above the lowest one before it, from step `start` on."""
    lowest, rise = float("inf"), 0.0
    for step, loss in enumerate(losses):
        if step >= start:
            rise = max(rise, loss - lowest)
        lowest = min(lowest, loss)
    return rise


def train_tables(results_dir):
    """Lines of bench/results/README.md for the training example's records (*-train*.json), newest
    first: each backend's final loss (mean of the last 10 steps), its difference to the run's bf16
    `mok`, the largest loss rise after the warm-up (a spike's height) and tokens/s."""
    paths = sorted(glob.glob(os.path.join(results_dir, "*-train*.json")), reverse=True)
    records = []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        if d.get("example") == "train_moe_lm":
            records.append((path, d))
    records.sort(key=lambda pd: (pd[1].get("date", ""), os.path.basename(pd[0])), reverse=True)
    if not records:
        return []
    out = ["## Training example (examples/train_moe_lm.py)", "",
           "Final loss = mean of the last 10 steps; vs mok = its difference to the same run's bf16 `mok`;",
           "largest rise = the highest a loss rose above the lowest before it after the warm-up (a spike).",
           "Runs before 2026-12-05 used a constant learning rate without clipping and were not deterministic",
           "(two runs of one seed differed by up to 5 %).", "",
           "| file | steps | seed | lr | recipe | backend | final loss | vs mok | largest rise | tokens/s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for path, d in records:
        if "schedule" in d:
            recipe = (f"{d['schedule']}, warm-up {d['lr_warmup']}, clip {d['clip']:g}"
                      + (", deterministic" if d.get("deterministic") else ""))
        else:
            recipe = "constant, no clipping (old)"
        start = d.get("lr_warmup", 0)
        base = d["backends"].get("mok", {}).get("final_loss")
        for b, r in d["backends"].items():
            vs = f"{(r['final_loss'] - base) / base:+.2%}" if base and b != "mok" else ""
            rise = r["largest_rise"] if "largest_rise" in r else largest_rise(r["losses"], start)
            out.append(f"| {os.path.basename(path)} | {d['steps']} | {d.get('seed', 0)} | {d.get('lr', '?'):g} | {recipe} | "
                       f"{b} | {r['final_loss']:.4f} | {vs} | {rise:.3f} | {r['tokens_per_s']:,.0f} |")
    return out + [""]


def newest_files(results_dir, pattern, heading):
    """(the section's heading lines, or none without files; [(path, its JSON)] newest first by name)."""
    paths = sorted(glob.glob(os.path.join(results_dir, pattern)), key=os.path.basename, reverse=True)
    files = []
    for path in paths:
        with open(path) as f:
            files.append((path, json.load(f)))
    return (heading + [""] if files else []), files


def record_sections(files, caption, header, row):
    """A section per file of newest_files' whose JSON is a list of records: its name, caption(its
    first record), then a table of `header` (a markdown header row) with row(record) for each."""
    out = []
    for path, records in files:
        if records:
            out += [f"### {os.path.basename(path)}", "", caption(records[0]), "", header,
                    "|" + "---|" * header.count(" | ") + "---|"] + [row(r) for r in records] + [""]
    return out


def power_tables(results_dir):
    """Markdown sections for bench/clock_power.py files (`*-power*.json`), newest first: per
    preset and pass, each implementation's time (median of the rounds' medians, min–max), TFLOP/s,
    the samples' median SM clock and board power, the energy a TFLOP, the work a clock (TFLOP/s over
    the median SM clock in GHz: at the power limit the clock falls as the tensor cores get busier, so
    this, not TFLOP/s, says how well a kernel keeps them fed), and time(base) / time(impl) —
    how many times faster than the BF16 layer in the same rounds (base `mok`, else `mok-py`; the
    rounds' ratios' median, min–max); where the file has `torch-fp8`, the FP8 layers' time against
    it too (time(torch-fp8) / time(impl), round by round); where it has the ceilings `dense` /
    `dense-fp8`, each layer's share of its precision's ceiling (time(ceiling) / time(impl): the FP8
    layers against dense-fp8, the others against dense; dense-fp8 and dense-fp8-blockwise against dense too)."""
    out, files = newest_files(results_dir, "*-power*.json", [
        "## Sustained at the power limit (bench/clock_power.py)", "",
        "Each implementation repeats one pass back to back, queued as in training, for a few seconds a",
        "window (the first 0.5 s dropped), in rotated rounds, while nvidia-smi samples the SM clock and the",
        "board power; the L2 is flushed before each iteration as layer_bench does. Where the board sits",
        "at its power limit (throttle reason 0x4) this is the time a training step sees; the short",
        "synchronous rounds of the layer runs below start each timing below the limit."])

    def ratio(b, r):  # time(b) / time(r): the ratio of the medians, and the rounds' min–max
        per_round = [x["ms"] / y["ms"] for x, y in zip(b["rounds"], r["rounds"])]
        return f"{b['ms'] / r['ms']:.3f} ({min(per_round):.3f}–{max(per_round):.3f})"
    for path, records in files:
        if not records:
            continue
        r0 = records[0]
        impls = {r["impl"] for r in records}
        base_impl = "mok" if "mok" in impls else "mok-py"
        fp8_peer = "torch-fp8" in impls
        ceilings = bool(impls & {"dense", "dense-fp8", "dense-fp8-blockwise"})
        out += [f"### {os.path.basename(path)}", "",
                f"GPU {r0['gpu']}, commit {r0['commit']}, {r0['date']}, {len(r0['rounds'])} rounds of "
                f"{r0['seconds']:g} s windows, PyTorch {r0.get('torch', '?')}", "",
                f"| preset | impl | pass | ms (min–max) | TFLOP/s | SM MHz | W | J/TFLOP | TFLOP/s ÷ SM GHz "
                f"| × {base_impl}'s speed (min–max) |"
                + (" × torch-fp8's speed (min–max) |" if fp8_peer else "")
                + (" of the dense ceiling's speed (min–max) |" if ceilings else "") + " throttle |",
                "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if fp8_peer else "") + ("---|" if ceilings else "")
                + "---|"]
        base = {(r["preset"], r["pass"]): r for r in records if r["impl"] == base_impl}
        peer = {(r["preset"], r["pass"]): r for r in records if r["impl"] == "torch-fp8"}
        dense = {(r["impl"], r["preset"], r["pass"]): r for r in records
                 if r["impl"] in ("dense", "dense-fp8", "dense-fp8-blockwise")}
        fp8 = ("mok-fp8", "mok-fp8-py", "torch-fp8", "mok-fp8-wgrad", "mok-fp8-bf16dgrad", "mok-fp8-step",
               "mok-fp8-wgrad-1block", "mok-fp8-wgrad-2block", "mok-fp8-2block", "mok-fp8-bf16dgrad-2block")
        for r in records:
            times = [w["ms"] for w in r["rounds"]]
            b = base.get((r["preset"], r["pass"]))
            cells = ["–" if b is None or r["impl"] == base_impl else ratio(b, r)]
            if fp8_peer:
                f = peer.get((r["preset"], r["pass"]))
                cells.append(ratio(f, r) if f is not None and r["impl"] in ("mok-fp8", "mok-fp8-py") else "–")
            if ceilings:  # (the FP8 ceilings' own rows: against dense, the FP8 GEMMs' gain at the same power)
                ceiling = "dense" if r["impl"] in ("dense-fp8", "dense-fp8-blockwise") else "dense-fp8" \
                    if r["impl"].split(":")[-1] in fp8 else "dense"
                c = dense.get((ceiling, r["preset"], r["pass"]))
                cells.append(ratio(c, r) if c is not None and c is not r else "–")
            reasons = sorted({x for w in r["rounds"] for x in w["throttle_reasons"]})
            out.append(f"| {r['preset']} | {r['impl']} | {r['pass']} | {r['ms']:.3f} ({min(times):.3f}–{max(times):.3f}) | "
                       f"{r['tflops']:.0f} | {r['sm_mhz']:.0f} | {r['power_w']:.0f} | {r['joules_per_tflop']:.3f} | "
                       f"{r['tflops'] / (r['sm_mhz'] / 1000):.0f} | "
                       + " | ".join(cells) + f" | {' '.join(x.replace('0x000000000000000', '0x') for x in reasons)} |")
        out.append("")
    return out


def fp8_gemm_clock_tables(results_dir):
    """Markdown sections for bench/fp8_gemm_clocks.py files (`*-fp8-gemm-clocks*.json`), newest first:
    per implementation the medians over its rounds of TFLOP/s, SM clock, power and the work a clock
    (TFLOP/s per SM GHz), that work against scaled-mm's (PyTorch's rowwise FP8 GEMM) and the speed against
    scaled-mm-blockwise's (cuBLAS's GEMM of the layer's recipe) where the file has them."""
    out, files = newest_files(results_dir, "*-fp8-gemm-clocks*.json", [
        "## One E4M3 GEMM at the power limit: our mainloops beside torch._scaled_mm (bench/fp8_gemm_clocks.py)", "",
        "Each implementation repeats the same dense GEMM back to back for a window while nvidia-smi samples",
        "the SM clock and the board power; at the cap the clock falls until the power fits, so the work a",
        "clock (TFLOP/s per SM GHz) is what the kernel's structure decides. current is the layer's FP8",
        "mainloop (128 x 256 tiles), narrow 128 x 128 tiles (those of cuBLAS's FP8 kernels, which ran",
        "scaled-mm and scaled-mm-blockwise: the names below each table)."])
    for path, records in files:
        if not records:
            continue
        r0 = records[0]
        impls = list(dict.fromkeys(r["impl"] for r in records))
        med = {i: {f: statistics.median(r[f] for r in records if r["impl"] == i)
                   for f in ("tflops", "sm_mhz", "power_w", "tflops_per_ghz")} for i in impls}
        peer, blockwise = med.get("scaled-mm"), med.get("scaled-mm-blockwise")
        out += [f"### {os.path.basename(path)}", "",
                f"GPU {r0['gpu']}, commit {r0['commit']}, {r0['date']}, M {r0['m']} N {r0['n']} K {r0['k']} "
                f"(fp8_tile_rate's tiles in groups of {r0.get('group_rows') or r0['m']} rows), "
                f"medians of {len({r['round'] for r in records})} rounds of {r0['seconds']:g} s windows, "
                f"PyTorch {r0.get('torch', '?')}", "",
                "| impl | TFLOP/s | SM MHz | W | TFLOP/s ÷ SM GHz | ÷ scaled-mm's | TFLOP/s ÷ scaled-mm-blockwise's "
                "| throttle |",
                "|---|---|---|---|---|---|---|---|"]
        for i in impls:
            m = med[i]
            reasons = sorted({t for r in records if r["impl"] == i for t in r["throttle_reasons"]})
            ratio = f"{m['tflops_per_ghz'] / peer['tflops_per_ghz']:.3f}" if peer and i != "scaled-mm" else "–"
            speed = f"{m['tflops'] / blockwise['tflops']:.3f}" if blockwise and i != "scaled-mm-blockwise" else "–"
            out.append(f"| {i} | {m['tflops']:.0f} | {m['sm_mhz']:.0f} | {m['power_w']:.0f} | {m['tflops_per_ghz']:.0f} | "
                       f"{ratio} | {speed} | {' '.join(x.replace('0x000000000000000', '0x') for x in reasons)} |")
        kernels = {r["impl"]: r["kernels"] for r in records if r.get("kernels")}  # (the PyTorch GEMMs' kernels)
        if kernels:
            out += [""] + [f"- {i} ran {', '.join(f'`{k}`' for k in ks)}" for i, ks in kernels.items()]
        out.append("")
    return out


def sm_share_tables(results_dir):
    """Markdown sections for bench/sm_share.py files (`*-sm-share.json`), newest first: per
    compute_sms setting, the layer's time alone, the side chain's alone, both together, the share of
    the side chain hidden under the layer, and the layer's time against the first setting's."""
    out, files = newest_files(results_dir, "*-sm-share.json", [
        "## SMs left to other streams (bench/sm_share.py, mok.set_compute_sms)", "",
        "The layer alone, a chain of elementwise kernels on another stream alone (a stand-in for",
        "communication kernels: they need SMs of their own), and both together, queued, the L2 flushed",
        "before each iteration; hidden = (layer + side - both) / side."])
    return out + record_sections(
        files, lambda r0: f"GPU {r0['gpu']} ({r0['sms']} SMs), commit {r0['commit']}, {r0['date']}, {r0['preset']} "
                          f"{r0['pass']}, {len(r0['rounds'])} rounds; side: {r0['side_kernels']} x add_ of "
                          f"{r0['side_elems']} fp32",
        "| compute_sms | layer ms | side ms | both ms | hidden | layer / first setting's |",
        lambda r: f"| {r['compute_sms'] or 'every SM'} | {r['layer_ms']:.3f} | {r['side_ms']:.3f} | {r['both_ms']:.3f} | "
                  f"{r['hidden']:.2f} | {r['layer_vs_first']:.3f} |")


def recompute_tables(results_dir):
    """Markdown sections for bench/recompute.py files (`*-recompute.json`), newest first: per
    preset, the saving layer, mok.moe(recompute=True) and torch.utils.checkpoint around the
    saving layer — forward+backward time (median of the rounds) against the saving layer's in the
    same round (median, min–max), the bytes a forward keeps until its backward and the step's peak."""
    out, files = newest_files(results_dir, "*-recompute.json", [
        "## Recompute against saving and against activation checkpointing (bench/recompute.py)", "",
        "Forward+backward in rotated rounds, queued; held = what a training forward leaves allocated",
        "until its backward (y and what it keeps: a model of L layers holds L times that); peak = the",
        "step's, beyond the inputs; every output checked bitwise equal to the saving layer's."])
    return out + record_sections(
        files, lambda r0: f"GPU {r0['gpu']}, commit {r0['commit']}, {r0['date']}, {len(r0['rounds'])} rounds of "
                          f"{r0['iters']} iterations, PyTorch {r0['torch']}",
        "| preset | variant | ms | vs saving (min–max) | held MiB | peak MiB |",
        lambda r: f"| {r['preset']} | {r['variant']} | {r['ms']:.3f} | {r['vs_save']:.3f} "
                  f"({r['vs_save_range'][0]:.3f}–{r['vs_save_range'][1]:.3f}) | {r['held_bytes'] / 2**20:.0f} | "
                  f"{r['peak_bytes'] / 2**20:.0f} |")


def fp8_compiled_tables(results_dir):
    """Markdown sections for bench/fp8_compiled_module.py files (`*-fp8-compiled.json`), newest
    first: per preset and micro-batches a step, each variant's step time (median of the rounds,
    min–max), TFLOP/s and time(per-call) / time(variant), with the run's checks."""
    out, files = newest_files(results_dir, "*-fp8-compiled.json", [
        "## mok.MoE(precision=\"fp8\") under torch.compile (bench/fp8_compiled_module.py)", "",
        "A training step: `micro` forward+backward passes, then mok.fp8.weights_changed() (an optimizer",
        "step's effect on the kept copy), timed queued, variants rotated by round. `fp8-compiled`: the",
        "compiled module keeping its quantized weights (once a step, the FP8 dgrad and weight gradients);",
        "`fp8-compiled-per-call`: the same without the copy (the behaviour before 2026-12-05: quantized",
        "every call, bf16 dgrad); `fp8-eager`; `bf16-compiled`. Checked first: the kept compiled step's",
        "y, dx and weight gradients bitwise the eager module's, and the quantizations a step of two",
        "micro-batches (kept 1, per-call 2)."])
    for path, d in files:
        records, checks = d["records"], d["checks"]
        if not records:
            continue
        r0 = records[0]
        out += [f"### {os.path.basename(path)}", "",
                f"GPU {r0['gpu']}, commit {r0['commit']}, {r0['date']}, {len(r0['ms_repeats'])} rounds", "",
                "| preset | micro | impl | step ms (min–max) | TFLOP/s | per-call / this (min–max) |",
                "|---|---|---|---|---|---|"]
        base = {(r["preset"], r["micro"]): r for r in records if r["impl"] == "fp8-compiled-per-call"}
        for r in records:
            b = base.get((r["preset"], r["micro"]))
            ratio = "–"
            if b is not None and r is not b:
                per_round = [x / y for x, y in zip(b["ms_repeats"], r["ms_repeats"])]
                ratio = f"{statistics.median(per_round):.3f} ({min(per_round):.3f}–{max(per_round):.3f})"
            out.append(f"| {r['preset']} | {r['micro']} | {r['impl']} | {r['ms']:.2f} ({min(r['ms_repeats']):.2f}–"
                       f"{max(r['ms_repeats']):.2f}) | {r['tflops']:.0f} | {ratio} |")
        for name, c in checks.items():
            out.append("")
            out.append(f"Checks, {name}: kept = eager bitwise: {all(c['kept_equals_eager'].values())}; FP8 dgrad: "
                       f"{c['fp8_dgrad']}; quantizations a step of two micro-batches: "
                       f"{c.get('quantizations_a_step_of_two', '(not counted)')}")
        out.append("")
    return out


def cmd_table(a):
    out = ["# Benchmark results", "",
           "Generated by `python3 bench/report.py table` from the `*-bench.json` files here, newest first.",
           "TFLOP/s use docs/design.md's FLOP convention (forward = 6·H·(routed pairs·I + T·I_s), fwd+bwd = 3× forward).",
           ""] + LAYER_NOTE + [
           "",
           "Older runs (before the layer benchmark): `torch` there is the eager PyTorch path only, one",
           "round; `cublas` the dense GEMMs called from C++; `plan` the device planner alone.",
           "", "![TFLOP/s of the newest layer run](latest.svg)", ""]
    hf = sorted(glob.glob(os.path.join(a.results_dir, "*-hf.json")), reverse=True)
    if hf:
        out += ["## Hugging Face end to end (bench/hf_bench.py)", "",
                "A Qwen3-MoE model with the expert shapes of its `--size`, trained forward+backward through",
                "transformers with each `experts_implementation`, from one initialisation: tokens/s (median of the",
                "rounds, min–max), the first loss's relative difference to the first backend's, the step's GPU",
                "time by part (CUDA events from module hooks) and the peak memory.", ""]
        for path in hf:
            with open(path) as f:
                records = json.load(f)
            r0 = records[0]
            base = records[-1]["tokens_per_s"]
            out += [f"### {os.path.basename(path)}", "",
                    f"GPU {r0['gpu']}, commit {r0['commit']}, {r0['date']}, size {r0['size']}, {r0['layers']} layers, "
                    f"{r0['batch']} x {r0['seq']} tokens, {r0['repeats']} rounds of {r0['steps']} steps, "
                    f"PyTorch {r0.get('torch', '?')}", "",
                    "| impl | tokens/s | / " + records[-1]["impl"] + " | step ms (min–max) | loss rel. diff | "
                    "experts fwd ms | experts bwd ms | attention ms | rest ms | peak GiB |",
                    "|---|---|---|---|---|---|---|---|---|---|"]
            for r in records:
                pm = r["profile_ms"]
                attention = pm.get("attention fwd", 0) + pm.get("attention bwd", 0)
                out.append(f"| {r['impl']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.3f} | "
                           f"{r['ms']:.2f} ({min(r['ms_repeats']):.2f}–{max(r['ms_repeats']):.2f}) | "
                           f"{r['loss_rel_diff']:.1e} | {pm.get('experts fwd', 0):.2f} | {pm.get('experts bwd', 0):.2f} | "
                           f"{attention:.2f} | {pm.get('rest', 0):.2f} | {r['peak_bytes'] / 2**30:.2f} |")
            out.append("")
    out += power_tables(a.results_dir)
    out += fp8_gemm_clock_tables(a.results_dir)
    out += fp8_compiled_tables(a.results_dir)
    out += sm_share_tables(a.results_dir)
    out += recompute_tables(a.results_dir)
    out += ab_tables(a.results_dir)
    out += train_tables(a.results_dir)
    for path, records in result_files(a.results_dir):
        r0 = records[0]
        if is_layer_run(records):
            reps = max(r.get("repeats", 1) for r in records)
            desc = f"{reps} interleaved rounds of {r0.get('iters', '?')} iterations, PyTorch {r0.get('torch', '?')}"
            if r0.get("timing") == "queued":
                desc += ", each timing's iterations queued (the host ahead of the GPU)"
            if r0.get("settle_ms"):
                desc += f", each timing after {r0['settle_ms']:g} ms of untimed passes"
            if r0.get("warmup_rounds"):
                desc += f", after {r0['warmup_rounds']} untimed rounds"
            if not has_baseline(records) and any(r["impl"] == "torch-fp8" for r in records):
                desc += (". No torch-compiled in this run: mok's FP8 layer against PyTorch's (torch-fp8) and against mok's "
                         "own BF16 layer; the BF16 layer is not compared with PyTorch here")
            elif not has_baseline(records):
                desc += (". No torch-compiled in this run: it compares mok.moe from Python with the C++ call "
                         "(the binding's cost), not the layer with PyTorch")
            body = layer_table(records)
        else:
            desc = f"median of {r0.get('iters', '?')} iterations"
            body = table(records)
        out += [f"## {os.path.basename(path)}", "", f"GPU {r0['gpu']}, commit {r0['commit']}, {r0['date']}, {desc}", "",
                body, ""]
    with open(os.path.join(a.results_dir, "README.md"), "w") as f:
        f.write("\n".join(out))


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
    g.add_argument("--part", default="", help="gpu_check.sh's --part (ctest, pytest: <stem>-<part>-gpucheck.json)")
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    for name in ("table", "plot"):
        sub.add_parser(name).add_argument("--results-dir", default=results)
    t = sub.add_parser("train-plot")
    t.add_argument("--input", required=True)
    t.add_argument("--output", required=True)
    a = ap.parse_args()
    if a.cmd in ("plot", "train-plot"):
        import report_plots  # (matplotlib's figures: bench/report_plots.py)
        {"plot": report_plots.cmd_plot, "train-plot": report_plots.cmd_train_plot}[a.cmd](a)
    else:
        {"gpucheck": cmd_gpucheck, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    main()
