"""The ``ccd`` sampler (CCD, arXiv 2512.02044, as its released code): parity with the official rule and its
properties.

Parity fixture ``tests/fixtures/ccd_parity.json`` (its ``source`` names what ran and what was left out). Recipe,
outside the repo (the official code lives only under /tmp, never here): take tonyckc/CCD-DLM-code ``model.py``'s
helpers (``top_p_logits``, ``top_k_logits``, ``sample_tokens``) and ``ExtendedDreamModel._sample_inference_lookahead``
as a plain function, without its transformers imports; call it with ``step_alloc_type="uniform"``, temperature 0,
``alg_temp`` None, no attention mask, on a stand-in model whose call returns the logits of
``make_tiny_checkpoint(DIR, "dream", std=std)`` loaded in dllm (the mask token's logit at -inf, moved one column
left for the official loop to shift back); record the sequence and the forwards; flag a run where the masked slots'
confidences hold an exact tie at some step, or whose output keeps a mask, and leave it out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dllm
from dllm.core.errors import ConfigError
from dllm.samplers.ccd import CCD

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "ccd_parity.json").read_text())
KEYS = ("alg", "seek_mode", "expand_ratio")


def _case_id(c):
    shape = f"std{c['std']}-P{len(c['prompt'])}-G{c['max_new_tokens']}-S{c['steps']}"
    return shape + "-" + "-".join(str(c[k]) for k in KEYS)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_case_id)
def test_generation_matches_the_official_loop(matches_recording, case):
    matches_recording(CCD(**{k: case[k] for k in KEYS}), {**case, "family": "dream"})


def test_the_fixture_covers_coherent_commits_both_modes_and_several_per_step():
    cases = FIXTURE["cases"]
    assert {c["alg"] for c in cases} == {"entropy", "maskgit_plus", "topk_margin"}
    assert {c["seek_mode"] for c in cases} == {True, False}
    assert any(c["max_new_tokens"] // c["steps"] > 1 for c in cases)  # k > 1
    assert any(c["seek_mode"] and c["nfe"] < c["steps"] for c in cases)  # CCD-DS took coherent sets


PROMPTS = ["Sort the list: 14 7 9\n", "Ben has 3 apples. He gets 5 more.\n"]


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_the_uniform_mode_takes_its_steps_and_seek_mode_no_more(family, tiny):
    """seek_mode=False commits exactly k a step (k of the coherent ones or the k most confident), so a block takes
    its steps exactly; CCD-DS commits at least k a step. Every slot is decoded, in blocks on every masked family."""
    model = tiny(family)
    block = {"block_size": 4, "steps_per_block": 2} if family == "sdar" else {"block_size": 8, "steps": 8}
    kw = {"max_new_tokens": 16, "eos_early_stop": False, **block}
    uniform = CCD(seek_mode=False).generate(model, PROMPTS, **kw)
    seek = CCD().generate(model, PROMPTS, **kw)
    steps = dllm.samplers.reference(family).generate(model, PROMPTS, **kw).nfe  # every block its steps
    assert uniform.nfe == steps and seek.nfe <= steps
    for out in (uniform, seek):
        assert not (out.sequences == model.mask_id).any()


def test_a_row_decodes_as_it_does_alone(tiny):
    model = tiny("dream", std=1.0)
    kw = {"max_new_tokens": 24, "steps": 24, "eos_early_stop": False}
    batch = CCD().generate(model, PROMPTS, **kw)
    for row, prompt in enumerate(PROMPTS):
        alone = CCD().generate(model, [prompt], **kw)
        assert batch.texts[row] == alone.texts[0]


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="alg"):
        dllm.samplers.get("ccd", alg="origin")
    with pytest.raises(ConfigError, match="expand_ratio"):
        dllm.samplers.get("ccd", expand_ratio=-1.0)
