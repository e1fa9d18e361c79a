"""The ``learn2pd`` sampler (Learn2PD, arXiv 2509.25188, as its released code), its filter files and its training
recipe (:mod:`dllm.train.learn2pd`).

Parity fixture ``tests/fixtures/learn2pd_parity.json`` (its ``source`` names what ran and what was left out), with
the filter ``tests/fixtures/learn2pd_filter.safetensors`` (trained by the recipe on tiny-llada, blocks of 8). Recipe,
outside the repo (the official code lives only under /tmp, never here): transcribe
ims-kdks/Learning-to-Parallel-Decoding ``llada/generate.py``'s ``add_gumbel_noise``, ``get_num_transfer_tokens`` and
``generate_learn2parallel``; call it at temperature 0, batch 1, block_length 8, on a stand-in model whose call
returns the logits of the tiny LLaDA checkpoint loaded in dllm in float64 (bundled ``tiny-llada`` with task prompts;
``make_tiny_checkpoint(DIR, "llada", std=0.5 / 2.0)``; the mask token's logit at -inf), with the fixture filter as its
``small_model``; record the sequence and the forwards; flag a run where ``torch.topk`` broke an exact tie other than
to the leftmost slot, or where a step's quota exceeded the block's masks left (its top-k then takes slots at -inf),
and leave it out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.core.errors import CheckpointError, ConfigError
from dllm.models.tiny import make_tiny_checkpoint
from dllm.samplers.learn2pd import FILTER_FILE, Filter, Learn2PD
from dllm.train import learn2pd as recipe

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = json.loads((FIXTURES / "learn2pd_parity.json").read_text())
FILTER = str(FIXTURES / "learn2pd_filter.safetensors")


def _case_id(c):
    return f"{c['model']}-P{len(c['prompt'])}-G{c['max_new_tokens']}-S{c['steps']}-{c['accept_thres']}"


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_case_id)
def test_generation_matches_the_official_loop(float64_models, case):
    out = Learn2PD(accept_thres=case["accept_thres"], filter=FILTER).generate(
        float64_models(case["model"]),
        torch.tensor([case["prompt"]]),
        max_new_tokens=case["max_new_tokens"],
        steps=case["steps"],
        block_size=case["block_size"],
        eos_early_stop=False,
    )
    assert out.sequences[0].tolist() == case["sequence"]
    assert out.nfe == case["nfe"]


def test_the_fixture_covers_filter_commits_and_quotas_above_one():
    cases = FIXTURE["cases"]
    assert {c["accept_thres"] for c in cases} == {0.96, 0.9, 0.5}
    assert all(c["nfe"] < c["steps"] for c in cases)  # the filter's commits saved forwards in every run
    assert any(c["max_new_tokens"] // c["steps"] > 1 for c in cases)  # quotas of 2 a step


PROMPTS = ["Sort the list: 14 7 9 33 2\n", "Reverse the list: 3 17 0 8\n", "Tom has 12 apples and buys 7 more.\n"]


@pytest.mark.parametrize(
    "name,block", [("tiny-llada", 8), ("tiny-dream", 8), ("tiny-sdar", 4), ("tiny-fast-dllm-v2", 8)]
)
def test_each_bundled_model_ships_a_filter_that_saves_forwards(name, block):
    """The bundled filter (trained by the recipe on the tasks' training split) loads by default, reads the model's
    bench block size, and commits more than the reference schedule at the same answers on these prompts."""
    model = dllm.load(name, device="cpu", dtype=torch.float32)
    kw = {"max_new_tokens": 16, "steps_per_block": block} if model.attention.block_causal else {"steps": 16}
    kw = {"max_new_tokens": 16, **kw}
    out = Learn2PD().generate(model, PROMPTS, block_size=block, **kw)
    reference = dllm.samplers.reference(model.family).generate(model, PROMPTS, block_size=block, **kw)
    assert out.nfe < reference.nfe
    assert not (out.sequences == model.mask_id).any()


def test_a_batch_gives_each_prompt_its_own_output(tiny, confidence_filter, batch_invariant):
    batch_invariant(Learn2PD(filter=confidence_filter(8)), tiny("llada"), PROMPTS, max_new_tokens=16, block_size=8)


def test_the_recipe_records_the_oracle_and_trains_a_filter_that_loads(tmp_path):
    """The extremely greedy oracle's records: one row per forward, the block's confidences in [0, 1] and targets that
    are 0 or 1 (the reference's own first step marks its argmax right); a short training writes a file learn2pd
    loads, with its recipe in the header."""
    model = dllm.load("tiny-llada", device="cpu", dtype=torch.float32)
    records = recipe.records_for(model, block_size=8, n=2, tasks=("listops",))
    assert records.confidence.shape == records.correct.shape and records.confidence.shape[1] == 8
    assert ((records.confidence >= 0) & (records.confidence <= 1)).all()
    assert set(records.correct.unique().tolist()) <= {0.0, 1.0} and records.correct.sum() > 0
    module, metrics = recipe.train_filter(records, epochs=50)
    path = tmp_path / FILTER_FILE
    module.save(path, metrics=metrics)
    assert Filter.load(path).block_size == 8 and metrics["records"] == records.confidence.shape[0]
    assert Learn2PD(filter=str(path)).generate(model, PROMPTS[0], max_new_tokens=16, block_size=8).texts[0]


def test_bad_filters_and_settings_are_refused_with_advice(tiny, tmp_path, confidence_filter):
    model = tiny("llada")
    bare = dllm.load(make_tiny_checkpoint(tmp_path / "bare", "llada"), device="cpu", dtype=torch.float32)
    with pytest.raises(ConfigError, match="python -m dllm.train.learn2pd"):
        Learn2PD().generate(bare, PROMPTS[0], max_new_tokens=16, block_size=8)  # a checkpoint without a filter
    with pytest.raises(ConfigError, match="blocks of 4 slots"):
        Learn2PD(filter=confidence_filter(4)).generate(model, PROMPTS[0], max_new_tokens=16, block_size=8)
    with pytest.raises(CheckpointError, match="no Learn2PD filter file"):
        Learn2PD(filter=str(tmp_path / "missing.safetensors")).generate(model, PROMPTS[0], max_new_tokens=16)
    (tmp_path / "bad.safetensors").write_bytes(b"not a filter")
    with pytest.raises(CheckpointError, match="is not a Learn2PD filter file"):
        Learn2PD(filter=str(tmp_path / "bad.safetensors")).generate(model, PROMPTS[0], max_new_tokens=16)
    with pytest.raises(ConfigError, match="reads every slot of the block"):
        Learn2PD(filter=confidence_filter(8)).generate(model, PROMPTS[0], max_new_tokens=16, cache="dkv")
    with pytest.raises(ConfigError, match="accept_thres"):
        Learn2PD(accept_thres=1.5)


# -- EoTP ------------------------------------------------------------------------------------------------------------
# Parity fixture tests/fixtures/eotp_parity.json: the same recipe with ``llada/generate.py``'s ``generate_predict_eot``
# (EoT, over LLaDA's schedule) and ``generate_l2p_eot`` (L2P+EoT), their EOS id the model's first; the official
# returns the canvas cut after the predicted end, ours keeps the cut columns as EOS padding. Left out: runs where the
# official failed (a cut inside the current block gives its filter fewer inputs than its size), topk ties, quotas above
# the masks left (see its ``source``).
EOTP = json.loads((FIXTURES / "eotp_parity.json").read_text())


def _eotp_id(c):
    return f"{c['method']}-{c['model']}-P{len(c['prompt'])}-G{c['max_new_tokens']}-S{c['steps']}-{c['accept_thres']}"


@pytest.mark.parametrize("case", EOTP["cases"], ids=_eotp_id)
def test_eotp_matches_the_official_loops(float64_models, case):
    if case["method"] == "EoT":
        sampler = dllm.samplers.get("eotp", base="llada", committed_first=False)
    else:
        sampler = dllm.samplers.get("eotp", base="learn2pd", filter=FILTER, accept_thres=case["accept_thres"])
    model = float64_models(case["model"])
    out = sampler.generate(
        model,
        torch.tensor([case["prompt"]]),
        max_new_tokens=case["max_new_tokens"],
        steps=case["steps"],
        block_size=case["block_size"],
        eos_early_stop=False,
    )
    n = len(case["sequence"])
    assert out.sequences[0, :n].tolist() == case["sequence"]
    assert (out.sequences[0, n:] == model.eos_id).all()  # the cut columns
    assert out.nfe == case["nfe"]


def test_the_eotp_fixture_covers_both_methods_cutting():
    cases = EOTP["cases"]
    for method in ("EoT", "L2P+EoT"):
        cut = [
            c for c in cases if c["method"] == method and len(c["sequence"]) < len(c["prompt"]) + c["max_new_tokens"]
        ]
        assert len(cut) >= 5, method


@pytest.mark.parametrize("base", ["llada", "learn2pd"])
def test_eotp_cuts_rows_on_their_own_and_saves_forwards(bundled_llada, base, batch_invariant):
    """A row's cut never moves another's (each prompt alone gives its row of a mixed batch); the cut columns are EOS,
    outside the canvas's valid columns; fewer forwards than the base alone."""
    kw = {"max_new_tokens": 32, "block_size": 8, "steps": 32, "eos_early_stop": False}
    sampler = dllm.samplers.get("eotp", base=base, committed_first=base == "learn2pd")
    batch_invariant(sampler, bundled_llada, PROMPTS, **kw)
    run = sampler.prepare(bundled_llada, PROMPTS, **kw)
    with torch.inference_mode():
        sampler.run(run)
    canvas = run.canvas
    cut = ~canvas.valid[:, canvas.prompt_width :]
    assert cut.any() and (canvas.tokens[:, canvas.prompt_width :][cut] == bundled_llada.eos_id).all()
    plain = dllm.samplers.get(base).generate(bundled_llada, PROMPTS, **kw)
    assert sampler.generate(bundled_llada, PROMPTS, **kw).nfe < plain.nfe


@pytest.fixture(scope="module")
def bundled_llada():
    return dllm.load("tiny-llada", device="cpu", dtype=torch.float32)
