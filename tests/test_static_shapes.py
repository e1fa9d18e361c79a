"""``generate(static_shapes=True)`` (:mod:`dllm.engine.static`): the same tokens, forwards and history as the default
path for every sampler x cache x family of the cache matrix, and forwards whose shapes stay fixed within a phase
(rows kept in place when they finish, bucketed query widths)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_cache_matrix import (
    CONFIGURED,
    CONFIGURED_MATRIX,
    MATRIX,
    PROMPTS,
    _cache,
    _generate,
    _lengths,
    _sampler,
    refused,
)

import dllm
from dllm import tasks
from dllm.engine import static


def _same(default, fixed):
    assert torch.equal(fixed.sequences, default.sequences)
    assert fixed.nfe == default.nfe
    if default.history is not None:
        assert len(fixed.history) == len(default.history)
        assert all(torch.equal(a, b) for a, b in zip(default.history, fixed.history))


@functools.cache
def _bundled(family):
    return dllm.load(f"tiny-{family}", device="cpu", dtype=torch.float32)


# prompts of four bundled tasks: on the bundled (trained) models their rows finish at different steps (EOS early
# stop), which the tiny random models' rows do not
MIXED = [e.prompt for task in ("arith", "pick", "shuffle", "listops") for e in tasks.get(task).examples("test", 1)]
BUNDLED = ("llada", "dream", "sdar")  # the families with a bundled (trained) model; LLaDA2's tiny random one below
CELLS = [(f, s, c, {}) for f, s, c in MATRIX if refused(s, c, f) is None and f in BUNDLED]
# exit rules that exit, look-aheads that adapt
CELLS += [(f, s, c, CONFIGURED[s]) for f, s, c in CONFIGURED_MATRIX if f in BUNDLED]
# Fast-dLLM v2 (bundled; SDAR's block-causal forward with Dream's shifted read-out): its own sampler and three others
# over its block caches and the dual cache (every sampler and cache runs on SDAR above)
CELLS += [
    ("fast_dllm_v2", s, c, {})
    for s in ("fast_dllm_v2", "threshold", "llada", "sdar")
    for c in ("block", "subblock", "dual")
    if refused(s, c, "fast_dllm_v2") is None
]


@pytest.mark.parametrize("family,name,cache,settings", CELLS)
def test_static_shapes_give_the_default_output(family, name, cache, settings):
    """Every sampler x cache x family of the cache matrix (and its exit rules configured to exit) on the bundled
    model of the family, rows finishing at different steps: the same tokens, forwards and history."""
    model, sampler = _bundled(family), dllm.samplers.get(name, **settings)
    kw = {**_lengths(sampler, model), "max_new_tokens": 32, "eos_early_stop": True, "history": True}
    default = sampler.generate(model, MIXED, cache=_cache(cache), **kw)
    _same(default, sampler.generate(model, MIXED, cache=_cache(cache), static_shapes=True, **kw))


def _sampled_cells():
    """Every sampler on every family that runs it, sampling, with one of the caches it runs with (in turn, so that
    every cache appears) and its configured settings where it has them (exit rules that exit)."""
    cells = []
    for family in BUNDLED:
        for i, name in enumerate(dllm.samplers.names()):
            caches = [c for c in dllm.caches.names() if refused(name, c, family) is None]
            if caches:
                cells.append((family, name, caches[i % len(caches)], CONFIGURED.get(name, {})))
    return cells


@pytest.mark.parametrize("family,name,cache,settings", _sampled_cells())
def test_static_shapes_give_the_default_output_of_every_sampler_when_sampling(family, name, cache, settings):
    """At temperature > 0 with a seed, on the bundled model of the family, rows finishing at different steps (a
    sampler then reads the states of the working rows among rows kept in place: S2D2's residual resample): the
    same tokens, forwards and history as the default path."""
    model, sampler = _bundled(family), dllm.samplers.get(name, **settings)
    kw = {**_lengths(sampler, model), "max_new_tokens": 32, "eos_early_stop": True, "history": True}
    kw.update(temperature=1.0, seed=0)
    default = sampler.generate(model, MIXED, cache=_cache(cache), **kw)
    _same(default, sampler.generate(model, MIXED, cache=_cache(cache), static_shapes=True, **kw))


SAMPLED = [
    (f, s, c)
    for f in ("llada", "dream", "sdar")
    for s in ("llada", "threshold")
    for c in ("prefix", "dual", "dkv", "window", "elastic", "block")
    if refused(s, c, f) is None
]
# LLaDA2 (no bundled model): its own decoders and the threshold sampler on its tiny random model, greedy and sampled
SAMPLED += [("llada2", s, c) for s in ("llada2", "llada21", "threshold") for c in ("block", "none", "dual")]
SAMPLED = [(f, s, c) for f, s, c in SAMPLED if refused(s, c, f) is None]


@pytest.mark.parametrize("family,name,cache", SAMPLED)
def test_static_shapes_give_the_default_output_when_sampling(family, name, cache, tiny):
    model, sampler = tiny(family), _sampler(name)
    settings = [{"temperature": 1.0, "seed": 3}] + ([{"history": True}] if family not in BUNDLED else [])
    for kw in settings:
        _same(
            _generate(sampler, model, PROMPTS, cache, **kw),
            _generate(sampler, model, PROMPTS, cache, static_shapes=True, **kw),
        )


def _record(sampler, model, prompts, cache, **kw):
    """Runs a generation; returns it and, per forward, ((the phase: each row's block start and the working rows;
    whether the plan is a refresh; None on the device step, which has no phases), (the tokens, positions and
    queries shapes))."""
    run = sampler.prepare(model, prompts, cache=cache, **kw)
    phases, forwards = [], []
    phase = static.Shapes.forward

    def forward_of_phase(self, step, plan, mask):
        phases.append((tuple(step.start.tolist()), tuple(step.active.tolist()), plan.refresh))
        return phase(self, step, plan, mask)

    def record(tokens, positions, options):
        queries = options.get("queries")
        shapes = (tuple(tokens.shape), tuple(positions.shape), None if queries is None else tuple(queries.shape))
        forwards.append((phases[-1] if run.static_shapes and not run.device_step else None, shapes))

    original = run.hidden  # every counted forward's body, the device step's too

    def hidden(tokens, positions, **options):
        record(tokens, positions, options)
        return original(tokens, positions, **options)

    run.hidden = hidden
    static.Shapes.forward = forward_of_phase
    try:
        with torch.inference_mode():
            sampler.run(run)
    finally:
        static.Shapes.forward = phase
    return sampler.finish(run), forwards


EARLY = [("llada", c) for c in ("prefix", "dual", "dkv", "window", "elastic")]
EARLY += [("dream", c) for c in ("prefix", "dual", "dkv", "window", "elastic")] + [("sdar", "block")]


@pytest.mark.parametrize("family,cache", EARLY)
@pytest.mark.parametrize("name", ["llada", "threshold"])
def test_a_batch_keeps_its_rows_and_a_phase_its_shapes(family, cache, name):
    """On a bundled (trained) model, prompts of four tasks finish at different steps (EOS early stop): by default
    finished rows leave the batch; with static shapes every forward has the whole batch, the output is the
    same, and within one block of one set of working rows every cached forward that is not a refresh (a block's
    first forward: bucketed on its own) has the same shapes (for the
    caches whose query set does not grow within a block; Window-Diffusion's and Elastic-Cache's step through a
    few bucketed widths)."""
    model, sampler = _bundled(family), _sampler(name)
    prompts = MIXED
    kw = {"max_new_tokens": 32, "block_size": None if family == "sdar" else 8}
    default, plain = _record(sampler, model, prompts, _cache(cache), **kw)
    fixed, forwards = _record(sampler, model, prompts, _cache(cache), static_shapes=True, **kw)
    _same(default, fixed)
    assert min(shapes[0][0] for _, shapes in plain) < len(prompts), "a row finished early (by default it leaves)"
    assert {shapes[0][0] for _, shapes in forwards} == {len(prompts)}, "every forward keeps every row"
    length = fixed.sequences.shape[1]
    widths = {shapes[2][1] for _, shapes in forwards if shapes[2] is not None}
    assert widths <= {static.bucket(w, length) for w in range(1, length + 1)}
    assert fixed.step_on_device == (cache in ("prefix", "dual", "block")), fixed.why_not_on_device
    if fixed.step_on_device:  # the width each step's status asks for: one per kind of forward in a block
        blocks = length // kw["block_size"] if kw["block_size"] else length // model.block_size
        assert len({shapes for _, shapes in forwards}) <= blocks + 1, forwards
        return
    by_phase = {}
    for (*phase, refresh), shapes in forwards:
        if shapes[2] is not None and not refresh:  # a cached forward (a refresh is a forward kind of its own)
            by_phase.setdefault(tuple(phase), set()).add(shapes)
    assert any(len(phase[1]) < len(prompts) for phase in by_phase), "cached forwards after a row finished"
    if cache not in ("window", "elastic"):
        assert all(len(shapes) == 1 for shapes in by_phase.values()), by_phase


@pytest.mark.parametrize("family,cache", [("llada", "dual"), ("sdar", "block")])
def test_rows_of_their_own_settings_step_on_the_device_as_alone(family, cache):
    """issue 44: rows of their own ``max_new_tokens`` and temperatures with static shapes (the step on the device,
    each row's span ending at its own column, each row scored at its own temperature): each row's tokens and text
    are those it gets alone by default."""
    model, sampler = _bundled(family), _sampler("threshold")
    kw = {"block_size": None if family == "sdar" else 8, "cache": _cache(cache), "seed": 3}
    lengths, temperatures = [32, 8, 24, 16], [1.0, 0.0, 2.0, 0.0]
    fixed = sampler.generate(model, MIXED, max_new_tokens=lengths, temperature=temperatures, static_shapes=True, **kw)
    assert fixed.step_on_device, fixed.why_not_on_device
    for row, (prompt, length, t) in enumerate(zip(MIXED, lengths, temperatures)):
        alone = sampler.generate(model, [prompt], max_new_tokens=length, temperature=t, **kw)
        generated = alone.sequences[0, alone.prompt_width :]
        assert torch.equal(fixed.sequences[row, fixed.prompt_width :][: generated.shape[0]], generated)
        assert (fixed.texts[row], fixed.tokens[row]) == (alone.texts[0], alone.tokens[0])


@pytest.mark.parametrize("options", [{"cache_ver": True}, {"draft_ver": True}])
def test_a_samplers_own_attention_mask_follows_the_static_rows(options):
    """S2D2's token-causal masks (``Sampler.forward_mask``) are padded like the queries, and a done row's padding
    queries attend only to themselves: the same output as by default, rows finishing early."""
    model, sampler = _bundled("sdar"), dllm.samplers.get("s2d2", **options)
    prompts = MIXED
    default, plain = _record(sampler, model, prompts, _cache("block"), max_new_tokens=32)
    _same(default, _record(sampler, model, prompts, _cache("block"), max_new_tokens=32, static_shapes=True)[0])
    assert min(shapes[0][0] for _, shapes in plain) < len(prompts)


def test_bucket_is_the_next_power_of_two_capped_at_the_canvas():
    assert [static.bucket(w, 40) for w in (1, 2, 3, 5, 8, 9, 17, 33, 40)] == [1, 2, 4, 8, 8, 16, 32, 40, 40]


def test_static_shapes_is_a_flag_and_needs_the_masked_process(tiny):
    with pytest.raises(dllm.ConfigError, match="static_shapes must be True or False"):
        dllm.samplers.get("threshold").generate(tiny("llada"), PROMPTS, max_new_tokens=8, static_shapes="yes")
    for name, family in (("wedlm", "wedlm"), ("entropy_bound", "diffusion_gemma")):
        process = dllm.samplers.get(name).process
        with pytest.raises(dllm.ConfigError, match=f"applies to the masked decoding process.*'{name}' sampler runs the "
                                                   f"'{process}' process"):  # fmt: skip
            dllm.samplers.get(name).prepare(tiny(family), PROMPTS, max_new_tokens=8, static_shapes=True)
