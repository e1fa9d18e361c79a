"""Counter-based random numbers: every draw is a pure function of (seed, row, step, column, what for,
vocabulary index), computed on the device with Philox-4x32-10 (Salmon et al., SC 2011; the generator of
cuRAND, JAX and Triton's ``tl.rand``).

Nothing is consumed, so a row's numbers never depend on its batch, on the other rows, on how many draws
were made before, or on whether a step was skipped; a fused kernel can draw the very same numbers from
the same counters; and no host synchronisation or Python loop over rows is needed.

Counters: ``key = seed`` (64 bits); ``(c0, c1, c2, c3) = (vocabulary index // 2, column offset from the
generation start, step, row + (stream << 24))``. Column offsets (not absolute columns) keep a prompt's
numbers the same under any left padding. ``row`` is the row's key: ``Sampler.prepare`` gives each row the
number of earlier rows of its batch holding the identical prompt (:func:`dllm.engine.prompts.repeats`), so a
prompt draws the same numbers at any index of any batch; the lm-eval adapter keys rows by their request.
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF
_ROUNDS = 10


class Stream(IntEnum):
    """What a draw is for; each has its own numbers."""

    TOKENS = 0  # Gumbel noise over the vocabulary (sampling a token)
    ORDER = 1  # random priorities of positions (random remasking, sampled positions)
    REVEAL = 2  # coin flips deciding which positions to reveal (Dream's "origin")
    ACCEPT = 3  # speculative acceptance: one coin per drafted position (S2D2)
    RESAMPLE = 4  # speculative residual resampling at a rejected position, over the vocabulary (S2D2)
    NOISE = 5  # uniform-state noise: a canvas's initial and renoised token ids (DiffusionGemma)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` for a 32-bit constant ``a`` and 32-bit values ``b`` held in
    int64, computed in 16-bit halves so that no intermediate exceeds 2**63."""
    low = a * (b & 0xFFFF)  # < 2**48
    mid = a * (b >> 16) + (low >> 16)  # full product >> 16, < 2**49
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low & 0xFFFF)


