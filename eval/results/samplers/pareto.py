"""Accuracy-NFE Pareto fronts and best speedups at <= 1 point loss, from ``summary.json``.

    python eval/results/samplers/pareto.py  # writes eval/results/samplers/pareto.md

Only reads the rows that ``dllm bench`` wrote (``summary.json`` is recomputed from ``runs/*.jsonl.gz``). Per
model x task: a cell is on the front when no other cell has at least its accuracy with fewer mean forwards,
or more accuracy with at most its forwards (the reference included). "Best at <= 1 pt" is the cell with the
largest NFE speedup whose accuracy is at least the reference's minus one point.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
TASKS = ("arith", "listops", "shuffle", "pick")
MODELS = ("tiny-llada", "tiny-dream", "tiny-sdar")
BASELINES = {"threshold", "factor", "llada", "dream", "sdar"}


def settings(row: dict) -> str:
    label = row["label"] or "defaults"
    return f"{row['sampler']} ({label})"


def front(rows: list[dict]) -> list[dict]:
    keep = []
    for r in rows:
        dominated = any(
            (o["accuracy"] >= r["accuracy"] and o["mean_nfe"] < r["mean_nfe"])
            or (o["accuracy"] > r["accuracy"] and o["mean_nfe"] <= r["mean_nfe"])
            for o in rows
            if o is not r
        )
        if not dominated:
            keep.append(r)
    return sorted(keep, key=lambda r: r["mean_nfe"])


def best(rows: list[dict], ref: dict, samplers: set[str] | None = None) -> dict | None:
    ok = [
        r
        for r in rows
        if not r["reference"]
        and r["accuracy"] >= ref["accuracy"] - 0.01 - 1e-9
        and (samplers is None or r["sampler"] in samplers)
    ]
    return max(ok, key=lambda r: (r["speedup_nfe"], r["accuracy"]), default=None)


def fmt(r: dict) -> str:
    return f"{100 * r['accuracy']:.1f} | {r['mean_nfe']:.2f} | {r['speedup_nfe']:.2f}x"


def main() -> None:
    rows = [r for r in json.loads((HERE / "summary.json").read_text()) if r.get("batch_size") == 1]
    out = ["# Pareto fronts (accuracy vs mean NFE per prompt, batch 1, greedy, n per cell as below)", ""]
    summary = [
        "## Best NFE speedup at <= 1 point accuracy loss",
        "",
        "| model | task | ref acc | ref NFE | best overall (acc, NFE, speedup) | settings "
        "| best baseline (threshold/factor) | settings |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for model in MODELS:
        for task in TASKS:
            cell = [r for r in rows if r["model"] == model and r["task"] == task]
            refs = [r for r in cell if r["reference"]]
            if not refs or len(cell) < 2:
                continue
            ref = refs[0]
            out += [
                f"## {model} / {task} (reference {settings(ref)}: {100 * ref['accuracy']:.1f}%, NFE "
                f"{ref['mean_nfe']:.2f}, n={ref['n']}; {len(cell)} cells)",
                "",
                "| accuracy (%) | mean NFE | speedup (NFE) | sampler (settings) |",
                "|---:|---:|---:|---|",
            ]
            out += [f"| {fmt(r)} | {settings(r)}{' **ref**' if r['reference'] else ''} |" for r in front(cell)]
            out.append("")
            b = best(cell, ref)
            bb = best(cell, ref, {"threshold", "factor"})
            summary.append(
                f"| {model} | {task} | {100 * ref['accuracy']:.1f} | {ref['mean_nfe']:.2f} | "
                + (f"{fmt(b).replace(' | ', ', ')} | {settings(b)}" if b else "none | -")
                + " | "
                + (f"{fmt(bb).replace(' | ', ', ')} | {settings(bb)}" if bb else "none | -")
                + " |"
            )
    (HERE / "pareto.md").write_text("\n".join(summary + ["", *out]) + "\n")
    plot(rows)


def plot(rows: list[dict]):
    """pareto.png: one panel per model x task, every cell in grey, the front coloured by sampler, the
    reference as a ring; x = mean NFE per prompt (log, plain tick labels), y = accuracy; the hardware the cells
    were measured on in the header."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dllm.bench.report import hardware, plain_log_ticks

    names = sorted({r["sampler"] for r in rows})
    colours = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
    fig, axes = plt.subplots(len(MODELS), len(TASKS), figsize=(4 * len(TASKS), 3.2 * len(MODELS)))
    for i, model in enumerate(MODELS):
        for j, task in enumerate(TASKS):
            ax = axes[i][j]
            cell = [r for r in rows if r["model"] == model and r["task"] == task]
            if not cell:
                ax.set_visible(False)
                continue
            ax.scatter([r["mean_nfe"] for r in cell], [100 * r["accuracy"] for r in cell], c="0.8", s=12)
            pts = front(cell)
            ax.plot([r["mean_nfe"] for r in pts], [100 * r["accuracy"] for r in pts], c="0.5", lw=0.8, zorder=1)
            for r in pts:
                ax.scatter(r["mean_nfe"], 100 * r["accuracy"], color=colours[r["sampler"]], s=30, zorder=2)
            for r in cell:
                if r["reference"]:
                    ax.scatter(r["mean_nfe"], 100 * r["accuracy"], facecolors="none", edgecolors="k", s=90, zorder=3)
                    ax.axhline(100 * r["accuracy"] - 1, c="k", ls=":", lw=0.7)
            ax.set_xscale("log")
            plain_log_ticks(ax)
            ax.set_title(f"{model} / {task}", fontsize=9)
            ax.set_xlabel("mean NFE per prompt", fontsize=8)
            ax.set_ylabel("accuracy (%)", fontsize=8)
            ax.tick_params(labelsize=7)
    handles = [plt.Line2D([], [], marker="o", ls="", color=colours[n], label=n) for n in names]
    handles.append(plt.Line2D([], [], marker="o", ls="", mfc="none", mec="k", label="reference (ring); dotted: -1 pt"))
    fig.legend(handles=handles, loc="lower center", ncol=8, fontsize=8)
    fig.suptitle(f"accuracy vs mean NFE per prompt (batch 1) | {hardware(rows)}", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(HERE / "pareto.png", dpi=110)
    return fig


if __name__ == "__main__":
    main()
