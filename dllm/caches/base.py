"""The cache interface the denoising loop drives.

Every cache scheme in the literature is "compute a subset of columns, attend to a chosen key set,
refresh the stored K/V when ...". A cache says, for each forward of the working rows
(``step.active``), which :class:`Plan` to run; the loop tells it when rows enter a block
(``begin_block``), what each step committed (``update``: dKV's delayed caching, Elastic's drift
trigger), and when finished rows leave the batch (``keep``). A cache never decides which tokens to
commit. With its refresh forced every step, a cache must give the no-cache output exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from dllm.models.layers import KVStore, Observer


@dataclasses.dataclass
class Plan:
    """One forward, as the cache wants it (rows are the working rows, ``step.active``).

    queries: [n, R] canvas columns to compute (None: every column). Rows may need different numbers of
        columns: pad a row by repeating one of its columns (with the same ``write`` flag).
    keys: bool [n, L] key columns the queries may attend (None: all the model's own mask allows).
    write: store the fresh K/V of the queries: True, False or bool [n, R].
    refresh: this forward recomputes the stored K/V (counted in ``run.refreshes``; no effect on the forward).
    observer: per-layer hooks (:class:`dllm.models.layers.Observer`) for this forward.
    commit: bool [n, L] the only slots this step may commit (None: no restriction), ANDed into
        ``step.committable`` for this step (Window-Diffusion commits only among its active masks). With it,
        the loop scores only the observed columns the forward computed (for Dream: whose column before was
        computed); every allowed slot must be among them.
    The scored columns (and, for Dream, the column before each) must be among the queries; a visible key
    neither computed nor ever stored is an error, never a silent zero.
    """

    queries: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    write: bool | torch.Tensor = True
    refresh: bool = False
    observer: Observer | None = None
    commit: torch.Tensor | None = None


class Cache:
    """Owns a :class:`~dllm.models.layers.KVStore` and plans each forward."""

    def __init__(self):
        self.kv = KVStore()

    def begin(self, run) -> None:
        """A new generation starts."""
        self.kv = KVStore()

    def begin_block(self, step, rows: torch.Tensor) -> None:
        """``rows`` (bool [B]) entered a new block (their bounds are ``step.start`` / ``step.end``)."""

    def plan(self, step) -> Plan:
        """The plan of this step's forward of ``step.active``."""
        raise NotImplementedError

    def update(self, step, committed: torch.Tensor) -> None:
        """After each step: ``committed`` bool [B, L] are the slots written."""

    def keep(self, index: torch.Tensor) -> None:
        """Finished rows left the batch: keep the rows ``index`` of the previous forward's batch."""
        self.kv = self.kv.select(index)
