"""SDAR's reference block decoding: ``block_diffusion_generate`` of JetAstra/SDAR ``generate.py``
(Cheng et al. 2025, "SDAR: A Synergistic Diffusion-AutoRegression Paradigm", arXiv 2510.06303)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.kernels.reference import top_k_filter, top_p_filter
from dllm.samplers.base import Sampler
from dllm.samplers.confidence import top_k_per_row

STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential")


@dataclasses.dataclass(frozen=True)
class SDAR(Sampler):
    """SDAR's reference block decoding, ``block_diffusion_generate`` of JetAstra/SDAR ``generate.py``.

    One block of ``block_size`` positions at a time on a block-causal model, with the finished blocks'
    K/V reused (exact, since attention is causal across blocks).

    Each block takes ``steps_per_block`` steps (the official ``denoising_steps``); step i may commit
    ``n_i`` tokens, ``block_size`` split evenly with the remainder first.
    remasking_strategy: ``"low_confidence_static"`` commits the ``n_i`` most confident;
        ``"low_confidence_dynamic"`` commits every candidate above ``confidence_threshold`` when there are
        at least ``n_i`` of them, else the ``n_i`` most confident; ``"sequential"`` the first ``n_i`` masks.
    top_k, top_p: filters before sampling (0 and 1.0 disable them, as in the official script).
    Temperature 0 is greedy: the argmax token, scored by its softmax probability. (The official code
    always samples; its greedy setting ``top_k=1`` makes every confidence 1.0, which we do not copy.)
    Fixed reference bugs: ``n_i`` is capped by the masks left, so decoded tokens are never overwritten
    (the official top-k then picks already-decoded slots and resamples them), and the mask token is
    never proposed (the official code can sample it and then crash with an IndexError).
    Defaults as the official script: dynamic, threshold 0.85, block size of the checkpoint (4).
    """

    name: ClassVar[str] = "sdar"
    remasking_strategy: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.85
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.remasking_strategy not in STRATEGIES:
            raise ConfigError(f"remasking_strategy must be one of {STRATEGIES}, got {self.remasking_strategy!r}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ConfigError(f"confidence_threshold must lie in [0, 1], got {self.confidence_threshold}")

    def check_model(self, model):
        if model.attention != "block":
            raise ConfigError(
                f"the 'sdar' sampler needs a block-causal model (SDAR); this {model.family} model has "
                f"{model.attention} attention. Use 'llada', 'threshold' or 'dream' instead"
            )

    def quota(self, ctx):
        bs, steps = ctx.canvas.block_size, ctx.steps_per_block
        i = ctx.step.clamp(max=steps - 1)
        return bs // steps + (i < bs % steps).long()

    def propose(self, logits, row_of, ctx):
        t = ctx.temperature
        if t > 0 and t != 1.0:
            logits = logits / t
        logits = top_p_filter(top_k_filter(logits, self.top_k, float("-inf")), self.top_p, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if t == 0:
            confidence, token = probs.max(-1)
            return token, confidence
        token = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        for r in row_of.unique().tolist():
            sel = (row_of == r).nonzero().squeeze(1)
            token[sel] = torch.multinomial(probs[sel], 1, generator=ctx.rng.generator(r)).squeeze(1)
        return token, probs.gather(-1, token[:, None]).squeeze(-1)

    def select(self, ctx, confidence, proposed):
        k = ctx.state["quota"]
        if self.remasking_strategy == "sequential":
            order = ctx.candidates.long().cumsum(1)
            return ctx.candidates & (order <= k[:, None])
        top = top_k_per_row(confidence, k)
        if self.remasking_strategy == "low_confidence_static":
            return top
        above = (confidence > self.confidence_threshold) & ctx.candidates
        enough = above.sum(1) >= k
        return torch.where(enough[:, None], above, top)
