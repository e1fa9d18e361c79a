"""The loop's seams: scored vs committable columns, block bounds as state, decisions that override tokens and
finish rows, exit rules over any base, counted forwards, host synchronisations per step."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dllm
from dllm.bench.overhead import SyncCounter
from dllm.engine.step import NO_OVERRIDE, Decision, Step
from dllm.kernels.selection import Rule
from dllm.samplers.confidence import Threshold
from dllm.samplers.transforms import SuppressTokens

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]
G, BS = 16, 4


def _run(model, sampler, prompts=PROMPTS, **kw):
    steps = []
    out = sampler.generate(
        model,
        prompts,
        max_new_tokens=G,
        block_size=BS,
        eos_early_stop=False,
        history=True,
        callback=lambda info: steps.append(info),
        **kw,
    )
    return out, steps


@dataclasses.dataclass(frozen=True)
class GreedyEverything(Threshold):
    """Observes the block and the next 6 columns and asks to commit every scored column."""

    fixed_steps: ClassVar[bool] = False

    def observe(self, step, state):
        return step.window(BS + 6)

    def select(self, step, state):
        assert bool(torch.isfinite(step.scores.prob[step.scored]).all())  # look-ahead columns are scored too
        return step.scored.clone()


def test_observed_columns_are_scored_but_only_committable_slots_are_written(tiny):
    model = tiny("llada")
    out, steps = _run(model, GreedyEverything())
    p = out.prompt_width
    previous = out.history[0].clone()
    previous[steps[0].committed] = model.mask_id
    for info, now in zip(steps, out.history):
        cols = info.committed.nonzero()[:, 1]
        assert bool(((cols - p) // BS == info.block[info.committed.nonzero()[:, 0]]).all()), "outside the block"
        assert bool((previous[info.committed] == model.mask_id).all())
        previous = now
    assert out.nfe == G // BS  # the whole block at each step: one forward per block


@dataclasses.dataclass(frozen=True)
class PairBlocks(Threshold):
    """Ends every block two columns after its start at the block's first step (AdaBlock-style sizing)."""

    threshold: float = 0.0  # commit everything committable

    def select(self, step, state):
        step.set_block_end(step.step == 0, step.start + 2)
        return super().select(step, state)


def test_a_sampler_may_end_its_block_at_its_first_step(tiny):
    model = tiny("llada")
    out, steps = _run(model, PairBlocks())
    assert out.nfe == G // 2  # every block holds two columns, committed in one step
    for info in steps:
        rows, cols = info.committed.nonzero(as_tuple=True)
        assert info.committed.sum(1).tolist() == [2, 2, 2]
        assert bool(((cols - out.prompt_width) // 2 == info.block[rows]).all())
    assert not bool((out.sequences == model.mask_id).any())


@dataclasses.dataclass(frozen=True)
class Sevens(Threshold):
    """Writes token 7 instead of the proposal in the first committed slot of each step."""

    def select(self, step, state):
        commit = super().select(step, state)
        tokens = torch.full_like(step.tokens, NO_OVERRIDE)
        first = commit & (commit.long().cumsum(1) == 1)
        tokens[first] = 7
        return Decision(commit, tokens=tokens)


def test_decisions_override_proposed_tokens(tiny):
    model = tiny("llada")
    base, _ = _run(model, Threshold())
    out, steps = _run(model, Sevens())
    for info in steps:
        first = info.committed & (info.committed.long().cumsum(1) == 1)
        assert bool((info.tokens[first] == 7).all())
    assert not torch.equal(out.sequences, base.sequences)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_an_exit_fills_every_remaining_mask_with_that_steps_proposal(family, tiny, exit_at):
    model = tiny(family)
    base, _ = _run(model, dllm.samplers.get("llada"))
    out, steps = _run(model, dllm.samplers.get("llada").with_exit(exit_at(at=2)))
    assert out.nfe == 3 and not bool((out.sequences == model.mask_id).any())
    assert torch.equal(out.history[1], base.history[1])  # the base's steps until the exit
    before = out.history[1]  # the canvas the exit step's forward saw
    width = before.shape[1] - G
    valid = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + G) for p in PROMPTS]).bool()
    with torch.no_grad():
        logits = model.logits(before, model.positions(valid), attention_mask=valid)
    logits[..., model.mask_id] = float("-inf")
    filled = steps[2].committed
    assert int(filled.sum()) == int((before == model.mask_id).sum())
    assert torch.equal(out.sequences[filled], logits.argmax(-1)[filled])


