"""SchED (``dllm.samplers.get("sched", ...)``): parity with the official code, batch invariance, reduction
to Dream, the argmax fill at temperature > 0, composition over LLaDA, and bad hyper-parameters.

``fixtures/sched_parity.json`` was recorded outside the repository by running the official
``diffusion_generate_schedule`` of ``amr-mohamedd/SchED@75534c3`` ``dream_sampling/sched.py`` (CPU, float32,
temperature 0, batch 1, ``mask_token_id`` of the model) with ``model(x, attention_mask, tok_idx).logits``
returning dllm's Dream logits of the same weights shifted back by one column (the official shifts them
again), on the tiny random Dream checkpoint ``make_tiny_checkpoint(dir, "dream", seed=0, std=0.5)`` and on
the bundled ``tiny-dream`` (prompts: ``dllm.tasks`` arith / listops test examples). Shims: the mask
token's logit was set to -inf (dllm never proposes it), and ``torch.topk`` was replaced by a stable sort so
that exact confidence ties go to the lower column, as dllm's ``top_k_per_row``. Settings: 16 new tokens in
8, 16 (the first step commits nothing) and 24 steps; every ``tau_mode``, ``stat`` mean / median / quantile,
region all / tail / custom, ``average_over_masked`` False, ``min_progress``, ``patience_steps``,
``max_change_ratio`` (1.0: exits at the first step), ``alg`` entropy / maskgit_plus / topk_margin; each
as given, with ``tau_high`` / ``tau_low`` placed around the aggregates the official recorded (exits in the
middle of the run), and never exiting; also ``top_p`` / ``top_k`` at temperature 0 (raw-logit margins,
filtered confidences), a custom region reaching into the prompt, and a region that empties before the end
(the official "converged" exit), with 5 and 16 steps. NFE is the number of official model calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.models.tiny import make_tiny_checkpoint
from dllm.samplers.sched import SchED

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sched_parity.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, spec in FIXTURE["checkpoints"].items():
        if not name.endswith("dream"):
            continue
        if spec == "bundled":
            out[name] = dllm.load(name, device="cpu", dtype=torch.float32)
        else:
            d = make_tiny_checkpoint(tmp_path_factory.mktemp(name), spec["family"], seed=spec["seed"], std=spec["std"])
            out[name] = dllm.load(d, device="cpu", dtype=torch.float32)
    return out


def _id(c):
    hyper = "-".join(f"{k}={v}" for k, v in sorted(c["hyper"].items()) if k not in ("tau_high", "tau_low"))
    return f"{c['model']}-{c['prompt']}-G{c['G']}-S{c['S']}-{hyper}-exit{c['steps_taken'] if c['exited'] else 'no'}"


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[_id(c) for c in FIXTURE["cases"]])
def test_matches_official(models, case):
    ids = torch.tensor([FIXTURE["prompts"][case["prompt"]]])
    out = dllm.samplers.get("sched", **case["hyper"]).generate(
        models[case["model"]],
        ids,
        attention_mask=torch.ones_like(ids),
        steps=case["S"],
        max_new_tokens=case["G"],
        temperature=0.0,
        eos_early_stop=False,
    )
    assert out.sequences[0].tolist() == case["official"]
    assert out.nfe == case["nfe"]


def test_fixture_covers_exits_at_many_steps():
    exits = {(c["S"], c["steps_taken"]) for c in FIXTURE["cases"] if c["exited"]}
    assert {8, 16, 24} <= {s for s, _ in exits}
    assert any(taken == 1 for _, taken in exits) and any(taken > s // 2 for s, taken in exits)
    assert any(not c["exited"] for c in FIXTURE["cases"])


PROMPTS = [[2, 40, 51, 62, 73, 84], [2, 17, 28, 39, 44, 55, 66, 77, 88, 91, 12], [2, 30, 31]]
FILLER = [2] + list(range(20, 34))  # longer than every prompt: changes the padding of the others


def _batch(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


HYPER = [
    {"tau_high": 2.0, "tau_low": 0.5},
    {"tau_high": 2.0, "tau_low": 0.5, "stat": "median", "answer_region": "tail", "average_over_masked": False},
    {"tau_high": 1.5, "tau_low": 0.5, "average_over_masked": False, "stat": "quantile", "q": 0.5},
    {"tau_high": 3.0, "tau_low": 0.0, "tau_mode": "exp", "tau_k": 8.0, "stat": "min", "max_change_ratio": 0.3},
    {"base": "llada", "tau_high": 1.5, "tau_low": 0.5},
    {"tau_high": 2.0, "tau_low": 0.5, "max_change_ratio": 1.0},  # no stability guard: exits when sampling too
]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("hyper", HYPER)
def test_each_prompt_alone_equals_its_row_in_a_padded_batch(tiny, hyper, temperature):
    """Greedy: each prompt alone; sampled: the random streams are keyed by the row index, so the prompt keeps
    its row index and the rows before it hold a longer prompt (different padding, other rows)."""
    family = "llada" if hyper.get("base") == "llada" else "dream"
    model = tiny(family)
    sampler = dllm.samplers.get("sched", **hyper)
    kw = dict(steps=16, max_new_tokens=16, temperature=temperature, seed=3, eos_early_stop=False)
    if family == "llada":
        kw["block_size"] = 8
    ids, mask = _batch(PROMPTS)
    batch = sampler.generate(model, ids, attention_mask=mask, **kw)
    nfes = []
    for row, p in enumerate(PROMPTS):
        others = [FILLER] * row if temperature else []
        alone_ids, alone_mask = _batch(others + [p])
        alone = sampler.generate(model, alone_ids, attention_mask=alone_mask, **kw)
        width, mine = alone_ids.shape[1], len(others)
        assert batch.sequences[row, ids.shape[1] :].tolist() == alone.sequences[mine, width:].tolist(), row
        nfes.append(alone.nfe)
    if not temperature or hyper.get("max_change_ratio") == 1.0:
        assert min(nfes) < 16  # the exit fires


@pytest.mark.parametrize("alg", ["entropy", "maskgit_plus", "topk_margin", "origin"])
@pytest.mark.parametrize("steps", [8, 12])
def test_without_exit_equals_dream(tiny, alg, steps):
    """With thresholds no margin reaches, sched is Dream's sampler (steps < max_new_tokens: every step of the
    confidence algorithms commits something, so the forwards are the same too; "origin" reveals at random, and
    a step revealing nothing in any row costs dream no forward, sched its scheduled one)."""
    model = tiny("dream")
    ids, mask = _batch(PROMPTS)
    kw = dict(steps=steps, max_new_tokens=16, temperature=0.5 if alg == "origin" else 0.0, seed=1)
    dream = dllm.samplers.get("dream", alg=alg).generate(model, ids, attention_mask=mask, **kw)
    sched = dllm.samplers.get("sched", alg=alg, tau_high=1e9, tau_low=1e9).generate(
        model, ids, attention_mask=mask, **kw
    )
    assert torch.equal(sched.sequences, dream.sequences)
    assert sched.nfe == dream.nfe if alg != "origin" else dream.nfe <= sched.nfe == steps


def test_first_step_runs_its_forward_when_it_commits_nothing(tiny):
    """steps == max_new_tokens: Dream's first step commits nothing; dllm's dream skips its forward, sched
    runs it as the official does (its argmax feeds the change ratio of the second step)."""
    model = tiny("dream")
    ids = torch.tensor([PROMPTS[0]])
    kw = dict(steps=16, max_new_tokens=16)
    dream = dllm.samplers.get("dream").generate(model, ids, **kw)
    sched = dllm.samplers.get("sched", tau_high=1e9, tau_low=1e9).generate(model, ids, **kw)
    assert torch.equal(sched.sequences, dream.sequences)
    assert dream.nfe == 15 and sched.nfe == 16


def test_exit_fills_with_the_argmax_at_temperature_above_zero(tiny, monkeypatch):
    """The official fills the remaining masks with the raw-logit argmax even when sampling: with an exit at
    the first step (max_change_ratio 1) every generated token is that forward's argmax."""
    model = tiny("dream")
    ids = torch.tensor([PROMPTS[1]])
    sampler = dllm.samplers.get("sched", max_change_ratio=1.0, tau_high=-1e9, tau_low=-1e9, alg="maskgit_plus")
    out = sampler.generate(model, ids, steps=16, max_new_tokens=16, temperature=5.0, seed=0)
    assert out.nfe == 1
    logits = model.forward(torch.cat([ids, torch.full((1, 16), model.mask_id)], 1))
    logits[..., model.mask_id] = float("-inf")
    assert out.sequences[0, ids.shape[1] :].tolist() == logits.argmax(-1)[0, ids.shape[1] :].tolist()
    # Prophet fills with the step's proposals (sampled), so its fill differs at this temperature
    prophet = dllm.samplers.get(
        "prophet", base="dream", answer_start_pos=ids.shape[1], early_exit_thresholds={"early": -1.0}
    )
    sampled = prophet.generate(model, ids, steps=16, max_new_tokens=16, temperature=5.0, seed=0)
    assert (
        sampled.nfe == 1 and sampled.sequences[0, ids.shape[1] :].tolist() != out.sequences[0, ids.shape[1] :].tolist()
    )


