"""The ``entropy_threshold`` sampler (dParallel, arXiv 2509.26488): parity with the official loops and its rule.

Parity fixture ``tests/fixtures/entropy_threshold_parity.json`` (its ``source`` names what ran). Recipe, outside the
repo (the official code lives only under /tmp, never here): copy czg1225/dParallel ``LLaDA/generate.py`` (its
``model.modeling_llada`` import stubbed) and ``Dream/eval_instruct/model/generation_utils_semiar.py``; run LLaDA's
``generate(model, prompt, steps=G, gen_length=G, block_length=B, temperature=0, mask_id=..., threshold=T)`` and
Dream's ``DreamGenerationMixin._sample`` (``alg="entropy_threshold"``, ``threshold=T``, ``block_length=B``) with a
model whose forward returns the logits of ``make_tiny_checkpoint(DIR, family, std=s)`` loaded in dllm (for Dream
unshifted, as its official model returns them; the model's own logits are checked against the official modeling by
``test_parity`` / ``test_dream``): s in (0.5, 1, 2), three prompts, (G, B, T) in (16, 8, 0.5), (16, 8, 2),
(32, 32, 3), (24, 8, 1.5), (16, 16, 100), (16, 8, 0); greedy, batch 1; recorded the sequence and the forwards. A
case is kept when the official run is the same with the mask token's logit at -inf (7 of 108 are not: the official
argmax proposes the mask token there, or its probability moves an entropy across the threshold, on these random
models whose mask token is as likely as any; dllm never proposes it and leaves it out of the statistics).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.samplers.entropy_threshold import EntropyThreshold, entropy_threshold

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "entropy_threshold_parity.json").read_text())


def _case_id(c):
    return (
        f"{c['family']}-std{c['std']}-P{len(c['prompt'])}-G{c['max_new_tokens']}-B{c['block_size']}-T{c['threshold']:g}"
    )


@pytest.mark.parametrize("case", FIXTURE["generations"], ids=_case_id)
def test_generation_matches_the_official_loop(matches_recording, case):
    matches_recording(EntropyThreshold(threshold=case["threshold"]), case)


def test_the_fixture_covers_both_families_parallel_commits_and_one_token_per_step():
    cases = FIXTURE["generations"]
    for family in ("llada", "dream"):
        mine = [c for c in cases if c["family"] == family]
        assert any(c["nfe"] <= c["max_new_tokens"] // 4 for c in mine)  # (parallel commits)
        assert any(c["max_new_tokens"] // 2 < c["nfe"] < c["max_new_tokens"] for c in mine)  # (some steps wait)
        assert any(c["nfe"] == c["max_new_tokens"] for c in mine if c["threshold"] == 0)  # (one token a step)


def test_the_rule_takes_the_lowest_entropy_slot_and_every_one_under_the_threshold():
    h = torch.tensor([[0.7, 0.5, 0.3, 0.3, 0.1, 2.0], [0.9, 0.8, 0.5, 0.6, 0.7, 0.0]])
    committable = torch.tensor([[True, True, True, True, False, True], [True, True, False, True, True, False]])
    # row 0: the 0.1 is not a candidate; the lowest candidates tie at 0.3 (both in: under the threshold)
    got = entropy_threshold(h, committable, 0.5)
    assert got[0].tolist() == [False, True, True, True, False, False]  # (LLaDA's <=: the 0.5 too)
    assert entropy_threshold(h, committable, 0.5, strict=True)[0].tolist() == [False, False, True, True, False, False]
    assert got[1].tolist() == [False, False, False, True, False, False]  # nothing under: the lowest candidate alone
    assert entropy_threshold(h, committable, 0.0)[0].tolist() == [False, False, True, False, False, False]  # leftmost
    assert not entropy_threshold(h, torch.zeros_like(committable), 10.0).any()  # no candidate: nothing


def test_the_threshold_defaults_to_the_familys_script():
    assert dllm.samplers.defaults("entropy_threshold") == {"threshold": None}
    assert EntropyThreshold().resolved("dream") == (0.45, True)
    assert EntropyThreshold().resolved("llada") == (0.5, False)
    assert EntropyThreshold(threshold=1.0).resolved("sdar") == (1.0, False)
    with pytest.raises(ConfigError, match="threshold"):
        EntropyThreshold(threshold=-1.0)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_a_larger_threshold_never_takes_more_forwards(family, tiny):
    model = tiny(family)
    kw = {"max_new_tokens": 16, "eos_early_stop": False, **({"block_size": 8} if family == "llada" else {})}
    nfe = [EntropyThreshold(threshold=t).generate(model, torch.tensor([[10, 11, 12]]), **kw).nfe for t in (0, 1, 2, 50)]
    assert nfe == sorted(nfe, reverse=True) and nfe[0] >= 16 and nfe[-1] <= 5  # (50 nats: a block per forward)
