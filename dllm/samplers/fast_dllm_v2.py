"""Fast-dLLM v2's reference decoding: ``batch_sample`` of NVlabs/Fast-dLLM ``v2/generation_functions.py`` (Wu et al.
2025, "Fast-dLLM v2: Efficient Block-Diffusion LLM", arXiv 2509.26328)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.engine.step import NO_OVERRIDE, Decision
from dllm.kernels import selection
from dllm.kernels.reference import ScoreSpec
from dllm.kernels.selection import Rule
from dllm.samplers.base import Sampler


@dataclasses.dataclass(frozen=True)
class FastDLLMv2(Sampler):
    """Fast-dLLM v2's sub-block parallel decoding (``batch_sample``, which its evaluation ``v2/eval.py`` runs).

    Blocks of the model's ``bd_size`` (32) positions in order, each decoded in sub-blocks of ``small_block_size``
    (8) positions from the block's start, left to right: a step forwards the block (its finished prefix from the
    exact block K/V cache) and, in the first sub-block still holding masks, commits every masked slot whose
    proposal's probability is above ``threshold`` (strictly) and always the most probable one. A block's first
    position is decoded alone, by the argmax of the forward that completes the previous block (the official
    ``next_token`` from that forward's last logit, which writes the finished block's K/V): with the exact block cache
    that is this block's first forward. ``threshold`` 1 commits one token per step (the published evals' setting).

    temperature > 0 samples the sub-block's proposals from the tempered distribution cut to its top-p nucleus
    (``top_p`` 0.95), scored by their probability there (``sample_with_top_p``); the block's first token is the
    argmax whatever the temperature, as officially.

    use_block_cache: the official name; True makes the default cache Fast-dLLM v2's sub-block cache (``subblock``:
    only the sub-block computed inside the block, approximate) instead of the exact block cache.

    Defaults as ``v2/eval.py``: threshold 0.9, small_block_size 8, top_p 0.95, use_block_cache False; the block is the
    model's ``bd_size``.
    On other block-causal models (SDAR, LLaDA2), whose first block position reads its own output, it is the same
    sub-block threshold rule without the argmax hand-off.

    Differences from the official code, all where it is batch-1 only or undefined (the texts of prompts it decodes
    as defined are the same, token for token):
    - ``max_new_tokens`` is ours: at least that many tokens, to the end of the block holding the last (the official
      ``batch_sample`` ends ``max_new_tokens`` after the start of the prompt's last block, so a prompt ending
      mid-block gets ``max_new_tokens - prompt_len % bd_size``);
    - every row decodes as it would alone: the official batch decodes a row whose prompt ends on a block boundary
      but is not the batch's shortest from its own output instead of the previous position's, samples every row
      from row 0's distribution at temperature > 0, and ignores the prompt when the shortest is exactly one block
      long (it then has no K/V of it);
    - a sub-block larger than the block is the block; one that does not divide it leaves a shorter last sub-block
      (the official loop never reaches the block's tail and does not end); the mask token is never proposed (nor
      counted in the probabilities: the official code can commit it, and then loops without end or decodes the
      block's first token from its own output);
    - forwards: the prompt's complete blocks are computed in the first step's forward, not a forward of their own,
      and no forward follows the last block (the official one writes its K/V and appends a token past the span);
      ``eos_early_stop`` (on by default) stops a row after the block in which it decoded EOS, as the official
      ``finished_flag``, and also when its EOS is a block's first token.
    """

    name: ClassVar[str] = "fast_dllm_v2"
    per_row_fields: ClassVar[tuple[str, ...]] = ("threshold",)
    on_device: ClassVar[bool] = True
    fixed_steps: ClassVar[bool] = False
    threshold: float = hp(0.9, "[0, 1]", note="strict: 1 commits one token per step")
    small_block_size: int = hp(8, ">= 1", note="the sub-block, at most the model's block")
    top_p: float = hp(0.95, "[0, 1]", note="temperature > 0 only; 1.0: off")
    use_block_cache: bool = hp(False, note="the default cache: the sub-block cache ('subblock'), not the block cache")

    def default_cache(self, model):
        if not self.use_block_cache:
            return super().default_cache(model)
        from dllm.caches.subblock import SubBlock

        return SubBlock(small_block_size=self.small_block_size)

    def check_cache(self, model, cache):
        from dllm.caches.subblock import SubBlock

        if isinstance(cache, SubBlock) and cache.small_block_size != self.small_block_size:
            raise ConfigError(
                f"the 'subblock' cache's small_block_size ({cache.small_block_size}) must be the sampler's "
                f"({self.small_block_size}): pass the same to both, or use_block_cache=True for the sampler's own"
            )

    def check_model(self, model):
        if not model.attention.block_causal:
            raise ConfigError(
                f"the {self.name!r} sampler needs a block-causal model (Fast-dLLM v2, SDAR, LLaDA2); this "
                f"{model.family} model has {model.attention} attention. Use 'threshold' (Fast-dLLM's rule) instead"
            )

    def score_spec(self, run):
        t = run.temperature
        if t == 0:
            return ScoreSpec(need=frozenset({"prob"}))
        # temper, then the top-p nucleus; its renormalised distribution is sampled as is and scores the proposal
        return ScoreSpec(need=frozenset({"prob", "argmax"}), temperature=1.0, temper=t, top_p=self.top_p)

    def observe(self, step, state):
        width = min(self.small_block_size, step.canvas.block_size)
        return step.window(width, step.sub_block(width)[0])

    def select(self, step, state):
        start, end = step.sub_block(min(self.small_block_size, step.canvas.block_size))
        columns = step.columns
        sub = step.committable & (columns >= start[:, None]) & (columns < end[:, None])
        rule = Rule("threshold", threshold=self.row_value(step, "threshold"), strict=True)
        commit = selection.select(rule, step.scores.prob, sub, None)
        if not step.model.shift:
            return commit
        # a masked block start reads the previous block's last output: it is decoded alone, by its argmax
        first = columns == step.start[:, None]
        hand_off = (step.committable & first).any(1)
        commit = torch.where(hand_off[:, None], step.committable & first, commit)
        if step.run.temperature == 0:  # (with rows of their own temperatures: whether any samples; a greedy row's
            return commit  # argmax is its proposal, so the override below leaves it as it is alone)
        tokens = torch.where(hand_off[:, None] & first, step.scores.argmax, NO_OVERRIDE)
        return Decision(commit=commit, tokens=tokens)
