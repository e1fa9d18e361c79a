"""``generate(static_shapes=True)``: the loop's forward with the same shapes at every cached step of a phase, so
that it can be compiled once per shape (``dynamic=False``) and captured as a CUDA graph
(:mod:`dllm.engine.compiled`).

By default a step's forward follows the cache plan exactly: rows that are done leave the batch (the K/V store is
compacted, :meth:`dllm.models.kv.KVStore.keep`) and the query width is the widest row's, which changes from step
to step. With static shapes:

- every forward runs every row of the canvas, in place: a done row is carried with padding queries (the
  ``padding`` column, its stored K/V rewritten from the row's final tokens, which nothing reads), its scores are
  not read and it commits nothing; the K/V store keeps its rows (and addresses) for the whole run. The
  cache, the scoring and the decision still see only the working rows (``step.active``), exactly as by default,
  so a cache is written once for both paths;
- the query width of a cached forward is bucketed (:func:`bucket`: the next power of two, capped at the canvas)
  and sticky within a phase (the set of working rows and their blocks): it grows to the widest bucket the
  phase's forwards ask for (a refresh, such as a block's first forward, is bucketed on its own and sets no
  width) and shrinks only when the phase changes, so the cached forwards of a phase share one shape (the
  Fast-dLLM prefix / dual caches and dKV, whose widths do not grow within a block; Window-Diffusion and
  Elastic-Cache, whose active sets grow with the phase's commits, step up through a few buckets). Rows are
  padded by repeating their first query column, as the plans already do between rows of different widths, and
  the padding is cut off the forward's states before anything reads them;
- full forwards stay full forwards (every column of every row).

The padding never changes the working rows' results: a query's output depends only on its own column and the
keys it attends (the fresh K/V of a padding query are those of the column it repeats), and the working rows see
the attention mask they see by default (a done row counts as unpadded, so that the mask disappears when the
working rows have no pads, as by default). Greedy and sampled tokens, forwards and history equal the default
path's (tested over the whole cache matrix, ``tests/test_static_shapes.py``).

Not static (they run as by default): the forwards a sampler or a cache runs besides the loop's one per step
(guidance's unconditional pass, S2D2's verifier, AdaBlock's look-ahead, the extra forward of rows finished by
an exit rule under a cache that did not compute their span); the loop's bookkeeping outside the forward (the
plan, the scoring, the decision) runs on the working rows only, as by default.
"""

from __future__ import annotations

import torch

from dllm.core.plan import Observer, Plan

PADDING = 0  # the column a done row's padding queries compute (a pad, or the prompt's first token)


def bucket(width: int, length: int) -> int:
    """The static query width of a forward computing ``width`` columns of a canvas of ``length``: the next power
    of two, capped at ``length``."""
    return min(1 << max(width - 1, 0).bit_length(), length)


