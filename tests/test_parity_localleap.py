"""Parity with LocalLeap's official ``generate`` (arXiv 2510.07081).

The authors' repository is not public; the fixture was recorded with the public copy of their
``generate.py`` in ZitongWang018/dlm-seq (commit 1e1b143, ``experiments/localleap/generate.py``: ``generate``
with ``threshold``, ``relaxed_threshold``, ``radius`` and ``early_stop=False``, as the paper's scripts run
it), run outside this repository with only its model import dropped, on
- the tiny random checkpoints of ``tests/conftest.py`` (``tiny(family, std=...)``: seed 0, std 0.5 and 1.0,
  LLaDA and Dream) with random prompts, and
- the bundled trained ``tiny-llada`` / ``tiny-dream`` with prompts of the bench tasks ``arith`` and ``listops``,
the model wrapped so that ``model(x).logits`` is our aligned logits (Dream's shift is the adapter's) with the
mask-id logit at -inf; greedy, batch 1, steps = max_new_tokens. Settings: (κ, τ, W) in (0.9, 0.75, 4),
(0.7, 0.4, 2), (0.5, 0.2, 1), (0.95, 0.5, 8), (0.9, None, 4), with (max_new_tokens, block) in (32, 8), (32, 32),
(16, 4); every case asserts the tokens and the number of forwards. ``relaxation_matters`` marks the cases whose
official output changes when ``relaxed_threshold`` is None (also recorded with the official code).

Sampled cases (``temperature`` 1.0 and 2.0, ``seed`` 3; three of the settings above on llada-1.0, dream-1.0 and
the bundled models): the official ``add_gumbel_noise``'s ``torch.rand_like`` (its only random draws) was replaced
by dllm's counter-based float64 draws for (seed, row 0, step = index of the forward, column offset from the
generation start), ``CounterRNG(seed).uniform(Stream.TOKENS, ...)``, the numbers ours draws: token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "localleap_parity.json").read_text())
_BUNDLED = {}


def model_of(key, tiny):
    """``llada-1.0`` -> tiny(``llada``, std=1.0); ``tiny-llada`` -> the bundled checkpoint (float32, CPU)."""
    if key.startswith("tiny-"):
        if key not in _BUNDLED:
            _BUNDLED[key] = dllm.load(key, device="cpu", dtype=torch.float32)
        return _BUNDLED[key]
    family, std = key.split("-")
    return tiny(family, std=float(std))


def _id(case):
    h = case["hyper"]
    return (
        f"{case['model']}-{case['prompt_name']}-G{case['max_new_tokens']}-B{case['block_size']}-"
        f"k{h['threshold']}-t{h['relaxed_threshold']}-W{h['radius']}-T{case.get('temperature', 0.0)}"
    )


@pytest.mark.parametrize("rec", FIXTURE["logits"], ids=lambda r: r["model"])
def test_model_logits_as_recorded(tiny, rec):
    """The model gives the logits the official code saw (else a mismatch below is a model change)."""
    model = model_of(rec["model"], tiny)
    x = torch.tensor([rec["prompt"] + [model.mask_id] * rec["gen"]])
    logits = model.logits(x, model.positions(torch.ones_like(x, dtype=torch.bool)))[0, rec["cols"]]
    torch.testing.assert_close(logits[:, rec["vocab"]], torch.tensor(rec["values"]), rtol=1e-4, atol=1e-4)
    assert logits.argmax(-1).tolist() == rec["argmax"]


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
def test_generation_matches_official(tiny, case):
    model = model_of(case["model"], tiny)
    n = case["max_new_tokens"]
    out = dllm.samplers.get("localleap", **case["hyper"]).generate(
        model,
        torch.tensor([case["prompt"]]),
        steps=n,
        max_new_tokens=n,
        block_size=case["block_size"],
        temperature=case.get("temperature", 0.0),
        seed=case.get("seed"),
        eos_early_stop=False,
    )
    assert out.sequences[0].tolist() == case["sequence"]
    assert out.nfe == case["nfe"]


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
def test_steps_one_per_block_as_the_official_main_passes_them(tiny, case):
    """LocalLeap's official ``main()`` passes ``steps = gen_length // block_length``; its threshold branch
    ignores them, so the output is the recorded one (tokens and forwards), as with steps = max_new_tokens."""
    model = model_of(case["model"], tiny)
    n, block = case["max_new_tokens"], case["block_size"]
    sampler = dllm.samplers.get("localleap", **case["hyper"])
    prompt = torch.tensor([case["prompt"]])
    run = dict(max_new_tokens=n, block_size=block, temperature=case.get("temperature", 0.0), seed=case.get("seed"))
    out = sampler.generate(model, prompt, steps=n // block, eos_early_stop=False, **run)
    assert out.sequences[0].tolist() == case["sequence"] and out.nfe == case["nfe"]
    free = sampler.generate(model, prompt, eos_early_stop=False, **run)  # no steps: the same tokens and forwards
    assert free.sequences.equal(out.sequences) and free.nfe == out.nfe


def test_fixture_exercises_the_relaxation():
    """Most families and models have cases where the relaxed window changes the official output."""
    matters = {c["model"] for c in FIXTURE["cases"] if c["relaxation_matters"]}
    assert sum(c.get("temperature", 0) > 0 for c in FIXTURE["cases"]) >= 20
    assert {"llada-1.0", "dream-1.0", "tiny-llada", "tiny-dream"} <= matters
    assert any(c["relaxation_matters"] is False and c["hyper"]["relaxed_threshold"] for c in FIXTURE["cases"])
