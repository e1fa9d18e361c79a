"""A generation's geometry: its length, its block grid and its steps, resolved once and read by everything.

:func:`resolve` turns what a user asked (``max_new_tokens``, ``block_size``, ``steps``, ``steps_per_block``) into a
frozen :class:`Geometry` for a model and a sampler, or refuses it with a :class:`~dllm.core.errors.ConfigError`
that says what would work, before any forward. The canvas, the decoding process, samplers, exit rules, caches,
the bench, the command line and lm-eval read the geometry; nothing else derives a block grid or a span.

The rules (LLaDA's and Dream's ``steps`` over ``max_new_tokens / block_size`` blocks; SDAR's own block size and
``steps_per_block``; adaptive samplers, whose steps the data decides, as their official code which takes
``steps`` and ignores it):

- a model whose attention is block-causal keeps its training ``block_size``, its blocks aligned to its position
  grid (a prompt-dependent number of them), and takes ``steps_per_block`` (SDAR's ``denoising_steps``);
- otherwise the blocks are the ``block_size`` grid of the span (``max_new_tokens`` a multiple of it), unless
  the sampler sizes its blocks at run time (``grid_blocks`` False: ``block_size`` is the initial size, at most
  the span); ``steps`` split evenly over the blocks;
- a sampler of the ``stream`` process (WeDLM) has a window instead of blocks, and no steps budget;
- a sampler of the ``renoise`` process (DiffusionGemma) refines canvases of ``block_size`` (default: the model's
  ``canvas_length``), the span rounded up to whole canvases, each in at most its ``max_denoising_steps``;
- neither ``steps`` nor ``steps_per_block``: one token per step.
"""

from __future__ import annotations

import dataclasses

from dllm.core import params
from dllm.core.errors import ConfigError, LengthError, plural

DEFAULT_MAX_NEW_TOKENS = 128  # when neither the call nor the checkpoint (generation_config.json) gives one
# A fixed schedule holds a block's steps in a tensor (LLaDA's per-step quotas, Dream's timesteps): past this it would
# not fit, and steps beyond a block's tokens commit nothing anyway.
MAX_STEPS_PER_BLOCK = 2**20


