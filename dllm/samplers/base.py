"""Sampler base: hyper-parameters as frozen dataclass fields, policy hooks the shared loop calls.

A sampler is a per-step policy (DESIGN §3). The loop (:func:`dllm.core.loop.denoise`) calls
- ``init_state(run)``: the sampler's own state for one generation (a dataclass; None if stateless);
- ``begin_block(step, state, rows)``: per-row set-up when ``rows`` (bool [B]) enter a new block;
- ``quota(step, state)``: tokens to commit per row at this step (fixed-schedule samplers only);
- ``idle_steps(step, state)``: how many steps from this one commit nothing (a long schedule's idle steps are then
  taken at once);
- ``observe(step, state)``: the columns [B, K] to score (default: the current block's window); a
  sampler may observe more columns than it may commit (look-ahead windows, answer regions);
- ``transforms(run)``: stateful logit transforms applied before scoring (:mod:`dllm.samplers.transforms`);
- ``score_spec(run)``: what the scoring seam (:func:`dllm.kernels.score`) computes (statistics, temperature,
  dtype, the sampling warps temper / top-k / top-p, suppressed ids);
- ``select(step, state)``: which slots to commit (a bool [B, L] or a :class:`~dllm.core.step.Decision`
  that may also override tokens and finish rows);
- ``selection(step, state)``: the :class:`~dllm.kernels.selection.Rule` that ``select`` applies to
  ``step.scores.prob`` when it is one of kernel B's rules (default None: the loop calls ``select``); the loop
  then commits through the dispatch :func:`dllm.kernels.dispatch.select` (fused on the Triton backend);
- ``forward_mask(step, state, plan)``: an attention pattern replacing the model's own for the loop's
  forward (default None: the model's).
- ``commit_span(step, state)``: slots beyond the current block that ``select`` may also commit (default
  None: the current block only; ETE's cross-block decoding widens it).
Exit rules and extra transforms attach to any sampler (:meth:`Sampler.with_exit`,
:meth:`Sampler.with_transforms`, :mod:`dllm.samplers.compose`). ``generate`` is ``prepare`` (validation,
prompts, canvas, random streams, cache) -> ``run`` (the shared loop; samplers with a different loop
override it) -> ``finish`` (accounting).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
import weakref
from pathlib import Path
from typing import ClassVar

import torch

from dllm.caches import resolve as resolve_cache
from dllm.core import compat, compiled, params, prompts
from dllm.core.canvas import Canvas
from dllm.core.errors import ConfigError, DllmWarning, ModelError, plural
from dllm.core.generation import Generation, count_generated
from dllm.core.loop import denoise
from dllm.core.rng import CounterRNG
from dllm.core.run import Run
from dllm.kernels.dispatch import resolve as resolve_kernel
from dllm.kernels.reference import ScoreSpec
from dllm.kernels.selection import Rule

DEFAULT_MAX_NEW_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class Sampler(params.HyperParameters):
    """Hyper-parameters are the fields, each declared with what it accepts (:func:`dllm.core.params.hp`) and
    checked when the sampler is built; checks across fields go in :meth:`check_hyper_parameters`."""

    name: ClassVar[str] = ""
    noun: ClassVar[str] = "sampler"
    fixed_steps: ClassVar[bool] = True  # True: each block takes exactly steps_per_block steps
    default_block: ClassVar[int | None] = 32  # None: the whole span is one block
    # True: blocks are the block_size grid, so max_new_tokens must be a multiple of block_size (and, for a fixed
    # schedule, steps split evenly over the blocks). False: the sampler sizes its blocks at run time (block_size
    # is the initial / fallback size, the last block may be shorter). Adaptive samplers (fixed_steps False) do
    # not use steps / steps_per_block.
    grid_blocks: ClassVar[bool] = True
    # True: the sampler decodes causal-attention models (WeDLM's streaming rule, with its own loop); the shared
    # loop's samplers do not (a mask would see no token after it).
    causal: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        """Refuse, when it is defined, a sampler the loop cannot drive: one with a fixed schedule and a ``select``
        but no ``quota`` (it failed deep in the loop with a TypeError)."""
        super().__init_subclass__(**kwargs)
        concrete = cls.select is not Sampler.select and cls.run is Sampler.run
        if concrete and cls.fixed_steps is True and cls.quota is Sampler.quota:
            raise ConfigError(
                f"{cls.__name__} has a fixed schedule (fixed_steps = True, the default) but no quota(step, state), "
                "which says how many tokens each row commits at each step: implement quota (LLaDA's in "
                "dllm/samplers/confidence.py), or set fixed_steps: ClassVar[bool] = False when select decides how "
                "many to commit (docs/samplers.md)"
            )

    # -- policy hooks --------------------------------------------------------------------------
    def init_state(self, run: Run):
        return None

    def begin_block(self, step, state, rows: torch.Tensor) -> None:
        pass

    def quota(self, step, state) -> torch.Tensor | None:
        return None

    def idle_steps(self, step, state) -> torch.Tensor | None:
        """Asked by the loop at a step whose quota is 0 in every working row (fixed-schedule samplers only): [B]
        per row, how many steps from this one on (>= 1) :meth:`quota` gives 0, nothing being committed meanwhile;
        the loop takes them at once (fewer is allowed: the loop asks again). None (the default): one step."""
        return None

    def observe(self, step, state) -> torch.Tensor:
        """Columns [B, K] to score at this step: by default the current block's ``block_size`` columns."""
        return step.window(step.canvas.block_size)

    def commit_span(self, step, state) -> torch.Tensor | None:
        """bool [B, L]: slots beyond the current block this sampler may also commit at this step (the loop
        keeps their masked slots of working rows); None (the default): the current block only."""
        return None

    def transforms(self, run: Run) -> tuple:
        return ()

    def score_spec(self, run: Run) -> ScoreSpec:
        return ScoreSpec(need=frozenset({"prob"}), temperature=run.temperature)

    def select(self, step, state):
        raise NotImplementedError

    def selection(self, step, state) -> Rule | None:
        """The rule of kernel B (:mod:`dllm.kernels.selection`) that :meth:`select` applies to ``step.scores.prob``
        with ``step.quota``, for the loop to commit through :func:`dllm.kernels.dispatch.select`; it must give
        exactly the commit of :meth:`select`, which needs the rule to commit each working row's most confident
        slot (``top_k``: fixed-schedule samplers only, by their quota). None (the default): the loop calls
        :meth:`select`."""
        return None

    def forward_mask(self, step, state, plan) -> torch.Tensor | None:
        """The attention mask (bool [n, 1, R, L]) of the loop's forward of ``step.active`` as ``plan`` computes
        it, replacing the model's own; None (the default) keeps the model's (S2D2's AR-like caching overrides)."""
        return None

    @property
    def exit_rules(self) -> tuple:
        return ()

    # -- composition ---------------------------------------------------------------------------
    def with_exit(self, *rules):
        """This sampler with early-exit rules attached (e.g. Prophet's)."""
        from dllm.samplers.compose import Composed

        return Composed(self, exits=rules)

    def with_transforms(self, *transforms):
        """This sampler with more logit transforms after its own (e.g. CreditDecoding's boost)."""
        from dllm.samplers.compose import Composed

        return Composed(self, extra=transforms)

    # -- checks --------------------------------------------------------------------------------
    def check_drives(self, model) -> None:
        """Raise :class:`~dllm.core.errors.ConfigError` when this sampler cannot drive ``model``: the rule every
        sampler shares (a causal-attention model needs a ``causal`` sampler), then :meth:`check_model`'s own.
        Needs no prompt: ``generate``, ``dllm bench`` (before it loads a model) and lm-eval ask it alike."""
        if model.attention == "causal" and not self.causal:
            raise ConfigError(
                f"this {model.family} model has causal attention: it decodes masks only with observed tokens "
                f"reordered before them, which the {self.name or type(self).__name__!r} sampler does not do. Use "
                "dllm.samplers.get('wedlm')"
            )
        self.check_model(model)

    def check_model(self, model) -> None:
        """Raise when this sampler cannot drive ``model`` (e.g. needs a block-causal model); a sampler's own
        rule, asked through :meth:`check_drives`."""

    def check_cache(self, model, cache) -> None:
        """Raise :class:`~dllm.core.errors.ConfigError` when this sampler cannot run on ``model`` with ``cache``
        (a cache object, or None for no cache). It needs no prompt: :meth:`check_run` asks it when a run is
        prepared, and ``dllm bench`` before it loads a model, so both ask the same question."""

    def check_run(self, run: Run) -> None:
        """Raise when this sampler cannot run as prepared; by default: :meth:`check_cache` of the run's cache."""
        self.check_cache(run.model, run.cache)

    def default_cache(self, model):
        """Exact block K/V reuse on block-causal models; no cache on full attention."""
        from dllm.caches.block import BlockCausal

        return BlockCausal() if model.attention == "block" else None

    # -- lengths -------------------------------------------------------------------------------
    def plan(self, model, prompt_len: int, max_new_tokens, block_size, steps, steps_per_block):
        """Validate and resolve (max_new_tokens, block_size, steps_per_block)."""
        sizes = dict(max_new_tokens=max_new_tokens, block_size=block_size, steps=steps, steps_per_block=steps_per_block)
        for key, value in sizes.items():
            params.check_value(key, value, int | None, ">= 1")
        g = max_new_tokens
        if g is None:  # the checkpoint's own default (generation_config.json), else ours
            g = getattr(model, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS
        if not self.fixed_steps:  # adaptive: the data decides the steps; the official code ignores them too
            steps = steps_per_block = None
        if model.attention == "block":
            bs = model.block_size if block_size is None else block_size
            if bs != model.block_size:
                raise ConfigError(
                    f"this {model.family} checkpoint is trained with block_size={model.block_size}; "
                    f"block_size={block_size} would change its attention pattern. Pass block_size={model.block_size}"
                )
            if steps is not None:
                raise ConfigError(
                    "block-causal models decode a prompt-dependent number of blocks: give steps_per_block "
                    "(SDAR's denoising_steps) instead of steps"
                )
            spb = steps_per_block
            total = prompt_len + g + bs
        else:
            if block_size is None and not self.grid_blocks:
                bs = self.default_block or g
            elif block_size is None:
                bs = g if self.default_block is None or g % self.default_block else self.default_block
            else:
                bs = block_size
            if g % bs and self.grid_blocks:
                rounded, divisor = -(-g // bs) * bs, max(d for d in range(1, min(bs, g) + 1) if g % d == 0)
                if prompt_len + rounded <= model.max_length:
                    advice = f"use e.g. max_new_tokens={rounded} or block_size={divisor}, a divisor of {g}"
                else:  # rounding up would pass the model's length: only a smaller block size is advice
                    advice = (
                        f"use e.g. block_size={divisor}, a divisor of {g} (max_new_tokens={rounded} would pass the "
                        f"model's maximum length of {model.max_length})"
                    )
                raise ConfigError(f"max_new_tokens={g} is not a multiple of block_size={bs}; {advice}")
            if not self.grid_blocks:  # a block size beyond the span is one block (no wider tensors than that)
                bs = min(bs, g)
            blocks = g // bs
            spb = steps_per_block
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
            total = prompt_len + g
        if spb is None:
            spb = bs  # one token per step
        if total > model.max_length:
            raise ConfigError(
                f"prompt ({prompt_len} tokens) + generation ({g}) exceeds the model's maximum length of "
                f"{model.max_length}; shorten the prompt or lower max_new_tokens"
            )
        return g, bs, spb

    # -- entry point ---------------------------------------------------------------------------
    def generate(
        self,
        model,
        prompt,
        *,
        steps: int | None = None,
        steps_per_block: int | None = None,
        max_new_tokens: int | None = None,
        block_size: int | None = None,
        temperature: float = 0.0,
        attention_mask: torch.Tensor | None = None,
        seed: int | None = None,
        eos_early_stop: bool = True,
        cache="default",
        history: bool = False,
        callback=None,
        kernel: str = "auto",
        compile: bool | str = False,
        static_shapes: bool = False,
        **transformers_arguments,
    ) -> Generation:
        """Generate continuations of ``prompt`` (text, texts, chat messages, or token ids).

        steps: total denoising steps over the generation (LLaDA / Dream meaning); must split evenly over
            the ``max_new_tokens / block_size`` blocks. steps_per_block: the same per block (SDAR meaning).
            Neither: one token per step. Adaptive samplers (``fixed_steps = False``: ``threshold``,
            ``localleap``, ``adablock``, ...), whose steps the data decides, do not use either (as their
            official code, which takes ``steps`` and ignores it).
        max_new_tokens: the generation length G; default: the checkpoint's ``generation_config.json``
            ``max_new_tokens`` (the bundled models ship one), else 128.
        temperature: 0 is greedy; > 0 samples with counter-based random numbers keyed by ``(seed, k, step,
            column offset)`` (:mod:`dllm.core.rng`), where k counts the earlier rows of the batch holding the
            identical prompt: a prompt samples the same tokens alone or at any index of any batch, repeated
            prompts sample differently, and different prompts with the same seed use the same numbers (as
            separate calls with that seed do).
        eos_early_stop: once a block holding EOS is complete, fill the rest of that row with EOS at no
            further cost; False decodes the whole span as the official samplers do (the text up to the
            first EOS is the same either way). A model without an EOS id (none in its ``config.json``,
            ``generation_config.json`` or tokenizer) decodes the whole span, its texts uncut, with one warning.
        cache: "default" (the sampler's own: exact block K/V reuse for SDAR, none for full attention),
            None or "none", a cache name (``dllm.caches.names()``: "prefix", "dual", "dkv", ...) with its
            default hyper-parameters, or a cache object (``dllm.caches.get("dkv", cache_reloading_step=8)``).
        transformers' arguments: ``do_sample`` (False: temperature 0; True: temperature 1.0 unless given),
            ``max_length`` (prompt width + max_new_tokens) and ``num_beams=1`` are translated; anything else
            is refused with the dllm equivalent (:mod:`dllm.core.compat`).
        kernel: the scoring backend (:mod:`dllm.kernels.dispatch`): "auto" (the fused Triton kernels on CUDA when
            triton imports, the PyTorch reference elsewhere), "torch" or "triton"; ``Generation.kernel`` says which
            ran.
        compile: True runs the model forward through ``torch.compile`` (inductor; a string names another
            backend, or ``"reduce-overhead"``: inductor capturing CUDA graphs, with ``static_shapes`` on), with the
            same tokens and forwards as eager (:mod:`dllm.core.compiled`).
        static_shapes: True runs the loop's forward with the same shapes at every cached step of a phase (done
            rows kept in place, query widths bucketed), so that it compiles once per shape and can be captured
            as a CUDA graph; the same tokens, forwards and history as False (:mod:`dllm.core.static`).
        """
        temperature, max_length = compat.translate(transformers_arguments, temperature, max_new_tokens)
        run = self.prepare(
            model,
            prompt,
            steps=steps,
            steps_per_block=steps_per_block,
            max_new_tokens=max_new_tokens,
            block_size=block_size,
            temperature=temperature,
            attention_mask=attention_mask,
            seed=seed,
            eos_early_stop=eos_early_stop,
            cache=cache,
            history=history,
            callback=callback,
            max_length=max_length,
            kernel=kernel,
            compile=compile,
            static_shapes=static_shapes,
        )
        with torch.inference_mode():
            self.run(run)
        return self.finish(run)

    def prepare(
        self,
        model,
        prompt,
        *,
        steps=None,
        steps_per_block=None,
        max_new_tokens=None,
        block_size=None,
        temperature=0.0,
        attention_mask=None,
        seed=None,
        eos_early_stop=True,
        cache="default",
        history=False,
        callback=None,
        max_length=None,
        kernel="auto",
        compile=False,
        static_shapes=False,
    ) -> Run:
        """Validate everything and build the :class:`~dllm.core.run.Run` (arguments as :meth:`generate`;
        ``max_length``: prompt width + generation, transformers' meaning, instead of ``max_new_tokens``)."""
        started = time.perf_counter()
        model = _model(model)
        model.check_usable()
        self.check_drives(model)
        temperature = params.check_value("temperature", temperature, float, params.Accepts(">= 0", note="0 = greedy"))
        params.check_value("seed", seed, int | None, params.Accepts(note="None: from torch's global seed"))
        for key, value in (("eos_early_stop", eos_early_stop), ("history", history), ("static_shapes", static_shapes)):
            params.check_value(key, value, bool)
        if callback is not None and not callable(callback):
            raise ConfigError(
                f"callback must be a function called with each step's StepInfo (dllm.core.loop.StepInfo), or None; "
                f"got {callback!r}"
            )
        kernel = resolve_kernel(kernel, model.device)
        if not model.eos_ids:
            _decode_without_eos(model)
        ids, mask = prompts.encode(model, prompt, attention_mask)
        if max_length is not None:
            max_new_tokens = max_length - ids.shape[1]
            if max_new_tokens < 1:
                raise ConfigError(
                    f"max_length={max_length} leaves no room after the {ids.shape[1]}-token prompt (max_length counts "
                    "the prompt, as in transformers); use max_new_tokens for the generated length"
                )
        g, bs, spb = self.plan(model, ids.shape[1], max_new_tokens, block_size, steps, steps_per_block)
        canvas = Canvas.build(model, ids, mask, g, bs)
        run = Run(
            model=model,
            canvas=canvas,
            temperature=float(temperature),
            steps_per_block=spb,
            eos_early_stop=eos_early_stop and bool(model.eos_ids),  # without an EOS id: the whole span
            rng=CounterRNG(seed, keys=prompts.repeats(ids, mask)),  # draws follow the prompt, not its row
            cache=resolve_cache(cache, lambda: self.default_cache(model)),
            history=[] if history else None,
            callback=callback,
            started=started,
            kernel=kernel,
            compile=compiled.check(compile),
            static_shapes=static_shapes or compiled.captures(compiled.check(compile)),
        )
        self.check_run(run)
        if run.static_shapes and type(self).run is not Sampler.run:
            raise ConfigError(
                f"static_shapes (which compile={compiled.CAPTURE!r} turns on) applies to the shared denoising loop; "
                f"the {self.name or type(self).__name__!r} sampler runs a loop of its own. Use static_shapes=False "
                "and compile=True or a backend name"
            )
        if run.cache is not None:
            run.cache.check_run(run)
        return run

    def run(self, run: Run) -> None:
        """Fill the canvas: the shared loop. Samplers with a loop of their own override this."""
        denoise(run, self)

    def finish(self, run: Run) -> Generation:
        """The :class:`~dllm.core.generation.Generation` of a finished run (the one accounting)."""
        canvas, model = run.canvas, run.model
        tokens = count_generated(canvas.tokens, canvas.prompt_width, model.eos_ids, model.mask_id, canvas.valid)
        return Generation(
            sequences=canvas.tokens,
            texts=decode(model, canvas),
            nfe=run.nfe,
            tokens=tokens.tolist(),
            seconds=time.perf_counter() - run.started,
            prompt_width=canvas.prompt_width,
            history=run.history,
            kernel=run.kernel,
            kernel_calls=dict(run.kernel_calls),
            select_calls=dict(run.select_calls),
        )

    def settings(self) -> dict:
        return dataclasses.asdict(self)


def _model(model):
    """``model`` itself, or the model a bundled name or checkpoint directory names (loaded with the defaults
    of :func:`dllm.load`); anything else is a ConfigError saying what to pass."""
    if isinstance(model, (str, os.PathLike)):
        from dllm.models.loading import BUNDLED, load

        if str(model) in BUNDLED or Path(model).is_dir():
            return load(model)
        raise ConfigError(
            f"model {str(model)!r} is neither a bundled model ({', '.join(BUNDLED)}) nor a checkpoint directory: "
            f"load it once with model = dllm.load({str(model)!r}) (a hub id is downloaded) and pass that model"
        )
    if not callable(getattr(model, "check_usable", None)):
        raise ConfigError(
            f"model must be a model loaded with dllm.load(...) (a bundled name such as 'tiny-llada', a checkpoint "
            f"directory or a hub id), got {type(model).__name__}"
        )
    return model


_WARNED_NO_EOS: weakref.WeakSet = weakref.WeakSet()  # the models whose missing EOS id was said


def _decode_without_eos(model) -> None:
    """Once per model: a model without an EOS id (none in its ``config.json``, ``generation_config.json`` or
    tokenizer: base checkpoints, checkpoints saved without the field) decodes every row to ``max_new_tokens``,
    as transformers' ``generate`` and the official engines do; it needs a pad id to lay out its canvas."""
    if model.pad_id is None:
        raise ModelError(
            f"{model.family} model has neither an EOS nor a pad token id, so its canvas cannot be padded: set "
            "pad_token_id (and eos_token_id, if the model has one) in config.json"
        )
    if model in _WARNED_NO_EOS:
        return
    _WARNED_NO_EOS.add(model)
    name = model.name_or_path or f"this {model.family} model"
    warnings.warn(
        f"{name} has no EOS token id (none in its config.json, generation_config.json or tokenizer): every "
        "generation runs to max_new_tokens, with no early stop, and its text is not cut. If the model has one, set "
        "eos_token_id in config.json or generation_config.json",
        DllmWarning,
        stacklevel=4,
    )


def decode(model, canvas: Canvas) -> list[str] | None:
    """The generated part of each row, cut at the first EOS, special tokens removed."""
    if model.tokenizer is None:
        return None
    eos = set(model.eos_ids)
    texts = []
    for row, valid in zip(
        canvas.tokens[:, canvas.prompt_width :].tolist(), canvas.valid[:, canvas.prompt_width :].tolist()
    ):
        ids = []
        for t, v in zip(row, valid):
            if not v or t in eos:
                break
            ids.append(t)
        texts.append(model.tokenizer.decode(ids, skip_special_tokens=True))
    return texts
