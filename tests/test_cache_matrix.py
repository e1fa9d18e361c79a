"""Every sampler of the registry x every cache of the registry x LLaDA and Dream.

Each combination either refuses clearly when it is prepared (a ConfigError: see ``refused``) or
- runs: every slot filled, the prompt untouched, committed tokens never change, commits only into masked slots;
- is batch invariant: each prompt alone gives its row of a left-padded batch of mixed lengths (greedy);
- with the cache's refresh forced at every step (``Cache.every_step()``) gives exactly the no-cache output
  and the same number of forwards.
New samplers and caches join the matrix by registering; the composed parts of the registry (exit rules,
transforms) run over their default base, and the conftest exit rule ``exit_at`` over ``threshold`` checks
that a row finished by an exit rule under a cache is filled from a forward that computed its span.
"""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError

FAMILIES = ["llada", "dream"]
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
KW = {"max_new_tokens": 16, "block_size": 8, "eos_early_stop": False}


def refused(name: str, cache: str, family: str) -> str | None:
    """Why a combination does not make sense (the documented refusals), or None."""
    if cache == "block":
        return "the exact block cache needs a block-causal model (SDAR)"
    if name == "sdar":
        return "the sdar sampler needs a block-causal model"
    return None


# Hyper-parameters that make a cache actually reuse K/V in these short runs (dKV's official default,
# cache_reloading_step=1, refreshes at every step).
CACHING = {"dkv": {"cache_reloading_step": 4}}


def _cache(name):
    return dllm.caches.get(name, **CACHING.get(name, {}))


def _sampler(name):
    return dllm.samplers.get(name)


def _lengths(sampler):
    return KW if sampler.default_block is not None else {**KW, "block_size": None}


def _generate(sampler, model, prompts, cache, **extra):
    cache = _cache(cache) if isinstance(cache, str) else cache
    return sampler.generate(model, prompts, cache=cache, **_lengths(sampler), **extra)


MATRIX = [(f, s, c) for f in FAMILIES for s in dllm.samplers.names() for c in dllm.caches.names()]


@pytest.mark.parametrize("family,name,cache", MATRIX)
def test_every_sampler_with_every_cache(family, name, cache, tiny):
    model = tiny(family)
    sampler = _sampler(name)
    why = refused(name, cache, family)
    try:
        sampler.prepare(model, PROMPTS, cache=cache, **_lengths(sampler))
    except ConfigError as error:
        # a refusal must be documented here, or say what the sampler cannot use (the cache or the model)
        assert why is not None or "cache" in str(error) or model.attention in str(error), str(error)
        return
    assert why is None, f"expected a refusal: {why}"

    # runs and respects the loop's guarantees
    out = _generate(sampler, model, PROMPTS, cache, history=True)
    assert not bool((out.sequences == model.mask_id).any())
    previous = None
    for now in out.history:
        if previous is not None:
            written = previous != model.mask_id
            assert torch.equal(now[written], previous[written]), "committed tokens never change"
        previous = now
    p = out.prompt_width
    plain = _generate(sampler, model, PROMPTS, None)
    assert torch.equal(out.sequences[:, :p], plain.sequences[:, :p])

    # batch invariance (greedy)
    for r, prompt in enumerate(PROMPTS):
        alone = _generate(sampler, model, [prompt], cache)
        generated = alone.sequences[0, len(prompt) :]
        assert torch.equal(out.sequences[r, p : p + generated.shape[0]], generated), f"row {r} alone"

    # refresh forced at every step: exactly no cache
    exact = _generate(sampler, model, PROMPTS, dllm.caches.CACHES[cache].every_step())
    assert torch.equal(exact.sequences, plain.sequences)
    assert exact.nfe == plain.nfe


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["prefix", "dual", "dkv"])
def test_sampled_generation_is_batch_invariant_with_a_cache(family, cache, tiny):
    """At temperature > 0 with a seed, a prompt alone equals row 0 of a mixed-length batch (row r draws from
    the stream of (seed, r)); each prompt is row 0 of one of the two batch orders."""
    model = tiny(family)
    for name in ("llada", "threshold"):
        sampler = _sampler(name)
        for prompts in (PROMPTS, PROMPTS[::-1]):
            batch = _generate(sampler, model, prompts, cache, temperature=1.0, seed=5)
            alone = _generate(sampler, model, prompts[:1], cache, temperature=1.0, seed=5)
            generated = alone.sequences[0, len(prompts[0]) :]
            assert torch.equal(batch.sequences[0, batch.prompt_width :], generated), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["prefix", "dual", "dkv"])
