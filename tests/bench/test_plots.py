"""The bench plots are readable at a glance: text of at least 9 pt, labels that neither overlap each other
nor leave their panel, legend entries drawn exactly as the points, the hardware in the header."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from matplotlib.collections import PathCollection
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


@pytest.fixture(scope="module", params=["mean_nfe", "tokens_per_second"])
def fig(request):
    fig = report.figure(crowded_rows(), request.param, "x")
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
