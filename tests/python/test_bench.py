"""The benchmark's own pieces, without a GPU: the inputs both processes build from one hash,
the routings, the PyTorch layers it times (eager and the one written for torch.compile)
against the fp32 per-token reference, the checksum that ties mok_bench's outputs to
mok.moe's, and the report's ratios."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from bench_support import MOK_BENCH, ROOT, small_preset  # noqa: E402  (puts bench/ on sys.path)
import ab_compare  # noqa: E402
import ab_serve  # noqa: E402
import fp8_gemm_clocks  # noqa: E402
import host_overhead  # noqa: E402
import layer_bench  # noqa: E402
import report  # noqa: E402
import rounds  # noqa: E402
import torch_baseline as tb  # noqa: E402


@pytest.mark.skipif(not os.path.exists(MOK_BENCH), reason=f"{MOK_BENCH} not built (scripts/test.sh builds it)")
def test_hash_fill_is_mok_bench_fill_element_for_element():
    n, seed = 5000, 16 * 3 + 2
    out = subprocess.run([MOK_BENCH, "--fill-sample", str(seed), str(n)], check=True, capture_output=True, text=True)
    cpp = torch.tensor([int(v) for v in out.stdout.split()], dtype=torch.int32)
    ours = tb.hash_fill((n,), seed, "cpu")
    assert torch.equal(ours.view(torch.int16).to(torch.int32) & 0xFFFF, cpp)
    values = ours.float()
    assert values.abs().max() <= 0.125 and values.std() > 0.05 and (values == 0).float().mean() < 0.01
    assert not torch.equal(tb.hash_fill((n,), seed + 1, "cpu"), ours)


@pytest.mark.parametrize("kind", tb.ROUTINGS)
def test_routing_is_distinct_per_token_and_reproducible(kind):
    ids, w = tb.make_routing(4096, 32, 4, kind, seed=3, device="cpu")
    assert ids.dtype == torch.int32 and ids.shape == (4096, 4) and w.dtype == torch.float32
    assert int(ids.min()) >= 0 and int(ids.max()) < 32
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), "a token routed twice to one expert"
    torch.testing.assert_close(w.sum(1), torch.ones(4096))
    again, _ = tb.make_routing(4096, 32, 4, kind, seed=3, device="cpu")
    assert torch.equal(ids, again)


def test_zipf_routing_is_skewed_and_uniform_is_not():
    uniform, _ = tb.make_routing(8192, 32, 4, "uniform", seed=1, device="cpu")
    zipf, _ = tb.make_routing(8192, 32, 4, "zipf1.2", seed=1, device="cpu")
    assert tb.max_load_ratio(uniform, 32) < 1.15
    assert tb.max_load_ratio(zipf, 32) > 3.0
    counts = torch.bincount(zipf.reshape(-1).long(), minlength=32).sort(descending=True).values.double()
    assert (counts[:-1] >= counts[1:]).all() and counts[0] > 4 * counts[16]  # a long tail, not a few hot experts


@pytest.mark.parametrize("shared,limit,routing", [(0, 0.0, "uniform"), (64, 0.5, "zipf1.2")])
def test_torch_layers_match_the_fp32_reference_and_each_other(shared, limit, routing):
    p = small_preset(shared, limit)
    d = tb.make_inputs(p, routing, seed=2, device="cpu")
    rows = torch.arange(p["tokens"])
    ref = tb.reference_rows(d, rows)
    eager, compilable = tb.TorchImpl(d, tb.moe_eager), tb.TorchImpl(d, tb.moe_compilable)
    outs = {}
    for name, impl in (("eager", eager), ("compilable", compilable)):
        for ps in tb.PASSES:
            outs[name, ps] = impl.outputs(ps)
            y = outs[name, ps]["y"].float()
            assert ((y - ref).norm() / ref.norm()) < 1e-2, (name, ps)
    for ps in tb.PASSES:
        got, want = outs["compilable", ps], outs["eager", ps]
        assert set(got) == set(want)
        for n in want:
            res = tb.compare(got[n], want[n])
            assert res["passed"], (n, ps, res)
    grads = outs["eager", "fwd+bwd"]
    assert set(grads) >= {"dx", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"}
    if shared:
        assert {"d_shared_gate", "d_shared_up", "d_shared_down"} <= set(grads)


def test_compare_fails_on_wrong_or_non_finite_values():
    a = torch.randn(1000)
    assert tb.compare(a, a)["passed"]
    assert not tb.compare(a * 1.05, a)["passed"]  # 5 % off
    b = a.clone()
    b[7] = float("nan")
    assert not tb.compare(b, a)["passed"]
    assert not tb.compare(a[:999], a)["passed"]


def test_compiled_layer_compiles_whole_for_both_passes():
    """fullgraph=True: a graph break would raise. Forward and forward+backward agree with
    the uncompiled function."""
    tb.configure_compile()
    torch._dynamo.reset()
    p = small_preset(shared=64, limit=7.0, tokens=64)
    d = tb.make_inputs(p, "uniform", seed=4, device="cpu")
    eager = tb.TorchImpl(d, tb.moe_compilable)
    want = {ps: eager.outputs(ps) for ps in tb.PASSES}
    compiled = tb.TorchImpl(d, tb.compiled_layer())
    for ps in tb.PASSES:
        got = compiled.outputs(ps)
        for n in want[ps]:
            assert tb.compare(got[n], want[ps][n])["passed"], (n, ps)


def test_checksum_is_the_sum_of_words_times_odd_positions():
    gen = torch.Generator().manual_seed(0)
    for t in (torch.randn(6, 10, generator=gen).bfloat16(), torch.randn(33, generator=gen)):
        words = t.contiguous().view(-1).view(torch.int32).tolist()
        want = sum((w & 0xFFFFFFFF) * (2 * i + 1) for i, w in enumerate(words)) % (1 << 64)
        assert layer_bench.checksum(t) == want
        assert layer_bench.checksum(t, chunk=7) == want  # chunking does not change it
    t = torch.randn(64, generator=gen).bfloat16()
    u = t.clone()
    u[40] = -u[40]
    assert layer_bench.checksum(t) != layer_bench.checksum(u)


def test_report_table_quotes_ratios_to_torch_compiled(tmp_path):
    base = dict(preset="deepseek-v3", tokens=8192, ep=1, hidden=7168, intermediate=2048, experts=32, top_k=8,
                shared_intermediate=0, swiglu_limit=0.0, repeats=3, iters=10, gpu="NVIDIA H200", commit="abc1234",
                date="2026-12-01T00:00:00Z", max_load_ratio=1.05, check="passed")
    records = []
    for routing in ("uniform", "zipf1.2"):
        for ps, scale in (("fwd", 1.0), ("fwd+bwd", 3.0)):
            for impl, ms in (("mok", 10.0), ("mok-py", 10.5), ("torch-compiled", 12.0), ("torch", 15.0),
                             ("dense", 8.0)):
                records.append(dict(base, impl=impl, routing=routing, **{"pass": ps}, ms=ms * scale,
                                    ms_min=ms * scale * 0.99, ms_max=ms * scale * 1.02, tflops=100 / ms,
                                    peak_bytes=int(1e9 * (2 if impl == "torch-compiled" else 1))))
    text = report.layer_table(records)
    assert "1.200" in text  # mok / torch-compiled: 12 / 10
    assert "1.143" in text  # mok-py / torch-compiled: 12 / 10.5
    assert "1.500" in text  # mok / torch eager
    assert "0.500" in text  # peak mok / torch-compiled
    assert "zipf1.2" in text
    path = tmp_path / "2026-12-01-abc1234-layer-bench.json"
    path.write_text(json.dumps(records))
    assert report.result_files(str(tmp_path))[0][0] == str(path)


def test_report_table_of_an_ep_run_compares_mok_ep_with_the_compiled_ep_baseline():
    base = dict(preset="deepseek-v3", tokens=8192, ep=2, gpu="NVIDIA H200", commit="abc1234", repeats=3, iters=10,
                date="2026-12-01T00:00:00Z", routing="uniform", max_load_ratio=1.05, check="passed", peak_bytes=0)
    records = [dict(base, impl=impl, **{"pass": ps}, ms=ms, ms_repeats=[ms, ms, ms], tflops=1000 / ms,
                    dispatch_gbps=150.0 if impl == "mok-ep" else None)
               for ps in ("fwd", "fwd+bwd")
               for impl, ms in (("mok-ep", 10.0), ("torch-compiled-ep", 13.0), ("torch-ep", 16.0), ("mok-compute", 9.0))]
    text = report.layer_table(records)
    assert "mok-ep / torch-compiled-ep" in text and "1.300" in text and "1.600" in text and "0.900" in text
    assert "EP = 2" in text and "| 150 |" in text
    # mok-ep's FP8 variants: a column each and their ratios (to the baseline, to mok-ep, E4M3 pulls to bf16 ones)
    records += [dict(base, impl=impl, **{"pass": ps}, ms=ms, ms_repeats=[ms, ms, ms], tflops=1000 / ms)
                for ps in ("fwd", "fwd+bwd") for impl, ms in (("mok-ep-fp8", 8.0), ("mok-ep-fp8-e4m3", 6.4))]
    text = report.layer_table(records)
    assert "mok-ep-fp8 TFLOP/s" in text and "mok-ep-fp8-e4m3 TFLOP/s" in text
    assert "mok-ep-fp8 / torch-compiled-ep" in text and "1.625" in text  # 13 / 8
    assert "mok-ep-fp8 / mok-ep" in text and "1.250" in text  # 10 / 8
    assert "mok-ep-fp8-e4m3 / mok-ep-fp8" in text and "| 1.250 |" in text  # 8 / 6.4


def test_hf_bench_runs_both_backends_from_one_initialisation_on_cpu(tmp_path):
    """bench/hf_bench.py on a tiny Qwen3-MoE: the glue over mok.moe_torch and transformers'
    own grouped_mm backend give the same first loss, and the step's time splits into
    experts, attention and the rest."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "hf_bench.py"), "--impls", "mok_torch,grouped_mm",
                          "--size", "tiny", "--layers", "2", "--seq", "64", "--steps", "1", "--warmup", "0",
                          "--repeats", "2", "--device", "cpu", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    records = json.loads(out.read_text())
    assert [r["impl"] for r in records] == ["mok_torch", "grouped_mm"]
    for r in records:
        assert r["loss_rel_diff"] <= 1e-3 and r["tokens_per_s"] > 0 and len(r["ms_repeats"]) == 2
        parts = r["profile_ms"]
        assert {"experts fwd", "experts bwd", "attention fwd", "attention bwd", "rest"} <= set(parts)
        assert all(v > 0 for k, v in parts.items() if k != "rest"), parts


