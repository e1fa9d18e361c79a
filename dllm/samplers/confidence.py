"""Confidence-ordered unmasking: LLaDA's reference sampler and Fast-dLLM's threshold / factor rules.

All three propose ``x0 = argmax`` of Gumbel-perturbed logits (float64 noise, LLaDA ``add_gumbel_noise``)
and score it by its softmax probability under the unperturbed logits; they differ in how many
candidates of the current block they commit per step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.core.rng import Stream
from dllm.kernels.reference import ScoreSpec, top_k_per_row
from dllm.kernels.selection import Rule
from dllm.samplers.base import Sampler
from dllm.samplers.transforms import Guidance


def num_transfer_tokens(masks: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's ``get_num_transfer_tokens``: split each row's ``masks`` count over ``steps`` steps,
    the remainder going to the first steps. Returns [B, steps]; each row sums to its count."""
    base = (masks // steps)[:, None]
    extra = (torch.arange(steps, device=masks.device)[None, :] < (masks % steps)[:, None]).long()
    return base + extra


@dataclasses.dataclass
class Schedule:
    """Per-row number of tokens to commit at each step of the current block: [B, steps_per_block]."""

    counts: torch.Tensor

    def begin(self, step, rows: torch.Tensor) -> None:
        """Rows entering a block split their masks over the block's steps (LLaDA, at block start)."""
        fresh = num_transfer_tokens(step.committable.sum(1), step.run.steps_per_block)
        self.counts = torch.where(rows[:, None], fresh, self.counts)

    def quota(self, step) -> torch.Tensor:
        index = step.step.clamp(max=self.counts.shape[1] - 1)
        return self.counts.gather(1, index[:, None]).squeeze(1)

    def idle(self, step) -> torch.Tensor:
        """[B] the steps from this one on that the schedule gives nothing (up to its next count above 0, or its
        end), found on the device."""
        steps = self.counts.shape[1]
        busy = (self.counts > 0) & (torch.arange(steps, device=self.counts.device) >= step.step[:, None])
        return torch.where(busy.any(1), busy.long().argmax(1), steps) - step.step


@dataclasses.dataclass(frozen=True)
class LLaDA(Sampler):
    """LLaDA's reference sampler (ML-GSAI/LLaDA ``generate.py``; Nie et al. 2025, arXiv 2502.09992).

    Semi-autoregressive blocks; in each block the masks are split evenly over the block's steps
    (``get_num_transfer_tokens``) and each step commits the most confident proposals.

    remasking: ``"low_confidence"`` (confidence = softmax probability, in the logits' dtype as in the
        official code) or ``"random"`` (uniform random order).
    cfg_scale: classifier-free guidance; the unconditional pass masks the prompt and the logits are
        ``un + (cfg_scale + 1) (cond - un)``. Costs two forwards per step (counted in ``nfe``).
    logits_eos_inf: never propose EOS (the official recommendation for HumanEval).
    confidence_eos_eot_inf: rank EOS / end-of-turn proposals last. The official code has a bug
        (ML-GSAI/LLaDA issue #137): at temperature > 0 it only suppresses end-of-turn. That reference
        behaviour is the default; ``fix_confidence_eos_eot=True`` suppresses both at every temperature.
    float64_confidence: compute the confidences in float64, as the copies of this sampler in Fast-dLLM
        (``get_transfer_index``) and dKV-Cache do; the LLaDA code uses the logits' dtype (default), where
        confident proposals saturate at exactly 1.0 and tie (broken towards the lower column).
    Defaults as ``generate()``: low_confidence, cfg 0; block_size 32 as in ``chat.py``.
    """

    name: ClassVar[str] = "llada"
    on_device: ClassVar[bool] = True
    remasking: str = hp("low_confidence", choices=("low_confidence", "random"))
    cfg_scale: float = hp(0.0, ">= 0", note="0: no guidance")
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    fix_confidence_eos_eot: bool = False
    float64_confidence: bool = False

    def init_state(self, run):
        b = run.canvas.batch
        return Schedule(torch.zeros(b, run.steps_per_block, dtype=torch.long, device=run.canvas.tokens.device))

    def begin_block(self, step, state, rows):
        state.begin(step, rows)

    def quota(self, step, state):
        return state.quota(step)

    def idle_steps(self, step, state):
        return state.idle(step)

    def check_cache(self, model, cache):
        if self.cfg_scale and cache is not None:
            block = model.attention.block_causal
            raise ConfigError(
                "classifier-free guidance (cfg_scale > 0) cannot be combined with a K/V cache: pass cache=None"
                + (" (this block-causal model uses an exact block cache by default)" if block else "")
            )

    def transforms(self, run):
        out = []
        if self.cfg_scale:
            out.append(Guidance(self.cfg_scale))
        return tuple(out)

    def score_spec(self, run):
        exclude = ()
        if self.confidence_eos_eot_inf:
            # Reference: at temperature 0 the noisy and clean logits are one tensor, so both EOS and
            # end-of-turn columns are cleared; at temperature > 0 only end-of-turn is.
            eos = run.model.eos_ids
            exclude = eos if self.fix_confidence_eos_eot or run.temperature == 0 else eos[1:]
        need = {"prob"} if self.remasking == "low_confidence" else set()
        dtype = torch.float64 if self.float64_confidence else None
        suppress = tuple(run.model.eos_ids[:1]) if self.logits_eos_inf else ()
        return ScoreSpec(
            need=frozenset(need), temperature=run.temperature, exclude=tuple(exclude), dtype=dtype, suppress=suppress
        )

    def select(self, step, state):
        if self.remasking == "random":
            confidence = step.uniform(Stream.ORDER, torch.float32)
        else:
            confidence = step.scores.prob
        return top_k_per_row(step.among_committable(confidence), step.quota)

    def selection(self, step, state):
        return Rule("top_k") if self.remasking == "low_confidence" else None


@dataclasses.dataclass(frozen=True)
class Threshold(Sampler):
    """Fast-dLLM confidence-threshold parallel decoding (Wu et al. 2025, arXiv 2505.22618, Alg. 1).

    Each step commits every candidate of the block whose probability (float64 softmax) is at least
    ``threshold``, and always the most confident one, so every step makes progress. Default τ = 0.9;
    τ = 1 is one token per step. The number of steps is data-dependent: ``steps`` / ``steps_per_block`` are
    not used (checked to be positive integers, then ignored), as Fast-dLLM's ``generate``, which asserts that
    ``steps`` divides into the blocks and then ignores it (this one does not ask it to divide).
    """

    name: ClassVar[str] = "threshold"
    on_device: ClassVar[bool] = True
    fixed_steps: ClassVar[bool] = False
    threshold: float = hp(0.9, "[0, 1]")
    per_row_fields: ClassVar[tuple[str, ...]] = ("threshold",)

    def score_spec(self, run):
        return ScoreSpec(need=frozenset({"prob"}), temperature=run.temperature, dtype=torch.float64)

    def selection(self, step, state):
        return Rule("threshold", threshold=self.row_value(step, "threshold"))


@dataclasses.dataclass(frozen=True)
class Factor(Sampler):
    """Fast-dLLM factor rule (``get_transfer_index_dynamic``; paper Theorem 1).

    Sort the block's candidates by confidence c(1) >= c(2) >= ...; commit the longest prefix whose
    i-th entry (1-based, i >= 2) satisfies c(i) >= 1 - factor / (i + 1), at least one token. The
    official scan also commits everything when only the *last* entry fails; that is reproduced unless
    ``strict_prefix=True``. ``factor`` default 1.0 (dInfer's default; Fast-dLLM has none).
    """

    name: ClassVar[str] = "factor"
    on_device: ClassVar[bool] = True
    fixed_steps: ClassVar[bool] = False
    factor: float = hp(1.0, "> 0")
    strict_prefix: bool = False
    per_row_fields: ClassVar[tuple[str, ...]] = ("factor",)

    def score_spec(self, run):
        return ScoreSpec(need=frozenset({"prob"}), temperature=run.temperature, dtype=torch.float64)

    def selection(self, step, state):
        return Rule("factor", factor=self.row_value(step, "factor"), strict_prefix=self.strict_prefix)
