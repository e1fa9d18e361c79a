"""Sampler base: hyper-parameters as frozen dataclass fields, policy hooks its decoding process calls.

A sampler is a per-step policy (DESIGN §3) of a decoding process (``process``: :mod:`dllm.engine.process`). The
masked process (:mod:`dllm.engine.loop`) calls
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
- ``selection(step, state)``: the sampler's selection rule when it is one of kernel B's
  (:class:`~dllm.kernels.selection.Rule`, declared once): the loop commits through the dispatch
  :func:`dllm.kernels.dispatch.select` (fused on the Triton backend), and the default ``select`` applies the same
  rule with the reference;
- ``select(step, state)``: which slots to commit (a bool [B, L] or a :class:`~dllm.engine.step.Decision`
  that may also override tokens and finish rows), for a sampler whose decision is not (always) a rule;
- ``forward_mask(step, state, plan)``: an attention pattern replacing the model's own for the loop's
  forward (default None: the model's).
- ``commit_span(step, state)``: slots beyond the current block that ``select`` may also commit (default
  None: the current block only; ETE's cross-block decoding widens it).
Exit rules and extra transforms attach to any sampler (:meth:`Sampler.with_exit`,
:meth:`Sampler.with_transforms`, :mod:`dllm.samplers.compose`). The stream process (:mod:`dllm.engine.stream`,
WeDLM) asks ``score_spec`` and ``select`` of its window. ``generate`` is the session
(:mod:`dllm.engine.session`): ``prepare`` (validation, geometry, prompts, canvas, random streams, cache) ->
``run`` (the process, step by step) -> ``finish`` (accounting); a sampler holds no part of that lifecycle.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core import params
from dllm.core.errors import ConfigError
from dllm.engine import compat, session
from dllm.engine.generation import Generation
from dllm.engine.run import Run
from dllm.kernels import selection
from dllm.kernels.reference import ScoreSpec
from dllm.kernels.selection import Rule


@dataclasses.dataclass(frozen=True)
class Sampler(params.HyperParameters):
    """Hyper-parameters are the fields, each declared with what it accepts (:func:`dllm.core.params.hp`) and
    checked when the sampler is built; checks across fields go in :meth:`check_hyper_parameters`."""

    name: ClassVar[str] = ""
    noun: ClassVar[str] = "sampler"
    fixed_steps: ClassVar[bool] = True  # True: each block takes exactly steps_per_block steps
    # an adaptive sampler whose rule reads its steps budget all the same (CCD: k = a block's length // its steps)
    reads_steps: ClassVar[bool] = False
    default_block: ClassVar[int | None] = 32  # None: the whole span is one block
    # True: blocks are the block_size grid, so max_new_tokens must be a multiple of block_size (and, for a fixed
    # schedule, steps split evenly over the blocks). False: the sampler sizes its blocks at run time (block_size
    # is the initial / fallback size, the last block may be shorter). Adaptive samplers (fixed_steps False) do
    # not use steps / steps_per_block.
    grid_blocks: ClassVar[bool] = True
    # the decoding process this sampler's policy runs on (dllm.engine.process): "masked" (masks decoded in place over
    # the canvas) or "stream" (WeDLM's causal window); the process says which attention kinds it drives
    process: ClassVar[str] = "masked"
    window: ClassVar[int | None] = None  # the stream process's window of slots (None: the masked process's blocks)
    # a block-causal model's steps per block when generate is given none, at most the block size (None: the block size,
    # one token per step)
    default_steps_per_block: ClassVar[int | None] = None
    # True: a block ends once it holds no mask, even under exit rules that check at every scheduled step (whose
    # official loops run a forward at each; LLaDA2's generate leaves a full block)
    leaves_full_blocks: ClassVar[bool] = False
    # True: ``eos_early_stop`` stops a row once a block it completed is all EOS (the model's first EOS id; FreeDave's
    # ``early_exit``); False: once a completed block holds an EOS it decoded (the same text, fewer forwards)
    stops_at_a_block_of_eos: ClassVar[bool] = False
    # False: the sampler's own schedule sets its temperatures (DiffusionGemma's entropy_bound, t_max -> t_min), so
    # generate's temperature must stay 0
    takes_temperature: ClassVar[bool] = True
    # False: the rule reads the generation length as one number (a share of it, the whole span's masks), so rows of
    # different max_new_tokens cannot share a run (generate(max_new_tokens=[...]) refuses them by name)
    per_row_lengths: ClassVar[bool] = True
    # False: the temperature shapes more than the scoring spec (``score_spec``, which the loop asks at each row's own
    # temperature), so rows of different temperatures cannot share a run (generate(temperature=[...]) refuses them)
    per_row_temperatures: ClassVar[bool] = True
    # False: the state is the batch's, so rows cannot join a running generation of this sampler between its steps
    # (dllm.engine.join: the server then decodes a batch to its end before the next starts)
    joins: ClassVar[bool] = True
    # False: the sampler sets the EOS rule itself (LLaDA2's official stop), so rows of different eos_early_stop cannot
    # share a run (generate(eos_early_stop=[...]) refuses them)
    per_row_eos: ClassVar[bool] = True
    # the hyper-parameters the rule reads as a tensor [B], so that rows may have their own (generate(
    # hyper_parameters=[...]): read them with :meth:`row_value`)
    per_row_fields: ClassVar[tuple[str, ...]] = ()
    # True (declared by the class itself, not inherited): every hook reads nothing back and is predicated (a done row,
    # or a row outside a hook's ``rows``, is left as it is), so that the static-shape steps run on the device with
    # one status read each (dllm.engine.device); :meth:`why_not_on_device` may still refuse a setting
    on_device: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        """Refuse, when it is defined, a sampler the loop cannot drive: one with a fixed schedule and a ``select``
        but no ``quota`` (it failed deep in the loop with a TypeError)."""
        super().__init_subclass__(**kwargs)
        decides = cls.select is not Sampler.select or cls.selection is not Sampler.selection
        concrete = decides and cls.process == "masked"
        if concrete and cls.fixed_steps is True and cls.quota is Sampler.quota:
            raise ConfigError(
                f"{cls.__name__} has a fixed schedule (fixed_steps = True, the default) but no quota(step, state), "
                "which says how many tokens each row commits at each step: implement quota (LLaDA's in "
                "dllm/samplers/confidence.py), or set fixed_steps: ClassVar[bool] = False when select decides how "
                "many to commit (docs/writing-samplers.md)"
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

    def why_not_on_device(self, run) -> str | None:
        """Why this setting of an ``on_device`` sampler must run its steps on the host (None: it need not)."""
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
        """The slots to commit; by default the rule of :meth:`selection` applied by the reference
        (:func:`dllm.kernels.selection.select`), so a sampler whose decision is a rule writes the rule alone."""
        rule = self.selection(step, state)
        if rule is None:
            raise NotImplementedError(f"{type(self).__name__} declares neither select nor a selection rule")
        return selection.select(rule, step.scores.prob, step.committable, step.quota)

    def selection(self, step, state) -> Rule | None:
        """The rule of kernel B (:mod:`dllm.kernels.selection`) this sampler's decision is at this step, applied to
        ``step.scores.prob`` with ``step.quota``; it must commit each working row's most confident slot
        (``top_k``: fixed-schedule samplers only, by their quota). None (the default): :meth:`select` decides."""
        return None

    def kernel_rule(self, step, state) -> Rule | None:
        """The rule the loop may commit by through the dispatch (fused): :meth:`selection`'s, unless ``select`` is
        overridden below the class that declares the rule (a subclass deciding for itself, as AdaBlock under
        Threshold), since the rule then no longer describes the decision."""
        return self.selection(step, state) if _rule_is_the_decision(type(self)) else None

    def row_forwards(self, state, working: torch.Tensor, forwards: int) -> torch.Tensor | None:
        """long [B]: of the last step's ``forwards`` (the loop's, and those this sampler made itself), those each row
        takes alone, for a sampler whose own forwards serve some rows only (S2D2's verifier); ``working``: the rows
        the loop's forward is theirs. None (the default): each working row takes them all."""
        return None

    def forward_mask(self, step, state, plan) -> torch.Tensor | None:
        """The attention mask (bool [n, 1, R, L]) of the loop's forward of ``step.active`` as ``plan`` computes
        it, replacing the model's own; None (the default) keeps the model's (S2D2's AR-like caching overrides)."""
        return None

    @property
    def exit_rules(self) -> tuple:
        return ()

    # -- composition ---------------------------------------------------------------------------
    # A sampler with exit rules or transforms attached: dllm.samplers.compose.Composed, itself a Sampler and so a
    # module above this one, which declares itself here when it loads (dllm.samplers loads it).
    _composition: ClassVar[type | None] = None

    def with_exit(self, *rules):
        """This sampler with early-exit rules attached (e.g. Prophet's)."""
        return self._composition(self, exits=rules)

    def with_transforms(self, *transforms):
        """This sampler with more logit transforms after its own (e.g. CreditDecoding's boost)."""
        return self._composition(self, extra=transforms)

    # -- checks --------------------------------------------------------------------------------
    def check_drives(self, model) -> None:
        """Raise :class:`~dllm.core.errors.ConfigError` when this sampler cannot drive ``model``: the rule every
        sampler shares (its process drives the model's attention kind, ``Process.drives``), then
        :meth:`check_model`'s own. Needs no prompt: ``generate``, ``dllm bench`` (before it loads a model) and
        lm-eval ask it alike."""
        process = session.PROCESSES.get(self.process)
        if not process.drives(model.attention):
            from dllm.models import registry as families
            from dllm.models.attention import KINDS

            kinds = " or ".join(kind for kind in KINDS.values() if process.drives(kind))
            own = families.get(model.family).reference_sampler
            use = f"dllm.samplers.get({own[0]!r}), its family's own, or another" if own else "a"
            raise ConfigError(
                f"the {self.name or type(self).__name__!r} sampler decodes {kinds}-attention models (the "
                f"{self.process!r} decoding process); this {model.family} model has {model.attention} attention. Use "
                f"{use} sampler of the {model.attention.process!r} process"
            )
        self.check_model(model)

    def check_model(self, model) -> None:
        """Raise when this sampler cannot drive ``model`` (e.g. needs a block-causal model); a sampler's own
        rule, asked through :meth:`check_drives`."""

    def check_cache(self, model, cache) -> None:
        """Raise :class:`~dllm.core.errors.ConfigError` when this sampler cannot run on ``model`` with ``cache``
        (a cache object, or None for no cache). It needs no prompt: :meth:`check_run` asks it when a run is
        prepared, and ``dllm bench`` before it loads a model, so both ask the same question."""

    def row_value(self, step, name: str):
        """The hyper-parameter ``name`` (one of ``per_row_fields``) at ``step``: each row's, a tensor [B], where the
        run's rows have their own (``generate(hyper_parameters=[...])``), else the sampler's."""
        rows = getattr(getattr(step, "run", None), "row_settings", None)
        return getattr(self, name) if rows is None or name not in rows else rows[name]

    def default_eos_early_stop(self) -> bool:
        """``generate``'s ``eos_early_stop`` when the caller passes none: True (stop a row after the block holding
        its EOS, at no change to its text), unless the sampler's official code has its own EOS rule, which it then
        follows (``llada21``: its ``eos_early_stop`` hyper-parameter, off by default, decodes every block)."""
        return True

    def check_run(self, run: Run) -> None:
        """Raise when this sampler cannot run as prepared; by default: :meth:`check_cache` of the run's cache."""
        self.check_cache(run.model, run.cache)

    def default_cache(self, model):
        """The cache the model's attention kind names (``Attention.default_cache``): exact block K/V reuse on
        block-causal models, the stream's exact prefix on causal ones, none on full attention."""
        from dllm.caches import get

        return None if model.attention.default_cache is None else get(model.attention.default_cache)

    # -- entry point ---------------------------------------------------------------------------
    def generate(
        self,
        model,
        prompt,
        *,
        steps: int | None = None,
        steps_per_block: int | None = None,
        max_new_tokens: int | list[int] | None = None,
        block_size: int | None = None,
        temperature: float | list[float] = 0.0,
        attention_mask: torch.Tensor | None = None,
        seed: int | None | list = None,
        eos_early_stop: bool | None = None,
        cache="default",
        history: bool = False,
        callback=None,
        kernel: str = "auto",
        compile: bool | str = False,
        static_shapes: bool = False,
        draws=None,
        constraint=None,
        template=None,
        hyper_parameters: list[dict] | None = None,
        **transformers_arguments,
    ) -> Generation:
        """Generate continuations of ``prompt`` (text, texts, chat messages, or token ids).

        steps: total denoising steps over the generation (LLaDA / Dream meaning); must split evenly over
            the ``max_new_tokens / block_size`` blocks. steps_per_block: the same per block (SDAR meaning).
            Neither: one token per step. Adaptive samplers (``fixed_steps = False``: ``threshold``,
            ``localleap``, ``adablock``, ...), whose steps the data decides, do not use either (as their
            official code, which takes ``steps`` and ignores it).
        max_new_tokens: the generation length G; default: the checkpoint's ``generation_config.json``
            ``max_new_tokens`` (the bundled models ship one), else 128. A list gives each prompt its own, in one
            batch, each row decoded as it is alone with its length, where the rows' blocks and steps per block
            agree (no ``steps`` total, which the lengths would split differently; a ConfigError otherwise).
        temperature: 0 is greedy; > 0 samples with counter-based random numbers keyed by ``(seed, k, step,
            column offset)`` (:mod:`dllm.core.rng`), where k counts the earlier rows of the batch holding the
            identical prompt: a prompt samples the same tokens alone or at any index of any batch, repeated
            prompts sample differently, and different prompts with the same seed use the same numbers (as
            separate calls with that seed do). A list gives each prompt its own seed (None: fresh): each row
            samples as its prompt alone with its seed, in one batch. A list of temperatures gives each prompt its
            own, each row sampling (or greedy at 0) as it does alone, on the masked decoding process (a sampler
            whose rule reads the temperature beyond its scores refuses it by name).
        eos_early_stop: once a block holding EOS is complete, fill the rest of that row with EOS at no
            further cost; False decodes the whole span as the official samplers do (the text up to the
            first EOS is the same either way). None (the default): True, unless the sampler follows its official
            code's own EOS rule (:meth:`default_eos_early_stop`: ``llada21`` decodes every block, as its official
            ``eos_early_stop=False``). A model without an EOS id (none in its ``config.json``,
            ``generation_config.json`` or tokenizer) decodes the whole span, its texts uncut, with one warning.
        cache: "default" (the sampler's own: exact block K/V reuse for SDAR, none for full attention),
            None or "none", a cache name (``dllm.caches.names()``: "prefix", "dual", "dkv", ...) with its
            default hyper-parameters, or a cache object (``dllm.caches.get("dkv", cache_reloading_step=8)``).
        transformers' arguments: ``do_sample`` (False: temperature 0; True: temperature 1.0 unless given),
            ``max_length`` (prompt width + max_new_tokens) and ``num_beams=1`` are translated; anything else
            is refused with the dllm equivalent (:mod:`dllm.engine.compat`).
        kernel: the scoring backend (:mod:`dllm.kernels.dispatch`): "auto" (the fused Triton kernels on CUDA when
            triton imports, the PyTorch reference elsewhere), "torch" or "triton"; ``Generation.kernel`` says which
            ran.
        compile: True runs the model forward through ``torch.compile`` (inductor; a string names another
            backend, or ``"reduce-overhead"``: inductor capturing CUDA graphs, with ``static_shapes`` on), with the
            same tokens and forwards as eager (:mod:`dllm.engine.compiled`).
        static_shapes: True runs the loop's forward with the same shapes at every cached step of a phase (done
            rows kept in place, query widths bucketed), so that it compiles once per shape and can be captured
            as a CUDA graph; the same tokens, forwards and history as False (:mod:`dllm.engine.static`).
        draws: the renoise process only (DiffusionGemma): every random number of the run from this object instead
            of ``seed`` (:class:`dllm.engine.renoise.Draws`), to reproduce another implementation's run.
        constraint: what each row's text must match (:mod:`dllm.constraints`: ``Regex``, ``JsonSchema``, ``Json``,
            checked exactly at every step whatever the sampler's commit order, a constraint no text within
            ``max_new_tokens`` meets a ConfigError before the first forward; ``Grammar``, a context-free one, each
            row's text kept a prefix of a word, ``Generation.finish_reasons`` "length" where it ran out).
        template: ``[text, dllm.Hole(max_tokens), text, ...]``: the generated span is the template, its text fixed,
            each hole filled with at most its ``max_tokens`` tokens (``Generation.fills``); ``max_new_tokens``
            defaults to its length; on every decoding process (DiffusionGemma's renoise one keeps its text in
            every canvas, never renoised).
        hyper_parameters: one dict per prompt of the sampler's ``per_row_fields`` (the threshold of ``threshold``,
            ``fast_dllm_v2`` and ``llada2``, ``factor``'s factor): each row decodes as the sampler with those values
            does alone, in one batch (a field the sampler reads as one value for the batch is refused by name).
        """
        temperature, max_length = compat.translate(transformers_arguments, temperature, max_new_tokens)
        return session.generate(
            self,
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
            draws=draws,
            constraint=constraint,
            template=template,
            hyper_parameters=hyper_parameters,
        )

    def prepare(self, model, prompt, **arguments) -> Run:
        """Validate everything and build the :class:`~dllm.engine.run.Run` (arguments as :meth:`generate`;
        ``max_length``: prompt width + generation, transformers' meaning, instead of ``max_new_tokens``):
        :func:`dllm.engine.session.prepare`."""
        return session.prepare(self, model, prompt, **arguments)

    def run(self, run: Run) -> None:
        """Fill the canvas of a prepared run with this sampler's decoding process
        (:func:`dllm.engine.session.decode`)."""
        session.decode(run, self)

    def finish(self, run: Run) -> Generation:
        """The :class:`~dllm.engine.generation.Generation` of a finished run (:func:`dllm.engine.session.result`)."""
        return session.result(run)

    def settings(self) -> dict:
        return dataclasses.asdict(self)


_DECIDES: dict[type, bool] = {}  # class -> whether its rule is its decision (a plain dict: a traced step reads it)


def _rule_is_the_decision(cls) -> bool:
    """Whether ``cls.select`` is not overridden below the class declaring ``selection`` (asked at every step: once
    per class)."""
    if cls not in _DECIDES:
        owner = {name: next(c for c in cls.__mro__ if name in vars(c)) for name in ("select", "selection")}
        _DECIDES[cls] = owner["select"] is owner["selection"] or not issubclass(owner["select"], owner["selection"])
    return _DECIDES[cls]
