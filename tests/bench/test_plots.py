"""The bench plots are readable at a glance: text of at least 9 pt, labels that neither overlap each other
nor leave their panel, legend entries drawn exactly as the points, the hardware in the header."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgba
from matplotlib.markers import MarkerStyle
from matplotlib.text import Annotation, Text

from dllm.bench import report

ENV = {"device": "cpu", "device_name": "Test CPU 9000", "dtype": "float32", "threads": 2, "torch": "2.13.0"}
G = 32


def row(task, model, sampler, accuracy, nfe, reference=False, **hp):
    generation = {"max_new_tokens": G, "block_size": 8, "steps": hp.pop("steps", None), "temperature": 0.0}
    return {
        "task": task,
        "model": model,
        "model_name": model,
        "sampler": sampler,
        "reference": reference,
        "hp": hp,
        "generation": generation,
        "accuracy": accuracy,
        "mean_nfe": nfe,
        "tokens_per_second": 1000 / nfe,
        "environment": ENV,
    }


def crowded_rows():
    """Two models, a reference and a steps sweep, and a threshold sweep whose cells sit almost on each other."""
    rows = []
    for task, model in itertools.product(("arith", "listops", "shuffle", "pick"), ("tiny-llada", "tiny-dream")):
        rows.append(row(task, model, "llada", 0.95, G, reference=True, steps=G))
        rows += [row(task, model, "llada", 0.9 - 0.1 * k, G / 2**k, steps=G // 2**k) for k in (1, 2)]
        rows += [
            row(task, model, "threshold", 0.97 + 0.01 * k, 5 + 0.2 * k, threshold=t)
            for k, t in enumerate((0.5, 0.7, 0.9))
        ]
    return rows


def cache_sweep_rows():
    """A cache sweep over two models (as eval/results/caches): most cells at one NFE and 98-100 %, each sampler
    + cache with refresh_prompt False and True, tokens/s spread over two decades."""
    rows = []
    for task, (m, model) in itertools.product(("arith", "pick"), enumerate(("tiny-llada", "tiny-dream"))):
        rows.append(row(task, model, "llada", 0.99, 8.0, reference=True, steps=8))
        for (s, sampler), (c, cache), refresh in itertools.product(
            enumerate(("llada", "threshold")), enumerate(("none", "prefix", "dual", "dkv")), (False, True)
        ):
            if cache == "none" and refresh:
                continue
            cell = row(task, model, sampler, 0.98 + 0.01 * ((c + refresh) % 3), 8.0 - 3 * s - 0.1 * m, steps=8)
            cell["tokens_per_second"] = 20 * 1.6 ** (c + 4 * s + refresh + m)
            hp = {} if cache == "none" else {"refresh_prompt": refresh}
            rows.append({**cell, "cache": cache, "cache_hp": hp})
    return rows


@pytest.fixture(
    scope="module",
    params=[(crowded_rows, "mean_nfe"), (crowded_rows, "tokens_per_second"), (cache_sweep_rows, "tokens_per_second")],
)
def fig(request):
    rows, metric = request.param
    fig = report.figure(rows(), metric, "x")
    fig.canvas.draw()
    return fig


def test_all_text_is_at_least_9_points(fig):
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert len(texts) > 20
    assert min(t.get_fontsize() for t in texts) >= 9


def test_labels_do_not_overlap_and_stay_in_their_panel(fig):
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        boxes = [Text.get_window_extent(a, renderer) for a in ax.texts if isinstance(a, Annotation)]  # no leader
        assert boxes, "every panel labels its sweeps"
        frame = ax.get_window_extent(renderer)
        for box in boxes:
            assert (
                frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1 and frame.y0 - 1 <= box.y0 and box.y1 <= frame.y1 + 1
            )
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), (a, b)


def test_legend_entries_are_drawn_as_the_points(fig):
    handles = fig.legends[0].legend_handles
    drawn = set()
    for ax in fig.axes:
        for collection in ax.collections:
            if isinstance(collection, PathCollection) and collection.get_facecolor().size:  # rings are hollow
                colour = tuple(np.round(collection.get_facecolor()[0], 3))
                drawn.add((colour, collection.get_paths()[0].vertices.round(3).tobytes()))
    legend = set()
    for handle in handles:
        if handle.get_markerfacecolor() == "none":
            continue
        marker = MarkerStyle(handle.get_marker())
        path = marker.get_path().transformed(marker.get_transform())
        from matplotlib.colors import to_rgba

        legend.add((tuple(np.round(to_rgba(handle.get_markerfacecolor()), 3)), path.vertices.round(3).tobytes()))
    assert drawn == legend  # every point has its legend entry, every entry its points
    assert any(h.get_label().startswith("reference") for h in handles)


def test_the_hardware_is_named(fig):
    assert "Test CPU 9000 (cpu, float32, 2 threads, torch 2.13.0)" in fig._suptitle.get_text()


def test_plot_files_are_written(tmp_path):
    files = report.plot(crowded_rows(), tmp_path)
    assert [f.name for f in files] == list(report.PLOTS) and all(f.stat().st_size > 10_000 for f in files)


def test_a_cache_sweep_tells_the_cache_variants_apart():
    """``--caches none,dual,dkv``: each sampler + cache is its own colour and legend entry, and a cache's swept
    setting labels its points (it was one colour of unlabelled dots)."""
    rows = [row("pick", "tiny-llada", "llada", 0.95, G, reference=True, steps=G)]
    for cache, nfe in (("none", 5.0), ("dual", 5.5), ("dkv", 6.0)):
        cell = row("pick", "tiny-llada", "threshold", 0.9, nfe, threshold=0.9)
        rows.append({**cell, "cache": cache, "cache_hp": {}})
    rows += [
        {**row("pick", "tiny-llada", "threshold", 0.8, 6.5 + k, threshold=0.9), "cache": "dkv"}
        | {"cache_hp": {"cache_reloading_step": step}}
        for k, step in enumerate((4, 8))
    ]
    rows[3]["cache_hp"] = {"cache_reloading_step": 1}
    fig = report.figure(rows, "mean_nfe", "x")
    fig.canvas.draw()
    labels = [h.get_label() for h in fig.legends[0].legend_handles]
    assert labels[:4] == ["llada", "threshold", "threshold + dual", "threshold + dkv"]
    (ax,) = [a for a in fig.axes if a.get_visible()]
    colours = {tuple(np.round(c.get_facecolor()[0], 3)) for c in ax.collections if c.get_facecolor().size}
    assert len(colours) == 4
    texts = {t.get_text() for t in ax.texts}
    assert "cache_reloading_step=1" in texts and "cache_reloading_step=8" in texts


def tick_texts(fig) -> list[str]:
    return [
        t.get_text()
        for ax in fig.axes
        if ax.get_visible() and ax.get_xscale() == "log"
        for t in ax.get_xticklabels(minor=True) + ax.get_xticklabels()
        if t.get_visible() and t.get_text()
    ]


def test_log_axes_have_plain_tick_labels():
    """A log x axis (NFE from 1 to 30) is labelled 1, 2, 5, 10, 20, not with matplotlib's overlapping
    ``2×10⁰ 3×10⁰`` mathtext."""
    rows = [row("arith", "tiny-llada", "llada", 0.95, 30.0, reference=True, steps=30)]
    rows += [row("arith", "tiny-llada", "threshold", 0.9, nfe, threshold=t) for nfe, t in ((1.1, 0.5), (2.5, 0.9))]
    fig = report.figure(rows, "mean_nfe", "x")
    fig.canvas.draw()
    texts = tick_texts(fig)
    assert texts == ["1", "2", "5", "10", "20"]


def test_pareto_plot_has_plain_ticks_and_names_the_hardware(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "eval" / "results" / "samplers" / "pareto.py"
    spec = importlib.util.spec_from_file_location("pareto", path)
    pareto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pareto)
    monkeypatch.setattr(pareto, "HERE", tmp_path)
    rows = [row("arith", "tiny-llada", "llada", 0.95, 24.0, reference=True, steps=24)]
    rows += [row("arith", "tiny-llada", "threshold", 0.9 + 0.01 * k, 2.0 + k, threshold=0.5) for k in range(3)]
    rows += [row("pick", "tiny-sdar", "sdar", 0.9, 3.9, reference=True), row("pick", "tiny-sdar", "sdar", 0.8, 7.5)]
    fig = pareto.plot(rows)
    fig.canvas.draw()
    assert (tmp_path / "pareto.png").is_file()
    assert "Test CPU 9000 (cpu, float32, 2 threads, torch 2.13.0)" in fig._suptitle.get_text()
    texts = tick_texts(fig)
    assert texts and all(float(t) > 0 for t in texts)  # plain numbers only
    assert {"2", "5", "10", "20"} <= set(texts) and {"4", "5", "6"} <= set(texts)


def test_a_composed_sampler_over_several_bases_is_labelled_by_base_and_its_own_sweep():
    """Prophet swept over two bases: each point says its base and what varies among that base's points, not
    the other base's settings (which the points of one base lack)."""
    rows = [
        row("arith", "tiny-llada", "prophet", 0.9, 4 + k, base="llada", remasking="low_confidence", gap=g)
        for k, g in enumerate((5.0, 7.5))
    ]
    rows += [
        row("arith", "tiny-llada", "prophet", 0.8, 2 + k, base="threshold", threshold=t)
        for k, t in enumerate((0.7, 0.9))
    ]
    texts = sorted(text for _, _, text, _ in report.point_labels(rows, "mean_nfe"))
    assert texts == [
        "base=llada, gap=5.0",
        "base=llada, gap=7.5",
        "base=threshold, threshold=0.7",
        "base=threshold, threshold=0.9",
    ]