def test_ab_compare_takes_the_median_of_rounds_and_the_range_of_round_ratios(tmp_path):
    def round_file(side, i, ms):
        path = tmp_path / f"ab-{side}-{i}.json"
        path.write_text(json.dumps([dict(preset="p", impl="mok", **{"pass": "fwd"}, ms=ms, gpu="G", commit=side,
                                         date="d")]))
        return str(path)

    base = [round_file("base", i, ms) for i, ms in enumerate((10.0, 12.0, 11.0))]
    head = [round_file("head", i, ms) for i, ms in enumerate((9.0, 12.0, 11.0))]
    out = tmp_path / "ab.json"
    ab_compare.main(base + ["--head"] + head + ["--out", str(out)])
    got = json.loads(out.read_text())
    row = got["rows"][0]
    assert (got["base_commit"], got["head_commit"]) == ("base", "head")
    assert (row["base_ms"], row["head_ms"]) == (11.0, 11.0)
    assert row["ratio"] == 1.0 and row["ratio_min"] == 0.9 and row["ratio_max"] == 1.0 and row["rounds"] == 3


def test_ab_serve_rows_carry_the_round_ratios_and_the_bitwise_verdict():
    times = {("p", "fwd"): {"base": [10.0, 12.0, 11.0], "head": [9.0, 12.0, 11.0]}}
    (row,) = ab_serve.rows_of(times, {("p", "fwd"): True})
    assert (row["base_ms"], row["head_ms"], row["ratio"]) == (11.0, 11.0, 1.0)
    assert (row["ratio_min"], row["ratio_max"], row["rounds"], row["bitwise_equal"]) == (0.9, 1.0, 3, True)
    assert "largest change: p fwd 1.000" in ab_compare.table([row])



def test_ab_serve_records_name_gpu_commit_and_date(monkeypatch):
    monkeypatch.setenv("MOK_COMMIT", "abc123")
    meta = ab_serve.record_meta('{"gpu": "NVIDIA H200", "base": "x"}')
    assert meta["gpu"] == "NVIDIA H200" and meta["commit"] == "abc123" and meta["base"] == "x"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"])
    given = ab_serve.record_meta('{"gpu": "g", "commit": "c", "date": "d"}')
    assert (given["gpu"], given["commit"], given["date"]) == ("g", "c", "d")
    assert ab_serve.record_meta("{}")["gpu"]  # (nvidia-smi's name, or "unknown" without one)


def test_ab_serve_rows_keep_the_rounds_both_sides_completed():
    # (a mok_bench call that failed mid-round: the rounds before are still written)
    times = {("p", "fwd"): {"base": [10.0, 12.0], "head": [9.0]}, ("q", "fwd"): {"base": [5.0], "head": []}}
    (row,) = ab_serve.rows_of(times, {("p", "fwd"): True})
    assert (row["preset"], row["rounds"], row["ratio"], row["base_ms"]) == ("p", 1, 0.9, 10.0)

def test_report_lists_one_build_comparisons_of_two_implementations(tmp_path):
    """report.py's before/after section takes ab_serve's one-build files too (fp8bench's FP8 against
    bf16, the FP8 weight gradients' A/B, whose early files lack the impls) and names both sides."""
    row = dict(preset="p", **{"pass": "fwd+bwd"}, base_ms=10.0, head_ms=8.0, ratio=0.8, ratio_min=0.7, ratio_max=0.9,
               rounds=3, bitwise_equal=False)
    files = {"2026-12-06-abc-fp8-vs-bf16-fwd-bwd-wgrad.json": dict(commit="abc", base_impl="mok",
                                                                    head_impl="mok-fp8-wgrad", rows=[row]),
             "2026-12-05-def-fp8-wgrad-ab.json": dict(commit="def", rows=[row]),
             "2026-12-04-ghi-vs-jkl-ab.json": dict(base_commit="jkl", head_commit="ghi", rows=[row])}
    for name, d in files.items():
        (tmp_path / name).write_text(json.dumps(d))
    text = "\n".join(report.ab_tables(str(tmp_path)))
    assert text.index("fp8-vs-bf16") < text.index("fp8-wgrad-ab") < text.index("ghi-vs-jkl")  # newest first
    assert "commit abc, base mok, head mok-fp8-wgrad" in text
    assert "commit def, base mok-fp8, head mok-fp8-wgrad" in text
    assert "base jkl, head ghi" in text
    assert text.count("| p | fwd+bwd | 10.000 | 8.000 | 0.800 | 0.700–0.900 | False |") == 3


def power_record(impl, times, ps="fwd", date="2026-12-06T00:00:00Z"):
    """A clock_power.py record of preset p at 700 W, 1500 MHz: one round per time (ms), the
    median of three as its ms."""
    rounds = [dict(ms=t, samples=50, sm_mhz=1500.0, sm_mhz_min=1400.0, sm_mhz_max=1600.0, power_w=700.0,
                   power_w_min=690.0, power_w_max=705.0, throttle_reasons=["0x0000000000000004"]) for t in times]
    return dict(preset="p", impl=impl, **{"pass": ps}, routing="uniform", ms=sorted(times)[1], tflops=500.0,
                sm_mhz=1500.0, power_w=700.0, joules_per_tflop=1.0, rounds=rounds, seconds=3.0, skip_s=0.5,
                interval_ms=50, gpu="G", commit="abc", date=date, torch="2.11")


