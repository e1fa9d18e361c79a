"""Reference semantics of the per-step "score the logits" work, in plain PyTorch.

:func:`score` is the one seam between a forward and a sampler's decision: it turns the logits of the
scored slots ([N, V], after the logit transforms) into a proposed token and the per-slot statistics the
sampler asks for. The fused kernels compute the same; these functions define what "the same" means.
"""

from __future__ import annotations

import dataclasses

import torch

from dllm.core.errors import ConfigError
from dllm.core.rng import Counters

# Statistics a sampler may ask for (besides the proposed token, which is always computed).
STATS = ("prob", "top1", "argmax", "margin", "logit_margin", "entropy")
ENTROPY_EPS = 1e-10  # Dream's ``sample_tokens``: entropy = -sum p log(p + 1e-10)


WARPS = ("temper", "top_k", "top_p")  # the sampling warps, applied in ``ScoreSpec.order``


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """What :func:`score` computes. Every field has a default that means "off".

    need: statistics to compute (a subset of :data:`STATS`); the others stay None.
    temperature: of the proposal: 0 takes the argmax, > 0 samples by Gumbel-max from the draws of the
        ``counters`` (LLaDA's ``add_gumbel_noise``; the statistics stay those of the unperturbed logits).
    dtype: of the probabilities (None: the logits' dtype; the Fast-dLLM rules use float64).
    exclude: token ids whose probability the statistics treat as zero (their logits set to -inf before
        the softmax) while they may still be proposed: LLaDA's ``confidence_eos_eot_inf``.
    suppress: token ids never proposed: their logits become -inf before anything else (LLaDA's
        ``logits_eos_inf``). The loop applies them with the mask id before its logit transforms too.
    temper, top_k, top_p: the sampling warps, applied after ``suppress`` and the ``logit_margin`` statistic,
        before the proposal and the other statistics (which are then those of the warped distribution, as in
        Dream's ``sample_tokens``): the logits divided by ``temper`` (1: off; Dream's, SDAR's and S2D2's
        temperature, in the logits' dtype), the ``top_k`` largest kept (None or 0: off; ties with the k-th
        kept), the nucleus of probability ``top_p`` kept (None or >= 1: off); filtered logits become ``fill``.
    order: the order of the three warps (Dream: temper, top_p, top_k; SDAR and S2D2: temper, top_k, top_p).
    Warps that are off, ``fill`` and ``order`` are normalised (``top_k`` 0 and ``top_p`` >= 1 become None,
    ``fill`` -inf without a filter, ``order`` the warps that are on, in their order, then the others in the
    default order), so that specs computing the same compare equal and a backend sees the defaults where
    nothing depends on them.
    """

    need: frozenset[str] = frozenset({"prob"})
    temperature: float = 0.0
    dtype: torch.dtype | None = None
    exclude: tuple[int, ...] = ()
    suppress: tuple[int, ...] = ()
    temper: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    fill: float = float("-inf")
    order: tuple[str, ...] = WARPS

    def __post_init__(self):
        unknown = set(self.need) - set(STATS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; known: {', '.join(STATS)}")
        if sorted(self.order) != sorted(WARPS):
            raise ConfigError(f"ScoreSpec.order must order {WARPS} (each once), got {self.order!r}")
        if not self.temper > 0 or self.temper == float("inf"):
            raise ConfigError(f"ScoreSpec.temper must be a finite number > 0 (1: off), got {self.temper!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise ConfigError(f"ScoreSpec.top_k must be None or an integer (0: off), got {self.top_k!r}")
        if self.top_p is not None and not self.top_p >= 0:
            raise ConfigError(f"ScoreSpec.top_p must be None or a number >= 0 (>= 1: off), got {self.top_p!r}")
        on = self.warps
        if "top_k" not in on:
            object.__setattr__(self, "top_k", None)
        if "top_p" not in on:
            object.__setattr__(self, "top_p", None)
        object.__setattr__(self, "order", (*on, *(w for w in WARPS if w not in on)))
        if not {"top_k", "top_p"} & set(on):
            object.__setattr__(self, "fill", float("-inf"))

    def merged(self, need) -> ScoreSpec:
        return dataclasses.replace(self, need=frozenset(self.need) | frozenset(need))

    @property
    def warps(self) -> tuple[str, ...]:
        """The warps that are on, in their order."""
        on = {
            "temper": self.temper != 1.0,
            "top_k": bool(self.top_k) and self.top_k > 0,
            "top_p": self.top_p is not None and self.top_p < 1.0,
        }
        return tuple(w for w in self.order if on[w])


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


SCORE_FIELDS = tuple(field.name for field in dataclasses.fields(Scores))  # (traceable: no dataclasses.fields)


def score(logits: torch.Tensor, spec: ScoreSpec, counters: Counters | None = None) -> Scores:
    """Proposed token and the statistics ``spec.need`` of each row of ``logits`` [N, V] (or [..., V]).

    In order: ``spec.suppress`` ids to -inf; ``logit_margin`` (before the warps); the warps
    (:func:`warp`); the proposal (Gumbel-max at ``spec.temperature`` with the draws of ``counters``, one
    slot per row, required when ``spec.temperature > 0``); the statistics of the warped logits. Ties go to
    the lowest token id (``argmax``).
    """
    need = spec.need
    logits = suppress(logits, spec.suppress)
    margin = logit_margin(logits) if "logit_margin" in need else None
    logits = warp(logits, spec)
    uniform = None
    if spec.temperature > 0:
        if counters is None:
            raise ValueError("sampling at temperature > 0 needs the random-number counters")
        uniform = counters.uniform(logits.shape[-1]).reshape(logits.shape)
    token = gumbel_argmax(logits, spec.temperature, uniform)
    out = Scores(token=token, logit_margin=margin)
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


def suppress(logits: torch.Tensor, ids) -> torch.Tensor:
    """``logits`` with the columns ``ids`` at -inf (a copy; the input when there are none)."""
    if not ids:
        return logits
    logits = logits.clone()
    logits[..., list(ids)] = float("-inf")
    return logits


def warp(logits: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    """The sampling warps of ``spec`` applied to ``logits`` [..., V] in ``spec.order`` (see :class:`ScoreSpec`):
    the distribution the proposal is drawn from and the statistics describe."""
    for name in spec.warps:
        if name == "temper":
            tempered = logits / spec.temper
            if spec.temper > torch.finfo(logits.dtype).max:  # -inf / inf would be NaN: -inf stays -inf
                tempered = tempered.masked_fill(logits == float("-inf"), float("-inf"))
            logits = tempered
        elif name == "top_k":
            logits = top_k_filter(logits, spec.top_k, spec.fill)
        else:
            logits = top_p_filter(logits, spec.top_p, spec.fill)
    return logits


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
    return ranks_per_row(score) < k[:, None]


def ranks_per_row(score: torch.Tensor) -> torch.Tensor:
    """long [B, L]: each column's place in its row by descending ``score`` (0: the highest; ties: the leftmost
    first, a stable sort)."""
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(
        1, order, torch.arange(score.shape[1], device=score.device).expand_as(order)
    )


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
