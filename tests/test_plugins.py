"""Samplers, caches and model families of another package, found through Python entry points
(:mod:`dllm.core.plugins`): an installed distribution (a ``*.dist-info`` with ``entry_points.txt`` on the path)
declares them, and every process sees them without importing that package itself: the CLI (another process),
the bench, the lm-eval model, ``dllm.load``. A broken package is named and left out; the classes a registry
cannot use are refused with what to write instead."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dllm
from dllm.cli import main
from dllm.core import plugins
from dllm.core.errors import ConfigError, DllmWarning

SORT = "Sort the list: 14 7 9\n"
PLUGIN = '''
import dataclasses
from typing import ClassVar

import torch

import dllm
from dllm.caches.base import Cache, Plan
from dllm.kernels.reference import ScoreSpec, top_k_per_row
from dllm.models.llada import LLaDA, tiny_llada_config
from dllm.models.registry import Family


@dataclasses.dataclass(frozen=True)
class MarginDemo(dllm.samplers.Sampler):
    """Commit the slots whose top-1 minus top-2 probability is at least ``margin`` (and the best one)."""

    name: ClassVar[str] = "margin_demo"
    fixed_steps: ClassVar[bool] = False
    margin: float = 0.5

    def score_spec(self, run):
        return ScoreSpec(need=frozenset({"margin"}), temperature=run.temperature)

    def select(self, step, state):
        margin = step.among_committable(step.scores.margin)
        return (margin >= self.margin) | top_k_per_row(margin, torch.ones_like(step.block))


@dataclasses.dataclass(frozen=True)
class BlockOnly(Cache):
    """A full forward at each block's first step; then only the block, against the stored K/V."""

    name: ClassVar[str] = "block_only"

    def start(self, run):
        state = super().start(run)
        state.full = True
        return state

    def begin_block(self, step, state, rows):
        state.full = True

    def plan(self, step, state):
        if state.full:
            state.full = False
            return Plan(refresh=True)
        return Plan(queries=step.of_active(step.window(step.canvas.block_size)))


class LLaDALike(LLaDA):
    """LLaDA's adapter under another model_type."""


def tiny_config(vocab_size, tokens, **shape):
    return {**tiny_llada_config(vocab_size, tokens, **shape), "model_type": "llada_like"}


