"""Rows joining a running generation between its steps (continuous batching: ``dllm serve``'s row scheduling).

A run of the masked process takes new rows at a step boundary (:func:`join`): their own run, prepared as each would
be alone (its prompt, length, temperature, seed), is laid out on the running canvas's columns (more left padding,
more padding past the spans: neither changes a row, DESIGN's batch invariance), and every per-row state becomes the
kept rows' followed by the new ones: the canvas, the random streams' keys, each row's length, temperature, EOS rule
and per-row hyper-parameters, the step's block walk and counters, the sampler's, its exit rules' and its logit
transforms' states, the order counters. Finished rows leave at the same time. A row then takes the steps it takes
alone: its block walk, its step counters and its random draws (keyed by its seed, its key, its own step count and its
column offset) are its own, so its tokens are those of ``generate()`` of it alone, and so are its forwards
(:attr:`Decoding.row_nfe`).

A cache's state joins the same way, and its store keeps the running rows' K/V and takes the new rows in its spare rows
(:meth:`~dllm.models.kv.KVStore.extend`), where their first forward computes their prefix; the block cache's prefill
is the batch's, so a join makes it run once more for every row (exact: finished blocks' K/V do not change).

The edit process (LLaDA2.1) and the draft process (FreeDave) join as the masked one does, with their own per-row
state (:meth:`~dllm.engine.loop.Masked.joined_rows`): each row's block kept open for edits; each row's carried
predictions (a new row has none: it is refreshed in the others' drafts forward, as a row entering its block is).

What cannot join says why (:func:`why_not`): another decoding process, a cache that does not declare ``joins``
(Elastic-Cache's), static shapes, constraints, a sampler whose rule reads the whole canvas (``per_row_lengths``
False) or that declares ``joins = False``. A state joins field by field: a tensor whose first dimension is the
batch's is per row (told from the state of the joined run, built alongside, whose batch differs from both);
anything else must be equal in both runs, else the join is refused (:class:`Unjoinable`) and nothing changes.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from dllm.core.errors import DllmError
from dllm.core.geometry import Geometry
from dllm.core.rng import CounterRNG
from dllm.engine.canvas import Canvas
from dllm.engine.draft import Drafting
from dllm.engine.edit import Editing
from dllm.engine.loop import Masked, Scorer
from dllm.engine.order import Order
from dllm.engine.run import Run
from dllm.engine.step import Step

# the step's per-row state: block bounds, block count, step counters, done and entering flags
_STEP_ROWS = ("start", "end", "block", "step", "t", "done", "entering")
# the processes whose state is the masked process's and per-row state of their own (Masked.joined_rows)
_JOINS = (Masked.name, Editing.name, Drafting.name)


class Unjoinable(DllmError):
    """These rows cannot join this run (the run is left as it was)."""


def why_not(run: Run, sampler) -> str | None:
    """Why rows cannot join ``run`` of ``sampler`` between its steps (None: they can)."""
    name = sampler.name or type(sampler).__name__
    if sampler.process not in _JOINS:
        return f"the {sampler.process!r} decoding process keeps state of its own"
    if run.cache is not None and not run.cache.joins:
        return f"the {run.cache.name!r} cache's state is the batch's"
    if run.static_shapes:
        return "static shapes (and compile='reduce-overhead') keep the batch's rows fixed"
    if run.guard is not None or run.template is not None:
        return "constraints and templates check the batch's canvas"
    if run.history is not None:
        return "history records whole canvases"
    if not sampler.per_row_lengths:
        return f"the {name!r} sampler's rule reads the whole span, which joined rows widen"
    if not sampler.joins:
        return f"the {name!r} sampler's state is the batch's"
    stuck = [type(t).__name__ for t in sampler.transforms(run) if not getattr(t, "joins", True)]
    if stuck:
        return f"the {name!r} sampler's logit transform {stuck[0]} keeps the batch's state"
    return None


def fits(running: Run, new: Run, sampler) -> str | None:
    """Why ``new``'s rows do not fit ``running``'s canvas (None: they fit): the same model, cache, kernel and compile
    settings, block grid and steps, EOS rule (unless ``sampler`` takes one per row), a prompt no wider and spans no
    longer than the running canvas holds."""
    if new.model is not running.model:
        return "another model"
    for name in ("cache", "kernel", "compile", "static_shapes", "draws"):
        if getattr(new, name) != getattr(running, name):
            return f"another {name} ({getattr(new, name)!r} against {getattr(running, name)!r})"
    if running.geometry.grid != new.geometry.grid or running.canvas.block_size != new.canvas.block_size:
        return f"another block grid ({new.geometry.grid} against {running.geometry.grid})"
    mixed_eos = running.eos_rows is not None or new.eos_rows is not None or running.eos_early_stop != new.eos_early_stop
    if mixed_eos and not sampler.per_row_eos:  # (the masked process stops each row by its own rule)
        return "another eos_early_stop"
    if new.canvas.prompt_width > running.canvas.prompt_width:
        return f"a prompt of {new.canvas.prompt_width} columns (the running canvas holds {running.canvas.prompt_width})"
    room = running.canvas.length - running.canvas.prompt_width
    if new.canvas.length - new.canvas.prompt_width > room:
        return f"a span of {new.canvas.length - new.canvas.prompt_width} columns (the running canvas holds {room})"
    return None


def widened(run: Run, prompt_width: int, length: int) -> Run:
    """``run`` (prepared, not started) on a canvas of ``prompt_width`` prompt columns and ``length`` in all (at least
    its own: :meth:`~dllm.engine.canvas.Canvas.widened`), so that rows of wider prompts or longer spans may join it."""
    prompt_width, length = max(prompt_width, run.canvas.prompt_width), max(length, run.canvas.length)
    length = max(length, prompt_width + run.canvas.length - run.canvas.prompt_width)
    return dataclasses.replace(run, canvas=run.canvas.widened(run.model, prompt_width, length))


def join(process: Masked, new: Run, keep: torch.Tensor) -> Run:
    """The rows ``keep`` [k >= 1] of ``process``'s run followed by the rows of ``new`` (a prepared run of the same
    sampler and settings, not started): every per-row state joined, the process now decoding the joined run, which
    is returned. Raises :class:`Unjoinable` (``process`` untouched) where a state does not join."""
    old, sampler = process.run, process.sampler
    why = why_not(old, sampler) or why_not(new, sampler) or fits(old, new, sampler)
    if why is not None:
        raise Unjoinable(f"these rows cannot join the running batch: {why}")
    if keep.numel() < 1:
        raise ValueError("a join keeps at least one running row (else start the new run alone)")
    keep = keep.to(old.canvas.tokens.device)
    new = dataclasses.replace(new, canvas=new.canvas.widened(new.model, old.canvas.prompt_width, old.canvas.length))
    sizes = (old.canvas.batch, new.canvas.batch, keep.numel() + new.canvas.batch)
    run = _joined_run(old, new, keep, sampler)
    step = _joined_step(process.step, Step(new), run, keep)
    state = _merge(process.state, sampler.init_state(new), sampler.init_state(run), keep, sizes, "the sampler's state")
    exit_states = [
        _merge(mine, rule.init_state(new), rule.init_state(run), keep, sizes, f"the {type(rule).__name__} state")
        for rule, mine in zip(process.exits, process.exit_states)
    ]
    scorer = Scorer(run, sampler, process.exits)  # each row's temperature's spec
    scorer.states = [
        _merge(mine, t.init_state(new), fresh, keep, sizes, f"the {type(t).__name__} state")
        for t, mine, fresh in zip(scorer.transforms, process.scorer.states, scorer.states)
    ]
    cache_state = None
    if old.cache_state is not None:  # its per-row state (the store's rows: below, once nothing can fail)
        fresh, mine = old.cache.start(run), old.cache.start(new)
        cache_state = copy.copy(old.cache_state)
        for field in dataclasses.fields(fresh):
            if field.name in old.cache.batch_fields:  # as for a run that starts now
                setattr(cache_state, field.name, getattr(fresh, field.name))
            elif field.name != "kv":
                where = f"the {old.cache.name!r} cache's state"
                values = (getattr(part, field.name) for part in (old.cache_state, mine, fresh))
                setattr(cache_state, field.name, _merge(*values, keep, sizes, where))
    order = None
    if old.order is not None:
        order = Order(run.canvas, old.order.mask_id)
        none = torch.zeros(new.canvas.batch, dtype=torch.long, device=keep.device)
        order.filled = torch.cat([old.order.filled.index_select(0, keep), none])
        order.in_order = torch.cat([old.order.in_order.index_select(0, keep), none])
    run.order = order
    # (nothing above changed the running process: from here on it decodes the joined run)
    if cache_state is not None:  # the store's rows are the working rows': the kept ones to the front, then new ones
        cache_state.kv.keep(torch.searchsorted(process.step.active, keep))
        cache_state.kv.extend(new.canvas.batch)
        run.cache_state = cache_state
    process.joined_rows(keep, new.canvas.batch)
    process.run, process.step, process.scorer = run, step, scorer
    process.state, process.exit_states = state, exit_states
    process.greedy_fill = run.temperature > 0 and any(rule.fill == "argmax" for rule in process.exits)
    return run


def _joined_run(old: Run, new: Run, keep: torch.Tensor, sampler) -> Run:
    """The run of ``old``'s rows ``keep`` then ``new``'s: canvas, lengths, temperatures, EOS rules, per-row
    hyper-parameters, random keys; the rest (the forwards counted, the checks, the callback, the kernel counts) stays
    ``old``'s."""
    canvas = Canvas.joined(old.canvas.rows(keep), new.canvas)  # (new's canvas: widened to old's columns)
    kept = keep.tolist()

    def each(of):  # a setting per row of the joined run: the kept rows', then the new ones'
        values = [of(old), of(new)]
        values = [_each(v, r.canvas.batch) for v, r in zip(values, (old, new))]
        return [values[0][i] for i in kept] + values[1]

    lengths = each(lambda r: r.geometry.lengths or r.geometry.max_new_tokens)
    geometry = dataclasses.replace(
        old.geometry, max_new_tokens=max(lengths), lengths=tuple(lengths) if len(set(lengths)) > 1 else None
    )
    temperatures = each(lambda r: r.temperatures or r.temperature)
    stops = each(lambda r: r.eos_early_stop if r.eos_rows is None else r.eos_rows)
    settings = {}
    for field in sorted({*(old.row_settings or {}), *(new.row_settings or {})}):
        values = each(lambda r, f=field: (r.row_settings or {}).get(f, getattr(sampler, f)))
        settings[field] = torch.tensor(values, dtype=torch.float64, device=keep.device)
    widths = each(lambda r: r.answer_width)
    answer_width = None
    if any(w is not None for w in widths):
        spans = (canvas.span_end - canvas.prompt_width).tolist()
        answer_width = torch.tensor([s if w is None else w for w, s in zip(widths, spans)], device=keep.device)
    run = dataclasses.replace(
        old,
        canvas=canvas,
        geometry=geometry,
        temperature=max(temperatures),
        temperatures=tuple(temperatures) if len(set(temperatures)) > 1 else None,
        rng=_joined_rng(old.rng, new.rng, kept, old.canvas.batch, new.canvas.batch),
        answer_width=answer_width,
        order=None,
        scorer=None,
        eos_early_stop=any(stops),
        eos_rows=torch.tensor(stops, device=keep.device) if len(set(stops)) > 1 else None,
        row_settings=settings or None,
    )
    return run


