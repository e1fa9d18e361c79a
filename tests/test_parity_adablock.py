"""Parity with AdaBlock-dLLM's official no-cache samplers (lgxi24/AdaBlock-dLLM, commit 491b205).

Recorded outside this repository by running, on
- the tiny random checkpoints of ``tests/conftest.py`` (``tiny(family, std=...)``: seed 0, std 0.5 and 1.0,
  LLaDA and Dream) with random prompts, delimiters = the three tokens the model proposes most often at the
  first forward (so that blocks do adapt), and
- the bundled trained ``tiny-llada`` / ``tiny-dream`` with prompts of the bench tasks ``arith`` and ``listops``,
  delimiters = newline and period of their tokenizer (ids 6 and 234),
the official code, greedy, batch 1, steps = max_new_tokens, the whole span decoded:
- ``adablock-llada-code``: ``llada/generate_adablock.py`` ``generate_adablock`` (only its model / tokenizer
  imports dropped), the model wrapped so that ``model(x).logits`` is our aligned logits (Dream models too:
  the shift is the adapter's) with the mask-id logit at -inf;
- ``adablock-dream-code``: ``dream/model/generation_utils_adablock.py`` ``DreamGenerationMixin._sample_adablock``
  (alg ``confidence_threshold``) bound to a shim whose ``self(x, "full", None).logits`` are our unshifted Dream
  logits (the LM head on our hidden states, mask-id logit at -inf; the official code shifts them itself), with
  the function's hard-coded delimiter list replaced by the case's; ``adablock-dream-code-unshimmed``: the
  same with its own 24 hard-coded Qwen delimiter ids (passed to ours as ``delimiter_ids``).
Settings: (τ, δ) in (0.9, 0.3), (0.9, 0.05), (0.6, 0.5), (0.9, inf); (max_new_tokens, init_block_length) in
(32, 8), (30, 7) (not a multiple), (32, 32), (24, 4). Every case asserts the tokens and the number of forwards;
``blocks`` is the official block history and ``adaptation_matters`` marks the cases whose output or forward
count differs from δ = inf (fixed blocks; also recorded with the official code).

Sampled cases (``adablock-llada-code``, ``temperature`` 1.0 and 2.0, ``seed`` 3, on llada-1.0, dream-1.0 and the
bundled models): the official ``add_gumbel_noise``'s ``torch.rand_like`` (its only random draws; they also pick
the window's proposals) was replaced by dllm's counter-based float64 draws for (seed, row 0, step = index of the
forward, column offset from the generation start), ``CounterRNG(seed).uniform(Stream.TOKENS, ...)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "adablock_parity.json").read_text())
_BUNDLED = {}


def model_of(key, tiny):
    """``dream-1.0`` -> tiny(``dream``, std=1.0); ``tiny-dream`` -> the bundled checkpoint (float32, CPU)."""
    if key.startswith("tiny-"):
        if key not in _BUNDLED:
            _BUNDLED[key] = dllm.load(key, device="cpu", dtype=torch.float32)
        return _BUNDLED[key]
    family, std = key.split("-")
    return tiny(family, std=float(std))


def _hyper(case):
    h = dict(case["hyper"])
    h["delimiter_threshold"] = float(h["delimiter_threshold"])  # "inf" in JSON
    return h


def _id(case):
    h = case["hyper"]
    return (
        f"{case['code']}-{case['model']}-{case['prompt_name']}-G{case['max_new_tokens']}-B{case['block_size']}-"
        f"t{h['threshold']}-d{h['delimiter_threshold']}-T{case.get('temperature', 0.0)}"
    )


@pytest.mark.parametrize("rec", FIXTURE["logits"], ids=lambda r: r["model"])
def test_model_logits_as_recorded(tiny, rec):
    model = model_of(rec["model"], tiny)
    x = torch.tensor([rec["prompt"] + [model.mask_id] * rec["gen"]])
    logits = model.logits(x, model.positions(torch.ones_like(x, dtype=torch.bool)))[0, rec["cols"]]
    torch.testing.assert_close(logits[:, rec["vocab"]], torch.tensor(rec["values"]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
def test_generation_matches_official(tiny, case):
    model = model_of(case["model"], tiny)
    n = case["max_new_tokens"]
    blocks = []
    out = dllm.samplers.get("adablock", **_hyper(case)).generate(
        model,
        torch.tensor([case["prompt"]]),
        steps=n,
        max_new_tokens=n,
        block_size=case["block_size"],
        temperature=case.get("temperature", 0.0),
        seed=case.get("seed"),
        eos_early_stop=False,
        callback=lambda info: blocks.append(int(info.block[0])),
    )
    assert out.sequences[0].tolist() == case["sequence"]
    assert out.nfe == case["nfe"]
    assert len(set(blocks)) == len(case["blocks"])


def test_fixture_exercises_adaptive_blocks():
    cases = FIXTURE["cases"]
    for code in ("adablock-llada-code", "adablock-dream-code"):
        assert sum(c["adaptation_matters"] is True for c in cases if c["code"] == code) >= 5
    assert any(c["adaptation_matters"] for c in cases if c["model"].startswith("tiny-"))
    assert sum(c.get("temperature", 0) > 0 for c in cases) >= 10
    # blocks both shorter and longer than init_block_length, and the span not a multiple of it
    assert any(min(c["blocks"][:-1] or [c["block_size"]]) < c["block_size"] for c in cases)
    assert any(max(c["blocks"]) > c["block_size"] for c in cases)
    assert any(c["max_new_tokens"] % c["block_size"] for c in cases)
