"""Parity of ``credit`` with dInfer's CreditDecoding rule (inclusionAI/dInfer@fce4e32,
``python/dinfer/decoding/parallel_strategy.py``: ``CreditThresholdParallelDecoder``).

The fixture was recorded by running dInfer's own code (``parallel_strategy.py``, ``utils.py``,
``generate_uniform.py`` of that commit, outside this repository, with ``torch.compile`` shimmed to the
identity to run on CPU) on
- tiny random LLaDA and Dream checkpoints (``make_tiny_checkpoint(dir, family, seed=0, std=0.5 | 1.0)``,
  random prompts) with dInfer's default credit (α 0.7, γ 0.2, β 0.8) at τ 0.9 / 0.7 / 0.95, and with
  τ 0.5, α 1.5, γ 0.5, β 0.5 and τ 0.95, α 3;
- the bundled ``tiny-llada`` and ``tiny-dream`` on arith and listops prompts at τ 0.99 to 0.9999 (these
  models commit whole blocks at τ 0.9, leaving the credit nothing to do) and α 2, γ 0.5, β 0.9;
greedy, batch 1, no cache, fresh decoder per case. The model was wrapped so that ``model(x).logits`` is our
logits with the mask-id logit at -inf (for Dream unshifted, so that dInfer's ``ShiftDiffusionIteration``
realigns them). Two loops drove the decoder:
- ``early_stop``: ``BlockWiseDiffusionLLM(..., BlockIteratorFactory(), early_stop=True,
  maximum_unroll=1)``'s block loop (``BlockRunner.decode``); ``nfe_unrolled`` is the forward count with its
  default ``maximum_unroll=4, expected_tpf=8`` (same tokens; forwards after a block completes commit
  nothing). dInfer stops on its single ``eos_id``; ours on every id of ``model.eos_ids``, so these cases run
  with the model's stop ids set to its EOS alone;
- ``span``: the same block loop and diffusion iteration without the EOS break (every block decoded), as
  ``eos_early_stop=False``; ``commits_per_step`` is how many slots each forward committed.

``sampled`` cases ran the same code (tiny random std 0.5 and bundled models) at temperature 1.0 and 0.5
with the random draws of dInfer's ``add_gumbel_noise`` (``torch.rand_like``) replaced by dllm's
counter-based ones (``dllm.core.rng``: ``Stream.TOKENS``, row 0, step = the forward's index, column offset
from the generation start, every vocabulary entry); the official global-RNG draws cannot match a per-row
stream token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "credit_dinfer.json").read_text())
CASES = FIXTURE["cases"]
SAMPLED = FIXTURE["sampled"]


@pytest.fixture(scope="module")
def bundled():
    return {name: dllm.load(name, device="cpu", dtype=torch.float32) for name in ("tiny-llada", "tiny-dream")}


def _model(case, tiny, bundled):
    return bundled[case["model"]] if case["std"] is None else tiny(case["model"], std=case["std"])


def _id(case):
    hp = case["hyper"]
    return (
        f"{case['model']}{case['std'] or ''}-P{len(case['prompt'])}-G{case['max_new_tokens']}-B{case['block_size']}"
        f"-t{hp['threshold']}-a{hp['credit_alpha']}"
    )


def _generate(model, case, hyper, stop, callback=None, **kw):
    return dllm.samplers.get("credit", **hyper).generate(
        model,
        torch.tensor([case["prompt"]]),
        max_new_tokens=case["max_new_tokens"],
        block_size=case["block_size"],
        eos_early_stop=stop,
        callback=callback,
        **{"temperature": 0.0, **kw},
    )


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_whole_span_matches_dinfer(case, tiny, bundled):
    model = _model(case, tiny, bundled)
    commits = []
    out = _generate(model, case, case["hyper"], False, lambda s: commits.append(int(s.committed.sum())))
    assert out.sequences[0].tolist() == case["span"]["sequence"]
    assert out.nfe == case["span"]["nfe"]
    assert commits == case["span"]["commits_per_step"]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_eos_early_stop_matches_dinfer_runner(case, tiny, bundled, monkeypatch):
    model = _model(case, tiny, bundled)
    monkeypatch.setattr(model, "eos_ids", (model.eos_id,))  # dInfer's runner stops on one EOS id
    out = _generate(model, case, case["hyper"], True)
    assert out.sequences[0].tolist() == case["early_stop"]["sequence"]
    assert out.nfe == case["early_stop"]["nfe"]
    assert case["early_stop"]["nfe_unrolled"] >= out.nfe


@pytest.mark.parametrize("case", SAMPLED, ids=lambda c: f"{_id(c)}-T{c['temperature']}")
def test_sampled_matches_dinfer_with_aligned_draws(case, tiny, bundled, monkeypatch):
    model = _model(case, tiny, bundled)
    kw = dict(temperature=case["temperature"], seed=case["seed"])
    commits = []
    out = _generate(model, case, case["hyper"], False, lambda s: commits.append(int(s.committed.sum())), **kw)
    assert out.sequences[0].tolist() == case["span"]["sequence"] and out.nfe == case["span"]["nfe"]
    assert commits == case["span"]["commits_per_step"]
    monkeypatch.setattr(model, "eos_ids", (model.eos_id,))
    out = _generate(model, case, case["hyper"], True, **kw)
    assert out.sequences[0].tolist() == case["early_stop"]["sequence"] and out.nfe == case["early_stop"]["nfe"]


def test_fixture_exercises_the_credit(tiny, bundled):
    """The recorded outputs depend on the credit: without it (α = 0) most cases decode differently, on
    every model; and the fixture has parallel commits, early stops and unrolled forwards."""
    changed = {}
    for case in CASES:
        model = _model(case, tiny, bundled)
        plain = _generate(model, case, {**case["hyper"], "credit_alpha": 0.0}, False)
        differs = plain.sequences[0].tolist() != case["span"]["sequence"] or plain.nfe != case["span"]["nfe"]
        changed.setdefault(case["model"], []).append(differs)
    assert set(changed) == {"llada", "dream", "tiny-llada", "tiny-dream"}
    for name, flags in changed.items():
        assert sum(flags) >= len(flags) // 3, name
    assert any(max(c["span"]["commits_per_step"]) >= 8 for c in CASES)
    assert any(c["early_stop"]["nfe"] < c["span"]["nfe"] for c in CASES)
    assert any(c["early_stop"]["nfe_unrolled"] > c["early_stop"]["nfe"] for c in CASES)