def test_report_lists_clock_power_runs_with_ratios_to_mok_per_round(tmp_path):
    """report.py's power section: clock_power.py's records, each implementation's rounds' min–max
    and how many times faster than mok it ran in the same rounds (time(mok) / time(impl))."""
    def rec(impl, ps, times):
        return power_record(impl, times, ps, date="2026-12-05T00:00:00Z")
    (tmp_path / "2026-12-05-abc-power-fp8.json").write_text(json.dumps(
        [rec("mok", "fwd", [10.0, 12.0, 11.0]), rec("mok-fp8", "fwd", [8.0, 8.0, 10.0]),
         rec("head:mok-fp8", "fwd+bwd", [5.0, 5.0, 5.0])]))
    (tmp_path / "2026-12-04-def-power.json").write_text(json.dumps([rec("mok", "fwd", [1.0, 1.0, 1.0])]))
    text = "\n".join(report.power_tables(str(tmp_path)))
    assert text.index("abc-power-fp8") < text.index("def-power")  # newest first
    assert "GPU G, commit abc, 2026-12-05T00:00:00Z, 3 rounds of 3 s windows" in text
    assert "| p | mok | fwd | 11.000 (10.000–12.000) | 500 | 1500 | 700 | 1.000 | 333 | – | 0x4 |" in text
    # rounds 10/8, 12/8, 11/10: 1.1–1.5; the medians' ratio 11/8
    assert "| p | mok-fp8 | fwd | 8.000 (8.000–10.000) | 500 | 1500 | 700 | 1.000 | 333 | 1.375 (1.100–1.500) | 0x4 |" in text
    assert "| p | head:mok-fp8 | fwd+bwd | 5.000 (5.000–5.000) | 500 | 1500 | 700 | 1.000 | 333 | – | 0x4 |" in text  # (no mok fwd+bwd)
    assert report.power_tables(str(tmp_path / "nothing")) == []


def test_report_power_runs_without_mok_compare_to_mok_py_and_fp8_layers_to_torch_fp8(tmp_path):
    """A clock_power run of the Python layers: the base is mok-py, and each FP8 layer's speed against
    torch-fp8 in the same rounds (time(torch-fp8) / time(impl)) is a column of its own."""
    rec = power_record
    (tmp_path / "2026-12-06-abc-power-torch-fp8.json").write_text(json.dumps(
        [rec("mok-py", [12.0, 12.0, 12.0]), rec("mok-fp8-py", [8.0, 9.0, 10.0]), rec("torch-fp8", [9.0, 9.0, 9.0])]))
    text = "\n".join(report.power_tables(str(tmp_path)))
    assert "× mok-py's speed (min–max) | × torch-fp8's speed (min–max) | throttle |" in text
    # against mok-py: 12/8, 12/9, 12/10 (median 12/9); against torch-fp8: 9/8, 9/9, 9/10
    assert "| p | mok-fp8-py | fwd | 9.000 (8.000–10.000) | 500 | 1500 | 700 | 1.000 | 333 | 1.333 (1.200–1.500) | 1.000 (0.900–1.125) | 0x4 |" in text
    assert "| p | torch-fp8 | fwd | 9.000 (9.000–9.000) | 500 | 1500 | 700 | 1.000 | 333 | 1.333 (1.333–1.333) | – | 0x4 |" in text
    assert "| p | mok-py | fwd | 12.000 (12.000–12.000) | 500 | 1500 | 700 | 1.000 | 333 | – | – | 0x4 |" in text


def test_report_power_runs_with_the_dense_ceilings_give_each_layers_share_of_its_precisions(tmp_path):
    """With dense and dense-fp8 in the run: the BF16 layers against dense, the FP8 ones against
    dense-fp8, dense-fp8 against dense (what FP8 GEMMs gain at the same power), dense itself none."""
    rec = power_record
    (tmp_path / "2026-12-06-abc-power-ceilings.json").write_text(json.dumps(
        [rec("mok-py", [10.0, 10.0, 10.0]), rec("mok-fp8-py", [8.0, 8.0, 8.0]), rec("dense", [9.0, 9.0, 9.0]),
         rec("dense-fp8", [6.0, 6.0, 6.0]), rec("dense-fp8-blockwise", [7.2, 7.2, 7.2])]))
    text = "\n".join(report.power_tables(str(tmp_path)))
    assert "| × mok-py's speed (min–max) | of the dense ceiling's speed (min–max) | throttle |" in text
    assert "| p | mok-py | fwd | 10.000 (10.000–10.000) | 500 | 1500 | 700 | 1.000 | 333 | – | 0.900 (0.900–0.900) | 0x4 |" in text
    assert "| p | mok-fp8-py | fwd | 8.000 (8.000–8.000) | 500 | 1500 | 700 | 1.000 | 333 | 1.250 (1.250–1.250) | 0.750 (0.750–0.750) | 0x4 |" in text
    assert "| p | dense-fp8 | fwd | 6.000 (6.000–6.000) | 500 | 1500 | 700 | 1.000 | 333 | 1.667 (1.667–1.667) | 1.500 (1.500–1.500) | 0x4 |" in text
    assert "| p | dense | fwd | 9.000 (9.000–9.000) | 500 | 1500 | 700 | 1.000 | 333 | 1.111 (1.111–1.111) | – | 0x4 |" in text
    # the blockwise FP8 ceiling (the layer's recipe) against dense too: 9 / 7.2
    assert "| p | dense-fp8-blockwise | fwd | 7.200 (7.200–7.200) | 500 | 1500 | 700 | 1.000 | 333 | 1.389 (1.389–1.389) | 1.250 (1.250–1.250) | 0x4 |" in text


def test_fp8_gemm_clocks_reads_fp8_tile_rates_line_of_the_variant_it_ran():
    """fp8_gemm_clocks.parse_tile_rate: the median TFLOP/s of the named variant's line as
    fp8_tile_rate prints it (name, tile, stages, median, [min, max]); None when the line is missing."""
    text = ("# NVIDIA H100 80GB HBM3, 132 SMs, E4M3 GEMM M 8192 N 4096 K 7168, 520 launches a repeat, median of 16\n"
            "narrow      128 x 128 CTA tiles, 6 stages of 32 KB   1098.4 TFLOP/s  [1050.2, 1110.9]\n"
            "narrow+bmc  128 x 128 CTA tiles, 6 stages of 32 KB   1133.0 TFLOP/s  [1101.0, 1140.0]\n")
    assert fp8_gemm_clocks.parse_tile_rate(text, "narrow") == 1098.4
    assert fp8_gemm_clocks.parse_tile_rate(text, "narrow+bmc") == 1133.0
    assert fp8_gemm_clocks.parse_tile_rate(text, "current") is None


def test_fp8_gemm_clocks_runs_a_tile_variant_and_starts_its_window_at_the_timing_line(tmp_path):
    """run_tile_variant: passes the variant, shape, tile order and warm-up to fp8_tile_rate, returns
    the variant's median TFLOP/s and the moment its "timing" line came (the clock window's start,
    after the process's set-up); a run that fails or prints no such line stops naming the variant."""
    import argparse
    import datetime

    fake = tmp_path / "fp8_tile_rate"
    fake.write_text("#!/bin/sh\n"
                    "echo \"$@\" > \"$(dirname \"$0\")/argv\"\n"
                    "sleep 0.3\n"
                    "echo 'timing narrow-ss'\n"
                    "echo 'narrow-ss   128 x 128 CTA tiles, 6 stages of 32 KB    987.6 TFLOP/s  [950.0, 990.0]'\n")
    fake.chmod(0o755)
    args = argparse.Namespace(tile_rate=str(fake), group_rows=2048)
    before = datetime.datetime.now()
    tflops, began = fp8_gemm_clocks.run_tile_variant(args, "narrow-ss", 8192, 4096, 7168, 500, 12, 4)
    assert tflops == 987.6 and (began - before).total_seconds() >= 0.25
    assert (tmp_path / "argv").read_text().split() == [
        "--only", "narrow-ss", "--m", "8192", "--n", "4096", "--k", "7168", "--iters", "500", "--repeats", "12",
        "--group-rows", "2048", "--warmup", "4"]
    fake.write_text("#!/bin/sh\necho 'narrow   128 x 128 CTA tiles, 6 stages of 32 KB    987.6 TFLOP/s  [1, 2]'\n")
    with pytest.raises(SystemExit, match="fp8_tile_rate --only narrow failed"):
        fp8_gemm_clocks.run_tile_variant(args, "narrow", 8192, 4096, 7168, 500, 12, 4)