def test_an_exit_rule_finishes_rows_under_a_cache(family, cache, tiny, exit_at):
    """A row finished by an exit rule is filled from this step's forward: the cache computes the masked span
    whenever exit rules may finish rows, so finishing at step 2 gives exactly what the no-cache run's
    step-2 forward proposes when the cache refreshes every step, and a complete canvas otherwise."""
    model = tiny(family)
    sampler = dllm.samplers.get("exit_at", at=2, base="threshold")
    plain = _generate(sampler, model, PROMPTS, None)
    cached = _generate(sampler, model, PROMPTS, cache)
    exact = _generate(sampler, model, PROMPTS, dllm.caches.CACHES[cache].every_step())
    assert torch.equal(exact.sequences, plain.sequences) and exact.nfe == plain.nfe == 3
    assert cached.nfe == 3 and not bool((cached.sequences == model.mask_id).any())


def test_the_matrix_covers_the_built_in_samplers_and_caches():
    assert {"llada", "threshold", "factor", "dream"} <= set(dllm.samplers.names())
    assert {"prefix", "dual", "dkv"} <= set(dllm.caches.names())
    assert len(MATRIX) >= 2 * 5 * 4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["prefix", "dual", "dkv"])
def test_cached_forwards_compute_fewer_columns_in_one_preallocated_store(family, cache, tiny):
    """Most forwards are not refreshes and compute a subset of the columns; the K/V store's buffers are
    allocated once per run (the same storage at every step, also after rows leave the batch)."""
    model = tiny(family)
    sampler = _sampler("threshold")
    prompts = PROMPTS + [[40, 41]]
    run = sampler.prepare(model, prompts, cache=_cache(cache), max_new_tokens=24, block_size=8, eos_early_stop=True)
    computed, pointers = [], set()
    original = run.forward

    def forward(*args, **options):
        queries = options.get("queries")
        computed.append(run.canvas.length if queries is None else queries.shape[1])
        hidden = original(*args, **options)
        pointers.add(run.cache.kv.k[0].untyped_storage().data_ptr())
        return hidden

    run.forward = forward
    with torch.inference_mode():
        sampler.run(run)
    assert not bool((run.canvas.tokens == model.mask_id).any())
    assert 0 < run.refreshes < run.nfe
    assert min(computed) < run.canvas.length
    assert len(pointers) == 1


@pytest.mark.parametrize("cache", ["prefix", "dual", "dkv"])
def test_refresh_prompt_computes_the_prompt_at_every_forward(cache, tiny):
    model = tiny("llada")
    sampler = _sampler("threshold")
    run = sampler.prepare(
        model, PROMPTS, cache=dllm.caches.get(cache, refresh_prompt=True, **CACHING.get(cache, {})), **KW
    )
    prompt_computed = []
    original = run.forward

    def forward(*args, **options):
        queries = options.get("queries")
        columns = set(range(run.canvas.length)) if queries is None else set(queries[0].tolist())
        prompt_computed.append(set(range(run.canvas.prompt_width)) <= columns)
        return original(*args, **options)

    run.forward = forward
    with torch.inference_mode():
        sampler.run(run)
    assert all(prompt_computed) and run.refreshes < run.nfe


def test_refresh_prompt_restores_the_bundled_models_accuracy_under_the_dual_cache():
    """On tiny-llada's copying task the dual cache's stale prompt K/V cost most answers (the prompt's states
    read the answer written so far); recomputing the prompt at every forward brings them back."""
    from dllm.bench import tasks

    model = dllm.load("tiny-llada", device="cpu", dtype=torch.float32)
    task = tasks.get("pick")
    examples = task.examples("test", 16)
    sampler = _sampler("threshold")

    def correct(cache):
        out = sampler.generate(model, [e.prompt for e in examples], cache=cache, block_size=8)
        return sum(task.score(e, text) for e, text in zip(examples, out.texts))

    plain, dual = correct(None), correct("dual")
    assert dual < plain - 4
    assert correct(dllm.caches.get("dual", refresh_prompt=True)) >= plain - 1
