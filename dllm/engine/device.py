"""The step on the device: one step of the masked process with nothing read back, and one read of its status.

On the static-shape path (``generate(static_shapes=True)``, which ``compile="reduce-overhead"`` turns on) a step of
the masked process (:mod:`dllm.engine.loop`) is one function of device state, :meth:`DeviceSteps.step`:

1. the forward of every row of the canvas, as the cache plans it (:meth:`~dllm.caches.base.Cache.demand`): its
   query columns picked on the device, the width chosen by the host (below); a done row computes a padding
   column and writes nothing;
2. the scoring, the selection and the commit (kernels A and B, or the sampler's own decision), the exit rules
   (a finishing row's masked span filled from the step's own forward, predicated: no branch on the device's
   answer), the cache's bookkeeping and the step counters;
3. the next step's preparation: finished blocks advance (EOS early stop included), the block-start hooks of the
   rows entering a block (every hook is predicated on its rows), the fixed schedule's quota, the steps it leaves
   idle taken at once (:meth:`~dllm.samplers.base.Sampler.idle_steps`), and the next forward's demand;
4. a small status tensor: every row done, whether the next step schedules anything, the next forward's widest
   row and whether it refreshes the cache, whether the working rows hold pads, and the deferred checks.

The host makes one read per step, of that status (:meth:`DeviceSteps.next_step`), and decides from it: stop, or
run the next step at the query width the status asks for (bucketed, :func:`dllm.engine.static.bucket`), with or
without the padding mask. So a step's shapes are data only through that choice: the block's start, the rows done,
the schedule are data, and one step function per (query width, mask) serves every block. Tokens, forwards,
history and callbacks equal the per-step loop's (the same hooks, in the same order, on the same values).

``compile="reduce-overhead"`` compiles the whole step (inductor, ``fullgraph=True``, the state it writes in place at
static addresses): one CUDA graph per (width, mask). Another ``compile=`` compiles the model's forward, as on the
per-step loop (its graphs shared by every sampler), the rest of the step running eagerly around it. A step run once
every row is done changes nothing: no commit, no K/V written, no counter moved.

What runs here (:func:`why_not` says otherwise, and :class:`~dllm.engine.generation.Generation` reports it:
``step_on_device`` and ``why_not_on_device``): samplers, exit rules and caches whose own class declares
``on_device = True`` (the reference samplers of the masked families, ``threshold``, ``factor``, ``localleap``,
``eb``, Prophet and SchED; no cache, ``prefix``, ``dual``, ``block``), with logit transforms that fold into the
scoring spec. Not here (the per-step loop runs them, with its reads): forwards of a sampler's own (guidance,
S2D2's verifier, AdaBlock's look-ahead), stateful logit transforms (credit), caches that plan on the host
(dKV, Window-Diffusion, Elastic-Cache), the edit process.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from dllm.caches.base import columns_of
from dllm.core.errors import DllmError, DllmWarning, ModelError
from dllm.engine import compiled
from dllm.engine.static import bucket

_UNFILLED = (
    "the cache's forward did not compute the masked span of a row that an exit rule finished: a cache on the device "
    "step must compute it when exit rules may finish rows (dllm.caches.base.needed)"
)


def why_not(run, sampler) -> str | None:
    """Why ``sampler`` with ``run``'s cache cannot run its steps on the device (None: it can). A part runs there
    when its own class declares ``on_device = True`` (a subclass that changes a hook declares it again)."""
    if sampler.process != "masked":
        return f"the {sampler.process!r} decoding process runs its steps on the host"
    if run.guard is not None:
        return "a constraint (or template) checks each step's commits on the host"
    base = getattr(sampler, "base", sampler)
    for part, noun in ((base, "sampler"), *((rule, "exit rule") for rule in sampler.exit_rules)):
        if not vars(type(part)).get("on_device", False):
            return f"the {part.name or type(part).__name__!r} {noun} decides on the host"
    reason = base.why_not_on_device(run)
    if reason is not None:
        return reason
    for transform in sampler.transforms(run):
        if not hasattr(transform, "fold"):  # (one that folds into the scoring spec runs in the scoring: Scorer)
            return f"the logit transform {type(transform).__name__} keeps state or runs forwards of its own"
    if run.cache is not None and not vars(type(run.cache)).get("on_device", False):
        return f"the {run.cache.name!r} cache plans its forwards on the host"
    return None


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the host chose for a step from the last status: the forward's query width (None: every column, no
    cache) and whether it masks pads."""

    width: int | None
    masked: bool


