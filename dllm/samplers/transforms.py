"""Logit transforms: small composable steps between the forward and the scoring, like ``transformers``'
logits processors. Each sees the logits [n, K, V] of the scored columns ``columns`` [n, K] of the batch
rows ``rows`` [n] (the mask token's logit is already -inf and must stay so) and returns new logits.

A transform may keep state for a generation (``init_state``), reset parts of it when rows enter a block
(``begin_block``, called by the loop with the sampler's own hook), and may run counted forwards through
``step.run.forward`` (classifier-free guidance does).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.kernels.reference import top_k_filter, top_p_filter


class Transform:
    """sampling: the transform shapes the sampling distribution only (temperature, top-p, top-k): the
    ``logit_margin`` statistic is measured on the logits before the first such transform."""

    sampling: ClassVar[bool] = False

    def init_state(self, run):
        return None

    def begin_block(self, step, state, rows: torch.Tensor) -> None:
        """``rows`` (bool [B]) entered a new block (per-block state, e.g. CreditDecoding's credit)."""

    def __call__(self, logits, rows, columns, step, state) -> torch.Tensor:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class SuppressTokens(Transform):
    """Never propose these token ids (LLaDA's ``logits_eos_inf``: their logits become -inf)."""

    ids: tuple[int, ...]

    def __call__(self, logits, rows, columns, step, state):
        logits[..., list(self.ids)] = float("-inf")
        return logits


@dataclasses.dataclass(frozen=True)
class Temperature(Transform):
    """Divide the logits by ``temperature`` (Dream and SDAR sample from the tempered distribution and
    take their confidences from it). A -inf logit stays -inf also when the temperature overflows the logits'
    dtype (e.g. 1e300 in float32: -inf / inf would be NaN)."""

    sampling: ClassVar[bool] = True

    temperature: float

    def __call__(self, logits, rows, columns, step, state):
        out = logits / self.temperature
        if self.temperature > torch.finfo(logits.dtype).max:
            out = out.masked_fill(logits == float("-inf"), float("-inf"))
        return out


@dataclasses.dataclass(frozen=True)
class TopK(Transform):
    """Keep the ``k`` largest logits per slot (ties kept), the rest become ``fill``."""

    sampling: ClassVar[bool] = True

    k: int | None
    fill: float = float("-inf")

    def __call__(self, logits, rows, columns, step, state):
        return top_k_filter(logits, self.k, self.fill)


@dataclasses.dataclass(frozen=True)
class TopP(Transform):
    """Nucleus filter at probability ``p`` per slot; the rest become ``fill``."""

    sampling: ClassVar[bool] = True

    p: float | None
    fill: float = float("-inf")

    def __call__(self, logits, rows, columns, step, state):
        return top_p_filter(logits, self.p, self.fill)


@dataclasses.dataclass
class _GuidanceState:
    iteration: int = -1  # the loop step whose unconditional forward is kept
    hidden: object = None
    fixed: torch.Tensor | None = None  # bool [B, L]: columns that held a token when decoding started


@dataclasses.dataclass(frozen=True)
class Guidance(Transform):
    """Classifier-free guidance (LLaDA ``generate.py``): a second, counted forward with every column that held
    a token when decoding started masked (the prompt, and tokens written before decoding such as Prophet's
    constraints: the official ``prompt_index = x != mask_id``) gives unconditional logits ``u``; the result
    is ``u + (scale + 1) (c - u)``. One unconditional forward per step: columns scored later in the same
    step (an early exit's fill) reuse it."""

    scale: float

    def init_state(self, run):
        return _GuidanceState()

    def __call__(self, logits, rows, columns, step, state):
        run = step.run
        if state.fixed is None:  # the first forward comes before any commit
            state.fixed = step.tokens != step.canvas.mask_id
        if state.iteration != step.iteration:
            tokens = step.of_active(step.tokens).masked_fill(step.of_active(state.fixed), step.canvas.mask_id)
            state.hidden = run.forward(tokens, step.of_active(step.canvas.positions), step.valid)
            state.iteration = step.iteration
        hidden = state.hidden.select(torch.searchsorted(step.active, rows))
        uncond = run.model.head(hidden, columns, checks=run.checks)
        out = uncond + (self.scale + 1) * (logits - uncond)
        out[..., run.model.mask_id] = float("-inf")  # -inf in both: keep it so instead of NaN
        return out
