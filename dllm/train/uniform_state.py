"""Uniform-state block diffusion: the training objective of DiffusionGemma's canvases (``--family diffusion_gemma``).

DiffusionGemma has no mask token: its decoding (:mod:`dllm.engine.renoise`) starts each canvas from uniform random ids,
keeps the slots the entropy bound accepts and renoises the rest with fresh uniform ids, every forward conditioned on
the previous one's logits. The objective teaches exactly that denoiser (uniform-state discrete diffusion, D3PM's
uniform transition; research/diffusion_gemma.md §2, §4):

- the response is cut into canvases of the model's ``canvas_length`` (its ``block_size``); each canvas of each row
  gets its own noise level t ~ U(eps, 1) (stratified over the batch, as the masked objectives' levels), and each of
  its slots is replaced with probability t by an id drawn uniformly from the whole vocabulary (as decoding's noise);
- the decoder reads every noisy canvas in one forward, each canvas seeing the causal encoder's K/V of the prompt and
  the clean canvases before it (:meth:`~dllm.models.diffusion_gemma.DiffusionGemma.canvases_logits`), as decoding
  sees the finished ones;
- **every** slot is predicted: the cross-entropy to its clean token, noised or not (a uniform-state model cannot tell
  which slots are noise: it must judge every one), averaged over the response slots;
- **self-conditioning** (Analog Bits' recipe, which DiffusionGemma's decoder input is built for): half of the rows
  first run the same noisy canvases without it, without gradient, and the second pass is conditioned on that
  prediction's soft embedding; the other half are conditioned on nothing (zeros: a canvas's first step). The first
  pass's logits are divided by a temperature drawn from the sampler's schedule, U(``t_min``, ``t_max``), because
  decoding conditions each step on the tempered logits of the step before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm.core.errors import ConfigError
from dllm.train.levels import noise_levels


def uniform_state_loss(model, tokens, valid, prompt_len: int, cfg, generator: torch.Generator) -> torch.Tensor:
    """The uniform-state loss of one batch (the module docstring); the response is everything after ``prompt_len``,
    a whole number of canvases (:class:`dllm.train.Data` rounds it up)."""
    from dllm.samplers.diffusion_gemma import EntropyBound

    n, length = tokens.shape
    width, vocab = model.block_size, model.vocab_size
    span = length - prompt_len
    if span % width:
        raise ConfigError(f"the response ({span} columns) must be a whole number of canvases of {width}")
    canvases = span // width
    t = noise_levels(n * canvases, cfg.eps, generator).view(n, canvases).repeat_interleave(width, 1)
    noised = torch.rand(n, span, generator=generator) < t
    noise = torch.randint(0, vocab, (n, span), generator=generator)
    conditioned = torch.rand(n, generator=generator) < 0.5
    schedule = EntropyBound()
    temperature = schedule.t_min + (schedule.t_max - schedule.t_min) * torch.rand(n, generator=generator)
    device = tokens.device
    response = tokens[:, prompt_len:]
    noisy = torch.where(noised.to(device), noise.to(device), response)
    conditioning = None
    rows = conditioned.nonzero().squeeze(1).to(device)
    if rows.numel():
        with torch.no_grad():
            first = model.canvases_logits(tokens[rows], noisy[rows], valid[rows], prompt_len)
            soft = model.soft_embedding(first / temperature.to(device)[rows, None, None])
        conditioning = soft.new_zeros(n, span, soft.shape[-1]).index_copy(0, rows, soft)
    logits = model.canvases_logits(tokens, noisy, valid, prompt_len, conditioning)
    scored = valid[:, prompt_len:]
    return F.cross_entropy(logits[scored].float(), response[scored])
