"""S2D2 beyond the official batch-1 code: reduction to ``sdar``, ragged batches (each prompt alone equals its
row in a left-padded batch, greedy and sampled), forward accounting, the verifier's attention pattern, and
hyper-parameter errors. Parity with the official code: tests/test_parity_s2d2.py."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.caches.base import Cache, Plan
from dllm.caches.block import BlockCausal
from dllm.core.errors import ConfigError
from dllm.samplers import s2d2

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [30, 31, 32, 33, 34]]
SETTINGS = {
    "default": {},
    "paperA": {
        "cache_ver": True,
        "draft_ver": True,
        "do_verify_policy": "score_threshold",
        "do_verify_score_threshold": 0.0,
        "do_verify_score_type": "difference_static",
        "score_penalty_coef": 1.0,
        "token_acceptance_estimator": "soft_entropy_negexp",
    },
    "draft_ver": {"draft_ver": True},
    "hysteresis": {"do_verify_policy": "score_hysteresis", "hysteresis_threshold_on": 1.0, "score_penalty_coef": 1.0},
    "ucb": {"do_verify_policy": "contextual_bandit_ucb", "ucb_entropy_source": "masked"},
    "ratio_all": {"ssd_ratio_threshold": 0.5, "ssd_threshold_all_spans": True, "always_check_high_confidence": True},
    "static": {"remasking_strategy": "low_confidence_static", "min_ssd_span_length": 2, "allow_resample": False},
}


@pytest.fixture(scope="module")
def trained():
    return dllm.load("tiny-sdar", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def bs8(tiny):
    """Block 8: spans long enough for rows to accept very different numbers of drafts."""
    return tiny("sdar", seed=1, std=1.0, block_size=8)


def _run(model, name_or_sampler, prompts, **kw):
    sampler = dllm.samplers.get(name_or_sampler) if isinstance(name_or_sampler, str) else name_or_sampler
    kw.setdefault("max_new_tokens", 2 * model.block_size + 3)
    return sampler.generate(model, prompts, eos_early_stop=False, **kw)


def _same(batch, r, prompt, alone):
    """Row ``r`` of ``batch`` (left-padded, maybe longer spans after it) equals the generation ``alone``."""
    row = batch.sequences[r, batch.prompt_width - len(prompt) :].tolist()
    mine = alone.sequences[0].tolist()
    return row[: len(mine)] == mine and all(t == 0 for t in row[len(mine) :])


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_prompt_alone_equals_its_row_in_a_ragged_batch(bs8, setting):
    sampler = dllm.samplers.get("s2d2", **SETTINGS[setting])
    commits = []
    batch = _run(bs8, sampler, PROMPTS, callback=lambda info: commits.append(info.committed.sum(1).tolist()))
    for r, prompt in enumerate(PROMPTS):
        alone = _run(bs8, sampler, [prompt])
        assert _same(batch, r, prompt, alone), f"row {r}"
    if setting == "default":  # rows accepted different numbers of drafts in the same step
        assert any(len(set(c)) > 1 for c in commits)


@pytest.mark.parametrize("setting", ["default", "paperA", "ratio_all"])
def test_sampled_row_does_not_depend_on_its_batch(bs8, setting):
    """At temperature > 0 drafts, acceptance coins and residual resamples come from per-row streams: row 0
    of a padded batch equals the prompt alone (same seed); runs repeat; another seed differs."""
    sampler = dllm.samplers.get("s2d2", **SETTINGS[setting])
    kw = {"temperature": 1.0, "seed": 5}
    batch = _run(bs8, sampler, PROMPTS, **kw)
    alone = _run(bs8, sampler, [PROMPTS[0]], **kw)
    assert _same(batch, 0, PROMPTS[0], alone)
    assert torch.equal(_run(bs8, sampler, PROMPTS, **kw).sequences, batch.sequences)
    assert not torch.equal(_run(bs8, sampler, PROMPTS, temperature=1.0, seed=6).sequences, batch.sequences)


def test_sampled_verifier_rejects_and_resamples(bs8, monkeypatch):
    """At temperature > 0 the verifier both accepts drafts and rejects some (then resampling from the
    residual), so the coins and the resample stream are exercised."""
    seen = []
    original = s2d2.S2D2._resample

    def resample(self, step, rows, *args):
        seen.append(rows.numel())
        return original(self, step, rows, *args)

    monkeypatch.setattr(s2d2.S2D2, "_resample", resample)
    commits = []
    sampler = dllm.samplers.get("s2d2")
    _run(bs8, sampler, PROMPTS, temperature=1.0, seed=3, callback=lambda info: commits.append(info.committed))
    assert sum(seen) > 0
    assert max(int(c.sum(1).max()) for c in commits) > 1  # some drafts accepted


@pytest.mark.parametrize("family_model", ["random", "tiny-sdar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "hp", [{}, {"remasking_strategy": "low_confidence_static"}, {"remasking_strategy": "sequential"}]
)
def test_speculation_off_equals_sdar(tiny, trained, family_model, temperature, hp):
    """With the verifier never routed to (a minimum span longer than the block), s2d2 is sdar: same tokens
    and forwards, batched, greedy and sampled."""
    model = tiny("sdar") if family_model == "random" else trained
    off = dllm.samplers.get("s2d2", min_ssd_span_length=model.block_size + 1, **hp)
    for spb in (model.block_size, 2):
        kw = {"temperature": temperature, "seed": 1, "steps_per_block": spb}
        a = _run(model, off, PROMPTS, **kw)
        b = _run(model, dllm.samplers.get("sdar", **hp), PROMPTS, **kw)
        assert torch.equal(a.sequences, b.sequences) and a.nfe == b.nfe


@pytest.mark.parametrize("setting", ["default", "paperA", "draft_ver", "ucb"])
def test_cache_none_equals_block_cache_batched(bs8, setting):
    sampler = dllm.samplers.get("s2d2", **SETTINGS[setting])
    a = _run(bs8, sampler, PROMPTS)
    b = _run(bs8, sampler, PROMPTS, cache=None)
    assert torch.equal(a.sequences, b.sequences) and a.nfe == b.nfe


def test_nfe_counts_drafting_and_verifier_forwards(tiny):
    """Batch 1, default policy: every drafting step is followed by one verifier forward."""
    model = tiny("sdar")
    steps = []
    out = _run(model, dllm.samplers.get("s2d2"), [PROMPTS[0]], callback=lambda info: steps.append(info.nfe))
    assert out.nfe == 2 * len(steps)
    assert steps == [2 * (i + 1) for i in range(len(steps))]  # each step: its draft and its verifier


@pytest.mark.parametrize("setting", ["paperA", "hysteresis", "ucb"])
def test_each_row_of_a_batch_counts_the_verifier_forwards_that_serve_it(trained, setting):
    """A routing policy verifies some rows of a step and not others: each row's own forwards (``Decoding.row_nfe``,
    the server's ``usage.nfe``) are its drafting forwards and the verifier forwards of the steps it verified, as
    alone; the batch's count is the union."""
    from dllm.engine.session import decode
    from dllm.tasks import get as task

    sampler = dllm.samplers.get("s2d2", **SETTINGS[setting])
    prompts = [e.prompt for e in task("arith").examples("test", 3)]
    kw = dict(max_new_tokens=[16, 24, 32], temperature=1.0, seed=[1, 2, 3])
    run = sampler.prepare(trained, prompts, **kw)
    with torch.inference_mode():
        row_nfe = decode(run, sampler, count_rows=True).tolist()
    alone = [
        sampler.generate(trained, [p], max_new_tokens=n, temperature=1.0, seed=seed).nfe
        for p, n, seed in zip(prompts, [16, 24, 32], [1, 2, 3])
    ]
    assert row_nfe == alone and run.nfe >= max(alone)


