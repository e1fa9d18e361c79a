"""Every sampler of the registry x every cache of the registry x LLaDA, Dream, SDAR, LLaDA2 and Fast-dLLM v2.

Each combination either is refused when it is prepared with the reason :func:`refused` lists for it (a
``ConfigError``; any other refusal, or none where one is listed, fails) or
- runs: every slot filled, the prompt untouched, committed tokens never change (the edit process's samplers:
  never outside the block being decoded; tests/test_llada21.py), commits only into masked slots;
- is batch invariant: each prompt alone gives its row of a left-padded batch of mixed lengths (greedy), also
  where the rows have their own ``max_new_tokens`` and temperatures (a sampler that reads either as one number
  refuses that by name);
- with the cache's refresh forced at every step (``Cache.every_step()``) gives exactly the no-cache output
  and the same number of forwards.
``dllm bench`` asks the same question without a prompt (``Sampler.check_cache``): it skips exactly the
refused combinations. New samplers and caches join the matrix by registering; the composed parts of the
registry (exit rules, transforms) run over their default base, and the conftest exit rule ``exit_at`` over
``threshold`` checks that a row finished by an exit rule under a cache is filled from a forward that computed
its span. The exit rules and look-ahead samplers also run configured so that they exit / adapt under a cache.
"""

from __future__ import annotations

import re

import pytest
import torch

import dllm
from dllm.bench import runner
from dllm.core.errors import ConfigError

FAMILIES = ["llada", "dream", "sdar", "llada2", "fast_dllm_v2"]
BLOCK_CAUSAL = ("sdar", "llada2", "fast_dllm_v2")
FULL = ["llada", "dream"]  # full attention: the approximate caches' own tests
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
KW = {"max_new_tokens": 16, "block_size": 8, "eos_early_stop": False}
READS_OUTSIDE = ("prophet", "sched", "adablock", "ete")  # read (or commit) columns outside the cache's window


def refused(name: str, cache: str, family: str) -> str | None:
    """The reason (a fragment of its ConfigError) a combination that makes no sense is refused with; None: it
    runs."""
    block_model = family in BLOCK_CAUSAL
    if name == "wedlm":
        return "decodes causal-attention models"  # WeDLM's streaming rule; no family here is causal
    if name == "entropy_bound":
        return "decodes encoder_decoder-attention models"  # DiffusionGemma's; no family here is one
    if name in ("llada2", "llada21") and family != "llada2":
        return "is LLaDA2's own decoder"
    if name == "llada21" and cache != "block":
        return "rewrites decoded tokens of the current block"  # the other caches assume decoded tokens never change
    if name in ("sdar", "s2d2", "fast_dllm_v2") and not block_model:
        return "needs a block-causal model"
    if name == "freedave":
        return "drafts whole canvases, without a K/V cache"  # its batch_expanding drafts would copy the store
    if cache == "block" and not block_model:
        return "exact only on block-causal models"  # the block cache's exactness needs block-causal attention
    if block_model and name == "adablock":
        return "trained with a fixed block_size"  # adaptive blocks would change SDAR's attention pattern
    if block_model and name == "ete":
        return "would commit into later blocks"  # its default look-ahead; SDAR decodes blocks in order
    if name == "s2d2" and cache not in ("block", "subblock"):
        return "runs with the block K/V cache"  # its verifier reads and extends the exact block store (finished blocks)
    if cache == "stream":
        return "holds the committed prefix of the 'wedlm' sampler"  # it is that sampler's own loop's cache
    if name in ("learn2pd", "eotp") and cache not in ("prefix", "dual", "block"):  # (eotp: over learn2pd)
        return "reads every slot of the block"  # its filter reads decoded slots the other caches do not compute
    if cache in ("window", "elastic") and name in READS_OUTSIDE:
        return f"which the {cache!r} cache does not compute"  # it computes / commits only its own window
    if cache == "subblock" and not block_model:
        return "serves block-causal models"  # Fast-dLLM v2's: the block's finished prefix is exact
    return None


# Hyper-parameters that make a cache actually reuse K/V in these short runs (dKV's official default,
# cache_reloading_step=1, refreshes at every step).
CACHING = {"dkv": {"cache_reloading_step": 4}}


def _cache(name):
    return dllm.caches.get(name, **CACHING.get(name, {}))


def _sampler(name):
    return dllm.samplers.get(name)


