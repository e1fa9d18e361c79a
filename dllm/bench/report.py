"""The summary of a ``dllm bench`` output directory, recomputed from its JSONL files every time.

``write_report(out)`` reads every complete ``runs/*.jsonl`` and writes ``summary.md`` (the table),
``summary.json`` (the same rows at full precision) and two plots, ``accuracy_vs_nfe.png`` and
``accuracy_vs_tokens_per_s.png`` (one panel per task, one point per cell, one colour per sampler).

Per cell: accuracy = mean of ``correct``; mean NFE = mean of the per-sample ``nfe`` (each sample carries
its batch's NFE); tokens/forward = Σ tokens / Σ nfe (tokens of one sequence per forward); tokens/s =
Σ tokens / Σ seconds; speedups = the reference cell's mean NFE (mean seconds) over this cell's.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

GENERATION_KEYS = ("max_new_tokens", "block_size", "steps", "steps_per_block", "temperature")
PLOTS = {
    "accuracy_vs_nfe.png": ("mean_nfe", "mean NFE per sample"),
    "accuracy_vs_tokens_per_s.png": ("tokens_per_second", "tokens/s"),
}


def read_cell_file(path) -> tuple[dict | None, list[dict]]:
    """The header and the sample records of one JSONL file; reading stops at a torn or foreign line."""
    header, samples = None, []
    with Path(path).open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            if not isinstance(record, dict):
                break
            if i == 0:
                if record.get("type") != "header":
                    return None, []
                header = record
            elif record.get("type") == "sample":
                samples.append(record)
            else:
                break
    return header, samples


@dataclasses.dataclass
class CellResult:
    path: Path
    header: dict
    samples: list[dict]

    @property
    def cell(self) -> dict:
        return self.header["cell"]

    @property
    def n(self) -> int:
        return len(self.samples)

    def total(self, key: str) -> float:
        return sum(s[key] for s in self.samples)

    @property
    def accuracy(self) -> float:
        return sum(bool(s["correct"]) for s in self.samples) / self.n

    @property
    def mean_nfe(self) -> float:
        return self.total("nfe") / self.n

    @property
    def mean_seconds(self) -> float:
        return self.total("seconds") / self.n

    @property
    def tokens_per_forward(self) -> float:
        nfe = self.total("nfe")
        return self.total("tokens") / nfe if nfe else 0.0

    @property
    def tokens_per_second(self) -> float:
        seconds = self.total("seconds")
        return self.total("tokens") / seconds if seconds > 0 else 0.0


def collect(out) -> tuple[list[CellResult], list[Path]]:
    """Complete cells (as many samples as their header's ``n``) and the paths of incomplete ones."""
    complete, incomplete = [], []
    for path in sorted((Path(out) / "runs").glob("*.jsonl")):
        header, samples = read_cell_file(path)
        if header is None or "cell" not in header:
            continue
        n = header.get("n", 0)
        if n and len(samples) >= n:
            complete.append(CellResult(path, header, samples[:n]))
        else:
            incomplete.append(path)
    return complete, incomplete


def reference_key(cell: dict) -> tuple:
    """Cells compared with one reference: same model, task, examples and generation length / block / temperature."""
    g = cell["generation"]
    return (
        cell["model"],
        cell["task"],
        cell["n"],
        cell["seed"],
        g["max_new_tokens"],
        g["block_size"],
        g["temperature"],
    )


def labels(results: list[CellResult]) -> list[str]:
    """Short settings labels: hyper-parameters that differ from the sampler's defaults or vary between
    cells of the same sampler, and generation settings that vary between cells of the same model."""
    from dllm import samplers

    def key_of(value) -> str:
        return json.dumps(value, sort_keys=True, default=str)

    hp_values, gen_values = defaultdict(set), defaultdict(set)
    for r in results:
        c = r.cell
        for key, value in c["hp"].items():
            hp_values[c["sampler"], key].add(key_of(value))
        for key in GENERATION_KEYS:
            gen_values[c["model"], key].add(key_of(c["generation"].get(key)))
    out = []
    for r in results:
        c = r.cell
        defaults = {}
        if c["sampler"] in samplers.names():
            part = samplers.registry.is_part(c["sampler"])
            defaults = samplers.defaults(c["sampler"], c["hp"].get("base")) if part else samplers.defaults(c["sampler"])
        parts = [
            f"{key}={value}"
            for key, value in c["hp"].items()
            if len(hp_values[c["sampler"], key]) > 1 or (key in defaults and value != defaults[key])
        ]
        for key in GENERATION_KEYS:
            value = c["generation"].get(key)
            if value is not None and len(gen_values[c["model"], key]) > 1:
                raw = c.get("grid", {}).get(key)
                parts.append(f"{key}={value}" + (f" ({raw})" if isinstance(raw, str) else ""))
        if c.get("cache", "none") != "none":
            cache_defaults = _cache_defaults(c["cache"])
            changed = [f"{k}={v}" for k, v in c.get("cache_hp", {}).items() if cache_defaults.get(k, v) != v]
            parts.append(f"cache={c['cache']}" + (f"({', '.join(changed)})" if changed else ""))
        out.append(", ".join(parts) or "defaults")
    return out


def _cache_defaults(name: str) -> dict:
    from dllm import caches

    return caches.defaults(name) if name in caches.names() else {}


def display_names(models: list[str]) -> dict[str, str]:
    """Short model names (a path's last component) unless two models would share one."""
    from dllm.bench.runner import short_name

    short = {m: short_name(m) for m in models}
    clash = {s for s in short.values() if list(short.values()).count(s) > 1}
    return {m: (m if s in clash else s) for m, s in short.items()}


def summarize(results: list[CellResult]) -> list[dict]:
    """One row per cell with its figures and its speedups against its reference."""
    refs: dict[tuple, CellResult] = {}
    for r in sorted((r for r in results if r.cell.get("reference")), key=lambda r: r.header.get("started", "")):
        refs[reference_key(r.cell)] = r  # the latest one if a reference was measured twice
    names = display_names(sorted({r.cell["model"] for r in results}))
    rows = []
    for r, label in zip(results, labels(results)):
        c = r.cell
        ref = refs.get(reference_key(c))
        speedup_nfe = speedup_wall = None
        note = "no reference cell" if ref is None else None
        if ref is not None:
            if ref.header.get("batch_size") != r.header.get("batch_size"):
                note = "reference measured with another batch size"
            else:
                speedup_nfe = ref.mean_nfe / r.mean_nfe if r.mean_nfe else None
                if ref.header.get("environment") == r.header.get("environment"):
                    speedup_wall = ref.mean_seconds / r.mean_seconds if r.mean_seconds else None
                else:
                    note = "reference measured in another environment"
        rows.append(
            {
                "task": c["task"],
                "model": c["model"],
                "model_name": names[c["model"]],
                "sampler": c["sampler"],
                "label": label,
                "reference": bool(c.get("reference")),
                "cache": c.get("cache", "none"),
                "hp": c["hp"],
                "generation": c["generation"],
                "n": r.n,
                "accuracy": r.accuracy,
                "mean_nfe": r.mean_nfe,
                "tokens_per_forward": r.tokens_per_forward,
                "tokens_per_second": r.tokens_per_second,
                "mean_seconds": r.mean_seconds,
                "speedup_nfe": speedup_nfe,
                "speedup_wall": speedup_wall,
                "reference_cell": ref.header.get("cell_id") if ref is not None else None,
                "note": note,
                "cell_id": r.header.get("cell_id", r.path.stem),
                "batch_size": r.header.get("batch_size"),
                "environment": r.header.get("environment"),
            }
        )
    order = ("task", "model", "reference", "sampler", "mean_nfe", "label")
    rows.sort(key=lambda row: tuple(-row[k] if k in ("reference", "mean_nfe") else row[k] for k in order))
    return rows


def _speedup(x) -> str:
    return "—" if x is None else f"{x:.2f}×"


def markdown(rows: list[dict], incomplete: int = 0) -> str:
    head = [
        "task",
        "model",
        "sampler",
        "settings",
        "n",
        "accuracy (%)",
        "mean NFE",
        "tokens/forward",
        "tokens/s",
        "speedup (NFE)",
        "speedup (wall)",
    ]
    lines = [
        "# dllm bench summary",
        "",
        f"{len(rows)} cells, recomputed from `runs/*.jsonl`"
        + (f" ({incomplete} unfinished cells left out; rerun the sweep to finish them)." if incomplete else "."),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + "|",
    ]
    for row in rows:
        sampler = row["sampler"] + (" (ref)" if row["reference"] else "")
        cells = [
            row["task"],
            row["model_name"],
            sampler,
            row["label"],
            str(row["n"]),
            f"{100 * row['accuracy']:.1f}",
            f"{row['mean_nfe']:.1f}",
            f"{row['tokens_per_forward']:.2f}",
            f"{row['tokens_per_second']:.1f}",
            _speedup(row["speedup_nfe"]),
            _speedup(row["speedup_wall"]),
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    batch_sizes = sorted({row["batch_size"] for row in rows if row["batch_size"] is not None})
    lines += [
        "",
        f"- **NFE** per sample is the NFE of its batch (batch size {', '.join(map(str, batch_sizes)) or '?'}): "
        "a batched forward counts once for every row in it. Every forward counts (cache refreshes, CFG passes).",
        "- **tokens**: generated tokens up to the first EOS (`dllm.count_generated`); tokens/forward = "
        "Σ tokens / Σ NFE, i.e. tokens of one sequence per forward.",
        "- **seconds** per sample = its batch's wall time (no model loading) / batch size; tokens/s = "
        "Σ tokens / Σ seconds.",
        "- **speedups** = the reference's mean NFE (mean seconds) / this cell's. The reference (ref) is the "
        "one-token-per-step sampler of the same model with the same task, examples, generation length, "
        "block size and temperature, measured in this run; — : no reference measured under the same "
        "conditions (batch size; for wall time also the environment). Rows leave their batch when done, so "
        "an adaptive sampler's later forwards are cheaper: its wall speedup can exceed its NFE speedup.",
    ]
    envs = []
    for row in rows:
        env = row["environment"]
        if env and env not in envs:
            envs.append(env)
    for env in envs:
        lines.append(
            f"- environment: dllm {env.get('dllm')}, torch {env.get('torch')}, {env.get('device')} "
            f"({env.get('device_name')}), {env.get('dtype')}, {env.get('threads')} threads, "
            f"Python {env.get('python')}, {env.get('platform')}"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out) -> list[Path]:
    """``accuracy_vs_nfe.png`` and ``accuracy_vs_tokens_per_s.png`` under ``out`` (Agg, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    tasks = list(dict.fromkeys(row["task"] for row in rows))
    samplers = list(dict.fromkeys(row["sampler"] for row in rows))
    models = list(dict.fromkeys(row["model"] for row in rows))
    colours = {s: f"C{i % 10}" for i, s in enumerate(samplers)}
    markers = {m: "osD^vP<>"[i % 8] for i, m in enumerate(models)}
    written = []
    for filename, (metric, xlabel) in PLOTS.items():
        fig = Figure(figsize=(5.5 * max(1, len(tasks)), 4.5))
        fig.subplots_adjust(left=0.08 / max(1, len(tasks)) + 0.04, right=0.97, bottom=0.12, top=0.92, wspace=0.25)
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, max(1, len(tasks)), squeeze=False)[0]
        for ax, task in zip(axes, tasks):
            mine = [row for row in rows if row["task"] == task]
            for row in mine:
                x, y = row[metric], 100 * row["accuracy"]
                ax.scatter(
                    [x],
                    [y],
                    color=colours[row["sampler"]],
                    marker="*" if row["reference"] else markers[row["model"]],
                    s=140 if row["reference"] else 50,
                    edgecolors="black",
                    linewidths=0.5,
                    zorder=3,
                )
                text = row["sampler"] + (" (ref)" if row["reference"] else "")
                if row["label"] != "defaults":
                    text += f"\n{row['label']}"
                if len(models) > 1:
                    text = f"{row['model_name']}: {text}"
                ax.annotate(text, (x, y), xytext=(4, 4), textcoords="offset points", fontsize=6)
            xs = [row[metric] for row in mine if row[metric] > 0]
            if xs and max(xs) / min(xs) > 20:
                ax.set_xscale("log")
            ax.set_ylim(-3, 103)
            ax.set_title(task)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("accuracy (%)")
            ax.grid(True, alpha=0.3)
        handles = [Line2D([], [], color=colours[s], marker="o", linestyle="", label=s) for s in samplers]
        if len(models) > 1:
            names = {row["model"]: row["model_name"] for row in rows}
            handles += [Line2D([], [], color="gray", marker=markers[m], linestyle="", label=names[m]) for m in models]
        handles.append(Line2D([], [], color="gray", marker="*", markersize=10, linestyle="", label="reference"))
        axes[-1].legend(handles=handles, fontsize=7, loc="best")
        path = Path(out) / filename
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


@dataclasses.dataclass
class Report:
    rows: list[dict]
    files: list[Path]
    incomplete: list[Path]

    @property
    def table(self) -> str:
        return markdown(self.rows, len(self.incomplete))


def write_report(out) -> Report:
    """Rewrite ``summary.md``, ``summary.json`` and the plots of ``out`` from its JSONL files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results, incomplete = collect(out)
    rows = summarize(results)
    summary = out / "summary.md"
    summary.write_text(markdown(rows, len(incomplete)), encoding="utf-8")
    data = out / "summary.json"
    data.write_text(json.dumps(rows, indent=1, default=str) + "\n", encoding="utf-8")
    files = [summary, data]
    if rows:
        files += plot(rows, out)
    return Report(rows, files, incomplete)
