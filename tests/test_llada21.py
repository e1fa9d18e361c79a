"""The edit decoding process (:mod:`dllm.engine.edit`) and LLaDA2.1's decoder on it: the guarantees the process
states (edits only in the current block, never in the prompt or a slot filled at the same step; bounded post-steps;
termination), and the cases where it must reduce to LLaDA2.0's decoder. Parity with the official LLaDA2.1 generate:
tests/test_parity_llada2.py."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError, DllmError, DllmWarning

PROMPTS = [[10, 11, 12, 13, 14], [20, 21, 22]]
KW = {"max_new_tokens": 13, "eos_early_stop": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from dllm.models.tiny import make_tiny_checkpoint

    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("llada21"), "llada2", seed=0, std=0.5)
    return dllm.load(directory, device="cpu", dtype=torch.float32)


class Steps:
    """A generate callback recording each step as (canvas before, canvas after, slots written, each row's block,
    the rows that worked at this step: not done, rows finishing only when the next step begins)."""

    def __init__(self, canvas: torch.Tensor):
        self.previous, self.steps = canvas.clone(), []

    def __call__(self, info):
        after = info.tokens.clone()
        self.steps.append((self.previous, after, info.committed.clone(), info.block.clone(), ~info.done))
        self.previous = after


def _run(model, sampler, block_size, prompts=PROMPTS, **kw):
    """The generation, its steps (:class:`Steps`) and each row's first block column."""
    prepared = sampler.prepare(model, prompts, block_size=block_size, **{**KW, **kw})
    steps = Steps(prepared.canvas.tokens)
    out = sampler.generate(model, prompts, block_size=block_size, callback=steps, **{**KW, **kw})
    return out, steps.steps, prepared.canvas.first_block.clone()


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("settings", [{"editing_threshold": 0.0}, {"editing_threshold": 0.3, "num_to_transfer": 2}])
def test_edits_stay_in_the_current_block_outside_the_prompt_and_the_steps_fills(model, block_size, settings):
    sampler = dllm.samplers.get("llada21", threshold=0.5, **settings)
    out, steps, first = _run(model, sampler, block_size)
    p, mask = out.prompt_width, model.mask_id
    columns = torch.arange(out.sequences.shape[1])
    edits = 0
    for before, after, written, block, working in steps:
        start = first + block * block_size
        in_block = (columns >= start[:, None]) & (columns < (start + block_size)[:, None])
        edited = written & (before != mask)
        edits += int(edited.sum())
        assert not bool((edited & ~in_block).any()), "an edit outside the current block"
        assert not bool((edited & (columns < p)).any()), "an edit in the prompt"
        assert torch.equal(after[~written], before[~written]), "only the written slots change"
        assert not bool((after[written] == mask).any())
        filled = written & (before == mask)
        had_masks = (in_block & (before == mask)).any(1)
        assert bool((filled.any(1) | ~(had_masks & working)).all()), "a working row's block with masks fills one"
        assert not bool(written[~working].any()), "a finished row never changes"
    assert edits > 0  # these settings edit on this model (else the test shows nothing)


def test_earlier_blocks_and_the_prompt_never_change(model):
    sampler = dllm.samplers.get("llada21", threshold=0.5, editing_threshold=0.0)
    out, steps, first = _run(model, sampler, 4)
    columns = torch.arange(out.sequences.shape[1])
    for before, after, _, block, _ in steps:
        earlier = columns < (first + block * 4)[:, None]
        assert torch.equal(after[earlier], before[earlier])


@pytest.mark.parametrize("max_post_steps", [0, 1, 3])
def test_post_steps_are_bounded_and_the_run_terminates(model, max_post_steps):
    """A block takes at most (its masks + max_post_steps) forwards: a forward of a block that had no mask when it
    began is a post-step, and each block has at most max_post_steps of them."""
    sampler = dllm.samplers.get("llada21", threshold=0.9, editing_threshold=0.0, max_post_steps=max_post_steps)
    out, steps, first = _run(model, sampler, 4)
    post = {}
    mask = model.mask_id
    columns = torch.arange(out.sequences.shape[1])
    for before, _, _, block, working in steps:
        start = first + block * 4
        in_block = (columns >= start[:, None]) & (columns < (start + 4)[:, None])
        for row in range(before.shape[0]):
            if bool(working[row]) and not bool((in_block[row] & (before[row] == mask)).any()):
                key = (row, int(block[row]))
                post[key] = post.get(key, 0) + 1
    assert all(count <= max_post_steps for count in post.values())
    if max_post_steps:
        assert post, "post-steps happened (edits with editing_threshold 0)"
    assert not bool((out.sequences == mask).any())


