"""Per-row random streams: row r of a batch draws from a generator seeded by (seed, r), so a row's
samples do not depend on how many other rows share its batch or how many draws they make."""

from __future__ import annotations

import torch


class RowRNG:
    def __init__(self, seed: int | None, rows: int, device: torch.device):
        if seed is None:  # follow torch's global seed, so torch.manual_seed still makes runs repeatable
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = int(seed)
        self.generators = []
        for r in range(rows):
            g = torch.Generator(device=device)
            # Row 0 uses the seed itself, so a single prompt reproduces torch.manual_seed(seed) streams.
            g.manual_seed((self.seed + r * 1_000_003) % 2**63)
            self.generators.append(g)

    def rand(self, row_of: torch.Tensor, tail: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
        """Uniform [0, 1) draws of shape [N, *tail]; entry n comes from the stream of row ``row_of[n]``."""
        out = torch.empty((row_of.shape[0], *tail), dtype=dtype, device=row_of.device)
        for r in row_of.unique().tolist():
            sel = (row_of == r).nonzero().squeeze(1)
            out[sel] = torch.rand(
                (sel.shape[0], *tail), generator=self.generators[r], dtype=dtype, device=row_of.device
            )
        return out

    def generator(self, row: int) -> torch.Generator:
        return self.generators[row]
