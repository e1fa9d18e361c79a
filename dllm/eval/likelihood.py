"""Likelihoods of a masked diffusion model: the Monte-Carlo estimate lm-eval's ``loglikelihood`` returns.

A masked diffusion model has no exact ``log p(y | x)``; the harnesses of LLaDA, Dream and dllm return a
Monte-Carlo estimate of its evidence lower bound (ELBO). :func:`mc_loglikelihood` is LLaDA's estimator
(arXiv:2502.09992, Appendix B.5; ML-GSAI/LLaDA ``get_log_likelihood.py``, the same math in
``eval_llada.py``), step for step:

- the sequence ``[prefix; target]`` is repeated ``batch_size`` times; only target tokens are masked;
- each of ``mc_num // batch_size`` iterations draws one integer ``k ~ U{1..T}`` (T = target length), spreads
  the number of masked tokens over the batch rows as the stratified grid
  ``round(linspace(k, k + (b-1) T/b, b))`` wrapped into ``1..T``, and masks that many target positions per
  row, chosen by a random permutation; ``p_mask = masked / T``;
- the iteration's loss is the cross-entropy of the masked tokens divided by their row's ``p_mask`` (the
  1/t weighting), summed and divided by ``batch_size``; with ``cfg > 0`` the logits are
  ``un + (cfg + 1)(cond - un)`` where ``un`` is the same batch with the prefix masked (one forward of
  both, as the official code concatenates them);
- the result is minus the mean of the iterations' losses.

Random draws. The official function draws ``k`` with ``torch.randint`` and each row's permutation with
``torch.randperm`` from torch's global generator, in that order. Here they come from a
``torch.Generator`` on the CPU seeded with ``seed``, in the same order with the same calls, so that
``torch.manual_seed(seed)`` followed by the official function draws exactly the same masks (the parity
test, ``tests/test_eval_likelihood.py``, relies on it). Each request gets a fresh generator with the same
seed, so a request's estimate does not depend on which requests ran before it, on their order or on how
they were split across processes, and the candidates of a multiple-choice question of equal length are
scored with the same masks (common random numbers, which lowers the variance of their comparison).
The official code draws ``k`` on the model's device (on CUDA, from the CUDA generator); ours are always
CPU draws, moved to the device.

Families. LLaDA: as above. Dream: the same estimator through Dream's aligned logits (its adapter reads the
prediction of column i from the hidden state of column i - 1, the shifted read-out Dream is trained
with); Dream's own harness uses a different (Bernoulli, antithetic-t) forward process. SDAR
(block-causal): the same masks, but each target block is predicted from its own noisy copy and the clean
earlier blocks, under the block-diffusion training mask (BD3-LM;
:func:`dllm.models.training.block_diffusion_logits`), which is what SDAR's decoding sees; the sum over
blocks of their masked diffusion ELBOs is what the estimate's expectation equals (a uniformly random
subset of the target restricted to one block is a uniformly random subset of that block, and for a block
holding n target positions the weight of m masked ones averages to the block's own: sum over l of
P(m | l) / l = 1 / m).

A quirk kept for parity: ``torch.round`` rounds halves to even, so when ``r T / b`` ends in .5 the count of
row r is not exactly uniform over ``1..T`` (T = 3, b = 2: row 1 masks 2, 1, 1 tokens for k = 1, 2, 3).

Differences from the official code: the cross-entropy is computed in float32 whatever the model's dtype
(the official code uses the logits' dtype, bfloat16 on its GPUs); ``mc_num`` must be a multiple of
``batch_size`` (the official function silently drops the remainder); CFG is refused on block-causal
models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm.core.errors import ConfigError
from dllm.core.params import check_value
from dllm.models.training import block_diffusion_logits


def forward_process(prefix_len: int, target_len: int, batch_size: int, generator: torch.Generator):
    """LLaDA's forward process: which columns of ``[prefix; target]`` are masked (bool ``[b, P+T]``) and
    each row's mask ratio (float ``[b]``), drawn from ``generator`` in the official order."""
    b, t = batch_size, target_len
    k = torch.randint(1, t + 1, (), generator=generator)
    x = torch.round(torch.linspace(float(k), k + (b - 1) * (t / b), steps=b)).long()
    x = ((x - 1) % t) + 1
    indices = torch.arange(t).repeat(b, 1)
    is_mask = indices < x.unsqueeze(1)
    for i in range(b):
        is_mask[i] = is_mask[i][torch.randperm(t, generator=generator)]
    is_mask = torch.cat((torch.zeros(b, prefix_len, dtype=torch.bool), is_mask), dim=1)
    return is_mask, x / t


