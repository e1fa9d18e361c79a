"""CreditDecoding (``credit`` and the ``credit_fusion`` transform): batch invariance, reductions, the
memory-light top-K credit, composition with other rules, bad hyper-parameters. Parity with dInfer is in
``test_parity_credit.py``."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.samplers.credit import Credit, CreditFusion

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]
SETTINGS = [
    {},
    {"threshold": 0.7, "credit_alpha": 2.0, "boost_gamma": 0.5, "decay_beta": 0.5},
    {"credit_top_k": 2},
]


def _lengths(family):
    return {"max_new_tokens": 16} if family == "sdar" else {"max_new_tokens": 16, "block_size": 8}


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
@pytest.mark.parametrize("hp", SETTINGS, ids=["default", "strong", "top2"])
def test_batch_invariance_greedy(family, hp, tiny, batch_invariant):
    model = tiny(family, std=1.0)
    out = batch_invariant(dllm.samplers.get("credit", **hp), model, PROMPTS, **_lengths(family), eos_early_stop=False)
    assert out.nfe < 16 * 2, "several tokens per forward"


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_batch_invariance_sampled(family, tiny, batch_invariant):
    """At temperature > 0 a prompt draws the same numbers at any index of a left-padded batch."""
    model = tiny(family, std=1.0)
    sampler = dllm.samplers.get("credit", threshold=0.8)
    kw = dict(**_lengths(family), eos_early_stop=False, temperature=1.0, seed=5)
    batch_invariant(sampler, model, PROMPTS, **kw)
    other = sampler.generate(model, PROMPTS, **dict(kw, seed=6))
    assert not torch.equal(other.sequences, sampler.generate(model, PROMPTS, **kw).sequences), "the seed matters"


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
@pytest.mark.parametrize("std", [0.5, 1.0])
def test_without_credit_is_threshold(family, std, tiny):
    """credit_alpha = 0 is dInfer's plain threshold rule: the same tokens and forwards as ``threshold`` (which
    scores in float64 and commits only its single best slot below τ; no case here sits on those edges)."""
    model = tiny(family, std=std)
    for tau in (0.9, 0.6):
        kw = dict(**_lengths(family), eos_early_stop=False)
        plain = dllm.samplers.get("threshold", threshold=tau).generate(model, PROMPTS, **kw)
        off = dllm.samplers.get("credit", threshold=tau, credit_alpha=0.0).generate(model, PROMPTS, **kw)
        assert torch.equal(off.sequences, plain.sequences)
        assert off.nfe == plain.nfe


def test_without_credit_is_threshold_on_the_trained_model():
    from dllm import tasks

    model = dllm.load("tiny-llada")
    prompts = [p.prompt for p in tasks.get("listops").examples("test", 4)]
    for tau in (0.9, 0.99):
        plain = dllm.samplers.get("threshold", threshold=tau).generate(model, prompts, eos_early_stop=False)
        off = dllm.samplers.get("credit", threshold=tau, credit_alpha=0).generate(model, prompts, eos_early_stop=False)
        assert torch.equal(off.sequences, plain.sequences) and off.nfe == plain.nfe


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_credit_changes_the_decoding(family, tiny):
    model = tiny(family, std=1.0)
    kw = dict(**_lengths(family), eos_early_stop=False)
    outs = [dllm.samplers.get("credit", credit_alpha=a).generate(model, PROMPTS, **kw) for a in (0.0, 0.7, 3.0)]
    assert not torch.equal(outs[0].sequences, outs[2].sequences)
    assert outs[2].nfe <= outs[0].nfe, "a strong credit boost commits more per forward"


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_top_k_credit_is_exact_when_it_holds_every_top1(family, tiny):
    """A slot earns credit for at most one token per forward, so K = block size entries hold all of it."""
    model = tiny(family, std=0.5)
    kw = dict(**_lengths(family), eos_early_stop=False)
    block = 8 if family != "sdar" else model.block_size
    full = dllm.samplers.get("credit", threshold=0.95).generate(model, PROMPTS, **kw)
    top = dllm.samplers.get("credit", threshold=0.95, credit_top_k=block).generate(model, PROMPTS, **kw)
    assert torch.equal(full.sequences, top.sequences) and full.nfe == top.nfe


def test_top_k_credit_state_matches_the_full_credit(tiny):
    """Step by step, the K entries are the full credit's nonzero entries (K large enough), and K = 1 keeps the
    most recent top-1 only."""
    model = tiny("llada", std=0.5)
    states = {}

    class Spy(CreditFusion):
        def __call__(self, logits, rows, columns, step, state):
            out = super().__call__(logits, rows, columns, step, state)
            states.setdefault(self.credit_top_k, []).append(
                (state.credit.clone(), None if state.tokens is None else state.tokens.clone())
            )
            return out

    for k in (None, 8):
        sampler = dllm.samplers.get("threshold", threshold=0.95).with_transforms(Spy(credit_top_k=k))
        sampler.generate(model, PROMPTS, max_new_tokens=16, block_size=8, eos_early_stop=False)
    assert len(states[None]) == len(states[8]) > 4
    for (full, _), (credit, tokens) in zip(states[None], states[8]):
        dense = torch.zeros_like(full).scatter_add_(-1, tokens.clamp(min=0), credit.masked_fill(tokens < 0, 0))
        torch.testing.assert_close(dense, full, rtol=0, atol=0)
    assert (states[None][-1][0] > 0).sum(-1).max() > 1, "some slot holds credit for several tokens"


def test_credit_resets_at_each_block_and_decays(tiny):
    """At a row's first forward in a block its credit is p1 ** gamma at the top-1 tokens of masked slots only;
    at the next forward the old entries are multiplied by decay_beta."""
    model = tiny("llada", std=0.5)
    seen = []

    class Spy(CreditFusion):
        def __call__(self, logits, rows, columns, step, state):
            out = super().__call__(logits, rows, columns, step, state)
            p1, v1 = torch.softmax(logits.float(), -1).max(-1)
            seen.append((step.step.clone(), step.masked[rows[:, None], columns], p1, v1, state.credit.clone()))
            return out

    spy = Spy(boost_gamma=0.5, decay_beta=0.25)
    dllm.samplers.get("llada").with_transforms(spy).generate(
        model, [PROMPTS[0]], max_new_tokens=16, block_size=8, steps=8, eos_early_stop=False
    )
    assert len(seen) == 8  # 2 blocks x 4 steps
    for i, (steps, masked, p1, v1, credit) in enumerate(seen):
        if int(steps[0]) == 0:  # block start: only this forward's boost
            expect = torch.zeros_like(credit)
        else:
            expect = seen[i - 1][4] * 0.25
        expect[0, torch.arange(8)[masked[0]], v1[0][masked[0]]] += p1[0][masked[0]] ** 0.5
        torch.testing.assert_close(credit, expect)


def test_fusion_composes_with_other_rules(tiny, batch_invariant):
    """credit_fusion by name over any base (here LLaDA's fixed schedule, whose ranking it changes)."""
    model = tiny("llada", std=0.5)
    kw = dict(max_new_tokens=16, block_size=8, eos_early_stop=False)
    by_name = dllm.samplers.get("credit_fusion", base="llada", credit_alpha=2.0)
    direct = dllm.samplers.get("llada").with_transforms(CreditFusion(credit_alpha=2.0))
    assert by_name.name == "credit_fusion(llada)"
    a, b = by_name.generate(model, PROMPTS, steps=8, **kw), direct.generate(model, PROMPTS, steps=8, **kw)
    assert torch.equal(a.sequences, b.sequences)
    plain = dllm.samplers.get("llada").generate(model, PROMPTS, steps=8, **kw)
    assert not torch.equal(a.sequences, plain.sequences)
    batch_invariant(by_name, model, PROMPTS, steps=8, **kw)
    zero = dllm.samplers.get("credit_fusion", base="threshold", credit_alpha=0.0).generate(model, PROMPTS, **kw)
    assert torch.equal(zero.sequences, dllm.samplers.get("threshold").generate(model, PROMPTS, **kw).sequences)


def test_early_exit_fill_reuses_the_step_credit(tiny):
    """An exit rule's fill rescores the span from the step's forward: the credit is applied, not accumulated a
    second time, so the block's open slots get the tokens the step proposed."""
    model = tiny("llada", std=1.0)
    kw = dict(max_new_tokens=16, block_size=8, eos_early_stop=False)
    calls, proposals = [], []

    class Spy(CreditFusion):
        def __call__(self, logits, rows, columns, step, state):
            out = super().__call__(logits, rows, columns, step, state)
            calls.append((step.iteration, columns.shape[1], state.credit.clone(), state.forwards.clone()))
            return out

    class Keep(dllm.samplers.ExitRule):
        def check(self, step, state, decision):
            proposals.append(step.scores.token.clone())
            return step.t == 2

    sampler = dllm.samplers.get("threshold", threshold=1.0).with_transforms(Spy(credit_alpha=3.0))
    out = sampler.with_exit(Keep()).generate(model, PROMPTS, **kw)
    assert out.nfe == 3 and [c[0] for c in calls] == [1, 2, 3, 3]
    assert calls[3][1] > calls[2][1], "the fill scores the whole span"
    assert torch.equal(calls[3][2], calls[2][2]) and torch.equal(calls[3][3], calls[2][3])
    block = slice(out.prompt_width, out.prompt_width + 8)
    before = sampler.generate(model, PROMPTS, history=True, **kw).history[1][:, block]  # after steps 0 and 1
    still = before == model.mask_id
    assert torch.equal(out.sequences[:, block][still], proposals[2][:, block][still])


@pytest.mark.parametrize(
    "hp",
    [
        {"threshold": 1.5},
        {"threshold": -0.1},
        {"credit_alpha": -1.0},
        {"credit_alpha": float("nan")},
        {"boost_gamma": -0.2},
        {"decay_beta": 1.5},
        {"decay_beta": "0.8"},
        {"credit_top_k": 0},
        {"credit_top_k": 2.5},
    ],
)
def test_bad_hyper_parameters(hp):
    key = next(iter(hp))
    with pytest.raises(ConfigError, match=key):
        dllm.samplers.get("credit", **hp)
    if key != "threshold":
        with pytest.raises(ConfigError, match=key):
            dllm.samplers.get("credit_fusion", **hp)


def test_defaults_are_dinfer_s():
    assert dllm.samplers.defaults("credit") == {
        "threshold": 0.9,
        "credit_alpha": 0.7,
        "boost_gamma": 0.2,
        "decay_beta": 0.8,
        "credit_top_k": None,
    }
    assert Credit().fusion == CreditFusion()