def test_fp8_gemm_clocks_refuses_unknown_implementations_and_shapes():
    """The harness names a bad --impl, a missing fp8_tile_rate and a shape the tile bench cannot run
    before it touches a GPU."""
    script = os.path.join(ROOT, "bench", "fp8_gemm_clocks.py")
    for argv, message in ((["--impl", "cutlass"], "--impl cutlass"),
                          (["--impl", "narrow", "--tile-rate", "/nonexistent"], "--tile-rate '/nonexistent'"),
                          (["--impl", "scaled-mm", "--m", "1000"], "--m 1000"),
                          (["--impl", "scaled-mm", "--group-rows", "3000"], "--group-rows 3000")):
        run = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True)
        assert run.returncode != 0 and message in run.stderr, (argv, run.stderr)


def test_cannot_run_names_why_a_peer_is_left_out():
    """torch_baseline.cannot_run (clock_power's and fp8_gemm_clocks' test of a peer GEMM): the first
    line of the error of a call that fails as a PyTorch that lacks it fails; other errors propagate."""
    def unsupported():
        raise NotImplementedError("scaled_mm: BlockWise1x128 is not supported on this device\nmore detail")

    def no_function():
        raise AttributeError("module 'torch.nn.functional' has no attribute 'scaled_mm'")

    def silent():
        raise RuntimeError()

    def bug():
        raise KeyError("fwd+bwd")

    assert tb.cannot_run(unsupported) == "scaled_mm: BlockWise1x128 is not supported on this device"
    assert tb.cannot_run(no_function) == "module 'torch.nn.functional' has no attribute 'scaled_mm'"
    assert tb.cannot_run(silent) == "RuntimeError"
    with pytest.raises(KeyError):
        tb.cannot_run(bug)


def test_report_lists_fp8_gemm_clock_runs_with_the_work_a_clock_against_scaled_mm(tmp_path):
    """report.py's section for fp8_gemm_clocks.py: per implementation the medians over rounds and
    its TFLOP/s per SM GHz over scaled-mm's."""
    def rec(impl, rnd, tflops, mhz):
        return dict(impl=impl, round=rnd, m=8192, n=4096, k=7168, tflops=tflops, tflops_per_ghz=tflops / (mhz / 1e3),
                    samples=40, sm_mhz=mhz, sm_mhz_min=mhz, sm_mhz_max=mhz, power_w=700.0, power_w_min=690.0,
                    power_w_max=705.0, throttle_reasons=["0x0000000000000004"], seconds=4.0, skip_s=1.0, gpu="G",
                    commit="abc", date="2026-12-06", torch="2.11")
    records = [rec("current", r, t, 1600.0) for r, t in enumerate((800.0, 960.0, 880.0))] + \
              [dict(rec("scaled-mm", r, 1100.0, 1375.0), kernels=["sm90_xmma_gemm_e4m3"]) for r in range(3)]
    (tmp_path / "2026-12-06-abc-fp8-gemm-clocks.json").write_text(json.dumps(records))
    text = "\n".join(report.fp8_gemm_clock_tables(str(tmp_path)))
    assert ("GPU G, commit abc, 2026-12-06, M 8192 N 4096 K 7168 (fp8_tile_rate's tiles in groups of 8192 rows), "
            "medians of 3 rounds of 4 s windows") in text  # (records before --group-rows: one group)
    # current: median 880 TFLOP/s at 1600 MHz = 550 a GHz; scaled-mm 1100 at 1375 = 800: 0.6875; no
    # scaled-mm-blockwise in this file: its speed column is empty
    assert "| current | 880 | 1600 | 700 | 550 | 0.688 | – | 0x4 |" in text
    assert "| scaled-mm | 1100 | 1375 | 700 | 800 | – | – | 0x4 |" in text
    assert "- scaled-mm ran `sm90_xmma_gemm_e4m3`" in text and "- current ran" not in text  # (which library ran)
    assert report.fp8_gemm_clock_tables(str(tmp_path / "nothing")) == []
    # with cuBLAS's blockwise GEMM in the file: each one's speed against it (880 / 1000)
    blockwise = [rec("scaled-mm-blockwise", r, 1000.0, 1500.0) for r in range(3)]
    (tmp_path / "2026-12-06-abc-fp8-gemm-clocks.json").write_text(json.dumps(records + blockwise))
    text = "\n".join(report.fp8_gemm_clock_tables(str(tmp_path)))
    assert "| current | 880 | 1600 | 700 | 550 | 0.688 | 0.880 | 0x4 |" in text
    assert "| scaled-mm-blockwise | 1000 | 1500 | 700 | 667 | 0.833 | – | 0x4 |" in text


def test_report_lists_compiled_fp8_module_runs_with_ratios_to_the_per_call_step(tmp_path):
    """report.py's section for bench/fp8_compiled_module.py: each variant's step time, min–max over
    the rounds, and time(per-call) / time(variant) per round; the run's checks below the table."""
    def rec(impl, times):
        return dict(preset="p", micro=4, impl=impl, ms=sorted(times)[1], ms_repeats=times, tflops=700.0, gpu="G",
                    commit="abc", date="2026-12-06T00:00:00Z")
    checks = {"p": dict(kept_equals_eager={"y": True, "dx": True}, per_call_finite={"y": True}, fp8_dgrad=True,
                        quantizations_a_step_of_two={"fp8-compiled": 1, "fp8-compiled-per-call": 2, "fp8-eager": 1})}
    (tmp_path / "2026-12-06-abc-fp8-compiled.json").write_text(json.dumps(dict(
        records=[rec("fp8-compiled", [10.0, 11.0, 12.0]), rec("fp8-compiled-per-call", [12.0, 13.0, 12.0])],
        checks=checks)))
    text = "\n".join(report.fp8_compiled_tables(str(tmp_path)))
    assert "GPU G, commit abc, 2026-12-06T00:00:00Z, 3 rounds" in text
    # rounds 12/10, 13/11, 12/12: median 1.182, 1.000–1.200
    assert "| p | 4 | fp8-compiled | 11.00 (10.00–12.00) | 700 | 1.182 (1.000–1.200) |" in text
    assert "| p | 4 | fp8-compiled-per-call | 12.00 (12.00–13.00) | 700 | – |" in text
    assert "kept = eager bitwise: True; FP8 dgrad: True; quantizations a step of two micro-batches: " in text
    assert report.fp8_compiled_tables(str(tmp_path / "nothing")) == []


def test_report_lists_training_runs_with_their_recipe_and_spikes(tmp_path):
    """report.py's training section: newest first by date, each backend's final loss against the
    run's bf16 mok, the recipe (old records have none) and the largest loss rise after the warm-up."""
    new = dict(example="train_moe_lm", date="2026-12-06T00:00:00Z", steps=6, seed=2, lr=1e-3, schedule="cosine",
               lr_warmup=2, clip=1.0, deterministic=True,
               backends={"mok": dict(losses=[5.0, 4.0, 3.0, 2.0, 2.0, 2.0], final_loss=2.0, tokens_per_s=1000.0),
                         "mok-fp8": dict(losses=[5.0, 4.0, 3.0, 4.5, 2.2, 2.1], final_loss=2.1, tokens_per_s=900.0)})
    old = dict(example="train_moe_lm", date="2026-12-01T00:00:00Z", steps=6, lr=3e-3,
               backends={"mok": dict(losses=[5.0] * 6, final_loss=5.0, tokens_per_s=1.0)})
    (tmp_path / "2026-12-06-zzz-train-fp8-seed2.json").write_text(json.dumps(new))
    (tmp_path / "2026-12-06-aaa-train.json").write_text(json.dumps(old))  # (named after, dated before)
    (tmp_path / "2026-12-06-bbb-train-other.json").write_text(json.dumps(dict(example="something else")))
    text = "\n".join(report.train_tables(str(tmp_path)))
    assert text.index("zzz") < text.index("aaa") and "bbb" not in text
    assert "| 6 | 2 | 0.001 | cosine, warm-up 2, clip 1, deterministic | mok-fp8 | 2.1000 | +5.00% | 1.500 | 900 |" in text
    assert "| mok | 2.0000 |  | 0.000 | 1,000 |" in text
    assert "| constant, no clipping (old) | mok | 5.0000 |  | 0.000 | 1 |" in text
    assert report.train_tables(str(tmp_path / "nothing")) == []


