"""The scoring seam (dllm.kernels.reference.score): what each statistic means, on fresh random logits."""

from __future__ import annotations

import pytest
import torch

from dllm.kernels.reference import STATS, ScoreSpec, gumbel_argmax, gumbel_top_k, score, top_k_per_row


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


def test_gumbel_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(40_000, -1)
    g = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.5):
        uniform = torch.rand(logits.shape, generator=g, dtype=torch.float64)
        s = score(logits, ScoreSpec(need=frozenset({"prob", "argmax"}), temperature=temperature), uniform)
        freq = torch.bincount(s.token, minlength=4).double() / logits.shape[0]
        torch.testing.assert_close(freq, torch.softmax(logits[0].double() / temperature, -1), atol=0.01, rtol=0)
        assert bool((s.argmax == 0).all())  # the highest-probability token, whatever was sampled
        torch.testing.assert_close(s.prob, torch.softmax(logits, -1).gather(-1, s.token[:, None])[:, 0])
    with pytest.raises(ValueError, match="needs uniform draws"):
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
