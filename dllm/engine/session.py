"""One generation, from its arguments to its :class:`~dllm.engine.generation.Generation` (DESIGN §3).

``sampler.generate(model, prompt, ...)`` is :func:`prepare` -> :func:`decode` -> :func:`result`. The lifecycle is
written here once, whatever the decoding process:

- :func:`prepare`: every argument checked before any forward, the prompts encoded, the :class:`Geometry`
  resolved (:mod:`dllm.core.geometry`), the canvas laid out, the random streams keyed, the cache chosen; the
  :class:`~dllm.engine.run.Run` that the rest reads;
- :func:`decode`: the sampler's decoding process (:mod:`dllm.engine.process`) driven step by step: the cache
  started (its K/V store allocated once) and dropped at the end, the hard cap, the history, the callback;
- :func:`result`: the one accounting (forwards, tokens up to the first EOS, seconds, texts).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
import weakref
from pathlib import Path

import torch

from dllm import constraints
from dllm.constraints import template as templates
from dllm.core import geometry, params
from dllm.core.errors import ConfigError, DllmError, DllmWarning
from dllm.core.registry import Registry
from dllm.core.rng import CounterRNG
from dllm.engine import compiled, device, prompts
from dllm.engine.canvas import Canvas
from dllm.engine.draft import Drafting
from dllm.engine.edit import Editing
from dllm.engine.generation import Generation, count_generated
from dllm.engine.loop import Masked, StepInfo
from dllm.engine.order import Order
from dllm.engine.renoise import Renoising
from dllm.engine.run import Run
from dllm.engine.stream import Stream

PROCESSES = Registry("decoding process")
PROCESSES.register(Masked)
PROCESSES.register(Stream)
PROCESSES.register(Editing)
PROCESSES.register(Renoising)
PROCESSES.register(Drafting)


def prepare(
    sampler,
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
    eos_early_stop=None,
    cache="default",
    history=False,
    callback=None,
    max_length=None,
    kernel="auto",
    compile=False,
    static_shapes=False,
    draws=None,
    constraint=None,
    template=None,
    hyper_parameters=None,
) -> Run:
    """Validate everything and build the :class:`~dllm.engine.run.Run` (arguments as ``Sampler.generate``;
    ``max_length``: prompt width + generation, transformers' meaning, instead of ``max_new_tokens``)."""
    from dllm.caches import resolve as resolve_cache
    from dllm.kernels.dispatch import resolve as resolve_kernel

    started = time.perf_counter()
    model = _model(model)
    model.check_usable()
    sampler.check_drives(model)
    temperatures = _row_temperatures(sampler, temperature) if isinstance(temperature, (list, tuple)) else None
    if temperatures is not None:
        temperature = max(temperatures)
    temperature = params.check_value("temperature", temperature, float, params.Accepts(">= 0", note="0 = greedy"))
    if temperature > 0 and not sampler.takes_temperature:
        raise ConfigError(
            f"the {sampler.name!r} sampler's temperatures are its own schedule; generate's temperature={temperature} "
            "does not apply: leave it at 0 (the sampler's fields set its temperatures)"
        )
    if not isinstance(seed, (list, tuple)):
        params.check_value("seed", seed, int | None, params.Accepts(note="None: from torch's global seed"))
    eos_rows = _row_eos(sampler, eos_early_stop) if isinstance(eos_early_stop, (list, tuple)) else None
    if eos_rows is not None:
        eos_early_stop = any(eos_rows)
    params.check_value("eos_early_stop", eos_early_stop, bool | None, params.Accepts(note="None: the sampler's own"))
    for key, value in (("history", history), ("static_shapes", static_shapes)):
        params.check_value(key, value, bool)
    if eos_early_stop is None:
        eos_early_stop = sampler.default_eos_early_stop()
    if callback is not None and not callable(callback):
        raise ConfigError(
            f"callback must be a function called with each step's StepInfo (dllm.engine.loop.StepInfo), or None; "
            f"got {callback!r}"
        )
    if draws is not None and sampler.process != Renoising.name:
        raise ConfigError(
            f"draws= replays another implementation's random numbers in the {Renoising.name!r} decoding process "
            f"(DiffusionGemma's entropy_bound); the {sampler.name or type(sampler).__name__!r} sampler draws from "
            "seed= (its counter-based streams)"
        )
    if draws is not None and not all(callable(getattr(draws, name, None)) for name in ("tokens", "sample")):
        raise ConfigError(
            f"draws must have tokens(rows, blocks, steps) and sample(probs, rows, blocks, steps) methods "
            f"(dllm.engine.renoise.Draws), got {type(draws).__name__}"
        )
    kernel = resolve_kernel(kernel, model.device)
    if not model.eos_ids:
        _decode_without_eos(model)
    ids, mask = prompts.encode(model, prompt, attention_mask)
    lengths = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else None
    if lengths is not None:
        _check_row_lengths(lengths, ids.shape[0], max_length, template)
    if eos_rows is not None and len(eos_rows) != ids.shape[0]:
        raise ConfigError(
            f"eos_early_stop as a list takes one value per prompt: {ids.shape[0]} prompts, got {len(eos_rows)}"
        )
    if temperatures is not None and len(temperatures) != ids.shape[0]:
        raise ConfigError(
            f"temperature as a list takes one temperature per prompt: {ids.shape[0]} prompts, got {len(temperatures)}"
        )
    if max_length is not None:
        max_new_tokens = max_length - ids.shape[1]
        if max_new_tokens < 1:
            raise ConfigError(
                f"max_length={max_length} leaves no room after the {ids.shape[1]}-token prompt (max_length counts "
                "the prompt, as in transformers); use max_new_tokens for the generated length"
            )
    constraint, template = constraints.check_constraint(constraint), templates.check_template(template)
    if constraint is not None or template is not None:
        _check_structured(sampler, model, constraint, template)
    if template is not None:
        max_new_tokens = _template_length(model, template, max_new_tokens, block_size, sampler)
        eos_early_stop = False  # (a hole's EOS filler ends nothing)
    sizes = dict(block_size=block_size, steps=steps, steps_per_block=steps_per_block)
    if lengths is None:
        shape = geometry.resolve(model, sampler, ids.shape[1], max_new_tokens, **sizes)
    else:
        shape = geometry.resolve_rows(model, sampler, ids.shape[1], list(lengths), **sizes)
    _beyond_training(model, int(mask.sum(1).max()), shape.max_new_tokens)
    run = Run(
        model=model,
        canvas=Canvas.build(model, ids, mask, shape),
        geometry=shape,
        temperature=float(temperature),
        eos_early_stop=eos_early_stop and bool(model.eos_ids),  # without an EOS id: the whole span
        rng=_rng(seed, ids, mask),  # draws follow the prompt (and its seed), not its row
        cache=resolve_cache(cache, lambda: sampler.default_cache(model)),
        history=[] if history else None,
        callback=callback,
        started=started,
        kernel=kernel,
        compile=compiled.check(compile),
        static_shapes=static_shapes or compiled.captures(compiled.check(compile)),
        answer_width=_answer_width(shape, ids.device),  # a block tail past it is decoded, not answered
        draws=draws,
        template=template,
        temperatures=temperatures if temperatures is not None and len(set(temperatures)) > 1 else None,
    )
    if eos_rows is not None and len(set(eos_rows)) > 1 and template is None:
        run.eos_rows = torch.tensor(eos_rows, dtype=torch.bool, device=ids.device)
    if hyper_parameters is not None:
        run.row_settings = _row_settings(sampler, hyper_parameters, ids.shape[0], ids.device)
    if constraint is not None or template is not None:
        run.guard = templates.guard_for(model, run.canvas, constraint, template, run.answer_width)
        if template is not None:  # the template's text and the EOS past it, in every row's span from the start
            _write_template(run)
        run.guard.check_start(run.canvas.tokens, blank=sampler.process == "renoise")  # (its span: noise, no mask)
    sampler.check_run(run)
    if run.static_shapes and not issubclass(PROCESSES.get(sampler.process), Masked):
        raise ConfigError(
            f"static_shapes (which compile={compiled.CAPTURE!r} turns on) applies to the masked decoding process; the "
            f"{sampler.name or type(sampler).__name__!r} sampler runs the {sampler.process!r} process. Use "
            "static_shapes=False and compile=True or a backend name"
        )
    if run.cache is not None:
        run.cache.check_run(run)
    if run.static_shapes:
        run.why_not_on_device = device.why_not(run, sampler)
        run.device_step = run.why_not_on_device is None
        if run.device_step and compiled.captures(run.compile):  # the whole step is compiled, forward included
            run.hidden, run.score = model.hidden, None
    return run


def takes_row_temperatures(sampler) -> bool:
    """Whether rows of different temperatures share a run of ``sampler``, each sampling as alone: its temperature
    reaches only its scoring spec (asked at each row's), on a process that scores the batch's own rows."""
    process = PROCESSES.get(sampler.process)
    scores_its_rows = issubclass(process, Masked) and not issubclass(process, Drafting)
    return sampler.takes_temperature and sampler.per_row_temperatures and scores_its_rows


def _row_temperatures(sampler, temperatures) -> tuple[float, ...]:
    """``temperature`` as a list, one per prompt: each checked; a sampler that reads the temperature outside its
    scoring spec (or a decoding process that scores other rows than the batch's) refuses rows of different ones."""
    out = _per_row(
        sampler,
        temperatures,
        lambda i, t: params.check_value(f"temperature[{i}]", t, float, params.Accepts(">= 0", note="0 = greedy")),
        "temperature as a list takes one temperature per prompt",
        takes_row_temperatures(sampler),
        "reads the temperature beyond its scores (its {process} process or its own rule), so rows of different "
        "temperatures ({values}) would not sample as they do alone: give one temperature",
    )
    return tuple(float(t) for t in out)


def _per_row(sampler, values, check, what: str, takes: bool, refusal: str) -> tuple:
    """A setting given as a list, one per prompt: each entry ``check(i, value)``ed; rows of different values
    refused (``refusal``, with the sampler's process and the values) where the sampler does not ``takes`` them."""
    out = tuple(check(i, v) for i, v in enumerate(values))
    if not out:
        raise ConfigError(f"{what}, got an empty list")
    if len(set(out)) > 1 and not takes:
        reason = refusal.format(process=repr(sampler.process), values=sorted(set(out)))
        raise ConfigError(
            f"the {sampler.name or type(sampler).__name__!r} sampler {reason}, or generate them in separate calls"
        )
    return out


def _row_settings(sampler, values, rows: int, device) -> dict | None:
    """``hyper_parameters``: one dict per prompt of the sampler's ``per_row_fields``, each checked as the sampler
    checks its own; each field whose rows differ from the sampler's value, as a float64 tensor [B] (None: none)."""
    name = sampler.name or type(sampler).__name__
    if not isinstance(values, (list, tuple)) or len(values) != rows or not all(isinstance(v, dict) for v in values):
        raise ConfigError(
            f"hyper_parameters takes one dict per prompt ({rows} prompts) of the {name!r} sampler's per-row "
            f"hyper-parameters, got {values!r}"
        )
    given = set().union(*values)
    if given - set(sampler.per_row_fields):
        own = ", ".join(sampler.per_row_fields) or "none"
        raise ConfigError(
            f"the {name!r} sampler reads {sorted(given - set(sampler.per_row_fields))} as one value for the batch, "
            f"so rows cannot have their own (its per-row hyper-parameters: {own}): set them on the sampler "
            "(dllm.samplers.get(name, ...)), or generate the rows in separate calls"
        )
    rows_of = [dataclasses.replace(sampler, **v) for v in values]  # (each checked as the sampler's own)
    out = {}
    for field in sorted(given):
        column = [float(getattr(row, field)) for row in rows_of]
        if any(v != getattr(sampler, field) for v in column):
            out[field] = torch.tensor(column, dtype=torch.float64, device=device)
    return out or None


def takes_row_eos(sampler) -> bool:
    """Whether rows of different ``eos_early_stop`` share a run of ``sampler``, each stopping as alone: a process
    whose rows stop at their block walk's EOS check (:meth:`dllm.engine.step.Step.settle`), under a sampler that does
    not set the rule itself (``per_row_eos``)."""
    return issubclass(PROCESSES.get(sampler.process), Masked) and sampler.per_row_eos


def _row_eos(sampler, values) -> tuple[bool, ...]:
    """``eos_early_stop`` as a list, one per prompt (None: the sampler's own): each checked; a sampler or process
    that reads the rule as one refuses rows of different ones."""
    return _per_row(
        sampler,
        values,
        lambda i, v: (
            sampler.default_eos_early_stop()
            if v is None
            else params.check_value(f"eos_early_stop[{i}]", v, bool, params.Accepts(note="None: the sampler's own"))
        ),
        "eos_early_stop as a list takes one value per prompt",
        takes_row_eos(sampler),
        "reads eos_early_stop as one rule for the batch (its {process} process or its own EOS rule), so rows of "
        "different ones would not stop as they do alone: give one value",
    )


def _check_row_lengths(lengths, rows: int, max_length, template) -> None:
    """``max_new_tokens`` as a list: one per prompt, and neither ``max_length`` nor ``template`` beside it."""
    if len(lengths) != rows:
        raise ConfigError(
            f"max_new_tokens as a list takes one length per prompt: {rows} prompts, got {len(lengths)} lengths"
        )
    if max_length is not None or template is not None:
        given = "max_length" if max_length is not None else "template (which sets the length)"
        raise ConfigError(f"max_new_tokens as a list (one per prompt) and {given} do not go together: give one")


def _answer_width(shape, device) -> int | torch.Tensor:
    """The answer's columns after the prompt: max_new_tokens, or with rows of their own lengths each row's ([B])."""
    if shape.lengths is None:
        return shape.max_new_tokens
    return torch.tensor(shape.lengths, dtype=torch.long, device=device)


def _rng(seed, ids: torch.Tensor, mask: torch.Tensor) -> CounterRNG:
    """The run's random numbers: one ``seed`` for every row, or a list of one per prompt (each row then draws as
    its prompt alone with its seed: a prompt's repeats are counted among the rows with its seed)."""
    if not isinstance(seed, (list, tuple)):
        return CounterRNG(seed, keys=prompts.repeats(ids, mask))
    if len(seed) != ids.shape[0] or not all(
        s is None or (isinstance(s, int) and not isinstance(s, bool)) for s in seed
    ):
        raise ConfigError(
            f"seed as a list takes one integer (or None) per prompt: {ids.shape[0]} prompts, got {seed!r}"
        )
    seeds = CounterRNG(list(seed)).seed  # (None entries: fresh seeds)
    return CounterRNG(seeds, keys=prompts.repeats(ids, mask, groups=seeds))


def _check_structured(sampler, model, constraint, template) -> None:
    """Constraints and templates run on every decoding process."""
    if model.mask_id is None and sampler.process != "renoise":  # (the renoise process writes no mask)
        raise ConfigError(f"constraint= and template= need a mask token; this {model.family} model has none")


def _template_length(model, template, max_new_tokens, block_size, sampler) -> int:
    """The generation length of a template: its slots (its text's tokens and its holes), rounded up to the block
    grid when ``block_size`` is given (the extra slots hold EOS); a larger ``max_new_tokens`` is kept."""
    length = templates.slots(model.tokenizer, template) if model.tokenizer is not None else 0
    if max_new_tokens is not None and max_new_tokens < length:
        raise ConfigError(
            f"the template takes {length} slots (its text's tokens and its holes); max_new_tokens={max_new_tokens} "
            "is fewer: leave it out (the template's length) or give at least that"
        )
    if max_new_tokens is None:
        max_new_tokens = length
        if block_size is not None and sampler.grid_blocks and not model.attention.block_causal:
            max_new_tokens = -(-length // block_size) * block_size
    return max_new_tokens


def _write_template(run) -> None:
    """Each row's span from the start: the template's text where it has some, EOS past it."""
    canvas = run.canvas
    p = canvas.prompt_width
    for row, layout in enumerate(run.guard.layouts):
        fixed = [(i, t) for i, t in enumerate(layout.tokens) if t is not None]
        if fixed:
            columns = torch.tensor([p + i for i, _ in fixed], device=canvas.tokens.device)
            canvas.tokens[row, columns] = torch.tensor([t for _, t in fixed], device=canvas.tokens.device)


def decode(run: Run, sampler, *, count_rows: bool = False) -> torch.Tensor | None:
    """Fill the canvas of ``run`` with ``sampler``'s decoding process, counting forwards in ``run.nfe``; with
    ``count_rows``, returns each row's own forwards (:attr:`Decoding.row_nfe`: a row's NFE alone)."""
    decoding = Decoding(run, sampler, count_rows=count_rows)
    while decoding.step():
        pass
    decoding.end()
    return decoding.row_nfe


class Decoding:
    """A run being decoded, one step at a time (:func:`decode` drives it to its end): the cache started (its K/V
    store allocated once) and dropped at the end, the hard cap, the history, the callback. Between steps, rows may
    join the run and finished ones leave (:meth:`join`, :mod:`dllm.engine.join`: the server's continuous batching).

    row_nfe: long [B] each row's forwards, those it takes alone (:meth:`~dllm.engine.process.Process.row_forwards`:
    the steps it works in, an adaptive sampler's or a fixed schedule's with a quota), counted with ``count_rows``
    (None: not counted). capacity: the rows the cache's store holds (rows that join take the spare ones; default:
    the run's)."""

    def __init__(self, run: Run, sampler, *, count_rows: bool = False, capacity: int | None = None):
        self.sampler, self.capacity = sampler, capacity
        self._start(run)
        self.iteration = 0
        self.started = [0] * run.canvas.batch  # each row's first iteration
        self.oldest = 0  # the running rows' first (the hard cap counts from it)
        self.row_nfe = None
        if count_rows:
            self.row_nfe = torch.zeros(run.canvas.batch, dtype=torch.long, device=run.canvas.tokens.device)

    def _start(self, run: Run) -> None:
        """The process of ``run``, its cache started, its order counted."""
        self.process = process = PROCESSES.get(self.sampler.process)(run, self.sampler)
        canvas = run.canvas
        if run.cache is not None:
            run.cache_state = run.cache.start(run)
            if process.allocates_store and compiled.captures(run.compile):  # CUDA graphs replay at fixed addresses
                compiled.take_store(run.cache_state.kv, run.model, canvas.batch, canvas.length)
            elif process.allocates_store:  # once, at its final size (capacity: with rows for the rows that join)
                run.cache_state.kv.allocate(run.model, canvas.batch, canvas.length, self.capacity)
        run.order = None if run.model.mask_id is None else Order(canvas, run.model.mask_id)

    @property
    def run(self) -> Run:
        return self.process.run

    def step(self) -> bool:
        """One step (one forward, or the idle steps before one); False when every row is done."""
        process, run = self.process, self.run
        if not process.next_step():
            return False
        self.iteration += 1
        if self.iteration - self.oldest > process.hard_cap:
            raise DllmError(f"internal error: the {process.name} decoding process exceeded its hard step cap")
        order, canvas = run.order, run.canvas
        masked = None if order is None else order.before()
        working, forwards = None if self.row_nfe is None else process.working_rows(), run.nfe
        committed = process.take_step(self.iteration)
        if working is not None:
            self.row_nfe += process.row_forwards(working, run.nfe - forwards)
        if order is not None:
            order.after(masked)
        if run.history is not None or run.callback is not None:
            tokens, done, blocks = process.after_commit()
            if run.history is not None:
                run.history.append(tokens.clone())
            if run.callback is not None:
                run.callback(
                    StepInfo(self.iteration, run.nfe, tokens, committed, blocks, done.clone(), canvas.prompt_width)
                )
        return True

    def join(self, new: Run) -> torch.Tensor:
        """The unfinished rows and then the rows of ``new`` (a prepared run of the same sampler and settings, not
        started) decode on as one run (:func:`dllm.engine.join.join`); returns the kept rows' indices in the run
        before (the finished rows leave). Raises :class:`~dllm.engine.join.Unjoinable` (nothing changed) where
        they cannot."""
        from dllm.engine import join

        keep = (~self.process.done()).nonzero().squeeze(1)
        if keep.numel() == 0:  # every row is done: the new rows start a run of their own, counted on
            old, sampler = self.run, self.sampler
            why = join.why_not(new, sampler)
            if why is not None:
                raise join.Unjoinable(f"these rows cannot join the running batch: {why}")
            old.checks.now()  # (the finished run's last deferred checks)
            new.nfe, new.callback, new.started = old.nfe, old.callback, old.started
            old.cache_state = None
            self._start(new)
        else:
            join.join(self.process, new, keep)
        self.started = [self.started[i] for i in keep.tolist()] + [self.iteration] * new.canvas.batch
        self.oldest = min(self.started)
        if self.row_nfe is not None:
            fresh = torch.zeros(new.canvas.batch, dtype=torch.long, device=self.row_nfe.device)
            self.row_nfe = torch.cat([self.row_nfe.index_select(0, keep), fresh])
        return keep

    def end(self) -> None:
        """Once every row is done: the process's finish, the last history entry, the cache's state dropped."""
        process, run = self.process, self.run
        run.checks.now()
        process.finish()
        if run.history:  # what finish() wrote (an EOS fill) belongs to the last step's canvas
            run.history[-1] = run.canvas.tokens.clone()
        if run.cache_state is not None and compiled.captures(run.compile):  # the next captured run replays on it
            compiled.return_store(run.cache_state.kv, run.model)
        run.cache_state = None  # the cache's per-run state (its K/V store) dies with the run


def result(run: Run, rows: torch.Tensor | None = None) -> Generation:
    """The :class:`~dllm.engine.generation.Generation` of a finished run (the one accounting); ``rows`` [n]: of
    those rows only, finished (a run that rows join: :class:`Decoding`), its ``nfe`` the run's."""
    if rows is not None:
        rows = rows.to(run.canvas.tokens.device)
        width = run.answer_width
        arness = None if run.order is None else [run.order.arness()[i] for i in rows.tolist()]
        run = dataclasses.replace(
            run,
            canvas=run.canvas.rows(rows),
            answer_width=width.index_select(0, rows) if isinstance(width, torch.Tensor) else width,
            history=None,
            order=None,
        )
        out = result(run)
        out.arness = arness or out.arness
        return out
    canvas, model = run.canvas, run.model
    valid = canvas.valid
    if run.answer_width is not None:  # the block tail past max_new_tokens was decoded, not answered
        width = run.answer_width if isinstance(run.answer_width, int) else run.answer_width[:, None]
        valid = valid & (torch.arange(canvas.length, device=valid.device) < canvas.prompt_width + width)
    tokens = count_generated(canvas.tokens, canvas.prompt_width, model.eos_ids, model.mask_id, valid).tolist()
    written, fills = texts(model, canvas, valid), None
    answer = valid & (torch.arange(canvas.length, device=valid.device) >= canvas.prompt_width)
    ended = (torch.isin(canvas.tokens, run.eos) & answer).any(1).tolist()
    if run.template is not None:  # the filled template, each hole's content without its filler
        written, fills, tokens = templates.filled(run.guard, canvas.tokens)
        ended = [True] * len(ended)
    return Generation(
        sequences=canvas.tokens,
        texts=written,
        fills=fills,
        finish_reasons=["stop" if e else "length" for e in ended],
        arness=[None] * canvas.batch if run.order is None else run.order.arness(),
        nfe=run.nfe,
        tokens=tokens,
        seconds=time.perf_counter() - run.started,
        prompt_width=canvas.prompt_width,
        history=run.history,
        kernel=run.kernel,
        step_on_device=run.device_step,
        why_not_on_device=run.why_not_on_device,
        kernel_calls=dict(run.kernel_calls),
        select_calls=dict(run.select_calls),
        geometry=run.geometry,
    )


def generate(sampler, model, prompt, **arguments) -> Generation:
    """:func:`prepare`, :func:`decode` (without autograd), :func:`result`."""
    run = prepare(sampler, model, prompt, **arguments)
    with torch.inference_mode():
        decode(run, sampler)
    return result(run)


def texts(model, canvas: Canvas, valid: torch.Tensor | None = None) -> list[str] | None:
    """The generated part of each row (its ``valid`` columns, default the canvas's), cut at the first EOS, special
    tokens removed."""
    if model.tokenizer is None:
        return None
    eos = set(model.eos_ids)
    valid = canvas.valid if valid is None else valid
    out = []
    for row, real in zip(canvas.tokens[:, canvas.prompt_width :].tolist(), valid[:, canvas.prompt_width :].tolist()):
        ids = []
        for t, v in zip(row, real):
            if not v or t in eos:
                break
            ids.append(t)
        out.append(model.tokenizer.decode(ids, skip_special_tokens=True))
    return out


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


def _beyond_training(model, prompt: int, answer: int) -> None:
    """Warn where a generation leaves the lengths the model was trained on (``model.trained_lengths``, from its
    ``training.json``: the bundled tiny models were trained on prompts and answers of at most 40 tokens): a longer
    prompt, or, on a full-attention model (which reads the whole span in every forward, so its length is part of
    the input), a longer answer span. tiny-llada decodes ``Sort the list: 14 7 9`` as ``38 38 14`` at 256 new
    tokens; block-causal and causal models decode a block or window at a time and are not held to it."""
    trained = model.trained_lengths
    if trained is None:
        return
    name = model.name_or_path or f"this {model.family} model"
    past, advice = [], []
    if prompt > trained["max_prompt"]:
        past.append(f"a prompt of {prompt} tokens (trained on at most {trained['max_prompt']})")
        advice.append(f"prompts of at most {trained['max_prompt']} tokens")
    if model.attention.attends_everything and answer > trained["max_new_tokens"]:
        past.append(
            f"max_new_tokens={answer} (trained on answer spans of at most {trained['max_new_tokens']}; its full "
            "attention reads the whole span at every step)"
        )
        advice.append(f"max_new_tokens={trained['max_new_tokens']} or less")
    if past:
        warnings.warn(
            f"{name} was never trained on {' and never on '.join(past)}, so its answers there are unreliable (its "
            f"training.json): use {', and use '.join(advice)}",
            DllmWarning,
            stacklevel=5,
        )


_WARNED_NO_EOS: weakref.WeakSet = weakref.WeakSet()  # the models whose missing EOS id was said


def _decode_without_eos(model) -> None:
    """Once per model: a model without an EOS id (none in its ``config.json``, ``generation_config.json`` or
    tokenizer: base checkpoints, checkpoints saved without the field) decodes every row to ``max_new_tokens``,
    as transformers' ``generate`` and the official engines do; padding, where a batch needs it, is the model's
    :attr:`~dllm.models.base.DiffusionLM.filler_id` under the attention mask."""
    if model in _WARNED_NO_EOS:
        return
    _WARNED_NO_EOS.add(model)
    name = model.name_or_path or f"this {model.family} model"
    warnings.warn(
        f"{name} has no EOS token id (none in its config.json, generation_config.json or tokenizer): every "
        "generation runs to max_new_tokens, with no early stop, and its text is not cut. If the model has one, set "
        "eos_token_id in config.json or generation_config.json",
        DllmWarning,
        stacklevel=5,
    )