FAMILY = Family("llada_like", ("llada_like",), LLaDALike, "full", tiny_config, tied_head=None)
'''


def install(root: Path, package: str, module: str, source: str, entries: str) -> Path:
    """A distribution ``package`` 0.1 with module ``module`` and ``entries`` (entry_points.txt) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    info = root / f"{package.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entries))
    return root


ENTRIES = """
    [dllm.samplers]
    margin_demo = {module}:MarginDemo
    [dllm.caches]
    block_only = {module}:BlockOnly
    [dllm.families]
    llada_like = {module}:FAMILY
"""


@pytest.fixture
def fresh(registries):
    """Registries as at start-up (built-ins only, no group loaded yet), restored afterwards."""
    monkeypatch = registries
    monkeypatch.setattr(plugins, "_loaded", set())
    monkeypatch.setattr(plugins, "_failed", {})
    before = set(sys.modules)
    yield monkeypatch
    for name in set(sys.modules) - before:
        if name.startswith("dllm_demo"):
            del sys.modules[name]


@pytest.fixture
def installed(tmp_path, fresh):
    module = "dllm_demo_plugin"
    root = install(tmp_path / "site", "dllm-demo-plugin", module, PLUGIN, ENTRIES.format(module=module))
    fresh.syspath_prepend(str(root))
    return root


def test_the_command_line_finds_an_installed_sampler_and_cache(installed):
    """`dllm generate --sampler NAME --cache NAME` in a new process, which never imported the plugin."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), str(Path(__file__).parents[1])])}
    command = [sys.executable, "-m", "dllm", "generate", SORT, "--sampler", "margin_demo", "--cache", "block_only"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "[llada | margin_demo + cache block_only] NFE" in done.stderr


def test_every_registry_user_sees_the_plugins(installed, tmp_path, capsys):
    assert main(["samplers"]) == 0 and main(["caches"]) == 0
    listed = capsys.readouterr().out
    assert "margin_demo" in listed and "block_only" in listed
    sampler = dllm.samplers.get("Margin_Demo", margin=0.9)  # names stay case-insensitive
    assert type(sampler).__module__ == "dllm_demo_plugin" and dllm.caches.get("block_only").name == "block_only"

    from dllm.bench import runner

    runner.validate(runner.BenchConfig(samplers=["margin_demo"], caches=["block_only"], tasks=["listops"]))

    from dllm.eval.harness import DllmLM

    lm = DllmLM(pretrained="tiny-llada", sampler="margin_demo", margin=0.9, cache="block_only", device="cpu")
    assert lm.sampler == sampler

    from dllm.models.tiny import make_tiny_checkpoint

    model = dllm.load(make_tiny_checkpoint(tmp_path / "ck", family="llada_like"))
    assert model.family == "llada_like" and type(model).__name__ == "LLaDALike"


def test_a_broken_package_is_named_and_left_out(tmp_path, fresh, capsys):
    entries = """
        [dllm.samplers]
        broken = dllm_demo_broken:Broken
        renamed = dllm_demo_broken:Renamed
        threshold = dllm_demo_broken:Impostor
    """
    source = "from dllm.samplers import Threshold\n\nclass Renamed(Threshold):\n    name = 'other'\n\n"
    source += "class Impostor(Threshold):\n    pass\n"
    fresh.syspath_prepend(str(install(tmp_path, "dllm-demo-broken", "dllm_demo_broken", source, entries)))
    with pytest.warns(DllmWarning) as caught:
        names = dllm.samplers.names()
    assert "threshold" in names and dllm.samplers.get("threshold") == dllm.samplers.Threshold()  # unharmed
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3 and all("package dllm-demo-broken 0.1" in m for m in messages)
    assert "'broken'" in messages[0] and "failed to import: AttributeError" in messages[0]
    assert "whose name is 'other'" in messages[1] and "would replace" in messages[2]
    with pytest.raises(
        ConfigError, match="unknown sampler 'broken'.*not loaded: the dllm.samplers entry point 'broken'"
    ):
        dllm.samplers.get("broken")
    assert main(["generate", SORT, "--sampler", "broken"]) == 2
    assert "not loaded: the dllm.samplers entry point 'broken' of package dllm-demo-broken" in capsys.readouterr().err


def test_a_cache_without_a_name_is_refused_with_the_name_to_give(fresh):
    from dllm.caches.base import Cache, Plan

    class BlockOnly(Cache):
        def plan(self, step, state):
            return Plan(refresh=True)

    with pytest.raises(ConfigError, match=r"BlockOnly has no name .*name: ClassVar\[str\] = 'block_only'"):
        dllm.caches.register(BlockOnly)
    BlockOnly.name = "block_only"
    assert dllm.caches.register(BlockOnly) is BlockOnly and "block_only" in dllm.caches.names()


def test_a_fixed_schedule_sampler_without_quota_is_refused_where_it_is_defined():
    """It used to fail deep in the loop (``torch.minimum(None, ...)``: a TypeError)."""
    with pytest.raises(ConfigError, match=r"EveryMask has a fixed schedule .* no quota\(step, state\)"):

        class EveryMask(dllm.samplers.Sampler):
            def select(self, step, state):
                return step.masked

    class Adaptive(dllm.samplers.Sampler):  # fine: select decides how many
        fixed_steps = False

        def select(self, step, state):
            return step.masked

    class Scheduled(Adaptive):  # fine: a quota
        fixed_steps = True

        def quota(self, step, state):
            return step.committable.sum(1)