def _lengths(sampler, model=None):
    if (model is not None and model.attention == "block") or sampler.default_block is None:
        return {**KW, "block_size": None}  # SDAR keeps its trained block size
    return KW


def _generate(sampler, model, prompts, cache, **extra):
    cache = _cache(cache) if isinstance(cache, str) else cache
    return sampler.generate(model, prompts, cache=cache, **{**_lengths(sampler, model), **extra})


MATRIX = [(f, s, c) for f in FAMILIES for s in dllm.samplers.names() for c in dllm.caches.names()]


def _check_runs(sampler, model, cache):
    """Runs and respects the loop's guarantees, is batch invariant and exact when refreshed at every step."""
    out = _generate(sampler, model, PROMPTS, cache, history=True)
    assert not bool((out.sequences == model.mask_id).any())
    kept = torch.ones_like(out.sequences, dtype=torch.bool)
    if any(type(rule).cut is not dllm.samplers.ExitRule.cut for rule in sampler.exit_rules):
        # an exit rule that cuts rows (EoTP): the slots past a row's cut leave its text, which ends at its first EOS
        p = out.prompt_width
        eos = torch.isin(out.sequences, torch.tensor(model.eos_ids)) & (torch.arange(out.sequences.shape[1]) >= p)
        kept = eos.long().cumsum(1) == 0
    previous = None
    for now in out.history:
        if previous is not None and sampler.process != "edit":
            written = (previous != model.mask_id) & kept
            assert torch.equal(now[written], previous[written]), "committed tokens never change"
        previous = now
    p = out.prompt_width
    plain = _generate(sampler, model, PROMPTS, None)
    assert torch.equal(out.sequences[:, :p], plain.sequences[:, :p])

    # batch invariance (greedy), and rows of their own lengths (the second's shorter) and temperatures (the second
    # sampled, where the sampler takes one per row) each as alone with its length and temperature
    own = {"max_new_tokens": [16, 8], "seed": 4}
    sampled = sampler.takes_temperature and sampler.per_row_temperatures and sampler.process in ("masked", "edit")
    own |= {"temperature": [0.0, 1.5]} if sampled else {}
    try:
        mixed = _generate(sampler, model, PROMPTS, cache, **own)
    except ConfigError as e:  # its rule reads the length, or its blocks are the whole span (Dream's default)
        assert not sampler.per_row_lengths or "share a run when their blocks and steps per block agree" in str(e)
        mixed = None
    for r, prompt in enumerate(PROMPTS):
        alone = _generate(sampler, model, [prompt], cache)
        generated = alone.sequences[0, len(prompt) :]
        assert torch.equal(out.sequences[r, p : p + generated.shape[0]], generated), f"row {r} alone"
        if mixed is not None:
            second = {"max_new_tokens": 8, "seed": 4, "temperature": 1.5 if sampled else 0.0}
            alone = _generate(sampler, model, [prompt], cache, **second) if r else alone
            generated = alone.sequences[0, len(prompt) :]
            assert torch.equal(mixed.sequences[r, p : p + generated.shape[0]], generated), f"row {r}, its own"

    # refresh forced at every step: exactly no cache
    exact = _generate(sampler, model, PROMPTS, dllm.caches.CACHES.get(cache).every_step())
    assert torch.equal(exact.sequences, plain.sequences)
    assert exact.nfe == plain.nfe
    return out, plain


