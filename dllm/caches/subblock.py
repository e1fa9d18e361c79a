"""Fast-dLLM v2's sub-block cache (Wu et al. 2025, arXiv 2509.26328, §3.3 "hierarchical cache"; NVlabs/Fast-dLLM
``v2/generation_functions.py::batch_sample`` with ``use_block_cache=True``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.base import Cache, CacheState, needed, plan_of
from dllm.core.errors import ConfigError
from dllm.core.params import hp


@dataclasses.dataclass(eq=False)
class _State(CacheState):
    fresh: torch.Tensor = None  # [B] the row entered a block since its last forward
    count: torch.Tensor = None  # [B] forwards of the row in its block


@dataclasses.dataclass(frozen=True)
class SubBlock(Cache):
    """Fast-dLLM v2's sub-block cache (``use_block_cache``): inside a block, only the current sub-block is computed.

    Finished blocks' K/V are reused exactly, as the block cache does (block-causal attention). Within the block, a
    forward that refreshes computes the whole block and stores its K/V; the others compute only the current sub-block
    (the first of ``small_block_size`` columns from the block's start still holding a mask) against the stored K/V of
    the rest of the block, and replace the sub-block's (the official ``replace_position``). A forward refreshes when
    the sub-block's first column is still masked, as officially, and at a block's first two forwards when its first
    column is generated: the one that completes the previous block (and decodes that first column) and the next, the
    official block cache's first (it is emptied at each block). Approximate: the rest of the block's K/V are those of
    the last refresh.

    small_block_size: the sub-block, the ``fast_dllm_v2`` sampler's (8; that sampler refuses another).
    refresh_steps: ours, 0 (the official rule) or R > 0: every R-th forward of a block also refreshes (1: every
        forward, exactly no cache). Columns a sampler observes outside the sub-block (and the column before each, on
        a shifted model) are computed too, their K/V not stored.
    """

    name: ClassVar[str] = "subblock"
    joins: ClassVar[bool] = True
    on_device: ClassVar[bool] = True
    exact_prefix: ClassVar[bool] = True  # finished blocks' K/V are exact, as the block cache's
    small_block_size: int = hp(8, ">= 1", note="the sampler's sub-block")
    refresh_steps: int = hp(0, ">= 0", note="0: the official rule; 1: every forward")

    @classmethod
    def every_step(cls):
        return cls(refresh_steps=1)

    def check_model(self, model):
        if not model.attention.block_causal:
            raise ConfigError(
                f"the 'subblock' cache (Fast-dLLM v2's use_block_cache) serves block-causal models; this {model.family}"
                f" model has {model.attention} attention. Use 'dual', the same scheme with the block as the sub-block"
            )

    def start(self, run):
        b, device = run.canvas.batch, run.canvas.tokens.device
        fresh = torch.ones(b, dtype=torch.bool, device=device)
        return _State(fresh=fresh, count=torch.zeros(b, dtype=torch.long, device=device))

    def begin_block(self, step, state, rows):
        state.fresh |= rows
        state.count.masked_fill_(rows, 0)

    def demand(self, step, state):
        """(columns to compute, columns whose K/V are stored, rows refreshing), each of the active rows."""
        bs, shift, columns = step.canvas.block_size, step.model.shift, step.columns
        start, end = step.of_active(step.start), step.of_active(step.end)
        width = min(self.small_block_size, bs)
        sub_start, sub_end = (step.of_active(t) for t in step.sub_block(width))
        count, fresh = step.of_active(state.count), step.of_active(state.fresh)
        generated = start >= step.canvas.prompt_width
        first_masked = step.of_active(step.masked).gather(1, sub_start[:, None])[:, 0]
        full = fresh | ((count == 1) & generated) | first_masked
        if self.refresh_steps:
            full |= count % self.refresh_steps == 0
        # a refresh computes the block (and the column before it on a shifted model); a block's first forward the
        # finished block before it too (its final K/V), the row's first forward the prompt
        low = torch.where(fresh, start - bs, start - shift).clamp(min=0)
        low = low.masked_fill((step.of_active(step.block) == 0) & (count == 0), 0)  # (the row's first forward)
        block = (columns >= low[:, None]) & (columns < end[:, None])
        sub = (columns >= sub_start[:, None]) & (columns < sub_end[:, None])
        own = torch.where(full[:, None], block, sub)
        return own | needed(step), own, full

    def advance(self, step, state, working=None):
        if working is None:
            rows = step.active
            state.fresh[rows] = False
            state.count[rows] += 1
        else:
            state.fresh &= ~working
            state.count += working.long()

    def plan(self, step, state):
        compute, write, refresh = self.demand(step, state)
        plan = plan_of(compute, write, refresh=refresh)
        self.advance(step, state)
        return plan
