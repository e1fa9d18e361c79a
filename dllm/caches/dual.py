"""Fast-dLLM's dual cache (Wu et al. 2025, "Fast-dLLM", arXiv 2505.22618, §3.2; NVlabs/Fast-dLLM
``llada/generate.py`` ``generate_with_dual_cache``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.prefix import Prefix


@dataclasses.dataclass(frozen=True)
class Dual(Prefix):
    """Fast-dLLM's dual cache: prefix *and* suffix K/V are reused within a block; only the block is computed.

    Each block starts with a full forward, which stores every column's K/V and makes the block's first
    commit (it counts). Every later forward of the block computes only the block's columns, against the
    prompt, finished-block and masked-suffix K/V as stored by the block's first forward; the block's fresh
    K/V replace theirs in the store (``replace_position`` in the official model).

    refresh_steps: ours, 0 (the official behaviour) = a full forward only at a block's first step; R > 0
        also makes every R-th forward of a block a full forward (R = 1: every step, exactly no cache).
    refresh_prompt: ours, False (the official behaviour); True also computes the prompt's columns at every
        forward and stores their K/V. Under bidirectional attention the prompt's states read the answer written
        so far, so prompt K/V stored before the block's latest commits are stale: on tasks that copy from the
        prompt they are what costs the dual and prefix caches their accuracy, which periodic full refreshes
        (``refresh_steps``) restore little and ``refresh_prompt`` restores, at the cost of the prompt's columns
        per forward (small for short prompts, large for long ones). Measurements: ``eval/results/caches/README.md``.
    No hyper-parameters in the official code. Deliberate differences: batched with mixed prompt lengths
    (the official function is batch-1; its batched use was a known bug, NVlabs/Fast-dLLM issue #7): each
    row has its own block and its own block-start full forward. Columns a sampler observes outside the
    block (and, for Dream, the column before each scored column, e.g. the one before the block) are
    computed too, their K/V not stored; with exit rules, that is the masked span (a finishing row is
    filled from it).
    """

    name: ClassVar[str] = "dual"
    on_device: ClassVar[bool] = True

    def reused(self, step):
        return ~step.of_active(step.in_block)

    def delayed_end(self, step):
        """[n]: ``delay`` columns past the last observed column, within the span (DCD's ``dual-delayK``)."""
        last = step.observed.max(1).values + 1
        return torch.minimum(last + self.delay, step.of_active(step.canvas.span_end))
