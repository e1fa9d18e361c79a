"""DCD: deferred commitment decoding ("Deferred Commitment Decoding", arXiv 2601.02076), as its released code."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.engine.step import Decision
from dllm.kernels.reference import ScoreSpec, top_k_per_row
from dllm.samplers.base import Sampler

ALGORITHMS = (
    "threshold",
    "fixed",
    "entropy_threshold",
    "entropy_fixed",
    "topk_margin_threshold",
    "topk_margin_fixed",
)


@dataclasses.dataclass(frozen=True)
class DCD(Sampler):
    """DCD (arXiv 2601.02076) as its released code: a sliding window that holds a fixed number of masks, not
    aligned to blocks, so a token it is not yet sure of stays masked while the window moves on and sees more of
    the text to its right before it is committed.

    Each row's window starts as the first ``initial_window_length`` columns of the span. Each step scores the
    window's columns and commits, among its masks (``decode_algo``):

    - ``"threshold"``: every one whose proposal's probability is at least ``decode_param``, and at least the most
      confident; ``"fixed"``: the ``decode_param`` most confident ones;
    - ``"entropy_..."`` / ``"topk_margin_..."``: the same on the negative entropy / the top-1 minus top-2
      probability.

    When a row commits an EOS, every slot after its first EOS becomes EOS (decoded ones too; with
    ``generate(eos_early_stop=True)``, the default). The window's left end then moves past the decoded columns,
    and its right end moves to refill it to ``initial_window_length`` masks, capped at ``max_window_length``
    columns from the left end and at the row's first EOS. The row is done once its span holds no mask. The span is
    one block (the official's); with ``block_size`` (and on a block-causal model, its blocks) the window opens at
    each block's first mask and moves within the block.

    Official code reproduced: shuyingte/DCD ``decode_algorithm.py``, ``window_bidirectional_decode`` with
    ``window_type="sliding"`` (``get_decode_num``, ``get_decode_conf_and_indices``). Defaults: its ``run_all.sh``
    (LLaDA-8B-Instruct, Dream-v0-Base-7B): ``initial_window_length`` 16, ``max_window_length`` 128, ``decode_algo``
    "threshold" with ``decode_param`` 0.9, temperature 0 (``DecodeConfig``'s own: 32 and 1e9). Its caches are
    :class:`~dllm.caches.prefix.Prefix` / :class:`~dllm.caches.dual.Dual` with ``delay`` and ``refresh_count``
    (``cache_type="prefix-delay2"`` / ``"dual-delay2"``, ``refresh_count=32``: ``dllm.caches.get("dual", delay=2,
    refresh_count=32)``); ``window_type="static"`` (its block baseline) is dllm's ``threshold`` sampler.

    Differences: each row has its own window (the official window is the batch's: its left end waits for every
    row, its right end moves by the largest row's count, so a row's output depends on its batch; at batch 1 they
    are the same); on a block-causal model (SDAR) the window moves within the current block, as the official
    ``window_causal_decode`` for Fast-dLLM v2 (without its optional block expansion, off by default there), except
    at a block's start: there the official decodes the block's first token alone, in a forward of its own whose block
    cache still holds the K/V of the previous block's last commits as computed while they were masks (even with
    ``cache_type="none"``), and opens the window one column later; dllm opens it at the block's first mask, exact; the
    EOS tokens are the model's (the official takes one id); ``topk_margin_*`` scores each slot by its own top-1 minus
    top-2 probability (the official ``sample_tokens`` indexes the window's first two slots of its [B, W, V]
    probabilities instead, ``sorted_probs[:, 0]``, and fails on the shapes); exact score ties go to the leftmost slot
    (``torch.topk``'s order is unspecified); at a temperature the proposal is a Gumbel-max sample from dllm's
    counter-based streams, its confidence the sample's probability, as there.
    """

    name: ClassVar[str] = "dcd"
    fixed_steps: ClassVar[bool] = False
    default_block: ClassVar[int | None] = None  # one block: the window is not aligned to blocks
    initial_window_length: int = hp(16, ">= 1", note="masks the window holds")
    max_window_length: int = hp(128, ">= 1", note="columns the window spans at most")
    decode_algo: str = hp("threshold", choices=ALGORITHMS)
    decode_param: float = hp(0.9, note="the threshold, or the count of a 'fixed' rule")

    def check_hyper_parameters(self) -> None:
        super().check_hyper_parameters()
        whole = self.decode_param >= 1 and self.decode_param == int(self.decode_param)
        if self.decode_algo.endswith("fixed") and not whole:
            raise ConfigError(
                f"dcd: decode_algo={self.decode_algo!r} commits decode_param tokens a step, a whole number >= 1; "
                f"got decode_param={self.decode_param}"
            )

    def init_state(self, run):
        b, device = run.canvas.batch, run.canvas.tokens.device
        zeros = torch.zeros(b, dtype=torch.long, device=device)
        return WindowState(left=zeros, right=zeros.clone(), placed=torch.zeros(b, dtype=torch.bool, device=device))

    def begin_block(self, step, state, rows):
        """A row entering its block (the span, or a block-causal model's block) opens its window at the block's first
        mask (a block-causal model's first block may start in the prompt)."""
        left = first_mask(step, step.start, step.start)
        state.left = torch.where(rows, left, state.left)
        state.right = torch.where(rows, torch.minimum(left + self.initial_window_length, step.end), state.right)
        state.placed |= rows

    def observe(self, step, state):
        """The window's columns [B, K] (K: the widest row's; a narrower row repeats its first column), the window
        moved first from the canvas as the last step left it."""
        self.slide(step, state)
        width = state.right - state.left
        k = max(int(width.max()), 1)
        offsets = torch.arange(k, device=width.device)
        columns = state.left[:, None] + offsets
        return torch.where(offsets < width[:, None], columns, state.left[:, None]).clamp(max=step.canvas.length - 1)

    def slide(self, step, state) -> None:
        """The official update after a step: the left end past the decoded columns, the right end refilled to
        ``initial_window_length`` masks, within ``max_window_length`` columns, the block and the row's first EOS.
        A window placed at this step's block start stays as it is."""
        columns, masked = step.columns, step.masked
        left = first_mask(step, state.left, step.end)
        inside = masked & (columns >= left[:, None]) & (columns < state.right[:, None])
        right = state.right + self.initial_window_length - inside.sum(1)
        right = torch.minimum(torch.minimum(right, left + self.max_window_length), step.end)
        if step.run.eos_early_stop:  # (the slots after a row's first EOS are EOS: the window stops there)
            span = (columns >= step.canvas.prompt_width) & (columns < step.canvas.span_end[:, None])
            eos = torch.isin(step.tokens, step.run.eos) & span
            stops = eos.any(1) if step.run.eos_rows is None else eos.any(1) & step.run.eos_rows
            right = torch.minimum(right, torch.where(stops, eos.long().argmax(1), step.end))
        moving = ~state.placed & ~step.done
        state.left = torch.where(moving, left, state.left)
        state.right = torch.where(moving, torch.maximum(right, left), state.right)
        state.placed = torch.zeros_like(state.placed)

    def score_spec(self, run):
        need = "entropy" if self.decode_algo.startswith("entropy") else "prob"
        if self.decode_algo.startswith("topk_margin"):
            need = "margin"
        return ScoreSpec(need=frozenset({need}), temperature=run.temperature)

    def select(self, step, state):
        scores = step.scores
        if self.decode_algo.startswith("entropy"):
            confidence = -scores.entropy
        else:
            confidence = scores.margin if self.decode_algo.startswith("topk_margin") else scores.prob
        window = (step.columns >= state.left[:, None]) & (step.columns < state.right[:, None])
        candidates = step.committable & window
        if self.decode_algo.endswith("fixed"):
            count = candidates.sum(1).clamp(max=int(self.decode_param))
        else:
            count = torch.maximum((candidates & (confidence >= self.decode_param)).sum(1), candidates.any(1).long())
        commit = top_k_per_row(confidence.masked_fill(~candidates, float("-inf")), count) & candidates
        if not step.run.eos_early_stop:
            return commit
        ends = (commit & torch.isin(scores.token, step.run.eos)).any(1)
        if step.run.eos_rows is not None:
            ends = ends & step.run.eos_rows
        return Decision(commit=commit, truncate=ends)


def first_mask(step, start: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
    """[B]: each row's first masked column of its block from ``start`` on (``default`` where there is none)."""
    columns = step.columns
    ahead = step.masked & (columns >= start[:, None]) & (columns < step.end[:, None])
    return torch.where(ahead.any(1), ahead.long().argmax(1), default)


@dataclasses.dataclass
class WindowState:
    left: torch.Tensor  # long [B]: the window's first column
    right: torch.Tensor  # long [B]: its end (exclusive)
    placed: torch.Tensor  # bool [B]: rows whose window was placed at this step's block start (not slid yet)