class Shapes:
    """One run's static shapes: the sticky query width of the current phase, and the forward of a plan over
    every row of the canvas (:meth:`forward`)."""

    def __init__(self, run):
        self.run = run
        self.width = 0  # the phase's query width so far (0: no cached forward yet in this phase)

    def new_phase(self) -> None:
        """The working rows or a row's block changed: the next cached forward chooses the width afresh."""
        self.width = 0

    def forward(self, step, plan: Plan, mask):
        """Run ``plan`` (the cache's plan of the working rows ``step.active``) as one counted forward of every
        row of the canvas, with the phase's query width; returns the states of the working rows, with the
        plan's own width (as :meth:`dllm.engine.run.Run.forward` of the plan would)."""
        run, canvas = self.run, self.run.canvas
        rows, b, length = step.active, canvas.batch, canvas.length
        device = canvas.tokens.device
        n = rows.shape[0]
        done = torch.ones(b, dtype=torch.bool, device=device).index_fill_(0, rows, False) if n < b else None
        valid = None
        if step.valid is not None:  # (None when the working rows have no pads: no mask, as by default)
            valid = canvas.valid if done is None else canvas.valid | done[:, None]
        queries, write, width = plan.queries, plan.write, None
        if queries is not None:
            width = queries.shape[1]
            padded = max(self.width, bucket(width, length))
            if not plan.refresh:  # (a refresh, e.g. a block's first forward, sets no width for the phase)
                self.width = padded
            queries = _rows(_pad(queries, padded), rows, b, PADDING)
            if isinstance(write, torch.Tensor):
                write = _rows(_pad(write, padded), rows, b, False)
        keys = None if plan.keys is None else _rows(plan.keys, rows, b, True)
        if mask is not None:  # a sampler's own mask: padding queries repeat their row's first; done rows see themselves
            mask = _mask(mask, queries, rows, b, length, length if queries is None else queries.shape[1])
        observer = plan.observer
        depth = plan.row_start is not None or plan.start_layer > 0
        if observer is not None and (n < b or width != (None if queries is None else queries.shape[1])):
            below = plan.start_layer if depth else len(run.model.decoder)
            observer = _Rows(observer, rows if n < b else None, width, below)
        options = {}
        if depth:
            options["start_layer"] = plan.start_layer
            if plan.row_start is not None:
                options["row_start"] = _rows(plan.row_start, rows, b, len(run.model.decoder))
        hidden = run.forward(
            canvas.tokens,
            canvas.positions,
            valid,
            queries=queries,
            keys=keys,
            kv=None if run.cache is None else run.cache_state.kv,
            write=write,
            observer=observer,
            mask=mask,
            **options,
        )
        if n < b:
            hidden = hidden.select(rows)
        if width is not None and not depth and width < queries.shape[1]:  # cut the padding off
            hidden.states, hidden.columns = hidden.states[:, :width], hidden.columns[:, :width]
        return hidden


def _pad(values: torch.Tensor, width: int) -> torch.Tensor:
    """[n, R] -> [n, width]: each row's first entry repeated."""
    r = values.shape[1]
    return values if r == width else torch.cat([values, values[:, :1].expand(-1, width - r)], 1)


def _rows(values: torch.Tensor, rows: torch.Tensor, batch: int, fill) -> torch.Tensor:
    """[n, ...] of the working ``rows`` -> [batch, ...] with ``fill`` in the other rows."""
    if rows.shape[0] == batch:
        return values
    out = torch.full((batch, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    return out.index_copy_(0, rows, values)


def _mask(mask, queries, rows, batch, length, width):
    """A sampler's attention mask [n, 1, R, L] -> [batch, 1, width, L]: padding query rows repeat each row's
    first; a done row's queries attend only to themselves."""
    r = mask.shape[2]
    if r < width:
        mask = torch.cat([mask, mask[:, :, :1].expand(-1, -1, width - r, -1)], 2)
    if rows.shape[0] == batch:
        return mask
    columns = torch.arange(length, device=mask.device)
    own = columns[None, :, None] if queries is None else queries[:, :, None]  # each query's own column
    self_only = (columns == own).expand(batch, width, length)[:, None]
    return self_only.clone().index_copy_(0, rows, mask)


class _Rows(Observer):
    """An observer of the working rows (``rows``; None: every row) and of the plan's own ``width`` of queries
    (None: a full forward) in the layers below ``below`` (from there, a forward started at a layer computes
    every column): what the cache's observer would see in the forward of its plan."""

    def __init__(self, observer: Observer, rows, width, below):
        self.observer, self.rows, self.width, self.below = observer, rows, width, below

    def _cut(self, index, x, dim):
        if self.rows is not None:
            x = x.index_select(0, self.rows)
        if self.width is not None and index < self.below:
            x = x.narrow(dim, 0, self.width)
        return x

    def layer(self, index, hidden):
        self.observer.layer(index, self._cut(index, hidden, 1))

    def attention(self, index, q, keys, mask):
        keys = keys if self.rows is None else keys.index_select(0, self.rows)
        mask = None if mask is None else self._cut(index, mask, 2)
        self.observer.attention(index, self._cut(index, q, 2), keys, mask)
