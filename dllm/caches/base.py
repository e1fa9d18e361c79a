"""The cache interface the denoising loop drives."""

from __future__ import annotations

import torch

from dllm.models.layers import KVStore


class Cache:
    """Owns a :class:`KVStore` and plans which columns each forward computes.

    ``plan`` returns the column indices [n, R] of the working rows to compute (None = all columns);
    the columns not planned are read from the store, and the planned ones are written back.
    """

    def __init__(self):
        self.kv = KVStore()

    def begin(self, canvas) -> None:
        self.kv = KVStore()

    def new_block(self, rows: torch.Tensor) -> None:
        """``rows`` [B] bool entered a new block."""

    def keep(self, keep: torch.Tensor) -> None:
        """Drop finished rows: ``keep`` [n] bool over the rows of the last forward."""
        self.kv = self.kv.select(keep.nonzero().squeeze(1))

    def plan(self, canvas, block: torch.Tensor, act: torch.Tensor) -> torch.Tensor | None:
        """Columns [n, R] to compute for the working rows ``act`` [n]; ``block`` [B] is every row's block."""
        raise NotImplementedError
