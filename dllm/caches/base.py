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
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
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

    name: ClassVar[str] = ""
    # True: every plan computes the columns :func:`needed` lists (the observed masked columns, the observed
    # columns an exit rule reads decoded, and with exit rules the whole masked span), so samplers and exit
    # rules that read columns outside the commit set can use it. False: the cache computes a window of its own
    # and restricts the commits to it (``Plan.commit``); those samplers refuse it (:func:`require_needed`).
    computes_needed: ClassVar[bool] = True

    @classmethod
    def every_step(cls) -> Cache:
        """This cache with its refresh forced at every step (it must then give the no-cache output exactly):
        the exactness tests use it."""
        raise NotImplementedError(f"{cls.__name__} does not say how to refresh at every step")

    def check_model(self, model) -> None:
        """Raise :class:`~dllm.core.errors.ConfigError` when this cache cannot serve ``model`` (needs no prompt:
        ``dllm bench`` asks it before loading the model)."""

    def check_run(self, run) -> None:
        """Raise :class:`~dllm.core.errors.ConfigError` when this cache cannot serve ``run``; by default
        :meth:`check_model` of its model."""
        self.check_model(run.model)

    def settings(self) -> dict:
        """The hyper-parameters (for reports)."""
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}

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
        self.kv.keep(index)


def needed(step) -> torch.Tensor:
    """bool [n, L] (active rows): the columns this step's forward must compute whatever the cache: the
    observed columns that are still masked, the observed columns an exit rule reads whatever their state
    (``step.read_decoded``), with (for Dream) the column before each, and, when exit rules may finish rows,
    every masked column of the generation span (and its source)."""
    masked = step.of_active(step.masked)
    n, length = masked.shape
    scored = torch.zeros_like(masked).scatter_(1, step.observed, True) & masked
    if step.read_decoded is not None:
        scored.scatter_(1, step.read_decoded, True)
    if step.may_finish:
        scored |= masked & (step.columns >= step.canvas.prompt_width)
    return scored | sources(step, scored)


def require_needed(cache, reader: str) -> None:
    """Raise :class:`~dllm.core.errors.ConfigError` when ``cache`` (None: no cache, always fine) does not compute
    the columns ``reader`` (what reads them, e.g. "prophet reads its answer region's logits at every step")
    needs (:attr:`Cache.computes_needed`)."""
    if cache is None or cache.computes_needed:
        return
    from dllm.caches import CACHES

    usable = ", ".join(repr(name) for name, cls in CACHES.items() if cls.computes_needed and name != "block")
    raise ConfigError(
        f"{reader}, which the {cache.name!r} cache does not compute: it computes its own window of masks and "
        f"commits only there. Use the {usable} cache or none"
    )


def sources(step, columns: torch.Tensor) -> torch.Tensor:
    """bool [n, L]: the columns whose hidden states give the logits of ``columns`` (bool [n, L])."""
    if not getattr(step.model, "shift", 0):
        return columns
    source = step.model.source_columns(step.columns)
    return torch.zeros(columns.shape, dtype=torch.long, device=columns.device).index_add_(1, source, columns.long()) > 0


def plan_of(compute: torch.Tensor, write: torch.Tensor | None = None, refresh=False, **options) -> Plan:
    """The :class:`Plan` computing the columns ``compute`` (bool [n, L]) and storing the K/V of ``write``
    (bool [n, L] within ``compute``; default: every computed column). ``refresh``: bool, or bool [n] rows
    whose forward is a refresh (the plan is a refresh when any row's is). Rows are padded to the longest by
    repeating their first column; when every row computes and writes every column, the plan is a full
    forward. Costs one read-back (the plan's shape)."""
    n, length = compute.shape
    counts = compute.sum(1)
    flags = [counts.min(), counts.max(), torch.as_tensor(refresh, device=compute.device).any()]
    if write is not None:
        flags.append((write | ~compute).all())
    low, high, refresh, *writes_all = torch.stack([f.to(counts.dtype) for f in flags]).tolist()
    if low == length and all(writes_all):
        return Plan(refresh=bool(refresh), **options)
    order = torch.arange(length, device=compute.device)
    index = torch.argsort((~compute).long() * length + order, dim=1)[:, :high]  # computed columns first, in order
    r = torch.arange(high, device=compute.device)
    index = torch.where(r < counts[:, None], index, index[:, :1])
    keep = True if write is None or all(writes_all) else write.gather(1, index)
    return Plan(queries=index, write=keep, refresh=bool(refresh), **options)
