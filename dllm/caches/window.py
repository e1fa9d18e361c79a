"""Window-Diffusion's phase cache (vhicrgit/Window-Diffusion, arXiv 2601.20332; LLaDA ``generate`` in
``llada/model/modeling_llada.py`` with ``build_window_plan`` / ``update_window_plan``).

Token classes: *active* tokens are computed at every step, *buffer* tokens keep the K/V stored at the
phase start, *far-field* masks are pruned (invisible as keys) until the next phase.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.base import Cache, Plan
from dllm.core.errors import ConfigError
from dllm.models.layers import KVStore


@dataclasses.dataclass
class _State:
    kv: KVStore
    offset: int = 0  # steps taken in the current phase (0: the next forward is the phase's full one)
    full: bool = False  # the last forward was a phase start
    window: torch.Tensor | None = None  # bool [B, L] key window fixed at the phase start
    recent: torch.Tensor | None = None  # bool [B, L] commits of the phase's full step (active once)
    decoded: torch.Tensor | None = None  # bool [B, L] commits of the phase's pruned steps (active to its end)


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
    - a step with nothing scheduled costs no forward and does not advance the phase (the official loop runs
      a forward that commits nothing);
    - for Dream (logits of column i read from column i - 1) the column before each active mask is
      computed too; the official Dream variant (``o_win_size`` / ``i_win_size``, a truncated canvas, a
      force-committed first window token) is a different algorithm and is not reproduced.
    """

    name: ClassVar[str] = "window"
    window_tokens: int = 64
    active_tokens: int = 16
    refresh_cycle: int = 32

    def __post_init__(self):
        for key in ("window_tokens", "active_tokens", "refresh_cycle"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"window cache: {key} must be a positive integer, got {value!r}")
        if self.active_tokens > self.window_tokens:
            raise ConfigError(
                f"window cache: active_tokens={self.active_tokens} exceeds window_tokens={self.window_tokens}; "
                "the active masks must lie inside the key window (e.g. window_tokens=64, active_tokens=16)"
            )

    # The dataclass holds the hyper-parameters; one generation's state lives in ``_state``.
    @property
    def kv(self) -> KVStore:
        return self._state.kv

    def begin(self, run):
        object.__setattr__(self, "_state", _State(KVStore()))

    def keep(self, index):
        self._state.kv = self._state.kv.select(index)

    def plan(self, step):
        state = self._state
        if state.offset == 0:
            state.full = True
            return Plan(refresh=True)
        state.full = False
        masked = step.of_active(step.masked)
        rank = masked.long().cumsum(1) - 1
        width = torch.full_like(rank[:, 0], self.active_tokens)
        if step.quota is not None:
            width = torch.maximum(width, step.of_active(step.quota))
        first = masked & (rank < width[:, None])  # the active masks: the only committable slots
        active = first | step.of_active(state.recent | state.decoded)
        shift = step.model.shift
        if shift:  # the column before each active mask gives its logits
            active[:, :-shift] |= first[:, shift:]
        return Plan(queries=_columns(active), keys=step.of_active(state.window), commit=first)

    def update(self, step, committed):
        state = self._state
        if state.full:
            masked = step.masked
            rank = masked.long().cumsum(1) - 1
            state.window = ~masked | (rank < self.window_tokens)
            state.recent = committed.clone()
            state.decoded = torch.zeros_like(committed)
        else:
            state.recent = torch.zeros_like(committed)
            state.decoded |= committed
        state.offset = (state.offset + 1) % self.refresh_cycle


def _columns(chosen: torch.Tensor) -> torch.Tensor:
    """Column indices [n, R] of the True entries of each row of ``chosen`` [n, L] in ascending order, R the
    largest count; shorter rows repeat their first column (one host read for R)."""
    n, length = chosen.shape
    columns = torch.arange(length, device=chosen.device)
    order = torch.argsort(torch.where(chosen, columns, columns + length), dim=1)
    counts = chosen.sum(1)
    width = int(counts.max())
    index = order[:, :width]
    return torch.where(torch.arange(width, device=chosen.device) < counts[:, None], index, index[:, :1])
