"""The drafting process: FreeDave's draft-and-verify over the masked process (:mod:`dllm.samplers.freedave`).

A step of the masked process (:class:`~dllm.engine.loop.Masked`) decodes from the predictions of one forward over
the canvas. Here the forward of a step runs over **drafts** instead: from the canvas ``x`` and its predictions
``P(x)`` (token and confidence of every mask of the current block), draft ``k`` (k = 0 ... K - 1) is ``x`` with its
``k + 1`` most confident masks filled with their proposals, and one forward over every row's K drafts (the batch
expanded K times: FreeDave's ``batch_expanding`` mode) gives each draft's own predictions. Draft ``k + 1`` holds
exactly the next static step from draft ``k`` when the slot and token that step commits from ``P(draft k)`` are
the ones draft ``k + 1`` added; the longest chain of such drafts from draft 0 is the row's commit, and the
predictions of its last draft are the next step's ``P(x)``, so no forward is spent on them. One-token-per-step
decoding of the same confidences would have written exactly these tokens, one forward each.

The predictions carried to the next step are those of the current block's columns: a row entering a new block (or
any change of the scored columns) needs a forward over its canvas first, as the official code's refresh forward at
each block. When every row does, that is one ordinary forward before the drafts; a row entering its block while
others draft is refreshed within their drafts forward (its canvas in place of each of its drafts, nothing
committed) and drafts at the next step, so rows keep their own forwards and the batch one forward a step. A step
where every row's block has one mask left commits it from the predictions at hand, without a forward (the official
loop's last step of a block). On AR-adapted models (the sampler's ``forces_first_token``) a block's first slot is
committed at its first drafting step whatever its confidence, and that step's draft ``k`` adds ``k`` masks to it.
Without a K/V cache (the drafts are full canvases).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.engine.loop import Masked, _place
from dllm.kernels.reference import ranks_per_row


class Drafting(Masked):
    """The masked process whose forward is one forward over each row's drafts (see the module docstring). The
    sampler (``draft_steps``) commits ``step.drafted``: the slots of each row's longest verified draft."""

    name: ClassVar[str] = "draft"

    def __init__(self, run, sampler):
        super().__init__(run, sampler)
        if self.exits or self.scorer.transforms:
            raise ConfigError(
                f"the {self.name!r} process verifies its drafts with the static rule alone: it takes no exit rules "
                "or logit transforms"
            )
        self.carried = None  # (columns [B, K], dense Scores): predictions of the canvas the last step left
        self.refreshed = torch.zeros_like(self.step.done)  # [B]: rows whose carried predictions are of a block start
        self.step.drafted = None
        # the last step's forwards: whether it took a plain one, and bool [n] the rows its drafts forward is theirs
        self.forwards = (False, None)

    @classmethod
    def drives(cls, attention) -> bool:
        return Masked.drives(attention)

    def forward(self) -> None:
        step = self.step
        columns = self.observed_columns()
        carried, refreshed = self.carried, self.refreshed
        self.carried = None
        held = torch.zeros_like(step.active, dtype=torch.bool)  # [n]: rows whose predictions are their block's
        if carried is not None:
            held = (carried[0].index_select(0, step.active) == columns).all(1)
        kept = int(held.sum())  # (one read a step)
        if kept == 0:  # every row starts a block: P(x), then its drafts
            super().forward()
            self.forwards = (True, None)
            self.draft(columns, fresh=~held, refresh=None)
            return
        # P(x) from the last step's forward, no forward spent; a row starting a block is refreshed in this step's
        # drafts forward instead (its canvas among the drafts; it drafts at the next step), so a batch whose rows
        # start blocks at different steps still takes one forward a step
        step.observed, step.read_decoded = columns, None
        self.forwards = (False, None)
        step.scores = carried[1]
        step.scored = torch.zeros_like(self.run.canvas.valid)
        step.scored[step.active[:, None], columns] = held[:, None].expand_as(columns)  # (no read: not a mask index)
        refresh = None if kept == held.shape[0] else ~held
        self.draft(columns, fresh=refreshed.index_select(0, step.active) & held, refresh=refresh)

    def draft(self, columns: torch.Tensor, fresh: torch.Tensor, refresh: torch.Tensor | None) -> None:
        """One counted forward over the drafts of every working row (none when each row's block has one mask left);
        ``step.drafted``: the slots each row commits; ``self.carried``: the predictions of the canvas after that
        commit. ``fresh`` (bool [n]): the active rows whose predictions are of their block's start (not drafted from
        yet); ``refresh`` (bool [n], None: none): rows that draft nothing this step, their canvas forwarded (as their
        draft 0) for their predictions."""
        step, run, canvas = self.step, self.run, self.run.canvas
        rows, scores = step.active, step.scores
        committable = step.committable.index_select(0, rows)  # [n, L]
        if refresh is not None:
            committable = committable & ~refresh[:, None]
        n, length = committable.shape
        # AR-adapted families: a block's first slot is committed from its start's forward whatever its confidence,
        # and that step's drafts add 0 ... k - 1 slots to it (the official draft 0 is the canvas as it stands)
        forced = torch.zeros_like(committable)
        if self.sampler.forces_first_token(run.model):
            first = step.start.index_select(0, rows)
            at_first = torch.arange(length, device=first.device)[None, :] == first[:, None]
            forced = at_first & committable & fresh[:, None]
            committable = committable & ~forced
        before = 1 - forced.any(1).long()  # [n]: slots draft 0 adds (1; 0 after a forced first slot)
        confidence = scores.prob.index_select(0, rows).masked_fill(~committable, float("-inf"))
        ranks = ranks_per_row(confidence)  # (ties: leftmost first)
        masks = committable.sum(1)  # [n]
        most = int(masks.max())  # (one read a step)
        k = max(1, min(self.sampler.draft_steps, most))  # drafts per row
        depth = torch.arange(k, device=ranks.device)
        filled = (ranks[:, None, :] < depth[None, :, None] + before[:, None, None]) & committable[:, None, :]
        filled |= forced[:, None, :]  # [n, k, L]: draft d's slots
        self.refreshed = torch.zeros_like(step.done)
        if most <= 1 and refresh is None:  # every row's block has one mask left: it is committed without a forward
            step.drafted = torch.zeros_like(canvas.valid)  # (the official takes draft 0 as it stands; the next block
            step.drafted[rows] = forced | (ranks < 1) & committable  # starts afresh)
            return
        if refresh is not None:
            self.refreshed[rows] = refresh
        # the rows the drafts forward is theirs: alone, a row whose block has one mask left takes none
        self.forwards = (self.forwards[0], masks > 1 if refresh is None else (masks > 1) | refresh)
        proposals = scores.token.index_select(0, rows)
        drafts = torch.where(filled, proposals[:, None, :], canvas.tokens.index_select(0, rows)[:, None, :])
        expanded = rows.repeat_interleave(k)  # draft d of row i at i * k + d
        valid = None if step.valid is None else step.valid.repeat_interleave(k, 0)
        hidden = run.forward(drafts.reshape(n * k, length), canvas.positions.index_select(0, expanded), valid)
        observed = columns.repeat_interleave(k, 0)
        out = self.scorer(step, expanded, observed, hidden)  # each draft's own predictions, [n * k, K]
        prob = out.prob.reshape(n, k, -1)
        token = out.token.reshape(n, k, -1)
        # the static step from draft d: its most confident remaining mask of the block, and that mask's token
        left = ~filled.gather(2, columns[:, None, :].expand(-1, k, -1)) & committable.gather(1, columns)[:, None, :]
        best = prob.masked_fill(~left, float("-inf")).argmax(2, keepdim=True)  # [n, k, 1] (ties: leftmost)
        slot = columns[:, None, :].expand(-1, k, -1).gather(2, best)[..., 0]  # [n, k]
        wrote = token.gather(2, best)[..., 0]
        # draft d + 1 is draft d plus one slot with P(x)'s token: verified when it holds the static step from draft d
        # (a slot draft d left masked, so in draft d + 1 exactly when it is the added one) with the same token
        added = filled[:, 1:].gather(2, slot[:, : k - 1, None])[..., 0]
        agree = added & (wrote[:, : k - 1] == proposals.gather(1, slot[:, : k - 1]))
        agree &= depth[None, 1:k] + before[:, None] <= masks[:, None]  # (a draft past the row's masks adds nothing)
        chosen = agree.long().cumprod(1).sum(1)  # [n]: the last verified draft
        drafted = torch.zeros_like(canvas.valid)
        drafted[rows] = filled[torch.arange(n, device=rows.device), chosen]
        step.drafted = drafted
        pick = torch.arange(n, device=rows.device) * k + chosen
        kept = _each(out, lambda name, v: v.index_select(0, pick))
        self.carried = (self._dense_columns(columns), _place(step, rows, columns, kept, None))

    def joined_rows(self, keep: torch.Tensor, count: int) -> None:
        def joined(rows: torch.Tensor, fill) -> torch.Tensor:
            return torch.cat([rows.index_select(0, keep), rows.new_full((count, *rows.shape[1:]), fill)])

        self.refreshed = joined(self.refreshed, False)
        if self.carried is not None:  # a new row's predictions are of no block (columns -1): it is refreshed first
            columns, scores = self.carried
            self.carried = (joined(columns, -1), _each(scores, lambda name, v: joined(v, 0)))

    def row_forwards(self, working: torch.Tensor, forwards: int) -> torch.Tensor:
        """A plain forward is every working row's; the drafts forward is a row's where it drafts or is refreshed
        (a row whose block has one mask left takes no forward alone, but sits in others' drafts forward)."""
        plain, drafts = self.forwards
        rows = self.step.active
        counts = torch.zeros_like(working, dtype=torch.long)
        counts[rows] = int(plain) + (0 if drafts is None else drafts.long())
        return counts

    def commit(self) -> torch.Tensor:
        commit = super().commit()
        # a row refreshed in others' drafts forward drafts at the next step under the same counters, as it would
        # have right after its refresh alone (its draws never depend on its batch)
        self.step.t -= self.refreshed.long()
        return commit

    def _dense_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """``columns`` [n, K] of the active rows placed in a [B, K] tensor (other rows: -1)."""
        dense = torch.full((self.run.canvas.batch, columns.shape[1]), -1, dtype=columns.dtype, device=columns.device)
        dense[self.step.active] = columns
        return dense


def _each(scores, fn):
    """``scores`` (:class:`~dllm.kernels.reference.Scores`) with ``fn(name, tensor)`` applied to each field it holds."""
    return type(scores)(**{name: None if v is None else fn(name, v) for name, v in vars(scores).items()})