class DeviceSteps:
    """The device step of one run of the masked process ``process`` (a :class:`~dllm.engine.loop.Masked` whose
    run has ``device_step``): :meth:`next_step` reads the status and chooses the next step's :class:`Shape`,
    :meth:`take_step` runs the step function for it."""

    def __init__(self, process):
        self.process, self.run = process, process.run
        run = self.run
        self.status = None  # the status tensor the last step (or the first preparation) left
        self.shape: Shape | None = None
        self.after: tuple | None = None  # (tokens, done, blocks) after the last commit, for history and callback
        self.keep_after = run.history is not None or run.callback is not None
        self.nfe = torch.zeros((), dtype=torch.long, device=run.canvas.tokens.device)  # forwards, on the device
        self.checks: list = []  # the errors of the deferred checks in the last status, in order
        self.step = self._step
        self.captured = compiled.captures(run.compile)  # the whole step compiled: one CUDA graph per shape
        self.places: list[tuple] = []  # where the carried tensors live (carried), once the first preparation ran
        self.slots: list[int] = []  # each place's buffer
        self.buffers: list[torch.Tensor] | None = None  # the carried tensors' fixed buffers, captured
        if self.captured:
            # one graph per (width, mask) and per kind of run: every run shares this function's graphs
            limit = 8 * compiled.RECOMPILE_LIMIT
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            self.step = self.compiled_step()

    def compiled_step(self):
        """The step function compiled whole: inductor, CUDA graphs, no graph break."""
        return torch.compile(self._step, backend="inductor", mode=compiled.CAPTURE, fullgraph=True)

    def _compile_forward_only(self, error: Exception) -> None:
        """Inductor could not compile the whole step (seen: its CPU code generator on SDAR's block cache): the step
        runs eagerly around the compiled forward and scoring, as on the per-step loop, with one warning."""
        run = self.run
        warnings.warn(
            f"compile={compiled.CAPTURE!r}: inductor could not compile the whole device step "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); its forward is compiled instead",
            DllmWarning,
            stacklevel=4,
        )
        self.step, self.captured = self._step, False
        run.hidden = compiled.hidden(run.model, run.compile, static=True)
        run.score = compiled.score(run.compile, static=True)

    def carried(self) -> list[tuple]:
        """Where the tensors a step reads live between steps, as (owner, key) pairs (an attribute, or a dict's or
        a list's item): the canvas, the loop's per-row state, the forward count, the cache's state (its K/V store
        apart: it has fixed buffers of its own), the sampler's, the exit rules' and the scorer's. A captured step
        reads and writes every one at a fixed address: cudagraph trees give up on a graph that writes in place an
        input not marked static, and fail on an input a former replay produced (both seen on an H200)."""
        process, run = self.process, self.run
        exits = process.exit_states
        places = [(self, "nfe"), (process, "state"), *((exits, i) for i in range(len(exits)))]
        for owner in (process.step, run.canvas, run.cache_state, process.state, *exits, process.scorer):
            if owner is None or not hasattr(owner, "__dict__"):
                continue
            for name, value in vars(owner).items():
                if name in _DERIVED:
                    continue
                places.append((owner, name))
                if isinstance(value, dict):
                    places += [(value, key) for key in value]
        return [(owner, key) for owner, key in places if _is_state(_get(owner, key))]

    def set_state(self, tensors: list[torch.Tensor]) -> None:
        """The run's carried tensors (:meth:`carried`, each once: a tensor held in two places is one buffer)
        replaced by ``tensors`` of the same shapes and values."""
        for (owner, key), slot in zip(self.places, self.slots):
            _set(owner, key, tensors[slot])

    def take_buffers(self) -> None:
        """Captured, after the first preparation (which runs eagerly and makes the carried state whole): the
        carried tensors moved to fixed addresses, those of the last captured run of these shapes."""
        self.places = self.carried()
        tensors, self.slots = _distinct([_get(owner, key) for owner, key in self.places])
        # an expanded tensor (several elements at one address) cannot be copied into: its own dense copy
        tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        self.buffers = compiled.take_state(self.run.model, tensors)
        self.set_state(self.buffers)

    def write_back(self) -> None:
        """Captured: the carried tensors a step replaced (the loop updates some functionally: ``step.end =
        torch.where(...)``) copied into the fixed buffers, so that every replay reads and writes the same addresses
        and no replay's output is read by the next."""
        for (owner, key), slot in zip(self.places, self.slots):
            now, fixed = _get(owner, key), self.buffers[slot]
            if now is not fixed and isinstance(now, torch.Tensor):
                fixed.copy_(now)
                _set(owner, key, fixed)

    def release(self) -> None:
        """At the end of a captured run: its state buffers left for the next run of these shapes, the run keeping
        copies (its output reads the canvas)."""
        if self.captured and self.buffers is not None:
            self.set_state([tensor.clone() for tensor in self.buffers])
            compiled.return_state(self.run.model, self.buffers)

    # -- the host's side -----------------------------------------------------------------------------------------
    def next_step(self) -> bool:
        """Read the last status (the one read of a step) and choose the next step's shape; False when every row
        is done. A step that would schedule nothing takes no forward: its preparation runs again instead."""
        run = self.run
        if self.status is None:
            self.status = self.prepare()
            if self.captured:
                self.take_buffers()
            self.checks = [error for _, error in run.checks.pending]
            run.checks.pending = []
        while True:
            values = self.status.tolist()
            self.process.step.touch()
            core, flags = values[:6], values[6:]
            errors, self.checks = [e for e, bad in zip(self.checks, flags) if bad], []
            if errors:
                raise errors[0]
            all_done, scheduled, width, refresh, masked, nfe = core
            if nfe != run.nfe:
                raise DllmError(f"internal error: the device counted {nfe} forwards, the host {run.nfe}")
            if all_done:
                return False
            if scheduled:
                break
            self.status = self.prepare(skip_only=True)  # a schedule with idle steps the sampler could not count
        length = run.canvas.length
        self.shape = Shape(None if run.cache is None else bucket(max(width, 1), length), bool(masked))
        run.refreshes += bool(refresh)
        return True

    def take_step(self) -> torch.Tensor:
        """One step on the device (the shape :meth:`next_step` chose); the slots written."""
        run = self.run
        if compiled.captures(run.compile):  # nothing of the last replay's outputs is read any more
            torch.compiler.cudagraph_mark_step_begin()
        run.nfe += 1
        # the step counts its scorings and deferred checks afresh (the values a traced step reads are the ones it is
        # guarded on: a running count would compile it again at every step), added up here
        kernel_calls, select_calls = run.kernel_calls, run.select_calls
        try:
            commit, self.status, self.after = self.step(self.shape.width, self.shape.masked)
        except Exception as error:  # (a compile failure is raised before the step ran: nothing changed yet)
            if not self.captured or not _compile_failure(error):
                raise
            self._compile_forward_only(error)
            run.kernel_calls, run.select_calls = kernel_calls, select_calls
            commit, self.status, self.after = self.step(self.shape.width, self.shape.masked)
        if self.captured:  # a replay's outputs are overwritten by the next: the host keeps its own
            commit = commit.clone()
            self.after = None if self.after is None else tuple(t.clone() for t in self.after)
        for total, counts in ((kernel_calls, run.kernel_calls), (select_calls, run.select_calls)):
            for backend, n in counts.items():
                total[backend] = total.get(backend, 0) + n
        run.kernel_calls, run.select_calls = kernel_calls, select_calls
        self.checks = [error for _, error in run.checks.pending]
        run.checks.pending = []
        return commit

    # -- the device's side ---------------------------------------------------------------------------------------
    def _step(self, width: int | None, masked: bool):
        """The step function: forward, scoring, decision, commit, bookkeeping, the next step's preparation and its
        status; nothing read back. Returns (the slots written, the status, the state after the commit or None)."""
        process, run = self.process, self.run
        step, canvas = process.step, run.canvas
        run.kernel_calls, run.select_calls = {}, {}
        working = ~step.done
        self.nfe += working.any().long()
        columns = process.observed_columns()
        hidden = self.forward(columns, working, width, masked)
        step.hidden = hidden
        process.score(step.active, columns, hidden)
        commit = process.commit()
        after = None
        if self.keep_after:
            after = (canvas.tokens.clone(), step.done.clone(), step.block.clone())
        return commit, self.prepare(), after

    def forward(self, columns, working, width: int | None, masked: bool):
        """The step's forward of every row: the cache's demand for the working rows (a done row computes a
        padding column and writes nothing), ``width`` query columns per row."""
        process, run = self.process, self.run
        step, canvas = process.step, run.canvas
        step.observed = columns
        step.read_decoded = process.read_decoded(columns)
        valid = (canvas.valid | step.done[:, None]) if masked else None
        options = {"block_size": canvas.block_size} if run.model.free_block_size else {}
        if run.cache is None:
            return run.hidden(canvas.tokens, canvas.positions, attention_mask=valid, checks=run.checks, **options)
        compute, write, _ = run.cache.demand(step, run.cache_state)
        compute = compute & working[:, None]
        queries = columns_of(compute, compute.sum(1), width)
        run.checks.add(
            (compute.sum(1) > width).any(), DllmError("internal error: a device step's query width was too small")
        )
        write = write.gather(1, queries) & working[:, None]
        run.cache.advance(step, run.cache_state, working)
        kv = run.cache_state.kv
        return run.hidden(
            canvas.tokens, canvas.positions, attention_mask=valid, queries=queries, kv=kv, write=write,
            checks=run.checks, **options,
        )  # fmt: skip

    def prepare(self, skip_only: bool = False) -> torch.Tensor:
        """The next step's preparation (see the module docstring), and the status it leaves. ``skip_only``: the
        schedule's idle steps again (the sampler could not count them all at once)."""
        process, run = self.process, self.run
        step, canvas = process.step, run.canvas
        if not skip_only:
            process.settle_blocks()
            process.begin_blocks()
        scheduled = process.schedule(skip=True)
        working = ~step.done
        width = torch.zeros((), dtype=torch.long, device=working.device)
        refresh = torch.zeros((), dtype=torch.bool, device=working.device)
        if run.cache is not None:
            step.observed = process.observed_columns()
            step.read_decoded = process.read_decoded(step.observed)
            compute, _, rows = run.cache.demand(step, run.cache_state)
            width = (compute & working[:, None]).sum(1).max()
            refresh = (rows & working).any()
        masked = (~canvas.valid & working[:, None]).any() if run.padded else torch.zeros_like(refresh)
        if self.buffers is not None and self.captured:
            self.write_back()
        core = [step.done.all(), scheduled, width, refresh, masked, self.nfe]
        flags = [bad for bad, _ in run.checks.pending]
        return torch.stack([torch.as_tensor(f, device=working.device).long().reshape(()) for f in core + flags])


