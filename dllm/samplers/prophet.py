"""Prophet: early commit once the answer is certain (Li et al. 2025, "Diffusion Language Models Know the
Answer Before Decoding", arXiv 2508.19982; official code ``pixeli99/Prophet`` ``generate_earlyexit.py``).

An exit rule on the shared loop: by default over LLaDA's fixed low-confidence schedule (``get("prophet",
...)``), and over any other base through the registry (``get("prophet", base="threshold", threshold=0.9,
answer_start_pos=...)``) or ``dllm.samplers.get("threshold").with_exit(Prophet(...))``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches import require_needed
from dllm.core.errors import ConfigError, DllmWarning
from dllm.core.params import Accepts, check_value, hp
from dllm.samplers.compose import ExitRule

THRESHOLDS = {"early": 7.5, "mid": 5.0, "late": 2.5}
PHASES = (0.33, 0.67)  # progress below 0.33 is "early", below 0.67 "mid", else "late"
ANSWER_LENGTH = 5  # columns of the answer region (hard-coded in the official generate)


@dataclasses.dataclass
class _State:
    total_steps: torch.Tensor  # float64 [B]: each row's fixed-schedule steps over its generation (max_steps)


@dataclasses.dataclass(frozen=True)
class Prophet(ExitRule):
    """Prophet (arXiv 2508.19982): commit every mask at once when the answer region's logit gap is large.

    At each step the gap between the top-1 and top-2 logit (after classifier-free guidance), averaged over the
    answer region, is compared with a threshold that falls with progress; once it is reached, every remaining
    mask of the row, in every block, gets this step's proposal (the argmax when greedy, as the official ``x0``)
    and the row is done. The check reuses the step's forward: an exit at step t costs t forwards (2t with
    guidance).

    answer_start_pos: absolute column of the ``[B, P+G]`` canvas where the answer region starts; the region
        is that column and the next 4, clipped to the generation span (columns in the prompt are left out;
        an empty region never exits). The gap is averaged over the region whatever the state of its slots
        (masked, committed, or constrained), as in the official code. None disables the exit.
    early_exit_thresholds: ``{"early": 7.5, "mid": 5.0, "late": 2.5}`` in logit units; a missing key takes
        its default. Phases: progress < 0.33 early, < 0.67 mid, else late.
    constraints: ``{offset from the generation start: token id}`` written into the canvas before decoding
        (e.g. the tokens of "The answer is" a few columns before the answer region). They are never masks:
        the base schedule does not count them, and classifier-free guidance treats them as prompt.
    analyze_gap: the official switch that enables the check (its default False never exits); here True.
    answer_offset (ours): the answer region's start as an offset from the generation start (column P +
        offset), for prompts of different lengths (a benchmark's); exclusive with ``answer_start_pos``.
    Progress: over a fixed-schedule base (``llada``), the 1-based global step over the total ``steps``,
    every scheduled step running its forward and check (also steps that commit nothing, e.g. the last steps
    of a block holding constraints), as in the official loop; over an adaptive base (``threshold``,
    ``factor``, ...), which has no fixed number of steps, the committed fraction of the generation span
    before this step's commit (ours).

    Without an answer region (or with ``analyze_gap=False``) and without constraints the run is its base sampler
    alone, the same tokens and forwards, with a warning (with constraints: as the official, a forward at every
    scheduled step).
    Defaults: thresholds 7.5 / 5.0 / 2.5, no answer region (no exit), no constraints; the base is LLaDA's
    ``low_confidence`` sampler (``cfg_scale`` and ``remasking`` are its hyper-parameters).
    K/V caches: with ``prefix``, ``dual``, ``dkv`` (and SDAR's ``block``) every forward also computes the answer
    region and the masked span (a finishing row is filled from it), without storing their K/V; ``window`` /
    ``elastic`` are refused. With its refresh forced every step a cache gives the no-cache output.
    Deliberate differences from the official code: batched with per-row exits (the official is batch-1);
    the mask token's logit is -inf before the gap is taken (dllm never proposes it; the official keeps it);
    the official re-imposes the constraints after every step, which changes nothing as they are never
    masks; the official also runs with ``analyze_gap=False`` (never exits), here the default is True.
    """

    name: ClassVar[str] = "prophet"
    on_device: ClassVar[bool] = True
    needs: ClassVar[frozenset] = frozenset({"logit_margin"})
    default_base: ClassVar[str] = "llada"
    answer_start_pos: int | None = hp(
        None,
        ">= 0",
        note="a column of the prompt + generation canvas, e.g. prompt length + offset of the answer; None: no exit",
    )
    early_exit_thresholds: dict | None = None
    constraints: dict | None = None
    analyze_gap: bool = True
    answer_offset: int | None = hp(None, ">= 0", note="columns after the prompt")

    def check_hyper_parameters(self):
        if self.answer_offset is not None and self.answer_start_pos is not None:
            raise ConfigError("give answer_start_pos (a canvas column) or answer_offset, not both")
        thresholds = self.early_exit_thresholds
        if thresholds is not None:
            if not isinstance(thresholds, dict):
                raise ConfigError(
                    f"early_exit_thresholds must be a dict with keys 'early', 'mid', 'late', got {thresholds!r}"
                )
            unknown = sorted(set(thresholds) - set(THRESHOLDS), key=str)
            if unknown:
                raise ConfigError(
                    f"early_exit_thresholds has unknown phase {', '.join(map(repr, unknown))}; "
                    "the phases are 'early', 'mid', 'late'"
                )
            for key, value in thresholds.items():
                check_value(f"early_exit_thresholds[{key!r}]", value, float, Accepts(note="logit units"))
        if self.constraints is not None:
            if isinstance(self.constraints, dict):  # offsets and ids given as digit strings (JSON) become ints
                digits = {_int(k): _int(v) for k, v in self.constraints.items()}
                object.__setattr__(self, "constraints", digits)
            if not isinstance(self.constraints, dict):
                raise ConfigError(
                    "constraints must be a dict {offset from the generation start: token id}, "
                    f"got {self.constraints!r}"
                )
            for pos, token in self.constraints.items():
                check_value("constraints: offset", pos, int, Accepts(">= 0", note="columns after the prompt"))
                check_value(f"constraints[{pos!r}]: token id", token, int, ">= 0")

    @property
    def enabled(self) -> bool:
        """Whether the exit is checked: an answer region is given and ``analyze_gap`` is on."""
        return (self.answer_start_pos is not None or self.answer_offset is not None) and self.analyze_gap

    @property
    def active(self) -> bool:
        """Without the exit and without constraints the run is the base sampler alone: the same tokens and NFE."""
        return self.enabled or bool(self.constraints)

    def _start(self, canvas) -> int:
        """The answer region's first column; any column past the canvas (an empty region) is the canvas length."""
        if self.answer_start_pos is not None:
            return min(self.answer_start_pos, canvas.length)
        return min(canvas.prompt_width + self.answer_offset, canvas.length)

    every_step: ClassVar[bool] = True  # the official runs every scheduled step, each with its forward
    reads_decoded: ClassVar[bool] = True  # the gap is averaged over the region whatever its slots' state

    def thresholds(self) -> tuple[float, float, float]:
        given = self.early_exit_thresholds or {}
        return tuple(float(given.get(k, v)) for k, v in THRESHOLDS.items())

    def init_state(self, run):
        canvas, model = run.canvas, run.model
        if self.constraints:
            # written before decoding, where the canvas holds masks (columns past a row's span are skipped,
            # as the official skips columns past the canvas)
            for pos, token in self.constraints.items():
                token = int(token)
                if token >= model.vocab_size or token == model.mask_id:
                    raise ConfigError(
                        f"constraints[{pos!r}] = {token} is not a token id of this model (vocabulary "
                        f"{model.vocab_size}, mask {model.mask_id})"
                    )
                column = canvas.prompt_width + int(pos)
                if column < canvas.length:
                    slot = canvas.tokens[:, column] == canvas.mask_id
                    canvas.tokens[:, column] = torch.where(slot, token, canvas.tokens[:, column])
        blocks = canvas.blocks  # per row (SDAR rows differ)
        return _State(total_steps=(blocks * run.steps_per_block).double())

    def check_cache(self, model, cache):
        require_needed(cache, "prophet reads its answer region's logits at every step", model)

    def check_run(self, run):
        super().check_run(run)
        if not self.enabled:
            warn_never_exits(self)

    def observe(self, step, state):
        if not self.enabled:
            return None
        return step.window(ANSWER_LENGTH, torch.full_like(step.start, self._start(step.canvas)))

    def check(self, step, state, decision):
        if not self.enabled:
            return torch.zeros_like(step.done)
        canvas = step.canvas
        columns = self._start(canvas) + torch.arange(ANSWER_LENGTH, device=step.columns.device)
        inside = (columns >= canvas.prompt_width) & (columns[None, :] < canvas.span_end[:, None])  # [B, 5]
        gaps = step.scores.logit_margin.index_select(1, columns.clamp(max=canvas.length - 1)).double()
        count = inside.sum(1)
        gaps = torch.where(inside, gaps, 0.0)
        total = gaps[:, 0]
        for k in range(1, ANSWER_LENGTH):  # left to right in float64, as the official Python sum
            total = total + gaps[:, k]
        gap = total / count.clamp(min=1)
        if step.quota is not None:  # fixed schedule: 1-based global step over the total steps
            progress = (step.t + 1).double() / state.total_steps
        else:  # adaptive: committed fraction of the generation span
            span = (step.columns >= canvas.prompt_width) & canvas.valid
            progress = 1 - (step.masked & span).sum(1).double() / span.sum(1).clamp(min=1)
        early, mid, late = self.thresholds()
        threshold = torch.where(progress < PHASES[0], early, torch.where(progress < PHASES[1], mid, late))
        return (count > 0) & (gap >= threshold)


def warn_never_exits(rule: Prophet) -> None:
    """Prophet without an answer region (its defaults) or with ``analyze_gap=False`` never exits: the run is
    its base sampler alone, the same tokens and forwards (with constraints: the base with them written, a forward
    at every scheduled step as the official). It runs (the official code's default does the same), with a
    warning."""
    import warnings

    why = "analyze_gap=False" if not rule.analyze_gap else "no answer region (answer_offset / answer_start_pos)"
    alone = "its base sampler alone"
    if rule.constraints:  # (there is no base run to equal: the official's, with a forward at every scheduled step)
        alone = "its base sampler with the constraints written, a forward at every scheduled step as the official"
    warnings.warn(
        f"prophet with {why} never exits early: this run is {alone}. Set answer_offset=K (the answer region "
        "starts K columns after the prompt) or answer_start_pos to enable the exit",
        DllmWarning,
        stacklevel=3,
    )


def _int(value):
    return int(value) if isinstance(value, str) and value.isdigit() else value
