"""The ``dcd`` sampler (DCD, arXiv 2601.02076, as its released code) and its delayed caches (``Prefix`` / ``Dual``
with ``delay`` and ``refresh_count``): parity with the official rule and their properties.

Parity fixture ``tests/fixtures/dcd_parity.json`` (its ``source`` names what ran and what was left out). Recipe,
outside the repo (the official code lives only under /tmp, never here): take shuyingte/DCD ``decode_algorithm.py``
(``DecodeConfig``, ``sample_tokens``, ``get_decode_num``, ``get_decode_conf_and_indices``,
``window_bidirectional_decode``) without its ``dllm_model`` import; call ``window_bidirectional_decode`` with
``window_type="sliding"``, temperature 0, batch 1, ``eos_id = pad_id`` = the model's first EOS id, on a stand-in
for ``dllm_model.py``'s ``Llada`` / ``Dream`` (lookahead 1) whose ``forward(all_input_ids, cache, predict_range,
use_cache)`` runs the dllm tiny checkpoint (bundled ``tiny-llada`` / ``tiny-dream`` with task prompts, and
``make_tiny_checkpoint(DIR, family, std=0.5 / 2.0)``) over an explicit ``KVStore``: a full forward stores every
column, a cached one computes the wrapper's forward slice (Dream: from the column before) against the store and
writes its K/V in place, as ``replace_position`` does; the mask token's logit at -inf. Record the sequence, the
forwards, the full forwards, whether the EOS padding overwrote a decoded token and the widest window; flag a run
with an exact tie at the boundary of a step's top-k, or whose output holds the model's other EOS id, and leave it out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.samplers.dcd import DCD

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "dcd_parity.json").read_text())
KEYS = ("initial_window_length", "max_window_length", "decode_algo", "decode_param")


def _cache(case):
    if case["cache"] == "none":
        return None
    kind, delay = case["cache"].split("-delay")
    return dllm.caches.get(kind, delay=int(delay), refresh_count=case["refresh_count"])


def _model(tiny, name):
    if name.startswith("tiny-"):
        return dllm.load(name, device="cpu", dtype=torch.float32)
    family, std = name.split(":")
    return tiny(family, std=float(std))


def _case_id(c):
    return f"{c['model']}-P{len(c['prompt'])}-G{c['max_new_tokens']}-{c['cache']}-" + "-".join(str(c[k]) for k in KEYS)


@pytest.fixture(scope="module")
def bundled():
    return {name: dllm.load(name, device="cpu", dtype=torch.float32) for name in ("tiny-llada", "tiny-dream")}


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_case_id)
def test_generation_matches_the_official_loop(tiny, bundled, case):
    model = bundled.get(case["model"]) or _model(tiny, case["model"])
    out = DCD(**{k: case[k] for k in KEYS}).generate(
        model, torch.tensor([case["prompt"]]), max_new_tokens=case["max_new_tokens"], cache=_cache(case)
    )
    assert out.sequences[0].tolist() == case["sequence"]
    assert out.nfe == case["nfe"]


def test_the_fixture_covers_every_branch():
    cases = FIXTURE["cases"]
    assert {c["decode_algo"] for c in cases} == {"threshold", "fixed", "entropy_threshold"}
    assert {c["model"].split(":")[0].removeprefix("tiny-") for c in cases} == {"llada", "dream"}
    assert any(c["overwrote"] for c in cases)  # the EOS padding wrote over decoded tokens
    assert any(c["widest"] == c["max_window_length"] for c in cases)  # the window's cap bound it
    cached = [c for c in cases if c["cache"] != "none"]
    assert {c["cache"].split("-")[0] for c in cached} == {"prefix", "dual"}
    assert any(c["full_forwards"] > 1 for c in cached)  # refresh_count fired
    # the caches' staleness is reproduced, not only the no-cache output: some cached runs differ from it

    def key(c):
        return (c["model"], tuple(c["prompt"]), c["max_new_tokens"], *map(c.get, KEYS))

    plain = {key(c): c["sequence"] for c in cases if c["cache"] == "none"}
    differ = [c for c in cached if key(c) in plain and plain[key(c)] != c["sequence"]]
    assert differ


PROMPTS = ["Sort the list: 14 7 9 33 2\n", "Reverse the list: 3 17 0 8\n", "Tom has 12 apples and buys 7 more.\n"]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("kind", ["prefix", "dual"])
def test_each_row_has_its_own_window_so_a_batch_gives_each_prompt_its_own_output(bundled, name, kind):
    """Rows of mixed prompt lengths, EOS padding at different places, delayed caches: each prompt alone gives its row
    of the batch (the official window is the batch's, which would couple them)."""
    model, sampler = bundled[name], DCD(initial_window_length=6, max_window_length=10)
    cache = dllm.caches.get(kind, delay=2, refresh_count=8)
    batch = sampler.generate(model, PROMPTS, max_new_tokens=32, cache=cache)
    for row, prompt in enumerate(PROMPTS):
        alone = sampler.generate(model, prompt, max_new_tokens=32, cache=cache)
        assert alone.texts[0] == batch.texts[row]


@pytest.mark.parametrize("kind", ["prefix", "dual"])
def test_a_delayed_cache_refreshed_after_every_commit_is_no_cache(bundled, kind):
    """refresh_count=1: every forward after the first follows a commit, so each is a full one: the no-cache output
    and forwards exactly (the delayed region and its K/V writes are then never read)."""
    model, sampler = bundled["tiny-dream"], DCD(initial_window_length=4)
    plain = sampler.generate(model, PROMPTS, max_new_tokens=32, cache=None)
    cached = sampler.generate(model, PROMPTS, max_new_tokens=32, cache=dllm.caches.get(kind, delay=1, refresh_count=1))
    assert cached.sequences.tolist() == plain.sequences.tolist() and cached.nfe == plain.nfe


def test_the_eos_padding_follows_eos_early_stop(bundled):
    """With eos_early_stop (the default) every slot after a row's first EOS is EOS (the official padding), which
    saves forwards; without it DCD decodes every slot itself."""
    model, sampler = bundled["tiny-llada"], DCD(initial_window_length=8)
    padded = sampler.generate(model, PROMPTS, max_new_tokens=32)
    full = sampler.generate(model, PROMPTS, max_new_tokens=32, eos_early_stop=False)
    eos = torch.tensor(model.eos_ids)
    p = padded.prompt_width
    for row in range(len(PROMPTS)):
        span = padded.sequences[row, p:]
        first = int(torch.isin(span, eos).long().argmax())
        assert torch.isin(span, eos).any() and (span[first:] == model.eos_id).all()
    assert padded.nfe < full.nfe  # the padding decoded the tails at once
    assert not (full.sequences[:, p:] == model.mask_id).any()


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_a_window_of_one_mask_decodes_left_to_right(tiny, family):
    """initial_window_length=1 with one commit a step: the window is each row's leftmost mask, so the order is left
    to right (ARness 1) and every slot takes a forward; on a block-causal model (SDAR) the window opens at each
    block's start and moves within it (the official window_causal_decode's)."""
    model = tiny(family)
    kw = {"max_new_tokens": 16, "eos_early_stop": False, **({"block_size": 4} if family == "sdar" else {})}
    out = DCD(initial_window_length=1, decode_algo="fixed", decode_param=1).generate(model, PROMPTS[0], **kw)
    assert out.arness == [1.0]
    steps = {"steps_per_block": 4} if family == "sdar" else {"steps": 16}  # one token a step
    assert out.nfe == dllm.samplers.reference(family).generate(model, PROMPTS[0], **kw, **steps).nfe
    assert not (out.sequences == model.mask_id).any()


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="decode_param"):
        DCD(decode_algo="fixed", decode_param=0.9)
    with pytest.raises(ConfigError, match="decode_algo"):
        DCD(decode_algo="factor")
    with pytest.raises(ConfigError, match="initial_window_length"):
        DCD(initial_window_length=0)
    with pytest.raises(ConfigError, match="delay"):
        dllm.caches.get("dual", delay=-1)
    with pytest.raises(ConfigError, match="refresh_count"):
        dllm.caches.get("prefix", refresh_count=0)
