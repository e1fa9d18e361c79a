"""The cache interface the denoising loop drives.

Every cache scheme in the literature is "compute a subset of columns, attend to a chosen key set,
refresh the stored K/V when ...". A cache is built like a sampler: a frozen dataclass of its
hyper-parameters, with its per-run state (the K/V store, counters, masks) created by :meth:`Cache.start`
when a run starts, kept on the run and dropped when it ends, so one cache object holds no tensors and can
serve any number of generations. For each forward of the working rows (``step.active``) it says which
:class:`~dllm.core.plan.Plan` to run (:meth:`Cache.plan`) and is told what each step committed
(:meth:`Cache.update`: dKV's delayed caching, Elastic's drift trigger) and when rows enter a block
(:meth:`Cache.begin_block`); row compaction when finished rows leave the batch is the store's
(:meth:`Cache.keep`, written once). A new cache is ``plan`` + ``update`` (and its state, if it has one).
A cache never decides which tokens to commit. With its refresh forced every step, a cache must give the
no-cache output exactly.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core import params
from dllm.core.plan import Plan
from dllm.models.kv import KVStore


@dataclasses.dataclass(eq=False)
class CacheState:
    """One generation's cache state: created by :meth:`Cache.start` when the run starts, kept on the run
    (``run.cache_state``) and dropped when it ends. Caches with counters or masks of their own subclass it."""

    kv: KVStore = dataclasses.field(default_factory=KVStore)


class Cache(params.HyperParameters):
    """Plans each forward; its per-run state (with the K/V store) is a :class:`CacheState` (:meth:`start`). A
    dataclass cache's fields are checked when it is built (:mod:`dllm.core.params`)."""

    name: ClassVar[str] = ""
    noun: ClassVar[str] = "cache"
    process: ClassVar[str] = "masked"  # the decoding process whose forwards it plans (dllm.engine.process)
    # True: every plan computes the columns :func:`needed` lists (the observed masked columns, the observed
    # columns an exit rule reads decoded, and with exit rules the whole masked span), so samplers and exit
    # rules that read columns outside the commit set can use it. False: the cache computes a window of its own
    # and restricts the commits to it (``Plan.commit``); those samplers refuse it (:func:`dllm.caches.require_needed`).
    computes_needed: ClassVar[bool] = True
    # True: after each step's forward the store holds the exact K/V (those a forward without cache computes) of
    # every column before each row's current block, so a forward of a sampler's own (S2D2's verifier) may read
    # them from a scratch copy (:meth:`~dllm.models.kv.KVStore.scratch`) and extend it.
    exact_prefix: ClassVar[bool] = False
    # True: the cache plans the device step's forwards (:mod:`dllm.engine.device`): :meth:`demand` says what a
    # step computes without a read-back, :meth:`advance` updates the state after it, and every hook is predicated
    # (a row outside ``rows`` or done is left as it is)
    on_device: ClassVar[bool] = False
    # True: every field of the state but the store is per row ([B] first), so that rows may join a running generation
    # between its steps (dllm.engine.join: the store keeps the running rows and takes the new ones)
    joins: ClassVar[bool] = False
    # the fields of the state that are the batch's, which rows that join reset to :meth:`start`'s (their values for a
    # run that starts now: the block cache's prefill, which then computes every row's prefix once more, exactly)
    batch_fields: ClassVar[tuple[str, ...]] = ()

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

    def start(self, run) -> CacheState:
        """A new generation starts: its state (an empty K/V store, and the cache's own counters)."""
        return CacheState()

    def begin_block(self, step, state: CacheState, rows: torch.Tensor) -> None:
        """``rows`` (bool [B]) entered a new block (their bounds are ``step.start`` / ``step.end``)."""

    def plan(self, step, state: CacheState) -> Plan:
        """The plan of this step's forward of ``step.active``."""
        raise NotImplementedError

    def demand(self, step, state: CacheState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(compute bool [n, L], write bool [n, L], refresh bool [n]) of this step's forward, without changing
        ``state`` (caches with ``on_device``)."""
        raise NotImplementedError(f"the {self.name!r} cache does not plan on the device")

    def advance(self, step, state: CacheState, working: torch.Tensor | None = None) -> None:
        """After the forward :meth:`demand` planned (caches with ``on_device``; ``working`` bool [B]: the rows of
        the whole batch that ran it on the device step)."""

    def update(self, step, state: CacheState, committed: torch.Tensor) -> None:
        """After each step: ``committed`` bool [B, L] are the slots written."""

    def keep(self, state: CacheState, index: torch.Tensor, store: bool = True) -> None:
        """Finished rows stopped working: keep the rows ``index`` of the previous step's working rows (the store
        compacts in place; a state with per-working-row tensors of its own extends this). ``store=False``
        (``generate(static_shapes=True)``, :mod:`dllm.engine.static`): the forward keeps every row in place, and
        so does the store; only the cache's own per-working-row tensors follow."""
        if store:
            state.kv.keep(index)


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


def sources(step, columns: torch.Tensor) -> torch.Tensor:
    """bool [n, L]: the columns whose hidden states give the logits of ``columns`` (bool [n, L]). The read-out
    rule (Dream's one-column shift) is the model's :meth:`~dllm.models.base.DiffusionLM.source_columns`."""
    source = step.model.source_columns(step.columns)
    if source is step.columns:  # logits read from the column itself
        return columns
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


def columns_of(chosen: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Column indices [n, width] of the True entries of each row of ``chosen`` [n, L] in ascending order
    (``counts`` [n] of them, at most ``width``); shorter rows repeat their first column."""
    length = chosen.shape[1]
    columns = torch.arange(length, device=chosen.device)
    order = torch.argsort(torch.where(chosen, columns, columns + length), dim=1)
    index = order[:, :width]
    return torch.where(torch.arange(width, device=chosen.device) < counts[:, None], index, index[:, :1])
