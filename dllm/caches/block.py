"""Exact K/V reuse for block-causal models (SDAR): a finished block's K/V never change, because no
earlier column attends to later blocks. So each forward computes only the current block (plus, on a
block's first step, the block just finished, whose K/V were last computed before its final commits; on a model
whose logits are shifted, Fast-dLLM v2, also the column before the block, whose output predicts its first column).
This replaces the official sampler's extra "store K/V" forward per block with one combined forward.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.base import Cache, CacheState, Plan, needed, plan_of
from dllm.core.errors import ConfigError


@dataclasses.dataclass(eq=False)
class _State(CacheState):
    # the prompt and first block were computed; some row entered a block since the last forward (Python bools, or
    # 0-d bool tensors on the device step, which never reads them back)
    prefilled: bool | torch.Tensor = False
    new_block: bool | torch.Tensor = False


@dataclasses.dataclass(frozen=True)
class BlockCausal(Cache):
    """SDAR's exact block cache: finished blocks' K/V reused on block-causal models (no hyper-parameters).

    With exit rules (Prophet, SchED) each forward also computes, without storing them, the columns they read
    outside the block and the masked span a finishing row is filled from (:func:`~dllm.caches.base.needed`).
    """

    name: ClassVar[str] = "block"
    joins: ClassVar[bool] = True
    batch_fields: ClassVar[tuple[str, ...]] = ("prefilled", "new_block")  # (rows that join: one more prefill)
    exact_prefix: ClassVar[bool] = True  # finished blocks' K/V never change (see the module docstring)
    on_device: ClassVar[bool] = True

    @classmethod
    def every_step(cls):
        return cls()  # exact: it gives the no-cache output as it is

    def check_model(self, model):
        if not model.attention.block_causal:
            raise ConfigError(
                f"the 'block' cache is exact only on block-causal models (SDAR); this {model.family} model "
                f"has {model.attention} attention. Use 'prefix', 'dual' or 'dkv'"
            )

    def start(self, run):
        if run.device_step:  # flags on the device, never read back
            flag = torch.zeros((), dtype=torch.bool, device=run.canvas.tokens.device)
            return _State(prefilled=flag, new_block=flag.clone())
        return _State()

    def begin_block(self, step, state, rows):
        if isinstance(state.new_block, torch.Tensor):
            state.new_block |= rows.any()
        else:  # (the loop calls it when some row entered a block)
            state.new_block = True

    def demand(self, step, state):
        """The device step's plan (see :meth:`plan`): the prompt and first block on the first forward, the block
        just finished and the new one after a row entered a block, else the block; a row never computes a column
        past its block. With exit rules, also the columns they read and the masked span, their K/V not stored."""
        bs, shift = step.canvas.block_size, step.model.shift
        start, end = step.of_active(step.start), step.of_active(step.end)
        first = torch.where(state.new_block, start - bs, start - shift).clamp(min=0).masked_fill(~state.prefilled, 0)
        block = (step.columns >= first[:, None]) & (step.columns < end[:, None])
        refresh = (~state.prefilled).expand(start.shape)
        if not step.may_finish and step.read_decoded is None:
            return block, block, refresh
        extra = needed(step)
        later = (extra & (step.columns >= end[:, None])).any(1, keepdim=True) & (step.columns >= end[:, None])
        return block | extra | later, block, refresh

    def advance(self, step, state, working=None):
        state.prefilled |= True
        state.new_block &= False

    def plan(self, step, state):
        bs = step.canvas.block_size
        start, end = step.of_active(step.start), step.of_active(step.end)
        if not state.prefilled:  # prompt and first block in one forward
            state.prefilled, state.new_block = True, False
            first, width, refresh = torch.zeros_like(start), int(end.max()), True
        elif state.new_block:  # the finished block's final K/V, and the new block
            state.new_block = False
            first, width, refresh = (start - bs).clamp(min=0), 2 * bs, False
        else:  # (a shifted model's block start reads the column before: computed again, its K/V unchanged)
            shift = step.model.shift
            first, width, refresh = (start - shift).clamp(min=0), bs + shift, False
        # Never compute a column past the row's block: it would attend to its block's later, never computed
        # columns. Rows are padded by repeating their last column.
        columns = (first[:, None] + torch.arange(width, device=start.device)).minimum(end[:, None] - 1)
        if not step.may_finish and step.read_decoded is None:
            return Plan(queries=columns, refresh=refresh)
        # Exit rules read columns outside the block and fill a finishing row's masked span from this forward:
        # those columns are computed too (a row reading past its block computes every later column, whose
        # keys they attend), and only the block's K/V are stored.
        block = torch.zeros(columns.shape[0], step.canvas.length, dtype=torch.bool, device=start.device)
        block.scatter_(1, columns, True)
        extra = needed(step)
        later = (extra & (step.columns >= end[:, None])).any(1, keepdim=True) & (step.columns >= end[:, None])
        return plan_of(block | extra | later, block, refresh=refresh)