def _logits(model, tokens: torch.Tensor, clean: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
    """Aligned logits [b, L, V] of ``tokens`` (all real, no padding). Block-causal models: the logits of the
    noisy ``tokens`` given the ``clean`` earlier blocks (block-diffusion mask), for the columns from
    ``start`` on (``start`` at a block boundary; earlier columns are prefix blocks nothing noisy attends to)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    if model.attention.block_causal:
        return block_diffusion_logits(model, tokens, clean, positions, torch.ones_like(tokens, dtype=torch.bool), start)
    return model.logits(tokens, positions)


def check_settings(model, mc_num: int, batch_size: int, cfg: float) -> None:
    for key, value in (("mc_num", mc_num), ("mc_batch_size", batch_size)):
        check_value(key, value, int, ">= 1")
    check_value("cfg", cfg, float, ">= 0")
    if mc_num % batch_size:
        raise ConfigError(
            f"mc_num={mc_num} is not a multiple of mc_batch_size={batch_size} (the Monte-Carlo samples are drawn "
            f"in batches of mc_batch_size); use e.g. mc_num={-(-mc_num // batch_size) * batch_size}"
        )
    if cfg > 0 and model.attention.block_causal:
        raise ConfigError("cfg (unsupervised classifier-free guidance) is only defined for full-attention models")


@torch.inference_mode()
def mc_loglikelihood(
    model,
    prefix: list[int],
    target: list[int],
    *,
    mc_num: int = 128,
    batch_size: int = 16,
    cfg: float = 0.0,
    seed: int = 0,
) -> float:
    """Monte-Carlo ELBO estimate of ``log p(target | prefix)`` (LLaDA's estimator; see the module docstring).

    prefix, target: token ids (the target non-empty). mc_num: masked samples in all; batch_size: samples
    per forward (also the stratification of the mask counts); cfg: unsupervised classifier-free guidance
    scale (0: none); seed: the random masks (``torch.manual_seed(seed)`` + the official function draw the
    same ones).
    """
    check_settings(model, mc_num, batch_size, cfg)
    if not target:
        raise ConfigError("the continuation to score is empty (no tokens)")
    device = model.device
    p, t = len(prefix), len(target)
    seq = torch.tensor([list(prefix) + list(target)], dtype=torch.long, device=device).repeat(batch_size, 1)
    start = 0
    if model.attention.block_causal:
        start = p - p % model.block_size
    generator = torch.Generator().manual_seed(int(seed))
    losses = []
    for _ in range(mc_num // batch_size):
        is_mask, ratio = forward_process(p, t, batch_size, generator)
        is_mask, ratio = is_mask.to(device), ratio.to(device)
        noisy = seq.masked_fill(is_mask, model.mask_id)
        if cfg > 0:
            uncond = noisy.clone()
            uncond[:, :p] = model.mask_id
            both = _logits(model, torch.cat([noisy, uncond]))
            cond, un = torch.chunk(both, 2, dim=0)
            logits = un + (cfg + 1) * (cond - un)
        else:
            logits = _logits(model, noisy, seq, start)
        mask = is_mask[:, start:]
        weights = ratio[:, None].expand_as(mask)[mask]
        ce = F.cross_entropy(logits[mask].float(), seq[:, start:][mask], reduction="none") / weights
        losses.append((ce.sum() / batch_size).item())
    return -sum(losses) / len(losses)


@torch.inference_mode()
def is_greedy(model, prefix: list[int], target: list[int]) -> bool:
    """Whether greedy decoding reconstructs ``target`` after ``prefix`` (lm-eval's ``is_greedy``): LLaDA's
    ``suffix_greedy_prediction`` (``eval_llada.py``): the target span starts fully masked; each forward
    commits the one masked token whose argmax has the highest probability (ties: the leftmost); after
    ``len(target)`` forwards the span is compared with the target. Block-causal models commit inside the
    earliest block that still holds a mask, as their decoding does."""
    device = model.device
    p, t = len(prefix), len(target)
    seq = torch.tensor([list(prefix) + [model.mask_id] * t], dtype=torch.long, device=device)
    positions = torch.arange(p + t, device=device)[None]
    for _ in range(t):
        masked = seq[0] == model.mask_id
        if model.attention.block_causal:
            first = int(masked.nonzero()[0]) // model.block_size
            masked &= torch.arange(p + t, device=device) // model.block_size == first
        columns = masked.nonzero()[:, 0]
        logits = model.logits(seq, positions)[0, columns].float()
        probs = torch.softmax(logits, -1)
        confidence, token = probs.max(-1)
        pick = int(torch.argmax(confidence))
        seq[0, columns[pick]] = token[pick]
    return seq[0, p:].tolist() == list(target)
