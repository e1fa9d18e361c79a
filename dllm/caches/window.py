"""Window-Diffusion's phase cache (vhicrgit/Window-Diffusion, arXiv 2601.20332; LLaDA ``generate`` in
``llada/model/modeling_llada.py`` with ``build_window_plan`` / ``update_window_plan``).

Token classes: *active* tokens are computed at every step, *buffer* tokens keep the K/V stored at the
phase start, *far-field* masks are pruned (invisible as keys) until the next phase.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.base import Cache, CacheState, Plan, columns_of, sources
from dllm.core.errors import ConfigError
from dllm.core.params import hp


@dataclasses.dataclass(eq=False)
class _State(CacheState):
    """One generation's state; per-row tensors have the canvas's B rows."""

    offset: torch.Tensor = None  # [B] steps taken in the row's current phase (0: its next forward is a full one)
    full: torch.Tensor = None  # [B] the row's last forward was its phase's full one
    window: torch.Tensor = None  # bool [B, L] key window fixed at the phase start
    recent: torch.Tensor = None  # bool [B, L] commits of the phase's full step (active at the next step only)
    decoded: torch.Tensor = None  # bool [B, L] commits of the phase's pruned steps (active to the phase's end)


@dataclasses.dataclass(frozen=True)
class Window(Cache):
    """Window-Diffusion (arXiv 2601.20332): phases of ``refresh_cycle`` steps.

    A phase starts with a full forward that stores every column's K/V (a refresh, counted in
    ``run.refreshes``) and may commit anywhere in the block. Its key *window* is then fixed for the whole
    phase: the first ``window_tokens`` masks left after that step's commits and every decoded column
    (prompt included); the masks beyond it are pruned. Each later step of the phase computes only the
    *active* columns, the first ``active_tokens`` masks, the tokens committed at the phase's full step (at
    the first pruned step only, as ``build_window_plan`` / ``update_window_plan`` do) and the tokens
    committed by its pruned steps, against the window's keys; it writes their fresh K/V back, and the
    sampler may commit only among the active masks.

    Defaults are the README's LLaDA settings for all four tasks: ``window_tokens=64``, ``active_tokens=16``,
    ``refresh_cycle=32``. The official setting decodes the whole generation as one block
    (``block_size=max_new_tokens``); with smaller blocks the phases run across block boundaries.
    ``refresh_cycle=1`` is a full forward at every step: exactly the no-cache output.

    Deliberate differences from the official code:
    - batched, with per-row windows and active sets (rows of different lengths pad their query list by
      repeating a column); the official code is batch-1;
    - when a fixed-schedule step must commit more tokens than ``active_tokens`` (its quota), the active set
      grows to the quota's first masks; the official ``topk`` over fewer candidates would overwrite
      decoded tokens;
    - each row keeps its own phase clock, which advances at the row's steps that have something scheduled: a
      step with nothing scheduled costs no forward (the official loop runs one that commits nothing), and a
      row that shares the forward of a batch without having anything scheduled does not advance. Rows in
      different phases share one forward (a row whose phase starts computes every column), so each row's
      output does not depend on its batch;
    - for Dream (logits of column i read from column i - 1) the column before each active mask is
      computed too; the official Dream variant (``o_win_size`` / ``i_win_size``, a truncated canvas, a
      force-committed first window token) is a different algorithm and is not reproduced.
    """

    name: ClassVar[str] = "window"
    joins: ClassVar[bool] = True
    computes_needed: ClassVar[bool] = False  # its own window of masks only (see Cache)
    window_tokens: int = hp(64, ">= 1")
    active_tokens: int = hp(16, ">= 1")
    refresh_cycle: int = hp(32, ">= 1")

    @classmethod
    def every_step(cls):
        return cls(refresh_cycle=1)  # a full forward at every step

    def check_hyper_parameters(self):
        if self.active_tokens > self.window_tokens:
            raise ConfigError(
                "cache 'window': active_tokens must be <= window_tokens (window_tokens must be >= active_tokens), got "
                f"active_tokens={self.active_tokens}, window_tokens={self.window_tokens}; the active masks must lie "
                "inside the key window (e.g. window_tokens=64, active_tokens=16)"
            )

    def start(self, run):
        tokens = run.canvas.tokens
        rows = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        cells = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
        return _State(offset=rows, full=rows.bool(), window=cells, recent=cells.clone(), decoded=cells.clone())

    def plan(self, step, state):
        full = step.of_active(state.offset) == 0  # [n] rows whose phase starts now
        masked = step.of_active(step.masked)
        rank = masked.long().cumsum(1) - 1
        width = torch.full_like(rank[:, 0], self.active_tokens)
        if step.quota is not None:
            width = torch.maximum(width, step.of_active(step.quota))
        first = masked & (rank < width[:, None])  # the active masks: the only committable slots
        active = first | step.of_active(state.recent | state.decoded)
        active |= sources(step, first)  # (Dream: the column before each active mask gives its logits)
        active |= full[:, None]
        counts = active.sum(1)
        all_full, any_full, most = torch.stack([full.all(), full.any(), counts.max()]).tolist()
        state.full = torch.zeros_like(state.full).index_copy_(0, step.active, full)
        if all_full:
            return Plan(refresh=True)
        # Rows of different phases share the forward: a row whose phase starts computes every column.
        return Plan(
            queries=columns_of(active, counts, most),
            keys=step.of_active(state.window) | full[:, None],
            commit=first | full[:, None],
            refresh=bool(any_full),
        )

    def update(self, step, state, committed):
        ran = torch.zeros_like(state.full).index_fill_(0, step.active, True)
        if step.quota is not None:  # a row with nothing scheduled has no forward of its own: no phase step
            ran &= step.quota > 0
        full, pruned = (state.full & ran)[:, None], (~state.full & ran)[:, None]
        masked = step.masked
        rank = masked.long().cumsum(1) - 1
        state.window = torch.where(full, ~masked | (rank < self.window_tokens), state.window)
        state.recent = torch.where(full, committed, state.recent & ~pruned)
        state.decoded = (state.decoded & ~full) | (committed & pruned)
        state.offset = torch.where(ran, (state.offset + 1) % self.refresh_cycle, state.offset)
