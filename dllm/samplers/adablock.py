"""AdaBlock-dLLM: semantic-aware adaptive block sizes (arXiv 2509.26432, ICLR 2026).

A fixed semi-autoregressive block makes confident tokens just past its end wait and forces unsure tokens
inside it. AdaBlock ends each block at the end of a semantic step instead: at the block's first forward, a
confidently predicted delimiter (newline, period) in a look-ahead window ends the block right after it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches import require_needed
from dllm.core.errors import ConfigError, ModelError
from dllm.core.params import hp
from dllm.samplers.confidence import Threshold

WINDOW_FRACTION = 0.25  # the official look-ahead window: int(0.25 * gen_length) columns
DEFAULT_DELIMITERS = ("\n", ".")  # the paper's delimiters besides the comma; newline alone in the LLaDA scripts


def default_delimiters(tokenizer) -> tuple[int, ...]:
    """The token ids of a newline and a period in ``tokenizer`` (each kept when it is one token); () if none."""
    if tokenizer is None:
        return ()
    ids = []
    for text in DEFAULT_DELIMITERS:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            ids.append(int(encoded[0]))
    return tuple(ids)


@dataclasses.dataclass
class _Sizing:
    """Per generation: the delimiter ids, the window width, and the rows whose block starts at this step."""

    delimiters: torch.Tensor  # long [D]
    window: int
    rows: torch.Tensor | None = None  # bool [B], set by begin_block, consumed by the step's select


@dataclasses.dataclass(frozen=True)
class AdaBlock(Threshold):
    """AdaBlock-dLLM (Lu et al., arXiv 2509.26432) over Fast-dLLM's threshold rule.

    Each block starts with one forward. Over the look-ahead window of ``int(0.25 * G)`` columns from the
    block start (G = ``max_new_tokens``; clipped to the columns left), the proposals that are delimiters
    (``delimiter_ids``) are candidates; the most confident one (its softmax probability in the logits' own
    dtype, as the official code; ties to the leftmost) ends the block right after it (inclusive) if its
    confidence is >= ``delimiter_threshold`` (δ). Otherwise the block is ``min(block_size, columns left)``.
    The same forward makes the block's first commit; every step commits the block's masked slots with
    float64 confidence >= ``threshold`` (τ) and always the most confident one (Fast-dLLM's threshold rule),
    until the block is full. Blocks may be shorter or longer than ``block_size`` (at most the window).

    ``block_size`` (``generate()``) is the official ``init_block_length``, default 32; ``max_new_tokens``
    need not be a multiple of it; ``steps`` / ``steps_per_block`` are not used (the official code takes
    ``steps`` and ignores it): the number of steps depends on the data.
    threshold: τ, default 0.9 (the README's setting; the official function has no default).
    delimiter_ids: token ids that end a block; default (None): the model's tokenizer's newline and period
        tokens (the paper's default set is newline, comma, period; the official LLaDA default is ``[198]``,
        LLaDA's newline, and the Dream code hard-codes 24 newline-bearing Qwen tokens). Ids outside the
        vocabulary never match.
    delimiter_threshold: δ, default 0.3 (the README's LLaDA setting and the Dream code's default; the scripts
        use 0.5 for Dream). ``inf`` (the official LLaDA function's default) never adapts: Fast-dLLM's threshold
        rule on fixed blocks.

    Official code: lgxi24/AdaBlock-dLLM commit 491b205, ``llada/generate_adablock.py``
    (``generate_adablock``, ``compute_block_length``) and ``dream/model/generation_utils_adablock.py``
    (``_sample_adablock``, alg ``confidence_threshold``), their no-cache paths. Deliberate differences:
    - batched: each row sizes its own blocks (per-row block bounds); the official asserts batch 1;
    - one rule for both families: the threshold compares the float64 confidence (the LLaDA code; the Dream
      code compares in the logits' dtype, which differs only within float32 rounding of τ), and the window's
      candidates are this step's proposals (the LLaDA code; the Dream code takes the plain argmax, the same
      at temperature 0); at temperature > 0 both families propose by the LLaDA code's float64 Gumbel-max with
      dllm's counter-based random numbers and score by the untempered softmax (the Dream code samples with
      torch's ``Categorical`` from ``softmax(logits / T)`` and takes its confidences from that);
    - the delimiter confidence is the model's probability before any composed logit transform;
    - ``eos_early_stop`` (on by default) stops a row after a block holding EOS; the official decodes the
      whole span (``eos_early_stop=False``; the text up to the first EOS is the same either way);
    - K/V caches: the parity is with the official no-cache paths. With ``cache="prefix"``, ``"dual"`` or
      ``"dkv"`` a block is sized from its first forward (a full forward for each of them, so the same
      look-ahead logits) and the cache serves the block's later steps, sized as it was; the official prefix /
      dual cache variants are not checked token for token. ``window`` / ``elastic`` are refused (they do not
      compute the look-ahead window).
    """

    name: ClassVar[str] = "adablock"
    grid_blocks: ClassVar[bool] = False
    per_row_lengths: ClassVar[bool] = False  # its look-ahead window is a share of the generation length G
    threshold: float = hp(0.9, "[0, 1]")
    delimiter_ids: tuple[int, ...] | None = hp(
        None, ">= 0", note="token ids; None: the tokenizer's newline and period (delimiter_threshold=inf: fixed blocks)"
    )
    delimiter_threshold: float = hp(0.3, "[0, inf]", note="a probability; inf keeps fixed blocks")

    def check_hyper_parameters(self):
        if self.delimiter_ids == ():
            raise ConfigError(
                "delimiter_ids must be a non-empty list of token ids, got []; leave it None for the tokenizer's "
                "newline and period (delimiter_threshold=inf: fixed blocks)"
            )

    def check_model(self, model):
        if model.attention.block_causal:
            raise ConfigError(
                f"adablock sizes blocks at run time, but this {model.family} checkpoint is trained with a fixed "
                f"block_size={model.block_size} (block-causal attention); use 'sdar' or 'threshold' instead"
            )

    def check_run(self, run):
        if self.delimiter_ids is None and not default_delimiters(run.model.tokenizer):
            raise ConfigError(
                "adablock: this model has no tokenizer with a one-token newline or period to take the default "
                "delimiters from; pass delimiter_ids=[...] (e.g. the ids of '\\n' and '.')"
            )
        super().check_run(run)

    def check_cache(self, model, cache):
        super().check_cache(model, cache)
        require_needed(cache, "adablock sizes each block from the logits of a look-ahead window past the block", model)

    def init_state(self, run):
        canvas = run.canvas
        ids = self.delimiter_ids if self.delimiter_ids is not None else default_delimiters(run.model.tokenizer)
        window = int(WINDOW_FRACTION * (canvas.length - canvas.prompt_width))  # the generation length G
        return _Sizing(torch.tensor(ids, dtype=torch.long, device=canvas.tokens.device), window)

    def begin_block(self, step, state, rows):
        state.rows = rows.clone()  # this step's forward sizes their blocks

    def observe(self, step, state):
        return step.window(max(step.canvas.block_size, state.window))  # the block and the look-ahead window

    def select(self, step, state):
        if state.rows is not None:
            self._size_blocks(step, state, state.rows & ~step.done)
            state.rows = None
        return super().select(step, state)

    def _size_blocks(self, step, state, rows):
        """End the blocks of ``rows`` (bool [B], at their first step) after their most confident delimiter."""
        width = state.window
        if width == 0 or self.delimiter_threshold == float("inf"):
            return
        run = step.run
        columns = step.window(width)  # [B, W] from each row's block start
        inside = columns - step.start[:, None] == torch.arange(width, device=columns.device)  # not clipped
        inside &= columns < step.canvas.span_end[:, None]
        active = step.active
        window = columns.index_select(0, active)
        # a cached forward computes the window of the rows whose block starts (a cache plans for the observed
        # masks); the other rows' columns may be placeholders, discarded below
        computed = step.model.computed(step.hidden, window)
        logits = run.scorer.logits(step, active, window, step.hidden, computed=computed)  # [n, W, V]
        token = step.scores.token.gather(1, columns).index_select(0, active)
        confidence = (logits.gather(-1, token[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)).exp()
        candidate = torch.isin(token, state.delimiters) & inside.index_select(0, active)
        if computed is not None:
            missed = rows.index_select(0, active)[:, None] & inside.index_select(0, active) & ~computed
            run.checks.add(missed.any(), ModelError("adablock: a cached forward missed the look-ahead window"))
            candidate &= computed
        confidence = confidence.masked_fill(~candidate, float("-inf"))
        best = confidence.max(1).values
        offsets = torch.arange(width, device=columns.device)
        offset = torch.where(candidate & (confidence == best[:, None]), offsets, width).min(1).values  # leftmost
        found = candidate.any(1) & (best.double() >= self.delimiter_threshold)  # compared as Python floats
        adapt = torch.zeros_like(rows)
        adapt[active] = found
        end = step.end.clone()
        end[active] = step.start.index_select(0, active) + offset + 1
        step.set_block_end(rows & adapt, end)
