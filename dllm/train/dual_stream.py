"""WeDLM's training objective: dual-stream masking with intra-block reordering (arXiv 2512.22737, §4.2; Tencent/WeDLM
@0216110 ``finetune/src/{masking,batch,loss}.py`` and ``trainer.py``).

Each row is fed twice, ``[clean | noisy]``, both streams at the same logical positions:

- the noisy stream is cut into blocks of ``block_size`` positions; each block draws its own mask ratio
  ``p ~ U(0, 1)`` (clamped to ``1e-8``) and masks ``round(p x candidates)`` of its response slots (prompt slots
  are never masked: the official SFT labels are -100 there), chosen at random; inside each block the observed
  tokens are moved before the masks, each keeping its position (``reorder_block``);
- attention (``build_2d_attention_mask``): the clean stream is causal; a noisy block sees the clean stream's
  earlier blocks and, causally, its own reordered block; the clean stream never sees the noisy one;
- loss: the cross-entropy of the masked slots (a mask predicts its own slot), weighted by ``1 / p`` normalised over
  the batch's masked slots (``compute_mlm_loss``, ``weighting_scheme="weighted"``), plus the auxiliary
  autoregressive loss of the clean stream on the response (column i predicts token i + 1;
  ``compute_ar_loss``), combined as ``(mlm + w ar) / (1 + w)`` with ``w = ar_loss_weight`` (1.0 in the official
  config).

So training sees what the streaming decoder sees: committed (clean) tokens before the window, observed tokens of
the window before its masks, and masks that see the masks physically before them.

Deliberate differences: rows are left-padded in a batch instead of packed (blocks count from each row's first
real position, as in the packed layout; pads are neither attended nor scored); the bundled model's recipe ends a
response at its EOS with the rest of the row as padding (``TrainConfig.eos_padding=False``), where the official
data appends 8 learnable end tokens (``num_learnable_im_end``) and the next packed sample follows, unattended;
the random draws come from one ``torch.Generator`` (the official code uses the global generator, one ``randperm``
per block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm.models.training import next_token_cross_entropy

MASK_EPS = 1e-8  # ``mask_eps`` of the official config: the smallest block mask ratio


def draw_masks(
    response: torch.Tensor, blocks: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which slots of each row are masked (bool [n, L]) and each slot's block mask ratio (float [n, L]).

    response: bool [n, L] the maskable slots; blocks: [n, L] each slot's block (-1 for pads, never maskable).
    Each (row, block) draws ``p ~ U(0, 1)`` and masks ``round(p x its maskable slots)`` of them at random."""
    n, length = response.shape
    nblocks = int(blocks.max()) + 1
    ratio = torch.rand(n, nblocks, generator=generator).clamp_min(MASK_EPS)
    order_keys = torch.rand(n, length, generator=generator)
    blk = blocks.clamp(min=0)
    candidates = torch.zeros(n, nblocks, dtype=torch.long).scatter_add_(1, blk, response.long())
    count = torch.round(candidates * ratio).long()
    # sort by block, maskable slots first in random order; a slot's rank inside its block decides
    key = blocks.double() * 2 + torch.where(response, order_keys.double(), 1.5)
    order = torch.argsort(key, dim=1)
    sorted_blocks = blocks.gather(1, order)
    first = torch.searchsorted(sorted_blocks, sorted_blocks, side="left")
    rank = torch.arange(length)[None, :] - first
    chosen = rank < count.gather(1, sorted_blocks.clamp(min=0))
    masked = torch.zeros_like(response).scatter_(1, order, chosen) & response
    return masked, ratio.gather(1, blk)


def dual_stream_logits(model, clean, noisy, masked, positions, valid, block_size: int):
    """Logits of ``[clean | noisy reordered]`` under WeDLM's 2-D mask: (clean-stream logits [n, L, V], noisy-stream
    logits [n, L, V] in the noisy stream's physical (reordered) order, that order [n, L])."""
    n, length = clean.shape
    device = clean.device
    blocks = torch.where(valid, positions // block_size, -1)
    cols = torch.arange(length, device=device)
    # inside each block: observed tokens first, then masks, each in column (= position) order; pads first
    order = torch.argsort(blocks * (2 * length) + masked.long() * length + cols, dim=1)
    noisy_r, pos_r, valid_r, blocks_r = (t.gather(1, order) for t in (noisy, positions, valid, blocks))
    q = torch.arange(2 * length, device=device)
    clean_q = (q < length)[None, :, None]
    clean_k = (q < length)[None, None, :]
    block_all = torch.cat([blocks, blocks_r], 1)
    block_q, block_k = block_all[:, :, None], block_all[:, None, :]
    causal = q[None, None, :] <= q[None, :, None]
    allowed = (
        (clean_q & clean_k & causal)  # the clean stream: causal
        | (~clean_q & clean_k & (block_k < block_q))  # a noisy block: the clean earlier blocks
        | (~clean_q & ~clean_k & (block_k == block_q) & causal)  # and its own reordered block, causally
    )
    allowed = allowed & torch.cat([valid, valid_r], 1)[:, None, :]
    allowed = allowed | torch.eye(2 * length, dtype=torch.bool, device=device)[None]  # no empty row (pads)
    ids = torch.cat([clean, noisy_r], 1)
    hidden = model.hidden(ids, torch.cat([positions, pos_r], 1), mask=allowed[:, None])
    logits = model.project(hidden.states)
    return logits[:, :length], logits[:, length:], order


def dual_stream_loss(
    model, tokens, valid, prompt_len: int, block_size: int, generator: torch.Generator, ar_weight: float = 1.0
) -> torch.Tensor:
    """WeDLM's loss of one batch (see the module docstring); the response is everything after ``prompt_len``."""
    n, length = tokens.shape
    positions = model.positions(valid)
    response = torch.zeros(n, length, dtype=torch.bool)
    response[:, prompt_len:] = True
    blocks = torch.where(valid.cpu(), positions.cpu() // block_size, -1)
    masked, ratio = draw_masks(response & valid.cpu(), blocks, generator)  # drawn on the CPU, then moved
    masked, ratio = masked.to(tokens.device), ratio.to(tokens.device)
    noisy = tokens.masked_fill(masked, model.mask_id)
    clean_logits, noisy_logits, order = dual_stream_logits(model, tokens, noisy, masked, positions, valid, block_size)
    scored = masked.gather(1, order)
    targets = tokens.gather(1, order)[scored]
    weights = 1.0 / (ratio.gather(1, order)[scored] + MASK_EPS)
    ce = F.cross_entropy(noisy_logits[scored].float(), targets, reduction="none")
    mlm = (ce * weights / weights.sum()).sum() if targets.numel() else noisy_logits.sum() * 0.0
    ar = next_token_cross_entropy(clean_logits, tokens, valid, prompt_len)
    return (mlm + ar_weight * ar) / (1.0 + ar_weight) if ar_weight > 0 else mlm
