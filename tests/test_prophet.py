"""Prophet (``dllm.samplers.get("prophet", ...)``): parity with the official code, batch invariance,
reduction to LLaDA, composition over adaptive bases, and bad hyper-parameters.

``fixtures/prophet_parity.json`` was recorded outside the repository by running the official
``generate`` of ``pixeli99/Prophet@460afe4`` ``generate_earlyexit.py`` (``analyze_gap=True``; CPU, float32,
temperature 0, batch 1) with ``model(x).logits`` returning dllm's logits of the same weights: the tiny random
LLaDA checkpoint ``make_tiny_checkpoint(dir, "llada", seed=0, std=0.5)`` and the bundled ``tiny-llada``
(prompts: ``dllm.tasks`` arith / listops test examples). Shims: the mask token's logit was set to -1e30
(it stays -1e30 after the CFG combination; dllm never proposes the mask token), and ``torch.topk`` was
replaced by a stable sort so that exact confidence ties (the trained tiny model saturates probabilities)
go to the lower column, as dllm's ``top_k_per_row`` does. Settings: generation 24 / 32, blocks 8 / 16 / 32,
steps 16 / 24 / 32 / 64 (also more steps than masks per block), answer regions in the span, clipped at
its end and starting in the prompt, constraints, ``cfg_scale`` 0.5 / 1; thresholds that exit in the early,
mid and late phases (placed between two gaps the official run recorded), the defaults, never, and no answer
region. NFE is the number of rows the official passed to the model (two per step with guidance).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError, DllmWarning
from dllm.models.tiny import make_tiny_checkpoint
from dllm.samplers.prophet import Prophet

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "prophet_parity.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, spec in FIXTURE["checkpoints"].items():
        if not name.endswith("llada"):
            continue
        if spec == "bundled":
            out[name] = dllm.load(name, device="cpu", dtype=torch.float32)
        else:
            d = make_tiny_checkpoint(tmp_path_factory.mktemp(name), spec["family"], seed=spec["seed"], std=spec["std"])
            out[name] = dllm.load(d, device="cpu", dtype=torch.float32)
    return out


def _id(c):
    return f"{c['model']}-{c['prompt']}-G{c['G']}-BL{c['BL']}-S{c['S']}-{c['label']}-" + "-".join(
        k for k in sorted(c["hyper"]) if k not in ("answer_start_pos", "early_exit_thresholds")
    )


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[_id(c) for c in FIXTURE["cases"]])
def test_matches_official(models, case):
    ids = torch.tensor([FIXTURE["prompts"][case["prompt"]]])
    out = dllm.samplers.get("prophet", **case["hyper"]).generate(
        models[case["model"]],
        ids,
        attention_mask=torch.ones_like(ids),
        steps=case["S"],
        max_new_tokens=case["G"],
        block_size=case["BL"],
        temperature=0.0,
        eos_early_stop=False,
    )
    assert out.sequences[0].tolist() == case["official"]
    assert out.nfe == case["nfe"]


def test_fixture_covers_every_phase_and_no_exit():
    labels = {(c["label"], c["exit_step"] is not None) for c in FIXTURE["cases"]}
    for phase in ("early", "mid", "late"):
        assert (phase, True) in labels
    assert ("never", False) in labels and ("no_region", False) in labels
    assert any(c["exit_step"] and "constraints" in c["hyper"] for c in FIXTURE["cases"])
    assert any(c["exit_step"] and c["hyper"].get("cfg_scale") for c in FIXTURE["cases"])


PROMPTS = [[2, 40, 51, 62, 73, 84], [2, 17, 28, 39, 44, 55, 66, 77, 88, 91, 12], [2, 30, 31]]


def _batch(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


FILLER = [2] + list(range(20, 34))  # longer than every prompt: changes the padding of the others


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("base", [{}, {"base": "threshold", "threshold": 0.5}, {"cfg_scale": 1.0}])
def test_each_prompt_alone_equals_its_row_in_a_padded_batch(tiny, base, temperature):
    """The answer region is given as a canvas column: the same generation offset (6) in the batch (whose
    prompt width is the longest prompt) and alone. Constraints; rows exit at different steps. Greedy: each
    prompt alone; sampled: the random streams are keyed by the row index, so the prompt keeps its row index
    and the rows before it hold a longer prompt (different padding, other rows)."""
    model = tiny("llada")
    hyper = dict(base, early_exit_thresholds={"early": 1.2, "mid": 0.8, "late": 0.4}, constraints={3: 45})
    ids, mask = _batch(PROMPTS)
    kw = dict(max_new_tokens=32, block_size=8, temperature=temperature, seed=7, eos_early_stop=False)
    if base.get("base") != "threshold":  # an adaptive base refuses steps
        kw["steps"] = 32
    batch = dllm.samplers.get("prophet", answer_start_pos=ids.shape[1] + 6, **hyper).generate(
        model, ids, attention_mask=mask, **kw
    )
    finished = []
    for row, p in enumerate(PROMPTS):
        others = [FILLER] * row if temperature else []
        alone_ids, alone_mask = _batch(others + [p])
        width = alone_ids.shape[1]
        alone = dllm.samplers.get("prophet", answer_start_pos=width + 6, **hyper).generate(
            model, alone_ids, attention_mask=alone_mask, **kw
        )
        mine = len(others)
        assert batch.sequences[row, ids.shape[1] :].tolist() == alone.sequences[mine, width:].tolist()
        assert alone.sequences[mine, width + 3] == 45
        finished.append(alone.nfe if not others else None)
    if not temperature and not base:
        assert len(set(finished)) > 1 and min(finished) < 32  # rows exit at different steps


@pytest.mark.parametrize(
    "settings",
    [
        dict(steps=32, block_size=8),
        dict(steps=16, block_size=32),
        dict(steps=24),
        dict(steps=64, block_size=8),  # more steps than masks per block: steps that commit nothing
        dict(steps=1000, block_size=8),
        dict(steps=64, block_size=8, temperature=1.0, seed=3, eos_early_stop=True),
    ],
)
def test_without_answer_region_equals_llada(tiny, settings):
    """Without an answer region (or with analyze_gap=False) Prophet never exits and, as its warning says, the run
    is its base sampler alone: the same tokens and the same forwards (no forward at a step that commits nothing)."""
    model = tiny("llada")
    ids, mask = _batch(PROMPTS)
    kw = dict(max_new_tokens=24 if settings.get("steps") == 24 else 32, block_size=8, eos_early_stop=False)
    kw.update(settings)
    llada = dllm.samplers.get("llada").generate(model, ids, attention_mask=mask, **kw)
    for off in ({"answer_start_pos": None}, {"answer_start_pos": ids.shape[1], "analyze_gap": False}):
        with pytest.warns(DllmWarning, match="never exits early: this run is its base sampler alone"):
            prophet = dllm.samplers.get("prophet", **off).generate(model, ids, attention_mask=mask, **kw)
        assert torch.equal(prophet.sequences, llada.sequences)
        assert prophet.nfe == llada.nfe


@pytest.mark.parametrize("cache", [None, "dual"])
def test_without_answer_region_equals_an_adaptive_base_on_its_commit_path(tiny, cache):
    """Over ``threshold`` (whose commit is kernel B's rule) with or without a cache: the base's tokens, forwards and
    commit path (Generation.select_calls), the answer region's columns not computed."""
    model = tiny("llada")
    ids, mask = _batch(PROMPTS)
    kw = dict(max_new_tokens=32, block_size=8, attention_mask=mask, cache=cache)
    base = dllm.samplers.get("threshold", threshold=0.7).generate(model, ids, **kw)
    with pytest.warns(DllmWarning, match="never exits early"):
        prophet = dllm.samplers.get("prophet", base="threshold", threshold=0.7).generate(model, ids, **kw)
    assert torch.equal(prophet.sequences, base.sequences) and prophet.nfe == base.nfe
    assert prophet.select_calls == base.select_calls and base.select_calls


def test_exit_fills_every_block_from_the_exit_forward(tiny):
    """An exit at the first step of block 0 fills the later blocks too, at the cost of one forward."""
    model = tiny("llada")
    ids = torch.tensor([PROMPTS[0]])
    out = dllm.samplers.get("prophet", answer_start_pos=ids.shape[1] + 20, early_exit_thresholds={"early": -1.0})
    out = out.generate(model, ids, steps=32, max_new_tokens=32, block_size=8, eos_early_stop=False)
    assert out.nfe == 1 and not (out.sequences == model.mask_id).any()
    logits = model.forward(torch.cat([ids, torch.full((1, 32), model.mask_id)], 1))
    logits[..., model.mask_id] = float("-inf")
    first = logits.argmax(-1)[0, ids.shape[1] :]
    committed = out.sequences[0, ids.shape[1] :]
    assert (committed == first).sum() == 32  # the step's one commit is its argmax too


def test_composes_over_adaptive_bases(tiny):
    """Over threshold, progress is the committed fraction: a 'late' threshold alone exits only once two
    thirds of the span is committed."""
    model = tiny("llada")
    ids = torch.tensor([PROMPTS[1]])
    kw = dict(max_new_tokens=32, block_size=8, eos_early_stop=False)
    plain = dllm.samplers.get("threshold", threshold=0.99).generate(model, ids, **kw)
    sampler = dllm.samplers.get(
        "prophet",
        base="threshold",
        threshold=0.99,
        answer_start_pos=ids.shape[1],
        early_exit_thresholds={"early": 1e9, "mid": 1e9, "late": -1.0},
    )
    assert sampler.name == "prophet(threshold)"
    seen = []
    out = sampler.generate(model, ids, callback=lambda info: seen.append(info.tokens.clone()), **kw)
    assert out.nfe < plain.nfe and len(seen) == out.nfe
    p = ids.shape[1]
    committed = [float((t[0, p:] != model.mask_id).float().mean()) for t in seen]
    # the exit step saw the canvas after the step before it: the first with >= 0.67 committed
    assert committed[-2] >= 0.67 and committed[-3] < 0.67 and committed[-1] == 1.0
    factor = dllm.samplers.get("prophet", base="factor", answer_start_pos=ids.shape[1]).generate(model, ids, **kw)
    assert not (factor.sequences == model.mask_id).any()


def test_registry_takes_the_official_names():
    sampler = dllm.samplers.get(
        "prophet", answer_start_pos=100, early_exit_thresholds={"mid": 4.0}, constraints={"200": 5}, cfg_scale=1.0
    )
    rule = sampler.exits[0]
    assert sampler.base.cfg_scale == 1.0 and rule.constraints == {200: 5}
    assert rule.thresholds() == (7.5, 4.0, 2.5)
    assert dllm.samplers.defaults("prophet")["base"] == "llada"


@pytest.mark.parametrize(
    "hyper, key",
    [
        ({"answer_start_pos": -1}, "answer_start_pos"),
        ({"answer_start_pos": 1.5}, "answer_start_pos"),
        ({"early_exit_thresholds": {"middle": 5.0}}, "middle"),
        ({"early_exit_thresholds": [7.5, 5.0]}, "early_exit_thresholds"),
        ({"early_exit_thresholds": {"early": "high"}}, "early"),
        ({"constraints": {-3: 5}}, "constraints"),
        ({"constraints": {3: -5}}, "constraints"),
        ({"constraints": "200:The"}, "constraints"),
        ({"analyze_gap": "yes"}, "analyze_gap"),
        ({"answer_offset": -1}, "answer_offset"),
        ({"answer_offset": 3, "answer_start_pos": 10}, "not both"),
    ],
)
def test_bad_hyper_parameters_raise(hyper, key):
    with pytest.raises(ConfigError, match=key):
        dllm.samplers.get("prophet", **hyper)


def test_constraint_outside_the_vocabulary_raises(tiny):
    model = tiny("llada")
    with pytest.raises(ConfigError, match="constraints"):
        Prophet(constraints={2: model.vocab_size}).compose(dllm.samplers.get("llada")).generate(
            model, torch.tensor([PROMPTS[0]]), max_new_tokens=8, block_size=8
        )


def test_answer_offset_is_the_same_region_for_every_prompt_width(tiny):
    model = tiny("llada")
    ids, mask = _batch(PROMPTS)
    kw = dict(steps=32, max_new_tokens=32, block_size=8, eos_early_stop=False)
    th = {"early": 1.2, "mid": 0.8, "late": 0.4}
    by_column = dllm.samplers.get("prophet", answer_start_pos=ids.shape[1] + 6, early_exit_thresholds=th)
    by_offset = dllm.samplers.get("prophet", answer_offset=6, early_exit_thresholds=th)
    a = by_column.generate(model, ids, attention_mask=mask, **kw)
    b = by_offset.generate(model, ids, attention_mask=mask, **kw)
    assert torch.equal(a.sequences, b.sequences) and a.nfe == b.nfe < 32


@pytest.mark.parametrize("name", ["prophet", "sched"])
def test_block_models_run_with_their_exact_block_cache_and_windowed_caches_are_refused(tiny, name):
    """Over SDAR the default block cache computes the region and the masked span at every forward: the output
    and the forwards are those without a cache. A cache computing only its own window of masks is refused."""
    model = tiny("sdar")
    hyper = {"answer_offset": 0} if name == "prophet" else {}
    sampler = dllm.samplers.get(name, base="sdar", **hyper)
    ids = torch.tensor([PROMPTS[0]])
    cached = sampler.generate(model, ids, max_new_tokens=16, steps_per_block=4)
    out = sampler.generate(model, ids, max_new_tokens=16, steps_per_block=4, cache=None)
    assert not (out.sequences == model.mask_id).any()
    assert torch.equal(cached.sequences, out.sequences) and cached.nfe == out.nfe
    with pytest.raises(ConfigError, match="'window' cache does not compute"):
        sampler.generate(model, ids, max_new_tokens=16, steps_per_block=4, cache="window")


def test_each_sdar_row_measures_progress_over_its_own_steps(tiny, batch_invariant):
    """SDAR rows of one batch decode different numbers of blocks: progress is over each row's own total
    steps (not the batch's longest row), so greedy output is the same alone and in the batch."""
    sampler = dllm.samplers.get("prophet", answer_offset=0, early_exit_thresholds={"early": 9, "mid": 4, "late": 0})
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]
    batch_invariant(sampler, tiny("sdar"), prompts, max_new_tokens=6, cache=None, eos_early_stop=False)
