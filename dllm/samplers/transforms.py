"""Logit transforms: small composable steps between the forward and the scoring, like ``transformers``'
logits processors. Each sees the logits [n, K, V] of the scored columns ``columns`` [n, K] of the batch
rows ``rows`` [n] (the mask token's logit is already -inf and must stay so) and returns new logits.

Stateless ones (:class:`SpecTransform`: temperature, top-k, top-p, suppressed ids) are fields of the
scoring spec that the scoring backend reads; the scorer folds them into the sampler's spec.

A transform may keep state for a generation (``init_state``), reset parts of it when rows enter a block
(``begin_block``, called by the loop with the sampler's own hook), and may run counted forwards through
``step.run.forward`` (classifier-free guidance does).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core import params
from dllm.core.errors import ConfigError
from dllm.kernels.reference import ScoreSpec, suppress, warp


class Transform(params.HyperParameters):
    """A logit transform with a state: run by the loop's scorer, in order, before the scoring. A dataclass
    transform's fields are checked when it is built (:mod:`dllm.core.params`)."""

    noun = "sampler"  # registered transforms are composed by name through dllm.samplers.get
    # False: the state is the batch's (allocated at the first call), so rows cannot join a running generation
    # (dllm.engine.join)
    joins: ClassVar[bool] = True

    def init_state(self, run):
        return None

    def begin_block(self, step, state, rows: torch.Tensor) -> None:
        """``rows`` (bool [B]) entered a new block (per-block state, e.g. CreditDecoding's credit)."""

    def __call__(self, logits, rows, columns, step, state) -> torch.Tensor:
        raise NotImplementedError


class SpecTransform(Transform):
    """A stateless transform: a field of the :class:`~dllm.kernels.reference.ScoreSpec` that the scoring
    backend reads (a fused kernel applies it in its pass over the vocabulary). The scorer folds it into the
    sampler's spec (:meth:`fold`) instead of running it; calling it applies the same to logits (for tests).
    Where it runs: suppressed ids before every stateful transform, the warps (temperature, top-k, top-p) after
    them and after the ``logit_margin`` statistic, in the order they were folded."""

    def fold(self, spec: ScoreSpec) -> ScoreSpec:
        raise NotImplementedError

    def __call__(self, logits, rows=None, columns=None, step=None, state=None):
        spec = self.fold(ScoreSpec())
        return warp(suppress(logits, spec.suppress), spec)


def _fold_warp(spec: ScoreSpec, name: str, value, off: bool, **fields) -> ScoreSpec:
    """``spec`` with the warp ``name`` set to ``value`` (and ``fields``), placed after the warps already on."""
    if off:
        return spec
    if name in spec.warps:
        raise ConfigError(
            f"{name} is set twice (by the sampler and by an added transform); set it once, e.g. as the sampler's "
            "hyper-parameter"
        )
    fill = fields.get("fill", spec.fill)
    if {"top_k", "top_p"} & set(spec.warps) and fill != spec.fill:
        raise ConfigError(f"{name} fills with {fill}, the filter already set with {spec.fill}: use one fill value")
    rest = tuple(w for w in spec.order if w not in spec.warps and w != name)
    return dataclasses.replace(spec, **{name: value}, **fields, order=(*spec.warps, name, *rest))


@dataclasses.dataclass(frozen=True)
class SuppressTokens(SpecTransform):
    """Never propose these token ids (LLaDA's ``logits_eos_inf``: their logits become -inf): the spec's
    ``suppress``."""

    ids: tuple[int, ...] = params.hp(range=">= 0")

    def fold(self, spec):
        return dataclasses.replace(spec, suppress=tuple(dict.fromkeys((*spec.suppress, *self.ids))))


@dataclasses.dataclass(frozen=True)
class Temperature(SpecTransform):
    """Divide the logits by ``temperature`` (Dream and SDAR sample from the tempered distribution and
    take their confidences from it): the spec's ``temper`` (a -inf logit stays -inf also when the temperature
    overflows the logits' dtype)."""

    temperature: float = params.hp(range="> 0")

    def fold(self, spec):
        return _fold_warp(spec, "temper", self.temperature, self.temperature == 1.0)


@dataclasses.dataclass(frozen=True)
class TopK(SpecTransform):
    """Keep the ``k`` largest logits per slot (ties kept), the rest become ``fill``: the spec's ``top_k``."""

    k: int | None
    fill: float = params.hp(float("-inf"), "[-inf, inf]")

    def fold(self, spec):
        return _fold_warp(spec, "top_k", self.k, not self.k or self.k <= 0, fill=self.fill)


@dataclasses.dataclass(frozen=True)
class TopP(SpecTransform):
    """Nucleus filter at probability ``p`` per slot; the rest become ``fill``: the spec's ``top_p``."""

    p: float | None = params.hp(range=">= 0", note=">= 1: off")
    fill: float = params.hp(float("-inf"), "[-inf, inf]")

    def fold(self, spec):
        return _fold_warp(spec, "top_p", self.p, self.p is None or self.p >= 1.0, fill=self.fill)


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

    scale: float = params.hp(range=">= 0")

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
        hidden = state.hidden.select(step.active_rows(rows))
        uncond = run.scorer.logits(step, rows, columns, hidden, raw=True)
        out = uncond + (self.scale + 1) * (logits - uncond)
        out[..., run.model.mask_id] = float("-inf")  # -inf in both: keep it so instead of NaN
        return out
