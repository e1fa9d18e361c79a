"""SchED: progress-aware confidence schedules for early exit (Mohamed et al. 2025, arXiv 2512.02892;
official code ``amr-mohamedd/SchED`` ``dream_sampling/sched.py``, ``diffusion_generate_schedule``).

An exit rule on the shared loop: by default over Dream's own sampler (``get("sched", alg="entropy", ...)``),
and over LLaDA bases too (``get("sched", base="llada", ...)``, the paper's LLaDA results).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from dllm.caches import require_needed
from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.samplers.compose import ExitRule

TAU_MODES = ("cosine", "linear", "exp")
STATS = {"mean": "mean", "median": "median", "quantile": "quantile", "q": "quantile", "percentile": "quantile"}
STATS["min"] = "min"  # ours: documented by the official README, absent from its sched.py
REGIONS = ("all", "tail", "last")


def threshold(i: int, total: int, mode: str, high: float, low: float, k: float) -> float:
    """tau at 0-based step ``i`` of ``total`` (the official ``_schedule_threshold``, float64 math)."""
    if total <= 1:
        return float(low)
    t = max(0.0, min(1.0, i / float(total - 1)))
    if mode == "cosine":
        return float(low + (high - low) * 0.5 * (1.0 + math.cos(math.pi * t)))
    if mode == "exp":
        return float(low + (high - low) * math.exp(-k * t))
    return float(high + (low - high) * t)


@dataclasses.dataclass
class _State:
    taus: torch.Tensor | None  # float64 [B, T]: each row's tau at each global step of a fixed schedule
    prev: torch.Tensor | None = None  # long [B, L]: the previous step's argmax (read where ``seen``)
    seen: torch.Tensor | None = None  # bool [B]: rows with a previous argmax
    patience: torch.Tensor | None = None  # long [B]


@dataclasses.dataclass(frozen=True)
class SchED(ExitRule):
    """SchED (arXiv 2512.02892): exit once the logit margins pass a threshold schedule falling with progress.

    Before each step's commit, the top-1 minus top-2 raw logit margins of the answer region are aggregated
    (``stat``) and compared with a threshold ``tau`` that falls from ``tau_high`` to ``tau_low`` over the steps;
    once it is reached (and the stability guard holds), every remaining mask of the row gets this step's argmax
    (at any temperature, as the official) and the row is done. The check reuses the step's forward: an exit at
    step i (0-based) costs i + 1 forwards.

    tau_mode: ``"cosine"`` (tau_low + (tau_high - tau_low)(1 + cos(pi p)) / 2), ``"linear"``, or ``"exp"``
        (tau_low + (tau_high - tau_low) exp(-tau_k p)); p = i / (T - 1) for the 0-based step i of T steps
        (the whole generation's, across blocks over a blocked base; each row's own T, so a row of a batch
        follows the schedule it follows alone).
    stat: aggregate of the margins: ``"mean"``, ``"median"`` (the lower middle value, as ``torch.median``),
        ``"quantile"`` (at ``q``, linear interpolation; aliases ``"q"``, ``"percentile"``) or ``"min"`` (ours;
        listed in the official README, absent from its ``sched.py``, which falls back to the mean).
    answer_region: ``"all"`` (the whole row, prompt included), ``"tail"`` (alias ``"last"``: the generation
        span), or with ``answer_start`` / ``answer_end`` (absolute canvas columns, ``[start, end)``) a custom
        region (with region "all"). Pad columns of a left-padded batch are never in a region.
    average_over_masked: aggregate over the region's masked slots (True) or over every region column.
    Stability guard: ``changed`` = the fraction of the region's masked slots whose argmax differs from the
        previous step's (1.0 at the first step); ``patience`` counts consecutive steps with ``progress >=
        min_progress`` and ``changed <= max_change_ratio``; the exit needs ``patience > patience_steps`` and
        ``progress >= min_progress``, where progress = 1 - masked / region columns (region "all" counts the
        prompt as committed). With the defaults the earliest exit is the second step. A row whose region
        holds no masks exits at once (the official "converged" branch).

    Defaults (the official ``diffusion_generate_schedule``): cosine, tau_high 7.5, tau_low 2.5, tau_k 4.0,
    min_progress 0, patience_steps 0, stat mean, q 0.2, region all, average_over_masked True,
    max_change_ratio 0; the base is Dream's sampler with ``alg="entropy"`` (its ``alg``, ``alg_temp``,
    ``eps``, ``top_p``, ``top_k``).
    K/V caches: with ``prefix``, ``dual``, ``dkv`` (and SDAR's ``block``) every forward also computes the masked
    span (and, with ``average_over_masked=False``, every region column), without storing their K/V; ``window``
    / ``elastic`` are refused. With its refresh forced every step a cache gives the no-cache output.
    Deliberate differences from the official code: the official pools the exit decision (and the progress,
    the change ratio and the margins) over the batch; here each row decides alone, which is the official
    batch-1 behaviour for every row. Over a fixed-schedule base every scheduled step runs its forward and
    check (the official runs a forward at Dream's first step also when it commits nothing; dllm's ``dream``
    alone skips it). Over an adaptive base (no fixed T) p is the committed fraction of the generation span
    (ours). Out-of-range values raise instead of being clamped; an unknown ``tau_mode`` or ``stat``
    raises instead of falling back to linear / mean; ``answer_region="tail"`` with ``answer_start`` /
    ``answer_end`` raises (the official ignores them). The mask token's logit is -inf before the margins are
    taken (dllm never proposes it).
    """

    name: ClassVar[str] = "sched"
    on_device: ClassVar[bool] = True
    needs: ClassVar[frozenset] = frozenset({"logit_margin", "argmax"})
    default_base: ClassVar[str] = "dream"
    every_step: ClassVar[bool] = True
    fill: ClassVar[str] = "argmax"
    tau_mode: str = hp("cosine", choices=TAU_MODES)
    tau_high: float = hp(7.5, note="logit units")
    tau_low: float = hp(2.5, note="logit units")
    tau_k: float = 4.0
    min_progress: float = hp(0.0, "[0, 1]")
    patience_steps: int = hp(0, ">= 0")
    stat: str = hp("mean", choices=tuple(STATS))
    q: float = hp(0.2, "[0, 1]")
    answer_region: str = hp("all", choices=REGIONS)
    answer_start: int | None = hp(None, ">= 0", note="a canvas column")
    answer_end: int | None = hp(None, ">= 0", note="a canvas column")
    average_over_masked: bool = True
    max_change_ratio: float = hp(0.0, "[0, 1]")

    def check_hyper_parameters(self):
        custom = self.answer_start is not None or self.answer_end is not None
        if custom and self.answer_region != "all":
            raise ConfigError(
                f"answer_start / answer_end define a custom region; they cannot be combined with "
                f"answer_region={self.answer_region!r} (use answer_region='all')"
            )

    # -- state -----------------------------------------------------------------------------------
    def init_state(self, run):
        canvas = run.canvas
        # each row's own schedule: its blocks (SDAR rows of one batch may have different numbers) times the steps
        blocks = canvas.blocks  # per row (SDAR rows differ)
        totals = (blocks * run.steps_per_block).tolist()
        # as wide as any row's schedule on this canvas, so that rows that join a running generation (dllm.engine.join,
        # on the same columns) bring the same width
        longest = max(
            max(totals), (-(-(canvas.length - canvas.prompt_width) // canvas.block_size) + 1) * run.steps_per_block
        )
        schedules = {
            total: [threshold(i, total, self.tau_mode, self.tau_high, self.tau_low, self.tau_k) for i in range(longest)]
            for total in set(totals)
        }
        device = canvas.tokens.device
        b = canvas.batch
        return _State(
            taus=torch.tensor([schedules[t] for t in totals], dtype=torch.float64, device=device),
            # made here, not at the first step: the captured device step reads its state at fixed addresses
            prev=torch.zeros(b, canvas.length, dtype=torch.long, device=device),
            seen=torch.zeros(b, dtype=torch.bool, device=device),
            patience=torch.zeros(b, dtype=torch.long, device=device),
        )

    def _region(self, step) -> torch.Tensor:
        """bool [B, L]: each row's region (real columns only)."""
        canvas, columns = step.canvas, step.columns
        if self.answer_region in ("tail", "last"):
            region = columns >= canvas.prompt_width
        elif self.answer_start is not None or self.answer_end is not None:
            start = 0 if self.answer_start is None else self.answer_start
            end = canvas.length if self.answer_end is None else self.answer_end
            region = (columns >= start) & (columns < end)
        else:
            region = torch.ones_like(columns, dtype=torch.bool)
        return region & canvas.valid

    @property
    def reads_decoded(self) -> bool:
        return not self.average_over_masked  # the margins of every region column, decoded or not

    def check_cache(self, model, cache):
        require_needed(cache, "sched reads the logits of its region at every step", model)

    def observe(self, step, state):
        canvas = step.canvas
        first = 0 if not self.average_over_masked and self.answer_region == "all" else canvas.prompt_width
        return step.window(canvas.length - first, torch.full_like(step.start, first))

    # -- the rule ----------------------------------------------------------------------------------
    def check(self, step, state, decision):
        canvas, scores = step.canvas, step.scores
        region = self._region(step)
        region_len = region.sum(1)
        masked = step.masked & region
        remaining = masked.sum(1)
        has_region = region_len > 0
        converged = has_region & (remaining == 0)
        # progress: float32 as the official, compared in float64
        progress = (1.0 - remaining.float() / region_len.clamp(min=1).float()).double()

        argmax = scores.argmax
        n = remaining.clamp(min=1).float()
        changed = ((argmax != state.prev) & masked).sum(1).float() / n
        changed = torch.where(state.seen & (remaining > 0), changed, 1.0).double()
        state.prev = argmax.clone()
        state.seen = state.seen | has_region

        stable = (progress >= self.min_progress) & (changed <= self.max_change_ratio)
        state.patience = torch.where(has_region & stable, state.patience + 1, 0)

        margins = scores.logit_margin
        if not self.average_over_masked and step.model.shift and step.run.padded:
            # the first real column of a left-padded row reads its own output, as at column 0 of a row alone
            first = canvas.valid.long().argmax(1)
            later = step.columns == (first + 1)[:, None]
            own = torch.where(later, margins, 0.0).sum(1)
            margins = torch.where(step.columns == first[:, None], own[:, None], margins)
        members = masked if self.average_over_masked else region
        gbar = _aggregate(margins.float(), members, STATS[self.stat], self.q).double()

        tau = self._tau(step, state)
        exit_now = (progress >= self.min_progress) & (gbar >= tau) & (state.patience > self.patience_steps)
        return converged | (has_region & (remaining > 0) & exit_now)

    def _tau(self, step, state) -> torch.Tensor:
        if step.quota is not None:  # fixed schedule: the 0-based global step
            index = step.t.clamp(max=state.taus.shape[1] - 1)
            return state.taus.gather(1, index[:, None]).squeeze(1)
        span = (step.columns >= step.canvas.prompt_width) & step.canvas.valid
        p = 1 - (step.masked & span).sum(1).double() / span.sum(1).clamp(min=1)
        high, low = self.tau_high, self.tau_low
        if self.tau_mode == "cosine":
            return low + (high - low) * 0.5 * (1.0 + torch.cos(math.pi * p))
        if self.tau_mode == "exp":
            return low + (high - low) * torch.exp(-self.tau_k * p)
        return high + (low - high) * p


def _aggregate(values: torch.Tensor, members: torch.Tensor, stat: str, q: float) -> torch.Tensor:
    """Per row, ``stat`` of ``values`` [B, L] over the ``members`` columns (-inf for a row without any)."""
    count = members.sum(1)
    if stat == "mean":
        out = torch.where(members, values, 0.0).sum(1) / count.clamp(min=1)
    elif stat == "min":
        out = torch.where(members, values, float("inf")).min(1).values
    else:
        ordered = torch.sort(torch.where(members, values, float("inf")), dim=1).values
        last = (count - 1).clamp(min=0)
        if stat == "median":  # torch.median: the lower of the two middle values
            out = ordered.gather(1, (last // 2)[:, None]).squeeze(1)
        else:  # torch.quantile, linear interpolation, in the values' dtype
            rank = torch.tensor(q, dtype=values.dtype, device=values.device) * last.to(values.dtype)
            below = rank.long()
            above = rank.ceil().long()
            low = ordered.gather(1, below[:, None]).squeeze(1)
            high = ordered.gather(1, above[:, None]).squeeze(1)
            out = low.lerp(high, rank - below.to(values.dtype))
    return torch.where(count > 0, out, float("-inf"))