def test_pass_timeline_splits_host_and_gpu_idle_time():
    """host_overhead.pass_timeline on a synthetic trace (µs): two calls, each after a 100 µs
    flush; the layer's kernels with a gap of 30 µs (first call) and 50 µs (second)."""
    cpu = []
    gpu = []
    for base, gap in ((0.0, 30.0), (10_000.0, 50.0)):
        cpu += [("aten::zero_", base, base + 5), ("cudaLaunchKernel", base + 2, base + 4),  # the flush
                ("mok_call", base + 10, base + 400), ("mok_C", base + 70, base + 390),
                ("cudaLaunchKernel", base + 90, base + 95), ("cudaLaunchKernel", base + 100, base + 104)]
        gpu += [("fill_kernel", base + 4, base + 104),
                ("mok::plan", base + 120, base + 130),  # 16 µs after the flush
                ("mok::forward_kernel", base + 130 + gap, base + 2000)]
    cpu.sort(key=lambda c: c[1])
    py, cxx, first_idle, inner, big = host_overhead.pass_timeline(cpu, gpu)
    assert py == 60 and cxx == 20  # entry - call start, first launch - entry
    assert first_idle == 16
    assert inner == 40  # median of 30 and 50
    assert big[1] == "mok::plan" and big[2] == "mok::forward_kernel" and big[0] in (30, 50)


@pytest.mark.parametrize("impls", [("mok", "mok-py"), ("torch-compiled", "torch", "mok", "mok-py", "dense")])
def test_round_order_lets_every_implementation_follow_the_other_pass_equally_often(impls):
    """Over len(impls) rounds (twice over), each (impl, pass) runs once a round, and within a pass
    every implementation follows a key of another pass equally often: what ran just before
    (a heavy forward+backward, or a forward) does not favour one implementation."""
    runnable = [(impl, ps) for ps in ("fwd", "fwd+bwd") for impl in impls]
    sequence = []
    for r in range(2 * len(impls)):
        order = rounds.round_order(runnable, r)
        assert sorted(order) == sorted(runnable)
        sequence += order
    after_other_pass = {key: 0 for key in runnable}
    for before, key in zip(sequence[-1:] + sequence[:-1], sequence):  # (the rounds repeat: cyclic)
        after_other_pass[key] += before[1] != key[1]
    for ps in ("fwd", "fwd+bwd"):
        counts = {after_other_pass[(impl, ps)] for impl in impls}
        assert len(counts) == 1, (ps, after_other_pass)


def test_paired_ratio_pairs_rounds_and_summary_shows_it():
    """A clock that drifts between rounds moves both implementations alike: the per-round
    ratio stays at 0.98 where a ratio of the medians would not."""
    mok = dict(preset="p", routing="uniform", impl="mok", tflops=1.0, check="passed",
               ms_repeats=[1.00, 1.20, 1.40], ms=1.20, **{"pass": "fwd"})
    py = dict(mok, impl="mok-py", ms_repeats=[1.00 / 0.98, 1.20 / 0.98, 1.40 / 0.98], ms=1.20 / 0.98)
    med, lo, hi = rounds.paired_ratio(mok, py)
    assert abs(med - 0.98) < 1e-12 and abs(lo - 0.98) < 1e-12 and abs(hi - 0.98) < 1e-12
    assert "0.980 [0.980, 0.980]" in layer_bench.summary([mok, py])


def test_hooked_extension_calls_around_the_named_functions_and_passes_the_rest_through():
    """mok_impls.HookedExtension (the host-time diagnostics' stand-in for mok.ops' extension):
    before, the function, after, in that order, with its arguments and result; other names are
    the extension's own."""
    from types import SimpleNamespace

    from mok_impls import HookedExtension

    calls = []
    ext = SimpleNamespace(forward=lambda *a, **kw: calls.append(("forward", a, kw)) or "y", other=42)
    hooked = HookedExtension(ext, {"forward": (lambda: calls.append("before"), lambda: calls.append("after"))})
    assert hooked.forward(1, scratch=2) == "y"
    assert calls == ["before", ("forward", (1,), {"scratch": 2}), "after"]
    assert hooked.other == 42


def test_diagnostics_problem_is_mok_moe_arguments_in_order(monkeypatch):
    """mok_impls.preset_problem (host_env.py's and forward_stages.py's problem): the preset's
    tb.make_inputs tensors in mok.moe's positional order; diagnostic_args: their command line."""
    from mok_impls import diagnostic_args, preset_problem

    d, args = preset_problem("tiny", device="cpu")
    assert args[0] is d["x"] and args[1] is d["ids"] and args[2] is d["weights"]
    assert args[3] is d["w_gate"] and args[4] is d["w_up"] and args[5] is d["w_down"]
    assert args[6] is d["shared"] and args[7] is d["limit"]
    monkeypatch.setattr(sys, "argv", ["diag", "--rounds", "3"])
    a = diagnostic_args("doc", "tiny,olmoe-1b-7b")
    assert (a.preset, a.rounds, a.iters) == ("tiny,olmoe-1b-7b", 3, 5)


def test_settle_runs_the_pass_until_its_time_has_passed_and_not_at_all_when_off():
    calls = []
    assert rounds.settle(lambda: calls.append(1), 0) == 0 and not calls
    assert rounds.settle(lambda: calls.append(1), 1e-6) == 1  # at least once when on
    t0 = time.perf_counter()
    n = rounds.settle(lambda: time.sleep(0.005), 30)
    assert time.perf_counter() - t0 >= 0.03 and 2 <= n <= 7  # (sleeps may run long, never short)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)),
                    reason="needs a Hopper GPU")
@pytest.mark.skipif(not os.path.exists(MOK_BENCH), reason=f"{MOK_BENCH} not built (scripts/test.sh builds it)")
@pytest.mark.parametrize("queued", [False, True])
def test_synced_and_queued_timings_give_every_iteration(queued):
    """mok_bench's `time` / `time-queued` on the tiny preset and torch_baseline.time_ms(queued=...):
    one positive time per iteration, sorted, and each iteration's host time."""
    from mok_impls import MokBench

    d = tb.make_inputs(tb.load_presets()["tiny"], "uniform", seed=1)
    server = MokBench(MOK_BENCH)
    try:
        server.load("tiny", 1, d)
        reply = server.call("time-queued" if queued else "time", "fwd", 1, 4, "mok")
    finally:
        server.close()
    assert len(reply["ms"]) == 4 and reply["ms"] == sorted(reply["ms"]) and min(reply["ms"]) > 0
    assert len(reply["host_ms"]) == 4
    x, host = torch.randn(512, 512, device="cuda"), []
    times = tb.time_ms(lambda: x @ x, 1, 4, host=host, queued=queued)
    assert len(times) == 4 and times == sorted(times) and min(times) > 0 and len(host) == 4


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)),
                    reason="needs a Hopper GPU")
