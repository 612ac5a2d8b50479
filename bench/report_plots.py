"""report.py's figures (needs matplotlib): `report.py plot` (bars of the newest layer run with the
torch-compiled baseline) and `report.py train-plot` (a training-example record's loss curves)."""
import json
import os

from report import EP_IMPLS, LAYER_IMPLS, has_baseline, is_layer_run, result_files


def cmd_plot(a):
    """Bars of the newest layer run with the torch-compiled baseline: TFLOP/s of every
    implementation per preset (median of the rounds, whiskers min–max), one panel per routing
    and pass (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path, records = next((p, r) for p, r in result_files(a.results_dir)
                         if is_layer_run(r) and not any(x["impl"] in EP_IMPLS for x in r) and has_baseline(r))
    routings = list(dict.fromkeys(r["routing"] for r in records))
    presets = list(dict.fromkeys(r["preset"] for r in records))
    impls = [i for i in LAYER_IMPLS if any(r["impl"] == i for r in records)]
    by = {(r["preset"], r["impl"], r["pass"], r["routing"]): r for r in records}
    fig, axes = plt.subplots(len(routings), 2, figsize=(16, 4.2 * len(routings)), sharey=True, squeeze=False)
    width = 0.8 / len(impls)
    for row, routing in enumerate(routings):
        for col, ps in enumerate(("fwd", "fwd+bwd")):
            ax = axes[row][col]
            for i, impl in enumerate(impls):
                xs, ys, lo, hi = [], [], [], []
                for j, p in enumerate(presets):
                    r = by.get((p, impl, ps, routing))
                    if r is None:
                        continue
                    xs.append(j + (i - (len(impls) - 1) / 2) * width)
                    ys.append(r["tflops"])
                    lo.append(r["tflops"] - r["tflops"] * r["ms"] / r.get("ms_max", r["ms"]))
                    hi.append(r["tflops"] * r["ms"] / r.get("ms_min", r["ms"]) - r["tflops"])
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=1.5, label=impl)
            ax.set_xticks(range(len(presets)), presets, rotation=35, ha="right")
            ax.set_title(f"{ps}, routing {routing}")
            ax.grid(axis="y", alpha=0.3)
        axes[row][0].set_ylabel("TFLOP/s")
    axes[0][0].legend(ncol=len(impls), fontsize=8)
    r0 = records[0]
    fig.suptitle(f"{r0['gpu']}, commit {r0['commit']}, {r0['date'][:10]} ({os.path.basename(path)})")
    fig.tight_layout()
    fig.savefig(os.path.join(a.results_dir, "latest.svg"), metadata={"Date": None})


def cmd_train_plot(a):
    """Loss per step of each backend of a training-example record (examples/train_moe_lm.py
    --out) and their tokens/s, as one SVG (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(a.input) as f:
        rec = json.load(f)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for name, b in rec["backends"].items():
        ax.plot(range(1, len(b["losses"]) + 1), b["losses"], label=f"{name} (final {b['final_loss']:.3f})", lw=1)
    ax.axhline(rec["entropy_floor"], color="gray", ls=":", lw=1, label="the chain's entropy (floor)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    names = list(rec["backends"])
    bx.bar(names, [rec["backends"][n]["tokens_per_s"] for n in names])
    bx.set_ylabel("tokens/s")
    bx.tick_params(axis="x", rotation=25)
    bx.grid(axis="y", alpha=0.3)
    c = rec["config"]
    fig.suptitle(f"train_moe_lm --size {rec['size']} ({c['layers']} layers, {c['experts']} experts top-{c['top_k']}), "
                 f"{rec['gpu']}, commit {rec['commit']}, {rec['date'][:10]}")
    fig.tight_layout()
    fig.savefig(a.output, metadata={"Date": None})
