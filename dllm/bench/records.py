"""Where a bench cell's records live and how they are read and written.

A cell's records are one file under ``OUT/runs``: ``<cell-id>.jsonl.gz`` (gzip-compressed JSON lines, what
``dllm bench`` writes) or ``<cell-id>.jsonl`` (plain, what versions before it wrote; still read, and a
plain file cut short is resumed in place). Appending to a ``.gz`` file adds a gzip member; a reader sees the
members as one stream. A file whose last member was cut short (a killed process) reads up to the damage. A
finished cell's file is rewritten as one member (:func:`compact`): a member per batch compresses ten times worse.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

COMPRESSED = ".jsonl.gz"
PLAIN = ".jsonl"
SUFFIXES = (COMPRESSED, PLAIN)  # in order of preference when a cell has both


def cell_id(path) -> str:
    """The cell id of a record file: its name without ``.jsonl.gz`` / ``.jsonl``."""
    name = Path(path).name
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return Path(path).stem


def cell_file(runs, cell_id: str) -> Path:
    """The file of ``cell_id`` under ``runs``: the existing one (compressed first), else a new ``.jsonl.gz``."""
    for suffix in SUFFIXES:
        path = Path(runs) / f"{cell_id}{suffix}"
        if path.is_file():
            return path
    return Path(runs) / f"{cell_id}{COMPRESSED}"


def cell_files(runs) -> list[Path]:
    """Every record file under ``runs``, one per cell (the compressed one when a cell has both), by name."""
    found: dict[str, Path] = {}
    for suffix in reversed(SUFFIXES):  # the preferred suffix last, so that it wins
        for path in Path(runs).glob(f"*{suffix}"):
            if path.name.endswith(suffix) and (suffix != PLAIN or not path.name.endswith(COMPRESSED)):
                found[cell_id(path)] = path
    return [found[k] for k in sorted(found)]


def open_records(path, mode: str = "r"):
    """``path`` opened as UTF-8 text for ``mode`` ``"r"``, ``"w"`` or ``"a"``; gzip when it ends in ``.gz``."""
    path = Path(path)
    if path.name.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return path.open(mode, encoding="utf-8")


def read_lines(path) -> Iterator[str]:
    """The lines of a record file, stopping quietly where a compressed file was cut short."""
    with open_records(path) as f:
        try:
            yield from f
        except (EOFError, OSError, zlib.error):  # a torn gzip member: what came before it stands
            return


def compact(path) -> None:
    """Rewrite the compressed record file ``path`` as one gzip member (the same lines), atomically; a plain file is
    left as it is."""
    path = Path(path)
    if not path.name.endswith(".gz"):
        return
    lines = list(read_lines(path))
    partial = path.with_name(path.name + ".part")
    with gzip.open(partial, "wt", encoding="utf-8") as f:
        f.write("".join(lines))
    os.replace(partial, path)
