"""Every bad input ends in a clear dllm error that names the problem and the way out."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError, ModelError, NumericalError


def test_prompt_plus_generation_longer_than_the_model(tiny):
    model = tiny("llada")  # max_sequence_length 512
    with pytest.raises(ConfigError, match="exceeds the model's maximum length of 512"):
        dllm.samplers.get("llada").generate(model, [[5] * 500], max_new_tokens=32)


def test_max_new_tokens_not_a_multiple_of_block_size(tiny):
    with pytest.raises(ConfigError, match="max_new_tokens=20 is not a multiple of block_size=8; use e.g. max_new_tok"):
        dllm.samplers.get("llada").generate(tiny("llada"), "a", max_new_tokens=20, block_size=8)


def test_steps_not_divisible_across_blocks_says_what_is_valid(tiny):
    with pytest.raises(
        ConfigError, match=r"steps=5 cannot be split evenly over the 4 blocks.*multiple of 4, e.g. 4, 8"
    ):
        dllm.samplers.get("llada").generate(tiny("llada"), "a", max_new_tokens=32, block_size=8, steps=5)


def test_steps_and_steps_per_block_disagree(tiny):
    with pytest.raises(ConfigError, match="disagree"):
        dllm.samplers.get("llada").generate(
            tiny("llada"), "a", max_new_tokens=16, block_size=8, steps=4, steps_per_block=4
        )


@pytest.mark.parametrize(
    "family, steps",
    [("llada", {"steps": 2**62}), ("dream", {"steps": 2**62}), ("sdar", {"steps_per_block": 2**40})],
)
def test_a_schedule_too_long_to_hold_is_refused_with_the_steps_that_fit(family, steps, tiny):
    """Found in issue 31's review: steps=2**62 ended in a storage-size overflow inside LLaDA's and Dream's schedules."""
    with pytest.raises(ConfigError, match=r"more than a block's schedule can hold.*Use at most \d+ steps per block"):
        dllm.samplers.get(family).generate(tiny(family), "a", max_new_tokens=8, **steps)


def test_block_model_rejects_total_steps_and_other_block_sizes(tiny):
    model = tiny("sdar")
    with pytest.raises(ConfigError, match="steps_per_block"):
        dllm.samplers.get("sdar").generate(model, "a", max_new_tokens=8, steps=8)
    with pytest.raises(ConfigError, match="trained with block_size=4"):
        dllm.samplers.get("sdar").generate(model, "a", max_new_tokens=8, block_size=8)


def test_sdar_sampler_needs_a_block_model(tiny):
    with pytest.raises(ConfigError, match="needs a block-causal model"):
        dllm.samplers.get("sdar").generate(tiny("llada"), "a", max_new_tokens=8)


def test_unknown_sampler_and_hyper_parameter_list_valid_ones():
    with pytest.raises(
        ConfigError,
        match="unknown sampler 'nope'; available: llada, dream, sdar, llada2, llada21, fast_dllm_v2, threshold, factor",
    ):
        dllm.samplers.get("nope")
    with pytest.raises(ConfigError, match="no hyper-parameter 'treshold'; valid: threshold"):
        dllm.samplers.get("threshold", treshold=0.9)
    with pytest.raises(ConfigError, match="alg must be one of"):
        dllm.samplers.get("dream", alg="greedy")
    with pytest.raises(ConfigError, match=r"threshold must be a number in \[0, 1\]"):
        dllm.samplers.get("threshold", threshold=1.5)


def test_model_without_mask_token(checkpoint_dir):
    model = dllm.load(checkpoint_dir("llada"))
    model.mask_id = None
    with pytest.raises(ModelError, match="no mask token id: set 'mask_token_id'"):
        dllm.samplers.get("llada").generate(model, "a", max_new_tokens=8, block_size=8)


def test_pad_id_equal_to_mask_id(checkpoint_dir):
    model = dllm.load(checkpoint_dir("dream"))
    model.pad_id = model.mask_id
    with pytest.raises(ModelError, match="pad token id equals the mask token id"):
        dllm.samplers.get("dream").generate(model, ["a", "bc"], max_new_tokens=8)


@pytest.mark.parametrize("prompt", ["", [""], ["a", ""], [[]], torch.zeros(1, 0, dtype=torch.long)])
def test_empty_prompt(prompt, tiny):
    with pytest.raises(ConfigError, match="empty prompt"):
        dllm.samplers.get("llada").generate(tiny("llada"), prompt, max_new_tokens=8, block_size=8)


def test_bad_prompt_contents(tiny):
    model = tiny("llada")
    sampler = dllm.samplers.get("llada")
    with pytest.raises(ConfigError, match="contains the mask token"):
        sampler.generate(model, [[5, model.mask_id]], max_new_tokens=8, block_size=8)
    with pytest.raises(ConfigError, match="must lie in"):
        sampler.generate(model, [[5, 10_000]], max_new_tokens=8, block_size=8)
    with pytest.raises(ConfigError, match="left padding"):
        sampler.generate(
            model, torch.tensor([[5, 6, 0]]), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=8, block_size=8
        )
    with pytest.raises(ConfigError, match="unsupported prompt"):
        sampler.generate(model, 42, max_new_tokens=8, block_size=8)
    with pytest.raises(ConfigError, match="temperature must be"):
        sampler.generate(model, "a", max_new_tokens=8, block_size=8, temperature=-1)


def test_nan_logits(checkpoint_dir):
    model = dllm.load(checkpoint_dir("llada"))
    with torch.no_grad():
        model.model.transformer.ln_f.weight.fill_(float("nan"))
    with pytest.raises(NumericalError, match="NaN or infinite logits"):
        dllm.samplers.get("llada").generate(model, "a", max_new_tokens=8, block_size=8)


def test_cfg_with_a_cache_is_refused(tiny):
    with pytest.raises(ConfigError, match="cannot be combined with a K/V cache"):
        dllm.samplers.get("llada", cfg_scale=1.0).generate(tiny("sdar"), "a", max_new_tokens=8)
