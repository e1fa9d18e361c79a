"""The summary of a ``dllm bench`` output directory, recomputed from its JSONL files every time.

``write_report(out)`` reads every complete cell file under ``runs/`` (``*.jsonl.gz`` or ``*.jsonl``,
:mod:`dllm.bench.records`) and writes ``summary.md`` (the table),
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

from dllm.bench import records
from dllm.core.errors import plural

GENERATION_KEYS = (
    "max_new_tokens",
    "block_size",
    "steps",
    "steps_per_block",
    "temperature",
    "kernel",
    "compile",
    "static_shapes",
)
# How a cell was measured besides its settings: the examples (n, seed), the batch (each sample's NFE is its
# batch's; the sampling seeds follow the batches) and the numerics. Labels name those that vary.
MEASURED = ("n", "seed", "batch_size", "dtype", "device")
PLOTS = {
    "accuracy_vs_nfe.png": ("mean_nfe", "mean NFE per sample"),
    "accuracy_vs_tokens_per_s.png": ("tokens_per_second", "tokens/s"),
}


def read_cell_file(path) -> tuple[dict | None, list[dict]]:
    """The header and the sample records of one cell file (``.jsonl`` or ``.jsonl.gz``); reading stops at a
    torn or foreign line."""
    header, samples = None, []
    for i, line in enumerate(records.read_lines(path)):
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
    def arness(self) -> float | None:
        """The samples' mean ARness (None: none recorded, e.g. cells run before it was)."""
        values = [s["arness"] for s in self.samples if s.get("arness") is not None]
        return sum(values) / len(values) if values else None

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
    for path in records.cell_files(Path(out) / "runs"):
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


def measured(row: dict) -> dict:
    """How the cell of a summary row was measured (:data:`MEASURED`): n, seed, batch size, dtype, device."""
    env = row.get("environment") or {}
    return {"n": row.get("n"), "seed": row.get("seed"), "batch_size": row.get("batch_size")} | {
        "dtype": env.get("dtype"),
        "device": env.get("device"),
    }


def _measured_cell(r: CellResult) -> dict:
    header = r.header
    return measured({"n": r.n, "seed": r.cell.get("seed"), **{k: header.get(k) for k in ("batch_size", "environment")}})


def labels(results: list[CellResult]) -> list[str]:
    """Short settings labels: hyper-parameters that differ from the sampler's defaults or vary between
    cells of the same sampler, and generation settings and how the cells were measured (seed, batch size,
    dtype, device; n has its own column) where they vary between cells of the same model and task."""
    from dllm import samplers

    def key_of(value) -> str:
        return json.dumps(value, sort_keys=True, default=str)

    hp_values, gen_values = defaultdict(set), defaultdict(set)
    for r in results:
        c = r.cell
        for key, value in c["hp"].items():
            hp_values[c["sampler"], key].add(key_of(value))
        for key, value in {**{k: c["generation"].get(k) for k in GENERATION_KEYS}, **_measured_cell(r)}.items():
            gen_values[c["model"], c["task"], key].add(key_of(value))
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
            if value is not None and len(gen_values[c["model"], c["task"], key]) > 1:
                raw = c.get("grid", {}).get(key)
                parts.append(f"{key}={value}" + (f" ({raw})" if isinstance(raw, str) else ""))
        if c.get("cache", "none") != "none":
            cache_defaults = _cache_defaults(c["cache"])
            changed = [f"{k}={v}" for k, v in c.get("cache_hp", {}).items() if cache_defaults.get(k, v) != v]
            parts.append(f"cache={c['cache']}" + (f"({', '.join(changed)})" if changed else ""))
        for key, value in _measured_cell(r).items():
            if key != "n" and len(gen_values[c["model"], c["task"], key]) > 1:
                parts.append(f"{key}={value}")
        out.append(", ".join(parts) or "defaults")
    return out


def _cache_defaults(name: str) -> dict:
    from dllm import caches

    return caches.defaults(name) if name in caches.names() else {}


def short_name(model: str) -> str:
    """``tiny-llada`` stays; a path becomes its last component."""
    return Path(model.rstrip("/")).name or model