@pytest.mark.skipif(not os.path.exists(MOK_BENCH), reason=f"{MOK_BENCH} not built (scripts/test.sh builds it)")
def test_fp8_step_quantizes_the_weights_again_to_the_same_bits():
    """mok_bench's mok-fp8-step (the routed weights quantized again in every pass, as a step with
    one micro-batch an optimizer step) gives mok-fp8-wgrad's outputs bit for bit (the same weights
    quantize to the same bytes), and times."""
    from mok_impls import MokBench

    d = tb.make_inputs(tb.load_presets()["tiny"], "uniform", seed=1)
    server = MokBench(MOK_BENCH)
    try:
        server.load("tiny", 1, d)
        once = server.call("check", "fwd+bwd", "mok-fp8-wgrad")["checksums"]
        every = server.call("check", "fwd+bwd", "mok-fp8-step")["checksums"]
        again = server.call("check", "fwd+bwd", "mok-fp8-step")["checksums"]  # (its second pass: quantized again)
        reply = server.call("time-queued", "fwd+bwd", 1, 3, "mok-fp8-step")
    finally:
        server.close()
    assert len(once) >= 5 and once == every == again
    assert len(reply["ms"]) == 3 and min(reply["ms"]) > 0


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)),
                    reason="needs a Hopper GPU")
def test_fp8_compiled_module_bench_checks_and_times(tmp_path):
    """bench/fp8_compiled_module.py on the small preset: the kept compiled FP8 step is the eager
    module's bit for bit (its exit status says so), and every variant is timed."""
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fp8_compiled_module.py"), "--preset", "small",
                    "--micro", "1", "--rounds", "1", "--iters", "2", "--warmup", "1", "--out", str(out)], check=True)
    run = json.loads(out.read_text())
    assert sorted(r["impl"] for r in run["records"]) == sorted(("fp8-compiled", "fp8-compiled-per-call", "fp8-eager",
                                                               "bf16-compiled"))
    assert all(r["ms"] > 0 for r in run["records"]) and all(run["checks"]["small"]["kept_equals_eager"].values())


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)),
                    reason="needs a Hopper GPU")
def test_dense_fp8_ceiling_runs_the_layers_flops_in_e4m3(monkeypatch):
    """torch_baseline.dense_fp8_step: every GEMM an E4M3 torch._scaled_mm, and together exactly the
    layer's FLOPs in each pass (with and without a shared expert), as dense_step's in BF16."""
    import torch_baseline as tb

    real, flops = torch._scaled_mm, []

    def counted(a, b, **kwargs):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.t().is_contiguous()
        flops.append(2 * a.shape[0] * a.shape[1] * b.shape[1])
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    for p in (small_preset(), small_preset(shared=128)):
        steps = tb.dense_fp8_step(p)
        for ps in ("fwd", "fwd+bwd"):
            flops.clear()
            steps[ps]()
            torch.cuda.synchronize()
            assert sum(flops) == tb.layer_flops(p, ps), (p, ps)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)),
                    reason="needs a Hopper GPU")
def test_dense_fp8_blockwise_ceiling_runs_the_layers_flops_in_the_layers_recipe(monkeypatch):
    """dense_fp8_step(recipe="blockwise"): every GEMM a torch.nn.functional.scaled_mm with A scaled
    per 1 x 128 ([M, K/128]) and B per 128 x 128 block, together the layer's FLOPs; a shape whose K
    or N is not a multiple of 128 is refused by name."""
    import torch_baseline as tb

    F = torch.nn.functional
    real, flops = F.scaled_mm, []

    def counted(a, b, scale_a, recipe_a, scale_b, recipe_b, **kwargs):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.t().is_contiguous()
        assert recipe_a == F.ScalingType.BlockWise1x128 and recipe_b == F.ScalingType.BlockWise128x128
        assert tuple(scale_a.shape) == (a.shape[0], a.shape[1] // 128) and scale_b.shape[1] == b.shape[1] // 128
        flops.append(2 * a.shape[0] * a.shape[1] * b.shape[1])
        return real(a, b, scale_a, recipe_a, scale_b, recipe_b, **kwargs)

    monkeypatch.setattr(F, "scaled_mm", counted)
    p = dict(small_preset(tokens=128), hidden=256, intermediate=256)  # (K = 256 routed rows in the weight gradients)
    steps = tb.dense_fp8_step(p, recipe="blockwise")
    for ps in ("fwd", "fwd+bwd"):
        flops.clear()
        steps[ps]()
        torch.cuda.synchronize()
        assert sum(flops) == tb.layer_flops(p, ps), ps
    with pytest.raises(ValueError, match="multiples of 128"):
        tb.dense_fp8_step(dict(p, intermediate=192), recipe="blockwise")


def test_dense_fp8_step_names_an_unknown_recipe():
    """dense_fp8_step refuses a recipe it does not have before touching a GPU."""
    import torch_baseline as tb

    with pytest.raises(ValueError, match="recipe 'mxfp8'"):
        tb.dense_fp8_step(small_preset(), recipe="mxfp8")


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)),
                    reason="needs a Hopper GPU")
def test_sm_share_bench_times_every_setting(tmp_path):
    """bench/sm_share.py on the small preset: a record per compute_sms setting, each with its three
    timings, and the setting left back at every SM."""
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sm_share.py"), "--preset", "small", "--sms", "0,-16",
                    "--side-kernels", "4", "--repeats", "2", "--iters", "2", "--warmup", "1", "--out", str(out)],
                   check=True)
    records = json.loads(out.read_text())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert [r["compute_sms"] for r in records] == [0, sms - 16]
    assert all(r["layer_ms"] > 0 and r["side_ms"] > 0 and r["both_ms"] > 0 and len(r["rounds"]) == 2 for r in records)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)),
                    reason="needs a Hopper GPU")
def test_recompute_bench_times_three_variants_bitwise_checked(tmp_path):
    """bench/recompute.py on the small preset: the saving layer, recompute and checkpointing, each
    checked bitwise against the saving layer (the script exits otherwise), recompute holding less."""
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "recompute.py"), "--preset", "small", "--repeats", "2",
                    "--iters", "2", "--warmup", "1", "--out", str(out)], check=True)
    records = {r["variant"]: r for r in json.loads(out.read_text())}
    assert sorted(records) == ["checkpoint", "recompute", "save"]
    assert all(r["checked_bitwise"] and r["ms"] > 0 and len(r["rounds"]) == 2 for r in records.values())
    assert records["recompute"]["held_bytes"] < records["save"]["held_bytes"]


def test_recompute_bench_refuses_unknown_presets_by_name():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "recompute.py"), "--preset", "nope"],
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "recompute: unknown preset(s) nope; known: " in run.stderr


def test_round_ratios_pair_each_run_and_pool_the_runs():
    """rounds.round_ratios pairs mok with mok-py within a run (same commit and date) and appends
    the runs' rounds; median_interval's median is the plain median and the interval holds it."""
    def rec(impl, date, ms):
        return {"preset": "p", "routing": "uniform", "pass": "fwd", "impl": impl, "commit": "c", "date": date,
                "ms_repeats": ms}
    records = [rec("mok", "d1", [1.0, 2.0]), rec("mok-py", "d1", [2.0, 2.0]),
               rec("mok", "d2", [3.0]), rec("mok-py", "d2", [4.0]), rec("mok", "d3", [9.0])]  # (d3: no partner)
    assert rounds.round_ratios(records) == {("p", "uniform", "fwd"): [0.5, 1.0, 0.75]}
    med, lo, hi = rounds.median_interval([0.5, 1.0, 0.75])
    assert med == 0.75 and lo <= med <= hi and rounds.median_interval([0.5, 1.0, 0.75]) == (med, lo, hi)


