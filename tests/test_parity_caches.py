"""Parity of the caches with their official implementations, against outputs recorded from them.

Fast-dLLM (``fastdllm_caches.json``): NVlabs/Fast-dLLM ``llada/generate.py`` at commit f6b35ec,
``generate_with_prefix_cache`` and ``generate_with_dual_cache`` (its ``get_transfer_index`` with a step
schedule = our ``llada`` sampler with ``float64_confidence=True``, with ``threshold=`` = ``threshold``, and
``get_transfer_index_dynamic`` with ``factor=`` = ``factor``), greedy, batch 1, on the tiny random LLaDA
checkpoints (``make_tiny_checkpoint(dir, "llada", seed=0, std=0.5 / 1.0)``) and the bundled ``tiny-llada``
(task prompts). The functions were run unchanged (transcribed outside the repo, the unused
``step_callback`` dropped) on a shim model that serves their calls ``model(x, use_cache=True,
past_key_values=..., replace_position=...)`` with our weights through a hand-written forward (not dllm's
K/V store or caches) that follows the official ``modeling_llada.py``: pre-RoPE K/V returned per layer,
concatenated after the given prefix (prefix cache) or written in place at ``replace_position`` (dual
cache), RoPE applied to the whole key tensor and to the queries at their positions, no attention mask;
the mask token's logit set to -inf (dllm never proposes it). Recorded: the sequence and the official
``nfe``.

dKV-Cache (``dkv_llada.json``): horseee/dKV-Cache ``generation_utils/llada_dkv_cache_decode.py`` at commit
49a76fc, ``generate(enable_cache=True, cache_reloading_step=R)`` with R in {8 (the README's LLaDA setting),
4, 2}, low_confidence remasking (float64 confidences), greedy, batch 1, the same checkpoints. The official
file ran unchanged; its model import was stubbed and the model was a shim that serves
``set_qkv_cache`` / ``get_pos_rotary_embedding_cache`` / ``model(x, past_query_key_values=..., use_cache=...,
preprocess_cache=...)`` with our weights, following ``models/modeling_llada_dkv_cache_decode.py``:
pre-RoPE K/V rows of the decoded set cached in canvas order, a cached step feeding ``x[~prv]`` with keys
``[fresh rows, cached rows of prv]`` and RoPE positions gathered in that order, the new cache taken at
``cur``. ``nfe`` = the shim's forward calls (every official step is one forward).

Most recorded outputs differ from the no-cache output (the test checks it), so the caches' staleness is
reproduced, not only their exact steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm

FIXTURES = Path(__file__).parent / "fixtures"
FASTDLLM = json.loads((FIXTURES / "fastdllm_caches.json").read_text())["cases"]
DKV = json.loads((FIXTURES / "dkv_llada.json").read_text())["cases"]


@pytest.fixture(scope="module")
def models(tiny):
    bundled = dllm.load("tiny-llada", device="cpu", dtype=torch.float32)

    def get(name):
        return bundled if name == "tiny-llada" else tiny("llada", std=float(name.split(":")[1]))

    return get


def _fastdllm_id(c):
    shape = f"P{len(c['prompt'])}-G{c['max_new_tokens']}-BL{c['block_size']}-S{c['steps']}"
    return f"{c['model']}-{c['cache']}-{c['sampler']}{c['value'] or ''}-{shape}"


def _sampler(c):
    if c["sampler"] == "llada":
        return dllm.samplers.get("llada", float64_confidence=True)
    return dllm.samplers.get(c["sampler"], **{c["sampler"]: c["value"]})


def _generate(model, c, sampler, cache):
    kw = {"steps": c["steps"]} if c.get("sampler", "llada") == "llada" else {}
    return sampler.generate(
        model,
        torch.tensor([c["prompt"]]),
        max_new_tokens=c["max_new_tokens"],
        block_size=c["block_size"],
        eos_early_stop=False,
        cache=cache,
        **kw,
    )


@pytest.mark.parametrize("case", FASTDLLM, ids=_fastdllm_id)
def test_fastdllm_prefix_and_dual_cache_match_official(models, case):
    out = _generate(models(case["model"]), case, _sampler(case), case["cache"])
    assert out.sequences[0].tolist() == case["sequence"]
    assert out.nfe == case["nfe"]


def _dkv_id(c):
    shape = f"P{len(c['prompt'])}-G{c['max_new_tokens']}-BL{c['block_size']}-S{c['steps']}"
    return f"{c['model']}-R{c['cache_reloading_step']}-{shape}"


@pytest.mark.parametrize("case", DKV, ids=_dkv_id)
def test_dkv_cache_matches_official(models, case):
    cache = dllm.caches.get("dkv", cache_reloading_step=case["cache_reloading_step"])
    out = _generate(models(case["model"]), case, _sampler({"sampler": "llada"}), cache)
    assert out.sequences[0].tolist() == case["sequence"]
    assert out.nfe == case["nfe"]


def test_the_fixtures_are_not_the_no_cache_output(models):
    """A cache that silently recomputed everything would pass the parity tests only where the recorded
    output equals the no-cache one: most recorded cases differ from it."""
    differ = total = 0
    for case in FASTDLLM[::6] + DKV[::4]:
        c = {"sampler": "llada", **case}
        out = _generate(models(c["model"]), c, _sampler(c), None)
        differ += out.sequences[0].tolist() != c["sequence"]
        total += 1
    assert differ >= total // 2
    assert {c["cache"] for c in FASTDLLM} == {"prefix", "dual"}
    assert {c["sampler"] for c in FASTDLLM} >= {"llada", "threshold"}
