"""Reference semantics of the per-step "score the logits" work, in plain PyTorch.

:func:`score` is the one seam between a forward and a sampler's decision: it turns the logits of the
scored slots ([N, V], after the logit transforms) into a proposed token and the per-slot statistics the
sampler asks for. The fused kernels compute the same; these functions define what "the same" means.
"""

from __future__ import annotations

import dataclasses

import torch

# Statistics a sampler may ask for (besides the proposed token, which is always computed).
STATS = ("prob", "top1", "argmax", "margin", "logit_margin", "entropy")
ENTROPY_EPS = 1e-10  # Dream's ``sample_tokens``: entropy = -sum p log(p + 1e-10)


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """What :func:`score` computes.

    need: statistics to compute (a subset of :data:`STATS`); the others stay None.
    temperature: of the proposal: 0 takes the argmax, > 0 samples by Gumbel-max (``uniform`` required).
    dtype: of the probabilities (None: the logits' dtype; the Fast-dLLM rules use float64).
    exclude: token ids whose probability the statistics treat as zero (their logits set to -inf before
        the softmax) while they may still be proposed: LLaDA's ``confidence_eos_eot_inf``.
    """

    need: frozenset[str] = frozenset({"prob"})
    temperature: float = 0.0
    dtype: torch.dtype | None = None
    exclude: tuple[int, ...] = ()

    def __post_init__(self):
        unknown = set(self.need) - set(STATS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; known: {', '.join(STATS)}")

    def merged(self, need) -> ScoreSpec:
        return dataclasses.replace(self, need=frozenset(self.need) | frozenset(need))


@dataclasses.dataclass
class Scores:
    """Per-slot results of :func:`score` (each [N], or dense [B, L] once the loop has placed them).

    token: the proposal (argmax, or a Gumbel-max sample at temperature > 0).
    prob: softmax probability of ``token``; top1 / argmax: the highest probability and its token
    (``argmax`` equals ``token`` when greedy); margin: top-1 minus top-2 probability; logit_margin:
    top-1 minus top-2 logit (the loop takes it before the sampling transforms: temperature, top-p, top-k);
    entropy: ``-sum p log(p + 1e-10)`` in nats.
    """

    token: torch.Tensor
    prob: torch.Tensor | None = None
    top1: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    margin: torch.Tensor | None = None
    logit_margin: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def score(logits: torch.Tensor, spec: ScoreSpec, uniform: torch.Tensor | None = None) -> Scores:
    """Proposed token and the statistics ``spec.need`` of each row of ``logits`` [..., V].

    Ties go to the lowest token id (``argmax``). ``uniform``: float64 draws in [0, 1) shaped like
    ``logits``, required when ``spec.temperature > 0``.
    """
    need = spec.need
    token = gumbel_argmax(logits, spec.temperature, uniform)
    out = Scores(token=token)
    if "logit_margin" in need:
        out.logit_margin = logit_margin(logits)
    if not need & {"prob", "top1", "argmax", "margin", "entropy"}:
        return out
    x = logits if spec.dtype is None else logits.to(spec.dtype)
    if spec.exclude:
        x = x.clone()
        x[..., list(spec.exclude)] = float("-inf")
    probs = torch.softmax(x, dim=-1)
    if "prob" in need:
        out.prob = probs.gather(-1, token[..., None]).squeeze(-1)
    if need & {"top1", "argmax"}:
        out.argmax = token if spec.temperature == 0 else logits.argmax(-1)
        out.top1 = probs.gather(-1, out.argmax[..., None]).squeeze(-1)
    if "margin" in need:
        top2 = torch.topk(probs, 2, dim=-1).values
        out.margin = top2[..., 0] - top2[..., 1]
    if "entropy" in need:
        out.entropy = -(probs * torch.log(probs + ENTROPY_EPS)).sum(-1)
    return out


def logit_margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit of each row of ``logits`` [..., V] (Prophet's and SchED's gap)."""
    top2 = torch.topk(logits, 2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def gumbel_argmax(logits: torch.Tensor, temperature: float, uniform: torch.Tensor | None) -> torch.Tensor:
    """Token ids: argmax over the vocabulary of ``l - T * log(-log u)`` in float64.

    That is Gumbel-max sampling from ``softmax(l / T)``: LLaDA's ``add_gumbel_noise`` takes the argmax of
    ``exp(l) / (-log u) ** T`` in float64 (low-precision Gumbel noise hurts quality, LLaDA ``generate.py``
    citing arXiv 2409.02908); its logarithm is this, the same argmax, computed in the log domain so that no
    finite temperature underflows it to 0 / 0 (the official form proposes an arbitrary column, the mask token's
    included, once ``exp(l)`` or ``(-log u) ** T`` leaves float64's range, e.g. at T = 1e6). A logit of -inf
    stays -inf (kept so also where ``T * log(-log u)`` overflows), so such a column (the mask token's) is never
    proposed while any other is finite. ``temperature == 0`` is the argmax. ``uniform``: float64 draws in
    [0, 1) shaped like ``logits`` (required when temperature > 0). The fused kernels compute this formula.
    """
    if temperature == 0:
        return logits.argmax(-1)
    if uniform is None:
        raise ValueError("sampling at temperature > 0 needs uniform draws")
    x = logits.to(torch.float64)
    keys = (x - temperature * torch.log(-torch.log(uniform))).masked_fill(x == float("-inf"), float("-inf"))
    return keys.argmax(-1)


def gumbel_top_k(log_weights: torch.Tensor, k: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: ``k[b]`` columns of each row drawn without replacement with probabilities
    proportional to ``exp(log_weights)`` (Gumbel-top-k, the same law as successive ``multinomial`` draws
    without replacement); columns at -inf are never drawn while others remain."""
    keys = log_weights.to(torch.float64) - torch.log(-torch.log(uniform))
    return top_k_per_row(keys, k)


def top_k_per_row(score: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: the ``k[b]`` highest-scoring columns of each row (k may differ per row).

    Ties go to the leftmost column (a stable sort). ``torch.topk``, which the official samplers use, breaks
    ties arbitrarily and differently for different row lengths, which would make a prompt's output depend
    on the padding of its batch; without exact ties both choose the same columns. No host synchronisation.
    """
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(score.shape[1], device=score.device).expand_as(order)
    )
    return ranks < k[:, None]


def top_k_filter(logits: torch.Tensor, k: int | None, fill: float) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th kept), set the rest to ``fill``."""
    if not k or k <= 0:
        return logits
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, fill)


def top_p_filter(logits: torch.Tensor, p: float | None, fill: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest prefix of sorted tokens whose probability reaches ``p``
    (the first token always kept), set the rest to ``fill``."""
    if p is None or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    remove = cumulative > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, remove)
    return logits.masked_fill(mask, fill)