def test_margins_ignore_the_sampling_temperature(tiny):
    """The margins are raw logits (before Dream's temperature / top-p / top-k filters): an exit at the first
    step (whose canvas no sampling has touched yet) happens at every temperature exactly when the mean raw
    margin of the masked slots reaches tau_high."""
    model = tiny("dream")
    ids = torch.tensor([PROMPTS[0]])
    canvas = torch.cat([ids, torch.full((1, 16), model.mask_id)], 1)
    logits = model.forward(canvas)[0, ids.shape[1] :]
    logits[..., model.mask_id] = float("-inf")
    top2 = logits.topk(2, dim=-1).values
    gbar = float((top2[:, 0] - top2[:, 1]).mean())
    for t in (0.0, 0.1, 10.0):
        for tau, exits in ((gbar - 1e-3, True), (gbar + 1e-3, False)):
            sampler = dllm.samplers.get("sched", tau_high=tau, tau_low=1e9, max_change_ratio=1.0, top_k=2, top_p=0.5)
            out = sampler.generate(model, ids, steps=16, max_new_tokens=16, temperature=t, seed=0)
            assert (out.nfe == 1) == exits, (t, tau)


def test_sched_over_llada_blocks(tiny):
    model = tiny("llada")
    ids = torch.tensor([PROMPTS[1]])
    kw = dict(steps=32, max_new_tokens=32, block_size=8, eos_early_stop=False)
    llada = dllm.samplers.get("llada").generate(model, ids, **kw)
    never = dllm.samplers.get("sched", base="llada", tau_high=1e9, tau_low=1e9).generate(model, ids, **kw)
    early = dllm.samplers.get("sched", base="llada", tau_high=2.0, tau_low=0.0).generate(model, ids, **kw)
    assert torch.equal(never.sequences, llada.sequences) and never.nfe == llada.nfe
    assert early.nfe < llada.nfe and not (early.sequences == model.mask_id).any()
    over = dllm.samplers.get("sched", base="threshold", threshold=0.99, tau_high=2.0, tau_low=0.0).generate(
        model, ids, **kw
    )
    assert not (over.sequences == model.mask_id).any()


