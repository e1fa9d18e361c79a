"""How autoregressive a run's decoding order is: its ARness (:class:`Order`).

A commit is *left to right* when it fills its row's leftmost masked slot, or runs on from it without a gap in the
same step (every masked slot to its left is filled in that step too). A row's ARness is the share of its commits
(masks filled) that are left to right: 1 for a left-to-right decoder whatever its parallelism, lower the more it
fills slots further right first. With one commit per step it is Global-ARness@1 (Gong et al., "DiffuCoder",
arXiv 2506.20639: the share of steps whose decoded token is the leftmost mask), the figure the NAP paper (arXiv
2602.23225) reports for LLaDA (0.73) and Dream (0.92) under confidence decoding.
"""

from __future__ import annotations

import torch


class Order:
    """Counts, per row of ``canvas``, the masks each step fills and those filled left to right (on the canvas's
    device: no host read)."""

    def __init__(self, canvas, mask_id: int):
        self.canvas, self.mask_id = canvas, mask_id
        b, device = canvas.batch, canvas.tokens.device
        self.filled = torch.zeros(b, dtype=torch.long, device=device)
        self.in_order = torch.zeros(b, dtype=torch.long, device=device)
        self.columns = torch.arange(canvas.length, device=device)

    def before(self) -> torch.Tensor:
        """bool [B, L]: the masked slots before a step."""
        return self.canvas.tokens == self.mask_id

    def after(self, masked: torch.Tensor) -> None:
        """Count the step that ran since :meth:`before` returned ``masked``."""
        still = self.canvas.tokens == self.mask_id
        filled = masked & ~still
        left = masked & still  # the first of these bounds the run from the leftmost mask
        first = torch.where(left.any(1), left.long().argmax(1), self.canvas.length)
        self.filled += filled.sum(1)
        self.in_order += (filled & (self.columns < first[:, None])).sum(1)

    def arness(self) -> list[float | None]:
        """Per row: the share of its filled masks filled left to right (None: it filled none)."""
        return [None if n == 0 else k / n for k, n in zip(self.in_order.tolist(), self.filled.tolist())]