def test_each_series_has_its_own_colour_across_models(fig):
    """Two models swept with the same samplers: every legend entry (model and sampler + cache) has its own colour
    (the second model's llada was the first's colour, told apart by the marker alone)."""
    colours = [h.get_markerfacecolor() for h in fig.legends[0].legend_handles if h.get_markerfacecolor() != "none"]
    assert len(colours) >= 4 and len({tuple(np.round(to_rgba(c), 3)) for c in colours}) == len(colours)


def marker_centres(ax) -> list[tuple[float, float]]:
    """Display positions of the filled markers of a panel, as drawn (with their offsets)."""
    return [
        tuple(c.get_offset_transform().transform(c.get_offsets()[0]))
        for c in ax.collections
        if isinstance(c, PathCollection) and c.get_facecolor().size
    ]


def test_points_at_the_same_place_are_set_apart():
    """A reference and a cached run of the same figures, plus a third at the same place: all three stay visible,
    side by side, and each keeps its label."""
    rows = [row("pick", "tiny-llada", "llada", 0.9, 8.0, reference=True, steps=8)]
    rows += [{**row("pick", "tiny-llada", "llada", 0.9, 8.0, steps=8), "cache": "dual", "cache_hp": {}}]
    rows += [
        row("pick", "tiny-dream", "llada", 0.9, 8.0, steps=8),
        row("pick", "tiny-dream", "llada", 0.5, 4.0, steps=4),
    ]
    fig = report.figure(rows, "mean_nfe", "x")
    fig.canvas.draw()
    (ax,) = [a for a in fig.axes if a.get_visible()]
    centres = marker_centres(ax)
    assert len(centres) == 4
    width = np.sqrt(report.MARKER["s"]) * fig.dpi / 72  # a marker's width in pixels
    for (xa, ya), (xb, yb) in itertools.combinations(centres, 2):
        assert abs(xa - xb) >= width or abs(ya - yb) >= width
    frame = ax.get_window_extent()
    assert all(frame.x0 < x < frame.x1 and frame.y0 < y < frame.y1 for x, y in centres)


@pytest.mark.parametrize("accuracies", [(0.95, 1.0), (0.2, 0.7, 1.0), (0.0, 0.05)])
def test_the_accuracy_axis_has_no_tick_above_100_percent(accuracies):
    rows = [row("pick", "tiny-llada", "llada", 1.0, 8.0, reference=True, steps=8)]
    rows += [
        row("pick", "tiny-llada", "threshold", a, 2.0 + k, threshold=0.5 + 0.1 * k) for k, a in enumerate(accuracies)
    ]
    fig = report.figure(rows, "mean_nfe", "x")
    fig.canvas.draw()
    (ax,) = [a for a in fig.axes if a.get_visible()]
    low, high = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if low <= t <= high]
    assert max(ticks) == 100 and len(ticks) >= 3
