"""The noise levels of a training batch, shared by the masked and the uniform-state objectives."""

from __future__ import annotations

import torch


def noise_levels(count: int, eps: float, generator: torch.Generator) -> torch.Tensor:
    """``count`` noise levels t ~ U(eps, 1), stratified (one per slice of [0, 1), in random order: MDLM's
    low-discrepancy sampler)."""
    u = (torch.arange(count) + torch.rand(count, generator=generator))[torch.randperm(count, generator=generator)]
    return eps + (1 - eps) * (u / count)
