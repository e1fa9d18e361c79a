"""The scoring seam (dllm.kernels.reference.score): what each statistic means, on fresh random logits."""

from __future__ import annotations

import itertools

import pytest
import torch

from dllm.core.errors import ConfigError
from dllm.core.rng import CounterRNG, Stream
from dllm.kernels.reference import (
    STATS,
    WARPS,
    ScoreSpec,
    gumbel_argmax,
    gumbel_top_k,
    logit_margin,
    score,
    top_k_filter,
    top_k_per_row,
    top_p_filter,
    warp,
)
from dllm.samplers.transforms import SuppressTokens, Temperature, TopK, TopP


def _logits(n=64, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_statistics_by_their_definitions(dtype):
    logits = _logits()
    s = score(logits, ScoreSpec(need=frozenset(STATS), dtype=dtype))
    probs = torch.softmax(logits.to(dtype or logits.dtype), -1)
    assert torch.equal(s.token, logits.argmax(-1)) and torch.equal(s.argmax, s.token)
    torch.testing.assert_close(s.prob, probs.max(-1).values)
    torch.testing.assert_close(s.top1, probs.max(-1).values)
    ranked = probs.sort(-1, descending=True).values
    torch.testing.assert_close(s.margin, ranked[:, 0] - ranked[:, 1])
    raw = logits.sort(-1, descending=True).values
    torch.testing.assert_close(s.logit_margin, raw[:, 0] - raw[:, 1])
    torch.testing.assert_close(s.entropy, -(probs * torch.log(probs + 1e-10)).sum(-1))
    assert s.prob.dtype == (dtype or logits.dtype)


def test_only_what_is_asked_is_computed():
    s = score(_logits(), ScoreSpec(need=frozenset()))
    assert all(getattr(s, name) is None for name in STATS)
    with pytest.raises(ValueError, match="unknown statistics"):
        ScoreSpec(need=frozenset({"confidence"}))


def test_excluded_tokens_may_be_proposed_but_count_as_zero_probability():
    logits = _logits()
    token = logits.argmax(-1)
    excluded = int(token[0])
    s = score(logits, ScoreSpec(need=frozenset({"prob", "top1"}), exclude=(excluded,)))
    assert int(s.token[0]) == excluded and s.prob[0] == 0  # still proposed, confidence 0
    other = token != excluded
    kept = logits.clone()
    kept[:, excluded] = float("-inf")
    torch.testing.assert_close(s.prob[other], torch.softmax(kept, -1)[other].gather(-1, token[other, None])[:, 0])


def _counters(n, seed=0, step=0):
    """Counters of n slots: rows 0..n-1 at one step and column."""
    rows = torch.arange(n)
    return CounterRNG(seed).counters(Stream.TOKENS, rows, torch.full((n,), step), torch.zeros(n, 1, dtype=torch.long))


def test_gumbel_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(40_000, -1)
    for temperature in (1.0, 0.5):
        counters = _counters(logits.shape[0], step=int(temperature * 10))
        s = score(logits, ScoreSpec(need=frozenset({"prob", "argmax"}), temperature=temperature), counters)
        freq = torch.bincount(s.token, minlength=4).double() / logits.shape[0]
        torch.testing.assert_close(freq, torch.softmax(logits[0].double() / temperature, -1), atol=0.01, rtol=0)
        assert bool((s.argmax == 0).all())  # the highest-probability token, whatever was sampled
        torch.testing.assert_close(s.prob, torch.softmax(logits, -1).gather(-1, s.token[:, None])[:, 0])
        # the draws are the counters' own: the same as materialising them
        uniform = counters.uniform(logits.shape[-1])
        assert torch.equal(s.token, gumbel_argmax(logits, temperature, uniform))
    with pytest.raises(ValueError, match="needs the random-number counters"):
        score(logits, ScoreSpec(temperature=1.0))


def test_gumbel_argmax_is_the_official_argmax_in_the_log_domain_and_never_picks_minus_inf():
    logits = _logits(n=2000, v=50)
    logits[:, 7] = float("-inf")  # the mask token's column
    uniform = torch.rand(logits.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for temperature in (0.3, 1.0, 2.0):  # where LLaDA's exp(l) / (-log u) ** T is finite: the same argmax
        official = (logits.double().exp() / (-torch.log(uniform)) ** temperature).argmax(-1)
        assert torch.equal(gumbel_argmax(logits, temperature, uniform), official)
    for temperature in (1e-300, 1e-6, 1e6, 1e300, 1.7e308):  # where it is 0 / 0 or inf / inf
        token = gumbel_argmax(logits, temperature, uniform)
        assert not (token == 7).any()
    assert torch.equal(gumbel_argmax(logits, 1e-6, uniform), logits.argmax(-1))  # nearly greedy


def test_top_k_per_row_breaks_ties_to_the_left_and_takes_k_per_row():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.5, -float("inf")], [0.1, 0.2, 0.3, 0.4, 0.5]])
    picked = top_k_per_row(scores, torch.tensor([2, 3]))
    assert picked.tolist() == [[True, True, False, False, False], [False, False, True, True, True]]


