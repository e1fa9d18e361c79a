"""The one interface every model family implements (DESIGN §3).

``logits(tokens, positions, attention_mask=, kv=, rows=)`` returns logits *aligned with the canvas*:
row i predicts the token of column i, whatever the family's training convention (Dream's one-position
shift is hidden in its adapter). Positions are explicit so that left padding never moves the RoPE
position of a real token (Dream, SDAR); LLaDA's official code has no position ids and numbers columns
0..L-1 even under left padding, which its adapter reproduces (RoPE is relative and pads are masked out
of attention, so the real tokens' attention is unchanged up to rounding).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dllm.core.errors import ModelError
from dllm.models.layers import ForwardContext, KVStore


class DiffusionLM(nn.Module):
    """A masked-denoising language model. Subclasses implement ``_forward`` over chosen query rows."""

    family: ClassVar[str]
    attention: ClassVar[str] = "full"  # "full" | "block" (block-causal) | "causal"

    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        self.tokenizer = None  # set by dllm.load
        self.name_or_path: str | None = None
        self.block_size: int | None = None
        self.mask_id: int | None = None
        self.pad_id: int | None = None
        self.bos_id: int | None = None
        self.eos_ids: tuple[int, ...] = ()
        self.vocab_size: int = 0
        self.max_length: int = 0
        self.max_new_tokens: int | None = None  # the checkpoint's default generation length, if it ships one

    def read_token_ids(self, config: dict) -> None:
        """Special token ids from the official config field names (the loader adds the tokenizer's)."""
        self.mask_id = config.get("mask_token_id")
        self.pad_id = config.get("pad_token_id")
        self.bos_id = config.get("bos_token_id")
        eos = config.get("eos_token_id")
        self.eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    # -- facts ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def eos_id(self) -> int:
        """The id written after the end of a finished row (the first end-of-sequence id)."""
        if not self.eos_ids:
            raise ModelError(f"{self.family} model has no end-of-sequence token id; set eos_token_id in config.json")
        return self.eos_ids[0]

    def check_usable(self) -> None:
        """Raise a clear error when the model cannot be sampled from."""
        if self.mask_id is None:
            raise ModelError(
                f"{self.family} model has no mask token id: set 'mask_token_id' in config.json "
                "(LLaDA 126336, Dream 151666, SDAR 151669) or give the tokenizer a mask_token"
            )
        if self.pad_id is not None and self.pad_id == self.mask_id:
            raise ModelError(
                f"pad token id equals the mask token id ({self.mask_id}): padded prompts would be decoded as "
                "masks. Give the tokenizer a different pad token (e.g. the EOS token)"
            )
        if not 0 <= self.mask_id < self.vocab_size:
            raise ModelError(f"mask token id {self.mask_id} is outside the vocabulary (size {self.vocab_size})")

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        """Position ids [B, L] for a canvas whose real (non-pad) columns are ``valid``.

        Default: real tokens count from 0 in order, so left padding does not shift them; pads get 0.
        """
        return (valid.long().cumsum(-1) - 1).clamp(min=0)

    # -- forward -------------------------------------------------------------------------------
    def attention_mask(self, positions, valid, rows) -> torch.Tensor | None:
        """bool [B, 1, R, L], True where a query row may attend a key column; None = everything."""
        if self.attention == "full":
            if valid is None or bool(valid.all()):
                return None
            allowed = valid[:, None, :].expand(-1, positions.shape[1] if rows is None else rows.shape[1], -1)
        elif self.attention == "block":
            q_pos = positions if rows is None else positions.gather(1, rows)
            bs = self.block_size
            allowed = (positions[:, None, :] // bs) <= (q_pos[:, :, None] // bs)
            if valid is not None:
                allowed = allowed & valid[:, None, :]
        else:
            raise NotImplementedError(self.attention)
        if valid is not None:
            # A pad query row attends to itself, so no row is empty (empty rows give NaN in some SDPA
            # backends); pad rows never influence real ones because pad keys are masked out.
            cols = torch.arange(positions.shape[1], device=positions.device)
            q_cols = cols[None, :, None] if rows is None else rows[:, :, None]
            q_valid = valid[:, :, None] if rows is None else valid.gather(1, rows)[:, :, None]
            allowed = allowed | ((cols[None, None, :] == q_cols) & ~q_valid)
        return allowed[:, None]

    def logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        kv: KVStore | None = None,
        rows: torch.Tensor | None = None,
        write: bool = True,
    ) -> torch.Tensor:
        """Logits for canvas columns ``rows`` ([B, R] indices; None = all), aligned: row i predicts column i.

        ``attention_mask`` [B, L] marks real columns (1) and pads (0). With a ``kv`` store, the columns not
        in ``rows`` are read from it, and (``write=True``) the fresh K/V of ``rows`` are written to it.
        """
        return self._rows_forward(tokens, positions, attention_mask, kv, rows, write)

    def _rows_forward(self, tokens, positions, attention_mask, kv, rows, write) -> torch.Tensor:
        valid = None if attention_mask is None else attention_mask.bool()
        ctx = ForwardContext(
            rows=rows,
            length=tokens.shape[1],
            mask=self.attention_mask(positions, valid, rows),
            kv=kv,
            write=write,
        )
        ids = tokens if rows is None else tokens.gather(1, rows)
        pos = positions if rows is None else positions.gather(1, rows)
        return self._forward(ids, pos, ctx)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, tokens, positions=None, attention_mask=None):
        """Plain full forward (aligned logits) for convenience; samplers use ``logits``."""
        if positions is None:
            valid = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            positions = self.positions(valid)
        return self.logits(tokens, positions, attention_mask=attention_mask)
