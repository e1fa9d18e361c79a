"""CreditDecoding: trace credits fused into the logits, then a confidence threshold (arXiv 2510.06133).

The official rule is inclusionAI/dInfer's ``CreditThresholdParallelDecoder``
(``python/dinfer/decoding/parallel_strategy.py``, commit fce4e32). Per block, each row keeps a float32
credit ``C`` over (block slot, vocabulary). At every forward:

1. ``C *= decay_beta``, except at the block's first forward;
2. at every still-masked slot, ``p1 ** boost_gamma`` is added at the raw top-1 token ``v1``, where ``p1`` is
   the top-1 probability of the float32 softmax of the (incoming) logits;
3. fused logits ``l + credit_alpha * log(C + 1)`` replace the logits.

The credit is a :class:`CreditFusion` logit transform, so it composes in front of any rule
(``dllm.samplers.get("llada").with_transforms(CreditFusion())``, or by name
``dllm.samplers.get("credit_fusion", base="llada")``); :class:`Credit` is the official pairing with dInfer's
threshold rule.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.params import hp, same_as
from dllm.kernels.reference import ScoreSpec
from dllm.samplers.base import Sampler
from dllm.samplers.transforms import Transform


@dataclasses.dataclass
class CreditState:
    """One generation's credit, per batch row and slot of its current block.

    credit: float32 [B, W, V] (W = the canvas block size), or [B, W, K] with ``credit_top_k = K``;
    tokens: long [B, W, K] the token of each top-K entry (-1: empty), None for the full credit;
    forwards: [B] forwards of the row in its current block (the first one does not decay);
    iteration: [B] the loop step whose forward last updated the row (a second scoring of the same forward,
    e.g. an early exit's fill, reuses the credit without updating it again).
    """

    credit: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    forwards: torch.Tensor | None = None
    iteration: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class CreditFusion(Transform):
    """CreditDecoding's credit fusion as a logit transform (dInfer ``_apply_credit_fusion``).

    Credit lives per row and block slot and is reset when the row enters a block; the columns of the current
    block are fused, other scored columns pass through unchanged (their credit is zero). The output is
    float32 (as dInfer's ``logits + alpha * log(C + 1)`` promotes it).

    credit_alpha: fusion strength α (0.7). boost_gamma: power γ of the top-1 probability added (0.2).
    decay_beta: per-forward decay β (0.8). credit_top_k (ours, not in dInfer): keep only K (token, credit)
    entries per slot instead of the whole vocabulary (memory [B, block, K] instead of [B, block, V]); a new
    top-1 token replaces the entry with the least credit. Exact whenever a slot sees at most K distinct
    top-1 tokens in its block, so ``K >= block_size`` equals the full credit.
    Over a base whose spec warps the sampling distribution (Dream's, SDAR's temperature, top-k, top-p), the
    credit is fused into the model's logits and the warps apply after it (dInfer has no such warps; the fused
    logits are what its decoders sample from). Suppressed ids are -inf before the fusion.
    """

    name: ClassVar[str] = "credit_fusion"
    default_base: ClassVar[str] = "threshold"
    credit_alpha: float = hp(0.7, ">= 0", note="dInfer's default")
    boost_gamma: float = hp(0.2, ">= 0", note="dInfer's default")
    decay_beta: float = hp(0.8, "[0, 1]", note="a decay; dInfer's default")
    credit_top_k: int | None = hp(None, ">= 1", note="None: the full vocabulary")

    def compose(self, base: Sampler) -> Sampler:
        return base.with_transforms(self)

    def settings(self) -> dict:
        return dataclasses.asdict(self)

    def init_state(self, run):
        b, device = run.canvas.batch, run.canvas.tokens.device
        state = CreditState(
            forwards=torch.zeros(b, dtype=torch.long, device=device),
            iteration=torch.full((b,), -1, dtype=torch.long, device=device),
        )
        self._allocate(state, b, run.canvas.block_size, run.model.vocab_size, device)  # (per row: rows may join)
        return state

    def begin_block(self, step, state, rows):
        state.forwards.masked_fill_(rows, 0)
        if state.credit is not None:
            state.credit.masked_fill_(rows[:, None, None], 0.0)
        if state.tokens is not None:
            state.tokens.masked_fill_(rows[:, None, None], -1)

    def _depth(self, vocab: int) -> int:
        return vocab if self.credit_top_k is None else min(self.credit_top_k, vocab)  # K >= V: every token fits

    def _allocate(self, state, b: int, width: int, vocab: int, device) -> None:
        depth = self._depth(vocab)
        state.credit = torch.zeros(b, width, depth, dtype=torch.float32, device=device)
        if self.credit_top_k is not None:
            state.tokens = torch.full((b, width, depth), -1, dtype=torch.long, device=device)

    def __call__(self, logits, rows, columns, step, state):
        n, k, vocab = logits.shape
        if state.credit is None or state.credit.shape[2] != self._depth(vocab):  # (a head wider than vocab_size)
            self._allocate(state, step.canvas.batch, step.canvas.block_size, vocab, logits.device)
        width = state.credit.shape[1]
        slot = columns - step.start.index_select(0, rows)[:, None]
        inside = (slot >= 0) & (slot < width) & (columns < step.end.index_select(0, rows)[:, None])
        slot = slot.clamp(0, width - 1)
        # Update once per forward and slot: the first scored copy of each block column of a fresh row.
        fresh = state.iteration.index_select(0, rows) != step.iteration  # [n]
        position = torch.arange(k, device=logits.device).expand(n, k)
        first = torch.full((n, width), k, dtype=torch.long, device=logits.device)
        first.scatter_reduce_(1, slot, position.masked_fill(~inside, k), "amin")
        unique = inside & (first.gather(1, slot) == position)
        masked = step.masked[rows[:, None], columns]
        boost = unique & masked & fresh[:, None]
        # 1. decay (not at a row's first forward in its block)
        decay = fresh & (state.forwards.index_select(0, rows) > 0)
        factor = torch.ones(state.credit.shape[0], dtype=torch.float32, device=logits.device)
        factor[rows] = torch.where(decay, self.decay_beta, 1.0)
        state.credit.mul_(factor[:, None, None])
        # 2. the raw top-1 token of each masked slot earns p1 ** gamma
        top1, argmax = torch.softmax(logits.to(torch.float32), dim=-1).max(-1)
        earned = top1.pow(self.boost_gamma) * boost.to(torch.float32)
        row_index = rows[:, None].expand(n, k)
        if state.tokens is None:
            state.credit.index_put_((row_index, slot, argmax), earned, accumulate=True)
        else:
            self._boost_top_k(state, rows, slot, argmax, earned, boost)
        state.forwards[rows] += fresh.long()
        state.iteration[rows] = step.iteration
        # 3. fusion: l + alpha * log(C + 1) (zero credit adds exactly 0)
        credit = state.credit[row_index, slot].masked_fill(~inside[..., None], 0.0)  # [n, k, V or K]
        if state.tokens is None:
            return logits + self.credit_alpha * torch.log(credit + 1)
        tokens = state.tokens[row_index, slot]
        gain = (self.credit_alpha * torch.log(credit + 1)).masked_fill(tokens < 0, 0.0)
        return logits.to(torch.float32).scatter_add(-1, tokens.clamp(min=0), gain)

    @staticmethod
    def _boost_top_k(state, rows, slot, argmax, earned, boost) -> None:
        """Add ``earned`` at the entry of ``argmax`` (or, if absent, in place of the least-credit entry)."""
        n, width = rows.shape[0], state.credit.shape[1]
        dense = torch.zeros(n, width, dtype=torch.long, device=rows.device)
        hit = dense.scatter_add(1, slot, boost.long()) > 0  # at most one boosted copy per slot
        token = dense.scatter_add(1, slot, argmax * boost.long())
        gain = torch.zeros(n, width, dtype=torch.float32, device=rows.device).scatter_add(1, slot, earned)
        tokens, credit = state.tokens[rows], state.credit[rows]  # [n, W, K]
        match = tokens == token[..., None]
        present = match.any(-1)
        entry = torch.where(present, match.long().argmax(-1), credit.argmin(-1))[..., None]
        current = credit.gather(-1, entry).squeeze(-1)
        updated = torch.where(present, current, 0.0) + gain
        credit.scatter_(-1, entry, torch.where(hit, updated, current)[..., None])
        tokens.scatter_(-1, entry, torch.where(hit, token, tokens.gather(-1, entry).squeeze(-1))[..., None])
        state.credit[rows], state.tokens[rows] = credit, tokens


@dataclasses.dataclass(frozen=True)
class Credit(Sampler):
    """CreditDecoding (arXiv 2510.06133): trace credits fused into the logits, then a threshold rule.

    "CreditDecoding: Accelerating Parallel Decoding in Diffusion LLMs with Trace Credits", as realised by
    dInfer's ``CreditThresholdParallelDecoder`` (inclusionAI/dInfer fce4e32).

    Each forward fuses the block's logits with the accumulated credit (:class:`CreditFusion`), proposes the
    argmax of the fused logits (a Gumbel-max sample of them at temperature > 0) with its float32 softmax
    probability as confidence, and commits every masked slot of the block whose confidence is at least
    ``min(threshold, best - 1e-5)`` (dInfer's ``get_transfer_index_threshold``; the ``- 1e-5`` makes the best
    slot, and any slot within 1e-5 of it, commit when none reaches the threshold).

    Defaults are dInfer's: threshold 0.9 (its ``ThresholdParallelDecoder`` callers' common setting; dInfer
    has no default τ), credit_alpha 0.7, boost_gamma 0.2, decay_beta 0.8. The paper's tuned LLaDA setting,
    as read by third-party notes, is α 0.65, β 0.7, γ 0.2. ``credit_top_k`` (ours) keeps K credit entries
    per slot instead of the vocabulary (see :class:`CreditFusion`). With ``credit_alpha=0`` this is dInfer's
    plain ``ThresholdParallelDecoder``, which equals our ``threshold`` sampler except that the confidence is
    float32 (ours: float64) and near-ties within 1e-5 of the best slot also commit.

    Deliberate differences from dInfer:
    - batched with per-row blocks and credit (dInfer shares one block range across the batch);
    - the credit is reset whenever a row enters a block; dInfer keys it by ``(block_start, block_end)`` and
      clears it only when the whole canvas has no mask left, so a generation that stops early at EOS leaves
      credit behind that a later generation of the same prompt length reuses;
    - one forward per step: dInfer's ``BlockRunner`` unrolls up to ``maximum_unroll=4`` forwards between its
      mask checks (``expected_tpf=8``), spending forwards after a block completes that commit nothing;
      with ``maximum_unroll=1`` its forward count is ours, and the tokens are the same either way;
    - the mask token is never proposed (its logit is -inf before the fusion; dInfer adds credit to it if it is
      the raw top-1 and then skips slots proposing it).
    Blocks are laid out from the end of the prompt (dInfer's ``BlockIteratorFactory()`` default; its
    benchmark scripts pass ``start_block_align=True``, which aligns blocks to absolute positions).
    ``eos_early_stop=True`` is dInfer's ``early_stop=True``.
    """

    name: ClassVar[str] = "credit"
    fixed_steps: ClassVar[bool] = False
    threshold: float = hp(0.9, "[0, 1]")
    credit_alpha: float = same_as(CreditFusion, "credit_alpha")
    boost_gamma: float = same_as(CreditFusion, "boost_gamma")
    decay_beta: float = same_as(CreditFusion, "decay_beta")
    credit_top_k: int | None = same_as(CreditFusion, "credit_top_k")

    @property
    def fusion(self) -> CreditFusion:
        return CreditFusion(self.credit_alpha, self.boost_gamma, self.decay_beta, self.credit_top_k)

    def transforms(self, run):
        return (self.fusion,)

    def score_spec(self, run):
        return ScoreSpec(need=frozenset({"prob"}), temperature=run.temperature, dtype=torch.float32)

    def select(self, step, state):
        confidence = step.among_committable(step.scores.prob)
        bar = (confidence.max(1).values - 1e-5).clamp(-1000, self.threshold)
        return confidence >= bar[:, None]