def _each(value, rows: int) -> list:
    """Each row's value of a setting given per row (a sequence or a tensor [B]) or for every row (anything else)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return list(value) if isinstance(value, (list, tuple)) else [value] * rows


def _joined_rng(old: CounterRNG, new: CounterRNG, kept: list[int], b_old: int, b_new: int) -> CounterRNG:
    """Each row's seed and key, as each run had them."""

    def rows(rng, b):
        seeds = rng.seed if isinstance(rng.seed, list) else [rng.seed] * b
        keys = list(range(b)) if rng.keys is None else rng.keys.tolist()
        return seeds, keys

    (seeds, keys), (new_seeds, new_keys) = rows(old, b_old), rows(new, b_new)
    return CounterRNG([seeds[i] for i in kept] + new_seeds, [keys[i] for i in kept] + new_keys)


def _joined_step(old: Step, new: Step, run: Run, keep: torch.Tensor) -> Step:
    """The step's per-row state of the kept rows then the new ones (who all work: the forward takes every row)."""
    step = Step(run)
    for name in _STEP_ROWS:
        setattr(step, name, torch.cat([getattr(old, name).index_select(0, keep), getattr(new, name)]))
    if old.keep_open is not None:  # (the edit process's blocks kept open for edits: none yet for the new rows)
        step.keep_open = torch.cat([old.keep_open.index_select(0, keep), torch.zeros_like(new.done)])
    step.may_finish, step.full_schedule, step.eos_block_ends = old.may_finish, old.full_schedule, old.eos_block_ends
    step.iteration = old.iteration
    return step