def test_gumbel_top_k_draws_without_replacement_in_proportion():
    weights = torch.tensor([0.5, 0.3, 0.2, 0.0]).log().expand(30_000, -1)
    uniform = torch.rand(weights.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    one = gumbel_top_k(weights, torch.ones(weights.shape[0], dtype=torch.long), uniform)
    torch.testing.assert_close(one.double().mean(0), torch.tensor([0.5, 0.3, 0.2, 0.0]).double(), atol=0.01, rtol=0)
    two = gumbel_top_k(weights, torch.full((weights.shape[0],), 2), uniform)
    assert bool((two.sum(1) == 2).all()) and not bool(two[:, 3].any())  # zero weight never drawn
    # P(first two = {0, 1}) = .5 * .3 / .5 + .3 * .5 / .7 for successive draws without replacement
    both = (two[:, 0] & two[:, 1]).double().mean().item()
    assert abs(both - (0.5 * 0.3 / 0.5 + 0.3 * 0.5 / 0.7)) < 0.015


WARP_VALUES = {"temper": 0.7, "top_k": 5, "top_p": 0.8}


def _by_hand(logits, order, fill):
    """The old transform chain: divide by the temperature, top_k_filter, top_p_filter, in ``order``."""
    for name in order:
        if name == "temper":
            logits = logits / WARP_VALUES["temper"]
        elif name == "top_k":
            logits = top_k_filter(logits, WARP_VALUES["top_k"], fill)
        else:
            logits = top_p_filter(logits, WARP_VALUES["top_p"], fill)
    return logits


@pytest.mark.parametrize("order", list(itertools.permutations(WARPS)))
@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spec_warps_equal_the_transforms_they_replace(order, fill, temperature):
    """Scoring with the spec's temper / top_k / top_p equals scoring the logits the old transforms produced, in
    every order, and folding the transforms in that order builds that spec."""
    logits = _logits(n=30, v=60, seed=1)
    logits[:3, 7] = logits[:3].max(-1).values  # exact ties
    logits[3, :5] = float("-inf")
    counters = _counters(logits.shape[0], seed=4)
    spec = ScoreSpec(need=frozenset(STATS), temperature=temperature, fill=fill, order=order, **WARP_VALUES)
    warped = _by_hand(logits, order, fill)
    assert torch.equal(warp(logits, spec), warped)
    plain = ScoreSpec(need=frozenset(STATS) - {"logit_margin"}, temperature=temperature)
    out, want = score(logits, spec, counters), score(warped, plain, counters)
    for name in ("token", *STATS):
        if name != "logit_margin":
            assert torch.equal(getattr(out, name), getattr(want, name)), name
    assert torch.equal(out.logit_margin, logit_margin(logits))  # measured before the warps
    transforms = {"temper": Temperature(0.7), "top_k": TopK(5, fill), "top_p": TopP(0.8, fill)}
    folded = ScoreSpec(need=frozenset(STATS), temperature=temperature)
    for name in order:
        folded = transforms[name].fold(folded)
        assert torch.equal(transforms[name](logits), _by_hand(logits, (name,), fill))
    assert folded == spec


def test_warps_that_are_off_change_nothing_and_suppressed_ids_are_never_proposed():
    logits = _logits()
    off = ScoreSpec(need=frozenset(STATS), temper=1.0, top_k=0, top_p=1.0)
    assert off.warps == () and warp(logits, off) is logits
    assert ScoreSpec(top_k=None, top_p=None).warps == ()
    # fill and order are normalised where nothing depends on them: a backend sees the defaults
    assert ScoreSpec(fill=-1e9, order=("top_p", "top_k", "temper"), top_k=0, top_p=1.0) == ScoreSpec()
    assert ScoreSpec(top_p=0.9, order=("top_k", "top_p", "temper")).order == ("top_p", "temper", "top_k")
    best = logits.argmax(-1)
    s = score(logits, ScoreSpec(need=frozenset({"prob", "logit_margin"}), suppress=(int(best[0]),)))
    kept = logits.clone()
    kept[:, int(best[0])] = float("-inf")
    assert torch.equal(s.token, kept.argmax(-1)) and int(s.token[0]) != int(best[0])
    torch.testing.assert_close(s.prob, torch.softmax(kept, -1).max(-1).values)
    torch.testing.assert_close(s.logit_margin, logit_margin(kept))  # after the suppression
    folded = SuppressTokens((3, 5)).fold(SuppressTokens((5, 1)).fold(ScoreSpec()))
    assert folded.suppress == (5, 1, 3)


def test_bad_spec_fields_and_warps_set_twice_are_refused():
    with pytest.raises(ConfigError, match="order must order"):
        ScoreSpec(order=("temper", "top_k"))
    with pytest.raises(ConfigError, match="temper must be a finite number > 0"):
        ScoreSpec(temper=0.0)
    with pytest.raises(ConfigError, match="top_k must be None or an integer"):
        ScoreSpec(top_k=2.5)
    with pytest.raises(ConfigError, match="top_k is set twice"):
        TopK(3).fold(ScoreSpec(top_k=5))
    assert TopK(None).fold(ScoreSpec(top_k=5)) == ScoreSpec(top_k=5)  # an "off" transform folds to nothing
    with pytest.raises(ConfigError, match="use one fill value"):
        TopK(3, fill=-1e9).fold(ScoreSpec(top_p=0.9))
