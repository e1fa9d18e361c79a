"""The loop's protocol types for a cache: the :class:`Plan` of one forward (which columns it computes, which keys
they attend, which K/V it writes) and the :class:`Observer` of its layers. They live in the core because the loop
reads them; the caches in :mod:`dllm.caches` produce them and the models (:mod:`dllm.models.layers`) call the
observer."""

from __future__ import annotations

import dataclasses

import torch


class Observer:
    """Per-layer hook points of a forward (e.g. Elastic-Cache's attention-drift test). Subclass and
    override what you need; every method is called once per layer."""

    def layer(self, index: int, hidden: torch.Tensor) -> None:
        """Before layer ``index``, with its input hidden states [B, R, d] of the query columns."""

    def attention(self, index: int, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Before the attention of layer ``index``: queries [B, H, R, D], the keys attended [B, H_kv, L, D]
        (fresh rows written in) and the boolean mask [B, 1, R, L] (None: every key)."""


@dataclasses.dataclass
class Plan:
    """One forward, as the cache wants it (rows are the working rows, ``step.active``).

    queries: [n, R] canvas columns to compute (None: every column). Rows may need different numbers of
        columns: pad a row by repeating one of its columns (with the same ``write`` flag).
    keys: bool [n, L] key columns the queries may attend (None: all the model's own mask allows).
    write: store the fresh K/V of the queries: True, False or bool [n, R].
    refresh: this forward recomputes the stored K/V (counted in ``run.refreshes``; no effect on the forward).
    observer: per-layer hooks (:class:`Observer`) for this forward.
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