def display_names(models: list[str]) -> dict[str, str]:
    """Short model names (a path's last component) unless two models would share one."""
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
                "cache_hp": c.get("cache_hp", {}),
                "hp": c["hp"],
                "generation": c["generation"],
                "n": r.n,
                "seed": c.get("seed"),
                "accuracy": r.accuracy,
                "mean_nfe": r.mean_nfe,
                "tokens_per_forward": r.tokens_per_forward,
                "arness": r.arness,
                "tokens_per_second": r.tokens_per_second,
                "mean_seconds": r.mean_seconds,
                "speedup_nfe": speedup_nfe,
                "speedup_wall": speedup_wall,
                "reference_cell": ref.header.get("cell_id") if ref is not None else None,
                "note": note,
                "cell_id": r.header.get("cell_id", records.cell_id(r.path)),
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
        "ARness",
        "tokens/s",
        "speedup (NFE)",
        "speedup (wall)",
    ]
    lines = [
        "# dllm bench summary",
        "",
        f"{len(rows)} cells, recomputed from the records in `runs/`"
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
            "—" if row.get("arness") is None else f"{row['arness']:.2f}",
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
        "- **ARness**: the mean share of a sample's masks filled left to right (its leftmost mask, or running on "
        "from it in the same step; `Generation.arness`): 1 is a left-to-right order; — : not recorded (cells run "
        "before dllm recorded it) or no masks (DiffusionGemma).",
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
            f"({env.get('device_name')}), {env.get('dtype')}, {plural(env.get('threads'), 'thread')}, "
            f"Python {env.get('python')}, {env.get('platform')}"
        )
    return "\n".join(lines) + "\n"


# Text sizes of the plots, in points (all at least 9, readable at 100 %).
FONT = {"title": 12, "axis": 11, "ticks": 10, "legend": 10, "point": 9, "header": 11}
PANEL = (5.6, 4.8)  # inches per task panel
MAX_COLUMNS = 3


def hardware(rows: list[dict]) -> str:
    """The machines the rows were measured on, for the plots' header: device name, device, dtype, threads."""
    seen = []
    for row in rows:
        env = row.get("environment") or {}
        if not env:
            continue
        text = f"{env.get('device_name')} ({env.get('device')}, {env.get('dtype')}"
        if str(env.get("device", "")).startswith("cpu"):
            text += f", {plural(env.get('threads'), 'thread')}"
        text += f", torch {env.get('torch')})"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen) or "unknown hardware"


def series(row: dict) -> str:
    """The sampler of a point, and its cache when it has one (``threshold + dual``), so that a ``--caches``
    sweep's variants are told apart."""
    cache = row.get("cache", "none")
    return row["sampler"] if cache in (None, "none") else f"{row['sampler']} + {cache}"


def series_key(row: dict) -> tuple[str, str]:
    """The series a point belongs to, its colour and legend entry: its model and :func:`series`."""
    return row["model"], series(row)


def palette(count: int) -> list:
    """``count`` distinct colours: matplotlib's ten, else tab20 / tab20b / tab20c (60), else evenly spaced hues."""
    from matplotlib import colormaps

    if count <= 10:
        return [f"C{i}" for i in range(count)]
    colours = [colormaps[name](i) for name in ("tab20", "tab20b", "tab20c") for i in range(20)]
    if count <= len(colours):
        return colours[:count]
    return [colormaps["hsv"](i / count) for i in range(count)]


def plain_log_ticks(ax, axis: str = "x") -> None:
    """Plain numbers (``2``, ``5``, ``10``, ``20``) on a log axis instead of matplotlib's ``2×10⁰ 3×10⁰``, which
    overlap on a short range: ticks at 1-2-5 steps within the axis' limits (finer steps, 1-1.5-2-3-4-5-6-8,
    when fewer than three fit), no minor labels. Call it once the limits are final."""
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    low, high = ax.get_xlim() if axis == "x" else ax.get_ylim()
    low, high = min(low, high), max(low, high)
    if low <= 0:
        return
    decades = range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
    for steps in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 8)):
        ticks = [m * 10**k for k in decades for m in steps if low <= m * 10**k <= high]
        if len(ticks) >= 3:
            break
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(ticks))
    target.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    target.set_minor_formatter(NullFormatter())


