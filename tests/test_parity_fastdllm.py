"""Parity with Fast-dLLM's threshold and factor rules (NVlabs/Fast-dLLM ``llada/generate.py``, commit
f6b35ec: ``generate`` without cache, ``get_transfer_index`` with ``threshold=``, and
``get_transfer_index_dynamic`` with ``factor=``).

The fixture was recorded by running the official functions on the tiny LLaDA checkpoints built here
(seed 0, std 0.5 and 1.0), the model wrapped so that ``model(x).logits`` is our aligned logits with the
mask-id logit at -inf; greedy, batch 1. It holds
- ``cases``: whole generations: the official sequence, its number of forwards, and how many slots each
  forward committed;
- ``logits``: a slice of the first forward's logits, to tell a model change from a sampler change;
- ``rules``: single official selections on synthetic logits whose candidates have chosen confidences,
  including the factor rule's "only the last sorted entry fails -> commit all" quirk, a confidence of
  exactly 1.0 at tau = 1 (commits: >=) and an "edge" candidate whose probability is just below 3/4 in
  float64 but exactly 3/4 in float32 (the official scores in float64).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dllm
from dllm.engine.step import Step
from dllm.kernels.reference import score
from dllm.samplers.confidence import Factor, Threshold

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "fastdllm_llada.json").read_text())
CASES = FIXTURE["cases"]
RULES = FIXTURE["rules"]
V, MASK = 101, 1


def _case_id(c):
    return f"std{c['std']}-P{len(c['prompt'])}-G{c['max_new_tokens']}-BL{c['block_size']}-{c['sampler']}{c['value']}"


def _run(model, case, **extra):
    commits = []
    gen = dllm.samplers.get(case["sampler"], **{case["sampler"]: case["value"]}, **extra).generate(
        model,
        torch.tensor([case["prompt"]]),
        max_new_tokens=case["max_new_tokens"],
        block_size=case["block_size"],
        temperature=0,
        eos_early_stop=False,
        callback=lambda s: commits.append(int(s.committed.sum())),
    )
    return gen, commits


@pytest.mark.parametrize("rec", FIXTURE["logits"], ids=lambda r: f"std{r['std']}-P{len(r['prompt'])}")
def test_model_logits_as_recorded(tiny, rec):
    """The rebuilt tiny model gives the logits the official sampler saw (else a generation mismatch below is
    a model change, not a sampler change). Logits reach |25| at std 1.0, so the tolerance scales with the value: float32
    sums in another BLAS order differed by 4e-5 of it on CI, a model change moves logits far more."""
    model = tiny("llada", std=rec["std"])
    x = torch.tensor([rec["prompt"] + [model.mask_id] * rec["gen"]])
    logits = model.logits(x, model.positions(torch.ones_like(x, dtype=torch.bool)))
    got = logits[0, rec["rows"]][:, rec["cols"]]
    torch.testing.assert_close(got, torch.tensor(rec["values"]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_generation_matches_official(tiny, case):
    model = tiny("llada", std=case["std"])
    gen, commits = _run(model, case)
    assert gen.sequences[0].tolist() == case["sequences"]
    assert gen.nfe == case["nfe"]
    assert commits == case["commits_per_step"]


def test_fixture_exercises_parallel_commits():
    for kind in ("threshold", "factor"):
        assert any(max(c["commits_per_step"]) >= 4 for c in CASES if c["sampler"] == kind)
        assert any(c["nfe"] < c["max_new_tokens"] for c in CASES if c["sampler"] == kind)


def test_factor_quirk_matters_end_to_end(tiny):
    """The official 'last entry fails -> commit all' changes some recorded generations: strict_prefix=True
    must then disagree with the official run (and never commit more per step)."""
    differs = 0
    for case in CASES:
        if case["sampler"] != "factor" or case["std"] != 1.0 or case["block_size"] != 4:
            continue
        gen, _ = _run(tiny("llada", std=case["std"]), case, strict_prefix=True)
        differs += gen.nfe > case["nfe"]
    assert differs > 0


def _rule_inputs(rule):
    """Candidate logits [N, V] (row-major over the candidate columns) as recorded: float32 ``rest``
    everywhere, the ``set`` entries, -inf on the mask token."""
    rows = []
    for spec in rule["logits"]:
        row = torch.full((V,), spec["rest"], dtype=torch.float32)
        for token, value in spec["set"]:
            row[token] = value
        row[MASK] = float("-inf")
        rows.append(row)
    cand = torch.zeros(1, rule["length"], dtype=torch.bool)
    cand[0, rule["columns"]] = True
    return torch.stack(rows), cand


def _select(sampler, rule):
    """The official rule's single selection: the sampler's scoring (``score`` with its spec) and its
    ``select`` on a step whose committable slots are the rule's candidate columns."""
    logits, cand = _rule_inputs(rule)
    scores = score(logits, sampler.score_spec(SimpleNamespace(temperature=0.0)))
    for got, want in zip(scores.prob.tolist(), rule["confidence"]):
        assert want == "edge" or abs(got - want) < 1e-6
    prob = torch.full(cand.shape, float("-inf"), dtype=scores.prob.dtype)
    prob[cand] = scores.prob
    proposed = torch.full(cand.shape, 10)
    proposed[cand] = scores.token
    step = SimpleNamespace(scores=SimpleNamespace(prob=prob), committable=cand, quota=None)
    step.among_committable = lambda values, fill=float("-inf"): Step.among_committable(step, values, fill)
    fill = sampler.select(step, None) & cand
    return fill[0].nonzero().squeeze(1).tolist(), proposed[fill].tolist()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r['sampler']}{r['value']}-{r['confidence']}")
def test_rule_matches_official(rule):
    cls = Threshold if rule["sampler"] == "threshold" else Factor
    committed, tokens = _select(cls(rule["value"]), rule)
    assert committed == rule["committed"]
    assert tokens == rule["tokens"]


def test_factor_strict_prefix_drops_the_quirk():
    quirk = [r for r in RULES if r["sampler"] == "factor" and r["confidence"] == [0.99, 0.9, 0.85, 0.5]]
    assert quirk and quirk[0]["committed"] == [1, 3, 4, 5]  # official: all four
    committed, _ = _select(Factor(1.0, strict_prefix=True), quirk[0])
    assert committed == [1, 3, 4]  # c(4) = 0.5 < 1 - 1/5: strict prefix stops before it
