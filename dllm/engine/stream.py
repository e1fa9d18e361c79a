"""The stream decoding process: a causal window in physical order (WeDLM, arXiv 2512.22737, Alg. 1), as its
engine runs it: Tencent/WeDLM @0216110 ``wedlm/engine/wedlm_decoder.py`` (window refill, reordering, commit).

Per row, a window of slots after the committed prefix, each a filled (predicted, not yet committed) token or a
mask; it starts as ``sampler.window`` masks. One step = one forward:

1. refill: with m the length of the window's leading run of filled slots, m masks are appended (within the
   model's position budget);
2. the forward computes the window reordered (filled slots first, then masks, each in ascending window order)
   at its logical positions, after the prompt and the committed prefix (the stream cache keeps their K/V,
   exact; the prompt's prefill folds into the first forward);
3. the leading filled run is committed in order; a stop token (kept) or reaching ``max_new_tokens`` ends the
   row, and what follows it is discarded;
4. the sampler's policy (``select`` of a :class:`StreamStep`) chooses which of the window's masks to fill from
   their raw logits; their tokens are the proposals of its ``score_spec`` (counter RNG: ``Stream.TOKENS``, keyed
   by the row, its step and the slot's offset from the generation start).

Under a constraint (``run.guard``), the window's masks are restricted to the tokens that keep it completable given
the committed prefix and the window's filled slots (their logical columns), and the fills are accepted in their
proposals' probability order, each checked against those before it (the first always fits). A template's text
(and the EOS past it) fills its slots when the window reaches them.

Guarantees: the committed prefix only grows, in order, and never changes; each step fills at least one mask of
every working row (the policy's argmin), so a row commits within ``2 x window`` steps of its last commit; the
session's hard cap turns a bug into an error. Rows are ragged (each has its own committed length and window); a
batch is one padded forward. The buffers hold at most ``2 x window`` slots, and none past the model's maximum
length, whose positions the window cannot pass (the engine's KV budget).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.rng import Stream as RandomStream
from dllm.engine.process import Process


@dataclasses.dataclass
class StreamStep:
    """What the stream cache plans from and the sampler's policy chooses from, at one step. rows: [n] the working
    rows; start: [n] each window's first column; width: [n] its width (in slots); after the forward, logits:
    float [n, K, V] the raw logits of each window's masks (in window order), slots: [n, K] their window slots,
    real: bool [n, K] where a mask is (rows hold different numbers of masks)."""

    rows: torch.Tensor
    start: torch.Tensor
    width: torch.Tensor
    logits: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    real: torch.Tensor | None = None


class Stream(Process):
    """The stream process of one generation. Per row b: buffer columns ``[0, P)`` the left-padded prompt, then the
    committed tokens, then the window reordered; ``start[b] = P + committed[b]`` is the window's first column.
    ``slots`` [B, S] / ``filled`` [B, S] hold the window in logical (slot) order, ``width[b]`` slots of it in use."""

    name: ClassVar[str] = "stream"
    allocates_store: ClassVar[bool] = False  # the stream's forwards are windows after a prefix: stored as they go

    def __init__(self, run, sampler):
        super().__init__(run, sampler)
        from dllm.engine.loop import Scorer

        canvas, model = run.canvas, run.model
        self.model = model
        b, p = canvas.batch, canvas.prompt_width
        self.g = canvas.length - p
        self.lengths = canvas.span_end - p  # [B] each row's max_new_tokens (the rows' may differ)
        w = sampler.window
        device = canvas.tokens.device
        self.device, self.p = device, p
        # a window holds at most W + m <= 2W slots during a forward, and no slot past the model's maximum length
        self.s = min(2 * w, model.max_length - int(canvas.prompt_lens.min()))
        length = p + self.g + self.s
        self.tokens = torch.full((b, length), model.mask_id, dtype=torch.long, device=device)
        self.tokens[:, :p] = canvas.tokens[:, :p]
        self.valid = torch.ones((b, length), dtype=torch.bool, device=device)
        self.valid[:, :p] = canvas.valid[:, :p]
        self.positions = torch.zeros((b, length), dtype=torch.long, device=device)
        self.positions[:, :p] = canvas.positions[:, :p]
        self.plen = canvas.prompt_lens.long()
        self.committed = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.full((b, self.s), model.mask_id, dtype=torch.long, device=device)
        self.filled = torch.zeros((b, self.s), dtype=torch.bool, device=device)
        self.budget = model.max_length - self.plen  # positions left after the prompt (the engine's KV budget)
        self.width = torch.minimum(torch.full_like(self.plen, w), self.budget)
        self.finished = torch.zeros(b, dtype=torch.bool, device=device)
        self.steps = torch.zeros(b, dtype=torch.long, device=device)  # forwards per row (the RNG's step counter)
        self.active = torch.arange(b, device=device)
        self.stop = run.eos if run.eos_early_stop else run.eos[:0]
        self.hard_cap = self.g * (self.s + 1) + 2
        self.scorer = Scorer(run, sampler, ())  # the LM head and the proposals, on the run's scoring backend
        self.spec = sampler.score_spec(run)
        self.state = sampler.init_state(run)

    def next_step(self) -> bool:
        return bool(self.active.numel())

    def done(self) -> torch.Tensor:
        return self.finished

    def take_step(self, iteration: int) -> torch.Tensor:
        rows = self.active
        slots, filled, width = self.slots[rows], self.filled[rows], self.width[rows]
        slot = torch.arange(self.s, device=self.device)[None, :]
        in_window = slot < width[:, None]
        # 1. refill: as many masks as the leading filled run is long (within the position budget)
        run_len = (filled & in_window).long().cumprod(1).sum(1)
        start = self.p + self.committed[rows]
        room = self.budget[rows] - self.committed[rows]
        width = torch.minimum(width + run_len, room)
        in_window = slot < width[:, None]
        filled = filled & in_window
        slots = torch.where(in_window & ~filled, self.model.mask_id, slots)
        # 2. reordered window: filled slots first, then masks, each in slot order; out-of-window slots last
        key = (~filled).long() * self.s + slot + (~in_window).long() * 2 * self.s
        order = torch.argsort(key, dim=1)  # reordered row r holds window slot order[r]
        n_filled = filled.sum(1)
        cols = start[:, None] + slot  # reordered row r sits at column start + r
        tokens, positions, valid = self.tokens[rows], self.positions[rows], self.valid[rows]
        write = in_window  # rows r < width (the in-window slots sort first)
        reordered_tokens = slots.gather(1, order)
        reordered_positions = (self.plen[rows] + self.committed[rows])[:, None] + order
        tokens.scatter_(1, cols, torch.where(write, reordered_tokens, tokens.gather(1, cols)))
        positions.scatter_(1, cols, torch.where(write, reordered_positions, positions.gather(1, cols)))
        self.tokens[rows], self.positions[rows] = tokens, positions
        # the forward, and the logits of the window's masks (reordered rows n_filled .. width - 1)
        n_masks = width - n_filled
        k = int(n_masks.max())
        mask_rows = n_filled[:, None] + torch.arange(k, device=self.device)[None, :]
        mask_cols = start[:, None] + mask_rows.minimum(width[:, None] - 1)
        step = StreamStep(rows, start, width)
        hidden = self._forward(step, tokens, positions, valid)
        logits = self.scorer.logits(None, rows, mask_cols, hidden, raw=True)  # the engine may propose the mask id
        self.steps[rows] += 1
        # 3. commit the leading filled run (the first run_len reordered rows, in slot order)
        finished, written = self._commit(rows, slots, run_len)
        # drop the committed slots from the window
        shifted = (slot + run_len[:, None]).clamp(max=self.s - 1)
        beyond = slot + run_len[:, None] >= self.s
        slots = slots.gather(1, shifted).masked_fill(beyond, self.model.mask_id)
        filled = filled.gather(1, shifted) & ~beyond
        width = width - run_len
        # 4. fill masks: the masks' window slots after the shift, in order (as their logits)
        mask_slots = (
            order.gather(1, mask_rows.minimum(torch.as_tensor(self.s - 1, device=self.device))) - run_len[:, None]
        )
        real = torch.arange(k, device=self.device)[None, :] < n_masks[:, None]
        if k:  # (no masks at all: every row's window was filled up to the position limit, and it ends now)
            step.logits, step.slots, step.real = logits.float(), mask_slots, real
            if self.run.guard is not None:  # the window's masks take only the tokens that keep the constraint
                columns, logical = self._constrained(step, slots, filled, width)
            chosen = self.sampler.select(step, self.state) & real & ~finished[:, None]
            proposal = self._propose(step)
            if self.run.guard is not None:  # a template's text (and the EOS past it) where the window reaches it
                at = columns.clamp(min=0, max=logical.shape[1] - 1)
                fixed = self.run.guard.fixed(logical)[rows].gather(1, at) & real & (columns >= 0)
                fixed &= columns < logical.shape[1]
                proposal = torch.where(fixed, logical[rows].gather(1, at), proposal)
                chosen, proposal = self._accepted(step, chosen | fixed, proposal, columns, logical)
            slots = _scatter(slots, mask_slots, proposal, chosen)
            filled = _scatter(filled, mask_slots, chosen, chosen)
        self.slots[rows], self.filled[rows], self.width[rows] = slots, filled, width
        self.finished[rows] |= finished
        committed = torch.zeros_like(self.run.canvas.valid)
        committed[rows] = written
        if bool(finished.any()):
            kept = (~finished).nonzero().squeeze(1)
            self.active = rows.index_select(0, kept)
            if self.run.cache is not None:
                self.run.cache.keep(self.run.cache_state, kept)
        return committed

    def finish(self) -> None:
        """The span after a row's end (stop token or length): EOS (a model without one ends every row at the length:
        no span is left)."""
        canvas, model = self.run.canvas, self.model
        if model.eos_ids:
            slot = torch.arange(self.g, device=self.device)[None, :]
            tail = (slot >= self.committed[:, None]) & (slot < self.lengths[:, None])
            canvas.tokens[:, self.p :] = torch.where(tail, model.eos_id, canvas.tokens[:, self.p :])

    def _forward(self, step: StreamStep, tokens, positions, valid):
        """One counted forward of the working rows' windows (with the cache: only the windows, after the first)."""
        run = self.run
        if run.cache is None:  # the cache-free recompute: prompt, committed prefix and window, every step
            end = int((step.start + step.width).max())
            return run.forward(tokens[:, :end], positions[:, :end], valid[:, :end])
        plan = run.cache.plan(step, run.cache_state)
        run.refreshes += plan.refresh
        return run.forward(tokens, positions, valid, queries=plan.queries, kv=run.cache_state.kv, write=plan.write)

    def _commit(self, rows, slots, run_len) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit each row's leading filled run to the canvas; returns (bool [n]: rows that end (stop token,
        length), bool [n, L]: the canvas slots written)."""
        slot = torch.arange(self.s, device=self.device)[None, :]
        committed = self.committed[rows]
        take = slot < run_len[:, None]
        is_stop = torch.isin(slots, self.stop) & take
        first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1) + 1, run_len)
        length = self.lengths[rows]
        count = torch.minimum(first_stop, length - committed)  # the stop token is kept; nothing past the length
        take = slot < count[:, None]
        canvas = self.run.canvas.tokens
        index = self.p + committed[:, None] + slot
        canvas[rows] = _scatter(canvas[rows], index, slots, take)
        written = _scatter(torch.zeros_like(canvas[rows], dtype=torch.bool), index, take, take)
        self.committed[rows] = committed + count
        return is_stop.any(1) | (committed + count >= length), written

    def _constrained(self, step: StreamStep, slots, filled, width) -> tuple[torch.Tensor, torch.Tensor]:
        """Restrict ``step.logits`` (in place) to the tokens each window mask may take under the run's constraint,
        which reads the committed prefix and the window's filled slots as written (their logical columns);
        returns the masks' logical columns [n, K] and the logical canvas [B, L]."""
        rows, canvas = step.rows, self.run.canvas
        written = canvas.tokens.clone()
        slot = torch.arange(self.s, device=self.device)[None, :]
        at = self.p + self.committed[rows][:, None] + slot
        keep = filled & (slot < width[:, None]) & (at < canvas.length)
        written[rows] = _scatter(written[rows], at.clamp(max=canvas.length - 1), slots, keep)
        columns = (self.p + self.committed[rows][:, None] + step.slots).masked_fill(~step.real, -1)
        self.run.guard.restrict(step.logits, rows, columns, written)
        return columns, written

    def _accepted(self, step: StreamStep, chosen, proposal, columns, written) -> tuple[torch.Tensor, torch.Tensor]:
        """The fills ``chosen`` [n, K] that keep the constraint completable, in the order of their proposals'
        probability (each checked against those before it), and their tokens [n, K] (a grammar's witness may
        replace a row's first mask's proposal when every fill waits)."""
        rows, guard = step.rows, self.run.guard
        b, length = written.shape
        commit = torch.zeros((b, length + 1), dtype=torch.bool, device=self.device)
        proposals = torch.cat([written, written[:, :1]], 1)
        confidence = torch.zeros((b, length + 1), dtype=torch.float64, device=self.device)
        inside = (columns >= 0) & (columns < length)  # (a window slot past the canvas: dropped at its commit)
        columns = columns.masked_fill(~inside, length)  # (a spare column)
        at = torch.where(chosen, columns, length)
        probability = step.logits.softmax(-1).gather(-1, proposal[..., None]).squeeze(-1).double()
        commit[rows] = commit[rows].scatter(1, at, chosen)
        proposals[rows] = proposals[rows].scatter(1, at, proposal)
        confidence[rows] = confidence[rows].scatter(1, at, probability)
        frontier = {}  # a grammar's fallback: the proposal of a row's first mask when every fill waits
        for j, row in enumerate(rows.tolist()):
            frontier.update({(row, c): t for c, t in zip(columns[j].tolist(), proposal[j].tolist()) if c < length})

        def refill(row, column, allowed):  # (the proposal where allowed, else the first allowed; None: not a mask)
            token = frontier.get((row, column))
            return token if token is None or allowed[token] else int(allowed.nonzero()[0])

        kept, tokens = guard.accept(
            written, commit[:, :length], proposals[:, :length], confidence[:, :length], None, refill
        )
        kept = torch.cat([kept, torch.zeros_like(kept[:, :1])], 1)[rows]
        tokens = torch.cat([tokens, tokens[:, :1]], 1)[rows].gather(1, columns)
        return torch.where(inside, kept.gather(1, columns), chosen) & step.real, torch.where(inside, tokens, proposal)

    def _propose(self, step: StreamStep) -> torch.Tensor:
        """The tokens [n, K] of the window's masks: the proposals of the sampler's score spec from their raw
        logits, drawn at temperature > 0 from the row's counters."""
        run, rows = self.run, step.rows
        counters = None
        if run.temperature > 0:
            offsets = self.committed[rows][:, None] + step.slots.clamp(min=0)
            counters = run.rng.counters(RandomStream.TOKENS, rows, self.steps[rows], offsets)
        return self.scorer.score(step.logits, self.spec, counters).token


def _scatter(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``target`` [n, L] with ``values`` written at ``index`` [n, K] where ``where`` [n, K] holds (the others go to a
    spare column, so that an unused index never races a used one in the scatter)."""
    n, length = target.shape
    wide = torch.cat([target, target[:, :1]], 1)
    index = torch.where(where, index, length)
    return wide.scatter_(1, index, values.to(target.dtype))[:, :length]
