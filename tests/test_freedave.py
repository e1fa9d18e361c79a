"""FreeDave (:mod:`dllm.samplers.freedave`, :mod:`dllm.engine.draft`): lossless. Its greedy output is one-token-per-step
static decoding of the same confidences, token for token, with fewer forwards; rows alone as in a batch; what it does
not do is refused by name."""

from __future__ import annotations

import functools

import pytest
import torch

import dllm
from dllm.constraints import Regex
from dllm.core.errors import ConfigError

PROMPTS = [
    "Sort the list: 14 7 9\n",
    "Reverse the list: 3 17 0 8\n",
    "Ben has 3 apples. He gets 5 more from Ann. He doubles them. How many apples does Ben have now?\n",
]
NEW = 24


@functools.cache
def _model(family):
    return dllm.load(f"tiny-{family}", device="cpu", dtype=torch.float32)


def _static(model, **kw):
    """Static decoding: the most confident mask of the block, one per forward."""
    steps = {"steps_per_block": model.block_size} if model.attention.block_causal else {"steps": NEW, "block_size": 8}
    return dllm.samplers.get("llada").generate(model, PROMPTS, cache=None, **steps, **kw)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2"])
@pytest.mark.parametrize("draft_steps", [1, 3, 8])
@pytest.mark.parametrize("eos_early_stop", [False, True])
def test_greedy_output_is_static_decoding_with_fewer_forwards(family, draft_steps, eos_early_stop):
    model = _model(family)
    kw = {"max_new_tokens": NEW, "eos_early_stop": eos_early_stop}
    want = _static(model, **kw)
    sampler = dllm.samplers.get("freedave", draft_steps=draft_steps)
    blocks = {} if model.attention.block_causal else {"block_size": 8}
    got = sampler.generate(model, PROMPTS, **blocks, **kw)
    assert torch.equal(got.sequences, want.sequences), (got.texts, want.texts)
    if draft_steps == 1:  # one forward per token, and one more at each block's start
        assert got.nfe > want.nfe
    else:  # (SDAR's and LLaDA2's blocks of 4 leave little to draft: a refresh and two drafts forwards a block)
        assert got.nfe < want.nfe or (model.block_size == 4 and got.nfe == want.nfe)
    alone = sampler.generate(model, PROMPTS[2], **blocks, **kw)
    assert alone.texts[0] == got.texts[2]


@pytest.mark.parametrize(
    "settings,kw,said",
    [
        ({}, {"cache": "dual"}, "without a K/V cache"),
        ({}, {"constraint": Regex("[0-9]+")}, "constraint"),
        ({"draft_mode": "tree_attention"}, {}, "tree_attention"),
        ({"confidence_threshold": 0.9}, {}, "not lossless"),
        ({"eager_acceptance_mode": True}, {}, "eager_acceptance_mode"),
        ({"draft_steps": 0}, {}, "draft_steps"),
    ],
)
def test_what_it_does_not_do_is_refused_by_name(settings, kw, said):
    with pytest.raises(ConfigError, match=said):
        dllm.samplers.get("freedave", **settings).generate(_model("llada"), PROMPTS[0], max_new_tokens=8, **kw)


def test_exit_rules_are_refused():
    sampler = dllm.samplers.get("prophet", base="freedave", answer_offset=0)
    with pytest.raises(ConfigError, match="no exit rules"):
        sampler.generate(_model("llada"), PROMPTS[0], max_new_tokens=8, block_size=8)
