"""The forwards the families are trained with, which their likelihoods read too.

- :func:`block_diffusion_logits`: a block-causal model (SDAR, Fast-dLLM v2) learns each noisy block from its own
  noisy copy and the clean earlier blocks (BD3-LM's training mask over ``[noisy ; clean]``), which is what its decoding
  sees; the Monte-Carlo likelihood of such a model reads the same forward (:mod:`dllm.eval.likelihood`).
- :func:`causal_outputs` and :func:`next_token_cross_entropy`: the causal next-token objective (the autoregressive
  warm start of Dream and WeDLM, WeDLM's auxiliary AR loss): column i - 1's output predicts token i.

The training objectives built on them live in :mod:`dllm.train`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_diffusion_logits(model, noisy, clean, positions, valid, start: int = 0) -> torch.Tensor:
    """Logits of the noisy half of ``[noisy ; clean]`` under BD3-LM's mask (SDAR training), for the columns
    from ``start`` on. Noisy columns before ``start`` are left out of the input: when they are whole clean
    blocks before the response (the prompt's), no noisy query after them attends to them, so the result is
    the same and the step a third cheaper. A shifted model's column reads the output before it (see below)."""
    n, length = clean.shape
    noisy, noisy_valid = noisy[:, start:], valid[:, start:]
    span = noisy.shape[1]
    block = positions // model.block_size
    q_block = torch.cat([block[:, start:], block], 1)[:, :, None]
    k_block = torch.cat([block[:, start:], block], 1)[:, None, :]
    noisy_half = torch.arange(span + length, device=noisy.device) < span
    q_noisy, k_noisy = noisy_half[None, :, None], noisy_half[None, None, :]
    allowed = (q_noisy & k_noisy & (k_block == q_block)) | (q_noisy & ~k_noisy & (k_block < q_block))
    allowed |= ~q_noisy & ~k_noisy & (k_block <= q_block)
    allowed &= torch.cat([noisy_valid, valid], 1)[:, None, :]
    allowed |= torch.eye(span + length, dtype=torch.bool, device=noisy.device)[None]  # pad rows attend to themselves
    ids = torch.cat([noisy, clean], 1)
    hidden = model.hidden(ids, torch.cat([positions[:, start:], positions], 1), mask=allowed[:, None])
    if not model.shift:
        return model.project(hidden.states[:, :span])
    # A shifted model (Fast-dLLM v2) reads column i from the output at i - 1: the noisy copy's inside a block, the
    # clean copy's for a block's first column, whose previous column ends a finished block (as its decoding reads it)
    columns = torch.arange(start, length, device=noisy.device).expand(n, -1)
    source = (columns - model.shift).clamp(min=0)
    inside = (source >= start) & (block.gather(1, source) == block[:, start:])
    index = torch.where(inside, source - start, span + source)
    return model.project(hidden.states.gather(1, index[..., None].expand(-1, -1, hidden.states.shape[-1])))


def causal_outputs(model, tokens, valid) -> torch.Tensor:
    """The network's raw outputs [B, L, V] under a causal mask: column i sees columns <= i only."""
    length = tokens.shape[1]
    positions = model.positions(valid)
    causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()[None, None]
    padding = model.attention_mask(positions, valid, None)  # pad keys out, pad rows attend to themselves
    mask = causal if padding is None else padding & causal
    return model.project(model.hidden(tokens, positions, mask=mask).states)


def next_token_cross_entropy(outputs, tokens, valid, prompt_len: int) -> torch.Tensor:
    """Mean cross-entropy of each response token (column >= ``prompt_len``) given the ``outputs`` [B, L, V] one
    column before it; padding (not ``valid``) is no target."""
    logits = outputs[:, prompt_len - 1 : -1]
    targets = tokens[:, prompt_len:].masked_fill(~valid[:, prompt_len:], -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
