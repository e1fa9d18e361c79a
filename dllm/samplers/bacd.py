"""BACD: bounded adaptive confidence decoding (TDAR, "Advancing Block Diffusion LMs for Test-Time Scaling",
arXiv 2602.09555)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.kernels.reference import ScoreSpec
from dllm.samplers.base import Sampler


@dataclasses.dataclass
class History:
    """Per row, the confidences committed so far in its current block: their sum (float64) and count."""

    total: torch.Tensor
    count: torch.Tensor

    def add(self, conf: torch.Tensor, commit: torch.Tensor) -> None:
        """Add the confidences ``conf`` [B, L] of a step's commits ``commit`` (bool [B, L])."""
        self.total += conf.double().masked_fill(~commit, 0.0).sum(1)
        self.count += commit.sum(1)


@dataclasses.dataclass(frozen=True)
class BACD(Sampler):
    """BACD (TDAR, arXiv 2602.09555): commit the block's masks whose confidence reaches a threshold set by the
    confidences committed so far in the block, clamped to [lower, upper].

    Per row and step, with ``conf`` the proposal's probability on the block's masks: at a block's first step the
    threshold is ``clamp(max conf, lower, upper)``, later ``clamp(mean of the confidences committed in the block so
    far, lower, upper)``; every mask with ``conf >= threshold`` is committed, else the most confident one (the
    progress guarantee), and the committed confidences join the block's history, which a new block starts empty.
    A confident start raises the bar for the rest of the block, an uncertain one lowers it, within the bounds.

    Official code reproduced (LuLuLuyi/TDAR, ``third_party/lmdeploy-0.10.2/lmdeploy/pytorch/strategies/dllm/
    unmasking.py``, ``UnmaskingProcessor.bounded_adaptive_confidence_decoding``): ``confidence_upper_threshold``
    0.9, ``confidence_lower_threshold`` 0.6 (its defaults); the confidence is the softmax of the logits in their
    dtype at the proposed token, compared in that dtype. TDAR's evaluation decodes its SDAR-family checkpoint in
    blocks of 16 at temperature 1.0 (``configs/eval_config/tdar_eval.yaml``); here the block size is the model's
    or ``block_size``, and the temperature ``generate``'s (the proposal sampled from ``softmax(logits / T)``, its
    confidence that of the untempered logits). The number of steps depends on the data: ``steps`` /
    ``steps_per_block`` are not used.

    Differences: batched and without a host read-back; each row keeps its own history (lmdeploy keys it by the
    block's index in the running batch, so a row can read another's history when the batch changes); the history's
    mean is its float64 sum over its count (lmdeploy: ``mean`` of the concatenated confidences in their dtype,
    which rounds differently in the last bits); exact ties of the most confident mask go to the leftmost; any masked
    family, not only SDAR's (on full-attention models, the semi-autoregressive blocks of the loop). TDAR's "think
    coarse, critic fine" (decode with BACD until ``</think>``, then at block size 1) is two ``generate`` calls.
    """

    name: ClassVar[str] = "bacd"
    on_device: ClassVar[bool] = True
    fixed_steps: ClassVar[bool] = False
    confidence_upper_threshold: float = hp(0.9, "[0, 1]")
    confidence_lower_threshold: float = hp(0.6, "[0, 1]")

    def check_hyper_parameters(self) -> None:
        super().check_hyper_parameters()
        if self.confidence_lower_threshold > self.confidence_upper_threshold:
            raise ConfigError(
                "bacd: confidence_lower_threshold must be at most confidence_upper_threshold (and "
                "confidence_upper_threshold must be at least confidence_lower_threshold): the threshold is clamped to "
                f"[lower, upper]; got {self.confidence_lower_threshold} > {self.confidence_upper_threshold}"
            )

    def init_state(self, run):
        b, device = run.canvas.batch, run.canvas.tokens.device
        return History(
            torch.zeros(b, dtype=torch.float64, device=device), torch.zeros(b, dtype=torch.long, device=device)
        )

    def begin_block(self, step, state, rows):
        state.total.masked_fill_(rows, 0.0)
        state.count.masked_fill_(rows, 0)

    def score_spec(self, run):
        return ScoreSpec(need=frozenset({"prob"}), temperature=run.temperature)

    def select(self, step, state):
        commit = bounded_adaptive(
            step.scores.prob, step.committable, state.total, state.count,
            self.confidence_lower_threshold, self.confidence_upper_threshold,
        )  # fmt: skip
        state.add(step.scores.prob, commit)
        return commit


def bounded_adaptive(conf, committable, total, count, lower: float, upper: float) -> torch.Tensor:
    """bool [B, L]: BACD's commits. ``conf`` [B, L] the proposals' probabilities, ``committable`` bool [B, L] the
    block's masks, ``total`` / ``count`` [B] the sum and number of the confidences committed in the row's block so
    far. No host synchronisation."""
    candidates = conf.masked_fill(~committable, float("-inf"))
    top, best = candidates.max(1)
    mean = total / count.clamp(min=1)
    tau = torch.where(count == 0, top.double(), mean).clamp(min=lower, max=upper).to(conf.dtype)
    eligible = committable & (conf >= tau[:, None])
    columns = torch.arange(conf.shape[1], device=conf.device)
    fallback = (columns == best[:, None]) & committable & ~eligible.any(1, keepdim=True)
    return eligible | fallback