def test_verifier_mask_is_the_official_2l_pattern():
    """Block at columns 2..4 of a 5-column canvas (no pads), 3 verifier masks after it at the block's
    positions: first half token-causal over the prefix and the block, mask i sees the prefix, drafts < i
    and itself."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 4]])
    valid = torch.ones_like(positions, dtype=torch.bool)
    causal = torch.zeros_like(valid)
    queries = torch.tensor([[2, 3, 4, 5, 6, 7]])
    mask = s2d2._verifier_mask(None, positions, valid, causal, torch.tensor([2]), 5, 3, queries)[0, 0].int()
    expected = [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1],
    ]
    assert mask.tolist() == expected


@pytest.mark.parametrize(
    "hp,needle",
    [
        ({"remasking_strategy": "entropy_bounded"}, "entropy_bounded"),
        ({"remasking_strategy": "nope"}, "remasking_strategy"),
        ({"do_verify_policy": "always"}, "do_verify_policy"),
        ({"token_acceptance_estimator": "x"}, "token_acceptance_estimator"),
        ({"do_verify_score_type": "ratio"}, "do_verify_score_type"),
        ({"ucb_entropy_source": "all"}, "ucb_entropy_source"),
        ({"do_verify_policy": "score_hysteresis", "hysteresis_threshold_on": -2.0}, "hysteresis_threshold_on"),
        ({"ssd_ratio_tempering_factor": -1.0}, "ssd_ratio_tempering_factor"),
        ({"min_ssd_span_length": 1.5}, "min_ssd_span_length"),
        ({"confidence_threshold": 2.0}, "confidence_threshold"),
        ({"ucb_entropy_bins": 10**9}, "ucb_entropy_bins=1000000000"),  # the fuzzer's 128 GB allocation
        ({"ucb_span_length_bins": 300, "ucb_block_progress_bins": 300}, "180000 buckets"),
        ({"ucb_block_progress_bins": 2.5}, "ucb_block_progress_bins"),
    ],
)
def test_bad_hyper_parameters(hp, needle):
    with pytest.raises(ConfigError, match=needle):
        dllm.samplers.get("s2d2", **hp)


def test_bad_runs(tiny):
    sampler = dllm.samplers.get("s2d2")
    with pytest.raises(ConfigError, match="block-causal"):
        sampler.generate(tiny("llada"), [PROMPTS[0]], max_new_tokens=8, block_size=8)
    model = tiny("sdar")
    with pytest.raises(ConfigError, match="steps_per_block"):
        sampler.generate(model, [PROMPTS[0]], max_new_tokens=8, steps_per_block=model.block_size + 1)

    class Other(Cache):
        def plan(self, step, state):
            return Plan()

    with pytest.raises(ConfigError, match="cache"):
        sampler.generate(model, [PROMPTS[0]], max_new_tokens=8, cache=Other())


def test_a_cache_with_an_exact_prefix_serves_the_verifier_whatever_its_class(tiny):
    """S2D2 asks the cache whether its stored prefix is exact (``exact_prefix``), not which class it is."""
    block = BlockCausal()

    class Delegate(Cache):  # the block cache's behaviour, not its class
        name = "delegate"
        exact_prefix = True

        def start(self, run):
            return block.start(run)

        def begin_block(self, step, state, rows):
            block.begin_block(step, state, rows)

        def plan(self, step, state):
            return block.plan(step, state)

    model, sampler = tiny("sdar"), dllm.samplers.get("s2d2")
    out = sampler.generate(model, PROMPTS, max_new_tokens=8, cache=Delegate())
    assert torch.equal(out.sequences, sampler.generate(model, PROMPTS, max_new_tokens=8).sequences)


def test_registered_with_the_official_defaults():
    defaults = dllm.samplers.defaults("s2d2")
    assert defaults["remasking_strategy"] == "low_confidence_dynamic" and defaults["confidence_threshold"] == 0.85
    assert defaults["do_verify_policy"] == "mask_span_length" and defaults["min_ssd_span_length"] == 1
    assert defaults["token_acceptance_estimator"] == "hard_margin_threshold"
    assert defaults["do_verify_score_type"] == "difference_dynamic" and defaults["score_penalty_coef"] == 2.0
    assert (defaults["hysteresis_threshold_on"], defaults["hysteresis_threshold_off"]) == (0.0, -1.0)
    assert isinstance(dllm.samplers.get("s2d2"), dllm.samplers.S2D2)