def test_an_exit_rule_that_never_fires_changes_nothing(tiny, exit_at):
    model = tiny("llada")
    for base in (dllm.samplers.get("llada"), dllm.samplers.get("threshold", threshold=0.7)):
        plain, _ = _run(model, base)
        composed, _ = _run(model, base.with_exit(exit_at(at=10_000)))
        assert torch.equal(composed.sequences, plain.sequences) and composed.nfe == plain.nfe


def test_exit_rules_compose_through_the_registry(tiny, exit_at):
    sampler = dllm.samplers.get("exit_at", at=1, base="threshold", threshold=0.8)
    assert sampler.base == Threshold(0.8) and sampler.exits == (exit_at(1),)
    assert sampler.name == "exit_at(threshold)" and not sampler.fixed_steps
    assert sampler.settings() == {"base": "threshold", "threshold": 0.8, "at": 1}
    assert dllm.samplers.get("exit_at").base == dllm.samplers.get("llada")  # the rule's default base
    assert dllm.samplers.defaults("exit_at", base="factor") == {
        "at": 1,
        "base": "factor",
        "factor": 1.0,
        "strict_prefix": False,
    }
    out, _ = _run(tiny("llada"), sampler)
    assert out.nfe == 2
    with pytest.raises(dllm.ConfigError, match="'exit_at' over base 'llada' has no hyper-parameter 'threshold'"):
        dllm.samplers.get("exit_at", threshold=0.8)
    with pytest.raises(dllm.ConfigError, match="base must name a sampler"):
        dllm.samplers.get("exit_at", base="exit_at")


def test_a_composition_is_its_base_in_every_hook_it_does_not_combine(exit_at):
    """Each policy hook and fact a Sampler declares reaches the base (a new hook needs no forwarder), except what
    the composition combines or runs itself."""
    from dllm.samplers.base import Sampler
    from dllm.samplers.compose import NOT_FORWARDED, Composed

    class Base(Threshold):
        fixed_steps, default_block, grid_blocks = False, None, False

    calls = []
    base = Base()
    combined = {
        "name",
        "exit_rules",
        "transforms",
        "check_cache",
        "check_run",
        "with_exit",
        "with_transforms",
        "settings",
    }
    composed = base.with_exit(exit_at(at=1))
    for name in (n for n in vars(Sampler) if not n.startswith("_") and n not in NOT_FORWARDED | combined):
        declared = getattr(Sampler, name)
        if not callable(declared):  # a fact of the base
            assert getattr(composed, name) == getattr(base, name), name
            continue
        object.__setattr__(base, name, lambda *args, name=name: calls.append((name, args)) or name)
        assert getattr(composed, name)(1, 2) == name and calls[-1] == (name, (1, 2)), name
    assert {"select", "selection", "quota", "observe", "default_cache"} <= {c[0] for c in calls}
    assert Composed.run is Sampler.run and Composed.generate is Sampler.generate  # the shared loop runs the composition


def test_transforms_attach_to_any_sampler(tiny):
    model = tiny("llada")
    eos = model.eos_ids[0]
    plain, _ = _run(model, dllm.samplers.get("threshold"))
    assert bool((plain.sequences[:, plain.prompt_width :] == eos).any())  # the tiny model proposes EOS
    out, _ = _run(model, dllm.samplers.get("threshold").with_transforms(SuppressTokens((eos,))))
    assert not bool((out.sequences[:, out.prompt_width :] == eos).any())