@dataclasses.dataclass(frozen=True)
class Geometry:
    """prompt_width: the prompt columns (left-padded); max_new_tokens: the generation length G; block_size: the
    block grid (a block-causal model's training size; the stream's: G); steps_per_block: steps a block takes (an
    adaptive sampler's bound: block_size); adaptive: the data decides the steps; aligned: blocks follow the model's
    position grid (a prompt-dependent count); window: the stream process's window (None: blocks)."""

    prompt_width: int
    max_new_tokens: int
    block_size: int
    steps_per_block: int
    adaptive: bool = False
    aligned: bool = False
    window: int | None = None
    # each row's own max_new_tokens where the rows' differ (``generate(max_new_tokens=[...])``; max_new_tokens is
    # then the largest, the canvas's); None: every row's is max_new_tokens
    lengths: tuple[int, ...] | None = None

    @property
    def blocks(self) -> int | None:
        """Blocks of the grid (None where the prompt decides: blocks aligned to positions)."""
        return None if self.aligned else -(-self.max_new_tokens // self.block_size)

    @property
    def grid(self) -> tuple:
        """What rows of different ``max_new_tokens`` must share to decode in one run as each does alone: the window
        (the stream process), else the block size, steps per block and kind of schedule."""
        if self.window is not None:
            return ("window", self.window)
        return (self.block_size, self.steps_per_block, self.adaptive, self.aligned)

    @property
    def steps(self) -> int | None:
        """Scheduled steps of the whole generation (None: adaptive, or aligned blocks)."""
        return None if self.adaptive or self.aligned else self.steps_per_block * self.blocks

    def describe(self) -> str:
        """The figures line's account of the shape: ``max_new_tokens 32, block_size 8, steps 32``."""
        length = self.max_new_tokens if self.lengths is None else f"{min(self.lengths)}-{self.max_new_tokens} per row"
        if self.window is not None:
            return f"max_new_tokens {length}, window {self.window}, steps adaptive"
        shape = f"max_new_tokens {length}, block_size {self.block_size}"
        if self.adaptive:
            return f"{shape}, steps adaptive"
        return f"{shape}, " + (f"steps_per_block {self.steps_per_block}" if self.aligned else f"steps {self.steps}")


def resolve(
    model,
    sampler,
    prompt_width: int,
    max_new_tokens: int | None = None,
    block_size: int | None = None,
    steps: int | None = None,
    steps_per_block: int | None = None,
) -> Geometry:
    """The geometry of a generation of ``sampler`` on ``model`` after a ``prompt_width``-column prompt (0: the
    shape alone, as ``dllm bench`` checks a cell before it has prompts)."""
    sizes = dict(max_new_tokens=max_new_tokens, block_size=block_size, steps=steps, steps_per_block=steps_per_block)
    for key, value in sizes.items():
        params.check_value(key, value, int | None, ">= 1")
    g = max_new_tokens or getattr(model, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS
    window = None
    if sampler.process == "stream":
        window = sampler.window
        if steps is not None or steps_per_block is not None:
            raise ConfigError(
                f"the {sampler.name!r} sampler streams through a window and takes no steps budget (steps, "
                "steps_per_block); set wedlm_entropy_threshold (None: one token per step) instead"
            )
        if block_size is not None:
            raise ConfigError(f"the {sampler.name!r} sampler has no blocks; its window is {window}")
    adaptive = not sampler.fixed_steps
    if adaptive and not sampler.reads_steps:  # the data decides the steps; the official code ignores them too
        steps = steps_per_block = None
    if sampler.process == "renoise":  # canvases of block_size (the model's canvas_length), at most N steps each
        geometry = (block_size or model.block_size, sampler.max_denoising_steps)
    elif model.attention.block_causal:
        geometry = _aligned(model, g, block_size, steps, steps_per_block, sampler.default_steps_per_block)
    else:
        geometry = _grid(model, sampler, prompt_width, g, block_size, steps, steps_per_block)
    bs, spb = geometry
    if spb > MAX_STEPS_PER_BLOCK:
        # named as the caller gave it: steps (LLaDA's total) or steps_per_block
        asked = f"steps={steps} ({spb:,} per block)" if steps is not None else f"steps_per_block={spb}"
        most = f"steps={bs * (g // bs)}" if steps is not None else f"steps_per_block={bs}"
        raise ConfigError(
            f"{asked} is more than a block's schedule can hold ({MAX_STEPS_PER_BLOCK:,} steps at most); a block of "
            f"{bs} tokens takes {bs} steps at one token per step, and steps past its tokens commit nothing. Use at "
            f"most {bs} steps per block ({most})"
        )
    total = prompt_width + g + model.attention.extra_columns(bs)
    if total > model.max_length:
        raise LengthError(
            f"prompt ({prompt_width} tokens) + generation ({g}) exceeds the model's maximum length of "
            f"{model.max_length}; shorten the prompt or lower max_new_tokens"
        )
    data_decides = adaptive and not sampler.reads_steps  # (CCD: its steps set the commits per step, shown as given)
    return Geometry(prompt_width, g, bs, spb, data_decides, model.attention.block_causal, window)


def resolve_rows(model, sampler, prompt_width: int, lengths: list[int], **sizes) -> Geometry:
    """The geometry of rows with their own ``max_new_tokens`` (``lengths``, one per row; ``sizes``: block_size,
    steps, steps_per_block as :func:`resolve`). They share one run when each row alone would decode the same block
    grid with the same steps per block (so each row's answer is the one it gets alone): otherwise a ConfigError
    that says what differs."""
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise ConfigError(f"max_new_tokens as a list takes one length per prompt, got {lengths!r}")
    for i, length in enumerate(lengths):
        params.check_value(f"max_new_tokens[{i}]", length, int, ">= 1")
    whole = resolve(model, sampler, prompt_width, max(lengths), **sizes)
    if len(set(lengths)) == 1:
        return whole
    if not sampler.per_row_lengths:
        raise ConfigError(
            f"the {sampler.name or type(sampler).__name__!r} sampler's rule reads the generation length as one "
            f"number, so rows of different max_new_tokens ({sorted(set(lengths))}) would not decode as they do "
            "alone: give one max_new_tokens, or generate them in separate calls"
        )
    for length in sorted(set(lengths)):
        own = resolve(model, sampler, prompt_width, length, **sizes)
        if own.grid != whole.grid:
            raise ConfigError(
                f"rows of different max_new_tokens share a run when their blocks and steps per block agree: "
                f"max_new_tokens={length} gives block_size {own.block_size}, steps_per_block {own.steps_per_block}, "
                f"and {whole.max_new_tokens} gives {whole.block_size}, {whole.steps_per_block}. Give block_size and "
                "steps_per_block (or no steps: one token per step), or one max_new_tokens"
            )
    return dataclasses.replace(whole, lengths=tuple(lengths))


def _aligned(model, g, block_size, steps, steps_per_block, default_steps=None) -> tuple[int, int]:
    """A block-causal model's (block_size, steps_per_block): its training block size (or, for a model whose block
    size is the decoder's choice, ``block_size``, default its own), steps per block."""
    bs = model.block_size if block_size is None else block_size
    if bs != model.block_size and not model.free_block_size:
        raise ConfigError(
            f"this {model.family} checkpoint is trained with block_size={model.block_size}; "
            f"block_size={block_size} would change its attention pattern. Pass block_size={model.block_size}"
        )
    if steps is not None:
        raise ConfigError(
            "block-causal models decode a prompt-dependent number of blocks: give steps_per_block "
            "(the official per-block steps: SDAR's denoising_steps, LLaDA2's steps) instead of steps"
        )
    # a sampler's default (LLaDA2's 32) past the block's tokens would schedule steps that commit nothing
    return bs, steps_per_block or min(default_steps or bs, bs)


def _grid(model, sampler, prompt_width, g, block_size, steps, steps_per_block) -> tuple[int, int]:
    """(block_size, steps_per_block) of blocks on the span's own grid."""
    if block_size is None and not sampler.grid_blocks:
        bs = sampler.default_block or g
    elif block_size is None:
        bs = g if sampler.default_block is None or g % sampler.default_block else sampler.default_block
    else:
        bs = block_size
    if g % bs and sampler.grid_blocks:
        rounded, divisor = -(-g // bs) * bs, max(d for d in range(1, min(bs, g) + 1) if g % d == 0)
        if prompt_width + rounded <= model.max_length:
            advice = f"use e.g. max_new_tokens={rounded} or block_size={divisor}, a divisor of {g}"
        else:  # rounding up would pass the model's length: only a smaller block size is advice
            advice = (
                f"use e.g. block_size={divisor}, a divisor of {g} (max_new_tokens={rounded} would pass the "
                f"model's maximum length of {model.max_length})"
            )
        raise ConfigError(f"max_new_tokens={g} is not a multiple of block_size={bs}; {advice}")
    if not sampler.grid_blocks:  # a block size beyond the span is one block (no wider tensors than that)
        bs = min(bs, g)
    blocks, spb = g // bs, steps_per_block
    if steps is not None:
        if steps % blocks:
            valid = ", ".join(str(blocks * k) for k in (1, 2, 4, bs) if blocks * k <= max(g, blocks))
            raise ConfigError(
                f"steps={steps} cannot be split evenly over the {plural(blocks, 'block')} "
                f"(max_new_tokens={g} / block_size={bs}); use a multiple of {blocks}, e.g. {valid}"
            )
        if spb is not None and spb * blocks != steps:
            raise ConfigError(
                f"steps={steps} and steps_per_block={spb} disagree: with {plural(blocks, 'block')}, steps = "
                f"steps_per_block * {blocks}. Give only one of them"
            )
        spb = steps // blocks
    return bs, spb or bs
