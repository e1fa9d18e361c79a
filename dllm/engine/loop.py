"""The masked decoding process (DESIGN §3): masks decoded in place over the canvas, block after block
(LLaDA, Dream, SDAR and every sampler of the ``"masked"`` process; the session, :mod:`dllm.engine.session`, drives
it step by step).

Each row walks through its blocks on its own: a row whose block is complete moves to its next block (or
stops early at EOS) while the others go on, and rows that are done leave the forward batch (with
``static_shapes``, :mod:`dllm.engine.static`, they stay in it as padding and the query width is bucketed). One step:

1. one read-back of the step's flags (all done? a row entered a block? a row finished? deferred checks);
2. block-start hooks of the sampler, its logit transforms, its exit rules and the cache; the fixed-schedule
   quota;
3. one counted forward of the working rows, as the cache plans it;
4. scoring (:class:`Scorer`, through the dispatch :func:`dllm.kernels.score`) of the columns the sampler and
   its exit rules observe, after the stateful logit transforms; the LM head runs on those columns only;
5. the decision (:class:`~dllm.engine.step.Decision`): commits, token overrides, rows to finish;
6. the commit, the cache update, and the advance of finished blocks. A sampler whose decision is one of
   kernel B's rules (``Sampler.selection``), without exit rules or a wider ``commit_span``, decides and
   commits through the dispatch :func:`dllm.kernels.dispatch.select` (fused on the Triton backend).

Guarantees: commits land only in masked slots of the current block (or, for a finishing row, in its still-masked
slots; for a sampler declaring a wider ``commit_span``, also in masked slots of that span); committed tokens never
change, except after a row's first EOS, outside its text, where a sampler's ``Decision.truncate`` pads them with EOS
(DCD), or past the end an exit rule cuts a row's span at (EoTP); adaptive samplers commit at least one token per row
per forward; fixed-schedule samplers finish each block within ``steps_per_block`` steps; a hard step cap turns any
bug into an error, not a hang. A greedy step without a cache synchronises with the host once (twice for
fixed-schedule samplers, whose step may be skipped), whatever the batch size.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import DllmError, ModelError, NumericalError
from dllm.core.plan import Plan
from dllm.core.rng import Stream
from dllm.engine import compiled, static
from dllm.engine.device import DeviceSteps, finish_rows
from dllm.engine.process import Process
from dllm.engine.step import NO_OVERRIDE, Decision, Step
from dllm.kernels.dispatch import chosen, chosen_selector, score, select
from dllm.kernels.reference import SCORE_FIELDS, Scores, ScoreSpec, warp

_UNCOMPUTED = (
    "the cache's forward did not compute a column the step may commit (for Dream: or the column before it); "
    "a cache plan must compute every committable observed column and, when exit rules may finish rows, the "
    "masked span"
)
_UNREAD = (
    "the cache's forward did not compute a column an exit rule reads whatever its state (step.read_decoded; for "
    "Dream: or the column before it); a cache that does not plan with dllm.caches.base.needed must set "
    "computes_needed = False"
)
_NEVER = torch.iinfo(torch.long).max  # the idle steps of a row that is done (it takes no step)
_FILL = {"token": None, "argmax": None, "entropy": float("inf")}  # dense fill where a column is not scored


@dataclasses.dataclass
class StepInfo:
    """Passed to ``generate(callback=...)`` after each commit (``docs/steps.md``). The canvas holds each row's
    prompt, left-padded to ``prompt_width`` columns, then its generated span; slots not yet decoded hold the model's
    ``mask_id``. :meth:`decode` reads a row's span as text."""

    iteration: int  # the step's number, from 1 (a step with nothing to commit makes no forward and no call)
    nfe: int  # forwards so far
    tokens: torch.Tensor  # [B, L] canvas after the commit (the live canvas: clone it to keep it)
    committed: torch.Tensor  # [B, L] bool: slots written at this step
    block: torch.Tensor  # [B] the block each row decodes (0-based; WeDLM's streaming decoder: 0)
    done: torch.Tensor  # [B] bool: rows finished
    prompt_width: int = 0  # columns before the generated span

    def decode(self, model, row: int = 0, mask: str = "_") -> str:
        """Row ``row``'s generated span as text, each mask shown as ``mask``
        (:func:`dllm.engine.generation.decode_span`)."""
        from dllm.engine.generation import decode_span

        return decode_span(model, self.tokens[row], self.prompt_width, mask)


