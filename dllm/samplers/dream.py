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
    """Dream's reference sampler, ``diffusion_generate`` of its HF ``generation_utils.py``.

    Time grid ``t = linspace(1, eps, steps + 1)``; at step i with t = t_i, s = t_{i+1} a fraction
    ``1 - s/t`` of the remaining masks is committed (all at the last step).

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
            # Each mask is committed with probability 1 - s/t. Drawn before the forward (the forward uses no
            # randomness, so the stream is the official one) to skip forwards that would commit nothing.
            candidates = ctx.candidates
            row_of = candidates.nonzero()[:, 0]
            chosen = torch.zeros_like(candidates)
            chosen[candidates] = ctx.rng.rand(row_of, ()) < self._fraction(ctx)[row_of]
            ctx.state["origin"] = chosen
            return chosen.sum(1)
        masks = ctx.candidates.sum(1).to(torch.float32)
        last = ctx.step >= ctx.steps_per_block - 1
        quota = torch.where(last, masks, masks * self._fraction(ctx)).long()
        if ctx.temperature > 0 and not bool((quota > 0).any()):
            self._skip_token_draws(ctx)
        return quota

    def _skip_token_draws(self, ctx) -> None:
        """The loop skips a step where no row commits anything (e.g. the first step when steps ==
        max_new_tokens), but the official sampler still draws a token for every mask there. Advance each
        row's stream by the same draws, so a row's samples equal the official ones under
        ``torch.manual_seed(seed)`` (one prompt) and never depend on the other rows."""
        for r, n in enumerate(ctx.candidates.sum(1).tolist()):
            if n:
                uniform = torch.ones(n, ctx.model.vocab_size, dtype=ctx.model.dtype, device=ctx.candidates.device)
                torch.multinomial(uniform, 1, generator=ctx.rng.generator(r))

    def propose(self, logits, row_of, ctx):
        if ctx.temperature > 0:
            logits = logits / ctx.temperature
        fill = torch.finfo(logits.dtype).min
        logits = top_k_filter(top_p_filter(logits, self.top_p, fill), self.top_k, fill)
        probs = torch.softmax(logits, dim=-1)
        confidence, token = probs.max(-1)
        if ctx.temperature > 0:
            # origin draws tokens only for the masks it reveals now, as the official code does
            draw = ctx.state["origin"][ctx.candidates] if self.alg == "origin" else None
            for r in row_of.unique().tolist():
                sel = (row_of == r) if draw is None else (row_of == r) & draw
                sel = sel.nonzero().squeeze(1)
                if sel.numel():
                    token[sel] = torch.multinomial(probs[sel], 1, generator=ctx.rng.generator(r)).squeeze(1)
            confidence = probs.gather(-1, token[:, None]).squeeze(-1)
        if self.alg == "topk_margin":
            confidence = margin(probs)
        elif self.alg == "entropy":
            confidence = negative_entropy(probs)
        return token, confidence

    def select(self, ctx, confidence, proposed):
        candidates = ctx.candidates
        if self.alg == "origin":
            return ctx.state["origin"]
        k = ctx.state["quota"]
        if not self.alg_temp:
            return top_k_per_row(confidence, k)
        fill = torch.zeros_like(candidates)
        weights = torch.softmax(confidence / self.alg_temp, dim=-1)
        for r in (k > 0).nonzero().squeeze(1).tolist():
            # Draw over the row's own columns (left padding excluded): the draws then do not depend on the
            # batch's padding, and a lone prompt draws over its whole row exactly like the official code.
            cols = ctx.canvas.valid[r].nonzero().squeeze(1)
            picks = torch.multinomial(weights[r, cols], int(k[r]), generator=ctx.rng.generator(r))
            fill[r, cols[picks]] = True
        return fill
