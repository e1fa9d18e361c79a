"""Fast-dLLM's prefix cache (Wu et al. 2025, "Fast-dLLM", arXiv 2505.22618, §3.2; NVlabs/Fast-dLLM
``llada/generate.py`` ``generate_with_prefix_cache``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.base import Cache, CacheState, needed, plan_of, sources
from dllm.core.params import hp


@dataclasses.dataclass(eq=False)
class _State(CacheState):
    fresh: torch.Tensor = None  # [B] the row's next forward is a full one
    count: torch.Tensor = None  # [B] forwards of the row in its block
    decoded: torch.Tensor = None  # [B] slots the row decoded since its last full forward (refresh_count)
    left: torch.Tensor = None  # [B] the first column the row's last forward observed (delay)


@dataclasses.dataclass(frozen=True)
class Prefix(Cache):
    """Fast-dLLM's prefix cache: the K/V of everything before the current block are reused within the block.

    Each block starts with a full forward, which stores every column's K/V and also makes the block's first
    commit (it counts as a step and a forward, as in the official code). Every later forward of the block
    computes the block and the whole rest of the generation span (still masked) against the prefix K/V
    (prompt and finished blocks) stored by the block's first forward.

    refresh_steps: ours, 0 (the official behaviour) = a full forward only at a block's first step; R > 0
        also makes every R-th forward of a block a full forward (R = 1: every step, exactly no cache).
    refresh_prompt: ours, False (the official behaviour); True also computes the prompt's columns at every
        forward and stores their fresh K/V (see :class:`~dllm.caches.dual.Dual` for why).
    delay, refresh_count: DCD's delayed cache ("Deferred Commitment Decoding", arXiv 2601.02076;
        shuyingte/DCD ``decode_algorithm.py``, ``cache_type="prefix-delayK"`` / ``"dual-delayK"`` with
        ``refresh_count``), for a sampler whose window is not a block (``dcd``). delay None (the default): the
        block, as above. delay K: a cached forward computes, and stores, from K columns before the first column
        the row's previous forward observed (its window's left end then: what that step decoded is recomputed
        once more, decoded) to the end of the span (prefix) or to K columns past the last observed column
        (dual), with, for Dream, the column before each. refresh_count N: a full forward also once the row
        decoded at least N slots since its last one (DCD's ``average_decode_since_last``, which is the batch's
        mean; here each row's own). DCD's scripts run K = 2 with N = 32 (LLaDA, Dream).
    No hyper-parameters in the official code. Deliberate differences: batched with mixed prompt lengths
    (the official function is batch-1): each row has its own block and its own block-start full forward;
    in a forward where some rows refresh and others do not, each row computes its own columns (rows are
    padded by repeating a column). Columns the sampler observes beyond the span (and, for Dream, the column
    before each scored column) are computed too, without storing their K/V.
    """

    name: ClassVar[str] = "prefix"
    joins: ClassVar[bool] = True
    on_device: ClassVar[bool] = True
    refresh_steps: int = hp(0, ">= 0", note="0: refresh only at a block's start")
    refresh_prompt: bool = False
    delay: int | None = hp(None, ">= 0", note="None: the block; K: DCD's window delayed by K columns")
    refresh_count: int | None = hp(None, ">= 1", note="a full forward once a row decoded this many (DCD); None: off")

    @classmethod
    def every_step(cls):
        return cls(refresh_steps=1)

    def start(self, run):
        b, device = run.canvas.batch, run.canvas.tokens.device
        zeros = torch.zeros(b, dtype=torch.long, device=device)
        return _State(fresh=torch.ones(b, dtype=torch.bool, device=device), count=zeros, decoded=zeros.clone(),
                      left=zeros.clone())  # fmt: skip

    def begin_block(self, step, state, rows):
        state.fresh |= rows
        state.count.masked_fill_(rows, 0)

    def full_rows(self, step, state) -> torch.Tensor:
        """bool [n]: active rows whose forward is a full one (block start, or the refresh policy)."""
        full = step.of_active(state.fresh)
        if self.refresh_steps:
            full = full | (step.of_active(state.count) % self.refresh_steps == 0)
        if self.refresh_count is not None:
            full = full | (step.of_active(state.decoded) >= self.refresh_count)
        return full

    def reused(self, step) -> torch.Tensor:
        """bool [n, L]: columns whose stored K/V a cached forward of each active row reads (delay None)."""
        return step.columns < step.of_active(step.start)[:, None]

    def delayed(self, step, state) -> torch.Tensor:
        """bool [n, L]: the columns a cached forward of each active row computes and stores with a ``delay``: from
        ``delay`` columns before its previous forward's first observed column to the end of its span (the dual
        cache: to ``delay`` columns past its last observed one), with their sources (Dream: the column before)."""
        canvas, columns = step.canvas, step.columns
        low = (step.of_active(state.left) - self.delay).clamp(min=canvas.prompt_width)
        high = self.delayed_end(step)
        region = (columns >= low[:, None]) & (columns < high[:, None])
        return region | sources(step, region)

    def delayed_end(self, step) -> torch.Tensor:
        """[n]: the end (exclusive) of a delayed forward's columns: the span's end."""
        return step.of_active(step.canvas.span_end)

    def demand(self, step, state) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What this step's forward of the active rows computes, without changing the state: (columns to compute
        bool [n, L], columns whose K/V it stores bool [n, L], rows refreshing bool [n]). The device step reads
        it at the end of the previous step to size the next forward (:mod:`dllm.engine.device`)."""
        full = self.full_rows(step, state)
        own = ~self.reused(step) if self.delay is None else self.delayed(step, state)
        fresh = own | full[:, None]
        if self.refresh_prompt:
            fresh = fresh | (step.columns < step.canvas.prompt_width)
        return fresh | needed(step), fresh, full

    def advance(self, step, state, working: torch.Tensor | None = None) -> None:
        """The forward planned by :meth:`demand` ran for the active rows (``working``: bool [B], which rows of
        the whole batch, on the device step)."""
        if self.delay is not None or self.refresh_count is not None:  # (Fast-dLLM's own caches pay nothing)
            self.advance_delayed(step, state, working)
        if working is None:
            state.fresh[step.active] = False  # (after the plan: of_active may return the state tensor itself)
            state.count[step.active] += 1
        else:
            state.fresh &= ~working
            state.count += working.long()

    def advance_delayed(self, step, state, working: torch.Tensor | None) -> None:
        """DCD's counters after a forward (before :meth:`advance` clears ``fresh``): the first column each row
        observed, and the decoded count of a row whose forward was a full one reset."""
        full = self.full_rows(step, state)
        left = step.observed.min(1).values
        if working is None:
            rows = step.active
            state.decoded[rows] = state.decoded[rows].masked_fill(full, 0)
            state.left[rows] = left
        else:  # (the device step's rows are the whole batch)
            state.decoded.masked_fill_(full & working, 0)
            state.left.copy_(torch.where(working, left, state.left))

    def update(self, step, state, committed):
        if self.refresh_count is not None:
            state.decoded += committed.sum(1)

    def plan(self, step, state):
        compute, write, refresh = self.demand(step, state)
        plan = plan_of(compute, write, refresh=refresh)
        self.advance(step, state)
        return plan
