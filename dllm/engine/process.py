"""Decoding processes: how one step of a generation computes and commits, and the guarantee it keeps (DESIGN §3).

A sampler names its process (``Sampler.process``) and a model's attention kind names the one that can drive it
(:attr:`dllm.models.attention.Attention.process`). The session (:mod:`dllm.engine.session`) owns what every
generation shares — validation, geometry, the canvas, the cache's start and end, the counted forward, the hard
cap, history, the callback, accounting — and asks its process, step after step:

- :meth:`Process.next_step`: prepare the next forward (advance blocks, drop finished rows, ...); False when every
  row is done;
- :meth:`Process.take_step`: one counted forward (``Run.forward``) and its commit; returns the slots written;
- :meth:`Process.finish`: what the canvas needs once every row is done.

Processes (``PROCESSES``): ``"masked"`` (:mod:`dllm.engine.loop`: masks decoded in place over the canvas, block
after block; a committed token never changes), ``"stream"`` (:mod:`dllm.engine.stream`: WeDLM's causal window
in physical order; the committed prefix is exact in the stream cache), ``"edit"`` (:mod:`dllm.engine.edit`: the
masked process plus LLaDA2.1's edits of the current block) and ``"renoise"`` (:mod:`dllm.engine.renoise`:
DiffusionGemma's canvases of noise refined in place, accepted by an entropy bound, with an adaptive stop).
"""

from __future__ import annotations

from typing import ClassVar

import torch


class Process:
    """One generation's decoding process (made by the session with the prepared run and the sampler).

    hard_cap: steps past which the session raises (a bug, never a hang); allocates_store: the session allocates
    the cache's K/V store at the canvas's full size before the first forward (False: the process's forwards
    allocate it as they go)."""

    name: ClassVar[str] = ""
    allocates_store: ClassVar[bool] = True
    # decoded tokens of a row's current block may still change (token-to-token edits): only the blocks before it, or
    # a finished row, are final (what a server may stream)
    rewrites_current_block: ClassVar[bool] = False
    hard_cap: int = 0

    def __init__(self, run, sampler):
        self.run, self.sampler = run, sampler

    @classmethod
    def drives(cls, attention) -> bool:
        """Whether this process can decode a model of ``attention`` kind (:mod:`dllm.models.attention`); by
        default the kinds that name it as their process."""
        return attention.process == cls.name

    def next_step(self) -> bool:
        raise NotImplementedError

    def take_step(self, iteration: int) -> torch.Tensor:
        """One forward and its commit (``iteration``: the step's number, from 1); bool [B, L]: the slots written."""
        raise NotImplementedError

    def blocks(self) -> torch.Tensor:
        """[B] the block each row decodes (for the callback)."""
        return torch.zeros(self.run.canvas.batch, dtype=torch.long, device=self.run.canvas.tokens.device)

    def after_commit(self) -> tuple:
        """(canvas tokens [B, L], done [B], blocks [B]) as the last step's commit left them, for ``history`` and
        the callback (by default the live state)."""
        return self.run.canvas.tokens, self.done(), self.blocks()

    def done(self) -> torch.Tensor:
        """bool [B]: the rows finished (for the callback)."""
        raise NotImplementedError

    def working_rows(self) -> torch.Tensor:
        """bool [B], asked before :meth:`take_step`: the rows whose forwards that step are theirs, those each takes
        alone (by default the unfinished rows)."""
        return ~self.done()

    def row_forwards(self, working: torch.Tensor, forwards: int) -> torch.Tensor:
        """long [B], after :meth:`take_step`: the forwards of that step (``forwards``, the batch's) that each row
        takes alone; ``working``: :meth:`working_rows` before it. Each row's sum is its NFE alone (the server's
        ``usage.nfe``: :attr:`dllm.engine.session.Decoding.row_nfe`)."""
        return working.long() * forwards

    def finish(self) -> None:
        """Once every row is done (before the last history entry is taken)."""
