"""Parity of the ``s2d2`` sampler with the official S2D2 code, phymhan/S2D2 @279500a
``SDAR/generate_ssd_policy.py::block_diffusion_generate`` (tests/fixtures/s2d2_sdar.json).

How the fixture was recorded (outside the repository): the official function was run unmodified, batch 1,
``temperature=0.0, do_sample=False, stopping_criteria_idx=None, return_forward_stats=True``, on three
SDAR models loaded with ``dllm.load`` in float32 on the CPU: ``make_tiny_checkpoint(dir, "sdar", seed=0,
std=0.5)`` (block 4), ``make_tiny_checkpoint(dir, "sdar", seed=1, std=1.0, block_size=8)`` and the bundled
``tiny-sdar`` (block 4, prompts from its tokenizer). The model it drives is a shim with the call signature
of the official ``modeling_sdar.py`` (``model(x, attention_mask=, position_ids=, past_key_values=
DynamicCache, use_cache=, store_kv=).logits``) computing our model's layers: ``store_kv=True`` appends the
fresh K/V to the ``DynamicCache`` (``cache.update``) and attends to ``[cache | fresh]``, ``store_kv=False``
attends to ``[cache | fresh]`` without storing, the official 0/1 or boolean masks are used as boolean
attention masks (the adapter's numerics match the official modeling code: tests/test_parity_sdar.py).
Two further shims, both our documented semantics: the mask token's logit is -inf (dllm never proposes it,
as for the SDAR fixture), and greedy verification: the verifier's logits are left as they are, the official
module's ``torch.rand`` (the acceptance coins of ``torch.rand < min(1, (q/p)**gamma)``) is replaced by -1
(accept) where the draft is the verifier's argmax (or gamma = 0, whose ratio is always 1) and 2 (reject)
elsewhere, and ``_reject_resample_from_delta`` by the argmax of q. So acceptance and the residual resample are
greedy whatever the seed, while ``ssd_ratio_threshold`` compares the official soft ratio (q the verifier's
temperature-1 float32 softmax at the draft, p the draft's probability clamped at 1e-12). (Unshimmed, the
official ``do_sample=False`` path accepts stochastically from the soft verifier distribution.) The first 114
cases were first recorded with one-hot verifier logits instead (0 at the argmax, -inf elsewhere), which also
makes the threshold's ratio 0 or 1, unlike the official; recorded again with the recipe above they come out
identical, and the ``soft_ratio_*`` cases (recorded with it), where a one-hot ratio differs, check the soft
one. The shim also counted the official forwards by kind (prefill, draft, verify, store).

Cases: 28 hyper-parameter settings (defaults; span lengths and the legacy span rule; the three remasking
strategies; the README's SDAR configs A and B with ``cache_ver`` and ``draft_ver``; each alone; score
threshold and hysteresis policies with every acceptance estimator; the UCB bandit over span and masked
entropies; ratio thresholds within the span and over all spans; ``always_check_high_confidence``;
``allow_resample=False``; ratio tempering 0; soft ratio thresholds with tempering 0.25 and 2, within the span
and over all spans), prompts shorter than, longer than and a multiple of the block, ``steps_per_block`` of
block, block / 2 and 1. Verification accepts whole spans, rejects at the first draft
and stops in between in these cases (checked below).

NFE: the official ``total_forward_steps`` counts a prefill forward (prompts of at least one block) and one
K/V store forward per block; ours folds both into the next drafting forward (the SDAR block cache), so our
``nfe`` is the official count of drafting and verifier forwards, and the official total is ours plus one
per decoded block plus the prefill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.models.tiny import make_tiny_checkpoint

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "s2d2_sdar.json").read_text())
CASES = [(name, i) for name, data in FIXTURE["models"].items() for i in range(len(data["cases"]))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, data in FIXTURE["models"].items():
        spec = data["checkpoint"]
        if "bundled" in spec:
            out[name] = dllm.load(spec["bundled"], device="cpu", dtype=torch.float32)
        else:
            directory = tmp_path_factory.mktemp("s2d2_parity")
            make_tiny_checkpoint(directory, spec["family"], seed=spec["seed"], std=spec["std"], **spec["shape"])
            out[name] = dllm.load(directory, device="cpu", dtype=torch.float32)
        assert out[name].block_size == data["block_size"]
    return out


def _generate(model, case, cache="default", callback=None):
    sampler = dllm.samplers.get("s2d2", **case["hyper"])
    return sampler.generate(
        model,
        torch.tensor([case["prompt"]]),
        attention_mask=torch.ones(1, len(case["prompt"]), dtype=torch.long),
        steps_per_block=case["steps_per_block"],
        max_new_tokens=case["max_new_tokens"],
        block_size=model.block_size,
        temperature=0.0,
        eos_early_stop=False,
        cache=cache,
        callback=callback,
    )


def _id(item):
    name, i = item
    case = FIXTURE["models"][name]["cases"][i]
    return f"{name}-{case['name']}-P{len(case['prompt'])}-S{case['steps_per_block']}"


@pytest.mark.parametrize("item", CASES, ids=[_id(c) for c in CASES])
def test_matches_official_tokens_and_forwards(models, item):
    name, i = item
    case = FIXTURE["models"][name]["cases"][i]
    model = models[name]
    out = _generate(model, case)
    assert out.sequences.tolist() == [case["official"]]
    forwards = case["forwards"]
    assert out.nfe == forwards["draft"] + forwards["verify"]
    bs = model.block_size
    prompt_len = len(case["prompt"])
    prefill = int(prompt_len >= bs)
    blocks = (len(case["official"]) - prompt_len // bs * bs) // bs
    assert forwards["prefill"] == prefill and forwards["store"] == blocks
    assert case["total_forward_steps"] == out.nfe + prefill + blocks


NO_CACHE = [c for c in CASES if FIXTURE["models"][c[0]]["cases"][c[1]]["name"] in ("paperA", "draft_ver", "ucb_span")]


@pytest.mark.parametrize("item", NO_CACHE, ids=[_id(c) for c in NO_CACHE])
def test_without_cache_same_tokens_and_forwards(models, item):
    """A full forward each step (the verifier over the whole extended canvas) equals the cached run."""
    name, i = item
    case = FIXTURE["models"][name]["cases"][i]
    out = _generate(models[name], case, cache=None)
    assert out.sequences.tolist() == [case["official"]]
    assert out.nfe == case["forwards"]["draft"] + case["forwards"]["verify"]


def test_fixture_exercises_acceptance_rejection_and_routing(models):
    """Among the recorded default-policy runs, verifier steps commit whole multi-token spans (long accepted
    prefixes) and single tokens out of longer spans (rejection at the first draft); routing policies skip
    the verifier in some steps."""
    seen = []  # (masks in the block before the step, tokens committed)

    def record(info, model):
        bs, mask_id = model.block_size, model.mask_id
        committed = info.committed[0].nonzero().squeeze(1)
        start = int(committed.min()) // bs * bs  # batch 1, no padding: blocks start at multiples of bs
        before = (info.tokens[0, start : start + bs] == mask_id) | info.committed[0, start : start + bs]
        seen.append((int(before.sum()), committed.numel()))

    for name, data in FIXTURE["models"].items():
        for case in data["cases"]:
            if case["name"] == "default" and case["steps_per_block"] == data["block_size"]:
                _generate(models[name], case, callback=lambda info, m=models[name]: record(info, m))
    # the default policy verifies every step and commits from the left of the block's masks: the span is
    # all of them; committing all but the last of >= 2 is a long accepted prefix, one of >= 2 a first reject
    assert sum(1 for span, n in seen if span >= 3 and n == span) > 5  # whole spans of >= 3 accepted
    assert sum(1 for span, n in seen if span >= 2 and n == 1) > 5  # rejected at the first draft
    assert sum(1 for span, n in seen if 1 < n < span) > 5  # stopped in between
    skipping = [c for d in FIXTURE["models"].values() for c in d["cases"] if c["name"] != "default"]
    assert any(0 < c["forwards"]["verify"] < c["forwards"]["draft"] for c in skipping)
    assert any(c["forwards"]["verify"] == 0 for c in skipping)


def test_ratio_threshold_compares_the_soft_ratio_when_greedy(models):
    """issue 18 item 2: tiny-sdar, ``ssd_ratio_tempering_factor=0.25, ssd_ratio_threshold=0.5,
    ssd_threshold_all_spans=True`` at temperature 0: the official commits by the soft ratio min(1, (q/p)**0.25)
    (NFE 10 here, 15 official forwards with its prefill and stores); a one-hot verifier ratio gave another
    token and NFE 12."""
    (case,) = [
        c
        for c in FIXTURE["models"]["tiny-sdar"]["cases"]
        if c["name"] == "soft_ratio_all" and c["prompt"] == [32, 228, 22, 244] and c["steps_per_block"] == 4
    ]
    hyper = {"ssd_ratio_tempering_factor": 0.25, "ssd_ratio_threshold": 0.5, "ssd_threshold_all_spans": True}
    assert case["hyper"] == hyper
    out = _generate(models["tiny-sdar"], case)
    assert out.nfe == 10 == case["forwards"]["draft"] + case["forwards"]["verify"]
    assert out.sequences.tolist() == [case["official"]]
