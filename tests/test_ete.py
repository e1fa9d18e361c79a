"""ETE (experimental explore-then-exploit reconstruction) and the loop's ``commit_span`` seam it uses for
cross-block commits: reductions to ``threshold``, exploration, cross-block commits, batch invariance, errors."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

import dllm
from dllm.caches.block import BlockCausal
from dllm.cli import main
from dllm.core.errors import ConfigError

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]
OFF = {"explore_k": 0, "lookahead_blocks": 0}


def _lengths(family):
    return {"max_new_tokens": 16} if family == "sdar" else {"max_new_tokens": 24, "block_size": 8}


def _trace(model, sampler, prompts=PROMPTS, **kw):
    """(generation, [(committed [B, L], block start [B], block end [B], canvas before [B, L])] per step)."""
    steps = []
    before = []

    def callback(info):
        steps.append(info.committed.clone())

    out = sampler.generate(model, prompts, eos_early_stop=False, history=True, callback=callback, **kw)
    previous = out.history[0].clone()
    previous[steps[0]] = model.mask_id
    for now in out.history:
        before.append(previous)
        previous = now
    return out, list(zip(steps, before))


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
@pytest.mark.parametrize("std", [0.5, 1.0])
def test_off_is_threshold(family, std, tiny):
    model = tiny(family, std=std)
    for tau in (0.9, 0.6):
        kw = dict(**_lengths(family), eos_early_stop=False)
        plain = dllm.samplers.get("threshold", threshold=tau).generate(model, PROMPTS, **kw)
        off = dllm.samplers.get("ete", threshold=tau, **OFF).generate(model, PROMPTS, **kw)
        assert torch.equal(off.sequences, plain.sequences) and off.nfe == plain.nfe
        # a zero entropy budget explores nothing either
        broke = dllm.samplers.get("ete", threshold=tau, lookahead_blocks=0, explore_budget=0.0)
        assert torch.equal(broke.generate(model, PROMPTS, **kw).sequences, plain.sequences)


def test_off_is_threshold_on_the_trained_model():
    from dllm import tasks

    model = dllm.load("tiny-dream")
    prompts = [p.prompt for p in tasks.get("arith").examples("test", 4)]
    kw = dict(block_size=8, eos_early_stop=False)
    plain = dllm.samplers.get("threshold", threshold=0.95).generate(model, prompts, **kw)
    off = dllm.samplers.get("ete", threshold=0.95, **OFF).generate(model, prompts, **kw)
    assert torch.equal(off.sequences, plain.sequences) and off.nfe == plain.nfe


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cross_block_commits_stay_in_the_look_ahead(family, tiny):
    model = tiny(family, std=1.0)
    out, steps = _trace(
        model, dllm.samplers.get("ete", threshold=0.6, explore_k=0, lookahead_blocks=1), **_lengths(family)
    )
    width = out.prompt_width
    beyond = 0
    for committed, before in steps:
        assert bool((before[committed] == model.mask_id).all())
        for row in range(len(PROMPTS)):
            cols = committed[row].nonzero().squeeze(1) - width
            if cols.numel():
                current = int((before[row, width:] == model.mask_id).nonzero()[0]) // 8  # first open block
                blocks = cols // 8
                assert bool((blocks >= current).all()) and bool((blocks <= current + 1).all())
                assert bool((blocks == current).any()), "the current block progresses at every step"
                beyond += int((blocks > current).sum())
    assert beyond > 0, "some confident tokens of the next block were committed early"
    plain = dllm.samplers.get("threshold", threshold=0.6).generate(
        model, PROMPTS, **_lengths(family), eos_early_stop=False
    )
    assert out.nfe <= plain.nfe


def test_exploration_commits_the_most_uncertain_slots(tiny):
    """At threshold 1 nothing passes, so each step explores explore_k slots of the block: the highest-entropy
    ones (or the leftmost)."""
    model = tiny("llada", std=0.5)
    kw = dict(max_new_tokens=16, block_size=8)
    out, steps = _trace(model, dllm.samplers.get("ete", threshold=1.0, explore_k=2, lookahead_blocks=0), **kw)
    assert out.nfe == 8  # two per step
    assert all(int(c.sum(1).max()) == 2 for c, _ in steps)
    _, left = _trace(
        model, dllm.samplers.get("ete", threshold=1.0, explore_select="leftmost_uncertain", lookahead_blocks=0), **kw
    )
    for committed, before in left:
        open_ = before == model.mask_id
        first = open_.long().argmax(1)
        assert torch.equal(committed.long().argmax(1), first)
        assert int(committed.sum(1).max()) == 1

    seen = []

    class Spy(dllm.samplers.ETE):
        def select(self, step, state):
            chosen = super().select(step, state)
            entropy = step.scores.entropy.masked_fill(~step.committable, float("-inf"))
            seen.append((chosen, entropy))
            return chosen

    Spy(threshold=1.0, explore_k=2, lookahead_blocks=0).generate(model, PROMPTS, eos_early_stop=False, **kw)
    for chosen, entropy in seen:
        for row in range(len(PROMPTS)):
            picked = entropy[row][chosen[row]]
            others = entropy[row][~chosen[row] & torch.isfinite(entropy[row])]
            if others.numel():
                assert picked.min() >= others.max()


def test_exploration_only_when_stalled(tiny):
    """With the stall trigger a step whose block has a confident slot explores nothing; with "always" it does."""
    model = tiny("llada", std=1.0)
    kw = dict(max_new_tokens=16, block_size=8)
    stall = dllm.samplers.get("ete", threshold=0.5, explore_k=3, lookahead_blocks=0)
    plain = dllm.samplers.get("threshold", threshold=0.5)
    always = dllm.samplers.get("ete", threshold=0.5, explore_k=3, lookahead_blocks=0, explore_trigger="always")
    nfe = {
        s.name + str(i): s.generate(model, PROMPTS, eos_early_stop=False, **kw).nfe
        for i, s in enumerate((stall, plain, always))
    }
    assert nfe["ete2"] < nfe["threshold1"]
    assert nfe["ete0"] <= nfe["threshold1"]


@pytest.mark.parametrize(
    "family,hp",
    [
        ("llada", {}),
        ("dream", {}),
        ("sdar", {"lookahead_blocks": 0}),
        ("llada", {"explore_select": "leftmost_uncertain", "explore_k": 2}),
    ],
)
def test_batch_invariance(family, hp, tiny):
    model = tiny(family, std=1.0)
    sampler = dllm.samplers.get("ete", threshold=0.8, **hp)
    kw = dict(**_lengths(family), eos_early_stop=False)
    batch = sampler.generate(model, PROMPTS, **kw)
    for r, prompt in enumerate(PROMPTS):
        alone = sampler.generate(model, [prompt], **kw)
        generated = alone.sequences[0, len(prompt) :]
        assert torch.equal(batch.sequences[r, batch.prompt_width :][: generated.shape[0]], generated), f"row {r}"
    # sampled: prompt r alone draws the stream of row 0, so put it first in the batch
    kw.update(temperature=1.0, seed=3)
    for r, prompt in enumerate(PROMPTS):
        batch = sampler.generate(model, [prompt] + PROMPTS[:r] + PROMPTS[r + 1 :], **kw)
        alone = sampler.generate(model, [prompt], **kw)
        generated = alone.sequences[0, len(prompt) :]
        assert torch.equal(batch.sequences[0, batch.prompt_width :][: generated.shape[0]], generated), f"prompt {r}"


@dataclasses.dataclass(frozen=True)
class Greedy(dllm.samplers.Sampler):
    """Asks to commit every masked slot of the canvas; may commit in the next ``ahead`` blocks too."""

    name: ClassVar[str] = "greedy_everything"
    fixed_steps: ClassVar[bool] = False
    ahead: int = 0

    def observe(self, step, state):
        return step.window(
            step.canvas.length - step.canvas.prompt_width, torch.full_like(step.start, step.canvas.prompt_width)
        )

    def commit_span(self, step, state):
        if not self.ahead:
            return None
        return (step.columns >= step.end[:, None]) & (step.columns < step.end[:, None] + 8 * self.ahead)

    def select(self, step, state):
        return step.masked


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_commit_span_bounds_the_commits(ahead, tiny):
    """The loop keeps only the current block's slots plus the sampler's declared span."""
    model = tiny("llada")
    out = Greedy(ahead).generate(model, PROMPTS, max_new_tokens=32, block_size=8, eos_early_stop=False)
    assert out.nfe == -(-4 // (ahead + 1))


def test_errors():
    for hp in (
        {"threshold": 2.0},
        {"explore_k": -1},
        {"explore_k": 1.5},
        {"min_exploit": -2},
        {"lookahead_blocks": True},
        {"explore_trigger": "sometimes"},
        {"explore_select": "random"},
        {"explore_budget": -1.0},
    ):
        with pytest.raises(ConfigError, match=next(iter(hp))):
            dllm.samplers.get("ete", **hp)


def test_cross_block_needs_no_cache_and_no_block_model(tiny):
    with pytest.raises(ConfigError, match="lookahead_blocks"):
        dllm.samplers.get("ete").generate(tiny("sdar"), PROMPTS, max_new_tokens=16)
    with pytest.raises(ConfigError, match="cache"):
        dllm.samplers.get("ete").generate(tiny("llada"), PROMPTS, max_new_tokens=16, block_size=8, cache=BlockCausal())
    out = dllm.samplers.get("ete", lookahead_blocks=0).generate(tiny("sdar"), PROMPTS, max_new_tokens=16)
    assert not bool((out.sequences == tiny("sdar").mask_id).any())


def test_listed_as_experimental(capsys):
    assert main(["samplers"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("ete "))
    assert "[experimental]" in line
    assert "EXPERIMENTAL" in dllm.samplers.ETE.__doc__
