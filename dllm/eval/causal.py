"""The exact log-likelihood of a causal-attention diffusion model (WeDLM), which lm-eval's ``loglikelihood`` returns.

A WeDLM model predicts a mask from the observed tokens physically before it (arXiv 2512.22737, §4; its
streaming decoder with a one-slot window commits exactly one token per forward, left to right). So
``log p(target | prefix) = sum_i log p(target_i | prefix, target_<i)`` is exact, each factor read at a mask
placed after ``prefix + target_<i`` at the logical position of ``target_i``: no Monte-Carlo ELBO as for the
masked-diffusion families (:mod:`dllm.eval.likelihood`). All T factors come from one forward of
``[prefix | target | T masks]`` (WeDLM's dual-stream layout with blocks of one: the clean stream is causal; mask
i, at position ``len(prefix) + i``, sees the clean columns before ``target_i`` and itself). The same forward gives
lm-eval's ``is_greedy``: every target token is the argmax at its mask.

This is the likelihood of the model's own decoding head. WeDLM's checkpoints are also trained with an auxiliary
autoregressive loss (``finetune/src/loss.py::compute_ar_loss``: the clean stream's column i predicts token
i + 1), a second exact likelihood that this module does not use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm.core.errors import ConfigError


@torch.inference_mode()
def causal_loglikelihood(model, prefix: list[int], target: list[int]) -> tuple[float, bool]:
    """``(log p(target | prefix), is_greedy)`` of a causal-attention model, exact (see the module docstring)."""
    if not model.attention.exact_likelihood:
        raise ConfigError(f"the exact causal likelihood needs a causal-attention model, not {model.attention}")
    if not target:
        raise ConfigError("the continuation to score is empty (no tokens)")
    device = model.device
    p, t = len(prefix), len(target)
    tokens = torch.tensor([list(prefix) + list(target) + [model.mask_id] * t], dtype=torch.long, device=device)
    clean = torch.arange(p + t, device=device)
    positions = torch.cat([clean, p + torch.arange(t, device=device)])[None]
    length = p + 2 * t
    cols = torch.arange(length, device=device)
    allowed = (cols[None, :] <= cols[:, None]) & (cols[None, :] < p + t)  # the clean stream, causal
    query = torch.arange(t, device=device)
    allowed[p + t + query] = cols[None, :] < (p + query)[:, None]  # mask i: the clean columns before target_i
    allowed[p + t + query, p + t + query] = True  # and itself
    hidden = model.hidden(tokens, positions, mask=allowed[None, None])
    logits = model.head(hidden, (p + t + query)[None])[0].float()
    expected = torch.tensor(list(target), device=device)
    ll = -F.cross_entropy(logits, expected, reduction="sum").item()
    return ll, bool((logits.argmax(-1) == expected).all())