def philox(counters: tuple[torch.Tensor, ...], key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox-4x32-10 of the four 32-bit counter words (int64 tensors, broadcastable) under ``key`` (two 32-bit
    words, or two int64 tensors broadcastable with the counters); returns four int64 tensors of 32-bit words."""
    c0, c1, c2, c3 = (torch.as_tensor(c) & _MASK32 for c in counters)
    k0, k1 = key
    for _ in range(_ROUNDS):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def _to_unit(high: torch.Tensor, low: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Uniform in [0, 1): 53 random bits from two words for float64, 24 from one for float32."""
    if dtype == torch.float64:
        return ((high >> 5) * 67108864 + (low >> 6)).to(torch.float64) * (1.0 / 9007199254740992.0)
    return (high >> 8).to(torch.float32) * (1.0 / 16777216.0)


class CounterRNG:
    """Uniform draws keyed by (seed, row key, step, column offset, stream[, vocabulary index]).

    seed: one seed for every row, or one per batch row (a list; None entries: fresh), so that rows with their own
    seeds share a batch (the server's requests). keys: the row word of each batch row (24 bits; default: the row's
    index). A row's draws depend on its seed and key, never on its index, so rows carrying their seed and key with
    them sample the same tokens in any batch.
    """

    def __init__(self, seed: int | None | list, keys=None):
        if isinstance(seed, (list, tuple)):
            self.seed = [_fresh() if s is None else int(s) for s in seed]
            seeds = torch.tensor([[s & _MASK32, (s >> 32) & _MASK32] for s in self.seed], dtype=torch.long)
            self.key = None
            self.seed_words = seeds.reshape(-1, 2)
        else:
            self.seed = _fresh() if seed is None else int(seed)
            self.key = (self.seed & _MASK32, (self.seed >> 32) & _MASK32)
            self.seed_words = None
        self.keys = None if keys is None else torch.as_tensor(keys, dtype=torch.long)

    def row_words(self, rows: torch.Tensor) -> torch.Tensor:
        """The row keys [n] of the batch rows ``rows`` [n]."""
        rows = rows.long()
        return rows if self.keys is None else self.keys.to(rows.device)[rows]

    def philox_key(self, rows: torch.Tensor) -> tuple:
        """The Philox key of the batch rows ``rows`` [n]: the seed's two words, or with per-row seeds two int64
        tensors [n]."""
        if self.seed_words is None:
            return self.key
        words = self.seed_words.to(rows.device)[rows.long()]
        return words[:, 0], words[:, 1]

    def counters(self, stream: Stream, rows: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor) -> Counters:
        """The counters of the draws of the slots ``offsets`` [n, K] of batch rows ``rows`` [n] at their
        ``steps`` [n], flattened to N = n * K slots: what a fused kernel needs to draw them itself. The tensors
        are contiguous (an expanded view can have stride 0, which a kernel reading them by pointer would not see)."""
        n, k = offsets.shape
        words = self.row_words(rows)[:, None].expand(n, k).contiguous().view(-1)
        steps = steps.long()[:, None].expand(n, k).contiguous().view(-1)
        key = self.philox_key(rows)
        if self.seed_words is not None:
            key = tuple(w[:, None].expand(n, k).contiguous().view(-1) for w in key)
        return Counters(key, words, steps, offsets.long().contiguous().view(-1), stream)

    def uniform(
        self,
        stream: Stream,
        rows: torch.Tensor,
        steps: torch.Tensor,
        offsets: torch.Tensor,
        vocab: int | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        """Draws of shape ``offsets.shape`` (``[n, K]``), or ``[n, K, vocab]`` with ``vocab``.

        rows, steps: [n] batch row (its index in the caller's batch, mapped to its key) and step of each
        row; offsets [n, K]: column offsets from the generation start.
        """
        return _uniform(self.philox_key(rows), stream, self.row_words(rows), steps, offsets, vocab, dtype)


def _fresh() -> int:
    """A seed from torch's global generator, so that torch.manual_seed still makes runs repeatable."""
    return int(torch.randint(0, 2**62, (1,)).item())


@dataclasses.dataclass(frozen=True)
class Counters:
    """The Philox counters of N slots' draws over a vocabulary: key (two 32-bit words, from the seed), and
    per slot [N] its row key, step and column offset, for one stream. Word layout: see the module docstring.
    ``uniform(vocab)`` materialises the draws ([N, vocab], as :meth:`CounterRNG.uniform` gives them); a fused
    kernel computes the same numbers from these counters instead."""

    key: tuple  # (two 32-bit words; with per-row seeds two int64 tensors [N])
    rows: torch.Tensor
    steps: torch.Tensor
    offsets: torch.Tensor
    stream: Stream = Stream.TOKENS

    def uniform(self, vocab: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return _uniform(self.key, self.stream, self.rows, self.steps, self.offsets[:, None], vocab, dtype)[:, 0]


def _uniform(key, stream, words, steps, offsets, vocab, dtype):
    row = (words.long() + (int(stream) << 24))[:, None]
    step = steps.long()[:, None]
    offsets = offsets.long()
    if isinstance(key[0], torch.Tensor):  # (a key per row [n]: broadcast over its slots)
        key = tuple(k.to(offsets.device)[:, None] for k in key)
    if vocab is None:
        w = philox((torch.zeros_like(offsets), offsets, step, row), key)
        return _to_unit(w[0], w[1], dtype)
    pairs = torch.arange((vocab + 1) // 2, device=offsets.device)
    if isinstance(key[0], torch.Tensor):
        key = tuple(k[..., None] for k in key)
    w = philox((pairs, offsets[..., None], step[..., None], row[..., None]), key)
    draws = torch.stack([_to_unit(w[0], w[1], dtype), _to_unit(w[2], w[3], dtype)], -1)
    return draws.flatten(-2)[..., :vocab]