def test_every_forward_is_counted(tiny, monkeypatch):
    model = tiny("llada")
    calls = []
    original = model.hidden
    monkeypatch.setattr(model, "hidden", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    for sampler in (dllm.samplers.get("llada", cfg_scale=1.0), dllm.samplers.get("threshold")):
        calls.clear()
        out, _ = _run(model, sampler)
        assert out.nfe == len(calls)


def _syncs(model, sampler, g, **kw):
    with torch.inference_mode(), SyncCounter() as counter:
        out = sampler.generate(model, PROMPTS, max_new_tokens=g, eos_early_stop=False, **kw)
    return counter.count, out.nfe


@pytest.mark.parametrize(
    "family,name,per_step",
    [("llada", "threshold", 1), ("llada", "llada", 2), ("dream", "dream", 2), ("sdar", "sdar", 2)],
)
def test_host_synchronisations_per_step(family, name, per_step, tiny):
    """A greedy step reads back from the device once (twice when a fixed schedule may skip the step), whatever
    the batch: the difference between a long and a short generation, per extra step."""
    model = tiny(family)
    sampler = dllm.samplers.reference(family) if name == family else dllm.samplers.get(name)
    kw = {} if family == "sdar" else {"block_size": 8}
    short, long_ = _syncs(model, sampler, 8, **kw), _syncs(model, sampler, 32, **kw)
    extra_steps = long_[1] - short[1]
    assert extra_steps > 0
    leaving = 2 * len(PROMPTS)  # a row that leaves the batch costs two reads (which rows; any pads left)
    assert (long_[0] - short[0]) <= per_step * extra_steps + leaving


@pytest.mark.parametrize("static_shapes", [False, True])
def test_host_synchronisations_per_step_with_a_cache(static_shapes, tiny):
    """A greedy threshold step under the dual cache reads back twice (the step's flags; the plan's query width,
    which the static path buckets without a read of its own), with static shapes as without."""
    model, sampler = tiny("llada"), dllm.samplers.get("threshold")
    kw = {"block_size": 8, "cache": "dual", "static_shapes": static_shapes}
    short, long_ = _syncs(model, sampler, 8, **kw), _syncs(model, sampler, 32, **kw)
    extra_steps = long_[1] - short[1]
    assert extra_steps > 0
    assert (long_[0] - short[0]) <= 2 * extra_steps + 2 * len(PROMPTS)


@pytest.mark.parametrize("cache", ["default", None])
def test_host_synchronisations_per_wedlm_step(cache, tiny):
    """A greedy WeDLM step reads back three times, with its stream cache as with the cache-free recompute: the
    widest window's mask count (the logits' width), the forward's width (the cache's query width, or the
    recompute's end column) and whether a row ended."""
    model, sampler = tiny("wedlm"), dllm.samplers.get("wedlm", wedlm_entropy_threshold=None)
    short, long_ = _syncs(model, sampler, 8, cache=cache), _syncs(model, sampler, 32, cache=cache)
    extra_steps = long_[1] - short[1]
    assert extra_steps > 0
    assert (long_[0] - short[0]) <= 3 * extra_steps + 2 * len(PROMPTS)


@pytest.mark.parametrize("alg,temperature", [("entropy", 0.0), ("maskgit_plus", 1.0), ("origin", 0.0), ("origin", 1.0)])
def test_idle_steps_are_taken_at_once_with_the_output_of_one_by_one(alg, temperature, tiny, monkeypatch):
    """Dream with steps far above the generation length: most scheduled steps commit nothing. The loop takes a run
    of them at once (``Sampler.idle_steps``) with the tokens, forwards, history and callbacks of taking them one
    by one, in a number of loop iterations that follows the forwards, not the steps."""
    model, sampler = tiny("dream"), dllm.samplers.get("dream", alg=alg)
    steps = 512  # 32 blocks of 4 -> 16 scheduled steps per slot
    iterations = []
    settle = Step.settle
    monkeypatch.setattr(Step, "settle", lambda step: iterations.append(1) or settle(step))
    at_once, seen = _run(model, sampler, steps=steps, temperature=temperature, seed=2)
    assert len(iterations) <= 2 * (at_once.nfe + 1)  # at most one run of idle steps before each forward
    monkeypatch.setattr(type(sampler), "idle_steps", lambda self, step, state: None)
    iterations.clear()
    one_by_one, expected = _run(model, sampler, steps=steps, temperature=temperature, seed=2)
    assert len(iterations) > steps // 8  # (the reference really takes the idle steps one by one)
    assert torch.equal(at_once.sequences, one_by_one.sequences) and at_once.nfe == one_by_one.nfe
    assert len(at_once.history) == len(one_by_one.history)
    assert all(torch.equal(a, b) for a, b in zip(at_once.history, one_by_one.history))
    assert [(i.iteration, i.nfe) for i in seen] == [(i.iteration, i.nfe) for i in expected]
    for a, b in zip(seen, expected):
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("committed", "block", "done"))