def finish_rows(process, finish: torch.Tensor, decision, greedy=None) -> torch.Tensor:
    """The device step's fill of the rows an exit rule finishes (the per-step loop's ``_finish_rows``, predicated):
    every still-masked slot of the span of the ``finish`` rows (bool [B]) gets this step's proposal (``greedy``
    rows: its argmax), scored for every row from the step's forward and written where ``finish``; the slots
    written. A captured cache computes the masked span when exit rules may finish rows."""
    from dllm.engine.step import NO_OVERRIDE

    step, scorer = process.step, process.scorer
    canvas = step.canvas
    p, length = canvas.prompt_width, canvas.length
    rows = step.active
    columns = torch.arange(p, length, device=rows.device).expand(rows.shape[0], -1)
    computed = step.model.computed(step.hidden, columns)
    span = canvas.masked[:, p:] & finish[:, None]
    if computed is not None:
        step.run.checks.add((span & ~computed).any(), ModelError(_UNFILLED))
    tokens = scorer(step, rows, columns, step.hidden, computed=computed, need=frozenset()).token
    if greedy is not None:
        argmax = scorer(step, rows, columns, step.hidden, computed=computed, need=frozenset(), temperature=0.0)
        tokens = torch.where(greedy[:, None], argmax.token, tokens)
    if decision.tokens is not None:
        override = decision.tokens[:, p:]
        tokens = torch.where(override != NO_OVERRIDE, override, tokens)
    fill = torch.zeros_like(canvas.tokens, dtype=torch.bool)
    fill[:, p:] = span
    written = canvas.tokens.clone()
    written[:, p:] = tokens
    canvas.tokens.copy_(torch.where(fill, written, canvas.tokens))
    return fill


_DERIVED = ("_masked", "_committable")  # the step's values derived from the canvas, made again after each change


def _is_state(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def _get(owner, key):
    return owner[key] if isinstance(owner, (dict, list)) else getattr(owner, key)


def _set(owner, key, value) -> None:
    if isinstance(owner, (dict, list)):
        owner[key] = value
    else:
        setattr(owner, key, value)


def _distinct(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct tensors of ``tensors`` in order, and each one's place among them."""
    seen: dict[int, int] = {}
    slots = [seen.setdefault(id(t), len(seen)) for t in tensors]
    return [t for t in {id(t): t for t in tensors}.values()], slots


def _compile_failure(error: Exception) -> bool:
    """Whether ``error`` is a backend's failure to compile a traced graph (torch.compile's BackendCompilerFailed,
    inductor's InductorError)."""
    import torch._dynamo.exc

    return isinstance(error, torch._dynamo.exc.BackendCompilerFailed)
