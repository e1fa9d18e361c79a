"""dKV-Cache-Decode (Ma et al. 2025, "dKV-Cache: The Cache for Diffusion Language Models", arXiv 2505.15781;
horseee/dKV-Cache ``generation_utils/llada_dkv_cache_decode.py``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.base import Cache, CacheState, needed, plan_of, sources
from dllm.core.params import hp


@dataclasses.dataclass(eq=False)
class _State(CacheState):
    count: torch.Tensor = None  # [B] forwards of the row since its block started
    previous: torch.Tensor = None  # bool [B, L] masked at the input of the row's previous forward


@dataclasses.dataclass(frozen=True)
class DKV(Cache):
    """dKV-Cache-Decode: delayed caching of decoded tokens' K/V, refreshed every ``cache_reloading_step``.

    Per row and block a step counter i (forwards since the block's start). Steps i <= 1 and every step with
    i % R == 0 are full forwards (every column computed and stored). Any other step computes only the
    columns that were masked at the previous step's input (still masked, and those committed at the previous
    step: *delayed* caching, a token's K/V are taken once it is decoded and recomputed with its real
    token) and reads every other column's K/V from the store, where a column's K/V are those of the
    forward that last computed it. The store is reset at every block (step counter 0).

    cache_reloading_step: R, official default 1 (every step a full forward: no caching); the dKV-Cache
        README uses 8 for LLaDA (and 4 for Dream's cache_steps).
    refresh_prompt: ours, False (the official behaviour); True also computes the prompt's columns at every
        forward (see :class:`~dllm.caches.dual.Dual` for why).
    Deliberate differences: batched with ragged rows (the official ``view(B, -1)`` needs the same number of
    cached columns in every row; here each row computes its own set, padded by repeating a column), so any
    sampler works, not only LLaDA's fixed schedule. For Dream (logits of column c from column c - 1) the
    column before each recomputed column is recomputed as well (dKV's Dream code shifts its cache the same
    way, ``shift_type="un"``). Observed columns that are still masked (and their sources) are always
    computed; decoded observed columns that the plan does not compute are not scored.
    """

    name: ClassVar[str] = "dkv"
    joins: ClassVar[bool] = True
    cache_reloading_step: int = hp(1, ">= 1", note="1: a full forward at every step")
    refresh_prompt: bool = False

    @classmethod
    def every_step(cls):
        return cls(cache_reloading_step=1)

    def start(self, run):
        canvas = run.canvas
        count = torch.zeros(canvas.batch, dtype=torch.long, device=canvas.tokens.device)
        return _State(count=count, previous=torch.ones_like(canvas.valid))

    def begin_block(self, step, state, rows):
        state.count.masked_fill_(rows, 0)

    def plan(self, step, state):
        i = step.of_active(state.count)
        full = (i <= 1) | (i % self.cache_reloading_step == 0)
        previous = step.of_active(state.previous)
        compute = full[:, None] | previous | sources(step, previous) | needed(step)
        if self.refresh_prompt:
            compute = compute | (step.columns < step.canvas.prompt_width)
        plan = plan_of(compute, refresh=full)
        state.previous[step.active] = step.of_active(step.masked)  # (after the plan: of_active may alias)
        state.count[step.active] += 1
        return plan
