"""The loop's protocol type for a cache: the :class:`Plan` of one forward (which columns it computes, which keys
they attend, which K/V it writes). It lives in the core because the loop reads it; the caches in
:mod:`dllm.caches` produce it."""

from __future__ import annotations

import dataclasses

import torch

from dllm.models.layers import Observer


@dataclasses.dataclass
class Plan:
    """One forward, as the cache wants it (rows are the working rows, ``step.active``).

    queries: [n, R] canvas columns to compute (None: every column). Rows may need different numbers of
        columns: pad a row by repeating one of its columns (with the same ``write`` flag).
    keys: bool [n, L] key columns the queries may attend (None: all the model's own mask allows).
    write: store the fresh K/V of the queries: True, False or bool [n, R].
    refresh: this forward recomputes the stored K/V (counted in ``run.refreshes``; no effect on the forward).
    observer: per-layer hooks (:class:`dllm.models.layers.Observer`) for this forward.
    start_layer: the forward starts at this layer (Elastic-Cache's depth-aware refresh): the layers below compute
        only ``queries``, the layers from it every column from the store's kept inputs (0: a plain forward;
        see :meth:`dllm.models.base.DiffusionLM.hidden`). Its states are every column's.
    row_start: [n] with ``start_layer``: each row's own first layer computing every column (below it, the row
        computes only its queries; the number of layers: the row is not refreshed at all).
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
    start_layer: int = 0
    row_start: torch.Tensor | None = None