@pytest.mark.parametrize("family,name,cache", MATRIX)
def test_every_sampler_with_every_cache(family, name, cache, tiny):
    model = tiny(family)
    sampler = _sampler(name)
    why = refused(name, cache, family)
    if why is not None:
        with pytest.raises(ConfigError, match=re.escape(why)):
            sampler.prepare(model, PROMPTS, cache=_cache(cache), **_lengths(sampler, model))
        return
    sampler.prepare(model, PROMPTS, cache=_cache(cache), **_lengths(sampler, model))  # no refusal
    _check_runs(sampler, model, cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_bench_skips_exactly_the_refused_combinations(family, tiny):
    """``dllm bench`` decides from (sampler, model, cache) alone, before it loads a model: its skips are the
    refusals of ``prepare``, with the same reasons."""
    model = tiny(family)
    for name in dllm.samplers.names():
        sampler = _sampler(name)
        for cache in dllm.caches.names():
            why = refused(name, cache, family)
            try:
                sampler.check_drives(model)
                skip = runner.refusal(model, sampler, cache, CACHING.get(cache, {}))
            except ConfigError as error:
                skip = str(error)
            assert (skip is None) == (why is None), (name, cache, skip)
            assert why is None or why in skip, (name, cache, skip)


# Exit rules that exit and a look-ahead that adapts in these short runs; sched's margins over every column of
# its region (average_over_masked=False) read decoded columns too.
CONFIGURED = {
    "prophet": {"answer_offset": 2, "early_exit_thresholds": {"early": 3.0, "mid": 1.0, "late": 0.0}},
    "sched": {"average_over_masked": False, "answer_region": "tail", "tau_high": 2.0, "tau_low": 0.5},
    "adablock": {"delimiter_ids": list(range(60)), "delimiter_threshold": 0.0},
    "ete": {"lookahead_blocks": 1, "explore_k": 1},
}
CONFIGURED_MATRIX = [
    (f, s, c)
    for f in FAMILIES
    for s in CONFIGURED
    for c in ("prefix", "dual", "dkv", "block")
    if refused(s, c, f) is None
]


@pytest.mark.parametrize("family,name,cache", CONFIGURED_MATRIX)
def test_exit_rules_and_look_ahead_samplers_under_a_cache(family, name, cache, tiny):
    """Prophet, SchED, AdaBlock and ETE configured to exit / adapt: they run under the cache (their columns
    outside the block are computed at every forward), exactly as without a cache when it refreshes every step;
    Prophet exits before its schedule ends."""
    model = tiny(family)
    sampler = dllm.samplers.get(name, **CONFIGURED[name])
    run = sampler.prepare(model, PROMPTS, cache=_cache(cache), **_lengths(sampler, model))
    queries = []
    original = run.forward

    def forward(*args, **options):
        queries.append(options.get("queries"))
        return original(*args, **options)

    run.forward = forward
    with torch.inference_mode():
        sampler.run(run)
    assert not bool((run.canvas.tokens == model.mask_id).any())
    assert any(q is not None for q in queries), "the cache computed a subset of the columns"
    if name == "prophet":  # the answer region (and, for Dream, the column before it) at every forward
        start = run.canvas.prompt_width + CONFIGURED["prophet"]["answer_offset"] - model.shift
        region = set(range(start, start + 5))
        assert all(q is None or all(region <= set(row) for row in q.tolist()) for q in queries)
    out, plain = _check_runs(sampler, model, cache)
    if name == "prophet":  # it exits: fewer forwards than without an answer region (never exits)
        never = _generate(_sampler(name), model, PROMPTS, cache)
        assert plain.nfe < never.nfe and out.nfe < never.nfe


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
    exact = _generate(sampler, model, PROMPTS, dllm.caches.CACHES.get(cache).every_step())
    assert torch.equal(exact.sequences, plain.sequences) and exact.nfe == plain.nfe == 3
    assert cached.nfe == 3 and not bool((cached.sequences == model.mask_id).any())


def test_the_matrix_covers_the_built_in_samplers_and_caches():
    assert {"llada", "threshold", "factor", "dream", "sdar", "prophet", "sched", "adablock", "ete"} <= set(
        dllm.samplers.names()
    )
    assert {"prefix", "dual", "dkv", "block"} <= set(dllm.caches.names())
    assert len(MATRIX) >= 3 * 9 * 4
    assert len(CONFIGURED_MATRIX) >= 3 * 2 * 3 + 2 * 2 * 3


@pytest.mark.parametrize("family", FULL)
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
        pointers.add(run.cache_state.kv.k[0].untyped_storage().data_ptr())
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
    from dllm import tasks

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


class _BlockOnly(dllm.caches.Cache):
    """A cache that ignores ``needed``: a full forward first, then only each row's block window."""

    name = "block_only"

    def start(self, run):
        state = super().start(run)
        state.started = False
        return state

    def plan(self, step, state):
        if not state.started:
            state.started = True
            return dllm.caches.Plan(refresh=True)
        return dllm.caches.Plan(queries=step.of_active(step.window(step.canvas.block_size)))


def test_a_cache_that_misses_the_columns_an_exit_rule_reads_is_an_error(tiny):
    """Prophet's answer region (here in the second block) is read at every step: a cache that claims
    ``computes_needed`` but does not compute it gets a ModelError, not a gap of placeholders that never exits."""
    model = tiny("llada")
    sampler = dllm.samplers.get("prophet", answer_offset=10)
    with pytest.raises(dllm.DllmError, match="computes_needed = False"):
        sampler.generate(model, PROMPTS, cache=_BlockOnly(), **KW)