def _merge(old, new, fresh, keep: torch.Tensor, sizes: tuple[int, int, int], where: str):
    """``old`` (the running run's state, of its b_old rows) and ``new`` (the new run's, b_new rows) joined: the kept
    rows then the new ones. ``fresh`` is the same state made for the joined run (n = k + b_new rows, k >= 1): a
    tensor whose first dimension is b_old, b_new and n in the three is per row (a tensor of another kind has one size
    in all three, and n differs from b_new); anything else must be the same in both."""
    b_old, b_new, n = sizes
    if old is new:
        return old
    if isinstance(fresh, torch.Tensor) and isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if fresh.dim() and (fresh.shape[0], old.shape[0], new.shape[0]) == (n, b_old, b_new):
            if old.shape[1:] != new.shape[1:] or old.dtype != new.dtype:
                raise Unjoinable(f"these rows cannot join the running batch: {where} has rows of other shapes")
            return torch.cat([old.index_select(0, keep.to(old.device)), new])
        if old.shape == new.shape and old.dtype == new.dtype and torch.equal(old, new):
            return old
    elif isinstance(fresh, torch.nn.Module) and type(old) is type(new):
        return old  # (a loaded module: a sampler's trained filter)
    elif isinstance(fresh, Run | Step | Canvas):
        return fresh
    elif isinstance(fresh, (list, tuple)) and isinstance(old, type(fresh)) and isinstance(new, type(fresh)):
        if len(old) == len(new) == len(fresh):
            return type(fresh)(_merge(a, b, f, keep, sizes, where) for a, b, f in zip(old, new, fresh))
    elif isinstance(fresh, dict) and isinstance(old, dict) and isinstance(new, dict):
        if old.keys() == new.keys() == fresh.keys():
            return {k: _merge(old[k], new[k], fresh[k], keep, sizes, where) for k in fresh}
    elif dataclasses.is_dataclass(fresh) and type(old) is type(new) is type(fresh):
        out = copy.copy(old)
        for field in dataclasses.fields(fresh):
            value = _merge(
                getattr(old, field.name), getattr(new, field.name), getattr(fresh, field.name), keep, sizes, where
            )
            object.__setattr__(out, field.name, value)
        return out
    elif isinstance(fresh, (int, float, str, bool, type(None), Geometry, torch.device, torch.dtype, frozenset)):
        if _same(old, new):
            return old
    raise Unjoinable(f"these rows cannot join the running batch: {where} is not per row ({type(fresh).__name__})")


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError):
        return False
