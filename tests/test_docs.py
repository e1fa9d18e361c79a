"""The examples of docs/samplers.md (each at most 40 lines) and docs/extending.md (each under 60) run as written,
so the guides cannot drift from the seams they document."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).parents[1] / "docs" / "samplers.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
TITLES = ["sampler", "transform", "exit rule", "cache"]


def test_the_guide_has_one_example_per_seam():
    assert len(EXAMPLES) == len(TITLES)


@pytest.mark.parametrize("code", EXAMPLES, ids=TITLES)
def test_example_runs(code, registries):  # (what an example registers is dropped after it)
    assert len(code.strip().splitlines()) <= 40
    name = f"{GUIDE.name}:{TITLES[EXAMPLES.index(code)]}"
    exec(compile(code, name, "exec", dont_inherit=True), {"__name__": "docs_example"})


def test_the_steps_guide_runs():
    """docs/steps.md (``history``, ``callback`` and the helpers that read the steps) runs as written."""
    (code,) = re.findall(r"```python\n(.*?)```", (GUIDE.parent / "steps.md").read_text(), flags=re.S)
    exec(compile(code, "steps.md", "exec", dont_inherit=True), {"__name__": "docs_example"})


EXTENDING = re.findall(r"```python\n(.*?)```", (GUIDE.parent / "extending.md").read_text(), flags=re.S)


@pytest.mark.parametrize("code", EXTENDING, ids=["model family", "decoding process"])
def test_extending_example_runs(code, registries):
    assert len(EXTENDING) == 2 and len(code.strip().splitlines()) < 60
    exec(compile(code, "extending.md", "exec", dont_inherit=True), {"__name__": "docs_example"})
