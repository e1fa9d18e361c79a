"""Reference semantics of kernel B: which slots a step commits, and the write-back, in plain PyTorch.

A :class:`Rule` is one of the confidence rules of ``caches_kernels.md`` §10.4 that the samplers use, as a
function of dense tensors (the loop's ``step.scores.prob`` and ``step.committable``), so that a fused kernel
(:mod:`dllm.kernels.triton_select`) can compute the same on the device:

- ``"top_k"``: the ``quota[b]`` most confident committable slots, ties to the leftmost column (LLaDA's
  ``get_num_transfer_tokens`` schedule; :class:`dllm.samplers.confidence.LLaDA`);
- ``"threshold"``: every committable slot with confidence ``>= threshold`` (``> threshold`` with ``strict``, as
  SGLang's and the vLLM dllm-plugin's), and always the most confident one (Fast-dLLM, arXiv 2505.22618, Alg. 1;
  :class:`dllm.samplers.confidence.Threshold`); with ``quota_floor``, always the ``quota[b]`` most confident
  instead (LLaDA2's hybrid acceptance: the slots above the threshold when there are at least ``quota`` of them,
  else the ``quota`` most confident, which is the same set; :class:`dllm.samplers.llada2.LLaDA2`);
- ``"factor"``: the longest prefix of the sorted confidences whose i-th entry (1-based, i >= 2) is
  ``>= 1 - factor / (i + 1)``, at least one; the official scan's quirk (the whole block when only the last entry
  fails) unless ``strict_prefix`` (Fast-dLLM ``get_transfer_index_dynamic``; :class:`~dllm.samplers.confidence.Factor`);
- ``"anchored_threshold"``: a threshold relaxed near anchors: slots within ``radius`` columns of an anchor
  (confidence ``>= threshold``) need only ``relaxed``, the others ``threshold``; always the most confident. The
  per-slot thresholds pass through a float32 tensor (LocalLeap, arXiv 2510.07081,
  :class:`dllm.samplers.localleap.LocalLeap`, computes them so: reproduced).

Every rule's commit is restricted to the committable slots; ``finish`` rows commit all of theirs (the loop's last
step of a capped block). :func:`write_back` writes the proposals of the committed slots into the canvas in place
and returns the per-row counts, with no host synchronisation.
"""

from __future__ import annotations

import dataclasses

import torch

from dllm.kernels.reference import top_k_per_row

RULES = ("top_k", "threshold", "factor", "anchored_threshold")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A selection rule (see the module docstring). threshold: the threshold rules' (the anchors' for
    ``anchored_threshold``); strict: ``>`` instead of ``>=``; factor / strict_prefix: the factor rule's; relaxed /
    radius: ``anchored_threshold``'s threshold near an anchor and its reach in columns; quota_floor: the threshold
    rule commits the ``quota`` most confident, not only the best. ``top_k`` (and ``quota_floor``) read the per-row
    ``quota``."""

    kind: str
    threshold: float | torch.Tensor = 0.9  # (a tensor [B]: each row's, generate(hyper_parameters=[...]))
    strict: bool = False
    factor: float | torch.Tensor = 1.0  # (a tensor [B]: each row's)
    strict_prefix: bool = False
    relaxed: float = 0.75
    radius: int = 4
    quota_floor: bool = False

    def __post_init__(self):
        if self.kind not in RULES:
            raise ValueError(f"unknown selection rule {self.kind!r}; known: {', '.join(RULES)}")
        if self.quota_floor and self.kind != "threshold":
            raise ValueError(f"quota_floor is an option of the threshold rule, not of {self.kind!r}")


def select(
    rule: Rule,
    confidence: torch.Tensor,
    committable: torch.Tensor,
    quota: torch.Tensor | None = None,
    finish: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [B, L]: the committable slots ``rule`` commits, from ``confidence`` [B, L] (any float dtype; ignored
    outside ``committable``), ``quota`` [B] (``top_k``) and ``finish`` [B] (rows that commit all they can)."""
    among = confidence.masked_fill(~committable, float("-inf"))
    if (rule.kind == "top_k" or rule.quota_floor) and quota is None:
        raise ValueError(f"the {rule.kind} rule{' with quota_floor' * rule.quota_floor} needs the per-row quota")
    if rule.kind == "top_k":
        commit = top_k_per_row(among, quota)
    elif rule.kind == "factor":
        commit = top_k_per_row(among, factor_count(among, committable.sum(1), rule.factor, rule.strict_prefix))
    else:
        floor = quota if rule.quota_floor else torch.ones(among.shape[0], dtype=torch.long, device=among.device)
        best = top_k_per_row(among, floor)
        threshold = _per_row(rule.threshold, among.dtype)
        if rule.kind == "threshold":
            need = threshold
        else:  # anchored_threshold: the per-slot thresholds of a float32 tensor
            near = dilate(among >= threshold, rule.radius)
            need = torch.where(near, rule.relaxed, threshold)
        commit = ((among > need) if rule.strict else (among >= need)) | best
    commit = commit & committable
    if finish is not None:
        commit = commit | (committable & finish[:, None])
    return commit


def factor_count(among: torch.Tensor, counts: torch.Tensor, factor: float, strict_prefix: bool) -> torch.Tensor:
    """[B] slots the factor rule commits per row, from the confidences ``among`` [B, L] (-inf where not
    committable) and the number of committable slots ``counts`` [B]: sort them, find the first entry below
    ``1 - factor / (i + 1)``."""
    ordered = torch.sort(among, dim=1, descending=True).values
    i = torch.arange(among.shape[1], device=among.device)
    need = (1 - _per_row(factor, ordered.dtype) / (i + 2).to(ordered.dtype)).expand(ordered.shape).clone()
    need[:, 0] = -1.0
    ok = (ordered >= need) | (i[None, :] >= counts[:, None])  # positions past the candidates pass
    first_fail = torch.where(ok.all(1), counts, (~ok).long().argmax(1))
    k = first_fail.clamp(min=1)
    if not strict_prefix:
        k = torch.where(first_fail == counts - 1, counts, k)
    return k


def _per_row(value, dtype):
    """A rule's number, or each row's ([B] -> [B, 1], to broadcast over the columns)."""
    return value.to(dtype)[:, None] if isinstance(value, torch.Tensor) else value


def dilate(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """bool [B, L]: columns within ``radius`` (inclusive) of a True column of ``mask`` [B, L], per row."""
    radius = min(radius, mask.shape[1])  # a wider radius reaches no further column
    if radius == 0:
        return mask
    width = 2 * radius + 1
    pooled = torch.nn.functional.max_pool1d(mask[:, None].float(), width, stride=1, padding=radius)
    return pooled[:, 0] > 0


def write_back(tokens: torch.Tensor, proposals: torch.Tensor, commit: torch.Tensor) -> torch.Tensor:
    """Write ``proposals`` [B, L] into ``tokens`` [B, L] (in place) where ``commit``; returns the per-row counts [B]."""
    tokens.copy_(torch.where(commit, proposals, tokens))
    return commit.sum(1)


def select_and_commit(
    rule: Rule,
    confidence: torch.Tensor,
    committable: torch.Tensor,
    proposals: torch.Tensor,
    tokens: torch.Tensor,
    quota: torch.Tensor | None = None,
    finish: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select`, then :func:`write_back`: returns (commit bool [B, L], counts [B]); ``tokens`` is updated."""
    commit = select(rule, confidence, committable, quota, finish)
    return commit, write_back(tokens, proposals, commit)
