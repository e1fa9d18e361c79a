"""Parity of the WeDLM family and its streaming sampler with the official Tencent/WeDLM code (commit 0216110).

How tests/fixtures/wedlm_parity.json was recorded (its ``source`` field says the same): three tiny random
checkpoints (Qwen2.5-style with q/k/v biases; Qwen3-style with q/k norms and an explicit ``head_dim``; Qwen3-style
with the published vocabulary of 151936 tokens and a null ``mask_token_id``) were written by ``_checkpoint`` below,
loaded and re-saved by the official ``hf_compat/modeling_wedlm.py`` ``WeDLMForCausalLM`` (transformers 4.56, float32,
CPU), and decoded greedily at batch 1 by the engine's rule: the official ``WeDLMDecoder`` (``init_wedlm_state``,
``_refill_window_masks``, ``process_decode_outputs``) and ``Sampler`` objects of ``wedlm/engine``, each step's
forward recomputed without a cache (the engine needs CUDA) over [prompt + committed tokens | window reordered]
with the engine's position ids, and ``Scheduler.postprocess``'s stop rule. ``nfe`` is the engine's decode steps.
Our output was checked identical on the re-saved directories too (same tensors, the HF-written config.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.core.errors import DllmWarning
from dllm.models.loading import build
from dllm.models.saving import random_init_, save
from dllm.models.tiny import tiny_config

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "wedlm_parity.json").read_text())
CASES = [(name, i) for name, spec in FIXTURE["checkpoints"].items() for i in range(len(spec["cases"]))]


def _checkpoint(directory, spec) -> Path:
    config = {**tiny_config("wedlm", spec["vocab"], **spec["shape"]), **spec["overrides"]}
    model = build(config)
    random_init_(model, std=spec["std"], seed=spec["seed"], ones=lambda name: name.endswith("norm.weight"))
    return save(model, directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    loaded = {}

    def get(name):
        if name not in loaded:
            directory = _checkpoint(tmp_path_factory.mktemp(f"wedlm_{name}"), FIXTURE["checkpoints"][name])
            loaded[name] = dllm.load(directory, device="cpu", dtype=torch.float32)
        return loaded[name]

    return get


def test_checkpoints_load_with_the_engine_token_ids(models):
    for name, spec in FIXTURE["checkpoints"].items():
        model = models(name)
        assert model.family == "wedlm" and model.attention == "causal"
        assert model.mask_id == spec["mask_id"] and list(model.eos_ids) == spec["eos_ids"]
    assert FIXTURE["checkpoints"]["published"]["mask_id"] == 151665  # the engine's default for a null mask id


@pytest.mark.parametrize("name,index", CASES)
def test_streaming_decoding_matches_the_engine(name, index, models):
    case = FIXTURE["checkpoints"][name]["cases"][index]
    sampler = dllm.samplers.get(
        "wedlm",
        wedlm_entropy_threshold=case["wedlm_entropy_threshold"],
        wedlm_pos_penalty_factor=case["wedlm_pos_penalty_factor"],
        wedlm_window_size=case["wedlm_window_size"],
    )
    prompt = torch.tensor([case["prompt"]])
    out = sampler.generate(models(name), prompt, max_new_tokens=case["max_new_tokens"], temperature=0.0)
    tokens = out.sequences[0, prompt.shape[1] :].tolist()
    assert tokens[: len(case["tokens"])] == case["tokens"]
    assert out.nfe == case["nfe"]


@pytest.fixture(scope="module")
def without_eos_or_pad(tmp_path_factory):
    """The published-vocabulary checkpoint with neither ``eos_token_id`` nor ``pad_token_id`` in its config (and
    no tokenizer to supply them), as some WeDLM configs ship."""
    spec = FIXTURE["checkpoints"]["published"]
    spec = {**spec, "overrides": {**spec["overrides"], "eos_token_id": None, "pad_token_id": None}}
    directory = _checkpoint(tmp_path_factory.mktemp("wedlm_no_eos"), spec)
    with pytest.warns(DllmWarning, match="no EOS token id"):
        model = dllm.load(directory, device="cpu", dtype=torch.float32)
        dllm.samplers.get("wedlm").generate(model, torch.tensor([[5]]), max_new_tokens=1, temperature=0.0)
    assert model.eos_ids == () and model.pad_id is None
    return model


# without an EOS id the engine has no stop token: its output is the recorded one wherever no EOS was decoded
NO_EOS_CASES = [c for c in FIXTURE["checkpoints"]["published"]["cases"] if 151643 not in c["tokens"]]


def _wedlm(case):
    keys = ("wedlm_entropy_threshold", "wedlm_pos_penalty_factor", "wedlm_window_size")
    return dllm.samplers.get("wedlm", **{key: case[key] for key in keys})


@pytest.mark.parametrize("case", NO_EOS_CASES[:3], ids=lambda case: f"G{case['max_new_tokens']}")
def test_a_config_without_eos_or_pad_decodes_one_prompt_as_the_engine(case, without_eos_or_pad):
    out = _wedlm(case).generate(
        without_eos_or_pad, torch.tensor([case["prompt"]]), max_new_tokens=case["max_new_tokens"], temperature=0.0
    )
    assert out.sequences[0, len(case["prompt"]) :].tolist() == case["tokens"] and out.nfe == case["nfe"]


def test_a_config_without_eos_or_pad_pads_a_ragged_batch_under_the_mask(without_eos_or_pad):
    """Prompts of different lengths need padding: any filler id under the attention mask. The short prompt, left
    padded beside a long one, is still decoded as the engine decoded it alone; the long one as it is alone."""
    case = NO_EOS_CASES[0]
    longer = max((c["prompt"] for c in NO_EOS_CASES), key=len)
    assert len(longer) > len(case["prompt"])
    sampler, new = _wedlm(case), case["max_new_tokens"]
    out = sampler.generate(without_eos_or_pad, [case["prompt"], longer], max_new_tokens=new, temperature=0.0)
    alone = sampler.generate(without_eos_or_pad, [longer], max_new_tokens=new, temperature=0.0)
    width = out.prompt_width
    assert out.sequences[0, width:].tolist() == case["tokens"]
    assert out.sequences[1, width:].tolist() == alone.sequences[0, alone.prompt_width :].tolist()