class Scorer:
    """The scoring seam of one generation (``run.scorer``): the LM head on chosen columns of chosen rows
    (:meth:`logits`), the stateful logit transforms (guidance, credit), then :func:`dllm.kernels.score` on the
    run's backend (``run.kernel``) with the sampler's :class:`~dllm.kernels.reference.ScoreSpec` and the
    random-number counters of the scored slots (:meth:`__call__`). Stateless transforms (temperature, top-k,
    top-p, suppressed ids) are spec fields: a transform that has ``fold`` (:mod:`dllm.samplers.transforms`) is
    folded into the spec instead of being run. Samplers that need logits themselves (AdaBlock's look-ahead,
    S2D2's verifier, guidance's unconditional pass) take them from :meth:`logits`, so the head runs in one place.
    Rows of their own temperatures (``run.temperatures``) are scored once per distinct temperature, with the spec the
    sampler asks at it, each row keeping its own (a batch of G temperatures scores G times; the forward once).
    """

    def __init__(self, run, sampler, exits):
        self.run = run
        transforms = [t for t in sampler.transforms(run) if not hasattr(t, "fold")]
        self.transforms = tuple(transforms)
        self.states = [t.init_state(run) for t in self.transforms]
        self._transformed = (
            f"the logit transforms ({', '.join(type(t).__name__ for t in self.transforms)}) turned finite logits into "
            "NaN or infinite ones: their scale (e.g. cfg_scale, credit_alpha) overflows the logits' dtype; lower it"
        )
        self.spec = spec = self._spec(run, sampler, exits)
        # rows of their own temperatures (generate(temperature=[...])): each distinct temperature's rows (bool [B]) and
        # the spec the sampler asks at that temperature (None: one temperature for every row)
        self.groups = None
        if run.temperatures is not None:
            device, temperatures = run.canvas.tokens.device, torch.tensor(run.temperatures, dtype=torch.float64)
            self.groups = []
            for t in sorted(set(run.temperatures)):
                view = copy.copy(run)  # the run as its rows at temperature t see it
                view.temperature = t
                self.groups.append(((temperatures == t).to(device), self._spec(view, sampler, exits)))
            need = frozenset().union(*(s.need for _, s in self.groups))  # every row's scores have the same fields
            self.groups = [(rows_of, s.merged(need)) for rows_of, s in self.groups]
            self.spec = spec = spec.merged(need)
        self._never: dict[tuple, torch.Tensor] = {}
        self.never_proposed(spec, run.model.device)  # (made here: a copy inside a step would synchronise)
        run.scorer = self

    @staticmethod
    def _spec(run, sampler, exits) -> ScoreSpec:
        """The sampler's spec at ``run``'s temperature, the stateless transforms folded in, the exit rules' needs."""
        spec = sampler.score_spec(run)
        for transform in sampler.transforms(run):
            if hasattr(transform, "fold"):
                spec = transform.fold(spec)
        for rule in exits:
            spec = spec.merged(rule.needs)
        return spec

    def never_proposed(self, spec, device) -> torch.Tensor:
        """The ids set to -inf before scoring (the mask id and ``spec.suppress``) as a tensor on ``device``, made
        once per set and device."""
        ids = (self.run.model.mask_id, *spec.suppress)
        key = (torch.device(device), ids)
        if key not in self._never:
            self._never[key] = torch.tensor(ids, dtype=torch.long, device=device)
        return self._never[key]

    def logits(self, step: Step, rows, columns, hidden, *, computed=None, spec=None, raw=False, warped=False):
        """Logits [n, K, V] of ``columns`` [n, K] of the batch rows ``rows`` [n] from their ``hidden`` states,
        the mask id and ``spec.suppress`` ids at -inf (``raw``: as the head gives them). NaN or infinite logits
        are reported at the loop's next read-back. computed: bool [n, K] the columns whose sources the forward
        computed (None: all), the others' logits zero. warped: the sampling distribution (``spec``'s warps
        applied), for samplers that need whole distributions (S2D2)."""
        run, model = self.run, self.run.model
        spec = spec or self.spec
        first = first_columns(run.canvas, rows) if model.shift else None  # (a row's first column reads itself)
        logits = model.head(hidden, columns, checks=run.checks, strict=computed is None, first=first)
        if computed is not None:
            logits = logits.masked_fill(~computed[..., None], 0.0)
        run.checks.add(
            ~torch.isfinite(logits).all(),
            NumericalError(
                "the model produced NaN or infinite logits; check the checkpoint weights and dtype "
                "(float16 overflows on some models: try bfloat16 or float32)"
            ),
        )
        if raw:
            return logits
        logits.index_fill_(-1, self.never_proposed(spec, logits.device), float("-inf"))
        if run.guard is not None:  # a masked slot's tokens that leave no completion of the constraint
            logits = run.guard.restrict(logits, rows, columns, step.tokens)
        return warp(logits, spec) if warped else logits

    def __call__(self, step: Step, rows, columns, hidden, spec=None, computed=None, allowed=None, **changes) -> Scores:
        """Scores [n, K] of ``columns`` [n, K] of the batch rows ``rows`` [n], from their ``hidden`` states, by
        ``spec`` (default: the sampler's, each row's at its own temperature) with ``changes`` (ScoreSpec fields).
        computed: bool [n, K] the columns whose sources the forward computed (None: all); the others get
        placeholder scores, which the caller discards. Logits that the stateful transforms made NaN or infinite (a
        slot without a finite logit) are reported at the loop's next read-back, as the model's are."""
        run = self.run
        groups = self.groups if spec is None else None
        spec = spec or self.spec
        if changes:
            spec = dataclasses.replace(spec, **changes)
            groups = groups and [(rows_of, dataclasses.replace(s, **changes)) for rows_of, s in groups]
        logits = self.logits(step, rows, columns, hidden, computed=computed, spec=spec)
        if allowed is not None:  # bool [..., V']: the tokens a slot may still take (a constraint's refill)
            keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            keep[..., : allowed.shape[-1]] = allowed.to(logits.device)
            logits = logits.masked_fill(~keep, float("-inf"))
        for transform, state in zip(self.transforms, self.states):
            logits = transform(logits, rows, columns, step, state)
        if self.transforms:  # what is scored: no NaN, no +inf, and some finite logit in every slot
            run.checks.add(~torch.isfinite(logits.amax(-1)).all(), NumericalError(self._transformed))
        if groups is None or len({s for _, s in groups}) == 1:
            return self._score(step, rows, columns, logits, spec if groups is None else groups[0][1])
        merged = None  # each row's scores at its own temperature (every spec's scores, kept where it is the row's)
        for rows_of, group_spec in groups:
            scores = self._score(step, rows, columns, logits, group_spec)
            if merged is None:
                merged = scores
                continue
            mine = rows_of.index_select(0, rows)
            for name in SCORE_FIELDS:
                value = getattr(scores, name)
                if value is not None:
                    shaped = mine.view(-1, *([1] * (value.dim() - 1)))
                    setattr(merged, name, torch.where(shaped, value, getattr(merged, name)))
        return merged

    def _score(self, step: Step, rows, columns, logits, spec) -> Scores:
        counters = None
        if spec.temperature > 0:
            run = self.run
            counters = run.rng.counters(Stream.TOKENS, rows, step.t[rows], columns - run.canvas.prompt_width)
        if spec.suppress:  # applied above, before the transforms
            spec = dataclasses.replace(spec, suppress=())
        return self.score(logits, spec, counters)

    def score(self, logits, spec, counters=None) -> Scores:
        """:func:`dllm.kernels.score` of ``logits`` [..., V] on the run's backend (scores shaped [...]; counters
        of the flattened slots), counted in ``run.kernel_calls``: for samplers with a loop of their own."""
        run = self.run
        flat = logits.reshape(-1, logits.shape[-1])
        backend = chosen(spec, flat, run.kernel)
        run.kernel_calls[backend] = run.kernel_calls.get(backend, 0) + 1
        if backend == "torch" and run.score is not None:  # compiled with the forward (static shapes)
            scores = run.score(flat, spec, counters)
        else:
            scores = score(flat, spec, counters, backend)
        for name in SCORE_FIELDS:
            value = getattr(scores, name)
            if value is not None:
                setattr(scores, name, value.reshape(logits.shape[:-1]))
        return scores


