"""A prepared generation: the model, the canvas, the settings, the random streams, the cache, and the one
place where forwards are counted.

The session (:mod:`dllm.engine.session`) validates the inputs and builds a :class:`Run`, drives it with the
sampler's decoding process and turns it into a :class:`~dllm.engine.generation.Generation`. Every model
forward of a generation, whoever asks for it (the loop, a guidance transform, a verifier, a cache
refresh), goes through :meth:`Run.forward`, so ``nfe`` is exact by construction.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from dllm.core.errors import Checks
from dllm.core.geometry import Geometry
from dllm.core.rng import CounterRNG
from dllm.engine import compiled
from dllm.engine.canvas import Canvas


@dataclasses.dataclass
class Run:
    model: object
    canvas: Canvas
    geometry: Geometry
    temperature: float  # (with rows of their own temperatures, the largest: whether any row samples)
    eos_early_stop: bool
    rng: CounterRNG
    cache: object | None = None
    cache_state: object | None = None  # the cache's per-run state (Cache.start), while the loop runs
    history: list | None = None
    callback: Callable | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)
    nfe: int = 0
    refreshes: int = 0  # forwards a cache planned as refreshes of its stored K/V
    checks: Checks = dataclasses.field(default_factory=Checks)
    # the scoring backend (dllm.kernels.resolve of generate's kernel=), the scorings each backend ran (a
    # kernel's unsupported specs fall back to the reference), and the loop's scoring seam (dllm.engine.loop.Scorer)
    kernel: str = "torch"
    kernel_calls: dict = dataclasses.field(default_factory=dict)
    select_calls: dict = dataclasses.field(default_factory=dict)  # kernel B's commits per backend (loop.commit_rule)
    scorer: object | None = None
    compile: str | None = None  # the torch.compile backend of the model forward, or "reduce-overhead" (None: eager)
    static_shapes: bool = False  # the loop's forward runs every row with bucketed query widths (engine/static.py)
    # the answer's columns after the prompt: max_new_tokens. A block-aligned span (SDAR's, LLaDA2's, DiffusionGemma's
    # canvases) decodes its last block's tail past it, which stays in ``sequences`` but not in texts or token counts
    # (None: the whole span)
    # (a tensor [B]: each row's, where the rows' max_new_tokens differ)
    answer_width: int | torch.Tensor | None = None
    # the renoise process's random numbers from elsewhere (dllm.engine.renoise.Draws; None: from ``rng``)
    draws: object | None = None
    # the static-shape steps run on the device, one status read each (dllm.engine.device); else, with
    # static_shapes, why not (None without static_shapes)
    device_step: bool = False
    why_not_on_device: str | None = None
    # a constraint's (and a template's) check of the canvas (dllm.constraints.guard.Guard; None: none), and the
    # template itself (its text and holes, for the texts and fills)
    guard: object | None = None
    template: list | None = None
    # the masks each step fills, and those filled left to right (dllm.engine.order.Order; None: no mask token)
    order: object | None = None
    # each row's temperature where the rows' differ (generate(temperature=[...]); None: every row's is temperature)
    temperatures: tuple[float, ...] | None = None
    # bool [B]: the rows that stop at EOS, where the rows' eos_early_stop differ (generate(eos_early_stop=[...]);
    # eos_early_stop is then whether any does; None: every row's is eos_early_stop)
    eos_rows: torch.Tensor | None = None
    # each row's value of the sampler's per-row hyper-parameters, float64 [B] by name, where the rows' differ
    # (generate(hyper_parameters=[...]); Sampler.row_value reads them; None: the sampler's)
    row_settings: dict | None = None

    def __post_init__(self):
        self.eos = torch.tensor(list(self.model.eos_ids), dtype=torch.long, device=self.canvas.tokens.device)
        self.padded = self.canvas.padded  # read once: whether any column is a pad
        self.hidden = compiled.hidden(self.model, self.compile, self.static_shapes)
        self.score = compiled.score(self.compile, self.static_shapes)  # the scoring seam's torch path (or None)

    @property
    def steps_per_block(self) -> int:
        return self.geometry.steps_per_block

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask=None, **options):
        """One model forward (counted): hidden states of the columns ``options["queries"]`` (default: every
        column); logits come from ``model.head`` on the columns that are read. ``options`` are those of
        :meth:`DiffusionLM.hidden` (queries, keys, kv, write, observer, mask); its checks are deferred to
        the loop's next read-back."""
        self.nfe += 1
        if self.model.free_block_size:  # the attention's blocks are the generation's (LLaDA2)
            options.setdefault("block_size", self.canvas.block_size)
        return self.hidden(tokens, positions, attention_mask=attention_mask, checks=self.checks, **options)
