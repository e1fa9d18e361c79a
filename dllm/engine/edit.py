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
from dllm.engine.loop import Masked, _best_slot
from dllm.engine.step import NO_OVERRIDE


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
        self.step.keep_open = torch.zeros(b, dtype=torch.bool, device=device)
        blocks = (run.canvas.length - run.canvas.prompt_width) // run.canvas.block_size + 2
        self.hard_cap += blocks * (self.max_post_steps + 1)

    def _begin_blocks(self) -> None:
        self.mask_free = self.mask_free.masked_fill(self.step.entering, 0)
        super()._begin_blocks()

    def commit(self) -> torch.Tensor:
        step, run, canvas = self.step, self.run, self.run.canvas
        had_masks = (step.masked & step.in_block).any(1)
        decision = self.sampler.select(step, self.state)
        committable = step.committable
        fill = decision.commit & committable
        fill |= _best_slot(step, committable) & (committable.any(1) & ~fill.any(1))[:, None]  # progress, as masked
        editable = step.in_block & ~step.masked & (step.columns >= canvas.prompt_width) & ~step.done[:, None]
        edit = torch.zeros_like(fill) if decision.edit is None else decision.edit & editable & step.scored
        edit &= step.scores.token != canvas.tokens  # an edit changes the token
        written = fill | edit
        proposals = step.scores.token
        if decision.tokens is not None:
            proposals = torch.where(decision.tokens != NO_OVERRIDE, decision.tokens, proposals)
        canvas.tokens.copy_(torch.where(written, proposals, canvas.tokens))
        step.allowed = None
        step.touch()
        if self.cache is not None:
            self.cache.update(step, run.cache_state, written)
        working = ~step.done
        step.step += working.long()
        step.t += working.long()
        # the block's fate: a mask-free forward that edits nothing closes it; otherwise, once it holds no mask, it
        # takes another forward while fewer than max_post_steps mask-free ones ran
        self.mask_free += (working & ~had_masks).long()
        settled = ~had_masks & ~edit.any(1)
        step.keep_open = working & ~settled & (self.mask_free < self.max_post_steps)
        return written
