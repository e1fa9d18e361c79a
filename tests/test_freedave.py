"""FreeDave (:mod:`dllm.samplers.freedave`, :mod:`dllm.engine.draft`): tokens and forwards equal to the official loops;
lossless (its greedy output is one-token-per-step static decoding of the same confidences, token for token, with fewer
forwards); rows alone as in a batch; what it does not do is refused by name.

Parity fixture ``tests/fixtures/freedave_parity.json`` (its ``source`` names what ran and what was left out). Recipe,
outside the repo (the official code lives only under /tmp, never here): take cychomatica/FreeDave 8b48121
``generation/core.py``: ``block_decode_with_full_attention_FreeDave``, ``block_decode_with_block_attention_FreeDave``,
with ``token_transfer``, ``draft_verification_vectorized`` and ``sample_tokens`` (temperature 0, batch 1,
``batch_expanding``, static, the prefix cache); run them on a stand-in model that serves each forward exactly with the
dllm tiny checkpoint in float64 (bundled ``tiny-llada`` / ``-dream`` / ``-sdar`` / ``-llada2`` with task prompts, and
``make_tiny_checkpoint(DIR, family, std=0.5 / 2.0)`` with short id prompts): a full-attention drafts forward gets the
prefix its cache held prepended, a block-causal one the blocks its K/V store forward stored; Dream returns the raw
next-token logits, which the loop shifts itself; the mask token's logit at -inf. Record the sequence, the predicting
forwards and the branches taken (a verification keeping some or all drafts, a block's last slot taken without a
forward, Dream's forced first slot, ``early_exit``); leave out a run where ``torch.topk`` broke a confidence tie other
than leftmost.
"""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.constraints import Regex
from dllm.core.errors import ConfigError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "freedave_parity.json").read_text())

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
    sampler = dllm.samplers.get("freedave", draft_steps=draft_steps, ar_first_token=False, eos_stop="block_with_eos")
    blocks = {} if model.attention.block_causal else {"block_size": 8}
    got = sampler.generate(model, PROMPTS, **blocks, **kw)
    assert torch.equal(got.sequences, want.sequences), (got.texts, want.texts)
    if draft_steps == 1 and not model.attention.block_causal:  # one forward per token (a block's first forward
        assert got.nfe == want.nfe  # stands in for its last slot's)
    elif draft_steps == 1:  # (rows whose prompts end in different places of a block start blocks at different steps,
        assert got.nfe >= want.nfe  # each start a forward more for the batch)
    else:  # (SDAR's and LLaDA2's blocks of 4 leave little to draft: a block's first forward and one or two more)
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


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_a_batch_whose_rows_start_blocks_at_different_steps_takes_one_forward_a_step(family):
    """A row starting its block while others draft is refreshed within their drafts forward (and drafts at the next
    step), so the batch takes about its slowest row's forwards (here at most one more), each row as alone."""
    model = _model(family)
    sampler = dllm.samplers.get("freedave", draft_steps=4)
    kw = {"max_new_tokens": 32, "eos_early_stop": False, **({} if model.attention.block_causal else {"block_size": 8})}
    batch = sampler.generate(model, PROMPTS, **kw)
    alone = [sampler.generate(model, prompt, **kw) for prompt in PROMPTS]
    assert batch.texts == [out.texts[0] for out in alone]
    assert batch.nfe <= max(out.nfe for out in alone) + 1


def test_on_dream_each_block_s_first_slot_comes_from_its_first_forward_and_drafting_stays_lossless(float64_models):
    """As the official code on AR-adapted models: the first slot of each block is its start's proposal, then static
    decoding; drafting more per forward changes no token."""
    model = float64_models("dream:0.5")  # (a random model: the forced slots change its answers)
    prompts = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    kw = {"max_new_tokens": NEW, "block_size": 8, "eos_early_stop": False}
    one = dllm.samplers.get("freedave", draft_steps=1).generate(model, prompts, **kw)
    plain = dllm.samplers.get("freedave", draft_steps=1, ar_first_token=False).generate(model, prompts, **kw)
    assert not torch.equal(one.sequences, plain.sequences)
    assert one.nfe == plain.nfe == NEW  # one forward per slot: the forced one from its block's first forward
    more = dllm.samplers.get("freedave", draft_steps=4).generate(model, prompts, **kw)
    assert torch.equal(more.sequences, one.sequences) and more.nfe < one.nfe


def test_dllm_s_eos_rule_keeps_the_text_and_saves_forwards():
    """``eos_stop="block_with_eos"`` stops a row after the block holding its EOS, not at a block of EOS."""
    model = _model("llada")
    kw = {"max_new_tokens": 32, "block_size": 8}
    official = dllm.samplers.get("freedave").generate(model, PROMPTS, **kw)
    ours = dllm.samplers.get("freedave", eos_stop="block_with_eos").generate(model, PROMPTS, **kw)
    assert ours.texts == official.texts
    assert ours.nfe < official.nfe


def _case_id(case):
    early = "early_exit" if case["early_exit"] else "to_the_end"
    return f"{case['model']}-b{case['block_size']}-d{case['draft_steps']}-{early}-{len(case['prompt'])}"


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_case_id)
def test_tokens_and_forwards_equal_the_official_loop(float64_models, case):
    model = float64_models(case["model"])
    blocks = {} if model.attention.block_causal else {"block_size": case["block_size"]}
    out = dllm.samplers.get("freedave", draft_steps=case["draft_steps"]).generate(
        model,
        torch.tensor([case["prompt"]]),
        max_new_tokens=case["max_new_tokens"],
        eos_early_stop=case["early_exit"],
        **blocks,
    )
    sequence = out.sequences[0].tolist()  # (the official block-causal canvas runs to its last block's end)
    assert sequence == case["sequence"][: len(sequence)]
    assert out.nfe == case["nfe"]


def test_the_fixture_covers_every_branch():
    seen = collections.defaultdict(set)
    for case in FIXTURE["cases"]:
        seen[case["model"].split(":")[0].removeprefix("tiny-")].update(case["branches"])
    every = {"chain_cut", "chain_full", "last_without_forward", "early_exit"}
    assert {family: every - got for family, got in seen.items()} == dict.fromkeys(
        ("llada", "dream", "sdar", "llada2"), set()
    )
    assert "forced_first" in seen["dream"]
