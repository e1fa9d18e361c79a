"""The ``eb`` sampler (EB-Sampler, arXiv 2505.24857): parity with SGLang's ``EBSampling`` and the rule's properties.

Parity fixture ``tests/fixtures/eb_parity.json`` (its ``source`` field names what ran). Recipe, outside the repo (the
official code lives only under /tmp/eb_official/, never here): copy sgl-project/sglang@38c8d9b
``python/sglang/srt/dllm/algorithm/eb_sampling.py`` and the later form of the file whose ``EBSampling.step`` holds
the same rule; stub the ``sglang`` modules it imports (``DllmAlgorithm.__init__`` sets ``block_size`` and
``mask_id`` from the config, the type-only imports are ``object``); then
- ``rules``: 16 forward batches of two 8-slot blocks over a 32-token vocabulary (mask id 1, some slots already
  decoded), logits ``randn * scale`` (scale from 0.2 to 25 per slot, so entropies from ~0 to ~3.4 nats) rounded to
  3 decimals, gamma from 0 to 1e9: one step of ``EBSampling.run`` (a model runner that returns the logits, then
  stops the run at its second forward), the ``step`` form checked to agree; recorded the committed columns, their
  tokens and SGLang's entropies. Cases where a partial entropy sum lies within 1e-4 of gamma, or with tied
  entropies, were drawn again (the two entropy formulas differ by ~1e-7, ties by sort order);
- ``generations``: ``EBSampling.run`` block after block on ``make_tiny_checkpoint(DIR, "llada", seed=0, std=s)``
  (s = 0.5, 1.0) loaded into the official LLaDA modeling file (NVlabs/Fast-dLLM ``llada/model/modeling_llada.py``,
  ``config.use_cache = False`` for transformers 5), the runner's forward running it on the whole canvas (prompt,
  decoded blocks, the current block, later blocks masked) and returning the current block's logits; greedy,
  batch 1, three prompts, G / block / gamma in (16 / 8 / 0, 0.15, 1, 3), (32 / 32 / 0.15, 1, 5), (24 / 8 / 0.5,
  2); recorded the sequence, the forwards that commit (SGLang's extra forward after a block, which writes its
  K/V, excluded) and the slots each committed; ``logits``: slices of the official model's first forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dllm
from dllm import tasks
from dllm.core.errors import ConfigError
from dllm.kernels.reference import score
from dllm.samplers.eb import EB, entropy_bounded

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "eb_parity.json").read_text())
MASK = FIXTURE["source"]["mask_id"]
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]


def _lengths(model):
    return {"max_new_tokens": 16} if model.attention == "block" else {"max_new_tokens": 16, "block_size": 8}


# -- parity with SGLang ------------------------------------------------------------------------------------------


def _scored(case, sampler):
    """The loop's dense scores of a recorded rule case: the mask logit at -inf (the loop's scorer never proposes
    it; SGLang sets it to the dtype's minimum), then the sampler's scoring spec."""
    logits = torch.tensor(case["logits"], dtype=torch.float32)
    logits[..., MASK] = float("-inf")
    rows, block, vocab = logits.shape
    flat = score(logits.reshape(-1, vocab), sampler.score_spec(SimpleNamespace(temperature=0.0)))
    return SimpleNamespace(entropy=flat.entropy.view(rows, block), token=flat.token.view(rows, block))


@pytest.mark.parametrize("case", FIXTURE["rules"], ids=lambda c: f"gamma{c['gamma']:g}")
def test_one_step_commits_what_sglang_commits(case):
    sampler = EB(gamma=case["gamma"])
    scores = _scored(case, sampler)
    committable = torch.tensor(case["ids"]) == MASK
    want = torch.tensor(case["entropy"])
    assert torch.allclose(scores.entropy[committable], want[committable], atol=2e-6, rtol=0)
    commit = sampler.select(SimpleNamespace(scores=scores, committable=committable), None)
    for row in range(commit.shape[0]):
        columns = commit[row].nonzero().squeeze(1)
        assert columns.tolist() == case["committed"][row]
        assert scores.token[row, columns].tolist() == case["tokens"][row]


def test_the_rule_fixture_covers_single_partial_and_whole_blocks():
    rows = [(c, ids) for r in FIXTURE["rules"] for c, ids in zip(r["committed"], r["ids"])]
    counts = [(len(c), ids.count(MASK)) for c, ids in rows]  # (committed, masked) per block
    assert any(n == 1 < m for n, m in counts) and any(1 < n < m for n, m in counts)
    assert any(1 < n == m for n, m in counts)


@pytest.mark.parametrize("rec", FIXTURE["logits"], ids=lambda r: f"std{r['std']}-P{len(r['prompt'])}")
def test_the_model_gives_the_recorded_logits(tiny, rec):
    """The rebuilt tiny model gives the logits the official run saw (else a generation mismatch below is a model
    change, not a sampler change)."""
    model = tiny("llada", std=rec["std"])
    x = torch.tensor([rec["prompt"] + [model.mask_id] * rec["gen"]])
    logits = model.logits(x, model.positions(torch.ones_like(x, dtype=torch.bool)))
    got = logits[0, rec["rows"]][:, rec["cols"]]
    torch.testing.assert_close(got, torch.tensor(rec["values"]), rtol=1e-4, atol=1e-4)


def _case_id(c):
    return f"std{c['std']}-P{len(c['prompt'])}-G{c['max_new_tokens']}-B{c['block_size']}-gamma{c['gamma']:g}"


@pytest.mark.parametrize("case", FIXTURE["generations"], ids=_case_id)
def test_generation_matches_sglang(tiny, case):
    commits = []
    out = EB(gamma=case["gamma"]).generate(
        tiny("llada", std=case["std"]),
        torch.tensor([case["prompt"]]),
        max_new_tokens=case["max_new_tokens"],
        block_size=case["block_size"],
        eos_early_stop=False,
        callback=lambda info: commits.append(int(info.committed.sum())),
    )
    assert out.sequences[0].tolist() == case["sequence"]
    assert out.nfe == case["nfe"] and commits == case["commits_per_step"]


def test_the_generation_fixture_commits_in_parallel():
    assert sum(max(c["commits_per_step"]) >= 8 for c in FIXTURE["generations"]) >= 5
    assert any(c["nfe"] < c["max_new_tokens"] // 4 for c in FIXTURE["generations"])


# -- the rule ----------------------------------------------------------------------------------------------------


def test_the_bound_is_the_sum_less_the_largest_entropy_of_the_prefix():
    """In a confidence order the largest entropy need not be the last: the paper's sum - max lets all three slots
    through at gamma 0.2 (0.45 - 0.3), where the sum of the entropies before the third (0.35) would not."""
    entropy = torch.tensor([[0.05, 0.3, 0.1, 0.9]])
    confidence = torch.tensor([[0.9, 0.8, 0.7, 0.1]])
    everything = torch.ones_like(entropy, dtype=torch.bool)
    assert entropy_bounded(entropy, confidence, everything, 0.2).tolist() == [[True, True, True, False]]
    assert entropy_bounded(entropy, confidence, everything, 0.14).tolist() == [[True, True, False, False]]
    # in the entropy order: 0.05, 0.1, 0.3, 0.9; the sums before them 0, 0.05, 0.15, 0.45 (<=: 0.15 passes)
    assert entropy_bounded(entropy, -entropy, everything, 0.15).tolist() == [[True, True, True, False]]
    assert entropy_bounded(entropy, -entropy, everything, 0.149).tolist() == [[True, False, True, False]]


def test_candidates_only_ties_to_the_left_and_at_least_one():
    entropy = torch.tensor([[0.0, 0.2, 0.2, 5.0], [1.0, 1.0, 1.0, 1.0], [0.1, 0.1, 0.1, 0.1]])
    committable = torch.tensor([[False, True, True, True], [True, True, True, True], [False] * 4])
    commit = entropy_bounded(entropy, -entropy, committable, 0.1)
    assert commit.tolist() == [[False, True, False, False], [True, False, False, False], [False] * 4]
    assert entropy_bounded(entropy, -entropy, committable, float("inf")).tolist() == committable.tolist()


def test_gamma_zero_lets_exactly_certain_slots_through_together():
    """gamma = 0 commits one slot per step unless some predictions have entropy exactly 0 (a float32 softmax
    that is one-hot): those, and the next slot, go together."""
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = logits[2, 5] = 300.0  # rows 0 and 2 certain
    sampler = EB(gamma=0.0)
    entropy = score(logits, sampler.score_spec(SimpleNamespace(temperature=0.0))).entropy
    assert entropy[0] == entropy[2] == 0 and (entropy[[1, 3]] > 0).all()
    everything = torch.ones(1, 4, dtype=torch.bool)
    commit = sampler.select(SimpleNamespace(scores=SimpleNamespace(entropy=entropy[None]), committable=everything), 0)
    assert commit[0].tolist() == [True, entropy[1] < entropy[3], True, entropy[3] < entropy[1]]


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_gamma_zero_commits_one_token_per_step(family, tiny):
    model = tiny(family)
    committed = []
    out = EB(gamma=0.0).generate(
        model, PROMPTS[:1], **_lengths(model), eos_early_stop=False, callback=lambda i: committed.append(i.committed)
    )
    assert all(int(c.sum()) == 1 for c in committed)
    assert out.nfe == len(committed) == out.sequences.shape[1] - out.prompt_width  # a forward per generated slot
    assert not (out.sequences == model.mask_id).any()


def test_gamma_zero_in_entropy_order_commits_the_lowest_entropy_mask_of_the_block(tiny):
    """Checked against the model's own entropies (log-softmax, the mask token excluded) of each step's canvas."""
    model = tiny("llada")
    out = EB(gamma=0.0).generate(model, PROMPTS[1:2], max_new_tokens=16, block_size=8, history=True)
    p = out.prompt_width
    before = torch.cat([out.sequences[:, :p], torch.full((1, 16), model.mask_id)], 1)
    for now in out.history:
        (column,) = (now[0] != before[0]).nonzero().squeeze(1).tolist()
        logits = model.logits(before, model.positions(torch.ones_like(before, dtype=torch.bool)))[0]
        logits[:, model.mask_id] = float("-inf")
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
        start = p + (column - p) // 8 * 8
        block = torch.arange(start, start + 8)
        masked = block[before[0, block] == model.mask_id]
        assert column == int(masked[entropy[masked].argmin()])
        before = now
    assert len(out.history) == out.nfe == 16


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_gamma_zero_in_confidence_order_is_llada_at_one_token_per_step(family, tiny):
    """With the proposal's probability as the proxy, gamma = 0 is LLaDA's low-confidence sampler at one token per
    step; the entropy order is another order (it differs on some prompt)."""
    model = tiny(family)
    kw = dict(**_lengths(model), eos_early_stop=False)
    llada = dllm.samplers.get("llada").generate(model, PROMPTS, **kw)
    confidence = EB(gamma=0.0, error_proxy="confidence").generate(model, PROMPTS, **kw)
    assert torch.equal(confidence.sequences, llada.sequences) and confidence.nfe == llada.nfe
    if family == "llada":
        by_entropy = EB(gamma=0.0).generate(model, PROMPTS, **kw, history=True).history
        by_confidence = EB(gamma=0.0, error_proxy="confidence").generate(model, PROMPTS, **kw, history=True).history
        assert any(not torch.equal(e, c) for e, c in zip(by_entropy, by_confidence))


def test_gamma_inf_commits_each_block_in_one_forward(tiny):
    model = tiny("llada")
    out = EB(gamma=float("inf")).generate(model, PROMPTS, max_new_tokens=24, block_size=8, eos_early_stop=False)
    assert out.nfe == 3 and not (out.sequences == model.mask_id).any()


def test_larger_gamma_never_takes_more_forwards_on_the_bundled_model():
    model = dllm.load("tiny-llada", device="cpu", dtype=torch.float32)
    prompts = [e.prompt for name in ("arith", "pick", "listops") for e in tasks.get(name).examples("test", 2)]
    gammas = [0.0, 0.05, 0.15, 0.5, 1.0, 2.0, float("inf")]
    for prompt in prompts:
        nfe = [EB(gamma=g).generate(model, [prompt], max_new_tokens=32, block_size=8).nfe for g in gammas]
        assert nfe == sorted(nfe, reverse=True), (prompt, nfe)
        assert nfe[0] > nfe[2], (prompt, nfe)  # the default bound saves forwards on every prompt


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
@pytest.mark.parametrize("hp", [{}, {"gamma": 1.0, "error_proxy": "margin"}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batch_rows_equal_alone(family, hp, temperature, tiny, batch_invariant):
    model = tiny(family)
    kw = dict(**_lengths(model), eos_early_stop=False, temperature=temperature, seed=4)
    batch_invariant(EB(**hp), model, PROMPTS, **kw)


def test_statistics_at_temperature_are_those_of_the_tempered_distribution(tiny):
    """At a tiny temperature every tempered prediction is certain (entropy ~0): the default bound commits each
    block at once, where greedy decoding (the model's own entropies, ~3 nats here) commits one token per step."""
    model = tiny("llada")
    kw = dict(max_new_tokens=16, block_size=8, eos_early_stop=False, seed=1)
    assert EB().generate(model, PROMPTS, **kw).nfe == 16
    assert EB().generate(model, PROMPTS, **kw, temperature=1e-6).nfe == 2


def test_registered_with_its_defaults():
    assert dllm.samplers.defaults("eb") == {"gamma": 0.15, "error_proxy": "entropy"}
    assert isinstance(dllm.samplers.get("EB", gamma=0), EB) and not EB.fixed_steps
    for bad in ({"gamma": -0.1}, {"gamma": float("nan")}, {"error_proxy": "random"}):
        with pytest.raises(ConfigError, match=f"{next(iter(bad))} must be"):
            dllm.samplers.get("eb", **bad)