def point_labels(rows: list[dict], metric: str) -> list[tuple[float, float, str, tuple[str, str]]]:
    """The labels of one panel as (x, y, text, series key): per point, the settings that vary between the points
    of its series (``threshold=0.7``, ``steps=16``, a cache's ``cache_reloading_step=8``, and how the cells were
    measured: ``n=16`` next to ``n=32`` when a sweep was rerun with another ``--n``); points of one series at the
    same place share one label (``threshold=0.7, 0.9``); a series of one point has none (the legend names it). A
    composed sampler swept over several bases (Prophet over ``llada`` and ``threshold``) says its ``base`` and
    what varies among the points of that base only, not every setting of every base."""
    groups = defaultdict(list)
    for row in rows:
        groups[series_key(row)].append(row)
    out = []
    for key, members in groups.items():
        bases = defaultdict(list)
        for row in members:
            bases[str(row["hp"].get("base"))].append(row)
        for base, same_base in bases.items():
            settings = [
                {**row["hp"], **row["generation"], **row.get("cache_hp", {}), **measured(row)} for row in same_base
            ]
            keys = [k for k in settings[0] if len({json.dumps(s.get(k), default=str) for s in settings}) > 1]
            prefix = f"base={base}" if len(bases) > 1 else ""
            if not keys and not prefix:
                continue
            places = defaultdict(list)
            for row, values in zip(same_base, settings):
                places[row[metric], 100 * row["accuracy"]].append(values)
            for (x, y), here in places.items():
                if len(keys) == 1:
                    text = f"{keys[0]}=" + ", ".join(str(v[keys[0]]) for v in here)
                else:
                    text = " | ".join(", ".join(f"{k}={v[k]}" for k in keys if v.get(k) is not None) for v in here)
                text = ", ".join(t for t in (prefix, text) if t)
                out.append((x, y, text, key))
    return out


MARKER = {"s": 70, "edgecolors": "black", "linewidths": 0.6, "zorder": 3}  # a point (size in points²)
RING = {"s": 260, "facecolors": "none", "edgecolors": "black", "linewidths": 1.4, "zorder": 2}  # the reference's
SPACING = 10.0  # points between the centres of markers set side by side (a marker is sqrt(70) ≈ 8.4 wide)