def first_columns(canvas, rows: torch.Tensor | None) -> torch.Tensor:
    """[n] the first real column of each of the canvas rows ``rows`` (None: every row): after its left padding."""
    first = canvas.prompt_width - canvas.prompt_lens
    return first if rows is None else first.index_select(0, rows)


def _place(step: Step, rows, columns, flat: Scores, computed=None) -> Scores:
    """Dense [B, L] scores from the flat ones of (rows, columns); -inf (+inf for entropy, the canvas token
    for tokens) where a column was not scored (or, ``computed`` False, not computed by a cached forward)."""
    dense = {}
    for name in SCORE_FIELDS:
        values = getattr(flat, name)
        if values is None:
            continue
        fill = _FILL.get(name, float("-inf"))
        if fill is None:
            out = step.tokens.clone()
            if computed is not None:
                values = torch.where(computed, values, out[rows[:, None], columns])
        else:
            out = torch.full(step.tokens.shape, fill, dtype=values.dtype, device=values.device)
            if computed is not None:
                values = values.masked_fill(~computed, fill)
        out[rows[:, None], columns] = values
        dense[name] = out
    return Scores(**dense)


class Masked(Process):
    """The masked decoding process (see the module docstring for the phases of a step)."""

    name: ClassVar[str] = "masked"

    def __init__(self, run, sampler):
        super().__init__(run, sampler)
        self.cache = run.cache
        self.step = Step(run)
        self.exits = tuple(rule for rule in sampler.exit_rules if rule.active)  # (inactive: the base alone)
        self.scorer = Scorer(run, sampler, self.exits)
        self.state = sampler.init_state(run)
        self.exit_states = [rule.init_state(run) for rule in self.exits]
        self.fixed = sampler.fixed_steps
        self.step.may_finish = bool(self.exits)  # a cache then computes the span at every forward
        # exit rules that check at every scheduled step (as the official loops, which run a forward at each)
        self.every_step = self.fixed and not sampler.leaves_full_blocks and any(rule.every_step for rule in self.exits)
        self.step.full_schedule = self.every_step
        self.step.eos_block_ends = sampler.stops_at_a_block_of_eos
        self.greedy_fill = run.temperature > 0 and any(rule.fill == "argmax" for rule in self.exits)
        canvas = run.canvas
        self.hard_cap = (canvas.length - canvas.prompt_width + 1) * (run.steps_per_block + 1) + 1
        self.shapes = static.Shapes(run) if run.static_shapes else None  # every row, bucketed widths
        self.device = DeviceSteps(self) if run.device_step else None  # one status read per step (engine/device.py)

    def take_step(self, iteration: int) -> torch.Tensor:
        self.step.iteration = iteration
        if self.device is not None:
            return self.device.take_step()
        self.forward()
        return self.commit()

    def finish(self) -> None:
        if self.device is not None:  # a captured step's state buffers, left for the next run (engine/device.py)
            self.device.release()

    def after_commit(self) -> tuple:
        if self.device is not None and self.device.after is not None:
            return self.device.after
        return super().after_commit()

    def blocks(self) -> torch.Tensor:
        return self.step.block.clone()

    def done(self) -> torch.Tensor:
        return self.step.done

    def joined_rows(self, keep: torch.Tensor, count: int) -> None:
        """Rows joined the run (:func:`dllm.engine.join.join`): this process's own per-row state becomes the rows
        ``keep`` [k] followed by ``count`` new rows, as they start (the masked process keeps none beyond the step's,
        the run's and the states the join merges)."""

    def working_rows(self) -> torch.Tensor:
        working = ~self.step.done
        if self.fixed and not self.every_step:  # a scheduled step is a row's own where it has a quota
            working = working & (self.step.quota > 0)
        return working

    def row_forwards(self, working: torch.Tensor, forwards: int) -> torch.Tensor:
        own = self.sampler.row_forwards(self.state, working, forwards)  # (a sampler's forwards of some rows)
        return super().row_forwards(working, forwards) if own is None else own

    def next_step(self) -> bool:
        """Advance finished blocks, read the step's flags back (once), and prepare the next forward; False
        when every row is done. Steps with nothing scheduled are taken here without a forward (a run of them at
        once: :meth:`_skip_idle_steps`)."""
        if self.device is not None:
            return self.device.next_step()
        step, run = self.step, self.run
        while True:
            self.settle_blocks()
            flags = [step.done.all(), step.entering.any(), step.done.index_select(0, step.active).any()]
            flags = torch.stack([torch.as_tensor(f).reshape(()) for f in flags + run.checks.flags()]).tolist()
            run.checks.verify(flags[3:])
            all_done, entering, shrink = flags[:3]
            if all_done:
                return False
            if shrink:
                self._drop_finished_rows()
            if entering:
                self.begin_blocks()
            if self.shapes is not None and (shrink or entering):
                self.shapes.new_phase()
            if self.fixed:
                self.schedule()
                if not self.every_step and not bool((step.quota > 0).any()):  # nothing scheduled: no forward
                    self._skip_idle_steps()
                    continue
            return True

    def settle_blocks(self) -> None:
        """Finished blocks advance (:meth:`Step.settle`), with the fixed schedule's check that none outlived its
        steps (read back later)."""
        step, run = self.step, self.run
        step.settle()
        if self.fixed:
            late = ((step.step >= run.steps_per_block) & ~step.done).any()
            run.checks.add(late, DllmError("internal error: a block holds masks after its last scheduled step"))

    def schedule(self, skip: bool = False) -> torch.Tensor:
        """The fixed schedule's quota of this step (``step.quota``); bool 0-d: whether the step has anything to
        commit (adaptive samplers: whether a row works). ``skip`` (the device step): when nothing is scheduled, the
        idle steps are taken now, predicated on the device (no read-back), and the quota taken again."""
        step = self.step
        working = (~step.done).any()
        if not self.fixed:
            return working
        step.quota = self._quota()
        if self.every_step:
            return working
        busy = (step.quota > 0).any()
        if skip:
            idle = (working & ~busy).long()
            count = self._idle_count() * idle
            step.step += (~step.done).long() * count
            step.t += (~step.done).long() * count
            step.quota = self._quota()
            busy = (step.quota > 0).any()
        return busy

    def _quota(self) -> torch.Tensor:
        step = self.step
        quota = self.sampler.quota(step, self.state)
        committable = step.committable.sum(1)
        if self.run.guard is not None:  # (a constraint may have left slots of earlier steps: the last takes them)
            quota = torch.where(step.step >= self.run.steps_per_block - 1, committable, quota)
        return torch.minimum(quota, committable).masked_fill(step.done, 0)

    def _idle_count(self) -> torch.Tensor:
        """0-d: the steps every working row takes at once at a step with nothing scheduled (at least one)."""
        step = self.step
        skip = self.sampler.idle_steps(step, self.state)
        if skip is None:
            return torch.ones((), dtype=torch.long, device=step.step.device)
        # never past a block's last step (it takes every mask)
        skip = torch.minimum(skip, self.run.steps_per_block - step.step).masked_fill(step.done, _NEVER)
        return skip.min().clamp(min=1)

    def _skip_idle_steps(self) -> None:
        """Take the steps with nothing scheduled from this one on, without a forward: as many at once as the
        sampler's schedule leaves idle in every working row (``Sampler.idle_steps``; one at a time when it cannot
        say), so that a schedule far longer than the generation costs a few iterations per commit, not one per
        step. Such a step computes, commits and records nothing: only the step counters move, as one by one."""
        step, working = self.step, (~self.step.done).long()
        working = working * self._idle_count()
        step.step += working
        step.t += working

    def _drop_finished_rows(self) -> None:
        """Finished rows stop working: they leave the forward batch and the K/V store is compacted (with static
        shapes, the forward and the store keep them in place: only the cache's own per-row state follows)."""
        step, canvas = self.step, self.run.canvas
        kept = (~step.done.index_select(0, step.active)).nonzero().squeeze(1)
        step.active = step.active.index_select(0, kept)
        if self.cache is not None:
            self.cache.keep(self.run.cache_state, kept, store=self.shapes is None)
        if step.valid is not None:
            step.valid = canvas.valid.index_select(0, step.active)
            if bool(step.valid.all()):
                step.valid = None

    def begin_blocks(self) -> None:
        """The block-start hooks of the rows entering a block (``step.entering``; every hook is predicated on its
        rows, so the device step calls them whether or not a row entered)."""
        step, rows = self.step, self.step.entering
        self.sampler.begin_block(step, self.state, rows)
        for transform, transform_state in zip(self.scorer.transforms, self.scorer.states):
            transform.begin_block(step, transform_state, rows)
        for rule, rule_state in zip(self.exits, self.exit_states):
            rule.begin_block(step, rule_state, rows)
        if self.cache is not None:
            self.cache.begin_block(step, self.run.cache_state, rows)
        step.entering = torch.zeros_like(rows)

    def forward(self) -> None:
        """One counted forward of the working rows, as the cache plans it, and the scores of the observed
        columns (dense in ``step.scores``)."""
        step, run = self.step, self.run
        rows = step.active
        columns = self.observed_columns()
        step.observed = columns  # a cache plans its forward to compute them (and, for Dream, their sources)
        step.read_decoded = self.read_decoded(columns)
        plan = self.cache.plan(step, run.cache_state) if self.cache is not None else Plan()
        run.refreshes += plan.refresh
        mask = self.sampler.forward_mask(step, self.state, plan)  # None: the model's own attention pattern
        if compiled.captures(run.compile):  # CUDA graphs: the last step's outputs are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        if self.shapes is not None:  # every row, the phase's query width (dllm.engine.static)
            step.hidden = self.shapes.forward(step, plan, mask)
        else:
            step.hidden = self._forward(plan, mask)
        if plan.commit is not None:  # the cache restricts this step's commit set
            allowed = plan.commit
            if rows.shape[0] != run.canvas.batch:
                allowed = torch.zeros_like(run.canvas.valid).index_copy_(0, rows, allowed)
            step.allowed = allowed
            step.touch()
        self.score(rows, columns, step.hidden)

    def observed_columns(self) -> torch.Tensor:
        """Columns [n, K] of the active rows to score at this step: the sampler's and its exit rules'."""
        step = self.step
        observed = [self.sampler.observe(step, self.state)]
        observed += [rule.observe(step, s) for rule, s in zip(self.exits, self.exit_states)]
        self._observed = observed
        return torch.cat([c for c in observed if c is not None], 1).index_select(0, step.active)

    def read_decoded(self, columns) -> torch.Tensor | None:
        """Those of the last :meth:`observed_columns` an exit rule reads whatever their state (None: none)."""
        decoded = [c for rule, c in zip(self.exits, self._observed[1:]) if c is not None and rule.reads_decoded]
        return torch.cat(decoded, 1).index_select(0, self.step.active) if decoded else None

    def _forward(self, plan: Plan, mask):
        """The forward of ``plan`` as it is: the working rows, the plan's query width."""
        step, run, canvas = self.step, self.run, self.run.canvas
        return run.forward(
            step.of_active(canvas.tokens),
            step.of_active(canvas.positions),
            step.valid,
            queries=plan.queries,
            keys=plan.keys,
            kv=None if self.cache is None else run.cache_state.kv,
            write=plan.write,
            observer=plan.observer,
            mask=mask,
            **({"start_layer": plan.start_layer, "row_start": plan.row_start} if plan.row_start is not None else {}),
        )

    def score(self, rows, columns, hidden) -> None:
        """The scores of the observed ``columns`` of the working ``rows`` from this step's forward ``hidden``."""
        step, run, canvas = self.step, self.run, self.run.canvas
        computed = run.model.computed(hidden, columns, first_columns(canvas, rows) if run.model.shift else None)
        if computed is not None:  # a cached forward: columns it did not compute are not scored
            missed = step.committable[rows[:, None], columns] & ~computed
            run.checks.add(missed.any(), ModelError(_UNCOMPUTED))
            if step.read_decoded is not None:
                unread = ~run.model.computed(step.hidden, step.read_decoded)
                run.checks.add(unread.any(), ModelError(_UNREAD))
        scores = self.scorer(step, rows, columns, hidden, computed=computed)
        step.scores = _place(step, rows, columns, scores, computed)
        step.scored = torch.zeros_like(canvas.valid)
        # (a device tensor, not a Python True: that would be a host copy at each step on CUDA)
        step.scored[rows[:, None], columns] = step.scored.new_ones(()) if computed is None else computed

    def commit(self) -> torch.Tensor:
        """The sampler's decision, the exit rules, the commit and the step's bookkeeping; the slots written."""
        step, run = self.step, self.run
        rule = None if self.exits or run.guard is not None else self.sampler.kernel_rule(step, self.state)
        if rule is not None and self.sampler.commit_span(step, self.state) is None:
            commit, working = self.commit_rule(rule), ~step.done
        else:
            commit, working = self.commit_decision()
        if self.cache is not None:
            self.cache.update(step, run.cache_state, commit)
        step.step += working.long()
        step.t += working.long()
        return commit

    def commit_rule(self, rule) -> torch.Tensor:
        """Kernel B: the commit of a sampler whose ``select`` is one of the fused rules (``selection``), by the
        dispatch on the run's backend, the proposals written into the canvas on the device (the per-row counts
        stay there). The rules commit each row's most confident slot (top-k: its fixed quota), so the
        progress guarantee of :meth:`commit_decision` holds without its extra pass."""
        step, run = self.step, self.run
        prob, committable = step.scores.prob, step.committable
        backend = chosen_selector(rule, prob, run.kernel)
        run.select_calls[backend] = run.select_calls.get(backend, 0) + 1
        commit, _ = select(rule, prob, committable, step.scores.token, run.canvas.tokens, step.quota, backend=backend)
        step.allowed = None
        step.touch()
        return commit

    def commit_decision(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler's ``select`` and the exit rules: the commit written into the canvas; returns (the slots
        written, the rows working before this step)."""
        step = self.step
        decision = self.sampler.select(step, self.state)
        if not isinstance(decision, Decision):
            decision = Decision(commit=decision)
        if decision.edit is not None:
            raise DllmError(
                f"the {self.sampler.name!r} sampler edits decoded tokens (Decision.edit), which the masked process "
                "never does: declare process = 'edit' (dllm.engine.edit)"
            )
        committable = step.committable
        allowed = committable
        span = self.sampler.commit_span(step, self.state)
        if span is not None:  # a sampler that may also commit beyond its block (ETE's cross-block decoding)
            allowed = committable | (span & step.masked & ~step.done[:, None])
        commit = decision.commit & allowed
        if not self.fixed:  # progress guarantee: at least one commit per working row (a slot scored: with a proposal)
            scored = committable & step.scored
            commit |= _best_slot(step, scored) & (scored.any(1) & ~commit.any(1))[:, None]
        if self.run.guard is not None:  # the commits that keep the constraint completable, in confidence order
            must = step.quota >= committable.sum(1) if self.fixed else None  # a block's last scheduled step
            commit, tokens = self.run.guard.accept(
                step.tokens, commit, self._proposals(decision.tokens), _confidence(step), must, self._refill
            )
            decision = dataclasses.replace(decision, tokens=tokens)
        finish = decision.finish  # the exit rules decide before this step's commit, as Prophet's does
        greedy = None  # rows finished by a rule that fills with the argmax (at temperature > 0)
        for rule, rule_state in zip(self.exits, self.exit_states):
            rule_finish = rule.check(step, rule_state, decision)
            finish = rule_finish if finish is None else finish | rule_finish
            if self.greedy_fill and rule.fill == "argmax":
                greedy = rule_finish if greedy is None else greedy | rule_finish
        self.write(commit, decision.tokens)
        working = ~step.done
        if decision.truncate is not None:
            commit = commit | self.truncate(decision.truncate & working)
        for rule, rule_state in zip(self.exits, self.exit_states):
            ends = rule.cut(step, rule_state, commit)
            if ends is not None:
                self.cut(torch.where(working, ends, self.run.canvas.span_end))
        if finish is not None:
            finish = finish & working
            if self.device is not None:  # predicated: no branch on the device's answer
                commit |= finish_rows(self, finish, decision, greedy)
                step.done |= finish
                step.touch()
            elif bool(finish.any()):
                commit |= _finish_rows(step, self.scorer, finish, decision, greedy, self._refill)
                step.done |= finish
                step.touch()
        return commit, working

    def truncate(self, rows: torch.Tensor) -> torch.Tensor:
        """Every slot of the span of ``rows`` (bool [B]) after the row's first EOS becomes the model's EOS token
        (:attr:`Decision.truncate`); returns the masked slots it filled (a cache counts them as decoded). No
        synchronisation."""
        step, canvas = self.step, self.run.canvas
        span = (step.columns >= canvas.prompt_width) & (step.columns < canvas.span_end[:, None])
        eos = torch.isin(canvas.tokens, self.run.eos) & span
        first = torch.where(eos.any(1), eos.long().argmax(1), canvas.span_end)
        after = rows[:, None] & span & (step.columns > first[:, None])
        filled = after & step.masked
        canvas.tokens.masked_fill_(after, self.run.model.eos_id)
        step.touch()
        return filled

    def cut(self, ends: torch.Tensor) -> None:
        """Each row's span ends at ``ends`` [B] (at most where it ended): the columns after leave the canvas (padding,
        outside every attention; they hold the EOS token, so a text ends there) and the current block ends there at
        the latest (an exit rule's :meth:`~dllm.samplers.compose.ExitRule.cut`, EoTP's). No synchronisation."""
        step, canvas = self.step, self.run.canvas
        ends = torch.minimum(ends, canvas.span_end)
        gone = (step.columns >= ends[:, None]) & (step.columns < canvas.span_end[:, None])
        canvas.tokens.masked_fill_(gone, self.run.model.eos_id)
        canvas.valid &= ~gone
        canvas.span_end = ends
        step.end = torch.maximum(torch.minimum(step.end, ends), step.start)
        step.valid = canvas.valid.index_select(0, step.active)
        step.touch()

    def _proposals(self, tokens: torch.Tensor | None) -> torch.Tensor:
        """This step's proposals with the decision's overrides (``NO_OVERRIDE``: the proposal)."""
        proposals = self.step.scores.token
        return proposals if tokens is None else torch.where(tokens != NO_OVERRIDE, tokens, proposals)

    def _refill(self, row: int, column: int, allowed: torch.Tensor) -> int:
        """The proposal of slot (``row``, ``column``) among the tokens ``allowed`` (bool [V]) only, from this step's
        forward (the same random numbers as its first proposal): a constraint's replacement of a commit that no
        longer fits where the step must commit the slot."""
        step = self.step
        rows = torch.tensor([row], device=step.tokens.device)
        hidden = step.hidden.select(step.active_rows(rows))
        columns = torch.tensor([[column]], device=step.tokens.device)
        return int(self.scorer(step, rows, columns, hidden, allowed=allowed[None, None], need=frozenset()).token[0, 0])

    def write(self, written: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """This step's proposals written into the canvas at ``written`` (bool [B, L]), ``tokens`` instead where it is
        not ``NO_OVERRIDE``; the step's commit restriction and derived state dropped."""
        step = self.step
        proposals = step.scores.token
        if tokens is not None:
            proposals = torch.where(tokens != NO_OVERRIDE, tokens, proposals)
        step.canvas.tokens.copy_(torch.where(written, proposals, step.canvas.tokens))
        step.allowed = None
        step.touch()


