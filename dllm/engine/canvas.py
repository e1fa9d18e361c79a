"""The canvas: prompts left-padded to a common width, followed by the generation span of masks.

Columns ``[0, P)`` hold the prompts (left padding), columns ``[P, span_end)`` a row's generation span.
Blocks of ``block_size`` columns from ``first_block`` are decoded one after another (semi-autoregressive);
the loop keeps each row's current block bounds (:class:`dllm.engine.step.Step`), so a sampler may size
blocks differently. Where each row's first block starts and how long its span is, the model's attention kind
says (:meth:`dllm.models.attention.Attention.span`: block-causal models align blocks to their position grid);
columns past a row's span are padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_MASK = -1  # the canvas's mask id for a model without a mask token: no slot is masked


@dataclass
class Canvas:
    tokens: torch.Tensor  # [B, L] token ids
    valid: torch.Tensor  # [B, L] bool: real columns (False for pads)
    positions: torch.Tensor  # [B, L] position ids (the model's convention)
    prompt_width: int  # P
    prompt_lens: torch.Tensor  # [B] real prompt tokens per row
    block_size: int
    first_block: torch.Tensor  # [B] column where block 0 of each row starts
    span_end: torch.Tensor  # [B] end (exclusive) of each row's generation span
    mask_id: int

    @classmethod
    def build(cls, model, prompt_ids, prompt_mask, geometry) -> Canvas:
        """The canvas of a generation of ``geometry`` (:mod:`dllm.core.geometry`) after these prompts; the model's
        attention kind aligns the blocks (:meth:`dllm.models.attention.Attention.span`)."""
        b, p = prompt_ids.shape
        lens = prompt_mask.sum(1)
        pad_id = model.filler_id
        block_size = geometry.block_size
        device = prompt_ids.device
        lengths = geometry.max_new_tokens  # (or each row's own)
        if geometry.lengths is not None:
            lengths = torch.tensor(geometry.lengths, dtype=torch.long, device=device)
        first_block, gen = model.attention.span(lens, p, lengths, block_size)
        width = p + int(gen.max())
        cols = torch.arange(width, device=device)
        in_span = (cols >= p) & (cols < (p + gen)[:, None])
        tokens = torch.full((b, width), pad_id, dtype=torch.long, device=device)
        tokens[:, :p] = prompt_ids
        # a uniform-state model (no mask token) starts from pads; its process writes the noise
        tokens[in_span] = pad_id if model.mask_id is None else model.mask_id
        valid = torch.zeros((b, width), dtype=torch.bool, device=device)
        valid[:, :p] = prompt_mask.bool()
        valid |= in_span
        return cls(
            tokens=tokens,
            valid=valid,
            positions=model.positions(valid),
            prompt_width=p,
            prompt_lens=lens,
            block_size=block_size,
            first_block=first_block,
            span_end=p + gen,
            mask_id=NO_MASK if model.mask_id is None else model.mask_id,
        )

    @property
    def blocks(self) -> torch.Tensor:
        """[B] the blocks of each row's span (rows of a block-causal model differ)."""
        return -(-(self.span_end - self.first_block) // self.block_size)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def padded(self) -> bool:
        """Whether any column is a pad (a host synchronisation: read it once, not per step)."""
        return not bool(self.valid.all())

    @property
    def masked(self) -> torch.Tensor:
        return (self.tokens == self.mask_id) & self.valid