def dodge(ax, places: list[tuple[float, float]]) -> list[float]:
    """Horizontal offsets in points for markers at ``places`` (data coordinates, final axis limits): markers
    that would overlap (centres closer than :data:`SPACING`) are set side by side in their order, as little as
    that takes and centred on where they were, so that no point hides another (a reference under a cached run
    of the same figures)."""
    scale = ax.figure.dpi / 72
    centres = ax.transData.transform(places) if places else []
    parent = list(range(len(places)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i in range(len(places)):
        for j in range(i):
            (xi, yi), (xj, yj) = centres[i], centres[j]
            if abs(xi - xj) < SPACING * scale and abs(yi - yj) < SPACING * scale:
                parent[root(i)] = root(j)
    clusters = defaultdict(list)
    for i in range(len(places)):
        clusters[root(i)].append(i)
    offsets = [0.0] * len(places)
    step = SPACING * scale
    for members in clusters.values():  # left to right, each as far right as it must be, then recentred
        members.sort(key=lambda i: tuple(centres[i]))
        placed: dict[int, float] = {}
        for i in members:
            x, y = centres[i]
            placed[i] = max([x] + [p + step for j, p in placed.items() if abs(centres[j][1] - y) < step])
        shift = sum(centres[i][0] - p for i, p in placed.items()) / len(members)
        for i, p in placed.items():
            offsets[i] = (p + shift - centres[i][0]) / scale
    return offsets


def ink(colour) -> tuple[float, float, float]:
    """``colour`` darkened where it is too light to read as text on white (a label in its series' colour)."""
    from matplotlib.colors import to_rgb

    rgb = to_rgb(colour)
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return tuple(c * min(1.0, 0.5 / luminance) for c in rgb) if luminance > 0 else rgb


def widen(ax, places: list[tuple[float, float]], shifts: list[float]) -> bool:
    """Widen the x axis where markers set side by side (``shifts`` in points, :func:`dodge`) would leave the panel;
    True when the limits changed (then dodge again: the scale did)."""
    if not places:
        return False
    scale = ax.figure.dpi / 72
    xs = [ax.transData.transform(p)[0] + dx * scale for p, dx in zip(places, shifts)]
    frame = ax.get_window_extent()
    low, high = min(xs) - SPACING * scale, max(xs) + SPACING * scale
    if low >= frame.x0 and high <= frame.x1:
        return False
    # at most half a panel more on each side per call: a crowd of markers at one spot (many cells with one result)
    # would otherwise widen a log axis without end (each widening packs the points closer, asking for more)
    low, high = max(low, frame.x0 - frame.width / 2), min(high, frame.x1 + frame.width / 2)
    inverse = ax.transData.inverted()
    ax.set_xlim(
        inverse.transform((min(low, frame.x0), frame.y0))[0], inverse.transform((max(high, frame.x1), frame.y0))[0]
    )
    if ax.get_xscale() == "log":
        plain_log_ticks(ax)
    return True


def _place_labels(ax, renderer, points: list[tuple], markers: list[tuple[float, float, float]]) -> int:
    """Annotate ``points`` (x, y, dx, text, colour; dx: the point's offset in points, :func:`dodge`) so that no
    label overlaps another label or a marker (at ``markers``: x, y, dx) or leaves the panel, trying offsets
    around each point (the first free one wins); a label set apart from its point gets a thin leader line. A
    label with no free place covers part of a marker at worst, never another label: one that can only overlap a
    label or leave the panel is left out (overlapping text is unreadable; the table lists every cell); returns
    how many were."""
    from matplotlib.transforms import offset_copy

    offsets = [(7, 5), (7, -15), (-7, 5), (-7, -15), (7, 19), (-7, 19), (7, -29), (-7, -29)]
    offsets += [(dx, dy) for dy in (33, -43, 47, -57, 61, -71) for dx in (7, -7, 30, -30)]
    offsets += [(dx, dy) for dy in range(-120, 121, 12) for dx in (7, -7, 40, -40, 80, -80)]  # crowded: farther
    offsets += [(dx, dy) for dy in range(-240, 241, 12) for dx in (7, -7, 60, -60, 120, -120, 180, -180)]
    scale = ax.figure.dpi / 72  # points -> display pixels
    half = 0.5 * SPACING * scale

    def centre(x, y, dx):
        cx, cy = ax.transData.transform((x, y))
        return cx + dx * scale, cy

    dots = []  # display-space boxes of the markers
    for x, y, dx in markers:
        cx, cy = centre(x, y, dx)
        dots.append((cx - half, cy - half, cx + half, cy + half))
    taken = []  # and of the labels placed
    frame = ax.get_window_extent(renderer)
    frame = (frame.x0, frame.y0, frame.x1, frame.y1)
    pad = 1.5  # pixels kept free around a label
    left_out = 0
    for x, y, shift, text, colour in sorted(points, key=lambda p: (-p[1], p[0] + p[2])):
        probe = ax.annotate(
            text, (x, y), xytext=(0, 0), textcoords="offset points", fontsize=FONT["point"], va="bottom"
        )
        extent = probe.get_window_extent(renderer)  # the label's size, measured once
        probe.remove()
        cx, cy = centre(x, y, shift)
        width, height = extent.width + 2 * pad, extent.height + 2 * pad
        rise = extent.y0 - ax.transData.transform((x, y))[1] - pad
        best, best_cost = None, None
        for dx, dy in offsets:  # the label's box at each offset, computed without drawing it
            left = cx + dx * scale - pad if dx >= 0 else cx + dx * scale - width + pad
            box = (left, cy + dy * scale + rise, left + width, cy + dy * scale + rise + height)
            if _overlap(box, frame) < width * height or any(_overlap(box, other) for other in taken):
                continue
            cost = sum(_overlap(box, dot) for dot in dots)
            if best_cost is None or cost < best_cost:
                best, best_cost = ((dx, dy), box), cost
            if cost == 0:
                break
        if best is None:
            left_out += 1
            continue
        (dx, dy), box = best
        ax.annotate(
            text,
            (x, y),
            xycoords=offset_copy(ax.transData, fig=ax.figure, x=shift, y=0, units="points"),
            xytext=(dx, dy),
            textcoords="offset points",
            fontsize=FONT["point"],
            ha="left" if dx >= 0 else "right",
            va="bottom",
            color=colour,
            annotation_clip=False,
            arrowprops=None
            if (dx, dy) in offsets[:4]
            else {"arrowstyle": "-", "color": "0.5", "lw": 0.6, "shrinkB": 5},
        )
        taken.append(box)
    return left_out


def _overlap(a, b) -> float:
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    return width * height if width > 0 and height > 0 else 0.0


def accuracy_axis(ax, accuracies: list[float]) -> None:
    """The y axis of a panel: zoomed in on the accuracies measured (in steps of 10 %), with room above 100 % for
    the labels but ticks at 100 % at most (an accuracy has no 110 %)."""
    low = min(accuracies, default=0.0)
    low = max(0.0, 10 * (low // 10) - 10)
    ax.set_ylim(low - 0.05 * (100 - low), 100 + 0.18 * (100 - low + 10))
    ax.set_yticks([t for t in ax.get_yticks() if low <= t <= 100])
    ax.set_ylim(low - 0.05 * (100 - low), 100 + 0.18 * (100 - low + 10))  # set_yticks may widen the limits


def figure(rows: list[dict], metric: str, xlabel: str):
    """The figure of one plot: a panel per task, one point per cell (one colour per series, a model and its
    sampler + cache, across the figure; marker: model; a black ring: the one-token-per-step reference), points
    that would hide each other set side by side, its varying settings next to each point, a legend whose
    entries are drawn exactly as the points, and the hardware in the header."""
    import math

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.transforms import offset_copy

    tasks = list(dict.fromkeys(row["task"] for row in rows)) or [""]
    models = list(dict.fromkeys(row["model"] for row in rows))
    keys = [(model, s) for model in models for s in dict.fromkeys(series(row) for row in rows if row["model"] == model)]
    colours = dict(zip(keys, palette(len(keys))))
    names = {row["model"]: row["model_name"] for row in rows}
    markers = {m: "osD^vP<>"[i % 8] for i, m in enumerate(models)}
    columns = min(MAX_COLUMNS, len(tasks))
    lines = math.ceil(len(tasks) / columns)
    fig = Figure(figsize=(PANEL[0] * columns, PANEL[1] * lines), layout="constrained")
    canvas = FigureCanvasAgg(fig)
    axes = fig.subplots(lines, columns, squeeze=False).ravel()
    for ax in axes[len(tasks) :]:
        ax.set_visible(False)
    drawn = defaultdict(list)  # (task, series key, x, y) -> the collections drawn there
    for ax, task in zip(axes, tasks):
        mine = [row for row in rows if row["task"] == task]
        for row in mine:
            x, y = row[metric], 100 * row["accuracy"]
            spot = (task, series_key(row), x, y)
            drawn[spot].append(
                ax.scatter([x], [y], color=colours[series_key(row)], marker=markers[row["model"]], **MARKER)
            )
            if row["reference"]:
                drawn[spot].append(ax.scatter([x], [y], **RING))
        xs = [row[metric] for row in mine if row[metric] > 0]
        if xs and max(xs) / min(xs) > 20:
            ax.set_xscale("log")
        ax.margins(x=0.15)
        if ax.get_xscale() == "log":
            plain_log_ticks(ax)
        accuracy_axis(ax, [100 * row["accuracy"] for row in mine])
        ax.set_title(task, fontsize=FONT["title"])
        ax.set_xlabel(xlabel, fontsize=FONT["axis"])
        ax.set_ylabel("accuracy (%)", fontsize=FONT["axis"])
        ax.tick_params(labelsize=FONT["ticks"])
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"accuracy vs {xlabel} | {hardware(rows)}", fontsize=FONT["header"])
    handles = []
    for key in keys:
        model, name = key
        handles.append(
            Line2D(
                [],
                [],
                color=colours[key],
                marker=markers[model],
                markersize=math.sqrt(MARKER["s"]),
                markeredgecolor="black",
                markeredgewidth=MARKER["linewidths"],
                linestyle="",
                label=name if len(models) == 1 else f"{names[model]}: {name}",
            )
        )
    handles.append(
        Line2D(
            [],
            [],
            marker="o",
            markersize=math.sqrt(RING["s"]),
            markerfacecolor="none",
            markeredgecolor="black",
            markeredgewidth=RING["linewidths"],
            linestyle="",
            label="reference (one token per step)",
        )
    )
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 4),
        fontsize=FONT["legend"],
        frameon=False,
    )
    fig.canvas.draw()  # lay out the panels, then set overlapping points apart and place the labels
    renderer = canvas.get_renderer()
    fig.set_layout_engine("none")  # keep the panels where they are while points move and labels are added
    for ax, task in zip(axes, tasks):
        spots = [spot for spot in drawn if spot[0] == task]
        places = [(x, y) for _, _, x, y in spots]
        for _ in range(3):
            offsets = dodge(ax, places)
            if not widen(ax, places, offsets):
                break
        shifts = dict(zip(spots, offsets))
        for spot, dx in shifts.items():
            for collection in drawn[spot]:
                collection.set_offset_transform(offset_copy(ax.transData, fig=fig, x=dx, y=0, units="points"))
        mine = [row for row in rows if row["task"] == task]
        labels = [
            (x, y, shifts[task, key, x, y], text, ink(colours[key])) for x, y, text, key in point_labels(mine, metric)
        ]
        left_out = _place_labels(ax, renderer, labels, [(x, y, dx) for (_, _, x, y), dx in shifts.items()])
        if left_out:
            ax.set_title(f"{task} ({plural(left_out, 'label')} left out: no room)", fontsize=FONT["title"])
    return fig


def plot(rows: list[dict], out) -> list[Path]:
    """``accuracy_vs_nfe.png`` and ``accuracy_vs_tokens_per_s.png`` under ``out`` (Agg, no pyplot state)."""
    written = []
    for filename, (metric, xlabel) in PLOTS.items():
        fig = figure(rows, metric, xlabel)
        path = Path(out) / filename
        fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.15)  # nothing cut off at the edges
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
