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

    def rows(self, index: torch.Tensor) -> Canvas:
        """The canvas of the rows ``index`` [n] (the same columns)."""
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        return Canvas(
            tokens=pick(self.tokens),
            valid=pick(self.valid),
            positions=pick(self.positions),
            prompt_width=self.prompt_width,
            prompt_lens=pick(self.prompt_lens),
            block_size=self.block_size,
            first_block=pick(self.first_block),
            span_end=pick(self.span_end),
            mask_id=self.mask_id,
        )

    def widened(self, model, prompt_width: int, length: int) -> Canvas:
        """This canvas on ``prompt_width`` prompt columns and ``length`` columns in all (at least its own): more left
        padding before the prompts, more padding past the spans. Neither changes a row's decoding (the positions
        count real columns only, and a pad is outside every attention): a row decodes as on its own canvas."""
        left, right = prompt_width - self.prompt_width, length - prompt_width - (self.length - self.prompt_width)
        if left < 0 or right < 0:
            raise ValueError(f"a canvas widens only: {self.prompt_width}/{self.length} -> {prompt_width}/{length}")
        if left == 0 and right == 0:
            return self
        pad = torch.nn.functional.pad
        tokens = pad(self.tokens, (left, right), value=model.filler_id)
        valid = pad(self.valid, (left, right), value=False)
        return Canvas(
            tokens=tokens,
            valid=valid,
            positions=model.positions(valid),
            prompt_width=prompt_width,
            prompt_lens=self.prompt_lens,
            block_size=self.block_size,
            first_block=self.first_block + left,
            span_end=self.span_end + left,
            mask_id=self.mask_id,
        )

    @staticmethod
    def joined(first: Canvas, second: Canvas) -> Canvas:
        """The rows of ``first`` then those of ``second`` (the same columns and blocks)."""
        columns = lambda canvas: (canvas.prompt_width, canvas.length, canvas.block_size)  # noqa: E731
        if columns(first) != columns(second):
            raise ValueError("canvases join on the same columns and blocks: widen one first")
        cat = lambda name: torch.cat([getattr(first, name), getattr(second, name)])  # noqa: E731
        return Canvas(
            tokens=cat("tokens"),
            valid=cat("valid"),
            positions=cat("positions"),
            prompt_width=first.prompt_width,
            prompt_lens=cat("prompt_lens"),
            block_size=first.block_size,
            first_block=cat("first_block"),
            span_end=cat("span_end"),
            mask_id=first.mask_id,
        )