def test_ab_serve_impls_times_two_implementations_of_one_build(monkeypatch, tmp_path, capsys):
    """--impls BASE,HEAD: both servers run the one --base binary; every check and time call of a
    side names that side's implementation; the verdict compares the two sides' checksums."""
    made, calls = [], []

    class FakeServer:
        def __init__(self, path):
            made.append(path)
            self.side = "base" if len(made) == 1 else "head"

        def call(self, cmd, *args):
            calls.append((self.side, cmd) + tuple(str(a) for a in args))
            if cmd == "check":
                return {"checksums": {"y": 7}}
            if cmd == "time":
                return {"ms": [2.0] if self.side == "base" else [1.0]}
            return {"ok": True}

        def close(self):
            pass

    monkeypatch.setattr(ab_serve, "MokBench", FakeServer)
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["ab_serve.py", "--base", "B/mok_bench", "--impls", "mok,mok-pp", "--preset",
                                      "olmoe-1b-7b", "--pass", "fwd,fwd+bwd", "--rounds", "2", "--out", str(out)])
    ab_serve.main()
    assert made == ["B/mok_bench", "B/mok_bench"]
    for side, impl in (("base", "mok"), ("head", "mok-pp")):
        timed = [c for c in calls if c[0] == side and c[1] in ("check", "time")]
        assert len(timed) == 2 * (1 + 2) and all(c[-1] == impl for c in timed)
    rows = json.load(open(out))["rows"]
    assert [(r["pass"], r["ratio"], r["bitwise_equal"]) for r in rows] == [("fwd", 0.5, True), ("fwd+bwd", 0.5, True)]
    # the side that goes first alternates round by round (a fixed order biased the second side)
    for ps in ("fwd", "fwd+bwd"):
        order = [c[0] for c in calls if c[1] == "time" and c[2] == ps]
        assert order == ["base", "head", "head", "base"], (ps, order)
    with pytest.raises(SystemExit):
        monkeypatch.setattr(sys, "argv", ["ab_serve.py", "--base", "B", "--impls", "mok"])
        ab_serve.main()


def test_report_table_of_an_fp8_run_quotes_python_fp8_against_torch_fp8():
    """An FP8 run without torch-compiled (mok-py, mok-fp8-py, torch-fp8): the Python FP8 layer's
    ratios to its BF16 twin and to torch-fp8, per round."""
    base = dict(preset="deepseek-v3", tokens=8192, ep=1, repeats=3, iters=10, gpu="NVIDIA H200", commit="abc1234",
                date="2026-12-03T00:00:00Z", routing="uniform", max_load_ratio=1.05, check="passed", peak_bytes=0)
    records = [dict(base, impl=impl, **{"pass": "fwd+bwd"}, ms=ms, ms_repeats=[ms, ms, ms], tflops=1000 / ms)
               for impl, ms in (("mok-py", 12.0), ("mok-fp8-py", 10.0), ("torch-fp8", 13.0))]
    text = report.layer_table(records)
    assert "mok-fp8-py / mok-py" in text and "1.200" in text  # 12 / 10
    assert "mok-fp8-py / torch-fp8" in text and "1.300" in text  # 13 / 10
    assert "| peak GiB torch-compiled" not in text and "/ torch-compiled" not in text  # (a baseline it did not time)
    assert "timed no torch-compiled" in text  # and it says its ratios are not to PyTorch's strongest layer


def test_clock_power_compares_a_second_builds_impl_round_by_round():
    """head:<impl> records (--mok-bench-head) against <impl> from the first build: the medians' ratio
    and the min–max of the rounds' ratios; a head impl without its base twin gives no line."""
    import clock_power

    def rec(impl, ps, times):
        return dict(preset="p", impl=impl, **{"pass": ps}, ms=sorted(times)[1], rounds=[dict(ms=t) for t in times])
    lines = clock_power.head_ratios([rec("mok", "fwd", [10.0, 10.0, 12.0]), rec("head:mok", "fwd", [9.0, 9.5, 10.8]),
                                     rec("head:mok-fp8", "fwd", [5.0, 5.0, 5.0])])
    assert len(lines) == 1
    assert "p" in lines[0] and "mok: head/base time 0.950 (0.900–0.950 over 3 rounds)" in lines[0]
    assert {"mok-fp8-wgrad", "head:mok-fp8-wgrad", "torch-compiled", "torch-fp8", "mok-fp8-py"} <= set(clock_power.IMPLS)  # (names it takes)


def test_clock_power_reads_nvidia_smi_samples_and_their_window():
    import datetime

    import clock_power

    text = ("2026/12/03 15:32:01.412, 1575, 692.11, 0x0000000000000004\n"
            "2026/12/03 15:32:01.462, 1440, 699.50, 0x0000000000000004\n"
            "2026/12/03 15:32:01.512, [N/A], 650.00, 0x0000000000000000\n"  # unreadable: skipped
            "2026/12/03 15:32:01.562, 1980, 82.00, 0x0000000000000000\n"
            "2026/12/03 15:32:0")  # cut short by the sampler's kill: skipped
    s = clock_power.parse_samples(text)
    assert [x[1] for x in s] == [1575.0, 1440.0, 1980.0] and s[1][2] == 699.5
    assert s[0][0] == datetime.datetime(2026, 12, 3, 15, 32, 1, 412000)
    start = datetime.datetime(2026, 12, 3, 15, 32, 1, 0)
    w = clock_power.window_stats(s, start, datetime.datetime(2026, 12, 3, 15, 32, 1, 500000), skip_s=0.44)
    assert w["samples"] == 1 and w["sm_mhz"] == 1440.0 and w["power_w"] == 699.5  # 01.412 falls in the skipped ramp
    w = clock_power.window_stats(s, start, datetime.datetime(2026, 12, 3, 15, 32, 2), skip_s=0.0)
    assert (w["samples"], w["sm_mhz"], w["sm_mhz_min"], w["sm_mhz_max"]) == (3, 1575.0, 1440.0, 1980.0)
    assert w["throttle_reasons"] == ["0x0000000000000000", "0x0000000000000004"]
    assert clock_power.window_stats(s, start, start, skip_s=0.0) is None
    # 700 W for a 10 ms pass of 7 TFLOP: 1 J / TFLOP
    assert abs(clock_power.joules_per_tflop(700.0, 10.0, 7e12) - 1.0) < 1e-12


def test_clock_power_samples_the_gpu_cuda_runs_on():
    import clock_power

    assert clock_power.smi_index(0, visible="") == "0" and clock_power.smi_index(1, visible="") == "1"
    assert clock_power.smi_index(0, visible="3,5") == "3" and clock_power.smi_index(1, visible="3,5") == "5"
    assert clock_power.smi_index(0, visible="GPU-1234abcd") == "GPU-1234abcd"


def test_report_quotes_fp8_against_the_faster_pytorch_layer_of_each_round():
    """With both PyTorch layers timed, the FP8 layer's ratio to the faster of them in each round
    (torch-fp8 won the first two rounds here, torch-compiled the third)."""
    base = dict(preset="mixtral-8x7b", tokens=8192, ep=1, repeats=3, iters=10, gpu="NVIDIA H200", commit="abc1234",
                date="2026-12-03T00:00:00Z", routing="uniform", max_load_ratio=1.03, check="passed", peak_bytes=0)
    times = {"mok-py": [12.0, 12.0, 12.0], "mok-fp8-py": [10.0, 10.0, 10.0], "torch-compiled": [13.0, 13.0, 10.5],
             "torch-fp8": [11.0, 12.0, 14.0]}
    records = [dict(base, impl=impl, **{"pass": "fwd"}, ms=sorted(ms)[1], ms_repeats=ms, tflops=1000 / sorted(ms)[1])
               for impl, ms in times.items()]
    assert report.round_ratio({r["impl"]: r for r in records}, "mok-fp8-py", report.BEST_TORCH) == (1.1, 1.05, 1.2)
    text = report.layer_table(records)
    assert "mok-fp8-py / faster PyTorch" in text and "1.100 (1.050–1.200)" in text
    assert "mok-fp8 / faster PyTorch" not in text  # (mok-fp8 was not timed)
    without = [r for r in records if r["impl"] != "torch-compiled"]
    assert "faster PyTorch" not in report.layer_table(without)  # only one PyTorch layer: no such claim


def test_mok_bench_path_takes_the_given_one_else_a_build():
    import mok_impls

    assert mok_impls.mok_bench_path("/x/mok_bench") == "/x/mok_bench"
    found = mok_impls.mok_bench_path("")
    assert found.endswith(os.path.join("bench", "mok_bench"))
    assert os.path.basename(os.path.dirname(os.path.dirname(found))) in ("build-gpu", "build")


