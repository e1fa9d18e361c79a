"""The LLaDA2 family and its LLaDA2.0 decoder beyond the official parity (tests/test_parity_llada2.py): the batched
expert path against its reference, the decoder's own block size, the default schedule, the answer cut at
max_new_tokens, exit rules over ``llada2``, bad settings."""

from __future__ import annotations

import warnings

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.models.llada2 import moe_dense, moe_reference, moe_sorted

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24]]
KW = {"max_new_tokens": 16, "eos_early_stop": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from dllm.models.tiny import make_tiny_checkpoint

    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("llada2"), "llada2", seed=0, std=0.5)
    return dllm.load(directory, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_the_batched_expert_path_is_the_reference_sum(model, rows):
    """Sorted by expert (one matmul each) and dense (the compiled path) equal the (row, slot) loop, also when some
    experts receive no row."""
    moe = model.model.layers[1].mlp
    x = torch.randn(rows, model.shape.hidden, generator=torch.Generator().manual_seed(rows))
    experts, weights = moe.gate(x)
    want = moe_reference(moe.experts, x, experts, weights)
    assert torch.allclose(moe_sorted(moe.experts, x, experts, weights), want, rtol=1e-5, atol=1e-4)
    assert torch.allclose(moe_dense(moe.experts, x, experts, weights), want, rtol=1e-5, atol=1e-4)
    if rows == 1:
        assert experts.unique().numel() < len(moe.experts)  # idle experts: the sorted path skips them


def test_routing_picks_from_the_best_groups_with_the_bias_and_weighs_without_it(model):
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(64, model.shape.hidden, generator=torch.Generator().manual_seed(0))
    experts, weights = gate(x)
    s = model.shape
    scores = torch.sigmoid(x @ gate.weight.T)
    biased = scores + gate.expert_bias
    groups = biased.view(-1, s.n_group, s.experts // s.n_group).topk(2, -1).values.sum(-1)
    best_groups = groups.topk(s.topk_group, -1).indices
    assert bool(((experts // (s.experts // s.n_group))[:, :, None] == best_groups[:, None, :]).any(-1).all())
    chosen = scores.gather(1, experts)
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True) * s.scaling)


def test_the_attention_blocks_are_the_generations(model):
    """LLaDA2's block-causal mask follows generate's block_size (its default the checkpoint's): another block size
    changes the forward and the output; a block size the model was not configured with is accepted (SDAR's is
    refused: tests/test_errors.py)."""
    x = torch.randint(5, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16)[None]
    with torch.no_grad():
        four, eight = model.logits(x, pos, block_size=4), model.logits(x, pos, block_size=8)
        assert torch.equal(model.logits(x, pos), four)  # the checkpoint's default (tiny: 4)
    first = model.logits(x[:, :4], pos[:, :4], block_size=4)  # block-causal: the first block sees no later one
    assert torch.allclose(four[:, :4], first, atol=1e-5)
    assert not torch.allclose(four[:, :8], eight[:, :8])
    sampler = dllm.samplers.get("llada2")
    a, b = (sampler.generate(model, PROMPTS, block_size=bs, **KW) for bs in (4, 8))
    assert a.geometry.block_size == 4 and b.geometry.block_size == 8
    assert a.sequences.tolist() != b.sequences.tolist()


def test_the_default_schedule_is_the_official_32_steps(model):
    """No steps_per_block: the official default (32 steps per block, capped at the block size, which schedules the
    same tokens), so the output equals an explicit steps_per_block=32."""
    sampler = dllm.samplers.get("llada2", threshold=0.99)
    for block_size in (4, 8):
        default = sampler.generate(model, PROMPTS, block_size=block_size, **KW)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            official = sampler.generate(model, PROMPTS, block_size=block_size, steps_per_block=32, **KW)
        assert torch.equal(default.sequences, official.sequences) and default.nfe == official.nfe
        assert default.geometry.steps_per_block == block_size


def test_the_answer_is_the_first_max_new_tokens(model):
    """The block tail past max_new_tokens is decoded (it is in the canvas) and dropped from the answer, as the
    official return x[P : P + gen_length]."""
    out = dllm.samplers.get("llada2").generate(model, PROMPTS, max_new_tokens=6, block_size=8, eos_early_stop=False)
    assert out.sequences.shape[1] - out.prompt_width > 6
    assert not bool((out.sequences == model.mask_id).any())
    assert all(len(text) <= 6 for text in out.texts) and max(out.tokens) == 6


@pytest.mark.parametrize(
    "name,settings",
    [
        ("prophet", {"answer_offset": 2, "early_exit_thresholds": {"early": 3.0, "mid": 1.0, "late": 0.0}}),
        ("sched", {"average_over_masked": False, "answer_region": "tail", "tau_high": 2.0, "tau_low": 0.5}),
    ],
)
def test_exit_rules_over_llada2_exit_early(model, name, settings, batch_invariant):
    """Prophet's and SchED's exits over LLaDA2's decoder: a block still ends once full (the official generate
    leaves it), so the exit only saves forwards."""
    base = dllm.samplers.get("llada2").generate(model, PROMPTS, **KW)
    sampler = dllm.samplers.get(name, base="llada2", **settings)
    out = batch_invariant(sampler, model, PROMPTS, **KW)
    assert not bool((out.sequences == model.mask_id).any())
    assert out.nfe < base.nfe


def test_bad_settings_are_refused(model, tiny):
    # max_new_tokens < minimal_topk: the official schedule divides by zero; here each block takes one step
    out = dllm.samplers.get("llada2", minimal_topk=4).generate(model, PROMPTS, max_new_tokens=3, eos_early_stop=False)
    bs = out.geometry.block_size
    blocks = max(-(-(len(p) + 3) // bs) - len(p) // bs for p in PROMPTS)  # the batch's longest row
    assert not bool((out.sequences == model.mask_id).any()) and out.nfe == blocks
    with pytest.raises(ConfigError, match="LLaDA2's own decoder"):
        dllm.samplers.get("llada2").generate(tiny("llada"), PROMPTS, max_new_tokens=8, block_size=8)
    with pytest.raises(ConfigError, match="minimal_topk must be"):
        dllm.samplers.get("llada2", minimal_topk=0)
    with pytest.raises(ConfigError, match="give steps_per_block"):
        dllm.samplers.get("llada2").generate(model, PROMPTS, max_new_tokens=8, steps=8)
