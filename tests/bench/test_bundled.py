"""The bundled trained tiny models: loadable by name, documented, small, and actually trained."""

from __future__ import annotations

import json

import pytest

import dllm
from dllm import tasks
from dllm.cli import DEFAULT_MODEL, main
from dllm.models.loading import BUNDLED
from dllm.train import RECIPES, reference_generate

FAMILIES = {
    "tiny-llada": "llada",
    "tiny-dream": "dream",
    "tiny-sdar": "sdar",
    "tiny-wedlm": "wedlm",
    "tiny-llada2": "llada2",
    "tiny-llada21": "llada2",
    "tiny-fast-dllm-v2": "fast_dllm_v2",
    "tiny-diffusion-gemma": "diffusion_gemma",
}
RECIPE = {"tiny-llada21": "llada21"}  # the RECIPES entry of a model that is not its family's own recipe
SHIPPED = [name for name in FAMILIES if name in BUNDLED]


def test_only_known_models_are_bundled_within_40_mb():
    """Eight models of 3.8 MB (6 MB with the experts of LLaDA2 and DiffusionGemma) in fp16."""
    assert SHIPPED, "no bundled model"
    assert set(BUNDLED) <= set(FAMILIES), f"unexpected bundled directories: {set(BUNDLED) - set(FAMILIES)}"
    size = sum(f.stat().st_size for name in BUNDLED for f in BUNDLED[name].iterdir())
    assert size <= 40 * 2**20, f"bundled models take {size / 2**20:.1f} MB"


@pytest.mark.parametrize("name", SHIPPED)
def test_loads_by_name_with_its_training_record(name):
    model = dllm.load(name, device="cpu")
    assert model.family == FAMILIES[name] and model.tokenizer is not None
    assert model.max_new_tokens == tasks.get("arith").max_new_tokens
    record = json.loads((BUNDLED[name] / "training.json").read_text())
    assert record["family"] == FAMILIES[name] and record["config"]["seed"] == 0
    # `python -m dllm.train --family F` reproduces it: its recipe is the one it was trained with
    recipe = RECIPES[RECIPE.get(name, FAMILIES[name])]
    assert {k: record["config"][k] for k in recipe} == recipe, f"{name} was trained with another recipe"
    assert record["steps_done"] == record["config"]["steps"] and record["evals"][-1]["step"] == record["steps_done"]
    assert (BUNDLED[name] / "loss.png").stat().st_size > 0


def test_a_bundled_name_takes_its_familys_underscores():
    """``tiny-<family>`` finds the bundled model whatever the family name's separators (tiny-fast_dllm_v2)."""
    from dllm.models.loading import resolve

    assert resolve("tiny-fast_dllm_v2") == resolve("tiny-fast-dllm-v2") == BUNDLED["tiny-fast-dllm-v2"]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("task", ["arith", "listops"])
def test_solves_held_out_problems_as_recorded(name, task):
    """The shipped weights solve held-out problems at one token per step as well as training.json recorded
    (a 32-problem sample with binomial slack; the full 500 + 500 of the quality bar is measured by
    `dllm bench`, see eval/results/)."""
    model = dllm.load(name, device="cpu")
    recorded = json.loads((BUNDLED[name] / "training.json").read_text())["evals"][-1][task]
    suite = tasks.get(task)
    examples = suite.examples("test", 32, seed=1)
    out = reference_generate(model, [e.prompt for e in examples], suite.max_new_tokens)
    correct = sum(suite.score(e, text) for e, text in zip(examples, out.texts, strict=True))
    assert correct / 32 >= recorded - 0.25, f"{name} solved {correct}/32 held-out {task} problems"


def test_dllm_generate_answers_with_the_default_bundled_model(capsys):
    """The README's run command: no --model, no --sampler, a correct worked answer and its figures."""
    assert DEFAULT_MODEL in SHIPPED
    prompt = "Ben has 3 apples. He gets 5 more from Ann. He doubles them. How many apples does Ben have now?\n"
    assert main(["generate", prompt]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ["3 + 5 = 8", "8 * 2 = 16", "The answer is 16."]
    assert "NFE" in err and "tokens/s" in err