def test_ncu_layer_sums_every_kernels_metrics_of_an_ncu_csv_log():
    import ncu_layer

    head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
           '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'

    def row(ident, kernel, metric, unit, value):
        return f'"{ident}","1","python3","h","{kernel}","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","m","{metric}","{unit}","{value}"'
    lines = ["==PROF== Connected to process 1", head,
             row(0, "gemm", "dram__bytes_read.sum", "byte", "1,500,000,000"),
             row(0, "gemm", "dram__bytes_write.sum", "byte", "250000000"),
             row(0, "gemm", "gpu__time_duration.sum", "nsecond", "2,000,000"),
             row(1, "swiglu", "dram__bytes_read.sum", "byte", "500000000"),
             row(1, "swiglu", "gpu__time_duration.sum", "nsecond", "500000"),
             row(1, "swiglu", "sm__cycles_elapsed.avg", "cycle", "99"),
             "==PROF== Disconnected from process 1"]
    t = ncu_layer.summarize(lines)
    assert t == {"kernels": 2, "read_gb": 2.0, "written_gb": 0.25, "ms": 2.5}
    lines.insert(-1, row(2, "void mok::kernels::(anonymous namespace)::quantize_columns_kernel<Storage<4, (bool)1>>"
                            "(mok::kernels::P)", "gpu__time_duration.sum", "nsecond", "3,000,000"))
    lines.insert(-1, row(3, "swiglu", "gpu__time_duration.sum", "nsecond", "250000"))
    per = ncu_layer.by_kernel(lines)  # (a name's launches together, the longest first)
    assert [name for name, _ in per] == ["mok::kernels::quantize_columns_kernel", "gemm", "swiglu"]
    assert per[2][1] == {"kernels": 2, "read_gb": 0.5, "written_gb": 0.0, "ms": 0.75}
    # ncu's other spellings of an anonymous namespace (mok_bench's kernels came out as 'unnamed')
    assert ncu_layer.kernel_name("unnamed>::quantize_blocks_kernel(QuantizeParams, bool)") == "quantize_blocks_kernel"
    assert ncu_layer.kernel_name("void mok::<unnamed>::k<Storage<4>>(P<2>)") == "mok::k"
    with pytest.raises(ValueError):
        ncu_layer.summarize(["==PROF== nothing profiled"])


@pytest.mark.parametrize("shared", [0, 64])
def test_liger_peer_passes_the_layer_in_liger_s_layout(shared):
    """bench/liger_peer.py on the CPU over a stand-in for Liger's Function (its kernels are
    Triton, GPU only): the arguments in Liger's order and layout (x, [E, 2I, H] gate rows first,
    [E, H, I], int32 ids, the routing weights), the shared expert added beside it, every output
    as layer_bench's reference path gives it; a SwiGLU clamp refused by name."""
    import types

    import liger_peer

    calls = []

    def apply(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
        assert top_k_index.dtype == torch.int32 and gate_up_proj.shape[1] == 2 * down_proj.shape[2]
        calls.append(top_k_weights.shape)
        return tb.moe_compilable(x, top_k_index.long(), top_k_weights, gate_up_proj, down_proj, None)

    p = small_preset(shared=shared, tokens=64)
    d = tb.make_inputs(p, "uniform", seed=9, device="cpu")
    peer = liger_peer.Liger(d, fn=types.SimpleNamespace(apply=apply))
    for ps in ("fwd", "fwd+bwd"):
        got = peer.outputs(ps)
        ref = tb.TorchImpl(d, tb.moe_eager).outputs(ps)
        assert set(got) == set(ref)
        for n in got:
            c = tb.compare(got[n], ref[n])
            assert c["passed"], (ps, n, c)
    assert calls == [(64, 2)] * 2
    with pytest.raises(ValueError, match="liger: its fused MoE has no SwiGLU clamp"):
        liger_peer.Liger(tb.make_inputs(small_preset(limit=7.0, tokens=64), "uniform", seed=9, device="cpu"),
                         fn=types.SimpleNamespace(apply=apply))


def test_summary_gives_mok_s_ratio_to_the_peer_where_it_ran():
    rec = lambda impl, ms: dict(preset="p", routing="uniform", impl=impl, tflops=1.0 / ms, check="passed",
                                ms_repeats=[ms], ms=ms, **{"pass": "fwd"})
    text = layer_bench.summary([rec("torch-compiled", 1.2), rec("mok", 1.0), rec("liger", 1.5)])
    header, row = text.splitlines()[:2]
    assert "mok/liger" in header and row.split()[-5:] == ["1.200", "-", "1.500", "-", "ok"]  # (compiled, py, liger)
    assert "mok/liger" not in layer_bench.summary([rec("torch-compiled", 1.2), rec("mok", 1.0)])


def test_sm_share_resolves_its_settings_and_the_hidden_share():
    """bench/sm_share.py: --sms values against the GPU's SM count (0 every SM, -n leaves n free,
    n is n; none outside 1 .. SMs), and the share of the side stream's time hidden under the layer."""
    import sm_share

    assert sm_share.resolve_sms([0, -8, -16, 100], 132) == [0, 124, 116, 100]
    for bad in (-132, 133, -200):
        with pytest.raises(ValueError, match=r"sm_share: --sms .* must be 1 \.\. 132"):
            sm_share.resolve_sms([bad], 132)
    assert sm_share.hidden_share(10.0, 2.0, 12.0) == 0.0  # (serialised)
    assert sm_share.hidden_share(10.0, 2.0, 10.5) == 0.75
    assert sm_share.hidden_share(10.0, 2.0, 9.9) == 1.0  # (noise clamped)
    assert sm_share.hidden_share(10.0, 0.0, 10.0) == 0.0


def test_report_lists_sm_share_runs(tmp_path):
    """report.py's section for bench/sm_share.py: each compute_sms setting's times, hidden share and
    the layer's time against the first setting's."""
    def rec(n, layer, side, both, hidden, vs):
        return dict(preset="p", routing="uniform", **{"pass": "fwd+bwd"}, compute_sms=n, sms=132, layer_ms=layer,
                    side_ms=side, both_ms=both, hidden=hidden, layer_vs_first=vs, rounds=[{}, {}, {}], side_kernels=100,
                    side_elems=1024, gpu="G", commit="abc", date="2026-12-06T00:00:00Z", torch="2.11")
    (tmp_path / "2026-12-06-abc-sm-share.json").write_text(json.dumps(
        [rec(0, 10.0, 2.0, 12.0, 0.0, 1.0), rec(116, 10.5, 2.0, 10.6, 0.95, 1.05)]))
    text = "\n".join(report.sm_share_tables(str(tmp_path)))
    assert "GPU G (132 SMs), commit abc, 2026-12-06T00:00:00Z, p fwd+bwd, 3 rounds; side: 100 x add_ of 1024 fp32" in text
    assert "| every SM | 10.000 | 2.000 | 12.000 | 0.00 | 1.000 |" in text
    assert "| 116 | 10.500 | 2.000 | 10.600 | 0.95 | 1.050 |" in text
    assert report.sm_share_tables(str(tmp_path / "nothing")) == []


def test_report_lists_recompute_runs(tmp_path):
    """report.py's section for bench/recompute.py: each variant's time against the saving layer's,
    the bytes held until the backward and the step's peak."""
    def rec(v, ms, vs, lo, hi, held, peak):
        return dict(preset="p", routing="uniform", variant=v, ms=ms, rounds=[ms] * 3, vs_save=vs, vs_save_range=[lo, hi],
                    held_bytes=held * 2**20, peak_bytes=peak * 2**20, checked_bitwise=True, gpu="G", commit="abc",
                    date="2026-12-06T00:00:00Z", torch="2.11", iters=10)
    (tmp_path / "2026-12-06-abc-recompute.json").write_text(json.dumps(
        [rec("save", 10.0, 1.0, 1.0, 1.0, 656, 3931), rec("recompute", 11.9, 1.19, 1.18, 1.25, 112, 4406)]))
    text = "\n".join(report.recompute_tables(str(tmp_path)))
    assert "GPU G, commit abc, 2026-12-06T00:00:00Z, 3 rounds of 10 iterations, PyTorch 2.11" in text
    assert "| p | save | 10.000 | 1.000 (1.000–1.000) | 656 | 3931 |" in text
    assert "| p | recompute | 11.900 | 1.190 (1.180–1.250) | 112 | 4406 |" in text
    assert report.recompute_tables(str(tmp_path / "nothing")) == []
