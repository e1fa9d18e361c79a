"""SDAR's reference block decoding: ``block_diffusion_generate`` of JetAstra/SDAR ``generate.py``
(Cheng et al. 2025, "SDAR: A Synergistic Diffusion-AutoRegression Paradigm", arXiv 2510.06303)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.kernels.reference import ScoreSpec, top_k_per_row
from dllm.kernels.selection import Rule
from dllm.samplers.base import Sampler

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
    on_device: ClassVar[bool] = True
    remasking_strategy: str = hp("low_confidence_dynamic", choices=STRATEGIES)
    confidence_threshold: float = hp(0.85, "[0, 1]")
    top_k: int = hp(0, ">= 0", note="0: off")
    top_p: float = hp(1.0, "[0, 1]", note="1.0: off")

    def check_model(self, model):
        if not model.attention.block_causal:
            raise ConfigError(
                f"the {self.name!r} sampler needs a block-causal model (SDAR); this {model.family} model has "
                f"{model.attention} attention. Use 'llada', 'threshold' or 'dream' instead"
            )

    def quota(self, step, state):
        bs, steps = step.canvas.block_size, step.run.steps_per_block
        i = step.step.clamp(max=steps - 1)
        return bs // steps + (i < bs % steps).long()

    def score_spec(self, run):
        # temperature, top-k, top-p, then the tempered, filtered distribution is sampled as is: Gumbel-max at
        # temperature 1
        t = run.temperature
        return ScoreSpec(
            need=frozenset({"prob"}),
            temperature=1.0 if t > 0 else 0.0,
            temper=t if t > 0 else 1.0,
            top_k=self.top_k,
            top_p=self.top_p,
            order=("temper", "top_k", "top_p"),
        )

    def select(self, step, state):
        k = step.quota
        committable = step.committable
        if self.remasking_strategy == "sequential":
            order = committable.long().cumsum(1)
            return committable & (order <= k[:, None])
        confidence = step.among_committable(step.scores.prob)
        top = top_k_per_row(confidence, k)
        if self.remasking_strategy == "low_confidence_static":
            return top
        above = (confidence > self.confidence_threshold) & committable
        enough = above.sum(1) >= k
        return torch.where(enough[:, None], above, top)

    def selection(self, step, state):
        return Rule("top_k") if self.remasking_strategy == "low_confidence_static" else None
