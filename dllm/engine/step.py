"""What a policy sees at one step of the denoising loop, and what it answers.

:class:`Step` is the loop's live state (one object for a whole generation, updated in place): each row's
current block bounds, step counters and done flag, the scores of the columns scored at this step. Block
bounds are state, not arithmetic: a sampler may set a row's block end at the block's first step
(:meth:`Step.set_block_end`), and every reader (commit set, EOS stop, caches) reads them from here.

:class:`Decision` is a step's answer: which slots to commit, optional token overrides, rows to finish.
"""

from __future__ import annotations

import dataclasses

import torch

from dllm.core.rng import Stream
from dllm.kernels.reference import Scores

NO_OVERRIDE = -1  # Decision.tokens value meaning "write the proposal"


@dataclasses.dataclass
class Decision:
    """commit: bool [B, L] slots to fill now (the loop keeps only masked slots of the current block).
    tokens: long [B, L] tokens to write instead of the proposals (``NO_OVERRIDE`` where none), e.g. verified
    tokens. finish: bool [B] rows that end now: every still-masked slot of their span is filled with the
    proposals of this step's forward (early exit) and the row is done. edit: bool [B, L] decoded slots of the current
    block to rewrite with this step's proposals (token-to-token editing: only the edit process,
    :mod:`dllm.engine.edit`, takes it). truncate: bool [B] rows whose text ends at their first EOS now: after this
    step's commit, every slot of the span after that EOS becomes the model's EOS token, decoded ones too (DCD's
    padding; the row's text, which ends at its first EOS, does not change)."""

    commit: torch.Tensor
    tokens: torch.Tensor | None = None
    finish: torch.Tensor | None = None
    edit: torch.Tensor | None = None  # bool [B, L]: decoded slots to rewrite with the proposals (the edit process)
    truncate: torch.Tensor | None = None  # bool [B]: rows padded with EOS after their first EOS (masked process)


