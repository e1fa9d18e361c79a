"""Attention kinds: what a family's attention pattern means for the rest of the package.

A family declares its kind once (:class:`~dllm.models.registry.Family`); every part outside the model asks the
kind, never compares its name:

- ``mask``: which key columns a query may attend (the model's own attention pattern);
- ``process``: the decoding process that can drive it (``"masked"``: masks decoded in place over the canvas,
  LLaDA / Dream / SDAR; ``"stream"``: a causal window in physical order, WeDLM; ``"renoise"``: canvases of
  noise refined in place by a decoder over an encoder's K/V, DiffusionGemma);
- ``block_causal``: attention is causal across the model's training blocks (SDAR): generation is aligned to
  its position grid (:meth:`span`), its block size is fixed by training, finished blocks' K/V are exact;
- ``default_cache``: the cache a sampler uses when asked for its default (the exact block cache of a
  block-causal model; none on full attention; the stream's own for a causal model);
- ``exact_likelihood``: log-likelihoods are exact (one causal forward), not Monte-Carlo estimates.

A kind is a ``str`` (its name: ``"full"``, ``"block"``, ``"causal"``, ``"encoder_decoder"``) so that it prints,
serialises and reads back as the name; its behaviour is its attributes and methods.
"""

from __future__ import annotations

from typing import ClassVar

import torch


class Attention(str):
    """An attention kind (the name is the string's value)."""

    process: ClassVar[str] = "masked"
    block_causal: ClassVar[bool] = False
    default_cache: ClassVar[str | None] = None
    exact_likelihood: ClassVar[bool] = False
    attends_everything: ClassVar[bool] = False  # no mask is needed without padding or a key restriction

    def allowed(self, positions, queries, block_size) -> torch.Tensor:
        """bool [B, R, L]: where a query row may attend a key column (padding aside)."""
        raise NotImplementedError

    def span(self, prompt_lens: torch.Tensor, prompt_width: int, max_new_tokens: int, block_size: int):
        """(first_block [B], generated [B]): the column where each row's first block starts and how many slots
        its generation span holds (``max_new_tokens``, an int or each row's [B], or more where blocks are aligned to
        positions)."""
        b, device = prompt_lens.shape[0], prompt_lens.device
        return torch.full((b,), prompt_width, device=device), _per_row(max_new_tokens, b, device)

    def extra_columns(self, block_size: int) -> int:
        """Canvas columns a row may need past ``prompt + max_new_tokens`` (block alignment)."""
        return 0


class Full(Attention):
    """Bidirectional attention over every real column (LLaDA, Dream)."""

    attends_everything: ClassVar[bool] = True

    def allowed(self, positions, queries, block_size):
        r = positions.shape[1] if queries is None else queries.shape[1]
        return torch.ones(positions.shape, dtype=torch.bool, device=positions.device)[:, None, :].expand(-1, r, -1)


class BlockCausal(Attention):
    """Causal across blocks of the model's training ``block_size``, bidirectional inside one (SDAR): a query
    sees every key whose position lies in its own block or an earlier one."""

    block_causal: ClassVar[bool] = True
    default_cache: ClassVar[str | None] = "block"

    def allowed(self, positions, queries, block_size):
        q_pos = positions if queries is None else positions.gather(1, queries)
        return (positions[:, None, :] // block_size) <= (q_pos[:, :, None] // block_size)

    def span(self, prompt_lens, prompt_width, max_new_tokens, block_size):
        """Each row's first block is the one holding its first generated position (its prompt tail stays fixed
        in it), and the span runs to the end of the block holding position ``prompt_len + max_new_tokens - 1``,
        as the official SDAR sampler aligns them."""
        first_pos = (prompt_lens // block_size) * block_size
        end_pos = -(-(prompt_lens + max_new_tokens) // block_size) * block_size
        return (prompt_width - prompt_lens) + first_pos, end_pos - prompt_lens

    def extra_columns(self, block_size):
        return block_size


class Causal(Attention):
    """Causal attention in physical column order (WeDLM): a query sees the key columns at or before its own
    (bottom-right aligned when the queries are the last columns of the forward), whatever their position ids."""

    process: ClassVar[str] = "stream"
    default_cache: ClassVar[str | None] = "stream"
    exact_likelihood: ClassVar[bool] = True

    def allowed(self, positions, queries, block_size):
        cols = torch.arange(positions.shape[1], device=positions.device)
        q_cols = cols[None, :, None] if queries is None else queries[:, :, None]
        return (cols[None, None, :] <= q_cols).expand(positions.shape[0], -1, -1)


class EncoderDecoder(Attention):
    """A causal encoder over the prompt and each finished canvas, whose K/V a bidirectional decoder attends while it
    refines the next canvas in place (DiffusionGemma): decoded by the ``"renoise"`` process, canvas after canvas, the
    span rounded up to whole canvases."""

    process: ClassVar[str] = "renoise"

    def allowed(self, positions, queries, block_size):
        raise NotImplementedError("an encoder-decoder model builds its own masks (its encoder cache and canvas)")

    def span(self, prompt_lens, prompt_width, max_new_tokens, block_size):
        b, device = prompt_lens.shape[0], prompt_lens.device
        whole = -(-max_new_tokens // block_size) * block_size
        return torch.full((b,), prompt_width, device=device), _per_row(whole, b, device)

    def extra_columns(self, block_size):
        return block_size - 1


def _per_row(value, b: int, device) -> torch.Tensor:
    """[B] int64: ``value`` for every row, or each row's own (a tensor [B])."""
    return torch.zeros(b, dtype=torch.long, device=device) + value


FULL, BLOCK, CAUSAL = Full("full"), BlockCausal("block"), Causal("causal")
ENCODER_DECODER = EncoderDecoder("encoder_decoder")
KINDS: dict[str, Attention] = {kind: kind for kind in (FULL, BLOCK, CAUSAL, ENCODER_DECODER)}
