"""The ``cad`` sampler (CD4LM's consistency-aware adaptive decoding, arXiv 2601.02236): parity with the official loop
and its rules.

Parity fixture ``tests/fixtures/cad_parity.json`` (its ``source`` names what ran). Recipe, outside the repo (the
official code lives only under /tmp, never here): copy yihao-liang/CDLM ``scripts/LLaDA_generate_dynamic.py`` and run
``generate_block(model, prompt, gen_length=G, block_length=B, temperature=0, mask_id=..., confidence_threshold=T,
entropy_threshold=E, min_tokens_per_step=lo, max_tokens_per_step=hi, max_steps_per_block=S,
selection_method=M, verbose=False)`` with a model whose forward returns the logits of
``make_tiny_checkpoint(DIR, "llada", std=s)`` loaded in dllm: s in (0.5, 1, 2), three prompts, (G, B, T, lo, hi, S,
M, E) in (16, 8, 0.95, 1, 32, None, confidence), (16, 8, 0.5, 1, 2, None, confidence), (24, 8, 0.8, 2, 4, 2,
confidence), (16, 16, 0.99, 1, 32, 3, confidence), (16, 8, 0.95, 1, 32, None, entropy, -0.3), (16, 8, 0.95, 1, 3,
1, entropy, -1.5); recorded the sequence, its steps (forwards) and the forced ones. The official EOS list holds no id
of the tiny vocabulary, so it suppresses nothing there: dllm runs with ``eos_threshold_ratio=0`` (the suppression is
tested below on its own). A case is kept when the official run is the same with the mask token's logit at -inf (3 of
54 are not: the official argmax proposes the mask token there; dllm never does).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.samplers.cad import CAD

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "cad_parity.json").read_text())
KEYS = ("confidence_threshold", "min_tokens_per_step", "max_tokens_per_step", "max_steps_per_block")


def _case_id(c):
    shape = f"P{len(c['prompt'])}-G{c['max_new_tokens']}-B{c['block_size']}"
    return f"std{c['std']}-{shape}-" + "-".join(str(c[k]) for k in KEYS) + f"-{c['selection_method']}"


@pytest.mark.parametrize("case", FIXTURE["generations"], ids=_case_id)
def test_generation_matches_the_official_loop(matches_recording, case):
    sampler = CAD(
        **{k: case[k] for k in KEYS},
        selection_method=case["selection_method"],
        entropy_threshold=case["entropy_threshold"],
        eos_threshold_ratio=0.0,
    )
    matches_recording(sampler, case)


def test_the_fixture_covers_forced_blocks_caps_and_parallel_commits():
    cases = FIXTURE["generations"]
    assert sum(c["forced"] > 0 for c in cases) >= 10
    assert any(c["nfe"] <= c["max_new_tokens"] // 4 for c in cases)
    assert {c["selection_method"] for c in cases} == {"confidence", "entropy"}


def _step(prob, token, masked, block, decoded_share, step_in_block=0, eos=(9,)):
    """A stand-in step: one row, its span the whole canvas (``decoded_share`` of it decoded), the block ``block``."""
    length = len(prob)
    columns = torch.arange(length)
    masked = torch.tensor([masked])
    decoded = int(decoded_share * length)
    masked_all = masked.clone()
    masked_all[0, :decoded] = False
    return SimpleNamespace(
        canvas=SimpleNamespace(prompt_width=0, span_end=torch.tensor([length]), block_size=block),
        committable=masked,
        masked=masked_all,
        columns=columns,
        scores=SimpleNamespace(prob=torch.tensor([prob]), token=torch.tensor([token])),
        run=SimpleNamespace(eos=torch.tensor(eos)),
        step=torch.tensor([step_in_block]),
    )


def test_eos_is_left_out_before_the_share_of_the_answer_then_allowed():
    prob, token = [0.99, 0.98, 0.97, 0.5], [9, 4, 9, 5]  # (columns 0 and 2 propose EOS, id 9)
    masked = [True, True, True, True]
    early = CAD(confidence_threshold=0.9).select(_step(prob, token, masked, 4, 0.0), None)
    assert early.tolist() == [[False, True, False, False]]
    late = CAD(confidence_threshold=0.9, eos_threshold_ratio=0.0).select(_step(prob, token, masked, 4, 0.0), None)
    assert late.tolist() == [[True, True, True, False]]
    only_eos = CAD(min_tokens_per_step=2).select(_step([0.9, 0.9, 0.2], [9, 9, 9], [True] * 3, 3, 0.0), None)
    assert only_eos.tolist() == [[True, True, False]]  # every mask left out: the min_tokens_per_step leftmost


def test_the_caps_and_the_forced_step():
    prob, token = [0.99, 0.98, 0.97, 0.1], [1, 2, 3, 4]
    masked = [True] * 4
    assert CAD(max_tokens_per_step=2).select(_step(prob, token, masked, 4, 0.5), None).sum() == 2
    assert CAD(min_tokens_per_step=4).select(_step(prob, token, masked, 4, 0.5), None).sum() == 4
    forced = CAD(max_steps_per_block=3).select(_step(prob, [9, 9, 9, 9], masked, 4, 0.0, step_in_block=3), None)
    assert forced.all()  # (its EOS proposals too: the block must end complete)


def test_the_settings_are_checked():
    assert dllm.samplers.defaults("cad")["confidence_threshold"] == 0.95
    with pytest.raises(ConfigError, match="min_tokens_per_step must be at most max_tokens_per_step"):
        CAD(min_tokens_per_step=5, max_tokens_per_step=4)
    with pytest.raises(ConfigError, match="selection_method"):
        CAD(selection_method="margin")