def test_without_edits_it_is_llada2_plus_one_confirming_forward_per_block(model):
    """No edit is possible (editing_threshold 1: confidences never exceed it): with max_post_steps 0 LLaDA2.1 is
    LLaDA2.0 at one scheduled token per step (same tokens and forwards); with max_post_steps > 0 each block adds
    one mask-free forward that edits nothing and closes it."""
    for block_size in (4, 8):
        base = dllm.samplers.get("llada2", threshold=0.7).generate(
            model, PROMPTS, block_size=block_size, steps_per_block=block_size, **KW
        )
        none = dllm.samplers.get("llada21", threshold=0.7, editing_threshold=1.0, max_post_steps=0)
        same = none.generate(model, PROMPTS, block_size=block_size, **KW)
        assert torch.equal(same.sequences, base.sequences) and same.nfe == base.nfe
        confirming = dllm.samplers.get("llada21", threshold=0.7, editing_threshold=1.0, max_post_steps=5)
        alone = [confirming.generate(model, [p], block_size=block_size, **KW) for p in PROMPTS]
        for p, one in zip(PROMPTS, alone):
            ref = dllm.samplers.get("llada2", threshold=0.7).generate(
                model, [p], block_size=block_size, steps_per_block=block_size, **KW
            )
            assert torch.equal(one.sequences, ref.sequences)
            blocks = -(-(len(p) + KW["max_new_tokens"]) // block_size) - len(p) // block_size
            assert one.nfe == ref.nfe + blocks


def test_batch_rows_equal_alone_and_the_block_cache_is_exact(model, batch_invariant):
    sampler = dllm.samplers.get("llada21", threshold=0.5, editing_threshold=0.2)
    prompts = PROMPTS + [[30, 31, 32, 33, 34, 35, 36]]
    for block_size in (4, 8):
        batch = batch_invariant(sampler, model, prompts, block_size=block_size, **KW)
        plain = sampler.generate(model, prompts, block_size=block_size, cache=None, **KW)
        assert torch.equal(batch.sequences, plain.sequences) and batch.nfe == plain.nfe
        sampled = dict(KW, temperature=1.0, seed=3)
        batch_invariant(sampler, model, PROMPTS, block_size=block_size, **sampled)


def test_caches_that_assume_fixed_tokens_are_refused_and_a_masked_sampler_cannot_edit(model, tiny):
    with pytest.raises(ConfigError, match="rewrites decoded tokens"):
        dllm.samplers.get("llada21").generate(model, PROMPTS, cache="dual", **KW)
    with pytest.raises(ConfigError, match="LLaDA2's own decoder"):
        dllm.samplers.get("llada21").generate(tiny("sdar"), PROMPTS, max_new_tokens=8)
    with pytest.raises(ConfigError, match="do not compose with the 'llada21' sampler"):
        dllm.samplers.get("prophet", base="llada21", answer_offset=2).generate(model, PROMPTS, **KW)
    # an exit rule that is not active (Prophet without an answer region) leaves llada21 alone
    with pytest.warns(DllmWarning, match="never exits early"):
        inactive = dllm.samplers.get("prophet", base="llada21").generate(model, PROMPTS, **KW)
    assert torch.equal(inactive.sequences, dllm.samplers.get("llada21").generate(model, PROMPTS, **KW).sequences)

    import dataclasses
    from typing import ClassVar

    from dllm.engine.step import Decision

    @dataclasses.dataclass(frozen=True)
    class Sneaky(dllm.samplers.get("threshold").__class__):
        name: ClassVar[str] = "sneaky"

        def select(self, step, state):
            return Decision(commit=step.committable, edit=step.committable)

    with pytest.raises(DllmError, match="declare process = 'edit'"):
        Sneaky().generate(model, PROMPTS, **KW)