class Step:
    """The loop's state, as every hook reads it. Per-row tensors have the batch's B rows.

    start, end: [B] columns of each row's current block ``[start, end)``; block: [B] blocks entered before it;
    step: [B] steps taken in it; t: [B] steps taken since the start (the random streams' counter);
    done: [B] finished rows; entering: [B] rows that entered their block at this step;
    allowed: bool [B, L] the slots this step's cache plan lets it commit (None: no restriction);
    quota: [B] tokens a fixed-schedule sampler commits this step (None for adaptive ones);
    scores: dense :class:`~dllm.kernels.reference.Scores` ([B, L]; -inf, or the canvas token, where not
    scored) after the forward; scored: bool [B, L] the columns scored; observed: [n, K] the columns of the
    active rows to be scored, known before the forward (a cache plans for them); read_decoded: [n, K'] those
    of them an exit rule reads also when decoded (None: none; a cache computes them too); may_finish: exit
    rules may finish rows, filling their span from this step's forward.
    """

    def __init__(self, run):
        canvas = run.canvas
        b, length = canvas.batch, canvas.length
        device = canvas.tokens.device
        self.run = run
        self.columns = torch.arange(length, device=device)
        self.start = canvas.first_block.clone()
        self.end = torch.minimum(self.start + canvas.block_size, canvas.span_end)
        self.block = torch.zeros(b, dtype=torch.long, device=device)
        self.step = torch.zeros(b, dtype=torch.long, device=device)
        self.t = torch.zeros(b, dtype=torch.long, device=device)
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.entering = torch.ones(b, dtype=torch.bool, device=device)
        self.quota: torch.Tensor | None = None
        self.scores: Scores | None = None
        self.scored: torch.Tensor | None = None
        self.active = torch.arange(b, device=device)  # rows computed by this step's forward, ascending
        self.valid = canvas.valid if run.padded else None  # padding mask of the active rows (None: no pads)
        self.iteration = 0  # forwards steps taken by the loop
        self.hidden = None  # this step's forward (models.base.Hidden of the active rows)
        self.observed: torch.Tensor | None = None  # [n, K] columns of the active rows scored at this step
        self.read_decoded: torch.Tensor | None = None  # [n, K'] observed columns read whatever their state
        self.may_finish = False  # exit rules may finish rows (filling the span from this step's forward)
        self.allowed: torch.Tensor | None = None  # bool [B, L]: the cache's commit restriction for this step
        self.full_schedule = False  # a block lasts all its scheduled steps, even once it holds no masks
        self.eos_block_ends = False  # eos_early_stop: a row stops at a block of EOS, not at a block holding one
        self.keep_open: torch.Tensor | None = None  # bool [B]: rows whose mask-free block takes another step (edits)
        self._masked = self._committable = None

    # -- the canvas ----------------------------------------------------------------------------
    @property
    def canvas(self):
        return self.run.canvas

    @property
    def model(self):
        return self.run.model

    @property
    def tokens(self) -> torch.Tensor:
        return self.run.canvas.tokens

    @property
    def masked(self) -> torch.Tensor:
        """bool [B, L]: the masked slots (kept until the canvas or the bounds change: :meth:`touch`)."""
        if self._masked is None:
            self._masked = self.run.canvas.masked
        return self._masked

    def of_active(self, tensor: torch.Tensor) -> torch.Tensor:
        """The active rows of a per-row tensor [B, ...]."""
        return tensor if self.active.shape[0] == tensor.shape[0] else tensor.index_select(0, self.active)

    def active_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The places of the working canvas rows ``rows`` (ascending) among the active rows: the batch rows of
        this step's forward states (``step.hidden``, which hold the working rows only, with static shapes too)."""
        return torch.searchsorted(self.active, rows)

    def store_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The K/V store's batch rows of the working canvas rows ``rows`` (ascending): their places among the
        active rows (the store is compacted when rows finish) or, with static shapes (the store keeps every row
        in place, :mod:`dllm.engine.static`), the rows themselves. Not the rows of ``step.hidden``
        (:meth:`active_rows`)."""
        return rows if self.run.static_shapes else self.active_rows(rows)

    @property
    def in_block(self) -> torch.Tensor:
        """bool [B, L]: the columns of each row's current block."""
        return (self.columns >= self.start[:, None]) & (self.columns < self.end[:, None])

    @property
    def committable(self) -> torch.Tensor:
        """bool [B, L]: where this step may commit: masked slots of the current block of working rows (and,
        after the forward, among the slots the cache plan allows)."""
        if self._committable is None:
            self._committable = self.masked & self.in_block & ~self.done[:, None]
            if self.allowed is not None:
                self._committable &= self.allowed
        return self._committable

    def touch(self) -> None:
        """The canvas, the bounds or the done flags changed: forget what was derived from them."""
        self._masked = self._committable = None

    def among_committable(self, values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """``values`` [B, L] where committable, ``fill`` elsewhere (for ranking by confidence)."""
        return values.masked_fill(~self.committable, fill)

    def window(self, width: int, start: torch.Tensor | None = None) -> torch.Tensor:
        """Columns [B, width] from ``start`` (default: each row's block start), clipped to the canvas."""
        start = self.start if start is None else start
        return (start[:, None] + torch.arange(width, device=start.device)).clamp(max=self.canvas.length - 1)

    def sub_block(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] start and end of each row's current sub-block: the first of its block's sub-blocks of ``width``
        columns (from the block's start; the last one may be shorter) that still holds a mask (Fast-dLLM v2)."""
        masked = self.masked & self.in_block
        first = torch.where(masked.any(1), masked.long().argmax(1), self.start)
        start = self.start + (first - self.start) // width * width
        return start, torch.minimum(start + width, self.end)

    def set_block_end(self, rows: torch.Tensor, end: torch.Tensor) -> None:
        """End the current block of ``rows`` (bool [B]) at ``end`` [B] (clipped to ``(start, span end]``);
        allowed before the commit of a block's first step (AdaBlock sizes blocks from that forward)."""
        end = torch.maximum(torch.minimum(end, self.canvas.span_end), self.start + 1)
        self.end = torch.where(rows, end, self.end)
        self._committable = None

    # -- randomness ----------------------------------------------------------------------------
    def uniform(self, stream: Stream, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """[B, L] draws of every row and column at this step, from ``stream`` (one per purpose)."""
        b, length = self.tokens.shape
        offsets = (self.columns - self.canvas.prompt_width).expand(b, length)
        rows = torch.arange(b, device=self.columns.device)
        return self.run.rng.uniform(stream, rows, self.t, offsets, dtype=dtype)

    # -- advancing blocks ----------------------------------------------------------------------
    def settle(self) -> None:
        """Move every working row whose block holds no more masks to its next block (or mark it done),
        stopping rows early at EOS when the run asks for it. No synchronisation. With ``full_schedule``
        (an exit rule that checks at every scheduled step) a block also lasts ``steps_per_block`` steps.

        The next block is the ``block_size`` grid block holding the row's next masked column, but never
        starting before the end of the block just finished (a sampler that ended a block early continues
        from there, with a tentative end ``block_size`` later)."""
        self.touch()
        canvas, masked = self.canvas, self.masked
        complete = ~self.done & ~(masked & self.in_block).any(1)
        if self.full_schedule:
            complete &= self.step >= self.run.steps_per_block
        if self.keep_open is not None:
            complete &= ~self.keep_open
        later = masked & (self.columns >= self.end[:, None])
        has_later = later.any(1)
        nxt = torch.where(has_later, later.long().argmax(1), canvas.span_end)  # first masked column after
        if self.run.eos_early_stop and self.eos_block_ends:
            hit = complete & ((self.tokens == self.model.eos_id) | ~self.in_block).all(1)
        elif self.run.eos_early_stop:
            decoded = (self.columns >= canvas.prompt_width) & (self.columns < nxt[:, None])
            hit = complete & (torch.isin(self.tokens, self.run.eos) & decoded).any(1)
        if self.run.eos_early_stop:
            if self.run.eos_rows is not None:  # (each row its own rule)
                hit = hit & self.run.eos_rows
            canvas.tokens.masked_fill_(masked & hit[:, None], self.model.eos_id)
            self.done |= hit
            complete &= ~hit
        move = complete & has_later
        self.done |= complete & ~has_later
        bs = canvas.block_size
        start = torch.maximum(canvas.first_block + (nxt - canvas.first_block) // bs * bs, self.end)
        self.block = self.block + move.long()
        self.start = torch.where(move, start, self.start)
        self.end = torch.where(move, torch.minimum(start + bs, canvas.span_end), self.end)
        self.step = torch.where(move, 0, self.step)
        self.entering |= move
        self.touch()
