"""ETE, explore-then-exploit decoding (arXiv 2511.21103): EXPERIMENTAL, reconstructed from the abstract."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches import require_needed
from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.kernels.reference import ScoreSpec, top_k_per_row
from dllm.samplers.base import Sampler

TRIGGERS = ("stall", "always")
SELECTORS = ("max_entropy", "leftmost_uncertain")


@dataclasses.dataclass(frozen=True)
class ETE(Sampler):
    """Explore-then-exploit (arXiv 2511.21103): cross-block thresholding plus high-entropy tokens.

    From "From Bits to Rounds": threshold decoding across blocks, plus a few high-entropy tokens committed
    when the confident ones run out.

    EXPERIMENTAL: there is no public code and the paper body was not available; this is our reconstruction
    from the abstract (its claims: confidence-only decoding reveals little information per round; ETE combines
    *cross-block decoding* with *targeted exploration of high-uncertainty tokens* whose resolution triggers
    cascades of confident predictions). Every hyper-parameter name and default below is ours.

    Each step, on the float64 softmax probabilities (as ``threshold``) and entropies of the proposals:
    1. exploit: commit every masked slot with probability >= ``threshold`` in the current block and in the
       next ``lookahead_blocks`` blocks (cross-block decoding; the loop's ``commit_span`` seam);
    2. explore: when fewer than ``min_exploit`` slots of the *current block* pass (``explore_trigger=
       "stall"``) or at every step (``"always"``), also commit up to ``explore_k`` other masked slots of the
       current block: the highest-entropy ones (``explore_select="max_entropy"``) or the leftmost ones
       (``"leftmost_uncertain"``), stopping before their summed entropy would exceed ``explore_budget``
       nats (None: no cap); an explored slot gets its proposal (the argmax, or the sample at T > 0);
    3. if the current block got no commit, its most confident slot commits (Fast-dLLM's progress rule).
    With ``explore_k=0, lookahead_blocks=0`` this is ``threshold`` token for token.

    Defaults: threshold 0.9, explore_k 1, explore_trigger "stall", min_exploit 1, explore_select
    "max_entropy", explore_budget None, lookahead_blocks 1. Cross-block commits need the look-ahead columns
    scored at every step: ``lookahead_blocks > 0`` runs with the caches that compute them (``prefix``,
    ``dual``, ``dkv``: their masked look-ahead columns are computed, not stored, at every forward; a column
    committed ahead keeps the K/V stored before its commit until the cache's next refresh), not with
    ``window`` / ``elastic``, and not on block-causal models (SDAR decodes its blocks in order); exploration
    alone works everywhere.
    """

    name: ClassVar[str] = "ete"
    fixed_steps: ClassVar[bool] = False
    experimental: ClassVar[bool] = True
    threshold: float = hp(0.9, "[0, 1]")
    explore_k: int = hp(1, ">= 0")
    explore_trigger: str = hp("stall", choices=TRIGGERS)
    min_exploit: int = hp(1, ">= 0")
    explore_select: str = hp("max_entropy", choices=SELECTORS)
    explore_budget: float | None = hp(None, "[0, inf]", note="nats; None or inf: no cap")
    lookahead_blocks: int = hp(1, ">= 0")

    def check_model(self, model):
        if self.lookahead_blocks and model.attention.block_causal:
            raise ConfigError(
                f"ete's cross-block decoding (lookahead_blocks={self.lookahead_blocks}) would commit into later "
                f"blocks of a block-causal {model.family} model, which decodes its blocks in order: pass "
                "lookahead_blocks=0 (exploration still applies)"
            )

    def check_cache(self, model, cache):
        if self.lookahead_blocks:
            require_needed(
                cache,
                f"ete's cross-block decoding (lookahead_blocks={self.lookahead_blocks}) scores and commits "
                "the columns after the current block at every step",
                model,
            )

    def observe(self, step, state):
        canvas = step.canvas  # look-ahead blocks past the canvas add no column: clip the window to it
        return step.window(min(canvas.block_size * (1 + self.lookahead_blocks), canvas.length))

    def score_spec(self, run):
        need = {"prob", "entropy"} if self.explore_k else {"prob"}
        return ScoreSpec(need=frozenset(need), temperature=run.temperature, dtype=torch.float64)

    def commit_span(self, step, state):
        if not self.lookahead_blocks:
            return None
        blocks = min(self.lookahead_blocks, step.canvas.length)  # blocks past the canvas add no column
        ahead_end = step.end + step.canvas.block_size * blocks
        return (step.columns >= step.end[:, None]) & (step.columns < ahead_end[:, None])

    def select(self, step, state):
        current = step.committable
        prob = step.scores.prob
        span = current
        if self.lookahead_blocks:
            span = current | (self.commit_span(step, state) & step.masked & ~step.done[:, None])
        exploit = span & (prob >= self.threshold)
        commit = exploit
        rows = current.shape[0]
        if self.explore_k:
            passed = (exploit & current).sum(1)
            fire = (
                passed < self.min_exploit
                if self.explore_trigger == "stall"
                else torch.ones_like(passed, dtype=torch.bool)
            )
            open_ = current & ~exploit
            if self.explore_select == "max_entropy":
                key = step.scores.entropy.masked_fill(~open_, float("-inf"))
            else:  # leftmost: a decreasing key over the columns
                key = (-step.columns.to(torch.float64)).expand(rows, -1).masked_fill(~open_, float("-inf"))
            k = torch.minimum(open_.sum(1), torch.full_like(passed, self.explore_k)) * fire
            chosen = top_k_per_row(key, k)
            if self.explore_budget is not None:
                order = torch.sort(key, dim=1, descending=True, stable=True)
                spent = torch.where(chosen.gather(1, order.indices), step.scores.entropy.gather(1, order.indices), 0.0)
                within = torch.zeros_like(chosen).scatter_(1, order.indices, spent.cumsum(1) <= self.explore_budget)
                chosen &= within
            commit = commit | chosen
        best = top_k_per_row(step.among_committable(prob), torch.ones(rows, dtype=torch.long, device=prob.device))
        return commit | (best & ~(commit & current).any(1, keepdim=True))