def _confidence(step: Step) -> torch.Tensor:
    """[B, L]: the order a constraint accepts a step's commits in: the proposals' probability (else their certainty:
    minus the entropy; else the column order)."""
    scores = step.scores
    if scores.prob is not None:
        return scores.prob
    if scores.entropy is not None:
        return -scores.entropy
    return -step.columns.expand(step.tokens.shape).to(torch.float32)


def _best_slot(step: Step, committable: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: each row's most confident committable slot (the leftmost without a confidence)."""
    confidence = step.scores.prob
    if confidence is None:
        confidence = torch.zeros(committable.shape, device=committable.device)
    floor = torch.finfo(confidence.dtype).min
    best = confidence.clamp(min=floor).masked_fill(~committable, float("-inf")).argmax(1)
    return step.columns == best[:, None]


def _finish_rows(
    step: Step, scorer: Scorer, finish: torch.Tensor, decision: Decision, greedy=None, refill=None
) -> torch.Tensor:
    """Fill every still-masked slot of the span of the ``finish`` rows with this step's proposals (scored
    now from the kept hidden states where they were not scored), or for the ``greedy`` rows (bool [B] or
    None) with this step's argmax; returns the slots written. When a cache had the forward compute only some
    columns and not the rows' masked span, the proposals come from one more (counted) forward of the
    finishing rows' canvas, this step's commits included."""
    canvas = step.canvas
    rows = finish.nonzero().squeeze(1)
    p, length = canvas.prompt_width, canvas.length
    columns = torch.arange(p, length, device=rows.device).expand(rows.shape[0], -1)
    hidden = step.hidden.select(step.active_rows(rows))
    computed = step.model.computed(hidden, columns)
    if computed is not None and bool((canvas.masked.index_select(0, rows)[:, p:] & ~computed).any()):
        # the cache's forward did not compute these rows' masked span (caches that plan for step.may_finish
        # do): one more counted forward of these rows
        valid = None if step.valid is None else canvas.valid.index_select(0, rows)
        hidden = step.run.forward(canvas.tokens.index_select(0, rows), canvas.positions.index_select(0, rows), valid)
        computed = None
    tokens = scorer(step, rows, columns, hidden, computed=computed, need=frozenset()).token
    if greedy is not None:  # the same logits, their argmax (temperature / top-p / top-k keep the argmax)
        argmax = scorer(step, rows, columns, hidden, computed=computed, need=frozenset(), temperature=0.0)
        tokens = torch.where(greedy.index_select(0, rows)[:, None], argmax.token, tokens)
    if decision.tokens is not None:
        override = decision.tokens.index_select(0, rows)[:, p:]
        tokens = torch.where(override != NO_OVERRIDE, override, tokens)
    fill = torch.zeros_like(canvas.tokens, dtype=torch.bool)
    fill[rows, p:] = canvas.masked.index_select(0, rows)[:, p:]
    written = torch.zeros_like(canvas.tokens)
    written[rows, p:] = tokens
    if step.run.guard is not None:  # every slot of a finishing row, one by one where they do not fit together
        must = torch.zeros_like(finish).index_fill_(0, rows, True)
        fill, written = step.run.guard.accept(canvas.tokens, fill, written, _confidence(step), must, refill)
    canvas.tokens.copy_(torch.where(fill, written, canvas.tokens))
    return fill