def test_registry_defaults_to_dream_with_the_official_names():
    sampler = dllm.samplers.get("sched", alg="entropy", tau_mode="exp", tau_high=7.5, tau_low=0.0, tau_k=2.0)
    assert sampler.base.name == "dream" and sampler.name == "sched(dream)"
    assert isinstance(sampler.exits[0], SchED) and sampler.exits[0].tau_k == 2.0
    names = set(dllm.samplers.defaults("sched"))
    assert {"tau_mode", "stat", "answer_region", "alg", "eps", "top_p", "top_k", "alg_temp"} <= names


@pytest.mark.parametrize(
    "hyper, key",
    [
        ({"tau_mode": "step"}, "tau_mode"),
        ({"tau_high": "7.5"}, "tau_high"),
        ({"tau_k": float("nan")}, "tau_k"),
        ({"min_progress": 1.5}, "min_progress"),
        ({"max_change_ratio": -0.1}, "max_change_ratio"),
        ({"q": 2.0}, "q"),
        ({"patience_steps": -1}, "patience_steps"),
        ({"patience_steps": 1.5}, "patience_steps"),
        ({"stat": "max"}, "stat"),
        ({"answer_region": "head"}, "answer_region"),
        ({"answer_start": -2}, "answer_start"),
        ({"answer_region": "tail", "answer_end": 40}, "answer_region"),
        ({"average_over_masked": 1}, "average_over_masked"),
    ],
)
def test_bad_hyper_parameters_raise(hyper, key):
    with pytest.raises(ConfigError, match=key):
        dllm.samplers.get("sched", **hyper)


@pytest.mark.parametrize(
    "hyper,g",
    [({"tau_mode": "exp", "tau_low": -1.0, "answer_region": "last"}, 2), ({"tau_high": 3.0, "tau_low": 0.5}, 6)],
)
def test_each_sdar_row_follows_its_own_schedule(tiny, batch_invariant, hyper, g):
    """SDAR rows of one batch decode different numbers of blocks: each row's tau schedule spans its own steps
    (not the batch's longest row), so greedy output is the same alone and in the batch."""
    sampler = dllm.samplers.get("sched", **{"answer_region": "last", **hyper})
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]
    batch_invariant(sampler, tiny("sdar"), prompts, max_new_tokens=g, cache=None, eos_early_stop=False)
