"""LLaDA2.x's own decoders: LLaDA2.0's threshold decoding (``llada2``) and LLaDA2.1's mask-to-token plus
token-to-token editing (``llada21``), the ``generate`` methods of the official ``modeling_llada2_moe.py``
(research/llada2.md §4–§5), batched.

Official argument -> dllm: ``block_length`` -> ``block_size``, ``gen_length`` -> ``max_new_tokens``, ``steps`` (per
block) -> ``steps_per_block``, ``temperature`` -> generate's ``temperature``; ``eos_id`` / ``mask_id`` are the
model's. Every other argument keeps its name, default and meaning.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp, same_as
from dllm.engine.step import NO_OVERRIDE, Decision
from dllm.kernels import selection
from dllm.kernels.reference import ScoreSpec
from dllm.kernels.selection import Rule
from dllm.samplers.base import Sampler


def _check_llada2(sampler, model) -> None:
    if model.family != "llada2":
        raise ConfigError(
            f"the {sampler.name!r} sampler is LLaDA2's own decoder (block-causal LLaDA2.x checkpoints); this is a "
            f"{model.family} model. Use its family's sampler, or 'threshold'"
        )


def _sampling_spec(run, top_k, top_p) -> ScoreSpec:
    """The official warps: logits / T, top-k, top-p, softmax, one draw; the confidence is the drawn token's
    probability under that distribution. T = 0: the argmax and its softmax probability (top-k / top-p unused)."""
    t = run.temperature
    if t == 0:
        return ScoreSpec(need=frozenset({"prob"}), temperature=0.0)
    warps = ("temper", "top_k", "top_p")
    return ScoreSpec(need=frozenset({"prob"}), temperature=1.0, temper=t, top_k=top_k, top_p=top_p, order=warps)


@dataclasses.dataclass(frozen=True)
class LLaDA2(Sampler):
    """LLaDA2.0's ``generate`` (``LLaDA2MoeModelLM.generate`` of the official remote code; Bie et al. 2025, arXiv
    2512.15745, §5.4 "hybrid acceptance").

    Blocks of ``block_size`` (official default 32) aligned to position 0, the first holding the prompt tail; the
    tail of the last block past ``max_new_tokens`` is decoded and left out of the answer (texts, token counts), as
    the official return ``x[P : P + gen_length]``. Each block takes at most ``steps_per_block`` steps (default: the
    official ``steps`` 32, capped at the block size, which schedules the same tokens), capped at
    ``max_new_tokens // minimal_topk``; step i is scheduled ``n_i`` tokens, ``block_size`` split evenly over the
    steps, the remainder first. A step commits every masked slot whose confidence is above ``threshold`` (strict)
    when there are at least ``n_i`` of them, else the ``n_i`` most confident (all that is left, at most).
    Temperature 0: the argmax, its confidence its softmax probability; T > 0: logits / T, ``top_k``, ``top_p``
    (None: off), one draw, its probability under that distribution.

    EOS: once a block holding an EOS is complete the row stops (the official generate always does; dllm's
    ``generate(eos_early_stop=False)`` decodes the whole span instead). ``eos_early_stop=True`` (this sampler's
    hyper-parameter, the official argument: ``dllm.samplers.get("llada2", eos_early_stop=True)``, ``--set
    eos_early_stop=true``; not generate's argument of the same name) also stops a row mid-block, right after a
    step that commits an EOS and leaves no mask before the row's first EOS; the row's remaining masks are then
    filled with EOS, at no forward.

    Differences from the official code (batch 1, every decision indexed on row 0): batched, each row with its own
    prompt length, schedule and stops; the first EOS is looked for in the generated span only (the official
    ``eos_early_stop`` scans the prompt too, so a prompt holding EOS gave an empty answer), and the answer never
    exceeds ``max_new_tokens`` (the official mid-block return after an EOS committed in the block tail returned
    more than ``gen_length`` ids); the mask token is never proposed (the official argmax may pick it and leave a
    mask in the answer); ``max_new_tokens < minimal_topk``, where the official schedule has no step (a division by
    zero), takes one step per block. Defaults as the official signature: threshold 0.95, minimal_topk 1,
    eos_early_stop False, 32 steps per block, block 32 (the paper's evaluation setting, temperature 0).
    """

    name: ClassVar[str] = "llada2"
    per_row_fields: ClassVar[tuple[str, ...]] = ("threshold",)
    per_row_eos: ClassVar[bool] = False  # (its eos_early_stop hyper-parameter sets the rule: the official)
    on_device: ClassVar[bool] = True
    default_steps_per_block: ClassVar[int | None] = 32
    leaves_full_blocks: ClassVar[bool] = True
    threshold: float = hp(0.95, "[0, 1]")
    minimal_topk: int = hp(1, ">= 1")
    eos_early_stop: bool = False
    top_k: int | None = hp(None, ">= 0", note="0 or None: off")
    top_p: float | None = hp(None, "(0, 1]", note="None or 1: off")

    def check_model(self, model):
        _check_llada2(self, model)

    def score_spec(self, run):
        return _sampling_spec(run, self.top_k, self.top_p)

    def quota(self, step, state):
        run = step.run
        # at least one (the official code divides by zero when max_new_tokens < minimal_topk)
        length = run.answer_width  # max_new_tokens (each row's own, a tensor, where the rows' differ)
        if isinstance(length, int):
            steps = max(1, min(run.steps_per_block, length // self.minimal_topk))
        else:
            steps = (length // self.minimal_topk).clamp(min=1, max=run.steps_per_block)
        bs = step.canvas.block_size
        return bs // steps + (step.step < bs % steps).long()

    def selection(self, step, state):
        # above the threshold when at least n_i are, else the n_i most confident: the union of the two (fused on
        # the Triton backend; with eos_early_stop, select applies it with the reference, then the stop)
        return Rule("threshold", threshold=self.row_value(step, "threshold"), strict=True, quota_floor=True)

    def kernel_rule(self, step, state):
        return None if self.eos_early_stop else super().kernel_rule(step, state)  # the stop is not the rule's

    def select(self, step, state):
        commit = super().select(step, state)
        return eos_stop(step, commit) if self.eos_early_stop else commit

    def commit_span(self, step, state):
        # a row stopped mid-block by eos_early_stop has its masks past the block filled with EOS
        return step.columns >= step.canvas.prompt_width if self.eos_early_stop else None


def eos_stop(step, commit: torch.Tensor) -> Decision:
    """The official ``eos_early_stop``: a row whose step commits an EOS and leaves no mask before its first EOS
    stops now, its remaining masks (any block) written as EOS."""
    proposals = step.scores.token
    tokens = torch.where(commit, proposals, step.tokens)
    span = step.columns >= step.canvas.prompt_width
    eos = torch.isin(tokens, step.run.eos) & span
    first = torch.where(eos.any(1), eos.long().argmax(1), step.canvas.length)
    masked_before = (tokens == step.model.mask_id) & span & (step.columns < first[:, None])
    stop = (commit & torch.isin(proposals, step.run.eos)).any(1) & ~masked_before.any(1) & ~step.done
    fill = stop[:, None] & step.masked & span & ~commit
    tokens = torch.where(fill, torch.full_like(tokens, step.model.eos_id), torch.full_like(tokens, NO_OVERRIDE))
    return Decision(commit=commit | fill, tokens=tokens)


@dataclasses.dataclass(frozen=True)
class LLaDA21(Sampler):
    """LLaDA2.1's ``generate``: mask-to-token commits plus token-to-token edits (Bie et al. 2026, "LLaDA2.1",
    arXiv 2602.08676, eq. 1–3), on the edit decoding process (:mod:`dllm.engine.edit`).

    Blocks as :class:`LLaDA2`'s. At each forward of a block: the masked slots whose confidence is above
    ``threshold`` (strict) are filled, or, when fewer than ``num_to_transfer`` are, the ``num_to_transfer`` most
    confident (all that is left, at most); and every decoded slot of the block (not the prompt, not a slot filled
    at this step) whose proposal differs from its token with a confidence above ``editing_threshold`` (strict) is
    rewritten. Once the block holds no mask it takes up to ``max_post_steps`` more forwards, and leaves after the
    first one that edits nothing (``max_post_steps=0``: none; edits still happen while masks remain). No schedule:
    ``steps_per_block`` is not used (the official ``steps`` and ``minimal_topk`` are accepted and unused).
    Temperature and ``top_k`` / ``top_p`` as :class:`LLaDA2`'s.

    EOS: this sampler's ``eos_early_stop`` (the official argument, default False) stops a row once a block is left
    with no mask and an EOS in the row's answer so far; the official generate otherwise decodes every block, and so
    does dllm's ``generate`` unless it is passed ``eos_early_stop=True`` (which stops as the official
    ``eos_early_stop`` does: the same text, cut at the first EOS, in fewer forwards).

    Presets (the model card): **S mode** (speed) ``threshold=0.5, editing_threshold=0.0``; **Q mode** (quality)
    ``threshold=0.7, editing_threshold=0.5``; both with block 32, temperature 0, ``max_post_steps=16``. The defaults
    are the official signature's (0.95 / 0.9 / 16 / 1), which is neither mode.

    Differences from the official code (batch 1): batched, each row with its own block, post-steps and stops; the
    mask token is never proposed. Caches: none, or the block cache (it recomputes the current block at every
    forward, which edits rewrite); the others assume that decoded tokens never change and are refused.
    """

    name: ClassVar[str] = "llada21"
    per_row_eos: ClassVar[bool] = False  # (its eos_early_stop hyper-parameter sets the rule: the official)
    process: ClassVar[str] = "edit"
    fixed_steps: ClassVar[bool] = False
    threshold: float = same_as(LLaDA2, "threshold")
    editing_threshold: float = hp(0.9, "[0, 1]")
    max_post_steps: int = hp(16, ">= 0")
    num_to_transfer: int = hp(1, ">= 1")
    eos_early_stop: bool = same_as(LLaDA2, "eos_early_stop")
    top_k: int | None = same_as(LLaDA2, "top_k")
    top_p: float | None = same_as(LLaDA2, "top_p")

    def check_model(self, model):
        _check_llada2(self, model)

    def check_cache(self, model, cache):
        if cache is not None and cache.name != "block":
            raise ConfigError(
                f"the {self.name!r} sampler rewrites decoded tokens of the current block, which the {cache.name!r} "
                "cache assumes never change; use cache='block' (the default: it recomputes the current block at "
                "every forward) or cache=None"
            )

    def default_eos_early_stop(self) -> bool:
        return self.eos_early_stop  # the official rule: off unless asked for

    def init_state(self, run):
        if self.eos_early_stop:  # the official block-level EOS stop
            run.eos_early_stop = bool(run.model.eos_ids)
        return None

    def score_spec(self, run):
        return _sampling_spec(run, self.top_k, self.top_p)

    def select(self, step, state):
        # mask-to-token: LLaDA2.0's rule with num_to_transfer as the quota; token-to-token: the process keeps the
        # block's decoded slots whose proposal differs
        rule = Rule("threshold", threshold=self.threshold, strict=True, quota_floor=True)
        quota = torch.full_like(step.start, self.num_to_transfer)
        fill = selection.select(rule, step.scores.prob, step.committable, quota)
        return Decision(commit=fill, edit=step.scores.prob > self.editing_threshold)
