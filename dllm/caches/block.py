"""Exact K/V reuse for block-causal models (SDAR): a finished block's K/V never change, because no
earlier column attends to later blocks. So each forward computes only the current block (plus, on a
block's first step, the block just finished, whose K/V were last computed before its final commits).
This replaces the official sampler's extra "store K/V" forward per block with one combined forward.
"""

from __future__ import annotations

import torch

from dllm.caches.base import Cache


class BlockCausal(Cache):
    def begin(self, canvas):
        super().begin(canvas)
        self.prefilled = False
        self.stale = torch.zeros(canvas.batch, dtype=torch.bool, device=canvas.tokens.device)

    def new_block(self, rows):
        self.stale |= rows

    def plan(self, canvas, block, act):
        bs = canvas.block_size
        start, end = (t[act] for t in canvas.block_bounds(block))
        if not self.prefilled:  # prompt and first block in one forward
            self.prefilled = True
            self.stale[:] = False
            return torch.arange(int(end.max()), device=start.device).expand(act.shape[0], -1)
        if bool(self.stale[act].any()):
            self.stale[act] = False
            first = (start - bs).clamp(min=0)
            return first[:, None] + torch.arange(2 * bs, device=start.device)
        return start[:, None] + torch.arange(bs, device=start.device)