class _Float64(TorchDispatchMode):
    """Records the aten ops that produce a float64 tensor."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(o, torch.Tensor) and o.dtype == torch.float64 for o in torch.utils._pytree.tree_leaves(out)):
            self.ops.add(str(func.overloadpacket))
        return out


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("static_shapes", [False, True])
def test_no_float64_on_the_hot_path_unless_a_rule_asks(family, static_shapes, tiny):
    """A float32 model's greedy step computes nothing in float64 (the loop, the cache, the scoring) unless the
    sampler's rule asks for it (the Fast-dLLM rules' float64 softmax: ``threshold``)."""
    model = tiny(family)
    kw = {"max_new_tokens": 16, "block_size": 8, "cache": "dual", "static_shapes": static_shapes}
    with torch.inference_mode(), _Float64() as plain:
        dllm.samplers.get("llada").generate(model, PROMPTS, **kw)
    assert not plain.ops
    with torch.inference_mode(), _Float64() as rule:
        dllm.samplers.get("threshold").generate(model, PROMPTS, **kw)
    assert "aten.softmax" in rule.ops  # (the check sees float64 where it is asked for)


@pytest.mark.parametrize("cache", ["default", None])
def test_no_float64_in_a_wedlm_step(cache, tiny):
    """WeDLM's entropy rule and its stream cache compute nothing in float64 on a float32 model."""
    with torch.inference_mode(), _Float64() as seen:
        dllm.samplers.get("wedlm").generate(tiny("wedlm"), PROMPTS, max_new_tokens=16, cache=cache)
    assert not seen.ops


def test_composing_something_that_is_not_a_part_is_refused(exit_at):
    with pytest.raises(dllm.ConfigError, match="'prophet' is not an exit rule"):
        dllm.samplers.get("threshold").with_exit("prophet")
    with pytest.raises(dllm.ConfigError, match="is not an exit rule .* or a logit transform"):
        dllm.samplers.get("threshold").with_transforms(lambda logits, *a: logits)
    with pytest.raises(dllm.ConfigError, match="the base must be a sampler"):
        exit_at().compose("threshold")


def test_a_selection_rule_is_declared_once():
    """Threshold, Factor and LocalLeap declare their rule and nothing else (the default select applies it); a
    subclass deciding for itself gets no fused rule, whatever the hook's name in its parents."""
    from dllm.samplers import Factor, LocalLeap

    for cls in (Threshold, Factor, LocalLeap):
        assert "select" not in vars(cls) and "selection" in vars(cls), cls.__name__
    assert Threshold(0.7).kernel_rule(None, None) == Rule("threshold", threshold=0.7)

    class Own(Threshold):
        def select(self, step, state):
            return super().select(step, state)

    class Relabelled(Own):
        pass

    assert Own().kernel_rule(None, None) is None and Relabelled().kernel_rule(None, None) is None
    assert Own().with_transforms().kernel_rule(None, None) is None  # a composition asks its base
