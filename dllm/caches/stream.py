"""WeDLM's exact streaming cache: the K/V of the prompt and of the committed prefix, nothing else.

Under causal attention in physical order (:mod:`dllm.models.wedlm`) a committed token's K/V depend only on
the tokens physically before it, which are committed too: they are exact, as in an autoregressive model,
and never change. The stream decoding process (:mod:`dllm.engine.stream`) lays each row out as
``[left pads | prompt | committed | window]`` with the window reordered (filled slots first, then masks);
each step computes only the window, against the stored prefix, and the window's leading filled run, which
that step commits, keeps the K/V it computed (the engine's ``_compute_slot_mapping`` store, then
``flash_attn_varlen`` with causal bottom-right alignment: Tencent/WeDLM @0216110
``wedlm/engine/wedlm_decoder.py``, ``wedlm/layers/attention.py``). The prompt's prefill is folded into the
first window forward. Rows are ragged: each has its own committed length and window width.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.base import Cache, CacheState, Plan
from dllm.core.errors import ConfigError


@dataclasses.dataclass(eq=False)
class _State(CacheState):
    prefilled: bool = False  # the prompt was computed and stored (by the first window forward)


@dataclasses.dataclass(frozen=True)
class StreamPrefix(Cache):
    """The exact K/V of the prompt and the committed prefix, for the ``wedlm`` streaming sampler.

    recompute: ours, False (the engine's behaviour). True recomputes the prompt and the committed prefix at
        every forward (the cache-free reference; the same output as ``cache=None``).
    """

    name: ClassVar[str] = "stream"
    process: ClassVar[str] = "stream"  # it plans the stream process's windows
    recompute: bool = False

    @classmethod
    def every_step(cls):
        return cls(recompute=True)

    def check_model(self, model):
        if model.attention.process != "stream":
            raise ConfigError(
                f"the 'stream' cache holds the committed prefix of the 'wedlm' sampler on causal-attention models "
                f"(WeDLM); this {model.family} model has {model.attention} attention. Use 'prefix', 'dual' "
                "or 'dkv' (or the 'block' cache on SDAR)"
            )

    def start(self, run):
        return _State()

    def plan(self, step, state) -> Plan:
        """The forward of the working rows' windows (a :class:`~dllm.engine.stream.StreamStep`: ``width`` [n] columns
        from column ``start`` [n]): on the first call (or with ``recompute``) from column 0, so that the prompt
        (and the committed prefix) is computed and stored too. Rows are padded to the widest by repeating their
        last column (the same K/V are written twice). Every computed column's K/V are stored: the window's are
        overwritten by the next forward, which computes the window again, before anything reads them. One
        read-back (the widest window)."""
        first = not state.prefilled or self.recompute
        state.prefilled = True
        begin = torch.zeros_like(step.start) if first else step.start
        end = step.start + step.width
        r = int((end - begin).max())
        columns = (begin[:, None] + torch.arange(r, device=begin.device)).minimum(end[:, None] - 1)
        return Plan(queries=columns, write=True, refresh=first)
