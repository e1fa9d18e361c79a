"""The Window-Diffusion cache through the public API: exactness with a refresh at every step, pruning that
restricts the commit set to the active masks, per-row phases (batch invariance), accounting, bad settings.
Parity with the official code: tests/test_parity_window.py."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.caches import Window

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]
SAMPLERS = [("llada", {}), ("threshold", {}), ("dream", {}), ("dream", {"alg": "origin"})]
IDS = ["llada", "threshold", "dream", "dream-origin"]
G = 16


def _generate(model, name, hp, prompts, cache, **kw):
    sampler = dllm.samplers.get(name, **hp)
    kw = {"max_new_tokens": G, "block_size": G, "eos_early_stop": False, **kw}
    run = sampler.prepare(model, prompts, cache=cache, **kw)
    with torch.inference_mode():
        sampler.run(run)
    return sampler.finish(run), run


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name,hp", SAMPLERS, ids=IDS)
def test_refresh_every_step_is_the_no_cache_output(family, name, hp, tiny):
    model = tiny(family)
    for block in (G, 8):
        plain, _ = _generate(model, name, hp, PROMPTS, None, block_size=block, seed=1)
        cached, run = _generate(model, name, hp, PROMPTS, Window(8, 2, 1), block_size=block, seed=1)
        assert torch.equal(cached.sequences, plain.sequences)
        assert cached.nfe == plain.nfe == run.refreshes


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name,hp", SAMPLERS, ids=IDS)
def test_pruned_steps_commit_only_among_the_active_masks(family, name, hp, tiny):
    model = tiny(family)
    active, cycle = 3, 4
    seen = []
    out, run = _generate(
        model, name, hp, PROMPTS, Window(8, active, cycle), seed=2, callback=lambda info: seen.append(info)
    )
    assert not (out.sequences == model.mask_id).any()
    plain, _ = _generate(model, name, hp, PROMPTS, None, seed=2)
    if name == "threshold":  # fewer candidates per step: at least as many steps
        assert out.nfe >= plain.nfe
    elif hp:  # "origin" reveals random slots; those outside the active set wait: at most one forward a step
        assert out.nfe <= G
    else:  # a fixed schedule: the same steps
        assert out.nfe == plain.nfe
    pruned = 0
    for i, info in enumerate(seen):
        before = (info.tokens == model.mask_id) | info.committed
        rank = before.long().cumsum(1) - 1
        if name in ("llada", "threshold") and i % cycle:  # every row's phase is the forward count here
            pruned += 1
            assert not (info.committed & ~(before & (rank < active))).any()
    assert run.refreshes < run.nfe
    if name in ("llada", "threshold"):
        assert run.refreshes == -(-run.nfe // cycle) and pruned > 0


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name,hp", SAMPLERS, ids=IDS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_prompt_alone_equals_its_row_in_a_mixed_length_batch(family, name, hp, temperature, tiny):
    model = tiny(family)
    cache = Window(6, 2, 3)
    for r, prompt in enumerate(PROMPTS[:2]):
        batch = [prompt] + [p for p in PROMPTS if p is not prompt]  # row 0: its random streams are (seed, 0)
        kw = {"max_new_tokens": 16, "block_size": 8, "temperature": temperature, "seed": 5}
        together, _ = _generate(model, name, hp, batch, cache, **kw)
        alone, _ = _generate(model, name, hp, [prompt], cache, **kw)
        width = together.prompt_width
        assert torch.equal(together.sequences[0, width:], alone.sequences[0, len(prompt) :]), f"prompt {r}"


def test_dream_origin_rows_run_different_phases_in_one_forward(tiny):
    """Dream's "origin" draws each row's commits at random: rows with nothing scheduled share the batch's
    forward without advancing their phase, so some forwards mix a phase start with pruned rows. (A prompt's
    draws follow the prompt: the batch repeats one, whose second occurrence draws anew.)"""
    mixed = []

    class Spy(Window):
        def plan(self, step, state):
            plan = super().plan(step, state)
            full = step.of_active(state.offset) == 0
            mixed.append(bool(full.any()) and not bool(full.all()))
            return plan

    _generate(tiny("dream"), "dream", {"alg": "origin"}, [PROMPTS[0], *PROMPTS], Spy(6, 2, 3), seed=5)
    assert any(mixed)


@pytest.mark.parametrize(
    "hp",
    [
        {"window_tokens": 0},
        {"active_tokens": 0},
        {"refresh_cycle": 0},
        {"refresh_cycle": 2.5},
        {"active_tokens": True},
        {"window_tokens": 4, "active_tokens": 8},
    ],
)
def test_bad_settings_are_config_errors(hp):
    with pytest.raises(dllm.ConfigError, match="cache 'window'"):
        Window(**hp)


def test_defaults_are_the_readme_settings():
    assert (Window().window_tokens, Window().active_tokens, Window().refresh_cycle) == (64, 16, 32)
    assert dllm.caches.CACHES.get("window") is Window


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_an_exit_rule_finishes_rows_at_a_pruned_step(family, tiny, exit_at):
    """A finishing row's masks outside the active set have no hidden states in a pruned step: one more
    counted forward of the finishing rows gives their proposals."""
    model = tiny(family)
    sampler = dllm.samplers.get("exit_at", base="threshold", at=2)
    kw = {"max_new_tokens": G, "block_size": G, "eos_early_stop": False}
    plain = sampler.generate(model, PROMPTS, cache=None, **kw)
    every = sampler.generate(model, PROMPTS, cache=Window(8, 2, 1), **kw)
    assert torch.equal(every.sequences, plain.sequences) and every.nfe == plain.nfe == 3
    pruned = sampler.generate(model, PROMPTS, cache=Window(8, 2, 4), **kw)  # step 2 is pruned
    assert not (pruned.sequences == model.mask_id).any() and pruned.nfe == plain.nfe + 1
