"""Parity of the LLaDA2 family and its decoders with the official LLaDA2.0 / LLaDA2.1 code.

The official code is Hugging Face remote code (``modeling_llada2_moe.py``); it was run from the vendored copies in
ZHZisZZ/dllm@ca17675 (``dllm/pipelines/llada2/models/``, ``dllm/pipelines/llada21/models/``) on the tiny random
checkpoints rebuilt here (``make_tiny_checkpoint(DIR, "llada2", seed, std, overrides)``, loaded with the official
classes, float32, CPU, SDPA). Shims for transformers 5.24 only (import stubs of the mask utilities, the 4.57 default
RoPE init, ``_tied_weights_keys`` as a dict) and the block mask kept as an additive float32 0/-inf block-causal mask
(the copies cast it to bfloat16, which SDPA refuses with float32 queries). Recording: ``model.forward`` wrapped to
count forwards (NFE) and to set the mask id's logit to -inf before the softmax / argmax (dllm never proposes the
mask token), the generate functions otherwise unmodified, temperature 0, batch 1. Each fixture's ``source`` and
``note`` fields say the same; the cases are in tests/fixtures/llada2_*.json and llada21_generate.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.models.tiny import make_tiny_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
LOGITS = json.loads((FIXTURES / "llada2_logits.json").read_text())
GENERATE = json.loads((FIXTURES / "llada2_generate.json").read_text())


def _checkpoint(tmp_path_factory, spec):
    assert spec["family"] == "llada2"
    directory = tmp_path_factory.mktemp("llada2_parity")
    make_tiny_checkpoint(directory, "llada2", seed=spec["seed"], std=spec["std"], overrides=spec["overrides"] or None)
    return dllm.load(directory, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(spec):
        key = json.dumps(spec, sort_keys=True)
        if key not in cache:
            cache[key] = _checkpoint(tmp_path_factory, spec)
        return cache[key]

    return get


@pytest.mark.parametrize("case", LOGITS["cases"], ids=lambda c: f"seed{c['checkpoint']['seed']}-B{c['block_size']}")
def test_logits_match_the_official_modeling(models, case):
    """The whole canvas under the block-causal mask of ``block_size``, float32: within 1e-5 of the official, plus 1e-6
    of the largest logit (logits reach 16 here: float32 rounding differs by CPU, 1.2e-5 on an AMD EPYC against the
    recorded values; an error in the model is orders of magnitude larger)."""
    model = models(case["checkpoint"])
    x = torch.tensor([case["x"]])
    with torch.no_grad():
        ours = model.logits(x, torch.arange(x.shape[1])[None], block_size=case["block_size"])[0]
    expected = torch.tensor(case["logits"])
    assert (ours - expected).abs().max().item() < 1e-5 + 1e-6 * expected.abs().max().item()
    assert ours.argmax(-1).tolist() == case["argmax"]


def test_the_logits_cases_cover_both_mlp_kinds_and_block_sizes():
    """The variant checkpoint has no dense layer, one expert per token (no renormalisation), one group and two
    shared experts; the default one a dense first layer and group-limited routing over 4 groups."""
    overrides = [c["checkpoint"]["overrides"] for c in LOGITS["cases"]]
    assert {} in overrides and any(o.get("num_experts_per_tok") == 1 for o in overrides)
    assert len({c["block_size"] for c in LOGITS["cases"]}) >= 2


def _llada2(model, case, prompts=None, **kw):
    model.eos_ids = (case["eos_id"],)
    sampler = dllm.samplers.get(
        "llada2", threshold=case["threshold"], minimal_topk=case["minimal_topk"], eos_early_stop=case["eos_early_stop"]
    )
    return sampler.generate(
        model,
        prompts or [case["prompt"]],
        max_new_tokens=case["gen_length"],
        block_size=case["block_length"],
        steps_per_block=case["steps"],
        **kw,
    )


def _answer(row: list[int], p: int, g: int, eos: int) -> list[int]:
    """The official return: the generated ids up to ``gen_length``, cut after the first EOS."""
    answer = row[p : p + g]
    return answer[: answer.index(eos) + 1] if eos in answer else answer


def _check(out, case, row=0):
    canvas = out.sequences[row, out.prompt_width - len(case["prompt"]) :].tolist()
    p, mask = len(case["prompt"]), GENERATE["mask_id"]
    assert _answer(canvas, p, case["gen_length"], case["eos_id"]) == case["official"]
    # the decoded slots of the official canvas (blocks after an EOS stop stay masks there; dllm fills them with EOS)
    decoded = [i for i, t in enumerate(case["canvas"]) if t != mask]
    assert [canvas[i] for i in decoded] == [case["canvas"][i] for i in decoded]


def _case_id(c):
    return (
        f"P{len(c['prompt'])}-G{c['gen_length']}-B{c['block_length']}-S{c['steps']}-t{c['threshold']}-"
        f"k{c['minimal_topk']}-{'early' if c['eos_early_stop'] else 'late'}-eos{c['eos_id']}"
    )


@pytest.mark.parametrize("case", GENERATE["cases"], ids=_case_id)
def test_llada2_matches_the_official_generate(models, case):
    model = models(GENERATE["checkpoint"])
    out = _llada2(model, case)
    _check(out, case)
    assert out.nfe == case["nfe"]


def test_the_llada2_cases_exercise_every_rule():
    """Each rule the official generate has fires in some recorded case: the EOS stops (block-level and mid-block),
    several tokens per step (G < block at 32 steps, minimal_topk), steps beyond the block."""
    cases = GENERATE["cases"]
    assert sum(c["eos_fired"] for c in cases) >= 5
    assert any(c["midblock_stop"] for c in cases)
    assert any(c["eos_fired"] and not c["eos_early_stop"] for c in cases)
    assert any(c["effective_steps"] < c["block_length"] for c in cases)
    assert any(c["steps"] > c["block_length"] for c in cases)
    assert {c["minimal_topk"] for c in cases} >= {1, 2}
    assert len({c["block_length"] for c in cases}) >= 4


def test_llada2_rows_of_a_batch_equal_their_official_outputs(models):
    """A recorded case's prompt decoded in the middle of a left-padded batch of other prompts (shorter and longer)
    equals its official output (the official code is batch 1)."""
    model = models(GENERATE["checkpoint"])
    prompts = sorted({tuple(c["prompt"]) for c in GENERATE["cases"]}, key=len)
    assert len({len(p) for p in prompts}) >= 3
    for case in GENERATE["cases"][::3]:
        others = [list(p) for p in prompts if list(p) != case["prompt"]]
        out = _llada2(model, case, prompts=[others[0], case["prompt"], others[-1]])
        _check(out, case, row=1)


EDIT = json.loads((FIXTURES / "llada21_generate.json").read_text())


def _llada21(model, case, prompts=None, **kw):
    model.eos_ids = (case["eos_id"],)
    names = ("threshold", "editing_threshold", "max_post_steps", "num_to_transfer", "eos_early_stop")
    sampler = dllm.samplers.get("llada21", **{k: case[k] for k in names})
    return sampler.generate(
        model,
        prompts or [case["prompt"]],
        max_new_tokens=case["gen_length"],
        block_size=case["block_length"],
        # generate's eos_early_stop left out: the sampler's official EOS rule (its default decodes every block)
        **kw,
    )


def _edit_id(c):
    early = "early" if c["eos_early_stop"] else "late"
    return (
        f"P{len(c['prompt'])}-G{c['gen_length']}-B{c['block_length']}-t{c['threshold']}-e{c['editing_threshold']}-"
        f"post{c['max_post_steps']}-n{c['num_to_transfer']}-{early}-eos{c['eos_id']}"
    )


@pytest.mark.parametrize("case", EDIT["cases"], ids=_edit_id)
def test_llada21_matches_the_official_generate(models, case):
    """Tokens, forwards and the number of token-to-token edits (slots rewritten after they were decoded)."""
    model = models(EDIT["checkpoint"])
    edits, canvas = [], []

    def count(info):  # (a first step edits nothing: its block holds no decoded slot but the prompt's)
        if canvas:
            edits.append(int((info.committed & (canvas[-1] != model.mask_id)).sum()))
        canvas.append(info.tokens.clone())

    out = _llada21(model, case, callback=count)
    _check(out, case)
    assert out.nfe == case["nfe"]
    assert sum(edits) == case["edits"]


def test_the_llada21_cases_exercise_edits_and_their_bounds():
    cases = EDIT["cases"]
    assert sum(c["edits"] > 0 for c in cases) >= 10 and sum(c["edits"] == 0 for c in cases) >= 10
    assert {c["max_post_steps"] for c in cases} >= {0, 1, 16}
    assert {c["num_to_transfer"] for c in cases} >= {1, 2}
    assert any(c["eos_fired"] and c["eos_early_stop"] for c in cases)
    assert any(0 in c["masks_per_forward"] for c in cases)  # mask-free (editing / confirming) forwards


def test_llada21_rows_of_a_batch_equal_their_official_outputs(models):
    model = models(EDIT["checkpoint"])
    prompts = sorted({tuple(c["prompt"]) for c in EDIT["cases"]}, key=len)
    for case in EDIT["cases"][::4]:
        others = [list(p) for p in prompts if list(p) != case["prompt"]]
        out = _llada21(model, case, prompts=[others[-1], case["prompt"], others[0]])
        _check(out, case, row=1)
