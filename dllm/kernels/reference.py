"""Reference semantics of the per-step "score the logits" work, in plain PyTorch.

These functions define what the fused kernels must compute; samplers call them on the logits of the
candidate slots only ([N, V]).
"""

from __future__ import annotations

import torch


def gumbel_argmax(logits: torch.Tensor, temperature: float, uniform: torch.Tensor | None) -> torch.Tensor:
    """Token ids [N]: argmax of ``exp(l) / (-log u) ** T`` in float64 (LLaDA's ``add_gumbel_noise``).

    That is Gumbel-max sampling from ``softmax(l / T)``; float64 because low-precision Gumbel noise
    hurts quality (LLaDA ``generate.py``, citing arXiv 2409.02908). ``temperature == 0`` is argmax.
    ``uniform``: float64 draws in [0, 1) shaped like ``logits`` (required when temperature > 0).
    """
    if temperature == 0:
        return logits.argmax(-1)
    noisy = logits.to(torch.float64).exp() / (-torch.log(uniform)) ** temperature
    return noisy.argmax(-1)


def token_probability(logits: torch.Tensor, token: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax(logits)[token] per row, computed in ``dtype`` (default: the logits' dtype)."""
    probs = torch.softmax(logits if dtype is None else logits.to(dtype), dim=-1)
    return probs.gather(-1, token[:, None]).squeeze(-1)


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


def margin(probs: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 probability per row."""
    top2 = torch.topk(probs, 2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def negative_entropy(probs: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """sum p log(p + eps) per row (higher = more confident), as in Dream's ``sample_tokens``."""
    return (probs * torch.log(probs + eps)).sum(-1)
