"""The edit decoding process (DESIGN §3): the masked process plus token-to-token edits of decoded slots of the
current block (LLaDA2.1's "JointThreshold" decoding, arXiv 2602.08676; :class:`dllm.samplers.llada2.LLaDA21`).

A step is the masked process's (one counted forward of the working rows, the sampler's scores and decision) except
its commit: the decision's ``commit`` fills masked slots of the current block (mask-to-token) and its ``edit``
rewrites decoded slots of the current block with this step's proposals (token-to-token). A block stays open once
it holds no mask for at most ``max_post_steps`` more forwards, and closes at once after a mask-free forward that
edits nothing.

Guarantees (each tested):
- edits land only in the current block, never in the prompt, never in a slot that was masked when the step began
  (a slot decoded at a step is not edited by it), never in a finished row; earlier blocks never change;
- each forward fills at least one mask of its row's block while the block holds masks; once it holds none, at most
  ``max_post_steps`` mask-free forwards follow (0: none), so a block takes at most (its masks + max_post_steps)
  forwards and the run terminates (a hard cap turns any bug into an error);
- a cache is exact only if it recomputes the current block at every forward (the block cache of a block-causal
  model): the sampler refuses the others.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.engine.loop import Masked, _best_slot, _confidence


class Editing(Masked):
    """The edit process (see the module docstring). The sampler gives ``max_post_steps`` and decides with
    :class:`~dllm.engine.step.Decision` ``commit`` (masks to fill) and ``edit`` (decoded slots to rewrite)."""

    name: ClassVar[str] = "edit"
    rewrites_current_block: ClassVar[bool] = True

    @classmethod
    def drives(cls, attention) -> bool:
        return attention.process == Masked.name  # the canvas and blocks of the masked process

    def __init__(self, run, sampler):
        super().__init__(run, sampler)
        editor = getattr(sampler, "base", sampler)  # the editing sampler itself (a composition holds it as its base)
        if self.exits:  # this process's commit runs no exit rule (an exit would fill a row's masks mid-edit)
            names = ", ".join(type(rule).__name__ for rule in self.exits)
            raise ConfigError(
                f"exit rules ({names}) do not compose with the {editor.name!r} sampler, which edits decoded tokens "
                "(the edit decoding process); use them over 'llada2' or another masked sampler"
            )
        b, device = run.canvas.batch, run.canvas.tokens.device
        self.max_post_steps = editor.max_post_steps
        self.mask_free = torch.zeros(b, dtype=torch.long, device=device)  # mask-free forwards in the current block
        self.edited = torch.zeros(b, dtype=torch.bool, device=device)  # rows whose last step edited a decoded slot
        self.step.keep_open = torch.zeros(b, dtype=torch.bool, device=device)
        blocks = (run.canvas.length - run.canvas.prompt_width) // run.canvas.block_size + 2
        self.hard_cap += blocks * (self.max_post_steps + 1)

    def joined_rows(self, keep: torch.Tensor, count: int) -> None:
        def joined(rows: torch.Tensor) -> torch.Tensor:
            return torch.cat([rows.index_select(0, keep), rows.new_zeros(count)])

        self.mask_free, self.edited = joined(self.mask_free), joined(self.edited)

    def begin_blocks(self) -> None:
        self.mask_free = self.mask_free.masked_fill(self.step.entering, 0)
        super().begin_blocks()

    def commit(self) -> torch.Tensor:
        """The masked process's commit and bookkeeping (through :meth:`commit_decision` below), then the block's
        fate: a mask-free forward that edits nothing closes it; otherwise, once it holds no mask, it takes another
        forward while fewer than max_post_steps mask-free ones ran."""
        step = self.step
        had_masks, working = (step.masked & step.in_block).any(1), ~step.done
        written = super().commit()
        self.mask_free += (working & ~had_masks).long()
        settled = ~had_masks & ~self.edited
        step.keep_open = working & ~settled & (self.mask_free < self.max_post_steps)
        return written

    def commit_rule(self, rule) -> torch.Tensor:
        return self.commit_decision()[0]  # edits need the sampler's whole decision, not a fused rule's commits

    def commit_decision(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler's decision: its ``commit`` in masked slots of the block (at least the best one: the masked
        process's progress guarantee) and its ``edit`` in the block's decoded slots whose proposal differs."""
        step, canvas = self.step, self.run.canvas
        decision = self.sampler.select(step, self.state)
        committable = step.committable
        fill = decision.commit & committable
        fill |= _best_slot(step, committable) & (committable.any(1) & ~fill.any(1))[:, None]
        editable = step.in_block & ~step.masked & (step.columns >= canvas.prompt_width) & ~step.done[:, None]
        edit = torch.zeros_like(fill) if decision.edit is None else decision.edit & editable & step.scored
        edit &= step.scores.token != canvas.tokens  # an edit changes the token
        tokens = decision.tokens
        if self.run.guard is not None:  # the fills, then the edits, that keep the constraint completable
            edit &= ~self.run.guard.fixed(canvas.tokens)  # (never a template's text)
            order = _confidence(step).double() + 1e9 * fill  # fills first: the first fits (the progress guarantee)
            kept, tokens = self.run.guard.accept(
                step.tokens, fill | edit, self._proposals(decision.tokens), order, None, self._refill
            )
            fill, edit = kept & step.masked, edit & kept
        self.edited = edit.any(1)
        written = fill | edit
        self.write(written, tokens)
        return written, ~step.done
