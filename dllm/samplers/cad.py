"""CAD: consistency-aware adaptive decoding (CD4LM, "Consistency Distillation and aDaptive Decoding for diffusion
language models", arXiv 2601.02236)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.core.rng import Stream
from dllm.kernels.reference import ScoreSpec, top_k_per_row
from dllm.samplers.base import Sampler

SELECTIONS = ("confidence", "entropy", "random")


@dataclasses.dataclass(frozen=True)
class CAD(Sampler):
    """CAD (CD4LM, arXiv 2601.02236): commit the block's masks above a threshold, between a minimum and a maximum a
    step, no EOS before a share of the answer is written, and a block forced complete after a number of steps.

    Per row and step: the score of each mask of the current block is the proposal's probability
    (``selection_method="confidence"``), its negative entropy (``"entropy"``, against ``entropy_threshold``) or a
    uniform draw (``"random"``); while fewer than ``eos_threshold_ratio`` of the answer's slots are decoded, a mask
    whose proposal is an EOS token is left out; of the others, ``k = #(score >= threshold)`` clamped to
    [``min_tokens_per_step``, ``max_tokens_per_step``] and to how many there are are committed, best first (when all
    are left out, the ``min_tokens_per_step`` leftmost masks). A block's step numbered ``max_steps_per_block``
    (0-based; None: the block size) commits every mask left in it.

    Official code reproduced (yihao-liang/CDLM ``scripts/LLaDA_generate_dynamic.py``, ``generate_block``, which its
    lm-eval model runs with ``use_dynamic=true``). Defaults: its evaluation scripts' (``evaluation/scripts/
    eval_*.sh``): ``confidence_threshold`` 0.95, ``min_tokens_per_step`` 1, ``max_tokens_per_step`` 32,
    ``eos_threshold_ratio`` 0.3, block 32, temperature 0 (``generate_block``'s own signature has 0.8, 1, 4, 0.5);
    ``max_steps_per_block`` None (the block size), ``entropy_threshold`` -0.3. At a temperature the proposal is the
    argmax of Gumbel-perturbed logits / T, its probability that of the untempered logits, as there.

    Differences: batched and without a host read-back (``generate_block`` is batch 1); the EOS tokens are the
    model's (the official list is LLaDA's and Qwen's ids, 126081, 126348, 151643, 151645); exact score ties go to
    the leftmost slot (``torch.topk``'s order is unspecified); the forced step commits every mask left in the block
    (the official one skips those whose EOS proposal is still left out and ends the block anyway, leaving masks in
    the output); the logits are not clamped to 50 below their maximum first (which moves a probability by under
    ``V e^-50``); ``"random"`` draws from dllm's counter-based streams; any masked family.
    """

    name: ClassVar[str] = "cad"
    on_device: ClassVar[bool] = True
    fixed_steps: ClassVar[bool] = False
    confidence_threshold: float = hp(0.95, "[0, 1]")
    min_tokens_per_step: int = hp(1, ">= 1")
    max_tokens_per_step: int = hp(32, ">= 1")
    eos_threshold_ratio: float = hp(0.3, "[0, 1]", note="no EOS committed before this share of the answer")
    max_steps_per_block: int | None = hp(None, ">= 1", note="None: the block size")
    selection_method: str = hp("confidence", choices=SELECTIONS)
    entropy_threshold: float = hp(-0.3, "<= 0", note="nats, on the negative entropy (selection_method='entropy')")

    def check_hyper_parameters(self) -> None:
        super().check_hyper_parameters()
        if self.min_tokens_per_step > self.max_tokens_per_step:
            raise ConfigError(
                "cad: min_tokens_per_step must be at most max_tokens_per_step (and max_tokens_per_step must be at "
                f"least min_tokens_per_step); got {self.min_tokens_per_step} > {self.max_tokens_per_step}"
            )

    def score_spec(self, run):
        need = {"entropy": "entropy", "confidence": "prob"}.get(self.selection_method)
        return ScoreSpec(need=frozenset({need} if need else set()), temperature=run.temperature, dtype=torch.float32)

    def select(self, step, state):
        canvas, committable = step.canvas, step.committable
        if self.selection_method == "confidence":
            score, threshold = step.scores.prob, self.confidence_threshold
        elif self.selection_method == "entropy":
            score, threshold = -step.scores.entropy, self.entropy_threshold
        else:
            score, threshold = step.uniform(Stream.ORDER, torch.float32), self.confidence_threshold
        answer = (step.columns >= canvas.prompt_width) & (step.columns < canvas.span_end[:, None])
        decoded = (answer & ~step.masked).sum(1)
        early = decoded.double() / answer.sum(1).double() < self.eos_threshold_ratio  # (float64, as the official)
        eos = torch.isin(step.scores.token, step.run.eos)
        valid = committable & ~(early[:, None] & eos)
        count = valid.sum(1)
        k = (valid & (score >= threshold)).sum(1).clamp(min=self.min_tokens_per_step)
        k = torch.minimum(k.clamp(max=self.max_tokens_per_step), count)
        chosen = top_k_per_row(score.masked_fill(~valid, float("-inf")), k) & valid
        blocked = top_k_per_row(committable.float(), torch.full_like(k, self.min_tokens_per_step)) & committable
        chosen = torch.where((count == 0)[:, None], blocked, chosen)  # (every mask left out: the leftmost)
        limit = self.max_steps_per_block or canvas.block_size
        return torch.where((step.step >= limit)[:, None], committable, chosen)
