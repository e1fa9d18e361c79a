"""Dream's reference sampler: ``diffusion_generate`` of the Dream HF ``generation_utils.py``
(Ye et al. 2025, "Dream 7B", arXiv 2508.15487)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.kernels.reference import margin, negative_entropy, top_k_filter, top_p_filter
from dllm.samplers.base import Sampler
from dllm.samplers.confidence import top_k_per_row

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclasses.dataclass(frozen=True)
class Dream(Sampler):
    """Dream ``diffusion_generate``: time grid ``t = linspace(1, eps, steps + 1)``; at step i with
    t = t_i, s = t_{i+1} a fraction ``1 - s/t`` of the remaining masks is committed (all at the last step).

    alg: ``"origin"`` commits each mask independently with probability 1 - s/t (random order);
        ``"maskgit_plus"`` / ``"topk_margin"`` / ``"entropy"`` commit the ``int(masks * (1 - s/t))``
        most confident (probability, top-1 minus top-2 probability, negative entropy).
    alg_temp: > 0 samples the positions from ``softmax(confidence / alg_temp)`` instead of top-k.
    top_p, top_k: filters applied after the temperature, before the softmax (the confidences come
        from the filtered distribution, as in the official ``sample_tokens``).
    eps: the time grid's end point (1e-3).
    Defaults: ``alg="entropy"``, ``alg_temp=0`` as in Dream's evaluation (``eval/eval.py``); the
    official ``DreamGenerationConfig`` default is ``"origin"``, which its README says may degrade quality.
    The whole generation is one block by default, as in the official sampler. The official code counts
    masks as the batch average; here each row uses its own count, which is the same for the equal-length
    spans of a batch and keeps rows independent.
    """

    name: ClassVar[str] = "dream"
    default_block: ClassVar[int | None] = None
    alg: str = "entropy"
    alg_temp: float | None = 0.0
    eps: float = 1e-3
    top_p: float | None = None
    top_k: int | None = None

    def __post_init__(self):
        if self.alg not in ALGORITHMS:
            raise ConfigError(f"alg must be one of {ALGORITHMS}, got {self.alg!r}")
        if not 0 < self.eps < 1:
            raise ConfigError(f"eps must lie in (0, 1), got {self.eps}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")

    def _fraction(self, ctx) -> torch.Tensor:
        """1 - s/t per row for the current step (float32, as the official linspace), 1 at the last step."""
        grid = torch.linspace(1, self.eps, ctx.steps_per_block + 1, device=ctx.step.device)
        i = ctx.step.clamp(max=ctx.steps_per_block - 1)
        frac = 1 - grid[i + 1] / grid[i]
        return torch.where(i == ctx.steps_per_block - 1, torch.ones_like(frac), frac)

    def quota(self, ctx):
        if self.alg == "origin":
            return None
        masks = ctx.candidates.sum(1).to(torch.float32)
        last = ctx.step >= ctx.steps_per_block - 1
        return torch.where(last, masks, masks * self._fraction(ctx)).long()

    def propose(self, logits, row_of, ctx):
        if ctx.temperature > 0:
            logits = logits / ctx.temperature
        fill = torch.finfo(logits.dtype).min
        logits = top_k_filter(top_p_filter(logits, self.top_p, fill), self.top_k, fill)
        probs = torch.softmax(logits, dim=-1)
        if ctx.temperature > 0:
            token = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
            for r in row_of.unique().tolist():
                sel = (row_of == r).nonzero().squeeze(1)
                token[sel] = torch.multinomial(probs[sel], 1, generator=ctx.rng.generator(r)).squeeze(1)
            confidence = probs.gather(-1, token[:, None]).squeeze(-1)
        else:
            confidence, token = probs.max(-1)
        if self.alg == "topk_margin":
            confidence = margin(probs)
        elif self.alg == "entropy":
            confidence = negative_entropy(probs)
        return token, confidence

    def select(self, ctx, confidence, proposed):
        candidates = ctx.candidates
        if self.alg == "origin":
            row_of = candidates.nonzero()[:, 0]
            p = self._fraction(ctx)[row_of]
            fill = torch.zeros_like(candidates)
            fill[candidates] = ctx.rng.rand(row_of, ()) < p
            return fill
        k = ctx.state["quota"]
        if not self.alg_temp:
            return top_k_per_row(confidence, k)
        fill = torch.zeros_like(candidates)
        weights = torch.softmax(confidence / self.alg_temp, dim=-1)
        for r in (k > 0).nonzero().squeeze(1).tolist():
            picks = torch.multinomial(weights[r], int(k[r]), generator=ctx.rng.generator(r))
            fill[r, picks] = True
        return fill
