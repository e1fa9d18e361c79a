"""EB-Sampler: entropy-bounded unmasking (Ben-Hamu, Gat, Severo, Nolte, Karrer; FAIR at Meta; "Accelerated Sampling
from Masked Diffusion Models via Entropy Bounded Unmasking", arXiv 2505.24857, NeurIPS 2025)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.params import hp
from dllm.kernels.reference import ScoreSpec
from dllm.samplers.base import Sampler

ERROR_PROXIES = ("entropy", "confidence", "margin")
_STATISTIC = {"entropy": "entropy", "confidence": "prob", "margin": "margin"}


@dataclasses.dataclass(frozen=True)
class EB(Sampler):
    """EB-Sampler (arXiv 2505.24857): commit the largest prefix of the error-proxy order whose entropy sum, less its
    largest entropy, stays within ``gamma``.

    At each step, per row, the masked slots of the current block are sorted by an error proxy, most certain first
    (``error_proxy``: ``"entropy"`` ascending, ``"confidence"`` = the proposal's probability descending,
    ``"margin"`` = top-1 minus top-2 probability descending: the paper's three proxies), and the longest prefix U
    of that order with ``sum_{i in U} H_i - max_{i in U} H_i <= gamma`` is committed (non-strict; the left side
    bounds the mutual information among the committed tokens), always at least the first slot. H_i is the entropy
    (nats) of slot i's predicted distribution, the mask token excluded (the loop never proposes it). In the
    entropy order the left side is the sum of the entropies before each slot, so ``gamma = 0`` commits one token
    per step unless some slots have an entropy of exactly 0 (certain predictions: the bound lets them through
    together, with the next slot); ``gamma = inf`` commits the whole block at once. The number of steps depends on
    the data: ``steps`` / ``steps_per_block`` are not used (``fixed_steps = False``). The proposals are the argmax
    at temperature 0; at T > 0 they are sampled from ``softmax(logits / T)`` and the entropies and orderings are those
    of that tempered distribution (as the transformers / diffusers EntropyBound samplers and d2Cache's EB rule
    measure them).

    Public implementation matched: SGLang ``python/sglang/srt/dllm/algorithm/eb_sampling.py`` (``EBSampling``,
    sgl-project/sglang@38c8d9bc, and the later ``step`` form with the same rule): per block, mask logit suppressed,
    argmax proposal, entropy of ``log_softmax``, ``argsort`` ascending, rank 0 always and rank k >= 1 iff the
    cumulative sum of ranks < k is ``<= gamma``; ``gamma`` from ``algorithm_config``, default 0.15, ``>= 0``.
    Defaults here: ``gamma=0.15`` (SGLang's; the file at sglang@43aaa1c, without the mask suppression, defaults to
    0.0; d2Cache's ``eb_sampler.yaml`` uses 0.001, DiffusionGemma's ``entropy_bound`` is 0.1),
    ``error_proxy="entropy"`` (SGLang's and the transformers sampler's order), block 32 (the loop's default; SGLang
    takes its served model's block size).

    Differences from SGLang's: batched and vectorised per row (no Python loop over rows, no host read-back); exact
    entropy ties go to the leftmost slot (a stable sort; ``torch.argsort`` leaves their order unspecified); the
    entropy is the scoring seam's ``-sum p log(p + 1e-10)`` in float32 (SGLang: ``-sum p log p`` from
    ``log_softmax`` in the logits' dtype; they differ by at most V * 1e-10 nats); the prefix is cumulative (the
    first slot over the bound stops it; the same as SGLang's per-rank test while entropies are >= 0); temperature
    and the confidence / margin orders are the paper's options, which SGLang's greedy entropy rule does not have
    (for them the bound is the paper's sum less the largest entropy of the prefix, not the sum before the slot);
    the forward of a block sees what the model family's geometry shows it (full attention: the later, masked
    blocks too, as LLaDA's semi-autoregressive sampler; block-causal SDAR: its prefix, SGLang's serving layout) and
    every cache of the loop applies; SGLang's extra forward after a block's last commit (writing its K/V) is not
    made or counted.

    No fused rule of kernel B (:mod:`dllm.kernels.selection`) applies: those rules compare one statistic, the
    proposal's probability, with thresholds or a quota; this one sorts the block's candidates by a proxy and
    compares a running sum of their entropies with the bound, so the sampler implements ``select``.
    """

    name: ClassVar[str] = "eb"
    on_device: ClassVar[bool] = True
    fixed_steps: ClassVar[bool] = False
    gamma: float = hp(
        0.15, "[0, inf]", note="nats; 0: one token per step (certain slots aside), inf: a whole block per step"
    )
    error_proxy: str = hp("entropy", choices=ERROR_PROXIES)

    def score_spec(self, run):
        need = frozenset({"entropy", _STATISTIC[self.error_proxy]})
        if run.temperature > 0:  # proposals and statistics of softmax(logits / T)
            return ScoreSpec(need=need, temperature=1.0, temper=run.temperature, dtype=torch.float32)
        return ScoreSpec(need=need, dtype=torch.float32)

    def select(self, step, state):
        scores = step.scores
        proxy = -scores.entropy if self.error_proxy == "entropy" else getattr(scores, _STATISTIC[self.error_proxy])
        return entropy_bounded(scores.entropy, proxy, step.committable, self.gamma)


def entropy_bounded(
    entropy: torch.Tensor, proxy: torch.Tensor, committable: torch.Tensor, gamma: float
) -> torch.Tensor:
    """bool [B, L]: the slots the entropy bound commits. ``entropy`` [B, L] (nats), ``proxy`` [B, L] (higher: more
    certain, committed first; ties to the leftmost column), ``committable`` bool [B, L] the candidates (others are
    ignored, whatever their values). Per row: the candidates in ``proxy`` order, the longest prefix whose entropy
    sum less its largest entropy is ``<= gamma``, at least one (none in a row without candidates). No host
    synchronisation."""
    order = torch.sort(proxy.masked_fill(~committable, float("-inf")), dim=1, descending=True, stable=True).indices
    h = entropy.masked_fill(~committable, 0.0).gather(1, order)  # the candidates first, in proxy order
    before = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1].cumsum(1)], 1)  # the sum of the earlier entropies
    bound = before + (h - h.cummax(1).values)  # sum - max of each prefix (exactly ``before`` in entropy order)
    rank = torch.arange(h.shape[1], device=h.device)
    within = (bound <= gamma) | (rank == 0)
    count = within.long().cummin(1).values.sum(1)  # the prefix up to the first rank over the bound
    ranks = torch.empty_like(order).scatter_(1, order, rank.expand_as(order))
    return (ranks < count[:, None]) & committable
